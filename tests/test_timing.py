"""Paired timing (`mixprec.timing`), on injected timings: what a burst of other work does to
the answer, when rounds are added, and the budget."""

import collections

import pytest

from mixprec.timing import (
    Paired,
    balanced_order,
    busy_cores,
    free_threads,
    paired_rounds,
    quantile,
    take_turns,
)


class Scripted:
    """A timer answering from scripted per-round times, and a clock that advances by them."""

    def __init__(self, times: dict[str, list[float]]):
        self.times = {name: list(t) for name, t in times.items()}
        self.now = 0.0
        self.order: list[str] = []

    def __call__(self, name: str) -> float:
        t = self.times[name].pop(0)
        self.now += t
        self.order.append(name)
        return t

    def clock(self) -> float:
        return self.now


def test_quantile_interpolates_between_the_sorted_values():
    assert quantile([4.0, 1.0, 3.0, 2.0, 5.0], 0.25) == 2.0
    assert quantile([1.0, 2.0], 0.5) == 1.5
    assert quantile([7.0], 0.25) == 7.0
    with pytest.raises(ValueError):
        quantile([], 0.5)


def test_a_burst_that_slows_the_baseline_does_not_make_the_piece_look_fast():
    """The busy-machine case: in two rounds of five float32 waited for the cores (80x its
    time); the median of the rates would say so, the lower quartile of paired ratios does not."""
    timer = Scripted(
        {"float32": [1.0, 80.0, 1.0, 80.0, 1.0], "bfloat16": [0.25, 0.25, 0.25, 0.25, 0.25]}
    )
    paired = paired_rounds(
        timer, ["float32", "bfloat16"], "float32", min_rounds=5, max_rounds=5, clock=timer.clock
    )
    assert paired.ratios("bfloat16") == (4.0, 320.0, 4.0, 320.0, 4.0)
    assert paired.ratio("bfloat16") == 4.0
    assert paired.spread("bfloat16") == 80.0 and paired.noisy() == ["bfloat16"]
    # the order rotates, so neither piece is always the first of a round
    assert timer.order[:4] == ["float32", "bfloat16", "bfloat16", "float32"]


def test_rounds_are_added_while_they_disagree_and_stop_when_they_agree():
    timer = Scripted({"a": [1.0] * 9, "b": [0.5, 2.0, 0.5, 0.5, 0.5, 0.5, 0.5, 0.5, 0.5]})
    paired = paired_rounds(
        timer, ["a", "b"], "a", min_rounds=3, max_rounds=9, budget_s=100.0, clock=timer.clock
    )
    # three rounds' quartiles spread 1.6x (ratios 2, 0.5, 2); a fourth brings them within 1.25x
    assert paired.rounds == 4 and paired.spread("b") < 1.25 and not paired.noisy()
    assert 1.5 < paired.ratio("b") < 2.0


def test_the_budget_stops_the_rounds_and_the_result_says_they_disagreed():
    timer = Scripted({"a": [1.0] * 20, "b": [0.5, 2.0] * 10})
    paired = paired_rounds(
        timer, ["a", "b"], "a", min_rounds=3, max_rounds=20, budget_s=7.5, clock=timer.clock
    )
    # three rounds took 6 s: a fourth, as long on average, would pass the budget
    assert paired.rounds == 3 and paired.seconds == 6.0
    assert paired.noisy() == ["b"]
    capped = paired_rounds(
        Scripted({"a": [1.0] * 20, "b": [0.5, 2.0] * 10}),
        ["a", "b"],
        "a",
        min_rounds=3,
        max_rounds=6,
        budget_s=100.0,
    )
    assert capped.rounds == 6


def test_a_measurement_can_be_continued():
    first = Paired("a", {"a": (1.0, 1.0), "b": (0.5, 0.5)}, 2.0)
    timer = Scripted({"a": [1.0], "b": [0.5]})
    more = paired_rounds(timer, ["a", "b"], "a", min_rounds=3, prior=first, clock=timer.clock)
    assert more.rounds == 3 and more.ratios("b") == (2.0, 2.0, 2.0) and more.seconds == 1.5
    with pytest.raises(ValueError, match="baseline"):
        paired_rounds(timer, ["b"], "a")


