"""The argument checks every public entry point shares: each bound, and each message word for word."""

import math
from fractions import Fraction

import numpy as np
import pytest

from shardfc.checks import (
    MAX_SEED,
    check_int,
    check_names,
    check_positive_int,
    check_probability,
    check_real,
    check_seed,
    chunk_size_arg,
    digits_value,
    integer_value,
)


def _message(fn, *args, **kwargs):
    with pytest.raises((ValueError, TypeError)) as info:
        fn(*args, **kwargs)
    return type(info.value), str(info.value)


def test_check_int():
    assert check_int("n", 3, 3) == 3 and check_int("n", -2, -5) == -2
    for bad in (2, True, 3.0, "4", None):
        assert _message(check_int, "n", bad, 3) == (ValueError, f"n must be an int >= 3, got {bad!r}")
    assert type(check_int("n", np.int64(4).item(), 0)) is int


def test_check_positive_int():
    assert check_positive_int("k", 1) == 1
    for bad in (0, -1, True, False, 1.0, "1"):
        assert _message(check_positive_int, "k", bad) == (ValueError, f"k must be a positive integer, got {bad!r}")


def test_check_seed():
    assert MAX_SEED == 2**63 - 1  # torch.Generator.manual_seed's largest
    for good in (0, 7, MAX_SEED, np.int64(5), np.uint64(2**63 - 1)):
        got = check_seed("init_seed", good)
        assert got == good and type(got) is int
    # each of these drew another seed's stream (-5 as 2**64 - 5, 2**64 + 1 as 1) or was truncated (1.5 as 1)
    for bad in (-1, -5, MAX_SEED + 1, 2**64 + 1, 1.5, 2.0, True, False, "7", None, np.float64(3)):
        assert _message(check_seed, "init_seed", bad) == (
            ValueError, f"init_seed must be an int in [0, 2**63 - 1], got {bad!r}")


@pytest.mark.parametrize("low_open, high_open, interval, inside, outside", [
    (True, True, "(0, 1)", (0.5,), (0, 1, 0.0, 1.0)),
    (True, False, "(0, 1]", (1, 1.0, 1e-9), (0, 0.0, 1.0000001)),
    (False, True, "[0, 1)", (0, 0.0), (1, -1e-9)),
    (False, False, "[0, 1]", (0, 1, 0.25), (-0.1, 1.1)),
])
def test_check_probability(low_open, high_open, interval, inside, outside):
    for v in inside:
        got = check_probability("p", v, low_open=low_open, high_open=high_open)
        assert got == v and type(got) is float
    for v in outside:
        assert _message(check_probability, "p", v, low_open=low_open, high_open=high_open) == (
            ValueError, f"p must be in {interval}, got {v!r}")
    for v in (math.nan, math.inf, True, "0.5", None):
        assert _message(check_probability, "p", v, low_open=low_open, high_open=high_open) == (
            ValueError, f"p must be a finite number, got {v!r}")


def test_check_real():
    assert check_real("x", 2) == 2.0 and type(check_real("x", Fraction(1, 4))) is float
    assert check_real("x", np.float32(0.5)) == 0.5 and check_real("x", -3) == -3.0
    for bad in (True, "1", None, 1j):
        assert _message(check_real, "x", bad) == (TypeError, f"x must be a real number, got {bad!r} ({type(bad).__name__})")
    for bad in (math.inf, -math.inf, math.nan):
        assert _message(check_real, "x", bad) == (ValueError, f"x must be finite, got {bad!r}")
    assert check_real("x", 1e-300, positive=True) == 1e-300
    assert _message(check_real, "x", 0, positive=True) == (ValueError, "x must be > 0, got 0.0")
    assert _message(check_real, "x", -1, positive=True) == (ValueError, "x must be > 0, got -1.0")
    assert check_real("x", 0, nonnegative=True) == 0.0
    assert _message(check_real, "x", -1e-12, nonnegative=True) == (ValueError, "x must be >= 0, got -1e-12")
    assert check_real("x", -1e-12) == -1e-12


def test_check_names():
    choices = ("a", "b", "c")
    assert check_names("--what", " b , a ,", choices) == ["b", "a"]
    assert check_names("--what", ["c", " a"], choices) == ["c", "a"]
    assert check_names("--what", ("b",), choices) == ["b"]
    assert _message(check_names, "--what", "a,x,y", choices) == (ValueError, "--what: unknown 'x', 'y'; choose from a, b, c")
    assert _message(check_names, "--what", " , ", choices) == (ValueError, "--what: unknown empty list ' , '; choose from a, b, c")
    assert _message(check_names, "--what", [], choices) == (ValueError, "--what: unknown empty list []; choose from a, b, c")
    assert _message(check_names, "--what", "a,b,a", choices) == (ValueError, "--what: each at most once, got ['a', 'b', 'a']")


def test_chunk_size_arg():
    assert chunk_size_arg("auto") == "auto" and chunk_size_arg("512") == 512
    with pytest.raises(ValueError):
        chunk_size_arg("AUTO")


def test_digits_value_reads_ascii_digits_only():
    assert [digits_value(t) for t in ("0", "7", "0012", "123456789012345678901")] == [0, 7, 12, 123456789012345678901]
    # "²" passes str.isdigit and int() refuses it; "٣" int() reads as 3; the rest are no count
    assert [digits_value(t) for t in ("²", "٣", "", " 3", "3 ", "-3", "+3", "3.0", "1_000", "x")] == [None] * 10


def test_integer_value_takes_every_integer_and_no_bool_or_float():
    import torch

    ints = (3, -2, np.int64(4), np.uint8(7), np.array(6), torch.tensor(5), torch.tensor(-1, dtype=torch.int8))
    assert [integer_value(v) for v in ints] == [3, -2, 4, 7, 6, 5, -1]
    assert all(type(integer_value(v)) is int for v in ints)
    for other in (True, np.bool_(False), np.array(True), torch.tensor(True), 1.5, 2.0, np.float64(2.0),
                  torch.tensor(2.0), torch.tensor([1, 2]), "3", None):  # int() took 1.5 as 1, True as 1
        assert integer_value(other) is None, other
