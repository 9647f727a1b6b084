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
        (lambda: M.AdaFace(scale=0), ValueError, "scale must be > 0, got 0.0"),
        (lambda: M.AdaFace(scale="64"), TypeError, "scale must be a real number, got '64'"),
        (lambda: M.AdaFace(h=-0.1), ValueError, "h must be >= 0, got -0.1"),
        (lambda: M.AdaFace(momentum=-0.5), ValueError, "momentum must be >= 0, got -0.5"),
        (lambda: M.AdaFace(momentum="a"), TypeError, "momentum must be a real number, got 'a'"),
        (lambda: M.MagFace(scale=-1), ValueError, "scale must be > 0, got -1.0"),
        (lambda: M.MagFace(scale=None), TypeError, "scale must be a real number, got None"),
        (lambda: M.MagFace(l_a=0), ValueError, "l_a must be > 0, got 0.0"),
        (lambda: M.MagFace(l_a="1"), TypeError, "l_a must be a real number, got '1'"),
        (lambda: M.MagFace(l_a=-20, u_a=0), ValueError, "l_a must be > 0, got -20.0"),
        (lambda: M.MagFace(u_a=0), ValueError, "u_a must be > 0, got 0.0"),
        (lambda: M.MagFace(u_a="1"), TypeError, "u_a must be a real number, got '1'"),
        (lambda: M.MagFace(l_a=50, u_a=50), ValueError, "u_a must be > l_a=50, got 50"),
        (lambda: M.MagFace(l_m=-0.1), ValueError, "l_m must be >= 0, got -0.1"),
        (lambda: M.MagFace(l_m="0"), TypeError, "l_m must be a real number, got '0'"),
        (lambda: M.MagFace(l_m=-0.2, u_m=-0.1), ValueError, "l_m must be >= 0, got -0.2"),
        (lambda: M.MagFace(u_m="0"), TypeError, "u_m must be a real number, got '0'"),
        (lambda: M.MagFace(l_m=0.0, u_m=-0.1), ValueError, "u_m must be >= 0, got -0.1"),
        (lambda: M.MagFace(u_m=math.pi / 2), ValueError, "u_m must be < pi/2, got 1.57"),
        (lambda: M.MagFace(lambda_g=-1), ValueError, "lambda_g must be >= 0, got -1.0"),
    ],
)
def test_bad_parameters_named(make, err, match):
    with pytest.raises(err, match=match):
        make()


def test_equal_margin_bounds_and_a_momentum_of_one_are_allowed():
    """``u_m = l_m`` is a constant margin (ArcFace's); momentum 1 keeps only the last batch."""
    assert M.MagFace(l_m=0.5, u_m=0.5).margin_of(torch.tensor([5.0, 50.0, 500.0])).tolist() == [0.5] * 3
    assert M.AdaFace(momentum=1.0).momentum == 1.0
    assert M.MagFace(u_m=1.5).u_m == 1.5  # any margin below π/2


def test_the_targets_need_the_norms():
    for margin in (M.AdaFace(), M.MagFace()):
        with pytest.raises(ValueError) as e:
            margin.target(torch.zeros(2))
        assert str(e.value) == f"{type(margin).__name__}.target needs the feature norms (norm=None given)"


@pytest.mark.parametrize("make", [_adaface, M.MagFace], ids=["adaface", "magface"])
def test_cosines_past_one_by_rounding_count_as_one(make):
    norm = torch.tensor([30.0, 30.0, 80.0, 80.0], dtype=torch.float64)
    past = torch.tensor([1.0 + 1e-12, -1.0 - 1e-12, 1.5, -1.5], dtype=torch.float64)
    at = torch.tensor([1.0, -1.0, 1.0, -1.0], dtype=torch.float64)
    for got, want in zip(make().target(past, norm), make().target(at, norm)):
        assert torch.equal(got, want)


def test_adaface_quality_is_clipped_to_one_either_way():
    """ẑ = h·(‖x‖ − μ)/(σ + ε) is clipped to [−1, 1]: a norm far from the mean gives ±1, not ±2."""
    m = M.AdaFace(h=1.0)
    m.norm_mean, m.norm_std = 50.0, 10.0
    q = m.quality(torch.tensor([0.5, 45.0, 55.0, 99.0], dtype=torch.float64))
    assert q[0] == -1.0 and q[3] == 1.0
    assert q[1] == pytest.approx(-5 / (10 + 1e-3)) and q[2] == pytest.approx(5 / (10 + 1e-3))


def test_magnitudes_at_the_clip_bounds_get_no_gradient():
    """``a = clip(‖x‖, l_a, u_a)``: at a bound exactly, as outside, the derivative is 0."""
    m = M.MagFace(l_a=10.0, u_a=110.0)
    a, da = m._magnitude(torch.tensor([5.0, 10.0, 60.0, 110.0, 200.0], dtype=torch.float64))
    assert a.tolist() == [10.0, 10.0, 60.0, 110.0, 110.0]
    assert da.tolist() == [0.0, 0.0, 1.0, 0.0, 0.0]


