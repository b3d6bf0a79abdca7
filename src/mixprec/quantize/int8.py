"""int8 weights with dynamic int8 activations (W8A8), as Keras's int8 mode.

Weights: one scale per output channel (per row), abs-max, ``q = round(w / scale)`` in
[-127, 127] with ``scale = max|w_row| / 127``; Keras stores the reciprocal ``127 / max|w|``,
the values are the same. Activations: one scale per token (row of the flattened input),
computed from the tensor at run time. The matmul runs on int8 x int8 -> int32 and the int32
sums are dequantized as ``float32(sums) * weight_scale * token_scale``, each product rounded
to float32 in that order (so oneDNN applies the weight scales inside its call, and every
path rounds alike); a reduction longer than `ACC_MAX_K` (133144 features), whose int32 sums
could overflow, runs in chunks added in int64.

The integer sums are exact on every path, so every path gives the same outputs bit for bit;
`Int8Linear.kernel` names the one a layer takes. On a CPU whose oneDNN int8 kernel gives
exact sums (with VNNI; asked of the kernel once per process, `cpu_int8_kernels`), a Linear
multiplies by its weight prepacked once for oneDNN with its scales
(``torch.ops.onednn.qlinear_pointwise``, the int8 linear of torch's x86 Inductor
quantization: brgemm with VNNI, the weight reordered once, no reorder per call, float32 out,
the weight scales applied in its epilogue; activation codes shifted to unsigned with zero
point 128). Elsewhere `torch._int_mm` where its sums are exact and it is fast (CUDA; CPUs
with VNNI), else (`float_sums`) a float32 matmul of the codes in chunks short enough for
every partial sum to be an exact float32 integer (float64 off the CPU): without VNNI
torch._int_mm's exact sums run a reference loop, many times slower than float32.
Without VNNI oneDNN's int8 kernels saturate 16-bit partial sums (a row of 127s times 127s
summed to 8160 instead of 1032256 under ``ONEDNN_MAX_CPU_ISA=AVX2``), and `torch._int_mm` on
CPU returned garbage for a reduction of one feature: neither is used where it is wrong.

A forward is a dozen tensor calls (codes by a rounding addition, `_codes`, the product, the
scales, the bias); docs/quantized.md compares it with torch.ao's dynamic int8 Linear.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any, NamedTuple, TypeVar

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from mixprec.errors import PolicySpecError
from mixprec.formats.registry import Format, Status, Support
from mixprec.policy.names import accepted_quantized
from mixprec.quantize.lora import LoraEmbeddingMixin, LoraMixin
from mixprec.quantize.rules import rows_and_features, swapped_in

if TYPE_CHECKING:
    from mixprec.device import DeviceInfo

__all__ = [
    "CODE_BUFFERS",
    "CodeCasts",
    "Int8Embedding",
    "Int8Linear",
    "ScaledCodes",
]

QMAX = 127
T = TypeVar("T")


def check_finite(w: Tensor, name: str) -> None:
    """Raise ValueError if the weight `w` holds an inf or NaN: quantizing would turn it into
    finite codes, hiding it for good.
    A meta tensor has no values to check (its layout can be quantized, then loaded)."""
    if w.is_meta:
        return
    bad = ~torch.isfinite(w.detach())
    what = "inf/NaN"
    if w.dtype == torch.float64:  # (quantized through float32, where these are infinite)
        bad |= w.detach().abs() > torch.finfo(torch.float32).max
        what = "inf/NaN or past float32's range"
    if bad.any():
        rows = bad.reshape(bad.shape[0], -1).any(dim=-1).nonzero().flatten().tolist()
        shown = ", ".join(map(str, rows[:5])) + (", ..." if len(rows) > 5 else "")
        raise ValueError(
            f"cannot quantize {name}: it holds {int(bad.sum())} value(s) {what}, in rows "
            f"{shown}. Quantized codes are finite, so they would silently stand for a "
            "broken weight; quantize finite weights (a diverged or corrupt checkpoint?)"
        )


_SMALLEST_SUBNORMAL = 2.0**-149


class ScaleRangeError(ValueError):
    """Scales a dtype cannot store (`storable_scale`); `detail` says which and why, for a
    caller that words the remedy (a cast, `apply`'s pre-checks)."""

    def __init__(self, message: str, detail: str) -> None:
        super().__init__(message)
        self.detail = detail


def storable_scale(scale: Tensor, dtype: torch.dtype, name: str, largest: int | Tensor) -> Tensor:
    """The float32 `scale` rounded up to a value `dtype` holds exactly (unchanged for float32
    and float64), so codes computed with it are the codes of the scale the layer stores.

    Scales are stored in the weight's dtype. Rounded to nearest, a float16 scale below 3e-8
    would become 0 (a row of tiny weights would come back as zeros) and a bfloat16 one could
    land below the row's ``max|w| / 127``, pushing its largest codes past 127; rounded up,
    codes stay in range and within half a stored step of the weight. A scale whose product
    with the `largest` code magnitude is beyond `dtype`'s range is refused, naming the
    weight `name` (a float16 row holding 65504: rounded up, 127 times its scale is inf);
    `largest` may be a tensor of each scale's own (int4's codes reach as far from their zero
    point as the group's weights reach from 0)."""
    if torch.finfo(dtype).bits >= 32:
        return scale
    stored = scale.to(dtype)
    up = torch.nextafter(stored, torch.full_like(stored, torch.inf))
    stored = torch.where(stored.float() < scale, up, stored)
    if isinstance(largest, Tensor):  # (multiplied in `dtype`, as a stored scale is used)
        largest = largest.to(dtype)
    if not scale.is_meta and torch.isinf(stored * largest).any():
        reach = int(largest.max()) if isinstance(largest, Tensor) else largest
        detail = (
            f"its largest scale {scale.max().item():.3g} times its largest code ({reach}) "
            f"exceeds {dtype}'s range"
        )
        raise ScaleRangeError(
            f"cannot quantize {name}: {detail}; quantize it with scales in float32 or bfloat16",
            detail,
        )
    return stored.float()


# 1.5 * 2**23. Added to a float32 below 2**22 in magnitude, the sum, between 2**23 and 2**24
# where float32 steps by 1, is rounded to an integer as torch.round does (to nearest, ties to
# even: the constant is even), and that integer's low byte is the low byte of the sum's bits.
_ROUNDER = 12582912.0


def _codes(x: Tensor, scale: Tensor, zero_point: int = 0, out: Tensor | None = None) -> Tensor:
    """``round(x / scale)`` clamped to [-127, 127], as int8, or plus `zero_point` (128) as
    uint8; 0 where ``x / scale`` is NaN. `out` (float32, x's shape) may take the quotient.

    No float-to-int conversion and no rounding pass: ``x / scale + _ROUNDER + zero_point`` is
    rounded to an integer by the addition (as ``torch.round`` rounds), clamped, and its low
    byte, read off its int32 bits, is the code plus `zero_point` (two's complement for int8):
    the codes of rounding, clamping and converting, in fewer passes over the activations."""
    offset = _ROUNDER + zero_point
    q = torch.div(x, scale, out=out).add_(offset).clamp_(offset - QMAX, offset + QMAX)
    q = q.nan_to_num_(offset)
    return q.view(torch.int32).to(torch.uint8 if zero_point else torch.int8)


def _quantize_rows(
    x: Tensor, dtype: torch.dtype = torch.float32, name: str = "the tensor", smallest: float = 0.0
) -> tuple[Tensor, Tensor]:
    """Symmetric per-row int8 of a 2-D tensor: int8 codes and scales [rows] as float32
    holding values `dtype` holds exactly (see `storable_scale`); an all-zero row gets scale 1.
    A row holding an inf or NaN gets codes 0 and scale NaN, so whatever is computed from it
    comes out NaN. (A forward takes `_quantize_tokens`: fewer tensor calls, the same codes.)"""
    if x.requires_grad:
        x = x.detach()
    if x.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        x = x.to(torch.float32)  # float64: codes of its float32 values, as before
    # max |x| per row, in x's own dtype (exact); NaN or inf for a non-finite row
    amax = x.abs().amax(dim=-1, keepdim=True).to(torch.float32)
    scale = torch.where(amax > 0, (amax / QMAX).clamp_min(smallest), 1.0)
    scale = torch.where(torch.isfinite(amax), scale, torch.nan)
    scale = storable_scale(scale, dtype, name, QMAX)
    return _codes(x, scale), scale.squeeze(-1)


def _quantize_tokens(x: Tensor, zero_point: int = 0) -> tuple[Tensor, Tensor]:
    """The codes of `quantize_tokens` for a 2-D `x` (plus `zero_point`, see `_codes`) and the
    scales [rows, 1] to multiply the sums by, in the fewest tensor calls (a forward pays each
    call's cost): ``max|x| / 127`` as is, so 0 for an all-zero row (its codes are 0 and so its
    sums: the product is 0 as with scale 1) and inf for a row holding an inf (its codes are 0:
    the product 0 * inf is NaN, as with scale NaN). Every row holding a NaN divides to NaN and
    gets codes 0. For a float32 `x` the quotient reuses the buffer of ``|x|``."""
    if x.requires_grad:
        x = x.detach()
    if x.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        x = x.to(torch.float32)  # float64: codes of its float32 values, as before
    absx = x.abs()
    amax = absx.amax(dim=-1, keepdim=True)
    if x.dtype == torch.float32:
        return _codes(x, amax.div_(QMAX), zero_point, out=absx), amax
    scale = amax.to(torch.float32).div_(QMAX)
    return _codes(x, scale, zero_point), scale


def quantize_rows(
    w: Tensor, name: str = "the weight", dtype: torch.dtype | None = None
) -> tuple[Tensor, Tensor]:
    """Symmetric per-row int8 of a weight: ``(q, scale)`` with ``w ~= q * scale[:, None]``,
    ``q`` in [-127, 127] and ``|w - q * scale| <= scale / 2``; an all-zero row gets scale 1.
    `scale` is float32 holding values of `dtype` (the scales' storage dtype, by default
    `w`'s). A weight holding inf or NaN is refused (`check_finite`; `name` says which in the
    error)."""
    check_finite(w, name)
    # contiguous codes: the kernels prepack them from memory (a transposed weight's codes
    # read as rows gave other sums)
    # (scales at least float32's smallest subnormal: a row of weights under 127 times it
    # would take scale 0 and come back as zeros)
    return _quantize_rows(
        w.contiguous(), w.dtype if dtype is None else dtype, name, _SMALLEST_SUBNORMAL
    )


def check_sums_fit(scale: Tensor, features: int, name: str) -> None:
    """Refuse an int8 Linear's weight scales whose product with the largest sum of
    `features` code products (127 x 127 each) is past float32: a forward multiplies the sums
    by the weight's scale before the input's (the order every kernel path shares), so such a
    layer's outputs could be inf where the true ones are finite (weights above about 6e32 at
    4096 features). An Embedding's lookups sum nothing: it takes any finite weight."""
    if scale.is_meta or not scale.numel():
        return
    largest = float(scale.max()) * QMAX * QMAX * features
    if largest > torch.finfo(torch.float32).max:
        detail = (
            f"its largest scale {float(scale.max()):.3g} times a sum of {features} products of "
            f"codes (up to {QMAX * QMAX} each) exceeds float32's range"
        )
        raise ScaleRangeError(
            f"cannot quantize {name} to int8: {detail}, so its outputs could overflow to inf; "
            "scale the layer's weights down (and its input up) or keep it in floating point",
            detail,
        )


# The longest reduction whose int32 sums cannot overflow: each product of two codes is at
# most 127 * 127 in magnitude, so 133144 of them stay within 2**31 - 1.
ACC_MAX_K = (2**31 - 1) // (QMAX * QMAX)


# Below this many features a float matmul of the codes costs nothing, and `torch._int_mm` on
# CPU (torch 2.13, oneDNN 3.12) returned wrong sums for a reduction of one feature.
INT_MM_MIN_K = 16
# The longest reduction the oneDNN path takes: its unsigned activation codes (up to 255) times
# the int8 weights are summed in int32 before the zero point's share comes off.
ONEDNN_MAX_K = (2**31 - 1) // (255 * QMAX)


def _probe_operands() -> list[tuple[Tensor, Tensor]]:
    """int8 operands whose exact products a kernel must give: full-range codes (summing pairs
    of u8 x s8 products in 16 bits saturates on them), a single token, random codes."""
    g = torch.Generator().manual_seed(0)
    full = torch.full((3, 64), QMAX, dtype=torch.int8)
    full[1] = -QMAX
    signs = torch.full((16, 64), QMAX, dtype=torch.int8)
    signs[1::2] = -QMAX
    cases = [(full, signs)]
    for m, k, n in ((1, 16, 8), (5, 200, 24), (33, 136, 40)):
        a = torch.randint(-QMAX, QMAX + 1, (m, k), generator=g, dtype=torch.int8)
        b = torch.randint(-QMAX, QMAX + 1, (n, k), generator=g, dtype=torch.int8)
        cases.append((a, b))
    return cases


def wrong_sums(product: Callable[[Tensor, Tensor], Tensor]) -> str | None:
    """None if ``product(a, b)`` equals ``a @ b.T`` on every probe operand, else what went
    wrong: the first case it got wrong, or the error it raised."""
    for a, b in _probe_operands():
        want = (a.long() @ b.long().t()).double()
        try:
            got = product(a, b).double()
        except RuntimeError as err:
            return f"it raised {type(err).__name__}: {str(err).splitlines()[0]}"
        if not torch.equal(got, want):
            off = (got - want).abs().max().item()
            return (
                f"wrong sums for {tuple(a.shape)} x {tuple(b.shape)} int8 codes (off by {off:.0f})"
            )
    return None


class OnednnWeight(NamedTuple):
    """An int8 weight prepacked for oneDNN's int8 linear, with the float32 scales its sums
    are multiplied by inside the call (its epilogue) and the zero points the call takes."""

    packed: Tensor
    scales: Tensor
    zeros: Tensor


def onednn_prepack(qweight: Tensor, weight_scale: Tensor | None = None) -> OnednnWeight:
    """`qweight` [N, K] (int8) prepacked for `onednn_product`, with its scales [N] (ones when
    None: the plain sums)."""
    n = qweight.shape[0]
    if weight_scale is None:
        scales = torch.ones(n, dtype=torch.float32, device=qweight.device)  # not the default
    else:
        scales = weight_scale.to(torch.float32).contiguous()
    return OnednnWeight(
        torch.ops.onednn.qlinear_prepack(qweight.contiguous(), None),
        scales,
        torch.zeros(n, dtype=torch.int32, device=qweight.device),
    )


def onednn_product(ux: Tensor, weight: OnednnWeight) -> Tensor:
    """``(qx @ qweight.T) * scales`` as float32 (the exact int32 sums converted as
    ``.to(float32)`` does, times each output channel's scale, rounded once, as
    ``torch.mul(sums, scales)``) for the unsigned codes ``ux = qx + 128`` [M, K] (uint8) of
    int8 codes `qx` and ``weight = onednn_prepack(qweight, scales)``: oneDNN's fast int8
    kernels take u8 activations (s8 ones run a reference loop, orders of magnitude slower),
    so the call takes them with zero point 128."""
    if ux.dtype != torch.uint8:
        raise ValueError(f"onednn_product takes the codes plus 128 as uint8, got {ux.dtype}")
    return torch.ops.onednn.qlinear_pointwise(
        ux, 1.0, 128, weight.packed, weight.scales, weight.zeros, None, 1.0, 0,
        torch.float32, "none", [], "",
    )  # fmt: skip


_cpu_int8_kernels: dict[str, str | None] = {}


def cpu_int8_kernels() -> dict[str, str | None]:
    """Which CPU int8 kernels give exact sums in this process: ``{"onednn": why not or None,
    "int_mm": why not or None}``, found once by running each on `_probe_operands`.

    Asked of the kernels, not of CPU flags: oneDNN picks its code from the ISA it sees
    (capped by ``ONEDNN_MAX_CPU_ISA``), and without VNNI its int8 sums saturate."""
    if not _cpu_int8_kernels:
        found: dict[str, str | None] = {}
        with torch.device("cpu"), torch.inference_mode():  # whatever default device is set
            if not torch.backends.mkldnn.is_available():
                found["onednn"] = "this torch is built without oneDNN"
            else:
                found["onednn"] = wrong_sums(
                    lambda a, b: onednn_product(a.view(torch.uint8) ^ 0x80, onednn_prepack(b))
                )
            found["int_mm"] = wrong_sums(lambda a, b: torch._int_mm(a, b.t()))
        _cpu_int8_kernels.update(found)
    return _cpu_int8_kernels


def _takes_int_mm(device: torch.device, m: int, k: int, n: int) -> bool:
    """Whether an [m, k] x [k, n] product of int8 codes runs through `torch._int_mm` here.

    On a CPU only where its sums are exact and oneDNN's int8 sums are too (VNNI): without
    VNNI, exact or not, it runs a reference loop many times float32's time, where
    `float_sums` takes about float32's."""
    if device.type == "cpu":
        if torch.compiler.is_compiling() and not _cpu_int8_kernels:
            return False  # not probed yet, and a traced graph cannot run the probes
        found = cpu_int8_kernels()
        return k >= INT_MM_MIN_K and found["int_mm"] is None and found["onednn"] is None
    return device.type == "cuda" and m > 16 and k % 8 == 0 and n % 8 == 0


# The longest reduction a float32 matmul of int8 codes sums exactly: every partial sum is an
# integer of magnitude at most 127 * 127 * K, exact in float32 while at most 2**24, whatever the
# order and blocking of the sums (1040 features).
F32_EXACT_K = 2**24 // (QMAX * QMAX)


# The float32 copy of a tile of weight codes `float_sums` makes at a time: small enough to stay
# in cache, unlike larger tiles, and unlike converting the whole weight at once, which
# allocates a fresh float32 copy of it on every call, its pages faulted in each time
# (docs/quantized.md has the measurements).
FLOAT_TILE_BYTES = 2 << 20


def float_sums(a: Tensor, b: Tensor) -> Tensor:
    """``a @ b.T`` for int8 codes ``a`` [M, K] and ``b`` [N, K], exactly, as floats: on a
    CPU float32 matmuls of the codes (integer kernels without VNNI saturate or run reference
    loops), over tiles of `b`'s rows whose float32 copy is at most `FLOAT_TILE_BYTES`, each
    in chunks of at most `F32_EXACT_K` features so every partial sum is exact; one chunk
    gives float32, several float64 (their sum, exact). Other devices: a float64 matmul.
    Converted to float32, a sum rounds as the int32 sum's ``.to(float32)`` does. Autocast
    is off inside: a bfloat16 matmul of the codes would round the sums."""
    with torch.autocast(a.device.type, enabled=False):
        return _float_sums(a, b)


def _float_sums(a: Tensor, b: Tensor) -> Tensor:
    if a.device.type != "cpu":
        return a.double() @ b.double().t()
    (m, k), n = a.shape, b.shape[0]
    chunk = min(k, F32_EXACT_K)
    rows = max(64, FLOAT_TILE_BYTES // (4 * chunk))
    af = a.float()
    if k <= F32_EXACT_K and rows >= n:
        return af @ b.float().t()
    out = torch.empty(m, n, dtype=torch.float32 if k <= F32_EXACT_K else torch.float64)
    for top in range(0, n, rows):
        tile = b[top : top + rows]
        acc = None
        for start in range(0, k, chunk):
            part = af[:, start : start + chunk] @ tile[:, start : start + chunk].float().t()
            acc = part if k <= F32_EXACT_K else part.double() if acc is None else acc.add_(part)
        out[:, top : top + rows] = acc
    return out


_FLOAT_PATH = f"float32 matmul of the int8 codes (exact: chunks of {F32_EXACT_K} features)"


def int_matmul(a: Tensor, b: Tensor, *, max_k: int = ACC_MAX_K) -> Tensor:
    """``a @ b.T`` for int8 ``a`` [M, K] and ``b`` [N, K] (codes in [-127, 127]), exactly.

    `torch._int_mm` where it is exact and fast (CPU: where `cpu_int8_kernels` finds its and
    oneDNN's sums exact, from `INT_MM_MIN_K` features; CUDA: M > 16, K and N multiples of 8);
    elsewhere the same sums from `float_sums`.
    The result is int32 [M, N] when ``K <= max_k``; a longer reduction would overflow the
    int32 accumulator (Linear(140000, n) at full scale summed to a negative number), so it is
    cut into chunks of at most `max_k` columns whose int32 sums are added in int64, and the
    result is int64. `max_k` is for tests.
    """
    m, k = a.shape
    n = b.shape[0]
    if k > max_k:
        acc = torch.zeros(m, n, dtype=torch.int64, device=a.device)
        for ac, bc in zip(a.split(max_k, dim=1), b.split(max_k, dim=1), strict=True):
            acc += int_matmul(ac, bc, max_k=max_k)
        return acc
    if _takes_int_mm(a.device, m, k, n):
        return torch._int_mm(a, b.t())
    return float_sums(a, b).to(torch.int32)


def quantize_tokens(x: Tensor) -> tuple[Tensor, Tensor]:
    """Per-token (per-row of ``x`` flattened to 2-D) int8 quantization of activations; a token
    holding an inf or NaN gets scale NaN, so its output row is NaN (as a float Linear's would
    be non-finite), where loss scalers and NaN checks see it."""
    return _quantize_rows(x.reshape(-1, x.shape[-1]))


def _version(t: Tensor) -> int:
    """`t`'s in-place change counter; an inference tensor keeps none (0)."""
    return 0 if t.is_inference() else t._version


class Prepacked:
    """Mixin for a quantized layer that keeps a kernel's prepacked copy of its buffers: made
    on first use, made again once any of them is replaced (`requantize`, ``.to()``,
    ``load_state_dict(..., assign=True)``) or changed in place (``load_state_dict`` copies
    into them: their version counters move; loading also drops the copy, for inference
    tensors, which count no versions). Never saved, copied or pickled: ``state_dict``,
    ``deepcopy`` and checkpoints hold only the canonical buffers."""

    def prepacked(self, sources: tuple[Tensor, ...], build: Callable[[], T]) -> T:
        """``build()``, made once per state of the `sources` buffers."""
        entry = self.__dict__.get("_prepacked_entry")
        if entry is not None:
            refs, versions, built = entry
            for ref, version, t in zip(refs, versions, sources, strict=True):
                if ref() is not t or version != _version(t):
                    break
            else:  # a forward's fixed cost: a plain loop, no generators
                return built
        entry = (
            tuple(weakref.ref(t) for t in sources),
            tuple(_version(t) for t in sources),
            build(),
        )
        self.__dict__["_prepacked_entry"] = entry
        return entry[2]

    def drop_prepacked(self) -> None:
        """Forget the prepacked copy (the buffers are about to change or move)."""
        self.__dict__.pop("_prepacked_entry", None)

    def __getstate__(self) -> dict[str, Any]:
        state = super().__getstate__()  # type: ignore[misc]
        state.pop("_prepacked_entry", None)
        return state

    def _apply(self, *args: Any, **kwargs: Any) -> Any:
        self.drop_prepacked()  # the old device's copy would linger until the next forward
        return super()._apply(*args, **kwargs)  # type: ignore[misc]

    def _load_from_state_dict(self, *args: Any, **kwargs: Any) -> None:
        self.drop_prepacked()
        super()._load_from_state_dict(*args, **kwargs)  # type: ignore[misc]


def int8_linear(
    x: Tensor, qweight: Tensor, weight_scale: Tensor, packed: OnednnWeight | None = None
) -> Tensor:
    """The int8 matmul of `Int8Linear` without bias, as float32 of shape (*x.shape[:-1], N):
    ``int_matmul(qx, qweight) * weight_scale[None, :] * x_scale[:, None]``, each product
    rounded to float32 in that order; the first product comes out of oneDNN's call on the
    prepacked `qweight` and scales when `packed` (``onednn_prepack(qweight, weight_scale)``)
    is given: the same integers (of the codes plus 128) times the same scales."""
    x2 = x if x.dim() == 2 else x.reshape(-1, x.shape[-1])
    if packed is None:  # int sums times float32 scales: converted as .to(float32) does
        qx, x_scale = _quantize_tokens(x2)
        if weight_scale.dtype != torch.float32:
            weight_scale = weight_scale.to(torch.float32)
        if not _takes_int_mm(qx.device, qx.shape[0], qx.shape[1], qweight.shape[0]):
            sums = float_sums(qx, qweight)  # the int32 sums' float32 values, rounded alike
            # (out of place: the sums are a matmul's output, which selective checkpointing
            # may keep for the backward and refuses to see changed)
            out = (sums if sums.dtype == torch.float32 else sums.float()).mul(weight_scale)
        else:
            # (out of place too: selective checkpointing keeps `torch._int_mm`'s output)
            out = torch.mul(int_matmul(qx, qweight), weight_scale)
    else:
        ux, x_scale = _quantize_tokens(x2, zero_point=128)
        out = onednn_product(ux, packed)
    out.mul_(x_scale)
    return out if x.dim() == 2 else out.view(*x.shape[:-1], qweight.shape[0])


class _Int8Matmul(torch.autograd.Function):
    """Forward: `int8_linear`. Backward: the input gets ``grad @ dequantized weight`` (the
    activation rounding passes gradients straight through); the int8 weight gets none."""

    @staticmethod
    def forward(
        ctx: Any, x: Tensor, qweight: Tensor, weight_scale: Tensor, packed: OnednnWeight | None
    ) -> Tensor:
        ctx.save_for_backward(qweight, weight_scale)
        ctx.x_dtype = x.dtype
        return int8_linear(x, qweight, weight_scale, packed)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, None, None, None]:
        qweight, weight_scale = ctx.saved_tensors
        if not ctx.needs_input_grad[0]:
            return None, None, None, None
        w = qweight.to(torch.float32) * weight_scale.to(torch.float32)[:, None]
        return (grad.to(torch.float32) @ w).to(ctx.x_dtype), None, None, None


def check_input(layer: nn.Module, x: Tensor) -> None:
    """Raise ValueError unless `x` is a floating tensor whose last dim is the quantized
    Linear `layer`'s in_features: an integer or bool input came out as integers, and a wrong
    width or a 0-d input failed deep inside the matmul."""
    if x.dim() == 0 or x.shape[-1] != layer.in_features or not x.is_floating_point():
        raise ValueError(
            f"{type(layer).__name__}({layer.in_features}, {layer.out_features}) needs a "
            f"floating input whose last dim is {layer.in_features}, got {x.dtype} of shape "
            f"{tuple(x.shape)}"
        )


def output_dtype(x: Tensor) -> torch.dtype:
    """What an nn.Linear would return here: the autocast dtype inside autocast, else x's
    (a float64 `x` stays float64 inside autocast too: autocast leaves float64 alone)."""
    device = x.device.type
    if x.dtype != torch.float64 and torch.is_autocast_enabled(device):
        return torch.get_autocast_dtype(device)
    return x.dtype


# the buffers of a `ScaledCodes` layer that change together when its scales change dtype
CODE_BUFFERS = ("qweight", "weight_scale", "weight_zero")


class CodeCasts:
    """What the code buffers of each layer became in one cast (``.half()``, ``.to()``,
    `apply`'s conversion), so that a layer holding the same ones (a tied embedding and head)
    takes the same new ones, not a copy requantized on its own. Keyed by the old tensors
    (held weakly, as the new ones: the memo keeps nothing alive) and the new scales' dtype
    and device; a tensor changed in place since does not match."""

    def __init__(self) -> None:
        self._done: dict[Any, tuple[tuple[Any, ...], dict[str, Any]]] = {}
        self._prune_at = 64

    @staticmethod
    def _key(old: Mapping[str, Tensor], scale: Tensor) -> Any:
        return tuple((k, id(t)) for k, t in old.items()), scale.dtype, scale.device

    def get(self, old: Mapping[str, Tensor], scale: Tensor) -> dict[str, Tensor] | None:
        """The buffers `old` became with scales like `scale` in this cast, if it did."""
        entry = self._done.get(self._key(old, scale))
        if entry is None:
            return None
        sources, made = entry
        for (ref, version), t in zip(sources, old.values(), strict=True):
            if ref() is not t or _version(t) != version:
                return None
        new = {}
        for k, (ref, version) in made.items():
            t = ref()
            if t is None or _version(t) != version:
                return None
            new[k] = t
        return new

    def put(self, old: Mapping[str, Tensor], new: Mapping[str, Tensor]) -> None:
        """Record that `old` became `new`."""
        if len(self._done) >= self._prune_at:  # (a cast function kept alive: drop the dead)
            self._done = {
                k: e for k, e in self._done.items() if all(r() is not None for r, _ in e[0])
            }
            self._prune_at = 2 * max(len(self._done), 32)
        self._done[self._key(old, new["weight_scale"])] = (
            tuple((weakref.ref(t), _version(t)) for t in old.values()),
            {k: (weakref.ref(t), _version(t)) for k, t in new.items()},
        )


# the memo of each cast `nn.Module._apply` runs: it hands the same function to every module
_CASTS: weakref.WeakKeyDictionary[Any, CodeCasts] = weakref.WeakKeyDictionary()

_CAST_REMEDY = (
    "store them in float32 or bfloat16 (model.bfloat16(), a bf16 policy), or keep this "
    "layer in float32"
)


class ScaledCodes:
    """Mixin for a layer holding integer codes and their ``weight_scale`` (int8, int4): its
    scales stay values of the dtype they are stored in. A cast of the scales to a dtype that
    does not hold them all (``model.bfloat16()`` or `apply` of a 16-bit policy after
    `mixprec.quantize`: float32 scales), or a checkpoint loaded with scales in another dtype
    than the layer's, requantizes the weight they stand for with scales rounded up in the
    layer's dtype (`storable_scale`), as quantizing in it does: rounded to nearest, a scale
    could fall below its row's ``max|w| / 127`` (codes past the range, weights off by almost
    a whole step) or to 0 (a float16 row of tiny weights). Layers sharing codes keep sharing
    them through a cast (`CodeCasts`)."""

    weight_scale: Tensor
    _buffers: dict[str, Tensor]

    def weight_from(self, buffers: Mapping[str, Tensor]) -> Tensor:
        """The float weight the codes and scales in `buffers` stand for (their dtype)."""
        raise NotImplementedError

    def quantized_buffers(self, weight: Tensor, dtype: torch.dtype) -> dict[str, Tensor]:
        """The code buffers of the float `weight` quantized with scales in `dtype`."""
        raise NotImplementedError

    def dequantized_weight(self) -> Tensor:
        """The float weight the codes stand for, in the scales' dtype (LoRA adapters not
        included)."""
        return self.weight_from(self._buffers)

    def float32_weight(self) -> Tensor:
        """The float weight the codes stand for, in float32: exact for 16-bit scales (codes
        times scales; `dequantized_weight` rounds them to the scales' dtype, off the grid
        the codes are on). LoRA adapters not included."""
        return self.weight_from({**self.code_buffers(), "weight_scale": self.weight_scale.float()})

    def code_buffers(self) -> dict[str, Tensor]:
        """The layer's `CODE_BUFFERS`, by name."""
        return {k: self._buffers[k] for k in CODE_BUFFERS if self._buffers.get(k) is not None}

    def take_buffers(self, buffers: Mapping[str, Tensor]) -> None:
        """Hold `buffers` (code buffers by name) in place of its own."""
        for k, t in buffers.items():
            setattr(self, k, t)
        drop = getattr(self, "drop_prepacked", None)
        if drop is not None:
            drop()

    def requantize(self, weight: Tensor, dtype: torch.dtype | None = None) -> None:
        """Replace the codes by the quantization of the float `weight`, scales in `dtype`
        (by default the scales' own)."""
        dtype = self.weight_scale.dtype if dtype is None else dtype
        self.take_buffers(self.quantized_buffers(weight, dtype))

    def requantized(
        self, old: Mapping[str, Tensor], scale: Tensor, name: str | None = None
    ) -> dict[str, Tensor] | None:
        """None where `scale`, the scales of the code buffers `old` cast (to another dtype
        or device), holds their values; else the code buffers of the weight `old` stands for
        quantized again with scales in `scale`'s dtype, on its device. Changes nothing; a
        `ScaleRangeError` naming `name` (default: the layer's type) where that dtype cannot
        store them."""
        before = old["weight_scale"]
        if (
            scale.dtype == before.dtype
            or not scale.is_floating_point()
            or scale.is_meta
            or before.is_meta
        ):
            return None  # (meta tensors hold no values to keep)
        back = scale.to(before.device, before.dtype)
        if bool(((back == before) | before.isnan()).all()):
            return None
        weight = self.weight_from(old).to(scale.device)
        try:
            return self.quantized_buffers(weight, scale.dtype)
        except ScaleRangeError as err:
            name = name or f"this {type(self).__name__}"
            message = f"cannot store the scales of {name} in {scale.dtype}: {err.detail}"
            raise ScaleRangeError(f"{message}; {_CAST_REMEDY}", err.detail) from None

    def scales_refused(self, dtype: torch.dtype) -> str | None:
        """Why this layer's scales cannot be stored in `dtype` (None: they can, requantized
        where they do not fit); changes nothing (`apply` asks before it converts)."""
        scale = self.weight_scale
        wide = torch.finfo(dtype).max > 2.0**127  # (float32's exponents: bfloat16 too)
        if scale.dtype == dtype or wide:
            return None
        try:
            self.requantized(self.code_buffers(), scale.to(dtype))
        except ScaleRangeError as err:
            return err.detail
        return None

    def _take_cast(
        self,
        old: Mapping[str, Tensor],
        cast: Mapping[str, Tensor],
        casts: CodeCasts,
        name: str | None = None,
    ) -> None:
        """Hold what the code buffers `old` become in a cast, given `cast`, them cast as
        plain tensors: what they became for another layer in `casts`, else `cast`
        requantized where its scales changed value (`requantized`)."""
        new = casts.get(old, cast["weight_scale"])
        if new is None:
            new = self.requantized(old, cast["weight_scale"], name) or dict(cast)
            casts.put(old, new)
        self.take_buffers(new)

    def _apply(self, fn: Any, recurse: bool = True) -> Any:
        old = self.code_buffers()
        try:
            casts = _CASTS.setdefault(fn, CodeCasts())
        except TypeError:  # (a function that takes no weak reference: no sharing)
            casts = CodeCasts()
        # the new buffers made first (`fn` of the scales is a copy of a vector): a cast
        # refused (ScaleRangeError) leaves the layer as it was, nothing of it cast
        scale = fn(old["weight_scale"])
        new = casts.get(old, scale) or self.requantized(old, scale)
        out = super()._apply(fn, recurse)  # type: ignore[misc]
        if new is None:  # (the plain casts hold the values)
            new = self.code_buffers()
        casts.put(old, new)
        self.take_buffers(new)
        return out

    def cast_scales(
        self, dtype: torch.dtype, casts: CodeCasts | None = None, name: str | None = None
    ) -> None:
        """Store the scales in `dtype` (the cast `mixprec.apply` makes of a policy's
        buffers), requantizing where they do not fit it exactly; layers sharing codes share
        the new ones through `casts`. Assigns only once the new buffers are made: refused
        (`ScaleRangeError`, naming `name`), it changes nothing."""
        old = self.code_buffers()
        cast = {**old, "weight_scale": old["weight_scale"].to(dtype)}
        self._take_cast(old, cast, CodeCasts() if casts is None else casts, name)

    def _load_from_state_dict(
        self,
        state_dict: dict[str, Any],
        prefix: str,
        local_metadata: dict[str, Any],
        strict: bool,
        missing_keys: list[str],
        unexpected_keys: list[str],
        error_msgs: list[str],
    ) -> None:
        refused: set[str] = set()
        if not local_metadata.get("assign_to_params_buffers", False):  # (assigned: as given)
            try:
                self._requantize_loaded(state_dict, prefix)
            except ScaleRangeError as err:
                error_msgs.append(str(err))
                # not copied in (the scales rounded to nearest, inf past the range, beside
                # codes made for others), as torch skips a tensor of the wrong shape
                refused = {prefix + k for k in self.code_buffers()}
                state_dict = {k: v for k, v in state_dict.items() if k not in refused}
        super()._load_from_state_dict(  # type: ignore[misc]
            state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs
        )
        if refused:  # (given, so not missing: refused, as error_msgs says)
            missing_keys[:] = [k for k in missing_keys if k not in refused]

    def _requantize_loaded(self, state_dict: dict[str, Any], prefix: str) -> None:
        """Put in `state_dict`, for code buffers whose scales are in another dtype than this
        layer's (float32 ones loaded into a model cast to 16 bits first), those of the
        weight they stand for requantized in the layer's dtype, as a cast after loading
        would make them: copied in, the scales would be rounded to nearest against codes
        made for the others."""
        mine = self.code_buffers()
        given = {k: state_dict.get(prefix + k) for k in mine}
        for k, t in given.items():
            if type(t) is not Tensor or t.shape != mine[k].shape or t.is_meta:
                return  # (missing, another layout, a tensor subclass: loaded as it is)
        own = mine["weight_scale"]
        if own.is_meta or given["weight_scale"].dtype == own.dtype:
            return
        name = repr(prefix[:-1]) if prefix else None
        new = self.requantized(given, given["weight_scale"].to(own.dtype), name)
        if new is not None:
            state_dict.update({prefix + k: t for k, t in new.items()})


class _Int8Rows(ScaledCodes):
    """The int8 weight of an int8 Linear or Embedding: ``qweight`` and one ``weight_scale``
    a row."""

    qweight: Tensor

    def take_rows(self, weight: Tensor, quantized: tuple[Tensor, ...] | None) -> None:
        """Hold the int8 rows of the float `weight` (scales in its dtype), or `quantized`
        (``(qweight, weight_scale)`` already made from it, the scales kept in their dtype:
        the format makes them in the dtype they are stored in)."""
        if quantized is not None:
            self.qweight, self.weight_scale = quantized
            return
        q, scale = quantize_rows(weight)
        self.qweight, self.weight_scale = q, scale.to(weight.dtype)

    def weight_from(self, buffers: Mapping[str, Tensor]) -> Tensor:
        scale = buffers["weight_scale"]
        return buffers["qweight"].to(scale.dtype) * scale[:, None]

    def quantized_buffers(self, weight: Tensor, dtype: torch.dtype) -> dict[str, Tensor]:
        q, scale = quantize_rows(weight, dtype=dtype)
        return {"qweight": q, "weight_scale": scale.to(dtype)}


class Int8Linear(_Int8Rows, Prepacked, LoraMixin, nn.Module):
    """A Linear with int8 weights (per output channel) and per-token int8 activations.

    The int8 weight and its scales are buffers (no gradient); the bias trains. Scales are
    floating buffers, so a policy stores them in its param dtype like any weight.
    """

    float_type = nn.Linear

    quantization_mode = "int8"

    def __init__(self, in_features: int, out_features: int, bias: bool = True) -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.register_buffer("qweight", torch.zeros(out_features, in_features, dtype=torch.int8))
        self.register_buffer("weight_scale", torch.ones(out_features))
        self.bias = nn.Parameter(torch.zeros(out_features)) if bias else None
        self._init_lora()

    @classmethod
    def from_float(
        cls,
        linear: nn.Linear,
        quantized: tuple[Tensor, ...] | None = None,
        name: str = "the weight",
    ) -> Int8Linear:
        """Quantize `linear` (or take ``(qweight, weight_scale)`` already made from its
        weight, so tied weights share one int8 copy); `name` says which in an error."""
        layer = cls(linear.in_features, linear.out_features, bias=linear.bias is not None)
        layer.take_rows(linear.weight, quantized)
        check_sums_fit(layer.weight_scale.float(), linear.in_features, name)
        layer.bias = linear.bias  # the same Parameter: an optimizer holding it keeps working
        return swapped_in(linear, layer.to(linear.weight.device))

    @property
    def kernel(self) -> str:
        """The integer matmul this layer runs on its device, and why that one (every path
        gives the same sums, so the same outputs)."""
        device, k = self.qweight.device, self.in_features
        if device.type == "cuda":
            return "torch._int_mm (a float64 matmul for up to 16 tokens or K, N not multiples of 8)"
        if device.type != "cpu":
            return f"float64 matmul of the int8 codes (no int8 kernel on {device.type})"
        if k < INT_MM_MIN_K:
            return f"{_FLOAT_PATH} ({k} < {INT_MM_MIN_K} input features)"
        found = cpu_int8_kernels()
        if self._onednn(device):
            return (
                "oneDNN int8 linear (torch.ops.onednn.qlinear_pointwise, weight and scales "
                "prepacked once); torch._int_mm for a single token"
            )
        if found["onednn"] is None:
            why = f"{k} input features: oneDNN's unsigned int32 sums hold {ONEDNN_MAX_K}"
        else:
            why = f"oneDNN int8 linear: {found['onednn']}"
        if found["onednn"] is None:  # past ONEDNN_MAX_K features, with VNNI
            return f"torch._int_mm ({why})"
        slow = found["int_mm"] or "exact, but a reference loop without VNNI"
        return f"{_FLOAT_PATH} ({why}; torch._int_mm: {slow})"

    def _onednn(self, device: torch.device) -> bool:
        """Whether this layer multiplies with oneDNN's prepacked weight on `device` (not
        under torch.compile, which traces `int_matmul`: the prepacked weight is an opaque
        oneDNN tensor kept outside the module)."""
        return (
            device.type == "cpu"
            and not torch.compiler.is_compiling()
            and INT_MM_MIN_K <= self.in_features <= ONEDNN_MAX_K
            and cpu_int8_kernels()["onednn"] is None
        )

    def forward(self, x: Tensor) -> Tensor:
        check_input(self, x)
        # buffers and bias read from their dicts: nn.Module.__getattr__ is Python code, and
        # fixed costs count here (with caches cold, a visible share of a small layer's time)
        qweight, weight_scale = self._buffers["qweight"], self._buffers["weight_scale"]
        bias = self._parameters.get("bias")  # None: built without one (a plain attribute)
        packed = None
        # one token (decode): torch._int_mm's matrix-vector path is faster than oneDNN's
        # linear there
        if x.numel() > x.shape[-1] and self._onednn(x.device):
            packed = self.prepacked(
                (qweight, weight_scale), lambda: onednn_prepack(qweight, weight_scale)
            )
        grad = torch.is_grad_enabled()
        if grad and x.requires_grad:
            out = _Int8Matmul.apply(x, qweight, weight_scale, packed)
        else:  # no graph to record: skip the autograd.Function's cost
            out = int8_linear(x, qweight, weight_scale, packed)
        if bias is not None:
            if bias.dtype != torch.float32:
                bias = bias.to(torch.float32)
            out = out + bias if grad else out.add_(bias)
        dtype = output_dtype(x)
        if out.dtype != dtype:
            out = out.to(dtype)
        return self.add_lora(x, out) if self.lora_rank else out

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, "
            f"bias={self.bias is not None}{self.lora_repr()}"
        )


