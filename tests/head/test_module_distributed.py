"""Process-group mode against the dense float64 reference, on W = 1, 2, 3, 4 gloo ranks.

One process group per world size for the whole module: each spawned rank runs every case and
returns its measured errors; the parent asserts per case. The same cases run again with ranks as
threads of the test's process (``tests/thread_world.py``), where mutation testing sees the
cross-rank code.
"""

from __future__ import annotations

import math
import threading

import pytest
import torch
import torch.distributed as dist

import shardfc
from shardfc import margins as M
from shardfc.head.baselines import NaiveParallelHead, ReplicatedHead
from shardfc.head.module import init_rows
from shardfc.parallel.context import DistContext
from shardfc.parallel.launch import spawn
from thread_world import ThreadWorld, TorchThreadWorld

C, D, SEED = 23, 6, 1234  # 23 classes: not divisible by 2, 3 or 4
SIZES = {1: [7], 2: [5, 3], 3: [4, 0, 6], 4: [3, 5, 0, 2]}  # unequal local batches, one empty
TOL = 1e-10
_GLOBAL_RNG = threading.Lock()

MARGINS = {
    "softmax": M.Softmax(),
    "normsoftmax": M.NormSoftmax(16.0),
    "cosface": M.CosFace(64.0, 0.35),
    "arcface": M.ArcFace(64.0, 0.5),
    "arcface_easy": M.ArcFace(32.0, 0.5, easy_margin=True),
    "combined": M.Combined(32.0, 0.9, 0.4, 0.15),
    "sphereface": M.SphereFace(4),
    "sphereface_lambda": M.SphereFace(2, lambda_=1.5),
}

CASES = {f"margin={k}": dict(margin=k) for k in MARGINS}
CASES.update(
    {
        "reduction=sum": dict(reduction="sum"),
        "reduction=none": dict(reduction="none"),
        "label_smoothing": dict(label_smoothing=0.1),
        "label_smoothing+none": dict(label_smoothing=0.2, reduction="none", margin="cosface"),
        "ignore_index": dict(ignore=True),
        "ignore_index=-100": dict(ignore=True, ignore_index=-100),
        "all_ignored": dict(all_ignored=True),
        "labels_on_one_shard": dict(one_shard=True),
        "chunked": dict(chunk_size=2),
        "chunked+smoothing+sphereface": dict(chunk_size=3, label_smoothing=0.1, margin="sphereface"),
        "chunked+none+ignore": dict(chunk_size=4, reduction="none", ignore=True),
    }
)


def _global_data(B: int, one_shard=False, ignore=False, all_ignored=False, ignore_index=-1):
    g = torch.Generator().manual_seed(SEED)
    x = torch.randn(B, D, generator=g, dtype=torch.float64) * 2
    y = torch.randint(0, C, (B,), generator=g)
    if one_shard:
        y = torch.randint(C - 5, C, (B,), generator=g)  # the last rank's range for any W <= 4
    if ignore:
        y[:: 3] = ignore_index
    if all_ignored:
        y[:] = ignore_index
    grad = torch.randn(B, generator=g, dtype=torch.float64)
    return x, y, grad


def _rows(rank, world):
    """The global batch size and this rank's slice ``[lo, hi)`` of it."""
    sizes = SIZES[world]
    return sum(sizes), sum(sizes[:rank]), sum(sizes[: rank + 1])


def _rel(a, b):
    if b.numel() == 0:
        return 0.0
    return float((a - b).abs().max() / b.abs().max().clamp(min=1e-300))


