"""Evaluation through the pipeline's stages (``evaluate_through_pipeline``): an evaluation that fails
on stage 0 still sends the other stages their stop message."""

from __future__ import annotations

import contextlib
import dataclasses
from types import SimpleNamespace

import pytest

from shardfc.parallel import pipeline_forward
from shardfc.train.builder.pipeline_train import evaluate_through_pipeline


def test_a_failed_evaluation_on_stage_0_still_stops_the_other_stages(monkeypatch):
    # PipelinedForward.close broadcasts the stop that ends the other stages' serve_forward
    # (tests/parallel/test_pipeline_forward.py): without it they would wait for the next batch
    # until the process group's timeout.
    closed = []

    class Forward:
        def __init__(self, stage, layout, specs, device, micro_batches):
            self.stage = stage

        def close(self):
            closed.append(self.stage)

    monkeypatch.setattr(pipeline_forward, "PipelinedForward", Forward)
    layout = SimpleNamespace(replica=0, stage=0)
    run = SimpleNamespace(pipeline=SimpleNamespace(layout=layout, specs=[], runner=SimpleNamespace(micro_batches=2)),
                          ctx=SimpleNamespace(device="cpu"), parts=SimpleNamespace(backbone="stage 0"))

    def evaluate(backbone):
        assert isinstance(backbone, Forward)
        raise RuntimeError("the evaluation failed")

    with pytest.raises(RuntimeError, match="the evaluation failed"):
        evaluate_through_pipeline(run, evaluate, contextlib.nullcontext)
    assert closed == ["stage 0"]
    assert evaluate_through_pipeline(run, lambda backbone: {"acc": 1.0}, contextlib.nullcontext) == {"acc": 1.0}
    assert closed == ["stage 0"] * 2


def test_the_other_stages_serve_and_the_other_replicas_return_at_once(monkeypatch):
    """Replica 0's first stage evaluates through a PipelinedForward of the run's own stage, specs,
    device and micro-batches; its other stages serve that forward; other replicas do nothing."""
    calls = []

    class Forward:
        def __init__(self, *args):
            calls.append(("forward", *args))

        def close(self):
            calls.append("close")

    monkeypatch.setattr(pipeline_forward, "PipelinedForward", Forward)
    monkeypatch.setattr(pipeline_forward, "serve_forward", lambda *args: calls.append(("serve", *args)))
    autocast = contextlib.nullcontext

    def run_at(replica, stage):
        layout = SimpleNamespace(replica=replica, stage=stage)
        return SimpleNamespace(pipeline=SimpleNamespace(layout=layout, specs="specs", runner=SimpleNamespace(micro_batches=3)),
                               ctx=SimpleNamespace(device="cpu"), parts=SimpleNamespace(backbone=f"stage {stage}"))

    run = run_at(1, 0)
    assert evaluate_through_pipeline(run, lambda backbone: pytest.fail("another replica evaluated"), autocast) == {}
    assert calls == []
    run = run_at(0, 1)
    assert evaluate_through_pipeline(run, lambda backbone: pytest.fail("stage 1 evaluated"), autocast) == {}
    assert calls == [("serve", "stage 1", run.pipeline.layout, "specs", "cpu", 3, autocast)]
    calls.clear()
    run = run_at(0, 0)
    assert evaluate_through_pipeline(run, lambda backbone: {"acc": 1.0}, autocast) == {"acc": 1.0}
    assert calls == [("forward", "stage 0", run.pipeline.layout, "specs", "cpu", 3), "close"]


def test_a_pipeline_layout_is_checked_before_any_process_starts():
    """``check_pipeline_config``: the backbone's split points counted on the meta device, a split point
    it lacks refused naming the layout, and BatchNorm over several micro-batches refused in full unless
    --micro-batch-stats."""
    from shardfc.models import build_backbone
    from shardfc.parallel.model_split import available_split_points
    from shardfc.train.builder.pipeline_train import check_pipeline_config
    from shardfc.train.config import ConfigError, TrainConfig

    cfg = TrainConfig(strategy="pipeline", pipeline_stages=2, micro_batches=2, micro_batch_stats=True, batch_size=8)
    points = available_split_points(build_backbone("tiny", cfg.embedding_dim), blocks=True)
    assert check_pipeline_config(cfg, 2) == len(points) >= 1
    assert check_pipeline_config(dataclasses.replace(cfg, split_points=[points[0]]), 2) == len(points)
    with pytest.raises(ConfigError, match=r"^strategy='pipeline' on 2 rank\(s\) with backbone='tiny': "):
        check_pipeline_config(dataclasses.replace(cfg, split_points=["no.such.layer"]), 2)
    stages = len(points) + 2  # more stages than the backbone has cuts for
    with pytest.raises(ConfigError, match=rf"^strategy='pipeline' on {stages} rank\(s\) with backbone='tiny': "):
        check_pipeline_config(dataclasses.replace(cfg, pipeline_stages=stages), stages)
    with pytest.raises(ConfigError) as err:
        check_pipeline_config(dataclasses.replace(cfg, micro_batch_stats=False), 2)
    assert str(err.value) == (
        "backbone='tiny' has BatchNorm ('body.1'), which in training normalises each of the micro_batches=2 "
        "micro-batches with its own statistics, unlike an unpipelined step of batch_size rows: pass "
        "--micro-batch-stats to accept that (the semantics of --grad-accum over micro-batches), or "
        "--micro-batches 1 --pipeline-schedule gpipe")
    assert check_pipeline_config(dataclasses.replace(cfg, micro_batch_stats=False, micro_batches=1), 2) == len(points)
