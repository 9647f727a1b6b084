"""Communicators: the collectives of the head and the trainer over torch.distributed or Horovod.

The head and the trainer need six operations, and nothing else::

    all_gather_rows(x, sizes)      every rank's rows (``sizes[r]`` on rank r, may differ), in rank order
    reduce_scatter_rows(x, sizes)  the sum over ranks of all ranks' rows; this rank's ``sizes[rank]`` rows
    all_reduce_(t, op)             in place, op "sum" or "max" (small tensors: statistics, flags)
    all_gather_object(obj)         every rank's picklable object, in rank order
    broadcast_object(obj)          rank 0's picklable object on every rank
    barrier()

:class:`Communicator` is that interface; :class:`TorchDistCommunicator` runs it over a
torch.distributed process group (the counted functions of :mod:`shardfc.parallel.collectives`),
:class:`HorovodCommunicator` over Horovod's global process set (``horovod.torch``, counted the same
way). A :class:`~shardfc.parallel.context.DistContext` carries one; code below it never names a
backend. Both record into :func:`~shardfc.parallel.counting.count_comm` under the name of the
operation asked for, with the same byte convention (the gathered output, the reduce-scatter input,
the all-reduced tensor, the pickled objects).

What Horovod 0.28.1 offers and what is built here instead:

* ``hvd.allgather`` concatenates unequal first dimensions itself: no padding.
* ``hvd.allreduce`` has ``op=hvd.Sum`` and ``op=hvd.Max`` (also Min, Product, Average, Adasum).
* ``hvd.reducescatter`` takes no split sizes: it divides the first dimension itself (as evenly as
  possible, the remainder to the first ranks). The head's splits are the ranks' local batch sizes,
  which may be anything, so when they are not Horovod's own split the reduce-scatter is an
  all-reduce (sum) of the whole buffer and a slice of this rank's rows: the same result for about
  twice the traffic of a true reduce-scatter.
* ``hvd.allgather_object`` / ``hvd.broadcast_object`` name their collective after the object's type
  by default; the types differ between ranks (rank 0 broadcasts a tuple, the others pass None), so
  every call here passes one fixed name.
"""

from __future__ import annotations

import math
import os
import pickle
import sys
from typing import Any, List, Optional, Sequence, Union

import torch
import torch.distributed as dist
from torch import Tensor

from shardfc.parallel import collectives
from shardfc.parallel.counting import record_comm, record_comm_bytes
from shardfc.parallel.partition import split_evenly

#: How to get Horovod, for error messages.
HOROVOD_INSTALL_HINT = (
    "install it with `bash scripts/install_horovod.sh` (builds horovod 0.28.1 with PyTorch and Gloo into the "
    "active python; a plain `pip install horovod` does not build against torch >= 2.1), then launch with "
    "`horovodrun -np N --gloo ...`"
)

ReduceOpLike = Union[str, "dist.ReduceOp.RedOpType"]


def reduce_op_name(op: ReduceOpLike) -> str:
    """``"sum"`` or ``"max"`` from that name or torch's ``ReduceOp.SUM`` / ``ReduceOp.MAX``."""
    if isinstance(op, str):
        name = op.lower()
    elif op == dist.ReduceOp.SUM:
        name = "sum"
    elif op == dist.ReduceOp.MAX:
        name = "max"
    else:
        name = repr(op)
    if name not in ("sum", "max"):
        raise ValueError(f"reduce op must be 'sum' or 'max' (or torch's ReduceOp.SUM / MAX), got {op!r}")
    return name


