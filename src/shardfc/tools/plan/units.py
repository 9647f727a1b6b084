"""Byte counts as ``shardfc plan`` reads them (``--budget 16GiB``) and writes them (its tables, ``--bytes``'s).

Their own module so that the plan (:mod:`shardfc.tools.plan`) and its traffic table
(:mod:`.traffic`), which the plan imports, share them without importing each other.
"""

from __future__ import annotations

import math
import re
from typing import Union

__all__ = ["format_bytes", "parse_bytes"]

_UNITS = {
    "": 1, "b": 1,
    "k": 1024, "kib": 1024, "kb": 1000,
    "m": 1024**2, "mib": 1024**2, "mb": 1000**2,
    "g": 1024**3, "gib": 1024**3, "gb": 1000**3,
    "t": 1024**4, "tib": 1024**4, "tb": 1000**4,
}


def parse_bytes(value: Union[int, float, str], name: str = "budget") -> int:
    """``16GiB``, ``16G`` (binary), ``16GB`` (decimal), ``1.5e9``, ``123`` -> bytes (positive);
    errors name the argument ``name``."""
    if isinstance(value, bool):
        raise ValueError(f"{name} must be a byte count such as 16GiB, got {value!r}")
    if isinstance(value, (int, float)):
        number = float(value)
    else:
        match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([A-Za-z]*)\s*", str(value))
        if not match or match.group(2).lower() not in _UNITS:
            raise ValueError(f"{name} must be a byte count such as 16GiB, 500MB or 1e9, got {value!r}")
        number = float(match.group(1)) * _UNITS[match.group(2).lower()]
    if not math.isfinite(number) or number < 1:
        raise ValueError(f"{name} must be at least 1 byte, got {value!r}")
    return int(number)


def format_bytes(n: float) -> str:
    """``n`` bytes in GiB, MiB or KiB (two decimals) from one of each, else in bytes."""
    for unit, size in (("GiB", 1024**3), ("MiB", 1024**2), ("KiB", 1024)):
        if abs(n) >= size:
            return f"{n / size:,.2f} {unit}"
    return f"{int(n)} B"
