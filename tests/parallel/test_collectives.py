"""The counted collectives of ``shardfc.parallel.collectives``, run for real between ranks.

The ranks are threads of this process with torch.distributed initialised over them
(``thread_world.TorchThreadWorld``: torch's in-process backend), so every ``dist.*`` call these
functions make runs as it would over gloo, and mutation testing sees it. Each result is checked
against what the ranks' inputs say it must be, worked out here: unequal and empty per-rank sizes,
rows of several dimensions, inputs that are not contiguous, a subgroup whose rank 0 is not global
rank 0, and the bytes each call counts.
"""

from __future__ import annotations

import pickle

import pytest
import torch
import torch.distributed as dist

from shardfc.parallel import collectives as c
from shardfc.parallel.collectives import count_comm
from thread_world import TorchThreadWorld


def _rows(rank: int, n: int, *tail: int, dtype=torch.float64) -> torch.Tensor:
    """``n`` rows that say whose they are: rank·1000 + a running index."""
    numel = n * int(torch.tensor(tail).prod()) if tail else n
    return (rank * 1000 + torch.arange(numel, dtype=dtype)).view(n, *tail)


@pytest.mark.parametrize("sizes", [[2, 0, 3], [3, 3, 3], [0, 0, 1], [1, 4]], ids=str)
def test_all_gather_rows_concatenates_every_ranks_rows_in_rank_order(sizes):
    world = TorchThreadWorld(len(sizes))
    got = world.results(lambda r: c.all_gather_rows(_rows(r, sizes[r], 2, 3), sizes, None))
    want = torch.cat([_rows(r, s, 2, 3) for r, s in enumerate(sizes)])
    for g in got:
        assert g.shape == (sum(sizes), 2, 3) and g.dtype == torch.float64
        torch.testing.assert_close(g, want, rtol=0, atol=0)


def test_all_gather_rows_takes_rows_that_are_not_contiguous():
    sizes = [3, 1]

    def rank(r):
        x = _rows(r, 2, sizes[r]).t()  # [sizes[r], 2], a transposed view
        assert not x.is_contiguous() or sizes[r] == 1
        return c.all_gather_rows(x, sizes, None)

    got = TorchThreadWorld(2).results(rank)
    want = torch.cat([_rows(r, 2, s).t() for r, s in enumerate(sizes)])
    for g in got:
        torch.testing.assert_close(g, want, rtol=0, atol=0)


def test_all_gather_rows_of_integers_keeps_them_exact():
    sizes = [2, 1, 0]
    got = TorchThreadWorld(3).results(lambda r: c.all_gather_rows(torch.full((sizes[r],), 2**40 + r), sizes, None))
    for g in got:
        assert g.dtype == torch.int64 and g.tolist() == [2**40, 2**40, 2**40 + 1]


@pytest.mark.parametrize("sizes", [[2, 0, 3], [2, 2, 2], [1, 3]], ids=str)
def test_reduce_scatter_rows_sums_over_ranks_and_keeps_this_ranks_rows(sizes):
    total = sum(sizes)
    inputs = [_rows(r, total, 2) * (r + 1) for r in range(len(sizes))]
    got = TorchThreadWorld(len(sizes)).results(lambda r: c.reduce_scatter_rows(inputs[r], sizes, None))
    summed = sum(inputs)
    starts = [sum(sizes[:r]) for r in range(len(sizes))]
    for r, g in enumerate(got):
        assert g.shape == (sizes[r], 2)
        torch.testing.assert_close(g, summed[starts[r] : starts[r] + sizes[r]], rtol=0, atol=0)


def test_reduce_scatter_rows_takes_rows_that_are_not_contiguous():
    sizes = [1, 2]
    inputs = [_rows(r, 2, 3).t() for r in range(2)]  # [3, 2] views
    got = TorchThreadWorld(2).results(lambda r: c.reduce_scatter_rows(inputs[r], sizes, None))
    summed = inputs[0] + inputs[1]
    torch.testing.assert_close(got[0], summed[:1], rtol=0, atol=0)
    torch.testing.assert_close(got[1], summed[1:], rtol=0, atol=0)


