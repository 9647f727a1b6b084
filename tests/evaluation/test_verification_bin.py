"""``load_bin``'s defences, exactly, in the test's process (:mod:`shardfc.evaluation.verification`).

``tests/data/test_hostile_data.py`` runs the large crafted files (2 GiB to 8 GiB declared) in a
subprocess under a memory cap; here the same checks meet sizes a test can afford should a check
fail (a few MiB), with each message in full and each bound at its value and one past it, so that
mutmut sees them. ``test_verification.py`` holds the round trips and the metrics.
"""

from __future__ import annotations

import io
import pickle
import struct
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from pickled_call import PickledCall
from shardfc import files
from shardfc.evaluation import load_bin, verification
from shardfc.evaluation.verification import _BinUnpickler


def _png(value: int = 0, size=(4, 2)) -> bytes:
    buf = io.BytesIO()
    Image.fromarray(np.full((size[0], size[1], 3), value, np.uint8)).save(buf, format="PNG")
    return buf.getvalue()


def _bin(tmp_path: Path, obj, protocol=2, name="x.bin") -> Path:
    path = tmp_path / name
    path.write_bytes(pickle.dumps(obj, protocol=protocol))
    return path


def _refusal(path: Path, **kw) -> str:
    with pytest.raises(ValueError) as info:
        load_bin(path, **kw)
    return str(info.value)


# ------------------------------------------------------------------ what a .bin may hold


@pytest.mark.parametrize("protocol", [2, 4, 5])
def test_numpy_images_load_under_every_protocol(tmp_path: Path, protocol):
    images = [np.frombuffer(_png(v), np.uint8) for v in (0, 255)]
    path = _bin(tmp_path, (images, np.array([[True]])), protocol)  # issame of any shape: flattened
    got, same = load_bin(path, image_size=(4, 2))
    assert got.shape == (2, 3, 4, 2) and got.dtype == torch.float32 and same.tolist() == [True]
    assert got[0].eq(-1).all() and got[1].eq(1).all()


def test_python2_strings_are_bytes_and_a_latin1_str_is_an_image(tmp_path: Path):
    # Python 2 wrote bytes as BINSTRING ('T'): read with encoding="bytes", never decoded as text.
    body = b"".join(b"T" + struct.pack("<i", len(p)) + p for p in (_png(0), _png(255)))
    path = tmp_path / "py2.bin"
    path.write_bytes(b"\x80\x02]q\x00(" + body + b"e]q\x01\x88a\x86q\x02.")
    images, same = load_bin(path, image_size=(4, 2))
    assert images[1].eq(1).all() and same.tolist() == [True]
    path = _bin(tmp_path, ([_png(0).decode("latin-1"), _png(255)], [1]), name="str.bin")
    images, same = load_bin(path, image_size=(4, 2))
    assert images[0].eq(-1).all() and same.dtype == torch.bool and same.tolist() == [True]


def test_images_are_float32_whatever_torch_s_default(tmp_path: Path):
    path = _bin(tmp_path, ([_png(0), _png(1)], [False]))
    before = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        assert load_bin(path, image_size=(4, 2))[0].dtype == torch.float32
    finally:
        torch.set_default_dtype(before)


def test_bins_held_in_a_numpy_array_are_not_taken_for_repeats(tmp_path: Path):
    bins = np.array([_png(0), _png(9), _png(3), _png(200)])  # iterating makes new objects each time
    images, _ = load_bin(_bin(tmp_path, (bins, [True, False])), image_size=(4, 2))
    assert images.shape == (4, 3, 4, 2)


# ------------------------------------------------------------------ the structure, named


def test_a_pickle_of_the_wrong_shape_is_named(tmp_path: Path):
    path = _bin(tmp_path, {"bins": []})
    assert _refusal(path) == f"{str(path)!r}: expected a pickled (bins, issame_list) pair, got dict"
    path = _bin(tmp_path, ([_png()] * 1 + [_png(1)] * 2, [True]), name="odd.bin")
    assert _refusal(path) == f"{str(path)!r}: 3 images for 1 pairs; expected exactly 2 images per pair"


def test_one_image_object_named_twice_is_refused(tmp_path: Path):
    image = _png()
    path = _bin(tmp_path, ([image, image, _png(1), _png(2)], [True, True]))
    assert _refusal(path) == (f"{str(path)!r} refers to the same encoded image more than once (4 images, "
                              "3 distinct): not an insightface verification set")


