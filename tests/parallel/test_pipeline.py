"""Multi-process pipelining (stages x replicas, gloo): loss and gradients equal the dense single-process step."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from shardfc.head import ShardedMarginHead
from shardfc.head.margins import ArcFace
from shardfc.head.module import init_rows
from shardfc.head.reference import reference_loss
from shardfc.models import build_backbone
from shardfc.parallel.collectives import count_comm
from shardfc.parallel.context import DistContext
from shardfc.parallel.launch import spawn
from shardfc.parallel.model_split import stages as cut_stages
from shardfc.parallel.pipeline import (
    PipelineLayout,
    PipelineRunner,
    activation_specs,
    average_gradients_,
    balanced_split_points,
    chained_activation_specs,
    create_layout,
    replicas_for,
)

DIM, CLASSES, SEED = 8, 7, 3  # 7 classes over 2 head shards: unequal shards


def _backbone() -> nn.Module:
    torch.manual_seed(SEED)
    # eval-mode BatchNorm (running statistics): rows do not couple, so micro-batching is exact
    return build_backbone("tiny", DIM, input_size=(8, 8), width=4).double().eval()


def _data(replicas: int, local: int):
    g = torch.Generator().manual_seed(11)
    images = torch.randn(replicas * local, 3, 8, 8, generator=g, dtype=torch.float64)
    labels = torch.randint(0, CLASSES, (replicas * local,), generator=g)
    labels[: local] = 0  # replica 0's labels all in the first shard
    return images, labels


def _worker(rank: int, world: int, stages: int, micro: int, local: int):
    layout = create_layout(DistContext.resolve(), stages, 1)
    return {schedule: _one_step(layout, schedule, micro, local) for schedule in ("gpipe", "1f1b")}


def _one_step(layout, schedule: str, micro: int, local: int):
    images, labels = _data(layout.replicas, local)
    parts = cut_stages(_backbone(), ["body"])
    specs = activation_specs(parts, images[:2])
    mine = parts[layout.stage]
    rows = slice(layout.replica * local, (layout.replica + 1) * local)
    head = None
    if layout.is_last:
        head = ShardedMarginHead(DIM, CLASSES, margin=ArcFace(), init_seed=SEED, dtype=torch.float64,
                                 context=layout.replica_ctx)

    def loss_fn(emb, y):  # called on the last stage only
        return head(emb, y) / micro

    runner = PipelineRunner(mine, layout, torch.device("cpu"), schedule=schedule, micro_batches=micro,
                            local_batch=local, specs=(specs[layout.stage], specs[layout.stage + 1]), loss_fn=loss_fn)
    with count_comm() as counter:
        loss = runner.step(images[rows], labels[rows])
    average_gradients_(list(mine.parameters()), layout.replica_ctx)
    out = {"stage": layout.stage, "grads": {n: p.grad.clone() for n, p in mine.named_parameters()},
           "sent": {k: v for k, v in counter.bytes.items() if k.startswith("pipeline_")},
           "boundary_bytes": local * math.prod(specs[1][0]) * 8}
    if head is not None:
        out.update(loss=loss, head_grad=head.weight.grad.clone(), rows=head.class_range)
    return out


def _reference(replicas: int, local: int):
    model = _backbone()
    images, labels = _data(replicas, local)
    weight = init_rows(0, CLASSES, DIM, SEED).double().requires_grad_()
    loss = reference_loss(model(images), weight, labels, ArcFace())
    loss.backward()
    return loss.detach(), {n: p.grad for n, p in model.named_parameters()}, weight.grad


@pytest.mark.parametrize("replicas", [2, 1])
def test_pipeline_step_equals_dense_reference(replicas):
    """2 stages x ``replicas``; GPipe and 1F1B each from the same initial weights."""
    local, micro = 6, 3  # 3 micro-batches of 2 rows per replica
    results = spawn(_worker, 2 * replicas, 2, micro, local, backend="gloo", timeout_s=240)
    loss, grads, head_grad = _reference(replicas, local)
    for schedule in ("gpipe", "1f1b"):
        _check(schedule, [r[schedule] for r in results], loss, grads, head_grad)
        # The stage-to-stage traffic is counted where it is sent: the first stage sends its output
        # activation (local rows x the boundary's shape, float64), the last its gradient, per step.
        for r in results:
            out = r[schedule]
            kind = "pipeline_activations" if out["stage"] == 0 else "pipeline_activation_grads"
            assert out["sent"] == {kind: out["boundary_bytes"]}, (schedule, out["stage"], out["sent"])


def _check(schedule, results, loss, grads, head_grad):
    seen = set()
    for out in results:
        for name, g in out["grads"].items():
            torch.testing.assert_close(g, grads[name], rtol=1e-9, atol=1e-12)
            seen.add(name)
        if "loss" in out:
            torch.testing.assert_close(out["loss"], loss, rtol=1e-12, atol=1e-12)
            torch.testing.assert_close(out["head_grad"], head_grad[out["rows"].start : out["rows"].stop],
                                       rtol=1e-9, atol=1e-12)
    assert seen == set(grads)  # every backbone parameter was checked on some stage


def _bn_worker(rank: int, world: int):
    layout = create_layout(DistContext.resolve(), 2, 1)
    images, labels = _data(1, 4)
    parts = cut_stages(_backbone().train(), ["body"])  # training-mode BatchNorm in both stages
    specs = activation_specs(parts, images[:2])
    runner = PipelineRunner(parts[layout.stage], layout, torch.device("cpu"), schedule="gpipe", micro_batches=2,
                            local_batch=4, specs=(specs[layout.stage], specs[layout.stage + 1]),
                            loss_fn=(lambda e, y: e.sum()) if layout.is_last else None)
    try:
        runner.step(images, labels)
    except RuntimeError as e:
        return str(e)
    return None


def test_batch_statistics_with_micro_batches_raise_on_every_rank():
    for msg in spawn(_bn_worker, 2, backend="gloo", timeout_s=120):
        assert msg is not None and "normalises with batch statistics" in msg and "micro_batches=2" in msg


def test_batch_not_divisible_by_micro_batches_is_a_clear_error():
    layout = PipelineLayout(2, 1, 0, 0, None, DistContext(), DistContext())
    spec = ((3, 8, 8), torch.float64)
    with pytest.raises(ValueError, match="local batch of 6 rows is not divisible by micro_batches=4"):
        PipelineRunner(nn.Identity(), layout, torch.device("cpu"), schedule="gpipe", micro_batches=4,
                       local_batch=6, specs=(spec, spec))
    with pytest.raises(ValueError, match="'1f1b' needs micro_batches >= pipeline_stages"):
        PipelineRunner(nn.Identity(), layout, torch.device("cpu"), schedule="1f1b", micro_batches=1,
                       local_batch=6, specs=(spec, spec))
    with pytest.raises(ValueError, match="pipeline_schedule must be one of gpipe, 1f1b, got 'zb'"):
        PipelineRunner(nn.Identity(), layout, torch.device("cpu"), schedule="zb", micro_batches=1,
                       local_batch=6, specs=(spec, spec))


def test_layout_errors_name_the_values():
    with pytest.raises(ValueError, match="world size 3 is not divisible by pipeline_stages=2"):
        replicas_for(3, 2)
    with pytest.raises(ValueError, match="pipeline_stages=3 but the backbone has 1 split point"):
        replicas_for(6, 3, 1)
    with pytest.raises(ValueError, match="pipeline_stages must be >= 2"):
        replicas_for(4, 1)
    with pytest.raises(ValueError, match="pipeline_stages=3 but the backbone has 1 split point"):
        balanced_split_points(_backbone(), 3)


def test_balanced_split_points_minimise_the_largest_stage():
    def linear(n):  # n + 1 parameters
        return nn.Linear(n, 1)

    model = nn.Sequential(linear(9), linear(9), linear(9), linear(29))  # 10, 10, 10, 30
    assert balanced_split_points(model, 2) == ["2"]  # 30 | 30
    assert balanced_split_points(model, 3) == ["0", "2"]  # 10 | 20 | 30 (ties: earliest cuts)
    assert balanced_split_points(_backbone(), 2) == ["body"]


def _probe_worker(rank: int, world: int):
    layout = create_layout(DistContext.resolve(), 2, 1)
    module = nn.Identity() if layout.stage == 0 else nn.Linear(3, 2)  # stage 1 cannot take stage 0's 5 features
    try:
        chained_activation_specs(module, layout, ((5,), torch.float32), torch.device("cpu"))
    except RuntimeError as e:
        return str(e)
    return None


def test_a_stage_that_fails_on_its_input_is_an_error_on_every_rank():
    # each rank holds only its stage, so the shapes are probed along the pipeline: a failure must
    # reach every rank (no rank left waiting for the next stage's shape)
    errors = spawn(_probe_worker, 2, backend="gloo", timeout_s=120)
    assert all(e is not None and e.startswith("pipeline stage 1 fails on an input of shape [2, 5] (torch.float32): "
                                              "RuntimeError: mat1 and mat2 shapes cannot be multiplied") for e in errors), errors
