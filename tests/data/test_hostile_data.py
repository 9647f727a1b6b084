"""Crafted inputs through every reader that is not a checkpoint's (issue 43): configs, the head-impl
cache, images, image folders, list files, RecordIO, ``.bin`` sets, IJB releases, re-ID folders and
fonts. Each case is a small file crafted here and ends, under an alarm, in the right data, in one
line naming the file (a FileRefused / ConfigError / ValueError; through a command, stderr and exit 2),
or, where skipping is what a user wants (one bad image, one bad font), in a skip with a warning
naming it. The cases whose attack is memory run in a subprocess under an address-space cap
(:func:`_capped`): 500 MB above what the imports took. ``tests/checkpoint/test_hostile_files.py``
holds the checkpoint readers' cases; a reader added to shardfc joins one of the two.
"""

from __future__ import annotations

import io
import logging
import os
import pickle
import struct
import subprocess
import sys
import textwrap
import zlib
from pathlib import Path

import numpy as np
import pytest
from numpy._core.multiarray import _reconstruct  # what a numpy 2 pickle of an array names
from PIL import Image

from pickled_call import PickledCall
from shardfc import files
from shardfc.cli import data as data_cli
from shardfc.cli import train as cli_train
from shardfc.data import ImageFolderDataset, ListFileDataset
from shardfc.data.glyphs import font_files, read_faces
from shardfc.data.market1501 import Market1501TrainDataset
from shardfc.data.recordio import IRHeader, RecordIODataset, RecordIOWriter, pack_header
from shardfc.data.transforms import CorruptImageError, decode_image
from shardfc.evaluation.ijb import read_ijb_meta
from shardfc.evaluation.verification import load_bin
from shardfc.head.impl_select import ImplSelector
from shardfc.train.config import ConfigError, load_toml

SRC = Path(__file__).resolve().parents[2] / "src"


pytestmark = pytest.mark.usefixtures("no_hang")  # tests/conftest.py: an alarm behind every case


def _one_line(error: BaseException, *needles: str) -> str:
    text = str(error)
    assert "\n" not in text and all(n in text for n in needles), text
    return text