def test_take_turns_rotates_the_order_drops_a_failed_step_and_asks_before_each_round():
    """The one schedule: each round starts one step later in the order; a step that fails
    (None) leaves with its times; the stopping rule is asked before every round, with the
    rounds run and the seconds taken."""
    order: list[str] = []
    fails_at = {"b": 2}

    def step(name: str):
        def run():
            order.append(name)
            rounds = order.count(name)
            return None if fails_at.get(name) == rounds else 1.0

        return run

    asked: list[int] = []

    def stop(times, rounds, seconds):
        asked.append(rounds)
        return "four" if rounds == 4 else None

    times, why = take_turns({n: step(n) for n in "abc"}, stop, clock=lambda: 0.0)
    assert why == "four" and asked == [0, 1, 2, 3, 4]
    assert order == ["a", "b", "c", "b", "c", "a", "a", "c", "c", "a"]
    assert times == {"a": [1.0] * 4, "c": [1.0] * 4}


@pytest.mark.parametrize("n", [1, 2, 3, 4, 5, 6])
def test_each_step_runs_after_each_other_equally_often_over_a_cycle_of_rounds(n):
    """A plain rotation put each step in each position equally often, but not after each
    other step: of three, mixprec's bf16 loop ran right after float32 twice as often as its
    raw twin did, and what a step leaves behind (a cache, the allocator) fell on one ratio
    more than the other. Over a cycle (n rounds, 2n for odd n) each ordered pair of
    neighbours and each position come up equally often."""
    items = list(range(n))
    cycle = n if n % 2 == 0 else 2 * n
    rounds = [balanced_order(items, r) for r in range(cycle)]
    assert all(sorted(r) == items for r in rounds)
    after = collections.Counter((r[i], r[i + 1]) for r in rounds for i in range(n - 1))
    place = collections.Counter((x, i) for r in rounds for i, x in enumerate(r))
    assert len(after) == n * (n - 1) and len(set(after.values())) <= 1
    assert len(place) == n * n and len(set(place.values())) == 1
    assert balanced_order(items, cycle) == rounds[0]  # (and again)


def _stat(busy: int, idle: int, steal: int = 0) -> str:
    # cpu  user nice system idle iowait irq softirq steal
    return f"cpu  {busy} 0 0 {idle} 0 0 0 {steal} 0 0\ncpu0 1 0 0 1 0 0 0 0 0 0\n"


def test_busy_cores_is_the_busy_share_of_the_sample_times_the_cores():
    """Another machine's load arrives as steal time and counts as busy; the reading is the
    change over the sample, not the totals since boot."""
    reads = iter([_stat(1000, 9000), _stat(1150, 9050)])  # 150 busy of 200 ticks
    assert busy_cores(0.0, read=lambda: next(reads), cores=2) == 1.5
    reads = iter([_stat(0, 0, steal=0), _stat(50, 150, steal=50)])  # 100 busy of 250
    assert busy_cores(0.0, read=lambda: next(reads), cores=4) == pytest.approx(1.6)


def test_free_threads_uses_the_free_cores_and_says_why_when_fewer():
    assert free_threads(2, 0.2, 2) == (2, None)  # a quiet machine: torch's default
    assert free_threads(2, None, 2) == (2, None)  # the load unknown: torch's default
    threads, why = free_threads(2, 1.0, 2)  # a burner on one of two cores
    assert threads == 1
    assert "other work kept 1.0 of 2 cores busy" in why and why.endswith(
        "--threads 2 to use them anyway"
    )
    assert free_threads(2, 3.7, 2)[0] == 1  # never fewer than one
    assert free_threads(8, 5.2, 8)[0] == 3
