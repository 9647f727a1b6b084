"""``shardfc train --strategy pipeline``: the ddp loss curve, per-stage checkpoints that resume
under pipeline and ddp (and ddp's under pipeline), evaluation through the stages, clear errors.

Processes: a 2-rank ddp run, a 2 stages x 2 replicas pipeline run of the same training, a ddp run
resumed from the pipeline's step-3 checkpoint and a pipeline run resumed from it.

The equivalence: the pipeline cuts each replica's batch of 8 into 2 micro-batches of 4, which the
tiny backbone's BatchNorm normalises one at a time (--micro-batch-stats); that is exactly ddp with
batches of 4 and --grad-accum 2 (the same rows, in the same order, with drop_last on both).
"""

from __future__ import annotations

import csv
import dataclasses
import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from shardfc.cli import train as train_cli
from shardfc.train.builder.strategy import check_launch
from shardfc.train.config import ConfigError, parse_config

from ..tiny import STEPS, tiny_config

RTOL = 1e-4


def _losses(out) -> dict:
    rows = csv.DictReader(open(Path(out) / "metrics.csv"))
    return {int(r["step"]): float(r["value"]) for r in rows if r["name"] == "train/loss"}


def _common(ckpt: Path) -> dict:
    return torch.load(ckpt / "common.pt", weights_only=True)


def _head(ckpt: Path) -> torch.Tensor:
    files = sorted(ckpt.glob("head_*.pt"), key=lambda p: int(p.stem.split("_")[1]))
    return torch.cat([torch.load(p, weights_only=True)["tensors"]["weight"] for p in files])


@pytest.fixture(scope="module")
def ddp_and_pipeline(tmp_path_factory):
    root = tmp_path_factory.mktemp("pipeline")
    # grad_clip that bites: the backbone's norm is summed over the stages, the head's over its ranks
    common = dict(log_every=1, drop_last=True, grad_clip=0.5, head_grad_clip=0.5)
    ddp = tiny_config(root / "ddp", batch_size=4, grad_accum=2, **common)
    pipe = tiny_config(root / "pipe", strategy="pipeline", nproc=4, pipeline_stages=2, micro_batches=2,
                       micro_batch_stats=True, batch_size=8, grad_accum=1, profile=True, **common)
    return ddp, train_cli.run(ddp), pipe, train_cli.run(pipe)


def test_pipeline_trains_the_ddp_curve(ddp_and_pipeline):
    ddp, ddp_summary, pipe, pipe_summary = ddp_and_pipeline
    a, b = _losses(ddp.output_dir), _losses(pipe.output_dir)
    assert sorted(b) == list(range(1, STEPS + 1)) and a[STEPS] < a[1]
    np.testing.assert_allclose([b[s] for s in sorted(a)], [a[s] for s in sorted(a)], rtol=RTOL)
    # evaluated through the stages (forward only, micro-batched): the unsplit model's metrics
    assert pipe_summary["metrics"]["synthetic"]["accuracy"] == pytest.approx(ddp_summary["metrics"]["synthetic"]["accuracy"])
    log = (Path(pipe.output_dir) / "train.log").read_text()
    assert "pipeline: 2 stages x 2 replicas, cut after body; 1f1b schedule over 2 micro-batches" in log


