"""Tests for shardfc.head.layout: contiguous class ranges per shard."""

from __future__ import annotations

import pytest

from shardfc.head.layout import class_range, class_ranges


@pytest.mark.parametrize(
    ("num_classes", "num_shards", "expected"),
    [
        (1, 1, [(0, 1)]),
        (12, 4, [(0, 3), (3, 6), (6, 9), (9, 12)]),
        (10, 4, [(0, 3), (3, 6), (6, 8), (8, 10)]),
        (7, 3, [(0, 3), (3, 5), (5, 7)]),
        (3, 5, [(0, 1), (1, 2), (2, 3), (3, 3), (3, 3)]),
        (5, 5, [(0, 1), (1, 2), (2, 3), (3, 4), (4, 5)]),
    ],
)
def test_known_layouts(num_classes: int, num_shards: int, expected: list[tuple[int, int]]) -> None:
    assert class_ranges(num_classes, num_shards) == [range(a, b) for a, b in expected]


@pytest.mark.parametrize("num_classes", [1, 2, 3, 7, 10, 64, 1001])
@pytest.mark.parametrize("num_shards", [1, 2, 3, 4, 8, 13])
def test_ranges_partition_classes(num_classes: int, num_shards: int) -> None:
    ranges = class_ranges(num_classes, num_shards)
    assert len(ranges) == num_shards
    # Contiguous, in rank order, covering [0, C) exactly.
    assert ranges[0].start == 0 and ranges[-1].stop == num_classes
    for prev, cur in zip(ranges, ranges[1:]):
        assert prev.stop == cur.start
    base, extra = divmod(num_classes, num_shards)
    assert [len(r) for r in ranges] == [base + 1] * extra + [base] * (num_shards - extra)
    assert all(r.step == 1 for r in ranges)
    assert [class_range(num_classes, num_shards, i) for i in range(num_shards)] == ranges


def test_fewer_classes_than_shards_gives_empty_tail() -> None:
    ranges = class_ranges(2, 4)
    assert [len(r) for r in ranges] == [1, 1, 0, 0]
    assert ranges[2] == range(2, 2) and ranges[3] == range(2, 2)


@pytest.mark.parametrize("bad", [0, -3, 1.5, "4", True, None])
def test_num_classes_validation(bad: object) -> None:
    with pytest.raises(ValueError, match=rf"num_classes must be a positive integer, got {bad!r}"):
        class_ranges(bad, 2)  # type: ignore[arg-type]


@pytest.mark.parametrize("bad", [0, -1, 2.0, False])
def test_num_shards_validation(bad: object) -> None:
    with pytest.raises(ValueError, match=rf"num_shards must be a positive integer, got {bad!r}"):
        class_ranges(10, bad)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="num_shards"):
        class_range(10, bad, 0)  # type: ignore[arg-type]


@pytest.mark.parametrize("bad", [-1, 3, 10, 1.0])
def test_index_validation(bad: object) -> None:
    with pytest.raises(ValueError, match=rf"index must be an int in \[0, num_shards=3\), got {bad!r}"):
        class_range(10, 3, bad)  # type: ignore[arg-type]
