"""A search's later phases: the assignment of least damage within the budget solved
(`solve`), written as a plan and run beside the baseline, float32 and every uniform plan
(`verify`); a plan that misses the tolerance has its layers' damages replaced by what each
one alone measures, when larger, and is solved again. The lowest measured loss that fits is
kept (`keep`), a uniform plan's included. Under ``batch_size`` each block's activation option
(`activation_choice`) is solved with the formats, one knapsack, and the plan carries it."""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field

from mixprec.optim.states import StateFormat
from mixprec.plan import solver
from mixprec.plan.activation_choice import (
    batch_at,
    plan_activations,
    saved_under,
    split_saved,
    tie_costs,
    tie_weight,
)
from mixprec.plan.budget import Budget, BudgetError
from mixprec.plan.inputs import SearchInputs, check_finite
from mixprec.plan.measure import Measured, convert, eval_loss, measure_plans
from mixprec.plan.report import (
    Attempt,
    BlockRow,
    UnitRow,
    costs_of,
    formats_of,
    ranked,
    within,
)
from mixprec.plan.state_choice import with_states
from mixprec.plan.units import Unit, path_rule
from mixprec.policy import Policy
from mixprec.policy.map import PolicyMap
from mixprec.precision import Precision

__all__: list[str] = []


@dataclass
class Verified:
    """Every attempt and measured plan of a search; ``plans["plan"]`` and
    ``measured["plan"]`` are the kept plan once `keep` has run."""

    plans: dict[str, PolicyMap]
    measured: dict[str, Measured] = field(default_factory=dict)
    attempts: list[Attempt] = field(default_factory=list)
    # (layer, format) -> its damage measured alone, where larger than predicted
    measured_damage: dict[tuple[int, str], float] = field(default_factory=dict)
    best: Attempt | None = None  # the solved plan of lowest measured loss
    winner: str | None = None  # the uniform plan returned instead of it, if one
    activations: tuple[str, ...] = ()  # the kept plan's option per block


def limits_of(budget: Budget, base_costs: dict[str, float], fixed: float = 0.0) -> dict[str, float]:
    """Each budgeted kind's limit in bytes or seconds, on what the search chooses: a memory
    budget in bytes less the `fixed` bytes (what no choice changes)."""
    return {
        k: budget.memory_bytes - fixed
        if k == "memory" and budget.memory_bytes is not None
        else getattr(budget, k) * base_costs[k]
        for k in budget.kinds
    }


