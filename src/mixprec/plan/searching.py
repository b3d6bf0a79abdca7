"""`search`: the format of each layer that least hurts the loss within a memory or speed
budget, verified by running the plan.

1. The layers (`units.find_units`) and the formats the device runs fast
   (`units.default_formats`, or the caller's list, checked against the hardware), with
   every argument (`inputs`).
2. Each (layer, format) built once by `apply`, its bytes weighed, its step timed, its
   damage scored against float32 on the search batches (`scoring`, `sensitivity`); under
   ``batch_size``, each block's activation options measured at that batch
   (`activation_choice`).
3. The assignment of least damage within the budget (`solver.solve`), written as a
   PolicyMap over the baseline policy (`verify`).
4. Verification (`verify`): the plan, the baseline, float32 and every uniform plan (one format
   everywhere it applies) converted and run on the evaluation batches; their losses, bytes
   and step times are what the report states. A plan whose loss misses the tolerance against
   the baseline has its layers' damages replaced by what each one alone measures on the
   same batches, when larger, and is solved again (`retries` times; a plan found before
   ends it), each attempt reported, the lowest measured loss kept; a uniform plan (the
   baseline and float32 among them) that fits and measured lower still is returned instead,
   the report saying so (`uniform_won`); under ``count="training"`` one training fewer
   parameters (int8/int4 weights frozen) only when lower by more than the tolerance.
5. Optionally a short training run of the plan beside the baseline (`train_steps`; not run,
   the report saying why, when the plan leaves nothing to train), and the `SearchReport`.
"""

from __future__ import annotations

import copy
import math
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from mixprec.hardware import DeviceInfo
from mixprec.optim.states import StateFormat
from mixprec.plan.activation_choice import block_rows, layer_activations
from mixprec.plan.budget import Budget
from mixprec.plan.inputs import SearchInputs, search_inputs
from mixprec.plan.measure import Trained, convert, train, trainable_elements
from mixprec.plan.report import BlockRow, SearchReport, UnitRow
from mixprec.plan.scoring import candidates, score
from mixprec.plan.units import compensated, state_bytes
from mixprec.plan.verify import Verified, keep, limits_of, verify
from mixprec.policy.map import PolicyMap

__all__ = [
    "search",
]

# a layer is said to be kept for its sensitivity when a cheaper format would hurt it at least
# this many times the median layer's damage in that format
WHY_RATIO = 1.5


def search(
    model: nn.Module,
    batches: Iterable[Any],
    loss_fn: Callable[..., Tensor] | None = None,
    *,
    budget: Budget | Mapping[str, float] | str,
    formats: Sequence[Any] | None = None,
    baseline: Any = "bf16-mixed",
    count: str = "weights",
    batch_size: int | None = None,
    states: str | StateFormat | Sequence[str | StateFormat] | None = None,
    eval_batches: Iterable[Any] | None = None,
    tolerance: float = 0.01,
    retries: int = 2,
    train_steps: int = 0,
    train_batches: Iterable[Any] | None = None,
    lr: float = 1e-3,
    reps: int = 5,
    device: torch.device | str | None = None,
    device_info: DeviceInfo | None = None,
    allow_slow: bool = False,
    seed: int = 0,
) -> SearchReport:
    """Choose a format per layer for `model` (never changed) within `budget`, verified.

    Args:
        batches: the batches sensitivities are measured on (a few suffice): ``(inputs...,
            target)`` for ``loss_fn``, or what a model computing its own loss takes.
        budget: ``Budget(memory=0.5)``, ``{"speed": 0.7}`` or ``"memory=0.5"``: fractions of
            the baseline's bytes / step time over the searched layers (and blocks); or bytes
            for the whole model, ``"memory=2GiB"`` or ``Budget(memory_bytes=...)``.
        formats: the formats each layer may take (policy names), the baseline always one;
            default: those of docs/doctor.md ("Formats") the device runs fast.
        baseline: the precision the plan departs from and whose loss it is judged against.
        count: ``"weights"`` (parameters and buffers) or ``"training"`` (also gradients,
            AdamW moments and Kahan buffers: `mixprec.plan.units`).
        batch_size: with ``count="training"``, also count the activations a step saves at
            this batch and choose each block's activation option with the formats
            (`mixprec.plan.activation_choice`), carried as the plan's ``activations`` rules.
        states: with ``count="training"``, the state formats (``("int8", "int4")`` or ``"int8"``)
            the searched layers' AdamW moments may take, each the cheapest that stays accurate
            (`mixprec.plan.state_choice`): the plan and the uniform plans carry them as rules.
        eval_batches: held-out batches the plans are verified on (default: `batches`).
        tolerance: the plan's loss may exceed the baseline's by this fraction.
        retries: solves again this many times with measured damages if the plan misses.
        train_steps: also train the plan and the baseline this many AdamW steps (`lr`) on
            `train_batches` (default: `batches`), held out compared (`untrained`: why not).
        reps: timed repetitions per layer and per plan (medians).
        device_info: judge formats for a described device (`mixprec.hardware.DeviceInfo`).
        allow_slow: accept given formats the device runs far slower than float32.

    Raises `BudgetError` (naming the smallest reachable budget) when nothing fits.
    """
    started = time.perf_counter()
    s = search_inputs(
        model,
        batches,
        loss_fn,
        budget=budget,
        formats=formats,
        baseline=baseline,
        count=count,
        states=states,
        eval_batches=eval_batches,
        tolerance=tolerance,
        retries=retries,
        train_steps=train_steps,
        train_batches=train_batches,
        lr=lr,
        reps=reps,
        device=device,
        device_info=device_info,
        allow_slow=allow_slow,
        seed=seed,
        batch_size=batch_size,
    )
    return _run(s, started)


