"""Turning a target run's statistics into verdicts: one source for the verdicts, the
thresholds that raise them (shared with the live `PrecisionMonitor`), and the reasons.

Every module gets `OK`, `AT_RISK` or `BROKEN` and a sentence saying why; a problem is blamed
where it starts (inputs fine, output not), never on the blocks that merely contain it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

import torch
from torch import nn

from mixprec.doctor.probe import Key, Recording, Stats, combine, lowest_float
from mixprec.dtypes import LOW_PRECISION_FLOATS, dtype_name, format_info
from mixprec.policy_map import PolicyMap


class Verdict(str, Enum):
    """How a module fares in the target precision, in order of severity."""

    BROKEN = "broken"
    AT_RISK = "at risk"
    OK = "ok"

    def __str__(self) -> str:
        return self.value

    @property
    def severity(self) -> int:
        """0 for the worst verdict: sorts findings worst first."""
        return list(Verdict).index(self)


OK, AT_RISK, BROKEN = Verdict.OK, Verdict.AT_RISK, Verdict.BROKEN

# When a finding is raised. Chosen so that healthy float16/bfloat16 runs of common layers
# (linear, conv, norms, attention, activations) raise none; see tests/test_doctor*.py.
HEADROOM = 4.0  # "at risk" when a layer's amax comes within this factor of the dtype's max
UNDERFLOW_AT_RISK = 0.5  # fraction of nonzero outputs below the smallest normal
GRAD_UNDERFLOW_AT_RISK = 0.1  # fraction of nonzero parameter gradients that underflow
GRAD_FLUSH_AT_RISK = 0.05  # ... that become exactly zero
GRAD_FLUSH_BROKEN = 0.5  # ... beyond this, the layer effectively stops learning
ERROR_AT_RISK = 0.1  # a layer's relative error above this (SQNR below 20 dB) ...
ERROR_GROWTH = 10.0  # ... and this many times the error already in its inputs
ERROR_BROKEN = 0.5  # a layer this wrong (SQNR 6 dB or less), quantized or not, has lost its signal
LOSS_SCALE_MARGIN = 8.0  # recommended scale keeps scaled gradients this far below the max
MAX_LOSS_SCALE = 2.0**24
DEFAULT_LOSS_SCALE = 2.0**16  # where a DynamicLossScaler starts
DEFAULT_TOLERANCE = 0.1  # relative loss/gradient error a recommended policy must reach
# ... under a quantized policy: float8's e5m2 gradients keep 2 mantissa bits, so a healthy
# float8 model's gradient is already 0.1-0.2 off the float one
QUANTIZED_TOLERANCE = 0.3
VANISH_AT_RISK = 0.25  # fraction of a layer's parameter updates that round away in storage
VANISH_BROKEN = 0.9  # ... beyond this, the layer effectively stops learning
UPDATE_RULES = ("adam", "sgd")


@dataclass(frozen=True)
class UpdateModel:
    """How big one optimizer step is, for the vanishing-update check: Adam-type steps move
    each weight by about `lr` (the update is normalised), SGD steps by `lr` x gradient."""

    lr: float
    rule: str = "adam"

    def __post_init__(self) -> None:
        if not (isinstance(self.lr, (int, float)) and math.isfinite(self.lr) and self.lr > 0):
            raise ValueError(f"lr must be a positive finite number, got {self.lr!r}")
        if self.rule not in UPDATE_RULES:
            raise ValueError(
                f"optimizer must be one of {', '.join(UPDATE_RULES)} (how the update is "
                f"sized), got {self.rule!r}"
            )

    def delta(self, grad: torch.Tensor) -> torch.Tensor:
        """The step a parameter with gradient `grad` takes (float32)."""
        return -self.lr * (torch.sign(grad) if self.rule == "adam" else grad)

    def describe(self) -> str:
        return f"lr {self.lr:g} ({self.rule} steps)"


def vanishing_fraction(weight: torch.Tensor, delta: torch.Tensor, dtype: torch.dtype) -> float:
    """Fraction of the nonzero steps `delta` that leave `weight`, stored in `dtype`, exactly
    unchanged: the update is below half a unit in the last place and rounds away."""
    stored = weight.detach().to(dtype)
    moving = delta != 0
    total = int(moving.sum())
    if not total:
        return 0.0
    lost = ((stored.float() + delta).to(dtype) == stored) & moving
    return int(lost.sum()) / total


def _fmt(x: float) -> str:
    """A magnitude for a sentence: 3 significant digits, or "7.1e4" style when large/small."""
    if math.isnan(x):
        return "nan"
    if math.isinf(x):
        return "inf" if x > 0 else "-inf"
    if x == 0 or 1e-3 <= abs(x) < 1e4:
        return f"{x:.3g}"
    mantissa, exponent = f"{x:.1e}".split("e")
    return f"{mantissa}e{int(exponent)}"


def scale_text(x: float) -> str:
    """A loss scale for a sentence: "65536", "0.5"."""
    return f"{int(x)}" if x >= 1 and x == int(x) else f"{x:g}"


@dataclass
class ModuleReport:
    """Statistics and verdict of one module (all its calls together).

    Ranges (`amax`, `amin`) are the reference run's, so they show what the target had to
    hold; `overflow`/`underflow` are fractions of the reference values beyond the target
    dtype's max / below its smallest normal (`underflow` of the nonzero ones); `flushed` is
    the fraction of nonzero reference values that underflow and are exactly zero in the
    target; `nonfinite` counts inf/NaN in the target; `rel_error` and `sqnr_db` compare the
    target output with the reference output. `grad_nonfinite`/`input_grad_nonfinite` count
    inf/NaN in the target's gradients of its output/inputs (at the run's loss scale);
    `param_*` describe the module's own parameters' gradients.
    """

    name: str
    type: str
    order: int
    dtype: str
    calls: int
    numel: int
    amax: float
    amin: float
    overflow: float
    underflow: float
    flushed: float
    nonfinite: int
    rel_error: float
    sqnr_db: float
    input_amax: float
    input_nonfinite: int
    input_rel_error: float
    input_underflow: float = 0.0
    input_dtype: str = "float32"
    grad_nonfinite: int = 0
    input_grad_nonfinite: int = 0
    param_grad_amax: float = math.nan
    param_grad_underflow: float = 0.0
    param_grad_flushed: float = 0.0
    param_grad_nonfinite: int = 0
    vanishing: float = 0.0  # share of its parameter updates that round away (with an lr)
    verdict: Verdict = OK
    reason: str = ""
    # "range" (fixable by a wider range), "precision" (needs float32), "quantization" (a
    # quantized layer: its source float policy fixes it), "scale" (the loss scale causes it)
    # or "loss" (the root's: the loss overflows outside every module)
    kind: str = ""
    quantized: str = ""  # the quantized policy a quantized layer runs in
    origin: bool = False
    note: str = ""

    @property
    def display_name(self) -> str:
        return self.name or "<root>"


@dataclass
class ParamReport:
    """Gradient statistics of one parameter at the run's loss scale.

    `underflow`: fraction of its nonzero reference gradient values whose scaled magnitude is
    below the smallest normal of the dtype the gradient is computed in; `flushed`: fraction
    that underflow and are exactly zero in the target; `overflow`: fraction whose scaled
    magnitude is above that dtype's max.
    """

    name: str
    module: str
    dtype: str
    numel: int
    nonzero: int
    grad_amax: float
    underflow: float
    flushed: float
    overflow: float
    nonfinite: int
    rel_error: float


def _frac(count: float, total: float) -> float:
    return count / total if total else 0.0


def _is_inside(child: str, parent: str) -> bool:
    return (parent == "" and child != "") or child.startswith(parent + ".")


def loss_scale_for(grad_amax: float, dtype: torch.dtype) -> float:
    """Largest power of two keeping `grad_amax` x scale below `dtype`'s max by the margin."""
    if grad_amax == 0:
        return MAX_LOSS_SCALE
    if not math.isfinite(grad_amax):
        return 1.0
    k = math.floor(math.log2(format_info(dtype).max / (LOSS_SCALE_MARGIN * grad_amax)))
    return float(min(max(2.0**k, 1.0), MAX_LOSS_SCALE))


