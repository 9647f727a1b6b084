"""Training on an insightface release folder: train.rec / train.idx / property with its .bin beside it."""

from __future__ import annotations

import io
import pickle

from PIL import Image

from shardfc.cli import data as data_cli
from shardfc.data.recordio import RecordIODataset
from shardfc.train.config import parse_config
from shardfc.train.loop import train


def _png(color) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", (16, 16), color).save(buf, format="PNG")
    return buf.getvalue()


def test_data_root_of_a_release_folder_trains_on_its_recordio_and_evaluates_its_bins(tmp_path):
    src = tmp_path / "images"
    for c in range(6):
        (src / f"id{c}").mkdir(parents=True)
        for k in range(4):
            Image.new("RGB", (16, 16), (40 * c, 20 * k, 200 - 30 * c)).save(src / f"id{c}" / f"{k}.png")
    release = tmp_path / "release"
    assert data_cli.main(["pack", str(src), str(release)]) == 0
    colors = [(25 * i, 100, 255 - 25 * i) for i in range(10)]
    pairs = [b for i, c in enumerate(colors) for b in (_png(c), _png(c if i % 2 == 0 else colors[-1 - i]))]
    (release / "lfw.bin").write_bytes(pickle.dumps((pairs, [i % 2 == 0 for i in range(10)])))

    cfg, _ = parse_config([
        "--data-root", str(release), "--val-bins", "lfw.bin", "--backbone", "tiny", "--image-size", "16", "16",
        "--embedding-dim", "8", "--batch-size", "8", "--max-steps", "2", "--nproc", "1", "--no-progress",
        "--output-dir", str(tmp_path / "run"),
    ])
    assert cfg.dataset == "recordio"  # found train.rec: no --dataset needed
    summary = train(cfg)
    assert summary["step"] == 2
    assert set(summary["metrics"]) == {"lfw"}  # lfw.bin found beside train.rec
    assert RecordIODataset(release, (16, 16)).num_classes == 6
    assert "6 classes" in (tmp_path / "run" / "train.log").read_text()
