"""The host-sync counter itself (``tools/host_syncs.py``): what it counts, what it lets pass, where it
says each one came from. The tests of the head's steps (tests/head/test_no_host_sync.py,
tests/head/fused/test_fused_no_sync.py) hold them to zero with it: a sync it missed would pass them.

A copy from a GPU to the host cannot be made on the CPU: those cases hand ``_reason`` a stand-in tensor
on "cuda:0" (a ``Mock`` with the spec of a tensor, which ``isinstance`` takes for one)."""

from __future__ import annotations

from unittest import mock

import pytest
import torch

from shardfc.tools.host_syncs import HostSyncCounter, _reason

aten = torch.ops.aten
CPU = torch.device("cpu")


def _on_gpu() -> torch.Tensor:
    t = mock.Mock(spec=torch.Tensor)
    t.device = torch.device("cuda", 0)
    return t


@pytest.mark.parametrize("kwargs, counted", [
    ({"device": CPU}, True),
    ({"device": "cpu"}, True),
    ({"device": CPU, "non_blocking": True}, False),  # into pinned memory behind an event: nothing waits
    ({"device": torch.device("cuda", 1)}, False),  # device to device
    ({"dtype": torch.float16}, False),  # no device: stays where it is
])
def test_a_copy_from_the_gpu_to_the_host_waits_unless_non_blocking(kwargs, counted):
    why = _reason(aten._to_copy.default, (_on_gpu(),), kwargs)
    assert why == ("aten._to_copy.default from cuda:0 to the CPU" if counted else None)
    assert _reason(aten._to_copy.default, (torch.zeros(2),), kwargs) is None  # from the host: nothing to wait for


@pytest.mark.parametrize("args, kwargs, counted", [
    ((), {}, True),
    ((False,), {}, True),
    ((True,), {}, False),
    ((), {"non_blocking": True}, False),
])
def test_copying_into_a_host_tensor_in_place_waits_unless_non_blocking(args, kwargs, counted):
    host = torch.zeros(2)
    why = _reason(aten.copy_.default, (host, _on_gpu(), *args), kwargs)
    assert why == ("aten.copy_.default from cuda:0 to the CPU" if counted else None)
    dest = _on_gpu()
    assert _reason(aten.copy_.default, (dest, _on_gpu(), *args), kwargs) is None  # into the GPU: no wait
    meta = torch.empty(2, device="meta")
    assert _reason(aten.copy_.default, (host, meta, *args), kwargs) is None  # shapes only: no values


def test_each_kind_of_sync_is_counted_once_where_it_happens():
    t = torch.tensor([3, 1, 3, 0])
    with HostSyncCounter() as syncs:
        for _ in range(2):
            t.sum().item()  # the same line twice: one site, counted twice
        torch.masked_select(t, t > 0)
        torch.argwhere(t)  # dispatched as nonzero
        torch.bincount(t)
        t[t > 1] = 5  # index_put with a boolean mask
        torch.repeat_interleave(t, 2)  # repeats given as a number: the size is known
        reps = torch.tensor([2, 1])
        torch.repeat_interleave(reps, reps, output_size=3)  # ... or given
        torch.repeat_interleave(reps)  # repeats as a tensor: the size is their sum
        t[torch.tensor([0, 2])] = 1  # integer indices: no sync
        t.tolist()
    assert syncs.count == 8, syncs.report()
    by_op = {site.split(": ", 1)[1]: n for site, n in syncs.sites.items()}
    assert by_op == {
        "aten._local_scalar_dense.default": 2,
        "aten.masked_select.default": 1,
        "aten.nonzero.default": 1,
        "aten.bincount.default": 1,
        "aten.index_put_.default with a boolean mask (nonzero)": 1,
        "aten.repeat_interleave.Tensor without output_size": 1,
        "Tensor.tolist": 1,
    }
    report = syncs.report().split("\n")
    assert report[0].startswith("  x2 ") and len(report) == 7 and all(line.startswith("  x1 ") for line in report[1:])


def test_each_site_is_the_line_outside_torch_that_asked():
    """Not under mutmut (its trampolines are frames of another file between the line and the counter:
    scripts/mutation.sh runs this module with ``-k "not site"``)."""
    t = torch.tensor([3, 1, 3, 0])
    with HostSyncCounter() as syncs:
        t.sum().item()
        torch.unique(t)
    this_file = __file__.replace("\\", "/")
    lines = [site.split(": ", 1)[0] for site in syncs.sites]
    assert len(lines) == 2 and lines[0] != lines[1], syncs.report()
    assert all(line.startswith(f"{this_file}:") and line.endswith(" (test_each_site_is_the_line_outside_torch_that_asked)")
               for line in lines), syncs.report()


def test_nothing_counted_reads_none_and_tolist_is_restored_even_after_an_error():
    real = torch.Tensor.tolist
    reps = torch.tensor([2, 1])
    with HostSyncCounter() as syncs:
        torch.ones(3).add_(1)
        torch.repeat_interleave(reps, reps, output_size=3)  # its size given: nothing to read
    assert syncs.count == 0 and syncs.report() == "  none"
    with pytest.raises(RuntimeError, match="in the step"), HostSyncCounter() as syncs:
        torch.ones(2).tolist()
        raise RuntimeError("in the step")
    assert torch.Tensor.tolist is real and syncs.count == 1
    torch.ones(2).tolist()  # after the counter: not counted anywhere
    assert syncs.count == 1
