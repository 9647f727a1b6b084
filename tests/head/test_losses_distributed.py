"""Sub-center ArcFace, inter-class filtering, AdaFace and MagFace in process-group mode against the
dense float64 references of ``dense_losses``, on W = 1..4 gloo ranks (23 classes: uneven shards;
unequal local batches, one empty).

One process group per world size for the whole module: each rank runs every case and returns its
errors; the parent asserts per case. The same cases run again with ranks as threads of the test's
process (``tests/thread_world.py``), where mutation testing sees the cross-rank code.
"""

from __future__ import annotations

import copy
import math

import pytest
import torch
from dense_losses import dense_loss

import shardfc
from shardfc import margins as M
from shardfc.head.module import init_rows
from shardfc.head.subcenters import noisy_samples, subcenter_counts
from shardfc.parallel.context import DistContext
from shardfc.parallel.launch import spawn
from thread_world import ThreadWorld

C, D, SEED = 23, 6, 99
SIZES = {1: [7], 2: [5, 3], 3: [4, 0, 6], 4: [3, 5, 0, 2]}
TOL = 1e-10

CASES = {
    "subcenters": dict(subcenters=3),
    "subcenters+chunk+none+ignore": dict(subcenters=2, chunk_size=2, reduction="none", ignore=True, margin="cosface"),
    "subcenters+labels_on_one_shard": dict(subcenters=3, one_shard=True, reduction="sum"),
    "subcenters+partial_fc": dict(subcenters=2, sample_rate=0.5),
    "filter": dict(filter=0.3),
    "filter+labels_on_one_shard": dict(filter=0.2, one_shard=True),
    "filter+subcenters+chunk+ignore": dict(filter=0.25, subcenters=2, chunk_size=3, ignore=True, reduction="none"),
    "filter+partial_fc": dict(filter=0.3, sample_rate=0.6),
    "adaface": dict(margin="adaface"),
    "adaface+chunk+none+ignore": dict(margin="adaface", chunk_size=2, reduction="none", ignore=True),
    "magface": dict(margin="magface"),
    "magface+chunk+sum+ignore": dict(margin="magface", chunk_size=3, reduction="sum", ignore=True),
    "magface+subcenters+filter": dict(margin="magface", subcenters=2, filter=0.3),
    # Partial FC's row-sparse gradient over sub-centres: the compact gradient of the sampled classes'
    # centre rows (K per class) against the dense reference's, and nothing else.
    "subcenters+partial_fc+sparse_grad+ignore": dict(subcenters=3, sample_rate=0.5, sparse=True, ignore=True),
    "subcenters+partial_fc+sparse_grad+labels_on_one_shard": dict(subcenters=2, sample_rate=0.4, sparse=True,
                                                                  one_shard=True, reduction="sum"),
    "magface+subcenters+filter+partial_fc+sparse_grad+chunk": dict(margin="magface", subcenters=2, filter=0.3,
                                                                   sample_rate=0.6, sparse=True, chunk_size=2),
}


def _margin(name):
    if name == "adaface":
        m = M.AdaFace()
        m.norm_mean, m.norm_std = 50.0, 30.0  # so the quality ẑ spreads over [−1, 1] on this data
        return m
    return {"arcface": M.ArcFace(32.0, 0.5), "cosface": M.CosFace(16.0, 0.3), "magface": M.MagFace()}[name]


def _global_data(B, one_shard=False, ignore=False):
    g = torch.Generator().manual_seed(SEED)
    direction = torch.nn.functional.normalize(torch.randn(B, D, generator=g, dtype=torch.float64), dim=1)
    x = direction * (5 + 125 * torch.rand(B, 1, generator=g, dtype=torch.float64))  # norms across MagFace's [10, 110]
    y = torch.randint(0, C, (B,), generator=g)
    if one_shard:
        y = torch.randint(C - 5, C, (B,), generator=g)  # the last rank's classes for any W <= 4
    if ignore:
        y[::3] = -1
    return x, y, torch.randn(B, generator=g, dtype=torch.float64)


