"""Batch-hard triplet loss over the global batch against a dense single-process float64 reference.

One process group per world size (2 and 3 gloo ranks) runs every case with unequal local batches
(one empty); the reference loops over anchors with plain per-pair distances.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from shardfc.head.triplet import BatchHardTripletLoss
from shardfc.parallel.collectives import count_comm
from shardfc.parallel.context import DistContext
from shardfc.parallel.launch import spawn

D, SEED, TOL = 5, 4321, 1e-10
SIZES = {1: [9], 2: [7, 4], 3: [5, 0, 8]}

CASES = {
    "hinge": dict(margin=0.3, soft=False, num_labels=4),
    "hinge_wide_margin": dict(margin=2.5, soft=False, num_labels=3),
    "soft": dict(margin=0.3, soft=True, num_labels=4),
    # Many singletons: anchors without a positive are left out of the mean.
    "singletons": dict(margin=0.3, soft=False, num_labels=9),
    # One label: no negatives anywhere, no valid anchor, a zero loss with a zero gradient.
    "one_label": dict(margin=0.3, soft=False, num_labels=1),
}


def _global_data(B: int, num_labels: int):
    g = torch.Generator().manual_seed(SEED)
    x = torch.randn(B, D, generator=g, dtype=torch.float64)
    y = torch.randint(0, num_labels, (B,), generator=g)
    return x, y


def reference_loss(x: torch.Tensor, y: torch.Tensor, margin: float, soft: bool) -> torch.Tensor:
    """Mean over anchors with a positive and a negative of the hardest-triplet loss; a plain loop."""
    terms = []
    for i in range(len(x)):
        pos = [((x[i] - x[j]) ** 2).sum().sqrt() for j in range(len(x)) if j != i and y[j] == y[i]]
        neg = [((x[i] - x[j]) ** 2).sum().sqrt() for j in range(len(x)) if y[j] != y[i]]
        if not pos or not neg:
            continue
        gap = torch.stack(pos).max() - torch.stack(neg).min()
        terms.append(torch.log1p(torch.exp(gap)) if soft else torch.relu(gap + margin))
    return torch.stack(terms).mean() if terms else x.sum() * 0


def _rel(a, b):
    if b.numel() == 0:
        return 0.0
    return float((a - b).abs().max() / b.abs().max().clamp(min=1e-12))


def _run_cases(rank, world):
    sizes = SIZES[world]
    lo, hi = sum(sizes[:rank]), sum(sizes[: rank + 1])
    ctx = DistContext.resolve() if world > 1 else DistContext()
    out = {}
    for name, case in CASES.items():
        x, y = _global_data(sum(sizes), case["num_labels"])
        x_ref = x.clone().requires_grad_()
        ref = reference_loss(x_ref, y, case["margin"], case["soft"])
        ref.backward()
        for scale in (1.0, None):  # the plain gradient, and the default W x for an averaging backbone
            loss_fn = BatchHardTripletLoss(case["margin"], case["soft"], context=ctx, grad_scale=scale)
            xr = x[lo:hi].clone().requires_grad_()
            loss = loss_fn(xr, y[lo:hi].to(torch.int32))
            loss.backward()
            factor = world if scale is None else 1.0
            value, want = float(loss.detach()), float(ref.detach())
            out[(name, scale)] = {
                "loss": abs(value - want) / abs(want) if want else abs(value),
                "grad": _rel(xr.grad, factor * x_ref.grad[lo:hi]) if want else float(xr.grad.abs().sum()),
                "ref": want,
            }
    out["bad_input"] = _bad_input(rank, world, ctx)
    out["bad_features"] = _bad_input(rank, world, ctx, features_as_list=True)
    out["comm"] = _counted_traffic(sizes, lo, hi, ctx)
    return out


def _counted_traffic(sizes, lo, hi, ctx):
    """The bytes the features move, as count_comm sees them: a padded gather forward, a reduce-scatter back."""
    x, y = _global_data(sum(sizes), 3)
    xr = x[lo:hi].clone().requires_grad_()
    with count_comm() as counter:
        BatchHardTripletLoss(context=ctx)(xr, y[lo:hi]).backward()
    return dict(counter.bytes)


def _bad_input(rank, world, ctx, features_as_list=False):
    """One rank passes float labels (or its features as a list): every rank raises naming it, none hangs."""
    loss_fn = BatchHardTripletLoss(context=ctx)
    x, y = torch.randn(3, D), torch.tensor([0, 1, 0])
    if rank == world - 1:
        if features_as_list:
            x = x.tolist()
        else:
            y = y.float()
    try:
        loss_fn(x, y)
    except ValueError as e:
        return str(e)
    return "no error"


@pytest.fixture(scope="module", params=["gloo-2", "gloo-3", "threads-2", "threads-3"])
def results(request):
    """Every rank's cases: gloo ranks in spawned processes, and the same over ``torch.distributed``'s
    threaded backend in this process (``tests/thread_world.py``), where mutation testing sees them."""
    how, world = request.param.split("-")
    world = int(world)
    if how == "gloo":
        return world, spawn(_run_cases, world, backend="gloo")
    from thread_world import TorchThreadWorld

    per_rank = TorchThreadWorld(world).results(lambda rank: _run_cases(rank, world))
    for out in per_rank:  # count_comm counts the process's traffic: thread ranks would see each other's
        del out["comm"]
    return world, per_rank


def test_single_process_matches_reference():
    out = _run_cases(0, 1)
    for key, r in out.items():
        if key == "bad_input":
            assert "labels must be an integer tensor" in r
            continue
        if key == "bad_features":
            assert r == "features must be a float tensor [B, D], got list"
            continue
        if key == "comm":
            assert r == {}  # one process: nothing to move
            continue
        assert r["loss"] < TOL and r["grad"] < TOL, (key, r)


def test_global_batch_matches_dense_reference(results):
    world, per_rank = results
    for rank, out in enumerate(per_rank):
        for key, r in out.items():
            if key in ("bad_input", "bad_features", "comm"):
                continue
            assert r["loss"] < TOL, (world, rank, key, r)
            assert r["grad"] < TOL, (world, rank, key, r)
    # The cases are not degenerate: all but 'one_label' have a positive loss.
    refs = {name: per_rank[0][(name, 1.0)]["ref"] for name in CASES}
    assert refs.pop("one_label") == 0.0
    assert all(v > 0 for v in refs.values()), refs


def test_feature_traffic_is_counted(results):
    world, per_rank = results
    if "comm" not in per_rank[0]:
        pytest.skip("thread ranks share the process's traffic counter; the gloo ranks count theirs")
    sizes = SIZES[world]
    for out in per_rank:
        # float64 features [B, D]: padded to the largest local batch forward, exact rows backward
        assert out["comm"]["reduce_scatter"] == sum(sizes) * D * 8
        features, labels, header = world * max(sizes) * D * 8, world * max(sizes) * 8, world * 2 * 8
        assert out["comm"]["all_gather"] == features + labels + header
        assert out["comm"]["all_reduce"] == 2 * 8  # the loss sum and the anchor count


def test_bad_input_raises_on_every_rank(results):
    world, per_rank = results
    for out in per_rank:
        assert "labels must be an integer tensor" in out["bad_input"], out["bad_input"]
        assert f"rank {world - 1}" in out["bad_input"]
        assert "features must be a float tensor [B, D], got list" in out["bad_features"], out["bad_features"]
        assert f"rank {world - 1}" in out["bad_features"]


def test_rejects_bad_margin():
    with pytest.raises(ValueError, match="margin must be a finite number >= 0, got -0.1"):
        BatchHardTripletLoss(-0.1, context=DistContext())
    with pytest.raises(ValueError, match="margin must be a finite number >= 0, got inf"):
        BatchHardTripletLoss(float("inf"), context=DistContext())


def test_grad_scale_in_a_world_of_one():
    x, y = _global_data(9, 3)
    grads = []
    for scale in (1.0, 2.0, 3.0):
        xr = x.clone().requires_grad_()
        loss = BatchHardTripletLoss(context=DistContext(), grad_scale=scale)(xr, y)
        loss.backward()
        grads.append((float(loss.detach()), xr.grad))
    for (value, grad), scale in zip(grads[1:], (2.0, 3.0)):
        assert value == pytest.approx(grads[0][0], rel=1e-12) and torch.allclose(scale * grads[0][1], grad)
    assert not dist.is_initialized()


# ---------------------------------------------------------------- refusals, defaults and dtypes, whole
@pytest.mark.parametrize("features,labels,message", [
    ([[0.0] * D], torch.tensor([0]), "features must be a float tensor [B, D], got list"),
    (torch.zeros(3), torch.tensor([0, 1, 0]), "features must be a float tensor [B, D], got shape (3,), dtype torch.float32"),
    (torch.zeros(3, D, dtype=torch.int64), torch.tensor([0, 1, 0]),
     "features must be a float tensor [B, D], got shape (3, 5), dtype torch.int64"),
    (torch.zeros(3, D), [0, 1, 0], "labels must be an integer tensor [B], got list"),
    (torch.zeros(3, D), torch.zeros(3, 1, dtype=torch.int64),
     "labels must be an integer tensor [B], got shape (3, 1), dtype torch.int64"),
    (torch.zeros(3, D), torch.zeros(3, dtype=torch.complex64),
     "labels must be an integer tensor [B], got shape (3,), dtype torch.complex64"),
    (torch.zeros(3, D), torch.tensor([0, 1]), "labels has 2 entries but features has 3 rows"),
])
def test_each_refusal_reads_whole(features, labels, message):
    with pytest.raises(ValueError) as info:
        BatchHardTripletLoss(context=DistContext())(features, labels)
    assert str(info.value) == message


def test_defaults_margin_zero_and_what_the_module_says_of_itself():
    plain = BatchHardTripletLoss()  # no group: this process alone
    assert (plain.margin, plain.soft, plain.grad_scale, plain.ctx.world_size) == (0.3, False, 1.0, 1)
    assert plain.extra_repr() == "margin=0.3, rank 0/1"
    assert BatchHardTripletLoss(soft=True).extra_repr() == "soft, rank 0/1"
    assert BatchHardTripletLoss(0).margin == 0.0  # the bound is >= 0
    ctx = DistContext()
    assert BatchHardTripletLoss(context=ctx).ctx is ctx
    for bad in (True, "0.3", None):
        with pytest.raises(ValueError, match=rf"^margin must be a finite number >= 0, got {bad!r}$"):
            BatchHardTripletLoss(bad, context=ctx)
    for bad in (-1.0, 0, float("nan"), float("inf"), True, "2"):  # -1 turned the gradient around
        with pytest.raises(ValueError) as e:
            BatchHardTripletLoss(context=ctx, grad_scale=bad)
        assert str(e.value) == f"grad_scale must be a finite number > 0 (or None: the world size), got {bad!r}"
    assert BatchHardTripletLoss(context=ctx, grad_scale=2).grad_scale == 2.0


def test_an_empty_batch_is_a_zero_loss_connected_to_the_features():
    x = torch.zeros(0, D, requires_grad=True)
    loss = BatchHardTripletLoss(context=DistContext())(x, torch.zeros(0, dtype=torch.int64))
    assert float(loss.detach()) == 0.0 and loss.requires_grad
    loss.backward()
    assert x.grad.shape == (0, D)


@pytest.mark.parametrize("dtype,computed", [(torch.float64, torch.float64), (torch.float32, torch.float32),
                                            (torch.bfloat16, torch.float32)])
def test_distances_in_fp32_at_least_also_under_autocast(dtype, computed):
    x, y = _global_data(9, 3)
    loss = BatchHardTripletLoss(context=DistContext())(x.to(dtype), y)
    assert loss.dtype == computed
    ref32 = BatchHardTripletLoss(context=DistContext())(x.float(), y)
    with torch.autocast("cpu", dtype=torch.bfloat16):  # a bf16 |a|^2 + |b|^2 - 2ab would cancel badly
        under = BatchHardTripletLoss(context=DistContext())(x.float(), y)
    assert under.dtype == torch.float32 and float(under) == pytest.approx(float(ref32), rel=1e-6)
    # against the float64 loss of the very values given (bf16 inputs rounded first): fp32 distances
    # of bf16 features are within 1e-6 of it, bf16 ones would be ~1e-3 off
    want = reference_loss(x.to(dtype).double(), y, 0.3, False)
    assert float(loss) == pytest.approx(float(want), rel=1e-12 if dtype == torch.float64 else 1e-6)
