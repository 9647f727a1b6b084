"""``shardfc data``'s actions at their edges (:mod:`shardfc.data.recordio_ops`): the insightface
layout ``write_insightface`` writes, record by record; what ``verify`` reports, word for word; the
encodings ``pack`` writes; the progress bar on a terminal. ``test_recordio.py`` holds the commands
end to end."""

from __future__ import annotations

import io
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from shardfc.data import recordio_ops
from shardfc.data.recordio import IRHeader, RecordIOReader, RecordIOWriter, pack_header, unpack_header
from shardfc.data.recordio_ops import CommandError, check_outputs, verify, write_insightface


def _png(value: int = 0) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", (3, 2), (value,) * 3).save(buf, format="PNG")
    return buf.getvalue()


# ------------------------------------------------------------------ the insightface layout


def test_the_layout_written_record_by_record(tmp_path: Path):
    rec, idx, prop = (str(tmp_path / n) for n in ("train.rec", "train.idx", "property"))
    images = [(1, b"i1", (2, 3)), (1, b"i2", (2, 3)), (3, b"i3", (4, 5))]  # classes 0, 2 and 4 have none
    assert write_insightface(rec, idx, prop, iter(images), 5) == (3, Counter({(2, 3): 2, (4, 5): 1}), (2, 3))
    reader = RecordIOReader(rec)
    headers = {k: unpack_header(reader.read(k)) for k in reader.keys.tolist()}
    assert sorted(headers) == list(range(9))  # images 1..3, header 0, identities 4..8
    for key, (label, data, _) in zip((1, 2, 3), images):
        header, image = headers[key]
        assert (header.flag, header.label, header.id, header.id2, image) == (0, float(label), key, 0, data)
    header, image = headers[0]
    assert (header.flag, header.label.tolist(), header.id, header.id2, image) == (2, [4.0, 9.0], 0, 0, b"")
    ranges = [headers[k][0].label.tolist() for k in range(4, 9)]
    assert ranges == [[1.0, 1.0], [1.0, 3.0], [3.0, 3.0], [3.0, 4.0], [4.0, 4.0]]  # an empty class: [next, next)
    assert all(headers[k][0].id == headers[k][0].id2 == 0 for k in range(4, 9))
    assert Path(prop).read_text() == "5,2,3\n"


def test_no_image_to_write_is_a_value_error(tmp_path: Path):
    with pytest.raises(ValueError) as info:
        write_insightface(str(tmp_path / "r"), str(tmp_path / "i"), str(tmp_path / "p"), iter(()), 3)
    assert str(info.value) == "no images to write"


def test_an_image_is_reencoded_as_asked():
    rgba = Image.new("RGBA", (16, 16), (10, 200, 30, 128))
    jpeg = recordio_ops._encode(rgba, "jpeg", 95)  # JPEG has no alpha: converted first
    assert Image.open(io.BytesIO(jpeg)).format == "JPEG"
    noisy = Image.fromarray(np.random.default_rng(0).integers(0, 256, (32, 32, 3), np.uint8))
    assert len(recordio_ops._encode(noisy, "jpeg", 10)) < len(recordio_ops._encode(noisy, "jpeg", 95))
    png = recordio_ops._encode(rgba, "png", 95)
    assert Image.open(io.BytesIO(png)).format == "PNG" and Image.open(io.BytesIO(png)).mode == "RGBA"


def test_an_existing_output_is_named(tmp_path: Path):
    (tmp_path / "b").write_text("")
    with pytest.raises(CommandError) as info:
        check_outputs([str(tmp_path / "a"), str(tmp_path / "b")], force=False)
    assert str(info.value) == f"{str(tmp_path / 'b')!r} exists (use --force to replace it)"
    check_outputs([str(tmp_path / "a"), str(tmp_path / "b")], force=True)


def test_a_bar_on_a_terminal_only_and_when_tqdm_is_there(monkeypatch):
    import sys
    import types

    class Tty(io.StringIO):
        def isatty(self):
            return True

    made = []
    stand_in = types.ModuleType("tqdm")
    stand_in.tqdm = lambda iterable, **kw: made.append(kw) or iterable  # what tqdm is asked for
    monkeypatch.setitem(sys.modules, "tqdm", stand_in)
    assert recordio_ops._progress([1, 2], 2, "pack") == [1, 2] and made == []  # not a terminal: no bar
    monkeypatch.setattr(recordio_ops.sys, "stderr", Tty())
    assert recordio_ops._progress([1, 2], 2, "verify") == [1, 2]
    assert made == [dict(total=2, desc="verify", unit="img", file=recordio_ops.sys.stderr, dynamic_ncols=True,
                         leave=False)]
    monkeypatch.setitem(sys.modules, "tqdm", None)  # not installed: the iterable itself
    assert recordio_ops._progress([3], 1, "verify") == [3] and len(made) == 1


# ------------------------------------------------------------------ verify


def _im2rec(root: Path, payloads, prop=None) -> Path:
    root.mkdir()
    with RecordIOWriter(root / "train.rec") as w:
        for key, payload in enumerate(payloads):
            w.write(key, payload)
    if prop is not None:
        (root / "property").write_text(prop)
    return root