def _rel(a, b):
    if b.numel() == 0:
        return 0.0
    return float((a - b).abs().max() / b.abs().max().clamp(min=1e-300))


def _run_case(rank, world, opts):
    sizes = SIZES[world]
    B, lo, hi = sum(sizes), sum(sizes[:rank]), sum(sizes[: rank + 1])
    x, y, up = _global_data(B, opts.get("one_shard", False), opts.get("ignore", False))
    K, reduction = opts.get("subcenters", 1), opts.get("reduction", "mean")
    margin = _margin(opts.get("margin", "arcface"))
    ref_margin = copy.deepcopy(margin)
    head = shardfc.ShardedMarginHead(
        D, C, margin=margin, subcenters=K, interclass_filter_threshold=opts.get("filter"), reduction=reduction,
        chunk_size=opts.get("chunk_size"), sample_rate=opts.get("sample_rate", 1.0), dtype=torch.float64,
        sparse_grad=opts.get("sparse", False),
    )
    xr = x[lo:hi].clone().requires_grad_()
    loss = head(xr, y[lo:hi])
    loss.backward(up[lo:hi] if reduction == "none" else torch.tensor(1.3, dtype=torch.float64))

    classes = None
    if opts.get("sample_rate"):
        (rows,) = head.sampled_rows
        mine = torch.unique(rows // K) + head.class_range.start
        classes = torch.cat([t for t in _all_gather(mine)]).sort().values
    if isinstance(ref_margin, M.AdaFace):  # the momentum step, written out: global batch, valid samples
        norms = torch.linalg.vector_norm(x[y != -1], dim=1).clamp(0.001, 100)
        ref_margin.norm_mean = 0.01 * float(norms.mean()) + 0.99 * ref_margin.norm_mean
        ref_margin.norm_std = 0.01 * float(norms.std()) + 0.99 * ref_margin.norm_std
    W = init_rows(0, C * K, D, 0).double().requires_grad_()
    x_ref = x.clone().requires_grad_()
    ref = dense_loss(
        x_ref, W, y, ref_margin, subcenters=K, filter_threshold=opts.get("filter"), reduction=reduction, classes=classes
    )
    ref.backward(up / world if reduction == "none" else torch.tensor(1.3, dtype=torch.float64))
    r = head.class_range
    out = {
        "loss": _rel(loss.detach(), (ref[lo:hi] if reduction == "none" else ref).detach()),
        "grad_embeddings": _rel(xr.grad, world * x_ref.grad[lo:hi]),
    }
    if opts.get("sparse"):
        row_grad = head.take_sampled_rows()[head.weight]
        centre_rows = row_grad.rows + r.start * K
        out["grad_weight"] = _rel(row_grad.values, W.grad[centre_rows])
        # K centre rows per sampled class, class-major; the dense gradient is zero on all others.
        whole = (centre_rows.view(-1, K)[:, :1] + torch.arange(K)).view(-1)
        out["sparse_rows_whole_classes"] = float(not torch.equal(centre_rows, whole) or centre_rows.numel() % K != 0)
        others = torch.ones(C * K, dtype=torch.bool)
        others[centre_rows] = False
        out["sparse_no_grad_elsewhere"] = float(W.grad[r.start * K : r.stop * K][others[r.start * K : r.stop * K]].abs().sum())
        out["sparse_no_dense_grad"] = float(head.weight.grad is not None)
    else:
        out["grad_weight"] = _rel(head.weight.grad, W.grad[r.start * K : r.stop * K])
    if isinstance(margin, M.AdaFace):
        out["adaface_stats"] = abs(margin.norm_mean - ref_margin.norm_mean) + abs(margin.norm_std - ref_margin.norm_std)
        state = head.sharded_state()["extras"]
        out["adaface_state_saved"] = abs(state["margin.norm_mean"] - margin.norm_mean)
    return out


def _all_gather(t):
    return DistContext.resolve().all_gather_object(t)


def _counts_case(rank, world):
    """subcenter_counts over ranks: the classes this rank holds, counted over every rank's samples."""
    sizes = SIZES[world]
    B, lo, hi = sum(sizes), sum(sizes[:rank]), sum(sizes[: rank + 1])
    x, y, _ = _global_data(B, ignore=True)
    head = shardfc.ShardedMarginHead(D, C, subcenters=3, dtype=torch.float64)
    counts = subcenter_counts(head, x[lo:hi], y[lo:hi])
    W = torch.nn.functional.normalize(init_rows(0, C * 3, D, 0).double(), dim=1).view(C, 3, D)
    expected = torch.zeros(C, 3, dtype=torch.int64)
    for xi, yi in zip(torch.nn.functional.normalize(x, dim=1), y):
        if yi >= 0:
            expected[yi, int((W[yi] @ xi).argmax())] += 1
    return torch.equal(counts, expected[head.class_range.start : head.class_range.stop])


def _noisy_case(rank, world, max_angle=60.0):
    """noisy_samples over ranks: this rank's samples, each flagged by the rank that holds its class
    (an ignored label never). Returns (equal to the dense flags, the dense flags of the global batch)."""
    sizes = SIZES[world]
    B, lo, hi = sum(sizes), sum(sizes[:rank]), sum(sizes[: rank + 1])
    x, y, _ = _global_data(B, ignore=True)
    head = shardfc.ShardedMarginHead(D, C, subcenters=3, dtype=torch.float64)
    got = noisy_samples(head, x[lo:hi], y[lo:hi], max_angle=max_angle)
    W = torch.nn.functional.normalize(init_rows(0, C * 3, D, 0).double(), dim=1).view(C, 3, D)
    nearest = torch.stack([(W[yi] @ xi).max() if yi >= 0 else torch.tensor(1.0, dtype=torch.float64)
                           for xi, yi in zip(torch.nn.functional.normalize(x, dim=1), y)])
    expected = nearest < math.cos(math.radians(max_angle))
    return bool(torch.equal(got, expected[lo:hi])), expected


def _worker(rank, world):
    results = {name: _run_case(rank, world, opts) for name, opts in CASES.items()}
    results["counts"] = _counts_case(rank, world)
    results["noisy"] = _noisy_case(rank, world)
    return results


@pytest.fixture(scope="module", params=[1, 2, 3, 4], ids=lambda w: f"W={w}")
def world_results(request):
    return request.param, spawn(_worker, request.param, backend="gloo")


@pytest.mark.parametrize("case", list(CASES))
def test_sharded_equals_dense_reference(world_results, case):
    world, results = world_results
    for rank, res in enumerate(results):
        errors = res[case]
        for key, err in errors.items():
            assert err < TOL, f"W={world} rank={rank} {case}: {key} error {err}"


def test_subcenter_counts_over_ranks(world_results):
    world, results = world_results
    assert all(res["counts"] for res in results)


def test_noisy_samples_over_ranks(world_results):
    world, results = world_results
    assert all(res["noisy"][0] for res in results)
    flags = results[0]["noisy"][1]
    assert flags.any() and not flags.all()  # some samples far from every centre of their class, not all


# One test, one case, ranks as threads: each test's own calls are what mutation testing sees.
THREAD_WORLDS = pytest.mark.parametrize("world", [2, 3], ids=lambda w: f"threads W={w}")


@THREAD_WORLDS
@pytest.mark.parametrize("case", list(CASES))
def test_sharded_equals_dense_reference_over_thread_ranks(world, case, monkeypatch):
    results = ThreadWorld(world).results(lambda rank: {case: _run_case(rank, world, CASES[case])}, monkeypatch)
    test_sharded_equals_dense_reference((world, results), case)


@THREAD_WORLDS
def test_subcenter_counts_over_thread_ranks(world, monkeypatch):
    results = ThreadWorld(world).results(lambda rank: {"counts": _counts_case(rank, world)}, monkeypatch)
    test_subcenter_counts_over_ranks((world, results))


@THREAD_WORLDS
def test_noisy_samples_over_thread_ranks(world, monkeypatch):
    results = ThreadWorld(world).results(lambda rank: {"noisy": _noisy_case(rank, world)}, monkeypatch)
    test_noisy_samples_over_ranks((world, results))