class Int8Embedding(_Int8Rows, LoraEmbeddingMixin, nn.Module):
    """An Embedding with int8 rows (one scale per row): each lookup is dequantized."""

    float_type = nn.Embedding

    quantization_mode = "int8"

    def __init__(
        self, num_embeddings: int, embedding_dim: int, padding_idx: int | None = None
    ) -> None:
        super().__init__()
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim
        self.padding_idx = padding_idx
        shape = (num_embeddings, embedding_dim)
        self.register_buffer("qweight", torch.zeros(shape, dtype=torch.int8))
        self.register_buffer("weight_scale", torch.ones(num_embeddings))
        self._init_lora()

    @classmethod
    def from_float(
        cls, embedding: nn.Embedding, quantized: tuple[Tensor, ...] | None = None
    ) -> Int8Embedding:
        """Quantize `embedding` (or take ``(qweight, weight_scale)`` of its weight)."""
        layer = cls(embedding.num_embeddings, embedding.embedding_dim, embedding.padding_idx)
        layer.take_rows(embedding.weight, quantized)
        return swapped_in(embedding, layer.to(embedding.weight.device))

    def forward(self, idx: Tensor) -> Tensor:
        rows = F.embedding(idx, self.qweight).to(self.weight_scale.dtype)
        return self.add_lora(idx, rows * F.embedding(idx, self.weight_scale[:, None]))

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}{self.lora_repr()}"


