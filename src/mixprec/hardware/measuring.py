"""Matmul rates measured on the device (`mixprec info --measure`): `measure_rates` times
each dtype's GEMM in paired rounds that take turns (`mixprec.timing`), `measure_notice` says
when other work on the device makes the rates not to be trusted. The ratings themselves live
in `hardware`."""

from __future__ import annotations

import os
import statistics
import time
from collections.abc import Mapping
from dataclasses import dataclass

import torch

from mixprec.device import DeviceInfo, default_device, detect
from mixprec.dtypes import dtype_name
from mixprec.hardware import FAST, REFUSED, SLOW, _cpu_prior, dtype_support
from mixprec.timing import WIDE, paired_rounds

__all__ = ["Rate", "measure", "measure_notice", "measure_rates", "rate_doubts"]


@dataclass(frozen=True)
class Rate:
    """A measured matmul rate in GFLOP/s: the median of the rounds and their range. A wide
    range means other work shared the device while it was timed. `ratio` is the speed against
    float32, the lower quartile of the rounds' paired ratios (None where float32 was not
    measured beside it), and `ratio_spread` their upper quartile over the lower."""

    median: float
    low: float
    high: float
    size: int
    ratio: float | None = None
    ratio_spread: float = 1.0

    @property
    def spread(self) -> float:
        """high / low: 1.0 when every round agreed."""
        return self.high / self.low if self.low > 0 else float("inf")


# a round's timed work is at least this long, so timer resolution and one scheduler hiccup
# are small against it; a matrix is grown until one multiply takes MIN_MULTIPLY_S
MIN_ROUND_S = 0.02
MIN_MULTIPLY_S = 0.005
# rounds whose rates differ by more than this factor were disturbed by other work
BUSY_SPREAD = 1.5
# a dtype rated slow here (emulated, or fast in matmuls alone: float16 with avx512_fp16 runs
# them near float32's speed) that measures this many times float32's speed measured a
# float32 slowed by other work
SLOW_READ_FAST = 4.0
# while the paired ratios disagree, rounds go on up to this many times `repeats` and this many
# times the time asked for
MORE = 3


