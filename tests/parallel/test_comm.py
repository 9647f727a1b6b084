"""``reduce_op_name``, the ``Communicator`` interface, and ``TorchDistCommunicator`` over a real
torch.distributed world of threads.

``thread_world.TorchThreadWorld`` initialises torch.distributed in each thread (torch's in-process
backend), so the communicator's calls run as they would over gloo, in this process where mutation
testing sees them. (Horovod's communicator is tested under horovodrun:
``tests/head/test_module_horovod.py``.)
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from shardfc.parallel.comm import Communicator, TorchDistCommunicator, reduce_op_name
from shardfc.parallel.counting import count_comm
from thread_world import TorchThreadWorld


@pytest.mark.parametrize("op, name", [("sum", "sum"), ("SUM", "sum"), ("Max", "max"),
                                      (dist.ReduceOp.SUM, "sum"), (dist.ReduceOp.MAX, "max")])
def test_reduce_op_names(op, name):
    assert reduce_op_name(op) == name


@pytest.mark.parametrize("op", ["min", "avg", dist.ReduceOp.MIN, dist.ReduceOp.AVG])
def test_other_reduce_ops_are_refused_naming_the_op(op):
    with pytest.raises(ValueError) as e:
        reduce_op_name(op)
    assert str(e.value) == f"reduce op must be 'sum' or 'max' (or torch's ReduceOp.SUM / MAX), got {op!r}"


def test_the_interface_has_no_implementation_of_its_own():
    comm = Communicator()
    comm.rank, comm.world_size = 0, 1
    x = torch.zeros(1)
    calls = [lambda: comm.backend, lambda: comm.comm_device, lambda: comm.all_gather_rows(x, [1]),
             lambda: comm.reduce_scatter_rows(x, [1]), lambda: comm.all_reduce_(x), lambda: comm.all_gather_object(1),
             lambda: comm.broadcast_object(1), comm.barrier]
    for call in calls:
        with pytest.raises(NotImplementedError):
            call()


def test_the_torch_communicator_needs_torch_distributed():
    assert not dist.is_initialized()
    with pytest.raises(RuntimeError, match=r"^torch\.distributed is not initialised: no process group to "
                                           r"communicate over$"):
        TorchDistCommunicator()


def test_the_torch_communicator_runs_the_six_operations_over_the_default_group():
    sizes = [1, 0, 2]

    def rank(r):
        comm = TorchDistCommunicator()
        t_sum, t_max = torch.tensor([float(r)]), torch.tensor([float(-r)])
        return {
            "where": (comm.rank, comm.world_size, comm.backend, comm.comm_device, repr(comm)),
            "rows": comm.all_gather_rows(torch.full((sizes[r], 2), float(r)), sizes).tolist(),
            "summed": comm.reduce_scatter_rows(torch.ones(3, 1) * (r + 1), sizes).tolist(),
            "sum": (comm.all_reduce_(t_sum) is t_sum, t_sum.item()),
            "max": (comm.all_reduce_(t_max, "max"), t_max.item()),
            "max op": comm.all_reduce_(torch.tensor([float(r)]), dist.ReduceOp.MAX).item(),
            "objects": comm.all_gather_object(f"r{r}"),
            "object": comm.broadcast_object(f"r{r}"),
            "barrier": comm.barrier(),
        }

    got = TorchThreadWorld(3).results(rank)
    for r, g in enumerate(got):
        assert g["where"] == (r, 3, "threaded", torch.device("cpu"),
                              f"TorchDistCommunicator(rank={r}, world_size=3, backend='threaded')")
        assert g["rows"] == [[0.0, 0.0], [2.0, 2.0], [2.0, 2.0]]
        assert g["summed"] == [[6.0]] * sizes[r]
        assert g["sum"] == (True, 3.0) and g["max"][1] == 0.0 and g["max op"] == 2.0
        assert g["objects"] == ["r0", "r1", "r2"] and g["object"] == "r0" and g["barrier"] is None


def test_the_torch_communicator_counts_under_the_operations_names():
    def rank(r):
        comm = TorchDistCommunicator()
        comm.all_gather_rows(torch.zeros(2, 1), [2, 2])
        comm.reduce_scatter_rows(torch.zeros(4, 1), [2, 2])
        comm.all_reduce_(torch.zeros(1))

    with count_comm() as counter:
        TorchThreadWorld(2).results(rank)
    assert counter.bytes == {"all_gather": 2 * 16, "reduce_scatter": 2 * 16, "all_reduce": 2 * 4}


def test_a_subgroup_communicator_counts_within_the_group_and_refuses_a_non_member():
    def rank(r):
        group = dist.new_group([1, 2])
        if r == 0:
            with pytest.raises(ValueError) as e:
                TorchDistCommunicator(group)
            return str(e.value)
        comm = TorchDistCommunicator(group)  # every operation over the group: rank 0 calls none
        t = torch.tensor([float(r)])
        comm.all_reduce_(t)
        comm.barrier()
        return (comm.rank, comm.world_size, comm.group is group, comm.broadcast_object(r), comm.all_gather_object(r),
                comm.all_gather_rows(torch.tensor([float(r)]), [1, 1]).tolist(),
                comm.reduce_scatter_rows(torch.tensor([1.0, 2.0]) * r, [1, 1]).tolist(), t.item())

    outsider, one, two = TorchThreadWorld(3, timeout=10).results(rank)
    assert outsider.startswith("this process (global rank 0) is not a member of group=")
    assert one == (0, 2, True, 1, [1, 2], [1.0, 2.0], [3.0], 3.0)
    assert two == (1, 2, True, 1, [1, 2], [1.0, 2.0], [6.0], 3.0)
