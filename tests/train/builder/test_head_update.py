"""``--head-update`` and ``--head-grad-clip``: who applies the head's optimizer step, and whether the
head is clipped (not by default since 0.2: arcface_torch clips the backbone only)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from shardfc.head.partial_fc import RowSparseAdamW, RowSparseSGD
from shardfc.parallel.context import DistContext
from shardfc.train.builder.factory import build_parts
from shardfc.train.builder.head_update import fused_head_update
from shardfc.train.config import ConfigError, TrainConfig, parse_config

BASE = TrainConfig(image_size=[16, 16], embedding_dim=8, synthetic_identities=10, grad_accum=1, device="cuda")


@pytest.mark.parametrize("change,why", [
    (dict(grad_accum=2), "grad_accum=2 (several backward passes add into one step's gradient)"),
    (dict(head_grad_clip=5.0), "head_grad_clip=5.0 (clipping reads the stored gradient)"),
    (dict(amp="fp16"), "amp='fp16'"),
    (dict(head_dtype="bfloat16", head_rounding="stochastic"), "head_rounding='stochastic'"),
    (dict(head_impl="torch"), "head_impl='torch'"),
    (dict(device="cpu"), "the run is on the CPU"),
    (dict(strategy="pipeline", nproc=2, micro_batches=2, batch_size=8), "micro_batches=2"),
])
def test_fused_is_refused_where_it_cannot_run(change, why):
    cfg = dataclasses.replace(BASE, head_update="fused", **change)
    with pytest.raises(ConfigError, match=r"head_update='fused': .*" + why.replace("(", r"\(").replace(")", r"\)")):
        cfg.validate()
    dataclasses.replace(cfg, head_update="auto").validate()  # auto falls back, quietly


def test_bad_values_name_the_flag():
    with pytest.raises(ConfigError, match=r"head_update must be one of auto, fused, optimizer; got 'fuse'"):
        dataclasses.replace(BASE, head_update="fuse").validate()
    with pytest.raises(ConfigError, match=r"head_grad_clip must be >= 0, got -1.0"):
        dataclasses.replace(BASE, head_grad_clip=-1.0).validate()
    cfg, _ = parse_config(["--head-update", "optimizer", "--head-grad-clip", "5"])
    assert cfg.head_update == "optimizer" and cfg.head_grad_clip == 5.0


def test_auto_on_the_cpu_keeps_torchs_optimizer():
    """On the CPU the head's step stays the optimizer's, built as before (torch's SGD for an fp32
    head without sampling): the default run's results do not move."""
    cfg = dataclasses.replace(BASE, device="cpu").validate()
    assert fused_head_update(cfg, torch.device("cpu"), None) is False
    parts = build_parts(cfg, DistContext(), 10, (16, 16), total_steps=4, amp_dtype=None)
    assert type(parts.opt_head) is torch.optim.SGD


def test_fused_decision(monkeypatch):
    cfg = BASE.validate()
    assert fused_head_update(cfg, torch.device("cuda"), torch.bfloat16) is True
    assert fused_head_update(cfg, torch.device("cuda"), torch.float16) is False  # amp 'auto' fell back to fp16
    assert fused_head_update(dataclasses.replace(cfg, head_update="optimizer"), torch.device("cuda"), None) is False
    with pytest.raises(ConfigError, match=r"head_update='fused': the run computes in fp16"):
        fused_head_update(dataclasses.replace(cfg, head_update="fused"), torch.device("cuda"), torch.float16)
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "triton" else real(name, *a))
    assert fused_head_update(cfg, torch.device("cuda"), None) is False


@pytest.mark.parametrize("optimizer,cls", [("sgd", RowSparseSGD), ("adamw", RowSparseAdamW)])
def test_the_fused_optimizer_is_built_for_the_run(monkeypatch, optimizer, cls):
    """Where the run qualifies, the head's optimizer is the row-sparse SGD or AdamW with its step
    fused into the head's backward (faked here on the CPU: the decision is what is tested)."""
    import shardfc.train.builder.factory as build

    monkeypatch.setattr(build, "fused_head_update", lambda cfg, device, amp: True)
    cfg = dataclasses.replace(BASE, device="cpu", optimizer=optimizer).validate()
    parts = build_parts(cfg, DistContext(), 10, (16, 16), total_steps=4, amp_dtype=None)
    assert isinstance(parts.opt_head, cls) and parts.opt_head.fused_update
    assert parts.head._fused_optimizer() is parts.opt_head


def test_auto_fuses_adamw_too():
    """AdamW's step is fused like SGD's: 'auto' picks it on CUDA, 'fused' is accepted."""
    cfg = dataclasses.replace(BASE, optimizer="adamw").validate()
    assert cfg.head_update_not_fusable("cuda") is None
    assert fused_head_update(cfg, torch.device("cuda"), torch.bfloat16) is True
    dataclasses.replace(cfg, head_update="fused").validate()


def test_fused_without_triton_says_how_to_install_it(monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "triton" else real(name, *a))
    with pytest.raises(ConfigError) as err:
        fused_head_update(dataclasses.replace(BASE, head_update="fused").validate(), torch.device("cuda"), None)
    assert str(err.value) == ("head_update='fused': Triton is not installed (pip install 'shardfc[gpu]'); "
                              "use head_update 'auto' or 'optimizer'")