def test_pipeline_profile_counts_the_stage_to_stage_traffic(ddp_and_pipeline):
    _, _, pipe, _ = ddp_and_pipeline
    from shardfc.models import build_backbone
    from shardfc.train.observe.profile import profile_path

    body = build_backbone("tiny", 16, input_size=(16, 16)).body
    boundary = 8 * body(torch.zeros(1, 3, 16, 16)).numel() * 4  # a replica's 8 rows at the cut, fp32
    for rank in range(4):
        p = json.loads(profile_path(pipe.output_dir, rank).read_text())
        assert p["backbone_traffic_counted"] is True
        sent = "pipeline_activations" if rank // 2 == 0 else "pipeline_activation_grads"  # stage-major ranks
        other = "pipeline_activation_grads" if sent == "pipeline_activations" else "pipeline_activations"
        assert len(p["comm_bytes_by_kind_per_step"]) == STEPS
        for step, kinds in enumerate(p["comm_bytes_by_kind_per_step"]):
            assert kinds[sent] == boundary and other not in kinds, (rank, step, kinds)
            # decode once: the first stage sends its batch's 8 int64 labels to the last, nothing else does
            assert kinds.get("pipeline_labels") == (8 * 8 if sent == "pipeline_activations" else None), (rank, kinds)
            assert p["comm_bytes"][step] == sum(kinds.values())
        # the first stage's batches are waited for and copied inside the schedule, but charged apart
        # (after the first step: --profile loads the first batch before the loop, as start-up)
        for phases in p["step_phases_s"][1:]:
            assert "pipeline schedule" in phases and "optimizer" in phases
            assert ({"loader wait", "h2d"} <= set(phases)) == (sent == "pipeline_activations"), (rank, phases)


def test_pipeline_checkpoint_is_saved_per_stage(ddp_and_pipeline):
    from shardfc.checkpoint import optimizer_by_index, read_stage_state, verify_checkpoint

    ddp, _, pipe, _ = ddp_and_pipeline
    for step in ("step_00000003", "step_00000006"):
        mine, theirs = (Path(c.output_dir) / "checkpoints" / step for c in (pipe, ddp))
        meta = verify_checkpoint(mine)
        # each stage's replica 0 wrote its part; the common file holds no backbone
        assert sorted(meta["backbone_stages"]["files"]) == ["backbone_stage0.pt", "backbone_stage1.pt"]
        a, b = _common(mine), _common(theirs)
        assert "backbone" not in a and "backbone_optimizer" not in a
        model, by_name = read_stage_state(mine, meta)  # assembled as the unsplit model reads it
        assert list(model) == list(b["backbone"])  # every key, in the unsplit model's order
        for key, value in b["backbone"].items():
            torch.testing.assert_close(model[key], value, rtol=RTOL, atol=1e-6, msg=key)
        opt_a, opt_b = optimizer_by_index(by_name, meta["backbone_stages"]["params"]), b["backbone_optimizer"]
        assert opt_a["param_groups"][0]["params"] == opt_b["param_groups"][0]["params"]
        assert sorted(opt_a["state"]) == sorted(opt_b["state"])
        for i, s in opt_b["state"].items():
            torch.testing.assert_close(opt_a["state"][i]["momentum_buffer"], s["momentum_buffer"], rtol=RTOL, atol=1e-5)
        torch.testing.assert_close(_head(mine), _head(theirs), rtol=RTOL, atol=1e-6)
        assert a["world_size"] == 2  # the data-parallel width, as ddp's 2 ranks


@pytest.mark.parametrize("saved_by, resumed_by", [("pipeline", "ddp"), ("pipeline", "pipeline"), ("ddp", "pipeline")])
def test_checkpoints_resume_across_strategies(ddp_and_pipeline, saved_by, resumed_by, tmp_path):
    ddp, _, pipe, _ = ddp_and_pipeline
    source, base = (ddp if saved_by == "ddp" else pipe), (ddp if resumed_by == "ddp" else pipe)
    out = tmp_path / "resumed"
    shutil.copytree(Path(source.output_dir) / "checkpoints" / "step_00000003", out / "checkpoints" / "step_00000003")
    resumed = dataclasses.replace(base, output_dir=str(out), resume=str(out / "checkpoints" / "step_00000003"))
    train_cli.run(resumed)
    again, uninterrupted = _losses(out), _losses(ddp.output_dir)
    assert sorted(again) == [4, 5, 6]
    np.testing.assert_allclose([again[s] for s in (4, 5, 6)], [uninterrupted[s] for s in (4, 5, 6)], rtol=RTOL)