@pytest.mark.parametrize("op, reduce", [(dist.ReduceOp.SUM, sum), (dist.ReduceOp.MAX, max)], ids=["sum", "max"])
def test_all_reduce_is_in_place_and_returns_its_tensor(op, reduce):
    values = [[1.0, -5.0], [4.0, 2.0], [-3.0, 7.0]]

    def rank(r):
        t = torch.tensor(values[r], dtype=torch.float64)
        return t, c.all_reduce(t, op, None)

    for t, out in TorchThreadWorld(3).results(rank):
        assert out is t
        assert t.tolist() == [reduce(v[0] for v in values), reduce(v[1] for v in values)]


def test_gather_to_root_gives_rank_0_every_ranks_tensor_in_rank_order_and_others_none():
    got = TorchThreadWorld(3).results(lambda r: c.gather_to_root(_rows(r, 2, 2).t(), None))
    assert got[1] is None and got[2] is None
    assert len(got[0]) == 3
    for r, t in enumerate(got[0]):
        torch.testing.assert_close(t, _rows(r, 2, 2).t(), rtol=0, atol=0)


def test_scatter_from_root_hands_rank_r_part_r():
    parts = [_rows(9, 3)[i:i + 1] * (i + 1) for i in range(3)]
    got = TorchThreadWorld(3).results(
        lambda r: c.scatter_from_root(parts if r == 0 else None, torch.zeros(1, dtype=torch.float64), None))
    for r, t in enumerate(got):
        torch.testing.assert_close(t, parts[r], rtol=0, atol=0)


def test_scatter_from_root_takes_parts_that_are_not_contiguous():
    parts = [_rows(i, 2, 2).t() for i in range(2)]
    got = TorchThreadWorld(2).results(
        lambda r: c.scatter_from_root(parts if r == 0 else None, torch.zeros(2, 2, dtype=torch.float64), None))
    for r, t in enumerate(got):
        torch.testing.assert_close(t, parts[r], rtol=0, atol=0)


def test_broadcast_from_root_is_in_place_from_rank_0():
    def rank(r):
        t = torch.full((2,), float(r + 5))
        return t, c.broadcast_from_root(t, None)

    for t, out in TorchThreadWorld(3).results(rank):
        assert out is t and t.tolist() == [5.0, 5.0]


def test_object_collectives():
    def rank(r):
        return c.all_gather_object({"rank": r}, None), c.broadcast_object(("from", r), None)

    for gathered, broadcast in TorchThreadWorld(3).results(rank):
        assert gathered == [{"rank": 0}, {"rank": 1}, {"rank": 2}]
        assert broadcast == ("from", 0)


def test_group_rank_size_and_the_cpu_for_control_tensors():
    got = TorchThreadWorld(3).results(lambda r: (c.group_rank(None), c.group_size(None), c.comm_device(None)))
    assert got == [(r, 3, torch.device("cpu")) for r in range(3)]


def test_nccl_puts_control_tensors_on_the_current_cuda_device(monkeypatch):
    monkeypatch.setattr(dist, "get_backend", lambda group=None: "nccl")
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 3)
    assert c.comm_device(None) == torch.device("cuda", 3)


def test_a_subgroup_roots_at_its_own_rank_0_not_global_rank_0():
    """Ranks 1 and 2 of three form a group: its root is global rank 1, and ranks count within it."""

    def rank(r):
        group = dist.new_group([1, 2])  # every rank makes it; only 1 and 2 use it
        if r == 0:
            return None
        t = torch.tensor([float(r)])
        return {
            "rank": c.group_rank(group),
            "size": c.group_size(group),
            "broadcast": c.broadcast_from_root(t.clone(), group).item(),
            "gather": c.gather_to_root(t * 10, group),
            "scatter": c.scatter_from_root([torch.tensor([7.0]), torch.tensor([8.0])] if r == 1 else None,
                                           torch.zeros(1), group).item(),
            "object": c.broadcast_object(f"rank {r}", group),
            "objects": c.all_gather_object(r, group),
            "rows": c.all_gather_rows(torch.full((r,), float(r)), [1, 2], group).tolist(),
            "summed": c.reduce_scatter_rows(torch.arange(3.0) * r, [1, 2], group).tolist(),
        }

    _, one, two = TorchThreadWorld(3).results(rank)
    assert (one["rank"], one["size"], two["rank"], two["size"]) == (0, 2, 1, 2)
    assert one["broadcast"] == two["broadcast"] == 1.0
    assert [t.item() for t in one["gather"]] == [10.0, 20.0] and two["gather"] is None
    assert (one["scatter"], two["scatter"]) == (7.0, 8.0)
    assert one["object"] == two["object"] == "rank 1"
    assert one["objects"] == two["objects"] == [1, 2]
    assert one["rows"] == two["rows"] == [1.0, 2.0, 2.0]
    assert one["summed"] == [0.0] and two["summed"] == [3.0, 6.0]


