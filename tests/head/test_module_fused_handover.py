"""What the head hands the fused implementations each forward, decided on the CPU: who applies the
optimizer's update (``_row_update_hook``, ``last_update``), the operand an update keeps for the next
forward (``_next_operands_for``), and the clipping norm's reports (``measure_weight_grad_norm``).

The kernels that use them are tested under the interpreter (``tests/head/fused``: ``test_fused_update.py``,
``test_next_operand.py``, ``test_grad_norm.py``), minutes a run; here the head's side of each is held by
a stand-in optimizer, in the test's process and in milliseconds, where mutation testing reaches it.
"""

from __future__ import annotations

import gc
import logging

import pytest
import torch

import shardfc
from shardfc.head.fused.chunks import NextOperand


class StandInOptimizer:
    """The three things the head asks a fused optimizer: ``fused_update``, why a weight cannot be
    updated in the backward, and the update to hand the backward."""

    def __init__(self, fused_update=True, unavailable=None):
        self.fused_update = fused_update
        self.unavailable = unavailable or {}  # id(weight) -> why not
        self.asked = []

    def fused_update_unavailable(self, w):
        return self.unavailable.get(id(w))

    def backward_update(self, w):
        self.asked.append(w)
        return ("the update of", w)


def _head(devices=None):
    return shardfc.ShardedMarginHead(4, 9, devices=devices)


def test_without_an_attached_optimizer_the_optimizer_updates():
    head = _head()
    assert head._update_optimizer() is None and head._fuses_update() is False
    assert head._row_update_hook("triton", torch.bfloat16, head.shard_weights) is None
    assert head.last_update is None


def test_the_attached_optimizer_is_held_weakly():
    head, opt = _head(), StandInOptimizer()
    head.fuse_optimizer_update(opt)
    assert head._update_optimizer() is opt and head._fuses_update() is True
    opt.fused_update = False
    assert head._fuses_update() is False
    del opt
    gc.collect()
    assert head._update_optimizer() is None and head._fuses_update() is False


def test_no_update_is_handed_over_when_autograd_does_not_record():
    head, opt = _head(), StandInOptimizer()
    head.fuse_optimizer_update(opt)
    with torch.no_grad():
        assert head._row_update_hook("triton", torch.bfloat16, head.shard_weights) is None
    assert head.last_update is None and opt.asked == []


@pytest.mark.parametrize("impl, dtype, why", [
    ("torch", torch.bfloat16, "impl='torch' stores the gradient (the fused update needs impl 'triton' or 'gemm')"),
    ("triton", torch.float16, "fp16 compute (a loss scaler's gradient is unscaled and checked in step())"),
    ("gemm", torch.float16, "fp16 compute (a loss scaler's gradient is unscaled and checked in step())"),
])
def test_the_optimizer_updates_from_the_gradient_and_the_head_says_why(impl, dtype, why, caplog):
    head, opt = _head(), StandInOptimizer()
    head.fuse_optimizer_update(opt)
    with caplog.at_level(logging.INFO, "shardfc.head"):
        assert head._row_update_hook(impl, dtype, head.shard_weights) is None
        assert head._row_update_hook(impl, dtype, head.shard_weights) is None
    assert head.last_update == f"optimizer: {why}"
    assert [r.getMessage() for r in caplog.records] == [f"head update: by the optimizer's step from .grad ({why})"]


