"""What a crafted pickle's REDUCE opcode calls, for the tests of readers of pickles (the ``.bin``
sets): ``PickledCall(func, *args)`` pickles as ``func(*args)``."""

from __future__ import annotations


class PickledCall:
    """Pickles as ``func(*args)``: the call an unpickler makes when it loads it."""

    def __init__(self, func, *args) -> None:
        self.func, self.args = func, args

    def __reduce__(self):
        return self.func, self.args
