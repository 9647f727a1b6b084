"""How many test processes pytest-xdist's ``-n auto`` starts (``tests/conftest.py``'s hook): one per
usable core, at most :data:`MAX_WORKERS`. A module of its own, not the conftest: ``import conftest``
from a test finds whichever folder's conftest comes first on the path."""

from __future__ import annotations

import os

#: The most test processes ``-n auto`` starts: each may launch up to 4 ranks of its own.
MAX_WORKERS = 8


def usable_cores() -> int:
    """The cores this process may run on (a container's or taskset's, not the host's)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - macOS
        return os.cpu_count() or 1


def auto_workers() -> int:
    return max(1, min(usable_cores(), MAX_WORKERS))
