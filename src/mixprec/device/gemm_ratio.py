"""How fast this CPU multiplies 16-bit matrices, against float32: a short measurement, cached
per machine.

Instruction flags say what a CPU should do with bfloat16 and float16; a GEMM says what it does
with this torch. The fast/supported/slow rating of those dtypes on a CPU
(`mixprec.hardware.dtype_support`) reads the ratio measured here. A 16-bit kernel's edge over
float32 grows with the matrix (its blocking and packing cost the same at any size), so a dtype is
rated at a size a training step multiplies: matrices grow from `SIZES`' first towards `TRAINING`
while the next size's rounds still fit the time budget, and a dtype more than `DECISIVE` times
slower than float32 at a size is rated there (no larger matrix makes it fast, and its larger
multiplies are the slow ones). float32 and the dtypes take turns within each round, and the
ratio is the paired ratios' lower quartile (`mixprec.timing`). One measurement stays within
`BUDGET_S` and is kept in a small JSON file, one entry per CPU model and flags, ISA cap,
torch version and measurement (`METHOD`), so a machine pays for it once per configuration.

The GEMMs run on one thread. A multi-threaded multiply waits for its slowest thread, and on a
host where other processes hold the cores every float32 multiply can wait a scheduler slice
while a 16-bit one that torch runs on one thread does not: the ratio then says bfloat16 is
many times faster than float32 on a CPU that emulates it. One thread measures what the cores'
instructions do, which is what the rating is about.
"""

from __future__ import annotations

import json
import math
import os
import threading
import time
import warnings
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import torch

from mixprec.dtypes import dtype_name
from mixprec.files import write_atomically
from mixprec.timing import WIDE, Paired, paired_rounds

__all__ = [
    "CACHE_ENV",
    "GemmRatios",
    "cache_path",
    "measure",
    "rate",
]

CACHE_ENV = "MIXPREC_CACHE_DIR"
CACHE_FILE = "gemm-ratios.json"
# part of every cache key: raised when the measurement changes, so that a newer mixprec does
# not read what an older one measured another way
METHOD = 2
# the dtypes rated against float32
DTYPES: tuple[torch.dtype, ...] = (torch.bfloat16, torch.float16)
# the square sizes tried, smallest first; the last is a training step's GEMM size
SIZES: tuple[int, ...] = (128, 256, 512, 1024)
TRAINING = SIZES[-1]
# a dtype whose ratio at a size is below this is rated at that size
DECISIVE = 0.1
# the whole measurement's time: a size is grown only while its estimated rounds fit
BUDGET_S = 0.4
# paired rounds at each size, and at most at the size rated
MIN_ROUNDS = 3
MAX_ROUNDS = 15
# a dtype's turn in a round times single multiplies until TURN_S has passed (at least
# MIN_CALLS, at most MAX_CALLS) and keeps the fastest: a small multiply is shorter than the
# timer's jitter, and a long one is the likelier to be preempted by other work
TURN_S = 0.002
MIN_CALLS = 2
MAX_CALLS = 64
# the time of a round at twice the size, against this one's: the work grows eightfold
GROWTH = 8
# entries kept in the cache file, newest last
KEEP = 16
# one measurement at a time in a process: two at once would compete for the cores they time,
# and each sets torch's thread count and restores it
_MEASURING = threading.Lock()


@dataclass(frozen=True)
class GemmRatios:
    """A measured GEMM speed of each 16-bit dtype against float32 on one CPU.

    `ratios` maps a dtype name to its speed against float32 (0.5: half float32's speed), the
    lower quartile of the rounds' paired ratios; `spread` maps it to the upper quartile over
    the lower (wide when other work shared the CPU); `sizes` to the square size it was rated
    at, and `rounds` to the paired rounds there."""

    ratios: dict[str, float]
    spread: dict[str, float]
    sizes: dict[str, int]
    rounds: dict[str, int]
    seconds: float
    measured_at: str

    def noisy(self) -> list[str]:
        """The dtypes whose rounds disagreed by more than `timing.WIDE`, unless even their
        upper quartile stays under `DECISIVE`."""
        return [
            name
            for name, s in self.spread.items()
            if s > WIDE and self.ratios[name] * s >= DECISIVE
        ]

    def note(self) -> str:
        """How it was measured, for `mixprec info`: each dtype's size and rounds, and whether
        the rounds disagreed."""
        parts = []
        for name in self.ratios:
            size = self.sizes[name]
            part = (
                f"{name} at {size}x{size} ({self.rounds[name]} rounds, within "
                f"{self.spread[name]:.2f}x"
            )
            if size < TRAINING and self.ratios[name] < DECISIVE:
                part += f"; under {DECISIVE:g}x float32's speed there, so not measured larger"
            parts.append(part + ")")
        text = (
            f"{', '.join(parts)}, against float32 on one thread, the lower quartile of paired "
            f"rounds, in {self.seconds:.2f} s, measured {self.measured_at}"
        )
        if self.noisy():
            text += (
                f"; the rounds of {' and '.join(self.noisy())} disagreed by more than "
                f"{WIDE:g}x: other work shared the CPU and the ratios may be off "
                "(`mixprec info --measure` measures again)"
            )
        return text


