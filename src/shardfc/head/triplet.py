"""Batch-hard triplet loss over the *global* batch of a data-parallel run.

For each anchor ``i`` of the global batch, the hardest positive is the farthest sample with the
same label (itself excluded) and the hardest negative the closest sample with another label
("In Defense of the Triplet Loss for Person Re-Identification", Hermans et al., 2017). The loss of
the anchor is ``max(0, d(a, p) - d(a, n) + margin)`` or, soft-margin, ``log(1 + exp(d(a, p) - d(a, n)))``,
with ``d`` the Euclidean distance; the batch loss is the mean over anchors that have both a positive
and a negative (an anchor alone with its label, or a batch of one label, has no triplet).

Distributed: every rank gathers the features of all ranks (an autograd all-gather whose backward
reduce-scatters, :func:`~shardfc.parallel.collectives.gather_rows_forward_reduce_scatter_backward`),
mines the triplets of *its own* anchors against the global batch (``[B_r, B]`` distances, not
``[B, B]`` on every rank) and adds its anchors' losses. The backward sums, for each rank's features,
the gradients of every rank's part: the exact gradient of the global loss. Every rank returns the
same value (the global mean), while the gradient flows through its own part only.
"""

from __future__ import annotations

import math
from typing import List, Optional

import torch
from torch import Tensor, nn

from shardfc.head.validation import raise_or_exchange_sizes
from shardfc.parallel.collectives import gather_rows_forward_reduce_scatter_backward
from shardfc.parallel.context import DistContext

__all__ = ["BatchHardTripletLoss", "batch_hard_triplet_terms", "pairwise_distances"]

#: Squared distances are clamped here before the square root: its gradient at 0 is infinite, and
#: two copies of one image (P x K sampling with replacement) sit at distance 0.
_MIN_SQUARED_DISTANCE = 1e-12


def pairwise_distances(a: Tensor, b: Tensor) -> Tensor:
    """Euclidean distances ``[len(a), len(b)]`` via ``|a|^2 + |b|^2 - 2 a.b`` (one matmul)."""
    sq = a.pow(2).sum(1, keepdim=True) + b.pow(2).sum(1)[None, :] - 2.0 * (a @ b.t())
    return sq.clamp(min=_MIN_SQUARED_DISTANCE).sqrt()


def batch_hard_triplet_terms(
    anchors: Tensor, anchor_labels: Tensor, anchor_index: Tensor, batch: Tensor, labels: Tensor,
    margin: float, soft: bool,
) -> tuple[Tensor, Tensor]:
    """Per-anchor losses and which anchors count: ``(losses [A], valid [A] bool)``.

    ``anchors`` are the rows ``anchor_index`` of ``batch`` (so an anchor is not its own positive).
    """
    dist = pairwise_distances(anchors, batch)  # [A, B]
    same = anchor_labels[:, None] == labels[None, :]
    self_pair = torch.arange(len(batch), device=batch.device)[None, :] == anchor_index[:, None]
    positive = same & ~self_pair
    negative = ~same
    valid = positive.any(1) & negative.any(1)
    # Masked max / min: filling with -inf / +inf keeps the masked entries out of the gradient.
    hardest_pos = dist.masked_fill(~positive, float("-inf")).amax(1)
    hardest_neg = dist.masked_fill(~negative, float("inf")).amin(1)
    gap = torch.where(valid, hardest_pos - hardest_neg, torch.zeros_like(hardest_pos))
    losses = nn.functional.softplus(gap) if soft else (gap + margin).clamp(min=0)
    return torch.where(valid, losses, torch.zeros_like(losses)), valid


def _check_inputs(features: Tensor, labels: Tensor) -> Optional[Exception]:
    if not isinstance(features, Tensor) or features.ndim != 2 or not features.is_floating_point():
        what = f"shape {tuple(features.shape)}, dtype {features.dtype}" if isinstance(features, Tensor) else type(features).__name__
        return ValueError(f"features must be a float tensor [B, D], got {what}")
    if not isinstance(labels, Tensor) or labels.ndim != 1 or labels.is_floating_point() or labels.is_complex():
        what = f"shape {tuple(labels.shape)}, dtype {labels.dtype}" if isinstance(labels, Tensor) else type(labels).__name__
        return ValueError(f"labels must be an integer tensor [B], got {what}")
    if labels.shape[0] != features.shape[0]:
        return ValueError(f"labels has {labels.shape[0]} entries but features has {features.shape[0]} rows")
    return None