# --- the int8 format ---------------------------------------------------------------------

# int8 dot products with 32-bit sums (without them oneDNN's int8 kernels saturate 16-bit
# partial sums, and mixprec's int8 layers sum their codes in float32 matmuls); and flags only
# an x86 CPU reports (an Arm CPU has none of them)
_VNNI_FLAGS = frozenset({"avx512_vnni", "avx_vnni", "amx_int8"})
_X86_FLAGS = frozenset({"sse2", "avx", "avx2", "avx512f", "avx512bw"})


def int8_support(info: DeviceInfo) -> Support:
    """How `info`'s device runs int8 x int8 matmuls with exact sums: an x86 CPU without VNNI
    has no integer kernel whose sums are exact (16-bit partial sums saturate), so mixprec's
    int8 layers sum their codes in exact float32 matmuls there (`float_sums`), converting
    the weight's codes per call, slower than float32 (docs/quantized.md has the
    measurements): memory saved, not time. MPS has neither integer matmuls nor float64."""
    if info.type == "mps":
        return Support(
            Status.REFUSED,
            "no integer matmul on mps, and the exact fallback sums in float64, which MPS "
            "lacks: int8 layers would fail there",
        )
    # (a CPU described with no flags at all, none of them unknown, is rated as its bfloat16
    # is: nothing assumed that is not listed, so as an x86 without VNNI)
    bare = not info.cpu_flags and not info.unknown_flags
    x86 = info.type == "cpu" and (bool(info.cpu_flags & _X86_FLAGS) or bare)
    vnni = sorted(info.cpu_flags & _VNNI_FLAGS)
    if vnni:
        return Support(Status.FAST, f"VNNI dot products ({', '.join(vnni)})")
    # (VNNI flags are x86's: one that could not be read may be missing, so int8 is not fast)
    if unread := sorted(info.unknown_flags & _VNNI_FLAGS):
        return Support(
            Status.SUPPORTED,
            f"flags unknown ({', '.join(unread)}): without VNNI, int8 sums run as float32 "
            "matmuls of the codes, slower than float32; saves memory, maybe not time",
        )
    if x86:
        return Support(
            Status.SUPPORTED,
            "no VNNI (avx512_vnni/avx_vnni/amx_int8): int8 sums run as float32 matmuls of the "
            "codes, slower than float32; saves memory, not time",
        )
    return Support(Status.FAST, f"integer matmuls on {info.type}")


