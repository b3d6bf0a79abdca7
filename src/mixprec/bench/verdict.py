"""How sure the bench is of a speedup, and what it may conclude.

A speedup is the median of paired ratios: float32's step time over the other precision's,
one ratio per round in which both ran (`rounds`). Other work on the machine slows single
steps by a random factor; a ratio of two steps from the same round cancels what the load
does to both, and the median ignores the rounds it hit unevenly. Its interval is the
order-statistic confidence interval of the median, ``[r_(k), r_(n+1-k)]`` with ``k`` from
the binomial distribution: it holds the true median ratio with at least `CONFIDENCE`
whatever the noise's distribution, assuming only that rounds are independent. Fewer than
`MIN_ROUNDS` rounds cannot give such an interval at all.

`speed_verdict` turns the intervals of one precision (one per batch size) into a finding,
or withholds it and says why: too few rounds, or an interval wider than `MAX_WIDTH` that
holds 1 (`carries_finding`: one wholly above or below 1 says which way, however wide, and
the finding then quotes it).
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass

__all__ = [
    "CONFIDENCE",
    "FASTER",
    "FEW",
    "MIN_ROUNDS",
    "NOISY",
    "NOT_FASTER",
    "TARGET_WIDTH",
    "Verdict",
    "carries_finding",
    "median_interval",
    "ratio_interval",
    "speed_verdict",
]

CONFIDENCE = 0.95
# rounds are added while an interval's high / low is wider than this (high = 1.10 low)
TARGET_WIDTH = 1.10
# a verdict is withheld when an interval's high / low is wider than this
MAX_WIDTH = 1.5
FASTER, NOT_FASTER, NOISY, FEW = "faster", "not faster", "too noisy", "too few rounds"


def _rank(n: int, confidence: float) -> int:
    """The largest k (at least 1) with P(Binomial(n, 1/2) < k) <= (1 - confidence) / 2."""
    tail, k = 0.0, 0
    while k < n:
        tail += math.comb(n, k) / 2**n
        if tail > (1 - confidence) / 2:
            break
        k += 1
    return max(k, 1)


def _min_rounds(confidence: float = CONFIDENCE) -> int:
    """The fewest values whose order statistics bound the median with `confidence`."""
    n = 1
    while 1 - 2 * 0.5**n < confidence:
        n += 1
    return n


MIN_ROUNDS = _min_rounds()


@dataclass(frozen=True)
class Interval:
    """A median and the interval that holds the true median with `confidence`
    (``confidence`` is lower than asked, down to 0, with fewer than `MIN_ROUNDS` values)."""

    median: float
    low: float
    high: float
    n: int
    confidence: float

    @property
    def width(self) -> float:
        """high / low, a factor of 1 or more."""
        return self.high / self.low if self.low > 0 else math.inf


def median_interval(values: Sequence[float], confidence: float = CONFIDENCE) -> Interval:
    """The median of `values` and its distribution-free confidence interval."""
    xs = sorted(values)
    n = len(xs)
    if n == 0:
        raise ValueError("no values")
    if not all(math.isfinite(x) for x in xs):
        raise ValueError(f"the values of a median interval must be finite numbers, got {values!r}")
    k = _rank(n, confidence)
    covered = 1 - 2 * sum(math.comb(n, i) for i in range(k)) / 2**n
    return Interval(statistics.median(xs), xs[k - 1], xs[n - k], n, round(covered, 4))


def ratio_interval(
    base_ms: Sequence[float], other_ms: Sequence[float], confidence: float = CONFIDENCE
) -> Interval | None:
    """How many times as fast `other` ran as `base`: the median of ``base[i] / other[i]``
    over the rounds both have, with its interval at `confidence`; None when they share no
    round."""
    n = min(len(base_ms), len(other_ms))
    if n == 0:
        return None
    bad = [t for t in (*base_ms[:n], *other_ms[:n]) if not (math.isfinite(t) and t > 0)]
    if bad:
        raise ValueError(
            f"step times are finite milliseconds above 0, got {bad[0]!r} among the rounds' "
            f"times (a step that failed leaves its loop instead: its time is None)"
        )
    ratios = [b / o for b, o in zip(base_ms[:n], other_ms[:n], strict=True)]
    return median_interval(ratios, confidence)


@dataclass(frozen=True)
class Verdict:
    """What one precision's intervals (one per batch size) allow to conclude.

    `kind`: `FASTER` (every interval above 1), `NOT_FASTER` (some interval reaches 1 or
    below), `NOISY` (an interval wider than `MAX_WIDTH` that holds 1: withheld) or `FEW`
    (fewer than `MIN_ROUNDS` rounds somewhere: withheld). `decisive` is the interval that
    withheld it, else the widest."""

    kind: str
    intervals: tuple[Interval, ...]
    decisive: Interval

    @property
    def withheld(self) -> bool:
        return self.kind in (NOISY, FEW)


def carries_finding(interval: Interval, max_width: float = MAX_WIDTH) -> bool:
    """Whether ``interval`` supports a finding: at most `max_width` wide, or wholly above or
    below 1 (then it says which way, however wide it is)."""
    return interval.width <= max_width or interval.low > 1 or interval.high < 1


def speed_verdict(intervals: Sequence[Interval], max_width: float = MAX_WIDTH) -> Verdict:
    """The finding the intervals support, or why there is none (see `Verdict`)."""
    if not intervals:
        raise ValueError("no intervals")
    few = [i for i in intervals if i.n < MIN_ROUNDS]
    if few:
        return Verdict(FEW, tuple(intervals), min(few, key=lambda i: i.n))
    widest = max(intervals, key=lambda i: i.width)
    unclear = [i for i in intervals if not carries_finding(i, max_width)]
    if unclear:
        return Verdict(NOISY, tuple(intervals), max(unclear, key=lambda i: i.width))
    kind = FASTER if all(i.low > 1 for i in intervals) else NOT_FASTER
    return Verdict(kind, tuple(intervals), widest)
