"""Microscaling (block-scaled) formats in pure PyTorch: MXFP8/MXFP6/MXFP4 (OCP MX v1.0) and
NVIDIA's NVFP4, bit-exact on any device, and `MicroscalingLinear`, which trains and infers
with them emulated (quantize, dequantize, float32 matmul).

Element formats (sign, exponent, mantissa bits; bias; max; specials): E4M3 (1-4-3, 7, 448,
S.1111.111 is NaN, no inf), E5M2 (1-5-2, 15, 57344, IEEE inf/NaN), E2M3 (1-2-3, 1, 7.5),
E3M2 (1-3-2, 3, 28), E2M1 (1-2-1, 1, 6); the FP6/FP4 ones have no inf or NaN. Casting a value
to an element rounds to nearest, ties to even, keeps subnormals and the sign of zero, and
saturates finite values to +-max; inf and NaN become NaN.

MX blocks (`quantize_mx`): `block_size` consecutive elements of the last dim share a scale
``X = 2**e`` stored as an E8M0 code ``e + 127`` (exponents -127..127; 0xFF is NaN).
"floor" (the spec): ``e = floor(log2(amax)) - emax`` where emax is the exponent of the
element's max (8 for E4M3, 15 E5M2, 2 E2M3, 4 E3M2, 2 E2M1), so values above ``max * X``
saturate. "rceil": the smallest e with ``amax <= max * 2**e``. An all-zero block gets
``e = -127``; a block holding an inf or NaN gets the NaN scale and decodes to NaN whole
(its element codes are stored as 0). Elements are ``cast(x / X)``.

NVFP4 (`quantize_nvfp4`, the equations of NVIDIA's NVFP4 pretraining paper, in float32):
the tensor's amax over its finite values gives ``s_enc = 6 * 448 / amax`` (1 for an
all-zero or empty tensor) and ``s_dec = 1 / s_enc``, the per-tensor float32 scale; each
block of 16 (1x16 along the last dim, or 16x16 tiles of a matrix) stores
``e4m3(amax_b / 6 * s_enc)`` and its elements ``e2m1(x * (1 / (scale_b * s_dec)))``; decoding is
``(element * scale_b) * s_dec``, the encode factor ``1 / (scale_b * s_dec)`` clamped to
float32's max. A block whose scale rounds to 0 holds zeros (of its values' signs), and
so do the smallest float32 subnormals of a tensor whose amax is tiny too (the clamped
factor cannot lift them to an element); one holding an inf or NaN gets the E4M3 NaN scale
(0x7F) and decodes to NaN.

All scaling is by exact powers of two (built from bits, never ``exp2``) or by single IEEE
float32 operations, so results do not depend on the CPU's instruction set.

Training (`MicroscalingLinear`): every GEMM's two operands are quantized in blocks along
the dimension the GEMM reduces, as torchao's MX training and Transformer Engine do: forward
``x @ W^T`` along the input features, input gradient ``g @ W`` along the outputs, weight
gradient ``g^T @ x`` along the tokens (zero-padded to whole blocks: zeros change neither a
block's amax nor the sum). All three tensors use the mode's element format: the MXFP8
recipe (Mishra et al. 2025) keeps E4M3 for gradients too, since a 32-element block's own
scale covers the range E5M2 used to buy. NVFP4's recipe options (2D weight tiles reused by
the backward, a random Hadamard transform of the weight-gradient GEMM's inputs, stochastic
rounding of the output gradient) are `MicroscalingConfig`'s. The bias is added after the
matmul in the output dtype, never quantized, and trains (torchao's MXFP8 training path
dropped it). There is no real block-scaled GEMM path: these matmuls need NVIDIA Blackwell
(SM 10.0+) kernels, so every device emulates.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor, nn

from mixprec.formats.microscaling import MicroscalingConfig
from mixprec.formats.registry import Format, Status, Support
from mixprec.quantize.first_order import first_order
from mixprec.quantize.rules import carry_hooks, plain_linear

if TYPE_CHECKING:
    from mixprec.device import DeviceInfo

__all__ = [
    "E8M0_NAN",
    "FORMATS",
    "ElementFormat",
    "MICROSCALING_FAST_ON",
    "MICROSCALING_FORMATS",
    "MXTensor",
    "MicroscalingFormat",
    "MicroscalingLinear",
    "NVFP4Tensor",
    "code_values",
    "decode_elements",
    "encode_elements",
    "exp2_int",
    "fake_quantize",
    "hadamard_16",
    "microscaling_support",
    "mx_scale_exponents",
    "pack_fp4",
    "quantize_mx",
    "quantize_nvfp4",
    "round_by_definition",
    "round_to_element",
    "unpack_fp4",
]

E8M0_BIAS = 127
E8M0_NAN = 0xFF
E4M3_NAN = 0x7F
NVFP4_TENSOR_MAX = 6.0 * 448.0  # E2M1 max times E4M3 max
_FLOAT32_MAX = torch.finfo(torch.float32).max


@dataclass(frozen=True)
class ElementFormat:
    """A small float format: bit widths, exponent bias, largest finite value and which codes
    are special ("fn": the all-ones magnitude is NaN, no inf; "ieee": the top exponent holds
    inf and NaN; "none": every code is finite)."""

    name: str
    exponent_bits: int
    mantissa_bits: int
    bias: int
    max: float
    specials: str

    @property
    def bits(self) -> int:
        return 1 + self.exponent_bits + self.mantissa_bits

    @property
    def emin(self) -> int:
        """Exponent of the smallest normal value."""
        return 1 - self.bias

    @property
    def emax(self) -> int:
        """Exponent of the largest finite value (the OCP MX spec's emax_elem)."""
        return math.frexp(self.max)[1] - 1


FORMATS: dict[str, ElementFormat] = {
    "e4m3": ElementFormat("e4m3", 4, 3, 7, 448.0, "fn"),
    "e5m2": ElementFormat("e5m2", 5, 2, 15, 57344.0, "ieee"),
    "e2m3": ElementFormat("e2m3", 2, 3, 1, 7.5, "none"),
    "e3m2": ElementFormat("e3m2", 3, 2, 3, 28.0, "none"),
    "e2m1": ElementFormat("e2m1", 2, 1, 1, 6.0, "none"),
}
E4M3, E2M1 = FORMATS["e4m3"], FORMATS["e2m1"]


def _format(element: str | ElementFormat) -> ElementFormat:
    if isinstance(element, ElementFormat):
        return element
    if element not in FORMATS:
        raise ValueError(f"unknown element format {element!r}; accepted: {', '.join(FORMATS)}")
    return FORMATS[element]


def exp2_int(e: Tensor) -> Tensor:
    """``2.0 ** e`` as float32 for integer `e` in [-149, 127], exact: built from the bits
    (normal numbers from the exponent field, subnormals from one mantissa bit)."""
    e = e.to(torch.int32)
    normal = (e + 127).clamp(min=1, max=254) << 23
    subnormal = torch.ones_like(e) << (e + 149).clamp(min=0, max=22)
    return torch.where(e >= -126, normal, subnormal).view(torch.float32)


def round_to_element(
    v: Tensor, element: str | ElementFormat, *, noise: Tensor | None = None
) -> Tensor:
    """`v` (as float32) rounded to the element format's values: to nearest with ties to even,
    or stochastically with `noise` (uniform in [0, 1), v's shape): ``floor(v / ulp + noise)``
    in exact arithmetic, so only the two neighbours of `v` come out, a value the format holds
    stays put, and the mean is `v`; finite values saturate to +-max, inf and NaN become NaN.
    Returns float32 values.

    E4M3 and E5M2 to nearest go through torch's float8 casts of the clamped values (the
    same rounding, a few passes over the tensor instead of a dozen; the tests hold both
    ways to torch's casts and to hand-computed values); the rest by `round_by_definition`."""
    fmt = _format(element)
    v = v.float()
    if noise is not None:
        _check_noise(noise, v)
    return _round_to_element(v, fmt, noise)


def _round_to_element(v: Tensor, fmt: ElementFormat, noise: Tensor | None) -> Tensor:
    """`round_to_element` of float32 `v` with `noise` unchecked: the layers' own noise comes
    from ``torch.rand``, and checking its values would make ``torch.compile`` read them."""
    if noise is None and fmt.name in _TORCH_FLOAT8:
        return torch.where(torch.isfinite(v), _saturating_cast(v, fmt), torch.nan)
    return _round_by_definition(v, fmt, noise)


def _check_noise(noise: Tensor, v: Tensor) -> None:
    """ValueError unless `noise` is a real floating tensor of v's shape with values in [0, 1)."""
    if not isinstance(noise, Tensor) or not noise.is_floating_point():
        raise ValueError(
            f"noise must be a floating tensor of uniform values in [0, 1) shaped like the "
            f"values, got {type(noise).__name__ if not isinstance(noise, Tensor) else noise.dtype}"
        )
    if noise.shape != v.shape:
        raise ValueError(
            f"noise must have the values' shape {tuple(v.shape)}, got {tuple(noise.shape)}"
        )
    if noise.numel() and not bool(((noise >= 0) & (noise < 1)).all()):
        raise ValueError("noise values must lie in [0, 1) (e.g. torch.rand), got some outside")


_TORCH_FLOAT8 = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}


