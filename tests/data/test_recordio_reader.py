"""The RecordIO reader's edges, exactly (:mod:`shardfc.data.recordio`): each message in full, each
bound at its value and one past it, what a read asks of the file, and the handle's life.

``test_recordio.py`` holds the round trips (pack, shuffle, verify, the CLI, DataLoader workers);
``test_hostile_data.py`` the hostile files under a memory cap in a subprocess. These run in the
test's process, so mutmut sees them (``scripts/mutation.sh src/shardfc/data/recordio.py``).
"""

from __future__ import annotations

import io
import os
import pickle
import struct
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from read_spy import ReadSpy
from shardfc import files
from shardfc.data import recordio
from shardfc.data.recordio import (
    IR_SIZE,
    IRHeader,
    RecordIODataset,
    RecordIOReader,
    RecordIOWriter,
    detect_layout,
    encode_record,
    first_label,
    pack_header,
    read_property,
    scan_records,
    unpack_header,
)
from shardfc.data.transforms import CorruptImageError

MAGIC = struct.pack("<I", recordio.RECORDIO_MAGIC)


def _part(cflag: int, data: bytes) -> bytes:
    """One part as dmlc-core frames it: magic, flag and length, data, padding to 4 bytes."""
    return MAGIC + struct.pack("<I", (cflag << 29) | len(data)) + data + b"\0" * (-len(data) % 4)


