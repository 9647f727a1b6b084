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
    with pytest.raises(recordio_ops.NoImages) as info:
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
    monkeypatch.setattr(recordio_ops, "progress", lambda it, total, desc: calls.append((total, desc)) or it)
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


# ------------------------------------------------------------------ pack


def _noise_png(h: int, w: int, seed: int = 0) -> bytes:
    buf = io.BytesIO()
    Image.fromarray(np.random.default_rng(seed).integers(0, 256, (h, w, 3), np.uint8)).save(buf, format="PNG")
    return buf.getvalue()


def _faces(tmp_path: Path, **classes) -> Path:
    """``tmp_path/faces/<class>/<i>.png`` holding each class's bytes, in order."""
    src = tmp_path / "faces"
    for name, images in classes.items():
        (src / name).mkdir(parents=True)
        for i, data in enumerate(images):
            (src / name / f"{i}.png").write_bytes(data)
    return src


def _record_progress(monkeypatch) -> list:
    calls = []
    monkeypatch.setattr(recordio_ops, "progress", lambda it, total, desc: calls.append((total, desc)) or it)
    return calls


def _stored(out: Path) -> list:
    """``(label, stored bytes)`` of each image record of a packed ``out``, in key order."""
    reader = RecordIOReader(out / "train.rec")
    header0 = unpack_header(reader.read(0))[0]
    first_identity = int(header0.label[0])
    return [(float(h.label), image) for h, image in (unpack_header(reader.read(k)) for k in range(1, first_identity))]


def test_pack_of_a_folder_keeps_the_bytes_and_says_what_it_did(tmp_path: Path, monkeypatch, capsys):
    calls = _record_progress(monkeypatch)
    src = tmp_path / "faces"
    for name in ("a", "b", "c"):
        (src / name).mkdir(parents=True)
    wide, big, small = _noise_png(2, 3, 1), _noise_png(300, 300, 2), _noise_png(2, 3, 3)
    (src / "a" / "0.png").write_bytes(wide)
    (src / "a" / "1.png").write_bytes(b"junk")  # undecodable: skipped, the next one still packed
    (src / "a" / "2.png").write_bytes(small)
    (src / "c" / "0.png").write_bytes(big)  # class b has no image
    log = io.StringIO()
    out = tmp_path / "out"
    summary = recordio_ops.pack(str(src), str(out), log=log)
    assert calls == [(4, "pack")]
    rec = out / "train.rec"
    assert _stored(out) == [(0.0, wide), (0.0, small), (2.0, big)]  # the files' bytes, not re-encoded
    reason = summary["skipped"][0]["reason"]
    assert reason.startswith("undecodable: UnidentifiedImageError: ")
    assert summary == {"out": str(out), "images": 3, "classes": 3,
                       "skipped": [{"path": str(src / "a" / "1.png"), "reason": reason}],
                       "image_sizes": {"2x3": 2, "300x300": 1}, "rec_bytes": rec.stat().st_size}
    assert rec.stat().st_size > 2**20 / 4  # so that "MiB" shows a rounding of the right divisor
    assert log.getvalue() == (f"packed 3 images of 3 classes into {rec} ({rec.stat().st_size / 2**20:.1f} MiB); "
                              "property 3,2,3\n")
    assert capsys.readouterr() == ("", "note: images have 2 different sizes (2x3, 300x300); property states the "
                                   "first one, use --resize for a uniform size\n"
                                   f"skipped image {src / 'a' / '1.png'}: {reason}\n")
    assert (out / "property").read_text() == "3,2,3\n" and (out / "classes.txt").read_text() == "a\nb\nc\n"
    assert sorted(p.name for p in out.iterdir()) == ["classes.txt", "property", "train.idx", "train.rec"]


