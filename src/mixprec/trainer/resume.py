"""What a Trainer checkpoint holds (`checkpoint_state`, `run_state`) and how a fit resumes
from one (`restore`, also across precisions: the float32 masters are restored by name), or
an evaluation loads its weights (`load_weights`). Everything is checked before anything is
loaded: a failed resume leaves the model as it was.

Reading and writing the files is `checkpoint`'s; a sharded checkpoint's shards are
`sharded`'s, which keeps its run state here too.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from mixprec.optim import LossScaleOptimizer, master_weights_by_name
from mixprec.policy.map import resumable_config
from mixprec.trainer.callbacks import callback_states, load_callback_states
from mixprec.trainer.checkpoint import FORMAT, FORMAT_VERSION, CheckpointError, rng_states
from mixprec.trainer.data import (
    describe_order,
    generators,
    loader_batch_size,
    loader_samples,
    order_of,
)
from mixprec.trainer.loop import FitRun, Run, rows_after_save
from mixprec.trainer.optimizers import across_state_formats, state_formats, state_shards
from mixprec.version import __version__

__all__: list[str] = []

log = logging.getLogger("mixprec")


def checkpoint_state(run: FitRun, ranks: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    """Everything needed to resume ``run`` exactly where it is now; ``ranks``: every
    process's `rank_state`, in rank order, where they were gathered (each resumes its own)."""
    state = {
        **run_state(run),
        "model": run.model.state_dict(),
        "optimizers": [opt.state_dict() for opt in run.optimizers],
    }
    if ranks is not None:
        state["ranks"] = ranks
    return state


def rank_state(run: FitRun) -> dict[str, Any]:
    """What is each process's own in a run state: its random generators (now, and at the
    epoch's start, which a mid-epoch resume replays from), its training loader's
    generators, and its training epoch's sums so far. A one-file checkpoint of several
    processes holds rank 0's in its run state and, where every process saved it, each
    one's here (`checkpoint_state`)."""
    if run.ended is not None:
        return dict(run.ended["rank"])
    at_epoch_end = run.epoch_finished
    return {
        "rng": saved_rng(run),
        "epoch_rng": None if at_epoch_end else run.epoch_rng,
        "loader_rng": saved_loader_rng(run),
        "training_epoch": {} if at_epoch_end else run.metrics.training_epoch_sums(),
    }


def run_state(run: FitRun) -> dict[str, Any]:
    """What a checkpoint holds besides the weights and the optimizers' state: versions,
    policy, loop position, schedulers, scaler, callbacks, this process's RNG states, and
    the metrics monitors read (the latest values, the training epoch's sums so far)."""
    if run.ended is not None:
        return dict(run.ended["run"])  # (a copy: a sharded save adds to it)
    at_epoch_end, progress, strategy = run.epoch_finished, run.progress, run.strategy
    # a process's own epoch sums: one file written by rank 0 of several would give every
    # rank rank 0's
    own = strategy.world_size == 1 or strategy.sharded
    return {
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        "mixprec_version": __version__,
        "torch_version": str(torch.__version__),
        "policy_name": run.precision.policy.name,
        "loop": {
            "epoch": progress.current_epoch + 1 if at_epoch_end else progress.current_epoch,
            "batch": 0 if at_epoch_end else progress.batches_done,
            "global_step": progress.global_step,
            "epoch_rng": None if at_epoch_end else run.epoch_rng,
            "epoch_batches": run.num_training_batches,
            "batch_size": loader_batch_size(run.train_loader),
            "first_batch_size": None if at_epoch_end else run.first_batch_size,
            "samples": loader_samples(run.train_loader),
            "order": order_of(run.train_loader),
            # the loader's own generators now: the next epochs' orders are drawn from them
            "loader_rng": saved_loader_rng(run),
            # the rows at this step logged before the save, and those logged right after
            # it that a resume does not log again: a resume drops the rows from this step
            # on (the others it logs again) and hands these back (`StepLog.replay`)
            "step_rows": run.log.rows_at(progress.global_step) + rows_after_save(run),
        },
        "optimizer_types": [type(opt.optimizer).__name__ for opt in run.optimizers],
        # each optimizer's parameter groups by parameter name: a resume holds them the same
        "optimizer_groups": [group_names(run.model, opt) for opt in run.optimizers],
        # each group's optimizer-state format (low-bit optimizers): a sharded resume keeps it
        "optimizer_state_formats": [state_formats(opt.optimizer) for opt in run.optimizers],
        # the parts low-bit codes are cut into (FSDP2's processes): a sharded resume keeps it
        "optimizer_state_shards": [state_shards(opt.optimizer) for opt in run.optimizers],
        # whether each optimizer skipped its last step, as it was (`step_was_skipped`)
        "last_step_skipped": [opt.step_was_skipped for opt in run.optimizers],
        "schedulers": [s.scheduler.state_dict() for s in run.schedulers],
        "precision": run.precision.state_dict(),
        "callbacks": callback_states(run.callbacks),
        "rng": saved_rng(run),
        "world_size": strategy.world_size,
        "metrics": {
            "callback": dict(run.log.read()),
            # (at an epoch's end, what is left there, values callbacks logged, is that
            # epoch's, logged right after the save: the next epoch starts with none)
            "training_epoch": run.metrics.training_epoch_sums() if own and not at_epoch_end else {},
        },
    }


