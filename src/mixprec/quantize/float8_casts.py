"""The memory-bound half of a float8 cast, fused: ``max|x|`` and the saturating scaled cast.

Run op by op in eager mode, a float8 cast is several kernels that each read or write the
whole tensor (the abs-max, the upcast, the multiply, the clamp, the NaN handling, the cast).
Under ``torch.compile`` the same math is two passes: one reduction for the abs-max and one
kernel that reads the tensor and writes one byte per element. torchao's float8 training
gets its speed from that compile (its eager casts are op by op; a prototype of it writes
the casts as hand-made Triton kernels instead); here the two functions are compiled on
their own, so an eager model gets the fused kernels too:

- `abs_max` and `saturated_cast` are torch.compile'd on first use on a device named by
  `set_compiled_casts` (CUDA by default), with symbolic shapes, so a model's many layer
  shapes share one compiled graph per input dtype instead of recompiling per shape;
- they run as plain torch ops elsewhere, and also inside a ``torch.compile`` trace (which
  fuses them with their neighbours itself), on tensor subclasses, under a dispatch mode,
  while a CUDA graph is being captured, when the input wants a gradient, on a GPU whose
  Triton cannot write float8 (compute capability under 8.9: A100, T4, RTX 30xx), and where
  this torch cannot compile (a one-time warning says each of the last two).

Both forms are the same Python function and use only ops whose result does not depend on
how a kernel computes them: a max in any order, a float32 multiply, clamp, adding a zero,
replacing NaNs, dtype casts. The scales (a division, a log2 for power-of-2 scales) are
computed by the caller on the tiny amax tensors, in eager torch: Triton's float32 division
and log2 are approximations unless asked otherwise, which would move a scale by an ulp. So
a compiled cast equals the eager one bit for bit (tests compare both on a CPU, and on a GPU
when there is one).
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import Tensor
from torch.utils._python_dispatch import _get_current_dispatch_mode

__all__ = [
    "TRITON_FLOAT8_FROM",
    "set_compiled_casts",
    "triton_writes_float8",
]

_devices: tuple[str, ...] = ("cuda",)
_compiled: dict[Callable[..., Tensor], Callable[..., Tensor]] = {}
_unavailable: dict[str, str] = {}  # device type -> why torch cannot compile for it here


def compiled_cast_devices() -> tuple[str, ...]:
    """The device types whose float8 casts run compiled (``("cuda",)`` unless changed)."""
    return _devices


def set_compiled_casts(devices: Iterable[str]) -> tuple[str, ...]:
    """Compile the float8 casts on these device types (``()``: nowhere, every cast op by
    op); returns the previous setting. The numerics are the same either way.

    >>> previous = set_compiled_casts(())
    >>> set_compiled_casts(previous)
    ()
    """
    global _devices
    if isinstance(devices, str):
        raise TypeError(
            f"devices must be a collection of device types, e.g. ('cuda',), got {devices!r}"
        )
    chosen = tuple(devices)
    for device in chosen:
        if not isinstance(device, str) or device not in ("cpu", "cuda", "xpu", "mps"):
            raise ValueError(
                f"unknown device type {device!r} for compiled float8 casts; accepted: "
                "'cpu', 'cuda', 'xpu', 'mps'"
            )
    previous, _devices = _devices, chosen
    return previous


def _why_not_compiled(device: str) -> str | None:
    """Why this torch cannot compile for `device` (None: it can), found once per type."""
    if device not in _unavailable:
        import torch._dynamo  # what torch.compile loads anyway
        import torch.utils._triton

        reason = ""
        if not torch._dynamo.is_dynamo_supported():
            reason = "torch.compile is not supported by this Python or platform"
        elif device in ("cuda", "xpu") and not torch.utils._triton.has_triton():
            reason = f"torch.compile needs Triton for {device} and it is not installed"
        _unavailable[device] = reason
        if reason:
            warnings.warn(
                f"float8 casts on {device} run op by op ({reason}): the same numbers, slower",
                RuntimeWarning,
                stacklevel=4,
            )
    return _unavailable[device] or None


_PLAIN = (Tensor, torch.nn.Parameter)  # not subclasses with their own dispatch (DTensor, fakes)


def _wants_compiled(x: Tensor, *others: Tensor) -> bool:
    """Whether this call runs the compiled kernel (see the module docstring for when not)."""
    device = x.device.type
    if device not in _devices or torch.compiler.is_compiling():
        return False
    if any(type(t) not in _PLAIN for t in (x, *others)):
        return False
    if x.requires_grad and torch.is_grad_enabled():
        return False
    if _get_current_dispatch_mode() is not None:
        return False
    if device == "cuda" and torch.cuda.is_current_stream_capturing():
        return False
    if device == "cuda" and not _cuda_writes_float8(x.device):
        return False
    return _why_not_compiled(device) is None


# the lowest compute capability whose Triton kernels write e4m3 (Ada, Hopper): on an A100,
# T4 or RTX 30xx a compiled cast failed to build ("fp8e4nv not supported in this
# architecture") at the first float8 forward
TRITON_FLOAT8_FROM = (8, 9)
_cuda_float8: dict[int, bool] = {}


def triton_writes_float8(capability: tuple[int, int]) -> bool:
    """Whether Triton's kernels write float8 e4m3 on a GPU of `capability`."""
    return tuple(capability) >= TRITON_FLOAT8_FROM


