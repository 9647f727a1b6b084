"""What each fused kernel reads and writes, told by its launcher on the meta device (``shardfc plan --bytes``).

On the ``meta`` device the launchers launch nothing (:func:`shapes_only`). Instead each one calls
:func:`note` with the regions of memory its loads and stores touch — computed from the very
arguments it would launch with — so :mod:`shardfc.tools.plan.traffic` can count a step's bytes
kernel by kernel beside the torch operators it sees through a dispatch mode. A region is a slice of
a tensor (:func:`span`) or rows gathered through an index tensor (:func:`gathered`). Outside a
recording (:func:`recording`), :func:`note` returns at once; on a GPU it is never called.
"""

from __future__ import annotations

import contextlib
from typing import Callable, Iterator, List, NamedTuple, Optional, Sequence

from torch import Tensor


class Region(NamedTuple):
    """``nbytes`` bytes of ``tensor``'s storage; ``part`` says which (equal parts are the same bytes:
    a span is its byte offset and length, whatever the dtype that reads it). ``streamed``: the
    kernel loads or stores it with ``eviction_policy="evict_first"`` (bytes used once, which
    should not push what is reused out of L2): the count takes it from or to HBM and keeps it out
    of its L2 model."""

    tensor: Tensor
    part: tuple
    nbytes: int
    streamed: bool = False


def streamed(regions: Sequence[Region]) -> List[Region]:
    """``regions`` marked as streamed (see :class:`Region`)."""
    return [r._replace(streamed=True) for r in regions]


def span(t: Tensor) -> Region:
    """The bytes of the view ``t`` (a slice of rows, or a whole tensor)."""
    nbytes = t.numel() * t.element_size()
    return Region(t, ("span", t.storage_offset() * t.element_size(), nbytes), nbytes)


def gathered(w: Tensor, rows: Optional[Tensor], r0: int, n: int) -> Region:
    """Rows ``r0 .. r0 + n`` of the scored rows of ``w``: ``w[r0:r0+n]``, or ``w[rows[r0:r0+n]]``."""
    if rows is None:
        return span(w[r0:r0 + n])
    return Region(w, ("rows", rows, rows.storage_offset() + r0, n), n * w.shape[1] * w.element_size())


def rows_of(t: Optional[Tensor], r0: int, n: int) -> List[Region]:
    """``t[r0:r0+n]`` as a one-region list, or nothing for ``t`` None (a kernel's optional input)."""
    return [] if t is None else [span(t[r0:r0 + n])]


Recorder = Callable[[str, Sequence[Region], Sequence[Region], float], None]
_recorder: Optional[Recorder] = None


def note(kernel: str, reads: Sequence[Region], writes: Sequence[Region], flops: float = 0.0) -> None:
    """A launch of ``kernel`` that would read ``reads`` and write ``writes`` (and do ``flops``)."""
    if _recorder is not None:
        _recorder(kernel, reads, writes, flops)


@contextlib.contextmanager
def recording(recorder: Recorder) -> Iterator[None]:
    """Send every :func:`note` to ``recorder`` inside the block."""
    global _recorder
    before, _recorder = _recorder, recorder
    try:
        yield
    finally:
        _recorder = before


__all__ = ["Region", "gathered", "note", "recording", "rows_of", "span", "streamed"]
