"""The designs shardfc replaces (``head/baselines.py``) against the dense float64 reference, in the
test's process: one process (the naive head over several devices too) and ranks as threads running
torch.distributed's in-process backend (the heads call torch.distributed themselves), with every
reduction, ignored and all-ignored labels, unequal and empty batches; and their refusals. The gloo
runs of the same heads are in test_module_distributed.py (``_baselines_case``)."""

from __future__ import annotations

import pytest
import test_module_distributed as cases
import torch
import torch.distributed as dist

import shardfc
from shardfc.head.baselines import NaiveParallelHead, ReplicatedHead
from shardfc.head.module import init_rows
from thread_world import TorchThreadWorld

C, D, TOL = cases.C, cases.D, cases.TOL
F64 = torch.float64


def _against_reference(rank: int, world: int, kind: str, reduction: str, labels: str = "some_ignored",
                       devices=None, margin: str = "arcface", group=None) -> dict:
    """This rank's loss and gradients, each as its relative error from the reference's (gradients by the
    project's convention: the objective is the mean over ranks of what each rank back-propagates).
    ``rank`` and ``world``: in ``group`` when one is given."""
    B, lo, hi = cases._rows(rank, world)
    x, y, upstream = cases._global_data(B, ignore=labels == "some_ignored", all_ignored=labels == "all_ignored")
    if labels == "one_valid":  # a mean over one sample
        y = torch.full_like(y, -1)
        y[1] = 5
    margin = cases.MARGINS[margin]
    if kind == "naive":
        head = NaiveParallelHead(D, C, margin=margin, label_smoothing=0.1, reduction=reduction, dtype=F64, group=group,
                                 **({"devices": devices} if devices else {}))
    else:
        head = ReplicatedHead(D, C, margin=margin, label_smoothing=0.1, reduction=reduction, dtype=F64, group=group)
    xr = x[lo:hi].clone().requires_grad_()
    loss = head(xr, y[lo:hi].to(torch.int32))  # int32 labels accepted, as by ShardedMarginHead
    mine = upstream[lo:hi] if reduction == "none" else torch.tensor(1.3, dtype=F64)
    loss.backward(mine)
    if kind == "replicated":
        head.average_gradients()

    W = init_rows(0, C, D, 0).double().requires_grad_()
    x_ref = x.clone().requires_grad_()
    ref = shardfc.reference_loss(x_ref, W, y, margin, label_smoothing=0.1, reduction=reduction)
    ref.backward(upstream / world if reduction == "none" else torch.tensor(1.3, dtype=F64))
    if kind == "naive":
        weights = [(w.grad, W.grad[r.start : r.stop]) for w, r in zip(head.shard_weights, head.shard_ranges)]
    else:
        weights = [(head.weight.grad, W.grad)]
    return {
        "loss": cases._rel(loss.detach(), (ref[lo:hi] if reduction == "none" else ref).detach()),
        "loss_shape": tuple(loss.shape) == ((hi - lo,) if reduction == "none" else ()),
        "grad_embeddings": cases._rel(xr.grad, world * x_ref.grad[lo:hi]),
        "grad_weight": max(cases._rel(mine_, ref_) for mine_, ref_ in weights),
        "shards": len(weights),
    }


def _assert_exact(results: list, shards: int = 1) -> None:
    for rank, res in enumerate(results):
        assert res["loss_shape"] and res["shards"] == shards, (rank, res)
        for key in ("loss", "grad_embeddings", "grad_weight"):
            assert res[key] < TOL, f"rank {rank}: {key} rel err {res[key]:.3g}"


REDUCTIONS = {"naive": ["mean", "sum"], "replicated": ["mean", "sum", "none"]}
KINDS_AND_REDUCTIONS = [(kind, red) for kind, reds in REDUCTIONS.items() for red in reds]


LABELS = ["some_ignored", "all_ignored", "one_valid"]


@pytest.mark.parametrize("margin", ["arcface", "cosface"])
@pytest.mark.parametrize("labels", LABELS)
@pytest.mark.parametrize("kind, reduction", KINDS_AND_REDUCTIONS)
def test_one_process_equals_the_reference(kind, reduction, labels, margin):
    _assert_exact([_against_reference(0, 1, kind, reduction, labels, margin=margin)])


def test_the_defaults_are_the_references():
    """No label smoothing, -1 ignored, the mean, ArcFace: as ``reference_loss`` and ``ShardedMarginHead``."""
    x, y, _ = cases._global_data(7, ignore=True)
    ref = shardfc.reference_loss(x.float(), init_rows(0, C, D, 0), y, shardfc.margins.ArcFace())
    for head in (ReplicatedHead(D, C), NaiveParallelHead(D, C)):
        assert torch.allclose(head(x.float(), y), ref, rtol=1e-5, atol=0), type(head).__name__


