"""How class ids are split across the ranks of a class-sharded classifier head.

With ``num_shards`` (W) ranks, class ids ``[0, num_classes)`` are cut into W
contiguous ranges in rank order. The first ``num_classes % num_shards`` ranks
hold one extra class, so shard sizes differ by at most one. When
``num_classes < num_shards`` the later ranks get empty ranges.

Example: ``class_ranges(10, 4) == [range(0, 3), range(3, 6), range(6, 8), range(8, 10)]``.
"""

from __future__ import annotations

from shardfc.checks import check_positive_int
from shardfc.parallel.partition import split_evenly

__all__ = ["class_ranges", "class_range"]


def class_range(num_classes: int, num_shards: int, index: int) -> range:
    """Return the contiguous class-id range held by shard ``index``.

    Args:
        num_classes: Total number of classes C (int >= 1).
        num_shards: Number of shards W (int >= 1).
        index: Shard (rank) index in ``[0, num_shards)``.

    Returns:
        ``range(start, stop)``; empty when ``index >= num_classes``.

    Raises:
        ValueError: If an argument is not an int in its valid domain.
    """
    check_positive_int("num_classes", num_classes)
    check_positive_int("num_shards", num_shards)
    if not isinstance(index, int) or isinstance(index, bool) or not 0 <= index < num_shards:
        raise ValueError(f"index must be an int in [0, num_shards={num_shards}), got {index!r}")
    sizes = split_evenly(num_classes, num_shards)
    start = sum(sizes[:index])
    return range(start, start + sizes[index])


def class_ranges(num_classes: int, num_shards: int) -> list[range]:
    """Return the class-id range of every shard, in rank order.

    The ranges are contiguous, disjoint and cover ``[0, num_classes)`` exactly.

    Raises:
        ValueError: If ``num_classes`` or ``num_shards`` is not an int >= 1.
    """
    check_positive_int("num_classes", num_classes)
    check_positive_int("num_shards", num_shards)
    return [class_range(num_classes, num_shards, i) for i in range(num_shards)]
