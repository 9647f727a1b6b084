"""``shardfc.compat.arcface_torch.PartialFC_V2`` against the dense float64 reference on 1–3 gloo
ranks, its margins read from arcface_torch's modules, and its checkpoints in arcface_torch's layout
(``checkpoint_gpu_<rank>.pt``) read back by ``shardfc import-arcface``'s reader."""

from __future__ import annotations

import math
import os
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist

import shardfc
from shardfc import margins as M
from shardfc.compat.arcface_torch import PartialFC_V2, margin_from_arcface_torch
from shardfc.head.module import init_rows
from shardfc.parallel.launch import spawn
from shardfc.train.checkpointing.arcface_import import arcface_class_range, read_arcface_head

C, D = 23, 16
SIZES = {1: [7], 2: [5, 1], 3: [4, 0, 6]}  # a rank of one sample: arcface_torch labels [1, 1]


def combined(s=64.0, m1=1.0, m2=0.5, m3=0.0, interclass_filtering_threshold=0):
    """An object with the attributes of arcface_torch's CombinedMarginLoss."""
    return SimpleNamespace(s=s, m1=m1, m2=m2, m3=m3, interclass_filtering_threshold=interclass_filtering_threshold)


def _same(a: M.Margin, b: M.Margin) -> bool:
    x = torch.linspace(-0.99, 0.99, 41, dtype=torch.float64)
    return type(a) is type(b) and all(torch.allclose(u, v) for u, v in zip(a.target(x)[:2], b.target(x)[:2]))


@pytest.mark.parametrize("given,expected", [
    (combined(64, 1.0, 0.5, 0.0), M.ArcFace(64, 0.5)),
    (combined(32, 1.0, 0.0, 0.4), M.CosFace(32, 0.4)),
    (SimpleNamespace(scale=64.0, cos_m=0.8775825618903728, sin_m=0.479425538604203, sinmm=0.2397, theta=-0.87),
     M.ArcFace(64, 0.5)),
    (SimpleNamespace(s=64.0, m=0.4), M.CosFace(64, 0.4)),
    (M.CosFace(30, 0.3), M.CosFace(30, 0.3)),
    # margins other than the defaults
    (combined(64, 1.0, 0.3, 0.0), M.ArcFace(64, 0.3)),
    (combined(64, 1.0, 0.0, 0.2), M.CosFace(64, 0.2)),
    (SimpleNamespace(scale=64.0, cos_m=math.cos(0.3), sin_m=math.sin(0.3), sinmm=0.09, theta=-0.95),
     M.ArcFace(64, 0.3)),
    (SimpleNamespace(s=64.0, m1=1.0, m2=0.5, m3=0.0), M.ArcFace(64, 0.5)),  # an older one: no threshold at all
])
def test_margins_read_from_arcface_torch_modules(given, expected):
    assert _same(margin_from_arcface_torch(given), expected)


def _arcface_torch_arcface(s: float, m: float, easy_margin: bool) -> SimpleNamespace:
    """An object with the attributes of arcface_torch's ArcFace module (losses.py)."""
    return SimpleNamespace(scale=s, cos_m=math.cos(m), sin_m=math.sin(m), theta=math.cos(math.pi - m),
                           sinmm=math.sin(math.pi - m) * m, easy_margin=easy_margin)


def _arcface_torch_target(module: SimpleNamespace, cos: torch.Tensor) -> torch.Tensor:
    """arcface_torch's ArcFace.forward on the target logits, as its source computes it."""
    sin = torch.sqrt(1.0 - cos * cos)
    cos_theta_m = cos * module.cos_m - sin * module.sin_m
    if module.easy_margin:
        final = torch.where(cos > 0, cos_theta_m, cos)
    else:
        final = torch.where(cos > module.theta, cos_theta_m, cos - module.sinmm)
    return final * module.scale


@pytest.mark.parametrize("easy_margin", [False, True])
def test_arcface_torch_arcface_targets_with_and_without_easy_margin(easy_margin):
    module = _arcface_torch_arcface(32.0, 0.5, easy_margin)
    cos = torch.linspace(-0.99, 0.99, 199, dtype=torch.float64)
    margin = margin_from_arcface_torch(module)
    torch.testing.assert_close(margin.target(cos)[0], _arcface_torch_target(module, cos), rtol=1e-12, atol=1e-10)
    other = _arcface_torch_target(_arcface_torch_arcface(32.0, 0.5, not easy_margin), cos)
    assert not torch.allclose(margin.target(cos)[0], other)  # the two differ on these cosines


