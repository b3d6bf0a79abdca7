"""Which tensors share memory: tied weights overlap, disjoint views of one buffer do not."""

import torch

from mixprec.aliasing import memory_span, overlapping, overlapping_pairs


def test_a_tensor_and_its_transpose_overlap_disjoint_views_do_not():
    buffer = torch.zeros(4, 6)
    a, b = buffer[:2], buffer[2:]  # disjoint rows of one buffer
    tied, other = torch.zeros(3, 5), torch.zeros(7)
    tensors = [a, tied.t(), b, other, tied, torch.zeros(0)]
    assert overlapping_pairs(tensors) in ([(1, 4)], [(4, 1)])
    assert overlapping(tensors) == {1, 4}


def test_a_strided_column_spans_from_its_first_to_its_last_element():
    buffer = torch.zeros(4, 6)
    column = buffer[:, 2]
    start, end = memory_span(column)
    assert start == buffer.data_ptr() + 2 * 4
    assert end == start + (3 * 6 + 1) * 4
    # a column's span covers the rows between its elements: another column overlaps it
    assert overlapping([column, buffer[:, 3]]) == {0, 1}
    assert overlapping([buffer[0], buffer[1], buffer[2:]]) == set()


def test_a_view_inside_a_longer_span_pairs_with_the_one_reaching_furthest():
    buffer = torch.zeros(100)
    pairs = overlapping_pairs([buffer[:10], buffer, buffer[50:60]])
    assert sorted(tuple(sorted(p)) for p in pairs) == [(0, 1), (1, 2)]


def test_meta_tensors_overlap_only_within_their_own_storage():
    """Every meta tensor is at address 0: distinct ones all overlapped, so an optimizer
    stepped each meta parameter alone where it joins them on a CPU. Without memory, a
    tensor's addresses count within its storage: a tied weight and its transpose still
    overlap there, distinct tensors do not."""
    a, b, tied = (torch.zeros(4, 4, device="meta") for _ in range(3))
    assert overlapping([a, b]) == set()
    assert overlapping([a, tied, b, tied.t()]) == {1, 3}
    assert overlapping([tied[:2], tied[2:]]) == set()