class Int8Format(Format):
    """int8: weights per output channel, activations per token at run time (Linear,
    Embedding and Hugging Face Conv1D layers). It takes no option."""

    name = "int8"
    accepted = "'int8'"
    embeddings = True
    keeps_weight = False
    search = ("int8",)
    info_row = True

    def parse(self, options: str | None, keywords: Mapping[str, Any], name: str) -> None:
        if options is not None:
            raise PolicySpecError(
                f"int8 takes no option ({name!r}): its scales are per output channel. "
                + accepted_quantized()
            )
        return None

    def source_reason(self, compute_dtype: torch.dtype) -> str | None:
        if compute_dtype != torch.float16:
            return None
        return (
            "int8 with a float16 compute dtype loses too much (as in Keras); use a bfloat16 "
            "or float32 source, e.g. 'int8_from_mixed_bfloat16'"
        )

    def quantize_weight(
        self, weight: Tensor, config: None, name: str, storage: torch.dtype
    ) -> tuple[Tensor, ...]:
        q, scale = quantize_rows(weight, name, storage)
        return q, scale.to(storage)

    def swap(self, module: nn.Module, config: None, *, path: str, **kwargs: Any) -> nn.Module:
        if isinstance(module, nn.Linear):  # (named in a refusal: `check_sums_fit`)
            codes = super()._codes(module, config, path=path, **kwargs)
            return Int8Linear.from_float(module, codes, f"{path}.weight")
        return super().swap(module, config, path=path, **kwargs)

    def build(self, module: nn.Module, config: None, codes: tuple[Tensor, ...]) -> nn.Module:
        layer = Int8Linear if isinstance(module, nn.Linear) else Int8Embedding
        return layer.from_float(module, codes)

    def to_float(self, layer: nn.Module, memo: dict[int, Any]) -> nn.Module:
        return float_layer(layer, memo)

    def weight_bytes(self, config: None, module: nn.Module, storage: torch.dtype) -> int:
        rows, features = rows_and_features(module)
        return rows * features + rows * storage.itemsize

    def rate(self, info: DeviceInfo) -> Support:
        return int8_support(info)


