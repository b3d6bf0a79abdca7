"""Tensor memory of a piece of work: the peak of its live tensor bytes, as the bench and the
Trainer measure it.

- CUDA: `torch.cuda.max_memory_allocated` after `reset_peak_memory_stats`, minus what was
  allocated when the work began;
- CPU: the peak of the running sum of the CPU allocator's allocation and free events that
  `torch.profiler` records (`profile_memory=True`) over the work. The first profile in a
  process starts the profiler's machinery (about a second or two). The profiler's own log
  lines (``USDT: ... profiler_start`` / ``profiler_stop``, written by torch's C++ side at each
  start and stop) are kept off the user's stderr; anything else written there meanwhile is
  passed on when the work ends.

Both count what the work allocates, never the tensors alive before it. They differ where
the work frees such a tensor: CUDA's count drops below its start by its bytes (a later
allocation of the same size nets to 0), the CPU's does not see that free (the profiler
records the frees of blocks it saw allocated), so there the later allocation counts whole.
The bench builds its models inside the work, which has no such tensors.
"""

from __future__ import annotations

import contextlib
import os
import sys
import tempfile
from collections.abc import Callable, Iterator
from typing import Any

import torch

__all__ = [
    "measured",
]


def cpu_tensor_peak(events: list[Any]) -> int:
    """Peak of the running sum of CPU allocation (+) and free (-) events, in bytes."""
    cpu = torch._C._autograd.DeviceType.CPU
    mem = sorted(
        (e.start_ns(), e.nbytes())
        for e in events
        if e.name() == "[memory]" and e.device_type() == cpu
    )
    live = peak = 0
    for _, nbytes in mem:
        live += nbytes
        peak = max(peak, live)
    return peak


def measured(device: torch.device, work: Callable[[], Any]) -> tuple[Any, int]:
    """Run `work` and return its result and the peak of the tensor bytes it allocated on
    `device` (see the module's docstring)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        base = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        out = work()
        torch.cuda.synchronize(device)
        return out, torch.cuda.max_memory_allocated(device) - base
    activities = [torch.profiler.ProfilerActivity.CPU]
    with _without_profiler_log():
        with torch.profiler.profile(activities=activities, profile_memory=True) as prof:
            out = work()
    return out, cpu_tensor_peak(prof.profiler.kineto_results.events())


# how torch's profiler starts the lines it logs to stderr at each start and stop
_PROFILER_LOG = b"USDT:"


@contextlib.contextmanager
def _without_profiler_log() -> Iterator[None]:
    """Hold what is written to the process's stderr (file descriptor 2, where torch's C++
    logs) in a temporary file, then write it back without the profiler's own lines."""
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile() as held:
        os.dup2(held.fileno(), 2)
        try:
            yield
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
            held.seek(0)
            kept = [line for line in held if not line.startswith(_PROFILER_LOG)]
            if kept:
                os.write(2, b"".join(kept))
