"""One progress bar for the commands' long loops over images (``data pack/shuffle/verify``,
``embed``): tqdm on stderr when stderr is a terminal and tqdm is installed, else the iterable as it
is (a log file or a pipe gets no bar, and nothing is required). Training has its own bar, which
logging writes above (:mod:`shardfc.train.observe.runlog`). A bottom layer: imports nothing of shardfc.

Evaluation's embedding loop is shared by ``shardfc eval`` (minutes over a large ``.bin`` or an IJB
release: it wants a bar) and training's evaluations (under the training bar: a second bar would break
it). So that loop asks :func:`labelled_bar`, which draws one only inside :func:`labelled` — the label
``shardfc eval`` puts around each target — and is the iterable itself everywhere else.
"""

from __future__ import annotations

import sys
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Iterable, Iterator, Optional, TypeVar

__all__ = ["counter", "labelled", "labelled_bar", "progress"]

T = TypeVar("T")

_LABEL: ContextVar[Optional[str]] = ContextVar("shardfc_progress_label", default=None)


def progress(iterable: Iterable[T], total: Optional[int], desc: str, unit: str = "img") -> Iterable[T]:
    """``iterable`` with a bar of ``total`` items named ``desc`` when stderr is a terminal and tqdm
    is installed; else ``iterable`` itself."""
    if not sys.stderr.isatty():
        return iterable
    try:
        from tqdm import tqdm
    except ImportError:
        return iterable
    return tqdm(iterable, total=total, desc=desc, unit=unit, file=sys.stderr, dynamic_ncols=True, leave=False)


class _NoBar:
    """What :func:`counter` gives where no bar is drawn: its calls do nothing."""

    def update(self, n: int = 1) -> None:
        pass

    def close(self) -> None:
        pass


def counter(desc: str, unit: str, total: Optional[int] = None):
    """A bar advanced by hand (``.update(n)``, ``.close()``), for work that is no loop over an
    iterable (``shardfc plan``'s replay of a step, op by op): tqdm's on a terminal with tqdm installed
    (``total`` None: a count and a rate without an end), else one that draws nothing."""
    if not sys.stderr.isatty():
        return _NoBar()
    try:
        from tqdm import tqdm
    except ImportError:
        return _NoBar()
    return tqdm(None, total=total, desc=desc, unit=unit, file=sys.stderr, dynamic_ncols=True, leave=False,
                unit_scale=True)


@contextmanager
def labelled(desc: str) -> Iterator[None]:
    """Within it, :func:`labelled_bar` loops draw a bar named ``desc`` (on a terminal, with tqdm)."""
    token = _LABEL.set(desc)
    try:
        yield
    finally:
        _LABEL.reset(token)


def labelled_bar(iterable: Iterable[T], total: Optional[int], unit: str = "batch") -> Iterable[T]:
    """:func:`progress` named by the enclosing :func:`labelled`; outside one, ``iterable`` itself.
    ``total`` None: a count without an end (tqdm's)."""
    desc = _LABEL.get()
    if desc is None:
        return iterable
    return progress(iterable, total, desc, unit)
