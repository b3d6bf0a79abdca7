"""What ``configure_optimizers`` returns, in any form Lightning accepts, made uniform:
optimizers, and schedulers with their interval, frequency and monitored metric."""

from __future__ import annotations

import functools
import inspect
import logging
import numbers
import warnings
import weakref
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from mixprec.optim import LossScaleOptimizer, follow_steps
from mixprec.optim.states import (
    LowBitAdam,
    LowBitAdamW,
    LowBitOptimizer,
    LowBitSGD,
    parse_state_format,
)
from mixprec.optim.states.assign import low_bit_settings
from mixprec.optim.states.moments import shards_of
from mixprec.precision import Precision
from mixprec.trainer.checkpoint import CheckpointError
from mixprec.trainer.module import TrainingModule

__all__: list[str] = []

log = logging.getLogger("mixprec")


@dataclass
class Scheduler:
    """A learning-rate scheduler, the wrapped optimizer it drives, and when it steps."""

    scheduler: Any
    optimizer: LossScaleOptimizer
    interval: str = "epoch"
    frequency: int = 1
    monitor: str | None = None
    # whether a monitored value not logged is an error (Lightning's default) or a warning
    # and a step left out
    strict: bool = True
    name: str | None = None  # (Lightning's name for it: said in messages)


_SCHEDULER_KEYS = ("scheduler", "interval", "frequency", "monitor", "strict", "name")
_OPTIMIZER_KEYS = ("optimizer", "lr_scheduler", "monitor")


def sched_config(s: Any) -> dict[str, Any]:
    """A scheduler config dict (Lightning's keys) from a scheduler or such a dict."""
    if not isinstance(s, dict):
        return {"scheduler": s}
    if "scheduler" not in s:
        raise ValueError(f"a scheduler config dict needs a 'scheduler' key, got {sorted(s)}")
    unknown = set(s) - set(_SCHEDULER_KEYS)
    if unknown:
        raise ValueError(
            f"unknown scheduler config keys {sorted(unknown)}; accepted: scheduler, "
            "interval ('epoch' or 'step'), frequency, monitor, strict, name"
        )
    return dict(s)


def optimizer_dict(d: dict[str, Any]) -> tuple[Any, dict[str, Any] | None]:
    """The optimizer and scheduler config of one ``{"optimizer": ..., "lr_scheduler": ...,
    "monitor": ...}`` dict. Any other key is refused: a misspelt ``"lr_scheduler"`` would
    train without its scheduler. A top-level ``"monitor"`` is the metric of a
    ReduceLROnPlateau whose config names none (Lightning's form: a bare one); unused
    elsewhere, it is warned about (Lightning ignores it there)."""
    unknown = [str(k) for k in d if k not in _OPTIMIZER_KEYS]
    if unknown or "optimizer" not in d:
        got = f"unknown keys {sorted(unknown)}" if unknown else f"no 'optimizer' in {sorted(d)}"
        lightning = [k for k in unknown if k in ("frequency", "interval")]
        hint = (
            f"; {' and '.join(map(repr, lightning))} beside 'optimizer' is Lightning 1.x's "
            "form (optimizers stepping in turn, which mixprec does not do): a scheduler's "
            "'interval' and 'frequency' go in its config dict, as 'lr_scheduler'"
            if lightning
            else ""
        )
        raise ValueError(
            "configure_optimizers must return dicts with the keys 'optimizer' (required), "
            "'lr_scheduler' (a scheduler, or a config dict with 'scheduler', 'interval', "
            "'frequency', 'monitor', 'strict', 'name') and 'monitor' (the metric of a "
            f"ReduceLROnPlateau given as a bare 'lr_scheduler'); got {got}{hint}"
        )
    monitor, sched = d.get("monitor"), d.get("lr_scheduler")
    if monitor is not None and not isinstance(monitor, str):
        raise ValueError(f"'monitor' must be a metric name, got {monitor!r}")
    if sched is None:
        _unused_monitor(monitor, "there is no 'lr_scheduler'")
        return d["optimizer"], None
    config = sched_config(sched)
    own = config.get("monitor")
    if monitor is None or own == monitor:
        return d["optimizer"], config
    if own is None and isinstance(config["scheduler"], torch.optim.lr_scheduler.ReduceLROnPlateau):
        config["monitor"] = monitor
    elif own is not None:
        _unused_monitor(monitor, f"the scheduler's config dict monitors {own!r}")
    else:
        _unused_monitor(monitor, f"{type(config['scheduler']).__name__} steps without a metric")
    return d["optimizer"], config


