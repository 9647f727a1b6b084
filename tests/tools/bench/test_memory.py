"""The CPU memory measure of ``shardfc bench`` (and of ``shardfc plan``'s replay): live bytes of the
storages the operators create, on any machine."""

from __future__ import annotations

import gc

import pytest
import torch

from shardfc.tools.bench.memory import LiveTensorBytes, PeakMemory

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
