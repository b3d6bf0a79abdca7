"""The per-layer format search (`mixprec.plan`): the solver against brute force, bytes counted
exactly, a planted sensitive layer kept in float32, budgets nothing fits, the plan's policy
file reproducing its measured loss, retries, training runs, the CLI, and bad input.

Formats are float32 and the int8/int4 ones (which every CPU runs, with the same numerics), so
the outcomes do not depend on the host; bfloat16 formats are judged on described devices."""

from __future__ import annotations

import copy
import json
import math
import re
import textwrap

import pytest
import torch
import torch.nn.functional as F
from devices import AVX2_CPU, ZEN4
from hypothesis import example, given, settings
from hypothesis import strategies as st
from torch import nn

import mixprec
from mixprec.cli import main
from mixprec.errors import PolicySpecError, SlowPrecisionError
from mixprec.optim.compensated import SMALL
from mixprec.plan import Budget, BudgetError, search
from mixprec.plan.fitting import step_peaks
from mixprec.plan.measure import convert
from mixprec.plan.solver import brute_force, solve
from mixprec.plan.units import candidate, default_formats, find_units, state_bytes
from mixprec.policy import as_policy
from mixprec.policy.map import PolicyMap

INT8 = "int8_from_32-true"
INT4 = "int4/32_from_32-true"