def saved_rng(run: FitRun) -> dict[str, Any]:
    """The random generator states a save now holds: those the run goes on from, which
    inside a validation or ``on_train_batch_start`` are not the current ones (`held_rng`)."""
    held = run.held_rng
    return held["rng"] if held is not None else rng_states()


def saved_loader_rng(run: FitRun) -> list[Tensor]:
    """The training loader's own generator states a save now holds (`saved_rng`'s)."""
    held = run.held_rng
    if held is not None and held["loader"] is not None:
        return list(held["loader"])
    return [g.get_state() for g in generators(run.train_loader)]


def keep_run_state(run: FitRun) -> None:
    """Keep the run state of ``run``, a fit that ended, as it is now (once): a later
    evaluation reseeds the generators, clears the metrics and the rows, and a checkpoint
    saved after it must hold the fit's (`run_state` and `rank_state` then hand these out).
    A fit cut short inside a window or a step keeps nothing: no save is taken there."""
    if run.ended is None and not (run.in_window or run.stepping):
        try:
            run.ended = {"run": run_state(run), "rank": rank_state(run)}
        except Exception:  # (a callback's state_dict: the save that needs it raises it)
            log.debug("the fit's run state could not be kept", exc_info=True)


def group_names(model: nn.Module, optimizer: LossScaleOptimizer) -> list[list[str]]:
    """Each parameter group of ``optimizer`` as the names its parameters (a master: the
    parameter it stands for) have in ``model`` ("?" for one the model does not hold)."""
    names: dict[int, str] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), name)
    return [
        [names.get(id(optimizer.model_param(p)), "?") for p in g["params"]]
        for g in optimizer.optimizer.param_groups
    ]


def check_groups(run: FitRun, state: dict[str, Any], path: Path) -> None:
    """Raise before anything is loaded if an optimizer's parameter groups are not the ones
    saved (another ``configure_optimizers``): a group's settings and each parameter's state
    would go to other parameters (by position, or by name into a group of other settings),
    silently where their shapes agree."""
    saved = state.get("optimizer_groups")  # (absent from checkpoints written before it)
    if saved is None or len(saved) != len(run.optimizers):
        return
    for i, (then, opt) in enumerate(zip(saved, run.optimizers, strict=True)):
        now = group_names(run.model, opt)
        if then != now:
            raise CheckpointError(
                f"{path}: optimizer {i}'s parameter groups were {_groups(then)} at the save; "
                f"this run's are {_groups(now)}: resume with the same configure_optimizers "
                "(the same groups, holding the same parameters). Nothing was loaded"
            )


def _groups(groups: list[list[str]]) -> str:
    return "; ".join(f"[{len(g)}: {_shown(g)}]" for g in groups)


def _shown(names: list[str]) -> str:
    return ", ".join(names[:5]) + (f" and {len(names) - 5} more" if len(names) > 5 else "")


def check_weights(model: nn.Module, state: dict[str, Any], path: Path) -> None:
    """Raise before anything is loaded if the checkpoint's weights are another model's."""
    saved, own = state["model"], model.state_dict()
    missing = [k for k in own if k not in saved]
    unexpected = [k for k in saved if k not in own]
    shapes = [
        f"{k} {tuple(saved[k].shape)} vs {tuple(v.shape)}"
        for k, v in own.items()
        if k in saved and tuple(saved[k].shape) != tuple(v.shape)
    ]
    if missing or unexpected or shapes:
        parts = [
            f"{label}: {_shown(items)}"
            for label, items in (
                ("missing in the checkpoint", missing),
                ("not in this model", unexpected),
                ("shapes differ (checkpoint vs model)", shapes),
            )
            if items
        ]
        raise CheckpointError(
            f"{path} holds the weights of another model ({type(model).__name__} here); "
            f"{'; '.join(parts)}. Nothing was loaded"
        )


