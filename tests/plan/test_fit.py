"""The search under a budget in bytes: activations counted at the batch (measured, as
`mixprec.activations.saved_bytes` measures them), each block's activation option chosen
with the formats, and `fit`: the measured peak of the plan it returns within the budget,
no worse a loss than the uniform activation plans that fit, and the shortfall said when
nothing fits.

Formats are float32 and int8 on float32 (every CPU runs them alike); budgets are computed
from a first count or measurement in the test, never written as machine figures."""

from __future__ import annotations

import math
import re
import warnings
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from mixprec.activations import saved_bytes
from mixprec.plan import Budget, BudgetError, search
from mixprec.plan.activation_choice import (
    _grads,
    batch_at,
    plan_activations,
    saved_under,
    split_saved,
)
from mixprec.plan.budget import parse_bytes
from mixprec.plan.fitting import FitReport, Peak, Tried, _against_uniform, fit, step_peaks
from mixprec.plan.measure import convert
from mixprec.plan.report import BlockRow, Option
from mixprec.plan.units import state_bytes
from mixprec.policy.map import PolicyMap
from mixprec.precision import Precision

INT8 = "int8_from_32-true"
FORMATS = ["32-true", INT8]
FAST = {"formats": FORMATS, "baseline": "32-true", "reps": 1, "retries": 0}


