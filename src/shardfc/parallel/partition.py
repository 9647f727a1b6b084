"""How a count is divided over ranks, the one rule used everywhere: evenly, the remainder to the
first ranks. Class shards (:mod:`shardfc.head.layout`), the bench's local batches and Horovod's
``reducescatter`` rows all follow it, so a shard of classes and a shard of rows line up."""

from __future__ import annotations

from typing import List

from shardfc.checks import check_int, check_positive_int

__all__ = ["split_evenly"]


def split_evenly(total: int, parts: int) -> List[int]:
    """Sizes of ``parts`` contiguous pieces of ``total``: ``total // parts`` each, one more for the
    first ``total % parts``. ``split_evenly(10, 4) == [3, 3, 2, 2]``; zeros when ``total < parts``."""
    check_int("total", total, 0)
    check_positive_int("parts", parts)
    base, extra = divmod(total, parts)
    return [base + (1 if r < extra else 0) for r in range(parts)]
