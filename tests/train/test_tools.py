"""``shardfc export``, ``embed`` and ``eval`` on the checkpoint of the shared 2-process run."""

from __future__ import annotations

import importlib.util
import io
import json
import math
import pickle
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from shardfc.cli import embed as cli_embed
from shardfc.cli import eval as cli_eval
from shardfc.cli import export as cli_export
from shardfc.train.checkpointing.artifacts import load_backbone

from .legacy import rewrite_file

# torch marks TorchScript deprecated; exporting to it is what these tests check.
pytestmark = pytest.mark.filterwarnings("ignore:`torch.jit:DeprecationWarning")


def _png_bytes(color, size=(16, 16)) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", size, color).save(buf, format="PNG")
    return buf.getvalue()


def test_export_round_trip(run2, tmp_path, capsys):
    cfg, _ = run2
    out = tmp_path / "model.pt"
    assert cli_export.main(["--checkpoint", cfg.output_dir, "--out", str(out)]) == 0
    assert "reload check" in capsys.readouterr().out
    scripted = torch.jit.load(str(out))
    eager = load_backbone(cfg.output_dir).model
    x = torch.rand(5, 3, 16, 16) * 2 - 1  # another batch size than the trace's
    with torch.no_grad():
        assert torch.allclose(scripted(x), eager(x), atol=1e-5)
    extra = {"shardfc.json": ""}
    torch.jit.load(str(out), _extra_files=extra)
    meta = json.loads(extra["shardfc.json"])
    assert meta["input_size"] == [16, 16] and meta["embedding_dim"] == 16

    assert cli_export.main(["--checkpoint", cfg.output_dir, "--out", str(out)]) == 2
    assert "exists; pass --force" in capsys.readouterr().err

    # The class centres as one tensor: the 2 saved shards' rows, read straight from their files, joined.
    fc = tmp_path / "fc.pt"
    assert cli_export.main(["--checkpoint", cfg.output_dir, "--out", str(out), "--force", "--fc", str(fc)]) == 0
    assert "class centres, one tensor [24, 16]" in capsys.readouterr().out
    step = max((Path(cfg.output_dir) / "checkpoints").glob("step_*"))
    shards = [torch.load(step / f"head_{r}.pt", weights_only=True) for r in (0, 1)]
    assert shards[0]["class_range"][1] == shards[1]["class_range"][0]
    assert torch.equal(torch.load(fc, weights_only=True), torch.cat([s["tensors"]["weight"] for s in shards]))
    if importlib.util.find_spec("onnx") is None:
        code = cli_export.main(["--checkpoint", cfg.output_dir, "--out", str(out), "--force", "--onnx"])
        assert code == 2
        assert "needs the 'onnx' package" in capsys.readouterr().err
        assert not (tmp_path / "model.onnx").exists()


def test_embed_writes_one_row_per_decodable_image(run2, tmp_path, capsys):
    cfg, _ = run2
    images = tmp_path / "imgs"
    (images / "a").mkdir(parents=True)
    for i, name in enumerate(["a/1.png", "a/2.png", "3.png"]):
        (images / name).write_bytes(_png_bytes((40 * i, 90, 200), size=(20, 24)))
    (images / "bad.jpg").write_bytes(b"\xff\xd8 truncated")
    out = tmp_path / "emb.pt"
    assert cli_embed.main(["--checkpoint", cfg.output_dir, "--images", str(images), "--out", str(out)]) == 0
    captured = capsys.readouterr()
    assert "skipped 1 corrupt image(s)" in captured.err and "bad.jpg" in captured.err
    saved = torch.load(out)
    assert saved["embeddings"].shape == (3, 16)
    assert saved["paths"] == ["3.png", "a/1.png", "a/2.png"]
    assert torch.allclose(saved["embeddings"].norm(dim=1), torch.ones(3), atol=1e-5)

    npy = tmp_path / "emb.npy"
    assert cli_embed.main(["--checkpoint", cfg.output_dir, "--images", str(images), "--out", str(npy)]) == 0
    assert np.load(npy).shape == (3, 16)
    assert Path(f"{npy}.paths.txt").read_text().splitlines() == saved["paths"]

    assert cli_embed.main(["--checkpoint", cfg.output_dir, "--images", str(images), "--out", str(tmp_path / "e.csv")]) == 2
    empty = tmp_path / "none"
    empty.mkdir()
    assert cli_embed.main(["--checkpoint", cfg.output_dir, "--images", str(empty), "--out", str(tmp_path / "x.pt")]) == 2
    assert "holds no images" in capsys.readouterr().err


