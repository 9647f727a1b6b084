"""The designs shardfc replaces, with the same margins and the same gradient convention.

* :class:`NaiveParallelHead` — "just write it like this": each shard computes its dense logits,
  all logits are concatenated on rank 0 (or device 0) and ``F.cross_entropy`` runs there. Rank 0
  holds ``[B, C]`` logits and moves ``O(B · C)`` bytes: the bottleneck the project exists to remove.
* :class:`ReplicatedHead` — pure data parallel: the full ``[C, D]`` FC on every rank. Average its
  gradients over ranks (wrap it in DDP with the backbone, or call :meth:`ReplicatedHead.average_gradients`).

Both compute exactly the loss of :class:`shardfc.ShardedMarginHead` (tests hold them to the dense
reference) and exist for comparison in ``shardfc bench``.
"""

from __future__ import annotations

from typing import List, Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn

from shardfc.checks import check_positive_int, check_seed
from shardfc.head import margins as _margins
from shardfc.head.module import ShardedMarginHead, init_rows
from shardfc.head.reference import reference_logits
from shardfc.head.validation import check_batch_and_exchange_sizes, check_head_options
from shardfc.parallel.collectives import (
    all_gather_rows,
    all_reduce,
    broadcast_from_root,
    gather_rows_forward_reduce_scatter_backward,
    gather_to_root,
    group_rank,
    scatter_from_root,
)
from shardfc.parallel.context import DistContext


def _loss_dtype(logits_dtype: torch.dtype) -> torch.dtype:
    """The dtype the losses of logits of ``logits_dtype`` are computed in: fp32 for fp16 / bf16."""
    return torch.float32 if logits_dtype in (torch.float16, torch.bfloat16) else logits_dtype


def _dense_losses(logits: Tensor, labels: Tensor, head) -> Tensor:
    return F.cross_entropy(
        logits.to(_loss_dtype(logits.dtype)),
        labels,
        label_smoothing=head.label_smoothing,
        ignore_index=head.ignore_index,
        reduction="none",
    )


class _GatherColumnsToRoot(torch.autograd.Function):
    """Logit columns of every rank concatenated on rank 0 forward; scattered back backward."""

    @staticmethod
    def forward(ctx, logits: Tensor, widths: List[int], group) -> Tensor:
        ctx.widths, ctx.group, ctx.shape = widths, group, logits.shape
        pad = max(widths) - logits.shape[1]
        parts = gather_to_root(F.pad(logits, (0, pad)), group)
        if parts is None:
            return logits.new_empty(logits.shape[0], 0)
        return torch.cat([p[:, :w] for p, w in zip(parts, widths)], dim=1)

    @staticmethod
    def backward(ctx, grad: Tensor):
        width = max(ctx.widths)
        like = grad.new_empty(ctx.shape[0], width)
        parts = None
        if group_rank(ctx.group) == 0:
            parts = [F.pad(p, (0, width - p.shape[1])) for p in grad.split(ctx.widths, dim=1)]
        mine = scatter_from_root(parts, like, ctx.group)
        return mine[:, : ctx.shape[1]], None, None


class NaiveParallelHead(ShardedMarginHead):
    """Class-sharded weights, but the loss on concatenated logits on rank 0 / device 0.

    Same constructor as :class:`ShardedMarginHead` (no ``chunk_size`` / ``sample_rate``);
    ``reduction`` is ``"mean"`` or ``"sum"``. Assumes every rank back-propagates the same scalar.
    """

    def __init__(self, embedding_dim: int, num_classes: int, margin: Optional[_margins.Margin] = None, **kwargs):
        for unsupported in ("chunk_size", "sample_rate"):
            if kwargs.get(unsupported) not in (None, 1.0):
                raise ValueError(f"NaiveParallelHead does not support {unsupported}={kwargs[unsupported]!r}")
        if kwargs.get("reduction", "mean") not in ("mean", "sum"):
            raise ValueError(f"NaiveParallelHead supports reduction 'mean' or 'sum', got {kwargs['reduction']!r}")
        super().__init__(embedding_dim, num_classes, margin, **kwargs)

    def forward(self, embeddings: Tensor, labels: Tensor) -> Tensor:
        sizes = self._check_and_exchange(embeddings, labels)
        labels = labels.to(device=embeddings.device, dtype=torch.int64)
        if self.distributed:
            x = gather_rows_forward_reduce_scatter_backward(embeddings, sizes, self.group, grad_scale=self.world_size)
            labels = all_gather_rows(labels, sizes, self.group)
        else:
            x = embeddings
        logits = []
        for w, r, d in zip(self.shard_weights, self.shard_ranges, self.devices):
            local = labels.to(d) - r.start  # outside [0, len(r)): no target here (reference_logits skips it)
            logits.append(reference_logits(x.to(d), w, local, self.margin))
        home = self.devices[0]
        if self.distributed:
            widths = [len(r) for r in self._all_ranges()]
            full = _GatherColumnsToRoot.apply(logits[0], widths, self.group)
        else:
            full = torch.cat([z.to(home) for z in logits], dim=1)
        # The loss's dtype on every rank (rank 0 broadcasts it: a buffer of another size elsewhere aborts gloo)
        value = torch.zeros((), dtype=_loss_dtype(full.dtype), device=home)
        loss = None
        if full.shape[1] == self.num_classes:  # rank 0 / device 0: the whole [B, C] is here
            losses = _dense_losses(full, labels.to(home), self)
            loss = losses.sum()
            if self.reduction == "mean":
                loss = loss / (labels != self.ignore_index).sum().clamp(min=1)
            value = loss.detach().clone()
        if self.distributed:
            broadcast_from_root(value, self.group)
            if loss is None:  # keep this rank in the backward's scatter
                loss = full.sum() * 0 + value
        return loss.to(embeddings.device)

    def _all_ranges(self):
        from shardfc.head.layout import class_ranges

        return class_ranges(self.num_classes, self.world_size)


