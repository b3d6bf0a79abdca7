"""`diagnose`: run a model once in a reference precision and once in a target precision,
compare them module by module, and say which layers break in the target and why.

`Diagnosis.recommend` then writes the smallest per-layer policy that repairs the target run,
checking each candidate by running it.
"""

from __future__ import annotations

import copy
import math
import re
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from mixprec.convert import apply
from mixprec.doctor.probe import (
    FIELDS,
    Key,
    Probe,
    Recording,
    lowest_float,
    measure_param_grads,
    seeded,
    sum_rows,
)
from mixprec.dtypes import LOW_PRECISION_FLOATS, dtype_name, format_info
from mixprec.errors import PrecisionError
from mixprec.hardware import FAST, SUPPORTED, detect, device_of, dtype_support, resolve_policy
from mixprec.policy import Policy
from mixprec.policy_map import PolicyMap
from mixprec.precision import Precision
from mixprec.scaling import LossScaler, StaticLossScaler
from mixprec.tree import map_tensors

OK, AT_RISK, BROKEN = "ok", "at risk", "broken"
_SEVERITY = {BROKEN: 0, AT_RISK: 1, OK: 2}

# When a finding is raised. Chosen so that healthy float16/bfloat16 runs of common layers
# (linear, conv, norms, attention, activations) raise none; see tests/test_doctor*.py.
HEADROOM = 4.0  # "at risk" when a layer's amax comes within this factor of the dtype's max
UNDERFLOW_AT_RISK = 0.5  # fraction of nonzero outputs below the smallest normal
GRAD_UNDERFLOW_AT_RISK = 0.1  # fraction of nonzero parameter gradients that underflow
GRAD_FLUSH_AT_RISK = 0.05  # ... that become exactly zero
GRAD_FLUSH_BROKEN = 0.5  # ... beyond this, the layer effectively stops learning
ERROR_AT_RISK = 0.1  # a layer's relative error above this (SQNR below 20 dB) ...
ERROR_GROWTH = 10.0  # ... and this many times the error already in its inputs
LOSS_SCALE_MARGIN = 8.0  # recommended scale keeps scaled gradients this far below the max
MAX_LOSS_SCALE = 2.0**24
DEFAULT_LOSS_SCALE = 2.0**16  # where a DynamicLossScaler starts


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


def _scale(x: float) -> str:
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
    verdict: str = OK
    reason: str = ""
    kind: str = ""  # "range" (fixable by a wider range) or "precision" (needs float32)
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


def _rel(row: dict[str, float]) -> float:
    if not row or row["numel"] == 0:
        return math.nan
    if row["nonfinite"] > 0:
        return math.inf
    if row["ref_sq"] == 0:
        return 0.0 if row["err_sq"] == 0 else math.inf
    return math.sqrt(row["err_sq"] / row["ref_sq"])


def _sqnr(row: dict[str, float]) -> float:
    if not row or row["numel"] == 0:
        return math.nan
    if row["nonfinite"] > 0:
        return -math.inf
    if row["err_sq"] == 0:
        return math.inf
    if row["ref_sq"] == 0:
        return -math.inf
    return 10.0 * math.log10(row["ref_sq"] / row["err_sq"])


def _frac(count: float, total: float) -> float:
    return count / total if total else 0.0


# -- running the model ---------------------------------------------------------------------


def _as_loss(result: Any, where: str) -> Tensor:
    if isinstance(result, dict):
        if "loss" not in result:
            raise TypeError(f"{where} returned a dict without a 'loss' key: {sorted(result)}")
        result = result["loss"]
    if not isinstance(result, Tensor) or result.numel() != 1 or not result.is_floating_point():
        got = tuple(result.shape) if isinstance(result, Tensor) else type(result).__name__
        raise TypeError(
            f"{where} must give a scalar floating loss tensor (or a dict with 'loss'), got {got};"
            " pass loss_fn=... with a batch of (inputs, targets)"
        )
    return result.reshape(())