def test_pack_of_one_size_prints_no_note_and_goes_to_stdout_by_default(tmp_path: Path, capsys):
    src = _faces(tmp_path, a=[_noise_png(2, 3)])
    out = tmp_path / "out"
    recordio_ops.pack(str(src), str(out))
    rec = out / "train.rec"
    assert capsys.readouterr() == (f"packed 1 images of 1 classes into {rec} (0.0 MiB); property 1,2,3\n", "")


def test_pack_refuses_an_existing_train_rec_without_force_only(tmp_path: Path):
    src = _faces(tmp_path, a=[_noise_png(2, 3)])
    out = tmp_path / "out"
    out.mkdir()
    (out / "property").write_text("9,9,9\n")  # not train.rec or train.idx: no --force needed
    recordio_ops.pack(str(src), str(out), log=io.StringIO())
    assert (out / "property").read_text() == "1,2,3\n"
    with pytest.raises(CommandError) as info:
        recordio_ops.pack(str(src), str(out), log=io.StringIO())
    assert str(info.value) == f"{str(out / 'train.rec')!r} exists (use --force to replace it)"
    recordio_ops.pack(str(src), str(out), force=True, log=io.StringIO())


def test_pack_of_a_folder_skips_an_image_linked_out_of_it(tmp_path: Path):
    outside = tmp_path / "elsewhere.png"
    outside.write_bytes(_noise_png(2, 3))
    src = tmp_path / "faces"
    (src / "a").mkdir(parents=True)
    (src / "a" / "0.png").symlink_to(outside)
    (src / "a" / "1.png").write_bytes(_noise_png(4, 4))  # after the refused one: still packed
    summary = recordio_ops.pack(str(src), str(tmp_path / "out"), log=io.StringIO())
    assert summary["images"] == 1 and summary["image_sizes"] == {"4x4": 1}
    [skip] = summary["skipped"]
    assert skip["path"] == str(src / "a" / "0.png") and skip["reason"] == (
        f"refusing to read image file {src / 'a' / '0.png'}: it resolves to {outside}, outside {src}")


def test_pack_of_a_list_resolves_against_root_and_writes_no_classes_txt(tmp_path: Path):
    images = tmp_path / "images"
    images.mkdir()
    (images / "x.png").write_bytes(_noise_png(2, 3, 1))
    (images / "y.png").write_bytes(_noise_png(2, 3, 2))
    listing = tmp_path / "lists" / "train.txt"
    listing.parent.mkdir()
    listing.write_text("y.png 1\nx.png 0\n")  # relative to --root, not to the list's folder
    out = tmp_path / "out"
    out.mkdir()
    (out / "classes.txt").write_text("stale\n")  # from an earlier folder pack: kept without --force
    summary = recordio_ops.pack(str(listing), str(out), list_file=True, root=str(images), log=io.StringIO())
    assert summary["images"] == 2 and summary["classes"] == 2
    assert _stored(out) == [(0.0, (images / "x.png").read_bytes()), (1.0, (images / "y.png").read_bytes())]
    assert (out / "classes.txt").read_text() == "stale\n"
    recordio_ops.pack(str(listing), str(out), list_file=True, root=str(images), force=True, log=io.StringIO())
    assert not (out / "classes.txt").exists()  # would name the wrong labels: removed with --force
    assert sorted(p.name for p in out.iterdir()) == ["property", "train.idx", "train.rec"]


def test_a_forced_pack_that_fails_leaves_the_earlier_pack_whole_class_names_included(tmp_path: Path, monkeypatch):
    """A list pack with --force over a folder pack removed the old classes.txt before its new files
    were put in place: when putting them in place then failed (a full or vanished disk, a kill), the
    old pack was left without its class names. Now the earlier pack keeps them until it is replaced."""
    src = _faces(tmp_path, z=[_noise_png(2, 3)])
    out = tmp_path / "out"
    recordio_ops.pack(str(src), str(out), log=io.StringIO())
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    assert before["classes.txt"] == b"z\n"
    listing = tmp_path / "train.txt"
    listing.write_text("x.png 0\n")
    (tmp_path / "x.png").write_bytes(_noise_png(2, 3, 1))

    def no_disk(*_):
        raise OSError("the disk is gone")

    monkeypatch.setattr(recordio_ops.os, "replace", no_disk)
    with pytest.raises(OSError, match="the disk is gone"):
        recordio_ops.pack(str(listing), str(out), list_file=True, force=True, log=io.StringIO())
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before  # and no .part file left behind


