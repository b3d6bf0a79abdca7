"""`search`: the format of each layer that least hurts the loss within a memory or speed
budget, verified by running the plan.

1. The layers (`units.find_units`) and the formats the device runs fast
   (`units.default_formats`, or the caller's list, checked against the hardware).
2. Each (layer, format) built once by `apply`, its bytes weighed, its step timed, its
   damage scored against float32 on the search batches (`sensitivity`).
3. The assignment of least damage within the budget (`solver.solve`), written as a
   PolicyMap over the baseline policy.
4. Verification: the plan, the baseline, float32 and every uniform plan (one format
   everywhere it applies) converted and run on the evaluation batches; their losses, bytes
   and step times are what the report states. A plan whose loss misses the tolerance against
   the baseline has its layers' damages replaced by what each one alone measures on the
   same batches, when larger, and is solved again (`retries` times; a plan found before
   ends it), each attempt reported, the lowest measured loss kept; a uniform plan (the
   baseline and float32 among them) that fits and measured lower still is returned instead,
   the report saying so (`uniform_won`).
5. Optionally a short training run of the plan beside the baseline (`train_steps`).
"""

from __future__ import annotations

import math
import numbers
import re
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from mixprec.doctor.probe import seeded
from mixprec.doctor.running import loss_of
from mixprec.hardware import DeviceInfo, check, detect, device_of, parse_device
from mixprec.plan import sensitivity, solver
from mixprec.plan.measure import Measured, convert, eval_loss, measure_plans, train
from mixprec.plan.report import (
    Attempt,
    Option,
    SearchReport,
    UnitRow,
    costs_of,
    formats_of,
    within,
)
from mixprec.plan.state_choice import choose_states, holder_formats, with_states
from mixprec.plan.units import (
    COUNTS,
    Unit,
    candidate,
    default_formats,
    find_units,
    format_name,
    state_bytes,
    unit_applies,
)
from mixprec.policy import Policy, QuantizedPolicy, as_policy
from mixprec.policy_map import PolicyMap
from mixprec.precision import Precision

__all__ = ["Budget", "BudgetError", "search"]

BUDGET_KINDS = ("memory", "speed")
# a layer is said to be kept for its sensitivity when a cheaper format would hurt it at least
# this many times the median layer's damage in that format
WHY_RATIO = 1.5


class BudgetError(ValueError):
    """No plan fits the budget; the message names the smallest one reachable."""


@dataclass(frozen=True)
class Budget:
    """Fractions of the baseline's cost: ``memory`` of its bytes (as ``count`` counts them),
    ``speed`` of its time, both summed over the searched layers. One or both."""

    memory: float | None = None
    speed: float | None = None

    def __post_init__(self) -> None:
        for kind in BUDGET_KINDS:
            value = getattr(self, kind)
            if value is None:
                continue
            if isinstance(value, bool) or not isinstance(value, numbers.Real):
                raise TypeError(f"budget {kind} must be a number, got {value!r}")
            value = float(value)  # numpy's and other real numbers too, as one type
            object.__setattr__(self, kind, value)
            if not 0 < value < math.inf:
                raise ValueError(
                    f"budget {kind} must be a positive fraction of the baseline's "
                    f"{'bytes' if kind == 'memory' else 'time'} (e.g. 0.5), got {value!r}"
                )
        if self.memory is None and self.speed is None:
            raise ValueError("a budget needs memory=..., speed=... or both (e.g. memory=0.5)")

    @property
    def kinds(self) -> list[str]:
        return [k for k in BUDGET_KINDS if getattr(self, k) is not None]

    def describe(self) -> str:
        return ", ".join(f"{k} <= {getattr(self, k):g}x the baseline" for k in self.kinds)

    @classmethod
    def of(cls, value: Any) -> Budget:
        """A Budget from a Budget, a mapping (``{"memory": 0.5}``) or a string
        (``"memory=0.5"``, ``"memory=0.5,speed=1"``)."""
        if isinstance(value, Budget):
            return value
        if isinstance(value, str):
            items: dict[str, Any] = {}
            for part in filter(None, (p.strip() for p in value.split(","))):
                key, sep, number = part.partition("=")
                if key.strip() in items:
                    raise ValueError(f"budget {key.strip()!r} given twice in {value!r}")
                try:
                    items[key.strip()] = float(number) if sep else None
                except ValueError:
                    items[key.strip()] = number
            value = items
        if isinstance(value, Mapping):
            unknown = sorted(set(value) - set(BUDGET_KINDS))
            if unknown:
                raise ValueError(
                    f"unknown budget {', '.join(map(repr, unknown))}: a budget takes memory "
                    "and/or speed, fractions of the baseline's, e.g. {'memory': 0.5}"
                )
            return cls(**value)
        raise TypeError(
            "budget must be a Budget, a dict such as {'memory': 0.5} or a string such as "
            f"'memory=0.5'; got {type(value).__name__}"
        )


