"""`fit`: the plan of least loss whose training step, measured, fits a memory budget in bytes.

A search (`mixprec.plan.search`, ``count="training"`` at the batch of the batches given)
counts parameters, gradients, optimizer states and saved activations; a step also holds
temporaries the count does not see (the backward's intermediate gradients, the loss's own
tensors, a recomputed block's forward). So each plan is *measured*: `measure` runs it (in a
fresh process, where the caller's CLI spawns one) and returns its peak. While the plan's
peak is over the budget, the search solves again within a budget lowered by the overshoot
(the measured peak less the counted bytes), the next cheaper plan, up to `MAX_STEPS` times.
The plan that fits (else the first) is measured beside its uniform activation plans (its
formats, every block in one option), and so are the plans of one format the search
verifies (float32, the baseline, each format everywhere; those over the budget with every
block in each option too): the search's loss is before training, and frozen int8/int4
weights may train to a worse one. When no solved plan fits, the smallest plan (each layer
and block in its cheapest option) and its uniform activation plans are measured too. Of
all measured that fit, the one of least loss after the steps is returned; when none fits,
the report says by how many bytes the smallest measured peak is over. Each plan measured
is counted as the search counts the plans it verifies (`_counter`): in its own formats and
activation options, never below what its parameters, gradients and states hold.

`step_peaks` is the measurement: the parameters' bytes plus the tensor peak
(`mixprec.memory.measured`) of building AdamW and running ``steps`` training steps, with
Python's cycle collector stopped so that the peak does not depend on what ran before, and
the loss on the batch afterwards.
"""

from __future__ import annotations

import copy
import dataclasses
import gc
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from mixprec.convert import apply
from mixprec.memory import measured
from mixprec.plan.activation_choice import (
    batch_at,
    batch_rows,
    plan_activations,
    saved_under,
    split_saved,
)
from mixprec.plan.budget import Budget, BudgetError, parse_bytes
from mixprec.plan.inputs import SearchInputs, search_inputs
from mixprec.plan.measure import convert, held_bytes
from mixprec.plan.report import SearchReport, ranked
from mixprec.plan.searching import Scored, planned, scored
from mixprec.plan.units import describe_bytes, state_bytes
from mixprec.plan.verify import extra_bytes, plan_map, uniform_plans
from mixprec.policy.map import PolicyMap
from mixprec.precision import Precision
from mixprec.step import backward, batch_loss, fresh, seeded
from mixprec.tree import iter_tensors

__all__ = [
    "FitReport",
    "Peak",
    "Tried",
    "fit",
    "step_peaks",
]

# how many times a plan over the budget is replaced by the next cheaper one
MAX_STEPS = 6


@dataclass(frozen=True)
class Peak:
    """One plan's measured training step: bytes at its peak (parameters and buffers, the
    batch, and the tensor peak of the step), and the loss on the batch after the steps."""

    bytes: int
    loss: float


@dataclass
class Tried:
    """A plan measured: its name ("plan 1", "all fp8", "smallest"), policy, the bytes the
    search counted for it, its measured peak and loss, and whether the peak fits."""

    name: str
    policy: PolicyMap
    counted: int
    peak: int
    loss: float
    fits: bool


@dataclass
class FitReport:
    """What `fit` found.

    Attributes:
        budget: the budget, in bytes.
        batch_size: the batch the plans were counted and measured at.
        tried: every plan measured, in order: the solved plans stepping down, the uniform
            activation plans of the one that fit (when none did: of the first), the plans
            of one format ("float32", "all <format>", "<those> with all fp8"), and when no
            solved plan fit, "smallest" and "smallest with all <option>".
        chosen: the plan returned (the least loss among those that fit), None when none fits.
        search: the search report of the solved plan the chosen one is, or takes the
            formats of (None when none does: a plan of one format or the smallest chosen,
            or nothing fits).
    """

    budget: int
    batch_size: int
    tried: list[Tried] = field(default_factory=list)
    chosen: Tried | None = None
    search: SearchReport | None = None

    @property
    def over(self) -> int | None:
        """When nothing fits: by how many bytes the smallest measured peak exceeds the budget
        (None when a plan fits)."""
        if self.chosen is not None:
            return None
        return min(t.peak for t in self.tried) - self.budget

    def summary(self) -> str:
        """A line per plan measured, and the verdict."""
        lines = [
            f"budget {describe_bytes(self.budget)} ({self.budget} bytes) for one training step "
            f"at batch {self.batch_size}, each plan measured:"
        ]
        for t in self.tried:
            mark = "fits" if t.fits else f"over by {t.peak - self.budget} bytes"
            lines.append(
                f"  {t.name}: peak {describe_bytes(t.peak)} (counted "
                f"{describe_bytes(t.counted)}), loss {t.loss:.6g}, {mark}"
            )
        if self.chosen is None:
            lines.append(
                f"no plan fits: the smallest measured is {self.over} bytes "
                f"({describe_bytes(self.over or 0)}) over the budget"
            )
        else:
            acts = self.chosen.policy.activations
            lines.append(
                f"chosen: {self.chosen.name}, peak {describe_bytes(self.chosen.peak)} <= "
                f"{describe_bytes(self.budget)}; activations: "
                f"{acts.spec() if acts is not None else 'keep'}"
            )
        return "\n".join(lines)


