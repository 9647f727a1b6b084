"""The plain dense reference: full ``[B, C]`` logits, margins by autograd, ``F.cross_entropy``.

Written independently of :mod:`shardfc.head.kernels` (the margins here are differentiated by
autograd, not by their hand-written derivatives), it is what the tests hold every sharded mode
to, in float64. Use it to check a configuration, never to train at scale.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor

from shardfc.head import margins as M


def reference_logits(embeddings: Tensor, weight: Tensor, labels: Tensor, margin: M.Margin) -> Tensor:
    """Dense ``[B, C]`` logits with the margin applied to each valid sample's target."""
    x, w = embeddings, weight
    if isinstance(margin, M.SphereFace):
        norm = torch.linalg.vector_norm(x, dim=1, keepdim=True)
        logits = x @ F.normalize(w, dim=1).t()  # ‖x‖·cos θ
        cos = logits / norm
    else:
        if margin.normalize_embeddings:
            x = F.normalize(x, dim=1)
        if margin.normalize_weights:
            w = F.normalize(w, dim=1)
        cos = x @ w.t()
        logits = cos * margin.scale
    rows = torch.nonzero((labels >= 0) & (labels < weight.shape[0])).squeeze(1)
    c = cos[rows, labels[rows]]
    if isinstance(margin, (M.Softmax, M.NormSoftmax)):
        return logits
    if isinstance(margin, M.CosFace):
        t = margin.s * (c - margin.m)
    elif isinstance(margin, M.ArcFace):
        cc = c.clamp(-1, 1)
        phi = torch.cos(torch.acos(cc) + margin.m)
        if margin.easy_margin:
            phi = torch.where(cc > 0, phi, cc)
        else:
            phi = torch.where(cc > math.cos(math.pi - margin.m), phi, cc - margin.m * math.sin(margin.m))
        t = margin.s * phi
    elif isinstance(margin, M.Combined):
        t = margin.s * (torch.cos(margin.m1 * torch.acos(c.clamp(-1, 1)) + margin.m2) - margin.m3)
    elif isinstance(margin, M.SphereFace):
        theta = torch.acos(c.clamp(-1, 1))
        k = torch.floor(margin.m * theta.detach() / math.pi)
        psi = (-1.0) ** k * torch.cos(margin.m * theta) - 2 * k
        t = norm[rows, 0] * (margin.lambda_ * c + psi) / (1 + margin.lambda_)
    else:
        raise TypeError(f"no reference for margin {margin!r}")
    logits = logits.index_put((rows, labels[rows]), t)
    return logits


def reference_loss(
    embeddings: Tensor,
    weight: Tensor,
    labels: Tensor,
    margin: M.Margin,
    *,
    label_smoothing: float = 0.0,
    ignore_index: int = -1,
    reduction: str = "mean",
) -> Tensor:
    """The loss of ``ShardedMarginHead`` on one process with the full ``[C, D]`` weight.

    ``mean`` over zero valid samples is 0 here (as in the head), where ``F.cross_entropy`` gives NaN.
    """
    labels = labels.long()
    logits = reference_logits(embeddings, weight, labels, margin)
    losses = F.cross_entropy(
        logits, labels, label_smoothing=label_smoothing, ignore_index=ignore_index, reduction="none"
    )
    if reduction == "none":
        return losses
    if reduction == "sum":
        return losses.sum()
    return losses.sum() / (labels != ignore_index).sum().clamp(min=1)