def _combined_margin_loss_target(module: SimpleNamespace, cos: torch.Tensor) -> torch.Tensor:
    """arcface_torch's CombinedMarginLoss.forward on the target logits, as its source branches:
    ArcFace(m2) when m1 == 1 and m3 == 0, else CosFace(m3) when m3 > 0 (m1 and m2 unread), else it raises."""
    if module.m1 == 1.0 and module.m3 == 0.0:
        return _arcface_torch_target(_arcface_torch_arcface(module.s, module.m2, False), cos)
    if module.m3 > 0:
        return (cos - module.m3) * module.s
    raise RuntimeError("arcface_torch raises")


@pytest.mark.parametrize("margins", [(1.0, 0.5, 0.0), (1.0, 0.0, 0.4), (1.0, 0.3, 0.0), (1.0, 0.0, 0.15)])
def test_a_combined_margin_loss_computes_what_arcface_torchs_forward_does(margins):
    module = combined(32.0, *margins)
    cos = torch.linspace(-0.99, 0.99, 199, dtype=torch.float64)
    got = margin_from_arcface_torch(module).target(cos)[0]
    torch.testing.assert_close(got, _combined_margin_loss_target(module, cos), rtol=1e-12, atol=1e-10)


@pytest.mark.parametrize("margins, says", [
    # arcface_torch trains CosFace(m3) and drops m1 or m2: shardfc's Combined trained another loss
    ((0.9, 0.4, 0.15), "arcface_torch computes CosFace(m3=0.15) when m3 > 0 and ignores m1 and m2; pass "
                       "CombinedMarginLoss(64, 1.0, 0.0, 0.15) (or shardfc.margins.CosFace(64, 0.15)) to train as "
                       "arcface_torch did, or shardfc.margins.Combined(64, 0.9, 0.4, 0.15) for the combined margin "
                       "cos(m1·θ + m2) − m3"),
    ((1.0, 0.3, 0.2), "arcface_torch computes CosFace(m3=0.2) when m3 > 0 and ignores m1 and m2; "),
    ((0.9, 0.0, 0.2), "arcface_torch computes CosFace(m3=0.2) when m3 > 0 and ignores m1 and m2; "),
    ((0.9, 0.4, 0.0), "arcface_torch has no margin for these (ArcFace for m1 = 1 and m3 = 0, CosFace for m3 > 0; "
                      "its forward raises otherwise); pass shardfc.margins.Combined(64, 0.9, 0.4, 0) for the "
                      "combined margin cos(m1·θ + m2) − m3"),
    ((1.0, 0.5, -0.1), "arcface_torch has no margin for these (ArcFace for m1 = 1 and m3 = 0, CosFace for m3 > 0; "),
])
def test_a_combined_margin_loss_arcface_torch_would_not_compute_as_named_is_refused(margins, says):
    cos = torch.linspace(-0.99, 0.99, 9, dtype=torch.float64)
    module = SimpleNamespace(s=64.0, m1=margins[0], m2=margins[1], m3=margins[2])
    try:  # what arcface_torch computes is none of the named margins, or nothing
        theirs = _combined_margin_loss_target(module, cos)
        assert not torch.allclose(theirs, M.Combined(64.0, *margins).target(cos)[0])
    except RuntimeError:
        pass
    with pytest.raises(ValueError) as e:
        margin_from_arcface_torch(module)
    assert str(e.value).startswith(f"margin_loss SimpleNamespace(s=64, m1={margins[0]:g}, m2={margins[1]:g}, "
                                   f"m3={margins[2]:g}): {says}")


