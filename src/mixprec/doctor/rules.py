"""The rules that judge a target run, and `judge`, which applies them in order.

Each module rule looks at one module's report and the facts of the run (`RunFacts`) and
returns a `Finding` (verdict, kind, reason) or None. A module gets the finding of the first
rule in `MODULE_RULES` that has one, so it is judged by the problem closest to its cause:

1. inf/NaN made here: in the forward (`forward_overflow`); in the backward
   (`backward_overflow`) or as it arrives at the output gradient (`gradient_arrives_nonfinite`),
   these two only when every forward value is finite (after a forward inf/NaN the gradients'
   follow from it, and the forward's origin is the one to fix);
2. gradients lost: most parameter gradients flush to zero (`gradients_flush`);
3. range at risk: outputs near the max (`output_near_max`) or below the smallest normal
   (`outputs_underflow`), parameter gradients underflowing (`gradients_underflow`);
4. precision: the error against the reference grows here (`error_grows`);
5. updates that round away in 16-bit weights (`updates_vanish`, with an optimizer's lr).

Then, over the whole run: `blame_innermost` clears the blocks whose child is flagged, so a
problem is blamed where it starts, never on the blocks that merely contain it;
`loss_outside_modules` gives the root a finding when the loss or the gradients are not finite
and no module is broken, `loss_underflows` when a finite 16-bit loss underflows; `mark_origins`
marks the broken modules and notes where inf/NaN only pass through.

The thresholds live in `mixprec.doctor.verdicts` (the live `PrecisionMonitor` shares two):
they are set so that healthy float16/bfloat16 runs of common layers (linear, conv, norms,
attention, activations) raise no finding, which tests/test_doctor*.py check along with the
broken cases.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

from mixprec.doctor.verdicts import (
    AT_RISK,
    BROKEN,
    DOWNSTREAM,
    ERROR_AT_RISK,
    ERROR_BROKEN,
    ERROR_GROWTH,
    GRAD_FLUSH_AT_RISK,
    GRAD_FLUSH_BROKEN,
    GRAD_UNDERFLOW_AT_RISK,
    HEADROOM,
    LOSS_SCALE_MARGIN,
    OK,
    UNDERFLOW_AT_RISK,
    UPSTREAM,
    VANISH_AT_RISK,
    VANISH_BROKEN,
    FindingKind,
    ModuleReport,
    Origins,
    UpdateModel,
    Verdict,
    largest_loss_scale,
    scale_text,
)
from mixprec.dtypes import LOW_PRECISION_FLOATS, FormatInfo, dtype_name, format_info

__all__: list[str] = []


@dataclass(frozen=True)
class Finding:
    """What a rule found in a module: its verdict, what fixes it, and why (a sentence)."""

    verdict: Verdict
    kind: FindingKind
    reason: str


@dataclass(frozen=True)
class RunFacts:
    """What every rule may consult about the target run besides the module's own report."""

    origins: Origins
    loss_scale: float
    recommended_scale: float
    range_dtype: torch.dtype  # the narrowest dtype the policy computes or stores in
    update: UpdateModel | None  # how big a step is, for `updates_vanish`; None: not judged
    loss_dtype: torch.dtype
    finite: bool  # the loss and every parameter gradient are finite
    forward_broken: bool  # the loss or some module's output is inf/NaN
    loss: float = math.nan  # the target run's loss; nan: not known
    reference_loss: float = math.nan  # the reference run's

    @property
    def limit(self) -> FormatInfo:
        return format_info(self.range_dtype)

    @property
    def scale_txt(self) -> str:
        return f"loss scale {scale_text(self.loss_scale)}"

    @property
    def too_high(self) -> FindingKind:
        """The kind of a gradient overflow: the loss scale's, when it is above the
        recommended one (which fixes it), else the range's."""
        return FindingKind.SCALE if self.loss_scale > self.recommended_scale else FindingKind.RANGE

    @property
    def too_low(self) -> FindingKind:
        """The kind of a gradient underflow: the loss scale's under float16 (the only dtype
        that is scaled) when the recommended scale is higher, else the range's."""
        scaled = self.range_dtype == torch.float16
        raise_it = scaled and self.recommended_scale > self.loss_scale
        return FindingKind.SCALE if raise_it else FindingKind.RANGE

    def info(self, m: ModuleReport) -> FormatInfo:
        """The format a module's output is held in: its own low-precision dtype, else the
        run's narrowest."""
        return format_info(m.dtype) if m.dtype in _LOW else self.limit