def _saturating_cast(v: Tensor, fmt: ElementFormat) -> Tensor:
    """float32 `v` clamped to +-max and cast through torch's float8 dtype (round to nearest
    even); an inf becomes +-max here (callers that need NaN mask it)."""
    return v.clamp(-fmt.max, fmt.max).to(_TORCH_FLOAT8[fmt.name]).float()


def round_by_definition(
    v: Tensor, element: str | ElementFormat, *, noise: Tensor | None = None
) -> Tensor:
    """`round_to_element` from the format's definition for any element format: the value's
    binade (its exponent, at least the smallest normal one) sets the step
    ``2**(e - mantissa bits)``; v / step is rounded (exact: steps are powers of two).
    Stochastic rounding goes up when ``noise >= 1 - frac``, frac being the (exact) part of a
    step that v lies above its floor, not by flooring the float32 sum ``v / step + noise``,
    which rounds up to the next integer for noise just under 1 and moved values the format
    holds."""
    fmt = _format(element)
    v = v.float()
    if noise is not None:
        _check_noise(noise, v)
    return _round_by_definition(v, fmt, noise)


def _round_by_definition(v: Tensor, fmt: ElementFormat, noise: Tensor | None) -> Tensor:
    """`round_by_definition` of float32 `v`, `noise` unchecked."""
    _, exponent = torch.frexp(v)  # v = m * 2**exponent, 0.5 <= |m| < 1
    e = (exponent.to(torch.int32) - 1).clamp(min=fmt.emin, max=127)
    ulp = exp2_int(e - fmt.mantissa_bits)
    scaled = v / ulp
    if noise is None:
        rounded = torch.round(scaled)
    else:
        below = torch.floor(scaled)
        rounded = below + (noise >= 1 - (scaled - below)).to(torch.float32)
    out = (rounded * ulp).clamp(-fmt.max, fmt.max)
    return torch.where(torch.isfinite(v), out, torch.nan)