def test_pack_of_a_folder_over_a_folder_pack_replaces_classes_txt(tmp_path: Path):
    src = _faces(tmp_path, z=[_noise_png(2, 3)])
    out = tmp_path / "out"
    out.mkdir()
    (out / "classes.txt").write_text("old\n")
    recordio_ops.pack(str(src), str(out), force=True, log=io.StringIO())
    assert (out / "classes.txt").read_text() == "z\n"


def test_pack_with_resize_reencodes_jpeg_at_quality_95_by_default(tmp_path: Path):
    src = tmp_path / "faces"
    (src / "a").mkdir(parents=True)
    square, target = _noise_png(6, 6, 1), _noise_png(4, 6, 2)
    (src / "a" / "0.png").write_bytes(square)  # 6x6: as wide as asked, not as high
    (src / "a" / "1.png").write_bytes(target)  # already 4x6: not resized, still re-encoded
    out = tmp_path / "out"
    summary = recordio_ops.pack(str(src), str(out), resize=(4, 6), log=io.StringIO())
    assert summary["image_sizes"] == {"4x6": 2}
    resized = Image.open(io.BytesIO(square)).resize((6, 4), Image.BILINEAR)
    expected = [recordio_ops._encode(resized, "jpeg", 95), recordio_ops._encode(Image.open(io.BytesIO(target)), "jpeg", 95)]
    assert [data for _, data in _stored(out)] == expected
    recordio_ops.pack(str(src), str(out), resize=(4, 6), quality=20, encode="jpeg", force=True, log=io.StringIO())
    assert _stored(out)[0][1] == recordio_ops._encode(resized, "jpeg", 20)
    recordio_ops.pack(str(src), str(out), encode="png", force=True, log=io.StringIO())  # no resize, re-encoded
    assert _stored(out)[0][1] == recordio_ops._encode(Image.open(io.BytesIO(square)), "png", 95)
    recordio_ops.pack(str(src), str(out), encode="jpeg", force=True, log=io.StringIO())  # PNGs stored as JPEG
    assert [data for _, data in _stored(out)] == [recordio_ops._encode(Image.open(io.BytesIO(png)), "jpeg", 95)
                                                 for png in (square, target)]


def test_pack_of_a_list_naming_a_missing_image_says_which(tmp_path: Path):
    listing = tmp_path / "train.txt"
    listing.write_text("gone.png 0\n")
    with pytest.raises(CommandError) as info:
        recordio_ops.pack(str(listing), str(tmp_path / "out"), list_file=True, log=io.StringIO())
    assert str(info.value) == f"image file not found: {str(tmp_path / 'gone.png')!r}"


def test_pack_of_nothing_decodable_is_a_command_error(tmp_path: Path):
    src = _faces(tmp_path, a=[b"junk", b"more junk"])
    out = tmp_path / "out"
    with pytest.raises(CommandError) as info:
        recordio_ops.pack(str(src), str(out), log=io.StringIO())
    reason = str(info.value).split(f"{src / 'a' / '0.png'}: ")[1]
    assert str(info.value) == f"no image in {str(src)!r} could be packed: 2 skipped, the first {src / 'a' / '0.png'}: {reason}"
    assert reason.startswith("undecodable: UnidentifiedImageError: ")
    assert list(out.iterdir()) == []  # nothing half-written left


# ------------------------------------------------------------------ inspect


