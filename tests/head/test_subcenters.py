"""Sub-center ArcFace in one process: single and devices mode, chunked, Partial FC, state, predict,
and dropping the non-dominant centres, against the dense float64 reference of ``dense_losses``."""

import math

import pytest
import torch
import torch.nn.functional as F
from dense_losses import dense_loss

import shardfc
from shardfc import margins as M
from shardfc.head.module import init_rows
from shardfc.head.subcenters import drop_subcenters, noisy_samples, subcenter_counts

C, D, K, B = 11, 5, 3, 9
TOL = 1e-10


def _data(seed=0, ignore=False):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(B, D, generator=g, dtype=torch.float64) * 3
    y = torch.randint(0, C, (B,), generator=g)
    if ignore:
        y[::4] = -1
    return x, y, torch.randn(B, generator=g, dtype=torch.float64)


def _grad_weight(head):
    return torch.cat([w.grad for w in head.shard_weights])


def _rel(a, b):
    return float((a - b).abs().max() / b.abs().max().clamp(min=1e-300))


@pytest.mark.parametrize("devices", [None, 3], ids=["single", "devices=3"])
@pytest.mark.parametrize("chunk", [None, 2])
@pytest.mark.parametrize(
    "margin,reduction,ignore",
    [(M.ArcFace(32.0, 0.5), "mean", False), (M.CosFace(16.0, 0.3), "none", True), (M.NormSoftmax(8.0), "sum", True)],
    ids=["arcface-mean", "cosface-none-ignore", "norm-sum-ignore"],
)
def test_subcenter_loss_and_gradients_equal_dense(devices, chunk, margin, reduction, ignore):
    x, y, up = _data(1, ignore)
    head = shardfc.ShardedMarginHead(
        D, C, margin=margin, subcenters=K, chunk_size=chunk, reduction=reduction,
        devices=["cpu"] * devices if devices else None, dtype=torch.float64,
    )
    assert sum(w.shape[0] for w in head.shard_weights) == C * K
    xs = x.clone().requires_grad_()
    loss = head(xs, y)
    loss.backward(up if reduction == "none" else None)

    W = init_rows(0, C * K, D, 0).double().requires_grad_()
    xr = x.clone().requires_grad_()
    ref = dense_loss(xr, W, y, margin, subcenters=K, reduction=reduction)
    ref.backward(up if reduction == "none" else None)
    assert _rel(loss.detach(), ref.detach()) < TOL
    assert _rel(xs.grad, xr.grad) < TOL
    assert _rel(_grad_weight(head), W.grad) < TOL
    # Each (sample, class) sends gradient to one centre: some centres must be untouched by some class.
    assert (W.grad.view(C, K, D).abs().sum(2) == 0).any()


@pytest.mark.parametrize("chunk", [None, 4])
def test_weight_gradient_accumulates_in_place(chunk):
    """A second backward adds into the existing .grad (the in-place path), centre row by centre row."""
    x, y, _ = _data(6)
    head = shardfc.ShardedMarginHead(D, C, subcenters=K, chunk_size=chunk, dtype=torch.float64)
    head(x, y).backward()
    grad_buffer = head.weight.grad
    head(x * 0.5, y).backward()
    assert head.weight.grad is grad_buffer  # added in place
    W = init_rows(0, C * K, D, 0).double().requires_grad_()
    dense_loss(x, W, y, head.margin, subcenters=K).backward()
    dense_loss(x * 0.5, W, y, head.margin, subcenters=K).backward()
    assert _rel(head.weight.grad, W.grad) < TOL


def test_subcenters_one_is_the_plain_head():
    """K = 1 (the default) against the plain dense reference, not against another K = 1 head."""
    x, y, _ = _data(2)
    head = shardfc.ShardedMarginHead(D, C, subcenters=1, dtype=torch.float64)
    xs = x.clone().requires_grad_()
    head(xs, y).backward()
    W = init_rows(0, C, D, 0).double().requires_grad_()
    xr = x.clone().requires_grad_()
    shardfc.reference_loss(xr, W, y, head.margin).backward()
    assert _rel(xs.grad, xr.grad) < TOL and _rel(head.weight.grad, W.grad) < TOL