def largest_loss_scale(amax: float, dtype: torch.dtype) -> float:
    """Largest power of two keeping `amax` x scale within `dtype`'s max (no margin); below 1
    when even `amax` itself does not fit."""
    k = math.floor(math.log2(format_info(dtype).max / amax))
    return 2.0 ** min(k, int(math.log2(MAX_LOSS_SCALE)))


def range_dtype(policy: PolicyMap) -> torch.dtype:
    """The narrowest dtype any layer of `policy` computes or stores in."""
    return lowest_float([d for p in policy.policies() for d in (p.compute_dtype, p.param_dtype)])


def param_reports(target: Recording, params: dict[str, Stats]) -> dict[str, ParamReport]:
    """One report per parameter gradient of the target run."""
    reports = {}
    for name, r in params.items():
        limit = dtype_name(target.param_limits[name])
        reports[name] = ParamReport(
            name=name,
            module=name.rpartition(".")[0],
            dtype=limit,
            numel=int(r.numel),
            nonzero=int(r.nonzero),
            grad_amax=r.amax,
            underflow=_frac(r.underflow, r.nonzero),
            flushed=_frac(r.flushed, r.nonzero),
            overflow=_frac(r.overflow, r.numel),
            nonfinite=int(r.nonfinite),
            rel_error=r.rel_error,
        )
    return reports