def test_inspect_of_a_packed_folder(tmp_path: Path):
    src = tmp_path / "faces"
    for name, n in (("a", 7), ("b", 0), ("c", 2), ("d", 0), ("e", 0)):
        (src / name).mkdir(parents=True)
        for i in range(n):
            (src / name / f"{i}.png").write_bytes(_noise_png(2, 3, i))
    out = tmp_path / "out"
    recordio_ops.pack(str(src), str(out), log=io.StringIO())
    rec = out / "train.rec"
    assert recordio_ops.inspect(str(out)) == {
        "rec": str(rec), "idx": str(out / "train.idx"), "layout": "insightface", "records": 1 + 9 + 5,
        "images": 9, "classes": 5, "classes_from": "property", "empty_classes": 3,
        "images_per_class": {"min": 0, "median": 0.0, "max": 7}, "identity_records": 5, "property": [5, 2, 3],
        "image_sizes_sampled": {"2x3": 8}, "undecodable_in_sample": [], "rec_bytes": rec.stat().st_size}
    assert recordio_ops.inspect(str(out), sample=0)["image_sizes_sampled"] == {}
    assert recordio_ops.inspect(str(out), sample=-3)["image_sizes_sampled"] == {}
    assert recordio_ops.inspect(str(out), sample=50)["image_sizes_sampled"] == {"2x3": 9}


def test_inspect_of_an_im2rec_file_without_property(tmp_path: Path):
    root = _im2rec(tmp_path / "r", [pack_header(IRHeader(0, 1.0, 0, 0), _png()), pack_header(IRHeader(0, 1.0, 0, 0), b"junk")])
    rec = root / "train.rec"
    info = recordio_ops.inspect(str(rec))
    [undecodable] = info["undecodable_in_sample"]
    assert undecodable.startswith(f"{rec}#key 1: UnidentifiedImageError: ")
    assert info == {
        "rec": str(rec), "idx": str(root / "train.idx"), "layout": "im2rec", "records": 2, "images": 2, "classes": 2,
        "classes_from": "labels", "empty_classes": 1, "images_per_class": {"min": 0, "median": 1.0, "max": 2},
        "identity_records": None, "property": None, "image_sizes_sampled": {"2x3": 1},
        "undecodable_in_sample": [undecodable], "rec_bytes": rec.stat().st_size}


# ------------------------------------------------------------------ shuffle


def _labelled(root: Path, n: int, prop=None) -> Path:
    """An im2rec file of ``n`` images whose label is their key (so an order can be read back)."""
    return _im2rec(root, [pack_header(IRHeader(0, float(k), k, 0), _png(k)) for k in range(n)], prop)


def _labels(rec: Path) -> list:
    reader = RecordIOReader(rec)
    assert reader.keys.tolist() == list(range(len(reader)))
    return [int(unpack_header(reader.read(k))[0].label) for k in range(len(reader))]


def test_shuffle_writes_seed_0s_permutation_and_says_so(tmp_path: Path, monkeypatch, capsys):
    calls = _record_progress(monkeypatch)
    src = _labelled(tmp_path / "src", 7, "7,2,3\n")
    out = tmp_path / "out"
    assert recordio_ops.shuffle(str(src), str(out)) == {"rec": str(out / "train.rec"), "images": 7}
    assert calls == [(7, "shuffle")]
    assert _labels(out / "train.rec") == np.random.default_rng(0).permutation(7).tolist()
    assert capsys.readouterr() == (f"wrote 7 images in shuffled order (seed 0) to {out / 'train.rec'}\n", "")
    assert (out / "property").read_text() == "7,2,3\n"
    log = io.StringIO()
    recordio_ops.shuffle(str(src), str(tmp_path / "s5.rec"), seed=5, log=log)
    assert _labels(tmp_path / "s5.rec") == np.random.default_rng(5).permutation(7).tolist()
    assert log.getvalue() == f"wrote 7 images in shuffled order (seed 5) to {tmp_path / 's5.rec'}\n"