def measure_rates(
    dtypes: tuple[torch.dtype, ...] = (torch.float32, torch.bfloat16, torch.float16),
    device: torch.device | str | None = None,
    seconds: float = 0.3,
    repeats: int = 5,
) -> dict[str, Rate]:
    """Matmul GFLOP/s per dtype on the device: `repeats` rounds of about `seconds / repeats`
    each (at least `MIN_ROUND_S`), the dtypes taking turns within each round so that a burst
    of other work hits them alike, and more while their paired ratios against float32 spread
    wider than `timing.WIDE` (up to `MORE` times the rounds and the time); a round's rate is
    that of its fastest single multiply (a multiply whose threads waited for cores other work
    held is not what the hardware does); the median round and the range, and each dtype's
    paired ratio against float32 with its spread.

    Every dtype multiplies matrices of one size, settled first from the median of three
    timings: it grows from 128 until the slowest dtype's multiply takes `MIN_MULTIPLY_S`, so
    a dtype far slower on this hardware still finishes in about `seconds` while the faster
    ones repeat their multiply more often.
    """
    if repeats < 1 or not seconds > 0:
        raise ValueError(f"measure needs repeats >= 1 and seconds > 0, got {repeats}, {seconds}")
    device = torch.device(device) if device is not None else default_device()
    # the device measured, not the current one (they differ for cuda:1)
    sync = (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else (lambda: None)

    def timed(a: torch.Tensor, b: torch.Tensor) -> float:
        sync()
        t0 = time.perf_counter()
        a @ b
        sync()
        return time.perf_counter() - t0

    per_round = max(seconds / repeats, MIN_ROUND_S)
    info = detect(device)
    kept = [d for d in dtypes if dtype_support(d, info).status != REFUSED]
    generator = torch.Generator().manual_seed(0)
    n = 128
    while True:
        a32 = torch.randn(n, n, generator=generator).to(device)
        b32 = torch.randn(n, n, generator=generator).to(device)
        operands = {dtype_name(d): (a32.to(d), b32.to(d)) for d in kept}
        one = {}
        for name, (a, b) in operands.items():
            timed(a, b)  # warm-up: kernel selection, first-touch allocation
            one[name] = sorted(timed(a, b) for _ in range(3))[1]
        if not one or max(one.values()) > MIN_MULTIPLY_S or n >= 4096:
            break
        n *= 2
    if not operands:
        return {}
    reps = {name: max(3, round(per_round / max(t, 1e-6))) for name, t in one.items()}

    def fastest(name: str) -> float:
        a, b = operands[name]
        return min(timed(a, b) for _ in range(reps[name]))

    names = list(operands)
    base = "float32" if "float32" in operands else names[0]
    with torch.no_grad(), torch.autocast(device.type, enabled=False):
        paired = paired_rounds(
            fastest,
            names,
            base,
            min_rounds=repeats,
            max_rounds=MORE * repeats,
            budget_s=MORE * seconds * len(names),
        )
    out = {}
    for name in names:
        rates = [2 * n**3 / t / 1e9 for t in paired.times[name]]
        ratio = paired.ratio(name) if base == "float32" else None
        spread = paired.spread(name) if base == "float32" else 1.0
        out[name] = Rate(statistics.median(rates), min(rates), max(rates), n, ratio, spread)
    return out


def measure(
    dtypes: tuple[torch.dtype, ...] = (torch.float32, torch.bfloat16, torch.float16),
    device: torch.device | str | None = None,
    seconds: float = 0.3,
) -> dict[str, float]:
    """Matmul GFLOP/s per dtype on the device, in about `seconds` each: the median rate of
    `measure_rates`."""
    return {name: r.median for name, r in measure_rates(dtypes, device, seconds).items()}


def measure_notice(
    rates: Mapping[str, Rate],
    info: DeviceInfo,
    load: float | None = None,
    seconds: float | None = None,
) -> str | None:
    """Why the rates just measured may not be trusted (`rate_doubts`), or None, with advice:
    to measure longer names more than the `seconds` the rates were measured in."""
    reasons = rate_doubts(rates, info, load)
    if not reasons:
        return None
    longer = max(2.0, 4 * seconds) if seconds is not None else 2.0
    return (
        "these rates are not to be trusted: "
        + "; ".join(reasons)
        + ". Other work is probably using the device; rerun when it is idle, or longer "
        f"(--seconds {longer:g}). The ratings above read their own measurement, on one "
        "thread, which a busy core disturbs less."
    )


def rate_doubts(
    rates: Mapping[str, Rate], info: DeviceInfo, load: float | None = None
) -> list[str]:
    """Why the rates just measured may not be trusted: rounds that disagree by more than
    `BUSY_SPREAD`, paired ratios against float32 spread wider than `timing.WIDE`, a load
    average above the cores, or a dtype the hardware's flags make fast measuring slower than
    float32, or one they make slow measuring faster (other work took the cores while one of
    them ran); none where they can be."""
    reasons = []
    wide = [
        f"{name} {r.low:,.1f}-{r.high:,.1f}" for name, r in rates.items() if r.spread > BUSY_SPREAD
    ]
    if wide:
        reasons.append(
            f"the rounds disagreed by more than {BUSY_SPREAD}x ({', '.join(wide)} GFLOP/s)"
        )
    unpaired = [
        f"{name} {r.ratio:.3g}x-{r.ratio * r.ratio_spread:.3g}x"
        for name, r in rates.items()
        if r.ratio is not None and r.ratio_spread > WIDE
    ]
    if unpaired:
        reasons.append(
            f"the paired rounds' ratios against float32 spread wider than {WIDE:g}x "
            f"(quartiles: {', '.join(unpaired)})"
        )
    cores = os.cpu_count() or 1
    if info.type == "cpu" and load is not None and load > cores:
        reasons.append(f"the 1-minute load average is {load:.2f} on {cores} cores")
    base = rates.get("float32")
    for name, r in rates.items():
        dtype = getattr(torch, name, None)
        if base is None or name == "float32" or not isinstance(dtype, torch.dtype):
            continue
        predicted = (
            _cpu_prior(dtype, info.cpu_flags, info.unknown_flags)
            if info.type == "cpu" and dtype in (torch.bfloat16, torch.float16)
            else dtype_support(dtype, info)
        )
        speed = r.ratio if r.ratio is not None else r.median / base.median
        if predicted.status == FAST and speed < 1 / BUSY_SPREAD:
            reasons.append(
                f"{name}, fast on this hardware, measured {1 / speed:.1f}x slower than float32"
            )
        elif predicted.status == SLOW and speed > SLOW_READ_FAST:
            reasons.append(
                f"{name}, slow on this hardware, measured {speed:.1f}x faster than float32 "
                f"(float32's own rounds were slowed)"
            )
    return reasons
