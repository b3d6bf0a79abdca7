"""The bench's verdict under noise: timing streams injected into the rounds (a fake clock and
fake steps, seeded), never the real machine's speed. A noisy stream must give the quiet
stream's verdict, or an explicit "too noisy" that says why."""

from __future__ import annotations

import math
import os
import random
import statistics
from collections.abc import Callable

import pytest

from mixprec.bench.report import conclusion, summarize
from mixprec.bench.rounds import BUDGET, NARROW, STEPS, RoundPolicy, run_rounds
from mixprec.bench.runner import OK, OOM, LoopResult, RunResult
from mixprec.bench.suite import BenchReport, Config, Row
from mixprec.bench.verdict import (
    FASTER,
    FEW,
    MIN_ROUNDS,
    NOISY,
    NOT_FASTER,
    median_interval,
    ratio_interval,
    speed_verdict,
)

FP32_MS, BF16_MS = 100.0, 22.0  # the true step times: bf16 4.55x as fast
TRUE_SPEEDUP = FP32_MS / BF16_MS
KEYS = ("32-true", "bf16-mixed")
PEAKS = {"32-true": 100, "bf16-mixed": 60}


class Machine:
    """A fake clock and fake steps: each step takes its true time times `slowdown(rng)`,
    and the clock advances by it."""

    def __init__(self, slowdown: Callable[[random.Random], float], seed: int = 0) -> None:
        self.now = 0.0
        self.rng = random.Random(seed)
        self.slowdown = slowdown
        self.order: list[str] = []

    def clock(self) -> float:
        return self.now

    def step(self, key: str, ms: float) -> Callable[[], float]:
        def run() -> float:
            taken = ms * self.slowdown(self.rng)
            self.now += taken / 1e3
            self.order.append(key)
            return taken

        return run

    def rounds(self, policy: RoundPolicy):
        steps = {"32-true": self.step("32-true", FP32_MS), "bf16-mixed": self.step("b", BF16_MS)}
        return run_rounds(steps, [KEYS], policy, clock=self.clock)


def quiet(rng: random.Random) -> float:
    return 1 + rng.uniform(0, 0.02)


def loaded(rng: random.Random) -> float:
    """Half the steps slowed 1-8x by other work (the issue's busy run: one row's min-max
    38.9-528.8 ms)."""
    return 1 + rng.uniform(0, 0.02) + (rng.uniform(0, 7) if rng.random() < 0.5 else 0)


def swamped(rng: random.Random) -> float:
    """Most steps slowed 1-20x."""
    return 1 + (rng.uniform(0, 19) if rng.random() < 0.8 else 0)


POLICY = RoundPolicy(min_rounds=10, budget_s=30.0)


def _report(times: dict[str, list[float]], threads: int = 2, load: float = 0.0) -> BenchReport:
    rows = [
        Row(
            Config(key, key, 16, None, key != "32-true"),
            RunResult(OK, LoopResult(step_ms=times[key], peak_memory=PEAKS[key]), paired=True),
        )
        for key in KEYS
    ]
    meta = {
        "model": "cnn",
        "threads": threads,
        "device_type": "cpu",
        "support": {"32-true": "fast", "bf16-mixed": "fast"},
        "load_average_before": [load, load, load],
    }
    return BenchReport(meta, rows)


def test_the_median_interval_is_the_order_statistics_the_binomial_gives():
    values = [float(x) for x in range(1, 11)]  # n = 10: [x_2, x_9] holds the median 97.9%
    interval = median_interval(values)
    assert (interval.median, interval.low, interval.high) == (5.5, 2.0, 9.0)
    assert interval.confidence == pytest.approx(1 - 2 * 11 / 1024, abs=1e-4)
    assert MIN_ROUNDS == 6  # 1 - 2 / 2**6 >= 95%: fewer values cannot give 95%
    five = median_interval([3.0, 1.0, 2.0, 5.0, 4.0])
    assert (five.low, five.high) == (1.0, 5.0) and five.confidence == pytest.approx(0.9375)
    # a ratio interval pairs index by index
    assert ratio_interval([10.0, 20.0], [5.0, 5.0]).median == pytest.approx(3.0)
    assert ratio_interval([], [1.0]) is None


def test_a_quiet_stream_stops_at_the_first_rounds_and_concludes_faster():
    machine = Machine(quiet)
    rounds = machine.rounds(POLICY)
    assert rounds.stop == NARROW and len(rounds.times["32-true"]) == 10
    verdict = speed_verdict([ratio_interval(rounds.times["32-true"], rounds.times["bf16-mixed"])])
    assert verdict.kind == FASTER
    assert verdict.decisive.low < TRUE_SPEEDUP < verdict.decisive.high
    assert verdict.decisive.width < 1.05


def test_a_noisy_stream_gets_the_quiet_streams_verdict_after_more_rounds():
    quiet_rounds = Machine(quiet).rounds(POLICY)
    noisy_rounds = Machine(loaded, seed=1).rounds(POLICY)
    calm = ratio_interval(quiet_rounds.times["32-true"], quiet_rounds.times["bf16-mixed"])
    noisy = ratio_interval(noisy_rounds.times["32-true"], noisy_rounds.times["bf16-mixed"])
    # more rounds were taken, within the budget, until the interval narrowed or time ran out
    assert noisy.n > calm.n and noisy_rounds.stop in (NARROW, BUDGET)
    assert speed_verdict([noisy]).kind == speed_verdict([calm]).kind == FASTER
    assert noisy.low < TRUE_SPEEDUP < noisy.high and noisy.low < calm.high and calm.low < noisy.high
    fp32 = noisy_rounds.times["32-true"]
    assert max(fp32) / min(fp32) > 4  # a row's min-max as wide as the busy run
    # and the sentence: the same finding, with its interval
    for times in (quiet_rounds.times, noisy_rounds.times):
        sentence = conclusion(_report(times), summarize(_report(times)))
        assert sentence.startswith("On this machine bf16-mixed trains the cnn model 4.")
        assert "as fast as float32" in sentence and "paired rounds" in sentence


def test_a_verdict_taken_with_several_threads_on_busy_cores_says_threads_1_measures_it():
    """Paired rounds cancel load that slows both steps alike, not threads waiting for each
    other at every op on cores other work holds, which weighs more on the shorter step."""
    times = Machine(quiet).rounds(POLICY).times
    busy = _report(times, threads=2, load=9.0)
    sentence = conclusion(busy, summarize(busy))
    assert sentence.startswith("On this machine bf16-mixed trains the cnn model 4.")
    assert "Measured with 2 threads on cores other work was using (1-minute load 9.0" in sentence
    assert sentence.endswith("--threads 1 measures what bf16-mixed itself buys.")
    ended = _report(times, threads=2, load=9.0)  # other work ended as the run began:
    ended.metadata["other_busy_cores"] = 0.4  # what was measured through the run
    for report in (_report(times, threads=1, load=9.0), _report(times, threads=2), ended):
        assert "Measured with" not in conclusion(report, summarize(report))


