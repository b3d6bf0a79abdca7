"""What the doctor says about a target run, and the numbers it says it from: the `Verdict`
and `FindingKind` vocabularies, the thresholds (shared with the live `PrecisionMonitor`), the
per-module and per-parameter reports of a run, where inf/NaN first appear, and loss-scale
arithmetic.

The rules that turn these reports into verdicts live in `mixprec.doctor.rules`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from enum import Enum
from numbers import Real
from typing import Any

import torch
from torch import nn

from mixprec.doctor.probe import Key, Recording, Stats, combine, lowest_float
from mixprec.dtypes import dtype_name, format_info
from mixprec.formats.registry import Ranked
from mixprec.optim.engine import check_compensation
from mixprec.policy.map import PolicyMap

__all__ = [
    "AT_RISK",
    "BROKEN",
    "DEFAULT_TOLERANCE",
    "OK",
    "QUANTIZED_TOLERANCE",
    "FindingKind",
    "ModuleReport",
    "ParamReport",
    "Verdict",
    "scale_text",
]


class Verdict(Ranked):
    """How a module fares in the target precision, in order of severity."""

    BROKEN = "broken"
    AT_RISK = "at risk"
    OK = "ok"

    @property
    def severity(self) -> int:
        """0 for the worst verdict: sorts findings worst first."""
        return self.rank


OK, AT_RISK, BROKEN = Verdict.OK, Verdict.AT_RISK, Verdict.BROKEN
# what an ok module holding inf/NaN that it did not make is shown as, never just "ok": in its
# outputs, made by a module before it; only in its gradients, made by a module after it
UPSTREAM = "inf/NaN from upstream"
DOWNSTREAM = "inf/NaN gradients from downstream"


class FindingKind(str, Enum):
    """What fixes a finding, which is what `Diagnosis.recommend` acts on (the values are the
    strings reports always carried)."""

    NONE = ""  # no finding: an OK module, or a block whose child is blamed
    RANGE = "range"  # a wider range fixes it (bfloat16 for float16, else float32)
    PRECISION = "precision"  # more mantissa bits fix it: float32
    QUANTIZATION = "quantization"  # a quantized layer: its source float policy fixes it
    SCALE = "scale"  # the loss scale causes it: the recommended loss scale fixes it
    LOSS = "loss"  # the root's: the loss breaks outside every module; no layer's dtype fixes it

    def __str__(self) -> str:
        return self.value


# When a finding is raised. Chosen so that healthy float16/bfloat16 runs of common layers
# (linear, conv, norms, attention, activations) raise none; see tests/test_doctor*.py.
# a parameter's reference gradients at most this fraction of its module's largest are
# float32 rounding noise (a few units in the last place), not signal a low precision loses
GRAD_NOISE = 2.0**-20
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
    master_weights: bool | None = None  # as `Precision` takes it: which 16-bit weights step
    # through float32 masters (None: float16's), whose updates never round away
    # as `Precision` takes it: 16-bit weights without masters compensated ("kahan" carries
    # what rounds away into the next steps, "stochastic" keeps it on average), which lose none
    compensation: str | None = None

    def __post_init__(self) -> None:
        lr = self.lr
        if isinstance(lr, bool) or not (isinstance(lr, Real) and math.isfinite(lr) and lr > 0):
            raise ValueError(f"lr must be a positive finite number, got {lr!r}")
        object.__setattr__(self, "lr", float(lr))  # numpy's numbers are held as a float
        self.check_flags(self.master_weights, self.compensation)
        if self.rule not in UPDATE_RULES:
            raise ValueError(
                f"optimizer must be one of {', '.join(UPDATE_RULES)} (how the update is "
                f"sized), got {self.rule!r}"
            )

    @staticmethod
    def check_flags(master_weights: Any, compensation: Any) -> None:
        """Refuse what `Precision` refuses of the two: a `master_weights` other than None,
        True or False, an unknown compensation, or both masters and a compensation."""
        if not (master_weights is None or isinstance(master_weights, bool)):
            raise TypeError(f"master_weights must be None, True or False, got {master_weights!r}")
        check_compensation(compensation)
        if compensation is not None and master_weights:
            raise ValueError(
                "compensation and master_weights=True are two answers to one problem (as "
                "Precision says): float32 masters already keep small updates; choose one"
            )

    def stored_in(self, dtype: torch.dtype) -> bool:
        """Whether weights of `dtype` take their updates in `dtype` itself (no masters, no
        compensation), where a step below half a unit in the last place rounds away."""
        if format_info(dtype).bits > 16 or self.master_weights or self.compensation:
            return False
        return self.master_weights is False or dtype != torch.float16

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
    target output with the reference output. `input_rel_error`/`input_underflow` pool its
    input tensors that carry any (an exact mask beside a hidden state hides none of it).
    `per_call` holds each call's own report when there are several (see the field).
    `grad_nonfinite`/`input_grad_nonfinite` count inf/NaN in the target's gradients of its
    output/inputs (at the run's loss scale); `param_*` describe the module's own parameters'
    gradients; `aliases` are its other paths (a module shared by two blocks, which the
    report names by its first).
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
    kind: FindingKind = FindingKind.NONE  # what fixes the finding
    quantized: str = ""  # the quantized policy a quantized layer runs in
    origin: bool = False
    note: str = ""
    aliases: tuple[str, ...] = ()
    # a module called more than once: one report per call (`call` its index), which the
    # rules judge by that call's own inputs (a loop's later calls take its earlier outputs)
    per_call: tuple[ModuleReport, ...] = field(default=(), repr=False)
    call: int | None = None

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


def _rates(s: Stats) -> dict[str, Any]:
    """What a report reads alike from one tensor's statistics: its size, the fractions that
    underflow, flush to zero and overflow, the non-finite count and the relative error."""
    return dict(
        numel=int(s.numel),
        underflow=_frac(s.underflow, s.nonzero),
        flushed=_frac(s.flushed, s.nonzero),
        overflow=_frac(s.overflow, s.numel),
        nonfinite=int(s.nonfinite),
        rel_error=s.rel_error,
    )


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
            nonzero=int(r.nonzero),
            grad_amax=r.amax,
            **_rates(r),
        )
    return reports


@dataclass
class Origins:
    """Where inf/NaN first appear in a target run.

    `forward`: modules with finite inputs (no infinity a mask's fill became either) and a
    non-finite output, or that made such infinities which a later module turned into
    inf/NaN (`_blame_fill`); `backward`: modules whose
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
    fed: list[Any] = []  # calls whose inf/NaN come from infinities taken as a mask's fill
    for order, (name, calls) in enumerate(calls_of.items()):
        own = [params[p] for p in target.params_of.get(name, []) if p in params]
        report = _module_report(target, values, name, order, calls, own)
        if report is None:
            continue
        report.aliases = target.aliases.get(name, ())
        for c in calls:
            c_out, c_in = _rows(values, c.outputs), _rows(values, c.inputs)
            # inputs are finite only without the infinities a mask's fill became either
            if c_out and c_out.nonfinite > 0 and not (c_in and c_in.nonfinite + c_in.filled):
                origins.forward.add(name)
            elif c_out and c_out.nonfinite > 0 and c_in and not c_in.nonfinite:
                fed.append(c)
            if not _bad_grads(target, c.outputs) and (
                _bad_grads(target, c.inputs) or any(p.nonfinite for p in own)
            ):
                origins.backward.add(name)
        reports[name] = report
    for c in fed:
        _blame_fill(target, values, reports, origins, c)
    _note_arrival(target, reports, origins)
    finite = math.isfinite(target.loss) and not any(p.nonfinite for p in params.values())
    if not finite and "" not in reports:
        reports[""] = _root_report(target, order=len(reports))
    return reports, origins


def _blame_fill(
    target: Recording,
    values: dict[Key, Stats],
    reports: dict[str, ModuleReport],
    origins: Origins,
    fed: Any,
) -> None:
    """Call `fed` made inf/NaN from infinities the target holds where the reference holds a
    mask's finite fill (harmless where a softmax row keeps finite entries, not in a fully
    masked one): the module that made them from finite inputs, and handed them to `fed`
    (the innermost, a child finishing first), is where they start, its report counting
    them as inf/NaN. Infinities made by code between modules leave the block running that
    code to blame (its inputs are finite)."""
    maker = None
    for c in target.calls:
        if c is fed:
            break
        if not set(c.outputs) & set(fed.inputs):
            continue
        c_out, c_in = _rows(values, c.outputs), _rows(values, c.inputs)
        if c_out and c_out.filled and not (c_in and c_in.nonfinite + c_in.filled):
            maker = c
            break
    if maker is None:
        return
    report = reports.get(maker.name)
    if report is None or maker.name in origins.forward:
        return
    origins.forward.add(maker.name)
    out = _rows(values, maker.outputs)
    assert out is not None
    views = [report] + [v for v in report.per_call if v.call == maker.index]
    for view in views:
        view.nonfinite += int(out.filled)
        view.rel_error, view.sqnr_db = math.inf, -math.inf


def _rows(values: dict[Key, Stats], keys: list[Key]) -> Stats | None:
    """The statistics of `keys` (each once) combined; None: none was recorded."""
    return combine([values[k] for k in dict.fromkeys(keys) if k in values])


def _bad_grads(target: Recording, keys: list[Key]) -> int:
    """Non-finite gradient elements of the tensors `keys` (each once)."""
    return sum(target.slots[k].grad_nonfinite for k in dict.fromkeys(keys))


def _module_report(
    target: Recording,
    values: dict[Key, Stats],
    name: str,
    order: int,
    calls: list[Any],
    own: list[ParamReport],
) -> ModuleReport | None:
    """The report of module `name` over its `calls` (`own`: its parameters' reports), with
    one view per call when there are several; None when none of its outputs was
    recorded."""
    out_keys = [k for c in calls for k in c.outputs]
    in_keys = [k for c in calls for k in c.inputs]
    pooled = _call_fields(values, out_keys, in_keys)
    if pooled is None:
        return None
    # (a parameter whose reference gradients are all at float32's rounding noise beside the
    # module's largest, such as attention's key bias, whose true gradient is zero: its
    # values are no signal to lose, and would count as underflowing)
    top = max((p.grad_amax for p in own), default=0.0)
    signal = [p for p in own if not p.grad_amax <= GRAD_NOISE * top]
    nonzero = sum(p.nonzero for p in signal)
    report = ModuleReport(
        name=name,
        type=target.types.get(name, ""),
        order=order,
        dtype=dtype_name(lowest_float([target.slots[k].dtype for k in out_keys])),
        calls=len(calls),
        **pooled,
        input_dtype=dtype_name(lowest_float([target.slots[k].dtype for k in in_keys])),
        grad_nonfinite=_bad_grads(target, out_keys),
        input_grad_nonfinite=_bad_grads(target, in_keys),
        param_grad_amax=max((p.grad_amax for p in own), default=math.nan),
        param_grad_underflow=sum(p.underflow * p.nonzero for p in signal) / nonzero
        if nonzero
        else 0.0,
        param_grad_flushed=sum(p.flushed * p.nonzero for p in signal) / nonzero if nonzero else 0.0,
        param_grad_nonfinite=sum(p.nonfinite for p in own),
    )
    if len(calls) > 1:  # a loop's later calls take its own earlier outputs: judge each alone
        views = [(c, _call_fields(values, c.outputs, c.inputs)) for c in calls]
        report.per_call = tuple(
            replace(report, calls=1, call=c.index, **fields)
            for c, fields in sorted(views, key=lambda v: v[0].index)
            if fields is not None
        )
    return report


def _call_fields(
    values: dict[Key, Stats], out_keys: list[Key], in_keys: list[Key]
) -> dict[str, Any] | None:
    """A report's output and input statistics over the tensors `out_keys` and `in_keys`;
    None when no output was recorded."""
    out, inp = _rows(values, out_keys), _rows(values, in_keys)
    if not out:
        return None
    # the error and underflow the inputs bring, pooled over the inputs that carry any: a
    # large exact input (an additive attention mask) would swamp a hidden state's error
    # beside it; the worst tensor alone would let a small side input hide a culprit
    ins = [values[k] for k in dict.fromkeys(in_keys) if k in values and values[k].numel]
    erring = combine([s for s in ins if s.rel_error > 0])
    under = combine([s for s in ins if s.underflow])
    return dict(
        amax=out.amax,
        amin=out.amin,
        **_rates(out),
        sqnr_db=out.sqnr_db,
        input_amax=inp.amax if inp else 0.0,
        input_nonfinite=int(inp.nonfinite) if inp else 0,
        input_rel_error=erring.rel_error if erring else 0.0,
        input_underflow=_frac(under.underflow, under.nonzero) if under else 0.0,
    )


def _note_arrival(target: Recording, reports: dict[str, ModuleReport], origins: Origins) -> None:
    """The backward's first non-finite gradient (hooks fire in dependency order), when it is
    no module's input gradient made from finite outputs: it arrived at a module's output,
    noted in ``origins.arrival`` with the reference's gradient peak there."""
    bad = [slot for slot in target.slots.values() if slot.grad_nonfinite]
    first = min(bad, key=lambda slot: slot.grad_order, default=None)
    if first is None or any(
        first.key in c.inputs and not _bad_grads(target, c.outputs) for c in target.calls
    ):
        return
    twin = first.twin.grad_amax if first.twin is not None else None
    peak = float(twin) if twin is not None else math.nan
    for c in target.calls:
        if first.key in c.outputs and c.name in reports:
            origins.arrival[c.name] = peak


def _root_report(target: Recording, order: int) -> ModuleReport:
    """The root's report (""), where a non-finite loss or gradient no module explains is
    reported."""
    return ModuleReport(
        name="",
        type=target.types.get("", ""),
        order=order,
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


def vanishing_by_module(
    model: nn.Module,
    trained: dict[str, torch.dtype],
    grads: dict[str, torch.Tensor],
    update: UpdateModel,
) -> dict[str, float]:
    """Per module, the share of its own parameters' updates that round away in the dtype the
    converted model stores them in (`trained`: the parameters it trains, by name, with their
    dtype; a quantized layer's frozen weight is none of them; 16-bit weights without float32
    masters only: `UpdateModel.stored_in`; the others lose none), with the reference run's
    gradients sizing the steps and `model`'s weights as the converted ones start."""
    lost: dict[str, float] = {}
    sizes: dict[str, int] = {}
    for name, param in model.named_parameters():
        module = name.rpartition(".")[0]
        dtype = trained.get(name)
        grad = grads.get(name)
        if grad is None or dtype is None or not update.stored_in(dtype):
            continue
        delta = update.delta(grad.to(param.device))
        n = int((delta != 0).sum())
        lost[module] = lost.get(module, 0.0) + vanishing_fraction(param, delta, dtype) * n
        sizes[module] = sizes.get(module, 0) + n
    return {m: lost[m] / sizes[m] for m in lost if sizes[m]}