# measures a list of plans, each on the model and batch `fit` was given, in order
Measure = Callable[[list[PolicyMap]], list[Peak]]
# the bytes the search counts for a plan (`_counter`)
Count = Callable[[PolicyMap], int]


def fit(
    model: nn.Module,
    batches: Iterable[Any],
    loss_fn: Callable[..., Any] | None,
    *,
    budget: int | str,
    measure: Measure,
    **search_args: Any,
) -> FitReport:
    """The plan of least loss whose measured step fits `budget` (bytes, or a size such as
    ``"4GiB"``), searched at the batch of `batches` (see the module's docstring).
    `measure` runs plans and returns their `Peak`s (`step_peaks`, in a fresh process);
    `search_args` go to the search (formats, baseline, eval_batches, device, ...)."""
    limit = Budget(memory_bytes=parse_bytes(budget) if isinstance(budget, str) else budget)
    assert limit.memory_bytes is not None
    batches = list(batches)
    started = time.perf_counter()
    s = search_inputs(
        model,
        batches,
        loss_fn,
        **{**_SEARCH_DEFAULTS, **search_args},
        budget=limit,
        count="training",
        batch_size=_batch_size(batches),
    )
    assert s.batch_size is not None
    m = scored(s)
    count = _counter(s, m)
    report = FitReport(budget=limit.memory_bytes, batch_size=s.batch_size)
    target = limit.memory_bytes
    first: tuple[Tried, SearchReport] | None = None  # the search's first (least loss)
    for step in range(1, MAX_STEPS + 1):
        try:
            found = planned(dataclasses.replace(s, budget=Budget(memory_bytes=target)), m, started)
        except BudgetError:
            break
        counted = found.total_bytes
        peak = measure([found.policy])[0]
        tried = Tried(f"plan {step}", found.policy, counted, peak.bytes, peak.loss, False)
        tried.fits = peak.bytes <= report.budget
        report.tried.append(tried)
        first = first or (tried, found)
        if tried.fits:
            report.chosen, report.search = tried, found
            break
        # the next cheaper plan: the overshoot taken off what the search may count
        target = min(counted - 1, report.budget - (peak.bytes - counted))
        if target <= 0:
            break
    solved = report.chosen
    # the plan that fits, else the first (least-loss formats), with every block in one option
    if solved is not None:
        assert report.search is not None
        _against_uniform(report, m, measure, count, solved, report.search)
    elif first is not None:
        _against_uniform(report, m, measure, count, *first)
    # the search's loss is before training: a plan of one format may train to a lower one
    _against_formats(report, s, m, measure, count)
    if solved is None:
        # nothing solved fits: the smallest plan, and its formats with every block in one
        # option (its cheapest option per block by count need not peak lowest)
        policy = _smallest(s.base, s.units, m)
        (smallest,) = _measure_new(report, measure, count, [("smallest", policy)], None, True)
        _against_uniform(report, m, measure, count, smallest, None, f"{smallest.name} with ")
    return report


# the search's defaults a fit changes: one verification attempt is enough, the measured
# peak and loss decide
_SEARCH_DEFAULTS: dict[str, Any] = {
    "formats": None,
    "baseline": "bf16-mixed",
    "states": None,
    "eval_batches": None,
    "tolerance": 0.01,
    "retries": 0,
    "train_steps": 0,
    "train_batches": None,
    "lr": 1e-3,
    "reps": 3,
    "device": None,
    "device_info": None,
    "allow_slow": False,
    "seed": 0,
}