def _cuda_writes_float8(device: torch.device) -> bool:
    """`triton_writes_float8` of `device`'s GPU, asked once per GPU; warned once where not
    (the casts then run op by op: the same numbers, slower)."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _cuda_float8:
        capability = torch.cuda.get_device_capability(index)
        _cuda_float8[index] = triton_writes_float8(capability)
        if not _cuda_float8[index]:
            warnings.warn(
                f"float8 casts on cuda:{index} (compute capability {capability[0]}."
                f"{capability[1]}) run op by op: Triton writes float8 from "
                f"{TRITON_FLOAT8_FROM[0]}.{TRITON_FLOAT8_FROM[1]} on; the same numbers, slower",
                RuntimeWarning,
                stacklevel=4,
            )
    return _cuda_float8[index]


def _run(fn: Callable[..., Tensor], x: Tensor, *args: Any) -> Tensor:
    """`fn(x, *args)`, compiled where `_wants_compiled` says so."""
    tensors = [a for a in args if isinstance(a, Tensor)]
    if not _wants_compiled(x, *tensors):
        return fn(x, *args)
    compiled = _compiled.get(fn)
    if compiled is None:
        compiled = _compiled[fn] = torch.compile(fn, dynamic=True)
    with torch.no_grad():  # one grad mode, so that no graph is compiled twice for it
        return compiled(x.detach(), *args)  # a plain tensor for a parameter too


# Each compiled function keeps its own graphs (dynamo caches them per code object, up to its
# recompile limit, past which it runs the function op by op), so the variants a model uses
# are separate functions, each compiled for at most a few input dtypes and layouts.


def _canonical_nan(amax: Tensor) -> Tensor:
    """`amax` with any NaN made the one quiet NaN (a max reduction's NaN payload and sign
    vary with how it is computed, and a scale, then every fp8 code scaled by it, carry them
    on); an amax is never negative, so +inf stays inf."""
    return torch.nan_to_num(amax, nan=math.nan, posinf=math.inf)


def _abs_max_whole(x: Tensor) -> Tensor:
    if x.dtype == torch.float64:  # (the max is exact in float64; narrowed after)
        return _canonical_nan(torch.linalg.vector_norm(x, math.inf).float())
    return _canonical_nan(torch.linalg.vector_norm(x, math.inf, dtype=torch.float32))


def _abs_max_along(x: Tensor, dim: int) -> Tensor:
    if x.dtype == torch.float64:
        amax = torch.linalg.vector_norm(x, math.inf, dim=dim, keepdim=True).float()
    else:
        amax = torch.linalg.vector_norm(x, math.inf, dim=dim, keepdim=True, dtype=torch.float32)
    return _canonical_nan(amax)


def abs_max(x: Tensor, dim: int | None = None) -> Tensor:
    """``max|x|`` in float32 over the whole tensor (0-dim) or along `dim` (kept as a size-1
    dim): NaN where x holds one, inf where an inf; 0 where there is nothing to reduce (an
    empty batch), as for an all-zero tensor. Never part of an autograd graph."""
    x = x.detach()
    if x.numel() == 0:  # a max has no identity to reduce an empty tensor to
        shape = list(x.shape)
        if dim is not None:
            shape[dim] = 1
        return x.new_zeros(() if dim is None else shape, dtype=torch.float32)
    if dim is None:
        return _run(_abs_max_whole, x)
    return _run(_abs_max_along, x, dim % x.dim())  # one graph for dim=-1 and dim=1


def _saturated(x: Tensor, scale: Tensor, fp8_dtype: torch.dtype) -> Tensor:
    limit = torch.finfo(fp8_dtype).max
    scaled = (x.float() * scale).clamp(-limit, limit)
    # each inf of x made NaN by a select (inductor folds ``x * 0`` to 0, so the arithmetic
    # way gives an inf the finite limit once compiled); a NaN of x is NaN already, and
    # nan_to_num makes every NaN the one quiet NaN (how a clamp passes a NaN on, payload and
    # sign, varies with the kernel, and a NaN's sign survives into the fp8 code)
    scaled = scaled.masked_fill(x.isinf(), math.nan)
    return torch.nan_to_num(scaled, nan=math.nan).to(fp8_dtype)


# one compiled function per fp8 format and scale layout the recipes use (tensorwise e4m3 and
# e5m2, per-row or per-column e4m3); another combination runs op by op
def _e4m3_by_tensor(x: Tensor, scale: Tensor) -> Tensor:
    return _saturated(x, scale, torch.float8_e4m3fn)


def _e5m2_by_tensor(x: Tensor, scale: Tensor) -> Tensor:
    return _saturated(x, scale, torch.float8_e5m2)


def _e4m3_by_axis(x: Tensor, scale: Tensor) -> Tensor:
    return _saturated(x, scale, torch.float8_e4m3fn)


_CASTS: dict[tuple[torch.dtype, bool], Callable[[Tensor, Tensor], Tensor]] = {
    (torch.float8_e4m3fn, True): _e4m3_by_tensor,
    (torch.float8_e5m2, True): _e5m2_by_tensor,
    (torch.float8_e4m3fn, False): _e4m3_by_axis,
}


def saturated_cast(x: Tensor, scale: Tensor, fp8_dtype: torch.dtype) -> Tensor:
    """``x * scale`` in float32, finite values saturated to the format's range, an inf or
    NaN of `x` made NaN, cast to `fp8_dtype`. `scale` is float32, 0-dim or broadcasting
    along one axis of a 2-D `x`."""
    fn = _CASTS.get((fp8_dtype, scale.dim() == 0))
    if fn is None:
        return _saturated(x, scale, fp8_dtype)
    return _run(fn, x, scale)