@dataclass
class Origins:
    """Where inf/NaN first appear in a target run.

    `forward`: modules with finite inputs and a non-finite output; `backward`: modules whose
    own backward turns a finite output gradient into non-finite input or parameter
    gradients; `arrival`: the module whose output gradient is the first non-finite gradient
    of the backward although no module's backward made it (it overflowed outside them, e.g.
    where the loss's float32 gradient is cast to a float16 output's), with the reference's
    largest magnitude of that gradient.
    """

    forward: set[str] = field(default_factory=set)
    backward: set[str] = field(default_factory=set)
    arrival: dict[str, float] = field(default_factory=dict)


def module_reports(
    target: Recording,
    values: dict[Key, Stats],
    params: dict[str, ParamReport],
) -> tuple[dict[str, ModuleReport], Origins]:
    """Per-module statistics and where inf/NaN first appear (judged call by call). A run
    whose loss or gradients are not finite always has a report for the root (""), called or
    not, where a problem no module explains is reported."""
    calls_of: dict[str, list[Any]] = {}
    for call in target.calls:
        calls_of.setdefault(call.name, []).append(call)
    reports: dict[str, ModuleReport] = {}
    origins = Origins()

    def rows(keys: list[Key]) -> Stats | None:
        return combine([values[k] for k in dict.fromkeys(keys) if k in values])

    def bad_grads(keys: list[Key]) -> int:
        return sum(target.slots[k].grad_nonfinite for k in dict.fromkeys(keys))

    for order, (name, calls) in enumerate(calls_of.items()):
        out_keys = [k for c in calls for k in c.outputs]
        in_keys = [k for c in calls for k in c.inputs]
        out, inp = rows(out_keys), rows(in_keys)
        if not out:
            continue
        own = [params[p] for p in target.params_of.get(name, []) if p in params]
        nonzero = sum(p.nonzero for p in own)
        for c in calls:
            c_out, c_in = rows(c.outputs), rows(c.inputs)
            if c_out and c_out.nonfinite > 0 and not (c_in and c_in.nonfinite):
                origins.forward.add(name)
            if not bad_grads(c.outputs) and (bad_grads(c.inputs) or any(p.nonfinite for p in own)):
                origins.backward.add(name)
        reports[name] = ModuleReport(
            name=name,
            type=target.types.get(name, ""),
            order=order,
            dtype=dtype_name(lowest_float([target.slots[k].dtype for k in out_keys])),
            calls=len(calls),
            numel=int(out.numel),
            amax=out.amax,
            amin=out.amin,
            overflow=_frac(out.overflow, out.numel),
            underflow=_frac(out.underflow, out.nonzero),
            flushed=_frac(out.flushed, out.nonzero),
            nonfinite=int(out.nonfinite),
            rel_error=out.rel_error,
            sqnr_db=out.sqnr_db,
            input_amax=inp.amax if inp else 0.0,
            input_nonfinite=int(inp.nonfinite) if inp else 0,
            input_rel_error=inp.rel_error if inp else 0.0,
            input_underflow=_frac(inp.underflow, inp.nonzero) if inp else 0.0,
            input_dtype=dtype_name(lowest_float([target.slots[k].dtype for k in in_keys])),
            grad_nonfinite=bad_grads(out_keys),
            input_grad_nonfinite=bad_grads(in_keys),
            param_grad_amax=max((p.grad_amax for p in own), default=math.nan),
            param_grad_underflow=sum(p.underflow * p.nonzero for p in own) / nonzero
            if nonzero
            else 0.0,
            param_grad_flushed=sum(p.flushed * p.nonzero for p in own) / nonzero
            if nonzero
            else 0.0,
            param_grad_nonfinite=sum(p.nonfinite for p in own),
        )
    # The backward's first non-finite gradient (hooks fire in dependency order), when it is
    # no module's input gradient made from finite outputs: it arrived at a module's output.
    bad = [slot for slot in target.slots.values() if slot.grad_nonfinite]
    first = min(bad, key=lambda slot: slot.grad_order, default=None)
    if first is not None and not any(
        first.key in c.inputs and not bad_grads(c.outputs) for c in target.calls
    ):
        twin = first.twin.grad_amax if first.twin is not None else None
        peak = float(twin) if twin is not None else math.nan
        for c in target.calls:
            if first.key in c.outputs and c.name in reports:
                origins.arrival[c.name] = peak
    finite = math.isfinite(target.loss) and not any(p.nonfinite for p in params.values())
    if not finite and "" not in reports:
        reports[""] = ModuleReport(
            name="",
            type=target.types.get("", ""),
            order=len(reports),
            dtype=dtype_name(lowest_float(list(target.param_limits.values()))),
            calls=0,
            numel=0,
            amax=math.nan,
            amin=math.nan,
            overflow=0.0,
            underflow=0.0,
            flushed=0.0,
            nonfinite=0,
            rel_error=math.nan,
            sqnr_db=math.nan,
            input_amax=math.nan,
            input_nonfinite=0,
            input_rel_error=math.nan,
        )
    return reports, origins


