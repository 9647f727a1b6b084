"""How many test processes pytest-xdist's ``-n auto`` starts (``tests/conftest.py``'s hook): one per
usable core (:func:`shardfc.train.builder.cpu.usable_cores`, as a training run counts them), at most
:data:`MAX_WORKERS`. A module of its own, not the conftest: ``import conftest`` from a test finds
whichever folder's conftest comes first on the path."""

from __future__ import annotations

#: The most test processes ``-n auto`` starts: each may launch up to 4 ranks of its own.
MAX_WORKERS = 8


def auto_workers() -> int:
    from shardfc.train.builder.cpu import usable_cores

    return min(usable_cores(), MAX_WORKERS)