def code_values(element: str | ElementFormat) -> Tensor:
    """The float32 value of every code of the format (index = code), from the definition."""
    fmt = _format(element)
    m_bits, e_bits = fmt.mantissa_bits, fmt.exponent_bits
    values = []
    for code in range(2**fmt.bits):
        sign = -1.0 if code >> (fmt.bits - 1) else 1.0
        field = (code >> m_bits) & ((1 << e_bits) - 1)
        mantissa = code & ((1 << m_bits) - 1)
        top = field == (1 << e_bits) - 1
        if fmt.specials == "fn" and top and mantissa == (1 << m_bits) - 1:
            values.append(math.nan)
        elif fmt.specials == "ieee" and top:
            values.append(sign * math.inf if mantissa == 0 else math.nan)
        elif field == 0:
            values.append(sign * mantissa * 2.0 ** (fmt.emin - m_bits))
        else:
            values.append(sign * (1 + mantissa / 2**m_bits) * 2.0 ** (field - fmt.bias))
    return torch.tensor(values, dtype=torch.float32)


def encode_elements(values: Tensor, element: str | ElementFormat) -> Tensor:
    """uint8 codes of values the format holds exactly (what `round_to_element` returns);
    NaN gets the format's NaN code and +-inf E5M2's inf codes. ValueError for a value the
    format does not hold (NaN or inf where it has none, a value off its grid or past its
    max) rather than a code of some other value."""
    fmt = _format(element)
    v = values.float()
    nan, inf = torch.isnan(v), torch.isinf(v)
    if fmt.specials == "none" and bool(nan.any()):
        raise ValueError(f"{fmt.name} has no NaN code; NaN values cannot be encoded")
    if fmt.specials != "ieee" and bool(inf.any()):
        raise ValueError(
            f"{fmt.name} has no inf code; inf values cannot be encoded (round_to_element "
            "turns them into NaN, and e5m2 is the element format that holds inf)"
        )
    a = torch.where(nan | inf, 0.0, v.abs())
    _, exponent = torch.frexp(a)
    e = exponent.to(torch.int32) - 1
    normal = a >= 2.0**fmt.emin
    m_scale = float(2**fmt.mantissa_bits)
    mantissa = torch.where(
        normal,
        (a / exp2_int(e.clamp(min=fmt.emin, max=127)) - 1) * m_scale,
        a / exp2_int(torch.full_like(e, fmt.emin - fmt.mantissa_bits)),
    ).to(torch.int32)
    field = torch.where(normal, e + fmt.bias, 0)
    magnitude_bits = fmt.bits - 1
    code = ((field << fmt.mantissa_bits) | mantissa) & ((1 << magnitude_bits) - 1)
    nan_code = (1 << magnitude_bits) - 1  # all ones below the sign: NaN in fn and ieee
    inf_code = ((1 << fmt.exponent_bits) - 1) << fmt.mantissa_bits  # ieee only
    code = torch.where(nan, nan_code, torch.where(inf, inf_code, code))
    code = code | (torch.signbit(v).to(torch.int32) << magnitude_bits)
    held = (decode_elements(code, fmt) == v) | nan
    if not bool(held.all()):
        bad = v[~held]
        raise ValueError(
            f"{bad.numel()} value(s) are not {fmt.name} values (first {bad[0].item()!r}; "
            f"{fmt.name} holds values on its grid up to +-{fmt.max:g}): round them with "
            "round_to_element before encoding"
        )
    return code.to(torch.uint8)