def token_loss(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Cross-entropy of a model that predicts its input tokens."""
    return F.cross_entropy(logits.flatten(0, 1), ids.flatten())


# --- the solver ---------------------------------------------------------------------------


@st.composite
def instances(draw: st.DrawFn, budgets: int) -> tuple:
    units = draw(st.integers(1, 5))
    options = draw(st.integers(1, 4))
    damages = [
        [draw(st.sampled_from([0.0, 0.5, 1.0, 2.0, 3.5, 7.0])) for _ in range(options)]
        for _ in range(units)
    ]
    costs = [
        [[draw(st.integers(0, 20)) for _ in range(options)] for _ in range(units)]
        for _ in range(budgets)
    ]
    limits = [draw(st.integers(1, 60 if budgets == 1 else 20)) for _ in range(budgets)]
    return damages, costs, limits


@settings(max_examples=150, deadline=None)
@given(instances(1))
def test_the_solver_finds_the_least_damage_brute_force_finds_under_one_budget(case) -> None:
    damages, costs, limits = case
    # a resolution of the budget itself makes integer costs whole steps: the DP is exact
    plan = solve(damages, costs, limits, resolution=limits[0])
    best = brute_force(damages, costs, limits)
    if best is None:
        assert plan is None
        return
    assert plan is not None
    assert sum(costs[0][u][f] for u, f in enumerate(plan)) <= limits[0]
    assert sum(damages[u][f] for u, f in enumerate(plan)) == best[0]


@settings(max_examples=100, deadline=None)
@given(instances(2))
def test_the_solver_finds_the_least_damage_brute_force_finds_under_two_budgets(case) -> None:
    damages, costs, limits = case
    best = brute_force(damages, costs, limits)
    # steps of 1/L1 of the first budget and 1/L0 of the second: integer costs are whole steps
    plan = solve(damages, costs, limits, resolution=limits[0] * limits[1])
    if best is None:
        assert plan is None
        return
    assert plan is not None
    for k in range(2):
        assert sum(costs[k][u][f] for u, f in enumerate(plan)) <= limits[k]
    assert sum(damages[u][f] for u, f in enumerate(plan)) == best[0]


@settings(max_examples=100, deadline=None)
@given(
    st.lists(
        st.lists(st.tuples(st.floats(0, 10), st.floats(0, 3)), min_size=1, max_size=3),
        min_size=1,
        max_size=4,
    ),
    st.floats(0.5, 8),
)
@example(options=[[(0.0, 1.0)], [(0.0, 2.220446049250313e-16)]], budget=1.0)  # (found once)
def test_a_plan_from_real_valued_costs_always_fits_its_budget(options, budget) -> None:
    damages = [[d for d, _ in unit] for unit in options]
    costs = [[[c for _, c in unit] for unit in options]]
    plan = solve(damages, costs, [budget], resolution=7)  # coarse: rounding matters
    if plan is not None:
        # (within the hair of float noise the solver forgives: costs 1.0 and 2.2e-16 fit a
        # budget of 1.0, their float sum an ulp over it)
        hair = budget * (1 + 1e-9)
        assert sum(costs[0][u][f] for u, f in enumerate(plan)) <= hair
        best = brute_force(damages, costs, [hair])
        assert best is not None and sum(damages[u][f] for u, f in enumerate(plan)) >= best[0]


def test_among_plans_of_equal_damage_the_cheapest_is_chosen() -> None:
    # two zero-damage options: the cheaper one wins
    assert solve([[0.0, 0.0]], [[[5, 2]]], [10]) == [1]
    # an option a unit cannot take is never chosen
    assert solve([[math.inf, 1.0]], [[[0, 9]]], [10]) == [1]
    assert solve([[1.0]], [[[11]]], [10]) is None


# --- units and bytes -----------------------------------------------------------------------


class Tied(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(50, 32)
        self.mid = nn.Linear(32, 32)
        self.head = nn.Linear(32, 50, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.head(torch.relu(self.mid(self.emb(idx))))


def test_layers_sharing_a_weight_are_one_unit_and_their_bytes_count_once() -> None:
    model = Tied()
    units = find_units(model)
    assert [u.paths for u in units] == [("emb", "head"), ("mid",)]
    assert units[0].params == 50 * 32 and units[1].params == 32 * 32 + 32
    holder = candidate(model, units[0], as_policy(INT8))
    assert type(holder[0]).__name__ == "Int8Embedding" and type(holder[1]).__name__ == "Int8Linear"
    assert holder[0].qweight is holder[1].qweight  # one int8 copy
    # int8 codes, one float32 scale per row: once, not twice
    assert state_bytes(holder, "weights") == 50 * 32 + 50 * 4
    # each of the two reads the shared weight inside itself: quantized formats apply
    idx = torch.randint(0, 50, (4, 6))
    report = search(
        model,
        [(idx, idx)],
        token_loss,
        budget={"memory": 0.5},
        formats=[INT8],
        baseline="32-true",
        reps=1,
    )
    assert not report.rows[0].not_applicable
    assert report.plan["emb"] == report.plan["head"] == "int8_from_float32"


def test_bytes_of_each_format_are_counted_exactly() -> None:
    model = nn.Sequential(nn.Linear(64, 32))
    (unit,) = find_units(model)
    n = 64 * 32 + 32

    def weigh(fmt: str, count: str) -> int:
        return state_bytes(candidate(model, unit, as_policy(fmt)), count)

    assert weigh("32-true", "weights") == 4 * n
    assert weigh("32-true", "training") == 16 * n  # weight, gradient, two AdamW moments
    assert weigh("bf16-true", "weights") == 2 * n
    # and a 16-bit Kahan buffer; the compensated step steps a small weight from a packed
    # copy of all of those, kept between steps: twice the bytes
    assert weigh("bf16-true", "training") == 2 * 10 * n
    # float16: the compensated step keeps Adam's moments of a float16 weight in float32
    assert weigh("16-true", "training") == 2 * (2 + 2 + 8 + 2) * n
    assert weigh("bf16-mixed", "weights") == 4 * n  # float32 storage, bf16 compute
    # int8: codes + float32 row scales + the float32 bias; only the bias trains
    assert weigh(INT8, "weights") == 64 * 32 + 32 * 4 + 32 * 4
    assert weigh(INT8, "training") == 64 * 32 + 32 * 4 + 32 * 4 * 4
    # int4 groups of 32: packed codes (half a byte each), per group a float32 scale and a
    # uint8 zero point, and the bias
    assert weigh(INT4, "weights") == 64 * 32 // 2 + 32 * 2 * (4 + 1) + 32 * 4


def test_a_compensated_step_counts_the_packed_copies_of_its_small_parameters() -> None:
    """bf16-true counted 10 bytes an element against float32's 16, but a compensated step
    steps every parameter, float32 ones too, those under SMALL elements from a packed copy
    of their weight, gradient and states: a plan with one small bf16-true layer held more
    than float32 everywhere, and a search said it was the cheaper one. A weight of SMALL
    elements or more is stepped in place: bf16-true saves there."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 4))
    batch = (torch.randn(8, 16), torch.randint(0, 4, (8,)))
    plans = [PolicyMap("32-true"), PolicyMap("32-true", {"0": "bf16-true"})]
    counted = [state_bytes(convert(model, plan), "training") for plan in plans]
    peaks = [peak.bytes for peak in step_peaks(model, batch, F.cross_entropy, plans)]
    assert counted[1] > counted[0] and peaks[1] > peaks[0]
    kw = dict(baseline="32-true", formats=["32-true", "bf16-true"], count="training", reps=1)
    kw["allow_slow"] = True  # (counts, on any CPU)
    with pytest.raises(BudgetError):  # (was: a plan with a bf16-true layer, said to fit)
        search(model, [batch], F.cross_entropy, budget=f"memory={counted[0] - 1}B", **kw)
    large = nn.Linear(SMALL, 1, bias=False)  # (one weight of SMALL elements, in place)
    weights = [state_bytes(convert(large, PolicyMap(f)), "training") for f in kw["formats"]]
    assert weights == [16 * SMALL, 10 * SMALL]


def test_default_formats_are_those_the_device_runs_fast() -> None:
    fast, left_out = default_formats(as_policy("bf16-mixed"), ZEN4)
    assert fast == [
        "32-true",
        "bf16-mixed",
        "bf16-true",
        "int8_from_mixed_bfloat16",
        "int4/32_from_mixed_bfloat16",
        "int4_from_mixed_bfloat16",
    ]
    assert "16-true" in left_out and "float16" in left_out["16-true"]
    assert any(k.startswith("float8") for k in left_out)
    fast, left_out = default_formats(as_policy("32-true"), AVX2_CPU)
    assert fast == ["32-true", "int8_from_float32", "int4/32_from_float32", "int4_from_float32"]
    assert "bfloat16" in left_out["bf16-true"]
    # a baseline slow here (allowed by the caller) admits the formats no slower than it
    slow, left_out = default_formats(as_policy("bf16-mixed"), AVX2_CPU)
    assert slow[:4] == ["32-true", "bf16-mixed", "bf16-true", "16-true"]
    assert "int8_from_mixed_bfloat16" in slow and not left_out


# --- a planted sensitive layer -------------------------------------------------------------


class Outlier(nn.Module):
    """Multiplies one feature by 1000: the next layer's int8 activations (one scale per
    token) then keep almost nothing of the other features."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.cat([x.new_full((1,), 1000.0), x.new_ones(x.shape[-1] - 1)])


def planted() -> tuple[nn.Module, list, list]:
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Linear(64, 64),
        nn.Tanh(),
        nn.Linear(64, 64),
        nn.Tanh(),
        Outlier(),
        nn.Linear(64, 64),
        nn.Tanh(),
        nn.Linear(64, 64),
    )
    with torch.no_grad():
        model[5].weight[:, 0] /= 1000.0  # the layer itself is ordinary
    x = torch.randn(96, 64)
    with torch.no_grad():
        t = model(x) + 0.1 * torch.randn(96, 64)
    batches = [(x[i : i + 32], t[i : i + 32]) for i in (0, 32)]
    return model, batches, [(x[64:], t[64:])]


# float32 bytes of one 64x64 Linear, and in int8 (codes, row scales, bias)
F32, I8 = (64 * 64 + 64) * 4, 64 * 64 + 64 * 4 + 64 * 4


def test_a_planted_sensitive_layer_stays_in_float32_and_the_report_says_why() -> None:
    model, batches, held_out = planted()
    # room for three int8 layers and one float32 one
    fraction = (3 * I8 + F32) / (4 * F32)
    report = search(
        model,
        batches,
        F.mse_loss,
        budget={"memory": fraction},
        formats=[INT8],
        baseline="32-true",
        eval_batches=held_out,
        reps=1,
    )
    assert report.plan == {
        "0": "int8_from_float32",
        "2": "int8_from_float32",
        "5": "32-true",
        "7": "int8_from_float32",
    }
    row = next(r for r in report.rows if r.unit.paths == ("5",))
    assert row.reason().startswith("int8_from_float32 would hurt it")
    assert row.why[0][1] > 100  # far above the median layer's int8 damage
    measured = report.measured
    assert measured["plan"].unit_bytes == 3 * I8 + F32
    assert report.fits("plan") and report.fits("all int8_from_float32")
    assert not report.fits("baseline")
    assert measured["plan"].loss < measured["all int8_from_float32"].loss
    assert report.beats_uniform and report.uniform_won is None
    assert "kept" not in report.summary() and "better than" in report.summary()


def test_a_uniform_plan_measured_lower_than_the_solved_plan_is_returned(tmp_path) -> None:
    """The solver keeps the last layer in float32 (its predicted damage is the largest), but
    under a loss linear in the outputs int4 there lowers the loss: int4 everywhere fits and
    measures lower. The search returned the worse solved plan, saying only
    ``beats_uniform=False``; it returns the uniform plan and says it won."""
    torch.manual_seed(1)
    model = nn.Sequential(
        nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 32)
    )
    c, x = torch.randn(32), torch.randn(96, 64)
    report = search(
        model,
        [(x[:48], c)],
        lambda y, c: (y @ c).mean(),
        budget={"memory": 0.45},
        formats=[INT4],
        baseline="32-true",
        eval_batches=[(x[48:], c)],
        reps=1,
    )
    uniform = "all int4/32_from_float32"
    (solved,) = report.attempts
    assert solved.chosen == ["int4/32_from_float32", "int4/32_from_float32", "32-true"]
    assert not solved.kept and report.uniform_won == uniform
    assert report.plan == {p: "int4/32_from_float32" for p in ("0", "2", "4")}
    assert [r.chosen for r in report.rows] == ["int4/32_from_float32"] * 3
    assert report.measured["plan"].loss == report.measured[uniform].loss
    assert report.measured["plan"].seconds > 0  # timed beside the baseline
    assert report.measured[uniform].loss < solved.loss - 0.02  # 0.152 against 0.180
    assert report.fits("plan") and not report.beats_uniform
    assert f"a uniform plan won: the plan is {uniform}" in report.summary()
    policy = report.save(tmp_path)
    assert json.loads((tmp_path / "search.json").read_text())["uniform_won"] == uniform
    again = mixprec.apply(copy.deepcopy(model), str(policy))
    with torch.no_grad():
        loss = float((again(x[48:]) @ c).mean())
    assert loss == report.measured["plan"].loss


def test_a_budget_nothing_fits_names_the_smallest_reachable() -> None:
    model, batches, _ = planted()
    with pytest.raises(BudgetError) as err:
        search(
            model,
            batches,
            F.mse_loss,
            budget="memory=0.2",
            formats=[INT8],
            baseline="32-true",
            reps=1,
        )
    smallest = math.ceil(I8 / F32 * 1000) / 1000
    assert f"the smallest reachable is {smallest:g}x" in str(err.value)
    assert "int8_from_float32" in str(err.value)


def test_the_saved_policy_file_reproduces_the_measured_loss(tmp_path) -> None:
    model, batches, held_out = planted()
    report = search(
        model,
        batches,
        F.mse_loss,
        budget={"memory": 0.5},
        formats=[INT8, INT4],
        baseline="32-true",
        eval_batches=held_out,
        reps=1,
    )
    policy = report.save(tmp_path, command="test")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["policy.json", "search.json", "search.md"]
    again = mixprec.apply(copy.deepcopy(model), str(policy)).eval()
    precision = mixprec.Precision(str(policy))
    with torch.no_grad():
        x, t = precision.convert_input(held_out[0])
        loss = F.mse_loss(again(x), t)
    assert float(loss) == report.measured["plan"].loss
    data = json.loads((tmp_path / "search.json").read_text())
    assert data["plan"] == report.plan and data["met"] == report.met
    assert "| plan |" in (tmp_path / "search.md").read_text()


def test_scores_of_the_last_layer_are_the_exact_loss_change_for_a_linear_loss() -> None:
    # loss = mean over samples of c . y: the first-order term is the whole change
    torch.manual_seed(1)
    model = nn.Sequential(nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 16))
    c = torch.randn(16)
    x = torch.randn(8, 32)
    report = search(
        model,
        [(x, c)],
        lambda y, c: (y @ c).mean(),
        budget={"memory": 10},
        formats=[INT4],
        baseline="32-true",
        reps=1,
    )
    option = report.rows[1].options["int4/32_from_float32"]
    alone = mixprec.apply(copy.deepcopy(model), PolicyMap("32-true", {"2": INT4}))
    with torch.no_grad():
        change = float((alone(x) @ c).mean() - (model(x) @ c).mean())
    assert option.taylor == pytest.approx(change, rel=1e-4, abs=1e-7)
    # the Fisher term: M/2 sum_t (g_t . d_t)^2 over the M = 8 rows, with g_t = c/M
    d = alone(x).detach().double() - model(x).detach().double()
    g_dot_d = d @ c.double() / 8
    assert option.damage == pytest.approx(float(8 / 2 * (g_dot_d**2).sum()), rel=1e-6)


def test_a_plan_missing_the_tolerance_is_solved_again_with_measured_damages() -> None:
    model, batches, held_out = planted()
    report = search(
        model,
        batches,
        F.mse_loss,
        budget={"memory": 0.3},
        formats=[INT8, INT4],
        baseline="32-true",
        tolerance=0.0,
        retries=2,
        reps=1,
    )
    assert len(report.attempts) >= 2
    assert not report.met
    remeasured = [o for r in report.rows for o in r.options.values() if o.measured_damage]
    assert remeasured
    assert "attempts" in report.summary() and "MISSES" in report.summary()


def test_a_training_run_trains_the_plan_and_the_baseline() -> None:
    torch.manual_seed(3)
    model = nn.Sequential(nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 64))
    batches = [(torch.randn(32, 64), torch.randn(32, 64))]
    report = search(
        model,
        batches,
        F.mse_loss,
        budget={"memory": 0.5},
        formats=[INT8],
        baseline="32-true",
        train_steps=4,
        lr=1e-2,
        reps=1,
        count="training",
    )
    assert set(report.trained) == {"plan", "baseline"}
    for t in report.trained.values():
        assert len(t.losses) == 4 and all(math.isfinite(v) for v in t.losses)
        assert t.losses[-1] < t.losses[0]
    assert "## Training run" in report.to_markdown()


def test_the_training_run_steps_through_its_own_batches() -> None:
    torch.manual_seed(4)
    model = nn.Sequential(nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 64))
    batches = [(torch.randn(8, 64), torch.randn(8, 64))]
    fresh = [(torch.randn(8, 64), torch.randn(8, 64)) for _ in range(3)]
    report = search(
        model,
        batches,
        F.mse_loss,
        budget={"memory": 0.5},
        formats=[INT8],
        baseline="32-true",
        train_steps=3,
        train_batches=fresh,
        reps=1,
    )
    with torch.no_grad():
        first = float(F.mse_loss(model(fresh[0][0]), fresh[0][1]))
    assert report.trained["baseline"].losses[0] == pytest.approx(first, rel=1e-6)


def test_the_baseline_is_checked_against_the_device() -> None:
    model, batches, _ = planted()
    with pytest.raises(SlowPrecisionError, match="bf16-mixed"):
        search(model, batches, F.mse_loss, budget="memory=0.5", device_info=AVX2_CPU)
    with pytest.raises(SlowPrecisionError, match="bf16-true"):
        search(
            model,
            batches,
            F.mse_loss,
            budget="memory=0.5",
            baseline="32-true",
            formats=["bf16-true"],
            device_info=AVX2_CPU,
        )


@pytest.mark.parametrize(
    ("kwargs", "error", "message"),
    [
        ({"budget": {}}, ValueError, "a budget needs memory"),
        ({"budget": {"memory": 0}}, ValueError, "positive fraction"),
        ({"budget": {"memry": 0.5}}, ValueError, "unknown budget 'memry'"),
        ({"budget": "memory=lots"}, TypeError, "must be a number"),
        ({"budget": "memory=0.5,memory=0.3"}, ValueError, "budget 'memory' given twice"),
        ({"budget": "memory,speed=0.8"}, ValueError, "budget 'memory' has no value"),
        ({"budget": "memory=0.5,speed"}, ValueError, "write it as speed=<value>"),
        ({"budget": 0.5}, TypeError, "budget must be a Budget"),
        ({"formats": ["int9"]}, PolicySpecError, "int9"),
        ({"baseline": INT8}, ValueError, "the baseline is the float precision"),
        ({"count": "bytes"}, ValueError, "count must be one of weights, training"),
        ({"batches": []}, ValueError, "batches is empty"),
        ({"eval_batches": iter([])}, ValueError, "eval_batches is empty (an iterator, used up"),
        ({"batches": torch.zeros(3)}, TypeError, "a list of batches"),
        ({"reps": 0}, ValueError, "reps must be an integer >= 1"),
        ({"tolerance": -1}, ValueError, "tolerance"),
        ({"tolerance": True}, ValueError, "tolerance must be a non-negative number"),
        ({"lr": "1e-3"}, ValueError, "lr must be a positive number"),
        ({"lr": math.nan}, ValueError, "lr must be a positive number"),
        ({"seed": 1.5}, ValueError, "seed must be an integer"),
    ],
)
def test_bad_input_is_refused_saying_what_is_accepted(kwargs, error, message) -> None:
    model, batches, _ = planted()
    args = {
        "budget": {"memory": 0.5},
        "baseline": "32-true",
        "formats": [INT8],
        "batches": batches,
        **kwargs,
    }
    with pytest.raises(error, match=re.escape(message)):
        search(model, args.pop("batches"), F.mse_loss, **args)


def test_a_float32_loss_that_is_not_finite_is_refused() -> None:
    model, batches, _ = planted()
    bad = (batches[1][0].clone(), batches[1][1])
    bad[0][0, 0] = math.nan
    args = {"budget": {"memory": 0.5}, "formats": [INT8], "baseline": "32-true", "reps": 1}
    with pytest.raises(ValueError, match=r"float32 loss on batches\[1\] is nan"):
        search(model, [batches[0], bad], F.mse_loss, **args)
    with pytest.raises(ValueError, match="float32 loss on eval_batches is nan"):
        search(model, batches, F.mse_loss, eval_batches=[bad], **args)


def test_a_plan_whose_loss_is_not_finite_is_solved_again_and_never_kept() -> None:
    """A plan whose held-out loss is NaN was kept: ``nan < loss`` is false, so a later
    attempt with a finite loss never replaced it, and the layer making it NaN alone (a NaN
    damage, never above the predicted one) was not learned from. Here the first layer's
    float16 damage is exactly zero on the search batch (integers) and it overflows on the
    held-out one; nothing but a solved plan fits."""
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Linear(32, 32), nn.LayerNorm(32), nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, 32)
    )
    with torch.no_grad():
        model[0].weight.copy_(torch.randint(-1, 2, (32, 32)))
        model[0].bias.zero_()
    x, target = torch.randint(-2, 3, (16, 32)).float(), torch.randn(16, 32)
    report = search(
        model,
        [(x, target)],
        F.mse_loss,
        budget="memory=0.67",  # two of the three layers in float16
        baseline="32-true",
        formats=["32-true", "16-true"],
        eval_batches=[(x * 1e4, target)],
        allow_slow=True,
        reps=1,
    )
    assert math.isnan(report.attempts[0].loss) and report.attempts[0].chosen[0] == "16-true"
    assert report.rows[0].options["16-true"].measured_damage == math.inf
    assert report.plan == {"0": "32-true", "2": "16-true", "4": "16-true"}
    assert math.isfinite(report.measured["plan"].loss) and report.fits("plan")
    assert report.uniform_won is None and report.beats_uniform


def test_a_weight_holding_nan_is_refused_naming_its_path_in_the_model() -> None:
    """A NaN in layer 4's weight was reported as "cannot quantize 0.weight", the path inside
    the one-layer copy the search quantizes."""
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, 8)
    )
    with torch.no_grad():
        model[4].weight[0, 0] = float("nan")
    with pytest.raises(ValueError, match=r"the model's 4.weight holds 1 inf/NaN value\(s\): a se"):
        search(
            model, [(torch.randn(8, 32), torch.randn(8, 8))], F.mse_loss,
            budget={"memory": 0.5}, formats=[INT8], baseline="32-true", reps=1,
        )  # fmt: skip


def test_a_model_on_the_meta_device_is_refused() -> None:
    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(16, 8), nn.Tanh(), nn.Linear(8, 4))
    with pytest.raises(ValueError, match=r"0\.weight \(and 3 more\) is on the meta device"):
        search(
            model,
            [(torch.zeros(2, 16), torch.zeros(2, 4))],
            F.mse_loss,
            budget={"memory": 0.5},
            baseline="32-true",
            device_info=ZEN4,
        )


def test_a_model_that_is_one_layer_is_told_to_wrap_it() -> None:
    """A bare Linear read "Linear has no layer a search can choose for (Linear, ...)"."""
    with pytest.raises(ValueError, match=r"itself one Linear.*\(nn.Sequential\(layer\)\)"):
        search(
            nn.Linear(16, 4),
            [(torch.zeros(2, 16), torch.zeros(2, 4))],
            F.mse_loss,
            budget=Budget(memory=0.5),
            baseline="32-true",
            device_info=ZEN4,
        )


def test_a_model_without_searchable_layers_is_refused() -> None:
    with pytest.raises(ValueError, match="no layer a search can choose for"):
        search(
            nn.Sequential(nn.Conv1d(2, 2, 1)),
            [(torch.zeros(1, 2, 3), torch.zeros(1, 2, 3))],
            F.mse_loss,
            budget=Budget(memory=0.5),
            baseline="32-true",
        )


# --- the command line -----------------------------------------------------------------------

FACTORY = textwrap.dedent(
    """
    import torch
    import torch.nn.functional as F
    from torch import nn

    def make():
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, 8))
        x, t = torch.randn(16, 32), torch.randn(16, 8)
        return {"model": model, "batches": [(x[:8], t[:8])], "eval_batches": [(x[8:], t[8:])],
                "loss_fn": F.mse_loss}
    """
)


def test_doctor_search_writes_the_plan_and_its_report(tmp_path, capsys) -> None:
    factory = tmp_path / "f.py"
    factory.write_text(FACTORY)
    out = tmp_path / "out"
    status = main(
        [
            "doctor",
            f"{factory}:make",
            "--search",
            "--memory",
            "0.5",
            "--baseline",
            "32-true",
            "--formats",
            INT8,
            "--out",
            str(out),
        ]
    )
    text = capsys.readouterr().out
    assert status == 0, text
    assert "plans, measured" in text and "plan:" in text
    policy = PolicyMap.load(out / "policy.json")
    assert policy.default == as_policy("32-true")
    assert "--search --memory 0.5" in (out / "search.md").read_text()


def test_doctor_search_refuses_bad_flags(tmp_path, capsys) -> None:
    factory = tmp_path / "f.py"
    factory.write_text(FACTORY)
    assert main(["doctor", f"{factory}:make", "--search", "--no-report"]) == 2
    assert "--search needs a budget" in capsys.readouterr().err
    assert main(["doctor", f"{factory}:make", "--memory", "0.5", "--no-report"]) == 2
    assert "--memory is an option of --search" in capsys.readouterr().err
    # options a diagnosis would have taken and ignored, without a word
    for flags, said in (
        (["--baseline", "32-true"], "--baseline is an option of --search and --fit (the "),
        (["--count", "training"], "--count is an option of --search"),
        (["--allow-slow"], "--allow-slow is an option of --search and --fit"),
        (["--optimizer", "sgd"], "--optimizer says how --lr sizes a step; give --lr too"),
    ):
        assert main(["doctor", f"{factory}:make", *flags, "--no-report"]) == 2
        assert said in capsys.readouterr().err
    assert (
        main(
            [
                "doctor",
                f"{factory}:make",
                "--search",
                "--memory",
                "0.5",
                "--precision",
                "bf16-true",
                "--no-report",
            ]
        )
        == 2
    )
    assert "--precision is not an option of --search" in capsys.readouterr().err
    assert (
        main(
            [
                "doctor",
                f"{factory}:make",
                "--search",
                "--memory",
                "0.01",
                "--baseline",
                "32-true",
                "--formats",
                INT8,
                "--no-report",
            ]
        )
        == 2
    )
    assert "smallest reachable" in capsys.readouterr().err
    factory.write_text(FACTORY.replace('"model": model, ', ""))
    assert main(["doctor", f"{factory}:make", "--search", "--memory", "0.5", "--no-report"]) == 2
    assert "the factory's dict has 'batches' but no 'model'" in capsys.readouterr().err


# --- layers the model treats unusually ------------------------------------------------------


class Unusual(nn.Module):
    """An in-place residual on a layer's output, a frozen first layer, and a head that reads
    the embedding's weight itself."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(40, 32)
        self.frozen = nn.Linear(32, 32)
        self.fc = nn.Linear(32, 32)
        self.frozen.requires_grad_(False)
        self.emb.weight.requires_grad_(False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        h = self.frozen(self.emb(idx))
        y = self.fc(h)
        y += h  # in place, on the recorded output
        return F.linear(torch.tanh(y), self.emb.weight)


def test_layers_changed_in_place_frozen_or_read_outside_are_scored_right() -> None:
    torch.manual_seed(0)
    model = Unusual()
    idx = torch.randint(0, 40, (4, 8))
    report = search(
        model,
        [(idx, idx)],
        token_loss,
        budget={"memory": 0.9},
        formats=[INT8],
        baseline="32-true",
        reps=1,
    )
    rows = {r.unit.paths: r for r in report.rows}
    # float32 is the reference: no damage, whatever the model does to the output after
    assert rows[("fc",)].options["32-true"].damage == 0
    # a frozen layer still gets the loss's gradient at its output, so a damage
    assert rows[("frozen",)].options[INT8.replace("32-true", "float32")].damage > 0
    # the embedding's weight is read by the head: no quantized format for it
    (reason,) = rows[("emb",)].not_applicable.values()
    assert "its parent Unusual reads its weight in its own forward" in reason
    assert report.plan["emb"] == "32-true"


def test_training_bytes_of_a_plan_that_freezes_every_layer_are_measured() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 32, bias=False), nn.Tanh(), nn.Linear(32, 8, bias=False))
    batch = (torch.randn(8, 32), torch.randn(8, 8))
    report = search(
        model,
        [batch],
        F.mse_loss,
        budget={"memory": 0.1},
        formats=[INT8],
        baseline="32-true",
        count="training",
        reps=1,
    )
    assert set(report.plan.values()) == {"int8_from_float32"}
    assert report.measured["plan"].unit_bytes == 32 * 32 + 32 * 4 + 8 * 32 + 8 * 4
    assert report.measured["plan"].trainable == 0


