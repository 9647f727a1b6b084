"""The CPU memory measure of ``shardfc bench`` (and of ``shardfc plan``'s replay): live bytes of the
storages the operators create, on any machine."""

from __future__ import annotations

import gc

import pytest
import torch

from shardfc.tools.bench import memory
from shardfc.tools.bench.memory import LiveTensorBytes, PeakMemory, tensors_in

KB4 = 1000 * 4  # bytes of a [1000] float32 tensor


@pytest.mark.parametrize("device", ["cpu", "meta"])
def test_counts_new_storages_until_freed(device):
    old = torch.zeros(1000, device=device)
    with LiveTensorBytes() as mode:
        a = torch.empty(1000, device=device)  # new: counts
        v = a.view(10, 100)  # a view: nothing new
        old.add_(1)  # in place into an older tensor: nothing new
        w = old[:500]  # a view of an older tensor: nothing new
        assert mode.current == KB4
        b = a + 1  # new
        assert mode.current == mode.peak == 2 * KB4
        del a
        assert mode.current == 2 * KB4  # its view keeps the storage
        del v
        assert mode.current == KB4  # gone with the last view
        c = torch.empty(250, device=device, dtype=torch.float64)
        assert mode.current == KB4 + 2000 and mode.peak == 2 * KB4
        d = b.to(torch.float64)  # a conversion is a new storage
        assert mode.peak == KB4 + 2000 + 8000
        del b, c, d, w
    assert mode.current == 0 and mode.peak == KB4 + 2000 + 8000
    assert sorted(mode.peak_live.values()) == [2000, KB4, 8000]


def test_a_resized_out_tensor_counts_its_new_size():
    with LiveTensorBytes() as mode:
        out = torch.empty(0)
        torch.add(torch.ones(10), 1, out=torch.empty(0))  # a temporary, gone
        torch.mul(torch.ones(1000), 2, out=out)  # resized in place to 1000 floats
        assert mode.current == KB4
        del out
    assert mode.current == 0


def test_peak_by_category():
    with LiveTensorBytes() as mode:
        a = torch.empty(1000)
        b = torch.empty(2000)
        tags = {mode.serial_of(a): "x", mode.serial_of(b): "y"}
        del a, b
    assert mode.peak_by(tags.get) == {"x": KB4, "y": 2 * KB4}


def test_nothing_is_counted_after_the_block():
    with LiveTensorBytes() as mode:
        a = torch.empty(1000)
    b = torch.empty(1000)
    del a, b
    gc.collect()
    assert mode.peak == KB4 and mode.current == KB4  # a's release after the block is not followed


def test_peak_memory_on_cpu_counts_the_step():
    mem = PeakMemory(torch.device("cpu"))
    assert mem.measure == "cpu_live_tensors"
    x = torch.ones(1000)
    mem.start()
    y = x * 2
    z = y + 1
    del y, z
    assert mem.stop() == 2 * KB4


def test_tensors_in_finds_the_tensors_of_nested_arguments():
    a, b, c = torch.ones(1), torch.ones(2), torch.ones(3)
    found = list(tensors_in([a, (b, {"k": c, "n": 3}), "x", None]))
    assert len(found) == 3 and all(f is t for f, t in zip(found, (a, b, c)))


def test_aliasing_is_read_from_the_schema_once_per_operator(monkeypatch):
    monkeypatch.setattr(memory, "_ALIASING", {})
    aten = torch.ops.aten
    assert memory._may_alias(aten.view.default) is True  # a view returns Tensor(a)
    assert memory._may_alias(aten.add_.Tensor) is True  # in place: Tensor(a!)
    assert memory._may_alias(aten.add.Tensor) is False  # a new tensor
    assert memory._may_alias(torch.ops.c10d.allreduce_.default) is True  # a collective: always
    assert memory._ALIASING == {aten.view.default: True, aten.add_.Tensor: True, aten.add.Tensor: False,
                                torch.ops.c10d.allreduce_.default: True}
    # the answer is kept: the schema is not read again for every call of the operator
    memory._ALIASING[aten.view.default] = False
    assert memory._may_alias(aten.view.default) is False


