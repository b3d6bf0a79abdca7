"""Checkpoint files: written atomically, read back safely, with the RNG states of a run; what
a Trainer checkpoint holds (`checkpoint_state`) and how a run is restored from one
(`restore`, also across precisions).

A save goes to a temporary file in the target's own directory, is flushed and fsync'ed, and
only then renamed over the target (``os.replace``, atomic on POSIX and Windows). A process
killed mid-save leaves the previous checkpoint intact and, at worst, a stray ``.tmp`` file,
which the next save into that directory removes.
Files are loaded with ``torch.load(weights_only=True)``: a checkpoint holds tensors and plain
Python values only, so loading one never runs code from the file.
"""

from __future__ import annotations

import errno
import glob
import logging
import os
import pickle
import random
import re
import secrets
import shutil
import socket
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor, nn

from mixprec.optim import master_weights_by_name
from mixprec.trainer.callbacks import ModelCheckpoint, callback_states
from mixprec.trainer.data import describe_order, generators, loader_batch_size, order_of
from mixprec.trainer.interrupt import ctrl_c_deferred
from mixprec.version import __version__

if TYPE_CHECKING:
    from mixprec.trainer.loop import FitRun, Run
    from mixprec.trainer.trainer import Trainer

__all__ = [
    "CheckpointError",
    "FORMAT",
    "FORMAT_VERSION",
    "RUN_KEYS",
    "atomic_link",
    "atomic_save",
    "check_resume_point",
    "check_weights",
    "checkpoint_state",
    "clean_stale_tmp",
    "install",
    "load",
    "load_weights",
    "recover_aside",
    "resolve_path",
    "restore",
    "restore_progress",
    "rng_states",
    "run_state",
    "saved_masters",
    "set_rng_states",
]

log = logging.getLogger("mixprec")

FORMAT = "mixprec.checkpoint"
FORMAT_VERSION = 1


def _fsync_dir(directory: Path) -> None:
    # Makes the rename itself durable; not possible (nor needed) on Windows.
    if os.name == "nt":
        return
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


_HOST = socket.gethostname().replace(".", "_") or "host"
# .<target name>.<host>.<pid>.<token>.tmp: who wrote it, so that stale ones can be told apart
_TMP = re.compile(r"\.(?P<name>.+)\.(?P<host>[^.]+)\.(?P<pid>\d+)\.[0-9a-f]+\.tmp")
# .<target name>.<host>.<pid>.<token>.old: a checkpoint `install` moved aside to replace it
_ASIDE = re.compile(r"\.(?P<name>.+)\.(?P<host>[^.]+)\.(?P<pid>\d+)\.[0-9a-f]+\.old")
_FULL = {errno.ENOSPC, errno.EFBIG, errno.EDQUOT}


def _new_tmp(target: Path) -> tuple[int, Path]:
    """Create a temporary file next to ``target``; mode 0666 less the umask, like any file."""
    while True:
        tmp = target.parent / f".{target.name}.{_HOST}.{os.getpid()}.{secrets.token_hex(4)}.tmp"
        try:
            return os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666), tmp
        except FileExistsError:
            continue


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # someone else's process
    return True


def _remove(entry: Path) -> None:
    if entry.is_dir():  # a sharded checkpoint's (`mixprec.trainer.sharded`)
        shutil.rmtree(entry, ignore_errors=True)
    else:
        entry.unlink(missing_ok=True)


def _left_by_dead_process(m: re.Match[str] | None) -> bool:
    """Whether a temporary or aside name was written on this host by a process gone now."""
    if m is None or m["host"] != _HOST:
        return False
    pid = int(m["pid"])
    return pid != os.getpid() and not _alive(pid)


