"""After Sub-center ArcFace training: keep each class's dominant centre, flag the noisy samples.

Sub-center ArcFace (Deng et al., ECCV 2020) trains ``K`` centres per class so that clean faces
gather around one dominant centre and noisy or hard ones around the others. After training the
paper keeps, for each class, the centre most of its samples are nearest to, and treats the
samples far from it (an angle above ~75°) as label noise to drop before training again.

Usage, over the training set (each rank passes its own batches, every rank calls each step)::

    counts = None
    for x, y in loader:
        counts = subcenter_counts(head, backbone(x), y, counts)
    drop_subcenters(head, counts)                       # head.subcenters is now 1
    noisy = noisy_samples(head, backbone(x), y, max_angle=75.0)   # per batch: bool [B_r]

``drop_subcenters`` replaces the weight parameters: build the head optimizer afterwards.
"""

from __future__ import annotations

import math
from typing import List, Optional, Tuple

import torch
from torch import Tensor, nn

from shardfc.head.normalize import l2_normalize
from shardfc.head.validation import check_batch_and_exchange_sizes

__all__ = ["subcenter_counts", "drop_subcenters", "noisy_samples"]


def _global_batch(head, embeddings: Tensor, labels: Tensor) -> Tuple[Tensor, Tensor, List[int]]:
    """The global batch's unit embeddings and labels on this process, and the local batch sizes."""
    sizes = check_batch_and_exchange_sizes(
        embeddings, labels, embedding_dim=head.embedding_dim, num_classes=head.num_classes,
        ignore_index=head.ignore_index, ctx=head.ctx,
    )
    x = l2_normalize(embeddings.detach())
    labels = labels.to(device=embeddings.device, dtype=torch.int64)
    if head.distributed:
        x, labels = head.ctx.all_gather_rows(x, sizes), head.ctx.all_gather_rows(labels, sizes)
    return x, labels, sizes


def _best_centre_cos(head, x: Tensor, labels: Tensor):
    """Per shard: (samples whose label it holds, their class row, cosine to each of its K centres)."""
    K = head.subcenters
    out = []
    for w, r in zip(head.shard_weights, head.shard_ranges):
        rows = torch.nonzero((labels >= r.start) & (labels < r.stop)).squeeze(1).to(w.device)
        cls = labels.to(w.device)[rows] - r.start
        centres = l2_normalize(w.detach()).view(-1, K, w.shape[1])[cls]  # [N, K, D]
        cos = (centres @ x.to(w.device, w.dtype)[rows].unsqueeze(2)).squeeze(2)
        out.append((rows, cls, cos))
    return out


@torch.no_grad()
def subcenter_counts(head, embeddings: Tensor, labels: Tensor, counts: Optional[Tensor] = None) -> Tensor:
    """``[n_local, K]`` int64: for each class this process holds, how many samples of the global batch
    (every rank's) are nearest to each of its centres, added to ``counts`` (a previous result)."""
    K, n = head.subcenters, len(head.class_range)
    if counts is None:
        counts = torch.zeros(n, K, dtype=torch.int64)
    elif tuple(counts.shape) != (n, K):
        raise ValueError(f"counts must have shape ({n}, {K}) (this process's classes, subcenters), got {tuple(counts.shape)}")
    x, labels, _ = _global_batch(head, embeddings, labels)
    for (rows, cls, cos), r in zip(_best_centre_cos(head, x, labels), head.shard_ranges):
        flat = (cls + (r.start - head.class_range.start)) * K + cos.argmax(dim=1)
        counts.view(-1).index_add_(0, flat.cpu(), torch.ones_like(flat, device="cpu"))
    return counts


@torch.no_grad()
def drop_subcenters(head, counts: Tensor) -> None:
    """Keep each class's dominant centre (most samples in ``counts``; the lowest index on a tie, so
    centre 0 for a class no sample reached). The head becomes an ordinary one (``subcenters=1``)."""
    K, n = head.subcenters, len(head.class_range)
    if K == 1:
        raise ValueError("drop_subcenters needs a head with subcenters > 1, got subcenters=1")
    if tuple(counts.shape) != (n, K):
        raise ValueError(f"counts must have shape ({n}, {K}) (this process's classes, subcenters), got {tuple(counts.shape)}")
    dominant = counts.argmax(dim=1)  # first maximum: lowest index on ties
    base = head.class_range.start
    kept = []
    for w, r in zip(head.shard_weights, head.shard_ranges):
        pick = dominant[r.start - base : r.stop - base].to(w.device)
        rows = torch.arange(len(r), device=w.device) * K + pick
        kept.append(nn.Parameter(w.detach()[rows].clone()))
    if head.mode == "devices":
        head.shards = nn.ParameterList(kept)
    else:
        head.weight = kept[0]
    head.subcenters = 1
    head.forget_sampled_rows()


@torch.no_grad()
def noisy_samples(head, embeddings: Tensor, labels: Tensor, max_angle: float = 75.0) -> Tensor:
    """bool ``[B_r]``: this rank's samples whose angle (degrees) to their class's nearest centre (the
    dominant one, after :func:`drop_subcenters`) exceeds ``max_angle``. Ignored labels are never noisy."""
    if isinstance(max_angle, bool) or not isinstance(max_angle, (int, float)) or not 0 < max_angle < 180:
        raise ValueError(f"max_angle must be a number of degrees in (0, 180), got {max_angle!r}")
    x, labels, sizes = _global_batch(head, embeddings, labels)
    noisy = torch.zeros(labels.shape[0], dtype=torch.int64, device=head.devices[0])
    threshold = math.cos(math.radians(max_angle))
    for rows, _, cos in _best_centre_cos(head, x, labels):
        noisy[rows.to(noisy.device)] = (cos.amax(dim=1) < threshold).to(noisy.device, torch.int64)
    if head.distributed:  # each sample's flag is set by its label's owner only
        head.ctx.all_reduce_(noisy, "sum")
    lo = sum(sizes[: head.rank])
    return noisy[lo : lo + sizes[head.rank]].to(embeddings.device).bool()