Rule = Callable[[ModuleReport, RunFacts], Finding | None]


def _each_call(rule: Rule) -> Rule:
    """`rule` applied to each call of a module called more than once, against that call's
    own inputs (a loop's later calls take the values its earlier calls made, whose error or
    range is its own doing): the worst call's finding, the earliest of equal ones, its
    reason saying which call."""

    @functools.wraps(rule)
    def judged(m: ModuleReport, run: RunFacts) -> Finding | None:
        if not m.per_call:
            return rule(m, run)
        found = [(c, f) for c in m.per_call if (f := rule(c, run)) is not None]
        if not found:
            return None
        c, f = min(found, key=lambda cf: (cf[1].verdict.severity, cf[0].call))
        where = f"in call {(c.call or 0) + 1} of {m.calls}, "
        return Finding(f.verdict, f.kind, where + f.reason)

    return judged


def forward_overflow(m: ModuleReport, run: RunFacts) -> Finding | None:
    """inf/NaN start in this module's forward: a call with finite inputs gave a non-finite
    output. Broken, and a wider range fixes it. The reason names what overflowed: the
    output, the input as it is cast to the run's dtype here, or a value inside (and, for a
    module called more than once, in which call)."""
    if m.name not in run.origins.forward:
        return None
    # a loop's call that overflowed: later calls' inputs are its own inf/NaN outputs
    calls = m.calls
    m = next((c for c in m.per_call if c.nonfinite and not c.input_nonfinite), m)
    where = f"in call {(m.call or 0) + 1} of {calls}, " if m.call is not None else ""
    info, limit = run.info(m), run.limit
    if m.amax > info.max:
        reason = (
            f"output reaches {_fmt(m.amax)} > {info.name} max {info.max:g} "
            f"({m.nonfinite} values become inf/NaN)"
        )
    elif m.input_amax > limit.max:
        reason = (
            f"its input reaches {_fmt(m.input_amax)} > {limit.name} max {limit.max:g} "
            f"and overflows when cast to {limit.name} here"
        )
    else:
        reason = (
            f"{m.nonfinite} of {m.numel} outputs are inf/NaN although its inputs are "
            f"finite: a value inside it overflows {limit.name} "
            f"(output is at most {_fmt(m.amax)} in the reference)"
        )
    return Finding(BROKEN, FindingKind.RANGE, where + reason)


def backward_overflow(m: ModuleReport, run: RunFacts) -> Finding | None:
    """inf/NaN start in this module's backward: a finite output gradient became non-finite
    input or parameter gradients (judged only with a finite forward). Broken; the loss
    scale's doing when it is above the recommended one."""
    if run.forward_broken or m.name not in run.origins.backward:
        return None
    limit = run.limit
    reason = (
        f"its backward produces inf/NaN gradients at {run.scale_txt} "
        f"({limit.name} max {limit.max:g})" + _fits_hint(run.loss_scale, run.recommended_scale)
    )
    return Finding(BROKEN, run.too_high, reason)


def gradient_arrives_nonfinite(m: ModuleReport, run: RunFacts) -> Finding | None:
    """The backward's first inf/NaN is this module's output gradient, made by no module's
    backward: it overflowed outside them, e.g. where the loss's float32 gradient is cast to
    this module's 16-bit output (judged only with a finite forward). Broken."""
    if run.forward_broken or m.name not in run.origins.arrival:
        return None
    reason = f"its output gradient is already inf/NaN as it arrives, at {run.scale_txt}: " + (
        _overflow_outside(
            run.origins.arrival[m.name],
            run.info(m),
            run.loss_dtype,
            run.loss_scale,
            run.recommended_scale,
        )
    )
    return Finding(BROKEN, run.too_high, reason)


def gradients_flush(m: ModuleReport, run: RunFacts) -> Finding | None:
    """At least `GRAD_FLUSH_BROKEN` (half) of the module's nonzero parameter gradients are
    exactly zero in the target: with most of its gradient gone the layer effectively stops
    learning, so it is broken; under float16 a higher loss scale may keep them."""
    if not m.param_grad_flushed >= GRAD_FLUSH_BROKEN:
        return None
    reason = (
        f"{m.param_grad_flushed:.0%} of its parameter gradients flush to zero in "
        f"{run.limit.name} at {run.scale_txt} (largest "
        f"{_fmt(m.param_grad_amax)}); it stops learning"
        + _scale_hint(run.loss_scale, run.recommended_scale, run.range_dtype)
    )
    return Finding(BROKEN, run.too_low, reason)


