"""Sharded checkpoints of FSDP runs: a directory written with ``torch.distributed.checkpoint``
(DCP), atomic as a whole.

Layout of a checkpoint ``path/``::

    .metadata, __<rank>_0.distcp   DCP: the model's and the optimizers' shards, each rank its
                                   own (``get_state_dict``: keys are parameter names)
    trainer-rank<r>.pt             rank r's run state (`resume.run_state`): loop position,
                                   scaler, schedulers, callbacks, its own RNG states

A save takes the steps of `checkpoint.atomic_write` across the processes: rank 0 prepares
``path``'s directory and makes one temporary directory next to it (`checkpoint.new_tmp`),
every rank writes into it, and after a barrier rank 0 commits it to ``path``. A save killed
before that leaves ``path`` as it was (the last complete checkpoint) and a temporary
directory that the next save into that directory removes. When ``path`` already exists
(``last.ckpt``) the old directory is first renamed aside, then removed; a crash between
those two renames leaves it complete under ``.<name>.<host>.<pid>.<token>.old``, and
`checkpoint.recover_aside` puts it back (the Trainer calls it before it resumes from a path,
and before a save to that path).

Loading reshards: DCP reads whatever shards this run's ranks need, so a checkpoint written by
2 ranks resumes with 1 (then each rank takes rank 0's run state, and a log line says so), or
in a single-device run.
"""

from __future__ import annotations

import contextlib
import logging
import os
import warnings
from collections import defaultdict
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
    set_state_dict,
)

from mixprec.policy.map import config_in_words, resumable_config
from mixprec.trainer import checkpoint as ckpt_io
from mixprec.trainer.callbacks import RUN_STATE, load_callback_states
from mixprec.trainer.interrupt import ctrl_c_deferred
from mixprec.trainer.optimizers import (
    holds_low_bit_states,
    saved_state_formats,
    state_formats,
    state_shards,
)
from mixprec.trainer.resume import (
    check_groups,
    check_resume_point,
    check_world,
    restore_progress,
    run_state,
)

if TYPE_CHECKING:
    from mixprec.trainer.loop import FitRun, Run
    from mixprec.trainer.strategy import Strategy

__all__: list[str] = []

log = logging.getLogger("mixprec")


def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


def _agreed_tmp(path: Path, rank: int) -> Path:
    """Rank 0 prepares ``path``'s directory and makes a temporary directory next to it; all
    ranks get it."""
    name = [None]
    if rank == 0:
        ckpt_io.prepare(path)
        name = [str(ckpt_io.new_tmp(path, directory=True))]
    if _distributed():
        dist.broadcast_object_list(name, src=0)
    return Path(name[0])  # type: ignore[arg-type]


def _dcp_load(state: dict[str, Any], path: Path) -> None:
    """``dcp.load`` in place; in one process without a group, without torch's warning that
    it assumes exactly that."""
    if _distributed():
        dcp.load(state, checkpoint_id=path)
        return
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "torch.distributed is disabled", UserWarning)
        dcp.load(state, checkpoint_id=path, no_dist=True)


def _as_saved(optim_state: dict[str, Any], path: Path) -> None:
    """Leave out of the optimizer state to load what the checkpoint at ``path`` does not
    hold, which DCP's strict load would refuse for the missing keys: the whole state of a
    parameter that had none at the save (it requires a gradient but never got one: an
    unused pooler, an expert no batch reached; torch's placeholder step gives it one here),
    and the low-bit records (``"shards"``, the layout; ``"shape"``, the parameter's) of a
    checkpoint saved before they were recorded (the run state's world size stands for the
    layout then, `restore`)."""
    saved = dcp.FileSystemReader(str(path)).read_metadata().state_dict_metadata
    held = set()  # every dotted prefix of the saved optimizer state's keys
    for key in saved:
        if key.startswith("optim.state."):
            parts = key.split(".")
            held.update(".".join(parts[:i]) for i in range(3, len(parts)))
    states = optim_state.get("state", {})
    for fqn, entry in list(states.items()):
        if f"optim.state.{fqn}" not in held:
            del states[fqn]  # (it loads without state, as it was saved)
            continue
        if not isinstance(entry, dict):
            continue
        for key in ("shards", "shape"):
            if key in entry and f"optim.state.{fqn}.{key}" not in saved:
                del entry[key]


