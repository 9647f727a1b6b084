"""Killing and resuming a run with DataLoader workers gives the weights of the uninterrupted run, bit for bit."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import torch
from PIL import Image

from shardfc.checkpoint import latest_checkpoint
from shardfc.train.loop import train

from ..tiny import tiny_config


def _faces(root: Path) -> Path:
    """6 identities x 5 random 16x16 images (no mirror symmetry, so every flip changes the input)."""
    rng = np.random.default_rng(0)
    for ident in range(6):
        for k in range(5):
            path = root / f"id{ident}" / f"{k}.png"
            path.parent.mkdir(parents=True, exist_ok=True)
            Image.fromarray(rng.integers(0, 256, (16, 16, 3), dtype=np.uint8)).save(path)
    return root


def _weights(run: Path) -> dict:
    ckpt = latest_checkpoint(run / "checkpoints")
    common = torch.load(ckpt / "common.pt", weights_only=True)
    head = torch.load(ckpt / "head_0.pt", weights_only=True)["tensors"]
    return {**{f"backbone.{k}": v for k, v in common["backbone"].items()}, **{f"head.{k}": v for k, v in head.items()}}


def test_resume_with_two_workers_matches_the_uninterrupted_run(tmp_path):
    data = _faces(tmp_path / "faces")
    # 30 images in batches of 4: 8 micro-batches an epoch. The interruption falls mid-epoch and the
    # run crosses an epoch boundary after it. poly_power 0 keeps the learning rate independent of
    # max_steps, so that the two halves train under the schedule of the whole.
    cfg = tiny_config(
        tmp_path / "whole", dataset="folder", data_root=str(data), nproc=1, num_workers=2, batch_size=4,
        grad_accum=1, max_steps=12, warmup_steps=2, poly_power=0.0, log_every=4, ckpt_every=0, eval_every=0,
        synthetic_val_pairs=0,
    )
    assert train(cfg)["step"] == 12
    halves = dataclasses.replace(cfg, output_dir=str(tmp_path / "halves"), max_steps=5)
    assert train(halves)["step"] == 5
    assert train(dataclasses.replace(halves, max_steps=12))["step"] == 12

    whole, resumed = _weights(tmp_path / "whole"), _weights(tmp_path / "halves")
    assert whole.keys() == resumed.keys()
    differ = [k for k in whole if not torch.equal(whole[k], resumed[k])]
    assert not differ, f"resumed run differs from the uninterrupted one in {differ}"
    # The comparison can see a difference: two more steps change the weights.
    more = dataclasses.replace(halves, max_steps=13)
    train(more)
    assert not torch.equal(_weights(tmp_path / "halves")["head.weight"], whole["head.weight"])
