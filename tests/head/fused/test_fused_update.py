"""The optimizer's step fused into the backward (``head_optimizer(..., fused_update=True)``): the
weights and the momentum after a few steps equal the unfused path (the gradient stored, then
``step()``) to fp32 rounding, for every layout and option; no ``.grad`` is stored; and where the
backward cannot apply it, ``step()`` does, as before."""

from __future__ import annotations

import copy

import pytest
import torch
from fused_pairs import DEVICE, MARGINS, C, D

import shardfc
from shardfc.head import partial_fc

B = 29
STEPS = 2


def _inputs(step: int, dtype=torch.float32):
    g = torch.Generator().manual_seed(100 + step)
    x = torch.randn(B, D, generator=g, dtype=torch.float64) * 3
    y = torch.randint(0, C, (B,), generator=g)
    y[:4] = y[4]  # samples sharing a target: their target terms add up in one row
    y[::9] = -1
    return x.to(dtype), y


def _run(fused: bool, *, margin="arcface", impl="triton", autocast=None, steps=STEPS, lr_schedule=(0.5, 0.2),
         opt_kw=None, **head_kw):
    torch.manual_seed(0)
    head = shardfc.ShardedMarginHead(D, C, margin=copy.deepcopy(MARGINS[margin]), impl=impl, device=DEVICE, **head_kw)
    kw = dict(lr=0.5, momentum=0.9, weight_decay=5e-3, nesterov=False)
    kw.update(opt_kw or {})
    opt = partial_fc.head_optimizer(head, "sgd", fused_update=fused, **kw)
    grads_x, losses = [], []
    for step in range(steps):
        for group in opt.param_groups:  # a schedule: the backward reads this step's rate
            group["lr"] = lr_schedule[step % len(lr_schedule)]
        opt.zero_grad(set_to_none=False)
        x, y = _inputs(step)
        xr = x.to(DEVICE).requires_grad_()
        with torch.autocast(DEVICE.type, dtype=autocast, enabled=autocast is not None):
            loss = head(xr, y.to(DEVICE))
        loss.backward()
        if fused and head.last_update == "fused":
            assert all(w.grad is None for w in head.shard_weights)  # nothing of [n, D] stored
        opt.step()
        grads_x.append(xr.grad.double().cpu())
        losses.append(float(loss.detach()))
    state = [opt.state[w].get("momentum_buffer") for w in head.shard_weights]
    return head, [w.detach().double().cpu() for w in head.shard_weights], state, grads_x, losses


def _rel(a, b):
    return float((a.double() - b.double()).abs().max() / b.double().abs().max().clamp(min=1e-30))


CASES = {
    "arcface": dict(),
    "nesterov_no_decay": dict(opt_kw=dict(nesterov=True, weight_decay=0.0)),
    "no_momentum": dict(opt_kw=dict(momentum=0.0)),
    "partial_fc": dict(sample_rate=0.5),
    "partial_fc_sparse_grad": dict(sample_rate=0.5, sparse_grad=True),
    "subcenters_smoothing": dict(subcenters=2, label_smoothing=0.1),
    "raw_centres_gemm": dict(margin="softmax", impl="gemm"),
    "filter": dict(interclass_filter_threshold=0.3, margin="cosface"),
    "bf16_autocast": dict(autocast=torch.bfloat16),
}


@pytest.mark.parametrize("case", list(CASES), ids=list(CASES))
def test_fused_update_equals_the_optimizers_step(case):
    kw = CASES[case]
    head, w_ref, buf_ref, gx_ref, loss_ref = _run(False, **kw)
    assert head.last_update is None  # no fused optimizer: nothing to say
    head, w, buf, gx, loss = _run(True, **kw)
    assert head.last_update == "fused"
    tol = 1e-5
    assert loss == pytest.approx(loss_ref, rel=tol)
    for a, b in zip(gx, gx_ref):
        assert _rel(a, b) < tol
    for a, b in zip(w, w_ref):
        assert _rel(a, b) < tol
    for a, b in zip(buf, buf_ref):
        assert (a is None) == (b is None)
        if a is not None:
            assert _rel(a, b) < tol


def test_above_the_operand_budget(monkeypatch):
    """A shard whose operand is made per chunk: the fused update reads the fp32 rows it writes,
    each tile before it writes it."""
    from shardfc.head.fused import chunks

    monkeypatch.setattr(chunks, "OPERAND_BYTES", 0)
    _, w_ref, buf_ref, _, _ = _run(False, sample_rate=0.5)
    _, w, buf, _, _ = _run(True, sample_rate=0.5)
    assert _rel(w[0], w_ref[0]) < 1e-5 and _rel(buf[0], buf_ref[0]) < 1e-5


def test_bf16_centres_round_once():
    """bf16 centres and momentum: the fused update rounds once from the fp32 gradient, the unfused
    path from a bf16 ``.grad``: equal to bf16's resolution."""
    _, w_ref, buf_ref, _, _ = _run(False, dtype=torch.bfloat16)
    head, w, buf, _, _ = _run(True, dtype=torch.bfloat16)
    assert head.last_update == "fused"
    assert _rel(w[0], w_ref[0]) < 2e-2 and _rel(buf[0], buf_ref[0]) < 2e-2


