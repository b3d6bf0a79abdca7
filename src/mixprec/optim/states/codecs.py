"""The registry of optimizer-state formats: each kind of storage for a moment (``float32``,
``int8``, ``int4``, ``float8``, ...) is one `StateCodec` object, registered once, that the
rest of mixprec reads through `StateFormat` (`mixprec.optim.states.formats`).

A codec says, in one place: its name and the other names it accepts (``fp8`` for
``float8``); its default block (None for a format stored as torch stores it, in float32);
the dtype and count of its codes (`code_count`: int4 packs two per byte) and so the bytes a
moment takes; its code maps (the values its codes index, or none when the codes are
values); and how a moment is stored and read back: `zeros`, `encode` and `decode` on blocks
of a flat float32 tensor, shape ``(blocks, block)``, one float32 scale per block. The
optimizers, their checkpoints, the policy map's ``states`` rules, ``explain``, the doctor
and the format search ask the format's codec, never a kind by name, so adding a format is
one subclass of `StateCodec` and one `register_state_format` call.

The builtin codecs (see `mixprec.optim.states.formats` for the maps and why):

- ``float32``: as torch keeps moments (``exp_avg``, ...); nothing encoded.
- ``int8`` (block 256): an index into a dynamic code map; the second moment stored as its
  square root, the block's scale negated to mark it.
- ``int4`` (block 128): a 4-bit index, two per byte; the second moment's square root on a
  linear map without zero, the block's scale negated to mark it.
- ``float8`` (block 256; also spelled ``fp8``): float8 e4m3 codes of the element over its
  block's scale; the second moment stored as its square root.
"""

from __future__ import annotations

import dataclasses
import math
from typing import ClassVar

import torch

__all__ = [
    "Float32Codec",
    "Float8Codec",
    "Int4Codec",
    "Int8Codec",
    "StateCodec",
    "register_state_format",
    "state_codec",
    "state_codecs",
    "unregister_state_format",
]

# e4m3's largest finite value: a block's largest magnitude maps onto it
FP8_MAX = 448.0
# e4m3's smallest positive (subnormal) value: the least a positive second moment's root keeps
_FP8_TINY = 2.0**-9
# the least a positive second moment decodes to (float32's smallest normal number): a block
# whose largest value is itself tiny would otherwise underflow its smallest codes to 0
SMALLEST_V = torch.finfo(torch.float32).tiny