def verify(
    s: SearchInputs,
    rows: list[UnitRow],
    base_costs: dict[str, float],
    phases: dict[str, float],
    states: list[StateFormat | None] | None = None,
    blocks: list[BlockRow] | None = None,
    fixed: float = 0.0,
) -> Verified:
    """Solve, run the plan (and, the first time, every other plan), and retry with measured damages
    while the plan misses the tolerance; the lowest measured solved plan is left as
    ``plans["plan"]``. `states`: each layer's optimizer-state formats, carried by every
    plan; `blocks`: the activation options of each block (their bytes and seconds are the
    counted ones, added to each plan's measured costs); `fixed`: bytes no choice changes.
    Adds seconds to ``phases["solve"]`` and ``phases["verify"]``."""
    blocks = blocks or []
    limits = list(limits_of(s.budget, base_costs, fixed).values())
    kinds = list(limits_of(s.budget, base_costs, fixed))
    # a fraction's limit is in bytes too (of the baseline's searched part): retried alike
    memory_at = kinds.index("memory") if "memory" in kinds else None
    v = Verified(plans=uniform_plans(s, rows, states))
    tried: dict[tuple[str, ...], int] = {}  # plan -> its attempt
    best: tuple[Attempt, Measured, PolicyMap, tuple[str, ...], int] | None = None
    clock = time.perf_counter()
    for attempt in range(s.retries + 1):
        chosen, options = _solve(
            s, rows, v.measured_damage, limits, base_costs, phases, blocks, fixed
        )
        if chosen + options in tried:
            v.attempts[-1].note = (
                f"solved again with the measured damages: the same plan as attempt "
                f"{tried[chosen + options] + 1}; stopped"
            )
            break
        tried[chosen + options] = attempt
        v.plans["plan"] = plan_map(
            s.base,
            s.units,
            list(chosen),
            states,
            dict(zip([b.path for b in blocks], options, strict=True)),
        )
        # the first attempt measures every plan, a retry the new plan beside the baseline
        todo = v.plans if not v.measured else {k: v.plans[k] for k in ("plan", "baseline")}
        # uniform plans are timed only when time is budgeted (each is a whole model)
        timed = set(todo) if s.budget.speed is not None else {"plan", "baseline", "float32"}
        v.measured.update(_measure(s, todo, timed & set(todo)))
        _count(s, v, list(todo), blocks, options, fixed)
        check_finite(v.measured["float32"].loss, "eval_batches" if s.held_out else "batches")
        plan_loss, base_loss = v.measured["plan"].loss, v.measured["baseline"].loss
        gap = (plan_loss - base_loss) / max(abs(base_loss), 1e-12)
        predicted = sum(
            r.options[c].damage + r.options[c].taylor for r, c in zip(rows, chosen, strict=True)
        )
        v.attempts.append(
            Attempt(chosen=list(chosen), loss=plan_loss, gap=gap, predicted=predicted)
        )
        over = _bytes_over(v.measured["plan"], limits, memory_at)
        # the lowest measured loss, a plan within the byte limit before any over it
        if best is None or (over > 0, ranked(plan_loss)) < (best[4] > 0, ranked(best[0].loss)):
            best = (v.attempts[-1], v.measured["plan"], v.plans["plan"], options, over)
        if over and attempt < s.retries:
            missed = _learn_miss(rows, chosen, blocks, options, v.measured["plan"], s.base.name)
            v.attempts[-1].note = (
                f"measured {over} bytes over the byte limit: its layers' activations came to "
                f"{missed} bytes more than counted, now counted on the layers it moved; "
                "solved again"
            )
            continue
        if gap <= s.tolerance or attempt == s.retries:
            break
        found = _measure_alone(s, rows, chosen, v)
        v.attempts[-1].note = f"missed; {found} layer(s) measured alone hurt more than predicted"
        if not found:
            v.attempts[-1].note += ": nothing to re-solve with; stopped"
            break
    phases["verify"] += time.perf_counter() - clock - phases["solve"]
    assert best is not None
    v.best, v.measured["plan"], v.plans["plan"], v.activations, _ = best
    return v


def _learn_miss(
    rows: list[UnitRow],
    chosen: tuple[str, ...],
    blocks: list[BlockRow],
    options: tuple[str, ...],
    measured: Measured,
    base: str,
) -> int:
    """A plan measured over the byte limit: what its count missed (its measured bytes less
    the solver's), spread over the layers it moved from the baseline, in the formats it gave
    them (`Option.activation_bytes`: the growth is theirs, given to the wrong layer or
    none); the baseline's counts stay, so a plan keeps fitting. Returns the bytes missed."""
    counted = sum(r.options[c].counted_bytes for r, c in zip(rows, chosen, strict=True)) + sum(
        b.options[o].bytes for b, o in zip(blocks, options, strict=True)
    )
    missed = measured.unit_bytes + measured.activation_bytes + measured.extra_bytes - counted
    moved = [r.options[c] for r, c in zip(rows, chosen, strict=True) if c != base]
    if missed > 0 and moved:
        share = math.ceil(missed / len(moved))
        for option in moved:
            option.activation_bytes += share
    return max(0, missed)


def _bytes_over(measured: Measured, limits: list[float], memory_at: int | None) -> int:
    """How many bytes the measured plan's count passes the byte limit by (a fraction's
    resolved to bytes; 0: within it, or no memory budget)."""
    if memory_at is None:
        return 0
    spent = measured.unit_bytes + measured.activation_bytes + measured.extra_bytes
    return max(0, math.ceil(spent - limits[memory_at] * (1 + 1e-9)))