class Block(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.up = nn.Linear(d, 4 * d)
        self.down = nn.Linear(4 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(F.gelu(self.up(self.norm(x))))


class TinyLM(nn.Module):
    def __init__(self, vocab: int = 16, d: int = 16, n: int = 2) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.blocks = nn.ModuleList(Block(d) for _ in range(n))
        self.head = nn.Linear(d, vocab)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.emb(ids)
        for block in self.blocks:
            h = block(h)
        return self.head(h)


def token_loss(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1), ids.flatten())


def tiny(rows: int = 4) -> tuple[nn.Module, list]:
    torch.manual_seed(0)
    ids = torch.randint(0, 16, (rows, 8))
    return TinyLM(), [(ids, ids)]


def counted(report) -> int:
    p = report.measured["plan"]
    return p.unit_bytes + p.activation_bytes + report.fixed_bytes


# --- budgets in bytes ----------------------------------------------------------------------


def test_a_memory_budget_is_taken_in_bytes_with_a_unit_and_bad_sizes_are_refused() -> None:
    assert Budget.of("memory=2GiB") == Budget(memory_bytes=2 * 2**30)
    assert Budget.of("memory=1.5GB,speed=1").memory_bytes == 1_500_000_000
    assert Budget.of({"memory_bytes": 4096}).kinds == ["memory"]
    assert Budget.of("memory=0.5").memory == 0.5  # a bare number stays a fraction
    assert parse_bytes("512MiB") == 512 * 2**20
    # (the bench's --memory-limit and the doctor's --fit read a size written out alike:
    # "512M" was refused by --fit)
    from mixprec.cli.bench import parse_size

    for text in ("512M", "1.5G", "4GiB", "500MB", "100000B", "2k", "3gb"):
        assert parse_bytes(text) == parse_size(text), text
    for bad in ("4XB", "GiB", "4", "-1GiB", "0B", ""):
        with pytest.raises(ValueError, match="size|at least one byte"):
            parse_bytes(bad)
    with pytest.raises(ValueError, match="not a size"):
        Budget.of("memory=2XB")
    with pytest.raises(ValueError, match="not both"):
        Budget(memory=0.5, memory_bytes=10)
    with pytest.raises(ValueError, match="positive whole number"):
        Budget(memory_bytes=0)


# --- activations counted and chosen ----------------------------------------------------------


def test_activation_bytes_are_counted_at_the_batch_as_saved_bytes_measures_them() -> None:
    model, batches = tiny(rows=4)
    reports = {
        b: search(
            model,
            batches,
            token_loss,
            budget=Budget(memory_bytes=10**12),
            count="training",
            batch_size=b,
            **FAST,
        )
        for b in (8, 16)
    }
    ids = torch.randint(0, 16, (8, 8))
    direct = saved_bytes(model.train(), ids)
    for block in reports[8].blocks:
        under = sum(
            n for p, n in direct.items() if p == block.path or p.startswith(block.path + ".")
        )
        assert block.options["keep"].bytes == under > 0
        twice = next(b for b in reports[16].blocks if b.path == block.path)
        assert twice.options["keep"].bytes == 2 * under  # activations grow with the batch
    # a budget with room keeps every activation: recompute costs time, storage damage
    assert set(reports[8].activations.values()) == {"keep"}
    assert reports[8].policy.activations is None
    with pytest.raises(ValueError, match="count='training'"):
        search(model, batches, token_loss, budget="memory=0.5", batch_size=8, **FAST)
    with pytest.raises(ValueError, match="batch_size must be"):
        search(model, batches, token_loss, budget="memory=0.5", count="training", batch_size=0)


class TwoHeads(nn.Module):
    """Two blocks saving one tensor: each head's Linear saves the shared hidden state."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(8, 64)
        self.a = nn.Linear(64, 4)
        self.b = nn.Linear(64, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        return self.a(h) + self.b(h)


def test_a_tensor_two_blocks_save_is_counted_as_the_step_holds_it() -> None:
    """Measured with every block under one option at once, the shared tensor counted in the
    first block only: the second block's bytes were 0 under every option, so it kept, and
    a plan storing the first in bf16 was counted at half of keep's bytes while the step
    held the tensor and its bfloat16 copy (1.5x keep's). Each option is now what it changes
    in the whole step's bytes with the others keeping: storing one head's save does not
    shrink the step, so no plan reaches 0.9x and the search says so."""
    torch.manual_seed(0)
    batches = [(torch.randn(8, 8), torch.randint(0, 4, (8,)))]
    report = search(
        TwoHeads(),
        batches,
        F.cross_entropy,
        budget=Budget(memory_bytes=10**12),
        count="training",
        batch_size=64,
        **FAST,
    )
    a = next(b for b in report.blocks if b.path == "a")
    # a's bf16 copy comes on top of the tensor b keeps: more bytes than keep's count
    assert a.options["bf16"].bytes > a.options["keep"].bytes > 0
    with pytest.raises(BudgetError, match="no plan fits"):
        search(
            TwoHeads(),
            batches,
            F.cross_entropy,
            budget="memory=0.9",
            formats=["32-true"],
            baseline="32-true",
            count="training",
            batch_size=64,
            reps=1,
            retries=0,
        )


def test_a_budget_only_smaller_activations_meet_gives_a_plan_storing_or_recomputing_them(
    tmp_path,
) -> None:
    model, batches = tiny()
    loose = search(
        model,
        batches,
        token_loss,
        budget=Budget(memory_bytes=10**12),
        count="training",
        batch_size=16,
        **FAST,
    )
    everything = counted(loose)
    bf16 = sum(b.options["bf16"].bytes for b in loose.blocks)
    keep = sum(b.options["keep"].bytes for b in loose.blocks)
    # below every block in bf16, with int8 weights' savings not enough on their own
    weights_saving = sum(
        r.options["32-true"].bytes - min(o.bytes for o in r.options.values()) for r in loose.rows
    )
    budget = everything - (keep - bf16) - weights_saving - 1
    report = search(
        model,
        batches,
        token_loss,
        budget=Budget(memory_bytes=budget),
        count="training",
        batch_size=16,
        **FAST,
    )
    assert counted(report) <= budget
    chosen = set(report.activations.values())
    assert chosen & {"fp8", "checkpoint"}, report.activations
    # the policy file carries the activation rules, and they put the options on a model
    path = report.save(tmp_path)
    loaded = PolicyMap.load(path)
    assert loaded.activations == report.policy.activations is not None
    resolved = loaded.activation_choices(model)
    for block, option in report.activations.items():
        assert resolved[block][0] == option
    # nothing fits a budget below every block recomputed and every weight at its smallest
    with pytest.raises(BudgetError, match="bytes, .* over"):
        search(
            model,
            batches,
            token_loss,
            budget=Budget(memory_bytes=loose.fixed_bytes),
            count="training",
            batch_size=16,
            **FAST,
        )


def test_a_block_used_twice_keeps_and_the_others_are_planned() -> None:
    """Before: a block reached at two paths was planned at its first alone, and the rules
    (its second path keeping) were refused by `resolve`: the search crashed whatever the
    budget. It is no block now; the others are planned."""
    torch.manual_seed(0)
    shared = nn.Sequential(nn.Linear(64, 64), nn.GELU(), nn.Linear(64, 64))
    model = nn.Sequential(nn.Linear(32, 64), shared, shared, nn.GELU(), nn.Linear(64, 4))
    batches = [(torch.randn(16, 32), torch.randint(0, 4, (16,)))]
    report = search(
        model,
        batches,
        F.cross_entropy,
        budget=Budget(memory_bytes=10**12),
        count="training",
        batch_size=64,
        **FAST,
    )
    assert [b.path for b in report.blocks] == ["3", "4"]  # ("0" saves nothing: its input)


# --- fit: measured peaks -------------------------------------------------------------------


def _uniform(option: str) -> PolicyMap:
    return PolicyMap("32-true", activations={r"blocks\.\d+|head": option})


@pytest.mark.slow  # measures plans in fresh processes
def test_fit_returns_a_plan_whose_measured_peak_fits_and_no_worse_than_uniform_ones() -> None:
    model, batches = tiny(rows=32)
    batch = batches[0]

    def measure(plans):
        return step_peaks(model, batch, token_loss, plans)

    keep, checkpointed = measure([_uniform("keep"), _uniform("checkpoint")])
    assert checkpointed.bytes < keep.bytes
    budget = (keep.bytes + checkpointed.bytes) // 2
    report = fit(model, batches, token_loss, budget=budget, measure=measure, **FAST)
    assert report.chosen is not None and report.over is None
    assert report.chosen.peak <= budget
    assert measure([report.chosen.policy])[0].bytes <= budget  # measured again
    assert report.chosen.policy.activations is not None  # keeping everything does not fit
    uniform = [t for t in report.tried if t.name.startswith("all ")]
    assert {t.name for t in uniform} >= {"all keep", "all bf16", "all fp8", "all checkpoint"}
    for t in uniform:
        if t.fits:
            assert report.chosen.loss <= t.loss, (t.name, t.loss, report.chosen.loss)
        else:
            assert t.peak > budget
    assert f"chosen: {report.chosen.name}" in report.summary()


def test_fit_says_how_far_the_smallest_plan_is_over_a_budget_nothing_fits() -> None:
    model, batches = tiny(rows=16)

    def measure(plans):
        return step_peaks(model, batches[0], token_loss, plans)

    report = fit(model, batches, token_loss, budget=1000, measure=measure, **FAST)
    assert report.chosen is None
    smallest = min(t.peak for t in report.tried)
    assert report.over == smallest - 1000 > 0
    assert any(t.name == "smallest" for t in report.tried)
    assert f"{report.over} bytes" in report.summary()
    with pytest.raises(ValueError, match="not a size"):
        fit(model, batches, token_loss, budget="4XB", measure=measure, **FAST)


def test_when_no_searched_plan_fits_its_uniform_activation_plans_are_measured() -> None:
    """Nothing the search solved fit, and the smallest plan was written, while the first
    plan's formats with every block in fp8 or recomputed fit at less loss: those uniform
    plans were never measured. Here every plan measured alone (the search's, the smallest)
    is reported over the budget, the uniform ones (measured together) as they are."""
    model, batches = tiny(rows=16)
    budget = 10**12

    def measure(plans):
        peaks = step_peaks(model, batches[0], token_loss, plans)
        if len(plans) == 1:
            return [Peak(bytes=budget + 1, loss=p.loss) for p in peaks]
        return peaks

    report = fit(model, batches, token_loss, budget=budget, measure=measure, **FAST)
    names = [t.name for t in report.tried]
    assert "all fp8" in names and "smallest" in names
    assert report.chosen is not None and report.chosen.name.startswith("all ")
    assert report.chosen.loss == min(t.loss for t in report.tried if t.fits)
    assert report.search is not None  # the formats are the first plan's


def test_a_plans_peak_counts_the_batch_the_step_holds() -> None:
    """The batch is made before the measured window, so its bytes were left out of every
    plan's peak: a plan said to fit did not once its batch was in memory."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 4))
    wide = torch.randn(64, 4096)  # 1 MiB, of which the model reads 8 columns (a view)

    def loss(out, target):
        return F.mse_loss(out, target)

    class FirstColumns(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.inner = model

        def forward(self, x):
            return self.inner(x[:, :8])

    (peak,) = step_peaks(FirstColumns(), (wide, torch.zeros(64, 4)), loss, [PolicyMap("32-true")])
    assert peak.bytes >= wide.nbytes


def test_a_batch_sliced_from_a_larger_tensor_counts_its_rows_not_the_whole_storage() -> None:
    """The batch's bytes were its tensors' storages: a batch sliced from a dataset held in
    memory (``data[:16]``) added the whole dataset to every plan's peak, though the step
    holds its own compact copy."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 4))
    data, targets = torch.randn(20_000, 8), torch.randn(20_000, 4)  # 720 KB in all
    plans = [PolicyMap("32-true")]
    (sliced,) = step_peaks(model, (data[:16], targets[:16]), F.mse_loss, plans)
    (compact,) = step_peaks(model, (data[:16].clone(), targets[:16].clone()), F.mse_loss, plans)
    assert sliced.bytes == compact.bytes < data.nbytes


def test_a_fit_never_chooses_a_plan_whose_loss_is_not_finite_over_one_that_is() -> None:
    """A plan whose loss is NaN was kept chosen: ``loss < nan`` is false for every loss,
    so neither a uniform activation plan nor the smallest plan that fits at a finite loss
    replaced it."""
    # a uniform activation plan measured after a NaN one that was chosen
    blocks = [BlockRow("0", "Linear", {"keep": Option(100), "checkpoint": Option(10)})]
    nan = Tried("plan 1", PolicyMap("32-true"), 100, 90, math.nan, True)
    report = FitReport(budget=100, batch_size=4, tried=[nan], chosen=nan)
    found = SimpleNamespace(total_bytes=100, activations={})

    def finite_after_nan(plans):
        return [Peak(bytes=90, loss=math.nan if i == 0 else 1.0) for i in range(len(plans))]

    blocks_ = SimpleNamespace(blocks=blocks)
    _against_uniform(report, blocks_, finite_after_nan, lambda policy: 100, nan, found)
    assert [t.name for t in report.tried] == ["plan 1", "all keep", "all checkpoint"]
    assert report.chosen is not None and report.chosen.name == "all checkpoint"
    # nothing solved fits, its uniform activation plans fit at NaN, the smallest finitely
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 4))
    batches = [(torch.randn(4, 8), torch.randn(4, 4))]
    budget, calls = 10**9, []

    def measure(plans):
        calls.append(len(plans))
        if len(plans) > 1:  # the uniform activation plans
            return [Peak(bytes=budget, loss=math.nan) for _ in plans]
        if len(calls) == 1:  # the first solved plan: far over, nothing cheaper tried
            return [Peak(bytes=10**12, loss=1.0)]
        return [Peak(bytes=budget, loss=1.0)]  # the smallest plan

    fitted = fit(model, batches, F.mse_loss, budget=budget, measure=measure, **FAST)
    assert any(t.name.startswith("all ") and t.fits for t in fitted.tried)
    assert fitted.tried[-1].name == "smallest" and fitted.chosen is fitted.tried[-1]


class MLPBlock(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.a = nn.Linear(d, 4 * d)
        self.b = nn.Linear(4 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.b(F.gelu(self.a(x)))


def mlp_blocks() -> tuple[nn.Module, list]:
    """Three residual MLP blocks at batch 256: all int8 measures a lower loss than float32
    before training (by 0.01%, noise), and a much higher one after two steps (frozen)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), *(MLPBlock(32) for _ in range(3)), nn.Linear(32, 4))
    g = torch.Generator().manual_seed(1)
    return model, [(torch.randn(256, 16, generator=g), torch.randint(0, 4, (256,), generator=g))]


def test_a_fit_with_room_for_float32_does_not_return_frozen_int8_weights() -> None:
    """Found by a review: with room for float32, `fit` returned int8 weights everywhere
    (frozen: they cannot train) at a loss after its steps far above float32's, which fit.
    Inside the fit the search let all int8 win on a loss before training lower by 0.01%
    (noise), and the fit measured only that plan's activation variants, never the baseline
    or the other uniform plans. It now measures those too and returns the least loss
    after the steps among all that fit."""
    model, batches = mlp_blocks()

    def measure(plans):
        return step_peaks(model, batches[0], F.cross_entropy, plans)

    linears = {n: INT8 for n, mod in model.named_modules() if isinstance(mod, nn.Linear)}
    float32, int8 = measure([PolicyMap("32-true"), PolicyMap("32-true", linears)])
    assert float32.loss < int8.loss and int8.bytes < float32.bytes
    budget = 2 * float32.bytes
    report = fit(model, batches, F.cross_entropy, budget=budget, measure=measure, **FAST)
    assert report.chosen is not None and report.chosen.peak <= budget
    assert report.chosen.loss <= float32.loss < int8.loss
    assert not report.chosen.policy.rules  # every layer in float32: it trains
    # the uniform plans of one format were measured beside the solved plan's variants
    names = [t.name for t in report.tried]
    assert f"all {INT8.replace('32-true', 'float32')}" in names, names
    fitting = [t for t in report.tried if t.fits]
    assert report.chosen.loss == min(t.loss for t in fitting)


def test_when_nothing_fits_the_distance_is_the_smallest_measured_peaks() -> None:
    """Found by a review: when nothing fit, only the smallest plan (each block in its
    cheapest option by count, mostly recomputed) was measured, and "N bytes over" was its
    peak's distance, while its formats with every block in fp8 peaked 96 KB lower. Its
    formats with every block in each option are now measured too, and the distance is the
    smallest measured peak's."""
    model, batches = mlp_blocks()

    def measure(plans):
        return step_peaks(model, batches[0], F.cross_entropy, plans)

    (float32,) = measure([PolicyMap("32-true")])
    budget = float32.bytes // 4
    report = fit(model, batches, F.cross_entropy, budget=budget, measure=measure, **FAST)
    assert report.chosen is None and report.over == min(t.peak for t in report.tried) - budget
    smallest = next(t for t in report.tried if t.name == "smallest")
    options = ["keep", "bf16", "fp8", "checkpoint"]
    variants = [
        smallest.policy.replace(activations=plan_activations(dict.fromkeys("1234", o)))
        for o in options
    ]
    for option, peak in zip(options, measure(variants), strict=True):
        assert peak.bytes - budget >= report.over, option
    assert f"{report.over} bytes" in report.summary()


def test_a_budget_error_says_its_count_is_the_solvers_sum() -> None:
    """Found by a review: with a layer used twice (its saved tensors in two blocks'
    counts), `BudgetError` said "the smallest plan counts 177108 bytes, 12108 over" while
    a search with that much room returned a plan whose count (total_bytes) was 159700:
    the solver's sum counts a tensor several blocks save once per block. The message now
    says the count is that sum, which a plan's own count can be below."""
    torch.manual_seed(0)
    shared = nn.Linear(32, 32)
    model = nn.Sequential(
        nn.Linear(16, 32), nn.GELU(), shared, nn.ReLU(), shared, nn.Dropout(0.0), nn.Linear(32, 4)
    )
    batches = [(torch.randn(16, 16), torch.randint(0, 4, (16,)))]
    kw = dict(count="training", batch_size=512, **FAST)
    with pytest.raises(BudgetError) as err:
        search(model, batches, F.cross_entropy, budget=Budget(memory_bytes=1), **kw)
    said = str(err.value)
    assert "as the solver sums its layers and blocks" in said and "total_bytes" in said
    summed = int(re.search(r"the smallest plan counts (\d+) bytes", said).group(1))
    found = search(model, batches, F.cross_entropy, budget=Budget(memory_bytes=summed), **kw)
    assert found.total_bytes < summed


# --- each measured plan counted in its own dtypes ---------------------------------------------


def mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(16, 64), nn.GELU(), nn.Linear(64, 64), nn.GELU(), nn.Linear(64, 4)
    )


def test_a_plans_activations_are_counted_in_the_dtypes_its_layers_compute_in() -> None:
    """The blocks' bytes were counted in the baseline's dtypes only: under a bfloat16
    baseline a plan with layers in float32 (no damage, so preferred where bytes allow) saves
    float32 activations, twice the count, and was returned under a byte budget it passed by
    half its activations. Every measured plan's are now its own."""
    torch.manual_seed(0)
    batch = (torch.randn(8, 16), torch.randint(0, 4, (8,)))
    model, cpu = mlp(), torch.device("cpu")
    kw = dict(
        baseline="bf16-mixed",
        formats=["32-true", "bf16-mixed"],
        count="training",
        batch_size=64,
        reps=1,
        allow_slow=True,
    )
    roomy = search(model, [batch], F.cross_entropy, budget="memory=1GiB", **kw)
    paths = [b.path for b in roomy.blocks]
    big = batch_at(batch, 64)
    for name, policy in (("float32", PolicyMap("32-true")), ("plan", roomy.policy)):
        inside, _ = split_saved(saved_under(model, policy, big, F.cross_entropy, cpu, 0), paths)
        assert roomy.measured[name].activation_bytes == inside, name
    counted = sum(b.options["keep"].bytes for b in roomy.blocks)  # (in the baseline's dtypes)
    assert roomy.measured["float32"].activation_bytes > counted
    assert roomy.measured["baseline"].activation_bytes == counted
    # the solver's count of a layer in float32 holds its activations' growth: all of it
    # together, at least the float32 plan's (a module saving less gives nothing back)
    grown = sum(r.options["32-true"].activation_bytes for r in roomy.rows)
    assert grown >= roomy.measured["float32"].activation_bytes - counted > 0
    f32 = roomy.measured["float32"]
    budget = f32.unit_bytes + f32.activation_bytes + f32.extra_bytes + roomy.fixed_bytes - 1
    tight = search(model, [batch], F.cross_entropy, budget=f"memory={budget}B", **kw)
    assert tight.total_bytes <= budget and tight.fits("float32") is False
    inside, _ = split_saved(saved_under(model, tight.policy, big, F.cross_entropy, cpu, 0), paths)
    assert tight.measured["plan"].activation_bytes == inside


def test_each_plan_a_fit_measures_is_counted_in_its_own_formats_and_options() -> None:
    """The uniform activation plans were counted as the plan's count plus the blocks'
    option deltas, measured in the baseline's dtypes: over a plan with int8 layers (frozen,
    saving less) that miscounted them, below their own weights in a larger model (`--fit`
    printed "counted -290 KB"). Each is now counted as the search counts its plans."""
    model, batches = tiny(rows=16)
    big, cpu = batch_at(batches[0], 16), torch.device("cpu")

    def own(policy: PolicyMap) -> int:  # (no bytes outside the blocks differ here)
        held = state_bytes(convert(model, policy), "training")
        return held + sum(saved_under(model, policy, big, token_loss, cpu, 0).values())

    def fitting(plans):  # (every plan fits: all of them measured and counted)
        return [Peak(bytes=0, loss=1.0) for _ in plans]

    budget = own(PolicyMap("32-true")) // 5  # (some layers int8)
    report = fit(model, batches, token_loss, budget=budget, measure=fitting, **FAST)
    assert report.tried[0].policy.rules and len(report.tried) > 2
    for t in report.tried:
        assert t.counted == own(t.policy), t.name


class Scaled(nn.Module):
    """Searched layers beside a parameter no layer holds (fixed bytes)."""

    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.ones(4096))
        self.a = nn.Linear(16, 32)
        self.b = nn.Linear(32, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.relu(self.a(x))) * self.scale[:4]


