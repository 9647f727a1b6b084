"""Sub-center ArcFace under Partial FC with the row-sparse gradient and low-precision centres, in one
process: the sampled rows are every centre of the sampled classes (class-major), the compact
gradient equals the dense float64 reference's on them, and the optimizers apply it like a dense one."""

import pytest
import torch
from dense_losses import dense_loss
from sparse_steps import step_both

import shardfc
from sgd_only import SGD_MOMENTUM
from shardfc import margins as M
from shardfc.head import kernels
from shardfc.head.module import init_rows
from shardfc.head.partial_fc import RowGrad, head_optimizer

C, D, K, B = 23, 5, 3, 11
TOL = 1e-10


def _rel(a, b):
    return float((a - b).abs().max() / b.abs().max().clamp(min=1e-300))


def _data(seed, first_shard=False, ignore=False, batch=B):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(batch, D, generator=g, dtype=torch.float64) * 3
    y = torch.randint(0, 6 if first_shard else C, (batch,), generator=g)
    if ignore:
        y[::4] = -1
    return x, y


def _head(sparse, devices=None, chunk=None, margin=None, filter_threshold=None, dtype=torch.float64, rate=0.4):
    return shardfc.ShardedMarginHead(
        D, C, margin=margin or M.ArcFace(32.0, 0.4), subcenters=K, sample_rate=rate, sample_seed=5,
        sparse_grad=sparse, chunk_size=chunk, interclass_filter_threshold=filter_threshold,
        devices=["cpu"] * devices if devices else None, dtype=dtype,
    )


