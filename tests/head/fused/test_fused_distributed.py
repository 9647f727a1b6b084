"""The GPU implementations (triton; gemm for two cases) in process-group mode, W = 1..3 gloo ranks, against the dense float64
reference: uneven shards (23 classes), unequal and empty local batches, labels on one shard."""

from __future__ import annotations

import json
import os

import pytest
import torch

import shardfc
from shardfc import margins as M
from shardfc.head.module import init_rows
from shardfc.parallel.launch import spawn

C, D = 23, 20
SIZES = {1: [7], 2: [5, 3], 3: [4, 0, 6]}
TOL = 1e-5
CASES = {
    "arcface": dict(),
    "smoothing+ignore+none": dict(label_smoothing=0.1, ignore=True, reduction="none", margin=M.CosFace()),
    "sphereface": dict(margin=M.SphereFace(4)),
    "labels_on_one_shard": dict(one_shard=True),
    "subcenters": dict(subcenters=2),
    "gemm": dict(impl="gemm"),
    "gemm+smoothing+ignore+none": dict(impl="gemm", label_smoothing=0.1, ignore=True, reduction="none", margin=M.CosFace()),
}


def _case(rank, world, opts):
    sizes = SIZES[world]
    B, lo, hi = sum(sizes), sum(sizes[:rank]), sum(sizes[: rank + 1])
    g = torch.Generator().manual_seed(11)
    x = torch.randn(B, D, generator=g, dtype=torch.float64) * 2
    y = torch.randint(C - 4 if opts.get("one_shard") else 0, C, (B,), generator=g)
    if opts.get("ignore"):
        y[::3] = -1
    up = torch.randn(B, generator=g, dtype=torch.float64)
    margin, K = opts.get("margin", M.ArcFace()), opts.get("subcenters", 1)
    eps, reduction = opts.get("label_smoothing", 0.0), opts.get("reduction", "mean")
    dev = _device()
    head = shardfc.ShardedMarginHead(D, C, margin=margin, label_smoothing=eps, reduction=reduction,
                                     subcenters=K, impl=opts.get("impl", "triton"), device=dev)
    xr = x[lo:hi].float().to(dev).requires_grad_()
    loss = head(xr, y[lo:hi].to(dev))
    loss.backward(up[lo:hi].float().to(dev) if reduction == "none" else torch.tensor(1.0, device=dev))
    loss, grad_x, grad_w = loss.detach().cpu(), xr.grad.cpu(), head.weight.grad.cpu()

    W = init_rows(0, C * K, D, 0, device=dev).double().cpu().requires_grad_()  # the head's rows, drawn where it draws them
    x_ref = x.clone().requires_grad_()
    if K > 1:
        xn = x_ref / x_ref.norm(dim=1, keepdim=True)
        wn = W / W.norm(dim=1, keepdim=True)
        cos = (xn @ wn.t()).view(B, C, K).amax(dim=2)
        ref = torch.nn.functional.cross_entropy(_arc(cos, y, margin), y, ignore_index=-1)
    else:
        ref = shardfc.reference_loss(x_ref, W, y, margin, label_smoothing=eps, reduction=reduction)
    ref.backward(up / world if reduction == "none" else torch.tensor(1.0, dtype=torch.float64))
    r = head.class_range
    rel = lambda a, b: float((a.double() - b).abs().max() / b.abs().max().clamp(min=1e-30)) if b.numel() else 0.0  # noqa: E731
    ref_loss = ref.detach()[lo:hi] if reduction == "none" else ref.detach()
    return {
        "impl": head.last_impl,
        "loss": rel(loss, ref_loss),
        "grad_x": rel(grad_x, world * x_ref.grad[lo:hi]),
        "grad_w": rel(grad_w, W.grad[r.start * K : r.stop * K]),
    }


def _arc(cos, y, margin):
    """ArcFace logits over the best sub-centre's cosine (margin.target: its one description)."""
    z = cos * margin.scale
    rows = torch.arange(cos.shape[0])
    value, _, _ = margin.target(cos[rows, y])
    return z.index_put((rows, y), value)


def _device() -> torch.device:
    """The ranks' device: the machine's GPU, shared by every rank (gloo moves CUDA tensors through
    the host), compiled kernels; else the CPU under Triton's interpreter."""
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def _interpret_off_gpu() -> None:
    # Each rank is a new process: the interpreter is set before it first imports the kernels.
    if not torch.cuda.is_available():
        os.environ["TRITON_INTERPRET"] = "1"


def _all_cases(rank, world):
    _interpret_off_gpu()
    return {name: _case(rank, world, opts) for name, opts in CASES.items()}


@pytest.mark.parametrize("world", sorted(SIZES))
def test_fused_matches_dense_reference(world):
    results = spawn(_all_cases, world, backend="gloo")
    for rank, per_case in enumerate(results):
        for name, errs in per_case.items():
            assert errs.pop("impl") == CASES[name].get("impl", "triton"), (world, rank, name)
            for key, err in errs.items():
                assert err < TOL, (world, rank, name, key, err)


def _auto_on_two_ranks(rank, world, cache_dir):
    """impl="auto" as on a GPU (the candidates under the interpreter), each rank's stub clock
    making a different candidate fastest: rank 0 gemm, rank 1 torch."""
    _interpret_off_gpu()
    os.environ["SHARDFC_CACHE_DIR"] = cache_dir
    import shardfc.head.module as module
    from shardfc.head import impl_select

    real = module.resolve_impl
    module.resolve_impl = lambda impl, *a: "auto" if impl == "auto" else real(impl, *a)
    ms = {0: [3.0, 1.0, 2.0], 1: [3.0, 2.0, 1.0]}[rank]
    ticks = {"n": 0, "now": 0.0}

    def clock():  # each timed call of candidate k lasts ms[k]; 2 steps each, clock read twice a step
        pair, end = divmod(ticks["n"], 2)
        ticks["n"] += 1
        if end:
            ticks["now"] += ms[min(pair // 2, 2)] / 1000
        return ticks["now"]

    selector = impl_select.ImplSelector(steps=2, warmup=0, clock=clock, sync=lambda: None)
    impl_select.default_selector = lambda: selector
    dev = _device()
    head = shardfc.ShardedMarginHead(D, C, impl="auto", device=dev)
    g = torch.Generator().manual_seed(3)
    x, y = torch.randn(SIZES[world][rank] or 1, D, generator=g), torch.randint(0, C, (SIZES[world][rank] or 1,), generator=g)
    head(x.to(dev).requires_grad_(), y.to(dev)).backward()
    fastest_here = min(selector.timings[next(iter(selector.timings))].items(), key=lambda kv: kv[1])[0]
    return head.last_impl, fastest_here


def test_auto_ranks_agree_on_rank_0s_choice(tmp_path):
    results = spawn(_auto_on_two_ranks, 2, str(tmp_path), backend="gloo")
    assert results == [("gemm", "gemm"), ("gemm", "torch")]
    cached = json.loads((tmp_path / "head_impl.json").read_text())  # written by rank 0 alone
    assert [v["impl"] for v in cached.values()] == ["gemm"]