def _check_codes(codes: Tensor, bits: int, what: str) -> None:
    """ValueError unless `codes` is an integer tensor of values in [0, 2**bits)."""
    if not isinstance(codes, Tensor) or codes.is_floating_point() or codes.is_complex():
        got = codes.dtype if isinstance(codes, Tensor) else type(codes).__name__
        raise ValueError(f"{what} takes an integer tensor of codes (uint8), got {got}")
    if codes.dtype == torch.bool:
        raise ValueError(f"{what} takes an integer tensor of codes (uint8), got torch.bool")
    if not codes.numel():
        return
    low, high = (int(v) for v in torch.aminmax(codes))
    if low < 0 or high >= 2**bits:
        raise ValueError(
            f"{what}: codes must lie in [0, {2**bits}) ({bits}-bit codes), got {low}..{high}"
        )


def decode_elements(codes: Tensor, element: str | ElementFormat) -> Tensor:
    """float32 values of uint8 `codes` (`code_values` looked up); ValueError for codes the
    format does not have (a negative code took the value of a code from the end)."""
    fmt = _format(element)
    _check_codes(codes, fmt.bits, f"decode_elements ({fmt.name})")
    return code_values(fmt).to(codes.device)[codes.long()]


def pack_fp4(codes: Tensor) -> Tensor:
    """Two 4-bit codes per byte along the last dim (even length): element 2i in the low
    nibble, 2i+1 in the high one. ValueError for codes outside [0, 16)."""
    if codes.shape[-1] % 2:
        raise ValueError(f"pack_fp4 needs an even last dim, got shape {tuple(codes.shape)}")
    _check_codes(codes, 4, "pack_fp4")
    return codes[..., 0::2] | (codes[..., 1::2] << 4)


def unpack_fp4(packed: Tensor) -> Tensor:
    """Inverse of `pack_fp4` (uint8 bytes)."""
    if not isinstance(packed, Tensor) or packed.dtype != torch.uint8:
        got = packed.dtype if isinstance(packed, Tensor) else type(packed).__name__
        raise ValueError(f"unpack_fp4 takes the uint8 bytes pack_fp4 returns, got {got}")
    return torch.stack([packed & 0xF, packed >> 4], dim=-1).flatten(-2)


