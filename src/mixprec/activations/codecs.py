"""The storage codecs: what a saved tensor becomes while it waits for the backward.

A codec's `pack` and `unpack` are `torch.autograd.graph.saved_tensors_hooks`. Only
activations are stored otherwise: a tensor without a ``grad_fn`` (an input, a parameter, a
buffer) or a cast or view of a parameter (autocast's 16-bit weight copy) is alive outside
the graph anyway, and a second, smaller copy of it would only add memory. A tensor saved
twice in one forward (the input of the query, key and value projections) is packed once.

``fp8`` is the optimizer states' float8 codec (`mixprec.optim.states.formats`, signed, blocks of
256 with one float32 scale each): a saved tensor decodes bit for bit as a state does. A
tensor of fewer elements than one block is kept as it is: its padded block would be larger.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

# the one place the states' codec is imported from
from mixprec.optim.states.formats import StateFormat, dequantize, quantize

__all__ = [
    "CHUNK",
    "CODECS",
    "FP8",
    "Codec",
    "Fp8Saved",
    "Keep",
    "Reshaped",
    "ToBfloat16",
    "ToFp8",
    "is_activation",
    "record_to",
]

FP8 = StateFormat("fp8")
# elements `ToFp8` encodes or decodes at a time (a multiple of the block): the codec's float32
# temporaries take this many elements, not a whole activation's, and the codes are the same
CHUNK = 1 << 18

# nodes through which a saved tensor is still a parameter: casts and views
_CAST_OR_VIEW = frozenset(
    {
        "ToCopyBackward0",
        "TBackward0",
        "TransposeBackward0",
        "PermuteBackward0",
        "ViewBackward0",
        "UnsafeViewBackward0",
        "ExpandBackward0",
        "AliasBackward0",
    }
)

_meter = threading.local()  # .record: told of each pack while a measurement runs


def record_to(record: Callable[[Tensor, int, int], None] | None) -> None:
    """Tell `record(original, bytes stored, key)` of every pack in this thread (None: stop);
    `key` is the same for one stored object saved twice."""
    _meter.record = record


def _record(original: Tensor, stored: int, key: int) -> None:
    record = getattr(_meter, "record", None)
    if record is not None:
        record(original, stored, key)


def is_activation(t: Tensor) -> bool:
    """Whether `t` was computed in this forward, not a parameter, buffer, input or a cast or
    view of a parameter: the tensors a codec stores otherwise."""
    node = t.grad_fn
    while node is not None and type(node).__name__ in _CAST_OR_VIEW:
        nexts = [n for n, _ in node.next_functions if n is not None]
        if len(nexts) != 1:
            return True
        node = nexts[0]
        if type(node).__name__ == "AccumulateGrad":
            return False
    return node is not None


class Codec:
    """Packs saved tensors and unpacks them for the backward; a tensor packed once per
    forward however often it is saved (`pack` is called per save), also when a later save
    is a reshaped view of it (``F.linear`` flattens a 3-d input before saving it)."""

    name = "keep"

    def __init__(self) -> None:
        # (storage, offset, elements, dtype, version) -> (weak reference to the tensor packed,
        # its shape, packed): an entry lives while that tensor does, so its memory is not
        # another tensor's
        self._packed: dict[tuple[Any, ...], tuple[weakref.ref[Tensor], torch.Size, Any]] = {}

    def stores(self, t: Tensor) -> bool:
        """Whether `t` is stored otherwise than as it is."""
        return False

    def encode(self, t: Tensor) -> Any:
        return t

    def decode(self, packed: Any) -> Tensor:
        return packed

    def pack(self, t: Tensor) -> Any:
        storage = t.untyped_storage()
        if not self.stores(t):
            _record(t, storage.nbytes(), storage.data_ptr())
            return t
        contiguous = t.is_contiguous()
        key = (storage.data_ptr(), t.storage_offset(), t.numel(), t.dtype, t._version)
        seen = self._packed.get(key) if contiguous else None
        if seen is not None and seen[0]() is not None:
            return seen[2] if seen[1] == t.shape else Reshaped(seen[2], t.shape)
        packed = self.encode(t.detach())
        _record(t, _bytes(packed), id(packed))
        if contiguous:
            forget = self._packed.pop
            original = weakref.ref(t, lambda _, k=key: forget(k, None))
            self._packed[key] = (original, t.shape, packed)
        return packed

    def unpack(self, packed: Any) -> Tensor:
        if isinstance(packed, Reshaped):
            return self.decode(packed.packed).view(packed.shape)
        return self.decode(packed)


@dataclass(frozen=True)
class Reshaped:
    """A save of a tensor already packed, seen through another shape (a contiguous view)."""

    packed: Any
    shape: torch.Size


def _bytes(packed: Any) -> int:
    if isinstance(packed, Tensor):
        return packed.untyped_storage().nbytes()
    if isinstance(packed, Fp8Saved):
        return packed.codes.nbytes + packed.scales.nbytes
    return sum(_bytes(p) for p in packed)


class Keep(Codec):
    """Every saved tensor as torch saves it: the codec of a ``keep`` layer inside a layer
    storing otherwise (the innermost hooks are the ones torch calls)."""


class ToBfloat16(Codec):
    """Saved float32 activations stored as bfloat16, cast back to float32 when read."""

    name = "bf16"

    def stores(self, t: Tensor) -> bool:
        return t.dtype == torch.float32 and is_activation(t)

    def encode(self, t: Tensor) -> Any:
        return (t.to(torch.bfloat16),)

    def decode(self, packed: Any) -> Tensor:
        if isinstance(packed, Tensor):
            return packed
        return packed[0].to(torch.float32)


@dataclass(frozen=True)
class Fp8Saved:
    """A saved tensor as the states' fp8 codec keeps it: e4m3 codes, block scales, and the
    shape and dtype to decode it back to."""

    codes: Tensor
    scales: Tensor
    shape: torch.Size
    dtype: torch.dtype


class ToFp8(Codec):
    """Saved floating activations of at least one block stored as the states' fp8 codec
    stores a first moment, decoded back to their dtype when read."""

    name = "fp8"

    def stores(self, t: Tensor) -> bool:
        return t.is_floating_point() and t.numel() >= FP8.block and is_activation(t)

    def encode(self, t: Tensor) -> Any:
        flat = t.reshape(-1)
        pieces = [
            quantize(flat[i : i + CHUNK], FP8, signed=True) for i in range(0, len(flat), CHUNK)
        ]
        if len(pieces) == 1:
            codes, scales = pieces[0]
        else:  # blocks are independent: the pieces' codes and scales are the whole's
            codes = torch.cat([c.view(torch.uint8) for c, _ in pieces]).view(torch.float8_e4m3fn)
            scales = torch.cat([s for _, s in pieces])
        return Fp8Saved(codes, scales, t.shape, t.dtype)

    def decode(self, packed: Any) -> Tensor:
        if isinstance(packed, Tensor):
            return packed
        if len(packed.codes) <= CHUNK:  # float32 comes back as dequantize made it, no copy
            out = dequantize(packed.codes, packed.scales, FP8, packed.shape, signed=True)
            return out.to(packed.dtype)
        out = torch.empty(packed.shape, dtype=packed.dtype, device=packed.codes.device)
        flat, block = out.view(-1), FP8.block
        for i in range(0, len(flat), CHUNK):
            n = min(CHUNK, len(flat) - i)
            blocks = -(-n // block)
            codes = packed.codes[i : i + blocks * block]
            scales = packed.scales[i // block : i // block + blocks]
            flat[i : i + n] = dequantize(codes, scales, FP8, (n,), signed=True)
        return out


# the codec of each storage option (and of `keep` below a storing layer)
CODECS: dict[str, type[Codec]] = {"keep": Keep, "bf16": ToBfloat16, "fp8": ToFp8}
