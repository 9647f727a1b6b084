"""Communication accounting: :func:`count_comm` counts the bytes and calls of every collective inside a block.

The collectives record here as they run: the counted functions of :mod:`shardfc.parallel.collectives`
and the communicators of :mod:`shardfc.parallel.comm` (Horovod's included), and code that issues
collectives of its own (DDP's buckets) through :func:`record_comm_bytes`. Each call adds the bytes of
its full-size buffer (see :mod:`~shardfc.parallel.collectives`).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Dict, Iterator, List

from torch import Tensor

__all__ = ["CommCounter", "count_comm", "record_comm", "record_comm_bytes"]


@dataclass
class CommCounter:
    """Bytes and calls per collective kind, counted at the call sites."""

    bytes: Dict[str, int] = field(default_factory=dict)
    calls: Dict[str, int] = field(default_factory=dict)

    def add(self, kind: str, nbytes: int) -> None:
        self.bytes[kind] = self.bytes.get(kind, 0) + int(nbytes)
        self.calls[kind] = self.calls.get(kind, 0) + 1

    @property
    def total_bytes(self) -> int:
        return sum(self.bytes.values())


_COUNTERS: List[CommCounter] = []


@contextlib.contextmanager
def count_comm() -> Iterator[CommCounter]:
    """Count the bytes of every collective this module issues inside the ``with`` block."""
    counter = CommCounter()
    _COUNTERS.append(counter)
    try:
        yield counter
    finally:
        _COUNTERS.remove(counter)


def record_comm(kind: str, t: Tensor) -> None:
    """Count a collective's full-size buffer ``t`` (its bytes) in every active :func:`count_comm`."""
    record_comm_bytes(kind, t.numel() * t.element_size())


def record_comm_bytes(kind: str, nbytes: int) -> None:
    """Count ``nbytes`` of a collective in every active :func:`count_comm`: the counted functions of
    :mod:`~shardfc.parallel.collectives`, the communicators of :mod:`~shardfc.parallel.comm`, and
    collectives issued elsewhere (DDP's gradient buckets, Horovod's gradient all-reduces), by the same
    convention."""
    for c in _COUNTERS:
        c.add(kind, nbytes)
