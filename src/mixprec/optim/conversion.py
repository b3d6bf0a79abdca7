"""``convert_for``: the optimizer a policy map's optimizer-state formats make of the one a
loop built, what `Precision.setup` asks the optimizer side for.

A torch AdamW, Adam or SGD becomes the low-bit optimizer of `mixprec.optim.states` with the
same parameter groups and state (`from_optimizer`), each parameter's moments in the format
the map gives it (`PolicyMap.state_formats`: its ``states`` rules, embeddings and small
parameters in float32, the rest in the default format). The torch optimizer then stands for
the new one where a caller still holds it (`hand_over`). A low-bit optimizer, or a wrapper
of one, is taken as it is, after checking that it keeps the formats the map gives.
"""

from __future__ import annotations

import types
import warnings
from collections.abc import Collection
from typing import Any

import torch
from torch import nn

from mixprec.optim.engine import SUPPORTED_OPTIMIZERS
from mixprec.optim.states import LowBitOptimizer, StateFormat, from_optimizer
from mixprec.optim.wrapper import LossScaleOptimizer, trained_params
from mixprec.policy.map import PolicyMap

__all__ = ["convert_for", "warn_if_foreign"]

# the torch optimizers whose state formats a policy map converts (exactly these classes:
# the engine's supported ones, as the compensated steps stand in for)
CONVERTIBLE: tuple[type[torch.optim.Optimizer], ...] = tuple(SUPPORTED_OPTIMIZERS)


def convert_for(
    policy_map: PolicyMap,
    optimizer: torch.optim.Optimizer | LossScaleOptimizer,
    model: nn.Module,
    *,
    optimizer_states: str | StateFormat | None = None,
    compensation: str | None = None,
    wrappers: Collection[LossScaleOptimizer] = (),
) -> Any:
    """``optimizer`` with its states in the formats ``policy_map`` gives each parameter of
    ``model``: a torch AdamW, Adam or SGD converted (and handed over, `hand_over`), a
    low-bit optimizer or a wrapper as it is (refused when it keeps another format than the
    one given, or than the map's state rules give some of its parameters; a torch optimizer
    converted before, when its low-bit one keeps another compensation than the one given).

    ``optimizer_states``: the run's default format (`Precision`'s), else the map's single
    ``states``, else float32. ``compensation``: the converted optimizer's (it compensates
    its own 16-bit updates). ``wrappers``: the loop's wrappers, a collection read whenever
    a parameter's format is asked (so that the wrapper made after the conversion counts):
    their float32 masters take their model parameters' formats."""
    default = policy_map.state_default(optimizer_states)
    # a torch optimizer converted before (a second fit, a setup after reset()) stands for
    # the low-bit one it became, whose moments and counts go on: converting it again would
    # start them afresh from its empty state
    given = optimizer
    optimizer = getattr(optimizer, "_converted_into", optimizer)
    if isinstance(optimizer, (LowBitOptimizer, LossScaleOptimizer)):
        inner = getattr(optimizer, "optimizer", optimizer)
        _check_kept_compensation(given, optimizer, inner, compensation)
        kept = inner.defaults["states"] if isinstance(inner, LowBitOptimizer) else None
        if kept is None and default is not None and str(default) != "float32":
            raise ValueError(
                f"the LossScaleOptimizer given wraps {type(inner).__name__} (float32 "
                f"states), which optimizer_states={str(default)!r} would convert: pass the "
                f"plain optimizer to setup (it is converted, then wrapped), or leave "
                f"optimizer_states out"
            )
        if default is not None and kept is not None and kept != default:
            said = (
                f"optimizer_states={default!r}"
                if optimizer_states is not None
                else f"the policy map's states say {default!r}"
            )
            raise ValueError(
                f"{said}, but the {type(inner).__name__} given keeps {kept!r} states: give "
                f"the format once (a torch AdamW, Adam or SGD is converted into {default!r}; "
                f"a low-bit optimizer is taken as it is without optimizer_states)"
            )
        if isinstance(inner, LowBitOptimizer):
            check_kept_formats(policy_map, inner, model, default or kept)
        return optimizer
    if type(optimizer) not in CONVERTIBLE:
        raise TypeError(
            f"optimizer_states converts torch.optim.AdamW, Adam and SGD (or takes a "
            f"mixprec.optim.states optimizer as it is), got {type(optimizer).__name__}: build "
            "one of those, or leave optimizer_states out"
        )
    default = default or "float32"
    assigned = policy_map.state_formats(model, default, frozen=True)
    named = dict(model.named_parameters())
    # each parameter's format is held per parameter (a master takes its parameter's), so
    # the groups stay the torch optimizer's: float32 by `keep_float32`, another low-bit
    # format than the default by `formats`
    plain = {id(named[n]) for n, (fmt, _) in assigned.items() if not fmt.quantized}
    formats = {
        named[n]: fmt for n, (fmt, _) in assigned.items() if fmt.quantized and str(fmt) != default
    }

    converted = from_optimizer(
        optimizer,
        default,
        formats=formats,
        keep_float32=KeptFloat32([p for p in named.values() if id(p) in plain], wrappers),
        compensation=compensation,
    )
    hand_over(optimizer, converted)
    return converted


