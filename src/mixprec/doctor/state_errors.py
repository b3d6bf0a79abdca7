"""Which layers' optimizer states a low-bit format hurts: a few float32 AdamW steps on a copy
of the model, then each moment stored in the format and read back (`state_errors`).

The measure is what the update sees: the relative error of the Adam update direction ``m /
(sqrt(v) + eps)`` computed from the moments read back, against the float32 moments'
(`update_error`), for each parameter in the format `mixprec.PolicyMap.state_formats` gives it
(small parameters and embedding tables keep float32 and are not measured). Each moment's own
relative error (`mixprec.optim.states.moment_error`) is reported beside it, but cannot be the
measure: a second moment thousands of times below its block's largest weighs nothing in
``||v||``, yet read back as 0 it turns its element's update into ``m / eps``. A parameter
whose update error exceeds ``threshold`` is named; `StateErrors.states_rules` is the
PolicyMap ``states`` rule that keeps those in float32.
"""

from __future__ import annotations

import copy
import re
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from mixprec.optim.states import StateFormat, dequantize, moment_error, parse_state_format, quantize
from mixprec.policy.map import PolicyMap, as_map
from mixprec.precision import Precision
from mixprec.step import batch_loss, fresh, seeded

__all__ = ["StateError", "StateErrors", "moment_errors", "state_errors", "update_error"]


@dataclass(frozen=True)
class StateError:
    """One parameter's moments stored in ``format`` and read back: the relative errors of
    each moment and of the update direction they give, and the positive second moments
    read back as 0."""

    param: str
    format: str
    first: float  # the first moment (exp_avg), signed
    second: float  # the second moment (exp_avg_sq), unsigned
    update: float  # the update direction m / (sqrt(v) + eps): the measure
    zeroed: int  # positive second moments read back as 0 (their update: m / eps)


@dataclass
class StateErrors:
    """Every measured parameter's errors (largest first), and those above ``threshold``."""

    rows: list[StateError]
    threshold: float
    steps: int

    @property
    def hurting(self) -> list[StateError]:
        """The parameters whose moments the format hurts: an update error above the
        threshold."""
        return [r for r in self.rows if r.update > self.threshold]

    def states_rules(self) -> dict[str, str]:
        """A PolicyMap ``states`` mapping keeping the hurt layers' moments in float32."""
        layers = dict.fromkeys(r.param.rpartition(".")[0] for r in self.hurting)
        return {re.escape(layer): "float32" for layer in layers}

    def __str__(self) -> str:
        lines = [
            f"optimizer-state errors after {self.steps} AdamW step(s) "
            f"(relative error of each moment stored and read back, and of the update "
            f"m / (sqrt(v) + eps) they give; hurt above {self.threshold:.0%} of the update):"
        ]
        width = max((len(r.param) for r in self.rows), default=0)
        for r in self.rows:
            zeroed = f"  {r.zeroed} positive v read back as 0" if r.zeroed else ""
            mark = "  HURT" if r.update > self.threshold else ""
            lines.append(
                f"  {r.param:<{width}}  {r.format:<6}  first {r.first:7.2%}  "
                f"second {r.second:7.2%}  update {r.update:7.2%}{zeroed}{mark}"
            )
        if self.hurting:
            lines.append(f"keep them in float32: PolicyMap(..., states={self.states_rules()!r})")
        else:
            lines.append("no layer's states are hurt by the format")
        return "\n".join(lines)


def update_error(
    first: Tensor,
    second: Tensor,
    first_read: Tensor,
    second_read: Tensor,
    *,
    eps: float = 1e-8,
    bias_correction2: float = 1.0,
) -> float:
    """Relative error ``||u_read - u|| / ||u||`` of the Adam update direction ``u = m /
    (sqrt(v / bias_correction2) + eps)`` given by the moments read back (``first_read``,
    ``second_read``) against the float32 moments' (``first``, ``second``);
    ``bias_correction2`` is ``1 - beta2^step``. 0 when both updates are 0, infinite when
    only the float32 one is."""
    if eps <= 0 or not 0 < bias_correction2 <= 1:
        raise ValueError(
            f"update_error takes eps > 0 and 0 < bias_correction2 <= 1, got eps={eps!r}, "
            f"bias_correction2={bias_correction2!r}"
        )

    def direction(m: Tensor, v: Tensor) -> Tensor:
        m, v = m.detach().to(torch.float32), v.detach().to(torch.float32)
        return m / ((v / bias_correction2).sqrt() + eps)

    exact = direction(first, second)
    error = torch.linalg.vector_norm(direction(first_read, second_read) - exact)
    norm = torch.linalg.vector_norm(exact)
    if norm == 0:
        return 0.0 if error == 0 else float("inf")
    return float(error / norm)


