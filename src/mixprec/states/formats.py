"""State formats: how an optimizer keeps one moment of one parameter.

``float32`` keeps it as torch does. The low-bit formats split the flattened moment into
blocks of ``block`` elements, keep one float32 scale per block (its largest magnitude) and
one code per element:

- ``int8`` (block 256): an 8-bit index into a dynamic code map, the nearest of its 256
  values to the element divided by its block's scale. The maps are the dynamic tree maps of
  block-wise 8-bit optimizers (Dettmers et al., arXiv 2110.02861): a sign (signed map, for
  the first moment), a run of zero bits giving the decade, an indicator bit, the remaining
  bits a linear fraction of the decade; the unsigned map (second moment) spends the sign
  bit on one more fraction bit. Our signed map holds -1 in place of its smallest positive
  value, so that a block's largest magnitude is kept exactly whatever its sign. The second
  moment is stored as its square root, a positive root below half the map's smallest
  positive value (3.25e-7 of the block's largest) taking that value's code, never 0's: a
  ``v`` stored as itself would decode as 0 under 1.6e-7 of its block's largest (a gradient
  a few thousand times below the largest of its block, as one outlier input feature gives),
  and its next step with a small gradient would be ``m / eps``. The block's scale, its largest
  root, is stored negated: a positive scale marks a block of codes of ``v`` itself, as
  states saved before int8 kept roots hold, and decodes as it did then.
- ``int4`` (block 128): a 4-bit index, two packed per byte. The first moment takes the
  signed dynamic map with 3 exponent bits (-1 in place of its smallest positive value);
  the second moment a linear map with no zero, 1/16 .. 16/16, as the 4-bit optimizer
  study (Li et al., arXiv 2309.01507) advises: a second moment rounded to zero turns its
  update ``m / sqrt(v)`` into a huge step.
- ``fp8`` (block 256): float8 e4m3 codes of the element divided by its block's scale (the
  block's largest magnitude over 448, e4m3's largest finite value). The second moment is
  stored as its square root and squared back: e4m3 spans 2^18.8 from 448 down to where it
  rounds to zero, so a block of ``v`` itself would lose every element below its largest
  over 2^18.8 (a spread gradients reach) and turn ``m / sqrt(v)`` into ``m / eps``; the
  square root spans 2^37.6 of ``v``, and a positive root below the smallest subnormal
  (2^-9) is stored as that subnormal, so no positive ``v`` decodes to 0 (an element
  that small gets a smaller step than float32 would give it, never a larger one).

In every format a positive second moment's code decodes to at least float32's smallest
normal number: a root squared underflows to 0 in a block whose largest ``v`` is below 1e-32.

The padded tail of the last block is stored, so a moment of ``n`` elements takes
``ceil(n / block)`` scales and ``ceil(n / block) * block`` codes (half as many bytes for
``int4``): `StateFormat.bytes` counts them exactly.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import torch

__all__ = [
    "DEFAULT_BLOCKS",
    "FP8_MAX",
    "KINDS",
    "StateFormat",
    "code_map",
    "code_tables",
    "decode",
    "dequantize",
    "encode",
    "nearest_code",
    "moment_error",
    "parse_state_format",
    "quantize",
]

KINDS: tuple[str, ...] = ("float32", "int8", "int4", "fp8")
DEFAULT_BLOCKS: dict[str, int] = {"int8": 256, "int4": 128, "fp8": 256}
# e4m3's largest finite value: a block's largest magnitude maps onto it
FP8_MAX = 448.0
# e4m3's smallest positive (subnormal) value: the least a positive second moment's root keeps
_FP8_TINY = 2.0**-9
# the least a positive second moment decodes to (float32's smallest normal number): a block
# whose largest value is itself tiny would otherwise underflow its smallest codes to 0
_SMALLEST_V = torch.finfo(torch.float32).tiny
_ACCEPTED = (
    "'float32', 'int8', 'int4' or 'fp8', optionally with a block size "
    "('int8/block=128'; defaults: int8 256, int4 128, fp8 256)"
)


@dataclasses.dataclass(frozen=True)
class StateFormat:
    """One moment's storage. ``StateFormat("int8")`` takes the kind's default block;
    ``str()`` gives the spec back (``"int8/block=128"`` where the block is not the default).

    Attributes:
        kind: ``"float32"``, ``"int8"``, ``"int4"`` or ``"fp8"``.
        block: elements sharing one float32 scale (an even number; None for float32).
    """

    kind: str
    block: int | None = None

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"unknown state format {self.kind!r}: expected {_ACCEPTED}")
        if self.kind == "float32":
            if self.block is not None:
                raise ValueError("a float32 state has no blocks: drop the block size")
            return
        if self.block is None:
            object.__setattr__(self, "block", DEFAULT_BLOCKS[self.kind])
        block = self.block
        if isinstance(block, bool) or not isinstance(block, int) or block < 2 or block % 2:
            raise ValueError(
                f"the block size of a {self.kind} state must be an even integer >= 2, got {block!r}"
            )

    @property
    def quantized(self) -> bool:
        """Whether the moment is stored in blocks of low-bit codes."""
        return self.kind != "float32"

    def blocks(self, numel: int) -> int:
        """The number of blocks (and float32 scales) of a moment of ``numel`` elements."""
        return -(-numel // self.block) if self.block else 0

    def code_bytes(self, numel: int) -> int:
        """Bytes of the codes of a moment of ``numel`` elements (padded to whole blocks)."""
        if not self.quantized:
            return 4 * numel
        padded = self.blocks(numel) * self.block
        return padded // 2 if self.kind == "int4" else padded

    def bytes(self, numel: int) -> int:
        """Exact bytes one moment of ``numel`` elements takes: codes and float32 scales."""
        return self.code_bytes(numel) + 4 * self.blocks(numel)

    def __str__(self) -> str:
        if self.quantized and self.block != DEFAULT_BLOCKS[self.kind]:
            return f"{self.kind}/block={self.block}"
        return self.kind


def parse_state_format(spec: str | StateFormat) -> StateFormat:
    """The `StateFormat` a spec names: ``"float32"``, ``"int8"``, ``"int4"``, ``"fp8"``,
    each low-bit kind optionally with ``/block=N``; a `StateFormat` is returned as is."""
    if isinstance(spec, StateFormat):
        return spec
    if not isinstance(spec, str):
        raise TypeError(
            f"a state format is a string or a StateFormat, got {type(spec).__name__}: "
            f"expected {_ACCEPTED}"
        )
    return _parse(spec)


@functools.lru_cache(maxsize=256)
def _parse(spec: str) -> StateFormat:
    """`parse_state_format` of a string, remembered: a step reads each parameter's."""
    kind, _, options = spec.strip().lower().partition("/")
    if kind not in KINDS:
        raise ValueError(f"unknown state format {spec!r}: expected {_ACCEPTED}")
    if not options:
        return StateFormat(kind)
    name, eq, value = options.partition("=")
    if name.strip() != "block" or not eq or not value.strip().isdigit():
        raise ValueError(
            f"state format {spec!r}: the only option is 'block=N' (an even number of "
            f"elements per scale), as in 'int8/block=128'"
        )
    return StateFormat(kind, int(value))