def _run_case(rank, world, opts):
    B, lo, hi = _rows(rank, world)
    ignore_index = opts.get("ignore_index", -1)
    x, y, gvec = _global_data(B, opts.get("one_shard", False), opts.get("ignore", False) or False, opts.get("all_ignored", False), ignore_index)
    margin = MARGINS[opts.get("margin", "arcface")]
    reduction = opts.get("reduction", "mean")
    eps = opts.get("label_smoothing", 0.0)

    head = shardfc.ShardedMarginHead(
        D, C, margin=margin, label_smoothing=eps, ignore_index=ignore_index, reduction=reduction,
        chunk_size=opts.get("chunk_size"), dtype=torch.float64,
    )
    xr = x[lo:hi].clone().requires_grad_()
    loss = head(xr, y[lo:hi].to(torch.int32))  # int32 labels are accepted
    upstream = gvec[lo:hi] if reduction == "none" else torch.tensor(1.3, dtype=torch.float64)
    loss.backward(upstream)

    W_full = init_rows(0, C, D, 0).double().requires_grad_()
    x_ref = x.clone().requires_grad_()
    ref = shardfc.reference_loss(x_ref, W_full, y, margin, label_smoothing=eps, ignore_index=ignore_index, reduction=reduction)
    # The objective is the average over ranks of what each rank back-propagates.
    ref.backward(gvec / world if reduction == "none" else torch.tensor(1.3, dtype=torch.float64))
    r = head.class_range
    ref_loss = ref[lo:hi] if reduction == "none" else ref
    return {
        "loss": _rel(loss.detach(), ref_loss.detach()),
        "grad_embeddings": _rel(xr.grad, world * x_ref.grad[lo:hi]),
        "grad_weight": _rel(head.weight.grad, W_full.grad[r.start : r.stop]),
        "loss_finite": bool(torch.isfinite(loss).all()),
    }


def _bad_input_cases(rank, world):
    """Each case: one rank passes bad input; every rank must raise, none may hang. In a process group
    the value checks travel with the batch-size exchange: they raise at once on every rank even
    with ``validate="deferred"``, whose one-call delay is for one process."""
    out = {}
    head = shardfc.ShardedMarginHead(D, C, dtype=torch.float64, validate="deferred")
    good_x, good_y = torch.randn(3, D, dtype=torch.float64), torch.tensor([0, 5, C - 1])
    bad = world - 1
    cases = {
        "label_out_of_range": lambda: (good_x, torch.tensor([0, C, 1])),
        "negative_label": lambda: (good_x, torch.tensor([0, -7, 1])),
        "float_labels": lambda: (good_x, good_y.float()),
        "wrong_width": lambda: (torch.randn(3, D + 1, dtype=torch.float64), good_y),
        "count_mismatch": lambda: (good_x, good_y[:2]),
        "non_finite": lambda: (torch.tensor([[float("nan")] * D] * 3, dtype=torch.float64), good_y),
        "three_d": lambda: (good_x.unsqueeze(0), good_y),
    }
    for name, make in cases.items():
        x, y = make() if rank == bad else (good_x, good_y)
        try:
            head(x, y)
            out[name] = ("no error", "")
        except Exception as e:  # noqa: BLE001 - the test records what every rank raised
            out[name] = (type(e).__name__, str(e))
    # The group still works after the errors.
    loss = head(good_x, good_y)
    out["after_errors_loss_finite"] = bool(torch.isfinite(loss))
    try:
        head.predict(good_x, k=C + 1)
        out["predict_bad_k"] = ("no error", "")
    except Exception as e:  # noqa: BLE001
        out["predict_bad_k"] = (type(e).__name__, str(e))
    return out


def _predict_case(rank, world):
    B, lo, hi = _rows(rank, world)
    x, _, _ = _global_data(B)
    results = {}
    for name in ("arcface", "softmax", "sphereface"):
        for chunk in (None, 4):
            head = shardfc.ShardedMarginHead(D, C, margin=MARGINS[name], chunk_size=chunk, dtype=torch.float64)
            scores, ids = head.predict(x[lo:hi], k=5)
            W_full = init_rows(0, C, D, 0).double()
            dense = shardfc.head.reference.reference_logits(x, W_full, torch.full((B,), -1), MARGINS[name])
            ref_s, ref_i = dense.topk(5, dim=1)
            results[(name, chunk)] = (
                _rel(scores, ref_s[lo:hi]) if hi > lo else 0.0,
                bool(torch.equal(ids, ref_i[lo:hi])),
                tuple(scores.shape),
            )
    return results