@pytest.mark.parametrize("reduction", REDUCTIONS["naive"])
def test_the_naive_head_over_devices_of_one_process_equals_the_reference(reduction):
    """Device 0 holds the [B, C] logits: each device's shard of the weight gets its rows' gradient."""
    _assert_exact([_against_reference(0, 1, "naive", reduction, devices=["cpu"] * 3)], shards=3)


@cases.THREAD_WORLDS
@pytest.mark.parametrize("labels", LABELS)
@pytest.mark.parametrize("kind, reduction", KINDS_AND_REDUCTIONS)
def test_ranks_with_unequal_and_empty_batches_equal_the_reference(world, kind, reduction, labels):
    _assert_exact(TorchThreadWorld(world).results(lambda rank: _against_reference(rank, world, kind, reduction, labels)))


@pytest.mark.parametrize("kind, reduction", KINDS_AND_REDUCTIONS)
def test_a_subgroup_of_ranks_is_the_heads_world(kind, reduction):
    """``group=`` ranks 1 and 2 of 3: rank 1 is the group's root, and rank 0 takes no part (a collective
    over the whole world would wait for it)."""

    def rank_main(rank):
        sub = dist.new_group([1, 2])  # every rank takes part in making it
        if rank == 0:
            return None
        return _against_reference(dist.get_rank(sub), 2, kind, reduction, group=sub)

    outside, *members = TorchThreadWorld(3, timeout=15.0).results(rank_main)
    assert outside is None
    _assert_exact(members)


@cases.THREAD_WORLDS
def test_the_naive_heads_low_precision_loss_over_thread_ranks(world):
    results = TorchThreadWorld(world).results(lambda rank: {"naive_low_precision": cases._naive_low_precision_case(rank, world)})
    cases.test_the_naive_heads_low_precision_loss_is_fp32_and_the_same_on_every_rank((world, results))


@pytest.mark.parametrize("kwargs, message", [
    ({"chunk_size": 4}, "NaiveParallelHead does not support chunk_size=4"),
    ({"sample_rate": 0.5}, "NaiveParallelHead does not support sample_rate=0.5"),
    ({"reduction": "none"}, "NaiveParallelHead supports reduction 'mean' or 'sum', got 'none'"),
])
def test_the_naive_head_refuses_what_it_cannot_do(kwargs, message):
    with pytest.raises(ValueError) as info:
        NaiveParallelHead(D, C, **kwargs)
    assert str(info.value) == message
    # what it can do: the defaults spelt out
    assert NaiveParallelHead(D, C, chunk_size=None, sample_rate=1.0, reduction="sum").reduction == "sum"


def test_the_replicated_head_refuses_an_unknown_reduction():
    with pytest.raises(ValueError) as info:
        ReplicatedHead(D, C, reduction="avg")
    assert str(info.value) == "reduction must be 'mean', 'sum' or 'none', got 'avg'"
    with pytest.raises(ValueError) as info:
        ReplicatedHead(D, C, init_seed=-1)  # drew the rows of seed 2**64 - 1
    assert str(info.value) == "init_seed must be an int in [0, 2**63 - 1], got -1"


@pytest.mark.parametrize("kwargs, message", [
    (dict(label_smoothing=1.0), "label_smoothing must be in [0, 1), got 1.0"),  # ignored the labels
    (dict(label_smoothing=-0.1), "label_smoothing must be in [0, 1), got -0.1"),
    (dict(embedding_dim=0), "embedding_dim must be a positive integer, got 0"),
    (dict(num_classes=2.5), "num_classes must be a positive integer, got 2.5"),
])
def test_the_replicated_head_takes_the_sharded_heads_checks(kwargs, message):
    args = dict(embedding_dim=D, num_classes=C) | kwargs
    with pytest.raises(ValueError) as e:
        ReplicatedHead(**args)
    assert str(e.value) == message


def test_the_replicated_head_holds_every_class_and_averages_nothing_alone():
    head = ReplicatedHead(D, C, margin=cases.MARGINS["cosface"], init_seed=5, dtype=F64)
    assert head.weight.shape == (C, D) and head.weight.dtype == F64
    assert torch.equal(head.weight.detach(), init_rows(0, C, D, 5).double())
    assert head.margin is cases.MARGINS["cosface"]
    assert type(ReplicatedHead(D, C).margin).__name__ == "ArcFace"
    head.average_gradients()  # no gradient yet: nothing to do
    assert head.weight.grad is None
    head.weight.grad = torch.ones_like(head.weight)
    head.average_gradients()  # one process: the gradient as it is
    assert torch.equal(head.weight.grad, torch.ones_like(head.weight))
