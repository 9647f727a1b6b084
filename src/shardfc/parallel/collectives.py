"""Collectives over an explicit process group, each counted, and the one autograd mapping the head needs.

Every function takes ``group`` explicitly (``None`` means torch's default group, and is only passed
by callers that were themselves given no group). Rows are gathered along dim 0 with *variable*
per-rank sizes: gloo's all-gather needs equal sizes, so rows are padded to the largest local size
and unpadded after; reduce-scatter uses the list form, which accepts unequal sizes on gloo and NCCL.

Communication accounting (:func:`~shardfc.parallel.counting.count_comm`, re-exported here): each
call adds the bytes of its full-size buffer: the gathered output of an all-gather, the input of a
reduce-scatter, the tensor of an all-reduce. That is the volume a rank moves through the collective
(the backend may split it into ring steps).
"""

from __future__ import annotations

import pickle
from typing import Any, List, Optional, Sequence

import torch
import torch.distributed as dist
from torch import Tensor

from shardfc.parallel.counting import CommCounter, count_comm, record_comm, record_comm_bytes

__all__ = [  # CommCounter, count_comm, record_comm_bytes: re-exported from their home, .counting
    "CommCounter", "all_gather_object", "all_gather_rows", "all_reduce", "barrier", "broadcast_from_root",
    "broadcast_object", "comm_device", "count_comm", "gather_rows_forward_reduce_scatter_backward",
    "gather_to_root", "group_rank", "group_size", "record_comm", "record_comm_bytes", "reduce_scatter_rows",
    "scatter_from_root",
]


def group_size(group: Optional[dist.ProcessGroup]) -> int:
    return dist.get_world_size(group)


def group_rank(group: Optional[dist.ProcessGroup]) -> int:
    return dist.get_rank(group)


def comm_device(group: Optional[dist.ProcessGroup]) -> torch.device:
    """Device for small control tensors: the current CUDA device under NCCL, else the CPU."""
    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def all_reduce(t: Tensor, op: dist.ReduceOp.RedOpType, group: Optional[dist.ProcessGroup]) -> Tensor:
    """In-place all-reduce; returns ``t``."""
    record_comm("all_reduce", t)
    dist.all_reduce(t, op=op, group=group)
    return t


# torch 2.13 renamed all_gather_into_tensor / reduce_scatter_tensor (the old names warn).
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def all_gather_rows(x: Tensor, sizes: Sequence[int], group: Optional[dist.ProcessGroup]) -> Tensor:
    """Concatenate every rank's ``x`` (``sizes[r]`` rows on rank r) along dim 0, in rank order."""
    world, width = len(sizes), max(sizes)
    x = x.contiguous()
    if x.shape[0] != width:
        padded = x.new_zeros((width,) + tuple(x.shape[1:]))
        padded[: x.shape[0]] = x
        x = padded
    out = x.new_empty((world * width,) + tuple(x.shape[1:]))
    record_comm("all_gather", out)
    _all_gather_single(out, x, group=group)
    if all(s == width for s in sizes):
        return out
    parts = out.split(width)
    return torch.cat([p[:s] for p, s in zip(parts, sizes)])


def reduce_scatter_rows(x: Tensor, sizes: Sequence[int], group: Optional[dist.ProcessGroup]) -> Tensor:
    """Sum ``x`` (all ranks' rows, in rank order) over ranks; return this rank's rows."""
    rank = group_rank(group)
    x = x.contiguous()
    record_comm("reduce_scatter", x)
    out = x.new_empty((sizes[rank],) + tuple(x.shape[1:]))
    if len(set(sizes)) == 1:
        _reduce_scatter_single(out, x, group=group)
    else:
        dist.reduce_scatter(out, list(x.split(list(sizes))), group=group)
    return out


def gather_to_root(x: Tensor, group: Optional[dist.ProcessGroup]) -> Optional[List[Tensor]]:
    """Every rank's equally shaped ``x`` on the group's rank 0 (``None`` elsewhere)."""
    world, root = group_size(group), _global_rank(group, 0)
    x = x.contiguous()
    if group_rank(group) == 0:
        out = [torch.empty_like(x) for _ in range(world)]
        for t in out:
            record_comm("gather", t)
        dist.gather(x, out, dst=root, group=group)
        return out
    record_comm("gather", x)
    dist.gather(x, None, dst=root, group=group)
    return None