def measure(dtypes: tuple[torch.dtype, ...] = DTYPES) -> GemmRatios:
    """Time GEMMs in float32 and each of `dtypes` on one CPU thread and return each dtype's
    speed against float32, at the largest of `SIZES` whose rounds fit `BUDGET_S`, or at the
    first size where it is `DECISIVE`ly slow.

    The global RNG, autocast, autograd and torch's thread count are left as they were: the
    operands come from a generator of their own, and the multiplies run with autocast off and
    without gradients."""
    with _MEASURING:
        threads = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            with torch.no_grad(), torch.autocast("cpu", enabled=False):
                return _measure(dtypes)
        finally:
            torch.set_num_threads(threads)


def _gemm_timer(size: int, names: list[str]) -> Callable[[str], float]:
    """A timer of `size`-square multiplies in each of `names`, warmed up: a dtype's turn times
    single multiplies until `TURN_S` has passed (at least `MIN_CALLS`, at most `MAX_CALLS`)
    and keeps the fastest."""
    generator = torch.Generator().manual_seed(size)
    a32 = torch.randn(size, size, generator=generator)
    b32 = torch.randn(size, size, generator=generator)
    operands = {n: (a32.to(getattr(torch, n)), b32.to(getattr(torch, n))) for n in names}
    for a, b in operands.values():
        a @ b  # warm-up: kernel selection, first-touch allocation

    def time_one(name: str) -> float:
        a, b = operands[name]
        times: list[float] = []
        turn = time.perf_counter()
        while len(times) < MIN_CALLS or (
            len(times) < MAX_CALLS and time.perf_counter() - turn < TURN_S
        ):
            t0 = time.perf_counter()
            a @ b
            times.append(time.perf_counter() - t0)
        return min(times)

    return time_one