def test_a_plan_leaving_nothing_to_train_is_returned_untrained_with_why() -> None:
    """Found by a review: `search(train_steps=3)` whose plan quantized every layer (frozen
    int8/int4 weights) finished the whole search and then raised "the plan leaves nothing
    to train", throwing the search away. The plan is now returned, the training run not
    run, and the report says why."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32, bias=False), nn.GELU(), nn.Linear(32, 4, bias=False))
    batch = (torch.randn(32, 16), torch.randint(0, 4, (32,)))
    report = search(
        model,
        [batch],
        F.cross_entropy,
        budget={"memory": 0.3},
        formats=["32-true", INT8, INT4],
        baseline="32-true",
        reps=1,
        train_steps=3,
    )
    assert "32-true" not in report.plan.values() and report.trained == {}
    assert report.untrained.startswith("train_steps=3 not run: the plan leaves nothing to train")
    assert report.untrained in report.summary() and report.untrained in report.to_markdown()
    assert report.to_dict()["untrained"] == report.untrained


class MLPBlock(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.a = nn.Linear(d, 4 * d)
        self.b = nn.Linear(4 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.b(F.gelu(self.a(x)))


def test_a_frozen_uniform_plan_does_not_win_a_training_search_on_noise() -> None:
    """Found by a review: with room for float32 and count="training", int8 everywhere
    (frozen weights: nothing but the biases trains) measured a loss before training 0.01%
    below float32's, noise, and was returned over the solved float32 plan; trained, its
    loss is far higher. Under count="training" a plan with fewer trainable parameters
    replaces the solved one only when lower by more than the tolerance; under
    count="weights" the lowest loss still wins."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), *(MLPBlock(32) for _ in range(3)), nn.Linear(32, 4))
    g = torch.Generator().manual_seed(1)
    batch = (torch.randn(256, 16, generator=g), torch.randint(0, 4, (256,), generator=g))
    kw = dict(formats=["32-true", INT8], baseline="32-true", reps=1, retries=0)
    int8 = "all int8_from_float32"
    trained = search(model, [batch], F.cross_entropy, budget="memory=3MB", count="training", **kw)
    m = trained.measured
    assert m[int8].loss < m["plan"].loss < m[int8].loss * (1 + trained.tolerance)
    assert m[int8].trainable < m["plan"].trainable and trained.fits(int8)
    assert trained.uniform_won is None and set(trained.plan.values()) == {"32-true"}
    assert "int8/int4 weights are frozen" in trained.summary()
    weights = search(model, [batch], F.cross_entropy, budget={"memory": 1.0}, **kw)
    assert weights.uniform_won == int8