class BatchHardTripletLoss(nn.Module):
    """Batch-hard triplet loss of the global batch (see the module docstring).

    Args:
        margin: the hinge margin (ignored when ``soft``); Luo et al. use 0.3.
        soft: soft-margin variant ``softplus(d(a, p) - d(a, n))`` instead of the hinge.
        context: the ranks the batch is spread over (default: :meth:`DistContext.resolve`).
        grad_scale: multiplies the features' gradient; default the world size, so that a
            data-parallel backbone that *averages* gradients over ranks (DDP, Horovod) gets the
            exact gradient, as the sharded head does. Pass 1.0 for the plain gradient. A finite
            number > 0.

    ``forward(features [B_r, D], labels [B_r])`` -> the mean loss over the global batch's valid
    anchors, the same on every rank (0, still connected to ``features``, if there is none).
    Collective: every rank of the group must call it, with any local batch size (0 included).
    """

    def __init__(
        self, margin: float = 0.3, soft: bool = False, context: Optional[DistContext] = None,
        grad_scale: Optional[float] = None,
    ) -> None:
        super().__init__()
        if isinstance(margin, bool) or not isinstance(margin, (int, float)) or not 0 <= margin < math.inf:
            raise ValueError(f"margin must be a finite number >= 0, got {margin!r}")
        self.margin = float(margin)
        self.soft = bool(soft)
        self.ctx = context if context is not None else DistContext.resolve()
        if grad_scale is not None and (isinstance(grad_scale, bool) or not isinstance(grad_scale, (int, float))
                                       or not 0 < grad_scale < math.inf):
            # a negative one turned the features' gradient around, NaN made it NaN, 0 took it away
            raise ValueError(f"grad_scale must be a finite number > 0 (or None: the world size), got {grad_scale!r}")
        self.grad_scale = float(self.ctx.world_size if grad_scale is None else grad_scale)

    def forward(self, features: Tensor, labels: Tensor) -> Tensor:
        error = _check_inputs(features, labels)
        # (not features.shape on a list: its error would be an AttributeError, on this rank alone)
        local = features.shape[0] if isinstance(features, Tensor) and features.ndim else 0
        sizes: List[int] = raise_or_exchange_sizes(error, local, self.ctx)
        if sum(sizes) == 0:  # nothing anywhere: a zero loss still connected to the features
            return features.sum().float() * 0
        # Distances in float32 at least, also under autocast: a bf16 |a|^2 + |b|^2 - 2ab cancels badly.
        with torch.autocast(features.device.type, enabled=False):
            return self._global_mean(features, labels, sizes)

    def _global_mean(self, features: Tensor, labels: Tensor, sizes: List[int]) -> Tensor:
        compute = torch.float64 if features.dtype == torch.float64 else torch.float32
        x = features.to(compute)
        labels = labels.to(device=features.device, dtype=torch.int64)
        if self.ctx.distributed:
            everyone = gather_rows_forward_reduce_scatter_backward(x, sizes, self.ctx, grad_scale=self.grad_scale)
            all_labels = self.ctx.all_gather_rows(labels, sizes)
        else:  # the same value with the gradient times grad_scale, as the gather's backward would give
            everyone = x if self.grad_scale == 1 else x * self.grad_scale - (x * (self.grad_scale - 1)).detach()
            all_labels = labels
        offset = sum(sizes[: self.ctx.rank])
        mine = torch.arange(offset, offset + sizes[self.ctx.rank], device=x.device)
        losses, valid = batch_hard_triplet_terms(
            everyone[mine], all_labels[mine], mine, everyone, all_labels, self.margin, self.soft
        )
        part = losses.sum()
        totals = torch.stack([part.detach(), valid.sum().to(compute)])
        self.ctx.all_reduce_(totals)
        count = totals[1].clamp(min=1)
        # The value is the global mean; the gradient is that of this rank's part only (the other
        # ranks' parts reach these features through the gather's backward).
        mean_part = part / count
        return mean_part + (totals[0] / count - mean_part).detach()

    def extra_repr(self) -> str:
        kind = "soft" if self.soft else f"margin={self.margin}"
        return f"{kind}, rank {self.ctx.rank}/{self.ctx.world_size}"
