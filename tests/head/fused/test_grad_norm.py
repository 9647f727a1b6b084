"""The head's clipping norm from the weight-gradient pass (issue 31 item 2): with
``measure_weight_grad_norm()``, the GPU implementations' backward sums the squares of the weight
gradient as it stores it, and ``take_weight_grad_sq_norm()`` returns that sum — equal to the float64
sum of squares of what was stored (``.grad``, or the compact rows of ``sparse_grad``), for every
layout: normalised and raw rows, sub-centres, the inter-class filter, Partial FC's rows scattered
into a dense ``.grad`` or kept compact, several shards, an existing ``.grad`` added into, samples
sharing a target and labels all on one shard. It says None where it cannot know."""

from __future__ import annotations

import copy

import pytest
import torch
from fused_pairs import DEVICE, MARGINS, C, D, trainer_steps

import shardfc
from shardfc.head import partial_fc

CASES = {
    "arcface": dict(),
    "softmax (raw rows)": dict(margin="softmax"),
    "subcentres": dict(subcenters=3),
    "filter": dict(interclass_filter_threshold=0.05),
    "partial fc, dense .grad": dict(margin="cosface", sample_rate=0.5),
    "partial fc, sparse rows": dict(sample_rate=0.5, sparse_grad=True),
    "two shards": dict(devices=[DEVICE, DEVICE], subcenters=2),
    "the gemm impl": dict(impl="gemm", subcenters=2),
}


def _head(margin="arcface", impl="triton", **kw):
    torch.manual_seed(0)
    head = shardfc.ShardedMarginHead(D, C, margin=copy.deepcopy(MARGINS[margin]), impl=impl,
                                     **({} if "devices" in kw else {"device": DEVICE}), **kw)
    head.measure_weight_grad_norm()
    return head


def _batch(seed=1, B=29, low=0, high=C):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(B, D, generator=g, dtype=torch.float64) * 3
    y = torch.randint(low, high, (B,), generator=g)
    y[:5] = y[5]  # samples sharing a target: their target terms add up in one row
    y[::7] = -1
    return x.float().to(DEVICE).requires_grad_(), y.to(DEVICE)


def _stored_sq(head) -> float:
    """The float64 sum of squares of what the head's backward stored."""
    if head.sparse_grad:
        return sum(float(v.double().square().sum()) for v in head.row_grad_values())
    return sum(float(w.grad.double().square().sum()) for w in head.shard_weights if w.grad is not None)


@pytest.mark.parametrize("case", list(CASES))
def test_the_measured_norm_is_the_stored_gradients(case):
    head = _head(**CASES[case])
    x, y = _batch()
    head(x, y).backward()
    assert head.last_impl == CASES[case].get("impl", "triton")
    got = head.take_weight_grad_sq_norm()
    want = _stored_sq(head)
    assert want > 0
    assert got is not None and got.dtype == torch.float32 and got.dim() == 0
    assert abs(float(got) - want) <= 1e-5 * want, (float(got), want)
    assert head.take_weight_grad_sq_norm() is None  # taken: nothing until the next backward


