"""How often the bench's reported 95% speedup interval holds the true ratio when rounds stop
as soon as an interval is narrow (`mixprec.bench.rounds.run_rounds`, the bench's default
policy: 10 rounds at least, then more while the interval is wider than 1.10x, a 30 s budget).

Fake paired steps: float32 100 ms and the other 80 ms, each times an independent lognormal
slowdown of spread ``sigma``, so the true median ratio is exactly 1.25; a fake clock. The
stop decision is taken on the interval at each confidence given (0.95: the interval reported
itself; the bench decides on `rounds.STOP_CONFIDENCE`'s), and the 95% interval is reported.

    python benchmarks/bench_stop_rule.py [--trials 2000] [--stop 0.95 0.99]
"""

from __future__ import annotations

import argparse
import math
import random
from unittest import mock

from mixprec.bench import rounds
from mixprec.bench.rounds import RoundPolicy, run_rounds
from mixprec.bench.verdict import ratio_interval

TRUE = 1.25


def trial(seed: int, sigma: float) -> tuple[bool, int]:
    """Whether one bench-like run's reported interval holds the true ratio, and its rounds."""
    rng = random.Random(seed)
    now = [0.0]

    def step(ms: float):
        def run() -> float:
            t = ms * math.exp(rng.gauss(0, sigma))
            now[0] += t / 1e3
            return t

        return run

    out = run_rounds(
        {"a": step(100.0), "b": step(80.0)}, [("a", "b")], RoundPolicy(10, 30.0), lambda: now[0]
    )
    interval = ratio_interval(out.times["a"], out.times["b"])
    assert interval is not None
    return interval.low <= TRUE <= interval.high, interval.n


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trials", type=int, default=2000)
    parser.add_argument("--stop", type=float, nargs="+", default=[0.95, 0.99])
    args = parser.parse_args()
    print("| stop decided on | noise sigma | coverage of the 95% interval | median rounds |")
    print("|---|---:|---:|---:|")
    for stop in args.stop:
        with mock.patch.object(rounds, "STOP_CONFIDENCE", stop):
            for sigma in (0.06, 0.10, 0.15):
                runs = [trial(seed, sigma) for seed in range(args.trials)]
                held = sum(h for h, _ in runs) / len(runs)
                n = sorted(r for _, r in runs)[len(runs) // 2]
                print(f"| {stop:.0%} interval | {sigma:.2f} | {held:.3f} | {n} |")


if __name__ == "__main__":
    main()