def _count(
    s: SearchInputs,
    v: Verified,
    names: list[str],
    blocks: list[BlockRow],
    options: tuple[str, ...],
    fixed: float,
) -> None:
    """The bytes and seconds of the measured plans `names` that the solver's counts leave
    out: the activations their blocks save at the search's ``batch_size``, measured in each
    plan's own dtypes and options (the blocks' rows count them in the baseline's: a layer
    in float32 saves twice a bfloat16 one's), and each option's counted seconds (the plan's
    options; ``keep`` in every other plan). Under a budget in bytes, ``extra_bytes``: what
    the plan holds outside its searched layers and blocks (its unsearched parameters, the
    activations saved outside the blocks, in its own dtypes) beyond the `fixed` bytes,
    which count them in the baseline's (a float32 plan's are larger)."""
    in_bytes = s.budget.memory_bytes is not None
    paths = [b.path for b in blocks]
    big = batch_at(s.batches[0], s.batch_size) if s.batch_size else None
    for name in names:
        m = v.measured[name]
        chosen = options if name == "plan" else tuple("keep" for _ in blocks)
        m.activation_seconds = sum(
            b.options[o].seconds for b, o in zip(blocks, chosen, strict=True)
        )
        outside = 0
        if big is not None:
            saved = saved_under(s.model, v.plans[name], big, s.loss_fn, s.device, s.seed)
            m.activation_bytes, outside = split_saved(saved, paths)
        if in_bytes:
            m.extra_bytes = extra_bytes(m.model_bytes, m.unit_bytes, outside, fixed)


def extra_bytes(model_bytes: int, unit_bytes: int, outside: int, fixed: float) -> int:
    """What a plan holding `model_bytes` (`unit_bytes` of them in its searched layers) and
    saving `outside` bytes outside its blocks holds beyond the `fixed` bytes the baseline
    counted; never below 0 (outside its searched layers and blocks a plan counts at least
    the fixed bytes)."""
    return max(0, math.ceil(model_bytes - unit_bytes + outside - fixed))


def keep(
    s: SearchInputs,
    rows: list[UnitRow],
    v: Verified,
    limits: dict[str, float],
    phases: dict[str, float],
) -> None:
    """The plan returned: the kept solved one, or a measured uniform plan that fits with a
    lower loss (`v.winner`, measured again beside the baseline when it was not timed; under
    ``count="training"`` one with fewer trainable elements, int8/int4 weights frozen, lower
    by more than the tolerance), or with any loss when the solved plan's measured bytes
    exceed the limit (none fitting: the solved plan, its attempt noting it; the same margin
    held between the plans that fit); each row's chosen format and measured damages
    written in."""
    assert v.best is not None
    chosen = tuple(v.best.chosen)
    bytes_only = {k: limit for k, limit in limits.items() if k == "memory"}
    over = within(costs_of(v.measured["plan"], rows, None), bytes_only) is False
    # a loss before training does not show what freezing layers costs in training: under
    # count="training" a plan freezing more wins only by more than the tolerance, over a
    # solved plan that meets it (one that misses it gives way to any lower loss)
    plan, base = v.measured["plan"].loss, v.measured["baseline"].loss
    meets = (plan - base) / max(abs(base), 1e-12) <= s.tolerance
    # (a solved plan over the limit is no rival: the margin holds between those that fit)
    margin = s.tolerance if s.count == "training" and (meets or over) else 0.0
    won = _uniform_winner(
        v.measured, rows, s.base.name, s.names, limits, any_loss=over, margin=margin
    )
    if over:
        said = f"; {won[0]} returned, which fits" if won else "; no measured plan fits"
        v.best.note = "; ".join(
            filter(None, [v.best.note, "measured over the byte limit the solver counted" + said])
        )
    if won is None:
        v.best.kept = True
    else:
        v.winner, formats_won = won
        v.plans["plan"], chosen = v.plans[v.winner], tuple(formats_won)
        v.activations = tuple("keep" for _ in v.activations)
        if v.measured[v.winner].seconds is None:  # uniform plans are timed under speed only
            clock = time.perf_counter()
            counted = {"plan": v.measured[v.winner], "baseline": v.measured["baseline"]}
            v.measured.update(
                _measure(s, {k: v.plans[k] for k in ("plan", "baseline")}, {"plan", "baseline"})
            )
            for name, was in counted.items():  # timed now; their bytes as counted before
                v.measured[name].activation_bytes = was.activation_bytes
                v.measured[name].activation_seconds = was.activation_seconds
                v.measured[name].extra_bytes = was.extra_bytes
            phases["verify"] += time.perf_counter() - clock
        else:
            v.measured["plan"] = v.measured[v.winner]
    for u, r in enumerate(rows):
        r.chosen = chosen[u]
        for (w, fmt), value in v.measured_damage.items():
            if w == u:
                r.options[fmt].measured_damage = value