@_each_call
def output_near_max(m: ModuleReport, run: RunFacts) -> Finding | None:
    """A low-precision output within `HEADROOM` (4x) of its dtype's max: two doublings of
    its activations, which training can bring, and it overflows. At risk, and a wider range
    fixes it. Not blamed when the module's low-precision inputs are as close already (the
    range problem starts upstream). A reference output past the max is said as what the
    target made of it: inf/NaN after inputs that held them already (it overflows too once
    those are fixed), or finite values, which cannot be the reference's there."""
    info = run.info(m)
    near = info.max / HEADROOM
    if not (_low(m) and m.amax > near and not (_inherited(m) and m.input_amax > near)):
        return None
    if m.amax > info.max and m.nonfinite:  # (not `forward_overflow`'s: inputs held them)
        reason = (
            f"output reaches {_fmt(m.amax)}, past {info.name} max {info.max:g} (its inputs are "
            "inf/NaN from upstream already: it overflows too once those are fixed)"
        )
    elif m.amax > info.max:
        reason = (
            f"output reaches {_fmt(m.amax)} in the reference, past {info.name} max "
            f"{info.max:g}, where its {info.name} output is finite: those values are not the "
            "reference's (saturated or replaced)"
        )
    else:
        reason = (
            f"output reaches {_fmt(m.amax)}, within {HEADROOM:g}x of {info.name} max {info.max:g}"
        )
    return Finding(AT_RISK, FindingKind.RANGE, reason)


@_each_call
def outputs_underflow(m: ModuleReport, run: RunFacts) -> Finding | None:
    """At least `UNDERFLOW_AT_RISK` (half) of a low-precision output's nonzero values are
    below its dtype's smallest normal, where they keep fewer bits or flush to zero: a few
    such values are harmless, most of an output is a range problem. At risk; broken where
    the output's error grows here to `ERROR_BROKEN` (SQNR 6 dB or less, as `error_grows`
    breaks on: an output flushed whole carries no signal); a wider range fixes it. Not
    blamed when one of its low-precision inputs underflows as much (the problem starts
    upstream; pooled over the inputs that underflow, a wider normal one hides nothing)."""
    if not (
        _low(m)
        and m.underflow >= UNDERFLOW_AT_RISK
        and not (_inherited(m) and m.input_underflow >= UNDERFLOW_AT_RISK)
    ):
        return None
    info = run.info(m)
    reason = (
        f"{m.underflow:.0%} of its nonzero outputs fall below {info.name}'s smallest "
        f"normal {info.smallest_normal:.2g} (smallest {_fmt(m.amin)})"
    )
    if (
        math.isfinite(m.rel_error)
        and m.rel_error >= ERROR_BROKEN
        and m.rel_error > ERROR_GROWTH * m.input_rel_error
    ):
        reason += (
            f"; its error against the reference grows to {m.rel_error:.2g} here "
            f"(SQNR {m.sqnr_db:.1f} dB): it carries little signal"
        )
        return Finding(BROKEN, FindingKind.RANGE, reason)
    return Finding(AT_RISK, FindingKind.RANGE, reason)


def gradients_underflow(m: ModuleReport, run: RunFacts) -> Finding | None:
    """`GRAD_UNDERFLOW_AT_RISK` (10%) of the module's nonzero parameter gradients below the
    smallest normal (a parameter's at float32 noise beside the module's largest, whose true
    gradient is zero, left out: `verdicts.GRAD_NOISE`), or `GRAD_FLUSH_AT_RISK` (5%)
    flushed to zero: part of its gradient is
    lost, short of the half `gradients_flush` breaks on (flushed values are gone, so their
    threshold is lower). At risk; under float16 a higher loss scale may keep them."""
    if not (
        m.param_grad_underflow >= GRAD_UNDERFLOW_AT_RISK
        or m.param_grad_flushed >= GRAD_FLUSH_AT_RISK
    ):
        return None
    reason = (
        f"{max(m.param_grad_underflow, m.param_grad_flushed):.0%} of its parameter "
        f"gradients underflow {run.limit.name} at {run.scale_txt}"
        + _scale_hint(run.loss_scale, run.recommended_scale, run.range_dtype)
    )
    return Finding(AT_RISK, run.too_low, reason)