def judge(
    modules: dict[str, ModuleReport],
    origins: Origins,
    loss_scale: float,
    recommended_scale: float,
    range_dtype: torch.dtype,
    update: UpdateModel | None = None,
    *,
    loss_finite: bool = True,
    grads_finite: bool = True,
    loss_dtype: torch.dtype = torch.float32,
) -> None:
    """Give every module a verdict and a reason, blaming only where a problem starts; a run
    whose loss or gradients are not finite with no module to blame is the root's finding.

    A problem the loss scale causes (a backward overflow above `recommended_scale`, gradients
    flushed to zero below it) has kind "scale": a loss scale fixes it, not a layer's dtype;
    a loss that overflows outside every module has kind "loss": no layer's dtype fixes it.
    """
    scale_txt = f"loss scale {scale_text(loss_scale)}"
    limit = format_info(range_dtype)
    forward_broken = not loss_finite or any(m.nonfinite for m in modules.values())
    too_high = "scale" if loss_scale > recommended_scale else "range"
    scaled = range_dtype == torch.float16
    too_low = "scale" if scaled and recommended_scale > loss_scale else "range"
    for m in modules.values():
        info = format_info(m.dtype) if m.dtype in _LOW else limit
        low = m.dtype in _LOW
        # a range problem already present in low-precision inputs belongs upstream
        inherited = m.input_dtype in _LOW
        if m.name in origins.forward:
            m.verdict, m.kind = BROKEN, "range"
            if m.amax > info.max:
                m.reason = (
                    f"output reaches {_fmt(m.amax)} > {info.name} max {info.max:g} "
                    f"({m.nonfinite} values become inf/NaN)"
                )
            elif m.input_amax > format_info(range_dtype).max:
                limit = format_info(range_dtype)
                m.reason = (
                    f"its input reaches {_fmt(m.input_amax)} > {limit.name} max {limit.max:g} "
                    f"and overflows when cast to {limit.name} here"
                )
            else:
                m.reason = (
                    f"{m.nonfinite} of {m.numel} outputs are inf/NaN although its inputs are "
                    f"finite: a value inside it overflows {format_info(range_dtype).name} "
                    f"(output is at most {_fmt(m.amax)} in the reference)"
                )
        elif not forward_broken and m.name in origins.backward:
            m.verdict, m.kind = BROKEN, too_high
            m.reason = (
                f"its backward produces inf/NaN gradients at {scale_txt} "
                f"({limit.name} max {limit.max:g})" + _fits_hint(loss_scale, recommended_scale)
            )
        elif not forward_broken and m.name in origins.arrival:
            m.verdict, m.kind = BROKEN, too_high
            m.reason = (
                f"its output gradient is already inf/NaN as it arrives, at {scale_txt}: "
                + _overflow_outside(
                    origins.arrival[m.name], info, loss_dtype, loss_scale, recommended_scale
                )
            )
        elif m.param_grad_flushed >= GRAD_FLUSH_BROKEN:
            m.verdict, m.kind = BROKEN, too_low
            m.reason = (
                f"{m.param_grad_flushed:.0%} of its parameter gradients flush to zero in "
                f"{format_info(range_dtype).name} at {scale_txt} (largest "
                f"{_fmt(m.param_grad_amax)}); it stops learning"
                + _scale_hint(m.param_grad_amax, loss_scale, recommended_scale, range_dtype)
            )
        elif (
            low
            and m.amax > info.max / HEADROOM
            and not (inherited and m.input_amax > info.max / HEADROOM)
        ):
            m.verdict, m.kind = AT_RISK, "range"
            m.reason = (
                f"output reaches {_fmt(m.amax)}, within {HEADROOM:g}x of {info.name} max "
                f"{info.max:g}"
            )
        elif (
            low
            and m.underflow >= UNDERFLOW_AT_RISK
            and not (inherited and m.input_underflow >= UNDERFLOW_AT_RISK)
        ):
            m.verdict, m.kind = AT_RISK, "range"
            m.reason = (
                f"{m.underflow:.0%} of its nonzero outputs fall below {info.name}'s smallest "
                f"normal {info.smallest_normal:.2g} (smallest {_fmt(m.amin)})"
            )
        elif (
            m.param_grad_underflow >= GRAD_UNDERFLOW_AT_RISK
            or m.param_grad_flushed >= GRAD_FLUSH_AT_RISK
        ):
            m.verdict, m.kind = AT_RISK, too_low
            m.reason = (
                f"{max(m.param_grad_underflow, m.param_grad_flushed):.0%} of its parameter "
                f"gradients underflow {format_info(range_dtype).name} at {scale_txt}"
                + _scale_hint(m.param_grad_amax, loss_scale, recommended_scale, range_dtype)
            )
        elif (
            math.isfinite(m.rel_error)
            and m.rel_error > ERROR_AT_RISK
            and m.rel_error > ERROR_GROWTH * m.input_rel_error
        ):
            growth = (
                f"its error against the reference grows to {m.rel_error:.2g} here "
                f"(inputs {m.input_rel_error:.2g}; SQNR {m.sqnr_db:.1f} dB)"
            )
            m.verdict = BROKEN if m.rel_error >= ERROR_BROKEN else AT_RISK
            if m.quantized:
                m.kind = "quantization"
                m.reason = (
                    f"quantized ({m.quantized}): {growth}; a few large values set the "
                    "quantization scale, the rest lose their precision"
                )
            else:
                m.kind = "precision"
                m.reason = growth + (": it carries little signal" if m.verdict == BROKEN else "")
    if update is not None:
        _judge_vanishing(modules, update)
    # Blame the innermost module: a block whose child explains the problem is not flagged.
    flagged = [m for m in modules.values() if m.verdict != OK]
    for m in flagged:
        inner = [c for c in flagged if c is not m and _is_inside(c.name, m.name)]
        if inner:
            m.verdict, m.kind, m.reason = OK, "", ""
            m.note = f"contains {inner[0].display_name} ({inner[0].verdict})"
    blamed = any(m.verdict == BROKEN for m in modules.values())
    if not (loss_finite and grads_finite) and not blamed:
        root = modules[""]
        root.verdict, root.kind = BROKEN, "loss" if forward_broken else too_high
        root.reason = (
            f"the loss is inf/NaN although every module's output is finite: it overflows "
            f"{limit.name} outside the modules (in the loss function, which runs in the "
            "precision's autocast region too); compute the loss from float32 outputs"
            if forward_broken
            else f"gradients hold inf/NaN at {scale_txt} but no module's backward or output "
            "gradient is where they start: "
            + _overflow_outside(math.nan, limit, loss_dtype, loss_scale, recommended_scale)
        )
    for m in modules.values():
        m.origin = m.verdict == BROKEN
        if m.verdict == OK and not m.note and (m.nonfinite or m.grad_nonfinite):
            m.note = "inf/NaN arrive from elsewhere"