def _unused_monitor(monitor: str | None, why: str) -> None:
    """Warn that a top-level ``"monitor"`` is not used (Lightning ignores it there)."""
    if monitor is not None:
        warnings.warn(
            f"configure_optimizers' 'monitor': {monitor!r} is not used: {why}. It is the "
            "metric of a ReduceLROnPlateau whose config names none (a bare 'lr_scheduler'); "
            "another scheduler monitors what its config dict names ({'scheduler': ..., "
            "'monitor': ...})",
            stacklevel=2,
        )


def parse_optimizers(config: Any) -> tuple[list[Any], list[dict[str, Any]]]:
    """Lightning's accepted ``configure_optimizers`` results -> (optimizers, scheduler configs)."""
    if isinstance(config, torch.optim.Optimizer):
        return [config], []
    if isinstance(config, dict):
        config = [config]
    if isinstance(config, (list, tuple)):
        if len(config) == 2 and isinstance(config[0], (list, tuple)):
            opts, scheds = config
            if all(isinstance(o, torch.optim.Optimizer) for o in opts):
                scheds = scheds if isinstance(scheds, (list, tuple)) else [scheds]
                return list(opts), [sched_config(s) for s in scheds]
        if config and all(isinstance(o, torch.optim.Optimizer) for o in config):
            return list(config), []
        if config and all(isinstance(d, dict) for d in config):
            pairs = [optimizer_dict(d) for d in config]
            return [o for o, _ in pairs], [s for _, s in pairs if s is not None]
    raise ValueError(
        "configure_optimizers must return an optimizer, a list of optimizers, "
        "([optimizers], [schedulers]), or {'optimizer': ..., 'lr_scheduler': ..., "
        "'monitor': ...} (or a list of such dicts); "
        f"got {type(config).__name__}"
    )


def scheduler_entry(config: dict[str, Any], optimizers: list[LossScaleOptimizer]) -> Scheduler:
    """A `Scheduler` from a config dict, bound to the wrapped optimizer it drives."""
    sched = config["scheduler"]
    inner = getattr(sched, "optimizer", None)
    owner = next((o for o in optimizers if o.optimizer is inner), None)
    if owner is None:
        raise ValueError(
            f"scheduler {type(sched).__name__} does not drive any optimizer returned by "
            "configure_optimizers"
        )
    interval = config.get("interval", "epoch")
    if interval not in ("epoch", "step"):
        raise ValueError(f"scheduler interval must be 'epoch' or 'step', got {interval!r}")
    monitor = config.get("monitor")
    if monitor is None and isinstance(sched, torch.optim.lr_scheduler.ReduceLROnPlateau):
        raise ValueError(
            "ReduceLROnPlateau needs a metric to monitor: {'optimizer': ..., 'lr_scheduler': "
            "scheduler, 'monitor': 'val_loss'}, or 'lr_scheduler': {'scheduler': scheduler, "
            "'monitor': 'val_loss'}"
        )
    frequency = config.get("frequency", 1)
    if isinstance(frequency, bool) or not isinstance(frequency, numbers.Integral) or frequency < 1:
        raise ValueError(
            f"scheduler frequency must be a whole number >= 1 (steps or epochs between its "
            f"steps), got {frequency!r}"
        )
    strict, name = config.get("strict", True), config.get("name")
    if not isinstance(strict, bool):
        raise ValueError(f"scheduler strict must be True or False, got {strict!r}")
    if name is not None and not isinstance(name, str):
        raise ValueError(f"scheduler name must be a string or None, got {name!r}")
    if interval == "step":  # (counts the steps of its first window too)
        follow_steps(sched, owner)
    return Scheduler(sched, owner, interval, int(frequency), monitor, strict, name)


