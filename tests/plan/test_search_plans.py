"""The plans a search writes: rule keys naming one module each, the same plan from the same
call, and bytes counted as the plan's optimizer keeps them."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from mixprec.plan import Budget, search
from mixprec.plan.activation_choice import plan_activations
from mixprec.plan.measure import Measured
from mixprec.plan.report import Attempt, BlockRow, Option, UnitRow
from mixprec.plan.units import Unit, find_units
from mixprec.plan.verify import Verified, _solve, keep, plan_map
from mixprec.policy import as_policy
from mixprec.policy.map import PolicyMap


class Backslashed(nn.Module):
    """``a.b`` and ``a\\.b``: the second's path is the first's path escaped as a regex."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.ModuleDict({"b": nn.Linear(8, 8)})
        self.add_module("a\\", nn.ModuleDict({"b": nn.Linear(8, 8)}))


def test_a_plans_rule_names_its_layer_not_one_whose_path_is_the_rule(tmp_path) -> None:
    model = Backslashed()
    units = find_units(model)
    assert [u.paths for u in units] == [("a.b",), ("a\\.b",)]
    for chosen in (["bf16-true", "32-true"], ["32-true", "bf16-true"]):
        plan = plan_map(as_policy("32-true"), units, chosen)
        resolved = plan.resolve(model)
        assert [resolved[u.paths[0]].policy.name for u in units] == chosen
        assert PolicyMap.load(plan.save(tmp_path / "plan.json")) == plan
    for option in ("checkpoint", "keep"):
        other = "keep" if option == "checkpoint" else "checkpoint"
        rules = plan_activations({"a.b": option, "a\\.b": other})
        assert rules is not None
        choices = rules.resolve(model)
        assert (choices["a.b"][0], choices["a\\.b"][0]) == (option, other)


def _blocks(checkpoint_seconds: list[float]) -> list[BlockRow]:
    """Identical blocks but for checkpoint's timing: keep, or checkpoint at a fifth of the
    bytes and more seconds."""
    return [
        BlockRow(
            path=str(i),
            kind="Linear",
            options={
                "keep": Option(bytes=1000, seconds=1.0),
                "checkpoint": Option(bytes=200, seconds=seconds),
            },
        )
        for i, seconds in enumerate(checkpoint_seconds)
    ]


def test_blocks_whose_timings_differ_by_noise_get_the_same_plan_every_time() -> None:
    s = SimpleNamespace(names=["32-true"], budget=Budget(memory_bytes=2200))
    plans = set()
    # the same three blocks timed three times: checkpoint adds about one keep step, each time
    # another block's timing lowest
    for seconds in ([1.9, 2.0, 2.1], [2.1, 1.9, 2.0], [2.0, 2.1, 1.9]):
        phases = {"solve": 0.0}
        _, options = _solve(s, [], {}, [2200.0], {}, phases, _blocks(seconds), 0.0)
        assert sorted(options) == ["checkpoint", "keep", "keep"]
        plans.add(options)
    assert len(plans) == 1
    # an option several times slower than another is still told apart
    _, options = _solve(s, [], {}, [2200.0], {}, phases, _blocks([2.0, 9.0, 9.0]), 0.0)
    assert options == ("checkpoint", "keep", "keep")
    _, options = _solve(s, [], {}, [2200.0], {}, phases, _blocks([9.0, 9.0, 2.0]), 0.0)
    assert options == ("keep", "keep", "checkpoint")


def test_bytes_counted_under_low_bit_states_are_the_bytes_the_plan_holds() -> None:
    torch.manual_seed(0)
    # a norm no unit holds, and a last layer too small for low-bit moments: the low-bit
    # optimizer keeps float32 moments for both, whatever the parameters' dtype
    model = nn.Sequential(
        nn.Linear(64, 256), nn.LayerNorm(256), nn.Linear(256, 256), nn.GELU(), nn.Linear(256, 10)
    )
    batch = (torch.randn(16, 64), torch.randint(0, 10, (16,)))
    report = search(
        model,
        [batch],
        F.cross_entropy,
        budget="memory=1GiB",
        reps=1,
        baseline="bf16-true",
        count="training",
        states=["int8"],
        formats=["bf16-true"],  # (float32, without states, never returned)
        allow_slow=True,
    )
    assert report.uniform_won is None and report.policy.states
    plan = report.measured["plan"]
    assert sum(r.options[r.chosen].bytes for r in report.rows) == plan.unit_bytes
    assert report.total_bytes == plan.model_bytes


