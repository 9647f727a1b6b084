"""MXNet / insightface RecordIO (``train.rec`` + ``train.idx`` + ``property``), without mxnet.

File format (dmlc-core RecordIO)
--------------------------------
A ``.rec`` file is a sequence of *parts*. Each part is::

    u32 magic = 0xCED7230A      (little endian)
    u32 lrec                    bits 29-31: continuation flag, bits 0-28: part length
    <length bytes>
    <zero padding to a multiple of 4>

A record whose payload contains the magic number at a 4-byte aligned offset is
split there by the writer: the magic is dropped and the record continues in a
new part. The continuation flag is 0 for a whole record, 1/2/3 for the
first/middle/last part of a split one; the reader joins the parts, putting the
magic bytes back between them. The ``.idx`` text file holds one ``key<TAB>offset``
line per record (``offset`` = byte position of the record's first magic).

Payload (``mx.recordio.pack``): an :class:`IRHeader` ``<IfQQ`` (flag u32,
label f32, id u64, id2 u64); when ``flag > 0``, ``flag`` float32 labels follow
and replace ``label`` (the class is the first one); then the encoded image.

insightface layout
------------------
insightface's face datasets (MS1M, Glint360K, WebFace...) put a header at key 0:
``flag = 2``, labels ``[a, b]``, no image. Keys ``1 .. a-1`` are the images and
keys ``a .. b-1`` one *identity record* per class (labels ``[first, end)``, the
range of that class's image keys). Files written by MXNet's ``im2rec`` have no
such header: every key is an image. :func:`detect_layout` follows the rule of
insightface's ``MXFaceDataset`` (read record 0; ``flag > 0`` means a header) and
additionally requires that record 0 has no image data and integral labels
``1 <= a <= b``, so a multi-label im2rec file whose key 0 is an image is not
mistaken for a header. Identity records are never yielded as images.

Errors
------
Structural damage (a missing ``.idx``, wrong magic, a truncated record, an idx
offset past the end of the file, an unknown continuation flag) raises
:class:`FileNotFoundError` or :class:`ValueError` naming the file and the key.
An image that is framed correctly but does not decode is *skipped and counted*
by :class:`RecordIODataset`, as in :mod:`shardfc.data.folder`.

(One file for one format, longer than ~400 lines on purpose: the reader, the writer, the layout
rules and the dataset share the private framing helpers above them, and the format is read
top to bottom once.)
"""

from __future__ import annotations

import logging
import os
import struct
from typing import Iterator, List, NamedTuple, Optional, Sequence, Set, Tuple, Union

import numpy as np
import torch

from shardfc import files
from shardfc.checks import integer_value
from shardfc.data.folder import FileImageDataset  # the shared decode / skip-and-count policy
from shardfc.data.labels import check_class_count
from shardfc.data.transforms import decode_image

__all__ = [
    "RECORDIO_MAGIC",
    "IRHeader",
    "pack_header",
    "unpack_header",
    "encode_record",
    "scan_records",
    "RecordIOReader",
    "RecordIOWriter",
    "RecordIOLayout",
    "detect_layout",
    "resolve_recordio_paths",
    "read_property",
    "write_property",
    "RecordIODataset",
]

logger = logging.getLogger("shardfc.data")

PathLike = Union[str, "os.PathLike[str]"]

#: dmlc-core RecordIO magic number.
RECORDIO_MAGIC = 0xCED7230A
_MAGIC_BYTES = struct.pack("<I", RECORDIO_MAGIC)
_PART_HEAD = struct.Struct("<II")
_LEN_MASK = (1 << 29) - 1
#: Largest payload one part can describe (dmlc-core refuses records of 2**29 bytes or more).
MAX_RECORD_BYTES = (1 << 29) - 1

_IR = struct.Struct("<IfQQ")  # mxnet's 'IfQQ' on little-endian machines: 24 bytes, no padding
IR_SIZE = _IR.size


class IRHeader(NamedTuple):
    """mxnet's ``IRHeader``: ``label`` is a float, or a float32 array when ``flag > 0``."""

    flag: int
    label: Union[float, np.ndarray]
    id: int
    id2: int