def test_a_swamped_stream_is_too_noisy_to_conclude_and_says_why():
    rounds = Machine(swamped, seed=2).rounds(RoundPolicy(min_rounds=10, budget_s=5.0))
    assert rounds.stop == BUDGET
    interval = ratio_interval(rounds.times["32-true"], rounds.times["bf16-mixed"])
    assert speed_verdict([interval]).kind == NOISY
    for threads, advice in ((2, "rerun on a quieter machine or with --threads 1."), (1, None)):
        report = _report(rounds.times, threads=threads, load=9.0)
        sentence = conclusion(report, summarize(report))
        assert sentence.startswith(
            "Too noisy to conclude how fast bf16-mixed trains the cnn model against float32"
        )
        assert (
            f"{interval.n} rounds is {math.ceil(interval.width * 100) / 100:.2f}x wide" in sentence
        )
        assert "under a 1-minute load of 9.0" in sentence
        if advice is not None:
            assert advice in sentence
        else:  # at one thread already: no advice to use fewer
            assert "--threads" not in sentence and "rerun on a quieter machine." in sentence
        assert "It uses 40% less peak memory than float32" in sentence


def test_a_withheld_verdict_rounds_its_interval_as_the_table_does():
    """The sentence rounded the interval to nearest where the table rounds it outward:
    "anywhere in 1.00-1.50x" beside the cell's "(0.99-1.50)", and "1.50x wide" for an
    interval 1.503x wide, over the 1.5x a verdict needs; the batch sizes named too noisy
    beside a finding read the same."""
    from mixprec.bench.report import _speedup_cell

    fp32 = [99.0, 99.78, 110, 120, 125, 130, 140, 145, 150, 170]  # ratios 0.99-1.7 over 100 ms
    interval = ratio_interval(fp32, [FP32_MS] * 10)
    assert interval.low < 1 < 1.5 < interval.width < 1.505
    report = _report({"32-true": fp32, "bf16-mixed": [FP32_MS] * 10})
    summaries = summarize(report)
    assert _speedup_cell(summaries[1]) == "1.27x (0.99-1.50)"
    sentence = conclusion(report, summaries)
    assert "anywhere in 0.99-1.50x (the 95% interval of 10 rounds is 1.51x wide" in sentence
    rows = [
        Row(
            Config(key, key, batch, None, key != "32-true"),
            RunResult(OK, LoopResult(step_ms=ms, peak_memory=PEAKS[key]), paired=True),
        )
        for batch, fp32_ms in ((8, [2 * FP32_MS] * 10), (16, fp32))
        for key, ms in zip(KEYS, (fp32_ms, [FP32_MS] * 10), strict=True)
    ]
    report = BenchReport({**report.metadata, "batch_sizes": [8, 16]}, rows)
    sentence = conclusion(report, summarize(report))
    assert "(batch 16: anywhere in 0.99-1.50x from 10 rounds;" in sentence, sentence


def test_too_few_rounds_withhold_the_verdict():
    rounds = Machine(quiet).rounds(RoundPolicy(min_rounds=3))
    assert rounds.stop == STEPS and len(rounds.times["bf16-mixed"]) == 3
    report = _report(rounds.times)
    sentence = conclusion(report, summarize(report))
    assert speed_verdict([ratio_interval(*rounds.times.values())]).kind == FEW
    assert sentence.startswith("Too few rounds to conclude how fast bf16-mixed")
    assert f"rerun with --steps {MIN_ROUNDS} or more" in sentence


def test_an_interval_reaching_one_is_not_a_speedup():
    same = [median_interval([0.97, 1.0, 1.02, 0.99, 1.03, 1.01, 0.98])]
    assert speed_verdict(same).kind == NOT_FASTER


def test_a_wide_interval_on_one_side_of_one_says_which_way():
    """0.08-0.35x is slower however wide it is, and 2.2-3.7x faster: both were withheld as
    too noisy, with the advice to rerun on a quieter machine. Only a wide interval that
    holds 1 withholds the verdict."""
    slower = median_interval([0.08, 0.1, 0.2, 0.15, 0.3, 0.35, 0.12, 0.25])
    faster = median_interval([2.19, 3.67, 2.5, 3.1, 2.8, 3.4, 2.3, 3.0])
    both_ways = median_interval([0.6, 1.4, 0.9, 1.2, 0.8, 1.3, 0.7, 1.1])
    assert min(i.width for i in (slower, faster, both_ways)) > 1.5
    assert speed_verdict([slower]).kind == NOT_FASTER
    assert speed_verdict([faster]).kind == FASTER
    assert speed_verdict([faster, both_ways]).kind == NOISY
    assert speed_verdict([faster, both_ways]).decisive == both_ways


def test_load_that_drifts_over_the_run_cancels_in_paired_rounds():
    """Other work starts after a second: timing float32's steps first and bf16's after (the old
    order) charges the load to bf16 alone; paired rounds charge both alike."""
    drift = Machine(lambda rng: 1.0)

    def step(ms: float) -> Callable[[], float]:
        def run() -> float:
            taken = ms * (3.0 if drift.now >= 1.0 else 1.0)
            drift.now += taken / 1e3
            return taken

        return run

    fp32_first = [step(FP32_MS)() for _ in range(10)]
    bf16_after = [step(BF16_MS)() for _ in range(10)]
    assert ratio_interval(fp32_first, bf16_after).median < TRUE_SPEEDUP / 2
    drift.now = 0.0
    rounds = run_rounds(
        {"32-true": step(FP32_MS), "bf16-mixed": step(BF16_MS)},
        [KEYS],
        RoundPolicy(20),
        clock=drift.clock,
    )
    paired = ratio_interval(rounds.times["32-true"], rounds.times["bf16-mixed"])
    assert paired.median == pytest.approx(TRUE_SPEEDUP)


def test_rounds_rotate_the_order_and_a_failed_loop_leaves_the_others_aligned():
    calls: list[str] = []

    def step(key: str, fail_at: int | None = None) -> Callable[[], float | None]:
        def run() -> float | None:
            calls.append(key)
            if fail_at is not None and calls.count(key) == fail_at:
                return None
            return 1.0

        return run

    steps = {"a": step("a"), "b": step("b"), "c": step("c", fail_at=2)}
    rounds = run_rounds(steps, [("a", "b")], RoundPolicy(4))
    # round 1: a b c; round 2: b c a (c fails and leaves); then a, b alternate who goes first
    assert calls == ["a", "b", "c", "b", "c", "a", "a", "b", "b", "a"]
    assert set(rounds.times) == {"a", "b"}
    assert len(rounds.times["a"]) == len(rounds.times["b"]) == 4


