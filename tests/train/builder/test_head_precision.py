"""``shardfc train`` with a low-precision head (--head-dtype, --head-rounding) and row-sparse head
gradients (--sparse-grad): the flags reach the head and its optimizer, and a sparse-gradient run
(micro-batches, clipping active) trains the head as the dense-gradient run does."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

from shardfc.cli import train as train_cli
from shardfc.train.config import ConfigError

from ..tiny import tiny_config


def _head(out: Path) -> dict:
    last = sorted(p for p in out.glob("checkpoints/*") if p.is_dir())[-1]
    return torch.load(last / "head_0.pt", weights_only=True)["tensors"]


def _run(out: Path, **overrides) -> dict:
    options = dict(nproc=1, max_steps=3, ckpt_every=3, eval_every=0, sample_rate=0.5, grad_clip=0.05, head_grad_clip=0.05)
    cfg = tiny_config(out, **{**options, **overrides})
    train_cli.run(cfg)
    return _head(out)


def test_sparse_gradient_run_equals_the_dense_gradient_run(tmp_path):
    dense = _run(tmp_path / "dense")
    sparse = _run(tmp_path / "sparse", sparse_grad=True)
    assert dense.keys() == sparse.keys()
    for key in dense:
        torch.testing.assert_close(sparse[key], dense[key], rtol=1e-5, atol=1e-7)
    assert not torch.equal(dense["weight"], _run(tmp_path / "unclipped", head_grad_clip=0.0)["weight"])


def test_subcenter_sparse_gradient_run_equals_the_dense_gradient_run(tmp_path):
    """--subcenters 2 with Partial FC: the compact gradient of the sampled classes' centre rows trains
    the head as the dense gradient does; the checkpoint stores [n, K, D] either way."""
    dense = _run(tmp_path / "dense", subcenters=2)
    sparse = _run(tmp_path / "sparse", subcenters=2, sparse_grad=True)
    assert dense["weight"].dim() == 3 and dense["weight"].shape[1] == 2
    for key in dense:
        torch.testing.assert_close(sparse[key], dense[key], rtol=1e-5, atol=1e-7)


def test_bf16_head_keeps_its_dtype_in_the_checkpoint(tmp_path):
    saved = _run(tmp_path / "bf16", head_dtype="bfloat16", head_rounding="stochastic", sparse_grad=True)
    assert saved["weight"].dtype == torch.bfloat16
    assert saved["optimizer.momentum_buffer"].dtype == torch.bfloat16


@pytest.mark.parametrize(
    "overrides, text",
    [
        (dict(head_dtype="half"), "head_dtype must be one of"),
        (dict(head_rounding="up"), "head_rounding must be one of"),
        (dict(sparse_grad=True), "sparse_grad needs Partial FC"),
        (dict(sparse_grad=True, sample_rate=0.5, amp="fp16"), "sparse_grad does not work with amp='fp16'"),
    ],
)
def test_bad_head_precision_flags(tmp_path, overrides, text):
    with pytest.raises(ConfigError, match=text):
        dataclasses.replace(tiny_config(tmp_path), **overrides).validate()