class Communicator:
    """The collectives the head and the trainer use, over one group of ranks.

    Subclasses set ``rank`` and ``world_size`` and implement the six operations; every rank of the
    group must call each operation in the same order.
    """

    rank: int
    """This process's rank in the group."""
    world_size: int
    """Ranks in the group."""

    @property
    def backend(self) -> str:
        """A name for logs and checks ("gloo", "nccl", "horovod")."""
        raise NotImplementedError

    @property
    def comm_device(self) -> torch.device:
        """Where small control tensors (batch sizes, flags) of a collective live."""
        raise NotImplementedError

    def all_gather_rows(self, x: Tensor, sizes: Sequence[int]) -> Tensor:
        """Every rank's ``x`` (``sizes[r]`` rows on rank r) concatenated along dim 0, in rank order."""
        raise NotImplementedError

    def reduce_scatter_rows(self, x: Tensor, sizes: Sequence[int]) -> Tensor:
        """Sum ``x`` (all ranks' rows, in rank order) over ranks; return this rank's ``sizes[rank]`` rows."""
        raise NotImplementedError

    def all_reduce_(self, t: Tensor, op: ReduceOpLike = "sum") -> Tensor:
        """In place over the group (``op`` "sum" or "max"); returns ``t``."""
        raise NotImplementedError

    def all_gather_object(self, obj: Any) -> List[Any]:
        """Every rank's picklable ``obj``, in rank order."""
        raise NotImplementedError

    def broadcast_object(self, obj: Any) -> Any:
        """Rank 0's picklable ``obj`` on every rank."""
        raise NotImplementedError

    def barrier(self) -> None:
        """Wait until every rank gets here."""
        raise NotImplementedError

    def __repr__(self) -> str:
        return f"{type(self).__name__}(rank={self.rank}, world_size={self.world_size}, backend={self.backend!r})"


class TorchDistCommunicator(Communicator):
    """A torch.distributed process group (``None``: the default group), through the counted collectives."""

    def __init__(self, group: Optional[dist.ProcessGroup] = None) -> None:
        if not (dist.is_available() and dist.is_initialized()):
            raise RuntimeError("torch.distributed is not initialised: no process group to communicate over")
        self.group = group
        self.rank = dist.get_rank(group)
        if self.rank < 0:
            raise ValueError(f"this process (global rank {dist.get_rank()}) is not a member of group={group!r}")
        self.world_size = dist.get_world_size(group)

    @property
    def backend(self) -> str:
        return dist.get_backend(self.group)

    @property
    def comm_device(self) -> torch.device:
        return collectives.comm_device(self.group)

    def all_gather_rows(self, x: Tensor, sizes: Sequence[int]) -> Tensor:
        return collectives.all_gather_rows(x, sizes, self.group)

    def reduce_scatter_rows(self, x: Tensor, sizes: Sequence[int]) -> Tensor:
        return collectives.reduce_scatter_rows(x, sizes, self.group)

    def all_reduce_(self, t: Tensor, op: ReduceOpLike = "sum") -> Tensor:
        torch_op = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX}[reduce_op_name(op)]
        return collectives.all_reduce(t, torch_op, self.group)

    def all_gather_object(self, obj: Any) -> List[Any]:
        return collectives.all_gather_object(obj, self.group)

    def broadcast_object(self, obj: Any) -> Any:
        return collectives.broadcast_object(obj, self.group)

    def barrier(self) -> None:
        collectives.barrier(self.group)


# ---------------------------------------------------------------------- Horovod


def import_horovod():
    """``horovod.torch``, or an :class:`ImportError` that says how to install it."""
    try:
        import horovod.torch as hvd
    except ImportError as e:
        raise ImportError(f"Horovod with PyTorch support is not importable here ({e}); {HOROVOD_INSTALL_HINT}") from e
    return hvd


def horovod_initialized() -> bool:
    """Horovod is imported and ``hvd.init()`` has run in this process (never imports it)."""
    hvd = sys.modules.get("horovod.torch")
    if hvd is None:
        return False
    try:
        return bool(hvd.is_initialized())
    except Exception:  # noqa: BLE001 - a half-imported or broken horovod is simply not in use
        return False


def launched_by_horovodrun() -> bool:
    """This process was started by ``horovodrun`` (its Gloo or MPI launcher sets these)."""
    return "HOROVOD_RANK" in os.environ or "OMPI_COMM_WORLD_RANK" in os.environ or "PMI_RANK" in os.environ