def _check_kept_compensation(
    given: Any, taken: Any, inner: torch.optim.Optimizer, compensation: str | None
) -> None:
    """A torch optimizer converted before stands for its low-bit optimizer, which keeps the
    compensation it was converted with: refuse another one asked for (``compensation``),
    which would be dropped without a word. (A low-bit optimizer or a wrapper given as such
    is refused at its wrapping, `Precision.setup`.)"""
    if compensation is None or given is taken or not isinstance(inner, LowBitOptimizer):
        return
    if inner.compensation != compensation:
        raise ValueError(
            f"compensation={compensation!r}, but the {type(given).__name__} given was "
            f"converted before (optimizer_states) into {type(inner).__name__} with "
            f"compensation={inner.compensation!r}, whose moments and counts go on: it keeps "
            f"that compensation. Build a new {type(given).__name__} to convert with "
            f"compensation={compensation!r}, or set compensation={inner.compensation!r}"
        )


def check_kept_formats(
    policy_map: PolicyMap, inner: LowBitOptimizer, model: nn.Module, default: str | None
) -> None:
    """A low-bit optimizer is taken as it is: refuse it when the map's per-module state
    rules give some of its parameters another kind of format than it keeps for them."""
    if not isinstance(policy_map.states, dict):
        return
    named = dict(model.named_parameters())
    group_of = {id(p): g for g in inner.param_groups for p in g["params"]}
    differ = []
    for name, (fmt, _) in policy_map.state_formats(model, default).items():
        group = group_of.get(id(named[name]))
        kept = inner.format_of(named[name], group) if group is not None else None
        if kept is not None and kept.kind != fmt.kind:
            differ.append(f"{name} keeps {kept.kind} where the map says {fmt.kind}")
    if differ:
        raise ValueError(
            f"the {type(inner).__name__} given is taken as it is, but the policy map's "
            f"state rules say otherwise: {'; '.join(differ)}. Give a torch AdamW, Adam or "
            "SGD to have it converted per the map, or build the low-bit optimizer with "
            "mixprec.optim.states.from_model(model, rules=...) (its rules match parameter "
            "names)"
        )


class KeptFloat32:
    """The ``keep_float32`` of a converted optimizer: True for the parameters the map keeps
    in float32 and for the float32 masters of those (through ``wrappers``, read at each
    call). It holds the tensors, not their ids alone, so that a copy of the optimizer
    (``copy.deepcopy``) asks about its own copies of them."""

    def __init__(self, kept: list[torch.Tensor], wrappers: Collection[LossScaleOptimizer]):
        self.kept = kept
        self.wrappers = wrappers
        self._ids = {id(t) for t in kept}

    def __call__(self, p: torch.Tensor) -> bool:
        ids = self._ids
        return id(p) in ids or any(id(w.model_param(p)) in ids for w in self.wrappers)

    def __getstate__(self) -> dict[str, Any]:
        return {"kept": self.kept, "wrappers": self.wrappers}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(state["kept"], state["wrappers"])  # type: ignore[misc]


def _stale_step(old: torch.optim.Optimizer, *args: Any, **kwargs: Any) -> Any:
    """The step of a torch optimizer handed over (`hand_over`): refused."""
    new = old._converted_into  # type: ignore[attr-defined]
    raise RuntimeError(
        f"this {type(old).__name__} was converted into {type(new).__name__} "
        f"(states {new.defaults['states']!r}) by Precision.setup: its own step would train "
        f"float32 moments that the run does not use. Step the optimizer setup returned, or "
        f"precision.step()"
    )


