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
    # a column's span covers the rows between its elements, which another column holds:
    # they share no byte, and neither does a row and a column
    assert overlapping([column, buffer[:, 3]]) == set()
    assert overlapping([column, buffer[1]]) == {0, 1}
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


def test_interleaved_views_of_one_tensor_overlap_only_where_they_share_bytes():
    """Found by a review: spans compared from first to last element called the column
    halves of one matrix (``a = nn.Parameter(big[:, :8]); b = nn.Parameter(big[:, 8:])``)
    overlapping, and `apply` refused them as two Parameters over the same memory. Where
    spans meet, the bytes each holds are compared."""
    big = torch.zeros(8, 16)
    assert overlapping([big[:, :8], big[:, 8:]]) == set()
    assert overlapping([big[:, :9], big[:, 8:]]) == {0, 1}  # (column 8 in both)
    assert overlapping([big[::2], big[1::2], big[:, ::2].t()]) == {0, 1, 2}
    assert overlapping_pairs([big[::2], big[1::2]]) == []
    assert overlapping([big[:, ::2], big[:, 1::2]]) == set()
    # a view of every third element against columns: the layouts differ, bytes compared
    flat = big.view(-1)
    assert overlapping([flat[1::3], big[:, 0]]) == {0, 1}  # (element 48: row 3, column 0)
    assert overlapping([flat[1:45:3], big[::3, 0]]) == set()  # (1, 4, ... 43 vs 0, 48, 96)
    # a tied weight and its transpose still overlap, as do a weight and its last column
    assert overlapping([big, big.t()]) == {0, 1}
    assert overlapping([big, big[:, -1]]) == {0, 1}


def test_views_of_a_large_tensor_are_compared_in_bounded_chunks(monkeypatch):
    """Two views of every other element of a tensor are compared by their bytes without
    laying out every element at once: chunks of a few runs give the answers one chunk
    gives, overlapping or not."""
    import mixprec.aliasing as aliasing

    buffer = torch.zeros(6, 10)
    flat = buffer.view(-1)
    pairs = [
        ([flat[0::7], flat[3::5]], {0, 1}),  # (element 28 in both)
        ([flat[0:27:9], flat[2::5]], set()),  # (0, 9, 18 vs 2, 7, 12, 17, 22...)
        ([buffer[:, 1:3], buffer[:, 2:4].t()], {0, 1}),
        ([buffer[:, 1:3], buffer[:, 3:5]], set()),
    ]
    for chunk in (1, 2, 3, 1 << 20):
        monkeypatch.setattr(aliasing, "_CHUNK", chunk)
        for tensors, expected in pairs:
            assert overlapping(tensors) == expected, (chunk, expected)