def _read_back(x: Tensor, fmt: StateFormat, signed: bool) -> Tensor:
    """``x`` stored in ``fmt`` and read back (float32 ``x`` as it is)."""
    if not fmt.quantized:
        return x
    return dequantize(*quantize(x, fmt, signed=signed), fmt, x.shape, signed=signed)


def _as_real(x: Tensor) -> Tensor:
    """A moment detached in float32; a complex one as its real and imaginary parts (a last
    dimension of 2, as AdamW steps it): ``float()`` would drop the imaginary half."""
    x = x.detach()
    if x.is_complex():
        x = torch.view_as_real(x.resolve_conj())
    return x.float()


def _stored_error(
    name: str, state: dict[str, Any], fmt: StateFormat, eps: float, beta2: float
) -> StateError:
    """The errors of the AdamW ``state`` of the parameter ``name`` stored in ``fmt``."""
    m, v = _as_real(state["exp_avg"]), _as_real(state["exp_avg_sq"])
    m_read, v_read = _read_back(m, fmt, True), _read_back(v, fmt, False)
    correction = 1 - beta2 ** float(state["step"])
    return StateError(
        name,
        str(fmt),
        moment_error(m, fmt, signed=True),
        moment_error(v, fmt, signed=False),
        update_error(m, v, m_read, v_read, eps=eps, bias_correction2=correction),
        int(((v > 0) & (v_read == 0)).sum()),
    )


def moment_errors(
    model: nn.Module,
    batches: Sequence[Any],
    loss_fn: Callable[..., Tensor] | None,
    formats: Sequence[str],
    *,
    steps: int = 3,
    lr: float = 1e-3,
    seed: int = 0,
) -> dict[str, dict[str, StateError]]:
    """Each trainable parameter's name -> format -> its `StateError` in that format (the
    relative errors of its moments and of the update they give, stored in that format),
    after ``steps`` float32 AdamW steps of a copy of ``model`` on ``batches`` in turn, its
    dropout off and the random generator seeded with ``seed`` (the same errors whatever
    the caller's generator, whose state is put back). The model is not touched."""
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
        raise ValueError(f"steps must be an integer >= 1, got {steps!r}")
    if not batches:
        raise ValueError("measuring moment errors needs at least one batch to take steps on")
    parsed = [parse_state_format(f) for f in formats]
    copied = copy.deepcopy(model).float()
    copied.train()
    for module in copied.modules():
        if isinstance(module, nn.modules.dropout._DropoutNd):
            module.eval()
    precision = Precision("32-true")
    optimizer = torch.optim.AdamW(copied.parameters(), lr=lr)
    first = next(copied.parameters(), None)
    with seeded(seed, torch.device("cpu") if first is None else first.device):
        for i in range(steps):
            optimizer.zero_grad(set_to_none=True)
            batch_loss(precision, copied, fresh(batches[i % len(batches)]), loss_fn).backward()
            optimizer.step()
    group = optimizer.param_groups[0]
    eps, beta2 = group["eps"], group["betas"][1]
    out: dict[str, dict[str, StateError]] = {}
    for name, p in copied.named_parameters():
        state = optimizer.state.get(p)
        if state:
            out[name] = {str(f): _stored_error(name, state, f, eps, beta2) for f in parsed}
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
    seed: int = 0,
) -> StateErrors:
    """Train a float32 copy of ``model`` ``steps`` AdamW steps on ``batches`` (in turn, as
    `mixprec.diagnose` takes a batch), then measure how much storing each parameter's
    moments in its state format changes the update they give (see the module's docstring).
    ``states``: a format for every parameter (``"int8"``, ``"int4"``, ``"fp8"``) or a
    PolicyMap with ``states`` rules; ``seed``: the generator's seed for the steps (dropout
    is off). The model is not touched."""
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
        steps=steps, lr=lr, seed=seed,
    )  # fmt: skip
    rows = [errors[name][str(fmt)] for name, fmt in assigned.items() if name in errors]
    rows.sort(key=lambda r: -r.update)
    return StateErrors(rows, float(threshold), steps)
