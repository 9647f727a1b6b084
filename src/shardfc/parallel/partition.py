"""How a count is divided over ranks, the one rule used everywhere: evenly, the remainder to the
first ranks. Class shards (:mod:`shardfc.head.layout`), the bench's local batches and Horovod's
``reducescatter`` rows all follow it, so a shard of classes and a shard of rows line up.

And how a sequence of costs is cut into contiguous parts with the smallest largest part
(:func:`linear_partition`): the pipeline's stages (by parameters) and the split bench's (by
multiply-accumulates)."""

from __future__ import annotations

import math
import numbers
from typing import List, Sequence

from shardfc.checks import check_int, check_positive_int

__all__ = ["linear_partition", "split_evenly"]


def split_evenly(total: int, parts: int) -> List[int]:
    """Sizes of ``parts`` contiguous pieces of ``total``: ``total // parts`` each, one more for the
    first ``total % parts``. ``split_evenly(10, 4) == [3, 3, 2, 2]``; zeros when ``total < parts``."""
    check_int("total", total, 0)
    check_positive_int("parts", parts)
    base, extra = divmod(total, parts)
    return [base + (1 if r < extra else 0) for r in range(parts)]


def linear_partition(costs: Sequence[float], parts: int) -> List[int]:
    """Cut ``costs`` into ``parts`` contiguous non-empty parts whose largest sum is the smallest
    possible; of the cuts that reach it, the earliest. Returns the index of the last item of every
    part but the last (``parts - 1`` increasing indices). ``parts <= len(costs)``; each cost a finite
    number ``>= 0`` (a NaN compares false with every bound, so no cut would be found).

    ``linear_partition([10, 10, 10, 30], 3) == [0, 2]``: parts 10 | 20 | 30."""
    check_positive_int("parts", parts)
    for i, c in enumerate(costs):
        if isinstance(c, bool) or not isinstance(c, numbers.Real) or not math.isfinite(c) or c < 0:
            raise ValueError(f"costs[{i}] must be a finite number >= 0, got {c!r}")
    n = len(costs)
    if parts > n:
        raise ValueError(f"parts={parts} but there are only {n} items to cut")
    prefix = [0]
    for c in costs:
        prefix.append(prefix[-1] + c)
    # tail[k][i]: the smallest largest part when costs[i:] are cut into k non-empty parts
    inf = float("inf")
    tail = [[inf] * (n + 1) for _ in range(parts + 1)]
    for i in range(n):
        tail[1][i] = prefix[n] - prefix[i]
    for k in range(2, parts + 1):
        for i in range(n - k + 1):
            tail[k][i] = min(max(prefix[c + 1] - prefix[i], tail[k - 1][c + 1]) for c in range(i, n - k + 1))
    target = tail[parts][0]
    cuts: List[int] = []
    start = 0
    for left in range(parts - 1, 0, -1):  # the earliest cut that still reaches the best
        c = next(c for c in range(start, n - left)
                 if prefix[c + 1] - prefix[start] <= target and tail[left][c + 1] <= target)
        cuts.append(c)
        start = c + 1
    return cuts