def pack_header(header: Union[IRHeader, Sequence], data: bytes = b"") -> bytes:
    """``IRHeader`` + encoded image -> record payload, like ``mx.recordio.pack``.

    A numeric ``label`` is stored in the header with ``flag = 0``; a sequence of
    labels sets ``flag = len(label)``, stores 0 in the header's label field and
    puts the float32 labels before ``data`` (the given ``flag`` is ignored, as
    in mxnet).
    """
    flag, label, id_, id2 = header
    if isinstance(label, (int, float, np.integer, np.floating)):
        head = _IR.pack(0, float(label), int(id_), int(id2))
        return head + bytes(data)
    arr = np.asarray(label, dtype="<f4").reshape(-1)
    if arr.size == 0:
        raise ValueError("pack_header: a label sequence must not be empty")
    return _IR.pack(arr.size, 0.0, int(id_), int(id2)) + arr.tobytes() + bytes(data)


def unpack_header(payload: bytes, name: str = "<record>") -> Tuple[IRHeader, bytes]:
    """Record payload -> ``(IRHeader, image bytes)``, like ``mx.recordio.unpack``.

    Raises:
        ValueError: the payload is shorter than its header (message names ``name``).
    """
    if len(payload) < IR_SIZE:
        raise ValueError(f"{name}: payload of {len(payload)} bytes is shorter than the {IR_SIZE}-byte IRHeader")
    flag, label, id_, id2 = _IR.unpack_from(payload, 0)
    rest = IR_SIZE
    if flag > 0:
        end = IR_SIZE + 4 * flag
        if len(payload) < end:
            raise ValueError(
                f"{name}: IRHeader says {flag} labels follow but the payload has only {len(payload)} bytes"
            )
        label = np.frombuffer(payload, dtype="<f4", count=flag, offset=IR_SIZE).astype(np.float32)
        rest = end
    return IRHeader(flag, label, id_, id2), payload[rest:]


def first_label(header: IRHeader) -> float:
    return float(header.label[0]) if header.flag > 0 else float(header.label)


def encode_record(payload: bytes) -> bytes:
    """Frame ``payload`` as one dmlc-core record (split at aligned magics, padded to 4 bytes)."""
    payload = bytes(payload)
    n = len(payload)
    if n > MAX_RECORD_BYTES:
        raise ValueError(f"RecordIO records must be shorter than 2**29 bytes, got {n}")
    out = bytearray()
    start = 0
    pos = payload.find(_MAGIC_BYTES)
    while pos != -1:
        if pos % 4 == 0:
            out += _PART_HEAD.pack(RECORDIO_MAGIC, ((1 if start == 0 else 2) << 29) | (pos - start))
            out += payload[start:pos]  # aligned start and end: no padding needed
            start = pos + 4
            pos = payload.find(_MAGIC_BYTES, start)
        else:
            pos = payload.find(_MAGIC_BYTES, pos + 1)
    out += _PART_HEAD.pack(RECORDIO_MAGIC, ((3 if start else 0) << 29) | (n - start))
    out += payload[start:]
    out += b"\0" * (-(n - start) % 4)
    return bytes(out)


def _parse_lrec(path: str, what: str, offset: int, head: bytes) -> Tuple[int, int]:
    magic, lrec = _PART_HEAD.unpack(head)
    if magic != RECORDIO_MAGIC:
        raise ValueError(
            f"{path}: {what}: bad magic 0x{magic:08X} at offset {offset} (expected 0x{RECORDIO_MAGIC:08X}); "
            f"the file is corrupt or its .idx offsets do not belong to it"
        )
    cflag, length = lrec >> 29, lrec & _LEN_MASK
    if cflag > 3:
        raise ValueError(f"{path}: {what}: invalid continuation flag {cflag} at offset {offset}")
    return cflag, length