def clean_stale_tmp(directory: Path) -> list[Path]:
    """Remove what killed saves left in ``directory``: temporary files (and directories)
    and, where the checkpoint they replaced is there again, the old copies moved aside
    (`install`); only those written on this host by a process that no longer runs (a save
    in progress elsewhere is never touched)."""
    removed = []
    for entry in directory.glob(".*.tmp"):
        if _left_by_dead_process(_TMP.fullmatch(entry.name)):
            _remove(entry)
            removed.append(entry)
    for entry in directory.glob(".*.old"):
        m = _ASIDE.fullmatch(entry.name)
        if _left_by_dead_process(m) and (directory / m["name"]).exists():  # type: ignore[index]
            _remove(entry)
            removed.append(entry)
    if removed:
        log.info("removed %d temporary file(s) of interrupted saves in %s", len(removed), directory)
    return removed


def install(tmp: Path, path: Path) -> None:
    """Move the complete file or directory ``tmp`` (named by `_new_tmp` or like it) to
    ``path``. A file onto a file, or onto nothing, is one atomic rename. Otherwise (a
    sharded checkpoint's directory, or a file where one is, or the other way round) ``path``
    is first renamed aside to ``.<name>.<host>.<pid>.<token>.old``, then removed: a crash
    between the two renames leaves it complete there, and `recover_aside` puts it back."""
    if path.exists() and (tmp.is_dir() or path.is_dir()):
        aside = tmp.with_name(tmp.name.removesuffix(".tmp") + ".old")
        os.replace(path, aside)
        os.replace(tmp, path)
        _fsync_dir(path.parent)
        _remove(aside)
    else:
        os.replace(tmp, path)
        _fsync_dir(path.parent)


def recover_aside(path: Path) -> bool:
    """Put a checkpoint back at ``path`` when a save killed between `install`'s two renames
    left it aside (complete: a file, or a directory with DCP's ``.metadata``), written on
    this host by a process that no longer runs; the newest such one if several. Returns
    whether it did; safe to call from several processes at once."""
    if path.exists() or not path.parent.is_dir():
        return False
    asides = []
    for entry in path.parent.glob(f".{glob.escape(path.name)}.*.old"):
        m = _ASIDE.fullmatch(entry.name)
        complete = entry.is_file() or (entry / ".metadata").is_file()
        if _left_by_dead_process(m) and m["name"] == path.name and complete:  # type: ignore[index]
            asides.append(entry)
    if not asides:
        return False
    newest = max(asides, key=lambda e: e.stat().st_mtime)
    try:
        os.replace(newest, path)
    except OSError:  # another process put it back first
        return False
    _fsync_dir(path.parent)
    log.warning(
        "restored the checkpoint %s from %s, where a save killed between its two renames had "
        "left it",
        path,
        newest.name,
    )
    return True


def _cause(exc: BaseException) -> BaseException:
    """The first exception of the chain torch builds when a write fails half-way (it then
    fails again finishing the archive, with an opaque 'inline_container' message)."""
    seen = exc
    while seen.__context__ is not None:
        seen = seen.__context__
    return seen