class ReplicatedHead(nn.Module):
    """The full ``[C, D]`` classifier on every rank (pure data parallel).

    ``reduction="mean"`` returns the global-batch mean on every rank, scaled for gradients the
    DDP way: after :meth:`average_gradients` (or DDP) every gradient matches
    :class:`ShardedMarginHead`'s.
    """

    def __init__(
        self,
        embedding_dim: int,
        num_classes: int,
        margin: Optional[_margins.Margin] = None,
        group: Optional[dist.ProcessGroup] = None,
        label_smoothing: float = 0.0,
        ignore_index: int = -1,
        reduction: str = "mean",
        init_seed: int = 0,
        device=None,
        dtype: Optional[torch.dtype] = None,
    ):
        super().__init__()
        if reduction not in ("mean", "sum", "none"):
            raise ValueError(f"reduction must be 'mean', 'sum' or 'none', got {reduction!r}")
        # the sharded head's own checks: a baseline compared with it must compute the same loss
        label_smoothing = check_head_options(label_smoothing=label_smoothing).label_smoothing
        embedding_dim = check_positive_int("embedding_dim", embedding_dim)
        num_classes = check_positive_int("num_classes", num_classes)
        self.embedding_dim, self.num_classes = embedding_dim, num_classes
        self.margin = _margins.ArcFace() if margin is None else margin
        self.label_smoothing, self.ignore_index, self.reduction = label_smoothing, ignore_index, reduction
        self.ctx = DistContext.resolve(group)
        self.distributed, self.group, self.world_size = self.ctx.distributed, self.ctx.group, self.ctx.world_size
        w = init_rows(0, num_classes, embedding_dim, check_seed("init_seed", init_seed))
        self.weight = nn.Parameter(w.to(device=device, dtype=dtype or torch.float32))

    def forward(self, embeddings: Tensor, labels: Tensor) -> Tensor:
        check_batch_and_exchange_sizes(
            embeddings, labels, embedding_dim=self.embedding_dim, num_classes=self.num_classes,
            ignore_index=self.ignore_index, ctx=self.ctx,
        )
        labels = labels.long()
        losses = _dense_losses(reference_logits(embeddings, self.weight, labels, self.margin), labels, self)
        if self.reduction == "none":
            return losses
        W = self.world_size
        local = losses.sum() * W  # × W: the average over ranks of the returned losses is the objective
        if self.reduction == "mean":
            count = (labels != self.ignore_index).sum().to(losses.dtype)
            if self.distributed:
                all_reduce(count, dist.ReduceOp.SUM, self.group)
            local = local / count.clamp(min=1).to(local.device)
        if not self.distributed:
            return local
        total = local.detach().clone()
        all_reduce(total, dist.ReduceOp.SUM, self.group)
        return local + (total / W - local).detach()  # the global value, this rank's gradient

    def average_gradients(self) -> None:
        """Average the weight gradient over ranks (what DDP would do)."""
        if self.distributed and self.weight.grad is not None:
            all_reduce(self.weight.grad, dist.ReduceOp.SUM, self.group)
            self.weight.grad /= self.world_size


__all__ = ["NaiveParallelHead", "ReplicatedHead"]
