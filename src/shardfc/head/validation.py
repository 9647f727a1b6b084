"""Input checks that raise the same clear error on every rank.

A check that fails on one rank only must not leave the other ranks waiting in a collective. So
each rank runs its local checks *before* any collective, then the ranks exchange one small
header ``[local batch size, error kind]``; if any rank failed, every rank raises, naming the rank
and the problem. The header doubles as the exchange of local batch sizes the gathers need.
"""

from __future__ import annotations

from typing import List, Optional

import torch
from torch import Tensor

from shardfc.parallel.context import DistContext

_KINDS = {None: 0, ValueError: 1, TypeError: 2}
_TYPES = {1: ValueError, 2: TypeError}


def check_embeddings(embeddings, embedding_dim: int) -> Optional[Exception]:
    if not isinstance(embeddings, Tensor):
        return TypeError(f"embeddings must be a torch.Tensor, got {type(embeddings).__name__}")
    if not embeddings.is_floating_point():
        return TypeError(f"embeddings must be floating point, got dtype={embeddings.dtype}")
    if embeddings.dim() != 2:
        return ValueError(
            f"embeddings must be 2-D [batch, embedding_dim], got shape {tuple(embeddings.shape)}"
        )
    if embeddings.shape[1] != embedding_dim:
        return ValueError(
            f"embeddings has width {embeddings.shape[1]} but the head's embedding_dim is "
            f"{embedding_dim} (shape {tuple(embeddings.shape)})"
        )
    if embeddings.numel() and not bool(torch.isfinite(embeddings).all()):
        bad = int((~torch.isfinite(embeddings)).any(dim=1).nonzero()[0])
        return ValueError(
            f"embeddings contain non-finite values (row {bad}: {embeddings[bad][:4].tolist()}...); "
            "fix the backbone or skip the batch"
        )
    return None


def check_labels(labels, batch: int, num_classes: int, ignore_index: int) -> Optional[Exception]:
    if not isinstance(labels, Tensor):
        return TypeError(f"labels must be a torch.Tensor, got {type(labels).__name__}")
    if labels.dtype == torch.bool or labels.is_floating_point() or labels.is_complex():
        return TypeError(f"labels must be an integer tensor, got dtype={labels.dtype}")
    if labels.dim() != 1:
        return ValueError(f"labels must be 1-D [batch], got shape {tuple(labels.shape)}")
    if labels.shape[0] != batch:
        return ValueError(
            f"labels has {labels.shape[0]} entries but embeddings has {batch} rows"
        )
    if labels.numel():
        bad = ((labels < 0) | (labels >= num_classes)) & (labels != ignore_index)
        if bool(bad.any()):
            i = int(bad.nonzero()[0])
            return ValueError(
                f"labels[{i}] = {int(labels[i])} is outside [0, num_classes={num_classes}) "
                f"and is not ignore_index={ignore_index}"
            )
    return None


def raise_or_exchange_sizes(error: Optional[Exception], local_batch: int, ctx: DistContext) -> List[int]:
    """Raise ``error`` (on every rank of ``ctx``'s group); else return every rank's batch size."""
    if not ctx.distributed:
        if error is not None:
            raise error
        return [local_batch]
    kind = _KINDS.get(type(error), 1) if error is not None else 0
    header = torch.tensor([[local_batch, kind]], dtype=torch.int64, device=ctx.comm_device)
    world = ctx.world_size
    table = ctx.all_gather_rows(header, [1] * world).cpu()
    kinds = table[:, 1].tolist()
    if any(kinds):
        messages = ctx.all_gather_object(None if error is None else str(error))
        failed = [(r, messages[r]) for r in range(world) if kinds[r]]
        text = "; ".join(f"rank {r}: {m}" for r, m in failed)
        me = ctx.rank
        if error is not None:
            raise type(error)(text if len(failed) > 1 else f"rank {me}: {error}")
        raise _TYPES.get(kinds[failed[0][0]], ValueError)(text)
    return table[:, 0].tolist()


def check_batch_and_exchange_sizes(
    embeddings, labels, *, embedding_dim: int, num_classes: int, ignore_index: int,
    ctx: DistContext,
) -> List[int]:
    """Check a head's inputs, raise on every rank if any rank's are bad, else return all batch sizes."""
    error = check_embeddings(embeddings, embedding_dim)
    if error is None:
        error = check_labels(labels, embeddings.shape[0], num_classes, ignore_index)
    local_batch = embeddings.shape[0] if error is None else 0
    return raise_or_exchange_sizes(error, local_batch, ctx)


__all__ = [
    "check_embeddings",
    "check_labels",
    "raise_or_exchange_sizes",
    "check_batch_and_exchange_sizes",
]
