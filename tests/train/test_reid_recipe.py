"""The re-ID strong-baseline recipe end to end through ``shardfc train`` on a synthetic Market-1501 folder.

Synthetic identities are written as Market-1501 files (``bounding_box_train/``, ``query/``,
``bounding_box_test/``, person and camera in the names, distractors and junk included); training
identities and test identities are disjoint, as in Market-1501. The trained model must rank the
gallery better than chance, computed from the data (the expected AP of a random ranking), and
better than the same network untrained.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from shardfc.cli import train as train_cli
from shardfc.data import SyntheticIdentities
from shardfc.evaluation import evaluate_reid, load_reid_split
from shardfc.models import build_backbone
from shardfc.train.config import parse_config

SIZE = (32, 16)
TRAIN_IDS, TEST_IDS = 32, 10


def _save(path: Path, image: torch.Tensor) -> None:
    pixels = ((image.permute(1, 2, 0).numpy() + 1) * 127.5).round().clip(0, 255).astype(np.uint8)
    Image.fromarray(pixels).save(path)


@pytest.fixture(scope="module")
def market(tmp_path_factory) -> Path:
    """A Market-1501 style folder of synthetic people: 32 training, 10 test identities."""
    root = tmp_path_factory.mktemp("market")
    for split in ("bounding_box_train", "query", "bounding_box_test"):
        (root / split).mkdir()
    people = SyntheticIdentities(TRAIN_IDS + TEST_IDS, 40, SIZE, seed=11)
    rng = np.random.default_rng(0)
    frame = 0

    def write(split: str, pid: int, identity: int, index: int, cam: int) -> None:
        nonlocal frame
        frame += 1
        _save(root / split / f"{pid:04d}_c{cam}s1_{frame:06d}_00.png", people.render(identity, index))

    for ident in range(TRAIN_IDS):  # 2 to 9 images each: some identities have fewer than K = 4
        for i in range(int(rng.integers(2, 10))):
            write("bounding_box_train", ident + 1, ident, i, int(rng.integers(1, 7)))
    for ident in range(TRAIN_IDS, TRAIN_IDS + TEST_IDS):
        pid = ident + 1
        for i in range(2):
            write("query", pid, ident, i, 1)
        write("bounding_box_test", pid, ident, 2, 1)  # same camera as the queries: excluded
        for i in range(3, 8):
            write("bounding_box_test", pid, ident, i, 2 + i % 5)
    for i in range(6):  # distractors (pid 0) stay in the gallery; junk (pid -1) is dropped
        write("bounding_box_test", 0, i % TRAIN_IDS, 30 + i, 3)
        write("bounding_box_test", -1, TRAIN_IDS + i % TEST_IDS, 30 + i, 2)
    return root


def chance_map(root: Path) -> float:
    """Expected mAP of a random ranking: per query, E[AP] of R matches among N ranked gallery entries
    is (R - 1) / (N - 1) + (N - R) / (N (N - 1)) * H_N (H_N the N-th harmonic number)."""
    query, gallery = load_reid_split(root, image_size=SIZE)
    aps = []
    for pid, cam in zip(query.pids.tolist(), query.cams.tolist()):
        same_pid = gallery.pids == pid
        ranked = ~(same_pid & (gallery.cams == cam))  # junk is already out of the gallery
        n, r = int(ranked.sum()), int((same_pid & ranked).sum())
        harmonic = sum(1.0 / k for k in range(1, n + 1))
        aps.append((r - 1) / (n - 1) + (n - r) / (n * (n - 1)) * harmonic)
    return float(np.mean(aps))


def _recipe_flags(root: Path, out: Path) -> list:
    return [
        "--dataset", "market1501", "--data-root", str(root), "--reid-root", str(root),
        "--image-size", str(SIZE[0]), str(SIZE[1]), "--sampler", "pk", "--pk-instances", "4",
        "--random-erasing", "0.5", "--triplet-weight", "1.0", "--triplet-margin", "0.3",
        "--nproc", "2", "--batch-size", "8", "--output-dir", str(out), "--no-progress",
        "--eval-batch-size", "64",
    ]


def test_recipe_learns_to_rank_beyond_chance(market, tmp_path):
    cfg, _ = parse_config(_recipe_flags(market, tmp_path / "run") + [
        "--backbone", "tiny", "--embedding-dim", "32", "--margin", "cosface", "--scale", "16",
        "--optimizer", "adamw", "--lr", "0.003", "--weight-decay", "0.0005", "--grad-clip", "0",
        "--max-steps", "60", "--warmup-steps", "5", "--eval-every", "30", "--ckpt-every", "0", "--log-every", "20",
    ])
    summary = train_cli.run(cfg)
    trained = summary["metrics"]["reid"]
    torch.manual_seed(cfg.seed)  # the initialisation the run started from
    untrained_model = build_backbone("tiny", 32, input_size=SIZE)
    untrained = evaluate_reid(untrained_model.eval(), market, image_size=SIZE)
    chance = chance_map(market)
    print(f"mAP: trained {trained['mAP']:.3f}, untrained {untrained['mAP']:.3f}, chance {chance:.3f}")
    assert trained["num_valid_queries"] == 2 * TEST_IDS
    assert trained["mAP"] > chance
    assert trained["mAP"] > untrained["mAP"] + 0.05
    assert (tmp_path / "run" / "metrics.csv").read_text().count("reid") >= 1


def test_market1501_preset_runs_the_resnet50_recipe(market, tmp_path):
    """The preset as shipped (resnet50, BNNeck, triplet, P x K, erasing), shrunk to CPU size."""
    cfg, _ = parse_config([
        "--preset", "market1501", "--data-root", str(market), "--image-size", "32", "16",
        "--nproc", "2", "--batch-size", "8", "--embedding-dim", "64", "--amp", "none", "--num-workers", "0",
        "--max-steps", "2", "--warmup-steps", "1", "--eval-every", "0", "--ckpt-every", "0",
        "--output-dir", str(tmp_path / "r50"), "--no-progress",
    ])
    assert cfg.reid_root == str(market)  # --data-root alone also points the evaluation at the release
    assert (cfg.backbone, cfg.neck, cfg.sampler, cfg.triplet_weight) == ("resnet50", "bnneck", "pk", 1.0)
    summary = train_cli.run(cfg)
    metrics = summary["metrics"]["reid"]
    assert summary["step"] == 2 and 0.0 <= metrics["mAP"] <= 1.0 and metrics["num_valid_queries"] == 2 * TEST_IDS
