"""``shardfc embed``'s command line (:mod:`shardfc.cli.embed`) at its edges: what each flag does to the
embeddings (a stand-in backbone whose output is worked by hand), the files written, the skipped
images' warning, each refusal as one line. ``tests/train/test_tools.py`` embeds with a real checkpoint."""

from __future__ import annotations

import io
import os
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from PIL import Image
from torch import nn

from shardfc.cli import embed as cli


def _png(value: int, size=(6, 6)) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", size, (value, value, value)).save(buf, format="PNG")
    return buf.getvalue()


class _MeanColour(nn.Module):
    """The mean of the first two channels (a solid image's normalised value, twice): its own mirror
    image. Records each batch's shape."""

    def __init__(self) -> None:
        super().__init__()
        self.shapes = []

    @property
    def batches(self):
        return [shape[0] for shape in self.shapes]

    def forward(self, x):
        self.shapes.append(tuple(x.shape))
        return x.mean(dim=(2, 3))[:, :2]


class _Backbone:
    """Stands in for ``load_backbone`` and ``pick_device`` and records what ``main`` asks of them."""

    def __init__(self, monkeypatch):
        self.model = _MeanColour()
        self.loaded, self.devices = [], []
        trained = SimpleNamespace(model=self.model, image_size=(4, 4), path=Path("/runs/a/step_3"))
        monkeypatch.setattr(cli, "load_backbone", lambda path, device, trust_pickle: self.loaded.append(
            (path, device, trust_pickle)) or trained)
        monkeypatch.setattr(cli, "pick_device", lambda name: self.devices.append(name) or torch.device("cpu"))


@pytest.fixture
def images(tmp_path):
    """Three decodable images (values 255, 0, 51: normalised 1, -1, -0.6) and one that is not."""
    root = tmp_path / "imgs"
    (root / "b").mkdir(parents=True)
    (root / "b" / "2.png").write_bytes(_png(0))
    (root / "a.png").write_bytes(_png(255))
    (root / "b" / "1.png").write_bytes(_png(51))
    (root / "c.jpg").write_bytes(b"\xff\xd8 truncated")
    return root


def _run(*argv):
    return cli.main([str(a) for a in argv])


def test_defaults_normalised_mirrored_embeddings_in_a_pt_file(monkeypatch, images, tmp_path, capsys):
    backbone = _Backbone(monkeypatch)
    out = tmp_path / "deep" / "er" / "emb.pt"
    assert _run("--checkpoint", "ck", "--images", images, "--out", out) == 0
    assert backbone.loaded == [("ck", torch.device("cpu"), False)] and backbone.devices == ["auto"]
    # one batch (of 256 at most) at the checkpoint's input size, and its mirror image
    assert backbone.model.shapes == [(3, 3, 4, 4)] * 2
    saved = torch.load(out, weights_only=True)
    assert saved["paths"] == ["a.png", "b/1.png", "b/2.png"]
    assert saved["checkpoint"] == "/runs/a/step_3"
    s = 2 ** -0.5
    torch.testing.assert_close(saved["embeddings"], torch.tensor([[s, s], [-s, -s], [-s, -s]]))
    captured = capsys.readouterr()
    assert captured.out == f"wrote {out}: 3 x 2 embeddings of images under {images}\n"
    assert captured.err == f"warning: skipped 1 corrupt image(s): {images / 'c.jpg'} (UnidentifiedImageError: cannot identify image file)\n"
    assert sorted(os.listdir(out.parent)) == ["emb.pt"]  # no temporary file left


def test_flags_reach_the_embedding(monkeypatch, images, tmp_path, capsys):
    backbone = _Backbone(monkeypatch)
    out = tmp_path / "emb.npy"
    assert _run("--checkpoint", "ck", "--trust-checkpoint", "--images", images, "--out", out, "--batch-size", 2,
                "--no-flip", "--no-normalize", "--device", "cpu") == 0
    assert backbone.loaded == [("ck", torch.device("cpu"), True)] and backbone.devices == ["cpu"]
    assert backbone.model.batches == [2, 1]
    got = np.load(out)
    assert got.dtype == np.float32
    np.testing.assert_allclose(got, [[1.0] * 2, [-0.6] * 2, [-1.0] * 2], atol=1e-6)
    assert Path(f"{out}.paths.txt").read_text(encoding="utf-8") == "a.png\nb/1.png\nb/2.png\n"
    assert capsys.readouterr().out == (f"wrote {out}: 3 x 2 embeddings of images under {images} "
                                       f"(paths in {out}.paths.txt)\n")
    # the mirror image added, not normalised: twice the mean
    assert _run("--checkpoint", "ck", "--images", images, "--out", out, "--force", "--no-normalize") == 0
    np.testing.assert_allclose(np.load(out), [[2.0] * 2, [-1.2] * 2, [-2.0] * 2], atol=1e-6)
    assert sorted(os.listdir(tmp_path)) == ["emb.npy", "emb.npy.paths.txt", "imgs"]