def test_the_float32_plan_counts_its_own_unsearched_parameters_against_bytes() -> None:
    """The float32 plan converts the unsearched parameters too, but its bytes were the
    searched layers' plus the baseline's fixed bytes: it was said to fit a budget its whole
    model passed, and could be returned."""
    torch.manual_seed(0)
    model, batch = Scaled(), (torch.randn(8, 16), torch.randint(0, 4, (8,)))
    kw = dict(baseline="bf16-true", formats=["32-true", "bf16-true"], reps=1, allow_slow=True)
    roomy = search(model, [batch], F.cross_entropy, budget="memory=1GiB", **kw)
    f32 = roomy.measured["float32"]
    assert f32.extra_bytes == 4096 * 2  # its scale in float32, not bfloat16
    old_count = f32.unit_bytes + roomy.fixed_bytes  # (what it was held to before)
    tight = search(model, [batch], F.cross_entropy, budget=f"memory={old_count}B", **kw)
    assert tight.fits("float32") is False
    assert tight.measured["plan"].model_bytes <= tight.total_bytes <= old_count


def test_sizes_are_read_exactly_and_a_size_given_twice_is_refused() -> None:
    assert parse_bytes("4.1MB") == 4_100_000  # (a float product was a byte short)
    assert parse_bytes("1.005KB") == 1005
    with pytest.raises(ValueError, match="given twice"):
        Budget.of("memory=1GiB,memory=2GiB")


