import itertools
import random

import pytest

from shardfc.head.layout import class_ranges
from shardfc.parallel.partition import linear_partition, split_evenly
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


def _brute_force(costs, parts):
    """Every way to cut: the smallest largest part, then the earliest cuts (lexicographic)."""
    best = None
    for cuts in itertools.combinations(range(len(costs) - 1), parts - 1):
        bounds = [0, *(c + 1 for c in cuts), len(costs)]
        largest = max(sum(costs[a:b]) for a, b in zip(bounds, bounds[1:]))
        if best is None or largest < best[0]:
            best = (largest, list(cuts))
    return best[1]


def test_linear_partition_is_the_best_cut_and_the_earliest_of_ties():
    assert linear_partition([10, 10, 10, 30], 3) == [0, 2]
    assert linear_partition([5, 1, 1, 1, 5], 1) == []
    assert linear_partition([1, 2, 3], 3) == [0, 1]
    rng = random.Random(0)
    for _ in range(300):
        n = rng.randint(1, 9)
        costs = [rng.choice([0, 1, 2, 3, 5, 8]) for _ in range(n)]  # small values: many ties
        parts = rng.randint(1, n)
        assert linear_partition(costs, parts) == _brute_force(costs, parts), (costs, parts)


def test_linear_partition_errors():
    with pytest.raises(ValueError, match="parts=4 but there are only 3 items to cut"):
        linear_partition([1, 2, 3], 4)
    with pytest.raises(ValueError, match="parts must be a positive integer, got 0"):
        linear_partition([1, 2, 3], 0)


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -1, True, "3", None])
def test_linear_partition_names_a_cost_it_cannot_cut(bad):
    # NaN made the search for a cut end in a bare StopIteration; a negative cost is no cost
    with pytest.raises(ValueError) as e:
        linear_partition([1, bad, 2], 2)
    assert str(e.value) == f"costs[1] must be a finite number >= 0, got {bad!r}"
