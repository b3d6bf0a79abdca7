"""Paired, interleaved rounds: the loops compared take turns (`mixprec.timing.take_turns`),
one step each per round, the order changing from round to round (`timing.balanced_order`),
so that other work on the machine, and what a step leaves for the next, fall on all of them
alike and each round gives one ratio per pair
(`verdict.ratio_interval`).

At least `RoundPolicy.min_rounds` rounds run; then more while some pair's interval is wider
than `target_width`, until `budget_s` seconds of rounds have passed or `max_rounds`. The
width that decides is the `STOP_CONFIDENCE` interval's, not the reported `CONFIDENCE` one's:
stopping as soon as the reported interval looks narrow stops most often where the rounds
happen to agree, and such intervals hold the true ratio less often than they claim; deciding
on the wider one keeps the claim, for more rounds (benchmarks/results/bench_stop_rule.md).
The steps and the clock are arguments, so the schedule is tested with injected timing
streams.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Hashable, Mapping, Sequence
from dataclasses import dataclass
from typing import Generic, TypeVar

from mixprec.bench.verdict import MIN_ROUNDS, TARGET_WIDTH, ratio_interval
from mixprec.timing import take_turns

__all__ = [
    "BUDGET",
    "CAPPED",
    "MAX_ROUNDS",
    "NARROW",
    "RoundPolicy",
    "Rounds",
    "STEPS",
    "STOP_CONFIDENCE",
    "run_rounds",
]

K = TypeVar("K", bound=Hashable)
MAX_ROUNDS = 200
# the confidence of the interval whose width decides whether to add rounds (see above)
STOP_CONFIDENCE = 0.99
# why the rounds ended
STEPS, NARROW, BUDGET, CAPPED = "steps", "narrow", "budget", "max rounds"


@dataclass(frozen=True)
class RoundPolicy:
    """How many rounds: `min_rounds` always; with a `budget_s`, more while an interval is
    wider than `target_width`, until that many seconds of rounds or `max_rounds`."""

    min_rounds: int
    budget_s: float = 0.0
    target_width: float = TARGET_WIDTH
    max_rounds: int = MAX_ROUNDS


@dataclass
class Rounds(Generic[K]):
    """Each loop's step times, one per round (index i is round i for all of them), and why
    the rounds ended (`STEPS`, `NARROW`, `BUDGET`, `CAPPED`). A loop whose step returned
    None left the rounds and has no times here."""

    times: dict[K, list[float]]
    stop: str


def _widest(times: Mapping[K, list[float]], pairs: Sequence[tuple[K, K]]) -> float:
    widths = [
        interval.width
        for base, other in pairs
        if base in times and other in times
        if (interval := ratio_interval(times[base], times[other], STOP_CONFIDENCE)) is not None
    ]
    return max(widths, default=0.0)


def run_rounds(
    steps: Mapping[K, Callable[[], float | None]],
    pairs: Sequence[tuple[K, K]],
    policy: RoundPolicy,
    clock: Callable[[], float] = time.monotonic,
    before_round: Callable[[], None] = lambda: None,
) -> Rounds[K]:
    """Run rounds of `steps` (each returns its step's milliseconds, or None when its loop
    failed and leaves) taking turns (`mixprec.timing.take_turns`) until `policy` says stop;
    `pairs` are (base, other) keys whose ratio intervals decide whether to add rounds.
    `before_round` may raise to stop."""

    def stop(times: dict[K, list[float]], rounds: int, seconds: float) -> str | None:
        if rounds < policy.min_rounds:
            return None
        if policy.budget_s <= 0:
            return STEPS
        # (an interval of fewer than MIN_ROUNDS rounds holds the median with less than
        # CONFIDENCE: narrow, it is still no reason to stop while the budget lasts)
        if rounds >= MIN_ROUNDS and _widest(times, pairs) <= policy.target_width:
            return NARROW
        if rounds >= policy.max_rounds:
            return CAPPED
        return BUDGET if seconds >= policy.budget_s else None

    times, why = take_turns(steps, stop, clock=clock, before_round=before_round)
    return Rounds(times, STEPS if why == "failed" else why)