def _read_record(f, path: str, offset: int, what: str) -> Tuple[bytes, int]:
    """Read the record starting at ``offset`` from binary file ``f``: ``(payload, end offset)``.

    Each part's declared length is checked against what the file holds before it is read: a read of
    ``n`` bytes allocates ``n`` up front, and a crafted part may declare 512 MiB in a tiny file."""
    size = os.fstat(f.fileno()).st_size
    f.seek(offset)
    parts: List[bytes] = []
    pos = offset
    while True:
        head = f.read(8)
        if len(head) < 8:
            raise ValueError(
                f"{path}: {what}: truncated record: expected an 8-byte part header at offset {pos}, "
                f"found {len(head)} bytes before the end of the file"
            )
        cflag, length = _parse_lrec(path, what, pos, head)
        if pos + 8 + length > size:
            raise ValueError(
                f"{path}: {what}: truncated record: part at offset {pos} declares {length} bytes, "
                f"only {max(size - pos - 8, 0)} remain in the file"
            )
        expect_first = not parts
        if expect_first and cflag not in (0, 1):
            raise ValueError(f"{path}: {what}: record at offset {pos} starts with continuation flag {cflag} (a later part)")
        if not expect_first and cflag not in (2, 3):
            raise ValueError(f"{path}: {what}: part at offset {pos} has flag {cflag}, expected the continuation of a split record")
        data = f.read(length)
        if len(data) < length:
            raise ValueError(
                f"{path}: {what}: truncated record: part at offset {pos} declares {length} bytes, "
                f"only {len(data)} remain in the file"
            )
        pad = -length % 4
        if pad:
            f.read(pad)  # a missing final pad at end of file is harmless
        parts.append(data)
        pos += 8 + length + pad
        if cflag in (0, 3):
            return (parts[0] if len(parts) == 1 else _MAGIC_BYTES.join(parts)), pos


def scan_records(rec_path: PathLike) -> Iterator[Tuple[int, bytes]]:
    """Every record of a ``.rec`` file in file order, as ``(offset, payload)``; needs no ``.idx``."""
    path = os.fspath(rec_path)
    with files.open_file(path, "record", "RecordIO file") as f:
        size = os.fstat(f.fileno()).st_size
        offset = 0
        n = 0
        while offset < size:
            payload, end = _read_record(f, path, offset, f"record #{n} (sequential scan)")
            yield offset, payload
            offset, n = end, n + 1


#: The most bytes an ``.idx`` line may average: two int64s in decimal, a tab, a newline (42), with room
#: for other whitespace. A ``.rec`` record takes at least 8 bytes, so an ``.idx`` is at most this many
#: bytes per 8 bytes of its ``.rec``: a longer one is not that file's index, and is not read.
IDX_BYTES_PER_RECORD = 64
_INT64_MIN, _INT64_MAX = -(1 << 63), (1 << 63) - 1