def vanishing_by_module(
    model: nn.Module, policy: PolicyMap, grads: dict[str, torch.Tensor], update: UpdateModel
) -> dict[str, float]:
    """Per module, the share of its own parameters' updates that round away in the dtype the
    policy stores them in (16-bit only; float32 and float64 weights lose none), with the
    reference run's gradients sizing the steps."""
    resolved = policy.resolve(model)
    lost: dict[str, float] = {}
    sizes: dict[str, int] = {}
    for name, param in model.named_parameters():
        module = name.rpartition(".")[0]
        dtype = resolved[module].policy.param_dtype
        grad = grads.get(name)
        if grad is None or format_info(dtype).bits > 16:
            continue
        delta = update.delta(grad.to(param.device))
        n = int((delta != 0).sum())
        lost[module] = lost.get(module, 0.0) + vanishing_fraction(param, delta, dtype) * n
        sizes[module] = sizes.get(module, 0) + n
    return {m: lost[m] / sizes[m] for m in lost if sizes[m]}


def _judge_vanishing(modules: dict[str, ModuleReport], update: UpdateModel) -> None:
    """Flag the modules, otherwise fine, whose 16-bit weights lose most of their updates."""
    for m in modules.values():
        if m.verdict != OK or m.vanishing < VANISH_AT_RISK:
            continue
        broken = m.vanishing >= VANISH_BROKEN
        m.verdict, m.kind = (BROKEN if broken else AT_RISK), "precision"
        m.reason = (
            f"{m.vanishing:.0%} of its parameter updates round away in its 16-bit weights at "
            f"{update.describe()}{': it stops learning' if broken else ''}; keep them with "
            "Precision(..., compensation='kahan') or master_weights=True, or give it a "
            "float32 rule"
        )