def test_a_block_that_allocates_nothing_has_no_peak():
    with LiveTensorBytes() as mode:
        torch.zeros(0)  # a storage of no bytes
    assert mode.peak == 0 and mode.peak_live == {} and mode.communication == set()


def test_the_peak_is_the_first_time_it_is_reached():
    with LiveTensorBytes() as mode:
        a = torch.empty(1000)
        first = mode.serial_of(a)
        del a
        b = torch.empty(1000)  # as many bytes again: the same peak, not a new one
        assert mode.peak_live == {first: KB4} and mode.serial_of(b) != first
        del b


def test_the_books_keep_only_live_storages():
    with LiveTensorBytes() as mode:
        kept = torch.empty(10)
        for _ in range(5):
            torch.empty(1000) + 1  # two storages made and freed each time
        assert mode.current == 40
        assert len(mode.live) == len(mode._finalizers) == len(mode._serials) == 1
        del kept
        assert mode.live == {} and mode._finalizers == {} and mode._serials == {}


class _CollectsWhileRecording(LiveTensorBytes):
    """Runs the garbage collector in the middle of the books' update, as an allocation can."""

    def __init__(self):
        super().__init__()
        self.pending_seen = []

    def _resize(self, serial, nbytes):
        super()._resize(serial, nbytes)
        gc.collect()
        self.pending_seen.append(len(self._pending))


def test_a_storage_freed_while_the_books_are_updated_is_settled_after():
    gc.disable()  # the cycle goes when this test's collect runs, not before
    try:
        with _CollectsWhileRecording() as mode:
            a = torch.empty(1000)
            cycle = [a]
            cycle.append(cycle)  # a's only reference is now in a cycle: freed by a collection
            del a, cycle
            assert mode.current == KB4
            b = torch.empty(10)  # the collection runs while b is being recorded
            assert mode.pending_seen[-1] == 1  # a's release waited for the update to end ...
            assert mode.current == 40 and list(mode.live.values()) == [40] and not mode._pending  # ... then came
            del b
    finally:
        gc.enable()
    assert mode.peak == KB4 + 40  # b was counted before the collection freed a


def test_collectives_mark_the_storages_they_read_or_write(tmp_path):
    import torch.distributed as dist

    if dist.is_initialized():
        pytest.skip("a process group is already initialised in this process")
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'rendezvous'}", rank=0, world_size=1)
    try:
        older = torch.ones(3)
        with LiveTensorBytes() as mode:
            sent, other = torch.ones(100), torch.ones(10)
            dist.all_reduce(sent)
            dist.all_reduce(older)  # not the step's: not tracked, not marked
            other.add_(1)
            assert mode.communication == {mode.serial_of(sent)}
            assert mode.serial_of(other) not in mode.communication
    finally:
        dist.destroy_process_group()


def test_peak_by_sums_a_category():
    with LiveTensorBytes() as mode:
        a, b, c = torch.empty(1000), torch.empty(2000), torch.empty(500)
        tags = {mode.serial_of(a): "x", mode.serial_of(b): "x", mode.serial_of(c): "y"}
        del a, b, c
    assert mode.peak_by(tags.get) == {"x": 3 * KB4, "y": KB4 // 2}


def test_peak_memory_on_cuda_is_the_allocators_peak_above_the_start(monkeypatch):
    calls = []
    allocated = {"now": 700, "max": 1000}
    monkeypatch.setattr(torch.cuda, "synchronize", lambda d: calls.append(("synchronize", d)))
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", lambda d: calls.append(("reset", d)))
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda d: calls.append(("allocated", d)) or allocated["now"])
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda d: calls.append(("max", d)) or allocated["max"])
    device = torch.device("cuda", 1)
    mem = PeakMemory(device)
    assert mem.measure == "cuda_max_allocated"
    mem.start()
    assert calls == [("synchronize", device), ("reset", device), ("allocated", device)]
    assert mem.stop() == 300
    assert calls[3:] == [("synchronize", device), ("max", device)]
    allocated["max"] = 700  # a step that allocated nothing more
    mem.start()
    assert mem.stop() == 0
    allocated["max"] = 600  # memory freed below the start (a peak never reads below it): 0, not negative
    assert mem.stop() == 0