def rate(
    names: list[str],
    timer_at: Callable[[int, list[str]], Callable[[str], float]],
    clock: Callable[[], float] = time.perf_counter,
) -> dict[str, tuple[Paired, int]]:
    """Each of `names` against float32, from the timers `timer_at(size, ["float32", ...])`
    builds (warming them up): `MIN_ROUNDS` paired rounds at each of `SIZES` in turn, a name
    whose ratio there is under `DECISIVE` in all its rounds but the fastest quarter (its upper
    quartile) rated at that size; the others rated at the last
    size, or at the last one whose rounds fit what is left of `BUDGET_S` (the next size's
    estimated `GROWTH` times as long, or its warm-up showing them longer), with more rounds
    there while they disagree. Returns each name's paired rounds and size."""
    start = clock()
    pending = list(names)
    rated: dict[str, tuple[Paired, int]] = {}
    last: tuple[Paired, Callable[[str], float], int] | None = None
    for size in SIZES:
        before = clock()
        timer = timer_at(size, ["float32", *pending])
        warm_up = clock() - before  # one multiply of each
        if last is not None and warm_up * MIN_CALLS * MIN_ROUNDS > BUDGET_S - (clock() - start):
            break
        paired = paired_rounds(
            timer,
            ["float32", *pending],
            "float32",
            min_rounds=MIN_ROUNDS,
            max_rounds=MIN_ROUNDS,
            clock=clock,
        )
        # (under DECISIVE at its rounds' upper quartile too: a turn other work slowed can
        # make a fast dtype read decisively slow from the few rounds of one size)
        decided = [n for n in pending if paired.ratio(n) * paired.spread(n) < DECISIVE]
        rated.update((n, (paired, size)) for n in decided)
        pending = [n for n in pending if n not in decided]
        last = (paired, timer, size)
        # a turn at the next size takes MIN_CALLS multiplies, or TURN_S of them
        next_round = sum(
            max(GROWTH * MIN_CALLS * sorted(paired.times[n])[paired.rounds // 2], TURN_S)
            for n in ["float32", *pending]
        )
        if not pending or next_round * (MIN_ROUNDS + 1) > BUDGET_S - (clock() - start):
            break
    if pending and last is not None:
        paired, timer, size = last
        paired = paired_rounds(
            timer,
            ["float32", *pending],
            "float32",
            min_rounds=MIN_ROUNDS,
            max_rounds=MAX_ROUNDS,
            budget_s=BUDGET_S - (clock() - start),
            prior=paired,
            clock=clock,
        )
        rated.update((n, (paired, size)) for n in pending)
    return rated


def _measure(dtypes: tuple[torch.dtype, ...]) -> GemmRatios:
    start = time.perf_counter()
    names = [dtype_name(d) for d in dtypes if d != torch.float32]
    rated = rate(names, _gemm_timer)
    return GemmRatios(
        ratios={n: rated[n][0].ratio(n) for n in names},
        spread={n: rated[n][0].spread(n) for n in names},
        sizes={n: rated[n][1] for n in names},
        rounds={n: rated[n][0].rounds for n in names},
        seconds=time.perf_counter() - start,
        measured_at=datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
    )


def cache_path(environ: Mapping[str, str] | None = None) -> Path:
    """The cache file: in ``MIXPREC_CACHE_DIR`` if set, else ``$XDG_CACHE_HOME/mixprec``, else
    ``~/.cache/mixprec``."""
    environ = os.environ if environ is None else environ
    if environ.get(CACHE_ENV):
        folder = Path(environ[CACHE_ENV])
    elif environ.get("XDG_CACHE_HOME"):
        folder = Path(environ["XDG_CACHE_HOME"]) / "mixprec"
    else:
        folder = Path.home() / ".cache" / "mixprec"
    return folder / CACHE_FILE


def _entries(path: Path) -> list[dict[str, Any]]:
    """The cache's entries; none when the file is missing or not one this module wrote (it is
    then measured again and rewritten)."""
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return []
    entries = data.get("entries") if isinstance(data, dict) else None
    return [e for e in entries if isinstance(e, dict)] if isinstance(entries, list) else []


def _from_entry(entry: dict[str, Any]) -> GemmRatios | None:
    """The entry's ratios, or None where a field is not what `measure` writes: a hand-edited
    "seconds": null passed, then failed every CPU `detect` in `GemmRatios.note`."""
    try:
        found = GemmRatios(**entry["measured"])
    except (KeyError, TypeError):
        return None
    names = {dtype_name(d) for d in DTYPES}
    fields = (found.ratios, found.spread, found.sizes, found.rounds)
    valid = all(
        isinstance(f, dict)
        and set(f) == names
        and all(
            isinstance(v, float | int) and not isinstance(v, bool) and 0 < v < math.inf
            for v in f.values()
        )
        for f in fields
    )
    seconds = found.seconds
    timed = (
        isinstance(seconds, float | int)
        and not isinstance(seconds, bool)
        and 0 <= seconds < math.inf
        and isinstance(found.measured_at, str)
    )
    return found if valid and timed else None


def _write(path: Path, entries: list[dict[str, Any]]) -> None:
    """Replace the cache file in one step: a reader sees the old file or the new one."""
    path.parent.mkdir(parents=True, exist_ok=True)
    write_atomically(path, json.dumps({"entries": entries[-KEEP:]}, indent=1))


def lookup(key: Mapping[str, Any]) -> GemmRatios | None:
    """The ratios the cache file holds for `key`, or None."""
    key = dict(key)
    for entry in _entries(cache_path()):
        if entry.get("key") == key and (found := _from_entry(entry)) is not None:
            return found
    return None


# measurements a cache file could not take, by file and key: this process's own
_UNSTORED: dict[str, tuple[GemmRatios, str]] = {}


def cached(key: Mapping[str, Any], refresh: bool = False) -> tuple[GemmRatios, str | None]:
    """The ratios measured for `key` (what decides them: CPU model and flags, the ISA cap this
    process's kernels run under, torch version), from the cache file, or measured now and
    stored there when the file has none for `key` or `refresh` asks; and why they are not in
    the cache file (None when they are), so that no one says they were cached. The caller
    vouches that `key` describes this process: its GEMMs are what is measured. A cache that
    cannot be written is warned about, and the measurement is then this process's alone
    (`_UNSTORED`: asked again, it is not measured again)."""
    key = dict(key)
    path = cache_path()
    held = json.dumps([str(path), key], sort_keys=True)  # (another cache file: tried anew)
    if not refresh:
        if (found := lookup(key)) is not None:
            return found, None
        if held in _UNSTORED:
            return _UNSTORED[held]
    entries = _entries(path)
    found = measure()
    kept = [e for e in entries if e.get("key") != key]
    try:
        _write(path, [*kept, {"key": key, "measured": asdict(found)}])
    except OSError as err:
        warnings.warn(
            f"mixprec could not cache its GEMM measurement in {path} ({err}); it measures "
            f"again in each process. Set {CACHE_ENV} to a writable folder.",
            RuntimeWarning,
            stacklevel=3,
        )
        _UNSTORED[held] = (found, f"{path} could not be written: {err.strerror or err}")
        return _UNSTORED[held]
    _UNSTORED.pop(held, None)
    return found, None
