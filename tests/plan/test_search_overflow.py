"""A search where a cheaper format overflows in some layers (float16 past 65504): infinite
damage there (not NaN), a why column that says so, a `BudgetError` that counts only the
formats the solver can take; and a summary that counts the baseline among uniform plans."""

from __future__ import annotations

import dataclasses
import math
import re
import warnings
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from mixprec.plan import Budget, BudgetError, search
from mixprec.plan.report import Option, UnitRow
from mixprec.plan.solver import solve
from mixprec.plan.units import Unit
from mixprec.plan.verify import _solve

FORMATS = ["32-true", "16-true"]


def overflowing() -> tuple[nn.Module, list]:
    """Layer 2's output passes float16's 65504 (and the next layer's input with it): in
    16-true both give inf; layers 0 and 6 do not."""
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Linear(16, 32),
        nn.ReLU(),
        nn.Linear(32, 32),
        nn.ReLU(),
        nn.Linear(32, 32),
        nn.ReLU(),
        nn.Linear(32, 4),
    )
    with torch.no_grad():
        model[2].weight.mul_(5e5)
        model[4].weight.div_(5e5)
    return model, [(torch.randn(32, 16), torch.randint(0, 4, (32,)))]


def searched(budget: str | dict[str, float]):
    torch.set_num_threads(1)
    model, batches = overflowing()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (16-true is slow on this CPU, and says so)
        return search(
            model,
            batches,
            F.cross_entropy,
            budget=budget,
            baseline="32-true",
            formats=FORMATS,
            allow_slow=True,
            reps=1,
        )


def test_a_format_that_overflows_in_a_layer_takes_infinite_damage_and_the_report_says_why():
    """An inf output error times a zero gradient (behind a ReLU) scored NaN: the report
    showed damage nan and an empty why column for the layers kept in float32."""
    report = searched({"memory": 0.9})
    damage = {r.unit.name: r.options["16-true"].damage for r in report.rows}
    assert damage["2"] == damage["4"] == math.inf
    assert 0 < damage["0"] < math.inf and 0 < damage["6"] < math.inf
    assert report.plan == {"0": "16-true", "2": "32-true", "4": "32-true", "6": "16-true"}
    for row in report.rows:
        if row.unit.name in ("2", "4"):
            assert row.reason().startswith("16-true overflows here"), row.reason()
    assert "nan" not in report.to_markdown().split("## Per layer")[1]


@pytest.mark.parametrize("budget", [{"memory": 0.6}, "memory=6KB"])
def test_a_budget_error_counts_only_the_formats_the_solver_can_take(budget) -> None:
    """ "The smallest reachable" took 16-true everywhere, which overflows in layers 2 and 4:
    0.5x, "reachable" under 0.6x, with "(each is reachable alone, not both together)" under
    one budget, and under 6000 bytes "5576 bytes, -424 over"."""
    loose = searched({"memory": 0.9})
    cheapest = sum(
        r.options["32-true" if r.unit.name in ("2", "4") else "16-true"].bytes for r in loose.rows
    )
    with pytest.raises(BudgetError) as err:
        searched(budget)
    message = str(err.value)
    if isinstance(budget, dict):
        smallest = math.ceil(cheapest / loose.base_costs["memory"] * 1000) / 1000
        assert f"the smallest reachable is {smallest:g}x" in message
    else:
        assert f"the smallest plan counts {cheapest} bytes, {cheapest - 6000} over" in message
    assert "16-true overflows in layers 2, 4" in message
    assert "not both together" not in message and not re.search(r"-\d+ over", message)


def _rows(names: list[str], options: list[dict[str, Option]]) -> list[UnitRow]:
    return [
        UnitRow(unit=Unit(paths=(n,), kinds=("Linear",), params=10), options=o)
        for n, o in zip(names, options, strict=True)
    ]


def test_each_budget_reachable_alone_is_said_only_under_two_budgets() -> None:
    """Under memory and speed each reachable alone the message says so; under one budget
    "the smallest reachable" leaves out a cheaper option of infinite damage, and names it."""
    rows = _rows(
        ["a", "b"],
        [
            {"32-true": Option(100, seconds=1.0), "16-true": Option(50, seconds=2.0, damage=1.0)},
            {"32-true": Option(100, seconds=1.0), "16-true": Option(50, seconds=2.0, damage=1.0)},
        ],
    )
    s = SimpleNamespace(names=FORMATS, budget=Budget(memory=0.5, speed=1.0))
    base = {"memory": 200.0, "speed": 2.0}
    with pytest.raises(BudgetError, match=r"\(each is reachable alone, not both together\)"):
        _solve(s, rows, {}, [100.0, 2.0], base, {"solve": 0.0}, [], 0.0)
    rows[1].options["16-true"].damage = math.inf
    s = SimpleNamespace(names=FORMATS, budget=Budget(memory=0.5))
    with pytest.raises(BudgetError) as err:
        _solve(s, rows, {}, [100.0], base, {"solve": 0.0}, [], 0.0)
    assert "the smallest reachable is 0.75x" in str(err.value)
    assert "16-true overflows in layers b" in str(err.value)
    assert "not both together" not in str(err.value)
    # a layer of no finite option reaches no budget
    rows[1].options["32-true"].damage = math.inf
    with pytest.raises(BudgetError, match="no plan fits any budget: b overflow"):
        _solve(s, rows, {}, [100.0], base, {"solve": 0.0}, [], 0.0)


def test_the_edge_plan_takes_each_units_cheapest_option_of_finite_damage() -> None:
    """Costs rounded up to the grid (7 steps of the budget) fit no plan, so the plans at the
    edge are checked at their true costs: each unit's cheapest option was the one of
    infinite damage, which never fits, and the plan that fits (0.45 + 0.45) was lost."""
    inf = math.inf
    damages = [[inf, 1.0, 0.0], [inf, 0.0, 1.0]]
    seconds = [[0.01, 0.45, 0.55], [0.01, 0.55, 0.45]]
    assert solve(damages, [seconds], [0.9], resolution=7) == [1, 2]


def test_a_plan_that_is_the_baseline_is_a_uniform_plan_that_fits() -> None:
    """The plan returned was the baseline (float32 alone searched, under a speed budget):
    the summary said "no uniform plan fits the budget", and its step, measured 1.11x the
    baseline's (noise: the same plan), "the whole step measures 1.11x the baseline's"."""
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 10))
    batch = (torch.randn(48, 32), torch.randint(0, 10, (48,)))
    report = search(
        model,
        [batch],
        F.cross_entropy,
        budget="speed=1",
        baseline="32-true",
        formats=["32-true"],
        reps=1,
    )
    assert report.plan == {"0": "32-true", "2": "32-true"} and report.fits("baseline")
    base = report.measured["baseline"]
    report.measured["plan"] = dataclasses.replace(
        report.measured["plan"], seconds=1.11 * base.seconds
    )
    summary = report.summary()
    assert "the plan is baseline: no layer moved from 32-true" in summary
    assert "no uniform plan fits" not in summary and "whole step" not in summary
