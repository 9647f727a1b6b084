"""Argument checks shared by every public entry point: each error names the argument and the value."""

from __future__ import annotations

import math
import numbers
import operator
from typing import Any, List, Optional, Sequence, Union

__all__ = ["FLOAT32_MAX", "MAX_INT64", "MAX_SEED", "MAX_TIMEOUT_S", "check_int", "check_names", "check_positive_int",
           "check_probability", "check_real", "check_seed", "check_timeout", "chunk_size_arg", "integer_value"]

#: float32's largest finite value.
FLOAT32_MAX = 3.4028234663852886e38
#: Largest int64: torch's sizes, element counts and seeds.
MAX_INT64 = 2**63 - 1
#: Largest seed: torch's generators take a signed 64-bit seed.
MAX_SEED = MAX_INT64
#: Largest timeout of a process group (seconds, 31 years): ``datetime.timedelta`` ends at 8.6e13 seconds.
MAX_TIMEOUT_S = 1e9


def check_int(name: str, value: Any, minimum: int) -> int:
    """``value`` as an int ``>= minimum`` (bool is rejected: ``True`` as a count is always a bug)."""
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name} must be an int >= {minimum}, got {value!r}")
    return int(value)


def digits_value(text: str) -> Optional[int]:
    """The int that ``text``, ASCII digits only, spells; else None. ``str.isdigit`` also takes "²",
    which ``int()`` refuses (a bare ValueError), and other scripts' digits: for counts read from the
    environment or a file, whose callers decide what to do with anything else."""
    return int(text) if text.isascii() and text.isdigit() else None


def integer_value(value: Any) -> Optional[int]:
    """``value`` as an int when it is an integer (Python's, numpy's, or a one-element integer tensor:
    a dataset's targets iterated), else None: a bool of any kind, a float (``int()`` would take 1.5
    as 1), a string. For ids and keys, whose callers name their own refusal."""
    if isinstance(value, bool) or str(getattr(value, "dtype", "")) in ("bool", "torch.bool"):
        return None
    try:
        return operator.index(value)
    except TypeError:
        return None


def check_seed(name: str, value: Any) -> int:
    """``value`` as a seed: an int in ``[0, 2**63 - 1]``. Seeds are hashed as 64-bit words
    (:func:`shardfc.seeding.mix_seed`), so a negative or larger one would silently draw the same
    stream as another seed (``-5`` as ``2**64 - 5``), and ``int()`` would take ``1.5`` as ``1``."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or not 0 <= value <= MAX_SEED:
        raise ValueError(f"{name} must be an int in [0, 2**63 - 1], got {value!r}")
    return int(value)


def check_positive_int(name: str, value: Any) -> int:
    """``value`` as an int >= 1."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")
    return int(value)


def check_probability(name: str, value: Any, *, low_open: bool, high_open: bool) -> float:
    """``value`` as a float in [0, 1], each end open or closed as asked."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ValueError(f"{name} must be a finite number, got {value!r}")
    lo_ok = value > 0 if low_open else value >= 0
    hi_ok = value < 1 if high_open else value <= 1
    if not (lo_ok and hi_ok):
        interval = ("(" if low_open else "[") + "0, 1" + (")" if high_open else "]")
        raise ValueError(f"{name} must be in {interval}, got {value!r}")
    return float(value)


def check_real(name: str, value, *, positive: bool = False, nonnegative: bool = False) -> float:
    """``value`` as a finite float (bool is rejected), ``> 0`` or ``>= 0`` when asked."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be a real number, got {value!r} ({type(value).__name__})")
    value = float(value)
    if not math.isfinite(value):
        raise ValueError(f"{name} must be finite, got {value!r}")
    if positive and value <= 0:
        raise ValueError(f"{name} must be > 0, got {value!r}")
    if nonnegative and value < 0:
        raise ValueError(f"{name} must be >= 0, got {value!r}")
    return value


def check_timeout(name: str, value: Any) -> float:
    """``value`` as seconds a process group waits: a finite number in ``(0, MAX_TIMEOUT_S]`` (a
    negative one made every rank's group fail to form; NaN or inf could not become a timedelta)."""
    seconds = check_real(name, value, positive=True)
    if seconds > MAX_TIMEOUT_S:
        raise ValueError(f"{name} must be at most {MAX_TIMEOUT_S:.0e} seconds (31 years), got {value!r}")
    return seconds


def check_names(what: str, value: Union[str, Sequence[str]], choices: Sequence[str]) -> List[str]:
    """``"a,b"`` or ``["a", "b"]`` as a list of names from ``choices``, in the order given: at least
    one, each known, none twice (the errors say ``what`` and list the choices)."""
    names = [v.strip() for v in value.split(",")] if isinstance(value, str) else [str(v).strip() for v in value]
    names = [v for v in names if v]
    unknown = [v for v in names if v not in choices]
    if not names or unknown:
        shown = ", ".join(map(repr, unknown)) or f"empty list {value!r}"
        raise ValueError(f"{what}: unknown {shown}; choose from {', '.join(choices)}")
    if len(set(names)) != len(names):
        raise ValueError(f"{what}: each at most once, got {names}")
    return names


def chunk_size_arg(text: str) -> Union[int, str]:
    """A command line's chunk size: ``auto`` or an int (argparse ``type=``)."""
    return "auto" if text == "auto" else int(text)