def _blocks(x: Tensor, block_size: int) -> Tensor:
    """x (float32) viewed as (..., n_blocks, block_size) along its last dim."""
    if x.dim() == 0 or x.shape[-1] % block_size:
        raise ValueError(
            f"block quantization needs a last dim that is a multiple of the block size "
            f"{block_size}, got shape {tuple(x.shape)}"
        )
    return x.float().reshape(*x.shape[:-1], x.shape[-1] // block_size, block_size)


def _check_real(x: object, what: str) -> None:
    """TypeError unless `x` is a tensor of real numbers (x.float() drops a complex tensor's
    imaginary part with only a warning)."""
    if not isinstance(x, Tensor) or x.is_complex():
        got = f"a {x.dtype} tensor" if isinstance(x, Tensor) else type(x).__name__
        raise TypeError(f"{what} takes a real tensor (floating, integer or bool), got {got}")


def mx_scale_exponents(amax: Tensor, element: str | ElementFormat, rounding: str) -> Tensor:
    """The shared exponent (int32, in [-127, 127]) of blocks whose abs-max is `amax`
    ("floor" per OCP MX v1.0, or "rceil"); non-finite amaxes give meaningless values (their
    blocks are marked NaN by the callers)."""
    fmt = _format(element)
    if rounding not in MicroscalingConfig.ROUNDINGS:
        raise ValueError(
            f"unknown scale rounding {rounding!r}; accepted: "
            f"{', '.join(MicroscalingConfig.ROUNDINGS)}"
        )
    amax = amax.float()
    _, exponent = torch.frexp(amax)
    e = (exponent.to(torch.int32) - 1 - fmt.emax).clamp(min=-127, max=127)
    if rounding == "rceil":  # floor's exponent, or one more if amax does not fit under it
        e = torch.where(amax * exp2_int(-e) > fmt.max, e + 1, e)
    return torch.where(amax == 0, -127, e).clamp(min=-127, max=127)


@dataclass
class MXTensor:
    """A tensor in an MX format: one uint8 element code per value (`pack_fp4` packs FP4 two
    per byte) and one E8M0 scale code per block of the last dim."""

    codes: Tensor
    scales: Tensor
    element: str
    block_size: int

    def __post_init__(self) -> None:
        MicroscalingConfig.check_block_size(self.block_size)

    def dequantize(self) -> Tensor:
        """The float32 values: element * 2**(scale - 127); NaN for blocks of scale 0xFF."""
        values = _blocks(decode_elements(self.codes, self.element), self.block_size)
        codes = self.scales.unsqueeze(-1).to(torch.int32)
        out = torch.where(codes == E8M0_NAN, torch.nan, values * exp2_int(codes - E8M0_BIAS))
        return out.reshape(self.codes.shape)


def _mx(
    x: Tensor, fmt: ElementFormat, block_size: int, rounding: str
) -> tuple[Tensor, Tensor, Tensor]:
    """(element values, shared exponents, non-finite-block mask), blocked."""
    blocks = _blocks(x, block_size)
    amax = blocks.abs().amax(dim=-1, keepdim=True)
    e = mx_scale_exponents(amax, fmt, rounding)
    bad = ~torch.isfinite(amax)
    elements = round_to_element(blocks * exp2_int(-e), fmt)
    return torch.where(bad, 0.0, elements), e, bad


def _mx_fake_fp8(x: Tensor, fmt: ElementFormat, block_size: int, rounding: str) -> Tensor:
    """`_mx_fake` for E4M3/E5M2 in fewer passes: a block's scaled values are finite unless
    the block holds an inf or NaN, and those blocks become NaN whole anyway."""
    blocks = _blocks(x, block_size)
    amax = blocks.abs().amax(dim=-1, keepdim=True)
    e = mx_scale_exponents(amax, fmt, rounding)
    out = _saturating_cast(blocks * exp2_int(-e), fmt) * exp2_int(e)
    return torch.where(torch.isfinite(amax), out, torch.nan).reshape(x.shape)


def quantize_mx(
    x: Tensor, element: str = "e4m3", block_size: int = 32, rounding: str = "rceil"
) -> MXTensor:
    """`x` in an MX format along its last dim (see the module docstring); `block_size` is
    an int >= 2 dividing the last dim."""
    _check_real(x, "quantize_mx")
    fmt = _format(element)
    MicroscalingConfig.check_block_size(block_size)
    elements, e, bad = _mx(x, fmt, block_size, rounding)
    scales = torch.where(bad, E8M0_NAN, e + E8M0_BIAS).squeeze(-1).to(torch.uint8)
    codes = encode_elements(elements, fmt).reshape(x.shape)
    return MXTensor(codes, scales, fmt.name, block_size)


def _mx_fake(x: Tensor, fmt: ElementFormat, block_size: int, rounding: str) -> Tensor:
    if fmt.name in _TORCH_FLOAT8:
        return _mx_fake_fp8(x, fmt, block_size, rounding)
    elements, e, bad = _mx(x, fmt, block_size, rounding)
    return torch.where(bad, torch.nan, elements * exp2_int(e)).reshape(x.shape)


@dataclass
class NVFP4Tensor:
    """A tensor in NVFP4: E2M1 codes (one per byte), E4M3 block-scale codes (one per 1x16
    block of the last dim, or per 16x16 tile of a matrix) and the float32 per-tensor decode
    scale ``s_dec``."""

    codes: Tensor
    block_scales: Tensor
    tensor_scale: Tensor
    two_d: bool = False

    def dequantize(self) -> Tensor:
        """``(element * block scale) * tensor scale`` in float32."""
        values = decode_elements(self.codes, E2M1)
        scales = decode_elements(self.block_scales, E4M3)
        blocks = _nv_blocks(values, self.two_d)
        out = (blocks * scales.unsqueeze(-1)) * self.tensor_scale
        return _nv_unblock(out, values.shape, self.two_d)


def _nv_blocks(x: Tensor, two_d: bool) -> Tensor:
    """x as (..., n_blocks, 16): 1x16 blocks of the last dim, or 16x16 tiles of a matrix
    (rows of tiles, then tiles along the row; 256 values each)."""
    size = MicroscalingConfig.NVFP4_BLOCK_SIZE
    if not two_d:
        return _blocks(x, size)
    if x.dim() != 2 or x.shape[0] % size or x.shape[1] % size:
        raise ValueError(
            f"16x16 NVFP4 tiles need a matrix whose dims are multiples of 16, got shape "
            f"{tuple(x.shape)}"
        )
    n, k = x.shape
    tiles = x.float().reshape(n // size, size, k // size, size).permute(0, 2, 1, 3)
    return tiles.reshape(n // size, k // size, size * size)


def _nv_unblock(blocks: Tensor, shape: torch.Size, two_d: bool) -> Tensor:
    if not two_d:
        return blocks.reshape(shape)
    size = MicroscalingConfig.NVFP4_BLOCK_SIZE
    n, k = shape
    tiles = blocks.reshape(n // size, k // size, size, size).permute(0, 2, 1, 3)
    return tiles.reshape(n, k)


def _nvfp4(x: Tensor, two_d: bool, noise: Tensor | None) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """(element values, block scale values, s_dec, non-finite-block mask), blocked."""
    x32 = x.float()
    finite = torch.where(torch.isfinite(x32), x32.abs(), 0.0)
    amax = finite.amax() if finite.numel() else finite.new_zeros(())  # amax() refuses empty
    s_enc = torch.where(amax > 0, NVFP4_TENSOR_MAX / amax, 1.0)
    s_enc = s_enc.clamp(max=_FLOAT32_MAX)  # a subnormal amax
    s_dec = 1.0 / s_enc
    blocks = _nv_blocks(x32, two_d)
    amax_b = blocks.abs().amax(dim=-1, keepdim=True)
    bad = ~torch.isfinite(amax_b)
    scale_b = round_to_element((amax_b / 6.0) * s_enc, E4M3)
    # 1 / (scale_b * s_dec) overflows for a block scale of 0 and for blocks of float32
    # subnormals in a tiny tensor (s_dec itself subnormal): inf * 0 was NaN
    encode = (1.0 / (scale_b * s_dec)).clamp(max=_FLOAT32_MAX)
    if noise is not None:
        noise = _nv_blocks(noise, two_d)
    elements = _round_to_element(blocks * encode, E2M1, noise)
    # zero-scale blocks hold zeros of x's signs (+0 lost a -0.0 the format holds)
    elements = torch.where(bad, 0.0, torch.where(scale_b == 0, blocks * 0.0, elements))
    return elements, torch.where(bad, torch.nan, scale_b), s_dec, bad


def quantize_nvfp4(x: Tensor, *, two_d: bool = False) -> NVFP4Tensor:
    """`x` in NVFP4: 1x16 blocks along the last dim, or 16x16 tiles of a matrix with
    `two_d` (see the module docstring)."""
    _check_real(x, "quantize_nvfp4")
    elements, scales, s_dec, _ = _nvfp4(x, two_d, None)
    block_scales = encode_elements(scales, E4M3).squeeze(-1)
    codes = encode_elements(_nv_unblock(elements, x.shape, two_d), E2M1)
    return NVFP4Tensor(codes, block_scales, s_dec, two_d)


def _nvfp4_fake(x: Tensor, two_d: bool, noise: Tensor | None) -> Tensor:
    elements, scales, s_dec, bad = _nvfp4(x, two_d, noise)
    out = torch.where(bad, torch.nan, (elements * scales) * s_dec)
    return _nv_unblock(out, x.shape, two_d)


def fake_quantize(
    x: Tensor, config: MicroscalingConfig, *, two_d: bool = False, stochastic: bool = False
) -> Tensor:
    """`x` quantized to `config`'s format and back (float32), in blocks along its last dim
    (NVFP4 `two_d`: 16x16 tiles of a matrix); `stochastic` rounds NVFP4 elements with
    noise from torch's default generator of x's device."""
    _check_real(x, "fake_quantize")
    if not isinstance(config, MicroscalingConfig):
        raise TypeError(
            f"fake_quantize takes a MicroscalingConfig (e.g. MicroscalingConfig('mxfp8') or "
            f"MicroscalingConfig.parse('mxfp8', 'floor')), got {type(config).__name__}"
        )
    if config.mode != "nvfp4":
        if two_d or stochastic:
            raise ValueError(
                f"two_d and stochastic are NVFP4's (its recipe's 16x16 weight tiles and "
                f"stochastic rounding of gradients), not {config.mode}'s"
            )
        return _mx_fake(x, _format(config.element), config.block_size, config.rounding)
    noise = torch.rand(x.shape, device=x.device) if stochastic else None
    return _nvfp4_fake(x, two_d, noise)


# --- the random Hadamard transform ----------------------------------------------------------

_RHT_SEED = 0x5EED


def _build_hadamard() -> Tensor:
    h = torch.ones(1, 1)
    while h.shape[0] < 16:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    gen = torch.Generator().manual_seed(_RHT_SEED)
    signs = torch.randint(0, 2, (16,), generator=gen).float() * 2 - 1
    return signs[:, None] * h / 4


_HADAMARD_CPU = _build_hadamard()


def hadamard_16(device: torch.device | str = "cpu") -> Tensor:
    """The 16x16 random Hadamard matrix ``diag(s) @ H16 / 4`` (Sylvester's H16, signs `s`
    drawn once from a fixed seed): orthogonal, so ``(a @ Q) @ (b @ Q)^T == a @ b^T``. A new
    copy each call: changing it changes no later transform."""
    return _hadamard_16(torch.device(device)).clone()


def _hadamard_16(device: torch.device) -> Tensor:
    """`hadamard_16`'s matrix on `device`, never handed out: `_HADAMARD_CPU`, made at import
    (a compiled graph then creates no random generator and mutates no cache), moved (16x16
    values) where the transform runs."""
    return _HADAMARD_CPU.to(device)


def _rht(x: Tensor) -> Tensor:
    """x (float32, last dim a multiple of 16) with each 16 consecutive values of its last dim
    multiplied by `hadamard_16`."""
    blocks = x.reshape(*x.shape[:-1], x.shape[-1] // 16, 16)
    return (blocks @ _hadamard_16(x.device)).reshape(x.shape)


def _pad_last(x: Tensor, multiple: int) -> Tensor:
    extra = -x.shape[-1] % multiple
    return torch.nn.functional.pad(x, (0, extra)) if extra else x


# --- training -------------------------------------------------------------------------------


class _BlockScaledMatmul(torch.autograd.Function):
    """``x @ weight.T`` with every GEMM's operands block-quantized along its reduced dim
    (forward, input gradient, weight gradient), emulated in float32; no bias."""

    @staticmethod
    def forward(
        ctx: Any, x: Tensor, weight: Tensor, config: MicroscalingConfig, out_dtype: torch.dtype
    ) -> Tensor:
        ctx.config, ctx.out_dtype = config, out_dtype
        ctx.x_dtype, ctx.w_dtype = x.dtype, weight.dtype
        with torch.autocast(x.device.type, enabled=False):
            x32, w32 = x.float(), weight.float()
            two_d = config.mode == "nvfp4" and config.two_d
            qw = fake_quantize(w32, config, two_d=two_d)
            if config.forward_rht:
                out = fake_quantize(_rht(x32), config) @ fake_quantize(_rht(w32), config).t()
            else:
                out = fake_quantize(x32, config) @ qw.t()
            ctx.save_for_backward(x, weight, qw if two_d else None)
            return out if out_dtype == torch.float32 else out.to(out_dtype)

    # the block rounding of the gradient and the operands passes no gradient, so a second
    # backward would miss its terms: `first_order` makes it raise
    @staticmethod
    def backward(ctx: Any, g: Tensor) -> tuple[Tensor | None, ...]:
        saved = ctx.saved_tensors  # read once: activation checkpointing unpacks them once
        compute = partial(_BlockScaledMatmul.gradients, ctx, g, saved)
        return first_order("MicroscalingLinear", compute, saved[1], g)

    @staticmethod
    def gradients(ctx: Any, g: Tensor, saved: tuple[Tensor, ...]) -> tuple[Tensor | None, ...]:
        """The backward's math on the `saved` tensors, without a graph."""
        config, out_dtype = ctx.config, ctx.out_dtype
        x, weight, qw_2d = saved
        grad_x = grad_w = None
        sr = config.mode == "nvfp4" and config.stochastic_gradients
        with torch.autocast(g.device.type, enabled=False):
            g32 = g.float()
            if ctx.needs_input_grad[0]:  # reduces over the outputs
                qw = qw_2d if qw_2d is not None else fake_quantize(weight.float().t(), config).t()
                grad_x = (fake_quantize(g32, config, stochastic=sr) @ qw).to(out_dtype)
            if ctx.needs_input_grad[1]:  # reduces over the tokens, padded to whole blocks
                multiple = math.lcm(config.block_size, 16)
                gt = _pad_last(g32.t(), multiple)
                xt = _pad_last(x.float().t(), multiple)
                if config.mode == "nvfp4" and config.rht:
                    gt, xt = _rht(gt), _rht(xt)
                qg = fake_quantize(gt, config, stochastic=sr)
                grad_w = (qg @ fake_quantize(xt, config).t()).to(out_dtype)
        return (
            None if grad_x is None else grad_x.to(ctx.x_dtype),
            None if grad_w is None else grad_w.to(ctx.w_dtype),
            None,
            None,
        )


class MicroscalingLinear(nn.Linear):
    """An `nn.Linear` whose matmuls run in a block-scaled format (`config`), emulated: see
    the module docstring for what each GEMM quantizes.

    The output comes out in the compute dtype (autocast's inside `torch.autocast`, else the
    input's); the bias is added in it, never quantized. Gradients are cast to the input's
    and the weight's dtypes. The weight and bias are the Linear's own parameters, so
    state-dict keys are a Linear's.
    """

    float_type = nn.Linear

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = True,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
        *,
        config: MicroscalingConfig | str = "mxfp8",
    ) -> None:
        super().__init__(in_features, out_features, bias, device=device, dtype=dtype)
        self._setup(config)

    def _setup(self, config: MicroscalingConfig | str) -> None:
        if isinstance(config, str):
            mode, slash, options = config.partition("/")
            config = MicroscalingConfig.parse(mode, options if slash else None)
        if not isinstance(config, MicroscalingConfig):
            raise TypeError(
                f"config must be a MicroscalingConfig or a mode name such as 'mxfp8/floor', "
                f"got {type(config).__name__}"
            )
        reason = config.shape_reason(self.in_features, self.out_features)
        if reason is not None:
            raise ValueError(f"{config.describe()} cannot quantize this Linear: {reason}")
        self.config = config
        self.quantization_mode = config.mode

    @classmethod
    def from_float(
        cls, linear: nn.Linear, config: MicroscalingConfig | str = "mxfp8"
    ) -> MicroscalingLinear:
        """A MicroscalingLinear holding `linear`'s own weight and bias parameters (no copy),
        with its training mode and hooks."""
        if not isinstance(linear, nn.Linear):
            raise TypeError(f"from_float needs an nn.Linear, got {type(linear).__name__}")
        new = cls.__new__(cls)
        nn.Module.__init__(new)
        new.in_features, new.out_features = linear.in_features, linear.out_features
        new.weight, new.bias = linear.weight, linear.bias
        new._setup(config)
        carry_hooks(linear, new)
        return new.train(linear.training)

    def to_float(self) -> nn.Linear:
        """A plain nn.Linear holding this module's parameters."""
        return plain_linear(self)

    def forward(self, x: Tensor) -> Tensor:
        if x.dim() == 0 or x.shape[-1] != self.in_features or not x.is_floating_point():
            raise ValueError(
                f"MicroscalingLinear({self.in_features}, {self.out_features}) needs a floating "
                f"input whose last dim is {self.in_features}, got {x.dtype} of shape "
                f"{tuple(x.shape)}"
            )
        device = x.device.type
        autocast = torch.is_autocast_enabled(device)
        out_dtype = torch.get_autocast_dtype(device) if autocast else x.dtype
        out = _BlockScaledMatmul.apply(
            x.reshape(-1, self.in_features), self.weight, self.config, out_dtype
        )
        out = out.reshape(*x.shape[:-1], self.out_features)
        if self.bias is not None:
            out = out + self.bias.to(out.dtype)
        return out

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, format={self.config.spelled()!r}"


# --- the block-scaled formats ------------------------------------------------------------

MICROSCALING_FAST_ON = (
    "no device through mixprec yet: its block-scaled (MX, NVFP4) matmuls are emulated "
    "everywhere; the hardware that runs them is NVIDIA Blackwell (compute capability 10.0+)"
)


def microscaling_support(info: DeviceInfo) -> Support:
    """How `info`'s device runs block-scaled (mxfp8/mxfp6/mxfp4/nvfp4) matmuls: emulated
    (quantize, dequantize, float32 matmul) on every device, since mixprec has no kernel path
    for them (they need NVIDIA Blackwell's block-scaled tensor cores)."""
    if info.type == "cuda":
        major, minor = info.capability or (0, 0)
        where = (
            "this GPU has block-scaled tensor cores, but mixprec has no kernel path for them"
            if major >= 10
            else f"compute capability {major}.{minor} has no block-scaled tensor cores"
        )
        return Support(Status.SLOW, f"block-scaled matmuls are emulated in float32 ({where})")
    return Support(
        Status.SLOW,
        f"no block-scaled matmul hardware on {info.type}: emulated in float32 (quantize, "
        "dequantize, float32 matmul), slower than float32",
    )


class MicroscalingFormat(Format):
    """One block-scaled format (mxfp8, mxfp6, mxfp4, nvfp4) on Linear layers
    (`MicroscalingLinear`, emulated); its options are `MicroscalingConfig`'s, after a '/'
    ("mxfp8/floor", "nvfp4/2d:rht:sr")."""

    accepted = "the block-scaled " + MicroscalingConfig.accepted()
    config_keys = {"options": "the ':'-separated options of a microscaling mode"}
    fast_on = MICROSCALING_FAST_ON

    def __init__(self, mode: str) -> None:
        self.name = MicroscalingConfig(mode).mode

    def parse(
        self, options: str | None, keywords: Mapping[str, Any], name: str
    ) -> MicroscalingConfig:
        return MicroscalingConfig.parse(self.name, options, name)

    def spell(self, config: MicroscalingConfig) -> str:
        return config.spelled()

    def describe(self, config: MicroscalingConfig) -> str:
        return config.describe()

    def skip(self, config: MicroscalingConfig, module: nn.Module) -> str | None:
        shape = config.shape_reason(module.in_features, module.out_features)
        return None if shape is None else f"does not fill whole blocks: {shape}"

    def swap(
        self,
        module: nn.Module,
        config: MicroscalingConfig,
        *,
        path: str,
        storage: torch.dtype,
        tie: tuple[Any, ...],
        memo: dict[Any, Any],
    ) -> nn.Module:
        return MicroscalingLinear.from_float(module, config)

    def layer_config(self, layer: nn.Module) -> MicroscalingConfig:
        return layer.config

    def rate(self, info: DeviceInfo) -> Support:
        return microscaling_support(info)


MICROSCALING_FORMATS = tuple(MicroscalingFormat(mode) for mode in MicroscalingConfig.MODES)