def _inner(run: FitRun | Run) -> list[torch.optim.Optimizer]:
    return [opt.optimizer for opt in getattr(run, "optimizers", [])]


@contextlib.contextmanager
def _masters_as_params(run: FitRun | Run) -> Iterator[list[Any]]:
    """The optimizers' float32 masters (a one-device run resuming a sharded checkpoint with
    ``master_weights``) replaced in their groups and states by the model parameters they
    stand for, which torch's ``get_state_dict`` names (it knew no masters and failed with a
    bare KeyError), then put back, their loaded states widened to the masters' dtype. An
    FSDP run keeps no masters beside 16-bit shards, so its checkpoint holds none: as a file
    checkpoint saved without them, the masters are then taken from the loaded weights
    (`restore`). Yields the wrappers whose masters were replaced."""
    swaps = []
    for lso in getattr(run, "optimizers", []):
        inner, model_param = lso.optimizer, getattr(lso, "model_param", None)
        if model_param is None:
            continue
        held = [p for g in inner.param_groups for p in g["params"]]
        to_param = {m: model_param(m) for m in held if model_param(m) is not m}
        if to_param:
            swaps.append((lso, inner, to_param, {p: m for m, p in to_param.items()}))
    for _, inner, to_param, _ in swaps:
        for g in inner.param_groups:
            g["params"] = [to_param.get(p, p) for p in g["params"]]
        inner.state = defaultdict(dict, {to_param.get(p, p): s for p, s in inner.state.items()})
    try:
        yield [lso for lso, *_ in swaps]
    finally:
        for _, inner, _, to_master in swaps:
            for g in inner.param_groups:
                g["params"] = [to_master.get(p, p) for p in g["params"]]
            state: dict[Any, Any] = defaultdict(dict)
            for p, entry in inner.state.items():
                master = to_master.get(p, p)
                state[master] = {
                    k: v.to(master.dtype)
                    if k != "step" and torch.is_tensor(v) and v.dtype == p.dtype != master.dtype
                    else v
                    for k, v in entry.items()
                }  # (torch's load cast them to the 16-bit parameter's dtype; widening is exact)
            inner.state = state


def _state_dicts(run: FitRun | Run) -> tuple[dict[str, Any], dict[str, Any], list[bool]]:
    """``get_state_dict`` of the run's model and optimizers, and which optimizers had no
    state yet. For those torch makes one by a step at learning rate 0 (Adam's step count 1,
    its moments 0); that state is taken out of the live optimizer again, so that saving or
    loading before the first real step (every step so far skipped for an overflow) changes
    nothing: Adam's bias correction would run a step ahead for the rest of the run."""
    inner = _inner(run)
    unstepped = [not opt.state for opt in inner]
    model_state, optim_state = get_state_dict(run.model, inner)
    for opt, empty in zip(inner, unstepped, strict=True):
        if empty:
            opt.state.clear()
    return model_state, optim_state, unstepped


def save(run: FitRun, path: str | os.PathLike[str]) -> Path:
    """Write a sharded checkpoint of ``run`` at ``path`` (every rank calls it)."""
    path = Path(path)
    rank = run.strategy.global_rank
    tmp = _agreed_tmp(path, rank)
    model_state, optim_state, unstepped = _state_dicts(run)
    state = run_state(run)
    state["optimizers_unstepped"] = unstepped  # (their saved state is torch's placeholder)
    with ctrl_c_deferred():
        dcp.save({"model": model_state, "optim": optim_state}, checkpoint_id=tmp)
        ckpt_io.atomic_save(state, tmp / RUN_STATE.format(rank))
        if _distributed():
            dist.barrier()  # every rank's files are in
        if rank == 0:
            ckpt_io.commit(tmp, path)
        if _distributed():
            dist.barrier()  # nobody reads or replaces it before it is there
    return path


