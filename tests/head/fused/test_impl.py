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
    with pytest.raises(ValueError, match=r"impl must be one of \('auto', 'triton', 'torch'\), got 'cuda'"):
        shardfc.ShardedMarginHead(8, 10, impl="cuda")


def test_auto_is_torch_on_the_cpu_even_under_the_interpreter():
    head = shardfc.ShardedMarginHead(8, 10)
    _step(head)
    assert head.impl == "auto" and head.last_impl == "torch"


def test_triton_on_cpu_without_interpreter(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    head = shardfc.ShardedMarginHead(8, 10, impl="triton")
    with pytest.raises(ValueError, match=r"impl='triton' cannot run: the head's tensors are on cpu, not a CUDA device"):
        _step(head)


def test_triton_with_float64():
    head = shardfc.ShardedMarginHead(8, 10, impl="triton", dtype=torch.float64)
    with pytest.raises(ValueError, match=r"fp32 statistics; inputs of torch.float64 need impl='torch'"):
        head(torch.randn(4, 8, dtype=torch.float64), torch.tensor([0, 1, 2, 3]))


def test_triton_with_too_wide_embeddings():
    D = fused.MAX_DIM + 1
    head = shardfc.ShardedMarginHead(D, 10, impl="triton")
    with pytest.raises(ValueError, match=rf"embedding_dim={D} is above the kernels' limit of {fused.MAX_DIM}"):
        _step(head, D)


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
