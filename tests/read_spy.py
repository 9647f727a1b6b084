"""A file object that tells what was asked of it: the tests of readers that must never ask for more
than they need (the file gate's reads, a RecordIO record's) wrap the files they open in it."""

from __future__ import annotations

from typing import Callable


class ReadSpy:
    """``f`` with each ``read(n)`` / ``readline(n)`` reported to ``asked(op, n)`` before it runs;
    everything else is ``f``'s. Closing it (or leaving its ``with``) closes ``f``."""

    def __init__(self, f, asked: Callable[[str, int], None]) -> None:
        self._f, self._asked = f, asked

    def read(self, n=-1):
        self._asked("read", n)
        return self._f.read(n)

    def readline(self, n=-1):
        self._asked("readline", n)
        return self._f.readline(n)

    def __getattr__(self, name):
        return getattr(self._f, name)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self._f.close()
