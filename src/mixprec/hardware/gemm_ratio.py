"""How fast this CPU multiplies 16-bit matrices, against float32: a short measurement, cached
per machine.

Instruction flags say what a CPU should do with bfloat16 and float16; a GEMM says what it does
with this torch. The fast/supported/slow rating of those dtypes on a CPU
(`hardware.dtype_support`) reads the ratio measured here. One measurement takes well under a
second (small square GEMMs, the same size for every dtype, the dtypes taking turns within each
round, the fastest multiply of each kept) and is kept in a small JSON file, one entry per CPU
model and flags, ISA cap and torch version, so a machine pays for it once per configuration.

The GEMMs run on one thread. A multi-threaded multiply waits for its slowest thread, and on a
host where other processes hold the cores every float32 multiply can wait a scheduler slice
while a 16-bit one that torch runs on one thread does not: the ratio then says bfloat16 is
many times faster than float32 on a CPU that emulates it. One thread measures what the cores'
instructions do, which is what the rating is about.
"""

from __future__ import annotations

import json
import os
import tempfile
import threading
import time
import warnings
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import torch

from mixprec.dtypes import dtype_name

__all__ = [
    "CACHE_ENV",
    "CACHE_FILE",
    "DTYPES",
    "GemmRatios",
    "cache_path",
    "cached",
    "measure",
]

CACHE_ENV = "MIXPREC_CACHE_DIR"
CACHE_FILE = "gemm-ratios.json"
# the dtypes rated against float32
DTYPES: tuple[torch.dtype, ...] = (torch.bfloat16, torch.float16)
# one square size for every dtype: large enough that a float32 multiply is more than the
# call's overhead, small enough that a dtype emulated in software still takes milliseconds
SIZE = 128
# rounds are started until MAX_ROUNDS or, after MIN_ROUNDS, until BUDGET_S has passed
MIN_ROUNDS = 2
MAX_ROUNDS = 7
BUDGET_S = 0.4
# a dtype's turn in a round times single multiplies, at least MIN_CALLS and then until TURN_S
# has passed or MAX_CALLS were timed, and keeps the fastest: a multi-threaded multiply whose
# thread waited for a core another process held is not what the hardware does
MIN_CALLS = 3
MAX_CALLS = 64
TURN_S = 0.002
# entries kept in the cache file, newest last
KEEP = 16
# one measurement at a time in a process: two at once would compete for the cores they time,
# and each sets torch's thread count and restores it
_MEASURING = threading.Lock()


@dataclass(frozen=True)
class GemmRatios:
    """A measured GEMM speed of each 16-bit dtype against float32 on one CPU.

    `ratios` maps a dtype name to float32's best time over that dtype's best time (0.5: half
    float32's speed); `spread` maps each dtype measured (float32 too) to its slowest round
    over its fastest, which is large when other work shared the CPU."""

    ratios: dict[str, float]
    spread: dict[str, float]
    size: int
    rounds: int
    seconds: float
    measured_at: str

    def note(self) -> str:
        """How it was measured, for `mixprec info`."""
        spread = max(self.spread.values(), default=1.0)
        return (
            f"{self.size}x{self.size} GEMMs on one thread, best of {self.rounds} interleaved "
            "rounds in "
            f"{self.seconds:.2f} s (rounds within {spread:.2f}x), measured {self.measured_at}"
        )


def measure(dtypes: tuple[torch.dtype, ...] = DTYPES) -> GemmRatios:
    """Time `SIZE`-square GEMMs in float32 and each of `dtypes` on one CPU thread and return
    each dtype's speed against float32.

    The global RNG, autocast, autograd and torch's thread count are left as they were: the
    operands come from a generator of their own, and the multiplies run with autocast off and
    without gradients."""
    with _MEASURING:
        threads = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            return _measure(dtypes)
        finally:
            torch.set_num_threads(threads)


def _measure(dtypes: tuple[torch.dtype, ...]) -> GemmRatios:
    start = time.perf_counter()
    generator = torch.Generator().manual_seed(0)
    a32 = torch.randn(SIZE, SIZE, generator=generator)
    b32 = torch.randn(SIZE, SIZE, generator=generator)
    names = ["float32", *(dtype_name(d) for d in dtypes if d != torch.float32)]
    with torch.no_grad(), torch.autocast("cpu", enabled=False):
        operands = {
            name: (a32.to(getattr(torch, name)), b32.to(getattr(torch, name))) for name in names
        }
        for a, b in operands.values():
            a @ b  # warm-up: kernel selection, first-touch allocation
        best: dict[str, list[float]] = {name: [] for name in names}
        rounds = 0
        while rounds < MAX_ROUNDS and (
            rounds < MIN_ROUNDS or time.perf_counter() - start < BUDGET_S
        ):
            for name, (a, b) in operands.items():
                times: list[float] = []
                turn = time.perf_counter()
                while len(times) < MIN_CALLS or (
                    len(times) < MAX_CALLS and time.perf_counter() - turn < TURN_S
                ):
                    t0 = time.perf_counter()
                    a @ b
                    times.append(time.perf_counter() - t0)
                best[name].append(min(times))
            rounds += 1
    return GemmRatios(
        ratios={name: min(best["float32"]) / min(best[name]) for name in names[1:]},
        spread={name: max(times) / min(times) for name, times in best.items()},
        size=SIZE,
        rounds=rounds,
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
    try:
        found = GemmRatios(**entry["measured"])
    except (KeyError, TypeError):
        return None
    ratios = found.ratios if isinstance(found.ratios, dict) else {}
    names = {dtype_name(d) for d in DTYPES}
    valid = set(ratios) == names and all(
        isinstance(v, float | int) and v > 0 for v in ratios.values()
    )
    return found if valid else None


def _write(path: Path, entries: list[dict[str, Any]]) -> None:
    """Replace the cache file in one step: a reader sees the old file or the new one."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as f:
            json.dump({"entries": entries[-KEEP:]}, f, indent=1)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def cached(key: Mapping[str, Any], refresh: bool = False) -> GemmRatios:
    """The ratios measured for `key` (what decides them: CPU model and flags, ISA cap, torch
    version), from the cache file, or measured now and stored there when the file has
    none for `key` or `refresh` asks. A cache that cannot be written is warned about, and the
    measurement is then only the caller's."""
    key = dict(key)
    path = cache_path()
    entries = _entries(path)
    if not refresh:
        for entry in entries:
            if entry.get("key") == key and (found := _from_entry(entry)) is not None:
                return found
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
    return found