@_each_call
def error_grows(m: ModuleReport, run: RunFacts) -> Finding | None:
    """The output's relative error against the reference is above `ERROR_AT_RISK` (0.1,
    SQNR below 20 dB) and `ERROR_GROWTH` (10) times its inputs' error (pooled over those
    carrying any: an exact input beside them, such as an attention mask, hides none): the
    precision is lost here, not upstream. Broken at `ERROR_BROKEN` (0.5, SQNR 6 dB or
    less), where the output carries little signal. A quantized layer's finding is the
    quantization's (its source float policy fixes it), any other layer's needs float32.
    Never the model itself (""): its inputs are the batch, which holds no error, so an
    error built up over its layers would read as made in it, and its fix would be the whole
    model in float32."""
    if not (
        m.name != ""
        and math.isfinite(m.rel_error)
        and m.rel_error > ERROR_AT_RISK
        and m.rel_error > ERROR_GROWTH * m.input_rel_error
    ):
        return None
    growth = (
        f"its error against the reference grows to {m.rel_error:.2g} here "
        f"(inputs {m.input_rel_error:.2g}; SQNR {m.sqnr_db:.1f} dB)"
    )
    verdict = BROKEN if m.rel_error >= ERROR_BROKEN else AT_RISK
    if m.quantized:
        reason = (
            f"quantized ({m.quantized}): {growth}; a few large values set the "
            "quantization scale, the rest lose their precision"
        )
        return Finding(verdict, FindingKind.QUANTIZATION, reason)
    reason = growth + (": it carries little signal" if verdict == BROKEN else "")
    return Finding(verdict, FindingKind.PRECISION, reason)


def updates_vanish(m: ModuleReport, run: RunFacts) -> Finding | None:
    """With an optimizer's step size (`RunFacts.update`): at least `VANISH_AT_RISK` (a
    quarter) of the module's parameter updates round away in its 16-bit weights, so that
    part of the model trains slower; broken at `VANISH_BROKEN` (90%), where it stops
    learning. Compensation, float32 masters or a float32 rule keep them."""
    if run.update is None or m.vanishing < VANISH_AT_RISK:
        return None
    broken = m.vanishing >= VANISH_BROKEN
    reason = (
        f"{m.vanishing:.0%} of its parameter updates round away in its 16-bit weights at "
        f"{run.update.describe()}{': it stops learning' if broken else ''}; keep them with "
        "Precision(..., compensation='kahan') or master_weights=True, or give it a "
        "float32 rule"
    )
    return Finding(BROKEN if broken else AT_RISK, FindingKind.PRECISION, reason)


# The order the rules are tried in (first finding wins); see the module's docstring.
MODULE_RULES: tuple[Rule, ...] = (
    forward_overflow,
    backward_overflow,
    gradient_arrives_nonfinite,
    gradients_flush,
    output_near_max,
    outputs_underflow,
    gradients_underflow,
    error_grows,
    updates_vanish,
)


def first_finding(m: ModuleReport, run: RunFacts) -> Finding | None:
    """The finding of the first rule in `MODULE_RULES` that has one for `m`."""
    for rule in MODULE_RULES:
        finding = rule(m, run)
        if finding is not None:
            return finding
    return None


def blame_innermost(modules: dict[str, ModuleReport]) -> None:
    """Clear every flagged block that contains another flagged module, at any of its paths
    (a module shared by two blocks is in both), noting which: the problem is blamed where
    it starts. One exception: a block broken by an overflow (kind
    range) holding modules only at risk keeps its verdict, as its own code (an op between
    its children) overflowed, and moving the block fixes it; an error that grows over its
    children is theirs to fix first. The model itself is cleared whenever it holds a
    flagged module, whatever its own finding: code between its modules is no module's
    (`loss_outside_modules` says where); a finding of its own (its own parameters, its own
    code's range) stays, and `recommend` never moves it, as that would put the whole model
    in another precision."""
    flagged = [m for m in modules.values() if m.verdict != OK]
    for m in flagged:
        own = m.name != "" and m.verdict == BROKEN and m.kind == FindingKind.RANGE
        inner = [
            (c, path)
            for c in flagged
            if c is not m
            and not (own and c.verdict == AT_RISK)
            and (path := _path_inside(c, m.name)) is not None
        ]
        if inner:
            c, path = inner[0]
            m.verdict, m.kind, m.reason = OK, FindingKind.NONE, ""
            m.note = f"contains {c.display_name} ({c.verdict})"
            m.note += f", here as {path}" if path != c.name else ""