def _check_optimizers(run: FitRun, state: dict[str, Any], path: Path) -> None:
    if len(state["optimizers"]) != len(run.optimizers) or len(state["schedulers"]) != len(
        run.schedulers
    ):
        raise CheckpointError(
            f"{path} has {len(state['optimizers'])} optimizers and {len(state['schedulers'])} "
            f"schedulers; this run configured {len(run.optimizers)} and "
            f"{len(run.schedulers)}: resume with the same configure_optimizers"
        )
    saved_types = state.get("optimizer_types", [None] * len(run.optimizers))
    for i, (opt, saved, saved_type) in enumerate(
        zip(run.optimizers, state["optimizers"], saved_types, strict=True)
    ):
        groups = saved["optimizer"]["param_groups"]
        mine = opt.optimizer.param_groups
        same_settings = all(
            set(g) - {"params"} == set(m) - {"params"} for g, m in zip(groups, mine, strict=False)
        )
        if saved_type not in (None, type(opt.optimizer).__name__) or not same_settings:
            was = saved_type or f"one with settings {sorted(set(groups[0]) - {'params'})}"
            raise CheckpointError(
                f"{path} holds the state of optimizer {i} as {was}; this run's is "
                f"{type(opt.optimizer).__name__}. Resume with the same optimizer, or start a "
                f"new fit from the weights alone: model.load_state_dict(load(path)['model'])"
            )
        if [len(g["params"]) for g in groups] != [len(m["params"]) for m in mine]:
            raise CheckpointError(
                f"{path}: optimizer {i} has parameter groups of sizes "
                f"{[len(g['params']) for g in groups]}, this run's "
                f"{[len(m['params']) for m in mine]}: resume with the same configure_optimizers"
            )


def check_resume_point(run: FitRun, loop: dict[str, Any], path: Path) -> None:
    """A mid-epoch checkpoint replays its epoch's order and skips the batches done: that
    needs the same batches as at the save."""
    if not loop["batch"]:
        return
    saved_n, saved_bs = loop.get("epoch_batches"), loop.get("batch_size")
    n, bs = run.num_training_batches, loader_batch_size(run.train_loader)
    fix = (
        "resume with the same data, batch size and limit_train_batches, or from a checkpoint "
        "saved at the end of an epoch"
    )
    if saved_bs is not None and bs is not None and saved_bs != bs:
        raise CheckpointError(
            f"{path} was saved after {loop['batch']} batches of {saved_bs} samples in epoch "
            f"{loop['epoch']}; this run's batches hold {bs}, so skipping {loop['batch']} "
            f"batches would repeat or skip samples: {fix}"
        )
    # a save on the epoch's last batch (batch == n) resumes by ending the epoch
    if n is not None and (loop["batch"] > n or (saved_n is not None and saved_n != n)):
        of = f" of {saved_n}" if saved_n is not None else ""
        raise CheckpointError(
            f"{path} was saved at batch {loop['batch']}{of} of epoch {loop['epoch']}, but "
            f"this run's epoch has {n} batches: {fix}"
        )
    if loop["batch"] == n:  # nothing of the epoch is left to replay
        return
    saved_samples, samples = loop.get("samples"), loader_samples(run.train_loader)
    if saved_samples is not None and samples is not None and saved_samples != samples:
        # (the same batches from another number of samples: another order, whose first
        # batches skipped are not the ones trained)
        def told(counts: list[int]) -> str:
            data, drawn = counts
            return f"{data} samples" + (f" ({drawn} drawn an epoch)" if drawn != data else "")

        raise CheckpointError(
            f"{path} was saved in epoch {loop['epoch']} of data of {told(saved_samples)}; "
            f"this run's has {told(samples)}, so its order differs and skipping "
            f"{loop['batch']} batches would repeat or skip samples: {fix}"
        )
    _check_order(run, loop, path)