class HorovodCommunicator(Communicator):
    """Horovod's global process set (``hvd.init()`` is called if it has not been)."""

    #: Fixed names of the object collectives (see the module docstring).
    _GATHER_NAME = "shardfc.all_gather_object"
    _BROADCAST_NAME = "shardfc.broadcast_object"

    def __init__(self) -> None:
        hvd = import_horovod()
        if not hvd.is_initialized():
            hvd.init()
        self.hvd = hvd
        self.rank = hvd.rank()
        self.world_size = hvd.size()
        self.local_rank = hvd.local_rank()

    @property
    def backend(self) -> str:
        return "horovod"

    @property
    def comm_device(self) -> torch.device:
        # Horovod runs CPU tensors through its CPU path (Gloo or MPI) whatever GPU ops it was built with.
        return torch.device("cpu")

    def all_gather_rows(self, x: Tensor, sizes: Sequence[int]) -> Tensor:
        if x.shape[0] != sizes[self.rank]:
            raise ValueError(f"rank {self.rank} has {x.shape[0]} rows but sizes says {sizes[self.rank]}")
        wire = _to_wire(x.contiguous())
        record_comm_bytes("all_gather", sum(sizes) * _row_bytes(wire))
        hvd = self.hvd
        return hvd.synchronize(hvd.allgather_async(wire)).to(x.dtype)

    def reduce_scatter_rows(self, x: Tensor, sizes: Sequence[int]) -> Tensor:
        wire = _to_wire(x.contiguous())
        record_comm("reduce_scatter", wire)
        hvd = self.hvd
        lo = sum(sizes[: self.rank])
        if min(sizes) > 0 and list(sizes) == _horovod_split(x.shape[0], self.world_size):
            return hvd.synchronize(hvd.reducescatter_async(wire, op=hvd.Sum)).to(x.dtype)
        # Horovod cannot scatter unequal splits of our choosing: reduce everything, keep our rows.
        total = hvd.synchronize(hvd.allreduce_async(wire, op=hvd.Sum))
        return total[lo : lo + sizes[self.rank]].to(x.dtype)

    def all_reduce_(self, t: Tensor, op: ReduceOpLike = "sum") -> Tensor:
        hvd = self.hvd
        hvd_op = {"sum": hvd.Sum, "max": hvd.Max}[reduce_op_name(op)]
        wire = _to_wire(t.contiguous())
        record_comm("all_reduce", wire)
        # Out of place and copied back: ``t`` may be a view (a slice of flags), which Horovod's
        # in-place op would not see as its own buffer. These tensors are small.
        t.copy_(hvd.synchronize(hvd.allreduce_async(wire, op=hvd_op)))
        return t

    def all_gather_object(self, obj: Any) -> List[Any]:
        record_comm_bytes("all_gather_object", len(pickle.dumps(obj)) * self.world_size)
        return list(self.hvd.allgather_object(obj, name=self._GATHER_NAME))

    def broadcast_object(self, obj: Any) -> Any:
        if self.rank == 0:
            record_comm_bytes("broadcast_object", len(pickle.dumps(obj)))
        return self.hvd.broadcast_object(obj, root_rank=0, name=self._BROADCAST_NAME)

    def barrier(self) -> None:
        record_comm_bytes("barrier", 0)
        self.hvd.barrier()


#: dtypes Horovod's ops refuse ("Tensor type torch.BFloat16Tensor is not supported"), and the one
#: they travel in instead: bf16 -> fp32 is exact, and its sums are then rounded once, on the way back.
_HOROVOD_WIRE_DTYPE = {torch.bfloat16: torch.float32}


def _to_wire(x: Tensor) -> Tensor:
    return x.to(_HOROVOD_WIRE_DTYPE.get(x.dtype, x.dtype))


def _row_bytes(x: Tensor) -> int:
    return math.prod(x.shape[1:]) * x.element_size()


def _horovod_split(rows: int, world: int) -> List[int]:
    """How ``hvd.reducescatter`` divides ``rows``: evenly, the remainder to the first ranks."""
    return split_evenly(rows, world)


__all__ = [
    "Communicator",
    "HOROVOD_INSTALL_HINT",
    "HorovodCommunicator",
    "TorchDistCommunicator",
    "horovod_initialized",
    "import_horovod",
    "launched_by_horovodrun",
    "reduce_op_name",
]