def test_a_finding_comes_from_the_batch_sizes_that_allow_one_and_names_the_noisy_rest():
    """One batch size swamped by other work withholds only its own speedup: the finding is
    given for the others, and the noisy one is named with its interval."""
    calm = Machine(quiet).rounds(POLICY).times
    noisy = Machine(swamped, seed=2).rounds(RoundPolicy(min_rounds=10, budget_s=5.0)).times
    rows = [
        Row(
            Config(key, key, batch, None, key != "32-true"),
            RunResult(OK, LoopResult(step_ms=times[key], peak_memory=PEAKS[key]), paired=True),
        )
        for batch, times in ((8, calm), (32, noisy))
        for key in KEYS
    ]
    meta = _report(calm, threads=1, load=9.0).metadata
    report = BenchReport(meta, rows)
    sentence = conclusion(report, summarize(report))
    interval = ratio_interval(noisy["32-true"], noisy["bf16-mixed"])
    assert sentence.startswith("On this machine bf16-mixed trains the cnn model 4.")
    assert "(batch 8; 95% intervals within" in sentence
    assert (
        f"Too noisy under a 1-minute load of 9.0 on {os.cpu_count() or 1} cores to state the "
        f"speedup at the other batch size(s) (batch 32: anywhere in "
        f"{math.floor(interval.low * 100) / 100:.2f}-{math.ceil(interval.high * 100) / 100:.2f}x "
        f"from {interval.n} rounds;"  # (rounded outward, as the table)
    ) in sentence
    assert sentence.endswith("rerun on a quieter machine.")
    # a batch size set aside between two others is not taken into a span ("batch 8-128")
    wide = rows + [
        Row(Config(r.config.spec, r.config.label, 128, None, r.config.raw), r.result)
        for r in rows
        if r.config.batch_size == 8
    ]
    wide_meta = {**meta, "batch_sizes": [8, 32, 128]}
    wide_report = BenchReport(wide_meta, wide)
    assert "(batch 8 and 128; 95% intervals" in conclusion(wide_report, summarize(wide_report))
    # every batch size noisy: no finding at all, as before
    both = BenchReport(meta, [Row(r.config, r.result) for r in rows if r.config.batch_size == 32])
    assert conclusion(both, summarize(both)).startswith("Too noisy to conclude")


def test_a_budget_adds_rounds_until_an_interval_can_hold_the_median_with_confidence():
    # before: three quiet rounds made a "narrow" min-max interval (75% confidence), the
    # rounds stopped there with the budget almost unused, and the verdict was withheld as
    # too few rounds
    rounds = Machine(quiet).rounds(RoundPolicy(min_rounds=3, budget_s=30.0))
    assert rounds.stop == NARROW and len(rounds.times["bf16-mixed"]) == MIN_ROUNDS
    assert speed_verdict([ratio_interval(*rounds.times.values())]).kind == FASTER


def _with_interval(low: float, median: float, high: float) -> tuple[BenchReport, list]:
    report = _report({key: [FP32_MS] * 10 for key in KEYS})
    summaries = summarize(report)
    mixed = summaries[1]
    mixed.speedup, mixed.speedup_low, mixed.speedup_high = median, low, high
    return report, summaries


@pytest.mark.parametrize(
    ("low", "median", "high", "than"),
    [
        (0.99, 1.40, 1.45, "about what it pays here."),  # (1.1 inside: not "more")
        (1.02, 1.40, 1.50, "about what it pays here."),
        (1.15, 1.40, 1.50, "so mixed precision pays more here than it did there."),
        (1.01, 1.04, 1.08, "so here it pays less than there."),
        (0.80, 0.85, 0.90, "train in float32 unless memory is what you need."),
    ],
)
def test_the_sentence_compares_with_the_seed_experiment_only_what_its_interval_carries(
    low, median, high, than
):
    # before: the median alone decided, so an interval holding the seed's 1.1x still read
    # "pays more here than it did there"
    sentence = conclusion(*_with_interval(low, median, high))
    assert sentence.endswith(than), sentence


def test_an_interval_just_above_one_is_printed_so_that_it_does_not_read_as_reaching_it():
    sentence = conclusion(*_with_interval(1.02, 1.40, 1.10 * 1.02))
    assert "trains the cnn model 1.4x as fast" in sentence
    assert "95% intervals within 1.02-1.13x" in sentence  # (not "1.0-1.1x"; rounded out)


@pytest.mark.parametrize("bad", [math.nan, math.inf, 0.0, -1.0])
def test_a_step_time_that_is_not_a_positive_finite_number_is_refused(bad):
    # before: a NaN made the interval's high NaN and the verdict "faster"; a zero divided
    with pytest.raises(ValueError, match="step times are finite milliseconds above 0"):
        ratio_interval([2.0] * 5 + [bad], [1.0] * 6)
    with pytest.raises(ValueError, match="step times are finite milliseconds above 0"):
        ratio_interval([1.0] * 6, [bad] * 6)
    with pytest.raises(ValueError, match="must be finite"):
        median_interval([1.0, math.nan, 2.0])


def test_equal_peaks_state_no_memory_finding(monkeypatch):
    # before: "with 0% less peak memory"
    monkeypatch.setitem(PEAKS, "bf16-mixed", 100)
    sentence = conclusion(*_with_interval(1.15, 1.40, 1.50))
    assert "peak memory" not in sentence and "as fast as float32 (batch 16;" in sentence


@pytest.mark.parametrize("peak", [100, 120])
def test_a_slower_run_saving_no_memory_does_not_point_at_memory(monkeypatch, peak):
    # before: "train in float32 unless memory is what you need" with equal or larger peaks
    monkeypatch.setitem(PEAKS, "bf16-mixed", peak)
    sentence = conclusion(*_with_interval(0.80, 0.85, 0.90))
    assert sentence.endswith("while here it is slower than float32: train in float32 here."), (
        sentence
    )


def test_a_slower_verdict_on_busy_cores_with_several_threads_gives_no_float32_advice():
    """Several threads on cores other work used: the sentence said "train in float32 here"
    and then that the ratio could be low for that alone (a CNN 0.84x so, 1.6-1.75x at one
    thread). The advice waits for a run that measures bf16-mixed itself."""
    report, summaries = _with_interval(0.80, 0.85, 0.90)
    report.metadata.update(threads=2, load_average_before=[9.0] * 3)
    sentence = conclusion(report, summaries)
    assert "while here it is slower than float32" in sentence
    assert "train in float32" not in sentence, sentence
    assert sentence.endswith(
        "--threads 1 measures what bf16-mixed itself buys before float32 is chosen over it."
    ), sentence
    report.metadata.update(threads=1)  # (one thread: the figure stands, and so the advice)
    assert "train in float32 unless memory is what you need." in conclusion(report, summaries)
    # the caveat's ending follows the advice it stands in for: no faster (advised at one
    # thread) ends so, and so does the note of an untimed fast precision the advice carried
    report, summaries = _with_interval(0.80, 0.88, 1.02)
    report.metadata.update(threads=2, load_average_before=[9.0] * 3, auto_precision="16-mixed")
    sentence = conclusion(report, summaries)
    assert "while here it is no faster than float32" in sentence and "train in" not in sentence
    assert sentence.endswith(
        "before float32 is chosen over it; 16-mixed, which mixprec info rates fast here, was "
        "not timed: add it to --precision before settling on float32."
    ), sentence