def _ddp_case(rank, world):
    """A backbone in DDP + the sharded head gives the backbone the gradients of one process."""
    B, lo, hi = _rows(rank, world)
    g = torch.Generator().manual_seed(7)
    inputs = torch.randn(B, 10, generator=g, dtype=torch.float64)
    labels = torch.randint(0, C, (B,), generator=g)

    def make_backbone():
        with _GLOBAL_RNG:  # ranks as threads share torch's global generator: seed and draw at once
            torch.manual_seed(0)
            return torch.nn.Sequential(torch.nn.Linear(10, 16), torch.nn.Tanh(), torch.nn.Linear(16, D)).double()

    backbone = torch.nn.parallel.DistributedDataParallel(make_backbone())
    head = shardfc.ShardedMarginHead(D, C, margin=M.ArcFace(64.0, 0.5), dtype=torch.float64)
    loss = head(backbone(inputs[lo:hi]), labels[lo:hi])
    loss.backward()

    ref_backbone = make_backbone()
    W_full = init_rows(0, C, D, 0).double().requires_grad_()
    ref = shardfc.reference_loss(ref_backbone(inputs), W_full, labels, M.ArcFace(64.0, 0.5))
    ref.backward()
    r = head.class_range
    errs = [_rel(p.grad, q.grad) for p, q in zip(backbone.module.parameters(), ref_backbone.parameters())]
    return {"backbone": max(errs), "head": _rel(head.weight.grad, W_full.grad[r.start : r.stop]), "loss": _rel(loss.detach(), ref.detach())}


def _baselines_case(rank, world):
    B, lo, hi = _rows(rank, world)
    x, y, _ = _global_data(B, ignore=True)
    out = {}
    for name, margin in (("arcface", MARGINS["arcface"]), ("sphereface", MARGINS["sphereface"])):
        W_full = init_rows(0, C, D, 0).double().requires_grad_()
        x_ref = x.clone().requires_grad_()
        ref = shardfc.reference_loss(x_ref, W_full, y, margin, label_smoothing=0.1)
        ref.backward()

        naive = NaiveParallelHead(D, C, margin=margin, label_smoothing=0.1, dtype=torch.float64)
        xr = x[lo:hi].clone().requires_grad_()
        loss = naive(xr, y[lo:hi])
        loss.backward()
        r = naive.class_range
        out[("naive", name)] = (
            _rel(loss.detach(), ref.detach()),
            _rel(xr.grad, world * x_ref.grad[lo:hi]),
            _rel(naive.weight.grad, W_full.grad[r.start : r.stop]),
        )

        rep = ReplicatedHead(D, C, margin=margin, label_smoothing=0.1, dtype=torch.float64)
        xr = x[lo:hi].clone().requires_grad_()
        loss = rep(xr, y[lo:hi])
        loss.backward()
        rep.average_gradients()
        out[("replicated", name)] = (
            _rel(loss.detach(), ref.detach()),
            _rel(xr.grad, world * x_ref.grad[lo:hi]),
            _rel(rep.weight.grad, W_full.grad),
        )
    return out


def _naive_low_precision_case(rank, world):
    """The naive head on fp16 / bf16 weights: rank 0 computes the loss in fp32 and broadcasts it, so
    every rank must hold an fp32 buffer for it (a bf16 one of half the size aborted gloo)."""
    B, lo, hi = _rows(rank, world)
    x, y, _ = _global_data(B, ignore=True)
    out = {}
    for dtype in (torch.bfloat16, torch.float16):
        naive = NaiveParallelHead(D, C, margin=M.CosFace(8.0, 0.35), dtype=dtype)
        xr = x[lo:hi].to(dtype).requires_grad_()
        loss = naive(xr, y[lo:hi])
        loss.backward()
        # one process over the whole batch, the same weights: the logits rounded alike
        alone = NaiveParallelHead(D, C, margin=M.CosFace(8.0, 0.35), dtype=dtype, context=DistContext())
        out[str(dtype)] = (loss.item(), loss.dtype, alone(x.to(dtype), y).item(), bool(torch.isfinite(xr.grad).all()))
    return out