def _run(s: SearchInputs, started: float) -> SearchReport:
    """The phases in order, each one's seconds kept for the report: measure (candidates
    built and weighed), score, solve and verify (with retries), keep, train, report."""
    return planned(s, scored(s), started)


@dataclass
class Scored:
    """What a search measured before solving (`scored`): every layer's formats and every
    block's activation options with their costs and damages, the baseline's costs, the bytes
    no choice changes. `planned` solves it within a budget, as often as asked."""

    rows: list[UnitRow]
    blocks: list[BlockRow]
    unit_states: list[StateFormat | None] | None
    base_costs: dict[str, float]
    fixed: float
    ref_losses: list[float]
    phases: dict[str, float]


def scored(s: SearchInputs) -> Scored:
    """The measuring phases of a search: candidates built and weighed, scored and timed
    against float32, and (under ``batch_size``) the blocks' activation options."""
    phases = dict.fromkeys(("candidates", "scores", "layer times", "solve", "verify", "train"), 0.0)
    # measure: every candidate built and weighed
    clock = time.perf_counter()
    reference, holders, rows, unit_states, base_bytes = candidates(s)
    phases["candidates"] = time.perf_counter() - clock
    # score: damages and times from the reference run, batch by batch
    ref_losses = score(s, reference, holders, rows, phases)
    del holders
    # the blocks' activation options, measured at the batch
    clock = time.perf_counter()
    blocks, outside = block_rows(s, reference)
    layer_activations(s, rows, blocks)
    if s.batch_size is not None:
        phases["activations"] = time.perf_counter() - clock
    base_costs = {
        "memory": base_bytes + sum(b.options["keep"].bytes for b in blocks),
        "speed": sum(r.options[s.base.name].seconds for r in rows)
        + sum(b.options["keep"].seconds for b in blocks),
    }
    fixed = _fixed_bytes(s, unit_states) + outside
    return Scored(rows, blocks, unit_states, base_costs, fixed, ref_losses, phases)


def _fixed_bytes(s: SearchInputs, unit_states: list[StateFormat | None] | None) -> int:
    """Bytes of the parameters and buffers no unit holds, in the baseline, with the moments
    the plan's optimizer keeps: float32 under a low-bit state format anywhere (the low-bit
    optimizer's for parameters without one), else each parameter's dtype (torch's AdamW)."""
    model = convert(s.model, PolicyMap(s.base))
    formats = {} if unit_states is not None and any(f is not None for f in unit_states) else None
    modules = dict(model.named_modules())
    units = nn.ModuleList(modules[p] for u in s.units for p in u.paths)
    step = compensated(model)
    return state_bytes(model, s.count, formats, step) - state_bytes(units, s.count, formats, step)