# (a scheduler built on the old optimizer leaves its step as it is: the new one's steps
# count for it, `LowBitOptimizer.step`)
_stale_step._wrapped_by_lr_sched = True  # type: ignore[attr-defined]


def _relinked_load(old: torch.optim.Optimizer, state_dict: Any) -> None:
    """A state dict loaded into a torch optimizer handed over goes into the one it stands
    for, which takes its own state dicts and torch's (moments converted into its formats;
    its groups keep their ``"states"``), and whose groups ``old`` goes on holding. One with
    no state at all (saved before any step, or by a version whose torch optimizer saved
    none) gives only its groups' settings: the state the new one holds, restored by whoever
    saved it (a Lightning plugin), stays."""
    new = old._converted_into  # type: ignore[attr-defined]
    if not state_dict.get("state") and new.state:
        type(old).load_state_dict(old, state_dict)  # (torch's checks, into ``old``'s groups)
        for mine, loaded in zip(new.param_groups, old.param_groups, strict=True):
            mine.update(
                {k: loaded[k] for k in mine if k not in ("params", "states") and k in loaded}
            )
    else:
        new.load_state_dict(state_dict)
    old.param_groups = new.param_groups


def _relinked_state_dict(old: torch.optim.Optimizer) -> dict[str, Any]:
    """The state dict of a torch optimizer handed over: the one it stands for's (its own
    state is empty; saving that would lose the moments)."""
    return old._converted_into.state_dict()  # type: ignore[attr-defined]


def _relinked_add(old: torch.optim.Optimizer, param_group: dict[str, Any]) -> None:
    """A group added to a torch optimizer handed over is added to the one it stands for
    (with its ``"states"``; torch's would give it the torch optimizer's defaults only)."""
    new = old._converted_into  # type: ignore[attr-defined]
    new.add_param_group(param_group)
    old.param_groups = new.param_groups


def hand_over(old: torch.optim.Optimizer, new: LowBitOptimizer) -> None:
    """Make the torch optimizer ``old``, converted into ``new``, stand for it where a caller
    still holds it: its parameter groups become ``new``'s (one to one), so a learning-rate
    scheduler built on ``old`` sets ``new``'s learning rates; its state dicts are ``new``'s,
    saved and loaded, and a group added to it is added to ``new``; its own step raises (it
    would train float32 moments that nothing uses); and ``new``'s steps count as ``old``'s
    for torch's check that a scheduler steps after its optimizer. Each is a method bound to
    the optimizer, linked to the other by an attribute, never by a closure: a copy of
    ``new`` steps its own parameters and counts its steps for its copy of ``old``, which,
    as torch copies and pickles optimizers (their defaults, state and groups), is a plain
    torch optimizer again."""
    old._converted_into = new  # type: ignore[attr-defined]
    new.stands_for = old
    old.step = types.MethodType(_stale_step, old)  # type: ignore[method-assign]
    old.load_state_dict = types.MethodType(_relinked_load, old)  # type: ignore[method-assign]
    old.state_dict = types.MethodType(_relinked_state_dict, old)  # type: ignore[method-assign]
    old.add_param_group = types.MethodType(_relinked_add, old)  # type: ignore[method-assign]
    old.param_groups = new.param_groups


def warn_if_foreign(model: nn.Module, optimizers: Collection[Any], stacklevel: int = 3) -> None:
    """Warn about an optimizer (torch's, or one wrapped) holding none of ``model``'s
    parameters, nor masters of them: its steps would never change the model."""
    mine = {id(p) for p in model.parameters()}
    for i, opt in enumerate(optimizers):
        if not any(id(p) in mine for p in trained_params(opt)):
            warnings.warn(
                f"optimizer {i} ({type(opt).__name__}) holds none of the parameters of the "
                f"{type(model).__name__} being trained, so its steps will not change it: build "
                "it from this model's parameters, or give the Trainer a factory "
                "(optimizer=lambda params: torch.optim.SGD(params, lr=0.1))",
                stacklevel=stacklevel,
            )