def test_a_folder_given_with_a_tilde(monkeypatch, images, tmp_path):
    _Backbone(monkeypatch)
    monkeypatch.setenv("HOME", str(tmp_path))
    out = tmp_path / "emb.pt"
    assert _run("--checkpoint", "ck", "--images", "~/imgs", "--out", out) == 0
    assert torch.load(out, weights_only=True)["paths"] == ["a.png", "b/1.png", "b/2.png"]


@pytest.mark.parametrize("bad, shown", [(5, ")"), (6, ") ...")])
def test_the_warning_names_five_skipped_images(monkeypatch, images, tmp_path, capsys, bad, shown):
    _Backbone(monkeypatch)
    for i in range(bad - 1):
        (images / f"z{i}.png").write_bytes(b"not a png")
    assert _run("--checkpoint", "ck", "--images", images, "--out", tmp_path / "e.pt") == 0
    err = capsys.readouterr().err
    assert err.startswith(f"warning: skipped {bad} corrupt image(s): {images / 'c.jpg'} (UnidentifiedImageError: cannot identify image file); ")
    assert err.count("(UnidentifiedImageError: cannot identify image file)") == 5 and err.endswith(f"{shown}\n")


def test_an_image_outside_the_folder_is_skipped(monkeypatch, images, tmp_path, capsys):
    _Backbone(monkeypatch)
    (tmp_path / "outside.png").write_bytes(_png(9))
    (images / "link.png").symlink_to(tmp_path / "outside.png")
    assert _run("--checkpoint", "ck", "--images", images, "--out", tmp_path / "e.pt") == 0
    assert torch.load(tmp_path / "e.pt", weights_only=True)["paths"] == ["a.png", "b/1.png", "b/2.png"]
    assert f"{images / 'link.png'} (" in capsys.readouterr().err


@pytest.mark.parametrize("argv, message", [
    (["--out", "{tmp}/e.csv"], "--out '{tmp}/e.csv' must end in .pt or .npy"),
    (["--out", "{tmp}/e.pt", "--batch-size", "0"], "--batch-size must be >= 1, got 0"),
    (["--out", "{tmp}/taken.pt"], "{tmp}/taken.pt exists; pass --force to replace it"),
    (["--out", "{tmp}/taken.npy"], "{tmp}/taken.npy.paths.txt exists; pass --force to replace it"),
    (["--out", "{tmp}/dir.pt", "--force"], "--out '{tmp}/dir.pt' is a folder; name the file to write"),
    (["--out", "{tmp}/d.npy", "--force"], "--out '{tmp}/d.npy.paths.txt' is a folder; name the file to write"),
    (["--out", "{tmp}/taken.pt/e.pt"], "--out '{tmp}/taken.pt/e.pt': '{tmp}/taken.pt' is a file, not a folder"),
    (["--out", "{tmp}/e.pt", "--images", "{tmp}/none"], "--images '{tmp}/none' does not exist or is not a folder"),
    (["--out", "{tmp}/e.pt", "--images", "{tmp}/bad"], "none of the 2 images under '{tmp}/bad' could be decoded"),
])
def test_refusals_are_one_line(monkeypatch, images, tmp_path, capsys, argv, message):
    backbone = _Backbone(monkeypatch)
    (tmp_path / "taken.pt").write_bytes(b"keep")
    (tmp_path / "taken.npy.paths.txt").write_bytes(b"keep")  # the paths of a .npy are the user's file too
    (tmp_path / "dir.pt").mkdir()
    (tmp_path / "d.npy.paths.txt").mkdir()  # where the .npy's list of paths would go
    (tmp_path / "bad").mkdir()
    for name in ("1.png", "2.jpg"):
        (tmp_path / "bad" / name).write_bytes(b"junk")
    argv = [a.format(tmp=tmp_path) for a in argv]
    if "--images" not in argv:
        argv += ["--images", str(images)]
    assert cli.main(["--checkpoint", "ck", *argv]) == 2
    assert capsys.readouterr() == ("", f"shardfc embed: error: {message.format(tmp=tmp_path)}\n")
    assert (tmp_path / "taken.pt").read_bytes() == b"keep" and (tmp_path / "taken.npy.paths.txt").read_bytes() == b"keep"
    assert not (tmp_path / "e.pt").exists() and not (tmp_path / "e.csv").exists() and not (tmp_path / "taken.npy").exists()
    assert os.listdir(tmp_path / "dir.pt") == []
    if "decoded" not in message:
        assert backbone.model.batches == []