def test_embed_to_npy_refuses_a_name_with_a_line_break_before_loading(run2, tmp_path, capsys, monkeypatch):
    cfg, _ = run2
    images = tmp_path / "imgs"
    images.mkdir()
    for name in ("a.png", "b\nc.png", "d.png"):
        (images / name).write_bytes(_png_bytes((10, 90, 200), size=(20, 24)))
    npy = tmp_path / "emb.npy"
    # paths.txt would have listed it on two lines: every row after it named by the wrong path
    loaded = []
    real = cli_embed.load_backbone
    monkeypatch.setattr(cli_embed, "load_backbone", lambda *a, **k: loaded.append(a) or real(*a, **k))
    assert cli_embed.main(["--checkpoint", cfg.output_dir, "--images", str(images), "--out", str(npy)]) == 2
    assert capsys.readouterr().err == (f"shardfc embed: error: --out {str(npy)!r} lists the paths one per line, but "
                                       "'b\\nc.png' holds a line break: use --out FILE.pt (the paths as a list)\n")
    assert loaded == [] and not npy.exists() and not Path(f"{npy}.paths.txt").exists()
    out = tmp_path / "emb.pt"
    assert cli_embed.main(["--checkpoint", cfg.output_dir, "--images", str(images), "--out", str(out)]) == 0
    assert torch.load(out)["paths"] == ["a.png", "b\nc.png", "d.png"]


def test_eval_synthetic_bin_and_reid(run2, tmp_path, capsys):
    cfg, _ = run2
    # Default targets: the run's own (held-out synthetic pairs).
    assert cli_eval.main(["--checkpoint", cfg.output_dir]) == 0
    assert "synthetic: accuracy" in capsys.readouterr().out

    # An insightface-style .bin: pickled (encoded images, issame), 10 pairs.
    colors = [(25 * i, 100, 255 - 25 * i) for i in range(10)]
    bins = [b for i, c in enumerate(colors) for b in (_png_bytes(c), _png_bytes(c if i % 2 == 0 else colors[-1 - i]))]
    bin_path = tmp_path / "toy.bin"
    bin_path.write_bytes(pickle.dumps((bins, [i % 2 == 0 for i in range(10)])))
    assert cli_eval.main(["--checkpoint", cfg.output_dir, "--bin", str(bin_path), "--json"]) == 0
    metrics = json.loads(capsys.readouterr().out)["metrics"]
    # The CLI reports what the library computes for the checkpoint's backbone on the file's pairs.
    from shardfc.evaluation.verification import evaluate_verification, load_bin

    trained = load_backbone(cfg.output_dir)
    images, issame = load_bin(bin_path, trained.image_size)
    expected = evaluate_verification(trained.model, images, issame)
    assert set(metrics) == {"toy"}
    assert metrics["toy"]["accuracy"] == pytest.approx(expected["accuracy"], abs=1e-12)
    tar_keys = [k for k in expected if k.startswith("tar@far")]
    # An undefined value (too few pairs for the FAR) is JSON's null.
    assert tar_keys and all(
        metrics["toy"][k] is None if np.isnan(expected[k]) else metrics["toy"][k] == pytest.approx(expected[k], abs=1e-12)
        for k in tar_keys
    )

    # A Market-1501 style split: <pid>_c<cam>s1_<frame>_01.jpg in query/ and bounding_box_test/.
    for folder, cam in (("query", 1), ("bounding_box_test", 2)):
        (tmp_path / "market" / folder).mkdir(parents=True)
        for pid in (1, 2, 3):
            img = Image.new("RGB", (8, 16), (70 * pid, 30, 100))
            img.save(tmp_path / "market" / folder / f"{pid:04d}_c{cam}s1_000{pid}00_01.jpg")
    assert cli_eval.main(["--checkpoint", cfg.output_dir, "--reid-root", str(tmp_path / "market")]) == 0
    assert "reid: mAP" in capsys.readouterr().out

    assert cli_eval.main(["--checkpoint", str(tmp_path / "missing")]) == 2
    assert "does not exist" in capsys.readouterr().err


