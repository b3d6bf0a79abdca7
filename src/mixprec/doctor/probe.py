"""Hooks that watch one forward and backward pass of a model copy, module by module.

A reference run records every module's inputs and outputs (cloned, so later in-place ops
cannot change them), the largest magnitude of each one's gradient, and every parameter's
gradient. A target run of an identical copy compares each tensor with its reference twin:
range (amax, smallest magnitude), how much falls outside the target dtype (overflow,
underflow, flush to zero), non-finite values, and the error against the reference; for the
gradients flowing between modules it only counts inf/NaN (where a backward pass breaks).

Tensors are matched by position: the i-th output of the k-th call of module `name`.
A tensor seen several times (the output of a block is also its last child's output and the
next layer's input) is measured once, in a few passes that allocate no large temporaries;
small tensors are measured together at the end (see `Comparisons`).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import torch
from torch import Tensor, nn

from mixprec.dtypes import format_info
from mixprec.tree import iter_tensors

__all__: list[str] = []


class RefStats(NamedTuple):
    """A reference tensor's statistics against one target dtype (and loss scale)."""

    numel: float  # elements compared
    nonzero: float  # nonzero elements in the reference
    amax: float  # largest |reference| (unscaled)
    amin: float  # smallest nonzero |reference| (unscaled; inf when all are zero)
    overflow: float  # reference values above the dtype's max (after scaling)
    underflow: float  # nonzero reference values below the dtype's smallest normal (scaled)
    ref_sq: float  # sum of squares of the reference


class Stats(NamedTuple):
    """One target tensor (or several, combined) against its reference: the same columns
    for activations and gradients."""

    numel: float
    nonzero: float
    amax: float
    amin: float
    overflow: float
    underflow: float
    ref_sq: float
    flushed: float  # underflow values (see RefStats) that are zero in the target
    nonfinite: float  # inf/NaN in the target
    err_sq: float  # sum of squared differences target - reference (unscaled)
    # infinities in the target taken as the reference's mask fill (see RefTensor): no error,
    # but no finite value either, which a module reading them may turn into NaN
    filled: float = 0.0

    @property
    def rel_error(self) -> float:
        """||target - reference|| / ||reference|| (inf with inf/NaN, nan when empty)."""
        if self.numel == 0:
            return math.nan
        if self.nonfinite > 0:
            return math.inf
        if self.ref_sq == 0:
            return 0.0 if self.err_sq == 0 else math.inf
        return math.sqrt(self.err_sq / self.ref_sq)

    @property
    def sqnr_db(self) -> float:
        """Signal-to-quantization-noise ratio of the target in dB."""
        if self.numel == 0:
            return math.nan
        if self.nonfinite > 0:
            return -math.inf
        if self.err_sq == 0:
            return math.inf
        if self.ref_sq == 0:
            return -math.inf
        return 10.0 * math.log10(self.ref_sq / self.err_sq)


Key = tuple[str, int, str, int]  # (module name, call index, "in"/"out", position)

_info = functools.cache(format_info)
_NO_ZERO = 1e30  # added to exact zeros so that the smallest nonzero magnitude is a plain min
_F32_MAX = torch.finfo(torch.float32).max


@functools.cache
def _finfo_max(dtype: torch.dtype) -> float:
    return torch.finfo(dtype).max


def floating_tensors(obj: Any) -> list[Tensor]:
    """Every floating tensor in a nested structure (see `mixprec.tree`), in a stable order."""
    return [t for t in iter_tensors(obj) if t.is_floating_point()]


def extreme(dtype: torch.dtype) -> float:
    """The largest finite value of a floating `dtype` as a float32 snapshot holds it: its
    own, or float32's for float64 (`snapshot` maps float64's there)."""
    return min(_finfo_max(dtype), _F32_MAX)


def mask_floor(dtype: torch.dtype) -> float:
    """The smallest magnitude that stands for a mask's fill in a floating `dtype` (as a
    float32 snapshot holds it): the bottom of its top binade. An additive mask of
    ``finfo(dtype).min`` plus a score is no longer the extreme itself (float16's -65504 + 20
    is -65472; below a negative score it is -inf) but stays there."""
    return 2.0 ** math.floor(math.log2(extreme(dtype)))