def test_a_plan_measured_over_the_byte_limit_is_not_returned_as_fitting() -> None:
    unit = Unit(paths=("0",), kinds=("Linear",), params=10)
    rows = [UnitRow(unit=unit, options={"32-true": Option(100), "bf16-true": Option(60)})]
    s = SimpleNamespace(
        base=as_policy("32-true"), names=["32-true", "bf16-true"], count="weights", tolerance=0.01
    )
    v = Verified(plans={n: PolicyMap("32-true") for n in ("plan", "baseline", "all bf16-true")})
    v.measured = {
        "plan": Measured(loss=1.0, unit_bytes=90, model_bytes=90, seconds=1.0),
        "baseline": Measured(loss=2.0, unit_bytes=100, model_bytes=100, seconds=1.0),
        "all bf16-true": Measured(loss=1.5, unit_bytes=60, model_bytes=60, seconds=1.0),
    }
    v.best = Attempt(chosen=["bf16-true"], loss=1.0, gap=0.0, predicted=0.0)
    keep(s, rows, v, {"memory": 80.0}, {"verify": 0.0})
    assert v.winner == "all bf16-true" and rows[0].chosen == "bf16-true"
    assert "over the byte limit" in v.best.note
    # nothing measured fits: the solved plan stays, saying so
    v.measured["all bf16-true"].unit_bytes = 85
    v.winner, v.best.note = None, ""
    keep(s, rows, v, {"memory": 80.0}, {"verify": 0.0})
    assert v.winner is None and "no measured plan fits" in v.best.note


def test_a_uniform_plan_with_a_finite_loss_is_returned_over_a_solved_one_at_nan() -> None:
    """The solved plan measured NaN: a uniform plan that fits compared ``loss < nan``,
    false, and the NaN plan was returned."""
    unit = Unit(paths=("0",), kinds=("Linear",), params=10)
    rows = [UnitRow(unit=unit, options={"32-true": Option(100), "bf16-true": Option(60)})]
    s = SimpleNamespace(
        base=as_policy("32-true"), names=["32-true", "bf16-true"], count="weights", tolerance=0.01
    )
    v = Verified(plans={n: PolicyMap("32-true") for n in ("plan", "baseline", "all bf16-true")})
    plan_at_nan = Measured(loss=math.nan, unit_bytes=60, model_bytes=60, seconds=1.0)
    v.measured = {
        "plan": plan_at_nan,
        "baseline": Measured(loss=1.0, unit_bytes=100, model_bytes=100, seconds=1.0),
        "all bf16-true": Measured(loss=1.5, unit_bytes=60, model_bytes=60, seconds=1.0),
    }
    v.best = Attempt(chosen=["bf16-true"], loss=math.nan, gap=math.nan, predicted=0.0)
    keep(s, rows, v, {"memory": 80.0}, {"verify": 0.0})
    assert v.winner == "all bf16-true" and v.measured["plan"].loss == 1.5
    # counting training, a plan training fewer parameters still wins over a NaN one (no
    # margin below a loss that is not finite)
    s.count, v.winner, v.measured["plan"] = "training", None, plan_at_nan
    v.measured["plan"].trainable, v.measured["all bf16-true"].trainable = 10, 5
    keep(s, rows, v, {"memory": 80.0}, {"verify": 0.0})
    assert v.winner == "all bf16-true"


def test_under_a_training_count_a_frozen_plan_wins_only_by_more_than_the_tolerance() -> None:
    """Found by a review: counting training, all int8 (frozen weights) was returned over
    the solved float32 plan on a loss before training 0.01% lower, noise; it trained to a
    far higher one. A plan training fewer parameters now wins only when lower by more than
    the tolerance; counting weights, or training as many, the lowest loss wins."""
    unit = Unit(paths=("0",), kinds=("Linear",), params=10)
    rows = [UnitRow(unit=unit, options={"32-true": Option(100), "bf16-true": Option(60)})]
    s = SimpleNamespace(
        base=as_policy("32-true"), names=["32-true", "bf16-true"], count="training", tolerance=0.01
    )

    def winner(
        loss: float, trainable: int, count: str = "training", plan: float = 1.0
    ) -> str | None:
        v = Verified(plans={n: PolicyMap("32-true") for n in ("plan", "baseline", "all bf16-true")})
        v.measured = {
            "plan": Measured(plan, 100, 100, 1.0, trainable=10),
            "baseline": Measured(1.0, 100, 100, 1.0, trainable=10),
            "all bf16-true": Measured(loss, 60, 60, 1.0, trainable=trainable),
        }
        v.best = Attempt(chosen=["32-true"], loss=1.0, gap=0.0, predicted=0.0)
        s.count = count
        keep(s, rows, v, {"memory": 200.0}, {"verify": 0.0})
        return v.winner

    assert winner(0.995, trainable=5) is None  # within the tolerance: noise
    assert winner(0.98, trainable=5) == "all bf16-true"
    assert winner(0.995, trainable=10) == "all bf16-true"  # trains as much
    assert winner(0.995, trainable=5, count="weights") == "all bf16-true"