def _check_batches(batches: Any, what: str) -> list[Any]:
    if isinstance(batches, (Tensor, Mapping)) or not isinstance(batches, Iterable):
        raise TypeError(
            f"{what} must be a list of batches (e.g. [batch] for one), got {type(batches).__name__}"
        )
    out = list(batches)
    if not out:
        spent = " (an iterator, used up already?)" if iter(batches) is batches else ""
        raise ValueError(f"{what} is empty{spent}: the search needs at least one batch")
    return out


def _check_finite(float32_loss: float, where: str) -> None:
    """A float32 loss that is not finite leaves nothing to score or compare plans against."""
    if not math.isfinite(float32_loss):
        raise ValueError(
            f"the model's float32 loss on {where} is {float32_loss}: a search scores and "
            "verifies plans against float32, which needs a finite loss (check the batches "
            "and the model)"
        )


def _formats(
    formats: Sequence[Any] | None,
    baseline: Policy,
    info: DeviceInfo,
    allow_slow: bool,
) -> tuple[list[Policy], dict[str, str]]:
    """The formats to try (each checked on the device), and those left out with why."""
    if formats is None:
        names, left_out = default_formats(baseline, info)
    else:
        if isinstance(formats, (str, Policy)):
            formats = [formats]
        names, left_out = [], {}
        for spec in formats:
            name = format_name(spec)
            check(PolicyMap(name), allow_slow=allow_slow, info=info)
            if name not in names:
                names.append(name)
        if baseline.name not in names:
            names.append(baseline.name)  # every layer can stay as the baseline has it
    return [as_policy(n) for n in names], left_out