def test_shuffle_to_a_rec_path_makes_its_folder(tmp_path: Path):
    src = _labelled(tmp_path / "src", 3, "3,2,3\n")
    deep = tmp_path / "a" / "b" / "s.rec"
    assert recordio_ops.shuffle(str(src), str(deep), log=io.StringIO())["rec"] == str(deep)
    assert sorted(p.name for p in deep.parent.iterdir()) == ["property", "s.idx", "s.rec"]
    again = tmp_path / "a" / "t.rec"  # a folder that exists
    recordio_ops.shuffle(str(src), str(again), log=io.StringIO())
    assert sorted(_labels(again)) == [0, 1, 2] and (again.parent / "property").read_text() == "3,2,3\n"
    folder = tmp_path / "a"  # a folder OUT that exists: train.rec in it
    recordio_ops.shuffle(str(src), str(folder), force=True, log=io.StringIO())
    assert (folder / "train.rec").exists() and (folder / "train.idx").exists()


def test_shuffle_refuses_to_overwrite_its_input(tmp_path: Path):
    src = _labelled(tmp_path / "src", 3)
    with pytest.raises(CommandError) as info:
        recordio_ops.shuffle(str(src), str(src), force=True)
    assert str(info.value) == f"OUT {str(src)!r} would overwrite the input {str(src / 'train.rec')!r}"


def test_shuffle_beside_its_input_shares_its_property(tmp_path: Path):
    src = _labelled(tmp_path / "src", 3, "5,2,3\n")
    recordio_ops.shuffle(str(src), str(src / "shuffled.rec"), log=io.StringIO())  # no --force: property is its own
    assert (src / "property").read_text() == "5,2,3\n"
    assert sorted(p.name for p in src.iterdir()) == ["property", "shuffled.idx", "shuffled.rec", "train.idx", "train.rec"]


def test_shuffle_without_property_clears_another_one_with_force_only(tmp_path: Path):
    src = _labelled(tmp_path / "src", 3)
    out = tmp_path / "out"
    out.mkdir()
    (out / "property").write_text("2,9,9\n")  # another data set's: 2 classes, but labels reach 2
    with pytest.raises(CommandError) as info:
        recordio_ops.shuffle(str(src), str(out), log=io.StringIO())
    assert str(info.value) == f"{str(out / 'property')!r} exists (use --force to replace it)"
    assert sorted(p.name for p in out.iterdir()) == ["property"]
    recordio_ops.shuffle(str(src), str(out), force=True, log=io.StringIO())
    assert sorted(p.name for p in out.iterdir()) == ["train.idx", "train.rec"]
    recordio_ops.shuffle(str(src), str(out), force=True, log=io.StringIO())  # and again, with nothing to clear


def test_a_forced_shuffle_that_fails_leaves_what_out_held_whole(tmp_path: Path, monkeypatch):
    """The shuffle of a data set without a property over another pack removed that pack's property
    before its own files were in place: a failure then left the earlier pack without it."""
    out = tmp_path / "out"
    recordio_ops.shuffle(str(_labelled(tmp_path / "other", 2, "2,2,3\n")), str(out), log=io.StringIO())
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    assert sorted(before) == ["property", "train.idx", "train.rec"]

    def no_disk(*_):
        raise OSError("the disk is gone")

    monkeypatch.setattr(recordio_ops.os, "replace", no_disk)
    with pytest.raises(OSError, match="the disk is gone"):
        recordio_ops.shuffle(str(_labelled(tmp_path / "src", 3)), str(out), force=True, log=io.StringIO())
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before


def test_shuffle_with_property_replaces_one_there_with_force_only(tmp_path: Path):
    src = _labelled(tmp_path / "src", 3, "3, 2,3\n")
    out = tmp_path / "out"
    out.mkdir()
    (out / "property").write_text("9,9,9\n")
    with pytest.raises(CommandError):
        recordio_ops.shuffle(str(src), str(out), log=io.StringIO())
    recordio_ops.shuffle(str(src), str(out), force=True, log=io.StringIO())
    assert (out / "property").read_text() == "3,2,3\n"  # the values the dataset read, written as the new file's
