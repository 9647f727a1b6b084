"""How the re-ID recipe enters a training step: the summed losses, and random erasing in the batch stream."""

from __future__ import annotations

import dataclasses

import torch

from shardfc.data import SyntheticIdentities
from shardfc.head import ShardedMarginHead
from shardfc.head.triplet import BatchHardTripletLoss
from shardfc.models import build_backbone
from shardfc.parallel.context import DistContext
from shardfc.train.config import TrainConfig
from shardfc.train.loader.data import micro_batches, rank_batches
from shardfc.train.state import Parts, RunState
from shardfc.train.step import micro_batch_loss


def _parts(triplet):
    torch.manual_seed(0)
    backbone = build_backbone("tiny", 8, input_size=(16, 8)).train()
    head = ShardedMarginHead(8, 5, context=DistContext())
    return Parts(backbone, head, None, None, [], None, triplet)


def test_step_loss_is_head_loss_plus_weighted_triplet_of_pre_neck_features():
    images, labels = torch.randn(12, 3, 16, 8), torch.tensor([0, 1, 2, 3, 4, 0, 1, 2, 3, 4, 0, 1])
    parts = _parts(BatchHardTripletLoss(0.3, context=DistContext()))
    loss = micro_batch_loss(parts, images, labels, 0.7)
    feature, embedding = parts.backbone(images, with_features=True)
    head_only = parts.head(embedding, labels)
    triplet = parts.triplet(feature, labels)
    assert triplet > 0 and not torch.allclose(triplet, parts.triplet(embedding, labels))
    assert torch.allclose(loss, head_only + 0.7 * triplet)
    assert torch.allclose(micro_batch_loss(_parts(None), images, labels, 0.7), head_only)


def test_random_erasing_in_the_stream_is_reproducible_across_a_resume():
    data = SyntheticIdentities(6, 4, (16, 8), seed=0, random_flip=False)
    cfg = TrainConfig(sampler="pk", pk_instances=2, batch_size=4, random_erasing=1.0)
    ctx = DistContext()

    def batches_from(start):
        state = RunState(epoch=1, batch_in_epoch=start)
        stream = micro_batches(data, rank_batches(cfg, data, 4, ctx), state, cfg, ctx)
        return [next(stream) for _ in range(3)]

    full, resumed = batches_from(0), batches_from(1)
    for (a, la, _), (b, lb, _) in zip(full[1:], resumed):
        assert torch.equal(la, lb) and torch.equal(a, b)  # same images, same rectangles erased
    plain = micro_batches(data, rank_batches(dataclasses.replace(cfg, random_erasing=0.0), data, 4, ctx),
                          RunState(epoch=1), dataclasses.replace(cfg, random_erasing=0.0), ctx)
    clean, labels, _ = next(plain)
    erased = full[0][0]
    assert torch.equal(labels, full[0][1])
    changed = (clean != erased).any(1)  # [N, H, W]
    assert changed.flatten(1).any(1).sum() >= 3 and (erased[changed.unsqueeze(1).expand_as(erased)] == 0).all()
