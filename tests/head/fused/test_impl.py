"""Which implementation a head runs, and the errors that say why Triton cannot."""

from __future__ import annotations

import importlib.util

import pytest
import torch

import shardfc
from shardfc.head import fused


def _step(head, D=8):
    x, y = torch.randn(4, D), torch.tensor([0, 1, 2, 3])
    return head(x, y)


def test_bad_impl_name():
    with pytest.raises(ValueError, match=r"impl must be one of \('auto', 'triton', 'gemm', 'torch'\), got 'cuda'"):
        shardfc.ShardedMarginHead(8, 10, impl="cuda")


def test_auto_is_torch_on_the_cpu_even_under_the_interpreter():
    head = shardfc.ShardedMarginHead(8, 10)
    _step(head)
    assert head.impl == "auto" and head.last_impl == "torch"


@pytest.mark.parametrize("impl", ["triton", "gemm"])
def test_gpu_impls_on_cpu_without_interpreter(monkeypatch, impl):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    head = shardfc.ShardedMarginHead(8, 10, impl=impl)
    with pytest.raises(ValueError, match=rf"impl='{impl}' cannot run: the head's tensors are on cpu, not a CUDA device"):
        _step(head)


@pytest.mark.parametrize("impl", ["triton", "gemm"])
def test_gpu_impls_with_float64(impl):
    head = shardfc.ShardedMarginHead(8, 10, impl=impl, dtype=torch.float64)
    with pytest.raises(ValueError, match=r"fp32 statistics; inputs of torch.float64 need impl='torch'"):
        head(torch.randn(4, 8, dtype=torch.float64), torch.tensor([0, 1, 2, 3]))


@pytest.mark.parametrize("impl", ["triton", "gemm"])
def test_wide_embeddings_run(impl):
    """No ``[tile, D]`` accumulator is left in any kernel: D above the old limit of 1024 runs,
    and equals the torch path."""
    D = 1100
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(6, D, generator=g), torch.tensor([0, 1, 2, 3, 4, 5])
    out = {}
    for name in ("torch", impl):
        head = shardfc.ShardedMarginHead(D, 10, impl=name)
        xr = x.clone().requires_grad_()
        head(xr, y).backward()
        out[name] = (xr.grad, head.weight.grad)
    for got, ref in zip(out[impl], out["torch"]):
        assert float((got - ref).abs().max() / ref.abs().max()) < 1e-5


def test_triton_not_installed(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "triton" else real(name, *a))
    head = shardfc.ShardedMarginHead(8, 10, impl="triton")
    with pytest.raises(ValueError, match=r"Triton is not installed \(pip install 'shardfc\[gpu\]'\)"):
        _step(head)
    auto = shardfc.ShardedMarginHead(8, 10)
    _step(auto)
    assert auto.last_impl == "torch"


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_auto_is_triton_on_cuda():
    head = shardfc.ShardedMarginHead(8, 10, device="cuda")
    head(torch.randn(4, 8, device="cuda"), torch.tensor([0, 1, 2, 3], device="cuda"))
    assert head.last_impl == "triton"


def test_an_impl_error_changes_no_state(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    head = shardfc.ShardedMarginHead(8, 10, impl="triton", sample_rate=0.5)
    with pytest.raises(ValueError, match="impl='triton' cannot run"):
        _step(head)
    assert head.sample_step == 0 and head.sampled_rows is None