def test_a_budget_at_the_cheapest_plan_is_met_when_rounding_leaves_no_room() -> None:
    # costs with no common divisor under a coarse grid: rounding up overshoots the budget,
    # yet the cheapest plan fits it exactly
    costs = [[[3.3, 1.1], [3.3, 1.2]]]
    assert solve([[0.0, 1.0], [0.0, 1.0]], costs, [2.3], resolution=10) == [1, 1]


# --- what the caller keeps -----------------------------------------------------------------


def test_the_callers_model_and_rng_state_are_left_as_they_were() -> None:
    torch.manual_seed(5)
    model = nn.Sequential(
        nn.Linear(16, 32), nn.BatchNorm1d(32), nn.Dropout(0.3), nn.Tanh(), nn.Linear(32, 8)
    )
    model[0].requires_grad_(False)
    model[4].eval()  # a mix of modes, as the caller set them
    batch = (torch.randn(16, 16), torch.randn(16, 8))
    state = copy.deepcopy(model.state_dict())
    modes = [m.training for m in model.modules()]
    rng = torch.get_rng_state()
    search(
        model,
        [batch],
        F.mse_loss,
        budget={"memory": 0.5},
        formats=[INT8],
        baseline="32-true",
        train_steps=2,
        reps=1,
        seed=123,
    )
    assert torch.equal(torch.get_rng_state(), rng)
    assert [m.training for m in model.modules()] == modes
    assert [p.requires_grad for p in model.parameters()] == [False, False, True, True, True, True]
    assert all(torch.equal(v, state[k]) for k, v in model.state_dict().items())
    assert all(p.grad is None for p in model.parameters())