def test_partial_fc_samples_whole_classes_and_equals_dense_over_them():
    x, y, _ = _data(3)
    head = shardfc.ShardedMarginHead(D, C, margin=M.ArcFace(32.0, 0.4), subcenters=K, sample_rate=0.4, dtype=torch.float64)
    xs = x.clone().requires_grad_()
    head(xs, y).backward()
    (rows,) = head.sampled_rows
    classes = torch.unique(rows // K)
    assert rows.numel() == classes.numel() * K  # every centre of a sampled class
    # a fixed count: ⌈0.4·C⌉, or the batch size (the most positives a batch can have) when larger
    assert classes.numel() == min(C, max(math.ceil(0.4 * C), y.numel())) < C and torch.isin(y, classes).all()
    W = init_rows(0, C * K, D, 0).double().requires_grad_()
    xr = x.clone().requires_grad_()
    dense_loss(xr, W, y, head.margin, subcenters=K, classes=classes).backward()
    assert _rel(xs.grad, xr.grad) < TOL
    assert _rel(head.weight.grad, W.grad) < TOL
    unsampled = torch.ones(C * K, dtype=torch.bool)
    unsampled[rows] = False
    assert head.weight.grad[unsampled].abs().max() == 0


def test_predict_takes_the_best_centre():
    x, _, _ = _data(4)
    head = shardfc.ShardedMarginHead(D, C, subcenters=K, devices=["cpu"] * 2, dtype=torch.float64)
    scores, ids = head.predict(x, k=4)
    W = init_rows(0, C * K, D, 0).double()
    dense = (F.normalize(x, dim=1) @ F.normalize(W, dim=1).t()).view(B, C, K).amax(2) * head.margin.s
    top, top_ids = dense.topk(4, dim=1)
    assert torch.allclose(scores, top, atol=1e-12) and torch.equal(ids, top_ids)


def test_sharded_state_is_class_indexed_and_reshards():
    head = shardfc.ShardedMarginHead(D, C, subcenters=K, dtype=torch.float64, init_seed=5)
    state = head.sharded_state()
    assert tuple(state["tensors"]["weight"].shape) == (C, K, D)
    other = shardfc.ShardedMarginHead(D, C, subcenters=K, devices=["cpu"] * 3, dtype=torch.float64)
    other.load_sharded_state(state)
    assert torch.equal(torch.cat([w.detach() for w in other.shard_weights]), head.weight.detach())
    plain = shardfc.ShardedMarginHead(D, C, dtype=torch.float64)
    with pytest.raises(ValueError, match="subcenters=1"):
        plain.load_sharded_state(state)


def test_drop_subcenters_keeps_dominant_centre_and_flags_far_samples():
    head = shardfc.ShardedMarginHead(D, 4, subcenters=3, devices=["cpu"] * 2, dtype=torch.float64)
    W = init_rows(0, 12, D, 0).double()
    # Class c's samples: three near centre 3c+2, one near centre 3c (a minority), and for class 0 one
    # pointing away from every centre of class 0 (noisy).
    xs, ys = [], []
    for c in range(4):
        for _ in range(3):
            xs.append(W[3 * c + 2] + 1e-4 * torch.randn(D, dtype=torch.float64))
            ys.append(c)
        xs.append(W[3 * c])
        ys.append(c)
    far = -F.normalize(W[0:3], dim=1).sum(0)
    xs.append(far)
    ys.append(0)
    x, y = torch.stack(xs), torch.tensor(ys)
    counts = subcenter_counts(head, x[:8], y[:8])
    counts = subcenter_counts(head, x[8:], y[8:], counts)  # accumulates over batches
    assert counts.sum() == len(ys) and tuple(counts.shape) == (4, 3)
    drop_subcenters(head, counts)
    assert head.subcenters == 1
    assert torch.equal(torch.cat([w.detach() for w in head.shard_weights]), W[[2, 5, 8, 11]])
    noisy = noisy_samples(head, x, y, max_angle=75.0)
    cos = (F.normalize(x, dim=1) * F.normalize(W[[2, 5, 8, 11]][y], dim=1)).sum(1)
    assert torch.equal(noisy, cos < math.cos(math.radians(75.0)))
    assert noisy[-1] and not noisy[:3].any()
    loss = head(x, y)  # an ordinary head now
    assert torch.isfinite(loss)


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(subcenters=0), "subcenters must be a positive integer, got 0"),
        (dict(subcenters=2.0), "subcenters must be a positive integer, got 2.0"),
        (dict(subcenters=256), "subcenters must be <= 255, got 256"),
    ],
)
def test_bad_subcenters_named(kwargs, match):
    with pytest.raises(ValueError, match=match):
        shardfc.ShardedMarginHead(D, C, **kwargs)


def test_drop_subcenters_bad_input_named():
    head = shardfc.ShardedMarginHead(D, C, subcenters=2)
    with pytest.raises(ValueError, match=r"counts must have shape \(11, 2\)"):
        drop_subcenters(head, torch.zeros(C, 3, dtype=torch.int64))
    with pytest.raises(ValueError, match="max_angle must be .* got 200"):
        noisy_samples(head, torch.randn(2, D), torch.tensor([0, 1]), max_angle=200)
    with pytest.raises(ValueError, match="subcenters=1"):
        drop_subcenters(shardfc.ShardedMarginHead(D, C), torch.zeros(C, 1))


def test_ignored_labels_are_neither_counted_nor_noisy():
    head = shardfc.ShardedMarginHead(D, C, subcenters=K, dtype=torch.float64)
    x, y, _ = _data(2, ignore=True)
    counts = subcenter_counts(head, x, y)
    assert int(counts.sum()) == int((y >= 0).sum()) < B
    noisy = noisy_samples(head, x, y, max_angle=1.0)  # every labelled sample is farther than 1 degree
    assert torch.equal(noisy, y >= 0)


def test_embeddings_in_another_dtype_than_the_centres_are_compared_in_the_centres():
    head = shardfc.ShardedMarginHead(D, C, subcenters=K, dtype=torch.float64)
    x, y, _ = _data(3)
    x32 = x.float()
    assert torch.equal(subcenter_counts(head, x32, y), subcenter_counts(head, x32.double(), y))
    assert torch.equal(noisy_samples(head, x32, y, max_angle=80.0), noisy_samples(head, x32.double(), y, max_angle=80.0))
