"""`search`: the format of each layer that least hurts the loss within a memory or speed
budget, verified by running the plan.

1. The layers (`units.find_units`) and the formats the device runs fast
   (`units.default_formats`, or the caller's list, checked against the hardware), with
   every argument (`inputs`).
2. Each (layer, format) built once by `apply`, its bytes weighed, its step timed, its
   damage scored against float32 on the search batches (`scoring`, `sensitivity`).
3. The assignment of least damage within the budget (`solver.solve`), written as a
   PolicyMap over the baseline policy (`verify`).
4. Verification (`verify`): the plan, the baseline, float32 and every uniform plan (one format
   everywhere it applies) converted and run on the evaluation batches; their losses, bytes
   and step times are what the report states. A plan whose loss misses the tolerance against
   the baseline has its layers' damages replaced by what each one alone measures on the
   same batches, when larger, and is solved again (`retries` times; a plan found before
   ends it), each attempt reported, the lowest measured loss kept; a uniform plan (the
   baseline and float32 among them) that fits and measured lower still is returned instead,
   the report saying so (`uniform_won`).
5. Optionally a short training run of the plan beside the baseline (`train_steps`), and the
   `SearchReport`.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import torch
from torch import Tensor, nn

from mixprec.hardware import DeviceInfo
from mixprec.optim.states import StateFormat
from mixprec.plan.budget import Budget
from mixprec.plan.inputs import SearchInputs, search_inputs
from mixprec.plan.measure import Trained, train
from mixprec.plan.report import SearchReport, UnitRow
from mixprec.plan.scoring import candidates, score
from mixprec.plan.verify import Verified, keep, limits_of, verify

__all__ = ["search"]

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
        batches: the batches sensitivities are measured on (a few suffice), each what
            ``loss_fn(model(*inputs), target)`` takes as ``(inputs..., target)``, or what a
            model that computes its own loss takes (Hugging Face, TrainingModule).
        budget: ``Budget(memory=0.5)``, ``{"speed": 0.7}`` or ``"memory=0.5"``: fractions of
            the baseline's bytes / step time, summed over the searched layers.
        formats: the formats each layer may take (policy names); default: float32, the
            baseline, bf16-true, int8 and int4 (groups 32, 128) on the baseline, 16-bit and
            float8 ones where the device runs them fast. The baseline is always one.
        baseline: the precision the plan departs from and is judged against (its loss is
            the one to keep within `tolerance`); other layers stay in it.
        count: ``"weights"`` (parameters and buffers) or ``"training"`` (also gradients,
            AdamW moments and Kahan buffers: `mixprec.plan.units`).
        states: with ``count="training"``, optimizer-state formats the searched layers'
            AdamW moments may take (``("int8", "int4")``, or one: ``"int8"``): each layer
            keeps the cheapest whose moment error after a few AdamW steps stays small
            (`mixprec.plan.state_choice`), its bytes counted so; the plan (and the uniform
            plans beside it) carry them as ``states`` rules.
        eval_batches: held-out batches the plans are verified on (default: `batches`).
        tolerance: the plan's loss may exceed the baseline's by this fraction.
        retries: solves again this many times with measured damages if the plan misses.
        train_steps: also train the plan and the baseline this many AdamW steps (`lr`), on
            `train_batches` in turn (default: `batches`), and compare their held-out losses.
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
    )
    return _run(s, started)


def _run(s: SearchInputs, started: float) -> SearchReport:
    """The phases in order, each one's seconds kept for the report: measure (candidates
    built and weighed), score, solve and verify (with retries), keep, train, report."""
    phases = dict.fromkeys(("candidates", "scores", "layer times", "solve", "verify", "train"), 0.0)
    # measure: every candidate built and weighed
    clock = time.perf_counter()
    reference, holders, rows, unit_states, base_bytes = candidates(s)
    phases["candidates"] = time.perf_counter() - clock
    # score: damages and times from the reference run, batch by batch
    ref_losses = score(s, reference, holders, rows, phases)
    del holders
    # solve and verify, retrying with measured damages; keep the lowest measured loss
    base_costs = {
        "memory": base_bytes,
        "speed": sum(r.options[s.base.name].seconds for r in rows),
    }
    limits = limits_of(s.budget, base_costs)
    verified = verify(s, rows, base_costs, phases, unit_states)
    keep(s, rows, verified, limits, phases)
    _why_kept(rows, s.names, s.budget.kinds[0])
    clock = time.perf_counter()
    trained = _train(s, verified)
    phases["train"] = time.perf_counter() - clock
    return _report(s, rows, verified, base_costs, limits, trained, ref_losses, phases, started)


def _train(s: SearchInputs, v: Verified) -> dict[str, Trained]:
    """The plan and the baseline each trained `train_steps` steps, when asked for."""
    if not s.train_steps:
        return {}
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
    }


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
    )


def _why_kept(rows: list[UnitRow], formats: list[str], kind: str) -> None:
    """For each layer left above a format cheaper by the budgeted cost (`kind`: bytes or
    seconds), note how much more that format would hurt it than the median layer, when
    clearly more (`WHY_RATIO`): the reason the search paid for it. A layer without such a note was
    kept because the budget had room, not because it is sensitive."""
    cost = "bytes" if kind == "memory" else "seconds"
    for fmt in formats:
        damages = sorted(r.options[fmt].damage for r in rows if fmt in r.options)
        if not damages:
            continue
        median = damages[len(damages) // 2]
        for r in rows:
            if fmt not in r.options or r.chosen == fmt:
                continue
            cheaper = getattr(r.options[fmt], cost) < getattr(r.options[r.chosen], cost)
            damage = r.options[fmt].damage
            ratio = damage / median if median > 0 else math.inf
            if cheaper and damage > 0 and ratio >= WHY_RATIO:
                r.why.append((fmt, ratio))
