"""The storage codecs: what a saved tensor becomes while it waits for the backward.

A codec's `pack` and `unpack` are `torch.autograd.graph.saved_tensors_hooks`. Only
activations are stored otherwise: a tensor without a ``grad_fn`` (an input, a parameter, a
buffer) or a cast or view of a parameter (autocast's 16-bit weight copy) is alive outside
the graph anyway, and a second, smaller copy of it would only add memory. A tensor saved
twice in one forward (the input of the query, key and value projections) is packed once.

``fp8`` is the optimizer states' float8 codec (`mixprec.optim.states.formats`, signed), in
blocks of 64 elements with one float32 scale each where states take 256: an outlier costs
fewer neighbours their precision (the char LM's held-out loss after 300 steps stays within
the activation target at 64 and not at 256; docs/activations.md). A saved tensor decodes bit
for bit as a state of that block does. A tensor of fewer elements than one block is kept as
it is: its padded block would be larger.
On a CPU, float32 and bfloat16 tensors are coded by the states' hand-written kernel
(`mixprec.optim.states.native`: a block in L1 at a time, no guards to check before a call).
Elsewhere, from `COMPILE_MIN` elements, on a device that can build
(`mixprec.optim.engine.can_compile`), the states' own `quantize` and `dequantize` run as one
torch.compile'd kernel each (shapes dynamic: one build per dtype), reading the tensor once
and writing codes and scales, or writing the decoded tensor in its dtype; elsewhere, or
after a failed build (warned once), eagerly, a chunk of blocks at a time. All give the same
codes and values.

``bf16`` stores a finite float32 value past bfloat16's range as its largest of that sign, so
a finite activation stays finite: on a CPU after one read of the tensor's range (no clamp
where none is needed), elsewhere in one compiled kernel under the same gate (no sync).
"""

from __future__ import annotations

import contextlib
import math
import sys
import threading
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx.experimental._config as fx_config
import torch.utils.checkpoint as checkpoint
from torch import Tensor

from mixprec.optim.engine import CompileGate, difference
from mixprec.optim.states import native

# the one place the states' codec is imported from
from mixprec.optim.states.formats import StateFormat, code_tables, dequantize, quantize
from mixprec.optim.states.formats import decode as decode_blocks
from mixprec.optim.states.formats import encode as encode_blocks

__all__ = [
    "CHUNK",
    "CHUNK_ACCELERATOR",
    "AsIs",
    "Centered",
    "Copied",
    "CenteredSaved",
    "FP8",
    "GATE",
    "Fp8Saved",
    "Keep",
    "NearOne",
    "NearOneSaved",
    "Reshaped",
    "ToBfloat16",
    "ToFp8",
    "has_storage",
    "is_activation",
    "record_to",
    "weights_standing",
]

FP8 = StateFormat("fp8", 64)
# elements `ToFp8` encodes or decodes eagerly at a time (a multiple of the block): the codec's
# float32 temporaries take this many elements, not a whole activation's, and the codes are
# the same. On a CPU they stay cache-sized; elsewhere a chunk is a dozen kernel launches, so
# chunks are large (docs/activations.md: at the CPU's size a GPU step took tens of times
# keep's)
CHUNK = 1 << 18
CHUNK_ACCELERATOR = 1 << 24
# elements from which `ToFp8` encodes and decodes with its compiled kernels: below, a call's
# fixed cost (guards, launch) is more than the eager passes it saves
COMPILE_MIN = 1 << 14
# whether `ToFp8` (and `ToBfloat16` off the CPU) compiles, and its eager fallback (one gate
# for the process: warned once)
GATE = CompileGate(
    None,
    "fp8 and bf16 activation codecs",
    "mixprec.activations.codecs.GATE.compile = False skips the attempt",
    COMPILE_MIN,
)

# nodes through which a saved tensor is still a parameter: casts and views (every view op
# of torch's, so that autocast's copy of any view of a weight, as ``w.unbind(0)[i]``, is one)
_CAST_OR_VIEW = frozenset(
    {
        "ToCopyBackward0",
        "TBackward0",
        "TransposeBackward0",
        "PermuteBackward0",
        "ViewBackward0",
        "UnsafeViewBackward0",
        "ReshapeAliasBackward0",
        "ExpandBackward0",
        "AliasBackward0",
        "SplitBackward0",
        "SplitWithSizesBackward0",
        "UnsafeSplitBackward0",
        "UnsafeSplitWithSizesBackward0",
        "UnbindBackward0",
        "SliceBackward0",
        "SelectBackward0",
        "DiagonalBackward0",
        "AsStridedBackward0",
        "UnfoldBackward0",
        "UnsqueezeBackward0",
        "SqueezeBackward0",
        "SqueezeBackward1",
        "SqueezeBackward2",
        "ViewAsRealBackward0",
        "ViewAsComplexBackward0",
    }
)

_meter = threading.local()  # .record: told of each pack while a measurement runs


def record_to(record: Callable[[Tensor, int, int], None] | None) -> None:
    """Tell `record(original, bytes stored, key)` of every pack in this thread (None: stop);
    `key` is the same for one stored object saved twice."""
    _meter.record = record


def has_storage(t: Tensor) -> bool:
    """Whether `t` has a storage to read: not a sparse or nested tensor, nor a tensor
    subclass dispatching its ops in Python (DTensor, a float8 training tensor), whose
    storage may have no memory behind it (such a tensor is kept as it is)."""
    return (
        t.layout == torch.strided
        and not t.is_nested
        and not torch._C._dispatch_keys(t).has(torch._C.DispatchKey.Python)
    )


