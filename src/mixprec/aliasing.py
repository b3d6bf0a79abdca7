"""Tensors over the same memory: which of a list share bytes with another.

A tied weight and its transpose, or two Parameters made over one tensor's data, overlap;
views of disjoint parts of one buffer do not, interleaved ones included (the column halves
``big[:, :8]`` and ``big[:, 8:]``). An optimizer step that read both before writing either
would lose one's update, and a policy that cast them apart would untie them: both ask this
module, which compares each tensor's span from its first to its last element, and where two
spans meet and either tensor leaves gaps in its span, the bytes each one holds there.
"""

from __future__ import annotations

import math
from collections.abc import Iterator

import torch

__all__ = ["memory_of", "memory_span", "overlapping", "overlapping_pairs", "share_bytes"]

# how many runs of contiguous bytes one tensor lays out at a time (`share_bytes`): two int64
# tensors of this length, whatever the size of the tensors compared
_CHUNK = 1 << 20


def memory_span(t: torch.Tensor) -> tuple[int, int]:
    """The addresses ``[start, end)`` from ``t``'s first element to past its last."""
    last = sum((n - 1) * s for n, s in zip(t.shape, t.stride(), strict=True))
    start = t.data_ptr()
    return start, start + (last + 1) * t.element_size()


def memory_of(t: torch.Tensor) -> tuple[str, int, int]:
    """What ``t``'s addresses count in: its device's memory, or for a tensor with none (the
    meta device's, all at address 0) its storage, which its views share."""
    storage = t.untyped_storage()
    own = 0 if storage.data_ptr() else storage._cdata
    return t.device.type, -1 if t.device.index is None else t.device.index, own


def _runs(t: torch.Tensor) -> tuple[int, list[int], list[int]]:
    """``t``'s elements as runs of contiguous bytes: the length of a run in bytes, and the
    sizes and byte strides of the dimensions that place the runs, outermost first (none:
    ``t`` fills its span, as a contiguous tensor or a transpose of one does). A dimension of
    stride 0 (an expanded one) places nothing new."""
    size = t.element_size()
    dims = sorted(((s, n) for n, s in zip(t.shape, t.stride(), strict=True) if n > 1 and s))
    run = 1  # (in elements; the innermost dimensions folded in while they continue it)
    while dims and dims[0][0] == run:
        run *= dims.pop(0)[1]
    dims.reverse()
    return run * size, [n for _, n in dims], [s * size for s, _ in dims]


def _nested(run: int, sizes: list[int], strides: list[int]) -> bool:
    """Whether each dimension's stride passes all it holds (`_runs`): the runs are then
    apart, and laid out in order of address (every view of a tensor's elements: a slice, a
    transpose, a column)."""
    reach = run
    for n, s in zip(reversed(sizes), reversed(strides), strict=True):
        if s < reach:
            return False
        reach += (n - 1) * s
    return True