def _partial_fc_case(rank, world):
    """Partial FC equals the dense loss over exactly the sampled classes (positives included)."""
    B, lo, hi = _rows(rank, world)
    x, y, _ = _global_data(B)
    head = shardfc.ShardedMarginHead(D, C, margin=M.CosFace(64.0, 0.35), sample_rate=0.4, sample_seed=3, dtype=torch.float64, label_smoothing=0.1)
    xr = x[lo:hi].clone().requires_grad_()
    loss = head(xr, y[lo:hi])
    loss.backward()
    rows = head.sampled_rows[0] + head.class_range.start
    gathered = DistContext.resolve().all_gather_object(rows.tolist())
    kept = torch.tensor(sorted(sum(gathered, [])))
    W_full = init_rows(0, C, D, 0).double().requires_grad_()
    x_ref = x.clone().requires_grad_()
    remap = torch.full((C,), -1, dtype=torch.long)
    remap[kept] = torch.arange(kept.numel())
    ref = shardfc.reference_loss(x_ref, W_full[kept], remap[y], M.CosFace(64.0, 0.35), label_smoothing=0.1)
    ref.backward()
    r = head.class_range
    untouched = torch.ones(C, dtype=torch.bool)
    untouched[kept] = False
    # The same step with a row-sparse gradient: the sampled rows' gradient only, no .grad.
    sparse = shardfc.ShardedMarginHead(D, C, margin=M.CosFace(64.0, 0.35), sample_rate=0.4, sample_seed=3,
                                       dtype=torch.float64, label_smoothing=0.1, sparse_grad=True)
    xs = x[lo:hi].clone().requires_grad_()
    sparse(xs, y[lo:hi]).backward()
    row_grad = sparse.take_sampled_rows()[sparse.weight]
    return {
        "sparse_no_grad": sparse.weight.grad is None,
        "sparse_rows": bool(torch.equal(row_grad.rows, rows - r.start)),
        "sparse_grad_weight": _rel(row_grad.values, W_full.grad[rows]),
        "sparse_grad_embeddings": _rel(xs.grad, world * x_ref.grad[lo:hi]),
        "positives_kept": bool(torch.isin(y, kept).all()),
        "loss": _rel(loss.detach(), ref.detach()),
        "grad_embeddings": _rel(xr.grad, world * x_ref.grad[lo:hi]),
        "grad_weight": _rel(head.weight.grad, W_full.grad[r.start : r.stop]),
        "unsampled_grad_zero": bool((head.weight.grad[untouched[r.start : r.stop]] == 0).all()),
        "count": kept.numel(),
        "expected_min": sum(math.ceil(0.4 * (len(rr))) for rr in shardfc.head.layout.class_ranges(C, world)),
    }


def _subgroup_case(rank, world):
    """With ``group=`` a subgroup of ranks 1..W-1, the head shards and reduces over it alone."""
    members = list(range(1, world))
    sub = dist.new_group(members)  # every rank takes part in creating it
    if rank not in members:
        return None
    sub_world, sub_rank = len(members), dist.get_rank(sub)
    sizes = [3, 0, 4][:sub_world]
    B, lo, hi = sum(sizes), sum(sizes[:sub_rank]), sum(sizes[: sub_rank + 1])
    x, y, _ = _global_data(B)
    head = shardfc.ShardedMarginHead(D, C, margin=MARGINS["arcface"], group=sub, dtype=torch.float64)
    xr = x[lo:hi].clone().requires_grad_()
    loss = head(xr, y[lo:hi])
    loss.backward()
    W_full = init_rows(0, C, D, 0).double().requires_grad_()
    x_ref = x.clone().requires_grad_()
    ref = shardfc.reference_loss(x_ref, W_full, y, MARGINS["arcface"])
    ref.backward()
    r = head.class_range
    return {
        "range": (r.start, r.stop),
        "loss": _rel(loss.detach(), ref.detach()),
        "grad_embeddings": _rel(xr.grad, sub_world * x_ref.grad[lo:hi]) if hi > lo else 0.0,
        "grad_weight": _rel(head.weight.grad, W_full.grad[r.start : r.stop]),
    }


def _worker(rank, world):
    torch.set_num_threads(1)
    return {
        "cases": {name: _run_case(rank, world, opts) for name, opts in CASES.items()},
        "bad": _bad_input_cases(rank, world),
        "predict": _predict_case(rank, world),
        "ddp": _ddp_case(rank, world),
        "baselines": _baselines_case(rank, world),
        "naive_low_precision": _naive_low_precision_case(rank, world),
        "partial": _partial_fc_case(rank, world),
        "subgroup": _subgroup_case(rank, world) if world >= 3 else None,
    }


@pytest.fixture(scope="module", params=[1, 2, 3, 4], ids=lambda w: f"W={w}")
def world_results(request):
    return request.param, spawn(_worker, request.param, backend="gloo")