INT8 = Int8Format()


def float_layer(layer: nn.Module, memo: dict[int, Any]) -> nn.Module:
    """The float Linear/Embedding (its ``float_type``) an int8/int4 layer holding codes
    stands for: its dequantized weight (frozen if the float weight was), LoRA adapters
    folded in, the bias the same Parameter. Layers sharing one quantized weight (and no
    adapters) share one float weight through `memo` (`mixprec.quantize.dequantize`'s)."""
    key = id(layer.qweight)
    weight = layer.dequantized_weight()
    if isinstance(layer, LoraMixin) and layer.lora_rank:
        weight, key = weight + layer.lora_delta().detach().to(weight.dtype), id(layer)
    if key not in memo:
        trains = getattr(layer, "weight_requires_grad", True)
        memo[key] = nn.Parameter(weight.detach().clone(), requires_grad=trains)
    if layer.float_type is nn.Linear:
        out = nn.Linear(layer.in_features, layer.out_features, bias=layer.bias is not None)
        out.bias = layer.bias
        if layer.bias is not None and isinstance(layer, LoraMixin) and layer.lora_rank:
            # (enable_lora froze it; merged into a float layer, it trains as it did before)
            layer.bias.requires_grad_(layer._bias_requires_grad)
    else:
        out = nn.Embedding(layer.num_embeddings, layer.embedding_dim, layer.padding_idx)
    out.weight = memo[key]
    return swapped_in(layer, out.to(weight.device))
