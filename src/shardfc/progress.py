"""One progress bar for the commands' long loops over images (``data pack/shuffle/verify``,
``embed``): tqdm on stderr when stderr is a terminal and tqdm is installed, else the iterable as it
is (a log file or a pipe gets no bar, and nothing is required). Training has its own bar, which
logging writes above (:mod:`shardfc.train.observe.runlog`). A bottom layer: imports nothing of shardfc.
"""

from __future__ import annotations

import sys
from typing import Iterable, TypeVar

__all__ = ["progress"]

T = TypeVar("T")


def progress(iterable: Iterable[T], total: int, desc: str, unit: str = "img") -> Iterable[T]:
    """``iterable`` with a bar of ``total`` items named ``desc`` when stderr is a terminal and tqdm
    is installed; else ``iterable`` itself."""
    if not sys.stderr.isatty():
        return iterable
    try:
        from tqdm import tqdm
    except ImportError:
        return iterable
    return tqdm(iterable, total=total, desc=desc, unit=unit, file=sys.stderr, dynamic_ncols=True, leave=False)