def snapshot(t: Tensor) -> Tensor:
    """A detached float32 copy of `t` (later in-place ops on `t` do not reach it); float64's
    largest finite values (an attention mask's ``finfo(float64).min``) become float32's, as
    `mixprec.convert` casts them, where they would be infinities."""
    out = t.detach().to(torch.float32, copy=True)
    if _finfo_max(t.dtype) > _F32_MAX and out.numel():
        top = _finfo_max(t.dtype)
        out.masked_fill_(t == top, _F32_MAX).masked_fill_(t == -top, -_F32_MAX)
    return out


def _norm(x: Tensor) -> float:
    """||x|| in float32, or summed in float64 where float32's sum of squares overflows
    (values beyond about 1.8e19) with `x` finite."""
    norm = torch.linalg.vector_norm(x).item()
    if math.isinf(norm) and bool(torch.isfinite(x).all()):
        norm = torch.linalg.vector_norm(x, dtype=torch.float64).item()
    return norm


class Scratch:
    """A reusable float32 buffer: fresh multi-megabyte temporaries cost more (page faults)
    than the passes over them."""

    def __init__(self) -> None:
        self._buf: Tensor | None = None

    def like(self, t: Tensor) -> Tensor:
        n = t.numel()
        if self._buf is None or self._buf.numel() < n or self._buf.device != t.device:
            self._buf = torch.empty(n, dtype=torch.float32, device=t.device)
        return self._buf[:n].view(t.shape)


class RefTensor:
    """A reference run's tensor (a float32 snapshot) and, computed on first use and shared by
    every run compared with it, its statistics: magnitudes and norm, and the counts against
    each target dtype's limits.

    inf/NaN the reference holds itself (a mask's -inf before a softmax) are no error of the
    target: `base` moves them out of `value` (set to 0, kept in `bad` / `bad_values`), and a
    target holding the same value there is compared as 0 too (`agreeing_zeroed`). So are the
    values at its dtype's largest finite magnitude (`extreme`), the fill a mask written
    ``torch.finfo(dtype).min`` gives: they stand for an infinity, and a target holding a
    value of the same sign in its own dtype's top binade or beyond there (`mask_floor`: the
    extreme itself, plus a score, or an infinity) holds the same mask."""

    def __init__(self, t: Tensor, scratch: Scratch) -> None:
        self.value = snapshot(t)
        self.extreme = extreme(t.dtype)
        self.bad: Tensor | None = None
        self.bad_values: Tensor | None = None
        self._scratch = scratch
        self._base: tuple[float, float, float, float] | None = None
        self._counts: dict[tuple[torch.dtype, float], tuple[float, float]] = {}

    def base(self) -> tuple[float, float, float, float]:
        """(nonzero count, amax, smallest nonzero magnitude, sum of squares) of the finite
        values."""
        if self._base is None:
            r = self.value
            if not r.numel():
                self._base = (0.0, 0.0, math.inf, 0.0)
                return self._base
            a = torch.abs(r, out=self._scratch.like(r))
            lo, hi = torch.aminmax(r)
            amax, amin, norm = torch.stack(
                [torch.maximum(lo.abs(), hi.abs()), a.amin(), torch.linalg.vector_norm(r)]
            ).tolist()
            if not amax < self.extreme:  # its own inf/NaN or mask fills: measure the rest
                self.bad = ~torch.isfinite(r) | (a == self.extreme)
                self.bad_values = r[self.bad]
                self.value = torch.where(self.bad, 0.0, r)
                return self.base()
            if math.isinf(norm):  # its squares overflow float32's sum: sum them in float64
                norm = _norm(r)
            nonzero = float(r.numel())
            if amin == 0:  # zeros: count them, and find the smallest nonzero magnitude
                # in float passes (boolean ones are several times slower on CPUs): with
                # s = sign|r|, sum(s) counts the nonzeros and |r| + (1 - s) * big moves the
                # zeros out of the way of the minimum
                s = torch.sign(a)
                nonzero, amin = torch.stack(
                    [
                        s.sum(dtype=torch.float64),  # exact beyond 2**24 elements
                        s.sub_(1.0).mul_(-_NO_ZERO).add_(a).amin().double(),
                    ]
                ).tolist()
            self._base = (nonzero, amax, amin if nonzero else math.inf, norm * norm)
        return self._base

    def stats(self, limit: torch.dtype, scale: float) -> RefStats:
        """Its statistics with `limit`'s max and smallest normal applied to the values times
        `scale`."""
        nonzero, amax, amin, sq = self.base()
        key = (limit, scale)
        if key not in self._counts:
            info = _info(limit)
            high, low = info.max / scale, info.smallest_normal / scale
            zeros = self.value.numel() - nonzero
            a = self.value.abs() if amax > high or amin < low else None
            over = torch.count_nonzero(a > high).item() if a is not None and amax > high else 0
            under = (
                torch.count_nonzero(a < low).item() - zeros if a is not None and amin < low else 0
            )
            self._counts[key] = (float(over), float(under))
        over, under = self._counts[key]
        return RefStats(float(self.value.numel()), nonzero, amax, amin, over, under, sq)

    def agreeing_zeroed(self, t: Tensor) -> tuple[Tensor, int]:
        """`t` (after `base`), as a float32 copy with 0 where it holds the same inf/NaN as the
        reference, or, where the reference holds its dtype's extreme (a mask's fill), a value
        of that sign at or beyond its own dtype's `mask_floor`; `t` itself when the
        reference holds neither. With the count of infinities taken as a fill."""
        if self.bad is None or self.bad_values is None:
            return t, 0
        floor = mask_floor(t.dtype)
        t = snapshot(t)
        got, ref = t[self.bad], self.bad_values
        same = (got == ref) | (got.isnan() & ref.isnan())
        fill = (ref.abs() == self.extreme) & (got * torch.sign(ref) >= floor)
        filled = int(torch.count_nonzero(fill & got.isinf()).item())
        t[self.bad] = torch.where(same | fill, 0.0, got)
        return t, filled