def copy(strategy: Strategy, src: str | os.PathLike[str], dst: str | os.PathLike[str]) -> Path:
    """Make ``dst`` an atomic copy of the sharded checkpoint ``src`` (`checkpoint.atomic_link`:
    hard links where the filesystem allows); every rank calls it, rank 0 copies."""
    src, dst = Path(src), Path(dst)
    if strategy.global_rank == 0:
        ckpt_io.atomic_link(src, dst)
    if _distributed():
        dist.barrier()
    return dst


def _read_run_state(path: Path, rank: int, world: int) -> tuple[dict[str, Any], int]:
    """This rank's run state (rank 0's when the world size changed) and the saved world size."""
    if not path.is_dir() or not (path / ".metadata").is_file():
        raise FileNotFoundError(f"no sharded checkpoint at {path} (a directory with .metadata)")
    saved_world = len(list(path.glob(RUN_STATE.format("*"))))
    own = path / RUN_STATE.format(rank if saved_world == world else 0)
    return ckpt_io.load(own, required=ckpt_io.RUN_KEYS), saved_world


def _check_keys(run: Run, path: Path, optimizers: bool) -> None:
    """Raise `CheckpointError` before loading if the shards are another model's."""
    saved = dcp.FileSystemReader(str(path)).read_metadata().state_dict_metadata
    saved_model = {k.removeprefix("model."): m for k, m in saved.items() if k.startswith("model.")}
    whole = run.model.state_dict()
    own = {k: v for k, v in whole.items() if isinstance(v, torch.Tensor)}
    missing = [k for k in own if k not in saved_model]
    unexpected = [k for k in saved_model if k not in whole]
    shapes = [
        f"{k} {tuple(saved_model[k].size)} vs {tuple(v.shape)}"
        for k, v in own.items()
        if k in saved_model and tuple(saved_model[k].size) != tuple(v.shape)
    ]
    has_optim = any(k.startswith("optim.") for k in saved)
    if missing or unexpected or shapes or (optimizers and _inner(run) and not has_optim):
        parts = [f"missing in the checkpoint: {', '.join(missing[:5])}"] if missing else []
        parts += [f"not in this model: {', '.join(unexpected[:5])}"] if unexpected else []
        parts += [f"shapes differ (checkpoint vs model): {', '.join(shapes[:5])}"] if shapes else []
        parts += [] if parts else ["it holds no optimizer state"]
        raise ckpt_io.CheckpointError(
            f"{path} does not fit this run ({type(run.model).__name__}): {'; '.join(parts)}. "
            "Nothing was loaded"
        )


def _check_policy(run: Run, state: dict[str, Any], path: Path) -> None:
    saved = state["precision"]["policy"]
    if resumable_config(saved) != resumable_config(run.precision.policy.to_config()):
        # (the maps in full: two of one name differ in their rules, states rules among them)
        raise ckpt_io.CheckpointError(
            f"{path} was trained in precision {config_in_words(saved)}, this run uses "
            f"{run.precision.policy!r}: a sharded checkpoint resumes in its own precision. "
            "To change precision, export the weights (Trainer.save_full_state_dict) and start "
            "a new fit from them"
        )


def load_weights(run: Run, path: str | os.PathLike[str]) -> None:
    """Load the model's weights from a sharded checkpoint (every rank calls it)."""
    path = Path(path)
    rank = dist.get_rank() if _distributed() else 0
    world = dist.get_world_size() if _distributed() else 1
    state, _ = _read_run_state(path, rank, world)
    _check_policy(run, state, path)
    _check_keys(run, path, optimizers=False)
    model_state, _ = get_state_dict(run.model, [])
    _dcp_load({"model": model_state}, path)
    set_state_dict(run.model, [], model_state_dict=model_state, optim_state_dict={})