@pytest.mark.parametrize("impl", ["triton", "gemm"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_backward_updates_when_every_shard_can_be(impl, dtype, caplog):
    head, opt = _head(devices=["cpu", "cpu", "cpu"]), StandInOptimizer()
    head.fuse_optimizer_update(opt)
    weights = head.shard_weights
    with caplog.at_level(logging.INFO, "shardfc.head"):
        hook = head._row_update_hook(impl, dtype, weights)
        head._row_update_hook(impl, dtype, weights)  # logged once: only a change is
    assert head.last_update == "fused"
    assert [r.getMessage() for r in caplog.records] == ["head update: fused into the backward (no .grad stored)"]
    assert hook(1) == ("the update of", weights[1]) and opt.asked == [weights[1]]
    assert hook(2)[1] is weights[2]


def test_the_first_shard_that_cannot_be_updated_says_why_for_all(caplog):
    head = _head(devices=["cpu", "cpu", "cpu"])
    w = head.shard_weights
    opt = StandInOptimizer(unavailable={id(w[1]): "shard 1 is fp16", id(w[2]): "shard 2 is fp16"})
    head.fuse_optimizer_update(opt)
    assert head._row_update_hook("gemm", torch.float32, w) is None
    assert head.last_update == "optimizer: shard 1 is fp16"
    opt.unavailable = {}  # the change back is logged too
    with caplog.at_level(logging.INFO, "shardfc.head"):
        assert head._row_update_hook("gemm", torch.float32, w) is not None
    assert head.last_update == "fused" and len(caplog.records) == 1


def test_an_operand_is_kept_for_the_next_forward_only_with_a_fused_update_on_the_fused_impls():
    head, opt = _head(devices=["cpu", "cpu"]), StandInOptimizer()
    assert head._next_operands_for("gemm", 2) is None  # no fused optimizer
    head.fuse_optimizer_update(opt)
    kept = head._next_operands_for("triton", 2)
    assert len(kept) == 2 and all(isinstance(k, NextOperand) for k in kept) and kept[0] is not kept[1]
    assert head._next_operands_for("gemm", 2) is kept  # the same ones, step after step
    kept[0].operand = torch.zeros(1)
    assert head._next_operands_for("torch", 2) is None  # the torch impl: released
    assert kept[0].operand is None and head._next_operands is None
    again = head._next_operands_for("gemm", 2)
    assert again is not kept and head._next_operands_for("gemm", 3) is not again  # another shard count
    assert len(head._next_operands) == 3


def test_release_next_operands_clears_each_one():
    head, opt = _head(devices=["cpu", "cpu"]), StandInOptimizer()
    head.fuse_optimizer_update(opt)
    kept = head._next_operands_for("triton", 2)
    for k in kept:
        k.operand, k.inv = torch.zeros(1), torch.ones(1)
    head.release_next_operands()
    assert head._next_operands is None and all(k.operand is None and k.inv is None for k in kept)
    head.release_next_operands()  # nothing kept: nothing to do
    opt.fused_update = False
    kept = head._next_operands_for("triton", 2)
    assert kept is None


# ---- the clipping norm's reports


def test_nothing_is_measured_unless_asked():
    head = _head()
    assert head._grad_sq_sink() is None and head.take_weight_grad_sq_norm() is None


def test_the_norm_is_the_sum_of_the_shards_reports_of_one_training_forward():
    head = _head(devices=["cpu", "cpu"])
    head.measure_weight_grad_norm()
    sink = head._grad_sq_sink()
    sink(0, torch.tensor([2.0]))
    sink(1, torch.tensor(3.0, dtype=torch.float64))
    got = head.take_weight_grad_sq_norm()
    assert got.shape == () and got.item() == 5.0 and got.device == head.devices[0]
    assert head.take_weight_grad_sq_norm() is None  # taken: none until the next forward's


def test_the_norm_is_unknown_after_two_forwards_or_a_shard_missing():
    head = _head(devices=["cpu", "cpu"])
    head.measure_weight_grad_norm(True)
    for _ in range(2):  # gradient accumulation: two forwards, each followed by its backward's reports
        sink = head._grad_sq_sink()
        sink(0, torch.tensor(1.0))
        sink(1, torch.tensor(1.0))
    assert len(head._grad_sq) == 2  # the second forward's reports are not kept
    assert head.take_weight_grad_sq_norm() is None
    head._grad_sq_sink()(0, torch.tensor(1.0))  # one shard of two reported (a fused update: none)
    assert head.take_weight_grad_sq_norm() is None


def test_a_forward_without_autograd_is_not_counted_and_turning_off_forgets():
    head = _head()
    head.measure_weight_grad_norm()
    with torch.no_grad():
        assert head._grad_sq_sink() is None
    head._grad_sq_sink()(0, torch.tensor(4.0))
    assert head.take_weight_grad_sq_norm().item() == 4.0
    head._grad_sq_sink()(0, torch.tensor(4.0))
    head.measure_weight_grad_norm(False)
    assert head._grad_sq == [] and head._grad_sq_forwards == 0
    assert head._grad_sq_sink() is None and head.take_weight_grad_sq_norm() is None


# ---- the plan each forward hands the sharded loss


class _Planned(Exception):
    pass


def _planned(monkeypatch, head, x, y, run=True):
    """The :class:`~shardfc.head.function.ShardedLossPlan` of one forward of ``head`` (``run=False``:
    the forward stops there, for a plan whose fused kernels cannot run here)."""
    from shardfc.head import module

    plans = []
    real = module.sharded_cross_entropy

    def spy(plan, *args):
        plans.append(plan)
        if not run:
            raise _Planned()
        return real(plan, *args)

    monkeypatch.setattr(module, "sharded_cross_entropy", spy)
    try:
        head(x, y)
    except _Planned:
        pass
    (plan,) = plans
    return plan


@pytest.mark.parametrize("x_dtype, w_dtype, compute, stats", [
    (torch.float32, torch.float32, torch.float32, torch.float32),
    (torch.float32, torch.float64, torch.float64, torch.float64),  # the weights' precision counts too
    (torch.float64, torch.float32, torch.float64, torch.float64),  # and the embeddings'
    (torch.bfloat16, torch.float32, torch.float32, torch.float32),
])
def test_the_plans_precision_is_that_of_both_inputs(monkeypatch, x_dtype, w_dtype, compute, stats):
    head = shardfc.ShardedMarginHead(4, 9, dtype=w_dtype)
    plan = _planned(monkeypatch, head, torch.randn(3, 4).to(x_dtype), torch.tensor([0, 5, 8]))
    assert (plan.config.compute_dtype, plan.config.stats_dtype) == (compute, stats)


@pytest.mark.parametrize("chunk_size, batch, want", [(None, 3, None), (2, 3, 2), ("auto", 4, 2 ** 20 // (8 * 4))])
def test_the_plan_walks_the_classes_in_the_chunks_asked_for(monkeypatch, chunk_size, batch, want):
    head = shardfc.ShardedMarginHead(4, 9, chunk_size=chunk_size, chunk_budget_bytes=2 ** 20)
    plan = _planned(monkeypatch, head, torch.randn(batch, 4), torch.arange(batch))
    assert plan.config.chunk_size == want


def test_the_plan_of_a_fused_impl_carries_the_update_the_operand_and_the_norms_sink(monkeypatch):
    """With a fused optimizer attached and the norm measured, a "gemm" forward hands the plan its impl
    at the head's chunk scale, the backward's update, the operands kept for the next forward and the
    clipping norm's sink."""
    from shardfc.head import module

    monkeypatch.setattr(module, "resolve_impl", lambda impl, *args: impl)
    head = shardfc.ShardedMarginHead(4, 9, impl="gemm", gpu_chunk_scale=4, devices=["cpu", "cpu"])
    opt = StandInOptimizer()
    head.fuse_optimizer_update(opt)
    head.measure_weight_grad_norm()
    plan = _planned(monkeypatch, head, torch.randn(3, 4), torch.tensor([0, 5, 8]), run=False)
    assert (plan.config.impl, plan.config.chunk_scale) == ("gemm", 4)
    assert (head.last_impl, head.last_chunk_scale, head.last_update) == ("gemm", 4, "fused")
    assert plan.row_update(1) == ("the update of", head.shard_weights[1])
    assert plan.next_operands is head._next_operands and len(plan.next_operands) == 2
    plan.grad_sq_sink(0, torch.tensor(1.0))
    assert head._grad_sq == [torch.tensor(1.0)]


def test_the_torch_impl_has_no_chunk_scale_whatever_the_head_says(monkeypatch):
    head = shardfc.ShardedMarginHead(4, 9, impl="torch", gpu_chunk_scale=4)
    plan = _planned(monkeypatch, head, torch.randn(3, 4), torch.tensor([0, 5, 8]))
    assert (head.last_impl, head.last_chunk_scale) == ("torch", None)
    assert plan.config.impl == "torch" and plan.row_update is None and plan.next_operands is None


def test_a_take_starts_the_count_of_forwards_again():
    head = _head()
    head.measure_weight_grad_norm()
    for _ in range(2):  # forward and backward, take; forward and backward, take
        head._grad_sq_sink()(0, torch.tensor(2.0))
        assert head.take_weight_grad_sq_norm().item() == 2.0


def test_an_fp16_forward_leaves_the_update_to_the_optimizer(monkeypatch):
    """fp16 compute (the inputs' dtype here) hands the plan no update: a loss scaler unscales and
    checks the gradient in ``step()``."""
    from shardfc.head import module

    monkeypatch.setattr(module, "resolve_impl", lambda impl, *args: impl)
    head = shardfc.ShardedMarginHead(4, 9, impl="gemm", dtype=torch.float16)
    opt = StandInOptimizer()
    head.fuse_optimizer_update(opt)
    plan = _planned(monkeypatch, head, torch.randn(3, 4).half(), torch.tensor([0, 5, 8]), run=False)
    assert plan.config.compute_dtype == torch.float16 and plan.row_update is None
    assert head.last_update == "optimizer: fp16 compute (a loss scaler's gradient is unscaled and checked in step())"
