import io
import json
import logging
import os
import pickle
import struct
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image
from torch.utils.data import DataLoader, Dataset

from shardfc import cli as top_cli
from shardfc.cli import data as data_cli
from shardfc.data import ImageFolderDataset, image_to_tensor
from shardfc.data.recordio import (
    RECORDIO_MAGIC,
    IRHeader,
    RecordIODataset,
    RecordIOReader,
    RecordIOWriter,
    detect_layout,
    encode_record,
    pack_header,
    scan_records,
    unpack_header,
)

MAGIC = struct.pack("<I", RECORDIO_MAGIC)


def _png(seed: int, size=(8, 8)) -> bytes:
    arr = np.random.default_rng(seed).integers(0, 256, size=(size[0], size[1], 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(arr).save(buf, format="PNG")
    return buf.getvalue()


def _tensor(data: bytes, size=(8, 8)) -> torch.Tensor:
    return image_to_tensor(Image.open(io.BytesIO(data)), size)


@pytest.fixture
def folder(tmp_path) -> Path:
    """3 identities with 3/1/2 PNGs and an empty identity folder ("d") -> 4 classes."""
    root = tmp_path / "faces"
    seed = 0
    for name, n in (("a", 3), ("b", 1), ("c", 2), ("d", 0)):
        (root / name).mkdir(parents=True)
        for i in range(n):
            (root / name / f"{i}.png").write_bytes(_png(seed))
            seed += 1
    return root


@pytest.fixture
def packed(folder, tmp_path) -> Path:
    out = tmp_path / "rec"
    assert data_cli.main(["pack", str(folder), str(out)]) == 0
    return out


def _write_im2rec(rec: Path, payloads) -> None:
    with RecordIOWriter(rec) as w:
        for key, payload in enumerate(payloads):
            w.write(key, payload)


# ------------------------------------------------------------------ format
def test_framing_matches_dmlc_recordio():
    # whole record: magic, lrec = length, data, zero padding to 4 bytes
    assert encode_record(b"xyz") == MAGIC + struct.pack("<I", 3) + b"xyz\0"
    # the magic at aligned offset 4 splits the record: first part (cflag 1) + last part (cflag 3)
    split = encode_record(b"abcd" + MAGIC + b"xy")
    assert split == MAGIC + struct.pack("<I", 1 << 29 | 4) + b"abcd" + MAGIC + struct.pack("<I", 3 << 29 | 2) + b"xy\0\0"
    # an unaligned magic is left alone
    assert encode_record(b"ab" + MAGIC + b"cd") == MAGIC + struct.pack("<I", 8) + b"ab" + MAGIC + b"cd"


@pytest.mark.parametrize(
    "payload",
    [MAGIC, MAGIC * 3 + b"x", b"abcd" + MAGIC, b"abcd" + MAGIC + b"efgh" + MAGIC + b"ij", b"a" + MAGIC + b"bcd" + MAGIC, b""],
)
def test_magic_in_payload_round_trips(tmp_path, payload):
    rec = tmp_path / "m.rec"
    with RecordIOWriter(rec) as w:
        w.write(7, payload)
        w.write(3, b"after")
    r = RecordIOReader(rec)
    assert r.read(7) == payload and r.read(3) == b"after"
    assert [p for _, p in scan_records(rec)] == [payload, b"after"]
    assert list(r) == [(7, payload), (3, b"after")]


def test_header_pack_unpack_like_mxnet():
    raw = pack_header(IRHeader(0, 5, 11, 12), b"img")
    assert raw == struct.pack("<IfQQ", 0, 5.0, 11, 12) + b"img"
    h, img = unpack_header(raw)
    assert (h.flag, h.label, h.id, h.id2, img) == (0, 5.0, 11, 12, b"img")
    raw = pack_header(IRHeader(0, [3, 9], 0, 0))  # insightface's header / identity records
    assert raw == struct.pack("<IfQQ", 2, 0.0, 0, 0) + np.array([3, 9], "<f4").tobytes()
    h, img = unpack_header(raw)
    assert h.flag == 2 and h.label.tolist() == [3.0, 9.0] and img == b""
    with pytest.raises(ValueError, match="shorter"):
        unpack_header(b"short", "x.rec#key 4")


# -------------------------------------------------------------- round trip
def test_pack_folder_round_trip(folder, packed):
    ref = ImageFolderDataset(folder, image_size=(8, 8), train=False)
    for target in (packed, packed / "train.rec"):
        ds = RecordIODataset(target, image_size=(8, 8), train=False)
        assert ds.layout == "insightface"
        assert ds.num_classes == 4 and ds.property == (4, 8, 8)
        assert len(ds) == len(ref) == 6
        assert ds.labels.tolist() == [label for _, label in ref.samples] == [0, 0, 0, 1, 2, 2]
        for i in range(len(ds)):
            x, y = ds[i]
            assert y == ref.samples[i][1]
            assert torch.equal(x, ref[i][0])
        assert ds.corrupt_count == 0
    assert (packed / "classes.txt").read_text().split() == ["a", "b", "c", "d"]


def test_identity_records_describe_classes_and_are_never_images(packed):
    ds = RecordIODataset(packed, image_size=(8, 8), train=False)
    a, b = ds.identity_range
    assert (a, b) == (7, 11)  # images at keys 1..6, one identity record per class
    assert ds.keys.tolist() == [1, 2, 3, 4, 5, 6]
    ranges = [unpack_header(ds.reader.read(k))[0].label.tolist() for k in range(a, b)]
    assert ranges == [[1, 4], [4, 5], [5, 7], [7, 7]]  # the empty class gets an empty range
    for start, stop in ranges:
        for key in range(int(start), int(stop)):
            assert ds.labels[ds.keys.tolist().index(key)] == ranges.index([start, stop])
    assert len(ds.reader) == 1 + 6 + 4


def test_im2rec_file_without_header(tmp_path):
    rec = tmp_path / "plain.rec"
    images = [_png(s) for s in range(4)]
    labels = [2, 0, 5, 2]
    _write_im2rec(rec, [pack_header(IRHeader(0, y, k, 0), im) for k, (y, im) in enumerate(zip(labels, images))])
    ds = RecordIODataset(rec, image_size=(8, 8), train=False)
    assert ds.layout == "im2rec" and ds.identity_range is None and ds.property is None
    assert ds.keys.tolist() == [0, 1, 2, 3]  # key 0 is an ordinary image here
    assert ds.labels.tolist() == labels and ds.num_classes == 6  # max label + 1 without property
    for i, im in enumerate(images):
        x, y = ds[i]
        assert y == labels[i] and torch.equal(x, _tensor(im))


def test_multi_label_records_use_the_first_label(tmp_path):
    # flag > 0 on every record, key 0 included: an image, not an insightface header
    rec = tmp_path / "multi.rec"
    images = [_png(s) for s in range(3)]
    many = [3.0] + [0.25] * 40  # more labels than the reader's first small read holds
    _write_im2rec(rec, [pack_header(IRHeader(0, y, 0, 0), im) for y, im in zip([[1, 99.0, 0.5], many, [0, 1]], images)])
    ds = RecordIODataset(rec, image_size=(8, 8), train=False)
    assert ds.layout == "im2rec" and ds.labels.tolist() == [1, 3, 0]
    assert torch.equal(ds[0][0], _tensor(images[0])) and torch.equal(ds[1][0], _tensor(images[1]))


def test_magic_inside_header_and_image(tmp_path):
    # id = magic puts it at the aligned offset 8 of the payload: the record splits inside the IRHeader
    rec = tmp_path / "s.rec"
    im = _png(1)
    payloads = [pack_header(IRHeader(0, 4, RECORDIO_MAGIC, 0), im), pack_header(IRHeader(0, 1, 0, 0), im + MAGIC * 2)]
    _write_im2rec(rec, payloads)
    assert sum(1 for _ in scan_records(rec)) == 2
    assert rec.read_bytes().count(MAGIC) > 2  # really split into parts
    ds = RecordIODataset(rec, image_size=(8, 8), train=False)
    assert ds.labels.tolist() == [4, 1]
    assert ds.reader.read(0) == payloads[0] and ds.reader.read(1) == payloads[1]
    assert torch.equal(ds[0][0], _tensor(im))


def test_pack_list_file_with_resize(tmp_path):
    imgs = tmp_path / "imgs"
    imgs.mkdir()
    data = [_png(s, size=(10, 12)) for s in range(3)]
    for i, d in enumerate(data):
        (imgs / f"{i}.png").write_bytes(d)
    (imgs / "list.txt").write_text("2.png 3\n0.png 0\n1.png 3\n")
    out = tmp_path / "out"
    rc = data_cli.main(["pack", str(imgs / "list.txt"), str(out), "--list-file", "--resize", "4x6", "--encode", "png"])
    assert rc == 0
    ds = RecordIODataset(out, image_size=(4, 6), train=False)
    assert ds.property == (4, 4, 6) and ds.labels.tolist() == [0, 3, 3]  # sorted by label, stable
    expected = Image.open(io.BytesIO(data[0])).resize((6, 4), Image.BILINEAR)
    assert torch.equal(ds[0][0], image_to_tensor(expected))
    assert Image.open(io.BytesIO(ds.read_image_bytes(1))).size == (6, 4)


# --------------------------------------------------------------- corruption
def test_undecodable_image_skipped_and_counted(tmp_path, caplog):
    rec = tmp_path / "train.rec"
    good = [_png(0), _png(1)]
    _write_im2rec(rec, [pack_header(IRHeader(0, 0, 0, 0), good[0]), pack_header(IRHeader(0, 1, 0, 0), b"not an image"),
                        pack_header(IRHeader(0, 2, 0, 0), good[1])])
    ds = RecordIODataset(tmp_path, image_size=(8, 8), train=False)
    with caplog.at_level(logging.WARNING, logger="shardfc.data"):
        x, y = ds[1]
        assert y == 2 and torch.equal(x, _tensor(good[1]))
        assert ds[1][1] == 2
    assert ds.corrupt_count == 2
    assert ds.corrupt_paths == {f"{rec}#key 1"}
    assert len([r for r in caplog.records if "train.rec#key 1" in r.getMessage()]) == 1


def _offset(rec: Path, key: int) -> int:
    for line in rec.with_suffix(".idx").read_text().splitlines():
        k, off = line.split("\t")
        if int(k) == key:
            return int(off)
    raise KeyError(key)


def test_wrong_magic_names_file_and_key(packed):
    rec = packed / "train.rec"
    raw = bytearray(rec.read_bytes())
    raw[_offset(rec, 3)] ^= 0xFF
    rec.write_bytes(bytes(raw))
    with pytest.raises(ValueError, match=r"train\.rec: key 3: bad magic"):
        RecordIODataset(packed)


def test_truncated_file_names_file_and_key(tmp_path):
    rec = tmp_path / "t.rec"
    _write_im2rec(rec, [pack_header(IRHeader(0, i, 0, 0), _png(i)) for i in range(3)])
    rec.write_bytes(rec.read_bytes()[:-20])  # cut into the last record (key 2)
    with pytest.raises(ValueError, match=r"t\.rec: key 2: truncated"):
        RecordIODataset(rec)
    reader = RecordIOReader(rec)
    with pytest.raises(ValueError, match=r"t\.rec: key 2: truncated"):
        reader.read(2)


def test_idx_offset_past_end_names_file_and_key(packed):
    idx = packed / "train.idx"
    lines = idx.read_text().splitlines()
    lines = [f"2\t{10**9}" if line.startswith("2\t") else line for line in lines]
    idx.write_text("\n".join(lines) + "\n")
    with pytest.raises(ValueError, match=r"train\.idx: key 2 has offset 1000000000, past the end of .*train\.rec"):
        RecordIODataset(packed)


def test_missing_index_and_paths(packed, tmp_path):
    (packed / "train.idx").unlink()
    with pytest.raises(FileNotFoundError, match=r"train\.idx"):
        RecordIODataset(packed)
    with pytest.raises(FileNotFoundError, match="nowhere"):
        RecordIODataset(tmp_path / "nowhere")
    with pytest.raises(FileNotFoundError, match="no train.rec"):
        RecordIODataset(tmp_path)


def test_malformed_idx_line(tmp_path):
    rec = tmp_path / "x.rec"
    _write_im2rec(rec, [b"12345678901234567890123456"])
    rec.with_suffix(".idx").write_text("0\t0\nbogus\n")
    with pytest.raises(ValueError, match=r"x\.idx:2: expected"):
        RecordIOReader(rec)


def test_property_with_too_few_classes(packed):
    (packed / "property").write_text("2,8,8\n")
    with pytest.raises(ValueError, match="num_classes=2"):
        RecordIODataset(packed)


# ------------------------------------------------------------- processes
class _WithPid(Dataset):
    def __init__(self, inner):
        self.inner = inner

    def __len__(self):
        return len(self.inner)

    def __getitem__(self, i):
        x, y = self.inner[i]
        return x, y, os.getpid(), self.inner.reader._pid


def test_dataloader_workers_open_their_own_handle(packed):
    ds = RecordIODataset(packed, image_size=(8, 8), train=False)
    ds[0]  # the parent holds an open handle before the workers fork
    loader = DataLoader(_WithPid(ds), batch_size=2, num_workers=2)
    xs, ys, pids, handle_pids = zip(*loader)
    assert torch.cat(ys).tolist() == ds.labels.tolist()
    assert torch.equal(torch.cat(xs), torch.stack([ds[i][0] for i in range(len(ds))]))
    pids, handle_pids = torch.cat(pids), torch.cat(handle_pids)
    assert torch.equal(pids, handle_pids) and os.getpid() not in pids.tolist()
    assert len(set(pids.tolist())) == 2
    clone = pickle.loads(pickle.dumps(ds))  # spawn-style workers get a dataset without a handle
    assert clone.reader._fh is None and torch.equal(clone[1][0], ds[1][0])


# ------------------------------------------------------------------- CLI
def test_shuffle_drops_header_and_keeps_images(packed, tmp_path):
    out = tmp_path / "shuffled"
    assert top_cli.main(["data", "shuffle", str(packed), str(out), "--seed", "3"]) == 0
    src = RecordIODataset(packed, train=False)
    dst = RecordIODataset(out, train=False)
    assert dst.layout == "im2rec" and len(dst.reader) == len(dst) == len(src) == 6
    assert dst.num_classes == 4  # property copied
    pairs = lambda ds: Counter((int(ds.labels[i]), ds.read_image_bytes(i)) for i in range(len(ds)))  # noqa: E731
    assert pairs(dst) == pairs(src)
    assert dst.labels.tolist() != src.labels.tolist()


def test_inspect_text_and_json(packed, capsys):
    assert data_cli.main(["inspect", str(packed)]) == 0
    text = capsys.readouterr().out
    assert "insightface" in text and "images        6" in text
    assert "min 0, median 1.5, max 3" in text and "8x8" in text
    assert data_cli.main(["inspect", str(packed / "train.rec"), "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["images"] == 6 and info["classes"] == 4 and info["layout"] == "insightface"
    assert info["images_per_class"] == {"min": 0, "median": 1.5, "max": 3}
    assert info["image_sizes_sampled"] == {"8x8": 6} and info["identity_records"] == 4


def test_verify_reports_bad_records(packed, tmp_path, capsys):
    assert data_cli.main(["verify", str(packed)]) == 0
    assert "6 images, 0 bad" in capsys.readouterr().out

    rec = tmp_path / "bad" / "train.rec"
    rec.parent.mkdir()
    _write_im2rec(rec, [pack_header(IRHeader(0, 0, 0, 0), _png(0)), pack_header(IRHeader(0, 1, 0, 0), b"junk"),
                        pack_header(IRHeader(0, 0, 0, 0), _png(1)), pack_header(IRHeader(0, 2, 0, 0), _png(2))])
    raw = bytearray(rec.read_bytes())
    raw[_offset(rec, 3)] ^= 0xFF  # wrong magic on key 3
    rec.write_bytes(bytes(raw))
    assert data_cli.main(["verify", str(rec.parent)]) == 1
    out = capsys.readouterr().out
    assert "key 1: undecodable image" in out and "key 3:" in out and "bad magic" in out
    assert "4 images, 2 bad" in out
    assert data_cli.main(["verify", str(rec), "--json"]) == 1
    assert [b["key"] for b in json.loads(capsys.readouterr().out)["bad"]] == [1, 3]


def test_cli_errors(folder, packed, tmp_path, capsys):
    assert top_cli.main(["data", "pack", str(tmp_path / "missing"), str(tmp_path / "o")]) == 2
    assert "missing" in capsys.readouterr().err
    assert data_cli.main(["pack", str(folder), str(packed)]) == 2  # exists, no --force: a refused input, exit 2 as every command
    assert "--force" in capsys.readouterr().err
    assert data_cli.main(["pack", str(folder), str(packed), "--force"]) == 0
    assert data_cli.main(["pack", str(folder), str(packed), "--resize", "big"]) == 2
    assert "HEIGHTxWIDTH" in capsys.readouterr().err
    assert data_cli.main(["verify", str(tmp_path / "nope")]) == 2
    lst = tmp_path / "l.txt"
    lst.write_text(f"{next(folder.glob('a/*.png'))} 0\n{tmp_path / 'ghost.png'} 1\n")
    failed = tmp_path / "failed"
    assert data_cli.main(["pack", str(lst), str(failed), "--list-file"]) == 2
    assert "ghost.png" in capsys.readouterr().err
    assert list(failed.iterdir()) == []  # no half-written train.rec, no .part files left
    (packed / "train.idx").unlink()
    assert data_cli.main(["inspect", str(packed)]) == 2
    assert "train.idx" in capsys.readouterr().err


def test_detect_layout_of_packed(packed):
    layout = detect_layout(RecordIOReader(packed / "train.rec"))
    assert layout.kind == "insightface" and layout.identity_range == (7, 11)
