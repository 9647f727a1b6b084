"""No host synchronisation in a head step (issue 31): forward and backward read nothing back to the
host, for every mode of the torch implementation, in one process with ``validate="deferred"``.

:class:`~shardfc.tools.host_syncs.HostSyncCounter` counts, on the CPU, what would make a GPU's host
wait (``.item()``, ``bool``, ``.tolist()``, ``nonzero``, ``unique``, a boolean mask, ...). The fused
implementations' twin of this test is tests/head/fused/test_fused_no_sync.py; on a GPU,
``scripts/gpu_step.py`` runs a step under ``torch.cuda.set_sync_debug_mode("error")``.
"""

from __future__ import annotations

import pytest
import torch

import shardfc
from shardfc import margins as M
from shardfc.head.partial_fc import head_optimizer
from shardfc.tools.host_syncs import HostSyncCounter

C, D, B = 41, 8, 9

#: Every option that changes what a step runs (one process: single shard and devices mode).
CONFIGS = {
    "plain": {},
    "chunked": dict(chunk_size=7),
    "smoothing+none": dict(label_smoothing=0.1, reduction="none"),
    "sum": dict(reduction="sum"),
    "partial_fc": dict(sample_rate=0.3),
    "partial_fc+chunked": dict(sample_rate=0.3, chunk_size=4),
    "partial_fc+sparse_grad": dict(sample_rate=0.3, sparse_grad=True),
    "subcenters": dict(subcenters=3),
    "subcenters+partial_fc+sparse_grad": dict(subcenters=3, sample_rate=0.3, sparse_grad=True),
    "filter": dict(interclass_filter_threshold=0.2),
    "filter+subcenters+partial_fc": dict(interclass_filter_threshold=0.2, subcenters=2, sample_rate=0.3),
    "devices": dict(devices=["cpu", "cpu"]),
    "devices+partial_fc+sparse_grad": dict(devices=["cpu", "cpu", "cpu"], sample_rate=0.3, sparse_grad=True),
    "adaface": dict(margin=M.AdaFace()),
    "magface": dict(margin=M.MagFace()),
    "sphereface": dict(margin=M.SphereFace(4)),
    "cosface": dict(margin=M.CosFace()),
}


def _batch(seed: int):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(B, D, generator=g) * 3
    y = torch.randint(0, C, (B,), generator=g)
    y[::4] = -1  # ignore_index samples
    return x.requires_grad_(), y


def _forward_backward(head, seed: int):
    x, y = _batch(seed)
    loss = head(x, y)
    loss.backward(torch.ones_like(loss) if loss.dim() else None)


@pytest.mark.parametrize("config", list(CONFIGS))
def test_a_head_step_reads_nothing_back_to_the_host(config):
    """Two micro-batches after a first step: the second forward reads the first's deferred check."""
    head = shardfc.ShardedMarginHead(D, C, validate="deferred", impl="torch", **CONFIGS[config])
    _forward_backward(head, 0)
    head.take_sampled_rows()  # the optimizer's part, not the step's
    with HostSyncCounter() as syncs:
        _forward_backward(head, 1)
        _forward_backward(head, 2)
    assert syncs.count == 0, f"{config}: host syncs in a head step:\n{syncs.report()}"
    head.check_pending()  # good inputs: nothing to raise


@pytest.mark.parametrize(
    "config,name",
    # Not torch's own AdamW (the full head's): it keeps its step count in a CPU tensor, even for CUDA
    # parameters, and reads it with .item(), a host read the CPU counter cannot tell from a device's.
    [("plain", "sgd"), ("partial_fc", "sgd"), ("partial_fc+sparse_grad", "sgd"), ("partial_fc+sparse_grad", "adamw"),
     ("subcenters+partial_fc+sparse_grad", "adamw")],
)
def test_a_training_step_with_its_optimizer_reads_nothing_back(config, name):
    """One forward per step: zero_grad, forward, backward and the (row-sparse) optimizer's step. (With
    several micro-batches the optimizer unites their rows: one torch.unique per step, docs/head.md.)"""
    head = shardfc.ShardedMarginHead(D, C, validate="deferred", **CONFIGS[config])
    opt = head_optimizer(head, name, lr=0.1)

    def step(seed):
        opt.zero_grad(set_to_none=False)
        _forward_backward(head, seed)
        opt.step()

    step(0)
    step(1)
    with HostSyncCounter() as syncs:
        step(2)
    assert syncs.count == 0, f"{config} {name}:\n{syncs.report()}"


def test_the_counter_finds_the_immediate_check():
    """validate="immediate" reads the value checks in the step that runs them: the one sync the
    deferred mode removes, found where it is (the counter would fail the tests above on it)."""
    head = shardfc.ShardedMarginHead(D, C, validate="immediate")
    _forward_backward(head, 0)
    with HostSyncCounter() as syncs:
        _forward_backward(head, 1)
    assert syncs.count == 1 and "validation.py" in next(iter(syncs.sites)), syncs.report()


def test_the_counter_counts_what_a_gpu_would_wait_for():
    t = torch.tensor([3, 1, 3, 0])
    with HostSyncCounter() as syncs:
        t.tolist()
        t[0].item()
        bool(t[1])
        t[t > 0]
        t.nonzero()
        torch.unique(t)
        torch.repeat_interleave(t)
        torch.equal(t, t)
        t.numpy()  # a host array of a host tensor: free (how deferred checks are read)
        t[torch.tensor([0, 2])]  # integer indices: no sync
        torch.repeat_interleave(t, t, output_size=7)
    assert syncs.count == 8, syncs.report()