def _fits_hint(scale: float, recommended: float) -> str:
    """Where a smaller loss scale fixes a backward overflow, which."""
    if not scale > recommended:
        return ""
    return f"; a loss scale of at most {scale_text(recommended)} fits"


def _overflow_outside(
    peak: float, info: Any, loss_dtype: torch.dtype, scale: float, recommended: float
) -> str:
    """Why a gradient overflows outside any module's backward: a 16-bit loss, whose gradient
    is the loss scale itself, or a float32 gradient cast to a 16-bit output (with `peak`, its
    largest magnitude in the reference, when known); and the loss scales that fit."""
    loss = format_info(loss_dtype)
    if scale > loss.max:
        fits = scale_text(largest_loss_scale(1.0, loss_dtype))
        return (
            f"the loss is {loss.name}, and its gradient, the loss scale itself, is beyond "
            f"{loss.name} max {loss.max:g}; loss scale {fits} fits, or compute the loss in "
            "float32"
        )
    reason = (
        f"it overflows {info.name} outside any module's backward, where a float32 gradient "
        f"(e.g. the loss's) is cast to {info.name}"
    )
    if math.isfinite(peak) and peak * scale > info.max:
        largest = largest_loss_scale(peak, info.dtype)
        reason += (
            f" (largest in the reference {_fmt(peak)}, x {scale_text(scale)} = "
            f"{_fmt(peak * scale)} > {info.name} max {info.max:g}); "
            + (
                f"loss scale {scale_text(largest)} is the largest that keeps it finite"
                if largest >= 1
                else "it overflows even unscaled"
            )
        )
        if scale > recommended and largest >= 1:
            reason += (
                f", {scale_text(recommended)} leaves every gradient {LOSS_SCALE_MARGIN:g}x headroom"
            )
        return reason
    return reason + _fits_hint(scale, recommended)


def _scale_hint(grad_amax: float, scale: float, recommended: float, dtype: torch.dtype) -> str:
    if dtype != torch.float16 or not recommended > scale:
        return ""
    return f"; loss scale {scale_text(recommended)} keeps them"


_LOW = {dtype_name(d) for d in LOW_PRECISION_FLOATS}
