"""The assignment of one format per layer that least hurts the loss within a budget.

A multiple-choice knapsack: unit ``u`` takes exactly one option ``f``, with damage
``d[u][f] >= 0`` and a cost per budget (bytes, seconds); minimise the summed damage with each
summed cost within its budget. Solved by dynamic programming over costs counted in whole
steps of each budget. Integer costs (bytes) are counted in steps of their greatest common
divisor when the budget holds at most ``resolution`` (2^20 under one budget) of those: then
the program is exact. Otherwise (seconds; bytes of too fine a divisor, as a large model's
often are) the step is ``1/resolution`` of the budget and every cost is rounded **up** to
whole steps: a plan it returns still always fits the true budget (to a hair of float
noise, 1e-9 of a step, forgiven in costs and budgets alike), and it is the least
damaging of the plans whose rounded costs fit, so at most ``units/resolution`` of the budget
is given away at its edge (`RESOLUTION_ONE` under one budget; `RESOLUTION_TWO` per budget
under two, a coarser grid, so more is given away). Among plans of equal
damage it returns the cheapest (first budget, then second). `brute_force` is the check on
small cases (tests compare the two).
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence

import torch

__all__: list[str] = []

# steps per budget: one budget (a vector) or two (a table)
RESOLUTION_ONE = 1 << 20
RESOLUTION_TWO = 1_000


def _grid(costs: Sequence[Sequence[float]], budget: float, resolution: int) -> tuple[float, int]:
    """The step costs are counted in and the budget's whole steps: the greatest common
    divisor of integer costs (bytes) where the budget holds at most `resolution` of them,
    which makes the program exact; else budget/resolution."""
    finite = [c for row in costs for c in row if math.isfinite(c)]
    if budget >= 1 and all(float(c).is_integer() for c in finite):
        step = 0
        for c in finite:
            step = math.gcd(step, int(c))
        if step and budget // step <= resolution:
            return float(step), _whole(budget / step)
    return budget / resolution, resolution


def _whole(steps: float) -> int:
    """The whole steps a budget holds, a hair of float noise forgiven: a budget given as the
    fraction a plan's bytes are of the baseline's holds that plan, though the fraction times
    the baseline's bytes may fall an ulp short of them."""
    return math.floor(steps + 1e-9)


def _steps(cost: float, step: float) -> int:
    """`cost` in whole steps, rounded up (a hair of float noise forgiven, so that an exact
    multiple stays exact)."""
    return max(0, math.ceil(cost / step - 1e-9))


def solve(
    damages: Sequence[Sequence[float]],
    costs: Sequence[Sequence[Sequence[float]]],
    budgets: Sequence[float],
    resolution: int | None = None,
) -> list[int] | None:
    """The option index per unit minimising the summed damage with ``sum(costs[k][u][f])
    <= budgets[k]`` for each budget k (one or two), or None if no assignment fits.

    ``damages[u][f]`` and ``costs[k][u][f]`` may be ``inf`` for an option a unit cannot take.
    """
    if len(budgets) not in (1, 2) or len(costs) != len(budgets):
        raise ValueError(f"one or two budgets, each with its costs; got {len(budgets)} budgets")
    if any(not b > 0 for b in budgets):
        return None
    res = resolution or (RESOLUTION_ONE if len(budgets) == 1 else RESOLUTION_TWO)
    grids = [_grid(costs[k], budgets[k], res) for k in range(len(budgets))]
    shape = (grids[0][1] + 1, grids[1][1] + 1 if len(budgets) == 2 else 1)
    inf = math.inf
    best = torch.full(shape, inf, dtype=torch.float64)
    best[0, 0] = 0.0
    choices: list[torch.Tensor] = []
    steps_of: list[list[list[int]]] = []
    for u, options in enumerate(damages):
        new = torch.full(shape, inf, dtype=torch.float64)
        pick = torch.full(shape, -1, dtype=torch.int16)
        unit_steps = []
        for f, damage in enumerate(options):
            steps = [
                _steps(costs[k][u][f], grids[k][0]) if math.isfinite(costs[k][u][f]) else -1
                for k in range(len(budgets))
            ]
            unit_steps.append(steps)
            if damage == inf or any(s < 0 or s >= shape[k] for k, s in enumerate(steps)):
                continue
            a, b = steps[0], steps[1] if len(steps) == 2 else 0
            moved = torch.full(shape, inf, dtype=torch.float64)
            moved[a:, b:] = best[: shape[0] - a, : shape[1] - b] + damage
            better = moved < new
            new = torch.where(better, moved, new)
            pick = torch.where(better, torch.tensor(f, dtype=torch.int16), pick)
        best = new
        choices.append(pick)
        steps_of.append(unit_steps)
    lowest = float(best.min())
    if lowest == inf:
        return _edge_plan(damages, costs, budgets)
    # the cheapest cell of least damage: first by the first budget, then the second
    cells = (best == lowest).nonzero().tolist()
    a, b = min(cells)
    plan = [0] * len(damages)
    for u in range(len(damages) - 1, -1, -1):
        f = int(choices[u][a, b])
        plan[u] = f
        a -= steps_of[u][f][0]
        if len(budgets) == 2:
            b -= steps_of[u][f][1]
    return plan


def _edge_plan(
    damages: Sequence[Sequence[float]],
    costs: Sequence[Sequence[Sequence[float]]],
    budgets: Sequence[float],
) -> list[int] | None:
    """The least damaging of a few plans that fit every true budget, for when the rounded
    costs fit none (rounding each unit's cost up can lose a plan at a budget's very edge):
    each unit's cheapest option of finite damage under one budget (ties: the cheaper under
    the others), and every unit taking the same option (the baseline, exactly at budgets
    given relative to it, among them). None if none of them fits."""
    kinds = range(len(budgets))
    units = range(len(costs[0]))
    plans = [
        [
            min(
                range(len(costs[k][u])),
                key=lambda f, u=u: [
                    not math.isfinite(damages[u][f]),
                    *(costs[j][u][f] for j in (k, *kinds)),
                ],
            )
            for u in units
        ]
        for k in kinds
    ]
    plans += [[f] * len(units) for f in range(min(len(options) for options in damages))]

    def fits(plan: list[int]) -> bool:
        return all(math.isfinite(damages[u][f]) for u, f in enumerate(plan)) and all(
            sum(costs[j][u][f] for u, f in enumerate(plan)) <= budgets[j] * (1 + 1e-9)
            for j in kinds
        )

    fitting = [plan for plan in plans if fits(plan)]
    if not fitting:
        return None
    return min(fitting, key=lambda plan: sum(damages[u][f] for u, f in enumerate(plan)))


def brute_force(
    damages: Sequence[Sequence[float]],
    costs: Sequence[Sequence[Sequence[float]]],
    budgets: Sequence[float],
) -> tuple[float, list[int]] | None:
    """The least summed damage over every assignment that fits (exact costs), and one
    assignment reaching it; None if none fits. Exponential: for checking `solve`."""
    found: tuple[float, list[int]] | None = None
    for plan in itertools.product(*(range(len(o)) for o in damages)):
        if any(
            sum(costs[k][u][f] for u, f in enumerate(plan)) > budgets[k]
            for k in range(len(budgets))
        ):
            continue
        total = sum(damages[u][f] for u, f in enumerate(plan))
        if found is None or total < found[0]:
            found = (total, list(plan))
    return found