def test_a_subgroup_is_where_every_collective_runs():
    """Rank 0 stays out and calls nothing: a collective issued over the default group instead of
    the subgroup would wait for it (a timeout) or count its rank and size."""

    def rank(r):
        group = dist.new_group([1, 2])
        if r == 0:
            return None
        summed = c.all_reduce(torch.tensor([float(r)]), dist.ReduceOp.SUM, group).item()
        scattered = c.reduce_scatter_rows(torch.arange(2.0) * r, [1, 1], group).tolist()  # equal sizes
        x = torch.tensor([float(r)], requires_grad=True)
        rows = c.gather_rows_forward_reduce_scatter_backward(x, [1, 1], group)
        (rows * torch.tensor([1.0, 10.0]) * r).sum().backward()  # rank r weighs the rows r, 10·r
        c.barrier(group)
        return summed, scattered, rows.tolist(), x.grad.tolist()

    _, one, two = TorchThreadWorld(3, timeout=10).results(rank)
    assert one == (3.0, [0.0], [1.0, 2.0], [3.0]) and two == (3.0, [3.0], [1.0, 2.0], [30.0])


def test_a_subgroups_object_collectives_count_its_own_size_and_root():
    def rank(r):
        group = dist.new_group([1, 2])
        if r > 0:
            c.all_gather_object("abc", group)
            c.broadcast_object("abc", group)  # global rank 1 is the group's rank 0: it alone counts

    with count_comm() as counter:
        TorchThreadWorld(3, timeout=10).results(rank)
    sent = len(pickle.dumps("abc"))
    assert counter.bytes == {"all_gather_object": 2 * 2 * sent, "broadcast_object": sent}


def test_the_control_tensors_device_is_that_of_the_group_asked_about(monkeypatch):
    monkeypatch.setattr(dist, "get_backend", lambda group=None: "nccl" if group == "an nccl group" else "gloo")
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    assert c.comm_device("an nccl group") == torch.device("cuda", 0)
    assert c.comm_device(None) == torch.device("cpu")


def test_barrier_waits_for_every_rank():
    arrived = []

    def rank(r):
        arrived.append(r)
        c.barrier(None)
        return len(arrived)

    assert TorchThreadWorld(3).results(rank) == [3, 3, 3]


def test_a_rank_that_skips_a_collective_is_a_timeout_not_a_hang():
    """The test world itself: a mutant that makes one rank skip a collective must fail, not hang."""
    got = TorchThreadWorld(2, timeout=2).run(lambda r: c.barrier(None) if r == 0 else "skipped")
    assert isinstance(got[0], TimeoutError) and got[1] == "skipped"


# ---- what each call counts: the bytes of its full-size buffer, summed here over the ranks


def _counted(world_size, fn):
    with count_comm() as counter:  # every rank's calls land in it (one process)
        TorchThreadWorld(world_size).results(fn)
    return counter.bytes, counter.calls


def test_all_gather_counts_the_padded_gathered_buffer():
    sizes = [2, 0, 3]  # padded to 3 rows a rank: 9 rows of 4 fp64 each, on each of 3 ranks
    got = _counted(3, lambda r: c.all_gather_rows(_rows(r, sizes[r], 4), sizes, None))
    assert got == ({"all_gather": 3 * 9 * 4 * 8}, {"all_gather": 3})