def _write_ijb_release(root: Path) -> None:
    """4 templates of 1-2 faces (2 identities, by colour), their 6 pairs, as IJB-C lays them out."""
    from shardfc.evaluation.alignment import ARCFACE_TEMPLATE

    (root / "meta").mkdir(parents=True)
    (root / "loose_crop").mkdir()
    faces, lmks = [], []
    for face, (tid, mid, color) in enumerate([(1, 1, (200, 40, 40)), (1, 1, (190, 50, 40)), (2, 2, (210, 30, 50)),
                                              (3, 3, (30, 40, 200)), (4, 4, (40, 60, 190)), (4, 5, (20, 40, 210))]):
        Image.new("RGB", (130, 130), color).save(root / "loose_crop" / f"{face}.jpg")
        faces.append(f"{face}.jpg {tid} {mid}")
        lmks.append(" ".join([f"{face}.jpg"] + [f"{v + 5:.3f}" for v in ARCFACE_TEMPLATE.reshape(-1)] + ["0.9"]))
    (root / "meta" / "ijbc_face_tid_mid.txt").write_text("\n".join(faces) + "\n")
    (root / "meta" / "ijbc_name_5pts_score.txt").write_text("\n".join(lmks) + "\n")
    pairs = [f"{a} {b} {int((a < 3) == (b < 3))}" for a in range(1, 5) for b in range(a + 1, 5)]
    (root / "meta" / "ijbc_template_pair_label.txt").write_text("\n".join(pairs) + "\n")


def test_eval_ijb(run2, tmp_path, capsys):
    cfg, _ = run2
    root = tmp_path / "IJBC"
    _write_ijb_release(root)
    argv = ["--checkpoint", cfg.output_dir, "--ijb", str(root), "--ijb-out", str(tmp_path / "ijb_out")]
    assert cli_eval.main(argv + ["--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    metrics = report["metrics"]
    from shardfc.evaluation.ijb import evaluate_ijb

    trained = load_backbone(cfg.output_dir)  # a 16x16 backbone: the aligned 112x112 crops are resized
    expected, scores, _ = evaluate_ijb(trained.model, root, "IJBC", image_size=trained.image_size)
    assert set(metrics) == {"ijbc"}
    # JSON has no NaN: a FAR too small for this few pairs is null, with the reason under "undefined"
    undefined = {k for k, v in expected.items() if not math.isfinite(v)}
    assert undefined and set(report["undefined"]["ijbc"]) == undefined
    assert {k: v for k, v in metrics["ijbc"].items() if k not in undefined} == pytest.approx(
        {k: v for k, v in expected.items() if k not in undefined})
    assert all(metrics["ijbc"][k] is None for k in undefined)
    assert np.allclose(np.load(tmp_path / "ijb_out" / "ijbc_scores.npy"), scores)
    assert (tmp_path / "ijb_out" / "ijbc_roc.csv").is_file()
    negatives = int(metrics["ijbc"]["num_negative_pairs"])
    assert report["undefined"]["ijbc"]["tar@far=1e-6"] == (
        f"FAR 1e-6 needs at least 1000000 negative pairs, this set has {negatives}")
    assert cli_eval.main(argv) == 0
    out = capsys.readouterr().out
    assert "ijbc: TAR@FAR 1e-6 n/a |" in out and "nan" not in out.lower()
    assert cli_eval.main(["--checkpoint", cfg.output_dir, "--ijb", str(tmp_path / "nowhere")]) == 2
    assert "--ijb" in capsys.readouterr().err


def test_a_checkpoint_needing_pickle_is_refused_unless_trusted(run2, tmp_path, capsys):
    cfg, _ = run2
    ckpt = tmp_path / "step_00000006"
    shutil.copytree(Path(cfg.output_dir) / "checkpoints" / "step_00000006", ckpt)
    common = torch.load(ckpt / "common.pt", weights_only=True)
    rewrite_file(ckpt, "common.pt", {**common, "best_accuracy": np.float64(0.5)})  # a numpy scalar: pickled
    out = tmp_path / "model.pt"
    for main, extra in ((cli_eval.main, []), (cli_export.main, ["--out", str(out)])):
        assert main(["--checkpoint", str(ckpt), *extra]) == 2
        err = capsys.readouterr().err
        assert f"refusing to load {ckpt / 'common.pt'}" in err and "--trust-checkpoint" in err
    assert cli_export.main(["--checkpoint", str(ckpt), "--out", str(out), "--trust-checkpoint"]) == 0
    assert out.is_file()
