"""Evaluation through the pipeline's stages (``evaluate_through_pipeline``): an evaluation that fails
on stage 0 still sends the other stages their stop message."""

from __future__ import annotations

import contextlib
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