def _capped(code: str, megabytes: int = 500) -> str:
    """Run ``code`` in a fresh Python whose address space may grow ``megabytes`` past what its
    imports took (RLIMIT_AS), under 30 s; its stdout. The code prints what it caught."""
    prelude = textwrap.dedent(f"""
        import resource, sys
        import numpy, torch, shardfc.data.recordio, shardfc.evaluation.verification, shardfc.data.folder
        with open("/proc/self/statm") as f:
            used = int(f.read().split()[0]) * resource.getpagesize()
        cap = used + {megabytes} * 2**20
        resource.setrlimit(resource.RLIMIT_AS, (cap, cap))
    """)
    env = {**os.environ, "PYTHONPATH": str(SRC)}
    proc = subprocess.run([sys.executable, "-c", prelude + textwrap.dedent(code)], capture_output=True, text=True,
                          timeout=30, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout


def _png(size=(4, 4), color=(10, 20, 30)) -> bytes:
    out = io.BytesIO()
    Image.new("RGB", size, color).save(out, format="PNG")
    return out.getvalue()


def _png_declaring(width: int, height: int) -> bytes:
    """A small PNG whose header declares ``width`` x ``height`` (its IHDR rewritten, CRC fixed)."""
    data = bytearray(_png())
    struct.pack_into(">II", data, 16, width, height)
    struct.pack_into(">I", data, 29, zlib.crc32(bytes(data[12:29])))
    return bytes(data)


# --------------------------------------------------------------------------- configs and the cache


@pytest.mark.parametrize("kind", ["fifo", "dev_zero", "deep", "latin1", "huge"])
def test_a_hostile_config_is_one_line_and_exit_2(tmp_path: Path, capsys, special_file, kind: str):
    path = tmp_path / "run.toml"
    if special_file(path, kind):
        pass
    elif kind == "deep":
        path.write_text("lr = " + "[" * 10_000 + "]" * 10_000)
    elif kind == "latin1":
        path.write_bytes(b"# caf\xe9\nlr = 0.1\n")
    else:
        path.write_bytes(b"#" * (2 << 20))
    with pytest.raises(ConfigError) as info:
        load_toml(path)
    _one_line(info.value, "run.toml")
    capsys.readouterr()
    assert cli_train.main(["--config", str(path)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "run.toml" in err and "Traceback" not in err


@pytest.mark.parametrize("kind", ["fifo", "dev_zero", "deep", "not_utf8", "huge", "folder"])
def test_a_damaged_head_impl_cache_is_ignored_with_a_warning(tmp_path: Path, caplog, kind: str):
    path = tmp_path / "head_impl.json"
    if kind == "fifo":
        os.mkfifo(path)
    elif kind == "dev_zero":
        os.symlink("/dev/zero", path)
    elif kind == "deep":
        path.write_text("[" * 100_000 + "]" * 100_000)
    elif kind == "not_utf8":
        path.write_bytes(b'{"k": "\xff"}')
    elif kind == "huge":
        path.write_bytes(b" " * (17 << 20))
    else:
        path.mkdir()
    sel = ImplSelector(path)
    with caplog.at_level(logging.WARNING, logger="shardfc.head"):
        assert sel._read() == {}
    warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warned) == 1 and "ignoring the head-impl cache" in warned[0] and "head_impl.json" in warned[0]
    assert "\n" not in warned[0]


# --------------------------------------------------------------------------- images


@pytest.mark.parametrize("width, height, needle", [(100_000, 100_000, "DecompressionBombError"),
                                                    (2100, 2100, "SHARDFC_MAX_IMAGE_PIXELS")])
def test_an_image_declaring_too_many_pixels_is_refused_before_decoding(width, height, needle):
    with pytest.raises(CorruptImageError) as info:
        decode_image(_png_declaring(width, height), name="bomb.png")
    _one_line(info.value, "bomb.png", needle)


def test_the_pixel_cap_is_a_setting(monkeypatch):
    data = io.BytesIO()
    Image.new("L", (2100, 2100)).save(data, format="PNG")
    with pytest.raises(CorruptImageError):
        decode_image(data.getvalue())
    monkeypatch.setenv("SHARDFC_MAX_IMAGE_PIXELS", "5M")
    assert decode_image(data.getvalue()).size == (2100, 2100)


def _face_folder(root: Path) -> Path:
    for who in ("ann", "bob"):
        (root / who).mkdir(parents=True)
        for i in range(2):
            (root / who / f"{i}.png").write_bytes(_png(color=(i, 0, 0)))
    return root


@pytest.mark.parametrize("kind", ["fifo", "dev_zero", "link_out", "bomb"])
def test_one_bad_image_of_a_folder_is_skipped_counted_and_named(tmp_path: Path, caplog, kind: str):
    root = _face_folder(tmp_path / "faces")
    bad = root / "bob" / "0.png"
    bad.unlink()
    if kind == "fifo":
        os.mkfifo(bad)
    elif kind == "dev_zero":
        os.symlink("/dev/zero", bad)
    elif kind == "link_out":
        (tmp_path / "secret.png").write_bytes(_png())
        os.symlink(tmp_path / "secret.png", bad)
    else:
        bad.write_bytes(_png_declaring(100_000, 100_000))
    ds = ImageFolderDataset(root, image_size=(4, 4), train=False)
    with caplog.at_level(logging.WARNING, logger="shardfc.data"):
        images = [ds[i] for i in range(len(ds))]
    assert len(images) == 4 and ds.corrupt_count == 1 and ds.corrupt_paths == {str(bad)}
    warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warned) == 1 and str(bad) in warned[0]


def test_a_class_folder_linked_out_of_the_root_is_refused(tmp_path: Path):
    root = _face_folder(tmp_path / "faces")
    (tmp_path / "elsewhere").mkdir()
    (tmp_path / "elsewhere" / "x.png").write_bytes(_png())
    os.symlink(tmp_path / "elsewhere", root / "cy")
    with pytest.raises(files.FileRefused) as info:
        ImageFolderDataset(root)
    _one_line(info.value, "class folder", "cy", "outside")


def test_a_market1501_image_linked_out_of_its_folder_is_skipped(tmp_path: Path):
    split = tmp_path / "market" / "bounding_box_train"
    split.mkdir(parents=True)
    (split / "0001_c1s1_000001_00.jpg").write_bytes(_png())
    (tmp_path / "secret.png").write_bytes(_png())
    os.symlink(tmp_path / "secret.png", split / "0002_c1s1_000001_00.jpg")
    ds = Market1501TrainDataset(tmp_path / "market", image_size=(4, 4), train=False)
    _ = [ds[i] for i in range(len(ds))]
    assert ds.corrupt_paths == {str(split / "0002_c1s1_000001_00.jpg")}


@pytest.mark.parametrize("content, needle", [
    (b"a.png 1000000000000\n", "declares 1000000000001 classes for 1 images"),
    (b"a.png 0\nb\xff.png 1\n", "line 2"),
    (b"a.png 0\n" + b"x" * (70 << 10) + b" 1\n", "longer than"),
])
def test_a_hostile_list_file_is_one_line(tmp_path: Path, content: bytes, needle: str):
    path = tmp_path / "train.lst"
    path.write_bytes(content)
    with pytest.raises(ValueError) as info:
        ListFileDataset(path)
    _one_line(info.value, "train.lst", needle)


def test_a_list_file_that_is_a_fifo_is_refused(tmp_path: Path):
    os.mkfifo(tmp_path / "train.lst")
    with pytest.raises(files.FileRefused) as info:
        ListFileDataset(tmp_path / "train.lst")
    _one_line(info.value, "train.lst", "FIFO")


# --------------------------------------------------------------------------- RecordIO


def _recordio(root: Path, header_range=None, labels=(0, 1), prop: str | None = None) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    with RecordIOWriter(root / "train.rec", root / "train.idx") as w:
        if header_range is not None:
            w.write(0, pack_header(IRHeader(2, list(header_range), 0, 0)))
        for k, label in enumerate(labels, start=1):
            w.write(k, pack_header(IRHeader(0, float(label), k, 0), _png()))
    if prop is not None:
        (root / "property").write_text(prop)
    return root


@pytest.mark.parametrize("case, needle", [
    ("header", "announces image keys"), ("label", "classes for 2 images"), ("property", "classes for 2 images"),
])
def test_recordio_counts_are_checked_against_the_file_before_allocating(tmp_path: Path, case: str, needle: str):
    """A header, a label or a property announcing 10^12 keys or classes: one line, within 500 MB."""
    kw = {"header": dict(header_range=(10**12, 10**12 + 5)), "label": dict(labels=(0, 1e12)),
          "property": dict(prop="1000000000000,112,112")}[case]
    root = _recordio(tmp_path / "rec", **kw)
    out = _capped(f"""
        from shardfc.data.recordio import RecordIODataset
        try:
            RecordIODataset({str(root)!r})
        except ValueError as e:
            print(type(e).__name__, e)
    """)
    assert needle in out and "\n" not in out.strip(), out


def test_a_record_declaring_more_bytes_than_the_file_holds_is_refused_unread(tmp_path: Path):
    """A part header declaring 512 MiB in a file of a few hundred bytes: one line, within 500 MB."""
    root = _recordio(tmp_path / "rec")
    data = bytearray((root / "train.rec").read_bytes())
    struct.pack_into("<I", data, 4, (1 << 29) - 1)  # the first record's length field, flag 0
    (root / "train.rec").write_bytes(bytes(data))
    out = _capped(f"""
        from shardfc.data.recordio import RecordIOReader, scan_records
        for read in (lambda: RecordIOReader({str(root / "train.rec")!r}).read(1),
                     lambda: list(scan_records({str(root / "train.rec")!r}))):
            try:
                read()
            except ValueError as e:
                print(type(e).__name__, e)
    """, megabytes=300)
    assert out.count("truncated record") == 2 and "536870911 bytes" in out, out


@pytest.mark.parametrize("which", ["train.rec", "train.idx", "property"])
def test_recordio_files_that_are_fifos_are_one_line(tmp_path: Path, capsys, which: str):
    root = _recordio(tmp_path / "rec", prop="2,4,4")
    (root / which).unlink()
    os.mkfifo(root / which)
    with pytest.raises(ValueError) as info:
        RecordIODataset(root)
    _one_line(info.value, which, "FIFO")
    capsys.readouterr()
    assert data_cli.main(["inspect", str(root)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and which in err


def test_an_idx_larger_than_its_rec_allows_is_refused_unread(tmp_path: Path):
    root = _recordio(tmp_path / "rec")
    with open(root / "train.idx", "a") as f:
        f.write("\n" * (1 << 20))
    with pytest.raises(files.FileRefused) as info:
        RecordIODataset(root)
    _one_line(info.value, "train.idx", "belongs to another file")


# --------------------------------------------------------------------------- .bin sets


@pytest.mark.parametrize("payload", [
    PickledCall(bytearray, 10**12), PickledCall(bytearray, 1 << 31),
    PickledCall(np.ndarray, (1 << 31,), np.dtype("u1")),
    PickledCall(_reconstruct, np.ndarray, (1 << 31,), b"b"),
], ids=["bytearray-1e12", "bytearray-2GiB", "ndarray-2GiB", "reconstruct-2GiB"])
def test_a_bin_constructor_is_bounded_by_the_file_length(tmp_path: Path, payload):
    path = tmp_path / "crafted.bin"
    path.write_bytes(pickle.dumps(([payload, payload], [True]), protocol=2))
    _refused_within_the_cap(path)


@pytest.mark.parametrize("opcode", [b"\x8e", b"\x8d", b"B"], ids=["BINBYTES8", "BINUNICODE8", "BINBYTES"])
def test_a_bin_opcode_declaring_more_bytes_than_the_file_holds_is_refused(tmp_path: Path, opcode: bytes):
    """The C unpickler allocates what a counted opcode declares before it reads: 8 GiB (or 2 GiB)
    declared in a file of a few bytes is refused first, within 500 MB of address space."""
    path = tmp_path / "crafted.bin"
    width = "<i" if opcode == b"B" else "<Q"
    path.write_bytes(b"\x80\x04" + opcode + struct.pack(width, (1 << 31) - 1 if opcode == b"B" else 1 << 33) + b"abc")
    _refused_within_the_cap(path)


def _refused_within_the_cap(path: Path) -> None:
    """``load_bin(path)`` in a process capped by :func:`_capped`: one line naming the file and that
    it declares more than the file holds."""
    out = _capped(f"""
        from shardfc.evaluation.verification import load_bin
        try:
            load_bin({str(path)!r})
        except ValueError as e:
            print(type(e).__name__, e)
    """)
    assert path.name in out and "more than the file holds" in out and "\n" not in out.strip(), out


def test_a_bin_that_is_a_fifo_or_a_device_is_one_line(tmp_path: Path):
    os.mkfifo(tmp_path / "lfw.bin")
    os.symlink("/dev/zero", tmp_path / "zero.bin")
    for name in ("lfw.bin", "zero.bin"):
        with pytest.raises(ValueError) as info:
            load_bin(tmp_path / name)
        _one_line(info.value, name, "not a regular file")


# --------------------------------------------------------------------------- IJB


def _ijb(root: Path, name: str) -> Path:
    meta = root / "meta"
    meta.mkdir(parents=True)
    (meta / "ijbc_face_tid_mid.txt").write_text(f"{name} 1 1\n")
    (meta / "ijbc_name_5pts_score.txt").write_text(f"{name} " + " ".join(["1"] * 10) + " 0.9\n")
    (meta / "ijbc_template_pair_label.txt").write_text("1 1 1\n")
    return root


@pytest.mark.parametrize("name", ["/etc/passwd", "../../etc/passwd", "a/../../x.jpg"])
def test_an_ijb_face_named_outside_loose_crop_is_refused(tmp_path: Path, name: str):
    root = _ijb(tmp_path / "IJBC", name)
    with pytest.raises(ValueError) as info:
        read_ijb_meta(root)
    _one_line(info.value, "ijbc_face_tid_mid.txt:1", "inside loose_crop")


def test_an_ijb_meta_file_that_is_a_fifo_is_one_line(tmp_path: Path):
    root = _ijb(tmp_path / "IJBC", "1.jpg")
    (root / "meta" / "ijbc_template_pair_label.txt").unlink()
    os.mkfifo(root / "meta" / "ijbc_template_pair_label.txt")
    with pytest.raises(ValueError) as info:
        read_ijb_meta(root)
    _one_line(info.value, "ijbc_template_pair_label.txt", "FIFO")


# --------------------------------------------------------------------------- fonts


def _ttc(faces: int, size: int = 64) -> bytes:
    """A collection header claiming ``faces`` faces, in a file of ``size`` bytes."""
    return (b"ttcf" + struct.pack(">HHL", 1, 0, faces) + b"\0" * size)[:max(size, 12)]


@pytest.mark.parametrize("data, needle", [
    (b"wOFF" + b"\0" * 60, "WOFF is not read"),
    (b"wOF2" + b"\0" * 60, "WOFF is not read"),
    (_ttc(10**6, 1 << 16), "claims 1000000 faces"),
    (_ttc(200, 64), "claims 200 faces"),
    (b"\0\1\0\0" + struct.pack(">H", 1) + b"\0" * 6 + b"cmap" + struct.pack(">LLL", 0, 12, 1 << 30), "past the end"),
], ids=["woff", "woff2", "a-million-faces", "faces-past-the-end", "table-past-the-end"])
def test_a_hostile_font_is_skipped_with_a_warning_naming_it(tmp_path: Path, data: bytes, needle: str):
    fonts = tmp_path / "fonts"
    fonts.mkdir()
    (fonts / "evil.ttc").write_bytes(data)
    warned: list = []
    assert read_faces(font_files([str(fonts)]), warn=warned.append) == []
    assert len(warned) == 1 and "evil.ttc" in warned[0] and needle in warned[0], warned


def test_a_font_linked_out_of_the_fonts_folder_is_skipped_with_a_warning(tmp_path: Path):
    fonts = tmp_path / "fonts"
    fonts.mkdir()
    (tmp_path / "outside.ttf").write_bytes(b"\0\1\0\0" + b"\0" * 60)
    os.symlink(tmp_path / "outside.ttf", fonts / "link.ttf")
    warned: list = []
    assert font_files([str(fonts)], warn=warned.append) == []
    assert len(warned) == 1 and "link.ttf" in warned[0] and "outside" in warned[0]