def test_intervals_on_both_sides_of_the_seeds_figure_say_so():
    """An interval under 1.1x at one batch size and one over it at another read "about
    what it pays here" (the span of all of them held 1.1x)."""
    rows = [
        Row(
            Config(key, key, batch, None, key != "32-true"),
            RunResult(OK, LoopResult(step_ms=[FP32_MS] * 10, peak_memory=PEAKS[key]), paired=True),
        )
        for batch in (16, 32)
        for key in KEYS
    ]
    report = BenchReport(_report({k: [FP32_MS] for k in KEYS}).metadata, rows)
    summaries = summarize(report)
    mixed = [s for s in summaries if s.precision != "32-true"]
    for s, (low, median, high) in zip(mixed, [(0.8, 0.82, 0.85), (1.3, 1.35, 1.4)], strict=True):
        s.speedup, s.speedup_low, s.speedup_high = median, low, high
    sentence = conclusion(report, summaries)
    assert sentence.endswith(
        "more than that at some batch sizes here and less at others; at batch 16 it is slower "
        "than float32."
    ), sentence
    # one interval above 1.1x and one holding it: 'less at others' named a class no
    # interval falls in
    for s, (low, median, high) in zip(mixed, [(1.07, 1.34, 1.46), (1.15, 1.39, 1.71)], strict=True):
        s.speedup, s.speedup_low, s.speedup_high = median, low, high
    sentence = conclusion(report, summaries)
    assert sentence.endswith("more than that at some batch sizes here and about that at others.")
    assert "intervals within 1.07-1.71x" in sentence  # (rounded out: '1.1-1.7x' hid 1.07)


def _two_batches(bf16_ms: float, peaks: dict[tuple[str, int], int]) -> BenchReport:
    """float32 at 100 ms and bf16-mixed at ``bf16_ms`` in every one of 10 paired rounds, at
    batch sizes 8 and 16, with the given peaks."""
    rows = [
        Row(
            Config(key, key, batch, None, key != "32-true"),
            RunResult(
                OK,
                LoopResult(
                    step_ms=[FP32_MS if key == "32-true" else bf16_ms] * 10,
                    peak_memory=peaks[(key, batch)],
                ),
                paired=True,
            ),
        )
        for batch in (8, 16)
        for key in KEYS
    ]
    meta = {"model": "mlp", "threads": 1, "device_type": "cpu",
            "support": {"32-true": "fast", "bf16-mixed": "fast"},
            "load_average_before": [0.0, 0.0, 0.0]}  # fmt: skip
    return BenchReport(meta, rows)


def test_a_small_speedup_is_not_printed_as_one_and_memory_both_ways_names_each_batch():
    """A verdict "faster" at 1.04x read "1.0x as fast as float32"; 30% less memory at one
    batch size and 10% more at the other read "10-30% less or more peak memory"."""
    even = dict.fromkeys([(k, b) for k in KEYS for b in (8, 16)], 1000)
    report = _two_batches(FP32_MS / 1.04, even)
    sentence = conclusion(report, summarize(report))
    assert "trains the mlp model 1.04x as fast as float32" in sentence
    peaks = {**even, ("bf16-mixed", 8): 700, ("bf16-mixed", 16): 1100}
    report = _two_batches(FP32_MS / 2, peaks)
    sentence = conclusion(report, summarize(report))
    assert (
        "2.0x as fast as float32 with 30% less peak memory at batch 8 and 10% more at "
        "batch 16 (" in sentence
    )


def test_a_memory_change_that_rounds_to_nothing_is_not_said():
    """0.3% less at batch 8 and 20% more at batch 16 read "0% less peak memory at batch 8
    and 20% more at batch 16"; the sides are taken as printed, to the percent."""
    even = dict.fromkeys([(k, b) for k in KEYS for b in (8, 16)], 1000)
    for (at_8, at_16), said in (
        ((997, 1200), "with 20% more peak memory at batch 16 ("),
        ((1004, 700), "with 30% less peak memory at batch 16 ("),
        ((700, 800), "with 20-30% less peak memory ("),
    ):
        peaks = {**even, ("bf16-mixed", 8): at_8, ("bf16-mixed", 16): at_16}
        report = _two_batches(FP32_MS / 2, peaks)
        sentence = conclusion(report, summarize(report))
        assert said in sentence and " 0%" not in sentence, sentence


def test_float32_alone_asked_for_does_not_read_as_no_mixed_precision_being_fast():
    """`--precision 32-true` where bf16 is fast ended "No mixed precision is fast on this
    machine", after the paragraph saying bf16-mixed was left out, fast here."""
    rows = [
        Row(
            Config("32-true", "32-true", 8, None, False),
            RunResult(OK, LoopResult(step_ms=[FP32_MS] * 10, peak_memory=100), paired=True),
        )
    ]
    gap = {"asked": True, "left_out": {"bf16-mixed": {"status": "fast"}, "16-mixed": {
        "status": "slow"}}}  # fmt: skip
    meta = {"model": "cnn", "precisions": ["32-true"], "comparison_gap": gap}
    sentence = conclusion(BenchReport(meta, rows), summarize(BenchReport(meta, rows)))
    assert sentence.startswith("Only 32-true was asked for, so no mixed precision ran beside")
    assert "(bf16-mixed would be fast here: see above)" in sentence
    assert "No mixed precision is fast" not in sentence
    gap["asked"] = False
    sentence = conclusion(BenchReport(meta, rows), summarize(BenchReport(meta, rows)))
    assert sentence.startswith("No mixed precision is fast on this machine")


def test_the_speedup_note_says_what_an_interval_of_too_few_rounds_is():
    """Before: the note called every bracket a 95% interval, also the lowest and highest
    of two rounds' ratios (50%)."""
    from mixprec.bench.report import notes

    for rounds, said in ((2, "at 50% confidence"), (10, None)):
        report = _report({"32-true": [FP32_MS] * rounds, "bf16-mixed": [FP32_MS / 2] * rounds})
        report.metadata.update(timing="cpu time", warmup=1, memory_method="peak")
        speedup = next(n for n in notes(report, summarize(report)) if n.startswith("speedup"))
        if said is None:
            assert "confidence" not in speedup
        else:
            assert speedup.endswith(f"give the lowest and highest ratio, {said}")