def _starts(
    t: torch.Tensor, layout: tuple[int, list[int], list[int]], low: int, high: int
) -> Iterator[torch.Tensor]:
    """The first addresses of ``t``'s runs (`_runs`: ``layout``) that meet ``[low, high)``,
    `_CHUNK` runs at a time, as int64 CPU tensors, in the layout's order: the arithmetic of
    its layout, which reads none of its memory. Runs of the outermost dimension's blocks
    that miss the range are never laid out."""
    run, sizes, strides = layout
    start = t.data_ptr()
    count, first = math.prod(sizes), 0
    if sizes:  # (the blocks of the outermost dimension meeting the range)
        inner = math.prod(sizes[1:])
        reach = run + sum((n - 1) * s for n, s in zip(sizes[1:], strides[1:], strict=True))
        first = max(0, (low - start - reach) // strides[0] + 1) * inner
        count = min(sizes[0], -((start - high) // strides[0])) * inner
    # the offsets of the innermost dimensions' runs, laid out once (at most `_CHUNK`), and
    # added to those of the outer blocks: the outer ones' indices alone are divided
    split, block = len(sizes), 1
    while split > 1 and block * sizes[split - 1] <= _CHUNK:
        split -= 1
        block *= sizes[split]
    inner = torch.zeros(1, dtype=torch.int64)
    for n, s in zip(sizes[split:], strides[split:], strict=True):
        inner = (inner[:, None] + torch.arange(n, dtype=torch.int64) * s).flatten()
    step = max(1, _CHUNK // block) * block
    for at in range(first, count, step):
        index = torch.arange(at // block, min(at + step, count) // block, dtype=torch.int64)
        outer = torch.full_like(index, start)
        for n, s in zip(reversed(sizes[:split]), reversed(strides[:split]), strict=True):
            outer += index % n * s
            index = index // n
        out = (outer[:, None] + inner).flatten()
        out = out[(out < high) & (out + run > low)]
        if out.numel():  # (never an empty one)
            yield out


def _meet(few: torch.Tensor, few_run: int, many: torch.Tensor, many_run: int) -> bool:
    """Whether a run of ``many`` (first addresses, ``many_run`` bytes each) meets one of
    ``few`` (sorted)."""
    # the last run of `few` starting before each run of `many` ends: the one reaching
    # furthest, since all are as long
    at = torch.searchsorted(few, many + many_run) - 1
    return bool(((at >= 0) & (few[at.clamp(min=0)] + few_run > many)).any())


def share_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether ``a`` and ``b`` (in the same memory, `memory_of`) hold a byte in common.
    Where their spans meet and one leaves gaps in its span, the runs of contiguous bytes of
    each (`_runs`) inside the other's span are laid out and compared, `_CHUNK` at a time
    (memory bounded however large the tensors): in one pass, in order of address, for
    views of a tensor's elements (`_nested`), else each chunk of one against all of the
    other's."""
    a_start, a_end = memory_span(a)
    b_start, b_end = memory_span(b)
    if not a.numel() or not b.numel() or a_end <= b_start or b_end <= a_start:
        return False
    a_layout, b_layout = _runs(a), _runs(b)
    if not a_layout[1] and not b_layout[1]:  # (both fill their spans, which meet)
        return True
    a_run, b_run = a_layout[0], b_layout[0]
    # every run of either starts a multiple of `step` bytes from its first: where each
    # one's runs keep to a part of every `step` bytes that the other's never reach (the
    # column halves of a matrix, every other element), they are apart, nothing laid out
    step = math.gcd(*a_layout[2], *b_layout[2])
    if (b_start - a_start) % step >= a_run and (a_start - b_start) % step >= b_run:
        return False
    low, high = max(a_start, b_start), min(a_end, b_end)
    if not (_nested(*a_layout) and _nested(*b_layout)):
        for chunk in _starts(a, a_layout, low, high):
            chunk = chunk.sort().values
            if any(_meet(chunk, a_run, other, b_run) for other in _starts(b, b_layout, low, high)):
                return True
        return False
    # both in order of address, runs apart: each chunk of b against the chunks of a that
    # reach into it, a's chunks taken in turn
    chunks = _starts(a, a_layout, low, high)
    chunk = next(chunks, None)
    for other in _starts(b, b_layout, low, high):
        end = int(other[-1]) + b_run
        while chunk is not None and int(chunk[-1]) + a_run <= int(other[0]):
            chunk = next(chunks, None)
        while chunk is not None:
            if _meet(chunk, a_run, other, b_run):
                return True
            if int(chunk[-1]) + a_run >= end:  # (it reaches the next chunk of b too)
                break
            chunk = next(chunks, None)
            if chunk is not None and int(chunk[0]) >= end:
                break
        if chunk is None:
            return False
    return False


def overlapping_pairs(tensors: list[torch.Tensor]) -> list[tuple[int, int]]:
    """Pairs of positions in ``tensors`` that share bytes (`share_bytes`; empty tensors
    never do), each pair once, the one whose span starts first (or reaches furthest, from
    the same start) first. Only tensors whose spans meet are compared."""
    spans = sorted(
        (memory_of(t), start, -end, i)
        for i, t in enumerate(tensors)
        if t.numel()
        for start, end in [memory_span(t)]
    )
    pairs: list[tuple[int, int]] = []
    memory = None
    open_: list[tuple[int, int]] = []  # (end, position) of the spans reaching past a start
    for where, start, neg_end, i in spans:
        if where != memory:
            memory, open_ = where, []
        open_ = [(end, j) for end, j in open_ if end > start]
        pairs.extend((j, i) for _, j in open_ if share_bytes(tensors[j], tensors[i]))
        open_.append((-neg_end, i))
    return pairs


def overlapping(tensors: list[torch.Tensor]) -> set[int]:
    """The positions in ``tensors`` of those whose memory overlaps another's."""
    return {i for pair in overlapping_pairs(tensors) for i in pair}