def _plain_layout(t: Tensor) -> bool:
    """Whether `t` has a storage (`has_storage`) in which each element has memory of its
    own: an expanded view (a stride of 0) or one whose elements share memory (``unfold``'s
    overlapping windows) holds fewer bytes than its elements, which a stored copy would
    multiply. Shown by the dimensions in order of stride, each stepping past all the memory
    the smaller ones span (a layout failing that is taken as shared)."""
    if not has_storage(t):
        return False
    if t.is_contiguous():
        return True
    span = 1  # elements from the first to past the last along the dimensions so far
    for size, stride in sorted(
        (d for d in zip(t.shape, t.stride(), strict=True) if d[0] > 1), key=lambda d: d[1]
    ):
        if stride < span:
            return False
        span += (size - 1) * stride
    return True


def _dense(t: Tensor) -> bool:
    """Whether `t` (of a plain layout, `_plain_layout`) fills the memory it spans: a
    permutation of a contiguous tensor's elements, none skipped."""
    span = 1 + sum((size - 1) * stride for size, stride in zip(t.shape, t.stride(), strict=True))
    return span == t.numel()


def _row_statistic(t: Tensor) -> bool:
    """Whether `t` is a statistic of each row, kept to broadcast over it (shape ``(..., 1)``,
    computed by a reduction, perhaps through a few elementwise ops and views: an RMS norm's
    reciprocal root, a mean), which a storing codec keeps exact: an RMS norm's backward reads
    its root in two terms that largely cancel, and rounded apart it made the gradient before
    the norm several times the codec's rounding off keep's. It costs one element a row. A
    tensor of that shape computed otherwise (a convolution's or a pooling's output over a
    last dimension of 1) is an activation like any other."""
    if t.dim() < 2 or t.shape[-1] != 1:
        return False
    node = t.grad_fn
    for _ in range(_STATISTIC_DEPTH):  # (along first inputs: a statistic's own history)
        name = type(node).__name__.rstrip("0123456789")
        if name in _REDUCTIONS:
            return True
        if name not in _ELEMENTWISE:
            return False
        node = next((n for n, _ in node.next_functions if n is not None), None)
    return False


# autograd nodes of reductions along a dimension (not a matrix product: a linear layer's
# output, viewed with a trailing 1, is an activation), of what a statistic goes through on its
# way to being saved (the reciprocal of the root of a mean plus epsilon, a view of it), and how
# many such steps are followed
_REDUCTIONS = frozenset(
    f"{name}Backward"
    for name in (
        "Mean",
        "Sum",
        "Var",
        "Std",
        "VarMean",
        "StdMean",
        "Norm",
        "LinalgVectorNorm",
        "Amax",
        "Amin",
        "Max",
        "Min",
        "Logsumexp",
        "Cumsum",
        "Bmm",
    )
)
_ELEMENTWISE = frozenset(
    f"{name}Backward"
    for name in (
        "Rsqrt",
        "Sqrt",
        "Reciprocal",
        "Add",
        "Sub",
        "Mul",
        "Div",
        "Pow",
        "Clamp",
        "ClampMin",
        "ClampMax",
        "Neg",
        "Exp",
        "Log",
        "ToCopy",
        "Unsqueeze",
        "Squeeze",
        "View",
        "UnsafeView",
        "Reshape",
        "ReshapeAlias",
        "Alias",
        "Expand",
        "Slice",
        "Select",
        "Transpose",
        "Permute",
    )
)
_STATISTIC_DEPTH = 8


# the frames in which torch's checkpoint saves its function's inputs: the non-reentrant
# one's `save_inputs` (through a comprehension's frame before Python 3.12), the reentrant
# one's `CheckpointFunction`, whose saves the `apply` of torch's Function packs
_SAVE_INPUTS = getattr(getattr(checkpoint, "_CheckpointFrame", None), "save_inputs", None)
_SAVE_INPUTS_CODE = getattr(_SAVE_INPUTS, "__code__", None)
_APPLY_CODE = torch.autograd.Function.apply.__func__.__code__  # type: ignore[attr-defined]


def _checkpoint_input() -> bool:
    """Whether the save `Codec.pack` packs (called from its caller's caller) is torch's
    checkpoint saving its function's inputs, which the backward recomputes the function
    from: stored rounded, the recomputation is another function's (a layer norm's input
    with an offset, no longer centred: docs/activations.md)."""
    frame = sys._getframe(2)
    for _ in range(3):
        if frame is None:
            return False
        code = frame.f_code
        if code is _SAVE_INPUTS_CODE:
            return True
        if code is _APPLY_CODE:
            return frame.f_locals.get("cls") is checkpoint.CheckpointFunction
        frame = frame.f_back
    return False


def _record(original: Tensor, stored: int, key: int) -> None:
    record = getattr(_meter, "record", None)
    if record is not None:
        record(original, stored, key)


# .tensors: by id, the tensors standing in for the parameters of the module whose forward a
# codec stores now (`weights_standing`); held, so that no other tensor takes their ids
_standing = threading.local()