def uniform_plans(
    s: SearchInputs, rows: list[UnitRow], states: list[StateFormat | None] | None
) -> dict[str, PolicyMap]:
    """float32, the baseline, and each format everywhere it applies (the baseline
    elsewhere): the plans a solved one is measured beside."""
    plans: dict[str, PolicyMap] = {
        "float32": PolicyMap("32-true"),
        "baseline": PolicyMap(s.base),
    }
    for name in s.names:
        # the baseline is measured; float32 everywhere is the float32 row, norms aside; a
        # format no layer can take would only repeat the baseline
        if name not in (s.base.name, "32-true") and any(name in r.options for r in rows):
            plans[f"all {name}"] = plan_map(
                s.base,
                s.units,
                [name if name in r.options else s.base.name for r in rows],
                states,
            )
    return plans


def _solve(
    s: SearchInputs,
    rows: list[UnitRow],
    measured_damage: dict[tuple[int, str], float],
    limits: list[float],
    base_costs: dict[str, float],
    phases: dict[str, float],
    blocks: list[BlockRow],
    fixed: float,
) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """The format of each layer and the activation option of each block of least total
    damage within `limits` (measured damages where there are, predicted ones elsewhere;
    recompute's extra seconds ranked by `tie_costs`, weighed by `tie_weight`); `BudgetError`
    when none fits."""
    names = s.names
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
                (r.options[n].counted_bytes if k == "memory" else r.options[n].seconds)
                if n in r.options
                else math.inf
                for n in names
            ]
            for r in rows
        ]
        for k in s.budget.kinds
    ]
    block_names = [list(b.options) for b in blocks]
    extra = tie_costs(blocks, block_names)
    weight = tie_weight(
        [d for row in damages for d in row if math.isfinite(d)]
        + [b.options[o].damage for b, opts in zip(blocks, block_names, strict=True) for o in opts],
        [max(e) for e in extra],
    )
    damages += [
        [b.options[o].damage + weight * e for o, e in zip(opts, ex, strict=True)]
        for b, opts, ex in zip(blocks, block_names, extra, strict=True)
    ]
    for k, kind in enumerate(s.budget.kinds):
        key = "bytes" if kind == "memory" else "seconds"
        costs[k] += [
            [getattr(b.options[o], key) for o in opts]
            for b, opts in zip(blocks, block_names, strict=True)
        ]
    solving = time.perf_counter()
    picked = solver.solve(damages, costs, limits)
    phases["solve"] += time.perf_counter() - solving
    if picked is None:
        units = [(r.unit.name, names) for r in rows] + [
            (b.path, opts) for b, opts in zip(blocks, block_names, strict=True)
        ]
        raise BudgetError(
            _too_small(s.budget, base_costs, units, damages, costs, names, fixed, bool(blocks))
        )
    return (
        tuple(names[f] for f in picked[: len(rows)]),
        tuple(opts[f] for opts, f in zip(block_names, picked[len(rows) :], strict=True)),
    )