def _check_order(run: FitRun, loop: dict[str, Any], path: Path) -> None:
    """The epoch's order replays from the generator states saved with it: the loader must
    draw it the same way (same samplers, a generator where there was one, none where there
    was none)."""
    here = order_of(run.train_loader)
    saved = loop.get("order")  # absent from checkpoints written before it was kept
    if saved is not None:
        kinds = ("sampler", "batch_sampler")
        same = [saved.get(k) for k in kinds] == [here[k] for k in kinds]
        same = same and len(saved["generators"]) == len(here["generators"])
        was, now = describe_order(saved), describe_order(here)
    else:
        count = len(loop["epoch_rng"]["loader"])
        same = count == len(generators(run.train_loader))
        was, now = (f"{k} torch generator(s)" for k in (count, len(here["generators"])))
    if not same:
        raise CheckpointError(
            f"{path} was saved after {loop['batch']} batches of epoch {loop['epoch']}, with a "
            f"DataLoader ordered by {was}; this run's DataLoader is ordered by {now}. The "
            "epoch's order cannot be replayed, so skipping the batches done would repeat or "
            "skip samples: resume with the DataLoader built as at the save (same sampler and "
            "shuffle, generator= given or not as then; the same strategy where the Trainer put "
            "in a DistributedSampler), or from a checkpoint saved at the end of an epoch"
        )


def load_weights(run: Run, state: dict[str, Any], path: Path) -> None:
    """Load the model weights.

    Across precisions the float32 master weights (if the checkpoint has them) are used in
    place of the 16-bit parameters they shadow, and everything is cast to this run's dtypes.
    """
    check_weights(run.model, state, path)
    same = same_precision(run, state)
    weights = dict(state["model"])
    if not same:
        log.info(
            "resuming %s, trained in precision %s, in %s: weights are cast to this run's dtypes%s",
            path,
            state.get("policy_name", "?"),
            run.precision.policy.name,
            " (from the float32 master weights)"
            if any(o["master_weights"] for o in state["optimizers"])
            else "",
        )
        weights.update(saved_masters(state))
    if run.strategy.sharded:  # (whole tensors, each rank keeping its shard of them)
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            set_model_state_dict,
        )

        set_model_state_dict(run.model, weights, options=StateDictOptions(full_state_dict=True))
    else:
        run.model.load_state_dict(weights)


def same_precision(run: Run, state: dict[str, Any]) -> bool:
    """Whether the checkpoint ``state`` was trained in ``run``'s precision policy."""
    saved_policy = state["precision"]["policy"]
    return resumable_config(saved_policy) == resumable_config(run.precision.policy.to_config())


def saved_masters(state: dict[str, Any]) -> dict[str, Tensor]:
    """Parameter name -> the checkpoint's float32 master of it, for a restore in another
    precision (the masters are saved under their parameters' names)."""
    out: dict[str, Tensor] = {}
    for saved in state["optimizers"]:
        out.update(master_weights_by_name(saved, state["model"]))
    return out


def check_world(path: Path, saved: int, world: int, loop: dict[str, Any]) -> None:
    """Refuse a checkpoint saved inside an epoch by another number of processes."""
    if saved != world and loop["batch"]:
        raise CheckpointError(
            f"{path} was saved inside an epoch (after its batch {loop['batch']}) with "
            f"{saved} processes; resuming inside an epoch needs the same number (this run "
            f"has {world}), also from its last batch, whose resume runs the epoch's end again "
            "from what each process accumulated; a checkpoint saved at an epoch's end "
            "resumes with any"
        )