# the torch optimizers `optimizer_states` converts into each low-bit class (subclasses first)
_CONVERTED_FROM = ((LowBitSGD, ("SGD",)), (LowBitAdam, ("Adam",)), (LowBitAdamW, ("AdamW", "Adam")))


def state_formats(optimizer: torch.optim.Optimizer) -> list[str]:
    """Each group's optimizer-state format: a low-bit optimizer's ``"states"``, float32 for
    any other optimizer's."""
    return [str(parse_state_format(g.get("states", "float32"))) for g in optimizer.param_groups]


def holds_low_bit_states(optimizer: torch.optim.Optimizer) -> bool:
    """Whether any parameter's moments are in a low-bit format (a group's ``"states"``, or
    a parameter's own, as a policy map's state rules give)."""
    if not isinstance(optimizer, LowBitOptimizer):
        return False
    return any(
        optimizer.format_of(p, g).quantized for g in optimizer.param_groups for p in g["params"]
    )


def state_shards(optimizer: torch.optim.Optimizer) -> int:
    """The most parts any parameter's low-bit moments are cut into (`shards_of`: an FSDP2
    run's processes; 1 unsharded): the layout a sharded checkpoint's codes are in."""
    return max((shards_of(p) for g in optimizer.param_groups for p in g["params"]), default=1)


def saved_state_formats(saved: list[list[str]]) -> list[list[str]]:
    """The formats a checkpoint recorded per optimizer and group, spelled as `state_formats`
    spells them now (``"fp8"``, the older name, is ``"float8"``)."""
    return [[str(parse_state_format(f)) for f in groups] for groups in saved]


def _per_parameter(saved: dict[str, Any]) -> Counter[str]:
    """How many parameters a low-bit optimizer state holds in each format (as recorded)."""
    return Counter(str(st["format"]) for st in saved["state"].values() if "format" in st)


def _held_formats(saved: dict[str, Any]) -> str:
    """The formats a low-bit optimizer state's groups hold, and its parameters' (with their
    counts) where those differ: small parameters keep float32, a block is cut to a smaller
    parameter, a map's states rules set them one by one."""
    groups = sorted({str(parse_state_format(g["states"])) for g in saved["param_groups"]})
    counts = _per_parameter(saved)
    text = ", ".join(groups)
    if set(counts) - set(groups):
        each = ", ".join(f"{n} in {f}" for f, n in sorted(counts.items()))
        text += f" (per parameter: {each})"
    return text


def _resume_advice(saved: dict[str, Any]) -> str:
    """How to resume a low-bit optimizer state in its formats: one ``optimizer_states``
    where its groups' kind is every parameter's (float32 aside: small parameters keep it;
    a block cut to a smaller parameter is that kind's), the rules that set them otherwise."""
    groups = {str(parse_state_format(g["states"])) for g in saved["param_groups"]}
    kinds = {parse_state_format(f).kind for f in _per_parameter(saved)}
    if len(groups) == 1 and kinds <= {parse_state_format(next(iter(groups))).kind, "float32"}:
        return f"resume with optimizer_states={groups.pop()!r}"
    return (
        "resume with the states rules it was trained with (a PolicyMap's states=, or a "
        "low-bit optimizer's formats=)"
    )


