"""The optimizer-state format of each searched layer under ``count="training"``: the
cheapest of the formats offered whose moments, after a few float32 AdamW steps, stored and
read back give an update direction ``m / (sqrt(v) + eps)`` within a relative error of
`THRESHOLD` of the float32 moments' (`mixprec.doctor.moment_errors`, the
doctor's measure); float32 when none does. Embedding tables keep float32 moments, as
`mixprec.PolicyMap.state_formats` gives them."""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from typing import Any

from torch import Tensor, nn

from mixprec.doctor import moment_errors
from mixprec.optim.states import MIN_SIZE, StateFormat, parse_state_format
from mixprec.plan.units import Unit
from mixprec.policy.map import PolicyMap

__all__: list[str] = []

STEPS = 3  # AdamW steps before the moments are measured
THRESHOLD = 0.1  # the largest relative update error a chosen format may give


def _state_params(model: nn.Module, unit: Unit) -> list[str]:
    """Names of the unit's parameters that can take low-bit moments (``min_size`` or more
    elements), as ``named_parameters`` lists them."""
    modules = dict(model.named_modules())
    named = {id(p): n for n, p in model.named_parameters()}
    return [
        named[id(p)]
        for path in unit.paths
        for p in modules[path].parameters(recurse=False)
        if p.numel() >= MIN_SIZE and id(p) in named
    ]


def choose_states(
    model: nn.Module,
    units: Sequence[Unit],
    batches: Sequence[Any],
    loss_fn: Callable[..., Tensor] | None,
    states: Sequence[str],
    *,
    lr: float,
    seed: int,
) -> list[StateFormat | None]:
    """Each unit's state format (None: float32), as the module's docstring says."""
    offered = sorted(
        {parse_state_format(s) for s in states if parse_state_format(s).quantized},
        key=lambda f: (f.bytes(1 << 16), str(f)),
    )
    if not offered:
        return [None for _ in units]
    errors = moment_errors(
        model, batches, loss_fn, [str(f) for f in offered], steps=STEPS, lr=lr, seed=seed
    )
    out: list[StateFormat | None] = []
    for unit in units:
        names = [n for n in _state_params(model, unit) if n in errors]
        if not names or "Embedding" in unit.kinds:
            out.append(None)
            continue
        fits = [f for f in offered if all(errors[n][str(f)].update <= THRESHOLD for n in names)]
        out.append(fits[0] if fits else None)
    return out


def holder_formats(holder: nn.Module, fmt: StateFormat | None) -> dict[int, StateFormat]:
    """The state format of each of a candidate's parameters that takes one (``min_size``
    elements or more), for `units.state_bytes` under a plan with low-bit states: the
    optimizer keeps float32 moments for the others, and all of them when `fmt` is None."""
    if fmt is None:
        return {}
    return {id(t): fmt for t in holder.parameters() if t.numel() >= MIN_SIZE}


def with_states(
    plan: PolicyMap, units: Sequence[Unit], chosen: Sequence[StateFormat | None]
) -> PolicyMap:
    """``plan`` with a ``states`` rule for each unit given a low-bit format."""
    rules = {
        re.escape(path): str(fmt)
        for unit, fmt in zip(units, chosen, strict=True)
        if fmt is not None
        for path in unit.paths + unit.aliases
    }
    if not rules:
        return plan
    return plan.replace(states=rules)
