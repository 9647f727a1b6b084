"""Where this process stands in a run: one object, resolved once at the boundary.

A :class:`DistContext` says which process group the work is collective over, this process's rank
and the group's size in it, and the device it computes on. It is built once (by the head, the
trainer, a checkpoint save) from what the caller passed and torch.distributed's state; everything
below takes it and never asks torch.distributed again. Its collectives go through
:mod:`shardfc.parallel.collectives`, so :func:`~shardfc.parallel.collectives.count_comm` sees all
traffic, and are no-ops in a world of one without a process group.

    ctx = DistContext.resolve(group)       # the default group when initialised, else a world of one
    ctx.rank, ctx.world_size, ctx.distributed, ctx.device
    ctx.all_reduce_(t); ctx.all_gather_object(x); ctx.broadcast_object(x); ctx.barrier()
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, List, Optional, Union

import torch
import torch.distributed as dist
from torch import Tensor

from shardfc.parallel import collectives

DeviceLike = Union[str, torch.device, int]


@dataclass(frozen=True)
class DistContext:
    """This process's place: ``group``, ``rank`` and ``world_size`` in it, ``device``."""

    group: Optional[dist.ProcessGroup] = None
    """The process group of the work (None with ``distributed``: torch's default group)."""
    rank: int = 0
    """Rank in ``group``."""
    world_size: int = 1
    """Ranks in ``group``."""
    distributed: bool = False
    """A process group is in use (torch.distributed initialised), even a group of one."""
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    """Where this rank computes."""

    @classmethod
    def resolve(cls, group: Optional[dist.ProcessGroup] = None, device: Optional[DeviceLike] = None) -> "DistContext":
        """The context of ``group`` (default: torch's default group when initialised, else none).

        ``device`` defaults to the current CUDA device under NCCL, else the CPU. A given group is
        used as is: never WORLD in its place.
        """
        if not (dist.is_available() and dist.is_initialized()):
            if group is not None:
                raise ValueError(f"group={group!r} was given but torch.distributed is not initialised")
            return cls(device=torch.device(device) if device is not None else torch.device("cpu"))
        rank = dist.get_rank(group)
        if rank < 0:
            raise ValueError(f"this process (global rank {dist.get_rank()}) is not a member of group={group!r}")
        default = collectives.comm_device(group)
        return cls(group, rank, dist.get_world_size(group), True, torch.device(device) if device is not None else default)

    @property
    def is_main(self) -> bool:
        """Rank 0 of the group: the one that prints and writes shared files."""
        return self.rank == 0

    @property
    def backend(self) -> Optional[str]:
        return dist.get_backend(self.group) if self.distributed else None

    @property
    def comm_device(self) -> torch.device:
        """Where small control tensors of a collective live: the CUDA device under NCCL, else the CPU."""
        return collectives.comm_device(self.group) if self.distributed else torch.device("cpu")

    def with_device(self, device: DeviceLike) -> "DistContext":
        return DistContext(self.group, self.rank, self.world_size, self.distributed, torch.device(device))

    # ---- collectives (no-ops in a world of one without a group)
    def all_reduce_(self, t: Tensor, op: "dist.ReduceOp.RedOpType" = dist.ReduceOp.SUM) -> Tensor:
        """In place over the group; returns ``t``."""
        return collectives.all_reduce(t, op, self.group) if self.distributed else t

    def all_gather_object(self, obj: Any) -> List[Any]:
        return collectives.all_gather_object(obj, self.group) if self.distributed else [obj]

    def broadcast_object(self, obj: Any) -> Any:
        """Rank 0's ``obj`` on every rank."""
        return collectives.broadcast_object(obj, self.group) if self.distributed else obj

    def barrier(self) -> None:
        if self.distributed:
            collectives.barrier(self.group)