def _measure(s: SearchInputs, todo: dict[str, PolicyMap], timed: set[str]) -> dict[str, Measured]:
    return measure_plans(
        s.model,
        todo,
        s.units,
        s.eval_batches,
        s.loss_fn,
        count=s.count,
        training=s.training,
        reps=s.reps,
        device=s.device,
        timed=timed,
        seed=s.seed,
    )


def _measure_alone(
    s: SearchInputs, rows: list[UnitRow], chosen: tuple[str, ...], v: Verified
) -> int:
    """The plan missed: what does each layer it moved cost the loss alone (measured on the
    batches the miss was measured on)? Larger than predicted: the damage it takes, recorded
    in ``v.measured_damage``. Returns how many were."""
    found = 0
    for u, (unit, fmt) in enumerate(zip(s.units, chosen, strict=True)):
        if fmt in ("32-true", s.base.name) or (u, fmt) in v.measured_damage:
            continue
        # (a loss gone non-finite is the worst damage there is, not one to pass over)
        alone = ranked(_alone_damage(s, unit, fmt, v.measured["float32"].loss))
        if alone > rows[u].options[fmt].damage:
            v.measured_damage[(u, fmt)] = alone
            found += 1
    return found


def _alone_damage(s: SearchInputs, unit: Unit, fmt: str, float32_loss: float) -> float:
    """The loss change of the float32 model with only `unit` in `fmt`, on the evaluation
    batches (whose float32 loss is `float32_loss`)."""
    rules = {path_rule(p): fmt for p in unit.paths + unit.aliases}
    policy = PolicyMap("32-true", rules)
    m = convert(s.model, policy)
    precision = Precision(policy, device=s.device)
    return (
        eval_loss(m, precision, s.eval_batches, s.loss_fn, seed=s.seed, device=s.device)
        - float32_loss
    )


def plan_map(
    baseline: Policy,
    units: list[Unit],
    chosen: list[str],
    states: list[StateFormat | None] | None = None,
    activations: dict[str, str] | None = None,
) -> PolicyMap:
    """The plan as a policy: the `chosen` format of each unit over the baseline, each
    unit's optimizer-state format, and each block's activation option (by path)."""
    rules = {}
    for unit, fmt in zip(units, chosen, strict=True):
        if fmt != baseline.name:
            for path in unit.paths + unit.aliases:
                rules[path_rule(path)] = fmt
    plan = PolicyMap(baseline, rules, activations=plan_activations(activations or {}))
    return with_states(plan, units, states) if states is not None else plan


def _uniform_winner(
    verified: dict[str, Measured],
    rows: list[UnitRow],
    baseline: str,
    names: list[str],
    limits: dict[str, float],
    any_loss: bool = False,
    margin: float = 0.0,
) -> tuple[str, list[str]] | None:
    """The measured plan other than the solved one (a uniform plan, the baseline, float32
    when it is one of the formats) that fits the budget with the lowest loss, if that loss
    is below the solved plan's (with `any_loss`, whatever it is): the damages the solver
    adds up are predictions, the losses measured. A plan with fewer trainable elements
    than the plan it displaces (the solved one, or one that fits) must be below it by more
    than `margin` (a fraction of its loss). Returned with the format of each layer."""
    fitting = []
    for name, measured in verified.items():
        formats = formats_of(name, rows, baseline, names) if name != "plan" else None
        if formats is not None and within(costs_of(measured, rows, formats), limits) is True:
            fitting.append((name, measured, formats))
    # those training more first, so a plan training fewer meets the margin against them
    fitting.sort(key=lambda f: -(f[1].trainable or 0))
    winner, held = None, None if any_loss else verified["plan"]
    for name, measured, formats in fitting:
        # (a loss that is not finite never wins: an overflowed plan is no plan)
        if not math.isfinite(measured.loss):
            continue
        if held is None or _beats(measured, held, margin):
            winner, held = (name, formats), measured
    return winner