def test_a_stochastic_rounding_format_leaves_the_callers_rng_state_as_it_was() -> None:
    """The candidates' timed backward ran outside the seeded runs: a stochastic-rounding
    format drew from the caller's generator."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 32), nn.GELU(), nn.Linear(32, 16))
    batch = (torch.randn(8, 32), torch.randn(8, 16))
    rng = torch.get_rng_state()
    report = search(
        model,
        [batch],
        F.mse_loss,
        budget="memory=1.0",
        baseline="32-true",
        formats=["32-true", "nvfp4/sr_from_32-true"],
        count="training",
        allow_slow=True,
        reps=1,
    )
    assert all("nvfp4/sr_from_float32" in r.options for r in report.rows)
    assert torch.equal(torch.get_rng_state(), rng)


class Aliased(nn.Module):
    """One Linear registered at two paths (``first`` and ``blocks.0``) and called once."""

    def __init__(self) -> None:
        super().__init__()
        self.first = nn.Linear(16, 16)
        self.blocks = nn.ModuleList([self.first, nn.Linear(16, 16)])
        self.head = nn.Linear(16, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = torch.tanh(block(x))
        return self.head(x)


def test_a_layer_registered_at_two_paths_takes_one_format_at_both() -> None:
    torch.manual_seed(6)
    model = Aliased()
    batch = (torch.randn(16, 16), torch.randn(16, 8))
    assert [(u.paths, u.aliases) for u in find_units(model)] == [
        (("first",), ("blocks.0",)),
        (("blocks.1",), ()),
        (("head",), ()),
    ]
    report = search(
        model,
        [batch],
        F.mse_loss,
        budget={"memory": 0.4},
        formats=[INT8],
        baseline="32-true",
        reps=1,
    )
    int8 = "int8_from_float32"
    assert report.plan == {"first": int8, "blocks.0": int8, "blocks.1": int8, "head": int8}
    again = mixprec.apply(copy.deepcopy(model), report.policy).eval()
    assert type(again.blocks[0]).__name__ == "Int8Linear" and again.blocks[0] is again.first
    with torch.no_grad():
        assert float(F.mse_loss(again(batch[0]), batch[1])) == report.measured["plan"].loss


def test_a_budget_given_as_a_plans_fraction_of_the_baseline_holds_that_plan() -> None:
    # int8 Linear(40, 5): 240 bytes of float32's 820; 240 / 820 * 820 is an ulp below 240
    assert 240 / 820 * 820 < 240
    assert solve([[0.0, 1.0]], [[[820, 240]]], [240 / 820 * 820]) == [1]
    torch.manual_seed(7)
    model = nn.Sequential(nn.Linear(40, 5))
    report = search(
        model,
        [(torch.randn(8, 40), torch.randn(8, 5))],
        F.mse_loss,
        budget={"memory": 240 / 820},
        formats=[INT8],
        baseline="32-true",
        reps=1,
    )
    assert report.plan == {"0": "int8_from_float32"}
    assert report.measured["plan"].unit_bytes == 240 and report.fits("plan")


class ReadOutside(nn.Module):
    """A head computed as ``F.linear(h, emb.weight)``: it reads the embedding's weight."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(40, 32)
        self.fc = nn.Linear(32, 32)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return F.linear(torch.tanh(self.fc(self.emb(idx))), self.emb.weight)