def _batch_size(batches: Sequence[Any]) -> int:
    """The rows of the first batch, the batch a fit counts and measures at."""
    rows = batch_rows(batches[0]) if batches else None
    if rows is None:
        raise ValueError(
            "fit measures a training step at the batch of the batches given: give at least "
            "one batch holding a tensor with a batch dimension"
        )
    return rows


def _smallest(base: Any, units: list[Any], m: Scored) -> PolicyMap:
    """Each layer and block in its cheapest option by bytes."""
    formats = [min(r.options, key=lambda n, r=r: r.options[n].counted_bytes) for r in m.rows]
    options = {b.path: min(b.options, key=lambda o, b=b: b.options[o].bytes) for b in m.blocks}
    return plan_map(base, units, formats, m.unit_states, options)


def _counter(s: SearchInputs, m: Scored) -> Count:
    """The bytes the search counts for a plan it verifies (`verify`), for any plan: its
    searched layers' and whole model's bytes in its own formats, and what its forward saves
    at the batch in its own dtypes and options. The blocks' rows count activations in the
    baseline's dtypes: added to a plan of other formats (int8 weights, frozen, save less)
    they miscount it, below what its weights alone hold."""
    assert s.batch_size is not None  # (a fit counts at the batch of its batches)
    paths = [b.path for b in m.blocks]
    big = batch_at(s.batches[0], s.batch_size)

    def count(policy: PolicyMap) -> int:
        unit, whole = held_bytes(convert(s.model, policy), policy, s.units, s.count)
        saved = saved_under(s.model, policy, big, s.loss_fn, s.device, s.seed)
        inside, outside = split_saved(saved, paths)
        return int(unit + inside + extra_bytes(whole, unit, outside, m.fixed) + m.fixed)

    return count


def _against_uniform(
    report: FitReport,
    m: Scored,
    measure: Measure,
    count: Count,
    base: Tried,
    found: SearchReport | None,
    prefix: str = "",
) -> None:
    """Measure ``base``'s formats (a plan the search ``found``) with every block in one
    option ("all fp8", after `prefix`), each counted by `count`; one that fits with a lower
    loss than the plan chosen so far (or the first that fits, none being chosen) is chosen
    instead. With a `prefix`, a policy measured before is not measured again (without one,
    the plan's own variants are measured together, its "all keep" again beside them)."""
    options = sorted({o for b in m.blocks for o in b.options}, key=_ORDER.index)
    if not options:  # no block saves anything: no activation plan to compare
        return
    named = [(f"{prefix}all {o}", _with_activations(base.policy, m, o)) for o in options]
    _measure_new(report, measure, count, named, found, again=not prefix)


def _measure_new(
    report: FitReport,
    measure: Measure,
    count: Count,
    named: list[tuple[str, PolicyMap]],
    found: SearchReport | None,
    again: bool = False,
) -> list[Tried]:
    """Measure the (name, policy) pairs in one call, those measured before left out unless
    `again`, each counted by `count` and added to ``report.tried``; one that fits with a
    lower loss than the plan chosen so far is chosen (its search: `found`). Returns them."""
    if not again:
        seen = [t.policy for t in report.tried]
        named = [(n, p) for i, (n, p) in enumerate(named) if p not in seen + _policies(named[:i])]
    if not named:
        return []
    peaks = measure([p for _, p in named])
    out = []
    for (name, policy), peak in zip(named, peaks, strict=True):
        t = Tried(name, policy, count(policy), peak.bytes, peak.loss, False)
        t.fits = peak.bytes <= report.budget
        report.tried.append(t)
        out.append(t)
        if t.fits and (report.chosen is None or ranked(t.loss) < ranked(report.chosen.loss)):
            report.chosen, report.search = t, found
    return out