def test_rounds_stop_on_the_wider_interval_not_the_one_reported():
    """Stopping as soon as the reported 95% interval looked narrow stopped most often where
    the rounds happened to agree: such intervals held the true ratio in 92-94% of simulated
    runs (benchmarks/results/bench_stop_rule.md). The 99% interval decides: ten rounds whose
    95% interval is narrow but whose extremes are not (the 99% interval of ten values is
    their range) go on."""
    ratios = iter([1.25] * 4 + [1.0] + [1.25] * 4 + [1.6] + [1.25] * 200)
    now = [0.0]

    def slow() -> float:
        now[0] += 0.1
        return 100.0

    def fast() -> float:
        now[0] += 0.1
        return 100.0 / next(ratios)

    rounds = run_rounds({"a": slow, "b": fast}, [("a", "b")], POLICY, clock=lambda: now[0])
    first = ratio_interval(rounds.times["a"][:10], rounds.times["b"][:10])
    assert first.width < 1.10  # (the rule that stopped here before)
    assert len(rounds.times["a"]) > 10 and rounds.stop == NARROW


@pytest.mark.parametrize("compiled", [False, True])
def test_the_sentence_judges_the_recommended_precision_under_compile_too(compiled):
    """With --compile every label ends in " (compiled)": the recommended name matched none,
    and the sentence judged the first mixed row (16-mixed's 0.11x: "train in float32 here")
    where bf16-mixed ran 3.3x as fast."""
    rng = random.Random(0)
    ms = {"32-true": 100.0, "16-mixed": 900.0, "bf16-mixed": 30.0}
    rows = []
    for name in ms:
        label = name + (" (compiled)" if compiled else "")
        times = [ms[name] * (1 + rng.uniform(0, 0.02)) for _ in range(10)]
        rows.append(
            Row(
                Config(label, name, 8, None, name != "32-true", compiled=compiled),
                RunResult(OK, LoopResult(step_ms=times, peak_memory=100), paired=True),
            )
        )
    meta = {
        "model": "cnn",
        "threads": 1,
        "device_type": "cpu",
        "load_average_before": [0, 0, 0],
        "support": {"32-true": "fast", "16-mixed": "slow: ...", "bf16-mixed": "fast"},
    }
    report = BenchReport(meta, rows)
    sentence = conclusion(report, summarize(report))
    assert sentence.startswith("On this machine bf16-mixed") and "3.3x as fast" in sentence


@pytest.mark.parametrize(
    ("low", "median", "high", "than"),
    [
        # before: "so here it pays less than there: train in float32 ..." for a run that does
        # not pay at all, and "about what it pays here" for one slower by its median
        (0.38, 0.42, 0.46, "while here it is slower than float32: train in float32 unless"),
        (0.80, 0.92, 1.17, "while here it is no faster than float32."),
    ],
)
def test_a_mixed_precision_slower_than_float32_is_called_slower(low, median, high, than):
    sentence = conclusion(*_with_interval(low, median, high))
    assert than in sentence, sentence


def test_a_speedup_printed_as_the_seeds_is_printed_finer_than_a_contradiction():
    """1.11-1.13x printed "1.1x ... the seed experiment got 1.1x ..., so mixed precision
    pays more here": both now take two digits."""
    sentence = conclusion(*_with_interval(1.11, 1.12, 1.13))
    assert "1.12x as fast" in sentence and "got 1.09-1.10x" in sentence, sentence


def test_on_cuda_speed_and_memory_are_against_the_same_float32_row_and_the_other_is_said():
    """CUDA times float32 twice, TF32 off then on: the speedup was against the first row and
    the memory against the second (5.7x and 47% less, where against TF32 off it was 24%)."""
    rows = [
        Row(
            Config(label, spec, 256, tf32, raw=False),
            RunResult(OK, LoopResult(step_ms=[ms] * 12, peak_memory=peak), paired=True),
        )
        for label, spec, tf32, ms, peak in (
            ("32-true (TF32 off)", "32-true", False, 296.8, 3848),
            ("32-true (TF32 on)", "32-true", True, 58.5, 5486),
            ("bf16-mixed", "bf16-mixed", None, 52.3, 2922),
        )
    ]
    meta = {**_report({k: [1.0] * 10 for k in KEYS}).metadata, "batch_sizes": [256]}
    report = BenchReport(meta, rows)
    sentence = conclusion(report, summarize(report))
    assert "as fast as float32 (TF32 off) with 24% less peak memory" in sentence, sentence
    assert (
        "Against float32 (TF32 on) it runs at 1.12x its speed (95% intervals within "
        "1.11-1.12x), with 47% less" in sentence
    ), sentence


def _tf32_rows(spread: float) -> BenchReport:
    """CUDA's three rows at batch 256, timed in the same 12 rounds: TF32 off at 300 ms, TF32
    on and bf16-mixed at 60 ms, each round's times spread by up to `spread` of that."""
    rng = random.Random(5)

    def times(ms: float) -> list[float]:
        return [ms * (1 + spread * rng.random()) for _ in range(12)]

    rows = [
        Row(
            Config(label, spec, 256, tf32, raw=False),
            RunResult(OK, LoopResult(step_ms=times(ms), peak_memory=peak), paired=True),
        )
        for label, spec, tf32, ms, peak in (
            ("32-true (TF32 off)", "32-true", False, 300.0, 3848),
            ("32-true (TF32 on)", "32-true", True, 60.0, 5486),
            ("bf16-mixed", "bf16-mixed", None, 60.0, 2922),
        )
    ]
    meta = {**_report({k: [1.0] * 10 for k in KEYS}).metadata, "batch_sizes": [256]}
    return BenchReport(meta, rows)


def test_a_second_float32_row_is_compared_with_its_interval_not_a_bare_ratio():
    """CUDA's "TF32 on" row is float32 too, and its speedup cell and the sentence's ratio
    against it were bare ratios (medians), with no interval and no noise test: TF32 on and
    bf16-mixed from the same distribution read "0.75x" in the table and "runs at 1.21x its
    speed" in the sentence. Its cell takes the interval of its rounds; the sentence says
    when no interval carries a finding."""
    from mixprec.bench.report import _speedup_cell

    report = _tf32_rows(spread=1.0)
    summaries = summarize(report)
    off, on, _ = summaries
    assert _speedup_cell(off) == "1.00x"
    assert "(" in _speedup_cell(on) and "-" in _speedup_cell(on), _speedup_cell(on)
    sentence = conclusion(report, summaries)
    assert "Against float32 (TF32 on) its speed is within this run's noise of it (95%" in sentence
    steady = conclusion(*(lambda r: (r, summarize(r)))(_tf32_rows(spread=0.01)))
    assert "Against float32 (TF32 on) it runs at 0.999x its speed (95% intervals within" in steady