def test_a_weight_read_outside_its_layer_keeps_the_baselines_dtype() -> None:
    torch.manual_seed(0)
    model = ReadOutside()
    idx = torch.randint(0, 40, (4, 8))
    # float32 code reading a bfloat16 weight would fail: bf16-true is not for emb
    report = search(
        model,
        [(idx, idx)],
        token_loss,
        budget={"memory": 0.8},
        formats=["bf16-true"],
        baseline="32-true",
        device_info=ZEN4,
        reps=1,
    )
    rows = {r.unit.paths: r for r in report.rows}
    assert rows[("emb",)].not_applicable == {
        "bf16-true": "emb's weight is read by linear outside any layer"
    }
    assert report.plan == {"emb": "32-true", "fc": "bf16-true"}


def test_float32_winning_over_a_layer_whose_weight_is_read_outside_is_reported() -> None:
    """Under a bfloat16 baseline the embedding the head reads has no float32 option, but
    the float32 plan puts it in float32: its speed cost read that option (KeyError), and
    so did the report's row of a layer float32 won."""
    torch.manual_seed(0)
    model = ReadOutside()
    idx = torch.randint(0, 40, (4, 8))
    with torch.no_grad():
        batch = (idx, model(idx))  # float32's own outputs: its loss is 0, the lowest

    def loss(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return F.mse_loss(out.float(), target)

    kw = dict(baseline="bf16-true", formats=["32-true", "bf16-true"], device_info=ZEN4, reps=1)
    report = search(model, [batch], loss, budget="memory=1GiB", **kw)
    emb = next(r for r in report.rows if r.unit.paths == ("emb",))
    assert "32-true" not in emb.options and "32-true" in emb.not_applicable
    assert report.uniform_won == "float32"
    assert report.plan == {"emb": "32-true", "fc": "32-true"}
    assert report._layer_rows()[0][3:7] == ["32-true", "-", "-", "-"]
    assert "not searched in 32-true" in report.to_markdown()
    timed = search(model, [batch], loss, budget="speed=2.0", **kw)
    assert timed.fits("float32") is None  # the embedding never timed in float32


class TwoTables(nn.Module):
    """Two embeddings whose bytes share only the divisor 4: under two budgets their costs are
    rounded up to 1/1000 of each budget."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Embedding(97, 40)
        self.b = nn.Embedding(89, 40)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return (self.a(idx % 97) * self.b(idx % 89)).sum(-1)


def test_a_budget_at_the_cheapest_plan_is_met_under_two_budgets() -> None:
    # rounded up, the two cheapest options take 1001 of the memory budget's 1000 steps
    costs = [[[3.3, 1.1], [3.3, 1.2]], [[1.0, 1.0], [1.0, 1.0]]]
    assert solve([[0.0, 1.0], [0.0, 1.0]], costs, [2.3, 10.0], resolution=10) == [1, 1]
    torch.manual_seed(8)
    model = TwoTables()
    int8 = 97 * 40 + 97 * 4 + 89 * 40 + 89 * 4  # codes and a float32 scale per row
    report = search(
        model,
        [(torch.randint(0, 200, (4, 8)), torch.randn(4, 8))],
        F.mse_loss,
        # a speed budget no plan approaches, beside memory at the cheapest plan exactly
        budget={"memory": int8 / ((97 + 89) * 40 * 4), "speed": 1e6},
        formats=[INT8],
        baseline="32-true",
        reps=1,
    )
    assert report.plan == {"a": "int8_from_float32", "b": "int8_from_float32"}
    assert report.measured["plan"].unit_bytes == int8


class Encoder(nn.Module):
    """An embedding, a torch TransformerEncoder (whose layers' fused inference path reads
    their feed-forward weights itself) and a head."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(50, 32)
        layer = nn.TransformerEncoderLayer(32, 2, 64, dropout=0.0, batch_first=True)
        self.enc = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
        self.head = nn.Linear(32, 50)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.head(self.enc(self.emb(idx)))


def test_the_feed_forward_of_a_torch_transformer_layer_is_searched_and_runs() -> None:
    """An int8 plan crashed at verification there (the fused path read an Int8Linear's
    weight); the swap now turns the layer's fused path off."""
    torch.manual_seed(9)
    model = Encoder()
    ffn = [f"enc.layers.{i}.linear{j}" for i in range(2) for j in (1, 2)]
    assert [u.paths for u in find_units(model)] == [("emb",), *[(p,) for p in ffn], ("head",)]
    idx = torch.randint(0, 50, (4, 8))
    report = search(
        model,
        [(idx, idx)],
        token_loss,
        budget={"memory": 0.3},
        formats=[INT8],
        baseline="32-true",
        reps=1,
    )
    assert report.plan == dict.fromkeys(["emb", *ffn, "head"], "int8_from_float32")
    # the plan runs as verified in eval without gradients, where the fused path would run
    again = mixprec.apply(copy.deepcopy(model), report.policy).eval()
    with torch.no_grad():
        assert float(token_loss(again(idx), idx)) == report.measured["plan"].loss


class Sampling(nn.Module):
    """A VAE's reparameterised sample: random numbers drawn in every forward, eval or not."""

    def __init__(self) -> None:
        super().__init__()
        self.enc = nn.Linear(32, 16)
        self.dec = nn.Linear(8, 32)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        mu, log_var = self.enc(x).chunk(2, -1)
        return self.dec(mu + torch.randn_like(mu) * (0.5 * log_var).exp())


def test_a_model_drawing_random_numbers_draws_the_same_ones_in_every_plan() -> None:
    torch.manual_seed(10)
    model = Sampling()
    x = torch.randn(16, 32)
    rng = torch.get_rng_state()
    report = search(
        model,
        [(x[:8], x[:8]), (x[8:], x[8:])],
        F.mse_loss,
        budget={"memory": 1.0},
        formats=[INT8],
        baseline="32-true",
        reps=1,
    )
    assert report.plan == {"enc": "32-true", "dec": "32-true"}
    measured = report.measured
    # one network, one loss: as the reference run measured it
    assert measured["plan"].loss == measured["baseline"].loss == measured["float32"].loss
    assert measured["float32"].loss == report.reference_loss
    assert report.attempts[0].gap == 0
    assert torch.equal(torch.get_rng_state(), rng)


def test_a_frozen_layer_whose_output_is_changed_in_place_is_scored_as_if_it_were_not() -> None:
    torch.manual_seed(11)
    plain = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 8))
    frozen = copy.deepcopy(plain)
    frozen[0].requires_grad_(False)
    frozen[1] = nn.ReLU(inplace=True)  # in place on the frozen layer's output
    batch = (torch.randn(16, 64), torch.randn(16, 8))
    damages = []
    for model in (plain, frozen):
        report = search(
            model,
            [batch],
            F.mse_loss,
            budget={"memory": 0.5},
            formats=[INT8],
            baseline="32-true",
            reps=1,
        )
        damages.append([r.options["int8_from_float32"].damage for r in report.rows])
    assert damages[1] == damages[0] and all(d > 0 for d in damages[0])


