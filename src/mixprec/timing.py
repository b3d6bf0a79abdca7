"""Paired timing: how fast pieces of work run against a baseline, measured so that other work on
the machine moves the answer as little as it can.

`take_turns` is the one schedule the bench and the GEMM ratings time with: the pieces take turns
within each round, the order changing from round to round (`balanced_order`: each piece in each
place and after each other equally often), so a burst of other work, or what one piece leaves
for the next, falls on them alike, until a stopping rule says enough. Each round gives a paired
ratio, the baseline's time over each piece's (2.0: twice the baseline's speed). The answer is a
low quantile of a piece's ratios (`QUANTILE`, the lower quartile): a round in which other work
slowed the baseline cannot raise it, and it claims a speed-up only most rounds showed. The ratio
of the quartiles, the spread, says how far to trust it: rounds are added while it is wider than
`WIDE`, within a time budget, and `Paired.noisy` names the pieces whose spread stayed wide.
"""

from __future__ import annotations

import os
import resource
import time
from collections.abc import Callable, Hashable, Mapping, Sequence
from dataclasses import dataclass
from typing import TypeVar

__all__ = [
    "WIDE",
    "Paired",
    "add_own_cpu",
    "balanced_order",
    "busy_cores",
    "cpu_sample",
    "free_threads",
    "other_busy_cores",
    "paired_rounds",
    "take_turns",
]

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


def balanced_order(items: Sequence[K], round_index: int) -> list[K]:
    """`items` in the order of round `round_index` of a Williams design: over a cycle of
    ``n`` rounds (``2n`` for an odd number of items) each item runs in each position equally
    often and right after each other item equally often. A plain rotation balances only the
    positions: with three steps, one ran after float32 in two rounds of three and another in
    one, so what a step leaves behind for the next (a cache, the allocator's state) fell on
    their ratios unevenly."""
    n = len(items)
    first, low, high = [0], 1, n - 1  # the first round's: 0, 1, n-1, 2, n-2, ...
    while len(first) < n:
        if len(first) % 2:
            first.append(low)
            low += 1
        else:
            first.append(high)
            high -= 1
    k = round_index % (n if n % 2 == 0 else 2 * n)
    row = [items[(i + k % n) % n] for i in first]
    return row[::-1] if k >= n else row


def take_turns(
    steps: Mapping[K, Callable[[], float | None]],
    stop: Callable[[dict[K, list[float]], int, float], str | None],
    *,
    prior: Mapping[K, Sequence[float]] | None = None,
    clock: Callable[[], float] = time.perf_counter,
    before_round: Callable[[], None] = lambda: None,
) -> tuple[dict[K, list[float]], str]:
    """Rounds in which each of `steps` runs once (returning its time, or None when it failed
    and leaves the rounds), in `balanced_order`, until `stop(times, rounds,
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
        for key in balanced_order(live, len(times[live[0]])):
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


def _cpu_ticks(stat: str) -> tuple[int, int]:
    """(busy, total) jiffies of all CPUs from the first line of /proc/stat: busy counts
    user, nice, system, irq, softirq and steal (another virtual machine on the host)."""
    fields = [int(x) for x in stat.split("\n", 1)[0].split()[1:9]]
    user, nice, system, idle, iowait, irq, softirq, steal = fields + [0] * (8 - len(fields))
    busy = user + nice + system + irq + softirq + steal
    return busy, busy + idle + iowait


def busy_cores(
    sample_s: float = 0.25,
    read: Callable[[], str] | None = None,
    cores: int | None = None,
) -> float | None:
    """How many cores other work keeps busy now: the CPUs' busy share over `sample_s` seconds
    in which this process sleeps, times the cores (Linux's /proc/stat; `read` returns its
    text). Elsewhere the 1-minute load average, which lags; None when neither is known."""
    cores = cores or os.cpu_count() or 1
    if read is None and os.path.exists("/proc/stat"):

        def read() -> str:
            with open("/proc/stat") as f:
                return f.read()

    if read is not None:
        busy0, total0 = _cpu_ticks(read())
        time.sleep(sample_s)
        busy1, total1 = _cpu_ticks(read())
        if total1 > total0:
            return cores * (busy1 - busy0) / (total1 - total0)
    if hasattr(os, "getloadavg"):
        return min(float(cores), os.getloadavg()[0])
    return None


CpuSample = tuple[int, int, float, float]


# CPU seconds of finished processes this one ran that are not its children, so not in its
# rusage (the bench's fork server forks them: `add_own_cpu`)
_OWN_ELSEWHERE = [0.0]


def add_own_cpu(seconds: float) -> None:
    """Count `seconds` of CPU time used for this process by one that is not its child (a
    measurement forked by a server it started) as its own in `cpu_sample`."""
    _OWN_ELSEWHERE[0] += seconds


def cpu_sample(stat: str | None = None) -> CpuSample | None:
    """(busy and all jiffies of every CPU (`_cpu_ticks` of /proc/stat, or of `stat`, its
    text); this process's CPU seconds with its finished children's and those run for it
    elsewhere (`add_own_cpu`); `time.monotonic()`), for `other_busy_cores`; None without
    /proc/stat."""
    if stat is None:
        try:
            with open("/proc/stat") as f:
                stat = f.read()
        except OSError:
            return None
    busy, total = _cpu_ticks(stat)
    own = sum(
        r.ru_utime + r.ru_stime
        for r in (
            resource.getrusage(resource.RUSAGE_SELF),
            resource.getrusage(resource.RUSAGE_CHILDREN),
        )
    )
    return busy, total, own + _OWN_ELSEWHERE[0], time.monotonic()


def other_busy_cores(start: CpuSample | None, end: CpuSample | None, cores: int) -> float | None:
    """How many of `cores` other work kept busy between two `cpu_sample`s: the CPUs' busy
    share times the cores, less the cores this process (and the children it ran) used."""
    if start is None or end is None or end[1] <= start[1] or end[3] <= start[3]:
        return None
    busy = cores * (end[0] - start[0]) / (end[1] - start[1])
    own = (end[2] - start[2]) / (end[3] - start[3])
    return round(max(0.0, busy - own), 2)


def free_threads(default: int, busy: float | None, cores: int) -> tuple[int, str | None]:
    """The threads a CPU measurement should use when other work keeps `busy` of `cores`
    busy: `default` while that many cores are free, else the free ones (at least one), and
    why fewer. Threads of one op wait for each other, so one that shares its core with other
    work stalls them all; a speed-up measured so is lower than free cores give."""
    if busy is None:
        return default, None
    free = max(1, int(cores - busy + 0.5))
    if free >= default:
        return default, None
    return free, (
        f"{free} thread(s), not torch's {default}: other work kept {busy:.1f} of {cores} cores "
        f"busy as the run began (threads sharing a core with other work wait for each other "
        f"at every op); --threads {default} to use them anyway"
    )