@contextlib.contextmanager
def weights_standing(tensors: dict[int, Tensor]) -> Iterator[None]:
    """While it runs, `is_activation` takes `tensors` (by id) and their views for weights:
    a "true" region's compute-dtype copies of the parameters, which, made inside a compiled
    graph, are that graph's outputs and would look like activations (eagerly they are casts
    of the parameters). Nested calls add to the outer one's tensors."""
    outer: dict[int, Tensor] = getattr(_standing, "tensors", {})
    _standing.tensors = {**outer, **tensors} if outer else tensors
    try:
        yield
    finally:
        _standing.tensors = outer


def _stands_for_weight(t: Tensor) -> bool:
    """Whether `t` (a view's base) stands in for a parameter now (`weights_standing`)."""
    return id(t) in getattr(_standing, "tensors", {})


def is_activation(t: Tensor) -> bool:
    """Whether `t` was computed in this forward, not a parameter, buffer, input, a tensor
    standing in for a parameter (`weights_standing`) or a cast or view of a parameter: the
    tensors a codec stores otherwise."""
    while t._is_view():  # (a view is what its base is: a split of a weight is the weight)
        t = t._base  # type: ignore[assignment]
    if _stands_for_weight(t):
        return False
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
    is a reshaped view of it (``F.linear`` flattens a 3-d input before saving it). A tensor
    saved several times (an `Fp8Saved`) whose saves the backward reads one right after
    another (a ReLU's output, the next Linear's input) is decoded once: the decoded tensor
    is kept until its last read or the next read of another tensor, whichever is first."""

    name = "keep"

    def __init__(self) -> None:
        # (storage, offset, elements, dtype, version) -> (weak reference to the tensor packed,
        # its shape, weak reference to what it was packed to, its strides where it is not
        # contiguous): an entry lives while that tensor does, so its memory is not another
        # tensor's, and holds the packed object only while a graph does (a tensor the caller
        # keeps, a returned hidden state, does not keep its stored copy after the backward)
        self._packed: dict[tuple[Any, ...], tuple[Any, ...]] = {}
        # (weak reference to the packed object last read, what it decoded to, that tensor's
        # version then) while more reads of it are to come
        self._last: tuple[weakref.ref[Any], Tensor, int] | None = None

    def stores(self, t: Tensor) -> bool:
        """Whether `t` is stored otherwise than as it is."""
        return False

    def encode(self, t: Tensor) -> Any:
        return t

    def decode(self, packed: Any) -> Tensor:
        return packed

    def pack(self, t: Tensor) -> Any:
        # a tensor kept as it is is held detached (its memory and version counter, not its
        # history): a saved output (relu's, softmax's) held with its grad_fn made a cycle,
        # grad_fn -> saved tensor -> it -> grad_fn, which the garbage collector cannot see,
        # so a graph dropped without a backward was never freed
        if not _plain_layout(t):
            if has_storage(t):  # (an expanded view: its storage is held, counted once)
                storage = t.untyped_storage()
                _record(t, storage.nbytes(), storage.data_ptr())
            return AsIs(t.detach(), t._version)  # (sparse, nested: their bytes unknown)
        storage = t.untyped_storage()
        if not self.stores(t) or _row_statistic(t) or _checkpoint_input():
            _record(t, storage.nbytes(), storage.data_ptr())
            return AsIs(t.detach(), t._version)
        contiguous = t.is_contiguous()
        key = (storage.data_ptr(), t.storage_offset(), t.numel(), t.dtype, t._version)
        # (a tensor packed, seen again through another shape, or through a permutation of
        # the memory it fills: ``y @ y.t()`` saves both)
        dense = contiguous or _dense(t)
        seen = (self._packed.get(key) or self._stored_apart(key)) if dense else None
        earlier = seen[2]() if seen is not None and seen[0]() is not None else None
        if earlier is not None:
            if isinstance(earlier, Fp8Saved):
                earlier.reads[0] += 1
            if seen[1] == t.shape and seen[3] == (None if contiguous else t.stride()):
                return earlier
            if contiguous and seen[3] is None:
                return Reshaped(earlier, t.shape)
            return Reshaped(earlier, t.shape, t.stride())
        # (torch function modes off: a save torch calls the hook for from Python, as an
        # autograd.Function's or torch's checkpoint's, runs while `wrapper`'s mode is on, and
        # the compiled codec traced into it and failed)
        with torch._C.DisableTorchFunction():
            packed = self.encode(t.detach())
        _record(t, _bytes(packed), id(packed))
        if dense:
            forget = self._packed.pop
            original = weakref.ref(t, lambda _, k=key: forget(k, None))
            stride = None if contiguous else t.stride()
            self._packed[key] = (original, t.shape, weakref.ref(packed), stride)
        return packed

    def _stored_apart(self, key: tuple[Any, ...]) -> tuple[Any, ...] | None:
        """The record of a tensor another codec stored as this one may read it back."""
        return None

    def unpack(self, packed: Any) -> Tensor:
        if isinstance(packed, AsIs):
            return packed.read()
        if isinstance(packed, Reshaped):
            out = self._read(packed.packed)
            if packed.stride is None:
                return out.view(packed.shape)
            return out.as_strided(packed.shape, packed.stride, out.storage_offset())
        return self._read(packed)

    def _read(self, packed: Any) -> Tensor:
        """`decode(packed)`, or what the last read decoded when it read `packed` too."""
        if isinstance(packed, NearOneSaved):  # (a sigmoid's output, saved again by another)
            return packed.read()
        if not isinstance(packed, Fp8Saved):
            return self.decode(packed)
        last, self._last = self._last, None
        # (again where a backward wrote into the tensor it was handed: the next read is the
        # forward's values, as a save kept apart is)
        reuse = last is not None and last[0]() is packed and last[1]._version == last[2]
        out = last[1] if reuse else self.decode(packed)
        packed.reads[0] -= 1
        if packed.reads[0] > 0:  # weakly: a graph freed before its last read drops it
            self._last = (weakref.ref(packed, self._forget), out, out._version)
        return out

    def _forget(self, ref: weakref.ref[Any]) -> None:
        if self._last is not None and self._last[0] is ref:
            self._last = None


@dataclass(frozen=True)
class AsIs:
    """A saved tensor kept as it is, with its version counter at the save. torch checks
    its own saves against in-place writes since, but not a tensor its saved-tensor hooks
    hand back: read back, it is checked here the same way, so that a weight updated or an
    input overwritten between the forward and the backward raises as it would under
    ``keep``, instead of giving gradients of the new values. `tensor` is detached (`Codec.pack`):
    the saved tensor's history is torch's to restore on unpacking."""

    tensor: Tensor
    version: int

    def read(self) -> Tensor:
        now = self.tensor._version
        if now != self.version:
            t = self.tensor
            raise RuntimeError(
                f"one of the variables needed for gradient computation has been modified by "
                f"an inplace operation: a saved {t.dtype} tensor of shape {list(t.shape)} is "
                f"at version {now}; expected version {self.version} instead (as torch checks "
                f"its own saves: run the backward before updating the weights, or clone a "
                f"tensor before writing into it)"
            )
        return self.tensor


@dataclass(frozen=True)
class Reshaped:
    """A save of a contiguous tensor already packed, seen through another shape (a
    contiguous view) or, with `stride`, through a permutation of its memory (a transpose)."""

    packed: Any
    shape: torch.Size
    stride: tuple[int, ...] | None = None


@dataclass(frozen=True)
class Copied:
    """A saved tensor stored as a copy: `tensor` (bfloat16 for ``bf16``'s float32, a small
    view's copy under ``fp8``), read back as `dtype`."""

    tensor: Tensor
    dtype: torch.dtype

    def read(self) -> Tensor:
        return self.tensor.to(self.dtype)


def _bytes(packed: Any) -> int:
    if isinstance(packed, Tensor):
        return packed.untyped_storage().nbytes()
    if isinstance(packed, Copied):
        return _bytes(packed.tensor)
    if isinstance(packed, Fp8Saved):
        return packed.codes.nbytes + packed.scales.nbytes
    if isinstance(packed, CenteredSaved):
        return _bytes(packed.inner) + packed.means.nbytes
    if isinstance(packed, NearOneSaved):
        return _bytes(packed.inner)
    raise TypeError(f"not a stored activation: {type(packed).__name__}")


class Keep(Codec):
    """Every saved tensor as torch saves it: the codec of a ``keep`` layer inside a layer
    storing otherwise (the innermost hooks are the ones torch calls)."""


# bfloat16's largest finite value: float32 values past it (to float32's largest, a mask's
# ``finfo(float32).min``) would round to infinity, and a zero gradient times it to NaN
_BF16_MAX = torch.finfo(torch.bfloat16).max


class ToBfloat16(Codec):
    """Saved float32 activations stored as bfloat16, cast back to float32 when read; a finite
    value past bfloat16's range is stored as its largest value of that sign (infinities and
    NaN as they are), so that a finite activation stays finite."""

    name = "bf16"

    def stores(self, t: Tensor) -> bool:
        return t.dtype == torch.float32 and is_activation(t)

    def encode(self, t: Tensor) -> Any:
        if not t.numel():
            return Copied(t.to(torch.bfloat16), t.dtype)
        if t.device.type == "cpu":
            # (a CPU's `isinf` takes several casts' time: the cast's range, read in one pass
            # in memory order and without a cost to sync there, spares the common activation
            # the clamp: a finite float32 value rounds to an infinity only past bfloat16's
            # largest, which the clamp would have taken there, so no infinity is the clamp's
            # result bit for bit)
            out = t.to(torch.bfloat16)  # (dense, in `t`'s order where `t` is dense)
            low, high = torch.aminmax(_in_memory_order(out)[0])
            if -_BF16_MAX <= float(low) and float(high) <= _BF16_MAX:
                return Copied(out, t.dtype)
        elif GATE.wants(t.device, t.numel()):
            # (no sync on an accelerator: the clamp, fused into the cast, reads the tensor once)
            flat, stride = _in_memory_order(t)
            out, ran = _run("to_bfloat16", _fresh(flat))
            if ran:
                shaped = out.view(t.shape) if stride is None else out.as_strided(t.shape, stride)
                return Copied(shaped, t.dtype)
        return Copied(_to_bfloat16(t), t.dtype)

    def decode(self, packed: Any) -> Tensor:
        return packed.read()


@dataclass(frozen=True)
class Fp8Saved:
    """A saved tensor as the states' fp8 codec keeps it: e4m3 codes, block scales, the
    shape and dtype to decode it back to, and its strides when its elements were coded in
    the order they lie in memory (a transposed view's: None for a contiguous tensor);
    `reads` counts the saves of it the backward has not read yet."""

    codes: Tensor
    scales: Tensor
    shape: torch.Size
    dtype: torch.dtype
    stride: tuple[int, ...] | None = None
    reads: list[int] = field(default_factory=lambda: [1], compare=False, repr=False)


# the dtypes `ToFp8` stores: those the states' float32 blocks hold without losing range
_FP8_STORED = frozenset({torch.float32, torch.bfloat16, torch.float16})


# what attention saves under ``fp8`` (`mixprec.activations.wrapper`): stored as ``bf16``
# stores it, its backward recomputing the weights from the saved query and key
ATTENTION = ToBfloat16()


class ToFp8(Codec):
    """Saved float32, bfloat16 and float16 activations of at least one block stored as the
    states' fp8 codec stores a first moment, decoded back to their dtype when read (float64
    ones are kept: their range is past the codec's float32 blocks)."""

    name = "fp8"

    def stores(self, t: Tensor) -> bool:
        # (float64 as it is: the codec's blocks are float32, out of whose range it reaches)
        if t.dtype not in _FP8_STORED or not is_activation(t):
            return False
        # under a block: stored only as a copy of a view of larger memory, which the view
        # kept as it is would hold whole (`encode`)
        return t.numel() >= FP8.block or _pins(t)

    def encode(self, t: Tensor) -> Any:
        if t.numel() < FP8.block:  # (a small view of a larger activation: `stores`)
            return Copied(t.clone(), t.dtype)
        flat, stride = _in_memory_order(t)
        done = native.fp8_encode(flat, FP8.block)
        if done is not None:
            return Fp8Saved(done[0], done[1], t.shape, t.dtype, stride)
        if GATE.wants(flat.device, flat.numel()):
            if flat.numel() % FP8.block:
                pair, ran = _run("encode", _fresh(flat))
            else:  # whole blocks: no padding for the kernel to mask
                pair, ran = _run("encode_blocks", _fresh(flat).view(-1, FP8.block))
            if ran:
                return Fp8Saved(pair[0], pair[1], t.shape, t.dtype, stride)
        size = _chunk(flat.device)
        pieces = [quantize(flat[i : i + size], FP8, signed=True) for i in range(0, len(flat), size)]
        if len(pieces) == 1:
            codes, scales = pieces[0]
        else:  # blocks are independent: the pieces' codes and scales are the whole's
            codes = torch.cat([c.view(torch.uint8) for c, _ in pieces]).view(torch.float8_e4m3fn)
            scales = torch.cat([s for _, s in pieces])
        return Fp8Saved(codes, scales, t.shape, t.dtype, stride)

    def _stored_apart(self, key: tuple[Any, ...]) -> tuple[Any, ...] | None:
        # (attention's output, the next projection's input, stored once as attention's
        # bfloat16 copy: less memory than a second copy in fp8, and nearer the value)
        return ATTENTION._packed.get(key)

    def decode(self, packed: Any) -> Tensor:
        if isinstance(packed, Tensor):
            return packed
        if isinstance(packed, Copied):  # (a small view's copy, or attention's: `encode`)
            return packed.read()
        numel = math.prod(packed.shape)
        out = native.fp8_decode(packed.codes, packed.scales, numel, packed.dtype, FP8.block)
        if out is not None:
            return _shaped(out, packed)
        if GATE.wants(packed.codes.device, numel):
            if numel % FP8.block:
                out, ran = _run("decode", packed.codes, packed.scales, numel, packed.dtype)
            else:
                out, ran = _run("decode_blocks", packed.codes, packed.scales, packed.dtype)
            if ran:
                return _shaped(out.view(-1), packed)
        size = _chunk(packed.codes.device)
        if len(packed.codes) <= size:  # float32 comes back as dequantize made it, no copy
            out = dequantize(packed.codes, packed.scales, FP8, (numel,), signed=True)
            return _shaped(out.to(packed.dtype), packed)
        flat, block = torch.empty(numel, dtype=packed.dtype, device=packed.codes.device), FP8.block
        for i in range(0, numel, size):
            n = min(size, numel - i)
            blocks = -(-n // block)
            codes = packed.codes[i : i + blocks * block]
            scales = packed.scales[i // block : i // block + blocks]
            flat[i : i + n] = dequantize(codes, scales, FP8, (n,), signed=True)
        return _shaped(flat, packed)


@dataclass(frozen=True)
class CenteredSaved:
    """A saved tensor as `Centered` keeps it: what the inner codec stored of its rows less
    their means, those float32 means, and the shape and dtype to decode it back to."""

    inner: Any
    means: Tensor
    shape: torch.Size
    dtype: torch.dtype


class Centered(Codec):
    """A layer norm's input, stored by ``inner`` (``bf16`` or ``fp8``) as its rows' (the
    normalized size's, ``row`` elements each) differences from their means, beside those
    means in float32; every other save of the call (the weight, the mean and the inverse
    deviation it computed) kept as it is. Stored whole, an input whose rows carry a large
    offset (a residual stream) lost to rounding most of what the backward's ``input -
    mean`` keeps: centred on the very means the norm subtracts, the rounding is relative to
    each row's spread, as the norm's own result is, for one float32 a row more. A row holding
    an inf or NaN decodes to NaN, as its norm is."""

    def __init__(self, inner: Codec, target: Tensor, row: int) -> None:
        super().__init__()
        self.inner, self.name, self.row = inner, inner.name, row
        self.target = (target.data_ptr(), target.numel(), target.dtype)
        self.shape, self.copied = target.shape, not target.is_contiguous()

    def _is_input(self, t: Tensor) -> bool:
        """Whether the save `t` is the norm's input: the tensor given (or a view of it of
        its size: an instance norm saves its input reshaped), its copy in another dtype
        (CUDA's autocast runs the norms in float32 on a cast copy of the input), or, of an
        input not contiguous, its contiguous copy (an instance norm, and a group norm off
        the CPU, normalize a copy of a channels_last input, whose rows are whole in memory:
        kept as it is, it held the input's float32 bytes)."""
        if (t.data_ptr(), t.numel(), t.dtype) == self.target:
            return True
        if t.dtype != self.target[2]:
            return t.shape == self.shape
        return self.copied and t.numel() == self.target[1] and t.is_contiguous()

    def stores(self, t: Tensor) -> bool:
        return (
            t.is_contiguous()
            and t.numel() >= FP8.block
            and self._is_input(t)
            and self.inner.stores(t)
        )

    def pack(self, t: Tensor) -> Any:
        # (the input not contiguous, as channels_last: stored as the codec stores it, not
        # centred, in its memory order; the call's other saves kept as they are)
        if _plain_layout(t) and not t.is_contiguous() and self._is_input(t):
            return _ByInner(self.inner.pack(t))
        return super().pack(t)

    def unpack(self, packed: Any) -> Tensor:
        if isinstance(packed, _ByInner):
            return self.inner.unpack(packed.packed)
        return super().unpack(packed)

    def encode(self, t: Tensor) -> Any:
        rows = t.reshape(-1, self.row)
        means = rows.mean(dim=1, dtype=torch.float32)
        if isinstance(self.inner, ToFp8):  # (the differences coded as they are made, on a CPU)
            done = native.fp8_encode(rows.view(-1), FP8.block, means)
            if done is not None:
                means.masked_fill_(~means.isfinite(), math.nan)
                inner = Fp8Saved(done[0], done[1], torch.Size([t.numel()]), torch.float32)
                return CenteredSaved(inner, means, t.shape, t.dtype)
        rest = rows - means[:, None]  # (float32, the one copy of the input made)
        # (a row holding an inf or NaN: its mean NaN and its differences 0, so that it decodes
        # to NaN, as its norm is, without spreading over an fp8 block shared with other rows)
        spoilt = ~means.isfinite()
        rest.masked_fill_(spoilt[:, None], 0.0)
        means.masked_fill_(spoilt, math.nan)
        return CenteredSaved(self.inner.encode(rest.view(-1)), means, t.shape, t.dtype)

    def decode(self, packed: Any) -> Tensor:
        if not isinstance(packed, CenteredSaved):
            return packed
        inner, means = packed.inner, packed.means
        if isinstance(inner, Fp8Saved):  # (the means added as it is decoded, on a CPU)
            numel, dtype = math.prod(packed.shape), packed.dtype
            out = native.fp8_decode(inner.codes, inner.scales, numel, dtype, FP8.block, means)
            if out is not None:
                return out.view(packed.shape)
        rest = self.inner.decode(packed.inner).reshape(-1, self.row)  # (float32, fresh)
        return rest.add_(packed.means[:, None]).to(packed.dtype).view(packed.shape)


@dataclass(frozen=True)
class _ByInner:
    """A save `Centered` left to its inner codec (an input not contiguous)."""

    packed: Any


_BF16 = ToBfloat16()


@dataclass(frozen=True)
class NearOneSaved:
    """A saved tensor as `NearOne` keeps it: what ``codec`` stored of its distances from 0
    or 1 (a tensor as it is where ``codec`` is None), and the dtype to decode it back to;
    `signed`: a tanh's output, ``inner`` its bfloat16 form (`NearOne.encode`) or, of its
    dtype, its copy as it was."""

    inner: Any
    codec: Codec | None
    dtype: torch.dtype
    signed: bool = False

    def read(self) -> Tensor:
        if self.signed:
            return self.inner if self.inner.dtype == self.dtype else _untailed(self.inner)
        if self.codec is None and self.inner.dtype != self.dtype:  # (float32 as bfloat16)
            return _unnear(self.inner)
        near = self.inner if self.codec is None else self.codec.decode(self.inner)
        return torch.where(near.signbit(), near + 1.0, near).to(self.dtype)


def _unnear(stored: Tensor) -> Tensor:
    """A float32 ``p`` from its distance from 0 or 1 stored in bfloat16 (`NearOne.encode`),
    a chunk at a time: no temporaries of the whole tensor's size beside the result (a
    hand-written attention's probabilities are its largest saves)."""
    out = torch.empty(stored.shape, dtype=torch.float32, device=stored.device)
    flat, into, step = stored.view(-1), out.view(-1), _chunk(stored.device)
    for start in range(0, flat.numel(), step):
        near = flat[start : start + step].float()
        into[start : start + step] = torch.where(near.signbit(), near.add(1.0), near)
    return out


def _near_bfloat16(t: Tensor, signed: bool) -> Tensor:
    """`NearOne`'s stored form of a contiguous float32 ``t`` in bfloat16, a chunk at a time
    (in range or infinite: what `ToBfloat16` stores, without its clamp)."""
    out = torch.empty(t.shape, dtype=torch.bfloat16, device=t.device)
    flat, into, step = t.view(-1), out.view(-1), _chunk(t.device)
    for start in range(0, flat.numel(), step):
        part = flat[start : start + step]
        if signed:
            near = part.abs()
            far = near > 0.5  # (NaN stays in the middle)
            near.neg_().add_(1.0).reciprocal_().copysign_(part)  # (1 - |a| exact past 1/2)
            into[start : start + step] = torch.where(far, near, part, out=near)
        else:
            # (1 - 1 is +0: -0 marks it)
            into[start : start + step] = torch.where(part > 0.5, (1.0 - part).neg_(), part)
    return out


def _untailed(stored: Tensor) -> Tensor:
    """A float32 tanh output from its bfloat16 form (`NearOne.encode`): past 1 in magnitude
    ``copysign(1 - 1 / |s|, s)`` (an infinity: +-1 exactly), elsewhere ``s``; computed in
    place on the one float32 tensor returned."""
    far = stored.abs() > 1.0
    out = stored.to(torch.float32)
    out.abs_().reciprocal_().neg_().add_(1.0).copysign_(stored)
    return torch.where(far, out, stored, out=out)


class NearOne(Codec):
    """A sigmoid's or a softmax's output ``p`` (in [0, 1]) stored as its distance from the
    nearer of 0 and 1: ``p`` up to one half, ``-(1 - p)`` past it (the sign says which;
    ``1 - p`` is exact there). Stored as it is, a confident ``p`` rounds to 1 and the
    backward's ``p (1 - p)``, which a binary cross-entropy of ``p`` divides by, is lost;
    stored so, ``1 - p`` keeps its relative precision. By ``inner`` under ``bf16``; under
    ``fp8`` as ``bf16`` stores it (float32 as bfloat16, 16-bit as it is): one fp8 scale for
    a block holding values near one half flushed a ``1 - p`` under about 2e-6 to 0, and a
    confidently wrong prediction's gradient with it. `signed`: a tanh's output ``a`` (in
    [-1, 1]; its backward reads ``1 - a^2``), float32 stored in bfloat16 under both as
    ``a`` up to one half in magnitude and ``copysign(1 / (1 - |a|), a)`` past it (at least 2
    in magnitude: the regions stay apart once rounded; +-1 is an infinity, read back
    exactly), 16-bit under ``fp8`` as a copy as it is."""

    def __init__(self, inner: Codec, signed: bool = False) -> None:
        super().__init__()
        self.inner, self.name, self.signed = inner, inner.name, signed
        self.store = _BF16 if inner.name == "fp8" else inner
        # the inner codec's record of what it packed, shared: the output saved again by
        # another function (a gate's product) is stored once, as here, and either decodes it
        self._packed = inner._packed

    def stores(self, t: Tensor) -> bool:
        return t.numel() >= FP8.block and self.inner.stores(t)

    def encode(self, t: Tensor) -> Any:
        if self.signed and t.dtype != torch.float32:  # (16-bit: a copy, as it may be written)
            return NearOneSaved(t.clone(), None, t.dtype, signed=True)
        if t.dtype == torch.float32:  # (stored in bfloat16, a chunk at a time)
            stored = _near_bfloat16(t.contiguous(), self.signed)
            return NearOneSaved(stored, None, t.dtype, signed=self.signed)
        near = torch.where(t > 0.5, (1.0 - t).neg_(), t)  # (1 - 1 is +0: -0 marks it)
        if self.store is _BF16 and near.dtype != torch.float32:  # (16-bit: as it is)
            return NearOneSaved(near, None, t.dtype)
        return NearOneSaved(self.store.encode(near), self.store, t.dtype)

    def decode(self, packed: Any) -> Tensor:
        if isinstance(packed, NearOneSaved):
            return packed.read()
        return self.inner.decode(packed)  # (the inner codec's, found in the shared record)


def _chunk(device: torch.device) -> int:
    """Elements the eager codec takes at a time on ``device`` (`CHUNK`)."""
    return CHUNK if device.type == "cpu" else CHUNK_ACCELERATOR


def _pins(t: Tensor) -> bool:
    """Whether `t` is a view of memory more than twice its own size (the last token's row
    of a sequence's activations): kept as it is, it would hold all of that memory."""
    return t.untyped_storage().nbytes() > 2 * t.numel() * t.element_size()


def _in_memory_order(t: Tensor) -> tuple[Tensor, tuple[int, ...] | None]:
    """`t`'s elements as one flat tensor, and the strides that put them back: for a tensor
    whose elements fill their memory without gaps in another order than its own (a
    transposed view), that memory as it lies, so no copy is made; otherwise its flattened
    order (a copy where it is not contiguous), and None."""
    if t.is_contiguous():
        return t.reshape(-1), None
    dims = sorted((st, size) for size, st in zip(t.shape, t.stride(), strict=True) if size > 1)
    expected = 1
    for st, size in dims:
        if st != expected:
            return t.reshape(-1), None
        expected *= size
    return t.as_strided((t.numel(),), (1,)), tuple(t.stride())


def _shaped(flat: Tensor, packed: Fp8Saved) -> Tensor:
    """The flat decoded `flat` in `packed`'s shape (and strides, where it has them)."""
    if packed.stride is None:
        return flat.view(packed.shape)
    return flat.as_strided(packed.shape, packed.stride)


def _encode(flat: Tensor) -> tuple[Tensor, Tensor]:
    """The states' `quantize` of a flat tensor, as one compiled kernel traces it."""
    return quantize(flat, FP8, signed=True)


def _encode_blocks(blocks: Tensor) -> tuple[Tensor, Tensor]:
    """`_encode` of a tensor of whole blocks, given as (blocks, block): what `quantize` does
    to it (the states' `encode` of its float32 blocks) without the padding to whole blocks,
    which costs a kernel of unknown size a mask on every element."""
    tables = code_tables(FP8, True, blocks.device)
    return encode_blocks(blocks.to(torch.float32), FP8, True, tables, tensor=True)


def _decode(codes: Tensor, scales: Tensor, numel: int, dtype: torch.dtype) -> Tensor:
    """The states' `dequantize` of `numel` elements, cast to `dtype` in the same kernel."""
    return dequantize(codes, scales, FP8, (numel,), signed=True).to(dtype)


def _decode_blocks(codes: Tensor, scales: Tensor, dtype: torch.dtype) -> Tensor:
    """`_decode` of whole blocks, (blocks, block): the states' `decode`, cast to `dtype`."""
    tables = code_tables(FP8, True, codes.device)
    return decode_blocks(codes, scales, FP8, True, tables, tensor=True).to(dtype)


def _fresh(flat: Tensor) -> Tensor:
    """The flat tensor `flat` on its memory, not a view of another tensor: views and fresh
    tensors take separate torch.compile builds, and this keeps every call's input fresh."""
    if flat._base is None:
        return flat
    out = flat.new_empty(0)
    return out.set_(flat.untyped_storage(), flat.storage_offset(), flat.shape, flat.stride())


def _to_bfloat16(t: Tensor) -> Tensor:
    """`ToBfloat16`'s stored tensor: `t` in bfloat16, a finite value past its range at its
    largest of that sign, infinities and NaN as they are (clamp takes infinities to the
    bound too: `where` puts them back)."""
    return torch.where(t.isinf(), t, t.clamp(-_BF16_MAX, _BF16_MAX)).to(torch.bfloat16)


_KERNELS: dict[str, Callable[..., Any]] = {
    "to_bfloat16": _to_bfloat16,
    "encode": _encode,
    "encode_blocks": _encode_blocks,
    "decode": _decode,
    "decode_blocks": _decode_blocks,
}
_COMPILED: dict[str, Callable[..., Any]] = {}
_NO_DUCK_SIZING = fx_config.patch(use_duck_shape=False)


def _run(name: str, first: Tensor, *args: Any) -> tuple[Any, bool]:
    """(the compiled kernel `name` on `first` and `args`, True), or (None, False) when its
    build failed (`GATE`). The states' table for the device is made before, so that no
    build traces its making, and sizes and storage offsets each take a symbol of their own
    (no duck sizing: a size equal to an offset, or to the codes' length, would otherwise
    build again for every other case). Autocast is off inside (none of its ops is one
    autocast changes): a forward saves under it and a recomputation outside it, and each
    state would be a build of its own, toward dynamo's limit of builds per function."""
    code_tables(FP8, True, first.device)
    with torch.no_grad(), torch.autocast(first.device.type, enabled=False), _NO_DUCK_SIZING:
        return GATE.run(
            _compiled(name), first, *args, eager=_KERNELS[name], agree=_agrees, stacklevel=4
        )


def _agrees(got: list[Any], expected: list[Any]) -> str:
    """How the compiled codec's results (`GATE`'s check) differ from eager's beyond a last
    bit of float32 rounding, or '' (`engine.difference` with `_far`): on a GPU the compiled
    block scales and quotients are a float32 ulp off eager's (an H200 run: scales in half the
    blocks, so a quotient at an exact tie of two e4m3 values takes the other), which the
    codec, lossy by design, allows."""
    return difference(got, expected, _far, " past a last bit")


def _far(a: Tensor, b: Tensor) -> Tensor:
    """The elements of the compiled result ``a`` past a last bit of eager's ``b``: codes
    more than one e4m3 value apart or NaN codes that differ, floats off by more than one
    unit in the last place of their dtype or not equal where either is infinite or NaN,
    other elements not equal."""
    if a.dtype == torch.float8_e4m3fn:
        x, y = _e4m3_order(a), _e4m3_order(b)
        special = (a.float().isnan() | b.float().isnan()).reshape(-1)
        return torch.where(special, x != y, (x - y).abs() > 1)
    if a.is_floating_point():
        x, y = a.double().reshape(-1), b.double().reshape(-1)
        ulp = torch.finfo(a.dtype).eps * y.abs().clamp_min(torch.finfo(a.dtype).tiny)
        finite = x.isfinite() & y.isfinite()
        near = torch.where(finite, (x - y).abs() <= ulp, x == y)
        return ~(near | (x.isnan() & y.isnan()))
    return (a != b).reshape(-1)


def _e4m3_order(codes: Tensor) -> Tensor:
    """e4m3 codes as integers in the order of their values (adjacent values one apart)."""
    b = codes.reshape(-1).view(torch.uint8).to(torch.int32)
    return torch.where(b >= 128, 128 - b, b)


def _compiled(name: str) -> Callable[..., Any]:
    """The torch.compile'd kernel `name` (`_KERNELS`), built on first use: sizes dynamic,
    so one build per dtype (and device) serves every tensor; eager's casts and division
    kept."""
    if name not in _COMPILED:
        _COMPILED[name] = torch.compile(
            _KERNELS[name],
            dynamic=True,
            fullgraph=True,
            options={"emulate_precision_casts": True, "eager_numerics.division_rounding": True},
        )
    return _COMPILED[name]


# the codec of each storage option (and of `keep` below a storing layer)
CODECS: dict[str, type[Codec]] = {"keep": Keep, "bf16": ToBfloat16, "fp8": ToFp8}