def loss_outside_modules(modules: dict[str, ModuleReport], run: RunFacts) -> Finding | None:
    """The root's finding, for a run whose loss or gradients are not finite with no module
    broken: the loss overflowed outside the modules (kind loss: no layer's dtype fixes it),
    or, with every forward value finite, a gradient did (the loss scale's kind when it is
    above the recommended one)."""
    if run.finite or any(m.verdict == BROKEN for m in modules.values()):
        return None
    limit = run.limit
    entry = _entry_of_nonfinite(modules)
    if entry is not None:
        where = "the model's inputs" if entry.name == "" else f"{entry.display_name}'s inputs"
        held = (
            f"{where} already hold {entry.input_nonfinite} inf/NaN values, finite in the reference"
        )
        beyond = entry.input_amax > limit.max
        if entry.name == "" and beyond:  # the batch itself: a "true" policy converts it
            reason = (
                f"{held}, where they reach {_fmt(entry.input_amax)} > {limit.name} max "
                f"{limit.max:g}: the policy converts the batch to {limit.name} before the "
                "model runs. Scale the inputs down, or use a mixed policy, which keeps them "
                "float32 and casts inside each layer"
            )
        elif entry.name == "":
            reason = (
                f"{held}: they overflow {limit.name} outside the modules (in the batch's "
                "conversion or in code between the modules)"
            )
        else:  # made by code between the modules (a parent's forward), in 16 bits
            reach = (
                f", where they reach {_fmt(entry.input_amax)} > {limit.name} max {limit.max:g}"
                if beyond
                else ""
            )
            reason = (
                f"{held}{reach}: they overflow {limit.name} outside the modules, in code "
                f"between them (the forward that computes {entry.display_name}'s inputs from "
                f"16-bit outputs): compute that in float32, or scale it down"
            )
        return Finding(BROKEN, FindingKind.LOSS, reason)
    if run.forward_broken:
        reason = (
            f"the loss is inf/NaN although every module's output is finite: it overflows "
            f"{limit.name} outside the modules (in the loss: a loss_fn takes the outputs in "
            "the policy's output dtype, a training step's own code runs in the precision's "
            "autocast region); compute the loss from float32 outputs"
        )
        return Finding(BROKEN, FindingKind.LOSS, reason)
    reason = (
        f"gradients hold inf/NaN at {run.scale_txt} but no module's backward or output "
        "gradient is where they start: "
        + _overflow_outside(math.nan, limit, run.loss_dtype, run.loss_scale, run.recommended_scale)
    )
    return Finding(BROKEN, run.too_high, reason)


def loss_underflows(modules: dict[str, ModuleReport], run: RunFacts) -> Finding | None:
    """The root's finding for a 16-bit loss (computed in the model's 16-bit outputs' dtype)
    that underflows, with no module broken: one whose reference value that dtype cannot
    hold (it rounds to 0) is broken, one below the dtype's smallest normal keeps fewer
    digits and is at risk. The cure is outside the modules (kind loss): computing the loss
    in float32. (A float32 loss that is 0 where the reference's is not is no finding here:
    the outputs it reads lost that, and the module findings say where.) Its gradients may
    still be right: the backward of a scaled-down loss multiplies by the factor."""
    ref, loss = run.reference_loss, run.loss
    if not (math.isfinite(ref) and math.isfinite(loss)) or ref == 0:
        return None
    info = format_info(run.loss_dtype)
    if info.name not in _LOW or any(m.verdict == BROKEN for m in modules.values()):
        return None
    fix = (
        f"compute the loss from float32 outputs (e.g. `loss_fn(output.float(), target)`), or "
        f"scale it up into the {info.name} range"
    )
    if abs(ref) < info.smallest_subnormal / 2:  # rounds to 0 in the loss's dtype
        reason = (
            f"the loss is {_fmt(loss)} where the reference's is {_fmt(ref)}, which "
            f"{info.name} cannot hold (it rounds to 0 below {info.smallest_subnormal / 2:.3g}): "
            f"the loss is computed in {info.name}, outside the modules; the loss you log, and "
            f"whatever watches it (early stopping, a scheduler on plateau), reads it; {fix}"
        )
        return Finding(BROKEN, FindingKind.LOSS, reason)
    if abs(ref) < info.smallest_normal:
        reason = (
            f"the loss {_fmt(ref)} is below {info.name}'s smallest normal "
            f"{info.smallest_normal:.3g} and keeps fewer digits (relative error "
            f"{abs(loss - ref) / abs(ref):.3g}); {fix}"
        )
        return Finding(AT_RISK, FindingKind.LOSS, reason)
    return None