def _dynamic_map(bits: int, signed: bool, exponent_bits: int) -> list[float]:
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
    (smallest) up: each one's first magnitude index, number of values and the factor
    scaling it onto [0.1, 1]; the magnitudes past which the next decade's first value is
    nearer than this one's last (``uppers``); below ``zero`` the nearest value is 0 (on the
    positive side of a signed map, which lacks index 0: below ``zero_positive``, else index
    1); above ``one``, 1."""

    starts: tuple[int, ...]
    parts: tuple[int, ...]
    factors: tuple[float, ...]
    uppers: tuple[float, ...]
    zero: float
    zero_positive: float
    one: float
    last: int


def _decades(bits: int, exponent_bits: int, signed: bool) -> _Decades:
    """`_Decades` of the map `_dynamic_map` builds with these arguments."""
    base = bits - 1 - exponent_bits + (0 if signed else 1)
    parts = tuple(2 ** (i + base) for i in range(exponent_bits))
    starts = tuple(2**base * (2**i - 1) for i in range(exponent_bits))
    tops = [10.0 ** (i - exponent_bits + 1) for i in range(exponent_bits)]

    def value(i: int, j: int) -> float:
        return tops[i] * (0.1 + 0.9 * (j + 0.5) / parts[i])

    uppers = tuple((value(i, parts[i] - 1) + value(i + 1, 0)) / 2 for i in range(exponent_bits - 1))
    second = value(0, 1) if parts[0] > 1 else value(1, 0)
    return _Decades(
        starts=starts,
        parts=parts,
        factors=tuple(1 / top for top in tops),
        uppers=uppers,
        zero=value(0, 0) / 2,
        zero_positive=second / 2,
        one=(value(exponent_bits - 1, parts[-1] - 1) + 1) / 2,
        last=starts[-1] + parts[-1],
    )


# the dynamic maps' decades by kind and signedness: (bits, exponent bits, signed)
_DECADES = {
    ("int8", True): _decades(8, 7, True),
    ("int8", False): _decades(8, 7, False),
    ("int4", True): _decades(4, 3, True),
}


def _dynamic_nearest(y: torch.Tensor, d: _Decades, signed: bool) -> torch.Tensor:
    """The code of the dynamic map value nearest each element of ``y`` by arithmetic (a
    tie to either side, one rounding apart): the decade from comparisons with the
    magnitudes between decades, the part of its even split the magnitude falls in (whose
    midpoint is the decade's nearest value), then 0 and 1 at the ends."""
    a = y.abs()
    a = torch.where(a <= 1.0, a, 1.0)  # (a NaN: the code of +-1)
    start = torch.full_like(a, d.starts[0])
    parts = torch.full_like(a, d.parts[0])
    factor = torch.full_like(a, d.factors[0])
    for i, upper in enumerate(d.uppers, start=1):
        above = a > upper
        start = torch.where(above, d.starts[i], start)
        parts = torch.where(above, d.parts[i], parts)
        factor = torch.where(above, d.factors[i], factor)
    j = torch.floor((a * factor - 0.1) * (parts / 0.9)).clamp(torch.zeros_like(parts), parts - 1)
    t = start + j
    negative = y < 0  # (-0: the code of 0 either way)
    if signed:  # no positive value of index 0 (-1 in its place): 0 or index 1
        zero = torch.where(negative, d.zero, d.zero_positive)
        t = torch.where(~negative & (t == 0), 1.0, t)
    else:
        zero = torch.full_like(a, d.zero)
    t = torch.where(a < zero, -1.0, torch.where(a > d.one, float(d.last), t))
    t = t.to(torch.int32)
    if not signed:
        return t + 1
    half = d.last + 1  # the code of 0: after -1 and the negative magnitudes
    return torch.where(negative, half - 1 - t, half + t.clamp_min(0))


def nearest_code(
    y: torch.Tensor, kind: str, signed: bool, tables: tuple[torch.Tensor, ...] = ()
) -> torch.Tensor:
    """The int32 code of the map value nearest to each element of ``y`` (float32, in
    [-1, 1]; >= 0 for an unsigned map), computed from the map's shape, not read from a
    table, so that it vectorizes: the dynamic maps' decade and part by arithmetic, then the
    nearest of three neighbours; int4's linear second-moment map by rounding. ``tables``
    is not read (`code_tables` for the signature the kernels share)."""
    if kind == "int4" and not signed:
        return (torch.ceil(y * 16 - 0.5) - 1).clamp(0, 15).to(torch.int32)
    return _dynamic_nearest(y, _DECADES[(kind, signed)], signed)


def code_map(kind: str, signed: bool) -> torch.Tensor:
    """The sorted float32 values the codes of ``kind`` (``"int8"``/``"int4"``) index: a
    code is its value's position. ``signed`` for the first moment (and SGD's momentum),
    unsigned for the second moment."""
    if kind == "int8":
        values = _dynamic_map(8, signed, 7)
    elif kind == "int4":
        values = _dynamic_map(4, True, 3) if signed else [k / 16 for k in range(1, 17)]
    else:
        raise ValueError(f"{kind!r} has no code map: only 'int8' and 'int4' states do")
    return torch.tensor(values, dtype=torch.float32)


@functools.cache
def _tables(kind: str, signed: bool, device: torch.device) -> tuple[torch.Tensor, ...]:
    if kind == "fp8":
        return (torch.empty(0, device=device),)
    return (code_map(kind, signed).to(device),)


def code_tables(fmt: StateFormat, signed: bool, device: torch.device) -> tuple[torch.Tensor, ...]:
    """What `decode` reads for ``fmt`` on ``device`` (made once): the code values, one
    tensor. Empty for fp8, whose codes are values (scaled; the second moment's root)."""
    return _tables(fmt.kind, signed, torch.device(device))


def encode(
    x: torch.Tensor, fmt: StateFormat, signed: bool, tables: tuple[torch.Tensor, ...]
) -> tuple[torch.Tensor, torch.Tensor]:
    """(codes, scales) of ``x``, float32 of shape (blocks, block): one float32 scale per
    block, uint8 codes (int4: two per byte, the first in the low half) or float8 e4m3;
    ``signed`` and ``tables`` (`code_tables`) give the code map. An unsigned fp8 or int8
    moment (``x >= 0``) is stored as its square root, no positive element coded as 0; the
    int8 one's scales negated, marking codes of roots."""
    roots = not signed and fmt.kind in ("fp8", "int8")
    if roots:
        x = x.sqrt()
    if fmt.kind == "fp8":
        scales = x.abs().amax(dim=1) / FP8_MAX
        safe = torch.where(scales > 0, scales, torch.ones_like(scales))
        y = x / safe[:, None]
        if not signed:
            y = torch.where(y > 0, y.clamp_min(_FP8_TINY), y)
        return y.to(torch.float8_e4m3fn).reshape(-1), scales
    absmax = x.abs().amax(dim=1)
    safe = torch.where(absmax > 0, absmax, torch.ones_like(absmax))
    y = x / safe[:, None]
    codes = nearest_code(y, fmt.kind, signed, tables)
    if roots:  # a positive root below half the smallest positive value takes its code
        codes = torch.where(y > 0, codes.clamp_min(1), codes)
        absmax = -absmax  # negated: the block's codes are of roots (see the module's docstring)
    codes = codes.reshape(-1).to(torch.uint8)
    if fmt.kind == "int4":
        codes = _pack(codes)
    return codes, absmax


def _pack(codes: torch.Tensor) -> torch.Tensor:
    """Pairs of 4-bit uint8 ``codes`` in one byte each, the first in the low half: through
    each pair read as one little-endian int16, so that the loop runs over contiguous
    elements (a pair's stride-2 reads do not vectorize)."""
    pairs = codes.view(torch.int16)
    return ((pairs & 0x0F) | ((pairs >> 4) & 0xF0)).to(torch.uint8)


def _unpack(packed: torch.Tensor) -> torch.Tensor:
    """The uint8 codes `_pack` packed, two per byte, in order (the reverse computation)."""
    wide = packed.to(torch.int16)
    return ((wide & 0x0F) | ((wide & 0xF0) << 4)).view(torch.uint8)


def decode(
    codes: torch.Tensor,
    scales: torch.Tensor,
    fmt: StateFormat,
    signed: bool,
    tables: tuple[torch.Tensor, ...],
) -> torch.Tensor:
    """The float32 blocks, shape (blocks, block), that ``codes`` and ``scales`` stand for;
    ``signed`` as `encode` took it. An unsigned fp8 moment is squared back, so is an
    unsigned int8 block whose scale is negative (a block with a positive scale holds codes
    of ``v`` itself, as states saved before int8 kept roots do); a positive unsigned code
    decodes to at least float32's smallest normal number, never to 0."""
    if fmt.kind == "fp8":
        values = codes.to(torch.float32).view(-1, fmt.block)
    else:
        index = _unpack(codes) if fmt.kind == "int4" else codes
        values = tables[0][index.to(torch.int32).reshape(-1, fmt.block)]
    if signed:
        return values * scales[:, None]
    magnitude = scales.abs()[:, None]
    stored = values * magnitude
    if fmt.kind == "fp8":
        v = stored * stored
    elif fmt.kind == "int8":
        v = torch.where(scales[:, None] < 0, stored * stored, stored)
    else:
        v = stored
    return torch.where((values > 0) & (magnitude > 0), v.clamp_min(_SMALLEST_V), v)


def _blocked(x: torch.Tensor, fmt: StateFormat) -> torch.Tensor:
    """``x`` flattened in float32, zero-padded to whole blocks, shape (blocks, block)."""
    flat = x.reshape(-1).to(torch.float32)
    pad = fmt.blocks(flat.numel()) * fmt.block - flat.numel()
    return torch.nn.functional.pad(flat, (0, pad)).view(-1, fmt.block)


def quantize(
    x: torch.Tensor, fmt: StateFormat | str, *, signed: bool = True
) -> tuple[torch.Tensor, torch.Tensor]:
    """(codes, float32 scales) of the tensor ``x`` in the low-bit format ``fmt``; ``signed``
    picks the first moment's map (False: the second moment's, for values >= 0)."""
    fmt = parse_state_format(fmt)
    if not fmt.quantized:
        raise ValueError("quantize takes a low-bit format ('int8', 'int4' or 'fp8')")
    return encode(_blocked(x, fmt), fmt, signed, code_tables(fmt, signed, x.device))


def dequantize(
    codes: torch.Tensor,
    scales: torch.Tensor,
    fmt: StateFormat | str,
    shape: torch.Size | tuple[int, ...],
    *,
    signed: bool = True,
) -> torch.Tensor:
    """The float32 tensor of ``shape`` that `quantize` turned into ``codes`` and ``scales``."""
    fmt = parse_state_format(fmt)
    tables = code_tables(fmt, signed, codes.device)
    numel = math.prod(shape)
    return decode(codes, scales, fmt, signed, tables).reshape(-1)[:numel].view(shape)


def moment_error(x: torch.Tensor, fmt: StateFormat | str, *, signed: bool | None = None) -> float:
    """Relative error of ``x`` stored in ``fmt``: ``||dequantize(quantize(x)) - x|| /
    ||x||`` (0 for float32 and for a zero tensor). ``signed`` defaults to whether ``x`` has a
    negative element (a first moment) or not (a second moment)."""
    fmt = parse_state_format(fmt)
    if not fmt.quantized:
        return 0.0
    if signed is None:
        signed = bool((x < 0).any())
    x32 = x.detach().to(torch.float32)
    back = dequantize(*quantize(x32, fmt, signed=signed), fmt, x32.shape, signed=signed)
    norm = torch.linalg.vector_norm(x32)
    if norm == 0:
        return 0.0
    return float(torch.linalg.vector_norm(back - x32) / norm)