def _fingerprint(model: nn.Module) -> list[tuple[Any, ...]]:
    """Identity, storage, dtype and in-place version of every parameter and buffer: any
    training step, conversion, move or load changes it."""
    return [
        (name, id(t), t.data_ptr(), t.dtype, t.device, t._version)
        for name, t in model.state_dict(keep_vars=True).items()
        if isinstance(t, Tensor)
    ]


class _Session:
    """Everything needed to run the model again in any precision on the same batch.

    Each run deep-copies `model`, which is the caller's own model (never changed here):
    a fingerprint taken at the start makes a later run refuse to go on if the caller has
    changed the model since.
    """

    def __init__(
        self,
        model: nn.Module,
        batch: Any,
        loss_fn: Callable[..., Tensor] | None,
        device: torch.device,
        seed: int,
    ) -> None:
        self.model = model
        self.batch = batch
        self.loss_fn = loss_fn
        self.device = device
        self.seed = seed
        self._fingerprint = _fingerprint(model)

    def copy(self) -> nn.Module:
        """A fresh copy of the model as it was diagnosed."""
        if _fingerprint(self.model) != self._fingerprint:
            raise ValueError(
                "the model changed since it was diagnosed (a parameter or buffer was "
                "modified, converted, moved or replaced); call diagnose() again"
            )
        return copy.deepcopy(self.model)

    def _loss(self, model: nn.Module, precision: Precision) -> Tensor:
        """The loss, computed as the Trainer does: inputs converted for a "true" policy,
        the whole step in the policy's autocast region."""
        batch = precision.convert_input(self.batch)
        with precision.autocast():
            if self.loss_fn is not None:
                if not isinstance(batch, (list, tuple)) or len(batch) < 2:
                    raise TypeError(
                        "with loss_fn the batch must be a tuple or list (inputs..., target), "
                        f"got {type(batch).__name__}"
                        + (f" of length {len(batch)}" if isinstance(batch, (list, tuple)) else "")
                    )
                *inputs, target = batch
                return _as_loss(self.loss_fn(model(*inputs), target), "loss_fn")
            step = getattr(model, "training_step", None)
            if step is None:
                return _as_loss(model(batch), "the model (no loss_fn given)")
            # self.log has no trainer to go to here: drop its calls (on this copy only)
            for name in ("log", "log_dict"):
                if callable(getattr(model, name, None)):
                    setattr(model, name, _ignore)
            return _as_loss(step(batch, 0), "training_step")

    def run(self, policy: PolicyMap, reference: Recording | None, scale: float) -> Recording:
        """One forward and backward of a fresh copy under `policy`, probed."""
        model = self.copy()
        for module in model.modules():
            if isinstance(module, nn.modules.dropout._DropoutNd):
                module.eval()  # both runs must see the same network
        # `apply`, not `Precision.setup`: a slow precision warns instead of raising here
        apply(model, policy)
        precision = Precision(policy, device=self.device, scaler=StaticLossScaler(scale))
        resolved = policy.resolve(model)
        params = list(model.named_parameters())
        limits = {
            name: lowest_float([p.dtype, resolved[name.rpartition(".")[0]].policy.compute_dtype])
            for name, p in params
        }
        probe = Probe(model, reference, grad_scale=scale)
        with seeded(self.seed, self.device), probe as rec:
            loss = self._loss(model, precision)
            if not loss.requires_grad:
                raise ValueError(
                    "the loss does not require grad: is the model frozen or run under no_grad?"
                )
            precision.backward(loss)
        rec.loss = float(loss.detach().float())
        measure_param_grads(params, rec, reference, limits, scale)
        rec.param_limits = limits
        rec.types = {name: type(m).__name__ for name, m in model.named_modules()}
        rec.params_of = {
            name: [f"{name}.{k}" if name else k for k, v in m._parameters.items() if v is not None]
            for name, m in model.named_modules()
        }
        return rec