def scatter_from_root(parts: Optional[List[Tensor]], like: Tensor, group: Optional[dist.ProcessGroup]) -> Tensor:
    """Rank r receives ``parts[r]`` from the group's rank 0 (shaped like ``like``)."""
    out = torch.empty_like(like)
    record_comm("scatter", out)
    dist.scatter(out, [p.contiguous() for p in parts] if parts is not None else None, src=_global_rank(group, 0), group=group)
    return out


def broadcast_from_root(t: Tensor, group: Optional[dist.ProcessGroup]) -> Tensor:
    """In-place broadcast from the group's rank 0; returns ``t``."""
    record_comm("broadcast", t)
    dist.broadcast(t, src=_global_rank(group, 0), group=group)
    return t


def _global_rank(group: Optional[dist.ProcessGroup], rank: int) -> int:
    return rank if group is None else dist.get_global_rank(group, rank)


def all_gather_object(obj: Any, group: Optional[dist.ProcessGroup]) -> List[Any]:
    """Every rank's picklable ``obj``, in rank order (counted as the pickled bytes of this rank's)."""
    record_comm_bytes("all_gather_object", len(pickle.dumps(obj)) * group_size(group))
    out: List[Any] = [None] * group_size(group)
    dist.all_gather_object(out, obj, group=group)
    return out


def broadcast_object(obj: Any, group: Optional[dist.ProcessGroup]) -> Any:
    """The group's rank 0's picklable ``obj`` on every rank."""
    if group_rank(group) == 0:
        record_comm_bytes("broadcast_object", len(pickle.dumps(obj)))
    box = [obj]
    dist.broadcast_object_list(box, src=_global_rank(group, 0), group=group)
    return box[0]


def barrier(group: Optional[dist.ProcessGroup]) -> None:
    """Wait until every rank of ``group`` gets here (moves no payload)."""
    record_comm_bytes("barrier", 0)
    dist.barrier(group=group)


class _GroupRows:
    """A process group seen through the two row collectives (what a communicator offers)."""

    def __init__(self, group: Optional[dist.ProcessGroup]):
        self.group = group

    def all_gather_rows(self, x: Tensor, sizes: Sequence[int]) -> Tensor:
        return all_gather_rows(x, sizes, self.group)

    def reduce_scatter_rows(self, x: Tensor, sizes: Sequence[int]) -> Tensor:
        return reduce_scatter_rows(x, sizes, self.group)


class _GatherRowsForwardReduceScatterBackward(torch.autograd.Function):
    """All-gather rows forward; reduce-scatter (sum) of the row gradients backward, times a scale."""

    @staticmethod
    def forward(ctx, x: Tensor, sizes: List[int], comm, grad_scale: float) -> Tensor:
        ctx.sizes, ctx.comm, ctx.grad_scale = sizes, comm, grad_scale
        return comm.all_gather_rows(x, sizes)

    @staticmethod
    def backward(ctx, grad: Tensor):
        out = ctx.comm.reduce_scatter_rows(grad, ctx.sizes)
        if ctx.grad_scale != 1:
            out = out * ctx.grad_scale
        return out, None, None, None


def gather_rows_forward_reduce_scatter_backward(
    x: Tensor, sizes: Sequence[int], group: Any, grad_scale: float = 1.0
) -> Tensor:
    """Autograd-aware gather of every rank's rows; the backward sums gradients over ranks.

    ``group``: a torch.distributed process group (``None``: the default group), or anything with
    ``all_gather_rows`` and ``reduce_scatter_rows`` (a :class:`~shardfc.parallel.comm.Communicator`
    or a :class:`~shardfc.parallel.context.DistContext`, e.g. over Horovod).
    ``grad_scale`` multiplies the returned gradient: a model-parallel head under the DDP
    convention passes the world size, because DDP will average the backbone's gradients.
    """
    has = [name for name in ("all_gather_rows", "reduce_scatter_rows") if hasattr(group, name)]
    if len(has) == 1:  # neither a process group nor a communicator: say so, not a collective's error
        raise TypeError(f"group must be a torch.distributed process group or have both all_gather_rows and "
                        f"reduce_scatter_rows; got {group!r}, which has {has[0]} only")
    comm = group if has else _GroupRows(group)
    return _GatherRowsForwardReduceScatterBackward.apply(x, list(sizes), comm, grad_scale)
