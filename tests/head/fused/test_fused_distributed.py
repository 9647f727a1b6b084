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
    making a different candidate fastest: rank 0 gemm at chunk scale 1, rank 1 torch (the order of
    ``TIMED``: triton at four scales, gemm at four, torch)."""
    _interpret_off_gpu()
    os.environ["SHARDFC_CACHE_DIR"] = cache_dir
    import shardfc.head.module as module
    from shardfc.head import impl_select

    real = module.resolve_impl
    module.resolve_impl = lambda impl, *a: "auto" if impl == "auto" else real(impl, *a)
    ms = {0: [3.0] * 4 + [1.0, 3.0, 3.0, 3.0, 2.0], 1: [3.0] * 4 + [2.0] * 4 + [1.0]}[rank]
    ticks = {"n": 0, "now": 0.0}

    def clock():  # each timed call of candidate k lasts ms[k]; 2 steps each, clock read twice a step
        pair, end = divmod(ticks["n"], 2)
        ticks["n"] += 1
        if end:
            ticks["now"] += ms[min(pair // 2, len(ms) - 1)] / 1000
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
    assert results == [("gemm", "gemm@1"), ("gemm", "torch")]
    cached = json.loads((tmp_path / "head_impl.json").read_text())  # written by rank 0 alone
    assert [v["impl"] for v in cached.values()] == ["gemm@1"]


#: impl="auto" on 2 ranks whose environments differ: case -> (rank -> SHARDFC_HEAD_IMPL, ranks where
#: Triton is not installed). The other ranks run as on a GPU (off one, the candidates run under the
#: interpreter). The error cases come first: the cases after them show the ranks still in step.
AGREEMENT_CASES = {
    "override on rank 1 only": ({1: "gemm"}, ()),
    "invalid override on rank 0": ({0: "cudnn", 1: "gemm"}, ()),
    "override that cannot run on rank 1": ({0: "triton", 1: "triton"}, (1,)),
    "override on both": ({0: "gemm", 1: "gemm"}, ()),
    "no Triton on rank 1": ({}, (1,)),
    "no override": ({}, ()),
}


def _agreement_cases(rank, world, cache_dir):
    """Each case on a fresh head and selector: ``(impl run, candidates timed)``, or ``("error",
    message, this rank's cause)`` for a ValueError."""
    import importlib.util

    _interpret_off_gpu()
    os.environ["SHARDFC_CACHE_DIR"] = cache_dir
    import shardfc.head.module as module
    from shardfc.head import impl_select

    real, find_spec = module.resolve_impl, importlib.util.find_spec
    as_on_gpu = lambda impl, *a: "auto" if impl == "auto" else real(impl, *a)  # noqa: E731
    no_triton = lambda name, *a: None if name == "triton" else find_spec(name, *a)  # noqa: E731
    dev = _device()
    g = torch.Generator().manual_seed(5)
    x, y = torch.randn(3, D, generator=g), torch.randint(0, C, (3,), generator=g)
    out = {}
    for name, (env, without_triton) in AGREEMENT_CASES.items():
        os.environ.pop(impl_select.ENV_VAR, None)
        if rank in env:
            os.environ[impl_select.ENV_VAR] = env[rank]
        # the kernels are imported already: only the head's check for Triton sees it missing
        importlib.util.find_spec = no_triton if rank in without_triton else find_spec
        module.resolve_impl = real if rank in without_triton else as_on_gpu
        selector = impl_select.ImplSelector(steps=1, warmup=0, sync=lambda: None)
        impl_select.default_selector = lambda: selector
        head = shardfc.ShardedMarginHead(D, C, impl="auto", device=dev)
        try:
            head(x.to(dev).requires_grad_(), y.to(dev)).backward()
            out[name] = (head.last_impl, sum(len(t) for t in selector.timings.values()))
        except ValueError as e:
            out[name] = ("error", str(e), None if e.__cause__ is None else str(e.__cause__))
        finally:
            importlib.util.find_spec = find_spec
    return out


@pytest.fixture(scope="module")
def agreement(tmp_path_factory):
    # a short group timeout: a rank left waiting in a collective fails the test in a minute, not five
    return spawn(_agreement_cases, 2, str(tmp_path_factory.mktemp("cache")), backend="gloo", timeout_s=60)


def test_auto_override_on_one_rank_only_is_the_same_error_on_both(agreement):
    expected = "SHARDFC_HEAD_IMPL differs across ranks: rank 0 unset, rank 1 'gemm'; set it on every rank or on none"
    assert [r["override on rank 1 only"] for r in agreement] == [("error", expected, None)] * 2


def test_auto_invalid_or_unrunnable_override_is_an_error_on_every_rank(agreement):
    (_, msg0, cause0), (_, msg1, cause1) = [r["invalid override on rank 0"] for r in agreement]
    assert msg0 == msg1 and msg0.startswith("SHARDFC_HEAD_IMPL names no implementation of the head on rank 0 ")
    assert "'cudnn'" in cause0 and cause1 is None  # the value itself, where it was set
    (_, msg0, cause0), (_, msg1, cause1) = [r["override that cannot run on rank 1"] for r in agreement]
    assert msg0 == msg1 and msg0.startswith("SHARDFC_HEAD_IMPL='triton' cannot run on rank 1 ")
    assert cause0 is None and "impl='triton' cannot run: Triton is not installed" in cause1


def test_auto_override_on_every_rank_is_run_without_timing(agreement):
    assert [r["override on both"] for r in agreement] == [("gemm", 0)] * 2


def test_auto_is_torch_on_every_rank_when_one_cannot_run_the_fused_kernels(agreement):
    assert [r["no Triton on rank 1"] for r in agreement] == [("torch", 0)] * 2
    # and the group is still in step after every case: the last times the candidates on both
    # (each fused implementation at each of the four chunk scales, and torch)
    assert [r["no override"][1] for r in agreement] == [9, 9]
    assert agreement[0]["no override"][0] == agreement[1]["no override"][0]