def restore(run: FitRun, path: str | os.PathLike[str]) -> None:
    """Put ``run`` and its progress back where the sharded checkpoint at ``path`` left them;
    another world size than at the save reshards (logged)."""
    path = Path(path)
    world = run.strategy.world_size
    state, saved_world = _read_run_state(path, run.strategy.global_rank, world)
    _check_policy(run, state, path)
    _check_keys(run, path, optimizers=True)
    types = [type(opt.optimizer).__name__ for opt in run.optimizers]
    if state["optimizer_types"] != types or len(state["schedulers"]) != len(run.schedulers):
        raise ckpt_io.CheckpointError(
            f"{path} holds optimizers {state['optimizer_types']} and "
            f"{len(state['schedulers'])} schedulers; this run configured {types} and "
            f"{len(run.schedulers)}: resume with the same configure_optimizers and "
            "optimizer_states (a sharded checkpoint keeps the optimizers it was saved with)"
        )
    check_groups(run, state, path)
    formats = [state_formats(opt.optimizer) for opt in run.optimizers]
    # (older checkpoints recorded none; "fp8" is spelled "float8" now)
    saved_formats = saved_state_formats(state.get("optimizer_state_formats", formats))
    if saved_formats != formats:
        raise ckpt_io.CheckpointError(
            f"{path} holds optimizer states in {saved_formats} (per optimizer, per group); "
            f"this run keeps {formats}: a sharded checkpoint resumes in the formats it was "
            "saved in, so resume with the optimizer_states it was trained with (an unsharded "
            "checkpoint converts them). Nothing was loaded"
        )
    shards = [state_shards(opt.optimizer) for opt in run.optimizers]
    # (older checkpoints recorded none: their codes were cut among the processes that saved
    # them if sharded, which their world size then tells)
    saved_shards = state.get("optimizer_state_shards")
    low_bit = [holds_low_bit_states(opt.optimizer) for opt in run.optimizers]
    moved = [
        quantized and (saved_shards[i] != shards[i] if saved_shards else saved_world != world)
        for i, quantized in enumerate(low_bit)
    ]
    if any(moved):
        was = saved_shards or [saved_world] * len(shards)
        raise ckpt_io.CheckpointError(
            f"{path} holds low-bit optimizer states cut into blocks within each of {was} "
            f"shards (per optimizer: the FSDP processes that saved them), where this run cuts "
            f"them in {shards}: low-bit states resume in the layout they were saved in only. "
            "Resume with the strategy and number of processes that saved it. Nothing was loaded"
        )
    loop = state["loop"]
    check_world(path, saved_world, world, loop)
    check_resume_point(run, loop, path)
    # another kind of scaler starts fresh, as a file checkpoint's resume does; the same kind
    # is checked before anything is loaded
    scaler_state = state["precision"]["scaler"]
    fresh_scaler = scaler_state.get("kind") != run.precision.scaler.kind
    if not fresh_scaler:
        try:
            run.precision.scaler.check_state_dict(scaler_state)
        except (TypeError, ValueError) as error:
            raise ckpt_io.CheckpointError(
                f"{path}: its loss scaler state does not fit this run's: {error}. Nothing "
                "was loaded"
            ) from error
    with _masters_as_params(run) as with_masters:
        model_state, optim_state, _ = _state_dicts(run)
        _as_saved(optim_state, path)
        _dcp_load({"model": model_state, "optim": optim_state}, path)
        # (not strict: a parameter saved without state loads without one)
        lenient = StateDictOptions(strict=False)
        set_optimizer_state_dict(run.model, _inner(run), optim_state, options=lenient)
        set_model_state_dict(run.model, model_state)
        unstepped = state.get("optimizers_unstepped", [])  # (absent from older checkpoints)
        for opt, empty in zip(_inner(run), unstepped, strict=False):
            if empty:  # saved before its first real step: it resumes as it was, without state
                opt.state.clear()
    with torch.no_grad():  # (the checkpoint has no masters: they start from its weights)
        for lso in with_masters:
            for param, master in lso.master_params.items():
                master.copy_(param)
    for s, saved in zip(run.schedulers, state["schedulers"], strict=True):
        s.scheduler.load_state_dict(saved)
    if fresh_scaler:
        log.info(
            "%s had a %r loss scaler, this run uses %r: starting it fresh",
            path,
            scaler_state.get("kind"),
            run.precision.scaler.kind,
        )
    else:
        run.precision.load_state_dict(state["precision"])
    load_callback_states(run.callbacks, state["callbacks"])
    if saved_world != world:
        log.info(
            "resharded %s, saved by %d processes, onto %d: random generators resume from "
            "rank 0's states",
            path,
            saved_world,
            world,
        )
    restore_progress(run, state, path)