def _beats(measured: Measured, held: Measured, margin: float) -> bool:
    """Whether `measured` displaces `held`: a lower loss, lower by more than `margin` (a
    fraction of `held`'s) when it trains fewer elements."""
    bar = ranked(held.loss)
    frozen = (
        measured.trainable is not None
        and held.trainable is not None
        and measured.trainable < held.trainable
    )
    # (a loss that is not finite sets no margin: any finite loss is below it)
    if frozen and math.isfinite(held.loss):
        bar = min(bar, held.loss - margin * abs(held.loss))
    return ranked(measured.loss) < bar


def _too_small(
    budget: Budget,
    base_costs: dict[str, float],
    units: list[tuple[str, list[str]]],
    damages: list[list[float]],
    costs: list[list[list[float]]],
    formats: list[str],
    fixed: float = 0.0,
    blocks: bool = False,
) -> str:
    """Why no plan fits, from what the solver was given (each layer's and block's name and
    option names, `damages`, `costs` per budget kind): the smallest fraction (or bytes)
    reachable for each budget on its own, with each in its cheapest option of finite damage
    (one that overflows there the solver never takes), those options, and the layers where
    a cheaper format overflows. With `blocks`, the bytes are said to be the solver's sum: a
    tensor several blocks save is in each block's count, once in a plan's own count."""
    tail = (
        f". Formats tried: {', '.join(formats)}; add cheaper ones with formats=[...] or "
        "raise the budget"
    )
    takes = [[f for f, d in enumerate(row) if math.isfinite(d)] for row in damages]
    stuck = [name for (name, _), t in zip(units, takes, strict=True) if not t]
    if stuck:
        return f"no plan fits any budget: {', '.join(stuck)} overflow(s) in every format" + tail
    parts, reachable = [], []
    overflows: dict[str, dict[str, None]] = {}  # format -> the layers it overflows in
    for k, kind in enumerate(budget.kinds):
        least, fmts = 0.0, set()
        for (name, options), t, cost in zip(units, takes, costs[k], strict=True):
            lowest = min(cost[f] for f in t)
            least += lowest
            fmts |= {options[f] for f in t if cost[f] == lowest}
            for f, c in enumerate(cost):
                if c < lowest and f not in t:  # cheaper, but overflows here
                    overflows.setdefault(options[f], {})[name] = None
        if kind == "memory" and budget.memory_bytes is not None:
            smallest = math.ceil(least + fixed)
            over = smallest - budget.memory_bytes
            reachable.append(over <= 0)
            # (a plan the search verifies is counted whole, each saved tensor once: its
            # total_bytes can be below this sum)
            bound = (
                " as the solver sums its layers and blocks (a tensor several blocks save is "
                "in each one's count: a plan's own count, total_bytes, can be lower)"
                if blocks
                else ""
            )
            parts.append(
                f"memory <= {budget.memory_bytes} bytes: the smallest plan counts {smallest} "
                f"bytes{bound}{f', {over} over' if over > 0 else ''} (each layer and block in "
                f"its cheapest option: {', '.join(sorted(fmts))})"
            )
            continue
        frac = least / base_costs[kind]
        reachable.append(frac <= getattr(budget, kind))
        parts.append(
            f"{kind} <= {getattr(budget, kind):g}x the baseline: the smallest reachable is "
            f"{math.ceil(frac * 1000) / 1000:g}x (each layer in its cheapest format: "
            f"{', '.join(sorted(fmts))})"
        )
    both = (
        " (each is reachable alone, not both together)"
        if len(parts) == 2 and all(reachable)
        else ""
    )
    cheaper = "".join(
        f"; {fmt} overflows in layers {', '.join(names)} (infinite damage: never taken there)"
        for fmt, names in overflows.items()
    )
    return "no plan fits the budget " + "; ".join(parts) + both + cheaper + tail