def test_a_search_counting_activations_leaves_the_callers_generators_as_they_were() -> None:
    """The modules' order was read from a forward in training mode outside the seeded
    runs: a Dropout drew from the caller's generator."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.Dropout(0.5), nn.Linear(32, 4))
    batch = (torch.randn(8, 16), torch.randint(0, 4, (8,)))
    torch.manual_seed(3)
    expected = torch.rand(4)
    torch.manual_seed(3)
    search(
        model,
        [batch],
        F.cross_entropy,
        budget="memory=1GiB",
        count="training",
        batch_size=16,
        **FAST,
    )
    assert torch.equal(torch.rand(4), expected)


def test_a_budget_as_a_fraction_retries_a_plan_over_it_as_a_budget_in_bytes_does() -> None:
    """Found by a review: under ``batch_size``, a solved plan whose own count passed a
    fraction budget (``memory=0.9``: a layer moved to float32 saves float32 activations)
    was never solved again, as under a limit in bytes: every int8 weight frozen was
    returned at a tenth of the bytes, 132 of 1796 elements trainable. The fraction's limit
    in bytes now takes the same retry, and the plan returned fits and trains."""
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Linear(16, 32), nn.LayerNorm(32), nn.GELU(), nn.Linear(32, 32), nn.GELU(),
        nn.Linear(32, 4),
    )  # fmt: skip
    batch = (torch.randn(16, 16), torch.randint(0, 4, (16,)))
    kw = dict(
        baseline="bf16-mixed",
        formats=["32-true", "bf16-true", "int8_from_bf16-mixed"],
        count="training",
        batch_size=64,
        reps=1,
        allow_slow=True,
    )
    report = search(model, [batch], F.cross_entropy, budget="memory=0.9", **kw)
    plan = report.measured["plan"]
    assert report.uniform_won is None and len(report.attempts) > 1
    assert "solved again" in report.attempts[0].note
    assert plan.unit_bytes + plan.activation_bytes <= report.limits["memory"]
    assert plan.trainable == report.measured["baseline"].trainable


class FlatLM(nn.Module):
    """A language model whose logits come flat, a row per token: ``[N * T, vocab]``."""

    def __init__(self) -> None:
        super().__init__()
        self.emb, self.mlp, self.out = nn.Embedding(16, 16), nn.Linear(16, 16), nn.Linear(16, 16)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.out(F.gelu(self.mlp(self.emb(ids)))).flatten(0, 1)


def test_batch_size_leaves_tensors_shared_by_the_rows_as_they_are() -> None:
    """Found by a diff review: a tensor whose first dimension was the rows times a row's
    positions was resized per row whatever it was: with one row, a causal mask ``[T, T]``
    or position ids ``[T]`` beside ids ``[1, T]``; with sizes that coincide, a bias of 6
    beside images ``[2, 3, 8, 8]``; the search then failed. Only a flat tensor beside
    integer ids ``[N, T]``, N above 1, is taken for per-token targets."""
    ids = torch.zeros(1, 8, dtype=torch.long)
    one = batch_at({"ids": ids, "mask": torch.ones(8, 8), "pos": torch.arange(8)}, 3)
    assert one["ids"].shape == (3, 8) and one["mask"].shape == (8, 8) and one["pos"].shape == (8,)
    images = batch_at((torch.randn(2, 3, 8, 8), torch.zeros(2), torch.randn(6)), 6)
    assert [tuple(t.shape) for t in images] == [(6, 3, 8, 8), (6,), (6,)]
    flat = batch_at((torch.zeros(2, 4, dtype=torch.long), torch.arange(8)), 3)
    assert flat[1].tolist() == [0, 1, 2, 3, 4, 5, 6, 7, 0, 1, 2, 3]  # (rows 0, 1, 0)


def test_batch_size_resizes_flat_per_token_targets_and_names_what_it_left() -> None:
    """Found by a review: ``batch_size`` repeated only the tensors leading with the first
    tensor's rows: a batch ``(ids [N, T], targets [N * T])`` failed in the loss with
    "Expected input batch_size (128) to match target batch_size (32)", naming neither
    batch_size nor the tensors resized. A tensor leading with a whole multiple of the rows
    that another tensor's per-row positions make (``T`` tokens per row) is resized per row
    now; where the loss still fails, the error says what was resized and what was left."""
    torch.manual_seed(0)
    ids = torch.randint(0, 16, (4, 8))
    targets = torch.randint(0, 16, (32,))
    big = batch_at((ids, targets), 6)
    rows = [0, 1, 2, 3, 0, 1]
    assert torch.equal(big[0], ids[rows])
    assert torch.equal(big[1], targets.reshape(4, 8)[rows].reshape(48))
    kw = dict(budget="memory=0.5", count="training", batch_size=16, **FAST)
    report = search(FlatLM(), [(ids, targets)], F.cross_entropy, **kw)
    assert report.batch_size == 16 and report.blocks
    # targets [8, 4]: 8 rows, no whole number of positions per row of ids: left as they are

    def flat_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(logits, targets.flatten())

    with pytest.raises(ValueError, match=r"batch_size=16 .*batch\[0\].*batch\[1\] \(8, 4\)") as err:
        search(FlatLM(), [(ids, targets.reshape(8, 4))], flat_loss, **kw)
    assert "Expected input batch_size" in str(err.value.__cause__)


class Spectral(nn.Module):
    """A complex filter on the input's spectrum: a complex parameter."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(9, dtype=torch.complex64) * 0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        spectrum = torch.fft.rfft(x, dim=-1) * (1 + self.w)
        return torch.fft.irfft(spectrum, n=x.shape[-1], dim=-1)


def test_lossy_storage_damage_counts_a_complex_gradients_imaginary_part() -> None:
    """Found by a review: the gradients lossy activation storage is scored by were read with
    ``.double()``, which drops a complex gradient's imaginary part (with torch's "discards
    the imaginary part" warning): half of a complex parameter's gradient error went unseen.
    They are read over real and imaginary parts (``torch.view_as_real``), as AdamW steps
    them and the state error measures them."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 16), Spectral(), nn.Tanh(), nn.Linear(16, 4))
    batch = (torch.randn(8, 16), torch.randint(0, 4, (8,)))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # (no complex value cast to a real one)
        flat = _grads(model, Precision("32-true"), batch, F.cross_entropy)
    F.cross_entropy(model(batch[0]), batch[1]).backward()
    expected = [
        (torch.view_as_real(p.grad) if p.is_complex() else p.grad).reshape(-1).double()
        for p in model.parameters()
    ]
    assert torch.equal(flat, torch.cat(expected))
    assert flat.numel() == sum(
        2 * p.numel() if p.is_complex() else p.numel() for p in model.parameters()
    )
