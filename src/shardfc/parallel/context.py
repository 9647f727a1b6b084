"""Where this process stands in a run: one object, resolved once at the boundary.

A :class:`DistContext` says which ranks the work is collective over (and through which
:class:`~shardfc.parallel.comm.Communicator`: torch.distributed or Horovod), this process's rank and
the group's size, and the device it computes on. It is built once (by the head, the trainer, a
checkpoint save) from what the caller passed and the state of the process; everything below takes
it and never asks torch.distributed or Horovod again. Its collectives go through the communicator,
which counts them for :func:`~shardfc.parallel.collectives.count_comm`, and are no-ops in a world of
one without a communicator.

    ctx = DistContext.resolve(group)       # torch's default group when initialised, else Horovod's
                                           # world when hvd.init() ran, else a world of one
    ctx = DistContext.horovod()            # Horovod's world (calls hvd.init() if needed)
    ctx.rank, ctx.world_size, ctx.distributed, ctx.device, ctx.backend
    ctx.all_gather_rows(x, sizes); ctx.reduce_scatter_rows(x, sizes); ctx.all_reduce_(t, "max")
    ctx.all_gather_object(x); ctx.broadcast_object(x); ctx.barrier()
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, List, Optional, Sequence, Union

import torch
import torch.distributed as dist
from torch import Tensor

from shardfc.parallel.comm import (
    Communicator,
    HorovodCommunicator,
    ReduceOpLike,
    TorchDistCommunicator,
    horovod_initialized,
)

DeviceLike = Union[str, torch.device, int]


@dataclass(frozen=True)
class DistContext:
    """This process's place: ``group``, ``rank`` and ``world_size`` in it, ``device``, and ``comm``."""

    group: Optional[dist.ProcessGroup] = None
    """The torch.distributed process group of the work (None: torch's default group, or not torch.distributed)."""
    rank: int = 0
    """Rank in the group."""
    world_size: int = 1
    """Ranks in the group."""
    distributed: bool = False
    """A communicator is in use (torch.distributed or Horovod initialised), even over a world of one."""
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    """Where this rank computes."""
    comm: Optional[Communicator] = field(default=None, compare=False)
    """The collectives of the group (None: a world of one without any). Left out with ``distributed``:
    torch.distributed over ``group``, made at the first collective."""

    @property
    def communicator(self) -> Optional[Communicator]:
        """``comm``, made for ``group`` on first use when left out of a distributed context."""
        if self.comm is None and self.distributed:
            object.__setattr__(self, "comm", TorchDistCommunicator(self.group))
        return self.comm

    @classmethod
    def resolve(cls, group: Optional[dist.ProcessGroup] = None, device: Optional[DeviceLike] = None) -> "DistContext":
        """The context of ``group``.

        Without a group: torch's default group when torch.distributed is initialised, else
        Horovod's world when ``hvd.init()`` has run in this process (so code that takes a group,
        such as a checkpoint save, runs over Horovod unchanged), else a world of one. A given group
        is used as is: never WORLD in its place. ``device`` defaults to the current CUDA device
        under NCCL (or under Horovod when CUDA is available), else the CPU.
        """
        if not (dist.is_available() and dist.is_initialized()):
            if group is not None:
                raise ValueError(f"group={group!r} was given but torch.distributed is not initialised")
            if horovod_initialized():
                return cls.horovod(device)
            return cls(device=torch.device(device) if device is not None else torch.device("cpu"))
        comm = TorchDistCommunicator(group)
        default = comm.comm_device
        dev = torch.device(device) if device is not None else default
        return cls(group, comm.rank, comm.world_size, True, dev, comm)

    @classmethod
    def horovod(cls, device: Optional[DeviceLike] = None) -> "DistContext":
        """Horovod's world (``hvd.init()`` is called if it has not been); an ImportError says how to install it.

        ``device`` defaults to the current CUDA device when CUDA is available (Horovod's recipe sets
        it to ``hvd.local_rank()`` first), else the CPU.
        """
        comm = HorovodCommunicator()
        if device is not None:
            dev = torch.device(device)
        elif torch.cuda.is_available():
            dev = torch.device("cuda", torch.cuda.current_device())
        else:
            dev = torch.device("cpu")
        return cls(None, comm.rank, comm.world_size, True, dev, comm)

    @classmethod
    def from_comm(cls, comm: Communicator, device: Optional[DeviceLike] = None) -> "DistContext":
        """The context of any :class:`~shardfc.parallel.comm.Communicator` (device: its ``comm_device``)."""
        dev = torch.device(device) if device is not None else comm.comm_device
        return cls(getattr(comm, "group", None), comm.rank, comm.world_size, True, dev, comm)

    @property
    def is_main(self) -> bool:
        """Rank 0 of the group: the one that prints and writes shared files."""
        return self.rank == 0

    @property
    def backend(self) -> Optional[str]:
        """"gloo" / "nccl" (torch.distributed), "horovod", or None without a communicator."""
        comm = self.communicator
        return comm.backend if comm is not None else None

    @property
    def is_horovod(self) -> bool:
        return isinstance(self.comm, HorovodCommunicator)

    @property
    def comm_device(self) -> torch.device:
        """Where small control tensors of a collective live: the CUDA device under NCCL, else the CPU."""
        comm = self.communicator
        return comm.comm_device if comm is not None else torch.device("cpu")

    def with_device(self, device: DeviceLike) -> "DistContext":
        return DistContext(self.group, self.rank, self.world_size, self.distributed, torch.device(device), self.comm)

    # ---- collectives (no-ops in a world of one without a communicator)
    def all_gather_rows(self, x: Tensor, sizes: Sequence[int]) -> Tensor:
        """Every rank's ``x`` (``sizes[r]`` rows on rank r) concatenated along dim 0, in rank order."""
        comm = self.communicator
        return comm.all_gather_rows(x, sizes) if comm is not None else x

    def reduce_scatter_rows(self, x: Tensor, sizes: Sequence[int]) -> Tensor:
        """The sum over ranks of ``x`` (all ranks' rows in rank order); this rank's rows."""
        comm = self.communicator
        return comm.reduce_scatter_rows(x, sizes) if comm is not None else x

    def all_reduce_(self, t: Tensor, op: ReduceOpLike = "sum") -> Tensor:
        """In place over the group (``op``: "sum"/"max" or torch's ReduceOp.SUM/MAX); returns ``t``."""
        comm = self.communicator
        return comm.all_reduce_(t, op) if comm is not None else t

    def all_gather_object(self, obj: Any) -> List[Any]:
        comm = self.communicator
        return comm.all_gather_object(obj) if comm is not None else [obj]

    def broadcast_object(self, obj: Any) -> Any:
        """Rank 0's ``obj`` on every rank."""
        comm = self.communicator
        return comm.broadcast_object(obj) if comm is not None else obj

    def barrier(self) -> None:
        comm = self.communicator
        if comm is not None:
            comm.barrier()


__all__ = ["DistContext"]