def count_nonfinite(t: Tensor) -> int:
    """inf/NaN values in `t`: x - x is NaN exactly there (float passes, no bool tensor)."""
    return int((t - t).nan_to_num_(1.0).sum(dtype=torch.float64).item())


def _target_stats(
    t: Tensor, ref: RefTensor, limit: torch.dtype, scale: float, flushed: bool, scratch: Scratch
) -> Stats:
    """One target tensor against its reference, with no large temporaries; `flushed` counts
    the underflowing reference values that are zero in the target."""
    head = ref.stats(limit, scale)  # first: it moves the reference's own inf/NaN out
    r, (t, filled) = ref.value, ref.agreeing_zeroed(t)
    lost = 0
    if flushed and head.underflow > 0:
        low = _info(limit).smallest_normal / scale
        lost = torch.count_nonzero((t == 0) & (r != 0) & (r.abs() < low)).item()
    # r - t / scale in one pass, through the scratch buffer (its sign does not matter)
    err = torch.linalg.vector_norm(torch.add(r, t, alpha=-1.0 / scale, out=scratch.like(r)))
    err = err.item()
    nonfinite = 0 if math.isfinite(err) else count_nonfinite(t)
    if not (nonfinite or math.isfinite(err)):  # finite values past float32 in r - t or its
        err = torch.linalg.vector_norm(r.double() - t.double() / scale).item()  # squares
    return Stats(*head, float(lost), float(nonfinite), err * err, float(filled))