def _read_idx(idx_path: str, rec_size: int) -> Tuple[np.ndarray, np.ndarray]:
    idx_size = files.regular_file(idx_path, "RecordIO index").st_size
    most = (rec_size // 8 + 1) * IDX_BYTES_PER_RECORD
    if idx_size > most:
        raise files.FileRefused(f"RecordIO index {idx_path} is {idx_size} bytes, more than an index of its "
                                f"{rec_size}-byte .rec can be ({most}): it belongs to another file")
    text = files.read_text(idx_path, "index", "RecordIO index", encoding="ascii")
    fields = text.split()
    try:
        if len(fields) % 2:
            raise ValueError
        table = np.array(fields, dtype=object).reshape(-1, 2)
        keys = table[:, 0].astype(np.int64)
        offsets = table[:, 1].astype(np.int64)
    except (ValueError, OverflowError):  # a field that is not an int, or one past int64
        # Slow path, only to name the offending line.
        for lineno, line in enumerate(text.splitlines(), start=1):
            cols = line.split()
            if not cols:
                continue
            try:
                if len(cols) != 2 or not all(_INT64_MIN <= int(c) <= _INT64_MAX for c in cols):
                    raise ValueError
            except ValueError:
                raise ValueError(f"{idx_path}:{lineno}: expected '<key>\\t<offset>' (two int64s), "
                                 f"got {line[:200]!r}") from None
        raise ValueError(f"{idx_path}: malformed index") from None  # not reached: a line above is named
    return keys, offsets


class RecordIOReader:
    """Random access to the records of a ``.rec`` file through its ``.idx``.

    The ``.idx`` is parsed at construction and checked against the file size;
    the ``.rec`` itself is opened lazily, once per process: the first access in
    a process opens a private handle, so DataLoader workers (fork or spawn)
    never share a file offset with the parent or with each other. Pickling
    drops the handle. One reader is not meant to be used from several threads.

    Args:
        rec_path: the ``.rec`` file.
        idx_path: its index; default: ``rec_path`` with the suffix ``.idx``.

    Attributes:
        keys: int64 array of the keys, in ``.idx`` order.
        offsets: int64 array of the matching byte offsets.

    Raises:
        FileNotFoundError: the ``.rec`` or the ``.idx`` does not exist.
        ValueError: a malformed ``.idx`` line, a duplicate key, or an offset
            past the end of the ``.rec`` (names the file and the key).
    """

    def __init__(self, rec_path: PathLike, idx_path: Optional[PathLike] = None) -> None:
        self.rec_path = os.fspath(rec_path)
        self.idx_path = os.fspath(idx_path) if idx_path is not None else os.path.splitext(self.rec_path)[0] + ".idx"
        if not os.path.lexists(self.rec_path):
            raise FileNotFoundError(f"RecordIO file {self.rec_path!r} does not exist")
        if not os.path.lexists(self.idx_path):
            raise FileNotFoundError(
                f"RecordIO index {self.idx_path!r} does not exist (needed for random access to {self.rec_path!r})"
            )
        # The gate: regular files only (a FIFO would block the first read, /dev/zero never end it).
        self.file_size = files.regular_file(self.rec_path, "RecordIO file").st_size
        self.keys, self.offsets = _read_idx(self.idx_path, self.file_size)
        bad = np.flatnonzero((self.offsets < 0) | (self.offsets + 8 > self.file_size))
        if bad.size:
            i = int(bad[0])
            raise ValueError(
                f"{self.idx_path}: key {int(self.keys[i])} has offset {int(self.offsets[i])}, past the end of "
                f"{self.rec_path!r} ({self.file_size} bytes); the .rec is truncated or the .idx belongs to another file"
            )
        self._order = np.argsort(self.keys, kind="stable")
        self._sorted_keys = self.keys[self._order]
        dup = np.flatnonzero(self._sorted_keys[1:] == self._sorted_keys[:-1])
        if dup.size:
            raise ValueError(f"{self.idx_path}: key {int(self._sorted_keys[dup[0]])} appears more than once")
        self._fh = None
        self._pid: Optional[int] = None

    # ------------------------------------------------------------- handles
    def _handle(self):
        pid = os.getpid()
        if self._fh is None or self._pid != pid:
            if self._fh is not None:
                try:  # inherited through fork: closes this process's descriptor only
                    self._fh.close()
                except OSError:
                    pass
            self._fh = files.open_file(self.rec_path, "record", "RecordIO file")
            self._pid = pid
        return self._fh

    def close(self) -> None:
        if self._fh is not None and self._pid == os.getpid():
            self._fh.close()
        self._fh, self._pid = None, None

    def __enter__(self) -> "RecordIOReader":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:
            pass

    def __getstate__(self) -> dict:
        state = self.__dict__.copy()
        state["_fh"], state["_pid"] = None, None
        return state

    # -------------------------------------------------------------- lookup
    def __len__(self) -> int:
        return int(self.keys.size)

    def _position(self, key: int) -> int:
        """Index of ``key`` in :attr:`keys`, or -1."""
        j = int(np.searchsorted(self._sorted_keys, key))
        if j < self._sorted_keys.size and self._sorted_keys[j] == key:
            return int(self._order[j])
        return -1

    def __contains__(self, key) -> bool:
        return self._position(int(key)) >= 0

    def positions(self, keys) -> np.ndarray:
        """Index into :attr:`keys` of each of ``keys`` (vectorised); -1 where absent."""
        keys = np.asarray(keys, dtype=np.int64)
        if self._sorted_keys.size == 0:
            return np.full(keys.shape, -1, dtype=np.int64)
        j = np.minimum(np.searchsorted(self._sorted_keys, keys), self._sorted_keys.size - 1)
        return np.where(self._sorted_keys[j] == keys, self._order[j], -1)

    def offset_of(self, key: int) -> int:
        i = self._position(int(key))
        if i < 0:
            raise KeyError(f"{self.rec_path}: key {key} is not in {self.idx_path}")
        return int(self.offsets[i])

    def name(self, key: int) -> str:
        """How a record is called in messages: ``"<rec path>#key <key>"``."""
        return f"{self.rec_path}#key {key}"

    # ------------------------------------------------------------- reading
    def read(self, key: int) -> bytes:
        """The payload of record ``key`` (parts joined).

        Raises:
            KeyError: ``key`` is not in the index.
            ValueError: bad magic, invalid flag or truncated record (names file, key and offset).
        """
        offset = self.offset_of(key)
        payload, _ = _read_record(self._handle(), self.rec_path, offset, f"key {key}")
        return payload

    def read_header(self, key: int) -> IRHeader:
        """Only the :class:`IRHeader` of record ``key``: reads a few dozen bytes, not the image.

        Also checks that a whole (unsplit) record fits in the file, so truncation is found early.
        """
        return self._read_header_at(self.offset_of(key), key)

    def _read_header_at(self, offset: int, key: int) -> IRHeader:
        f = self._handle()
        f.seek(offset)
        chunk = f.read(8 + IR_SIZE + 32)
        what = f"key {key}"
        if len(chunk) < 8:
            raise ValueError(f"{self.rec_path}: {what}: truncated record at offset {offset}")
        cflag, length = _parse_lrec(self.rec_path, what, offset, chunk[:8])
        if cflag not in (0, 1):
            raise ValueError(
                f"{self.rec_path}: {what}: record at offset {offset} starts with continuation flag {cflag} (a later part)"
            )
        if cflag == 0 and offset + 8 + length > self.file_size:
            raise ValueError(
                f"{self.rec_path}: {what}: truncated record: part at offset {offset} declares {length} bytes, "
                f"only {self.file_size - offset - 8} remain in the file"
            )
        body = chunk[8 : 8 + length]
        if len(body) >= IR_SIZE:
            flag = _IR.unpack_from(body, 0)[0]
            if len(body) >= IR_SIZE + 4 * flag:
                return unpack_header(body, self.name(key))[0]
        # Split inside the header, many labels, or short: read the whole record.
        payload, _ = _read_record(f, self.rec_path, offset, what)
        return unpack_header(payload, self.name(key))[0]

    def __iter__(self) -> Iterator[Tuple[int, bytes]]:
        """``(key, payload)`` for every record, in ``.idx`` order."""
        for key in self.keys.tolist():
            yield key, self.read(key)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.rec_path!r}, records={len(self)})"


