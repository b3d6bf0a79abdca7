"""The block-scaled formats' numbers in pure PyTorch, bit-exact on any device: the small
float element formats, MX blocks (OCP MX v1.0: MXFP8/MXFP6/MXFP4) and NVIDIA's NVFP4.

Element formats (sign, exponent, mantissa bits; bias; max; specials): E4M3 (1-4-3, 7, 448,
S.1111.111 is NaN, no inf), E5M2 (1-5-2, 15, 57344, IEEE inf/NaN), E2M3 (1-2-3, 1, 7.5),
E3M2 (1-3-2, 3, 28), E2M1 (1-2-1, 1, 6); the FP6/FP4 ones have no inf or NaN. Casting a value
to an element rounds to nearest, ties to even, keeps subnormals and the sign of zero, and
saturates finite values to +-max; inf and NaN become NaN.

MX blocks (`quantize_mx`): `block_size` consecutive elements of the last dim share a scale
``X = 2**e`` stored as an E8M0 code ``e + 127`` (exponents -127..127; 0xFF is NaN).
"floor" (the spec): ``e = floor(log2(amax)) - emax``, emax the exponent of the element's max,
so values above ``max * X`` saturate. "rceil": the smallest e with ``amax <= max * 2**e``.
An all-zero block gets ``e = -127``; a block holding an inf or NaN gets the NaN scale and
decodes to NaN whole (its element codes stored as 0). Elements are ``cast(x / X)``.

NVFP4 (`quantize_nvfp4`, the equations of NVIDIA's NVFP4 pretraining paper, in float32): the
tensor's finite amax gives ``s_enc = 6 * 448 / amax`` (1 for an all-zero or empty tensor) and
``s_dec = 1 / s_enc``; each block of 16 (1x16 along the last dim, or 16x16 tiles of a matrix)
stores ``e4m3(amax_b / 6 * s_enc)`` and its elements ``e2m1(x * (1 / (scale_b * s_dec)))``,
the encode factor clamped to float32's max; decoding is ``(element * scale_b) * s_dec``. A
block whose scale rounds to 0 holds zeros (of its values' signs); one holding an inf or NaN
gets the E4M3 NaN scale (0x7F) and decodes to NaN.

All scaling is by exact powers of two (built from bits, never ``exp2``) or by single IEEE
float32 operations, so results do not depend on the CPU's instruction set.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from mixprec.formats.microscaling import MicroscalingConfig

__all__: list[str] = []

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
    return _round_to_element(*_checked(v, element, noise))


def _round_to_element(v: Tensor, fmt: ElementFormat, noise: Tensor | None) -> Tensor:
    """`round_to_element` of float32 `v` with `noise` unchecked: the layers' own noise comes
    from ``torch.rand``, and checking its values would make ``torch.compile`` read them."""
    if noise is None and fmt.name in _TORCH_FLOAT8:
        return torch.where(torch.isfinite(v), _saturating_cast(v, fmt), torch.nan)
    return _round_by_definition(v, fmt, noise)


def _checked(
    v: Tensor, element: str | ElementFormat, noise: Tensor | None
) -> tuple[Tensor, ElementFormat, Tensor | None]:
    """The arguments of a public rounding, checked: `v` as float32, the element format,
    the noise (None, or uniform values in [0, 1) of v's shape)."""
    fmt = _format(element)
    v = v.float()
    if noise is not None:
        _check_noise(noise, v)
    return v, fmt, noise


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
    return _round_by_definition(*_checked(v, element, noise))


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
        # (-1.0 + 1.0 is +0.0: a negative value rounded up to zero keeps its sign, as -0.0)
        rounded = torch.copysign(rounded, scaled)
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


_FLOAT32_MAX = torch.finfo(torch.float32).max


def _times_scale(values: Tensor, e: Tensor) -> Tensor:
    """Elements times their block's power of two, saturated to float32's range: an element
    rounded up under a scale near float32's largest (``rceil`` on a block of 3.4e38: 256 *
    2^120) is 2^128, beyond float32, and would decode to inf from finite values."""
    return (values * exp2_int(e)).clamp(-_FLOAT32_MAX, _FLOAT32_MAX)


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
        out = torch.where(codes == E8M0_NAN, torch.nan, _times_scale(values, codes - E8M0_BIAS))
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
    out = _times_scale(_saturating_cast(blocks * exp2_int(-e), fmt), e)
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
    return torch.where(bad, torch.nan, _times_scale(elements, e)).reshape(x.shape)


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


# a tensor's largest magnitude below which NVFP4's scales are taken on the tensor scaled up
# (`_nvfp4`): s_enc = 2688 / amax and the encode factors stay far inside float32's range
_TINY_AMAX = 2.0**-64


def _nvfp4(x: Tensor, two_d: bool, noise: Tensor | None) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """(element values, block scale values, s_dec, non-finite-block mask), blocked."""
    x32 = x.float()
    finite = torch.where(torch.isfinite(x32), x32.abs(), 0.0)
    amax = finite.amax() if finite.numel() else finite.new_zeros(())  # amax() refuses empty
    # A tensor whose largest magnitude is tiny is scaled up by 2^64 (twice at most: exact)
    # first, its s_dec down by as much at the end: its s_enc, and the blocks' encode factors
    # beside a subnormal s_dec, overflow float32 (clamped apart, elements encoded with one
    # factor decoded with another). NVFP4's codes do not depend on the tensor's scale:
    # elsewhere nothing changes, bit for bit.
    # (float32 factors: two Python numbers would give torch's default dtype, which a
    # "true" policy sets in the forward and backward: 2^64 is inf in float16)
    up = torch.full_like(amax, 2.0**64)
    ups = []
    for _ in range(2):
        ups.append(torch.where((amax > 0) & (amax < _TINY_AMAX), up, 1.0))
        x32, amax = x32 * ups[-1], amax * ups[-1]
    # (a division: a number over a tensor is its reciprocal times the number in torch, two
    # roundings, a float32 ulp off s_enc for a quarter of amaxes)
    s_enc = torch.where(amax > 0, torch.full_like(amax, NVFP4_TENSOR_MAX) / amax, 1.0)
    s_dec = 1.0 / s_enc
    blocks = _nv_blocks(x32, two_d)
    amax_b = blocks.abs().amax(dim=-1, keepdim=True)
    bad = ~torch.isfinite(amax_b)
    scale_b = round_to_element((amax_b / 6.0) * s_enc, E4M3)
    # 1 / (scale_b * s_dec) overflows for a block scale of 0: inf * 0 was NaN
    encode = (1.0 / (scale_b * s_dec)).clamp(max=_FLOAT32_MAX)
    if noise is not None:
        noise = _nv_blocks(noise, two_d)
    elements = _round_to_element(blocks * encode, E2M1, noise)
    # zero-scale blocks hold zeros of x's signs (+0 lost a -0.0 the format holds)
    elements = torch.where(bad, 0.0, torch.where(scale_b == 0, blocks * 0.0, elements))
    for up in ups:  # (one factor at a time: 2^128 is past float32)
        s_dec = s_dec / up
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
    float32 noise (whatever torch's default dtype) from the default generator of x's
    device."""
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
    # float32 noise, not the default dtype's (a "true" policy's backward sets it): 8-bit
    # bfloat16 noise never rounds up a value within 1/256 of a step above a grid point
    noise = torch.rand(x.shape, dtype=torch.float32, device=x.device) if stochastic else None
    return _nvfp4_fake(x, two_d, noise)
