"""AdaFace and MagFace in one process: their derivatives, running statistics, state, and the head's
loss and gradients (feature norm included) against the dense float64 reference."""

import copy
import math

import pytest
import torch
from dense_losses import _target_logit, dense_loss

import shardfc
from shardfc import margins as M
from shardfc.head.module import init_rows

C, D, B = 9, 5, 12
TOL = 1e-10


def _data(seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.nn.functional.normalize(torch.randn(B, D, generator=g, dtype=torch.float64), dim=1)
    x = x * (3 + 130 * torch.rand(B, 1, generator=g, dtype=torch.float64))  # norms inside and outside [10, 110]
    y = torch.randint(0, C, (B,), generator=g)
    y[5] = -1
    return x, y, torch.randn(B, generator=g, dtype=torch.float64)


def _rel(a, b):
    return float((a - b).abs().max() / b.abs().max().clamp(min=1e-300))


def _adaface():
    m = M.AdaFace()
    m.norm_mean, m.norm_std = 50.0, 30.0
    return m


def test_paper_defaults_and_build_by_name():
    a, m = M.build_margin("adaface"), M.build_margin("MagFace")
    assert (a.s, a.m, a.h, a.momentum, a.norm_mean, a.norm_std) == (64.0, 0.4, 0.333, 0.01, 20.0, 100.0)
    assert (m.s, m.l_a, m.u_a, m.l_m, m.u_m, m.lambda_g) == (64.0, 10.0, 110.0, 0.45, 0.8, 35.0)
    assert M.build_margin("magface", l_m=0.3).l_m == 0.3


@pytest.mark.parametrize("margin", [_adaface(), M.MagFace()], ids=["adaface", "magface"])
def test_target_derivatives_equal_autograd(margin):
    g = torch.Generator().manual_seed(1)
    c = (torch.rand(200, generator=g, dtype=torch.float64) * 1.98 - 0.99).requires_grad_()
    norm = (1 + 140 * torch.rand(200, generator=g, dtype=torch.float64)).requires_grad_()
    value, d_raw, d_norm = margin.target(c.detach(), norm.detach())
    ref = _target_logit(margin, c, norm)
    gc, gn = torch.autograd.grad(ref.sum(), (c, norm), allow_unused=True, materialize_grads=True)
    assert _rel(value, ref.detach()) < 1e-12
    assert _rel(d_raw, gc) < 1e-9
    assert (d_norm - gn).abs().max() < 1e-9  # AdaFace: 0 (stop-gradient); MagFace: through m(a)


@pytest.mark.parametrize("devices", [None, 2], ids=["single", "devices=2"])
@pytest.mark.parametrize("chunk", [None, 2])
@pytest.mark.parametrize("name,reduction", [("adaface", "mean"), ("adaface", "none"), ("magface", "mean"), ("magface", "sum")])
def test_head_equals_dense(devices, chunk, name, reduction):
    x, y, up = _data(2)
    margin = _adaface() if name == "adaface" else M.MagFace()
    ref_margin = copy.deepcopy(margin)
    head = shardfc.ShardedMarginHead(
        D, C, margin=margin, chunk_size=chunk, reduction=reduction, devices=["cpu"] * devices if devices else None,
        dtype=torch.float64,
    )
    xs = x.clone().requires_grad_()
    loss = head(xs, y)
    loss.backward(up if reduction == "none" else None)
    if name == "adaface":  # the head stepped the statistics on the valid samples before using them
        norms = torch.linalg.vector_norm(x[y != -1], dim=1)
        ref_margin.norm_mean = 0.99 * 50.0 + 0.01 * float(norms.mean())
        ref_margin.norm_std = 0.99 * 30.0 + 0.01 * float(norms.std())
        assert abs(margin.norm_mean - ref_margin.norm_mean) < 1e-12
        assert abs(margin.norm_std - ref_margin.norm_std) < 1e-12
    W = init_rows(0, C, D, 0).double().requires_grad_()
    xr = x.clone().requires_grad_()
    ref = dense_loss(xr, W, y, ref_margin, reduction=reduction)
    ref.backward(up if reduction == "none" else None)
    assert _rel(loss.detach(), ref.detach()) < TOL
    assert _rel(xs.grad, xr.grad) < TOL
    assert _rel(torch.cat([w.grad for w in head.shard_weights]), W.grad) < TOL


def test_magface_norm_gets_its_gradient():
    """The regulariser λ_g·(a/u_a² + 1/a) and its derivative λ_g·(1/u_a² − 1/a²) inside [l_a, u_a];
    outside the bounds ``a`` is clipped and the norm gets no regulariser gradient."""
    m = M.MagFace()
    value, grad = m.regularizer(torch.tensor([5.0, 20.0, 120.0], dtype=torch.float64))
    assert value[1] == pytest.approx(35 * (20 / 110**2 + 1 / 20))
    assert grad[1] == pytest.approx(35 * (1 / 110**2 - 1 / 400)) and grad[0] == 0 and grad[2] == 0


def test_adaface_statistics_training_only_and_saved():
    x, y, _ = _data(3)
    head = shardfc.ShardedMarginHead(D, C, margin=M.AdaFace(), dtype=torch.float64)
    head.eval()
    head(x, y)
    assert (head.margin.norm_mean, head.margin.norm_std) == (20.0, 100.0)
    head.train()
    head(x, y)
    assert head.margin.norm_mean != 20.0
    state = head.sharded_state()
    assert state["extras"]["margin.norm_mean"] == head.margin.norm_mean
    other = shardfc.ShardedMarginHead(D, C, margin=M.AdaFace(), devices=["cpu"] * 2, dtype=torch.float64)
    other.load_sharded_state(state)
    assert other.margin.state() == head.margin.state()
    assert other.margin == head.margin  # equality compares hyper-parameters, not the running state
    head(x[:1], y[:1])  # one sample has no std: statistics unchanged
    assert head.margin.state() == other.margin.state()


@pytest.mark.parametrize(
    "make,err,match",
    [
        (lambda: M.AdaFace(margin=-0.1), ValueError, "margin must be >= 0, got -0.1"),
        (lambda: M.AdaFace(h="x"), TypeError, "h must be a real number, got 'x'"),
        (lambda: M.AdaFace(momentum=1.5), ValueError, r"momentum must be in \[0, 1\], got 1.5"),
        (lambda: M.MagFace(l_a=50, u_a=40), ValueError, "u_a must be > l_a=50, got 40"),
        (lambda: M.MagFace(l_m=0.5, u_m=0.4), ValueError, "u_m must be >= l_m=0.5, got 0.4"),
        (lambda: M.MagFace(u_m=2.0), ValueError, "u_m must be < pi/2, got 2.0"),
        (lambda: M.MagFace(lambda_g=math.inf), ValueError, "lambda_g must be finite, got inf"),
        (lambda: M.build_margin("adaface", t_alpha=0.1), TypeError, "margin 'adaface'"),
    ],
)
def test_bad_parameters_named(make, err, match):
    with pytest.raises(err, match=match):
        make()