def test_margin_errors():
    with pytest.raises(ValueError, match=r"interclass_filtering_threshold=0.2: arcface_torch zeroes the logits") as e:
        margin_from_arcface_torch(combined(interclass_filtering_threshold=0.2))
    assert str(e.value).endswith(
        "while shardfc's interclass_filter_threshold leaves out negatives too close to the sample's target centre; "
        "the methods differ, so pass threshold 0 here (or use ShardedMarginHead(interclass_filter_threshold=...) "
        "for shardfc's)")
    with pytest.raises(TypeError, match=r"margin_loss must be arcface_torch's CombinedMarginLoss.*got function"):
        margin_from_arcface_torch(lambda logits, labels: logits)


def test_needs_an_initialised_process_group():
    with pytest.raises(RuntimeError) as e:
        PartialFC_V2(combined(), D, C)
    assert str(e.value) == ("PartialFC_V2 needs torch.distributed initialised first, as arcface_torch's does "
                            "(one process: use shardfc.ShardedMarginHead)")


@pytest.fixture
def world_of_one():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def test_arcface_torch_s_constructor_and_attributes(world_of_one):
    """fp16 off unless asked; a CPU run ignores it (arcface_torch's autocast is CUDA's); embedding_size
    as arcface_torch names it; fp16 must be a bool."""
    pfc = PartialFC_V2(combined(), D, C, 1.0)
    assert pfc.fp16 is False and pfc.embedding_size == D and pfc.reduction == "mean"
    g = torch.Generator().manual_seed(2)
    x, y = torch.randn(6, D, generator=g), torch.randint(0, C, (6,), generator=g)
    half = PartialFC_V2(combined(), D, C, 1.0, True)
    assert half.fp16 is True and torch.equal(half(x, y), pfc(x, y))
    with pytest.raises(TypeError) as e:
        PartialFC_V2(combined(), D, C, 1.0, "yes")
    assert str(e.value) == "fp16 must be True or False, got 'yes'"


def _rank(rank, world, out_dir):
    sizes = SIZES[world]
    B, lo, hi = sum(sizes), sum(sizes[:rank]), sum(sizes[: rank + 1])
    g = torch.Generator().manual_seed(11)
    x = torch.randn(B, D, generator=g, dtype=torch.float64) * 2
    y = torch.randint(0, C, (B,), generator=g)
    pfc = PartialFC_V2(combined(64.0, 1.0, 0.5, 0.0), D, C, 1.0, False)
    start, stop = arcface_class_range(C, world, rank)
    shape_ok = tuple(pfc.weight.shape) == (stop - start, D) and pfc.class_range == range(start, stop)
    xr = x[lo:hi].float().requires_grad_()
    loss = pfc(xr, y[lo:hi].view(-1, 1).int())  # arcface_torch's labels: [B_r, 1], any int dtype
    loss.backward()

    W = init_rows(0, C, D, 0).double().requires_grad_()
    xd = x.clone().requires_grad_()
    ref = shardfc.reference_loss(xd, W, y, M.ArcFace(64.0, 0.5))
    ref.backward()
    rel = lambda a, b: float((a.double() - b).abs().max() / b.abs().max().clamp(min=1e-30)) if b.numel() else 0.0  # noqa: E731
    errs = {
        "loss": rel(loss.detach(), ref.detach()),
        "grad_w": rel(pfc.weight.grad, W.grad[start:stop]),
        "grad_x": rel(xr.grad, world * xd.grad[lo:hi]),  # arcface_torch's convention: W× this rank's share
    }
    # arcface_torch's checkpoint layout, read back by shardfc import-arcface's reader and by a new module
    path = os.path.join(out_dir, f"checkpoint_gpu_{rank}.pt")
    torch.save({"epoch": 0, "global_step": 1, "state_dict_softmax_fc": pfc.state_dict()}, path)
    fresh = PartialFC_V2(combined(), D, C, sample_rate=0.5)
    fresh.load_state_dict(torch.load(path)["state_dict_softmax_fc"])
    loaded = torch.equal(fresh.weight, pfc.weight)

    # Partial FC: the same step as ShardedMarginHead with the same sampling
    torch.manual_seed(0)
    sampled = PartialFC_V2(combined(32.0, 1.0, 0.0, 0.35), D, C, sample_rate=0.5)
    head = shardfc.ShardedMarginHead(D, C, margin=M.CosFace(32.0, 0.35), sample_rate=0.5)
    outs = []
    for module in (sampled, head):
        xs = x[lo:hi].float().requires_grad_()
        module(xs, y[lo:hi]).backward()
        outs.append((xs.grad, module.weight.grad))
    same_sampled = all(torch.equal(a, b) for a, b in zip(*outs)) and outs[0][1].abs().sum() > 0

    # arcface_torch's ignored samples: label -1 (every third sample, as [B_r, 1] int64) adds no loss and
    # no gradient, and the mean is over the other samples, as the reference's ignore_index=-1
    ignored = y.clone()
    ignored[::3] = -1
    pfc = PartialFC_V2(combined(64.0, 1.0, 0.5, 0.0), D, C)
    xr = x[lo:hi].float().requires_grad_()
    loss = pfc(xr, ignored[lo:hi].view(-1, 1))
    loss.backward()
    W = init_rows(0, C, D, 0).double().requires_grad_()
    xd = x.clone().requires_grad_()
    ref = shardfc.reference_loss(xd, W, ignored, M.ArcFace(64.0, 0.5))
    ref.backward()
    errs.update({
        "ignored loss": rel(loss.detach(), ref.detach()),
        "ignored grad_w": rel(pfc.weight.grad, W.grad[start:stop]),
        "ignored grad_x": rel(xr.grad, world * xd.grad[lo:hi]),
    })
    ignored_rows_zero = not xr.grad[(ignored[lo:hi] == -1)].any()

    # a label outside [0, C) on rank 0 only: a ValueError on every rank
    bad = y[lo:hi].clone().view(-1, 1)
    if rank == 0:
        bad[0] = C
    try:
        pfc(x[lo:hi].float(), bad)
        refused = ""
    except ValueError as e:
        refused = str(e)
    return errs, shape_ok, loaded, same_sampled, ignored_rows_zero, refused


