"""Tensors over the same memory: which of a list share bytes with another.

A tied weight and its transpose, or two Parameters made over one tensor's data, overlap;
views of disjoint parts of one buffer do not. An optimizer step that read both before
writing either would lose one's update, and a policy that cast them apart would untie them:
both ask this module, which compares each tensor's span from its first to its last element.
"""

from __future__ import annotations

import torch

__all__ = ["memory_of", "memory_span", "overlapping", "overlapping_pairs"]


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


def overlapping_pairs(tensors: list[torch.Tensor]) -> list[tuple[int, int]]:
    """Pairs of positions in ``tensors`` whose spans overlap (empty tensors never do): for
    each tensor that starts inside an earlier one's span in the same memory, it and the one
    reaching furthest."""
    spans = sorted((memory_of(t), *memory_span(t), i) for i, t in enumerate(tensors) if t.numel())
    pairs: list[tuple[int, int]] = []
    memory, reach, holder = None, -1, -1
    for where, start, end, i in spans:
        if where != memory:
            memory, reach, holder = where, -1, -1
        if start < reach:
            pairs.append((holder, i))
        if end > reach:
            reach, holder = end, i
    return pairs


def overlapping(tensors: list[torch.Tensor]) -> set[int]:
    """The positions in ``tensors`` of those whose memory overlaps another's."""
    return {i for pair in overlapping_pairs(tensors) for i in pair}