def test_float32_out_of_memory_where_mixed_precision_fits_is_the_finding():
    """The blog's "-" rows: float32 out of memory at a batch size where bf16-mixed fit read
    "No mixed precision and float32 ran side by side here to compare", and beside a batch
    size both ran, the other was left out unsaid."""
    meta = {**_report({k: [1.0] * 10 for k in KEYS}).metadata, "precisions": list(KEYS)}

    def row(label: str, batch: int, ms: float | None) -> Row:
        config = Config(label, label, batch, None, raw=False)
        if ms is None:
            return Row(config, RunResult(OOM, LoopResult(status=OOM, error="out of memory")))
        loop = LoopResult(step_ms=[ms] * 12, peak_memory=PEAKS[label])
        return Row(config, RunResult(OK, loop, paired=True))

    alone = BenchReport(
        {**meta, "batch_sizes": [512]}, [row("32-true", 512, None), row("bf16-mixed", 512, 5.0)]
    )
    sentence = conclusion(alone, summarize(alone))
    assert sentence.startswith(
        "On this machine float32 ran out of memory where mixed precision fit: bf16-mixed at "
        "batch 512 (5.0 ms/step)"
    ), sentence
    rows = [row("32-true", 16, 10.0), row("bf16-mixed", 16, 5.0)]
    both = BenchReport({**meta, "batch_sizes": [16, 512]}, [*rows, *alone.rows])
    sentence = conclusion(both, summarize(both))
    assert "2.0x as fast as float32" in sentence and "(batch 16;" in sentence
    assert sentence.endswith(
        "Also, float32 ran out of memory where mixed precision fit: "
        "bf16-mixed at batch 512 (5.0 ms/step), so there is no speed to compare there, and "
        "memory is what it buys."
    ), sentence


def test_the_closing_sentence_says_why_nothing_was_compared():
    """One catch-all, "No mixed precision and float32 ran side by side here", stood where
    float32 was not asked for, where nothing fit under the limit, and where every
    configuration failed."""
    meta = {**_report({k: [1.0] * 10 for k in KEYS}).metadata, "precisions": list(KEYS)}

    def row(label: str, status: str) -> Row:
        config = Config(label, label, 8, None, raw=False)
        if status == OK:
            loop = LoopResult(step_ms=[5.0] * 12, peak_memory=PEAKS[label])
            return Row(config, RunResult(OK, loop, paired=True))
        return Row(config, RunResult(status, LoopResult(status=status, error="x")))

    cases = {
        ("bf16-mixed", OK): "bf16-mixed ran without float32 to compare it with (add 32-true",
        ("32-true", OOM, "bf16-mixed", OOM): "No configuration fit under the memory limit",
        ("32-true", "error", "bf16-mixed", "error"): "Every configuration failed",
        ("32-true", OK, "bf16-mixed", "error"): "Every mixed precision configuration failed",
        ("32-true", "error", "bf16-mixed", OK): "Every float32 configuration failed (see the "
        "table), so nothing was compared with it",
    }
    for spec, start in cases.items():
        rows = [row(spec[i], spec[i + 1]) for i in range(0, len(spec), 2)]
        report = BenchReport({**meta, "comparison_gap": None}, rows)
        sentence = conclusion(report, summarize(report))
        assert sentence.startswith(start), (spec, sentence)


def _rows(*specs: tuple[str, str, int, bool | None, float | None]) -> BenchReport:
    """A report of (label, precision, batch, tf32, ms: None for out of memory) rows, 12
    paired rounds each."""
    rows = []
    for label, spec, batch, tf32, ms in specs:
        config = Config(label, spec, batch, tf32, raw=False)
        if ms is None:
            rows.append(Row(config, RunResult(OOM, LoopResult(status=OOM, error="oom"))))
            continue
        loop = LoopResult(step_ms=[ms] * 12, peak_memory=PEAKS[spec])
        rows.append(Row(config, RunResult(OK, loop, paired=True)))
    batches = sorted({s[2] for s in specs})
    meta = {**_report({k: [1.0] * 10 for k in KEYS}).metadata, "batch_sizes": batches}
    return BenchReport(meta, rows)


def test_one_batch_size_clearly_faster_is_not_summed_up_as_no_faster():
    report = _rows(
        ("32-true", "32-true", 32, None, 12.5),
        ("bf16-mixed", "bf16-mixed", 32, None, 10.0),
        ("32-true", "32-true", 64, None, 7.0),
        ("bf16-mixed", "bf16-mixed", 64, None, 10.0),
    )
    sentence = conclusion(report, summarize(report))
    assert "no faster" not in sentence and "more than that at some batch sizes" in sentence


def test_a_batch_size_one_float32_row_ran_at_is_not_said_to_be_out_of_memory():
    report = _rows(
        ("32-true (TF32 off)", "32-true", 512, False, 20.0),
        ("32-true (TF32 on)", "32-true", 512, True, None),
        ("bf16-mixed", "bf16-mixed", 512, None, 5.0),
    )
    sentence = conclusion(report, summarize(report))
    assert "ran out of memory" not in sentence and "float32 (TF32 off)" in sentence


def test_a_withheld_verdict_still_says_float32_ran_out_of_memory_where_mixed_fit():
    report = _rows(
        ("32-true", "32-true", 128, None, 10.0),
        ("bf16-mixed", "bf16-mixed", 128, None, 5.0),
        ("32-true", "32-true", 256, None, None),
        ("bf16-mixed", "bf16-mixed", 256, None, 9.0),
    )
    for row in report.rows:  # (3 rounds: too few for a verdict)
        if row.result.status == OK:
            row.result.mixprec.step_ms = row.result.mixprec.step_ms[:3]
    sentence = conclusion(report, summarize(report))
    assert sentence.startswith("Too few rounds"), sentence
    assert sentence.endswith(
        "Also, float32 ran out of memory where mixed precision fit: "
        "bf16-mixed at batch 256 (9.0 ms/step), so there is no speed to compare there, and "
        "memory is what it buys."
    ), sentence


def test_a_step_vs_keep_cell_of_too_few_rounds_says_how_many():
    """The cell read "0.80x (0.80-0.80)" from one round, and a 3-round min-max as a 95%
    interval, where the speedup cell beside it said so."""
    from mixprec.bench.report import _vs_keep_cell

    report = _rows(("bf16-mixed", "bf16-mixed", 16, None, 5.0))
    (s,) = summarize(report)
    s.vs_keep, s.vs_keep_low, s.vs_keep_high = 0.8, 0.8, 0.8
    s.vs_keep_rounds, s.vs_keep_confidence = 1, 0.0
    assert _vs_keep_cell(s) == "0.80x (1 round)"
    s.vs_keep_high, s.vs_keep_rounds, s.vs_keep_confidence = 1.2, 3, 0.75
    assert _vs_keep_cell(s) == "0.80x (0.80-1.20, 3 rounds)"


def _apart(fp32_ms: list[float], bf16_ms: list[float], **meta) -> BenchReport:
    """float32 and bf16-mixed at batch 8, each run alone in a process of its own, one after
    the other (--memory-limit, --compile): rows that share no rounds."""
    rows = [
        Row(
            Config(key, key, 8, None, key != "32-true"),
            RunResult(OK, LoopResult(step_ms=ms, peak_memory=PEAKS[key]), fresh_process=True),
        )
        for key, ms in zip(KEYS, (fp32_ms, bf16_ms), strict=True)
    ]
    base = _report({k: [1.0] for k in KEYS}).metadata
    return BenchReport({**base, "batch_sizes": [8], "timing": "apart", "warmup": 1,
                        "memory_method": "m", **meta}, rows)  # fmt: skip