def test_a_budget_takes_any_real_number_as_a_float() -> None:
    """numpy's float32 (a budget read from an array or a config) was refused as 'must be a
    number'; every real number is taken, as a float."""
    np = pytest.importorskip("numpy")
    from fractions import Fraction

    for value in (np.float32(0.5), np.float64(0.5), np.int64(1), Fraction(1, 2), 1):
        budget = Budget.of({"memory": value})
        assert type(budget.memory) is float and budget.memory == float(value)
    with pytest.raises(TypeError, match="must be a number"):
        Budget(memory=np.bool_(True))
    with pytest.raises(ValueError, match="positive fraction"):
        Budget(speed=np.float32("nan"))


@pytest.mark.parametrize(
    "states", [{"0": "int8", "2": "int8"}, {"0": "int8/block=65536", "2": "int4"}]
)
@pytest.mark.parametrize("base", ["bf16-true", "32-true"])
def test_training_bytes_of_a_plan_with_state_formats_are_what_training_holds(base, states):
    """The search's count of a plan with optimizer-state formats against a real step: the
    weights, their gradients and every tensor the low-bit optimizer holds (moments, scales,
    Kahan buffers), equal. It counted a small 16-bit parameter's moments (a bias under
    MIN_SIZE, which the optimizer keeps in float32) in its own dtype, under by 4 bytes an
    element, and a block larger than its parameter as given, where the optimizer cuts it to
    the parameter (over by 114,520 bytes here)."""
    from mixprec.optim.states import state_bytes as held
    from mixprec.plan.measure import _state_formats

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 96), nn.ReLU(), nn.Linear(96, 10))
    plan = mixprec.PolicyMap(base, states=states)
    precision = mixprec.Precision(
        plan, compensation="kahan" if base == "bf16-true" else None, allow_slow=True
    )
    model, opt = precision.setup(model, torch.optim.AdamW(model.parameters()))
    x = precision.convert_input(torch.randn(4, 64))
    precision.backward(model(x).float().pow(2).mean())
    precision.step(opt)
    weights_and_grads = sum(2 * p.numel() * p.element_size() for p in model.parameters())
    real = weights_and_grads + held(opt.optimizer)
    assert state_bytes(model, "training", _state_formats(model, plan)) == real