def test_pipeline_flags_and_errors(tmp_path):
    cfg, _ = parse_config(["--strategy", "pipeline", "--pipeline-stages", "2", "--pipeline-schedule", "gpipe",
                           "--micro-batches", "4", "--split-points", "body", "--micro-batch-stats"])
    assert (cfg.strategy, cfg.pipeline_stages, cfg.pipeline_schedule, cfg.micro_batches) == ("pipeline", 2, "gpipe", 4)
    assert cfg.split_points == ["body"] and cfg.micro_batch_stats

    def launch(**kw):
        check_launch(tiny_config(tmp_path, strategy="pipeline", micro_batch_stats=True, **kw).validate())

    with pytest.raises(ConfigError, match="world size 3 is not divisible by pipeline_stages=2"):
        launch(nproc=3)
    with pytest.raises(ConfigError, match="pipeline_stages=3 but the backbone has 1 split point"):
        launch(nproc=6, pipeline_stages=3, micro_batches=4)
    with pytest.raises(ConfigError, match="unknown split point 'bdy'.*did you mean 'body'"):
        launch(nproc=4, split_points=["bdy"])
    with pytest.raises(ConfigError, match=r"BatchNorm \('body.1'\).*--micro-batch-stats"):
        check_launch(tiny_config(tmp_path, strategy="pipeline", nproc=4).validate())
    with pytest.raises(ConfigError, match="batch_size=8 is not divisible by micro_batches=3"):
        tiny_config(tmp_path, strategy="pipeline", micro_batches=3).validate()
    with pytest.raises(ConfigError, match="'1f1b' needs micro_batches >= pipeline_stages, got micro_batches=1"):
        tiny_config(tmp_path, strategy="pipeline", micro_batches=1).validate()
    with pytest.raises(ConfigError, match=r"split_points=\['body', 'pool'\] names 2 cut\(s\), but pipeline_stages=2"):
        tiny_config(tmp_path, strategy="pipeline", split_points=["body", "pool"]).validate()


def test_imprint_under_ddp_then_a_head_only_warm_up_under_pipeline(ddp_and_pipeline, tmp_path):
    """The route the pipeline's imprint refusal names: a 1-step ddp run imprints 6 new identities' rows,
    a 2-stage pipeline run resumes it; its warm-up (to step 3) moves the head and leaves every stage weight
    and BatchNorm statistic as loaded, bit for bit; step 4 trains the backbone."""
    from shardfc.checkpoint import read_stage_state, verify_checkpoint

    ddp, _, _, _ = ddp_and_pipeline
    out = tmp_path / "ft"
    with pytest.raises(ConfigError, match=r"head_init='imprint'.*--strategy ddp.*then --resume that run with "
                                          r"--strategy pipeline"):
        tiny_config(out, strategy="pipeline", micro_batch_stats=True, head_init="imprint").validate()
    imprinted = train_cli.run(tiny_config(out, nproc=1, init_from=ddp.output_dir, head_init="imprint",
                                          synthetic_identities=30, head_warmup_steps=1, max_steps=1, eval_every=0,
                                          ckpt_every=0))
    loaded = _common(Path(ddp.output_dir) / "checkpoints" / "step_00000006")["backbone"]
    pipe = tiny_config(out, strategy="pipeline", nproc=2, pipeline_stages=2, micro_batches=2, micro_batch_stats=True,
                       synthetic_identities=30, head_warmup_steps=3, max_steps=4, ckpt_every=3, eval_every=0,
                       drop_last=True, resume=imprinted["checkpoint"])
    train_cli.run(pipe)

    def backbone(step: int) -> dict:
        path = out / "checkpoints" / f"step_{step:08d}"
        return read_stage_state(path, verify_checkpoint(path))[0]

    warmed, trained = backbone(3), backbone(4)
    assert list(warmed) == list(loaded)
    for key, value in loaded.items():  # weights, running statistics, num_batches_tracked
        assert torch.equal(warmed[key], value), key
    assert not torch.equal(_head(out / "checkpoints" / "step_00000003"), _head(Path(imprinted["checkpoint"])))
    assert not torch.equal(trained["body.0.weight"], loaded["body.0.weight"])
    assert not torch.equal(trained["body.1.running_mean"], loaded["body.1.running_mean"])