def test_added_into_an_existing_gradient_and_labels_on_one_shard():
    """With ``.grad`` already there the backward adds into it in place: the sum is of what is
    stored after the add; the labels all sit on the second shard."""
    head = _head(devices=[DEVICE, DEVICE])
    for w in head.shard_weights:
        w.grad = torch.full_like(w, 0.01)
    x, y = _batch(low=C // 2 + 1, high=C)
    head(x, y).backward()
    want = _stored_sq(head)
    assert abs(float(head.take_weight_grad_sq_norm()) - want) <= 1e-5 * want


def test_none_where_it_cannot_say():
    x, y = _batch()
    torch_head = _head(impl="torch")  # the reference implementation measures nothing
    torch_head(x, y).backward()
    assert torch_head.take_weight_grad_sq_norm() is None

    head = _head()
    head(x, y).backward()
    head(x, y).backward()  # accumulation: the last backward's sum is not the norm of the sum
    assert head.take_weight_grad_sq_norm() is None
    head(x, y).backward()
    assert head.take_weight_grad_sq_norm() is not None  # counted afresh after a take

    head.measure_weight_grad_norm(False)
    head(x, y).backward()
    assert head.take_weight_grad_sq_norm() is None

    fused = _head()
    opt = partial_fc.head_optimizer(fused, "sgd", lr=0.1, fused_update=True)
    opt.zero_grad()
    fused(x, y).backward()  # the update is applied in the backward: no gradient stored
    assert fused.last_update == "fused" and fused.take_weight_grad_sq_norm() is None


def test_eval_forwards_do_not_count():
    head = _head()
    x, y = _batch()
    with torch.no_grad():
        head(x, y)
    head(x, y).backward()
    assert head.take_weight_grad_sq_norm() is not None


@pytest.mark.parametrize("optimizer", ["sgd", "adamw"])
@pytest.mark.parametrize("sample_rate", [1.0, 0.5])
def test_the_trainers_clip_reads_the_measured_norm_and_the_update_applies_it(monkeypatch, optimizer, sample_rate):
    """``shardfc train --head-grad-clip``: two steps clip the head with the norm the backward
    measured and let the optimizer divide the gradient as it reads it (torch's fused optimizer, here
    on the CPU; the row-sparse one under Partial FC) — no reduction or ``mul_`` over the stored
    gradient — and train the head exactly as the clip by a reduction and a ``mul_`` does."""

    import shardfc.train.builder.factory as build
    import shardfc.train.step as step_mod
    from shardfc.parallel.context import DistContext
    from shardfc.train.config import TrainConfig

    monkeypatch.setattr(partial_fc, "fused_optimizer_ok", lambda params: True)  # torch's fused kernels, as on CUDA
    cfg = TrainConfig(image_size=[16, 16], embedding_dim=D, synthetic_identities=C, head_impl="triton", warmup_steps=1,
                      grad_clip=0.5, head_grad_clip=0.05, backbone="tiny", optimizer=optimizer,
                      sample_rate=sample_rate, lr=0.5).validate()
    ctx = DistContext(device=DEVICE)
    measured = []

    def run(new_path: bool):
        with monkeypatch.context() as m:
            if not new_path:  # the clip as it was: a reduction over .grad, then mul_
                m.setattr(step_mod, "scales_in_step", lambda opt: False)
            else:
                def no_pass(*a, **k):
                    raise AssertionError("the clip ran a pass over the stored gradient")
                m.setattr(step_mod, "head_grads", no_pass)  # what a reduction or a mul_ would go over
            torch.manual_seed(0)
            parts = build.build_parts(cfg, ctx, C, (16, 16), total_steps=4, amp_dtype=None)
            if not new_path:
                parts.head.measure_weight_grad_norm(False)
            assert step_mod.scales_in_step(parts.opt_head) == new_path
            take = parts.head.take_weight_grad_sq_norm
            m.setattr(parts.head, "take_weight_grad_sq_norm", lambda: measured.append(take()) or measured[-1])
            trainer_steps(parts, cfg, ctx)
            assert not hasattr(parts.opt_head, "grad_scale")  # removed after the step
            return parts.head.weight.detach().double().cpu()

    new = run(True)
    assert len(measured) == 2 and all(t is not None and float(t) > cfg.head_grad_clip ** 2 for t in measured)
    old = run(False)
    assert all(t is None for t in measured[2:])
    assert (new - old).abs().max() <= 1e-5 * old.abs().max()


@pytest.mark.parametrize("fused", [False, True])
@pytest.mark.parametrize("rows", [False, True])
def test_row_sparse_sgd_divides_by_grad_scale(fused, rows):
    """:class:`RowSparseSGD` with ``grad_scale`` set moves the weights as with the gradient divided
    beforehand: its torch blocks and its fused kernel (``row_sgd_``), dense and at sampled rows."""
    g = torch.Generator().manual_seed(0)
    w0 = torch.randn(37, 20, generator=g)
    grad = torch.randn(37, 20, generator=g)
    idx = torch.tensor([0, 3, 4, 17, 36]) if rows else None
    scale = torch.tensor(3.7)
    out = []
    for divided in (False, True):
        p = torch.nn.Parameter(w0.clone())
        p.grad = grad / scale if divided else grad.clone()
        opt = partial_fc.RowSparseSGD([p], lr=0.3, momentum=0.9, weight_decay=0.01, nesterov=True, fused=fused,
                                      sampled_rows=(lambda: {p: idx}) if rows else None)
        for _ in range(2):
            if not divided:
                opt.grad_scale = scale
            opt.step()
            if not divided:
                del opt.grad_scale
        out.append(p.detach().double())
    assert not torch.equal(out[0], w0.double())
    torch.testing.assert_close(out[0], out[1], rtol=1e-6, atol=1e-6)
