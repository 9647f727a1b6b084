"""``DistContext``: this process's place, outside torch.distributed and inside a real
torch.distributed world of threads (``thread_world.TorchThreadWorld``), where ``resolve`` reads the
default group as it would over gloo."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from shardfc.parallel.comm import Communicator, TorchDistCommunicator
from shardfc.parallel.context import DistContext
from thread_world import TorchThreadWorld


def test_outside_torch_distributed_the_context_is_a_world_of_one():
    ctx = DistContext.resolve()
    assert (ctx.group, ctx.rank, ctx.world_size, ctx.distributed, ctx.device, ctx.comm) == (
        None, 0, 1, False, torch.device("cpu"), None)
    assert DistContext.resolve(device="meta").device == torch.device("meta")
    assert ctx.is_main and ctx.backend is None and ctx.communicator is None and not ctx.is_horovod
    assert ctx.comm_device == torch.device("cpu")
    x = torch.arange(3.0)
    assert ctx.all_gather_rows(x, [3]) is x and ctx.reduce_scatter_rows(x, [3]) is x and ctx.all_reduce_(x) is x
    assert ctx.all_gather_object("a") == ["a"] and ctx.broadcast_object("a") == "a" and ctx.barrier() is None


def test_a_group_given_outside_torch_distributed_is_refused():
    with pytest.raises(ValueError, match=r"^group='g' was given but torch\.distributed is not initialised$"):
        DistContext.resolve("g")


def test_resolve_reads_the_default_group_and_its_communicator():
    def rank(r):
        ctx = DistContext.resolve()
        on_meta = DistContext.resolve(device="meta")
        return {
            "ctx": (ctx.group, ctx.rank, ctx.world_size, ctx.distributed, ctx.device, ctx.is_main),
            "comm": (type(ctx.comm), ctx.comm.rank, ctx.backend, ctx.comm_device, ctx.is_horovod),
            "meta": (on_meta.device, on_meta.rank),
            "gathered": ctx.all_gather_rows(torch.tensor([float(r)]), [1, 1]).tolist(),
            "summed": ctx.reduce_scatter_rows(torch.tensor([1.0, 2.0]), [1, 1]).tolist(),
            "max": ctx.all_reduce_(torch.tensor([float(r + 1)]), "max").item(),
            "sum": ctx.all_reduce_(torch.tensor([float(r + 1)])).item(),  # the default op
            "objects": ctx.all_gather_object(r),
            "object": ctx.broadcast_object(r + 10),
            "barrier": ctx.barrier(),
        }

    for r, g in enumerate(TorchThreadWorld(2).results(rank)):
        assert g["ctx"] == (None, r, 2, True, torch.device("cpu"), r == 0)
        assert g["comm"] == (TorchDistCommunicator, r, "threaded", torch.device("cpu"), False)
        assert g["meta"] == (torch.device("meta"), r)
        assert g["gathered"] == [0.0, 1.0] and g["summed"] == [[2.0], [4.0]][r] and (g["max"], g["sum"]) == (2.0, 3.0)
        assert g["objects"] == [0, 1] and g["object"] == 10 and g["barrier"] is None


def test_resolve_uses_a_given_group_as_is():
    def rank(r):
        group = dist.new_group([1, 2])
        if r == 0:
            return None
        ctx = DistContext.resolve(group)
        return ctx.group is group, ctx.rank, ctx.world_size, ctx.all_gather_object(r)

    assert TorchThreadWorld(3).results(rank)[1:] == [(True, 0, 2, [1, 2]), (True, 1, 2, [1, 2])]


def test_a_distributed_context_without_a_communicator_makes_one_for_its_group_at_first_use():
    def rank(r):
        ctx = DistContext(rank=r, world_size=2, distributed=True)
        before = ctx.comm
        comm = ctx.communicator
        return before, type(comm), comm is ctx.communicator, ctx.broadcast_object(r + 1)

    for got in TorchThreadWorld(2).results(rank):
        assert got == (None, TorchDistCommunicator, True, 1)


def test_from_comm_and_with_device_keep_the_place_and_the_communicator():
    class Comm(Communicator):
        rank, world_size, group = 2, 4, "g"
        comm_device = torch.device("meta")

    comm = Comm()
    ctx = DistContext.from_comm(comm)
    assert (ctx.group, ctx.rank, ctx.world_size, ctx.distributed, ctx.device, ctx.comm) == (
        "g", 2, 4, True, torch.device("meta"), comm)
    assert not ctx.is_main
    assert DistContext.from_comm(comm, device="cpu").device == torch.device("cpu")
    moved = ctx.with_device("cpu")
    assert (moved.group, moved.rank, moved.world_size, moved.distributed, moved.device, moved.comm) == (
        "g", 2, 4, True, torch.device("cpu"), comm)
    bare = Comm()
    del Comm.group
    assert DistContext.from_comm(bare).group is None


def test_the_context_barrier_waits_for_every_rank():
    arrived = []

    def rank(r):
        arrived.append(r)
        DistContext.resolve().barrier()
        return len(arrived)

    assert TorchThreadWorld(3).results(rank) == [3, 3, 3]


class _StandInHorovod(Communicator):
    """What ``DistContext.horovod`` reads of Horovod's communicator (the real one runs under
    horovodrun: ``tests/head/test_module_horovod.py``)."""

    rank, world_size = 1, 2


@pytest.mark.parametrize("cuda, device, want", [
    (False, None, torch.device("cpu")),
    (True, None, torch.device("cuda", 1)),  # the current CUDA device, as Horovod's recipe sets it
    (True, "meta", torch.device("meta")),
])
def test_horovods_world_when_hvd_init_has_run_and_torch_distributed_has_not(monkeypatch, cuda, device, want):
    from shardfc.parallel import context

    monkeypatch.setattr(context, "HorovodCommunicator", _StandInHorovod)
    monkeypatch.setattr(context, "horovod_initialized", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: cuda)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 1)
    for ctx in (DistContext.resolve(device=device), DistContext.horovod(device)):
        assert (ctx.group, ctx.rank, ctx.world_size, ctx.distributed, ctx.device) == (None, 1, 2, True, want)
        assert isinstance(ctx.comm, _StandInHorovod) and ctx.is_horovod
