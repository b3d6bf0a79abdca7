"""Which layers' optimizer states a low-bit format hurts: a few float32 AdamW steps on a copy
of the model, then each moment stored in the format and read back (`state_errors`).

The measure is the core's `mixprec.states.moment_error`, ``||dequantize(quantize(m)) - m||
/ ||m||``, of each parameter's first moment (signed) and second moment (unsigned) in the
format `mixprec.PolicyMap.state_formats` gives it (small parameters and embedding tables
keep float32 and are not measured). A parameter whose error exceeds ``threshold`` is named;
`StateErrors.states_rules` is the PolicyMap ``states`` rule that keeps those in float32.
"""

from __future__ import annotations

import copy
import re
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from mixprec.doctor.running import loss_of
from mixprec.policy.map import PolicyMap, as_map
from mixprec.precision import Precision
from mixprec.states import moment_error, parse_state_format

__all__ = ["StateError", "StateErrors", "moment_errors", "state_errors"]


@dataclass(frozen=True)
class StateError:
    """One parameter's moments stored in ``format``: their relative errors."""

    param: str
    format: str
    first: float  # the first moment (exp_avg), signed
    second: float  # the second moment (exp_avg_sq), unsigned

    @property
    def worst(self) -> float:
        return max(self.first, self.second)


@dataclass
class StateErrors:
    """Every measured parameter's errors (largest first), and those above ``threshold``."""

    rows: list[StateError]
    threshold: float
    steps: int

    @property
    def hurting(self) -> list[StateError]:
        """The parameters whose moments the format hurts: an error above the threshold."""
        return [r for r in self.rows if r.worst > self.threshold]

    def states_rules(self) -> dict[str, str]:
        """A PolicyMap ``states`` mapping keeping the hurt layers' moments in float32."""
        layers = dict.fromkeys(r.param.rpartition(".")[0] for r in self.hurting)
        return {re.escape(layer): "float32" for layer in layers}

    def __str__(self) -> str:
        lines = [
            f"optimizer-state errors after {self.steps} AdamW step(s) "
            f"(relative error of each moment stored and read back; hurt above "
            f"{self.threshold:.0%}):"
        ]
        width = max((len(r.param) for r in self.rows), default=0)
        for r in self.rows:
            mark = "  HURT" if r.worst > self.threshold else ""
            lines.append(
                f"  {r.param:<{width}}  {r.format:<6}  first {r.first:7.2%}  "
                f"second {r.second:7.2%}{mark}"
            )
        if self.hurting:
            lines.append(f"keep them in float32: PolicyMap(..., states={self.states_rules()!r})")
        else:
            lines.append("no layer's states are hurt by the format")
        return "\n".join(lines)


def moment_errors(
    model: nn.Module,
    batches: Sequence[Any],
    loss_fn: Callable[..., Tensor] | None,
    formats: Sequence[str],
    *,
    steps: int = 3,
    lr: float = 1e-3,
) -> dict[str, dict[str, tuple[float, float]]]:
    """Each trainable parameter's name -> format -> the relative errors of its (first,
    second) moment stored in that format, after ``steps`` float32 AdamW steps of a copy of
    ``model`` on ``batches`` in turn. The model is not touched."""
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
        raise ValueError(f"steps must be an integer >= 1, got {steps!r}")
    if not batches:
        raise ValueError("measuring moment errors needs at least one batch to take steps on")
    parsed = [parse_state_format(f) for f in formats]
    copied = copy.deepcopy(model).float()
    copied.train()
    precision = Precision("32-true")
    optimizer = torch.optim.AdamW(copied.parameters(), lr=lr)
    for i in range(steps):
        optimizer.zero_grad(set_to_none=True)
        loss_of(copied, precision, batches[i % len(batches)], loss_fn).backward()
        optimizer.step()
    out: dict[str, dict[str, tuple[float, float]]] = {}
    for name, p in copied.named_parameters():
        state = optimizer.state.get(p)
        if state:
            out[name] = {
                str(f): (
                    moment_error(state["exp_avg"], f, signed=True),
                    moment_error(state["exp_avg_sq"], f, signed=False),
                )
                for f in parsed
            }
    return out


def state_errors(
    model: nn.Module,
    batches: Iterable[Any],
    loss_fn: Callable[..., Tensor] | None = None,
    states: str | PolicyMap = "int8",
    *,
    steps: int = 3,
    lr: float = 1e-3,
    threshold: float = 0.1,
) -> StateErrors:
    """Train a float32 copy of ``model`` ``steps`` AdamW steps on ``batches`` (in turn, as
    `mixprec.diagnose` takes a batch), then measure how much storing each parameter's
    moments in its state format changes them (see the module's docstring). ``states``: a
    format for every parameter (``"int8"``, ``"int4"``, ``"fp8"``) or a PolicyMap with
    ``states`` rules. The model is not touched."""
    if isinstance(threshold, bool) or not isinstance(threshold, (int, float)) or threshold < 0:
        raise ValueError(f"threshold must be a number >= 0, got {threshold!r}")
    if isinstance(states, PolicyMap):
        pmap, default = states, None
    else:
        pmap, default = as_map("32-true"), str(parse_state_format(states))
    assigned = {
        name: fmt for name, (fmt, _) in pmap.state_formats(model, default).items() if fmt.quantized
    }
    errors = moment_errors(
        model, list(batches), loss_fn, sorted({str(f) for f in assigned.values()}),
        steps=steps, lr=lr,
    )  # fmt: skip
    rows = [
        StateError(name, str(fmt), *errors[name][str(fmt)])
        for name, fmt in assigned.items()
        if name in errors
    ]
    rows.sort(key=lambda r: -r.worst)
    return StateErrors(rows, float(threshold), steps)