def test_reduce_scatter_and_all_reduce_count_their_input():
    def rank(r):
        c.reduce_scatter_rows(_rows(r, 5, 2), [2, 3], None)
        c.all_reduce(torch.zeros(3, dtype=torch.float32), dist.ReduceOp.SUM, None)

    assert _counted(2, rank) == ({"reduce_scatter": 2 * 5 * 2 * 8, "all_reduce": 2 * 3 * 4},
                                 {"reduce_scatter": 2, "all_reduce": 2})


def test_gather_counts_each_received_tensor_on_the_root_and_the_sent_one_elsewhere():
    got = _counted(3, lambda r: c.gather_to_root(torch.zeros(5, dtype=torch.float64), None))
    assert got == ({"gather": (3 + 2) * 5 * 8}, {"gather": 3 + 2})


def test_scatter_and_broadcast_count_the_buffer_of_each_rank():
    def rank(r):
        parts = [torch.zeros(4, dtype=torch.float64)] * 2 if r == 0 else None
        c.scatter_from_root(parts, torch.zeros(4, dtype=torch.float64), None)
        c.broadcast_from_root(torch.zeros(6, dtype=torch.int32), None)

    assert _counted(2, rank) == ({"scatter": 2 * 4 * 8, "broadcast": 2 * 6 * 4}, {"scatter": 2, "broadcast": 2})


def test_object_collectives_count_pickled_bytes_and_a_barrier_counts_a_call():
    objs = [{"rank": 0, "pad": "x" * 10}, {"rank": 1}]

    def rank(r):
        c.all_gather_object(objs[r], None)
        c.broadcast_object(objs[r], None)
        c.barrier(None)

    bytes_, calls = _counted(2, rank)
    sent = [len(pickle.dumps(o)) for o in objs]
    assert bytes_ == {"all_gather_object": 2 * sum(sent), "broadcast_object": sent[0], "barrier": 0}
    assert calls == {"all_gather_object": 2, "broadcast_object": 1, "barrier": 2}


# ---- the autograd mapping


@pytest.mark.parametrize("scale", [None, 2.0, 3.0])
@pytest.mark.parametrize("through", ["group", "communicator"])
def test_gather_forward_reduce_scatter_backward_equals_the_dense_gradient_times_the_scale(scale, through):
    """Rank r's loss is Σ weights[r] ⊙ gathered: the gradient of its rows is the sum over ranks of
    their weights at those rows, times ``grad_scale``."""
    from shardfc.parallel.comm import TorchDistCommunicator

    sizes = [2, 0, 3]
    weights = [_rows(r + 1, 5, 2) / 1000 for r in range(3)]

    def rank(r):
        x = _rows(r, sizes[r], 2).requires_grad_()
        group = None if through == "group" else TorchDistCommunicator(None)
        scaled = {} if scale is None else {"grad_scale": scale}  # None: the default, 1
        y = c.gather_rows_forward_reduce_scatter_backward(x, tuple(sizes), group, **scaled)
        (y * weights[r]).sum().backward()
        return y.detach(), x.grad

    got = TorchThreadWorld(3).results(rank)
    want_y = torch.cat([_rows(r, s, 2) for r, s in enumerate(sizes)])
    summed = sum(weights) * (scale or 1.0)
    starts = [0, 2, 2]
    for r, (y, grad) in enumerate(got):
        torch.testing.assert_close(y, want_y, rtol=0, atol=0)
        torch.testing.assert_close(grad, summed[starts[r] : starts[r] + sizes[r]], rtol=0, atol=1e-12)


def test_a_group_like_object_needs_both_row_collectives():
    class HalfACommunicator:
        def all_gather_rows(self, x, sizes):
            return x

    with pytest.raises(TypeError) as e:
        c.gather_rows_forward_reduce_scatter_backward(torch.zeros(1), [1], HalfACommunicator())
    assert str(e.value).startswith("group must be a torch.distributed process group or have both all_gather_rows "
                                   "and reduce_scatter_rows; got <")
    assert str(e.value).endswith(">, which has all_gather_rows only")