class Comparisons:
    """Target tensors compared with their reference twins, under a tag each.

    Large tensors are measured as they are added (no copy, a few passes through a scratch
    buffer); small ones are copied and measured together at the end, concatenated with
    per-tensor segment reductions, so that a model of many small layers costs a few big
    operations rather than many tiny ones. Each pair has a `limit` dtype whose max and
    smallest normal the scaled reference is checked against, and the `scale` the target's
    values carry (a loss scale for gradients; the error is measured with it divided out).
    """

    SMALL = 4096  # elements; below this a tensor waits to be measured with the others

    def __init__(self, scratch: Scratch | None = None) -> None:
        self._rows: dict[Any, Stats] = {}
        self._small: dict[torch.device, list[tuple[Any, Tensor, Tensor, float, ...]]] = {}
        self._scratch = scratch or Scratch()

    def add(
        self,
        tag: Any,
        target: Tensor,
        reference: RefTensor,
        limit: torch.dtype,
        scale: float = 1.0,
        *,
        flushed: bool = False,
    ) -> None:
        """Measure `target` (its current values) against `reference`; `flushed` also counts
        the underflowing reference values that became zero (always done for small ones)."""
        target = target.detach()
        if target.shape != reference.value.shape or target.numel() == 0:
            return
        if target.numel() >= self.SMALL:
            self._rows[tag] = _target_stats(target, reference, limit, scale, flushed, self._scratch)
            return
        info = _info(limit)
        unscaled = snapshot(target.reshape(-1))
        mine = torch.tensor(mask_floor(target.dtype), dtype=torch.float32)  # (its mask fills)
        if scale != 1.0:
            unscaled.div_(scale)
            mine.div_(scale)
        self._small.setdefault(target.device, []).append(
            (
                tag,
                unscaled,
                reference.value.reshape(-1),
                info.max / scale,
                info.smallest_normal / scale,
                reference.extreme,
                mine.item(),
            )
        )

    def compute(self) -> dict[Any, Stats]:
        """The statistics of each tag."""
        for device, items in self._small.items():
            lengths = torch.tensor([item[1].numel() for item in items], device=device)
            columns = [torch.tensor([item[i] for item in items], device=device) for i in (3, 4)]
            extremes = [
                torch.tensor([item[i] for item in items], device=device, dtype=torch.float32)
                for i in (5, 6)
            ]
            rows = _segment_stats(
                torch.cat([item[1] for item in items]),
                torch.cat([item[2] for item in items]),
                lengths,
                *columns,
                *extremes,
            )
            self._rows.update(zip((item[0] for item in items), rows, strict=True))
        self._small.clear()
        return self._rows


def _segment_stats(
    t: Tensor,
    r: Tensor,
    lengths: Tensor,
    high: Tensor,
    low: Tensor,
    ref_extreme: Tensor | None = None,
    extreme: Tensor | None = None,
) -> list[Stats]:
    """Statistics of each segment (consecutive `lengths` elements) of the unscaled target `t`
    against `r`, where segment i's reference is checked against `high[i]` and `low[i]`
    (the dtype's max and smallest normal divided by the scale); three segment reductions.
    Where `r` holds inf/NaN itself, or its dtype's largest finite magnitude
    (`ref_extreme[i]`, a mask's fill), both count as 0 if `t` holds the same, or a value of
    that sign at or beyond `extreme[i]` (its own dtype's `mask_floor`, unscaled; see
    RefTensor; the infinities among those are counted as `filled`). Squares are summed in
    float64 (a float32 sum overflows past 1.8e19)."""
    bad = ~torch.isfinite(r)
    same = (t == r) | (t.isnan() & r.isnan())
    filled = torch.zeros_like(same)
    if ref_extreme is not None and extreme is not None:
        fill = r.abs() == torch.repeat_interleave(ref_extreme, lengths)
        bad |= fill
        fill &= t * torch.sign(r) >= torch.repeat_interleave(extreme, lengths)
        same |= fill
        filled = fill & t.isinf()
    t = torch.where(bad & same, 0.0, t)
    r = torch.where(bad, 0.0, r)
    ra = r.abs()
    nonzero = r != 0
    tiny = nonzero & (ra < torch.repeat_interleave(low, lengths))
    wide = r.double()
    diff = t.double() - wide
    counts = torch.stack(
        [
            nonzero,
            ra > torch.repeat_interleave(high, lengths),
            tiny,
            tiny & (t == 0),
            ~torch.isfinite(t),
            filled,
        ],
        dim=1,
    ).to(torch.float64)
    sums = torch.segment_reduce(
        torch.cat([counts, (wide * wide)[:, None], (diff * diff)[:, None]], dim=1),
        "sum",
        lengths=lengths,
        axis=0,
    )
    amax = torch.segment_reduce(ra, "max", lengths=lengths)
    amin = torch.segment_reduce(torch.where(nonzero, ra, math.inf), "min", lengths=lengths)
    nonzero_n, overflow, underflow, flushed, nonfinite, filled_n, ref_sq, err_sq = sums.unbind(1)
    columns = [lengths.double(), nonzero_n, amax.double(), amin.double(), overflow, underflow]
    columns += [ref_sq, flushed, nonfinite, err_sq, filled_n]
    return [Stats(*row) for row in torch.stack(columns, dim=1).tolist()]