def _against_formats(
    report: FitReport, s: SearchInputs, m: Scored, measure: Measure, count: Count
) -> None:
    """Measure the uniform plans the search verifies (the baseline, float32 when it is one
    of the formats, as the search lets it win, each format everywhere it applies) with
    every activation kept, and those over the budget with every block in each other
    option unless its loss is no lower than the plan chosen so far; one that fits at a lower
    loss than that plan is chosen (its search: none). A plan measured before is not
    measured again."""
    plans = [
        (name, policy)
        for name, policy in uniform_plans(s, m.rows, m.unit_states).items()
        if name != "float32" or "32-true" in s.names
    ]
    _measure_new(report, measure, count, plans, None)
    for name, policy in plans:
        # (measured now, or before under another name)
        t = next(t for t in report.tried if t.policy == policy)
        # (a plan at no lower a loss than the chosen one's, every activation kept, left:
        # recomputing changes no loss, storing in bf16/fp8 changes it by their rounding)
        beaten = report.chosen is not None and ranked(t.loss) >= ranked(report.chosen.loss)
        if not t.fits and not beaten:
            _against_uniform(report, m, measure, count, t, None, f"{name} with ")


def _policies(named: list[tuple[str, PolicyMap]]) -> list[PolicyMap]:
    return [p for _, p in named]


_ORDER = ("keep", "bf16", "fp8", "checkpoint", "selective", "offload")


def _with_activations(policy: PolicyMap, m: Scored, option: str) -> PolicyMap:
    """`policy` with every block (that can take it) in `option`."""
    given = {b.path: option for b in m.blocks if option in b.options}
    return policy.replace(activations=plan_activations(given))


def _without_collector(run: Callable[[], Any]) -> Any:
    """``run()`` with Python's cycle collector stopped (after one collection): where it
    would run depends on every object the process made before, so the same step would peak
    differently from one process to the next; stopped, cyclic garbage waits to the end, and
    the peak is the same each time and never below what a collection could make it."""
    gc.collect()
    enabled = gc.isenabled()
    gc.disable()
    try:
        return run()
    finally:
        if enabled:
            gc.enable()


def _held_bytes(batch: Any) -> int:
    """Bytes of `batch`'s tensors, each storage once. Given the step's own copy (`fresh`):
    a batch sliced from a larger tensor (``data[:128]``) is held as its rows, not as the
    whole storage it views."""
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage() for t in iter_tensors(batch)}
    return sum(s.nbytes() for s in storages.values())


def step_peaks(
    model: nn.Module,
    batch: Any,
    loss_fn: Callable[..., Any] | None,
    plans: Sequence[PolicyMap],
    *,
    device: torch.device | str | None = None,
    steps: int = 2,
    lr: float = 1e-3,
    seed: int = 0,
) -> list[Peak]:
    """Each plan's `Peak`: a copy of `model` converted to it (parameters and buffers
    counted), the batch (made before the measured window, so counted apart: a step holds
    it), then the tensor peak of AdamW built and `steps` training steps on `batch` (16-bit
    weights with Kahan compensation, as the search's training run), and the loss after."""
    dev = torch.device(device) if device is not None else next(model.parameters()).device
    batch_bytes = _held_bytes(fresh(batch))
    out = []
    for plan in plans:
        with seeded(seed, dev):
            trained = copy.deepcopy(model).train()
            apply(trained, plan, warn=False)
            held = state_bytes(trained, "weights")
            sixteen = any(
                p.dtype in (torch.bfloat16, torch.float16)
                for p in trained.parameters()
                if p.requires_grad
            )
            # the activation options are on the model (`apply`); the step needs the rest
            precision = Precision(
                plan.replace(activations=None),
                device=dev,
                allow_slow=True,
                compensation="kahan" if sixteen else None,
            )

            # each step's copy of the batch made before the measured window, as the batch
            # itself was (counted apart: ``batch_bytes``)
            copies = [fresh(batch) for _ in range(steps)]

            def work(
                trained: nn.Module = trained, precision: Precision = precision, copies=copies
            ) -> None:
                params = [p for p in trained.parameters() if p.requires_grad]
                optimizer = torch.optim.AdamW(params, lr=lr)
                model_, optimizer = precision.setup(trained, optimizer, convert=False)
                for copy in copies:
                    loss = batch_loss(precision, model_, copy, loss_fn)
                    backward(precision, loss)
                    precision.step(optimizer)
                    optimizer.zero_grad(set_to_none=True)

            _, peak = _without_collector(lambda: measured(dev, work))
            trained.eval()
            with torch.no_grad():
                loss = float(batch_loss(precision, trained, fresh(batch), loss_fn))
        out.append(Peak(bytes=held + batch_bytes + peak, loss=loss))
    return out
