"""Decode once: under the pipeline strategy only the first stage reads images; the others walk the
same batches (and the same epoch bookkeeping) without loading any."""

from __future__ import annotations

import dataclasses

import torch
from torch.utils.data import Dataset

from shardfc.parallel.context import DistContext
from shardfc.parallel.pipeline import PipelineLayout
from shardfc.train.builder.pipeline_train import stage_stream
from shardfc.train.loader.data import ShardBatches
from shardfc.train.state import RunState

from ..tiny import tiny_config


class Counting(Dataset):
    """30 images; counts every read."""

    def __init__(self) -> None:
        self.reads = 0

    def __len__(self) -> int:
        return 30

    def __getitem__(self, i: int):
        self.reads += 1
        return torch.full((3, 4, 4), float(i)), i % 5


def _stream(tmp_path, stage: int):
    cfg = dataclasses.replace(tiny_config(tmp_path), num_workers=0, drop_last=False, random_erasing=0.0)
    ctx = DistContext.resolve()
    layout = PipelineLayout(3, 1, stage, 0, None, ctx, ctx)
    data, state = Counting(), RunState()
    batches = ShardBatches(len(data), 8, 0, 1, cfg.seed, drop_last=False)
    return data, state, stage_stream(data, batches, state, cfg, ctx, layout)


def test_only_the_first_stage_decodes_and_every_stage_walks_the_same_batches(tmp_path):
    first, first_state, first_stream = _stream(tmp_path, 0)
    others = [_stream(tmp_path, k) for k in (1, 2)]
    rows_read = 0
    for _ in range(9):  # 30 images in batches of 8, 8, 8, 6: over two epochs
        images, labels, skipped = next(first_stream)
        rows_read += images.shape[0]
        for data, state, stream in others:
            assert next(stream) == images.shape[0]
            assert (state.epoch, state.batch_in_epoch) == (first_state.epoch, first_state.batch_in_epoch)
    assert first_state.epoch == 2 and first.reads == rows_read == 2 * 30 + 8
    assert all(data.reads == 0 for data, _, _ in others)  # never decoded an image
