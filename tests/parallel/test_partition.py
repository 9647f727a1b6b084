import pytest

from shardfc.head.layout import class_ranges
from shardfc.parallel.partition import split_evenly
from shardfc.tools.bench import local_batch_sizes


@pytest.mark.parametrize("total,parts,expected", [
    (10, 4, [3, 3, 2, 2]), (8, 4, [2, 2, 2, 2]), (3, 5, [1, 1, 1, 0, 0]), (0, 3, [0, 0, 0]), (7, 1, [7]),
])
def test_split_evenly_gives_the_remainder_to_the_first_ranks(total, parts, expected):
    assert split_evenly(total, parts) == expected


@pytest.mark.parametrize("total,parts", [(1, 1), (10, 4), (3, 5), (1000, 7)])
def test_class_shards_and_bench_batches_follow_the_same_rule(total, parts):
    assert [len(r) for r in class_ranges(total, parts)] == split_evenly(total, parts)
    assert local_batch_sizes(total, parts) == split_evenly(total, parts)
    ranges = class_ranges(total, parts)
    assert ranges[0].start == 0 and ranges[-1].stop == total
    assert all(a.stop == b.start for a, b in zip(ranges, ranges[1:]))


@pytest.mark.parametrize("total,parts,message", [
    (-1, 2, "total must be an int >= 0, got -1"), (4, 0, "parts must be a positive integer, got 0"),
    (2.0, 2, "total must be an int >= 0, got 2.0"),
])
def test_split_evenly_names_a_bad_argument(total, parts, message):
    with pytest.raises(ValueError, match=message):
        split_evenly(total, parts)