class RecordIOWriter:
    """Writes a ``.rec`` and its ``.idx`` (``key<TAB>offset`` lines, in write order).

    Records are framed as dmlc-core does (see :func:`encode_record`), so mxnet,
    insightface and DALI read the result.

    Args:
        rec_path: the ``.rec`` to create (overwritten).
        idx_path: default: ``rec_path`` with the suffix ``.idx``.
    """

    def __init__(self, rec_path: PathLike, idx_path: Optional[PathLike] = None) -> None:
        self.rec_path = os.fspath(rec_path)
        self.idx_path = os.fspath(idx_path) if idx_path is not None else os.path.splitext(self.rec_path)[0] + ".idx"
        self._rec = open(self.rec_path, "wb")
        self._idx = open(self.idx_path, "w", encoding="ascii", newline="\n")
        self._keys: Set[int] = set()
        self._offset = 0

    def write(self, key: int, payload: bytes) -> int:
        """Append one record under ``key``; returns its offset."""
        if self._rec.closed:
            raise ValueError(f"RecordIOWriter for {self.rec_path!r} is closed")
        index = integer_value(key)  # ints, numpy's and torch's integers; 1.5 was written as key 1
        if index is None or index < 0:
            raise ValueError(f"{self.rec_path}: keys must be ints >= 0, got {key!r}")
        key = index
        if key in self._keys:
            raise ValueError(f"{self.rec_path}: key {key} written twice")
        framed = encode_record(payload)
        offset = self._offset
        self._rec.write(framed)
        self._offset += len(framed)
        self._idx.write(f"{key}\t{offset}\n")
        self._keys.add(key)
        return offset

    def close(self) -> None:
        if not self._rec.closed:
            self._rec.close()
            self._idx.close()

    def __enter__(self) -> "RecordIOWriter":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __len__(self) -> int:
        return len(self._keys)


# ---------------------------------------------------------------- layout
class RecordIOLayout(NamedTuple):
    """What :func:`detect_layout` found.

    ``kind`` is ``"insightface"`` (header at key 0) or ``"im2rec"`` (no header);
    ``image_keys`` the keys holding images, in reading order; ``identity_range``
    the ``[a, b)`` keys of the identity records, or ``None``.
    """

    kind: str
    image_keys: np.ndarray
    identity_range: Optional[Tuple[int, int]]