def _ignore(*args: Any, **kwargs: Any) -> None:
    """Stands in for TrainingModule.log during a diagnosis."""


# -- turning two recordings into verdicts --------------------------------------------------


def _is_inside(child: str, parent: str) -> bool:
    return (parent == "" and child != "") or child.startswith(parent + ".")


def _loss_scale_for(grad_amax: float, dtype: torch.dtype) -> float:
    """Largest power of two keeping `grad_amax` x scale below `dtype`'s max by the margin."""
    if grad_amax == 0:
        return MAX_LOSS_SCALE
    if not math.isfinite(grad_amax):
        return 1.0
    k = math.floor(math.log2(format_info(dtype).max / (LOSS_SCALE_MARGIN * grad_amax)))
    return float(min(max(2.0**k, 1.0), MAX_LOSS_SCALE))


def _range_dtype(policy: PolicyMap) -> torch.dtype:
    """The narrowest dtype any layer of `policy` computes or stores in."""
    return lowest_float([d for p in policy.policies() for d in (p.compute_dtype, p.param_dtype)])


def _param_reports(target: Recording, params: dict[str, list[float]]) -> dict[str, ParamReport]:
    reports = {}
    for name, row in params.items():
        limit = dtype_name(target.param_limits[name])
        r = dict(zip(FIELDS, row, strict=True))
        reports[name] = ParamReport(
            name=name,
            module=name.rpartition(".")[0],
            dtype=limit,
            numel=int(r["numel"]),
            nonzero=int(r["nonzero"]),
            grad_amax=r["amax"],
            underflow=_frac(r["underflow"], r["nonzero"]),
            flushed=_frac(r["flushed"], r["nonzero"]),
            overflow=_frac(r["overflow"], r["numel"]),
            nonfinite=int(r["nonfinite"]),
            rel_error=_rel(r),
        )
    return reports