def test_rows_run_one_after_another_get_the_medians_ratio_and_no_verdict():
    """With --memory-limit each configuration ran alone, one after another, yet the speedup
    paired float32's step i with bf16's step i and gave a 95% interval and a verdict with
    advice (a neighbour started between the runs: "0.55x (0.33-0.83) ... slower than
    float32: train in float32 unless memory is what you need", where paired runs gave 1.8x)."""
    from mixprec.bench.report import _speedup_cell, notes

    rng = random.Random(0)
    fp32 = [195.0 * (1 + rng.uniform(0, 0.5)) for _ in range(8)]
    bf16 = [462.0 * (1 + rng.uniform(0, 0.1)) for _ in range(8)]
    report = _apart(fp32, bf16, memory_limit=2**32, load_average_before=[9.0, 9.0, 9.0])
    summaries = summarize(report)
    mixed = summaries[1]
    assert not mixed.paired and mixed.speedup_low is None and mixed.rounds is None
    assert mixed.speedup == pytest.approx(statistics.median(fp32) / statistics.median(bf16))
    assert _speedup_cell(mixed).endswith("x (medians)")
    sentence = conclusion(report, summaries)
    assert sentence.startswith("No verdict on how fast bf16-mixed trains the cnn model"), sentence
    assert "one after another in separate processes (--memory-limit: a fresh process" in sentence
    assert "a neighbour's load between them moves the ratio" in sentence
    assert "For a verdict, rerun without --memory-limit" in sentence
    for claim in ("95%", "interval within", "train in float32", "slower than float32"):
        assert claim not in sentence, (claim, sentence)
    assert sentence.endswith("It uses 40% less peak memory than float32 (memory does not "
                             "depend on the load).")  # fmt: skip
    said = notes(report, summaries)
    speedup = next(n for n in said if n.startswith("speedup:"))
    assert "95%" not in speedup and "(medians)" in speedup
    warning = next(n for n in said if n.startswith("WARNING"))
    assert "taken from paired rounds" not in warning and "no interval and no verdict" in warning
    # and under --compile, that one is named
    sentence = conclusion(*(lambda r: (r, summarize(r)))(_apart(fp32, bf16, compile=True)))
    assert "(--compile: a fresh process each)" in sentence and "without --compile" in sentence


def test_a_float32_only_run_is_not_said_to_have_run_in_separate_processes():
    """A float32-only run (--precision 32-true, or the default on an AVX2 CPU) has one row
    per batch size, which shares no rounds: its notes said the configurations ran one after
    another in separate processes, and under load advised rerunning "without --memory-limit
    and --compile", neither of them given. The run's options decide, as for the plan."""
    from mixprec.bench.report import notes

    alone = RunResult(OK, LoopResult(step_ms=[FP32_MS] * 10, peak_memory=100))  # not paired
    meta = _apart([FP32_MS], [BF16_MS], load_average_before=[9.0, 9.0, 9.0]).metadata
    for options, apart in (({}, False), ({"memory_limit": 2**30}, True), ({"compile": True}, True)):
        row = Row(Config("32-true", "32-true", 8, None, False), alone)
        report = BenchReport({**meta, **options}, [row])
        said = notes(report, summarize(report))
        speedup = next(n for n in said if n.startswith("speedup:"))
        warning = next(n for n in said if n.startswith("WARNING"))
        assert ("separate processes" in speedup) is apart, (options, speedup)
        assert ("taken from paired rounds" in warning) is not apart, (options, warning)
        assert ("--memory-limit" in warning) is ("memory_limit" in options), (options, warning)
        assert ("--compile" in warning) is ("compile" in options), (options, warning)
    # results of a version that ran every configuration apart: its mixed rows say so
    report = _apart([FP32_MS] * 8, [BF16_MS] * 8)
    speedup = next(n for n in notes(report, summarize(report)) if n.startswith("speedup:"))
    assert "separate processes" in speedup


def test_the_busy_machine_warning_says_how_this_run_times_its_steps():
    from mixprec.bench.report import busy_machine_warning

    load = [9.0, 9.0, 9.0]
    paired = busy_machine_warning(load, 2, "cpu", cores=2, paired=True)
    apart = busy_machine_warning(load, 2, "cpu", cores=2, paired=False)
    unknown = busy_machine_warning(load, 2, "cpu", cores=2)
    assert "the speedup is taken from paired rounds with its interval" in paired
    assert "taken from paired rounds" not in apart
    assert "one after another in separate processes" in apart
    # (no option named: the caller says which were given, `rerun_for_verdict`)
    assert apart.endswith("for a verdict, time them side by side in paired rounds in one process")
    assert "separate processes (--memory-limit, --compile) get the ratio of medians" in unknown


def test_other_work_the_pre_run_check_found_is_not_subtracted_away(monkeypatch):
    """The caveat of a verdict measured with 2 threads on busy cores took min(load before,
    load after - threads); in a 24 s run the 1-minute load moves by a fraction of the run's
    threads, so a busy neighbour's load was subtracted away (the reviewer's run: load 1.48
    before, 2.04 after, the pre-run warning given, no caveat)."""
    times = Machine(quiet).rounds(POLICY).times
    monkeypatch.setattr(os, "cpu_count", lambda: 64)  # (the core count recorded counts)
    for meta, said in (
        # recorded before the run measured other work: the load the warning read
        ({"load_average_after": [2.04, 2.73, 2.18]}, "(1-minute load 1.5 on 2 cores)"),
        # measured through the run (/proc/stat's busy ticks less the run's own CPU time)
        ({"other_busy_cores": 0.99}, "(other work kept 1.0 of 2 cores busy through the run)"),
        # measured as the run began (the threads were chosen then)
        ({"busy_cores_before": 1.2}, "(other work kept 1.2 of 2 cores busy as the run began)"),
    ):
        report = _report(times, threads=2, load=1.48)
        report.metadata.update(cores=2, **meta)
        sentence = conclusion(report, summarize(report))
        assert f"Measured with 2 threads on cores other work was using {said}" in sentence, sentence
    quiet_run = _report(times, threads=2, load=1.48)
    quiet_run.metadata.update(cores=2, other_busy_cores=0.1)
    assert "Measured with" not in conclusion(quiet_run, summarize(quiet_run))


def test_other_busy_cores_is_the_cpus_busy_share_less_the_runs_own_cpu_time():
    from mixprec.timing import cpu_sample, other_busy_cores

    # 2 cores, 10 s: 15 of 20 core-seconds busy, 5 of them this process's: 1 core of others
    start, end = (200, 1000, 10.0, 100.0), (1700, 3000, 15.0, 110.0)
    assert other_busy_cores(start, end, 2) == 1.0
    assert other_busy_cores(start, (200, 3000, 15.0, 110.0), 2) == 0.0  # (never below 0)
    assert other_busy_cores(None, end, 2) is None and other_busy_cores(start, start, 2) is None
    busy, total, own, _ = cpu_sample("cpu  10 1 5 80 2 1 1 3 0 0\ncpu0 1 2 3 4\n")
    assert (busy, total) == (21, 103) and own >= 0


