"""Checks of the arguments that shape a backbone (input size, width, dropout), shared by the nets
that take them: a 0-wide or 0-pixel net, or a NaN dropout, built without a word and trained to
nothing (a NaN dropout made every training output NaN)."""

from __future__ import annotations

import numbers
from typing import Any

from shardfc.checks import check_positive_int, check_probability

__all__ = ["check_dropout", "check_input_size", "check_width"]


def check_input_size(value: Any) -> tuple[int, int]:
    """``value`` (an int, or an ``(H, W)`` pair) as ``(H, W)`` positive ints."""
    pair = (value, value) if isinstance(value, numbers.Integral) and not isinstance(value, bool) else value
    if (not isinstance(pair, (tuple, list)) or len(pair) != 2
            or not all(isinstance(v, numbers.Integral) and not isinstance(v, bool) and v > 0 for v in pair)):
        raise ValueError(f"input_size must be a positive int or an (H, W) pair of them, got {value!r}")
    return int(pair[0]), int(pair[1])


def check_width(value: Any) -> int:
    """The channels of a net's first stage: a positive int."""
    return check_positive_int("width", value)


def check_dropout(value: Any) -> float:
    """A dropout probability in ``[0, 1)`` (1 drops every feature: the embeddings are all zero)."""
    return check_probability("dropout", value, low_open=False, high_open=True)