def lowest_float(dtypes: list[torch.dtype]) -> torch.dtype:
    """The floating dtype with the smallest range among `dtypes` (float32 if none)."""
    floats = [d for d in dtypes if d.is_floating_point]
    if not floats:
        return torch.float32
    return min(floats, key=lambda d: (_info(d).max, _info(d).eps))


def combine(stats: list[Stats]) -> Stats | None:
    """The statistics of several tensors as one (counts and squares summed, the largest
    amax, the smallest amin); None for none."""
    if not stats:
        return None
    sums = [sum(column) for column in zip(*stats, strict=True)]
    combined = Stats(*sums)
    return combined._replace(
        amax=max(s.amax for s in stats), amin=min((s.amin for s in stats), default=math.inf)
    )


@dataclass
class Call:
    """One call of one module: the keys of its input and output tensors."""

    name: str
    index: int
    inputs: list[Key] = field(default_factory=list)
    outputs: list[Key] = field(default_factory=list)


@dataclass
class Slot:
    """One distinct tensor seen during a run."""

    key: Key
    dtype: torch.dtype
    value: RefTensor | None = None  # reference runs: the tensor
    grad_amax: Tensor | None = None  # reference runs: largest magnitude of its gradient
    grad_nonfinite: int = 0  # target runs: inf/NaN in its gradient
    grad_order: int = 0  # target runs: 1 for the first gradient the backward made, 2 ...
    twin: Slot | None = None  # target runs: the reference tensor at the same position


class Recording:
    """What one run saw: calls in completion order, tensors by key, parameter gradients,
    and (target runs) the queued comparisons with the reference."""

    def __init__(self) -> None:
        self.calls: list[Call] = []
        self.slots: dict[Key, Slot] = {}
        self.call_at: dict[tuple[str, int], Call] = {}
        self.loss: float = math.nan
        self.loss_dtype: torch.dtype = torch.float32
        self.param_grads: dict[str, RefTensor | None] = {}
        # reference runs: the parameters whose gradients hold inf/NaN in their own dtype (a
        # float64 one's overflow past float32 is no inf there, its NaN is)
        self.nonfinite_grads: list[str] = []
        self.types: dict[str, str] = {}
        # a module at several paths (shared by two blocks), by its name here: its other paths
        self.aliases: dict[str, tuple[str, ...]] = {}
        self.params_of: dict[str, list[str]] = {}
        self.param_limits: dict[str, torch.dtype] = {}
        # the parameters the converted model trains, in the dtype it stores them in (a
        # quantized layer's frozen codes are no parameter of it, or none that trains)
        self.trained: dict[str, torch.dtype] = {}
        self.scratch = Scratch()
        self.comparisons = Comparisons(self.scratch)
        self._rows: dict[Any, Stats] | None = None

    def rows(self) -> tuple[dict[Key, Stats], dict[str, Stats]]:
        """Statistics of values (by tensor key) and of parameter gradients (by name);
        computed on first call."""
        if self._rows is None:
            self._rows = self.comparisons.compute()
        split: dict[str, dict[Any, Stats]] = {"value": {}, "param": {}}
        for (kind, key), row in self._rows.items():
            split[kind][key] = row
        return split["value"], split["param"]