class StateCodec:
    """One kind of optimizer-state storage. Subclass it, set the class attributes, override
    `encode` and `decode` (and what else differs), and `register_state_format` an instance.

    Attributes:
        name: the kind as specs spell it (``"int8"``); lower case, no ``/``.
        aliases: other spellings accepted for it (``("fp8",)``); output spells `name`.
        default_block: elements per float32 scale when a spec gives none; None for a
            format kept as torch keeps moments (float32, no blocks, no codes).
        code_dtype: the dtype of the codes tensor.
        description: what it stores, in a few words, for messages and docs.
    """

    name: ClassVar[str] = ""
    aliases: ClassVar[tuple[str, ...]] = ()
    default_block: ClassVar[int | None] = None
    code_dtype: ClassVar[torch.dtype] = torch.uint8
    description: ClassVar[str] = ""

    def __init__(self) -> None:
        self._tables: dict[tuple[bool, torch.device], torch.Tensor] = {}

    @property
    def quantized(self) -> bool:
        """Whether a moment is stored in blocks of codes (False: float32, as torch)."""
        return self.default_block is not None

    def check_block(self, block: object) -> int:
        """``block`` if this format takes it (an even integer >= 2), else ``ValueError``."""
        if isinstance(block, bool) or not isinstance(block, int) or block < 2 or block % 2:
            raise ValueError(
                f"the block size of a {self.name} state must be an even integer >= 2, got {block!r}"
            )
        return block

    def code_count(self, padded: int) -> int:
        """Elements of the codes tensor of a moment of ``padded`` elements (whole blocks;
        any ``numel`` for a format without blocks)."""
        return padded

    def code_bytes(self, padded: int) -> int:
        """Bytes of the codes of a moment of ``padded`` elements."""
        return self.code_count(padded) * self.code_dtype.itemsize

    def code_map(self, signed: bool) -> torch.Tensor | None:
        """The sorted float32 values the codes index (a code is its value's position), for
        the first moment (``signed``) or the second; None when the codes are values."""
        return None

    def table(self, signed: bool, device: torch.device) -> torch.Tensor:
        """What `encode` and `decode` read on ``device``, made once: the `code_map` there,
        or an empty tensor for a format without one."""
        key = (signed, torch.device(device))
        if key not in self._tables:
            values = self.code_map(signed)
            self._tables[key] = (
                torch.empty(0, device=device) if values is None else values.to(device)
            )
        return self._tables[key]

    def zeros(self, blocks: int, block: int, device: torch.device) -> tuple[torch.Tensor, ...]:
        """(codes, scales) of a zero moment of ``blocks`` blocks of ``block`` elements."""
        codes = torch.zeros(self.code_count(blocks * block), dtype=self.code_dtype, device=device)
        return codes, torch.zeros(blocks, dtype=torch.float32, device=device)

    def encode(
        self, x: torch.Tensor, signed: bool, table: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(flat codes, float32 scales, one per block) of the float32 blocks ``x``, shape
        (blocks, block); ``signed``: a first moment (else ``x >= 0``, a second moment);
        ``table``: `table` for ``signed`` on ``x``'s device. Runs eagerly and inside the
        compiled step (elementwise and per-block reductions only)."""
        raise NotImplementedError(f"state format {self.name!r} defines no encode")

    def decode(
        self,
        codes: torch.Tensor,
        scales: torch.Tensor,
        block: int,
        signed: bool,
        table: torch.Tensor,
    ) -> torch.Tensor:
        """The float32 blocks, shape (blocks, block), that `encode` stored as ``codes`` and
        ``scales``."""
        raise NotImplementedError(f"state format {self.name!r} defines no decode")

    def encode_tensor(
        self, x: torch.Tensor, signed: bool, table: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """`encode` of a tensor stored once (`formats.quantize`, a saved activation), not a
        moment stepped in the update: a codec may keep there what costs the update more than
        a moment needs (float8 keeps infinities). `encode` by default."""
        return self.encode(x, signed, table)

    def decode_tensor(
        self,
        codes: torch.Tensor,
        scales: torch.Tensor,
        block: int,
        signed: bool,
        table: torch.Tensor,
    ) -> torch.Tensor:
        """The blocks `encode_tensor` stored (`decode` by default)."""
        return self.decode(codes, scales, block, signed, table)

    def __repr__(self) -> str:
        return f"<state format {self.name}>"


# every registered codec by name, in the order registered (the builtin ones first), and the
# aliases by the name they stand for
_CODECS: dict[str, StateCodec] = {}
_ALIASES: dict[str, str] = {}
_GENERATION = [0]  # bumped by each change: parsed specs are remembered per generation


def generation() -> int:
    """A number that changes whenever a codec is registered or unregistered."""
    return _GENERATION[0]


def register_state_format(codec: StateCodec) -> StateCodec:
    """Add ``codec`` to the registry (its name and aliases must be free) and return it."""
    if not isinstance(codec, StateCodec):
        raise TypeError(
            f"register_state_format takes a StateCodec instance, not {type(codec).__name__}"
        )
    names = (codec.name, *codec.aliases)
    for name in names:
        if not isinstance(name, str) or not name or name != name.strip().lower() or "/" in name:
            raise ValueError(
                f"a state format's name is lower case, without blanks or '/', got {name!r} "
                f"from {type(codec).__name__}"
            )
        if name in _CODECS or name in _ALIASES:
            raise ValueError(f"a state format named {name!r} is registered already")
    if codec.default_block is not None:
        codec.check_block(codec.default_block)
    _CODECS[codec.name] = codec
    for alias in codec.aliases:
        _ALIASES[alias] = codec.name
    _GENERATION[0] += 1
    return codec


def unregister_state_format(name: str) -> StateCodec:
    """Remove the state format ``name`` (and its aliases) from the registry; returns it."""
    if name not in _CODECS:
        raise KeyError(f"no state format named {name!r} is registered")
    codec = _CODECS.pop(name)
    for alias in codec.aliases:
        _ALIASES.pop(alias, None)
    _GENERATION[0] += 1
    return codec


def state_codecs() -> tuple[StateCodec, ...]:
    """The registered codecs, in the order they were registered."""
    return tuple(_CODECS.values())


def state_codec(name: str) -> StateCodec | None:
    """The registered codec called ``name`` or one of its aliases, or None."""
    codec = _CODECS.get(name)
    if codec is None and name in _ALIASES:
        codec = _CODECS.get(_ALIASES[name])
    return codec


# -- float32 ------------------------------------------------------------------------------------


class Float32Codec(StateCodec):
    """Moments kept as torch keeps them: float32 tensors of the parameter's shape (the
    optimizers store them under torch's keys; `encode` here is a copy, for symmetry)."""

    name = "float32"
    default_block = None
    code_dtype = torch.float32
    description = "float32, as torch keeps moments"

    def check_block(self, block: object) -> int:
        raise ValueError("a float32 state has no blocks: drop the block size")

    def zeros(self, blocks: int, block: int, device: torch.device) -> tuple[torch.Tensor, ...]:
        n = blocks * block
        return torch.zeros(n, device=device), torch.zeros(0, device=device)

    def encode(self, x, signed, table):  # type: ignore[no-untyped-def]
        return x.reshape(-1).to(torch.float32), x.new_zeros(0, dtype=torch.float32)

    def decode(self, codes, scales, block, signed, table):  # type: ignore[no-untyped-def]
        return codes.to(torch.float32).view(-1, block)


# -- the dynamic maps (int8, int4) --------------------------------------------------------------


def dynamic_map(bits: int, signed: bool, exponent_bits: int) -> list[float]:
    """The dynamic tree code map, sorted: for each decade ``10^-e`` (``e`` from
    ``exponent_bits - 1`` down to 0) the midpoints of an even split of [0.1, 1] times the
    decade, into as many parts as the fraction bits left after the decade's marker give;
    then 0 and 1. A signed map also holds the negatives of these values and -1, and drops
    its smallest positive value to make room: a block whose largest magnitude is negative
    keeps it exactly, as one whose largest is positive does (the paper's map has no -1, so
    the former would shrink by half its top step every time). ``2^bits`` values."""
    free = bits - 1  # the bits after the sign (an unsigned map uses it as a fraction bit)
    magnitudes = []
    for i in range(exponent_bits):
        parts = 2 ** (i + free - exponent_bits + (0 if signed else 1))
        decade = 10.0 ** (i - exponent_bits + 1)
        for j in range(parts):
            low = 0.1 + 0.9 * j / parts
            high = 0.1 + 0.9 * (j + 1) / parts
            magnitudes.append(decade * (low + high) / 2)
    values = [0.0, *magnitudes, 1.0]
    if signed:
        values = [-1.0, *(-m for m in magnitudes), 0.0, *magnitudes[1:], 1.0]
    assert len(values) == 2**bits, (bits, signed, len(values))
    return sorted(values)


@dataclasses.dataclass(frozen=True)
class _Decades:
    """A dynamic map's decades as the arithmetic nearest code reads them, from decade 0
    (smallest) up: in each, the position ``a * slope + offset`` of a magnitude ``a`` on the
    decade's even split, counted in codes from the map's first magnitude (its floor is the
    code of the part ``a`` falls in, whose midpoint is the nearest value), and the decade's
    last code (a magnitude past the decade's top, but nearer its last value than the next
    decade's first, lands one part beyond), which is ``floor(offset * end_slope +
    end_offset)`` in every decade (both grow as the decade's parts); the magnitudes past
    which the next decade's first value is nearer than this one's last (``uppers``); below
    ``zero`` the nearest value is 0 (on the positive side of a signed map, which lacks index
    0: below ``zero_positive``, else index 1); above ``one``, 1, code ``last``."""

    slopes: tuple[float, ...]
    offsets: tuple[float, ...]
    end_slope: float
    end_offset: float
    uppers: tuple[float, ...]
    zero: float
    zero_positive: float
    one: float
    last: int


def _decades(bits: int, exponent_bits: int, signed: bool) -> _Decades:
    """`_Decades` of the map `dynamic_map` builds with these arguments."""
    base = bits - 1 - exponent_bits + (0 if signed else 1)
    parts = [2 ** (i + base) for i in range(exponent_bits)]
    starts = [2**base * (2**i - 1) for i in range(exponent_bits)]
    tops = [10.0 ** (i - exponent_bits + 1) for i in range(exponent_bits)]

    def value(i: int, j: int) -> float:
        return tops[i] * (0.1 + 0.9 * (j + 0.5) / parts[i])

    uppers = tuple((value(i, parts[i] - 1) + value(i + 1, 0)) / 2 for i in range(exponent_bits - 1))
    second = value(0, 1) if parts[0] > 1 else value(1, 0)
    # (a / top - 0.1) * parts / 0.9 + start, folded into one multiply and one add
    slopes = tuple(n / (0.9 * top) for n, top in zip(parts, tops, strict=True))
    offsets = tuple(s - 0.1 * n / 0.9 for s, n in zip(starts, parts, strict=True))
    # the last code, start + parts - 1, from offset = start - parts / 9 and start = 2^base
    # (2^i - 1), parts = 2^(base + i): 9/4 offset + 5/4 2^base - 1 (+ 1/2 for the floor)
    end_slope, end_offset = 2.25, 1.25 * 2**base - 0.5
    ends = torch.floor(torch.tensor(offsets) * end_slope + end_offset)
    assert ends.tolist() == [float(s + n - 1) for s, n in zip(starts, parts, strict=True)]
    return _Decades(
        slopes=slopes,
        offsets=offsets,
        end_slope=end_slope,
        end_offset=end_offset,
        uppers=uppers,
        zero=value(0, 0) / 2,
        zero_positive=second / 2,
        one=(value(exponent_bits - 1, parts[-1] - 1) + 1) / 2,
        last=starts[-1] + parts[-1],
    )


def dynamic_nearest(y: torch.Tensor, d: _Decades, signed: bool) -> torch.Tensor:
    """The code of the dynamic map value nearest each element of ``y`` by arithmetic (a
    tie to either side, one rounding apart): the decade from comparisons with the
    magnitudes between decades, the part of its even split the magnitude falls in (whose
    midpoint is the decade's nearest value), then 0 and 1 at the ends. float32 (whole
    numbers): a float becomes a uint8 code by one vectorized conversion on every CPU, where
    int32 to uint8 runs element by element on AVX2."""
    a = y.abs()
    a = torch.where(a <= 1.0, a, 1.0)  # (a NaN: the code of +-1)
    slope = torch.full_like(a, d.slopes[0])
    offset = torch.full_like(a, d.offsets[0])
    for i, upper in enumerate(d.uppers, start=1):
        above = a > upper
        slope = torch.where(above, d.slopes[i], slope)
        offset = torch.where(above, d.offsets[i], offset)
    end = torch.floor(offset * d.end_slope + d.end_offset)
    t = torch.minimum(torch.floor(a * slope + offset), end)
    t = torch.where(a > d.one, float(d.last), t)  # the magnitude's index, 1 as the last
    if not signed:  # 0 first, then the magnitudes
        return torch.where(a < d.zero, 0.0, t + 1.0)
    # the magnitude's distance from 0's code: its index + 1 on the negative side; on the
    # positive side, which lacks index 0 (-1 took its place), the index itself, at least 1
    negative = y < 0  # (-0: the code of 0 either way)
    k = torch.where(negative, t + 1.0, t.clamp_min(1.0))
    k = torch.where(a < torch.where(negative, d.zero, d.zero_positive), 0.0, k)
    half = float(d.last + 1)  # the code of 0: after -1 and the negative magnitudes
    return torch.where(negative, half - k, half + k)


# whether torch's CPU kernels (and inductor's, which read the same cap) use AVX2 at most
_AVX2 = torch.backends.cpu.get_cpu_capability() == "AVX2"


def _read(table: torch.Tensor, codes: torch.Tensor, vectorized: bool = True) -> torch.Tensor:
    """The values of ``table`` at the flat uint8 ``codes`` (every code in its range), by
    ``torch.gather``: compiled, a plain read per element where indexing adds a negative
    index's wrap-around and a clamp (about a third longer in the update). The index goes
    int32 then int64 (uint8 to int64 directly runs element by element).

    ``vectorized=False`` takes the index through int16 on an AVX2 CPU: inductor vectorizes
    no loop that holds an int16 value, so the update's loop around the read runs element by
    element. Measured on the small MLP's compiled update, capped to AVX2: int8's takes 310-350
    us vectorized against 530-620 element by element, while int4's and float8's (whose
    vectorized loops recompute their decodes in every loop nest that reads them) take
    450-500 element by element against 780-900 vectorized."""
    if not vectorized and _AVX2 and codes.device.type == "cpu":
        index = codes.to(torch.int16).to(torch.int32)
    else:
        index = codes.to(torch.int32)
    return torch.gather(table, 0, index.reshape(-1).to(torch.int64))


def _over(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Each block of ``x`` over its ``scale`` (a zero scale: over 1), by one reciprocal a
    block and a multiply an element, as a division an element costs several times more; a
    scale below float32's smallest normal number is first scaled up by 2^64 with its block
    (exact), so that its reciprocal stays finite."""
    up = torch.where(scale < SMALLEST_V, 2.0**64, 1.0)
    safe = torch.where(scale > 0, scale * up, 1.0)
    return (x * up[:, None]) * (1.0 / safe)[:, None]


def _scaled(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(``x`` over each block's largest magnitude, that magnitude)."""
    absmax = x.abs().amax(dim=1)
    return _over(x, absmax), absmax


def _root_scaled(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(the square root of ``x`` (a second moment, >= 0 or NaN) over each block's largest
    root, that root). The largest root is taken as the root of the block's largest ``x``:
    the same number, as the square root is correctly rounded and never decreasing, for one
    root a block where a largest root takes one an element (a second pass over the block)."""
    absmax = x.amax(dim=1).sqrt().abs()  # (abs: a block of -0.0 has the scale +0.0)
    return _over(x.sqrt(), absmax), absmax


def _at_least_tiny(v: torch.Tensor, values: torch.Tensor, magnitude: torch.Tensor) -> torch.Tensor:
    """``v`` with every element of a positive code and scale at least float32's smallest
    normal number: a positive second moment never decodes to 0."""
    return torch.where((values > 0) & (magnitude > 0), v.clamp_min(SMALLEST_V), v)


class Int8Codec(StateCodec):
    """8-bit indices into the dynamic tree maps (7 exponent bits). The unsigned moment is
    stored as its square root, the block's scale negated to mark it; a block with a positive
    scale holds codes of ``v`` itself (states saved before int8 kept roots) and decodes as
    then. A positive root below half the map's smallest positive value takes that value's
    code, never 0's."""

    name = "int8"
    default_block = 256
    description = "8-bit dynamic-map codes, one float32 scale per block"
    _D = {True: _decades(8, 7, True), False: _decades(8, 7, False)}

    def code_map(self, signed: bool) -> torch.Tensor:
        return torch.tensor(dynamic_map(8, signed, 7), dtype=torch.float32)

    def nearest(self, y: torch.Tensor, signed: bool) -> torch.Tensor:
        """The code of the map value nearest each element of ``y`` (in [-1, 1]), as a
        float32 whole number."""
        return dynamic_nearest(y, self._D[signed], signed)

    def encode(self, x, signed, table):  # type: ignore[no-untyped-def]
        y, absmax = _scaled(x) if signed else _root_scaled(x)
        codes = self.nearest(y, signed)
        if not signed:  # a positive root below half the smallest positive value takes its code
            codes = torch.where(y > 0, codes.clamp_min(1), codes)
            absmax = -absmax  # negated: the block's codes are of roots
        return codes.reshape(-1).to(torch.uint8), absmax

    def decode(self, codes, scales, block, signed, table):  # type: ignore[no-untyped-def]
        values = _read(table, codes).view(-1, block)
        if signed:
            return values * scales[:, None]
        magnitude = scales.abs()[:, None]
        stored = values * magnitude
        v = torch.where(scales[:, None] < 0, stored * stored, stored)
        return _at_least_tiny(v, values, magnitude)


def pack4(codes: torch.Tensor) -> torch.Tensor:
    """Pairs of 4-bit uint8 ``codes`` in one byte each, the first in the low half: through
    each pair read as one little-endian int16, so that the loop runs over contiguous
    elements (a pair's stride-2 reads do not vectorize)."""
    pairs = codes.view(torch.int16)
    return ((pairs & 0x0F) | ((pairs >> 4) & 0xF0)).to(torch.uint8)


def unpack4(packed: torch.Tensor) -> torch.Tensor:
    """The uint8 codes `pack4` packed, two per byte, in order (the reverse computation)."""
    wide = packed.to(torch.int16)
    return ((wide & 0x0F) | ((wide & 0xF0) << 4)).view(torch.uint8)


class Int4Codec(StateCodec):
    """4-bit indices, two per byte (the first in the low half): the signed dynamic map with
    3 exponent bits for the first moment; for the second a linear map without zero, 1/16 ..
    16/16 (a second moment rounded to zero turns ``m / sqrt(v)`` into a huge step), of its
    square root, the block's scale negated to mark it, as int8 stores it: the map's floor
    (which shrinks an update, never grows one) then lifts a ``v`` under 1/1024 of the
    block's largest, where on ``v`` itself it lifted every one under 1/32. A block with a
    positive scale holds codes of ``v`` itself (states saved before int4 kept roots) and
    decodes as then."""

    name = "int4"
    default_block = 128
    description = "4-bit codes, two per byte, one float32 scale per block"
    _D = _decades(4, 3, True)

    def code_count(self, padded: int) -> int:
        return padded // 2

    def code_map(self, signed: bool) -> torch.Tensor:
        values = dynamic_map(4, True, 3) if signed else [k / 16 for k in range(1, 17)]
        return torch.tensor(values, dtype=torch.float32)

    def nearest(self, y: torch.Tensor, signed: bool) -> torch.Tensor:
        """The code of the map value nearest each element of ``y``, as a float32 whole
        number: the dynamic map's by arithmetic, the linear map's by rounding."""
        if not signed:
            return (torch.ceil(y * 16 - 0.5) - 1).clamp(0, 15)
        return dynamic_nearest(y, self._D, True)

    def encode(self, x, signed, table):  # type: ignore[no-untyped-def]
        y, absmax = _scaled(x) if signed else _root_scaled(x)
        codes = self.nearest(y, signed)
        # (a second moment's scale negated: the block's codes are of roots)
        return pack4(codes.reshape(-1).to(torch.uint8)), absmax if signed else -absmax

    def decode(self, codes, scales, block, signed, table):  # type: ignore[no-untyped-def]
        if signed or (_AVX2 and codes.device.type == "cpu"):
            values = _read(table, unpack4(codes), vectorized=False).view(-1, block)
        else:  # the linear map's value k/16 of code k - 1 by arithmetic (exact), as a table
            # read costs the compiled update more than the rest of the moment's decode; not
            # on AVX2, where the update's loop then runs element by element
            values = (unpack4(codes).to(torch.float32) + 1.0).reshape(-1, block) * 0.0625
        if signed:
            return values * scales[:, None]
        # an infinite scale (a second moment past float32's range: a huge finite gradient)
        # decodes as NaN, so that the step's weights show it as int8's and float8's do: as
        # infinities, with no code below 1/16, the whole block's updates would be 0, frozen
        magnitude = scales.abs()
        magnitude = torch.where(magnitude == math.inf, math.nan, magnitude)[:, None]
        stored = values * magnitude
        v = torch.where(scales[:, None] < 0, stored * stored, stored)
        return _at_least_tiny(v, values, magnitude)


# the float32 value of each e4m3 byte (NaN for the two NaN codes): a table read in place of
# the conversion, which AVX2 CPUs run element by element (the same values bit for bit)
_E4M3_VALUES = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).to(torch.float32)


def _e4m3(y: torch.Tensor) -> torch.Tensor:
    """``y.to(torch.float8_e4m3fn)`` from the bits of float32 ``y``, bit for bit as torch
    converts (round to nearest even, subnormals, past 448 saturated to 448, NaN to NaN): in
    integer operations that vectorize on AVX2, where torch's conversion does not."""
    bits = y.view(torch.int32)
    magnitude = bits & 0x7FFFFFFF
    # a normal e4m3 (from 2^-6): the exponent rebiased from 127 to 7, three mantissa bits
    # kept, rounded to nearest even by adding just under half the dropped part and its low bit
    normal = ((magnitude + 0x7FFFF + ((magnitude >> 20) & 1)) >> 20) - (120 << 3)
    subnormal = torch.round(y.abs() * 512.0).to(torch.int32)  # multiples of 2^-9
    code = torch.where(magnitude < 0x3C800000, subnormal, normal)  # (2^-6)
    code = torch.where(magnitude > 0x43E00000, 0x7E, code)  # past 448 (inf too): 448
    code = torch.where(magnitude > 0x7F800000, 0x7F, code)  # NaN
    code = code | ((bits >> 24) & 0x80)
    # (through float32: int32 to uint8 runs element by element on AVX2 too)
    return code.to(torch.float32).to(torch.uint8).view(torch.float8_e4m3fn)


def _finite_amax(a: torch.Tensor) -> torch.Tensor:
    """Each block's largest element of ``a`` (magnitudes, or a second moment: >= 0 or NaN),
    infinities left out: NaN where the block holds a NaN."""
    return torch.where(a == torch.inf, 0.0, a).amax(dim=1)


def _coded_infinities(y: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """``y`` (``x`` over its block's scale, which is finite, so that ``y`` is infinite where
    ``x`` is, and of ``x``'s sign everywhere) with +-inf as NaN of the same sign: e4m3 has no
    infinity, and a conversion saturates one to +-448, so an infinity takes the NaN code of
    its sign (0x7F, 0xFF). By a select and a ``copysign``, which vectorize (a float32 value's
    bits as int32 and back are two element-by-element copies in inductor's CPU code, which
    doubled the encode's time), the select reading ``x`` (a fused kernel's input, where
    ``y``'s magnitude would be computed again)."""
    return torch.copysign(torch.where(x.abs() == torch.inf, torch.nan, y), x)


class Float8Codec(StateCodec):
    """float8 e4m3 codes of the element over its block's scale (the block's largest
    magnitude over 448, e4m3's largest finite value). The second moment is stored as its
    square root and squared back, a positive root below the smallest subnormal (2^-9) stored
    as that subnormal: e4m3 spans 2^18.8, its square root 2^37.6 of ``v``.

    A tensor stored once (`encode_tensor`: `formats.quantize`, a saved activation) keeps an
    infinity to its element: the block's scale is its largest finite magnitude's, the
    infinity takes e4m3's NaN code of its sign and decodes to itself (a masked
    log-softmax's -inf); a NaN makes the block's scale, and the block, NaN. A moment in the
    update (`encode`) skips those selects, a third of the update's time: an infinite moment
    makes its block's scale infinite, as a NaN does (only an overflowed gradient, a step
    loss scaling skips, makes one)."""

    name = "float8"
    aliases = ("fp8",)
    default_block = 256
    code_dtype = torch.float8_e4m3fn
    description = "float8 e4m3 codes, one float32 scale per block"

    def encode(self, x, signed, table):  # type: ignore[no-untyped-def]
        return self._encode(x, signed, infinities=False)

    def encode_tensor(self, x, signed, table):  # type: ignore[no-untyped-def]
        return self._encode(x, signed, infinities=True)

    def decode(self, codes, scales, block, signed, table):  # type: ignore[no-untyped-def]
        return self._decode(codes, scales, block, signed, infinities=False)

    def decode_tensor(self, codes, scales, block, signed, table):  # type: ignore[no-untyped-def]
        return self._decode(codes, scales, block, signed, infinities=True)

    def _encode(
        self, x: torch.Tensor, signed: bool, infinities: bool
    ) -> tuple[torch.Tensor, torch.Tensor]:
        magnitudes = x.abs() if signed else x  # (a second moment: >= 0 or NaN)
        largest = _finite_amax(magnitudes) if infinities else magnitudes.amax(dim=1)
        # (over a tensor, not a number: CUDA divides by a number as a multiply by its
        # reciprocal, a last bit off the division a CPU and the compiled kernels do)
        top = largest.new_full((), FP8_MAX)
        if signed:
            scales = largest / top
        else:  # (the largest root as `_root_scaled` takes it)
            scales = largest.sqrt().abs() / top
            x = x.sqrt()
        y = _over(x, scales)
        if not signed:
            y = torch.where(y > 0, y.clamp_min(_FP8_TINY), y)
        if infinities:
            y = _coded_infinities(y, x)
        if _AVX2 and y.device.type == "cpu" and y.dtype == torch.float32:
            # (a float64 parameter's update is float64: converted by torch, in one rounding)
            return _e4m3(y).reshape(-1), scales
        return y.to(torch.float8_e4m3fn).reshape(-1), scales

    def _decode(
        self, codes: torch.Tensor, scales: torch.Tensor, block: int, signed: bool, infinities: bool
    ) -> torch.Tensor:
        if _AVX2 and codes.device.type == "cpu":  # (e4m3 to float32 runs element by element)
            values = _read(_E4M3_VALUES, codes.view(torch.uint8), vectorized=False)
            values = values.view(-1, block)
        else:
            values = codes.to(torch.float32).view(-1, block)
        if signed:
            out = values * scales[:, None]
        else:
            magnitude = scales.abs()[:, None]
            stored = values * magnitude
            out = _at_least_tiny(stored * stored, values, magnitude)
        if not infinities:
            return out
        # a NaN code under a scale that is not NaN (it is finite: of the finite values) is an
        # infinity of the code's sign (the NaN's sign bit)
        infinite = (values != values) & (scales == scales)[:, None]
        signed_inf = torch.copysign(torch.full_like(values, torch.inf), values)
        return torch.where(infinite, signed_inf, out)


for _codec in (Float32Codec(), Int8Codec(), Int4Codec(), Float8Codec()):
    register_state_format(_codec)
del _codec