def _png(seed: int = 0) -> bytes:
    arr = np.random.default_rng(seed).integers(0, 256, size=(4, 4, 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(arr).save(buf, format="PNG")
    return buf.getvalue()


def _files(tmp_path: Path, rec: bytes, idx: str, name: str = "x") -> Path:
    path = tmp_path / f"{name}.rec"
    path.write_bytes(rec)
    path.with_suffix(".idx").write_text(idx)
    return path


def _written(tmp_path: Path, payloads, name: str = "x", keys=None) -> Path:
    path = tmp_path / f"{name}.rec"
    with RecordIOWriter(path) as w:
        for key, payload in zip(keys if keys is not None else range(len(payloads)), payloads):
            w.write(key, payload)
    return path


@pytest.fixture
def reads(monkeypatch):
    """The sizes every file the RecordIO module opens is asked for."""
    asked = []
    real = files.open_file
    monkeypatch.setattr(recordio.files, "open_file",
                        lambda *a, **k: ReadSpy(real(*a, **k), lambda op, n: asked.append(n)))
    return asked


# ------------------------------------------------------------------ the payload's header


def test_a_label_sequence_sets_the_flag_even_of_one_label_and_keeps_float32():
    for labels in ([5.0], [[1.0], [2.0]], np.array(7.0)):
        payload = pack_header(IRHeader(99, labels, 3, 4), b"img!")
        header, image = unpack_header(payload)
        flat = np.asarray(labels, dtype=np.float32).reshape(-1)
        assert header.flag == flat.size and header.id == 3 and header.id2 == 4 and image == b"img!"
        assert header.label.dtype == np.float32 and header.label.tolist() == flat.tolist()
        assert payload[:IR_SIZE] == struct.pack("<IfQQ", flat.size, 0.0, 3, 4)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # float() of a one-element array is deprecated in numpy
        assert first_label(unpack_header(pack_header(IRHeader(0, [5.0], 0, 0)))[0]) == 5.0
    with pytest.raises(ValueError) as info:
        pack_header(IRHeader(0, [], 0, 0))
    assert str(info.value) == "pack_header: a label sequence must not be empty"


def test_a_header_alone_is_a_payload_and_a_shorter_one_is_named():
    header, image = unpack_header(struct.pack("<IfQQ", 0, 2.5, 1, 2))
    assert header == IRHeader(0, 2.5, 1, 2) and image == b""
    with pytest.raises(ValueError) as info:
        unpack_header(b"\0" * 23)
    assert str(info.value) == "<record>: payload of 23 bytes is shorter than the 24-byte IRHeader"
    with pytest.raises(ValueError) as info:
        unpack_header(struct.pack("<IfQQ", 3, 0.0, 0, 0) + b"\0" * 11, "k#7")
    assert str(info.value) == "k#7: IRHeader says 3 labels follow but the payload has only 35 bytes"


def test_the_labels_are_as_many_as_the_flag_says_and_the_image_follows():
    payload = pack_header(IRHeader(0, [1.0, 2.0], 0, 0), b"\x01\x02\x03\x04\x05\x06\x07\x08")
    header, image = unpack_header(payload)
    assert header.label.tolist() == [1.0, 2.0] and image == b"\x01\x02\x03\x04\x05\x06\x07\x08"


# ------------------------------------------------------------------ framing


def test_a_payload_is_split_at_each_aligned_magic_only():
    payload = b"abcd" + MAGIC + b"efgh" + MAGIC + b"ij" + MAGIC + b"k"  # the third magic is not aligned
    assert encode_record(payload) == (_part(1, b"abcd") + _part(2, b"efgh") + _part(3, b"ij" + MAGIC + b"k"))
    assert encode_record(b"xyz") == _part(0, b"xyz")
    # past an unaligned magic, the search goes on from the next byte, to the next magic, not the last
    payload = b"ab" + MAGIC + b"cd" + MAGIC + b"efgh" + MAGIC
    assert encode_record(payload) == _part(1, b"ab" + MAGIC + b"cd") + _part(2, b"efgh") + _part(3, b"")
    assert encode_record(MAGIC) == _part(1, b"") + _part(3, b"")


def test_the_largest_record_is_framed_and_one_byte_more_refused(monkeypatch):
    monkeypatch.setattr(recordio, "MAX_RECORD_BYTES", 10)  # the real bound, 2**29 - 1, is 512 MiB
    assert encode_record(b"0123456789") == _part(0, b"0123456789")
    with pytest.raises(ValueError) as info:
        encode_record(b"0123456789a")
    assert str(info.value) == "RecordIO records must be shorter than 2**29 bytes, got 11"


def test_a_split_record_is_read_back_whole(tmp_path: Path, reads):
    payload = pack_header(IRHeader(0, 1.0, 0, 0), b"abcd" + MAGIC + b"ef")  # magic at offset 28: aligned
    rec = _written(tmp_path, [payload, b"next record ."])
    reader = RecordIOReader(rec)
    reads.clear()  # (the index's reads)
    assert reader.read(0) == payload and reader.read(1) == b"next record ."
    assert reader.read_header(0) == unpack_header(payload)[0]
    # each part: its 8-byte head, its data, its padding; never the rest of the file
    assert reads == [8, 28, 8, 2, 2, 8, 13, 3, 8 + IR_SIZE + 32]
    assert [p for _, p in scan_records(rec)] == [payload, b"next record ."]


def _damaged(tmp_path: Path, part: bytes) -> Path:
    """A file whose record 0 is fine and record 1 is ``part``."""
    good = encode_record(pack_header(IRHeader(0, 0.0, 0, 0), b"ok"))
    return _files(tmp_path, good + part, f"0\t0\n1\t{len(good)}\n")


@pytest.mark.parametrize("cflag", [4, 7])
def test_a_continuation_flag_past_3_is_named(tmp_path: Path, cflag):
    rec = _damaged(tmp_path, _part(cflag, b"x" * 24))
    at = len(encode_record(pack_header(IRHeader(0, 0.0, 0, 0), b"ok")))
    for read, what in ((lambda: RecordIOReader(rec).read(1), "key 1"),
                       (lambda: RecordIOReader(rec).read_header(1), "key 1"),
                       (lambda: list(scan_records(rec)), "record #1 (sequential scan)")):
        with pytest.raises(ValueError) as info:
            read()
        assert str(info.value) == f"{rec}: {what}: invalid continuation flag {cflag} at offset {at}"


def test_a_bad_magic_is_named_with_its_offset(tmp_path: Path):
    rec = _damaged(tmp_path, b"\x01\x02\x03\x04" + struct.pack("<I", 24) + b"x" * 24)
    at = 36
    tail = f"bad magic 0x04030201 at offset {at} (expected 0xCED7230A); the file is corrupt or its .idx offsets do not belong to it"
    for read, what in ((lambda: RecordIOReader(rec).read(1), "key 1"),
                       (lambda: RecordIOReader(rec).read_header(1), "key 1"),
                       (lambda: list(scan_records(rec)), "record #1 (sequential scan)")):
        with pytest.raises(ValueError) as info:
            read()
        assert str(info.value) == f"{rec}: {what}: {tail}"


def test_a_record_that_starts_or_goes_on_with_the_wrong_part_is_named(tmp_path: Path):
    rec = _damaged(tmp_path, _part(2, b"x" * 24))
    for read in (lambda r: r.read(1), lambda r: r.read_header(1)):
        with pytest.raises(ValueError) as info:
            read(RecordIOReader(rec))
        assert str(info.value) == f"{rec}: key 1: record at offset 36 starts with continuation flag 2 (a later part)"
    rec = _damaged(tmp_path, _part(1, b"x" * 24) + _part(1, b"y" * 4))
    with pytest.raises(ValueError) as info:
        RecordIOReader(rec).read(1)
    assert str(info.value) == f"{rec}: key 1: part at offset 68 has flag 1, expected the continuation of a split record"
    # a split record whose second part is damaged, found by read_header's whole read (split in the header)
    rec = _damaged(tmp_path, _part(1, b"x" * 8) + b"\0" * 8)
    with pytest.raises(ValueError) as info:
        RecordIOReader(rec).read_header(1)
    assert str(info.value).startswith(f"{rec}: key 1: bad magic 0x00000000 at offset 52 ")


def test_a_part_longer_than_the_file_is_refused_before_it_is_read(tmp_path: Path, reads):
    good = encode_record(pack_header(IRHeader(0, 0.0, 0, 0), b"ok"))  # 36 bytes
    for declared, held in ((40, 36), (1 << 28, 4), (9, 8)):
        head = MAGIC + struct.pack("<I", declared)
        rec = _files(tmp_path, good + head + b"z" * held, f"0\t0\n1\t{len(good)}\n")
        message = (f"{rec}: key 1: truncated record: part at offset 36 declares {declared} bytes, "
                   f"only {held} remain in the file")
        reader = RecordIOReader(rec)
        reads.clear()
        with pytest.raises(ValueError) as info:
            reader.read(1)
        assert str(info.value) == message
        assert reads == [8]  # the part's head, and nothing it declares
        with pytest.raises(ValueError) as info:
            RecordIOReader(rec).read_header(1)
        assert str(info.value) == message
        with pytest.raises(ValueError) as info:
            list(scan_records(rec))
        assert str(info.value) == message.replace("key 1", "record #1 (sequential scan)")
    # a second part past the end: what is left after its head may be nothing
    rec = _files(tmp_path, good + _part(1, b"x" * 8) + MAGIC + struct.pack("<I", (3 << 29) | 100), f"0\t0\n1\t{len(good)}\n")
    with pytest.raises(ValueError) as info:
        RecordIOReader(rec).read(1)
    assert str(info.value) == f"{rec}: key 1: truncated record: part at offset 52 declares 100 bytes, only 0 remain in the file"


def test_a_file_that_ends_inside_a_part_head_is_named(tmp_path: Path):
    good = encode_record(pack_header(IRHeader(0, 0.0, 0, 0), b"ok"))
    rec = _files(tmp_path, good + MAGIC + b"\0", "0\t0\n")
    with pytest.raises(ValueError) as info:
        list(scan_records(rec))
    assert str(info.value) == (f"{rec}: record #1 (sequential scan): truncated record: expected an 8-byte part "
                               "header at offset 36, found 5 bytes before the end of the file")


def test_a_sequential_scan_counts_records_from_0_and_names_its_file(tmp_path: Path, special_file):
    rec = _written(tmp_path, [b"a" * 30, b"b" * 30, b"c" * 30])
    data = bytearray(rec.read_bytes())
    data[2 * 40] ^= 0xFF  # record #2's magic
    rec.write_bytes(bytes(data))
    with pytest.raises(ValueError, match=r"x\.rec: record #2 \(sequential scan\): bad magic"):
        list(scan_records(rec))
    fifo = tmp_path / "f.rec"
    special_file(fifo, "fifo")
    with pytest.raises(files.FileRefused) as info:
        list(scan_records(fifo))
    assert str(info.value) == f"refusing to read RecordIO file {fifo}: it is a FIFO, not a regular file"


# ------------------------------------------------------------------ the index


def test_an_index_is_at_most_64_bytes_per_8_of_its_rec(tmp_path: Path):
    rec = _written(tmp_path, [b"r" * 32])  # 40 bytes: an index of at most (40 // 8 + 1) * 64 = 384
    idx = rec.with_suffix(".idx")
    idx.write_text("0\t0\n" + " " * (384 - 4))
    assert RecordIOReader(rec).keys.tolist() == [0]
    idx.write_text("0\t0\n" + " " * (385 - 4))
    with pytest.raises(files.FileRefused) as info:
        RecordIOReader(rec)
    assert str(info.value) == (f"RecordIO index {idx} is 385 bytes, more than an index of its 40-byte .rec can be "
                               "(384): it belongs to another file")


def test_an_index_is_named_by_the_gate_and_must_be_ascii(tmp_path: Path):
    rec = _written(tmp_path, [b"r" * 32])
    idx = rec.with_suffix(".idx")
    idx.write_bytes("0\t０\n".encode())  # a full-width zero: int() would take it, a RecordIO reader would not
    with pytest.raises(files.FileRefused) as info:
        RecordIOReader(rec)
    assert str(info.value) == f"RecordIO index {idx} is not ascii text (byte 2: ordinal not in range(128))"
    idx.unlink()
    idx.mkdir()
    with pytest.raises(files.FileRefused) as info:
        RecordIOReader(rec)
    assert str(info.value) == f"refusing to read RecordIO index {idx}: it is a folder, not a regular file"


@pytest.mark.parametrize("text, line", [
    ("0\t0\n\nbogus\n", 3),  # a blank line is skipped, and the count goes on
    ("0\t0\nx\t0\n", 2),  # the key, then the offset
    ("0\t0\n1\ty\n", 2),
    ("0\t0 1\n", 1),
    ("0\t0\n1\t99999999999999999999\n", 2),  # past int64: no OverflowError from numpy
    ("0\t0\n-99999999999999999999\t0\n", 2),
    ("-9223372036854775808\t9223372036854775807\n9223372036854775808\t0\n", 2),  # int64's ends, and past one
    ("-9223372036854775808\t9223372036854775807\nbogus\n", 2),
])
def test_a_malformed_index_line_is_named(tmp_path: Path, text, line):
    rec = _written(tmp_path, [b"r" * 32])
    rec.with_suffix(".idx").write_text(text)
    with pytest.raises(ValueError) as info:
        RecordIOReader(rec)
    got = text.splitlines()[line - 1]
    assert str(info.value) == f"{rec.with_suffix('.idx')}:{line}: expected '<key>\\t<offset>' (two int64s), got {got!r}"


def test_a_long_malformed_line_is_quoted_in_part(tmp_path: Path):
    rec = _written(tmp_path, [b"r" * 32] * 40)
    rec.with_suffix(".idx").write_text("0\t0\n" + "9" * 300 + "\n")
    with pytest.raises(ValueError) as info:
        RecordIOReader(rec)
    assert str(info.value).endswith(f"got {'9' * 200!r}")


def test_the_index_is_read_as_int64_and_may_be_named(tmp_path: Path):
    rec = _written(tmp_path, [b"a" * 32, b"b" * 32], keys=[5, 2])
    elsewhere = tmp_path / "other.index"
    os.replace(rec.with_suffix(".idx"), elsewhere)
    reader = RecordIOReader(rec, idx_path=elsewhere)
    assert reader.idx_path == str(elsewhere)
    assert reader.keys.dtype == np.int64 and reader.offsets.dtype == np.int64
    assert reader.keys.tolist() == [5, 2] and reader.offsets.tolist() == [0, 40]
    assert repr(reader) == f"RecordIOReader({str(rec)!r}, records=2)"


def test_an_offset_is_in_the_file_while_a_part_head_fits(tmp_path: Path):
    rec = _files(tmp_path, _part(0, b"r" * 24) + _part(0, b""), "0\t0\n1\t32\n")  # the last head ends the file
    reader = RecordIOReader(rec)
    assert reader.file_size == 40 and reader.read(1) == b""
    rec.with_suffix(".idx").write_text("0\t0\n1\t33\n")
    with pytest.raises(ValueError) as info:
        RecordIOReader(rec)
    assert str(info.value) == (f"{rec.with_suffix('.idx')}: key 1 has offset 33, past the end of {str(rec)!r} "
                               "(40 bytes); the .rec is truncated or the .idx belongs to another file")


def test_a_key_twice_in_the_index_is_named(tmp_path: Path):
    rec = _written(tmp_path, [b"r" * 32] * 4)
    rec.with_suffix(".idx").write_text("7\t0\n3\t40\n9\t80\n7\t120\n")  # not the smallest key
    with pytest.raises(ValueError) as info:
        RecordIOReader(rec)
    assert str(info.value) == f"{rec.with_suffix('.idx')}: key 7 appears more than once"


def test_the_reader_names_a_missing_or_irregular_file(tmp_path: Path):
    with pytest.raises(FileNotFoundError) as info:
        RecordIOReader(tmp_path / "none.rec")
    assert str(info.value) == f"RecordIO file {str(tmp_path / 'none.rec')!r} does not exist"
    (tmp_path / "dir.rec").mkdir()
    (tmp_path / "dir.idx").write_text("")
    with pytest.raises(files.FileRefused) as info:
        RecordIOReader(tmp_path / "dir.rec")
    assert str(info.value) == f"refusing to read RecordIO file {tmp_path / 'dir.rec'}: it is a folder, not a regular file"


# ------------------------------------------------------------------ lookups


def test_lookups_find_every_key_and_no_other(tmp_path: Path):
    rec = _written(tmp_path, [b"r" * 32] * 4, keys=[0, 9, 4, 2])
    reader = RecordIOReader(rec)
    for position, key in enumerate([0, 9, 4, 2]):
        assert key in reader and reader._position(key) == position and reader.offset_of(key) == 40 * position
    for key in (-1, 1, 3, 10, 1 << 40):
        assert key not in reader and reader._position(key) == -1
    got = reader.positions([[9, 1], [0, 10]])
    assert got.dtype == np.int64 and got.tolist() == [[1, -1], [0, -1]]
    assert reader.positions(np.array([2.0, 3.0])).tolist() == [3, -1]
    with pytest.raises(KeyError) as info:
        reader.offset_of(3)
    assert info.value.args == (f"{rec}: key 3 is not in {rec.with_suffix('.idx')}",)


def test_lookups_in_an_empty_or_one_record_file(tmp_path: Path):
    empty = _files(tmp_path, b"", "", "empty")
    reader = RecordIOReader(empty)
    got = reader.positions([[0, 5]])
    assert len(reader) == 0 and got.dtype == np.int64 and got.tolist() == [[-1, -1]] and 0 not in reader
    one = RecordIOReader(_written(tmp_path, [b"r" * 32], "one", keys=[6]))
    assert one.positions([6, 0, 7]).tolist() == [0, -1, -1]


# ------------------------------------------------------------------ read_header


def test_read_header_reads_a_few_dozen_bytes_unless_it_must_read_the_record(tmp_path: Path, reads):
    payloads = [pack_header(IRHeader(0, 3.0, 1, 2), b"i" * 500),  # the header in the first read
                pack_header(IRHeader(0, 4.0, 0, 0)),  # a payload of exactly the header
                pack_header(IRHeader(0, [1.0, 2.0], 0, 0), b"j" * 100),  # header and labels: 32 bytes
                pack_header(IRHeader(0, list(range(7)), 0, 0), b"l" * 100),  # 52 bytes of the 56 read
                pack_header(IRHeader(0, list(range(9)), 0, 0), b"k" * 8)]  # labels past the first read
    rec = _written(tmp_path, payloads)
    reader = RecordIOReader(rec)
    for key, payload in enumerate(payloads):
        reads.clear()
        header = reader.read_header(key)
        expected = unpack_header(payload)[0]
        assert header.flag == expected.flag and np.array_equal(header.label, expected.label)
        whole = [8, len(payload)] + ([-len(payload) % 4] if len(payload) % 4 else [])
        assert reads == [8 + IR_SIZE + 32] + (whole if key == 4 else [])


def test_read_header_names_a_short_or_truncated_record(tmp_path: Path, reads):
    # a payload shorter than the header (only a whole read can tell), then one cut short of its labels
    cut = pack_header(IRHeader(0, [1.0, 2.0], 0, 0))[:-1]  # 31 bytes; the next record's byte would fill it
    rec = _files(tmp_path, _part(0, b"0123456789") + _part(0, cut) + _part(0, b"z" * 40), "0\t0\n1\t20\n2\t60\n")
    reader = RecordIOReader(rec)
    with pytest.raises(ValueError) as info:
        reader.read_header(0)
    assert str(info.value) == f"{rec}#key 0: payload of 10 bytes is shorter than the 24-byte IRHeader"
    with pytest.raises(ValueError) as info:
        reader.read_header(1)
    assert str(info.value) == f"{rec}#key 1: IRHeader says 2 labels follow but the payload has only 31 bytes"
    # a header only, at the end of the file: its 8 bytes are there, its payload is empty
    rec = _files(tmp_path, _part(0, b"r" * 24) + _part(0, b""), "0\t0\n1\t32\n", "end")
    with pytest.raises(ValueError) as info:
        RecordIOReader(rec).read_header(1)
    assert str(info.value) == f"{rec}#key 1: payload of 0 bytes is shorter than the 24-byte IRHeader"
    # the file cut after the reader checked it
    rec = _files(tmp_path, _part(0, b"r" * 24) + _part(0, b"s" * 24), "0\t0\n1\t32\n", "cut")
    reader = RecordIOReader(rec)
    with open(rec, "r+b") as f:
        f.truncate(36)
    with pytest.raises(ValueError) as info:
        reader.read_header(1)
    assert str(info.value) == f"{rec}: key 1: truncated record at offset 32"
    rec = _files(tmp_path, _part(0, b"r" * 24) + _part(0, b"s" * 24)[:16], "0\t0\n1\t32\n", "cut")
    reader = RecordIOReader(rec)
    reads.clear()
    with pytest.raises(ValueError) as info:
        reader.read_header(1)
    assert str(info.value) == f"{rec}: key 1: truncated record: part at offset 32 declares 24 bytes, only 8 remain in the file"
    assert reads == [8 + IR_SIZE + 32]  # known from the size, before the record is read


def test_a_file_that_shrinks_while_a_record_is_read_is_named(tmp_path: Path, monkeypatch):
    rec = _files(tmp_path, _part(0, b"r" * 24) + _part(0, b"s" * 20), "0\t0\n1\t32\n")
    reader = RecordIOReader(rec)
    fstat = os.fstat

    def larger(fd):  # what fstat said before the file lost its last bytes
        fields = list(fstat(fd))
        fields[6] += 100
        return os.stat_result(fields)

    monkeypatch.setattr(recordio.os, "fstat", larger)
    with open(rec, "r+b") as f:
        f.truncate(50)
    with pytest.raises(ValueError) as info:
        reader.read(1)
    assert str(info.value) == f"{rec}: key 1: truncated record: part at offset 32 declares 20 bytes, only 10 remain in the file"


# ------------------------------------------------------------------ the handle


def test_one_handle_per_process_and_close_leaves_another_process_s_alone(tmp_path: Path, monkeypatch, special_file):
    rec = _written(tmp_path, [b"a" * 32, b"b" * 32])
    reader = RecordIOReader(rec)
    reader.read(0)
    first = reader._fh
    reader.read(1)
    assert reader._fh is first and reader._pid == os.getpid()
    parent = os.getpid()
    monkeypatch.setattr(recordio.os, "getpid", lambda: parent + 1)  # as if forked
    reader.read(0)
    assert reader._fh is not first and first.closed and reader._pid == parent + 1
    second = reader._fh
    monkeypatch.setattr(recordio.os, "getpid", lambda: parent + 2)
    reader.close()  # the handle belongs to another process: dropped, not closed
    assert not second.closed and reader._fh is None and reader._pid is None
    second.close()
    monkeypatch.setattr(recordio.os, "getpid", lambda: parent)
    with RecordIOReader(rec) as r:
        r.read(0)
        handle = r._fh
    assert handle.closed and r._fh is None and r._pid is None
    clone = pickle.loads(pickle.dumps(reader))
    assert clone._fh is None and clone.read(1) == b"b" * 32
    # the .rec swapped for a FIFO after the check: the handle's open refuses it
    reader = RecordIOReader(rec)
    rec.unlink()
    special_file(rec, "fifo")
    with pytest.raises(files.FileRefused) as info:
        reader.read(0)
    assert str(info.value) == f"refusing to read RecordIO file {rec}: it is a FIFO, not a regular file"


# ------------------------------------------------------------------ the writer


def test_the_writer_refuses_a_negative_or_repeated_key_and_a_write_after_close(tmp_path: Path):
    rec = tmp_path / "w.rec"
    w = RecordIOWriter(rec)
    assert [w.write(k, b"p" * 4) for k in (3, 0, 1)] == [0, 12, 24] and len(w) == 3
    for bad in (-1, 1.5, True, "7", None):  # 1.5 was written as key 1
        with pytest.raises(ValueError) as info:
            w.write(bad, b"p")
        assert str(info.value) == f"{rec}: keys must be ints >= 0, got {bad!r}"
    with pytest.raises(ValueError) as info:
        w.write(0, b"p")
    assert str(info.value) == f"{rec}: key 0 written twice"
    assert w.write(np.int64(5), b"") == 36 and w.write(torch.tensor(6), b"") == 44  # numpy's and torch's ints
    w.close()
    with pytest.raises(ValueError) as info:
        w.write(4, b"p")
    assert str(info.value) == f"RecordIOWriter for {str(rec)!r} is closed"
    assert rec.with_suffix(".idx").read_bytes() == b"3\t0\n0\t12\n1\t24\n5\t36\n6\t44\n"


# ------------------------------------------------------------------ the insightface layout


def _insightface(tmp_path: Path, header_labels, image_keys, identities=(), name="if") -> RecordIOReader:
    payloads = {0: pack_header(IRHeader(2, list(header_labels), 0, 0))}
    for k in image_keys:
        payloads[k] = pack_header(IRHeader(0, 0.0, k, 0), b"img")
    for k in identities:
        payloads[k] = pack_header(IRHeader(2, [1.0, 2.0], 0, 0))
    return RecordIOReader(_written(tmp_path, list(payloads.values()), name, keys=list(payloads)))


@pytest.mark.parametrize("labels, kind", [
    ([3, 5], "insightface"), ([1, 1], "insightface"), ([3, 3], "insightface"),  # no images; no identities
    ([1.5, 5], "im2rec"), ([3, 5.5], "im2rec"), ([0, 5], "im2rec"), ([4, 3], "im2rec"),
])
def test_a_header_is_two_integral_labels_1_le_a_le_b(tmp_path: Path, labels, kind):
    reader = _insightface(tmp_path, labels, [1, 2], [3, 4])
    found = detect_layout(reader)
    assert found.kind == kind
    if kind == "insightface":
        a, b = labels
        assert found.image_keys.tolist() == list(range(1, a)) and found.identity_range == (a, b)
    else:
        assert found.image_keys.tolist() == [0, 1, 2, 3, 4] and found.identity_range is None


def test_a_header_may_announce_as_many_keys_as_the_index_holds_and_no_more(tmp_path: Path):
    reader = _insightface(tmp_path, [5, 5], [1, 2], [7, 8], name="a")  # keys 1..4 announced, 3 and 4 absent
    with pytest.raises(ValueError) as info:
        detect_layout(reader)
    assert str(info.value) == (f"{reader.idx_path}: the insightface header (key 0) announces image keys 1..4, "
                               "but key 3 is not in the index (2 missing)")
    reader = _insightface(tmp_path, [4, 4], [1, 2], name="b")  # 1..3: as many keys as the index holds (3)
    with pytest.raises(ValueError, match=r"announces image keys 1..3, but key 3 is not in the index \(1 missing\)$"):
        detect_layout(reader)
    reader = _insightface(tmp_path, [6, 6], [1, 2, 3], name="c")  # 1..5: one more than the index holds (4)
    with pytest.raises(ValueError) as info:
        detect_layout(reader)
    assert str(info.value) == (f"{reader.idx_path}: the insightface header (key 0) announces image keys 1..5 and "
                               "0 identity records, but the index holds 4 records")
    reader = _insightface(tmp_path, [1, 4], [], [1, 2, 3], name="d")  # 3 identity records of 4 held
    assert detect_layout(reader).identity_range == (1, 4)
    reader = _insightface(tmp_path, [1, 4], [], [1, 2], name="e")  # 3 announced, 3 held
    assert detect_layout(reader).identity_range == (1, 4)
    reader = _insightface(tmp_path, [1, 5], [], [1, 2], name="f")  # 4 announced, 3 held
    with pytest.raises(ValueError, match="announces image keys 1..0 and 4 identity records, but the index holds 3"):
        detect_layout(reader)


def test_a_header_record_too_short_is_named(tmp_path: Path):
    rec = _written(tmp_path, [b"short", pack_header(IRHeader(0, 0.0, 0, 0), b"i")])
    with pytest.raises(ValueError) as info:
        detect_layout(RecordIOReader(rec))
    assert str(info.value) == f"{rec}#key 0: payload of 5 bytes is shorter than the 24-byte IRHeader"


# ------------------------------------------------------------------ property, labels, the dataset


@pytest.mark.parametrize("text, ok", [("1,112,112", True), ("7, 2 ,3\n", True), ("0,112,112", False),
                                      ("5,112", False), ("5,112,112,3", False), ("5,-1,112", False),
                                      ("five,112,112", False)])
def test_a_property_file_is_three_positive_ints(tmp_path: Path, text, ok):
    path = tmp_path / "property"
    path.write_text(text)
    if ok:
        assert read_property(path) == tuple(int(v) for v in text.split(","))
        return
    with pytest.raises(ValueError) as info:
        read_property(path)
    assert str(info.value) == f"{path}: expected 'num_classes,height,width' (positive ints), got {text.strip()!r}"


def test_a_property_file_is_named_by_the_gate(tmp_path: Path):
    assert read_property(tmp_path / "property") is None
    (tmp_path / "property").mkdir()
    with pytest.raises(files.FileRefused) as info:
        read_property(tmp_path / "property")
    assert str(info.value) == (f"refusing to read RecordIO property file {tmp_path / 'property'}: it is a folder, "
                               "not a regular file")


def _dataset_files(tmp_path: Path, labels, name="d", prop=None) -> Path:
    root = tmp_path / name
    root.mkdir()
    with RecordIOWriter(root / "train.rec") as w:
        for k, label in enumerate(labels):
            w.write(k, pack_header(IRHeader(0, float(label), k, 0), _png(k)))
    if prop is not None:
        (root / "property").write_text(prop)
    return root


@pytest.mark.parametrize("label", [-1, 1.5, float("nan")])
def test_a_label_that_is_not_a_class_id_is_named(tmp_path: Path, label):
    root = _dataset_files(tmp_path, [0, label])
    with pytest.raises(ValueError) as info:
        RecordIODataset(root)
    assert str(info.value) == (f"{root / 'train.rec'}#key 1: label {float(np.float32(label))!r} is not a class id "
                               "(a non-negative integer)")


def test_the_dataset_takes_its_settings_and_one_image_is_enough(tmp_path: Path):
    ds = RecordIODataset(_dataset_files(tmp_path, [0]))
    assert len(ds) == 1 and ds.train is True and ds.transform.random_flip and ds.seed == 0
    assert ds.label_of(0) == 0 and ds.num_classes == 1
    ds = RecordIODataset(_dataset_files(tmp_path, [2, 0, 1], "e"), image_size=(4, 4), train=True, flip_prob=1.0, seed=7)
    assert ds.seed == 7 and ds.transform.flip_prob == 1.0 and [ds.label_of(i) for i in range(3)] == [2, 0, 1]
    assert repr(ds) == f"RecordIODataset({str(tmp_path / 'e' / 'train.rec')!r}, layout=im2rec, images=3, num_classes=3)"
    flipped, label = ds._load(1, ds.augmentation_generator(1, 0))
    plain = RecordIODataset(tmp_path / "e", image_size=(4, 4), train=False)._load(1, None)[0]
    assert label == 0 and flipped.flip(-1).equal(plain)


def test_an_empty_dataset_is_named(tmp_path: Path):
    root = tmp_path / "empty"
    root.mkdir()
    (root / "train.rec").write_bytes(b"")
    (root / "train.idx").write_text("")
    with pytest.raises(ValueError) as info:
        RecordIODataset(root)
    assert str(info.value) == f"RecordIO dataset {str(root / 'train.rec')!r} contains no images"


def test_class_counts_are_checked_naming_their_file(tmp_path: Path, monkeypatch):
    monkeypatch.setenv("SHARDFC_MAX_CLASSES_WITHOUT_IMAGES", "3")
    root = _dataset_files(tmp_path, [0, 5])
    with pytest.raises(files.FileRefused) as info:
        RecordIODataset(root)
    assert str(info.value) == (f"RecordIO file {root / 'train.rec'} declares 6 classes for 2 images: more than one "
                               "class per image and more than 3 (raise it with SHARDFC_MAX_CLASSES_WITHOUT_IMAGES)")
    root = _dataset_files(tmp_path, [0, 1], "p", prop="1000000000000,2,2")
    with pytest.raises(files.FileRefused) as info:
        RecordIODataset(root)
    assert str(info.value).startswith(f"RecordIO property file {root / 'property'} declares 1000000000000 classes for 2 images")
    root = _dataset_files(tmp_path, [0, 2], "q", prop="2,4,4")
    with pytest.raises(ValueError) as info:
        RecordIODataset(root)
    assert str(info.value) == f"{root / 'property'}: num_classes=2, but {str(root / 'train.rec')!r} has label 2"
    assert RecordIODataset(_dataset_files(tmp_path, [0, 2], "r", prop="3,4,4")).num_classes == 3


def test_a_record_changed_after_the_label_scan_is_named_when_read(tmp_path: Path):
    root = _dataset_files(tmp_path, [0, 1])
    ds = RecordIODataset(root)
    rec = root / "train.rec"
    offset = int(ds.reader.offset_of(1))
    rec.write_bytes(rec.read_bytes()[:offset] + _part(0, b"short"))
    ds.reader.close()  # (its buffered handle may hold the old bytes)
    with pytest.raises(ValueError) as info:
        ds.read_image_bytes(1)
    assert str(info.value) == f"{rec}#key 1: payload of 5 bytes is shorter than the 24-byte IRHeader"


def test_a_flip_draws_from_the_sample_s_generator_only(tmp_path: Path):
    import torch

    ds = RecordIODataset(_dataset_files(tmp_path, [0, 1]), image_size=(4, 4), flip_prob=0.5)
    outs = []
    for seed in range(16):
        torch.manual_seed(seed)  # the global generator must not matter
        outs.append(ds._load(1, ds.augmentation_generator(1, 3))[0])
    assert all(o.equal(outs[0]) for o in outs)


def test_a_corrupt_image_is_named_by_its_key(tmp_path: Path):
    root = tmp_path / "c"
    root.mkdir()
    with RecordIOWriter(root / "train.rec") as w:
        w.write(0, pack_header(IRHeader(0, 0.0, 0, 0), _png(0)))
        w.write(1, pack_header(IRHeader(0, 1.0, 1, 0), b"not an image"))
    ds = RecordIODataset(root, image_size=(4, 4))
    with pytest.raises(CorruptImageError) as info:
        ds._load(1, None)
    assert info.value.path == f"{root / 'train.rec'}#key 1"
    assert ds.read_image_bytes(1) == b"not an image"

