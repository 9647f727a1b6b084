"""No host synchronisation in a head step of the fused implementations (issue 31): forward and
backward of ``impl="triton"`` and ``"gemm"`` read nothing back to the host, plain, under Partial FC
(dense and sparse gradient), with sub-centres and with the inter-class filter, in one process with
``validate="deferred"`` (the default on CUDA). Under the interpreter on a CPU (the counter:
:class:`~shardfc.tools.host_syncs.HostSyncCounter`), compiled on a GPU, where the same step must also
pass ``torch.cuda.set_sync_debug_mode("error")``."""

from __future__ import annotations

import pytest
import torch
from fused_pairs import DEVICE

import shardfc
from shardfc import margins as M
from shardfc.tools.host_syncs import HostSyncCounter

C, D, B = 40, 16, 6

CONFIGS = {
    "plain": {},
    "partial_fc": dict(sample_rate=0.3),
    "partial_fc+sparse_grad": dict(sample_rate=0.3, sparse_grad=True),
    "subcenters+partial_fc+sparse_grad": dict(subcenters=2, sample_rate=0.3, sparse_grad=True),
    "filter": dict(interclass_filter_threshold=0.2),
    "adaface": dict(margin=M.AdaFace()),
}


def _batch(seed: int):
    """A batch on the device (made before a step: a copy from pageable host memory would block)."""
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(B, D, generator=g) * 3).to(DEVICE).requires_grad_()
    y = torch.randint(0, C, (B,), generator=g)
    y[::3] = -1
    return x, y.to(DEVICE)


def _step(head, batch) -> None:
    head(*batch).backward()


@pytest.mark.parametrize("config", list(CONFIGS))
@pytest.mark.parametrize("impl", ["triton", "gemm"])
def test_a_fused_head_step_reads_nothing_back_to_the_host(impl, config):
    head = shardfc.ShardedMarginHead(D, C, impl=impl, validate="deferred", device=DEVICE, **CONFIGS[config])
    batches = [_batch(seed) for seed in range(3)]
    _step(head, batches[0])
    head.take_sampled_rows()
    with HostSyncCounter() as syncs:
        _step(head, batches[1])  # reads the first step's deferred check
    assert head.last_impl == impl
    assert syncs.count == 0, f"impl={impl} {config}:\n{syncs.report()}"
    if DEVICE.type == "cuda":  # compiled: torch's own detector agrees (a sync raises RuntimeError)
        head.take_sampled_rows()
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            _step(head, batches[2])
        finally:
            torch.cuda.set_sync_debug_mode("default")
    head.check_pending()


@pytest.mark.parametrize("optimizer", ["sgd", "adamw"])
@pytest.mark.parametrize("config", ["plain", "partial_fc"])
def test_a_step_with_the_update_fused_reads_nothing_back(config, optimizer):
    """The update applied in the backward (``head_optimizer(..., fused_update=True)``) and the
    optimizer's ``step()`` after it: its target rows are summed by a scatter, not a unique; AdamW's
    betas reach the kernel as fp32 arguments, its step counts are read and written there."""
    head = shardfc.ShardedMarginHead(D, C, impl="triton", validate="deferred", device=DEVICE, **CONFIGS[config])
    kw = dict(momentum=0.9) if optimizer == "sgd" else {}
    opt = shardfc.head_optimizer(head, optimizer, lr=0.1, weight_decay=5e-4, fused_update=True, **kw)
    batches = [_batch(seed) for seed in range(2)]

    def step(batch):
        opt.zero_grad(set_to_none=False)
        _step(head, batch)
        opt.step()

    step(batches[0])
    with HostSyncCounter() as syncs:
        step(batches[1])
    assert head.last_update == "fused"
    assert syncs.count == 0, f"{config}:\n{syncs.report()}"
    head.check_pending()


@pytest.mark.parametrize("config", ["plain", "partial_fc", "subcenters+partial_fc+sparse_grad"])
def test_a_step_clipped_with_the_measured_norm_reads_nothing_back(config, monkeypatch):
    """``--head-grad-clip`` as the trainer runs it: the squared norm summed by the weight-gradient
    pass and its target-row correction, the clip factor, and the optimizer dividing by it as its
    ``grad_scale`` — no value read back on the way."""
    import shardfc.train.step as step_mod
    from shardfc.parallel.context import DistContext
    from shardfc.train.step import grads_divided_by, head_clip_factor, scales_in_step

    monkeypatch.setattr(step_mod, "head_grads", None)  # the norm must be the measured one, not a pass

    head = shardfc.ShardedMarginHead(D, C, impl="triton", validate="deferred", device=DEVICE, **CONFIGS[config])
    head.measure_weight_grad_norm()
    opt = shardfc.head_optimizer(head, "sgd", lr=0.1, momentum=0.9, weight_decay=5e-4)
    opt = opt if scales_in_step(opt) else torch.optim.SGD(head.parameters(), lr=0.1, momentum=0.9, fused=True)
    ctx = DistContext(device=DEVICE)
    batches = [_batch(seed) for seed in range(2)]

    def step(batch):
        opt.zero_grad(set_to_none=False)
        _step(head, batch)
        norm, coef = head_clip_factor(head, 0.01, ctx)
        with grads_divided_by(opt, coef.reciprocal()):
            opt.step()
        return norm

    step(batches[0])
    with HostSyncCounter() as syncs:
        norm = step(batches[1])
    assert syncs.count == 0, f"{config}:\n{syncs.report()}"
    assert float(norm) > 0.01  # the clip acted (read after the count)
    head.check_pending()