def across_state_formats(
    state: dict[str, Any], optimizers: list[LossScaleOptimizer], path: Path
) -> dict[str, Any]:
    """A checkpoint's ``state`` with each optimizer's saved state in the form this run's
    ``optimizers`` load, where ``optimizer_states`` (or a map's ``states``) changed between
    the runs: a torch optimizer's state, saved without it, goes to the low-bit optimizer
    this run converted it into with that one's groups (`states.low_bit_settings`, each
    group's ``"states"``), its float32 moments stored in their formats on load; a low-bit
    state in other formats is converted by the optimizer's load. Either is announced, naming
    both formats: moments stored again are close to the saved ones, not them. A low-bit
    state resumed by a torch optimizer is refused, naming the formats to resume with."""
    if len(state["optimizers"]) != len(optimizers):
        return state  # the resume's checks refuse it
    saved_types = state.get("optimizer_types", [None] * len(optimizers))
    states, types = [], []
    for i, (opt, saved, saved_type) in enumerate(
        zip(optimizers, state["optimizers"], saved_types, strict=True)
    ):
        inner, groups = opt.optimizer, saved["optimizer"]["param_groups"]
        low_bit = "states" in groups[0] if groups else False
        if low_bit and not isinstance(inner, LowBitOptimizer):
            raise CheckpointError(
                f"{path} holds optimizer {i}'s states in {_held_formats(saved['optimizer'])} "
                f"({saved_type}); this run's {type(inner).__name__} keeps float32 ones: "
                f"{_resume_advice(saved['optimizer'])}, as the checkpoint was trained"
            )
        if not low_bit and isinstance(inner, LowBitOptimizer):
            torch_names = next(names for cls, names in _CONVERTED_FROM if isinstance(inner, cls))
            if saved_type in torch_names:
                try:
                    groups = [
                        {**low_bit_settings(g, saved_type), "states": ours["states"]}
                        for g, ours in zip(groups, inner.param_groups, strict=True)
                    ]
                except ValueError as error:
                    raise CheckpointError(f"{path}, optimizer {i}: {error}") from None
                saved = {**saved, "optimizer": {**saved["optimizer"], "param_groups": groups}}
                saved_type = type(inner).__name__
        if isinstance(inner, LowBitOptimizer):
            _announce_formats(saved["optimizer"], inner, f"{path}: optimizer {i}")
        states.append(saved)
        types.append(saved_type)
    return {**state, "optimizers": states, "optimizer_types": types}


def _announce_formats(saved: dict[str, Any], inner: LowBitOptimizer, where: str) -> None:
    """Warn when parameters saved in one state format resume in another."""
    index = [k for g in saved["param_groups"] for k in g["params"]]
    mine = [(p, g) for g in inner.param_groups for p in g["params"]]
    changed: dict[tuple[str, str], int] = {}
    for key, (p, group) in zip(index, mine, strict=False):
        entry = saved["state"].get(key)
        if entry:
            pair = (str(entry.get("format", "float32")), str(inner.format_of(p, group)))
            if pair[0] != pair[1]:
                changed[pair] = changed.get(pair, 0) + 1
    if changed:
        said = "; ".join(f"{n} saved as {a}, resumed as {b}" for (a, b), n in changed.items())
        warnings.warn(
            f"{where}'s states change format ({said} parameter(s)): optimizer_states or the "
            f"map's states rules differ from the saved run's, so those moments are decoded and "
            f"stored again, close to the saved ones but not them; the run does not continue "
            f"bit for bit",
            stacklevel=2,
        )


def repoint_converted(configs: list[dict[str, Any]], precision: Precision) -> None:
    """Make each scheduler built on an optimizer that ``precision`` converted to low-bit
    states (``optimizer_states=``) drive the converted one: `states.from_optimizer` keeps
    the parameter groups one to one, in order (a parameter's own format is held per
    parameter, not by splitting its group), and `Precision.setup` gave the torch optimizer
    the converted one's groups and steps, so the learning rates it sets land where they did.
    The converted one's step is patched as torch patches a scheduler's optimizer
    (`count_steps_for_schedulers`), so torch's check of the step order passes, silently."""
    for config in configs:
        sched = config["scheduler"]
        old = getattr(sched, "optimizer", None)
        new = precision.converted(old) if isinstance(old, torch.optim.Optimizer) else None
        if new is None:
            continue
        sched.optimizer = new
        count_steps_for_schedulers(new)


