"""State formats: how an optimizer keeps one moment of one parameter. A `StateFormat` is a
kind (a codec registered in `mixprec.optim.states.codecs`) and a block size; what follows
describes the builtin kinds (docs/states.md, "The code maps", gives the reasons in full).

``float32`` keeps it as torch does. The low-bit formats split the flattened moment into
blocks of ``block`` elements, keep one float32 scale per block (its largest magnitude) and
one code per element:

- ``int8`` (block 256): an 8-bit index into a dynamic tree map of block-wise 8-bit
  optimizers (Dettmers et al., arXiv 2110.02861), signed for the first moment, unsigned for
  the second. Our signed map holds -1 in place of its smallest positive value, so that a
  block's largest magnitude is kept exactly whatever its sign. The second moment is stored
  as its square root, a positive root below half the map's smallest positive value taking
  that value's code, never 0's (a ``v`` decoded as 0 makes its next step ``m / eps``). The
  block's scale, its largest root, is stored negated: a positive scale marks a block of
  codes of ``v`` itself, as states saved before int8 kept roots hold, and decodes as then.
- ``int4`` (block 128): a 4-bit index, two packed per byte: the signed dynamic map with 3
  exponent bits (-1 in place of its smallest positive value) for the first moment, a linear
  map with no zero, 1/16 .. 16/16 (Li et al., arXiv 2309.01507), for the second's square
  root, the scale negated as int8's (docs/states.md says why).
- ``float8`` (block 256; ``fp8`` is accepted for it): float8 e4m3 codes of the element
  divided by its block's scale (the block's largest magnitude over 448, e4m3's largest
  finite value). The second moment is stored as its square root, and a positive root below
  the smallest subnormal as that subnormal, so no positive ``v`` decodes to 0.

In every format a positive second moment's code decodes to at least float32's smallest
normal number. The padded tail of the last block is stored, so a moment of ``n`` elements
takes ``ceil(n / block)`` scales and ``ceil(n / block) * block`` codes (half as many bytes
for ``int4``): `StateFormat.bytes` counts them exactly.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import torch

from mixprec.optim.states import codecs
from mixprec.optim.states.codecs import StateCodec, state_codec, state_codecs

__all__ = [
    "KINDS",
    "StateFormat",
    "code_map",
    "code_tables",
    "decode",
    "dequantize",
    "encode",
    "moment_error",
    "parse_state_format",
    "quantize",
    "state_kinds",
]

# the builtin kinds (`state_kinds` lists every registered one)
KINDS: tuple[str, ...] = ("float32", "int8", "int4", "float8")


def state_kinds() -> tuple[str, ...]:
    """The names of the registered state formats, in the order registered."""
    return tuple(c.name for c in state_codecs())


def _accepted() -> str:
    """What a state format spec may say, from the registry, for messages."""
    names = [f"{c.name!r}" + (f" (or {', '.join(map(repr, c.aliases))})" if c.aliases else "")
             for c in state_codecs()]  # fmt: skip
    listed = ", ".join(names[:-1]) + f" or {names[-1]}" if len(names) > 1 else "".join(names)
    blocked = [c for c in state_codecs() if c.quantized]
    defaults = ", ".join(f"{c.name} {c.default_block}" for c in blocked)
    example = f"{blocked[0].name}/block=128" if blocked else "int8/block=128"
    return (
        f"{listed}, a blocked one optionally with a block size ({example!r}; defaults: {defaults})"
    )


def _codec(kind: str) -> StateCodec:
    codec = state_codec(kind) if isinstance(kind, str) else None
    if codec is None:
        raise ValueError(f"unknown state format {kind!r}: expected {_accepted()}")
    return codec


@dataclasses.dataclass(frozen=True)
class StateFormat:
    """One moment's storage: a registered kind (`codec`) and its block size.
    ``StateFormat("int8")`` takes the kind's default block; an alias is spelled by its
    kind's name (``StateFormat("fp8").kind == "float8"``); ``str()`` gives the spec back
    (``"int8/block=128"`` where the block is not the default).

    Attributes:
        kind: the codec's name: ``"float32"``, ``"int8"``, ``"int4"``, ``"float8"`` or any
            registered one.
        block: elements sharing one float32 scale (None for a format without blocks).
    """

    kind: str
    block: int | None = None

    def __post_init__(self) -> None:
        codec = _codec(self.kind)
        object.__setattr__(self, "kind", codec.name)
        if not codec.quantized:
            if self.block is not None:
                codec.check_block(self.block)  # (refuses)
            return
        if self.block is None:
            object.__setattr__(self, "block", codec.default_block)
        codec.check_block(self.block)

    @property
    def codec(self) -> StateCodec:
        """The registered codec of this format's kind."""
        return _codec(self.kind)

    @property
    def quantized(self) -> bool:
        """Whether the moment is stored in blocks of codes (False: float32, as torch)."""
        return self.block is not None

    def blocks(self, numel: int) -> int:
        """The number of blocks (and float32 scales) of a moment of ``numel`` elements."""
        return -(-numel // self.block) if self.block else 0

    def padded(self, numel: int) -> int:
        """``numel`` rounded up to whole blocks (itself for a format without blocks)."""
        return self.blocks(numel) * self.block if self.block else numel

    def code_count(self, numel: int) -> int:
        """Elements of the codes tensor of a moment of ``numel`` elements (padded to whole
        blocks; for float32, ``numel``)."""
        return self.codec.code_count(self.padded(numel))

    def code_bytes(self, numel: int) -> int:
        """Bytes of the codes of a moment of ``numel`` elements (padded to whole blocks)."""
        return self.codec.code_bytes(self.padded(numel))

    def bytes(self, numel: int) -> int:
        """Exact bytes one moment of ``numel`` elements takes: codes and float32 scales."""
        return self.code_bytes(numel) + 4 * self.blocks(numel)

    def __str__(self) -> str:
        if self.quantized and self.block != self.codec.default_block:
            return f"{self.kind}/block={self.block}"
        return self.kind


def parse_state_format(spec: str | StateFormat) -> StateFormat:
    """The `StateFormat` a spec names: a registered kind (``"float32"``, ``"int8"``,
    ``"int4"``, ``"float8"`` or ``"fp8"``...), a blocked one optionally with ``/block=N``;
    a `StateFormat` is returned as is."""
    if isinstance(spec, StateFormat):
        return spec
    if not isinstance(spec, str):
        raise TypeError(
            f"a state format is a string or a StateFormat, got {type(spec).__name__}: "
            f"expected {_accepted()}"
        )
    return _parse(spec, codecs.generation())


@functools.lru_cache(maxsize=256)
def _parse(spec: str, generation: int) -> StateFormat:
    """`parse_state_format` of a string, remembered (per registry ``generation``): a step
    reads each parameter's."""
    kind, _, options = spec.strip().lower().partition("/")
    if state_codec(kind) is None:
        raise ValueError(f"unknown state format {spec!r}: expected {_accepted()}")
    if not options:
        return StateFormat(kind)
    name, eq, value = options.partition("=")
    if name.strip() != "block" or not eq or not value.strip().isdigit():
        raise ValueError(
            f"state format {spec!r}: the only option is 'block=N' (an even number of "
            f"elements per scale), as in 'int8/block=128'"
        )
    return StateFormat(kind, int(value))


def _as_codec(kind: str | StateFormat | StateCodec) -> StateCodec:
    if isinstance(kind, StateCodec):
        return kind
    if isinstance(kind, StateFormat):
        return kind.codec
    return _codec(kind)


def code_map(kind: str | StateFormat | StateCodec, signed: bool) -> torch.Tensor:
    """The sorted float32 values the codes of ``kind`` (``"int8"``/``"int4"``...) index: a
    code is its value's position. ``signed`` for the first moment (and SGD's momentum),
    unsigned for the second moment."""
    codec = _as_codec(kind)
    values = codec.code_map(signed)
    if values is None:
        raise ValueError(
            f"{codec.name!r} has no code map: its codes are values (only formats whose codes "
            f"index a map, as 'int8' and 'int4', have one)"
        )
    return values


def code_tables(fmt: StateFormat, signed: bool, device: torch.device) -> tuple[torch.Tensor, ...]:
    """What `decode` reads for ``fmt`` on ``device`` (made once): one tensor, the codec's
    `StateCodec.table` (empty where the codes are values, as float8's)."""
    return (fmt.codec.table(signed, device),)


def nearest_code(
    y: torch.Tensor, kind: str, signed: bool, tables: tuple[torch.Tensor, ...] = ()
) -> torch.Tensor:
    """The int32 code of the map value nearest to each element of ``y`` (float32, in
    [-1, 1]; >= 0 for an unsigned map) for a kind whose codes index a map (int8, int4),
    computed from the map's shape so that it vectorizes. ``tables`` is not read."""
    codec = _as_codec(kind)
    nearest = getattr(codec, "nearest", None)
    if nearest is None:
        raise ValueError(f"{codec.name!r} has no code map to find the nearest code in")
    return nearest(y, signed).to(torch.int32)


def encode(
    x: torch.Tensor,
    fmt: StateFormat,
    signed: bool,
    tables: tuple[torch.Tensor, ...],
    *,
    tensor: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(codes, scales) of ``x``, float32 of shape (blocks, block), in ``fmt`` (its codec's
    `StateCodec.encode`; with ``tensor``, of a tensor stored once, `StateCodec.encode_tensor`);
    ``tables``: `code_tables` for ``fmt`` and ``signed``."""
    if tensor:
        return fmt.codec.encode_tensor(x, signed, tables[0])
    return fmt.codec.encode(x, signed, tables[0])


def decode(
    codes: torch.Tensor,
    scales: torch.Tensor,
    fmt: StateFormat,
    signed: bool,
    tables: tuple[torch.Tensor, ...],
    *,
    tensor: bool = False,
) -> torch.Tensor:
    """The float32 blocks, shape (blocks, block), that ``codes`` and ``scales`` stand for
    (``fmt``'s codec's `StateCodec.decode`); ``signed`` and ``tensor`` as `encode` took
    them."""
    if tensor:
        return fmt.codec.decode_tensor(codes, scales, fmt.block, signed, tables[0])
    return fmt.codec.decode(codes, scales, fmt.block, signed, tables[0])


def _blocked(x: torch.Tensor, fmt: StateFormat) -> torch.Tensor:
    """``x`` flattened in float32, zero-padded to whole blocks, shape (blocks, block)."""
    flat = x.reshape(-1).to(torch.float32)
    pad = fmt.padded(flat.numel()) - flat.numel()
    return torch.nn.functional.pad(flat, (0, pad)).view(-1, fmt.block)


def quantize(
    x: torch.Tensor, fmt: StateFormat | str, *, signed: bool = True
) -> tuple[torch.Tensor, torch.Tensor]:
    """(codes, float32 scales) of the tensor ``x`` (any shape, flattened and zero-padded
    to whole blocks) in the blocked format ``fmt``; ``signed`` picks the first moment's map
    (False: the second moment's, for values >= 0). With `dequantize`, the pair that stores
    any tensor block-wise in a state format (as the float8 codec stores moments)."""
    fmt = parse_state_format(fmt)
    if not fmt.quantized:
        blocked = ", ".join(repr(c.name) for c in state_codecs() if c.quantized)
        raise ValueError(f"quantize takes a blocked state format ({blocked}), got {str(fmt)!r}")
    # (the second moment's maps hold no negative value: its root would be NaN, and its code
    # whatever a NaN cast to an integer gives)
    if not signed and bool((x < 0).any()):
        raise ValueError(
            f"quantize(..., signed=False) stores values >= 0 (a second moment), got "
            f"{float(x.min()):g}: pass signed=True for values of either sign"
        )
    return encode(_blocked(x, fmt), fmt, signed, code_tables(fmt, signed, x.device), tensor=True)


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
    return decode(codes, scales, fmt, signed, tables, tensor=True).reshape(-1)[:numel].view(shape)


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