def test_verify_names_each_bad_image_record(tmp_path: Path, monkeypatch):
    calls = []
    monkeypatch.setattr(recordio_ops, "_progress", lambda it, total, desc: calls.append((total, desc)) or it)
    root = _im2rec(tmp_path / "r", [pack_header(IRHeader(0, 0.0, 0, 0), _png()), b"short",
                                     pack_header(IRHeader(0, -1.0, 0, 0), _png()),
                                     pack_header(IRHeader(0, 0.0, 0, 0), b"junk")])
    rec = root / "train.rec"
    got = verify(str(root))
    assert calls == [(4, "verify")]
    assert got["rec"] == str(rec) and got["layout"] == "im2rec" and got["images"] == 4
    assert [b["key"] for b in got["bad"]] == [1, 2, 3]
    assert got["bad"][0]["reason"] == f"{rec}#key 1: payload of 5 bytes is shorter than the 24-byte IRHeader"
    assert got["bad"][1]["reason"] == f"{rec}#key 2: label -1.0 is not a class id (a non-negative integer)"
    assert got["bad"][2]["reason"].startswith("undecodable image: UnidentifiedImageError: ")


@pytest.mark.parametrize("prop, bad", [("3,2,3", False), ("2,2,3", True), ("1,2,3", True)])
def test_verify_checks_the_property_against_the_largest_label(tmp_path: Path, prop, bad):
    root = _im2rec(tmp_path / "r", [pack_header(IRHeader(0, float(c), 0, 0), _png(c)) for c in (0, 2, 1)], prop)
    got = verify(str(root))
    expected = [{"key": None, "reason": f"{root / 'property'}: num_classes={prop[0]} but label 2 occurs"}]
    assert got["bad"] == (expected if bad else [])


def test_verify_of_labels_0_with_one_class_is_clean(tmp_path: Path):
    root = _im2rec(tmp_path / "r", [pack_header(IRHeader(0, 0.0, 0, 0), _png())], "1,2,3")
    assert verify(str(root)) == {"rec": str(root / "train.rec"), "layout": "im2rec", "images": 1, "bad": []}


def test_verify_of_a_damaged_structure_says_so_alone(tmp_path: Path):
    root = _im2rec(tmp_path / "r", [pack_header(IRHeader(0, 0.0, 0, 0), _png())])
    (root / "train.idx").write_text("0\tzero\n")
    got = verify(str(root))
    assert got == {"rec": str(root / "train.rec"), "layout": None, "images": 0,
                   "bad": [{"key": None, "reason": f"{root / 'train.idx'}:1: expected '<key>\\t<offset>' (two int64s), "
                                                   "got '0\\tzero'"}]}


def _insightface(root: Path, identities) -> Path:
    """Images at keys 1, 2 (class 0), the header at 0 announcing identity records 3..3+n."""
    root.mkdir()
    with RecordIOWriter(root / "train.rec") as w:
        for key in (1, 2):
            w.write(key, pack_header(IRHeader(0, 0.0, key, 0), _png()))
        w.write(0, pack_header(IRHeader(0, [3, 3 + len(identities)], 0, 0)))
        for i, payload in enumerate(identities):
            if payload is not None:
                w.write(3 + i, payload)
    return root


@pytest.mark.parametrize("payload, why", [
    (pack_header(IRHeader(0, [1, 3], 0, 0)), None),  # the images' range: sound
    (pack_header(IRHeader(0, [3, 3], 0, 0)), None),  # an empty class at the end
    (pack_header(IRHeader(0, [1, 1], 0, 0)), None),  # an empty class at the start
    (pack_header(IRHeader(0, [1, 3], 0, 0), b"img"), "flag=2, label=[1. 3.], 3 image bytes"),
    (pack_header(IRHeader(0, [2], 0, 0)), "flag=1, label=[2.], 0 image bytes"),
    (pack_header(IRHeader(0, 1.0, 0, 0)), "flag=0, label=1.0, 0 image bytes"),
    (pack_header(IRHeader(0, [0, 2], 0, 0)), "flag=2, label=[0. 2.], 0 image bytes"),
    (pack_header(IRHeader(0, [2, 1], 0, 0)), "flag=2, label=[2. 1.], 0 image bytes"),
    (pack_header(IRHeader(0, [1, 4], 0, 0)), "flag=2, label=[1. 4.], 0 image bytes"),
])
def test_verify_checks_each_identity_record(tmp_path: Path, payload, why):
    got = verify(str(_insightface(tmp_path / "r", [payload])))
    assert got["layout"] == "insightface" and got["images"] == 2
    expected = [] if why is None else [
        {"key": 3, "reason": f"identity record does not hold an image-key range within [1, 3): {why}"}]
    assert got["bad"] == expected


def test_verify_names_an_identity_record_that_is_missing_or_short(tmp_path: Path):
    root = _insightface(tmp_path / "r", [b"tiny", None])
    rec = root / "train.rec"
    got = verify(str(root))
    assert got["bad"] == [
        {"key": 3, "reason": f"{rec}#key 3: payload of 4 bytes is shorter than the 24-byte IRHeader"},
        {"key": 4, "reason": f"{rec}: key 4 is not in {root / 'train.idx'}"},  # a KeyError's quotes taken off
    ]