def test_two_budgets_met_exactly_by_the_baseline_find_it():
    """Costs rounded up to the grid of two budgets (1/1000 of each) made three units at a
    third of each budget 1002 steps, past the grid: the baseline plan, at exactly 1.0x of
    both, was lost and `search(budget={"memory": 1.0, "speed": 1.0})` raised BudgetError."""
    damages = [[0.0, 0.0, 1e-4]] * 3
    memory = [[2000.0, 4000.0, 1000.0]] * 3
    speed = [[1.0, 0.9, 1.3]] * 3
    budgets = [6000.0, 3.0]
    assert brute_force(damages, [memory, speed], budgets) == (0.0, [0, 0, 0])
    assert solve(damages, [memory, speed], budgets) == [0, 0, 0]
    # a plan of least damage among those that fit at the edge, not merely the first
    damages = [[1.0, 0.5, 1e-4]] * 3
    memory = [[2000.0, 2000.0, 1000.0]] * 3
    speed = [[1.0, 1.0, 1.3]] * 3
    assert solve(damages, [memory, speed], budgets) == [1, 1, 1]
    assert solve(damages, [memory, speed], [5999.0, 3.0]) is None


def test_plans_are_measured_on_the_batch_as_given_when_the_model_writes_into_it():
    """Every plan's run took the caller's batch itself: a model scaling its input in place
    gave each later plan another batch ("float32" and "baseline", the same precision,
    measured different losses) and left the caller's batch at 0."""

    class ScaledInPlace(nn.Module):
        def forward(self, x):
            return x.div_(255.0)

    torch.manual_seed(0)
    model = nn.Sequential(ScaledInPlace(), nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 4))
    x, y = torch.rand(32, 16) * 255, torch.randint(0, 4, (32,))
    given = x.clone()
    report = search(
        model, [(x, y)], F.cross_entropy, budget="memory=0.5", baseline="32-true", reps=1
    )
    assert report.measured["float32"].loss == report.measured["baseline"].loss
    assert torch.equal(x, given)


def test_a_uniform_plan_equal_to_the_chosen_one_is_not_called_better():
    """int4 in groups of 32 and of 128 quantize these small layers alike (the group is cut
    to the layer): the summary said the plan was "NOT better than" the one it equals."""
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 32), nn.GELU(), nn.Linear(32, 4)
    )
    x, y = torch.randn(32, 16), torch.randint(0, 4, (32,))
    report = search(
        model, [(x, y)], F.cross_entropy, budget="memory=0.5", baseline="32-true", reps=1
    )
    summary = report.summary()
    equal = [
        n
        for n in report.uniform
        if (report.measured[n].loss, report.measured[n].unit_bytes)
        == (report.measured["plan"].loss, report.measured["plan"].unit_bytes)
    ]
    assert equal  # (int4 in groups of 32 and of 128)
    for n in equal:
        assert f"NOT better than {n}," not in summary
        assert f"the plan is {n}" in summary or f"the same loss and bytes as {n}" in summary


class _SharedNormBlock(nn.Module):
    def __init__(self, shared: nn.Module) -> None:
        super().__init__()
        self.shared, self.lin = shared, nn.Linear(32, 32)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.lin(self.shared(x))


class _SharedNormNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        shared = nn.LayerNorm(32)
        self.inp, self.head = nn.Linear(8, 32), nn.Linear(32, 4)
        self.blocks = nn.ModuleList([_SharedNormBlock(shared), _SharedNormBlock(shared)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.inp(x)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def test_blocks_sharing_a_module_take_no_activation_option_but_keep():
    """Blocks holding one LayerNorm between them were offered options that resolving the
    plan then refused (the shared norm would take two): the search failed. They keep."""
    torch.manual_seed(0)
    batches = [(torch.randn(8, 8), torch.randint(0, 4, (8,)))]
    report = mixprec.search(
        _SharedNormNet(), batches, F.cross_entropy, budget=Budget(memory_bytes=10**12),
        count="training", batch_size=16, formats=["32-true"], baseline="32-true", reps=1,
        retries=0,
    )  # fmt: skip
    assert report.activations["blocks.0"] == report.activations["blocks.1"] == "keep"
    row = next(r for r in report.blocks if r.path == "blocks.0")
    assert "also reachable at blocks.1.shared" in row.not_applicable["checkpoint"]


class Teacher(nn.Module):
    """A student and a frozen teacher branch the forward runs with gradients off (`grad`:
    the context it runs under; `deep`: a second layer inside it)."""

    def __init__(self, grad: object, deep: bool = False) -> None:
        super().__init__()
        self.grad, self.deep = grad, deep
        self.enc, self.head = nn.Linear(16, 32), nn.Linear(32, 4)
        self.teacher = nn.Linear(16, 4)
        self.inner = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with self.grad():
            t = self.teacher(x)
            if self.deep:
                t = self.inner(torch.tanh(t))
        if not self.deep:
            t = self.inner(t)
        return self.head(F.gelu(self.enc(x))) + 0.1 * t


def test_a_layer_run_without_gradients_is_scored_by_the_gradient_reaching_its_output() -> None:
    """Found by a review: a searched layer the forward runs under ``torch.no_grad()`` (a
    frozen teacher branch) crashed the search ("cannot register a hook on a tensor that
    doesn't require gradient"). Its output's copy now requires grad, so where the loss
    reaches it (the ops after it run with gradients) its damage is the one it takes run
    with gradients on; where none can (the ops after it run without too), the search is
    refused naming it, not scored as harmless."""
    torch.manual_seed(0)
    batch = (torch.randn(16, 16), torch.randint(0, 4, (16,)))
    kw = dict(budget="memory=0.5", baseline="32-true", formats=[INT8], reps=1, retries=0)
    weights, damages = Teacher(torch.enable_grad).state_dict(), []
    for grad in (torch.enable_grad, torch.no_grad, torch.inference_mode):
        model = Teacher(grad)
        model.load_state_dict(weights)
        report = search(model, [batch], F.cross_entropy, **kw)
        damages.append(
            {(r.unit.paths, n): o.damage for r in report.rows for n, o in r.options.items()}
        )
    assert damages[1] == damages[2] == damages[0]
    assert damages[0][(("teacher",), "int8_from_float32")] > 0
    with pytest.raises(ValueError, match=r"teacher ran with gradients off .* no gradient"):
        search(Teacher(torch.no_grad, deep=True), [batch], F.cross_entropy, **kw)