def _insightface_header(header: IRHeader, image: bytes) -> Optional[Tuple[int, int]]:
    if header.flag < 2 or len(image) != 0:
        return None
    a, b = float(header.label[0]), float(header.label[1])
    if not (a.is_integer() and b.is_integer() and 1 <= a <= b):
        return None
    return int(a), int(b)


def detect_layout(reader: RecordIOReader) -> RecordIOLayout:
    """insightface header at key 0, or an im2rec file (see the module docstring).

    Raises:
        ValueError: a header announces image keys that the ``.idx`` lacks.
    """
    if 0 in reader:
        header, image = unpack_header(reader.read(0), reader.name(0))
        ranges = _insightface_header(header, image)
        if ranges is not None:
            a, b = ranges
            # Checked against the index before anything is allocated: a header announcing 10^12
            # keys would otherwise ask np.arange for terabytes.
            if a - 1 > len(reader) or b - a > len(reader):
                raise ValueError(
                    f"{reader.idx_path}: the insightface header (key 0) announces image keys 1..{a - 1} and "
                    f"{b - a} identity records, but the index holds {len(reader)} records"
                )
            keys = np.arange(1, a, dtype=np.int64)
            missing = np.flatnonzero(reader.positions(keys) < 0)
            if missing.size:
                raise ValueError(
                    f"{reader.idx_path}: the insightface header (key 0) announces image keys 1..{a - 1}, "
                    f"but key {int(keys[missing[0]])} is not in the index ({missing.size} missing)"
                )
            return RecordIOLayout("insightface", keys, (a, b))
    return RecordIOLayout("im2rec", reader.keys.copy(), None)


# ------------------------------------------------------------ paths, property
def resolve_recordio_paths(root_or_rec_path: PathLike) -> Tuple[str, str, str]:
    """``(rec, idx, property)`` paths for a dataset folder or a ``.rec`` file.

    A folder means ``train.rec``/``train.idx``/``property`` inside it; a file
    path means that file, the ``.idx`` beside it and ``property`` in its folder.

    Raises:
        FileNotFoundError: the path, or the ``.rec`` inside a folder, does not exist.
    """
    path = os.fspath(root_or_rec_path)
    if os.path.isdir(path):
        rec = os.path.join(path, "train.rec")
        if not os.path.lexists(rec):
            raise FileNotFoundError(f"RecordIO folder {path!r} has no train.rec")
    elif os.path.lexists(path):  # anything but a regular file is refused by the reader, in one line
        rec = path
    else:
        raise FileNotFoundError(f"RecordIO path {path!r} does not exist (expected a folder with train.rec, or a .rec file)")
    return rec, os.path.splitext(rec)[0] + ".idx", os.path.join(os.path.dirname(rec), "property")


def read_property(path: PathLike) -> Optional[Tuple[int, int, int]]:
    """insightface's ``property`` file (``num_classes,H,W``), or ``None`` if absent."""
    path = os.fspath(path)
    if not os.path.lexists(path):
        return None
    text = files.read_text(path, "property", "RecordIO property file").strip()
    try:
        values = tuple(int(v) for v in text.split(","))
        if len(values) != 3 or min(values) <= 0:
            raise ValueError
    except ValueError:
        raise ValueError(f"{path}: expected 'num_classes,height,width' (positive ints), got {text!r}") from None
    return values  # type: ignore[return-value]


def write_property(path: PathLike, num_classes: int, height: int, width: int) -> None:
    with open(path, "w", encoding="utf-8") as f:
        f.write(f"{int(num_classes)},{int(height)},{int(width)}\n")


def class_id(reader: RecordIOReader, key: int, value: float) -> int:
    if not (value >= 0 and float(value).is_integer()):
        raise ValueError(f"{reader.name(key)}: label {value!r} is not a class id (a non-negative integer)")
    return int(value)