def test_the_gate_names_a_verification_bin(tmp_path: Path, special_file):
    special_file(tmp_path / "lfw.bin", "fifo")
    assert _refusal(tmp_path / "lfw.bin") == (f"refusing to read verification .bin {tmp_path / 'lfw.bin'}: "
                                              "it is a FIFO, not a regular file")
    with pytest.raises(FileNotFoundError) as info:
        load_bin(tmp_path / "none.bin")
    assert str(info.value) == f"verification bin file not found: {str(tmp_path / 'none.bin')!r}"


def test_a_global_other_than_an_array_s_or_bytes_is_refused_by_name(tmp_path: Path):
    path = tmp_path / "g.bin"
    path.write_bytes(b"\x80\x02cos\ngetcwd\n)R.")
    assert _refusal(path) == (f"{str(path)!r} is not a readable verification .bin pickle: refusing to unpickle "
                              f"global os.getcwd from {str(path)!r}: a verification .bin should contain only "
                              "encoded images and a bool list")


def test_a_refusal_quotes_the_unpickler_in_one_line_of_300_characters_at_most(tmp_path: Path):
    name = "x" * 400
    path = tmp_path / "long.bin"
    path.write_bytes(b"\x80\x02c" + b"os\n" + name.encode() + b"\n.")  # GLOBAL os.xxx...
    text = _refusal(path)
    head = f"{str(path)!r} is not a readable verification .bin pickle: "
    assert text.startswith(head + f"refusing to unpickle global os.{'x' * 20}") and len(text) == len(head) + 300


# ------------------------------------------------------------------ sizes, before a byte is allocated


def _unpickler(size: int = 100) -> _BinUnpickler:
    return _BinUnpickler(io.BytesIO(b""), "p.bin", size)


def test_what_an_array_would_take_is_counted_before_numpy_builds_it():
    u = _unpickler()
    assert u._items((2, 3), "u4") == 24 and u._items(5, np.dtype("u2")) == 10 and u._items([2], b"f8") == 16
    assert u._items((0, 7), "u1") == 0
    assert u._items((3,), "no such dtype") == 3 and u._items((3,), b"\xff") == 3 and u._items((4,), "S0") == 4
    for shape in ((-1,), (1.5,), "ab", (2, None)):
        with pytest.raises(pickle.UnpicklingError) as info:
            u._items(shape, "u1")
        assert str(info.value) == f"'p.bin': an array shape {shape!r} that is not non-negative ints"


def test_each_constructor_that_takes_a_size_is_bounded_by_the_file(tmp_path: Path):
    u = _unpickler(100)
    ba = u.find_class("builtins", "bytearray")
    assert ba() == bytearray() and ba(b"ab") == bytearray(b"ab") and ba(100) == bytearray(100)
    with pytest.raises(pickle.UnpicklingError) as info:
        ba(101)
    assert str(info.value) == ("'p.bin' (100 bytes) asks bytearray for 101 bytes, more than the file holds: "
                               "a verification .bin only holds its encoded images")
    nd = u.find_class("numpy", "ndarray")
    arr = nd((3,), np.dtype("u1"), b"abc")
    assert arr.dtype == np.uint8 and arr.tolist() == [97, 98, 99] and nd((25,), "u4").nbytes == 100
    with pytest.raises(pickle.UnpicklingError, match=r"^'p.bin' \(100 bytes\) asks an array for 104 bytes"):
        nd((26,), "u4")
    rc = u.find_class("numpy._core.multiarray", "_reconstruct")
    built = rc(nd, (0,), b"b")
    assert type(built) is np.ndarray and built.shape == (0,)
    with pytest.raises(pickle.UnpicklingError, match=r"^'p.bin' \(100 bytes\) asks an array for 101 bytes"):
        rc(nd, (101,), b"b")