def _module_reports(
    target: Recording,
    values: dict[Key, list[float]],
    params: dict[str, ParamReport],
) -> tuple[dict[str, ModuleReport], set[str], set[str]]:
    """Per-module statistics, plus the modules where inf/NaN first appear going forward
    (finite inputs, non-finite output) and going backward (finite output gradient,
    non-finite input gradient), judged call by call."""
    calls_of: dict[str, list[Any]] = {}
    for call in target.calls:
        calls_of.setdefault(call.name, []).append(call)
    reports: dict[str, ModuleReport] = {}
    fwd_origins: set[str] = set()
    bwd_origins: set[str] = set()

    def rows(keys: list[Key]) -> dict[str, float]:
        return sum_rows([values[k] for k in dict.fromkeys(keys) if k in values])

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
            if c_out and c_out["nonfinite"] > 0 and not c_in.get("nonfinite", 0):
                fwd_origins.add(name)
            if not bad_grads(c.outputs) and (bad_grads(c.inputs) or any(p.nonfinite for p in own)):
                bwd_origins.add(name)
        reports[name] = ModuleReport(
            name=name,
            type=target.types.get(name, ""),
            order=order,
            dtype=dtype_name(lowest_float([target.slots[k].dtype for k in out_keys])),
            calls=len(calls),
            numel=int(out["numel"]),
            amax=out["amax"],
            amin=out["amin"],
            overflow=_frac(out["overflow"], out["numel"]),
            underflow=_frac(out["underflow"], out["nonzero"]),
            flushed=_frac(out["flushed"], out["nonzero"]),
            nonfinite=int(out["nonfinite"]),
            rel_error=_rel(out),
            sqnr_db=_sqnr(out),
            input_amax=inp.get("amax", 0.0),
            input_nonfinite=int(inp.get("nonfinite", 0)),
            input_rel_error=_rel(inp) if inp else 0.0,
            input_underflow=_frac(inp.get("underflow", 0), inp.get("nonzero", 0)),
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
    return reports, fwd_origins, bwd_origins


def _judge(
    modules: dict[str, ModuleReport],
    fwd_origins: set[str],
    bwd_origins: set[str],
    loss_scale: float,
    recommended_scale: float,
    range_dtype: torch.dtype,
) -> None:
    """Give every module a verdict and a reason, blaming only where a problem starts."""
    scale_txt = f"loss scale {_scale(loss_scale)}"
    forward_broken = any(m.nonfinite for m in modules.values())
    for m in modules.values():
        info = format_info(m.dtype) if m.dtype in _LOW else format_info(range_dtype)
        low = m.dtype in _LOW
        # a range problem already present in low-precision inputs belongs upstream
        inherited = m.input_dtype in _LOW
        if m.name in fwd_origins:
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
        elif not forward_broken and m.name in bwd_origins:
            m.verdict, m.kind = BROKEN, "range"
            hint = (
                f"; a loss scale of at most {_scale(recommended_scale)} fits"
                if loss_scale > recommended_scale
                else ""
            )
            m.reason = (
                f"its backward produces inf/NaN gradients at {scale_txt} "
                f"({format_info(range_dtype).name} max {format_info(range_dtype).max:g}){hint}"
            )
        elif m.param_grad_flushed >= GRAD_FLUSH_BROKEN:
            m.verdict, m.kind = BROKEN, "range"
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
            m.verdict, m.kind = AT_RISK, "range"
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
            m.verdict, m.kind = AT_RISK, "precision"
            m.reason = (
                f"its error against the reference grows to {m.rel_error:.2g} here "
                f"(inputs {m.input_rel_error:.2g}; SQNR {m.sqnr_db:.1f} dB)"
            )
    # Blame the innermost module: a block whose child explains the problem is not flagged.
    flagged = [m for m in modules.values() if m.verdict != OK]
    for m in flagged:
        inner = [c for c in flagged if c is not m and _is_inside(c.name, m.name)]
        if inner:
            m.verdict, m.kind, m.reason = OK, "", ""
            m.note = f"contains {inner[0].display_name} ({inner[0].verdict})"
    for m in modules.values():
        m.origin = m.verdict == BROKEN
        if m.verdict == OK and not m.note and (m.nonfinite or m.grad_nonfinite):
            m.note = "inf/NaN arrive from elsewhere"


def _scale_hint(grad_amax: float, scale: float, recommended: float, dtype: torch.dtype) -> str:
    if dtype != torch.float16 or not recommended > scale:
        return ""
    return f"; loss scale {_scale(recommended)} keeps them"


_LOW = {dtype_name(d) for d in LOW_PRECISION_FLOATS}


# -- the result ----------------------------------------------------------------------------

DEFAULT_TOLERANCE = 0.1


class Diagnosis:
    """What changed between the reference run and the target run, module by module.

    `modules` (execution order) and `params` hold the statistics; `findings` lists the
    modules judged "at risk" or "broken", worst first. Prints as a rich table; `to_markdown`
    and `save` write a report. Keeps the reference run's tensors so that `recommend` can
    verify its candidates.
    """

    def __init__(
        self,
        session: _Session,
        precision: PolicyMap,
        reference: PolicyMap,
        ref: Recording,
        target: Recording,
        loss_scale: float,
        recommended_loss_scale: float,
    ) -> None:
        values, params = target.rows()
        self.precision = precision
        self.reference = reference
        self.device = session.device
        self.dtype = _range_dtype(precision)
        self.loss = ref.loss
        self.target_loss = target.loss
        self.loss_scale = loss_scale
        self.recommended_loss_scale = recommended_loss_scale
        self.params: dict[str, ParamReport] = _param_reports(target, params)
        self.modules, fwd, bwd = _module_reports(target, values, self.params)
        _judge(self.modules, fwd, bwd, loss_scale, recommended_loss_scale, self.dtype)
        ref_sq = sum(row[FIELDS.index("ref_sq")] for row in params.values())
        err_sq = sum(row[FIELDS.index("err_sq")] for row in params.values())
        nonfinite = sum(p.nonfinite for p in self.params.values())
        self.grad_rel_error = (
            (math.inf if nonfinite or (err_sq and not ref_sq) else math.sqrt(err_sq / ref_sq))
            if ref_sq or err_sq or nonfinite
            else 0.0
        )
        self.recommend_log: list[str] = []
        self.recommended: PolicyMap | None = None
        self.fixed: Diagnosis | None = None
        self._session = session
        self._ref = ref

    # -- summaries ---------------------------------------------------------------------------

    @property
    def findings(self) -> list[ModuleReport]:
        """Modules judged at risk or broken: broken first, each group in execution order."""
        found = [m for m in self.modules.values() if m.verdict != OK]
        return sorted(found, key=lambda m: (_SEVERITY[m.verdict], m.order))

    def worst(self, n: int | None = None) -> list[ModuleReport]:
        """Modules ordered worst first: by verdict, then by relative error."""
        ranked = sorted(
            self.modules.values(),
            key=lambda m: (
                _SEVERITY[m.verdict],
                -(m.rel_error if not math.isnan(m.rel_error) else -1.0),
                m.order,
            ),
        )
        return ranked[:n] if n is not None else ranked

    @property
    def loss_rel_error(self) -> float:
        """|target loss - reference loss| / |reference loss| (inf if the target's is not
        finite)."""
        if not math.isfinite(self.target_loss):
            return math.inf
        return abs(self.target_loss - self.loss) / max(abs(self.loss), 1e-12)

    @property
    def finite(self) -> bool:
        """Whether the target run's loss and every parameter gradient are finite."""
        return math.isfinite(self.target_loss) and not any(
            p.nonfinite for p in self.params.values()
        )

    def passes(self, tolerance: float = DEFAULT_TOLERANCE) -> bool:
        """The target run is finite, no module is broken, and the loss and the gradient
        (as one vector) are within `tolerance` relative error of the reference's."""
        return (
            self.finite
            and not any(m.verdict == BROKEN for m in self.modules.values())
            and self.loss_rel_error <= tolerance
            and self.grad_rel_error <= tolerance
        )

    # -- the fix -----------------------------------------------------------------------------

    def _safer(self, module: ModuleReport, current: Policy | None) -> Policy | None:
        """The next, safer policy for `module`: bfloat16 for a float16 range problem when
        this device runs bfloat16, else float32; None when float32 was tried already."""
        inherited = self.precision.resolve(self._session.model)[module.name].policy
        wide = (
            inherited.param_dtype
            if format_info(inherited.param_dtype).bits >= 32
            else torch.float32
        )
        steps = []
        if (
            module.kind == "range"
            and self.dtype == torch.float16
            and dtype_support(torch.bfloat16, detect(self.device)).status in (FAST, SUPPORTED)
        ):
            steps.append(
                Policy(
                    param_dtype=wide,
                    compute_dtype=torch.bfloat16,
                    output_dtype=inherited.output_dtype,
                )
            )
        steps.append(
            Policy(
                param_dtype=wide, compute_dtype=torch.float32, output_dtype=inherited.output_dtype
            )
        )
        if current is None:
            return steps[0]
        later = steps[steps.index(current) + 1 :] if current in steps else []
        return later[0] if later else None

    def _rule_key(self, name: str) -> str:
        """`name` as a rule key: escaped only if, as a regex, it would match another module."""
        names = [n for n, _ in self._session.model.named_modules()]
        if any(n != name and re.fullmatch(name, n) for n in names):
            return re.escape(name)
        return name

    def _map(self, chosen: dict[str, Policy]) -> PolicyMap:
        rules: dict[Any, Any] = dict(self.precision.rules)
        rules.update({self._rule_key(name): p for name, p in chosen.items()})
        return PolicyMap(
            self.precision.default, rules, float32_islands=self.precision.float32_islands
        )

    def _trial(self, chosen: dict[str, Policy]) -> Diagnosis:
        policy = self._map(chosen)
        target = self._session.run(policy, self._ref, self.loss_scale)
        return Diagnosis(
            self._session,
            policy,
            self.reference,
            self._ref,
            target,
            self.loss_scale,
            self.recommended_loss_scale,
        )

    def recommend(self, tolerance: float = DEFAULT_TOLERANCE) -> PolicyMap:
        """The target policy with the fewest modules moved to a safer precision such that the
        target run is finite, has no broken module, and its loss and gradient are within
        `tolerance` (relative) of the reference.

        Greedy: fix the first remaining finding (broken before at risk, in execution order),
        re-run, repeat; then drop every fix the run does not need. Each step is one run of
        the model. Raises PrecisionError when no per-module map gets there.
        """
        if not tolerance > 0:
            raise ValueError(f"tolerance must be a positive relative error, got {tolerance}")
        chosen: dict[str, Policy] = {}
        exhausted: set[str] = set()
        self.recommend_log = []
        trial: Diagnosis = self
        for _ in range(2 * len(self.modules) + 1):
            if trial.passes(tolerance):
                break
            pick = next((m for m in trial.findings if m.name not in exhausted), None)
            if pick is None:
                hint = (
                    " Under a 'true' policy a layer's output is cast back to the policy's "
                    "output dtype, so an activation beyond its range cannot be kept per layer: "
                    "try a mixed policy."
                    if not self.precision.default.is_mixed
                    else ""
                )
                raise PrecisionError(
                    f"no per-module policy brings {self.precision.default.name} within "
                    f"tolerance {tolerance:g} of {self.reference.default.name}: after trying "
                    f"{', '.join(sorted(n or '<root>' for n in exhausted))} in every safer "
                    f"precision, {_why_not(trial, tolerance)} (loss error "
                    f"{trial.loss_rel_error:.3g}, gradient error {trial.grad_rel_error:.3g}).{hint}"
                    " Use a larger tolerance or train in the reference precision."
                )
            safer = self._safer(pick, chosen.get(pick.name))
            if safer is None:
                exhausted.add(pick.name)
                continue
            chosen[pick.name] = safer
            trial = self._trial(chosen)
            self.recommend_log.append(
                f"{pick.display_name} -> {safer.name}: "
                + ("the run passes" if trial.passes(tolerance) else _why_not(trial, tolerance))
            )
        else:
            raise PrecisionError(f"recommend did not converge after {len(chosen)} fixes")
        for name in reversed(list(chosen)):
            fewer = {k: v for k, v in chosen.items() if k != name}
            without = self._trial(fewer)
            if without.passes(tolerance):
                chosen, trial = fewer, without
                self.recommend_log.append(f"{name or '<root>'}: not needed after all, dropped")
        self.recommended, self.fixed = self._map(chosen), trial
        return self.recommended

    # -- printing ----------------------------------------------------------------------------

    def summary(self) -> str:
        """Two lines: what was compared, the losses, the loss scale."""
        from mixprec.doctor.report import summary

        return summary(self)

    def to_markdown(self, plots: dict[str, str] | None = None) -> str:
        """The report as markdown; `plots` maps a caption to an image path to link."""
        from mixprec.doctor.report import to_markdown

        return to_markdown(self, plots, self.recommended, self.fixed)

    def save(self, directory: str | Path) -> Path:
        """Write report.md and PNG plots (per-layer error, per-layer range) to `directory`;
        returns the report's path. After `recommend` they include the recommended policy and
        its verified run. Needs matplotlib."""
        from mixprec.doctor.report import save

        return save(self, directory)

    def __rich__(self) -> Any:
        from mixprec.doctor.report import rich_view

        return rich_view(self)

    def __str__(self) -> str:
        from mixprec.doctor.report import as_text

        return as_text(self)

    def __repr__(self) -> str:
        return (
            f"Diagnosis({self.precision.name} vs {self.reference.name}: "
            f"{sum(m.verdict == BROKEN for m in self.modules.values())} broken, "
            f"{sum(m.verdict == AT_RISK for m in self.modules.values())} at risk)"
        )


def _why_not(d: Diagnosis, tolerance: float) -> str:
    """Why a trial run does not pass yet, in a few words."""
    broken = [m for m in d.findings if m.verdict == BROKEN]
    if broken:
        return f"{broken[0].display_name} is broken"
    if not d.finite:
        return "the loss or a gradient is still not finite"
    return (
        f"loss error {d.loss_rel_error:.3g}, gradient error {d.grad_rel_error:.3g} "
        f"(tolerance {tolerance:g})"
    )


def _grad_amax(ref: Recording) -> float:
    """Largest gradient magnitude the reference run saw (activations and parameters)."""
    peaks = [s.grad_amax for s in ref.slots.values() if s.grad_amax is not None]
    peaks += [g.value.abs().amax() for g in ref.param_grads.values() if g is not None]
    return float(torch.stack([p.to("cpu") for p in peaks]).amax()) if peaks else 0.0


def diagnose(
    model: nn.Module,
    batch: Any,
    loss_fn: Callable[..., Tensor] | None = None,
    precision: Any = "16-mixed",
    reference: Any = "32-true",
    *,
    loss_scale: float | LossScaler | None = None,
    device: str | torch.device | None = None,
    seed: int = 0,
) -> Diagnosis:
    """Run `model` forward and backward once in `reference` and once in `precision` on
    copies of the same weights, and compare them module by module.

    As in the Trainer, a batch `(inputs..., target)` gives `loss_fn(model(*inputs), target)`;
    without `loss_fn`, a TrainingModule (any model with `training_step(batch, batch_idx)`)
    is asked for its loss, and any other model must return the loss (or a dict with
    "loss") from `model(batch)`.

    `loss_scale` is the scale the target's backward runs at: a number, a LossScaler (its
    current scale), or None for what a dynamic scaler starting at 2^16 settles at on this
    batch (1 when the policy needs no scaling).

    Dropout is off in both runs so they see the same network, and both start from the same
    RNG seed; the caller's RNG state is restored afterwards. The model itself is not
    touched: every run works on a deep copy (no hooks, no dtype, value or gradient changes
    on yours). `recommend` copies it again, so do not change it in between (it checks).
    A slow or unsupported precision only warns: numerics can be studied anywhere, so keep
    the batch small.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"diagnose needs an nn.Module, got {type(model).__name__}")
    where = torch.device(device) if device is not None else device_of(model)
    # "auto" means the fastest stable precision of the device the runs happen on
    target_map, ref_map = resolve_policy(precision, where), resolve_policy(reference, where)
    if device is not None and where != device_of(model):
        model = copy.deepcopy(model).to(where)  # the runs copy this one, not the caller's
    if device is not None:
        batch = map_tensors(lambda t: t.to(where), batch)
    session = _Session(model, batch, loss_fn, where, seed)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the reference may be slow here too: it is a probe
        ref = session.run(ref_map, None, 1.0)
    if not math.isfinite(ref.loss):
        raise ValueError(
            f"the reference run ({ref_map.name}) already gives a non-finite loss "
            f"({ref.loss}): the problem is not the precision; check the data and the model"
        )
    narrow = _range_dtype(target_map)
    recommended = _loss_scale_for(_grad_amax(ref), narrow) if target_map.needs_loss_scaling else 1.0
    if loss_scale is None:
        scale = min(DEFAULT_LOSS_SCALE, recommended) if target_map.needs_loss_scaling else 1.0
    elif isinstance(loss_scale, LossScaler):
        scale = loss_scale.loss_scale
    else:
        scale = float(loss_scale)
        if not scale > 0 or not math.isfinite(scale):
            raise ValueError(f"loss_scale must be a positive finite number, got {loss_scale}")
    target = session.run(target_map, ref, scale)
    return Diagnosis(session, target_map, ref_map, ref, target, scale, recommended)