def _check(world, results, tmp_path):
    for rank, (errs, shape_ok, loaded, same_sampled, ignored_rows_zero, refused) in enumerate(results):
        assert shape_ok and loaded and same_sampled and ignored_rows_zero, (world, rank)
        assert f"= {C} is outside [0, num_classes={C})" in refused, (world, rank, refused)
        for key, err in errs.items():
            assert err < 1e-5, (world, rank, key, err)
    joined = read_arcface_head(sorted(tmp_path.glob("checkpoint_gpu_*.pt")))
    assert joined.weight.shape == (C, D) and joined.world_size == world
    assert torch.allclose(joined.weight, init_rows(0, C, D, 0))  # the shards, in class order


@pytest.mark.parametrize("world", sorted(w for w in SIZES if w > 1))
def test_matches_the_dense_reference_and_round_trips_checkpoints(world, tmp_path):
    _check(world, spawn(_rank, world, str(tmp_path), backend="gloo"), tmp_path)


def test_one_rank_in_this_process_matches_the_dense_reference(tmp_path):
    """The world of one, in this process rather than a spawned one: the same checks, and a run of the
    drop-in that mutation testing sees (mutmut traces only the test's own process)."""
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        results = [_rank(0, 1, str(tmp_path))]
        # one sample, as arcface_torch's labels [1, 1]: its loss and gradients, not a scalar label's
        g = torch.Generator().manual_seed(5)
        x, y = torch.randn(1, D, generator=g, dtype=torch.float64), torch.randint(0, C, (1,), generator=g)
        pfc = PartialFC_V2(combined(64.0, 1.0, 0.5, 0.0), D, C)
        xr = x.float().requires_grad_()
        loss = pfc(xr, y.view(1, 1))
        loss.backward()
    finally:
        dist.destroy_process_group()
    _check(1, results, tmp_path)
    W, xd = init_rows(0, C, D, 0).double().requires_grad_(), x.clone().requires_grad_()
    ref = shardfc.reference_loss(xd, W, y, M.ArcFace(64.0, 0.5))
    ref.backward()
    assert loss.shape == () and float(loss.detach()) == pytest.approx(float(ref.detach()), rel=1e-5)
    for got, want in ((pfc.weight.grad, W.grad), (xr.grad, xd.grad)):  # as _rank's errors: to the largest entry
        assert float((got.double() - want).abs().max() / want.abs().max()) < 1e-5