@pytest.mark.parametrize("devices", [None, 3], ids=["single", "devices=3"])
@pytest.mark.parametrize("chunk", [None, 2])
@pytest.mark.parametrize(
    "margin,filter_threshold,first_shard,ignore",
    [
        (M.ArcFace(32.0, 0.4), None, False, False),
        (M.CosFace(16.0, 0.3), 0.2, False, True),
        (M.ArcFace(32.0, 0.4), None, True, True),
    ],
    ids=["arcface", "cosface+filter+ignore", "labels_on_first_shard+ignore"],
)
def test_sparse_gradient_equals_dense_reference_on_sampled_centre_rows(
    monkeypatch, devices, chunk, margin, filter_threshold, first_shard, ignore
):
    """23 classes over 3 shards (8, 8, 7), K = 3; without a chunk size SAMPLED_BLOCK = 7 rows makes
    blocks of 2 whole classes (6 rows), several per shard. A batch of 5: each shard samples
    max(⌈0.4·n⌉, 5) = 5 classes (the batch size bounds its positives), a real sample."""
    monkeypatch.setattr(kernels, "SAMPLED_BLOCK", 7)
    x, y = _data(1, first_shard, ignore, batch=5)
    head = _head(True, devices, chunk, margin, filter_threshold)
    xs = x.clone().requires_grad_()
    loss = head(xs, y)
    loss.backward()

    got = head.take_sampled_rows()
    centre_rows, values, offset = [], [], 0
    for w in head.shard_weights:
        assert w.grad is None  # autograd never saw a weight gradient
        entry = got[w]
        assert isinstance(entry, RowGrad)
        assert entry.values.shape == (entry.rows.numel(), D)
        by_class = entry.rows.view(-1, K)
        assert torch.equal(by_class, by_class[:, :1] + torch.arange(K))  # whole classes, class-major
        centre_rows.append(entry.rows + offset)
        values.append(entry.values)
        offset += w.shape[0]
    centre_rows, values = torch.cat(centre_rows), torch.cat(values)
    classes = torch.unique(centre_rows // K)
    assert classes.numel() < C  # a real sample, not every class

    W = init_rows(0, C * K, D, 0).double().requires_grad_()
    xr = x.clone().requires_grad_()
    ref = dense_loss(xr, W, y, margin, subcenters=K, filter_threshold=filter_threshold, classes=classes)
    ref.backward()
    assert _rel(loss.detach(), ref.detach()) < TOL
    assert _rel(xs.grad, xr.grad) < TOL
    assert _rel(values, W.grad[centre_rows]) < TOL
    others = torch.ones(C * K, dtype=torch.bool)
    others[centre_rows] = False
    assert W.grad[others].abs().max() == 0


@pytest.mark.parametrize("chunk", [None, 2])
def test_dense_partial_fc_gradient_lands_on_the_centre_rows(monkeypatch, chunk):
    """Without sparse_grad the same blocks are added at their centre rows of the dense .grad."""
    monkeypatch.setattr(kernels, "SAMPLED_BLOCK", 4)  # one class (3 rows) per block
    x, y = _data(2, ignore=True)
    head = _head(False, chunk=chunk)
    head(x, y).backward()
    head.weight.grad.zero_()  # the in-place path: a second step adds into the existing .grad
    head(x, y).backward()
    (rows,) = head.sampled_rows  # the union of both steps' samples
    classes = torch.unique(rows // K)
    assert rows.numel() == classes.numel() * K
    sparse = _head(True, chunk=chunk)
    sparse(x, y).backward()
    sparse.take_sampled_rows()
    sparse(x, y).backward()  # the same second sample (same seed, same step)
    entry = sparse.take_sampled_rows()[sparse.weight]
    torch.testing.assert_close(entry.values, head.weight.grad[entry.rows], rtol=1e-12, atol=1e-14)


@pytest.mark.parametrize("name", ["sgd", "adamw"])
@pytest.mark.parametrize("devices", [None, 2])
def test_optimizer_update_equals_the_dense_gradient_run(name, devices):
    """Three steps of two micro-batches each: the sparse head's weights and state equal the dense
    gradient head's; centre rows never sampled (and their state) are untouched."""
    heads = [_head(s, devices, rate=0.15) for s in (False, True)]
    opts = [head_optimizer(h, name, lr=0.1, **SGD_MOMENTUM[name], weight_decay=5e-4) for h in heads]
    start = torch.cat([w.detach().clone() for w in heads[1].shard_weights])
    touched = step_both(heads, opts, lambda step, micro: _data(10 * step + micro, ignore=micro == 1, batch=4),
                        rows=C * K)
    dense_w = torch.cat([w.detach() for w in heads[0].shard_weights])
    sparse_w = torch.cat([w.detach() for w in heads[1].shard_weights])
    torch.testing.assert_close(sparse_w, dense_w, rtol=1e-12, atol=1e-14)
    for key in opts[0].state[heads[0].shard_weights[0]]:
        a = torch.cat([opts[0].state[w][key] for w in heads[0].shard_weights])
        b = torch.cat([opts[1].state[w][key] for w in heads[1].shard_weights])
        torch.testing.assert_close(b, a, rtol=1e-12, atol=1e-14, msg=key)
        assert torch.count_nonzero(b[~touched]) == 0, key
    assert not touched.all()
    assert torch.equal(sparse_w[~touched], start[~touched])
    assert torch.equal(touched.view(C, K), touched.view(C, K)[:, :1].expand(C, K))  # whole classes


def test_bf16_subcenter_head_tracks_the_fp32_head():
    """bf16 centres and momentum with K = 3, Partial FC and the sparse gradient: after 8 SGD steps
    every weight is within 8 bf16 ulps (at the largest |w|) of an fp32 head started from the same
    rounded weights; weight and state stay bf16."""
    low, ref = _head(True, dtype=torch.bfloat16, rate=0.5), _head(True, dtype=torch.float32, rate=0.5)
    with torch.no_grad():
        ref.weight.copy_(low.weight.float())
    start = low.weight.detach().clone()
    kw = dict(lr=0.02, momentum=0.9, weight_decay=5e-4)
    opts = [head_optimizer(h, "sgd", **kw) for h in (low, ref)]
    for step in range(8):
        x, y = _data(100 + step)
        for head, opt in zip((low, ref), opts):
            opt.zero_grad(set_to_none=False)
            head(x.float(), y).backward()
            opt.step()
    err = (low.weight.float() - ref.weight).abs().max().item()
    assert err <= 8 * 2**-8 * ref.weight.abs().max().item(), err
    assert not torch.equal(low.weight, start)
    assert low.weight.dtype == torch.bfloat16 and low.weight.shape == (C * K, D)
    assert opts[0].state[low.weight]["momentum_buffer"].dtype == torch.bfloat16