def test_a_solved_plan_missing_the_tolerance_gives_way_to_any_lower_frozen_loss() -> None:
    """Found by a diff review: the margin a frozen plan must beat applied to a solved plan
    that misses the tolerance too, so it was kept (the search failing) over all int8 that
    fits and meets it."""
    unit = Unit(paths=("0",), kinds=("Linear",), params=10)
    formats = {"32-true": Option(100), "bf16-true": Option(60), "int8_from_32-true": Option(30)}
    rows = [UnitRow(unit=unit, options=formats)]
    s = SimpleNamespace(base=as_policy("32-true"), names=list(formats), count="training")
    s.tolerance = 0.01
    names = ("plan", "baseline", "all bf16-true", "all int8_from_32-true")
    v = Verified(plans={n: PolicyMap("32-true") for n in names})
    v.measured = {
        "plan": Measured(1.03, 60, 60, 1.0, trainable=10),
        "baseline": Measured(1.0, 100, 100, 1.0, trainable=10),  # (over the budget)
        "all bf16-true": Measured(1.03, 60, 60, 1.0, trainable=10),
        "all int8_from_32-true": Measured(1.025, 30, 30, 1.0, trainable=5),
    }
    v.best = Attempt(chosen=["bf16-true"], loss=1.03, gap=0.03, predicted=0.0)
    keep(s, rows, v, {"memory": 80.0}, {"verify": 0.0})
    assert v.winner == "all int8_from_32-true"


def test_a_solved_plan_over_the_byte_limit_gives_way_to_a_frozen_one_only_by_the_tolerance():
    """Found by a review: a solved plan measured over the byte limit gave way to the fitting
    measured plan of lowest loss whatever it trained: all int8 (frozen weights) was returned
    over all bf16-true, which fits and trains every weight, on a loss 0.5% lower (noise).
    Counting training, the fallback now holds a plan training fewer parameters than another
    that fits to the same rule: lower by more than the tolerance."""
    unit = Unit(paths=("0",), kinds=("Linear",), params=10)
    formats = {"32-true": Option(100), "bf16-true": Option(60), "int8_from_32-true": Option(30)}
    rows = [UnitRow(unit=unit, options=formats)]
    s = SimpleNamespace(base=as_policy("32-true"), names=list(formats), tolerance=0.01)

    def winner(int8_loss: float, count: str = "training") -> str | None:
        names = ("plan", "baseline", "all int8_from_32-true", "all bf16-true")
        v = Verified(plans={n: PolicyMap("32-true") for n in names})
        v.measured = {
            "plan": Measured(0.9, 90, 90, 1.0, trainable=10),  # (over the limit)
            "baseline": Measured(1.0, 100, 100, 1.0, trainable=10),  # (over the limit)
            "all int8_from_32-true": Measured(int8_loss, 30, 30, 1.0, trainable=5),
            "all bf16-true": Measured(1.0, 60, 60, 1.0, trainable=10),
        }
        v.best = Attempt(chosen=["32-true"], loss=0.9, gap=-0.1, predicted=0.0)
        s.count = count
        keep(s, rows, v, {"memory": 80.0}, {"verify": 0.0})
        assert "over the byte limit" in v.best.note
        return v.winner

    assert winner(0.995) == "all bf16-true"  # within the tolerance: noise
    assert winner(0.98) == "all int8_from_32-true"
    assert winner(0.995, count="weights") == "all int8_from_32-true"


@pytest.mark.parametrize("bad", [math.inf, math.nan])
def test_an_overflowed_plan_never_wins_the_fallback(bad):
    """Found by a diff review: when the solved plan was over the limit, the first fitting
    plan (the one training most) was taken whatever its loss, inf or NaN: an overflowed
    plan returned. A loss that is not finite never wins; no measured plan fits then."""
    unit = Unit(paths=("0",), kinds=("Linear",), params=10)
    formats = {"32-true": Option(100), "16-true": Option(50), "int8_from_32-true": Option(30)}
    rows = [UnitRow(unit=unit, options=formats)]
    for count in ("training", "weights"):
        s = SimpleNamespace(base=as_policy("32-true"), names=list(formats), tolerance=0.01)
        s.count = count
        names = ("plan", "baseline", "all 16-true", "all int8_from_32-true")
        v = Verified(plans={n: PolicyMap("32-true") for n in names})
        v.measured = {
            "plan": Measured(0.9, 90, 90, 1.0, trainable=10),  # (over the limit)
            "baseline": Measured(1.0, 100, 100, 1.0, trainable=10),  # (over)
            "all 16-true": Measured(bad, 50, 50, 1.0, trainable=10),  # (fits, overflowed)
            "all int8_from_32-true": Measured(1.0, 85, 85, 1.0, trainable=5),  # (over)
        }
        v.best = Attempt(chosen=["32-true"], loss=0.9, gap=-0.1, predicted=0.0)
        keep(s, rows, v, {"memory": 80.0}, {"verify": 0.0})
        assert v.winner is None and "no measured plan fits" in v.best.note
