"""The tiny training config the ``shardfc train`` tests share."""

from __future__ import annotations

import dataclasses
from pathlib import Path

from shardfc.train.config import TrainConfig

STEPS = 6


def tiny_config(out: Path, **overrides) -> TrainConfig:
    """A run of seconds: 24 identities x 5 images at 16x16, 8 images per rank, 2 micro-batches per step.

    120 images over 2 ranks are 60 per rank: 7 full batches and one of 4, so the 6 steps (12
    micro-batches) cross an epoch boundary and train on a partial batch.
    """
    cfg = TrainConfig(
        synthetic_identities=24,
        synthetic_images_per_identity=5,
        image_size=[16, 16],
        embedding_dim=16,
        batch_size=8,
        grad_accum=2,
        max_steps=STEPS,
        warmup_steps=2,
        lr=0.05,
        scale=16.0,
        log_every=2,
        ckpt_every=3,
        eval_every=3,
        synthetic_val_pairs=40,
        eval_batch_size=64,
        output_dir=str(out),
        progress=False,
        nproc=2,
    )
    return dataclasses.replace(cfg, **overrides)
