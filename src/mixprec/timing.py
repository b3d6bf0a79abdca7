"""Paired timing: how fast pieces of work run against a baseline, measured so that other work on
the machine moves the answer as little as it can.

`take_turns` is the one schedule the bench and the GEMM ratings time with: the pieces take
turns within each round, the order rotating from round to round, so a burst of other work falls
on them alike, until a stopping rule says enough. Each round gives a paired ratio, the
baseline's time over each piece's (2.0: twice the baseline's speed). The answer is a low
quantile of a piece's ratios (`QUANTILE`, the lower quartile): a round in which other work
slowed the baseline cannot raise it, and it claims a speed-up only most rounds showed. The
ratio of the quartiles, the spread, says how far to trust it: rounds are added while it is
wider than `WIDE`, within a time budget, and `Paired.noisy` names the pieces whose spread
stayed wide.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Hashable, Mapping, Sequence
from dataclasses import dataclass
from typing import TypeVar

__all__ = ["QUANTILE", "WIDE", "Paired", "paired_rounds", "quantile", "take_turns"]

K = TypeVar("K", bound=Hashable)

QUANTILE = 0.25
# a spread (upper quartile over lower quartile of the paired ratios) above this is noise
WIDE = 1.25


def quantile(values: Sequence[float], q: float) -> float:
    """The `q` quantile of `values`, interpolated linearly between the sorted values."""
    if not values:
        raise ValueError("quantile of no values")
    ordered = sorted(values)
    at = q * (len(ordered) - 1)
    low = int(at)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (at - low)


@dataclass(frozen=True)
class Paired:
    """Per-round times (seconds) of each piece, the baseline's among them, from rounds in
    which they took turns; `seconds` is the wall time the rounds took."""

    baseline: str
    times: dict[str, tuple[float, ...]]
    seconds: float

    @property
    def rounds(self) -> int:
        return len(self.times[self.baseline])

    def ratios(self, name: str) -> tuple[float, ...]:
        """The baseline's time over `name`'s, round by round."""
        return tuple(
            b / t for b, t in zip(self.times[self.baseline], self.times[name], strict=True)
        )

    def ratio(self, name: str) -> float:
        """`name`'s speed against the baseline: the `QUANTILE` of its paired ratios."""
        return quantile(self.ratios(name), QUANTILE)

    def spread(self, name: str) -> float:
        """The upper quartile of `name`'s paired ratios over the lower: 1.0 when every round
        agreed."""
        ratios = self.ratios(name)
        return quantile(ratios, 1 - QUANTILE) / quantile(ratios, QUANTILE)

    def noisy(self, wide: float = WIDE) -> list[str]:
        """The pieces whose paired ratios spread wider than `wide`."""
        return [n for n in self.times if n != self.baseline and self.spread(n) > wide]


def take_turns(
    steps: Mapping[K, Callable[[], float | None]],
    stop: Callable[[dict[K, list[float]], int, float], str | None],
    *,
    prior: Mapping[K, Sequence[float]] | None = None,
    clock: Callable[[], float] = time.perf_counter,
    before_round: Callable[[], None] = lambda: None,
) -> tuple[dict[K, list[float]], str]:
    """Rounds in which each of `steps` runs once (returning its time, or None when it failed
    and leaves the rounds), the order rotating each round, until `stop(times, rounds,
    seconds)`, asked before every round with the rounds run and the seconds taken so far,
    names why they end. `prior` holds earlier rounds of the same steps, which the times
    start from (its seconds are not counted). `before_round` may raise to stop. Returns each
    step's times (index i is round i for all) and `stop`'s reason."""
    live = list(steps)
    times: dict[K, list[float]] = {k: list(prior[k]) if prior else [] for k in live}
    start, done = clock(), 0
    while live:
        reason = stop(times, done, clock() - start)
        if reason is not None:
            return times, reason
        before_round()
        shift = len(times[live[0]]) % len(live)
        for key in live[shift:] + live[:shift]:
            took = steps[key]()
            if took is None:
                live.remove(key)
                del times[key]
            else:
                times[key].append(took)
        done += 1
    return times, "failed"


def paired_rounds(
    time_one: Callable[[str], float],
    names: Sequence[str],
    baseline: str,
    *,
    min_rounds: int = 3,
    max_rounds: int = 15,
    budget_s: float = 1.0,
    wide: float = WIDE,
    prior: Paired | None = None,
    clock: Callable[[], float] = time.perf_counter,
) -> Paired:
    """Rounds in which `time_one(name)` times each of `names` (the baseline among them) once,
    taking turns (`take_turns`): `min_rounds`, then more while a piece's spread is wider than
    `wide`, up to `max_rounds` and while another round, as long as the rounds so far took on
    average, still ends within `budget_s` of the start. `prior` continues an earlier
    measurement of the same pieces: its rounds count, its time does not."""
    if baseline not in names:
        raise ValueError(f"the baseline {baseline!r} is not among the pieces timed {names}")

    def stop(times: dict[str, list[float]], done: int, elapsed: float) -> str | None:
        rounds = len(times[baseline])
        if rounds < min_rounds:
            return None
        measured = Paired(baseline, {n: tuple(t) for n, t in times.items()}, 0.0)
        per_round = elapsed / done if done else 0.0
        if rounds >= max_rounds or not measured.noisy(wide) or elapsed + per_round > budget_s:
            return "enough"
        return None

    start = clock()
    times, _ = take_turns(
        {n: (lambda n=n: time_one(n)) for n in names},
        stop,
        prior=prior.times if prior is not None else None,
        clock=clock,
    )
    return Paired(baseline, {n: tuple(t) for n, t in times.items()}, clock() - start)