@pytest.mark.parametrize(
    ("bf16_16", "ends"),
    [
        # before: "... at 0.80-1.50x the speed of float32 ... more than that at some batch
        # sizes here and less at others", the slowdown at batch 8 never called one
        (
            66.7,
            "more than that at some batch sizes here and less at others; at batch 8 it is "
            "slower than float32.",
        ),  # fmt: skip
        (
            91.0,
            "about that at some batch sizes here and less at others; at batch 8 it is "
            "slower than float32.",
        ),  # fmt: skip
        (
            100.0,
            "while here it is no faster than float32, and slower at batch 8: train in "
            "float32 unless memory is what you need.",
        ),  # fmt: skip
    ],
)
def test_a_batch_size_clearly_slower_than_float32_is_named_slower(bf16_16, ends):
    report = _rows(
        ("32-true", "32-true", 8, None, 100.0),
        ("bf16-mixed", "bf16-mixed", 8, None, 125.0),
        ("32-true", "32-true", 16, None, 100.0),
        ("bf16-mixed", "bf16-mixed", 16, None, bf16_16),
    )
    for i, row in enumerate(report.rows):  # (tight intervals; 100 ms against 100 holds 1)
        wobble = (0.999, 1.001) if i % 2 else (1.001, 0.999, 1.0)
        ms = row.result.mixprec.step_ms
        row.result.mixprec.step_ms = [t * wobble[k % len(wobble)] for k, t in enumerate(ms)]
    sentence = conclusion(report, summarize(report))
    assert sentence.endswith(ends), sentence


def test_a_tiny_effect_is_not_rounded_to_one():
    """A 0.4% slowdown printed "1.00x (1.00-1.00)" and "runs ... at 1.00x the speed of
    float32 ... while here it is slower than float32"; interval ends were rounded to the
    nearest, which can make an interval look tighter than measured."""
    from mixprec.bench.report import _speedup_cell

    rng = random.Random(3)
    for bf16, cell, speed in (
        (100.4, "0.996x (0.99", "runs the cnn model at 0.996x the speed of float32"),
        (99.6, "1.004x (1.00", "trains the cnn model 1.004x as fast as float32"),
    ):
        times = {
            "32-true": [100.0] * 12,
            "bf16-mixed": [bf16 + rng.uniform(0, 0.05) for _ in range(12)],
        }
        report = _report(times, threads=1)
        summaries = summarize(report)
        shown = _speedup_cell(summaries[1])
        assert shown.startswith(cell) and "1.00-" not in shown and "-1.00)" not in shown, shown
        sentence = conclusion(report, summaries)
        assert speed in sentence and "1.00x" not in sentence, sentence
        assert "1.00-" not in sentence and "-1.00x" not in sentence, sentence
    report, summaries = _with_interval(4.419, 4.58, 4.8051)
    assert _speedup_cell(summaries[1]) == "4.58x (4.41-4.81)"  # (outward: was "4.42-4.81")


def test_threads_outnumbering_the_cores_are_not_called_other_work():
    """Found by a review: --threads 4 on 2 idle cores was warned of as "other work was using
    the CPUs (other work kept 0.0 of 2 cores busy ...)", and the sentence blamed other work
    and dropped its advice: `cores_shared` took any load above 2 - 4 + 0.5 for other work.
    The run's own threads outnumbering the cores are said so; the advice follows the ratio,
    with the caveat."""
    from mixprec.bench.report import busy_machine_warning

    over = busy_machine_warning([0.0] * 3, 4, "cpu", cores=2, paired=True, busy_cores=0.0)
    assert over == (
        "WARNING: this run's 4 threads outnumber the 2 cores (other work kept 0.0 of them busy "
        "as the run began): its threads wait for each other at each parallel op, so single "
        "steps are slowed at random; the speedup is taken from paired rounds with its "
        "interval, and withheld if still too noisy; for tighter figures, rerun with "
        "--threads 2 or fewer"
    ), over
    both = busy_machine_warning([0.0] * 3, 4, "cpu", cores=2, paired=True, busy_cores=1.0)
    assert both.startswith(
        "WARNING: other work was using the CPUs (other work kept 1.0 of 2 cores busy as the run "
        "began, 4 thread(s) timing), and this run's 4 threads outnumber the 2 cores: single "
        "steps are slowed at random;"
    ), both
    assert busy_machine_warning([0.0] * 3, 2, "cpu", cores=2, busy_cores=0.0) is None
    report, summaries = _with_interval(0.48, 0.50, 0.52)
    report.metadata.update(threads=4, cores=2, busy_cores_before=0.0, other_busy_cores=0.0)
    sentence = conclusion(report, summaries)
    assert "other work" not in sentence, sentence
    assert sentence.endswith(
        "while here it is slower than float32: train in float32 unless memory is what you "
        "need. Measured with 4 threads on 2 cores: the run's threads outnumber the cores, so "
        "they wait for each other at every op, which may cost the shorter low-precision step "
        "more, so this ratio can be lower than 2 threads or fewer give; --threads 1 measures "
        "what bf16-mixed itself buys."
    ), sentence
    report.metadata.update(other_busy_cores=1.0)  # (other work too: no advice, as before)
    sentence = conclusion(report, summaries)
    assert "train in float32" not in sentence, sentence
    assert (
        "Measured with 4 threads on cores other work was using (other work kept 1.0 of 2 cores "
        "busy through the run), more threads than the 2 cores: threads then wait"
    ) in sentence, sentence


def test_a_large_slowdown_is_printed_with_its_significant_digits():
    """Found by a review: bfloat16 emulated 250x slower than float32 printed "0.00x
    (0.00-0.01)" in the table and "at 0.00x the speed of float32" in the sentence (two
    decimals at most four, for ratios near 1). A ratio far below 1 keeps two significant
    digits, as `mixprec info` prints it, and its interval is still rounded outward."""
    from mixprec.bench.report import _speedup_cell, ratio_places

    times = {"32-true": [100.0] * 10, "bf16-mixed": [100.0 * (240 + 3 * i) for i in range(10)]}
    report = _report(times, threads=1)
    summaries = summarize(report)
    assert _speedup_cell(summaries[1]) == "0.0039x (0.0037-0.0042)"
    sentence = conclusion(report, summaries)
    assert sentence.startswith(
        "On this machine bf16-mixed runs the cnn model at 0.0039x the speed of float32, 253x "
        "slower, with 40% less peak memory (batch 16; 95% intervals within 0.0037-0.0042x from "
        "10 paired rounds)"
    ), sentence
    assert ratio_places(0.5) == 2 and ratio_places(0.05) == 3 and ratio_places(0.004) == 4
    assert ratio_places(0.03, 0.004, 0.06) == 3  # (its low end shows a digit: 0.004)
    assert ratio_places(0.03, 0.0004, 0.06) == 4  # (not 0.000)