def _why_kept(rows: list[UnitRow], formats: list[str], kind: str) -> None:
    """For each layer left above a format cheaper by the budgeted cost (`kind`: bytes or
    seconds), note how much more that format would hurt it than the median layer, when
    clearly more (1.5x): the reason the search paid for it. A layer without such a note was
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


def _weight_dtype(holder: nn.ModuleList) -> torch.dtype | None:
    """The dtype a candidate stores its (first layer's) float weight in; None: it has none."""
    weight = getattr(holder[0], "weight", None)
    return weight.dtype if isinstance(weight, Tensor) else None


def _plan_map(
    baseline: Policy, units: list[Unit], chosen: list[str], states: list[Any] | None = None
) -> PolicyMap:
    rules = {}
    for unit, fmt in zip(units, chosen, strict=True):
        if fmt != baseline.name:
            for path in unit.paths + unit.aliases:
                rules[re.escape(path)] = fmt
    plan = PolicyMap(baseline, rules)
    return with_states(plan, units, states) if states is not None else plan


def search(
    model: nn.Module,
    batches: Iterable[Any],
    loss_fn: Callable[..., Tensor] | None = None,
    *,
    budget: Budget | Mapping[str, float] | str,
    formats: Sequence[Any] | None = None,
    baseline: Any = "bf16-mixed",
    count: str = "weights",
    states: Sequence[str] | None = None,
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
            AdamW moments may take (``("int8", "int4")``): each layer keeps the cheapest
            whose moment error after a few AdamW steps stays small
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
    if not isinstance(model, nn.Module):
        raise TypeError(f"search() takes an nn.Module, got {type(model).__name__}")
    meta = [n for n, t in [*model.named_parameters(), *model.named_buffers()] if t.is_meta]
    if meta:
        more = f" (and {len(meta) - 1} more)" if len(meta) > 1 else ""
        raise ValueError(
            f"{meta[0]}{more} is on the meta device, without values: a search runs the "
            "model, so give it one whose weights are loaded"
        )
    broken = [
        (n, int((~torch.isfinite(t)).sum()))
        for n, t in [*model.named_parameters(), *model.named_buffers()]
        if t.is_floating_point() and not bool(torch.isfinite(t).all())
    ]
    if broken:
        more = f" (and {len(broken) - 1} more tensors)" if len(broken) > 1 else ""
        raise ValueError(
            f"the model's {broken[0][0]} holds {broken[0][1]} inf/NaN value(s){more}: a search "
            "runs the model against float32 and quantizes its weights, which needs them finite "
            "(a diverged or corrupt checkpoint?)"
        )
    budget = Budget.of(budget)
    if count not in COUNTS:
        raise ValueError(f"count must be one of {', '.join(COUNTS)}, got {count!r}")
    if states is not None and count != "training":
        raise ValueError(
            f"states are optimizer-state formats, counted only under count='training' (got "
            f"count={count!r}); pass count='training' or leave states out"
        )
    for name, value, least in (
        ("retries", retries, 0),
        ("train_steps", train_steps, 0),
        ("reps", reps, 1),
    ):
        if isinstance(value, bool) or not isinstance(value, int) or value < least:
            raise ValueError(f"{name} must be an integer >= {least}, got {value!r}")
    if isinstance(tolerance, bool) or not (
        isinstance(tolerance, (int, float)) and 0 <= tolerance < math.inf
    ):
        raise ValueError(f"tolerance must be a non-negative number, got {tolerance!r}")
    if isinstance(lr, bool) or not (isinstance(lr, (int, float)) and 0 < lr < math.inf):
        raise ValueError(f"lr must be a positive number (the training run's), got {lr!r}")
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise ValueError(f"seed must be an integer, got {seed!r}")
    batches = _check_batches(batches, "batches")
    train_list = (
        batches if train_batches is None else _check_batches(train_batches, "train_batches")
    )
    held_out = eval_batches is not None
    eval_list = _check_batches(eval_batches, "eval_batches") if held_out else batches
    dev = parse_device(device) if device is not None else device_of(model)
    info = device_info or detect(dev)
    base = as_policy(baseline)
    if isinstance(base, QuantizedPolicy):
        raise ValueError(
            f"the baseline is the float precision a plan departs from (e.g. 'bf16-mixed'), "
            f"got the quantized {base.name!r}; put quantized formats in formats="
        )
    check(PolicyMap(base), allow_slow=allow_slow, info=info)
    policies, left_out = _formats(formats, base, info, allow_slow)
    units = find_units(model)
    if not units:
        raise ValueError(
            f"{type(model).__name__} has no layer a search can choose for (Linear, Embedding "
            "or Hugging Face Conv1D with a floating weight)"
        )

    # 2. candidates: built, weighed; inapplicable ones marked
    phases: dict[str, float] = {
        "candidates": 0.0,
        "scores": 0.0,
        "layer times": 0.0,
        "solve": 0.0,
        "verify": 0.0,
        "train": 0.0,
    }
    clock = time.perf_counter()
    reference = convert(model, PolicyMap("32-true"))
    unit_states = (
        choose_states(reference, units, batches, loss_fn, list(states), lr=lr)
        if states is not None
        else None
    )
    names = [p.name for p in policies]
    holders: list[list[nn.ModuleList | None]] = []
    rows: list[UnitRow] = []
    base_bytes = 0
    modules = dict(reference.named_modules())
    for unit in units:
        row = UnitRow(unit=unit)
        built: list[nn.ModuleList | None] = []
        for p in policies:
            reason = unit_applies(p, [modules[path] for path in unit.paths])
            if reason is not None:
                row.not_applicable[p.name] = reason
                built.append(None)
                continue
            holder = candidate(reference, unit, p)
            built.append(holder)
            formats = holder_formats(holder, unit_states[len(rows)]) if unit_states else None
            row.options[p.name] = Option(bytes=state_bytes(holder, count, formats))
            if p.name == base.name:  # the budget's reference keeps float32 states
                base_bytes += state_bytes(holder, count)
        holders.append(built)
        rows.append(row)

    # 3. damages and times from the reference run, batch by batch
    phases["candidates"] = time.perf_counter() - clock
    precision = Precision("32-true", device=dev)
    scores = [[sensitivity.Scores() for _ in policies] for _ in units]
    paths = [p for u in units for p in u.paths]
    training = count == "training"
    ref_losses = []
    for b, batch in enumerate(batches):
        clock = time.perf_counter()
        with seeded(seed, dev):  # the caller's RNG state is theirs
            loss, calls, read_outside = sensitivity.record(
                reference, paths, lambda batch=batch: loss_of(reference, precision, batch, loss_fn)
            )
        reference.zero_grad(set_to_none=True)
        _check_finite(loss, f"batches[{b}]")
        ref_losses.append(loss)
        for u, unit in enumerate(units):
            readers = [
                f"{p}'s weight is read by {read_outside[p]}"
                for p in unit.paths
                if p in read_outside
            ]
            base_dtype = _weight_dtype(holders[u][names.index(base.name)])
            for f, p in enumerate(policies):
                # a quantized layer has no float weight left for that reader, and the reader,
                # run as the baseline runs, needs the weight in the baseline's dtype
                if (
                    readers
                    and holders[u][f] is not None
                    and (
                        isinstance(p, QuantizedPolicy) or _weight_dtype(holders[u][f]) != base_dtype
                    )
                ):
                    holders[u][f] = None
                    rows[u].options.pop(p.name)
                    rows[u].not_applicable[p.name] = "; ".join(readers)
        for u, unit in enumerate(units):
            for f, holder in enumerate(holders[u]):
                if holder is not None:
                    sensitivity.score(holder, unit, calls, scores[u][f])
        phases["scores"] += time.perf_counter() - clock
        clock = time.perf_counter()
        for u, unit in enumerate(units):
            if b == 0:
                live = [h for h in holders[u] if h is not None]
                seconds = sensitivity.time_candidates(live, unit, calls, training, reps)
                for name, s in zip(
                    [n for n, h in zip(names, holders[u], strict=True) if h is not None],
                    seconds,
                    strict=True,
                ):
                    rows[u].options[name].seconds = s
        phases["layer times"] += time.perf_counter() - clock
        del calls
    for u, row in enumerate(rows):
        for f, name in enumerate(names):
            if name in row.options:
                row.options[name].damage = scores[u][f].damage
                row.options[name].taylor = scores[u][f].first_order
    del holders

    # 4. solve, verify, retry
    base_costs = {
        "memory": base_bytes,
        "speed": sum(r.options[base.name].seconds for r in rows),
    }
    limits = [getattr(budget, k) * base_costs[k] for k in budget.kinds]
    measured_damage: dict[tuple[int, str], float] = {}
    attempts: list[Attempt] = []
    plans: dict[str, PolicyMap] = {"float32": PolicyMap("32-true"), "baseline": PolicyMap(base)}
    for name in names:
        # the baseline is measured; float32 everywhere is the float32 row, norms aside; a
        # format no layer can take would only repeat the baseline
        if name not in (base.name, "32-true") and any(name in r.options for r in rows):
            plans[f"all {name}"] = _plan_map(
                base, units, [name if name in r.options else base.name for r in rows], unit_states
            )
    verified: dict[str, Measured] = {}

    def measure(todo: dict[str, PolicyMap], timed: set[str]) -> dict[str, Measured]:
        return measure_plans(
            model,
            todo,
            units,
            eval_list,
            loss_fn,
            count=count,
            training=training,
            reps=reps,
            device=dev,
            timed=timed,
            seed=seed,
        )

    tried: dict[tuple[str, ...], int] = {}  # plan -> its attempt
    best: tuple[Attempt, Measured, PolicyMap] | None = None
    clock = time.perf_counter()
    for attempt in range(retries + 1):
        damages = [
            [
                measured_damage.get((u, n), r.options[n].damage) if n in r.options else math.inf
                for n in names
            ]
            for u, r in enumerate(rows)
        ]
        costs = [
            [
                [
                    (r.options[n].bytes if k == "memory" else r.options[n].seconds)
                    if n in r.options
                    else math.inf
                    for n in names
                ]
                for r in rows
            ]
            for k in budget.kinds
        ]
        solving = time.perf_counter()
        picked = solver.solve(damages, costs, limits)
        phases["solve"] += time.perf_counter() - solving
        if picked is None:
            raise BudgetError(_too_small(budget, rows, names, base_costs))
        chosen = tuple(names[f] for f in picked)
        if chosen in tried:
            attempts[-1].note = (
                f"solved again with the measured damages: the same plan as attempt "
                f"{tried[chosen] + 1}; stopped"
            )
            break
        tried[chosen] = attempt
        plans["plan"] = _plan_map(base, units, list(chosen), unit_states)
        # the first attempt measures every plan, a retry the new plan beside the baseline
        todo = plans if not verified else {k: plans[k] for k in ("plan", "baseline")}
        # uniform plans are timed only when time is budgeted (each is a whole model)
        timed = set(todo) if budget.speed is not None else {"plan", "baseline", "float32"}
        verified.update(measure(todo, timed & set(todo)))
        _check_finite(verified["float32"].loss, "eval_batches" if held_out else "batches")
        plan_loss, base_loss = verified["plan"].loss, verified["baseline"].loss
        gap = (plan_loss - base_loss) / max(abs(base_loss), 1e-12)
        predicted = sum(
            r.options[c].damage + r.options[c].taylor for r, c in zip(rows, chosen, strict=True)
        )
        attempts.append(Attempt(chosen=list(chosen), loss=plan_loss, gap=gap, predicted=predicted))
        if best is None or plan_loss < best[0].loss:
            best = (attempts[-1], verified["plan"], plans["plan"])
        if gap <= tolerance or attempt == retries:
            break
        # the plan missed: what does each layer it moved cost the loss alone (measured on
        # the batches the miss was measured on)? Larger than predicted: the damage it takes
        found = 0
        for u, (unit, fmt) in enumerate(zip(units, chosen, strict=True)):
            if fmt in ("32-true", base.name) or (u, fmt) in measured_damage:
                continue
            alone = _alone_damage(
                model, unit, fmt, eval_list, loss_fn, dev, seed, verified["float32"].loss
            )
            if alone > rows[u].options[fmt].damage:
                measured_damage[(u, fmt)] = alone
                found += 1
        attempts[-1].note = f"missed; {found} layer(s) measured alone hurt more than predicted"
        if not found:
            attempts[-1].note += ": nothing to re-solve with; stopped"
            break
    phases["verify"] += time.perf_counter() - clock - phases["solve"]
    assert best is not None
    kept, verified["plan"], plans["plan"] = best
    chosen = tuple(kept.chosen)
    limit_of = dict(zip(budget.kinds, limits, strict=True))
    won = _uniform_winner(verified, rows, base.name, names, limit_of)
    winner: str | None = None
    if won is None:
        kept.kept = True
    else:
        winner, formats_won = won
        plans["plan"], chosen = plans[winner], tuple(formats_won)
        if verified[winner].seconds is None:  # uniform plans are timed under speed budgets only
            clock = time.perf_counter()
            verified.update(
                measure({k: plans[k] for k in ("plan", "baseline")}, {"plan", "baseline"})
            )
            phases["verify"] += time.perf_counter() - clock
        else:
            verified["plan"] = verified[winner]
    for u, r in enumerate(rows):
        r.chosen = chosen[u]
        for (v, fmt), value in measured_damage.items():
            if v == u:
                r.options[fmt].measured_damage = value
    _why_kept(rows, names, budget.kinds[0])

    trained = {}
    clock = time.perf_counter()
    if train_steps:
        for name in ("plan", "baseline"):
            trained[name] = train(
                model,
                plans[name],
                train_list,
                eval_list,
                loss_fn,
                steps=train_steps,
                lr=lr,
                device=dev,
                seed=seed,
            )
    return SearchReport(
        rows=rows,
        formats=names,
        left_out=left_out,
        baseline=base.name,
        budget=budget,
        count=count,
        base_costs=base_costs,
        limits=limit_of,
        policy=plans["plan"],
        measured=verified,
        attempts=attempts,
        tolerance=tolerance,
        held_out=held_out,
        trained=trained,
        reference_loss=sum(ref_losses) / len(ref_losses),
        device=info.describe(),
        seconds=time.perf_counter() - started,
        phases={**phases, "train": time.perf_counter() - clock},
        uniform_won=winner,
    )


def _uniform_winner(
    verified: dict[str, Measured],
    rows: list[UnitRow],
    baseline: str,
    names: list[str],
    limits: dict[str, float],
) -> tuple[str, list[str]] | None:
    """The measured plan other than the solved one (a uniform plan, the baseline, float32
    when it is one of the formats) that fits the budget with the lowest loss, if that loss
    is below the solved plan's: the damages the solver adds up are predictions, the losses
    measured. Returned with the format of each layer in it."""
    winner, lowest = None, verified["plan"].loss
    for name, measured in verified.items():
        formats = formats_of(name, rows, baseline, names) if name != "plan" else None
        if formats is None or within(costs_of(measured, rows, formats), limits) is not True:
            continue
        if measured.loss < lowest:
            winner, lowest = (name, formats), measured.loss
    return winner


def _alone_damage(
    model: nn.Module,
    unit: Unit,
    fmt: str,
    batches: list[Any],
    loss_fn: Any,
    device: torch.device,
    seed: int,
    float32_loss: float,
) -> float:
    """The loss change of float32 `model` with only `unit` in `fmt`, on `batches` (whose
    float32 loss is `float32_loss`)."""
    rules = {re.escape(p): fmt for p in unit.paths + unit.aliases}
    policy = PolicyMap("32-true", rules)
    m = convert(model, policy)
    precision = Precision(policy, device=device)
    return eval_loss(m, precision, batches, loss_fn, seed=seed, device=device) - float32_loss


def _too_small(
    budget: Budget, rows: list[UnitRow], names: list[str], base_costs: dict[str, float]
) -> str:
    """Why no plan fits: the smallest fraction reachable for each budget on its own, and the
    formats that reach it."""
    parts, reachable = [], []
    for k in budget.kinds:
        key = "bytes" if k == "memory" else "seconds"
        least, fmts = 0.0, set()
        for r in rows:
            lowest = min(getattr(o, key) for o in r.options.values())
            least += lowest
            fmts |= {n for n, o in r.options.items() if getattr(o, key) == lowest}
        frac = least / base_costs[k]
        reachable.append(frac <= getattr(budget, k))
        parts.append(
            f"{k} <= {getattr(budget, k):g}x the baseline: the smallest reachable is "
            f"{math.ceil(frac * 1000) / 1000:g}x (each layer in its cheapest format: "
            f"{', '.join(sorted(fmts))})"
        )
    both = " (each is reachable alone, not both together)" if all(reachable) else ""
    return (
        "no plan fits the budget "
        + "; ".join(parts)
        + both
        + f". Formats tried: {', '.join(names)}; add cheaper ones with formats=[...] or "
        "raise the budget"
    )
