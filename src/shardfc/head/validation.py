"""Input checks that raise the same clear error on every rank.

A check that fails on one rank only must not leave the other ranks waiting in a collective. So
each rank runs its local checks *before* any collective, then the ranks exchange one small
header ``[local batch size, error kind, value flags]``; if any rank failed, every rank raises,
naming the rank and the problem. The header doubles as the exchange of local batch sizes the
gathers need. The value checks (finite embeddings, labels in range) run on the device and travel
in the header, so they add no host synchronisation to the one the exchange needs.
"""

from __future__ import annotations

from typing import Callable, List, Optional

import torch
from torch import Tensor

from shardfc.parallel.context import DistContext

_KINDS = {None: 0, ValueError: 1, TypeError: 2}
_TYPES = {1: ValueError, 2: TypeError}
#: Device-side checks read with the exchange (:func:`value_flags`): non-finite embeddings, bad labels.
_FLAGS = 2


def check_embeddings(embeddings, embedding_dim: int, values: bool = True) -> Optional[Exception]:
    """Type and shape of the embeddings, and with ``values`` that they are finite (a host sync)."""
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
    if values and embeddings.numel() and not bool(torch.isfinite(embeddings).all()):
        return embeddings_value_error(embeddings)
    return None


def embeddings_value_error(embeddings: Tensor) -> Exception:
    """The error for embeddings known to hold a non-finite value, naming the first bad row."""
    bad = int((~torch.isfinite(embeddings)).any(dim=1).nonzero()[0])
    return ValueError(
        f"embeddings contain non-finite values (row {bad}: {embeddings[bad][:4].tolist()}...); "
        "fix the backbone or skip the batch"
    )


def check_labels(labels, batch: int, num_classes: int, ignore_index: int, values: bool = True) -> Optional[Exception]:
    """Type and shape of the labels, and with ``values`` their range (a host sync)."""
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
    if values and labels.numel() and bool(_bad_labels(labels, num_classes, ignore_index).any()):
        return labels_value_error(labels, num_classes, ignore_index)
    return None


def _bad_labels(labels: Tensor, num_classes: int, ignore_index: int) -> Tensor:
    return ((labels < 0) | (labels >= num_classes)) & (labels != ignore_index)


def labels_value_error(labels: Tensor, num_classes: int, ignore_index: int) -> Exception:
    """The error for labels known to hold a value out of range, naming the first."""
    i = int(_bad_labels(labels, num_classes, ignore_index).nonzero()[0])
    return ValueError(
        f"labels[{i}] = {int(labels[i])} is outside [0, num_classes={num_classes}) "
        f"and is not ignore_index={ignore_index}"
    )


def value_flags(embeddings: Tensor, labels: Tensor, num_classes: int, ignore_index: int) -> Tensor:
    """``[2]`` int64 on the embeddings' device, no host sync: whether any embedding is non-finite,
    whether any label is out of range. Read with the batch-size exchange, which syncs anyway."""
    nonfinite = ~torch.isfinite(embeddings).all() if embeddings.numel() else torch.zeros((), dtype=torch.bool)
    bad = _bad_labels(labels.to(embeddings.device), num_classes, ignore_index).any()
    return torch.stack([nonfinite.to(embeddings.device), bad]).to(torch.int64)


def raise_or_exchange_sizes(
    error: Optional[Exception], local_batch: int, ctx: DistContext,
    flags: Optional[Tensor] = None, describe: Optional[Callable[[List[int]], Exception]] = None,
) -> List[int]:
    """Raise ``error`` (on every rank of ``ctx``'s group); else return every rank's batch size.

    ``flags``: device-side checks (:func:`value_flags`) read with the exchange, so they cost no
    host sync of their own: the header ``[batch, kind, flags...]`` goes to the host once, as the
    batch sizes must. ``describe(flags)`` builds the error of a rank whose flags are set (only then
    are its inputs read again to name the bad row); a call site that checks values passes it on
    every rank (with ``flags`` None where a host check already failed).
    """
    if not ctx.distributed:
        if error is None and flags is not None:
            raised = flags.tolist()  # the one sync of a single process's checks
            if any(raised):
                error = describe(raised)
        if error is not None:
            raise error
        return [local_batch]
    kind = _KINDS.get(type(error), 1) if error is not None else 0
    # A call site with value checks (``describe`` given) sends the flag columns on every rank, also
    # from a rank that failed a host check and has no flags (zeros): the widths must match.
    header = torch.zeros(1, 2 + (_FLAGS if describe is not None else 0), dtype=torch.int64, device=ctx.comm_device)
    header[0, 0], header[0, 1] = local_batch, kind
    if flags is not None:
        header[0, 2:] = flags.to(ctx.comm_device, torch.int64)
    world = ctx.world_size
    table = ctx.all_gather_rows(header, [1] * world).cpu()
    if describe is not None:
        mine = table[ctx.rank, 2:].tolist()
        if error is None and any(mine):
            error = describe(mine)
        table[:, 1] = torch.where(table[:, 2:].any(dim=1), table[:, 1].clamp(min=1), table[:, 1])
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
    """Check a head's inputs, raise on every rank if any rank's are bad, else return all batch sizes.

    Types and shapes are checked on the host; the values (finite embeddings, labels in range) on
    the device, read with the batch-size exchange: no host sync beyond the one that exchange needs
    (one in a single process), where reading each check would stall the GPU twice a step.
    """
    error = check_embeddings(embeddings, embedding_dim, values=False)
    if error is None:
        error = check_labels(labels, embeddings.shape[0], num_classes, ignore_index, values=False)
    flags = value_flags(embeddings, labels, num_classes, ignore_index) if error is None else None

    def describe(raised: List[int]) -> Exception:
        if raised[0]:
            return embeddings_value_error(embeddings)
        return labels_value_error(labels, num_classes, ignore_index)

    local_batch = embeddings.shape[0] if error is None else 0
    return raise_or_exchange_sizes(error, local_batch, ctx, flags, describe)


__all__ = [
    "check_embeddings",
    "check_labels",
    "raise_or_exchange_sizes",
    "check_batch_and_exchange_sizes",
]