def test_magface_at_the_edge_of_its_fallback():
    """θ = π − m(a) exactly is still ``cos(θ + m)`` (= −1), as ArcFace's."""
    mag = M.MagFace(scale=1.0)
    norm = torch.tensor([60.0], dtype=torch.float64)
    m = float(mag.margin_of(norm))
    edge = torch.tensor([math.cos(math.pi - m)], dtype=torch.float64)
    assert float(mag.target(edge, norm)[0]) == pytest.approx(-1.0, abs=1e-12)


def test_adaface_angles_past_pi_are_held_at_pi():
    """θ − m·ẑ passes π for a near-opposite target of a low-quality sample (ẑ < 0): the angle is
    clipped to π (the target is s·(−1 − m·(1 + ẑ))) and gets no gradient there."""
    m = M.AdaFace(scale=1.0, margin=0.4, h=1.0)
    m.norm_mean, m.norm_std = 50.0, 10.0
    norm = torch.tensor([0.5], dtype=torch.float64)  # ẑ = −1
    value, grad, _ = m.target(torch.tensor([-0.999], dtype=torch.float64), norm)
    assert float(value) == pytest.approx(-1.0) and float(grad) == 0.0
    # θ = π exactly (ẑ = 0): the bound itself is clipped too, its gradient 0, not sin(π)'s rounding.
    _, grad, _ = m.target(torch.tensor([-1.0], dtype=torch.float64), torch.tensor([50.0], dtype=torch.float64))
    assert float(grad) == 0.0


def test_adaface_on_meta_leaves_the_statistics_where_they_are():
    """``shardfc plan`` replays the step on ``meta``: the quality has the norms' shape and the running
    statistics keep their values and device."""
    m = _adaface()
    q = m.quality(torch.zeros(3, device="meta"))
    assert q.shape == (3,) and q.device.type == "meta"
    assert m.state() == {"norm_mean": 50.0, "norm_std": 30.0} and m._stats.device.type == "cpu"


@pytest.mark.parametrize("low", [torch.bfloat16, torch.float16])
def test_the_norms_of_low_precision_embeddings_are_taken_in_fp32(low):
    """AdaFace's running statistics from bf16/fp16 embeddings are those of the same values in fp32
    (a norm summed in 8 or 11 bits of mantissa would be off by a rounding)."""
    x, y, _ = _data(3)
    x = (x * 7).to(low)
    heads = [shardfc.ShardedMarginHead(D, C, margin=M.AdaFace()) for _ in range(2)]
    heads[0](x, y)
    heads[1](x.float(), y)
    assert heads[0].margin.state() == heads[1].margin.state()
    assert heads[0].margin.norm_mean != 20.0  # they moved


@pytest.mark.parametrize("key,bad,why", [("norm_mean", float("nan"), "must be finite"),
                                         ("norm_std", float("inf"), "must be finite"),
                                         ("norm_std", -30.0, "must be >= 0")])
def test_adaface_statistics_that_are_not_numbers_or_a_negative_std_are_refused(key, bad, why):
    """A NaN mean or std made every quality, target logit and the loss NaN from the next step on (a
    resumed checkpoint's, or one set by hand); a negative std turned the quality around. Refused by
    name, through the setters and :meth:`AdaFace.load_state`, and the statistics stay as they were."""
    m = _adaface()
    with pytest.raises(ValueError, match=f"^{key} {why}"):
        setattr(m, key, bad)
    saved = dict(m.state(), **{key: bad})
    with pytest.raises(ValueError, match=f"^AdaFace's saved {key} {why}, got"):
        m.load_state(saved)
    with pytest.raises(TypeError, match=f"^{key} must be a real number"):
        setattr(m, key, "20")
    assert m.state() == {"norm_mean": 50.0, "norm_std": 30.0}
    # through a head's sharded state, as a resumed run reads it
    head = shardfc.ShardedMarginHead(D, C, margin=_adaface())
    state = head.sharded_state()
    state["extras"][f"margin.{key}"] = bad
    state["tensors"]["weight"] = torch.zeros_like(state["tensors"]["weight"])
    before = head.weight.detach().clone()
    with pytest.raises(ValueError, match=f"AdaFace's saved {key} {why}"):
        head.load_sharded_state(state)
    assert torch.equal(head.weight.detach(), before), "a refused state wrote the head's rows"
    # what was taken before stays taken: a one-element tensor, a std of 0
    m.load_state({"norm_mean": torch.tensor(40.0, dtype=torch.float64), "norm_std": 0.0})
    assert m.state() == {"norm_mean": 40.0, "norm_std": 0.0}