# ----------------------------------------------------------------- dataset
class RecordIODataset(FileImageDataset):
    """Images of an insightface / MXNet RecordIO dataset, as ``(tensor [3, H, W], class id)``.

    Same interface and corrupt-image policy as
    :class:`~shardfc.data.folder.ImageFolderDataset`: an image that does not
    decode is skipped (the next decodable index is returned, wrapping around),
    counted in ``corrupt_count`` and named in ``corrupt_paths`` as
    ``"<rec>#key <key>"``; a warning is logged once per record. Structural
    damage raises instead (see the module docstring).

    Args:
        root_or_rec_path: a folder with ``train.rec``, ``train.idx`` and
            optionally ``property``; or a ``.rec`` path (``.idx`` beside it,
            ``property`` in its folder).
        image_size: output ``(height, width)``; images are resized if needed.
        train: random horizontal flips.
        flip_prob: flip probability when ``train``.
        seed: seed of the augmentation (a function of seed, epoch and index,
            as in :mod:`shardfc.data.folder`).

    Attributes:
        labels: int64 array, the class of each index, read from the record
            headers at construction without decoding images (for samplers).
        keys: int64 array, the record key of each index.
        num_classes: from ``property`` when present, else ``max(labels) + 1``.
        layout: ``"insightface"`` or ``"im2rec"``.
        identity_range: keys ``[a, b)`` of the identity records, or ``None``.
        property: ``(num_classes, H, W)`` from the ``property`` file, or ``None``.

    Raises:
        FileNotFoundError: the path, the ``.rec`` or the ``.idx`` is missing.
        ValueError: structural corruption, a label that is not a class id, a
            ``property`` with fewer classes than the labels need, or no images.
    """

    def __init__(
        self,
        root_or_rec_path: PathLike,
        image_size: Tuple[int, int] = (112, 112),
        train: bool = True,
        flip_prob: float = 0.5,
        seed: int = 0,
    ) -> None:
        self.rec_path, self.idx_path, self.property_path = resolve_recordio_paths(root_or_rec_path)
        self.reader = RecordIOReader(self.rec_path, self.idx_path)
        found = detect_layout(self.reader)
        self.layout = found.kind
        self.identity_range = found.identity_range
        self.keys = found.image_keys
        if self.keys.size == 0:
            raise ValueError(f"RecordIO dataset {self.rec_path!r} contains no images")
        self.labels = self._scan_labels(self.keys)
        self.property = read_property(self.property_path)
        needed = check_class_count(int(self.labels.max()) + 1, len(self.reader), f"RecordIO file {self.rec_path}")
        if self.property is not None:
            check_class_count(self.property[0], len(self.reader), f"RecordIO property file {self.property_path}")
        if self.property is not None:
            self.num_classes = self.property[0]
            if self.num_classes < needed:
                raise ValueError(
                    f"{self.property_path}: num_classes={self.num_classes}, but {self.rec_path!r} has label {needed - 1}"
                )
        else:
            self.num_classes = needed
        super().__init__(image_size, train, flip_prob, seed)

    def _scan_labels(self, keys: np.ndarray) -> np.ndarray:
        labels = np.empty(keys.size, dtype=np.int64)
        # Visit records in file order: sequential reads, kind to disks and page cache.
        offsets = self.reader.offsets[self.reader.positions(keys)]
        for i in np.argsort(offsets, kind="stable").tolist():
            key = int(keys[i])
            header = self.reader._read_header_at(int(offsets[i]), key)
            labels[i] = class_id(self.reader, key, first_label(header))
        return labels

    def __len__(self) -> int:
        return int(self.keys.size)

    def sample_name(self, index: int) -> str:
        """``"<rec path>#key <key>"`` of the record behind ``index``."""
        return self.reader.name(int(self.keys[index]))

    def label_of(self, index: int) -> int:
        """The class of ``index`` (read from its header at construction)."""
        return int(self.labels[index])

    def read_image_bytes(self, index: int) -> bytes:
        """The encoded image of ``index`` (no decoding)."""
        key = int(self.keys[index])
        return unpack_header(self.reader.read(key), self.reader.name(key))[1]

    def _load(self, index: int, generator: Optional[torch.Generator]) -> Tuple[torch.Tensor, int]:
        img = decode_image(self.read_image_bytes(index), name=self.sample_name(index))
        return self.transform(img, generator), int(self.labels[index])

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}({self.rec_path!r}, layout={self.layout}, images={len(self)}, "
            f"num_classes={self.num_classes})"
        )