@pytest.mark.parametrize("make, what, nbytes", [
    (lambda n: PickledCall(bytearray, n), "bytearray", lambda n: n),
    (lambda n: PickledCall(np.ndarray, (n,), np.dtype("u1")), "an array", lambda n: n),
    (lambda n: PickledCall(np.ndarray, (n // 4 + 1,), np.dtype("u4")), "an array", lambda n: 4 * (n // 4 + 1)),
])
def test_a_constructor_asking_for_more_than_the_file_is_refused_in_load_bin(tmp_path: Path, make, what, nbytes):
    n = 4 << 20  # 4 MiB in a file of a few hundred bytes
    path = _bin(tmp_path, ([make(n), _png()], [True]))
    size = path.stat().st_size
    assert _refusal(path) == (f"{str(path)!r} is not a readable verification .bin pickle: {str(path)!r} ({size} bytes) "
                              f"asks {what} for {nbytes(n)} bytes, more than the file holds: a verification .bin "
                              "only holds its encoded images")


def test_a_bytearray_of_the_file_s_length_is_built_and_one_more_refused(tmp_path: Path):
    noise = io.BytesIO()  # an image of about 1 KiB: the file's length then takes the same 2-byte int as n
    Image.fromarray(np.random.default_rng(0).integers(0, 256, (16, 16, 3), np.uint8)).save(noise, format="PNG")

    def file_for(n):
        return _bin(tmp_path, ([PickledCall(bytearray, n), noise.getvalue()], [True]), name=f"{n}.bin")

    size = file_for(1000).stat().st_size
    assert 1000 < size < 1 << 16
    with pytest.raises(Exception) as info:  # built, then not an image
        load_bin(file_for(size))
    assert "asks bytearray" not in str(info.value) and f"{size}.bin[0]" in str(info.value)
    assert f"asks bytearray for {size + 1} bytes" in _refusal(file_for(size + 1))


@pytest.mark.parametrize("opcode, width", [(b"B", "<i"), (b"\x8e", "<Q"), (b"\x8d", "<Q")],
                         ids=["BINBYTES", "BINBYTES8", "BINUNICODE8"])
def test_a_counted_opcode_declaring_more_than_remains_is_refused_before_it_is_read(tmp_path: Path, opcode, width):
    path = tmp_path / "c.bin"
    head = b"\x80\x04" + opcode
    declared = 40  # 30 bytes remain after the count
    path.write_bytes(head + struct.pack(width, declared) + b"a" * 29 + b".")
    size = path.stat().st_size
    assert _refusal(path) == (f"{str(path)!r} is not a readable verification .bin pickle: {str(path)!r} ({size} bytes) "
                              f"declares a value of {declared} bytes, more than the file holds")
    path.write_bytes(head + struct.pack(width, 31) + b"a" * 29 + b".")  # one byte past what remains
    assert "declares a value of 31 bytes, more than the file holds" in _refusal(path)
    path.write_bytes(head + struct.pack(width, 30) + b"a" * 30 + b".")  # all that remains but the STOP
    assert _refusal(path).endswith(": expected a pickled (bins, issame_list) pair, got " +
                                   ("str" if opcode == b"\x8d" else "bytes"))


def test_a_malformed_pickle_is_left_to_the_unpickler(tmp_path: Path):
    path = tmp_path / "m.bin"
    path.write_bytes(b"\x80\x02\xff")  # an opcode that does not exist
    assert _refusal(path) == f"{str(path)!r} is not a readable verification .bin pickle: invalid load key, '\\xff'."


# ------------------------------------------------------------------ the decoded size


def test_the_decoded_images_may_take_the_cap_and_not_a_byte_more(tmp_path: Path, monkeypatch):
    path = _bin(tmp_path, ([_png(0), _png(1)], [True]))
    decoded = 2 * 3 * 4 * 2 * 4  # images x channels x height x width x float32
    monkeypatch.setattr(verification, "MAX_DECODED_RATIO", 0)
    monkeypatch.setattr(verification, "MIN_DECODED_CAP", decoded)
    assert load_bin(path, image_size=(4, 2))[0].shape == (2, 3, 4, 2)
    monkeypatch.setattr(verification, "MIN_DECODED_CAP", decoded - 1)
    assert _refusal(path, image_size=(4, 2)) == (
        f"{str(path)!r} ({path.stat().st_size} bytes) holds 2 images, 0.0 GiB decoded at 4 x 2: "
        "more than 0 times its size, which encoded images never are")
    monkeypatch.setattr(verification, "MIN_DECODED_CAP", 0)
    monkeypatch.setattr(verification, "MAX_DECODED_RATIO", -(-decoded // path.stat().st_size))  # the ratio's turn
    assert load_bin(path, image_size=(4, 2))[0].shape == (2, 3, 4, 2)


def test_a_bin_that_would_decode_past_its_cap_is_refused_before_decoding(tmp_path: Path):
    path = _bin(tmp_path, ([_png(0), _png(1)], [True]))
    assert _refusal(path, image_size=(4096, 3072)) == (
        f"{str(path)!r} ({path.stat().st_size} bytes) holds 2 images, 0.3 GiB decoded at 4096 x 3072: "
        "more than 1024 times its size, which encoded images never are")


def test_a_file_too_large_for_the_gate_is_refused_unread(tmp_path: Path, monkeypatch):
    path = _bin(tmp_path, ([_png(0), _png(1)], [True]))
    monkeypatch.setenv("SHARDFC_MAX_BIN_BYTES", "64")
    with pytest.raises(files.FileRefused, match=r"verification \.bin .* more than the 64 bytes a bin file may have"):
        load_bin(path)
