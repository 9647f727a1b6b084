"""The byte counts ``shardfc plan`` reads (``--budget``, ``--l2``) and writes (its tables), at their edges."""

import pytest

from shardfc.tools.plan.units import format_bytes, parse_bytes


@pytest.mark.parametrize("text, value", [
    ("16GiB", 16 << 30), ("16G", 16 << 30), ("16gb", 16 * 10**9), ("1.5KiB", 1536), (" 2 kb ", 2000),
    ("3TiB", 3 << 40), ("1tb", 10**12), ("7", 7), ("7b", 7), ("1e3", 1000), (".5M", 512 << 10), ("2.5E2", 250),
    (1, 1), (2.9, 2), (5e9, 5 * 10**9),
])
def test_byte_counts_read(text, value):
    assert parse_bytes(text) == value


@pytest.mark.parametrize("text", ["", "GiB", "16 XB", "-1GiB", "1e", "16GiBs", "one", "1,5G"])
def test_not_a_byte_count(text):
    with pytest.raises(ValueError) as info:
        parse_bytes(text, "--l2")
    assert str(info.value) == f"--l2 must be a byte count such as 16GiB, 500MB or 1e9, got {text!r}"


@pytest.mark.parametrize("value", [0, 0.5, "0", "0.2", float("inf"), float("nan"), -3])
def test_less_than_a_byte(value):
    with pytest.raises(ValueError) as info:
        parse_bytes(value)
    assert str(info.value) == f"budget must be at least 1 byte, got {value!r}"


@pytest.mark.parametrize("value", [True, False])
def test_a_bool_is_not_a_count(value):
    with pytest.raises(ValueError) as info:
        parse_bytes(value)
    assert str(info.value) == f"budget must be a byte count such as 16GiB, got {value!r}"


@pytest.mark.parametrize("n, text", [
    (0, "0 B"), (1023, "1023 B"), (1023.9, "1023 B"), (1024, "1.00 KiB"), (1536, "1.50 KiB"),
    ((1 << 20) - 1, "1,024.00 KiB"), (1 << 20, "1.00 MiB"), ((1 << 30) - 1, "1,024.00 MiB"),
    (1 << 30, "1.00 GiB"), (3 << 40, "3,072.00 GiB"), (-2048, "-2.00 KiB"), (-5, "-5 B"),
])
def test_byte_counts_written(n, text):
    assert format_bytes(n) == text