def atomic_save(obj: Any, path: str | os.PathLike[str]) -> Path:
    """``torch.save`` to ``path`` so that readers see the old file or the new one, never half.

    Stale temporary files of killed saves in that directory are removed first. A full disk
    raises ``OSError`` naming the path; Ctrl-C during the save lets it finish, then raises
    ``KeyboardInterrupt`` (a second Ctrl-C abandons the save, leaving the old file).
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    recover_aside(path)
    clean_stale_tmp(path.parent)
    with ctrl_c_deferred():
        fd, tmp = _new_tmp(path)
        try:
            with os.fdopen(fd, "wb") as f:
                torch.save(obj, f)
                f.flush()
                os.fsync(f.fileno())
            install(tmp, path)
        except BaseException as exc:
            tmp.unlink(missing_ok=True)
            cause = _cause(exc)
            if isinstance(cause, KeyboardInterrupt):
                raise KeyboardInterrupt from None
            if isinstance(cause, OSError) and cause.errno in _FULL:
                raise OSError(
                    cause.errno,
                    f"cannot write the checkpoint {path}: disk full or file too large "
                    f"({os.strerror(cause.errno)}); the previous file, if any, is intact. "
                    "Free space or save elsewhere",
                ) from None
            raise
    return path


def atomic_link(src: str | os.PathLike[str], dst: str | os.PathLike[str]) -> Path:
    """Make ``dst`` an atomic copy of ``src`` (a hard link where the filesystem allows)."""
    src, dst = Path(src), Path(dst)
    fd, tmp = _new_tmp(dst)
    os.close(fd)
    tmp.unlink()
    try:
        os.link(src, tmp)
    except OSError:
        atomic_save(load(src), dst)
        return dst
    install(tmp, dst)
    return dst


class CheckpointError(ValueError):
    """A file is not a readable mixprec checkpoint, or does not fit the run loading it."""


# what every checkpoint the Trainer writes holds; a sharded one's run state (`run_state`)
# holds RUN_KEYS, its weights and optimizer state are in DCP shards (`sharded`)
RUN_KEYS = ("loop", "schedulers", "precision", "callbacks", "rng")
_KEYS = ("loop", "model", "optimizers", "schedulers", "precision", "callbacks", "rng")


def load(
    path: str | os.PathLike[str], map_location: Any = "cpu", *, required: tuple[str, ...] = _KEYS
) -> dict[str, Any]:
    """Read a checkpoint written by `atomic_save`; raise `CheckpointError` for anything else
    (truncated, empty, garbage, text, a pickled model, another program's checkpoint), or one
    lacking a ``required`` key."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"no checkpoint at {path}")
    hint = "save one with Trainer.save_checkpoint or ModelCheckpoint"
    try:
        state = torch.load(path, map_location=map_location, weights_only=True)
    except pickle.UnpicklingError:
        raise CheckpointError(
            f"{path} is not a readable mixprec checkpoint: it holds pickled Python objects "
            "(e.g. a whole model saved with torch.save(model)), and loading those would run "
            f"code from the file; {hint}"
        ) from None
    except Exception as err:  # torch raises many kinds for a damaged file
        detail = (str(err).strip().splitlines() or [""])[0][:120]
        raise CheckpointError(
            f"{path} is not a readable mixprec checkpoint ({path.stat().st_size} bytes): it "
            f"is truncated, empty or not a file torch.save wrote ({type(err).__name__}: "
            f"{detail}); {hint}"
        ) from None
    if not isinstance(state, dict) or state.get("format") != FORMAT:
        raise CheckpointError(
            f"{path} is not a readable mixprec checkpoint (expected a dict with "
            f"format={FORMAT!r}); {hint}"
        )
    if state.get("format_version", 0) > FORMAT_VERSION:
        raise CheckpointError(
            f"{path} has checkpoint format version {state['format_version']}, newer than this "
            f"mixprec understands ({FORMAT_VERSION}); upgrade mixprec to load it"
        )
    missing = [k for k in required if k not in state]
    if missing:
        raise CheckpointError(
            f"{path} is not a readable mixprec checkpoint: it lacks {', '.join(missing)}"
        )
    return state


def rng_states() -> dict[str, Any]:
    """The state of every random generator a training step may draw from.

    numpy's state is stored as tensors and ints so that the file loads with weights_only.
    """
    states: dict[str, Any] = {
        "python": random.getstate(),
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        states["cuda"] = torch.cuda.get_rng_state_all()
        # the GPU this process trains on (each DDP rank has set its own): rank 0's list holds
        # the other ranks' GPUs as this process never moved them
        states["cuda_current"] = torch.cuda.get_rng_state()
    try:
        import numpy as np
    except ImportError:
        return states
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    states["numpy"] = {
        "kind": str(kind),
        "keys": torch.from_numpy(keys.astype(np.int64)),
        "pos": int(pos),
        "has_gauss": int(has_gauss),
        "cached_gaussian": float(cached),
    }
    return states


def set_rng_states(states: dict[str, Any]) -> None:
    """Restore what `rng_states` returned."""
    version, internal, gauss = states["python"]
    random.setstate((version, tuple(internal), gauss))
    torch.set_rng_state(states["torch"])
    if "cuda" in states and torch.cuda.is_available():
        # one state per GPU of the saving machine: a resume on fewer GPUs restores those it
        # has (torch.cuda.set_rng_state_all would index past default_generators)
        for index, state in enumerate(states["cuda"][: torch.cuda.device_count()]):
            torch.cuda.set_rng_state(state, index)
        if "cuda_current" in states:
            # every rank resumes its own GPU from the saving rank's, as every rank's CPU
            # generator resumes from the saving rank's (ranks seeded alike draw alike)
            torch.cuda.set_rng_state(states["cuda_current"])
    if "numpy" in states:
        import numpy as np

        s = states["numpy"]
        np.random.set_state(
            (
                s["kind"],
                s["keys"].numpy().astype(np.uint32),
                s["pos"],
                s["has_gauss"],
                s["cached_gaussian"],
            )
        )


def resolve_path(
    ckpt_path: str | os.PathLike[str] | None, callback: ModelCheckpoint | None
) -> Path | None:
    """The file a ``ckpt_path`` argument names: a path, or ``"best"`` / ``"last"`` of the
    run's ModelCheckpoint."""
    if ckpt_path in ("best", "last"):
        found = ""
        if callback is not None:
            found = callback.best_model_path if ckpt_path == "best" else callback.last_model_path
        if not found:
            raise ValueError(
                f"ckpt_path={ckpt_path!r} but no ModelCheckpoint has saved a {ckpt_path} "
                "checkpoint yet (for 'last' use ModelCheckpoint(save_last=True))"
            )
        return Path(found)
    return Path(ckpt_path) if ckpt_path is not None else None


# -- what a Trainer checkpoint holds ------------------------------------------------------------


def checkpoint_state(trainer: Trainer, run: FitRun) -> dict[str, Any]:
    """Everything needed to resume ``run`` exactly where it is now."""
    return {
        **run_state(trainer, run),
        "model": run.model.state_dict(),
        "optimizers": [opt.state_dict() for opt in run.optimizers],
    }


def run_state(trainer: Trainer, run: FitRun) -> dict[str, Any]:
    """What a checkpoint holds besides the weights and the optimizers' state: versions,
    policy, loop position, schedulers, scaler, callbacks, this process's RNG states, and
    the metrics monitors read (the latest values, the training epoch's sums so far)."""
    at_epoch_end = run.epoch_finished
    # a process's own epoch sums: one file written by rank 0 of several would give every
    # rank rank 0's
    own = trainer.world_size == 1 or trainer.strategy.sharded
    return {
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        "mixprec_version": __version__,
        "torch_version": str(torch.__version__),
        "policy_name": run.precision.policy.name,
        "loop": {
            "epoch": trainer.current_epoch + 1 if at_epoch_end else trainer.current_epoch,
            "batch": 0 if at_epoch_end else trainer.batches_done,
            "global_step": trainer.global_step,
            "epoch_rng": None if at_epoch_end else run.epoch_rng,
            "epoch_batches": run.num_training_batches,
            "batch_size": loader_batch_size(run.train_loader),
            "order": order_of(run.train_loader),
        },
        "optimizer_types": [type(opt.optimizer).__name__ for opt in run.optimizers],
        # an epoch-interval scheduler does not advance after a skipped last step
        "last_step_skipped": [opt.step_was_skipped for opt in run.optimizers],
        "schedulers": [s.scheduler.state_dict() for s in run.schedulers],
        "precision": run.precision.state_dict(),
        "callbacks": callback_states(trainer.callbacks),
        "rng": rng_states(),
        "world_size": trainer.world_size,
        "metrics": {
            "callback": dict(trainer.callback_metrics),
            "training_epoch": trainer._metrics.training_epoch_sums() if own else {},
        },
    }


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
    if loop["batch"] != n:  # else nothing of the epoch is left to replay
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


def load_weights(run: Run, state: dict[str, Any], path: Path) -> bool:
    """Load the model weights; return whether the checkpoint's precision is this run's.

    Across precisions the float32 master weights (if the checkpoint has them) are used in
    place of the 16-bit parameters they shadow, and everything is cast to this run's dtypes.
    """
    check_weights(run.model, state, path)
    saved_policy = state["precision"]["policy"]
    same = saved_policy == run.precision.policy.to_config()
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
    run.model.load_state_dict(weights)
    return same


def saved_masters(state: dict[str, Any]) -> dict[str, Tensor]:
    """Parameter name -> the checkpoint's float32 master of it, for a restore in another
    precision (the masters are saved under their parameters' names)."""
    out: dict[str, Tensor] = {}
    for saved in state["optimizers"]:
        out.update(master_weights_by_name(saved, state["model"]))
    return out


def restore(trainer: Trainer, run: FitRun, state: dict[str, Any], path: Path) -> None:
    """Put ``run`` and ``trainer``'s progress back where the checkpoint ``state`` left them."""
    # everything is checked before anything is loaded: a failed resume leaves the model as it was
    check_weights(run.model, state, path)
    _check_optimizers(run, state, path)
    loop = state["loop"]
    if state.get("world_size", 1) != trainer.world_size and loop["batch"]:
        raise CheckpointError(
            f"{path} was saved mid-epoch with {state['world_size']} processes; resuming "
            f"mid-epoch needs the same number (this run has {trainer.world_size})"
        )
    check_resume_point(run, loop, path)
    same = load_weights(run, state, path)
    if not same:
        # this run's masters come from the checkpoint's own weights (a float32 checkpoint's
        # exactly, not as this run's 16-bit model holds them) or its masters
        full = {**run.model.state_dict(), **state["model"], **saved_masters(state)}
    for opt, saved in zip(run.optimizers, state["optimizers"], strict=True):
        if same:
            opt.load_state_dict(saved)
        else:  # this run's masters from full-precision weights
            opt.load_state_dict_across_precisions(saved, full)
    for s, saved in zip(run.schedulers, state["schedulers"], strict=True):
        s.scheduler.load_state_dict(saved)
    precision = run.precision
    scaler_state = state["precision"]["scaler"]
    if scaler_state.get("kind") == precision.scaler.kind:
        precision.load_state_dict(state["precision"])
    else:
        log.info(
            "%s had a %r loss scaler, this run uses %r: starting it fresh",
            path,
            scaler_state.get("kind"),
            precision.scaler.kind,
        )
    trainer._load_callback_states(state["callbacks"])
    restore_progress(trainer, run, state, path)


def restore_progress(trainer: Trainer, run: FitRun, state: dict[str, Any], path: Path) -> None:
    """The loop position, the RNG states to resume with and the metrics monitors read, from
    a checkpoint's run state (a file's or a sharded one's)."""
    loop = state["loop"]
    trainer.current_epoch, trainer.batches_done = loop["epoch"], loop["batch"]
    trainer.global_step = loop["global_step"]
    if loop["epoch_rng"] is not None:
        run.epoch_rng = loop["epoch_rng"]
    run.resume_rng = state["rng"]
    for opt, skipped in zip(run.optimizers, state.get("last_step_skipped", []), strict=False):
        opt.step_was_skipped = skipped
    metrics = state.get("metrics", {})  # absent from checkpoints written before it was kept
    trainer._log.callback_metrics.update(metrics.get("callback", {}))
    trainer._metrics.load_training_epoch_sums(
        metrics.get("training_epoch", {}), trainer.strategy.device
    )
    log.info(
        "resumed from %s at epoch %d, batch %d, step %d",
        path,
        trainer.current_epoch,
        trainer.batches_done,
        trainer.global_step,
    )