def planned(s: SearchInputs, m: Scored, started: float) -> SearchReport:
    """Solve and verify `m` within `s.budget` (retrying with measured damages; the lowest
    measured loss kept), train when asked, and report. `m` is left as it was: each call
    works on its own copy of the rows, so one `Scored` serves several budgets."""
    rows, blocks = copy.deepcopy(m.rows), copy.deepcopy(m.blocks)
    phases = dict(m.phases)
    limits = limits_of(s.budget, m.base_costs, m.fixed)
    verified = verify(s, rows, m.base_costs, phases, m.unit_states, blocks, m.fixed)
    keep(s, rows, verified, limits, phases)
    for b, option in zip(blocks, verified.activations, strict=True):
        b.chosen = option
    _why_kept(rows, s.names, s.budget.kinds[0])
    clock = time.perf_counter()
    trained, untrained = _train(s, verified)
    phases["train"] = time.perf_counter() - clock
    report = _report(
        s,
        rows,
        verified,
        m.base_costs,
        limits,
        trained,
        m.ref_losses,
        phases,
        started,
        blocks,
        m.fixed,
    )
    report.untrained = untrained
    return report


def _train(s: SearchInputs, v: Verified) -> tuple[dict[str, Trained], str]:
    """The plan and the baseline each trained `train_steps` steps, when asked for; none
    when the plan leaves nothing to train (every trainable layer in a frozen int8/int4
    format), with why (the search's plan stands: a finished search is not thrown away)."""
    if not s.train_steps:
        return {}, ""
    if not trainable_elements(convert(s.model, v.plans["plan"])):
        why = (
            "every trainable layer quantized; int8/int4 weights are frozen"
            if any(p.requires_grad for p in s.model.parameters())
            else "the model has no parameter that requires grad"
        )
        return {}, f"train_steps={s.train_steps} not run: the plan leaves nothing to train ({why})"
    return {
        name: train(
            s.model,
            v.plans[name],
            s.train_batches,
            s.eval_batches,
            s.loss_fn,
            steps=s.train_steps,
            lr=s.lr,
            device=s.device,
            seed=s.seed,
        )
        for name in ("plan", "baseline")
    }, ""


def _report(
    s: SearchInputs,
    rows: list[UnitRow],
    v: Verified,
    base_costs: dict[str, float],
    limits: dict[str, float],
    trained: dict[str, Trained],
    ref_losses: list[float],
    phases: dict[str, float],
    started: float,
    blocks: list[BlockRow],
    fixed: float,
) -> SearchReport:
    return SearchReport(
        rows=rows,
        formats=s.names,
        left_out=s.left_out,
        baseline=s.base.name,
        budget=s.budget,
        count=s.count,
        base_costs=base_costs,
        limits=limits,
        policy=v.plans["plan"],
        measured=v.measured,
        attempts=v.attempts,
        tolerance=s.tolerance,
        held_out=s.held_out,
        trained=trained,
        reference_loss=sum(ref_losses) / len(ref_losses),
        device=s.info.describe(),
        seconds=time.perf_counter() - started,
        phases=phases,
        uniform_won=v.winner,
        blocks=blocks,
        batch_size=s.batch_size,
        fixed_bytes=int(fixed),
    )


def _why_kept(rows: list[UnitRow], formats: list[str], kind: str) -> None:
    """For each layer left above a format cheaper by the budgeted cost (`kind`: bytes or
    seconds), note how much more that format would hurt it than the median layer, when
    clearly more (`WHY_RATIO`), or that it overflows there: the reason the search paid for it.
    A layer without such a note was kept because the budget had room, not because it is
    sensitive."""
    cost = "counted_bytes" if kind == "memory" else "seconds"
    for fmt in formats:
        damages = sorted(r.options[fmt].damage for r in rows if fmt in r.options)
        if not damages:
            continue
        median = damages[len(damages) // 2]
        for r in rows:
            # (float32 won and put a layer whose weight is read outside it in float32, an
            # option its row lacks: no cost to weigh a cheaper format against)
            if fmt not in r.options or r.chosen == fmt or r.chosen not in r.options:
                continue
            cheaper = getattr(r.options[fmt], cost) < getattr(r.options[r.chosen], cost)
            damage = r.options[fmt].damage
            # (infinite damage: the format overflows in this layer, whatever the median)
            ratio = math.inf if damage == math.inf or median == 0 else damage / median
            if cheaper and damage > 0 and ratio >= WHY_RATIO:
                r.why.append((fmt, ratio))
