"""The small helpers of shardfc.head.sampling against plain Python: positives per class range, the
union of several forwards' rows, a micro-batched row-sparse gradient merged. (The draw itself:
test_partial_fc.py and fused/test_draw.py.)"""

import pytest
import torch

from shardfc.head.sampling import RowGrad, merge_row_grads, positive_mask, positives_per_range, union_rows, united


def _plain_count(labels, valid, ranges):
    return [len({int(v) for v, ok in zip(labels, valid) if ok and v in r}) for r in ranges]


@pytest.mark.parametrize("seed", range(4))
def test_positives_per_range_against_a_plain_count(seed):
    from shardfc.head.layout import class_ranges

    g = torch.Generator().manual_seed(seed)
    C = 37
    labels = torch.randint(0, C, (int(torch.randint(0, 60, (1,), generator=g)),), generator=g)
    valid = torch.rand(labels.shape[0], generator=g) > 0.3
    ranges = class_ranges(C, 5) + [range(C, C)]  # an empty range too
    assert positives_per_range(labels, valid, ranges) == _plain_count(labels, valid, ranges)


@pytest.mark.parametrize("dtype", [torch.int64, torch.int32])
@pytest.mark.parametrize("ranges", [[range(0, 10)], [range(0, 4), range(4, 10)], [range(0, 3), range(3, 3), range(3, 10)]],
                         ids=["one", "two", "an_empty_one_between"])
def test_positives_per_range_counts_distinct_valid_labels_of_each_range(dtype, ranges):
    labels = torch.tensor([9, 0, 3, 3, 9, 5, 8, 1, 7], dtype=dtype)
    valid = torch.tensor([True, True, True, True, True, False, True, False, True])
    got = positives_per_range(labels, valid, ranges)
    assert got == _plain_count(labels, valid, ranges) and sum(got) == 5  # 0, 3, 7, 8, 9; not 5 or 1 (invalid)
    assert positives_per_range(labels, torch.zeros_like(valid), ranges) == [0] * len(ranges)
    assert positives_per_range(labels, valid, []) == []


def test_positive_mask_marks_the_rows_labels_fall_on():
    local = torch.tensor([-1, 2, 2, 0, -1])  # −1: a label on another shard
    assert positive_mask(local, 4).tolist() == [True, False, True, False]
    assert positive_mask(torch.full((3,), -1), 2).tolist() == [False, False]


def test_the_rows_of_several_forwards_are_united_sorted_and_distinct():
    a, b = torch.tensor([1, 4, 6]), torch.tensor([0, 4, 9])
    assert united([a]) is a
    assert united([a, b, torch.tensor([6])]).tolist() == [0, 1, 4, 6, 9]
    assert union_rows(a, b).tolist() == [0, 1, 4, 6, 9]
    assert union_rows(None, b) is None and union_rows(a, None) is None and union_rows(None, None) is None


def test_merged_row_gradients_are_the_sum_of_the_micro_batches():
    g = torch.Generator().manual_seed(3)
    parts = [(torch.tensor([1, 5]), torch.randn(2, 3, generator=g)),
             (torch.tensor([0, 5, 7]), torch.randn(3, 3, generator=g)),
             (torch.tensor([7]), torch.randn(1, 3, generator=g))]
    dense = torch.zeros(8, 3)
    for rows, values in parts:
        dense.index_add_(0, rows, values)
    merged = merge_row_grads(parts)
    assert merged.rows.tolist() == [0, 1, 5, 7]
    torch.testing.assert_close(merged.values, dense[merged.rows], rtol=0, atol=1e-6)
    one = merge_row_grads(parts[:1])
    assert isinstance(one, RowGrad) and one.rows is parts[0][0] and one.values is parts[0][1]