@pytest.mark.parametrize("case", list(CASES))
def test_loss_and_gradients_equal_dense_reference(world_results, case):
    world, results = world_results
    for rank, res in enumerate(results):
        errs = res["cases"][case]
        assert errs["loss_finite"]
        for key in ("loss", "grad_embeddings", "grad_weight"):
            assert errs[key] < TOL, f"W={world} rank {rank} {case}: {key} rel err {errs[key]:.3g}"


def test_bad_input_raises_on_every_rank(world_results):
    world, results = world_results
    expected = {
        "label_out_of_range": ("ValueError", "outside [0, num_classes=23)"),
        "negative_label": ("ValueError", "labels[1] = -7"),
        "float_labels": ("TypeError", "integer"),
        "wrong_width": ("ValueError", "width 7"),
        "count_mismatch": ("ValueError", "labels has 2 entries"),
        "non_finite": ("NonFiniteEmbeddingsError", "non-finite"),  # a ValueError that says what it is
        "three_d": ("ValueError", "2-D"),
        "predict_bad_k": ("ValueError", "k must be"),
    }
    for rank, res in enumerate(results):
        bad = res["bad"]
        for name, (kind, text) in expected.items():
            got_kind, message = bad[name]
            assert got_kind == kind, f"rank {rank} {name}: {got_kind}: {message}"
            assert text in message, f"rank {rank} {name}: {message!r}"
            if name != "predict_bad_k" and world > 1:
                assert f"rank {world - 1}" in message  # every rank names the rank at fault
        assert bad["after_errors_loss_finite"]


def test_predict_equals_dense_topk(world_results):
    world, results = world_results
    for rank, res in enumerate(results):
        for key, (err, same_ids, shape) in res["predict"].items():
            assert shape == (SIZES[world][rank], 5)
            assert err < TOL and same_ids, f"rank {rank} {key}"


def test_ddp_backbone_gets_single_process_gradients(world_results):
    world, results = world_results
    for res in results:
        assert res["ddp"]["backbone"] < TOL
        assert res["ddp"]["head"] < TOL
        assert res["ddp"]["loss"] < TOL


def test_baselines_equal_reference(world_results):
    world, results = world_results
    for res in results:
        for key, errs in res["baselines"].items():
            assert max(errs) < TOL, f"{key}: {errs}"


def test_the_naive_heads_low_precision_loss_is_fp32_and_the_same_on_every_rank(world_results):
    world, results = world_results
    for dtype in ("torch.bfloat16", "torch.float16"):
        losses = [res["naive_low_precision"][dtype] for res in results]
        value, loss_dtype, alone, grads_finite = losses[0]
        assert loss_dtype == torch.float32 and grads_finite
        assert all(other[:2] == (value, torch.float32) and other[3] for other in losses), (dtype, losses)
        assert abs(value - alone) <= 1e-2 * abs(alone), (dtype, value, alone)


def test_partial_fc_equals_dense_loss_over_sampled_classes(world_results):
    world, results = world_results
    for res in results:
        p = res["partial"]
        assert p["positives_kept"] and p["unsampled_grad_zero"]
        assert p["sparse_no_grad"] and p["sparse_rows"]
        assert p["count"] >= p["expected_min"]
        for key in ("loss", "grad_embeddings", "grad_weight", "sparse_grad_weight", "sparse_grad_embeddings"):
            assert p[key] < TOL, f"{key}: {p[key]}"


def test_explicit_subgroup_is_used_not_world(world_results):
    world, results = world_results
    if world < 3:
        pytest.skip("needs a world of 3 or more ranks to leave one out")
    assert results[0]["subgroup"] is None
    members = results[1:]
    ranges = [tuple(m["subgroup"]["range"]) for m in members]
    assert ranges == [(r.start, r.stop) for r in shardfc.head.layout.class_ranges(C, world - 1)]
    for m in members:
        sub = m["subgroup"]
        for key in ("loss", "grad_embeddings", "grad_weight"):
            assert sub[key] < TOL, f"{key}: {sub[key]}"


# ---- the same cases, ranks as threads of this process. One test, one case: each test's own calls
# (not a module fixture's, charged to whichever test ran first) are what mutation testing sees.

