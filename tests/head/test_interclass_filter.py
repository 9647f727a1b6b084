"""Inter-class filtering in one process: equal to a dense head with the near classes masked."""

import pytest
import torch
import torch.nn.functional as F
from dense_losses import dense_loss

import shardfc
from shardfc import margins as M
from shardfc.head.module import init_rows

C, D, B = 13, 4, 10
TOL = 1e-10


def _data(seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(B, D, generator=g, dtype=torch.float64)
    y = torch.randint(0, C, (B,), generator=g)
    y[3] = -1
    return x, y, torch.randn(B, generator=g, dtype=torch.float64)


def _rel(a, b):
    return float((a - b).abs().max() / b.abs().max().clamp(min=1e-300))


def _masked_fraction(t, K):
    """How many (sample, negative) pairs the dense reference masks: the tests must mask some."""
    W = F.normalize(init_rows(0, C * K, D, 0).double(), dim=1).view(C, K, D)
    cos = torch.einsum("ikd,jld->ijkl", W, W).amax(dim=(2, 3))  # an upper bound over the target's centres
    return float((cos > t).float().mean())


@pytest.mark.parametrize("devices", [None, 3], ids=["single", "devices=3"])
@pytest.mark.parametrize("chunk", [None, 2])
@pytest.mark.parametrize("K", [1, 2])
@pytest.mark.parametrize("t,reduction", [(0.3, "mean"), (0.05, "none"), (0.9, "sum")])
def test_filtered_loss_and_gradients_equal_dense(devices, chunk, K, t, reduction):
    x, y, up = _data(K)
    margin = M.ArcFace(16.0, 0.4)
    head = shardfc.ShardedMarginHead(
        D, C, margin=margin, subcenters=K, interclass_filter_threshold=t, chunk_size=chunk, reduction=reduction,
        devices=["cpu"] * devices if devices else None, dtype=torch.float64,
    )
    xs = x.clone().requires_grad_()
    loss = head(xs, y)
    loss.backward(up if reduction == "none" else None)
    W = init_rows(0, C * K, D, 0).double().requires_grad_()
    xr = x.clone().requires_grad_()
    ref = dense_loss(xr, W, y, margin, subcenters=K, filter_threshold=t, reduction=reduction)
    ref.backward(up if reduction == "none" else None)
    assert torch.isfinite(loss).all()
    assert _rel(loss.detach(), ref.detach()) < TOL
    assert _rel(xs.grad, xr.grad) < TOL
    assert _rel(torch.cat([w.grad for w in head.shard_weights]), W.grad) < TOL
    # The filter is not a no-op here: without it the loss differs.
    unfiltered = dense_loss(x, W.detach(), y, margin, subcenters=K, reduction=reduction)
    assert (unfiltered - ref.detach()).abs().max() > 1e-6


def test_thresholds_mask_some_but_not_all():
    assert 0.05 < _masked_fraction(0.3, 1) < 0.9
    assert _masked_fraction(0.05, 2) > 0.4  # so that some chunks have every class masked (the −inf path)
    assert _masked_fraction(0.9, 1) > 1 / C  # beyond the diagonal


def test_partial_fc_filters_among_sampled_classes():
    x, y, _ = _data(5)
    head = shardfc.ShardedMarginHead(D, C, interclass_filter_threshold=0.2, sample_rate=0.7, dtype=torch.float64)
    xs = x.clone().requires_grad_()
    head(xs, y).backward()
    (rows,) = head.sampled_rows
    W = init_rows(0, C, D, 0).double().requires_grad_()
    xr = x.clone().requires_grad_()
    dense_loss(xr, W, y, head.margin, filter_threshold=0.2, classes=rows).backward()
    assert _rel(xs.grad, xr.grad) < TOL and _rel(head.weight.grad, W.grad) < TOL


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(interclass_filter_threshold=0.0), r"interclass_filter_threshold must be in \(0, 1\], got 0.0"),
        (dict(interclass_filter_threshold=1.5), r"interclass_filter_threshold must be in \(0, 1\], got 1.5"),
        (dict(interclass_filter_threshold="x"), "interclass_filter_threshold must be a finite number, got 'x'"),
        (dict(interclass_filter_threshold=0.5, label_smoothing=0.1), "label_smoothing=0.1"),
    ],
)
def test_bad_threshold_named(kwargs, match):
    with pytest.raises(ValueError, match=match):
        shardfc.ShardedMarginHead(D, C, **kwargs)