def restore(run: FitRun, state: dict[str, Any], path: Path) -> None:
    """Put ``run`` and its progress back where the checkpoint ``state`` left them."""
    # everything is checked before anything is loaded: a failed resume leaves the model as it was
    if run.strategy.sharded:
        raise CheckpointError(
            f"{path} is a file checkpoint (a one-device or DDP run's), and this run shards its "
            "model (strategy='fsdp'), which resumes sharded checkpoints only: resume it with "
            "strategy='ddp' or on one device, or start this run from its weights alone "
            "(model.load_state_dict(torch.load(path)['model']) before fit, without ckpt_path). "
            "Nothing was loaded"
        )
    check_weights(run.model, state, path)
    state = across_state_formats(state, run.optimizers, path)
    _check_optimizers(run, state, path)
    check_groups(run, state, path)
    # an optimizer whose compensation or masters differ from the checkpoint's (Kahan buffers
    # saved, none kept now) restores as one across precisions does: it folds what it cannot
    # keep into the weights; checked before anything is loaded, as every other
    precision = run.precision
    scaler_state = state["precision"]["scaler"]
    fresh_scaler = scaler_state.get("kind") != precision.scaler.kind
    if fresh_scaler:  # (each optimizer's copy of it too: it is this run's scaler, as built)
        state["optimizers"] = [
            {**saved, "scaler": opt.scaler.state_dict()} if "scaler" in saved else saved
            for opt, saved in zip(run.optimizers, state["optimizers"], strict=True)
        ]
    same = same_precision(run, state)
    direct = [
        same and opt.loads_directly(saved)
        for opt, saved in zip(run.optimizers, state["optimizers"], strict=True)
    ]
    for i, (opt, saved) in enumerate(zip(run.optimizers, state["optimizers"], strict=True)):
        try:
            if direct[i]:
                opt.check_state_dict(saved)
            else:
                opt.check_state_dict_across_precisions(saved)
        except (TypeError, ValueError) as error:
            raise CheckpointError(
                f"{path}: the state of optimizer {i} does not fit this run's: {error}. "
                "Nothing was loaded"
            ) from error
    loop = state["loop"]
    check_world(path, state.get("world_size", 1), run.strategy.world_size, loop)
    check_resume_point(run, loop, path)
    load_weights(run, state, path)
    if not all(direct):
        # this run's masters come from the checkpoint's own weights (a float32 checkpoint's
        # exactly, not as this run's 16-bit model holds them) or its masters
        full = {**run.model.state_dict(), **state["model"], **saved_masters(state)}
    for opt, saved, as_saved in zip(run.optimizers, state["optimizers"], direct, strict=True):
        if as_saved:
            opt.load_state_dict(saved)
        else:  # this run's masters from full-precision weights
            opt.load_state_dict_across_precisions(saved, full)
    for s, saved in zip(run.schedulers, state["schedulers"], strict=True):
        s.scheduler.load_state_dict(saved)
    if not fresh_scaler:
        precision.load_state_dict(state["precision"])
    else:
        log.info(
            "%s had a %r loss scaler, this run uses %r: starting it fresh",
            path,
            scaler_state.get("kind"),
            precision.scaler.kind,
        )
    load_callback_states(run.callbacks, state["callbacks"])
    restore_progress(run, state, path)


def _restore_loader_rng(run: FitRun, loop: dict[str, Any]) -> None:
    """The train loader's own generators (``generator=``, a sampler's) as they were at the
    save, so that the epochs after it are drawn as in a run that never stopped (a mid-epoch
    resume first replays its epoch from the states at the epoch's start). A loader ordered
    otherwise than at the save, taken at an epoch's end, keeps its generators as given."""
    saved = loop.get("loader_rng")  # absent from checkpoints written before it was kept
    if saved is None:
        return
    here = order_of(run.train_loader)
    if here != loop.get("order"):
        log.info(
            "the training DataLoader is ordered by %s, at the save by %s: its generators "
            "start as given, not from the checkpoint",
            describe_order(here),
            describe_order(loop.get("order") or {"generators": []}),
        )
        return
    for gen, state in zip(generators(run.train_loader), saved, strict=True):
        gen.set_state(state)


def restore_progress(run: FitRun, state: dict[str, Any], path: Path) -> None:
    """The loop position, the RNG states to resume with and the metrics monitors read, from
    a checkpoint's run state (a file's or a sharded one's)."""
    loop, progress = state["loop"], run.progress
    progress.current_epoch, progress.batches_done = loop["epoch"], loop["batch"]
    progress.global_step = loop["global_step"]
    metrics = state.get("metrics", {})  # absent from checkpoints written before it was kept
    sums, rng = metrics.get("training_epoch", {}), state["rng"]
    ranks = state.get("ranks")  # every process's own, where each saved (`rank_state`)
    if ranks is not None and len(ranks) == run.strategy.world_size:
        own = ranks[run.strategy.global_rank]
        loop = {**loop, "epoch_rng": own["epoch_rng"], "loader_rng": own["loader_rng"]}
        sums, rng = own["training_epoch"], own["rng"]
    if loop["epoch_rng"] is not None:
        run.epoch_rng = loop["epoch_rng"]
    run.first_batch_size = loop.get("first_batch_size")  # (absent before it was kept)
    _restore_loader_rng(run, loop)
    run.resume_rng = rng
    for opt, skipped in zip(run.optimizers, state.get("last_step_skipped", []), strict=False):
        opt.step_was_skipped = skipped
    run.log.callback_metrics.update(metrics.get("callback", {}))
    run.metrics.load_training_epoch_sums(sums, run.strategy.device)
    # (None in checkpoints written before they were kept at every save, but on an
    # epoch's last batch: their loggers resume at the step, keeping its rows)
    rows = loop.get("step_rows")
    if rows is not None:
        run.log.replay(progress.global_step, rows)
    else:
        for lg in run.trainer.loggers:
            lg.resume_at(progress.global_step)
    log.info(
        "resumed from %s at epoch %d, batch %d, step %d",
        path,
        progress.current_epoch,
        progress.batches_done,
        progress.global_step,
    )