def test_step_skips_what_the_backward_updated():
    """A ``.grad`` left from an earlier step (kept by ``zero_grad(set_to_none=False)``) is neither
    written by the fused backward nor stepped on again by ``step()``."""
    _, w_ref, buf_ref, _, _ = _run(False)
    torch.manual_seed(0)
    head = shardfc.ShardedMarginHead(D, C, margin=copy.deepcopy(MARGINS["arcface"]), impl="triton", device=DEVICE)
    head.weight.grad = torch.zeros_like(head.weight)
    opt = partial_fc.head_optimizer(head, "sgd", lr=0.5, momentum=0.9, weight_decay=5e-3, fused_update=True)
    for step in range(STEPS):
        for group in opt.param_groups:
            group["lr"] = (0.5, 0.2)[step % 2]
        opt.zero_grad(set_to_none=False)
        x, y = _inputs(step)
        head(x.to(DEVICE).requires_grad_(), y.to(DEVICE)).backward()
        opt.step()
    assert head.last_update == "fused" and not head.weight.grad.any()
    assert _rel(head.weight.detach(), w_ref[0]) < 1e-5
    assert _rel(opt.state[head.weight]["momentum_buffer"], buf_ref[0]) < 1e-5


def test_a_second_backward_before_the_step_is_an_error():
    head = shardfc.ShardedMarginHead(D, C, impl="triton", device=DEVICE)
    opt = partial_fc.head_optimizer(head, "sgd", lr=0.1, fused_update=True)
    x, y = _inputs(0)
    head(x.to(DEVICE), y.to(DEVICE)).backward()
    with pytest.raises(RuntimeError, match=r"accumulating gradients over several backward passes needs fused_update=False"):
        head(x.to(DEVICE), y.to(DEVICE)).backward()
    opt.step()
    opt.zero_grad()
    head(x.to(DEVICE), y.to(DEVICE)).backward()  # a new step: allowed again


@pytest.mark.parametrize("why,kw,expect", [
    ("torch", dict(impl="torch"), "optimizer: impl='torch' stores the gradient"),
    ("fp16", dict(autocast=torch.float16), "optimizer: fp16 compute"),
])
def test_where_the_backward_cannot_the_step_does(why, kw, expect):
    _, w_ref, _, _, _ = _run(False, **kw)
    head, w, _, _, _ = _run(True, **kw)
    assert head.last_update.startswith(expect)
    assert _rel(w[0], w_ref[0]) < 1e-6


def test_bad_arguments():
    head = shardfc.ShardedMarginHead(D, C, impl="triton", device=DEVICE)
    with pytest.raises(ValueError, match=r"fused_update=True needs the 'sgd' optimizer"):
        partial_fc.head_optimizer(head, "adamw", lr=0.1, fused_update=True)
    with pytest.raises(TypeError, match=r"fused_update must be True or False, got 'yes'"):
        partial_fc.head_optimizer(head, "sgd", lr=0.1, fused_update="yes")
    with pytest.raises(TypeError, match=r"fused_update=True needs a ShardedMarginHead, got Linear"):
        partial_fc.head_optimizer(torch.nn.Linear(2, 3), "sgd", lr=0.1, fused_update=True)


def test_the_trainers_step_with_the_fused_update(monkeypatch):
    """``shardfc train``'s step (zero_grad, forward, backward, clip the backbone, both optimizers,
    the schedules) with head_update 'fused' trains the head as with 'optimizer' (faked onto this
    device: the interpreter, or the GPU)."""
    import dataclasses

    import shardfc.train.build as build
    from shardfc.parallel.context import DistContext
    from shardfc.train.config import TrainConfig
    from shardfc.train.step import apply_gradients

    monkeypatch.setattr(build, "fused_head_update", lambda cfg, device, amp: cfg.head_update == "fused")
    base = TrainConfig(image_size=[16, 16], embedding_dim=D, synthetic_identities=C, head_impl="triton", warmup_steps=1,
                       grad_clip=0.5, backbone="tiny")
    heads = {}
    for mode in ("optimizer", "fused"):
        cfg = dataclasses.replace(base, head_update=mode).validate()
        torch.manual_seed(0)
        parts = build.build_parts(cfg, DistContext(device=DEVICE), C, (16, 16), total_steps=4, amp_dtype=None)
        for step in range(2):
            parts.opt_backbone.zero_grad()
            parts.opt_head.zero_grad(set_to_none=False)
            g = torch.Generator().manual_seed(step)
            images = torch.randn(12, 3, 16, 16, generator=g).to(DEVICE)
            labels = torch.randint(0, C, (12,), generator=g).to(DEVICE)
            parts.head(parts.backbone(images), labels).backward()
            apply_gradients(parts, cfg.grad_clip, DistContext(device=DEVICE), head_grad_clip=cfg.head_grad_clip)
        assert parts.head.last_update == ("fused" if mode == "fused" else None)
        heads[mode] = parts.head.weight.detach().double().cpu()
    assert _rel(heads["fused"], heads["optimizer"]) < 1e-5