def count_steps_for_schedulers(optimizer: torch.optim.Optimizer) -> None:
    """Patch ``optimizer.step`` as torch's ``LRScheduler.__init__`` patches its optimizer's
    (torch has no public call for it): each step marks the optimizer as stepped, which
    torch's check that a scheduler steps after its optimizer reads. A scheduler moved onto
    another optimizer needs it, or its first step warns that ``optimizer.step()`` was
    overridden. Like torch's, the patch holds the optimizer by a weak reference, and a copy
    of the optimizer (torch copies its defaults, state and groups) goes without it."""
    step = optimizer.step
    if hasattr(step, "_wrapped_by_lr_sched"):
        return
    owner = weakref.ref(optimizer)
    func = step.__func__

    @functools.wraps(func)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        opt = owner()
        opt._opt_called = True  # type: ignore[union-attr]
        return func.__get__(opt, type(opt))(*args, **kwargs)

    wrapper._wrapped_by_lr_sched = True  # type: ignore[attr-defined]
    optimizer.step = wrapper  # type: ignore[method-assign]


OptimizerFactory = Callable[[nn.Module], torch.optim.Optimizer]


def configured_optimizers(
    model: nn.Module, optimizer: Any
) -> tuple[list[torch.optim.Optimizer | OptimizerFactory], list[dict[str, Any]]]:
    """Optimizers (or factories called once the model is on its device) and scheduler
    configs, from ``Trainer.fit(optimizer=...)`` or the module's ``configure_optimizers``."""
    if optimizer is not None:
        if isinstance(optimizer, torch.optim.Optimizer):
            return [optimizer], []
        if callable(optimizer):
            return [lambda m: optimizer(m.parameters())], []
        raise ValueError(
            "optimizer must be a torch.optim.Optimizer, a factory params -> optimizer, or "
            f"None, got {type(optimizer).__name__}"
        )
    if not isinstance(model, TrainingModule):
        log.info("no optimizer given: using AdamW(lr=1e-3)")
        return [lambda m: torch.optim.AdamW(m.parameters(), lr=1e-3)], []
    return parse_optimizers(model.configure_optimizers())


def needs_closure(optimizer: torch.optim.Optimizer) -> bool:
    """Whether ``optimizer.step`` requires a closure that re-evaluates the loss (LBFGS)."""
    closure = inspect.signature(optimizer.step).parameters.get("closure")
    return closure is not None and closure.default is inspect.Parameter.empty


def check_closure_fit(
    optimizers: list[LossScaleOptimizer],
    loss_scaling: bool,
    accumulate_grad_batches: int,
    strategy: str,
) -> bool:
    """Whether the fit steps an optimizer that evaluates the loss inside its step (LBFGS);
    the Trainer then runs each batch's training step in its closure (`loop.closure_step`).
    Raises where that cannot work, before training."""
    closures = [o for o in optimizers if needs_closure(o.optimizer)]
    if not closures:
        return False
    name = type(closures[0].optimizer).__name__
    why = (
        f"{name} evaluates the loss inside its step, so the Trainer runs the training step "
        "in its closure"
    )
    if len(optimizers) > 1:
        names = ", ".join(type(o.optimizer).__name__ for o in optimizers)
        raise ValueError(
            f"{why}, which steps one optimizer alone; this fit has {len(optimizers)} ({names}). "
            f"Train with {name} alone, or step several optimizers in a loop of your own "
            "(precision.step(opt, closure=...))"
        )
    if loss_scaling:
        raise ValueError(
            f"{why}, several times per step, and a loss-scaled step cannot be skipped half-way "
            f"for an overflow: train {name} without loss scaling, with precision '32-true', "
            "'bf16-mixed' or 'bf16-true' (or a mixprec.Precision with scaler='none')"
        )
    if accumulate_grad_batches > 1:
        raise ValueError(
            f"{why}, which evaluates one batch, so gradients cannot be accumulated over "
            f"{accumulate_grad_batches}: use accumulate_grad_batches=1 (and larger batches)"
        )
    if strategy == "fsdp":
        raise ValueError(
            f"{why}; {name} works on whole gradients, which strategy='fsdp' shards: use "
            "strategy='ddp'"
        )
    return True