class Probe:
    """Hooks every module of a model copy for one run; use as `with Probe(...) as rec:`.

    With `reference=None` it records every tensor; given the recording of a reference run
    it queues each tensor for comparison with its twin there instead. `grad_scale` is the
    loss scale the target's backward runs at.
    """

    def __init__(
        self,
        model: nn.Module,
        reference: Recording | None = None,
        *,
        grad_scale: float = 1.0,
    ) -> None:
        self.model = model
        self.reference = reference
        self.grad_scale = grad_scale
        self.recording = Recording()
        self._handles: list[Any] = []
        self._seen: dict[int, tuple[Tensor, int, Key]] = {}
        self._counts: dict[str, int] = {}
        self._open: dict[str, list[Call]] = {}
        self._grads_seen = 0

    # -- tensor bookkeeping ------------------------------------------------------------------

    def _slot_for(self, t: Tensor, call: Call, kind: str, i: int) -> Key:
        """The key of `t`: an existing one if this very tensor (same version) was seen."""
        seen = self._seen.get(id(t))
        if seen is not None and seen[0] is t and seen[1] == t._version:
            return seen[2]
        key: Key = (call.name, call.index, kind, i)
        self._seen[id(t)] = (t, t._version, key)
        slot = Slot(key, t.dtype)
        self.recording.slots[key] = slot
        if self.reference is None:
            slot.value = RefTensor(t, self.recording.scratch)
        else:
            slot.twin = self._twin(call, kind, i)
            if slot.twin is not None and slot.twin.value is not None:
                self.recording.comparisons.add(("value", key), t, slot.twin.value, t.dtype)
        if t.requires_grad:
            self._handles.append(t.register_hook(self._grad_hook(slot)))
        return key

    def _grad_hook(self, slot: Slot) -> Callable[[Tensor], None]:
        def hook(grad: Tensor) -> None:
            if not grad.numel():
                return
            if self.reference is None:
                low, high = torch.aminmax(grad.detach())
                slot.grad_amax = torch.maximum(low.abs(), high.abs())
                return
            self._grads_seen += 1
            slot.grad_order = self._grads_seen
            # one reduction in at least float32 (a float16 norm overflows on finite values)
            wide = torch.promote_types(grad.dtype, torch.float32)
            if not math.isfinite(torch.linalg.vector_norm(grad.detach(), dtype=wide)):
                slot.grad_nonfinite = count_nonfinite(grad.detach())

        return hook

    def _twin(self, call: Call, kind: str, i: int) -> Slot | None:
        """The reference run's tensor at the same position (module, call, input/output, i)."""
        assert self.reference is not None
        twin = self.reference.call_at.get((call.name, call.index))
        if twin is None:
            return None
        keys = twin.inputs if kind == "in" else twin.outputs
        return self.reference.slots.get(keys[i]) if i < len(keys) else None

    # -- module hooks ------------------------------------------------------------------------

    def _pre(self, name: str) -> Callable[..., None]:
        def hook(module: nn.Module, args: Any, kwargs: Any) -> None:
            index = self._counts.get(name, 0)
            self._counts[name] = index + 1
            call = Call(name, index)
            for i, t in enumerate(floating_tensors((args, kwargs))):
                call.inputs.append(self._slot_for(t, call, "in", i))
            self._open.setdefault(name, []).append(call)

        return hook

    def _post(self, name: str) -> Callable[..., None]:
        def hook(module: nn.Module, args: Any, kwargs: Any, output: Any) -> None:
            call = self._open[name].pop()
            for i, t in enumerate(floating_tensors(output)):
                call.outputs.append(self._slot_for(t, call, "out", i))
            self.recording.calls.append(call)
            self.recording.call_at[(call.name, call.index)] = call

        return hook

    def __enter__(self) -> Recording:
        for name, module in self.model.named_modules():
            self._handles.append(
                module.register_forward_pre_hook(self._pre(name), with_kwargs=True)
            )
            self._handles.append(module.register_forward_hook(self._post(name), with_kwargs=True))
        return self.recording

    def __exit__(self, *exc: object) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        self._seen.clear()
        self._open.clear()


def measure_param_grads(
    params: list[tuple[str, Tensor]],
    recording: Recording,
    reference: Recording | None,
    limits: dict[str, torch.dtype],
    scale: float,
) -> None:
    """Store (reference run) or compare with the reference (target run) the gradient of
    each named parameter; `limits` gives the dtype whose range counts for each one."""
    for name, p in params:
        grad = p.grad
        if grad is not None and grad.layout != torch.strided:  # Embedding(sparse=True)
            grad = grad.to_dense()
        if reference is None:
            recording.param_grads[name] = (
                RefTensor(grad, recording.scratch) if grad is not None else None
            )
            if grad is not None and not bool(torch.isfinite(grad).all()):
                recording.nonfinite_grads.append(name)
            continue
        twin = reference.param_grads.get(name)
        if grad is None or twin is None:
            continue
        recording.comparisons.add(("param", name), grad, twin, limits[name], scale, flushed=True)