def test_a_write_that_fails_names_the_file_and_leaves_no_scratch_file(monkeypatch, images, tmp_path, capsys):
    _Backbone(monkeypatch)

    def full_disk(obj, f, *args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(cli.torch, "save", full_disk)
    assert _run("--checkpoint", "ck", "--images", images, "--out", tmp_path / "out" / "e.pt") == 2
    assert capsys.readouterr().err.endswith(
        f"shardfc embed: error: cannot write {tmp_path / 'out' / 'e.pt'}: No space left on device\n")
    assert os.listdir(tmp_path / "out") == []


def test_batch_size_one(monkeypatch, images, tmp_path):
    backbone = _Backbone(monkeypatch)
    assert _run("--checkpoint", "ck", "--images", images, "--out", tmp_path / "e.pt", "--batch-size", 1,
                "--no-flip") == 0
    assert backbone.model.batches == [1, 1, 1]


def test_no_flag_taken_by_a_prefix(monkeypatch, images, tmp_path, capsys):
    _Backbone(monkeypatch)
    with pytest.raises(SystemExit):
        _run("--checkpoint", "ck", "--images", images, "--out", tmp_path / "e.pt", "--batch", 2)
    assert "unrecognized arguments: --batch" in capsys.readouterr().err


def test_the_device_it_picks_runs_the_model(monkeypatch, images, tmp_path):
    backbone = _Backbone(monkeypatch)
    monkeypatch.setattr(cli, "pick_device", lambda name: torch.device("meta"))
    seen = []

    def forward(x):
        seen.append(x.device.type)
        return torch.ones(x.shape[0], 2)

    monkeypatch.setattr(backbone.model, "forward", forward)
    assert _run("--checkpoint", "ck", "--images", images, "--out", tmp_path / "e.pt", "--device", "meta") == 0
    assert seen == ["meta", "meta"] and backbone.loaded[0][1] == torch.device("meta")


def test_arguments_from_the_command_line(monkeypatch, images, tmp_path):
    backbone = _Backbone(monkeypatch)
    monkeypatch.setattr("sys.argv", ["shardfc embed", "--checkpoint", "from-argv", "--images", str(images),
                                     "--out", str(tmp_path / "e.pt")])
    assert cli.main() == 0
    assert backbone.loaded[0][0] == "from-argv"


def test_batches_of_256_by_default(monkeypatch, tmp_path):
    backbone = _Backbone(monkeypatch)
    root = tmp_path / "many"
    root.mkdir()
    png = _png(128, size=(4, 4))
    for i in range(257):
        (root / f"{i:03d}.png").write_bytes(png)
    assert _run("--checkpoint", "ck", "--images", root, "--out", tmp_path / "e.pt", "--no-flip") == 0
    assert backbone.model.batches == [256, 1]


def test_a_name_with_a_line_break_is_refused_for_npy_and_kept_in_a_pt(monkeypatch, images, tmp_path, capsys):
    """A .npy lists its paths one per line: a name holding a line break would shift every row after it."""
    backbone = _Backbone(monkeypatch)
    (images / "b" / "two\nlines.png").write_bytes(_png(7))
    assert _run("--checkpoint", "ck", "--images", images, "--out", tmp_path / "e.npy") == 2
    assert capsys.readouterr().err == (
        f"shardfc embed: error: --out {str(tmp_path / 'e.npy')!r} lists the paths one per line, but "
        f"{'b/two' + chr(10) + 'lines.png'!r} holds a line break: use --out FILE.pt (the paths as a list)\n")
    assert backbone.model.batches == [] and not (tmp_path / "e.npy").exists()
    assert _run("--checkpoint", "ck", "--images", images, "--out", tmp_path / "e.pt") == 0
    assert "b/two\nlines.png" in torch.load(tmp_path / "e.pt", weights_only=True)["paths"]


def test_the_images_go_through_the_progress_bar(monkeypatch, images, tmp_path):
    """A folder of 100,000 images takes minutes: a bar on a terminal (shardfc.progress decides)."""
    _Backbone(monkeypatch)
    asked = []
    monkeypatch.setattr(cli, "progress", lambda it, total, desc: asked.append((len(list(it)), total, desc)) or it)
    assert _run("--checkpoint", "ck", "--images", images, "--out", tmp_path / "e.pt") == 0
    assert asked == [(4, 4, "embed")]  # every file listed, the undecodable one too