THREAD_WORLDS = pytest.mark.parametrize("world", [2, 3], ids=lambda w: f"threads W={w}")


def _on_threads(world, fn, monkeypatch):
    return world, ThreadWorld(world).results(lambda rank: fn(rank, world), monkeypatch)


@THREAD_WORLDS
@pytest.mark.parametrize("case", list(CASES))
def test_loss_and_gradients_equal_dense_reference_over_thread_ranks(world, case, monkeypatch):
    world, results = _on_threads(world, lambda rank, w: {"cases": {case: _run_case(rank, w, CASES[case])}}, monkeypatch)
    test_loss_and_gradients_equal_dense_reference((world, results), case)


@pytest.mark.parametrize("case", ["margin=arcface", "chunked+none+ignore", "labels_on_one_shard"])
def test_loss_and_gradients_over_torch_distributed_thread_ranks(case):
    """The whole stack in this process: torch.distributed initialised in each thread, so the head
    finds the default group itself and its collectives are ``torch.distributed``'s."""
    world = 3
    results = TorchThreadWorld(world).results(lambda rank: {"cases": {case: _run_case(rank, world, CASES[case])}})
    test_loss_and_gradients_equal_dense_reference((world, results), case)


#: The rest of the gloo cases over the whole stack in this process, each with the test that checks it.
TORCH_THREAD_CASES = {
    "predict": (lambda rank, w: {"predict": _predict_case(rank, w)}, test_predict_equals_dense_topk),
    "ddp": (lambda rank, w: {"ddp": _ddp_case(rank, w)}, test_ddp_backbone_gets_single_process_gradients),
    "baselines": (lambda rank, w: {"baselines": _baselines_case(rank, w)}, test_baselines_equal_reference),
    "partial": (lambda rank, w: {"partial": _partial_fc_case(rank, w)},
                test_partial_fc_equals_dense_loss_over_sampled_classes),
    "subgroup": (lambda rank, w: {"subgroup": _subgroup_case(rank, w)}, test_explicit_subgroup_is_used_not_world),
}


@pytest.mark.parametrize("case", list(TORCH_THREAD_CASES))
def test_the_other_cases_over_torch_distributed_thread_ranks(case):
    run, check = TORCH_THREAD_CASES[case]
    world = 3
    check((world, TorchThreadWorld(world).results(lambda rank: run(rank, world))))


@THREAD_WORLDS
def test_bad_input_raises_on_every_thread_rank(world, monkeypatch):
    test_bad_input_raises_on_every_rank(_on_threads(world, lambda rank, w: {"bad": _bad_input_cases(rank, w)},
                                                    monkeypatch))


@THREAD_WORLDS
def test_partial_fc_over_thread_ranks_equals_dense_loss_over_sampled_classes(world, monkeypatch):
    test_partial_fc_equals_dense_loss_over_sampled_classes(
        _on_threads(world, lambda rank, w: {"partial": _partial_fc_case(rank, w)}, monkeypatch))


@THREAD_WORLDS
def test_every_bad_rank_is_named_and_only_those(world, monkeypatch):
    """Every rank raises the same error, which names each rank whose batch was bad, in rank order,
    with its own row and value, and no rank whose batch was good."""
    def bad_labels(rank):
        y = torch.tensor([0, 5, C - 1])
        y[rank % 3] = C + rank  # out of range, a different row and value on each rank
        return y

    def step(rank, bad_ranks):
        head = shardfc.ShardedMarginHead(D, C, dtype=torch.float64)
        x = torch.randn(3, D, dtype=torch.float64)
        try:
            head(x, bad_labels(rank) if rank in bad_ranks else torch.tensor([0, 5, C - 1]))
        except ValueError as e:
            return str(e)
        return "no error"

    def text(rank):
        return (f"rank {rank}: labels[{rank % 3}] = {C + rank} is outside [0, num_classes={C}) "
                f"and is not ignore_index=-1")

    both = (0, world - 1)
    results = ThreadWorld(world).results(lambda rank: step(rank, both), monkeypatch)
    assert results == [f"{text(0)}; {text(world - 1)}"] * world
    results = ThreadWorld(world).results(lambda rank: step(rank, (1,)), monkeypatch)
    assert results == [text(1)] * world
