"""Dtype names, aliases and format facts (max, smallest normal, epsilon).

One place that knows how people spell dtypes ("f16", "half", "bfloat16", torch.float16)
and what each format can represent, so policies, the doctor and the bench agree.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass

import torch

from mixprec.errors import PolicySpecError

__all__ = [
    "DTYPE_NAMES",
    "FLOAT8_DTYPES",
    "FormatInfo",
    "LOW_PRECISION_FLOATS",
    "default_dtype",
    "dtype_name",
    "format_info",
    "is_float8",
    "needs_default_dtype",
    "to_dtype",
]

FLOAT8_DTYPES: tuple[torch.dtype, ...] = tuple(
    d
    for d in (
        getattr(torch, "float8_e4m3fn", None),
        getattr(torch, "float8_e5m2", None),
        getattr(torch, "float8_e4m3fnuz", None),
        getattr(torch, "float8_e5m2fnuz", None),
    )
    if d is not None
)

# Canonical name of each dtype a policy may use, and every spelling accepted for it.
_CANONICAL: dict[torch.dtype, str] = {
    torch.float64: "float64",
    torch.float32: "float32",
    torch.float16: "float16",
    torch.bfloat16: "bfloat16",
    **{d: str(d).removeprefix("torch.") for d in FLOAT8_DTYPES},
}
_ALIASES: dict[str, torch.dtype] = {
    "float64": torch.float64,
    "f64": torch.float64,
    "double": torch.float64,
    "float32": torch.float32,
    "f32": torch.float32,
    "float": torch.float32,
    "full": torch.float32,
    "float16": torch.float16,
    "f16": torch.float16,
    "half": torch.float16,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    **{name: d for d, name in _CANONICAL.items() if d in FLOAT8_DTYPES},
}
DTYPE_NAMES: tuple[str, ...] = tuple(_ALIASES)

LOW_PRECISION_FLOATS: tuple[torch.dtype, ...] = (torch.float16, torch.bfloat16, *FLOAT8_DTYPES)


def dtype_name(dtype: torch.dtype) -> str:
    """Canonical short name of a dtype ("float32", "bfloat16", ...)."""
    return _CANONICAL.get(dtype, str(dtype).removeprefix("torch."))


def to_dtype(value: str | torch.dtype) -> torch.dtype:
    """Parse a dtype spelled as a torch.dtype, "float32", "f32", "half", "bf16", ...

    Raises PolicySpecError naming the bad value and the accepted spellings.
    """
    if isinstance(value, torch.dtype):
        return value
    if isinstance(value, str):
        key = value.strip().lower().removeprefix("torch.")
        if key in _ALIASES:
            return _ALIASES[key]
        named = getattr(torch, key, None)
        if isinstance(named, torch.dtype):
            return named  # an integer or complex dtype: callers refuse it with the reason
    raise PolicySpecError(
        f"unknown dtype {value!r}; accepted: a torch.dtype or one of {', '.join(DTYPE_NAMES)}"
    )


def is_float8(dtype: torch.dtype) -> bool:
    """True for the float8 formats (e4m3, e5m2 and their fnuz variants)."""
    return dtype in FLOAT8_DTYPES


@dataclass(frozen=True)
class FormatInfo:
    """What a floating format can represent: used by the doctor and the scalers."""

    dtype: torch.dtype
    bits: int
    max: float
    smallest_normal: float
    smallest_subnormal: float
    eps: float

    @property
    def name(self) -> str:
        return dtype_name(self.dtype)


def format_info(dtype: torch.dtype | str) -> FormatInfo:
    """Range and resolution facts of a floating dtype (from torch.finfo)."""
    dtype = to_dtype(dtype)
    if not dtype.is_floating_point:
        raise PolicySpecError(f"{dtype} is not a floating dtype")
    fi = torch.finfo(dtype)
    # smallest subnormal = smallest normal * eps (one ulp below the normal range)
    return FormatInfo(
        dtype=dtype,
        bits=fi.bits,
        max=float(fi.max),
        smallest_normal=float(fi.smallest_normal),
        smallest_subnormal=float(fi.smallest_normal) * float(fi.eps),
        eps=float(fi.eps),
    )


# torch's default dtype is process-wide. A "true" forward that needs another default sets it
# for its duration under this lock, so forwards of "true" precisions in two threads take turns
# instead of seeing each other's default. A float32 forward outside any such block takes no
# lock (float32 and mixed models keep running in parallel), so while another thread's
# float64/16-bit "true" forward runs, it sees that forward's default.
_default_dtype_lock = threading.RLock()
_held = threading.local()  # .dtypes: the defaults this thread's open blocks set, innermost last


def needs_default_dtype(dtype: torch.dtype) -> bool:
    """Whether a forward computing in `dtype` must set torch's default dtype first."""
    mine = getattr(_held, "dtypes", None)
    if mine:
        return mine[-1] != dtype
    return dtype != torch.float32 or torch.get_default_dtype() != dtype


@contextmanager
def exclusive() -> Iterator[None]:
    """Hold the lock `default_dtype` takes: a forward that swaps a module's parameters
    for copies in its compute dtype (which every thread calling the module sees) runs while
    no other thread's such forward or default change does, so none reads another's swap
    (one thread's copies, restored by it mid-way through another's forward: a dtype
    mismatch). Not in a backward (`default_dtype`) or while torch.compile traces."""
    if torch.compiler.is_compiling() or torch._C._current_graph_task_id() != -1:
        yield
        return
    with _default_dtype_lock:
        yield


@contextmanager
def default_dtype(dtype: torch.dtype) -> Iterator[None]:
    """Make `dtype` torch's default dtype inside the block (restored on exit, also on error),
    so tensors a forward creates without a dtype (`torch.ones(n, 3)`) match its weights.
    Inside a backward (a forward recomputed there) the lock is not taken: CUDA's autograd
    runs the backward on a thread of its own while the thread that called ``backward`` holds
    it (`Precision.backward_context`), and it would never come free."""
    in_backward = torch._C._current_graph_task_id() != -1
    with nullcontext() if in_backward else _default_dtype_lock:
        mine = _held.__dict__.setdefault("dtypes", [])
        before = torch.get_default_dtype()
        torch.set_default_dtype(dtype)
        mine.append(dtype)
        try:
            yield
        finally:
            mine.pop()
            torch.set_default_dtype(before)