def _entry_of_nonfinite(modules: dict[str, ModuleReport]) -> ModuleReport | None:
    """Where inf/NaN that no module made enter the modules: the root when the model's own
    inputs hold them, else the first module (in execution order) whose inputs do; None when
    no module's inputs hold inf/NaN."""
    called = [m for m in modules.values() if m.calls and m.input_nonfinite]
    root = next((m for m in called if m.name == ""), None)
    return root or min(called, key=lambda m: m.order, default=None)


def mark_origins(modules: dict[str, ModuleReport]) -> None:
    """Mark the broken modules as where problems start, and note on the others that hold
    inf/NaN that they only pass them on: in their outputs from upstream, or only in their
    gradients, from downstream (a module before the broken one)."""
    for m in modules.values():
        m.origin = m.verdict == BROKEN
        if m.verdict == OK and not m.note and (m.nonfinite or m.grad_nonfinite):
            m.note = UPSTREAM if m.nonfinite else DOWNSTREAM


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
    loss: float = math.nan,
    reference_loss: float = math.nan,
) -> None:
    """Give every module (fresh from `module_reports`) a verdict, a kind and a reason: the
    first rule's finding, then the blame moved to the innermost module, then the root's
    finding for a non-finite run no module explains (`modules` then holds the root, "")."""
    run = RunFacts(
        origins=origins,
        loss_scale=loss_scale,
        recommended_scale=recommended_scale,
        range_dtype=range_dtype,
        update=update,
        loss_dtype=loss_dtype,
        finite=loss_finite and grads_finite,
        forward_broken=not loss_finite or any(m.nonfinite for m in modules.values()),
        loss=loss,
        reference_loss=reference_loss,
    )
    for m in modules.values():
        _record(m, first_finding(m, run))
    blame_innermost(modules)
    root = loss_outside_modules(modules, run) or loss_underflows(modules, run)
    if root is not None:
        _record(modules[""], root)
    mark_origins(modules)


def _record(m: ModuleReport, finding: Finding | None) -> None:
    if finding is not None:
        m.verdict, m.kind, m.reason = finding.verdict, finding.kind, finding.reason


def _low(m: ModuleReport) -> bool:
    """The module's output is held in a low-precision dtype."""
    return m.dtype in _LOW


def _inherited(m: ModuleReport) -> bool:
    """Its inputs are low-precision too, so a range problem in them belongs upstream."""
    return m.input_dtype in _LOW


def _is_inside(child: str, parent: str) -> bool:
    return (parent == "" and child != "") or child.startswith(parent + ".")


def _path_inside(m: ModuleReport, parent: str) -> str | None:
    """The first of `m`'s paths (its name, then the other paths of a shared module) inside
    the module `parent`; None when it is not inside."""
    return next((p for p in (m.name, *m.aliases) if _is_inside(p, parent)), None)


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


def _fits_hint(scale: float, recommended: float) -> str:
    """Where a smaller loss scale fixes a backward overflow, which."""
    if not scale > recommended:
        return ""
    return f"; a loss scale of at most {scale_text(recommended)} fits"


def _scale_hint(scale: float, recommended: float, dtype: torch.dtype) -> str:
    """Where a higher loss scale keeps underflowing float16 gradients, which."""
    if dtype != torch.float16 or not recommended > scale:
        return ""
    return f"; loss scale {scale_text(recommended)} keeps them"


def _overflow_outside(
    peak: float, info: FormatInfo, loss_dtype: torch.dtype, scale: float, recommended: float
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


_LOW = {dtype_name(d) for d in LOW_PRECISION_FLOATS}
