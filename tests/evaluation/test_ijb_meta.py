"""The IJB release reader's edges, exactly (:func:`shardfc.evaluation.ijb.read_ijb_meta`,
:class:`~shardfc.evaluation.ijb.AlignedFaces`): each message in full, what is kept and in which
dtype. ``test_ijb.py`` holds the protocol end to end against a plain reference."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from shardfc.data import CorruptImageError, image_to_tensor, pil_to_tensor
from shardfc.evaluation.alignment import ARCFACE_TEMPLATE, align_face
from shardfc.evaluation.ijb import AlignedFaces, read_ijb_meta

LMK = " ".join(f"{v:g}" for v in ARCFACE_TEMPLATE.reshape(-1))


def _release(root: Path, faces=None, lmk=None, pairs="1 2 1\n1 2 0\n", target="ijbc") -> Path:
    faces = "a.png 1 10\nb.png 2 20\n\nc.png 2 21\n" if faces is None else faces
    if lmk is None:
        named = [line.split()[0] for line in faces.split("\n") if line.strip()]
        lmk = "".join(f"{name} {LMK} 0.{i + 5}\n" for i, name in enumerate(named))
    (root / "meta").mkdir(parents=True, exist_ok=True)
    (root / "meta" / f"{target}_face_tid_mid.txt").write_text(faces)
    (root / "meta" / f"{target}_name_5pts_score.txt").write_text(lmk)
    (root / "meta" / f"{target}_template_pair_label.txt").write_text(pairs)
    return root


def _refusal(root, target="IJBC", error=ValueError) -> str:
    with pytest.raises(error) as info:
        read_ijb_meta(root, target)
    return str(info.value)


def test_a_release_is_read_in_its_dtypes_and_shapes(tmp_path: Path):
    root = _release(tmp_path / "r")
    meta = read_ijb_meta(root)
    assert meta.root == root and meta.target == "IJBC" and meta.names == ["a.png", "b.png", "c.png"]
    assert meta.templates.dtype == meta.medias.dtype == meta.pairs.dtype == meta.labels.dtype == np.int64
    assert meta.templates.tolist() == [1, 2, 2] and meta.medias.tolist() == [10, 20, 21]
    assert meta.landmarks.dtype == np.float64 and meta.landmarks.shape == (3, 5, 2)
    assert np.allclose(meta.landmarks[2], ARCFACE_TEMPLATE) and meta.scores.tolist() == [0.5, 0.6, 0.7]
    assert meta.pairs.tolist() == [[1, 2], [1, 2]] and meta.labels.tolist() == [1, 0]
    ijbb = read_ijb_meta(_release(tmp_path / "b", target="ijbb"), "IJBB")
    assert ijbb.target == "IJBB" and len(ijbb.names) == 3


def test_a_release_named_from_home(tmp_path: Path, monkeypatch):
    _release(tmp_path / "home" / "IJB_C")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert read_ijb_meta("~/IJB_C").root == tmp_path / "home" / "IJB_C"


def test_what_is_not_a_release_is_named(tmp_path: Path):
    assert _refusal(tmp_path, "IJBA") == "target (shardfc eval --ijb-target) must be one of IJBB, IJBC, got 'IJBA'"
    assert _refusal(tmp_path, "ijbc") == "target (shardfc eval --ijb-target) must be one of IJBB, IJBC, got 'ijbc'"
    (tmp_path / "file").write_text("")
    assert _refusal(tmp_path / "file", error=FileNotFoundError) == f"root (shardfc eval --ijb) {str(tmp_path / 'file')!r} is not a folder"
    root = _release(tmp_path / "r")
    missing = root / "meta" / "ijbb_face_tid_mid.txt"
    assert _refusal(root, "IJBB", FileNotFoundError) == f"IJB meta file not found: {str(missing)!r}"


def test_a_meta_file_goes_through_the_gate_inside_its_release(tmp_path: Path, special_file):
    root = _release(tmp_path / "r")
    pairs = root / "meta" / "ijbc_template_pair_label.txt"
    pairs.unlink()
    special_file(pairs, "fifo")
    assert _refusal(root) == f"refusing to read IJB meta file {pairs}: it is a FIFO, not a regular file"
    pairs.unlink()
    (tmp_path / "elsewhere.txt").write_text("1 2 1\n")
    os.symlink(tmp_path / "elsewhere.txt", pairs)
    assert _refusal(root) == (f"refusing to read IJB meta file {pairs}: it resolves to {tmp_path / 'elsewhere.txt'}, "
                              f"outside {root}")


def test_a_malformed_line_is_named_with_its_number(tmp_path: Path):
    tid_mid = "ijbc_face_tid_mid.txt"
    root = _release(tmp_path / "a", faces="a.png 1 10\n\nb.png 2\n")
    assert _refusal(root) == f"{root / 'meta' / tid_mid}:3: expected 3 fields, got 2: 'b.png 2'"
    long = "x" * 300
    root = _release(tmp_path / "b", faces=f"a.png 1 10 {long}\n")
    assert _refusal(root) == f"{root / 'meta' / tid_mid}:1: expected 3 fields, got 4: {('a.png 1 10 ' + long)[:200]!r}"
    root = _release(tmp_path / "c", faces="a.png 1 ten\n")
    assert _refusal(root) == f"{root / 'meta' / tid_mid}:1: not a int: '1 ten'"
    root = _release(tmp_path / "d", lmk=f"a.png {LMK} high\nb.png {LMK} 1\nc.png {LMK} 1\n")
    assert _refusal(root) == f"{root / 'meta' / 'ijbc_name_5pts_score.txt'}:1: not a float: {(LMK + ' high')!r}"


@pytest.mark.parametrize("name", ["/etc/passwd", "../x.png", "a/../../x.png", "/" + "y" * 300])
def test_a_face_outside_loose_crop_is_refused(tmp_path: Path, name):
    root = _release(tmp_path / "r", faces=f"a.png 1 10\n{name} 1 11\n")
    assert _refusal(root) == (f"{root / 'meta' / 'ijbc_face_tid_mid.txt'}:2: face {name[:200]!r} is not a file name "
                              "inside loose_crop/")


def test_the_two_face_lists_must_agree_line_by_line(tmp_path: Path):
    lmk_file = "ijbc_name_5pts_score.txt"
    root = _release(tmp_path / "a", lmk=f"a.png {LMK} 1\nc.png {LMK} 1\nb.png {LMK} 1\n")
    assert _refusal(root) == (f"{root / 'meta' / lmk_file}:2: face 'c.png' but line 2 of ijbc_face_tid_mid.txt is "
                              "'b.png'; the two files must list the same faces in the same order")
    root = _release(tmp_path / "b", lmk=f"a.png {LMK} 1\nb.png {LMK} 1\nc.png {LMK} 1\nd.png {LMK} 1\n")
    assert _refusal(root) == (f"{root / 'meta' / lmk_file}:4: face 'd.png' but line 4 of ijbc_face_tid_mid.txt is "
                              "'(no such face)'; the two files must list the same faces in the same order")
    root = _release(tmp_path / "c", lmk=f"a.png {LMK} 1\n\nb.png {LMK} 1\n")
    assert _refusal(root) == (f"{root / 'meta' / lmk_file} lists 2 faces, "
                              f"{root / 'meta' / 'ijbc_face_tid_mid.txt'} lists 3")


def test_the_pairs_are_labelled_0_or_1_and_name_known_templates(tmp_path: Path):
    pair_file = "ijbc_template_pair_label.txt"
    root = _release(tmp_path / "a", pairs="1 2 1\n1 2 -1\n")
    assert _refusal(root) == f"{root / 'meta' / pair_file}:2: label must be 0 or 1, got -1"
    root = _release(tmp_path / "b", pairs="\n\n")
    assert _refusal(root) == f"{root / 'meta' / pair_file} holds no template pairs"
    unknown = " ".join(f"{t} 1 0" for t in range(100, 112))
    root = _release(tmp_path / "c", pairs="1 2 1\n" + unknown.replace(" 0 ", " 0\n") + "\n7 3 1\n")
    assert _refusal(root) == (f"{root / 'meta' / pair_file} names templates without faces in ijbc_face_tid_mid.txt: "
                              f"{[3, 7] + list(range(100, 108))}")
    root = _release(tmp_path / "d", pairs="1 x 1\n")
    assert _refusal(root) == f"{root / 'meta' / pair_file}:1: not a int: '1 x 1'"


# ------------------------------------------------------------------ the faces


def test_a_face_is_aligned_by_its_landmarks_and_resized(tmp_path: Path):
    root = _release(tmp_path / "r")
    (root / "loose_crop").mkdir()
    rng = np.random.default_rng(0)
    for name in ("a.png", "b.png", "c.png"):
        Image.fromarray(rng.integers(0, 256, (120, 120, 3), np.uint8)).save(root / "loose_crop" / name)
    meta = read_ijb_meta(root)
    faces = AlignedFaces(meta, image_size=(56.0, 48))
    assert len(faces) == 3 and faces.image_size == (56, 48)
    img = pil_to_tensor(Image.open(root / "loose_crop" / "b.png"))
    aligned = align_face(img, meta.landmarks[1])
    expected = image_to_tensor(Image.fromarray(aligned.permute(1, 2, 0).numpy()), (56, 48))
    assert torch.equal(faces[1], expected)


def test_a_missing_face_or_one_linked_out_is_named(tmp_path: Path):
    root = _release(tmp_path / "r")
    (root / "loose_crop").mkdir()
    meta = read_ijb_meta(root)
    with pytest.raises(FileNotFoundError) as info:
        AlignedFaces(meta)[0]
    assert str(info.value) == f"IJB face image not found: {str(root / 'loose_crop' / 'a.png')!r}"
    Image.fromarray(np.zeros((8, 8, 3), np.uint8)).save(tmp_path / "outside.png")
    os.symlink(tmp_path / "outside.png", root / "loose_crop" / "a.png")
    with pytest.raises(CorruptImageError) as info:
        AlignedFaces(meta)[0]
    assert info.value.path == str(root / "loose_crop" / "a.png")
    assert info.value.reason == (f"refusing to read image file {root / 'loose_crop' / 'a.png'}: it resolves to "
                                 f"{tmp_path / 'outside.png'}, outside {root / 'loose_crop'}")
