"""``shardfc train --profile``: per-process step times, samples, counted traffic and peak memory."""

from __future__ import annotations

import csv
import dataclasses
import json
from pathlib import Path

import pytest
import torch

from shardfc.cli import train as train_cli
from shardfc.models import build_backbone
from shardfc.parallel.collectives import count_comm
from shardfc.train.config import TrainConfig
from shardfc.train.observe.profile import StepProfiler, count_horovod_gradients, profile_path

from ..tiny import STEPS, tiny_config

FIELDS = {
    "rank", "world_size", "strategy", "launcher", "device", "amp", "backbone", "step_s", "samples", "comm_bytes",
    "comm_bytes_by_kind", "comm_bytes_by_kind_per_step", "backbone_traffic_counted", "peak_rss_bytes", "cuda_peak_bytes",
    "pid", "startup", "step_phases_s", "memory_phases",
}


def _backbone_bytes(cfg):
    model = build_backbone(cfg.backbone, cfg.embedding_dim, input_size=tuple(cfg.image_size))
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    buffers = sum(b.numel() * b.element_size() for b in model.buffers())
    return params, buffers


def _losses(out):
    with open(out / "metrics.csv") as f:
        return {int(r["step"]): float(r["value"]) for r in csv.DictReader(f) if r["name"] == "train/loss"}


@pytest.fixture(scope="module")
def profiled(tmp_path_factory):
    out = tmp_path_factory.mktemp("profiled")
    cfg = tiny_config(out, profile=True)
    train_cli.run(cfg)
    return cfg, [json.loads(profile_path(out, r).read_text()) for r in range(2)]


def test_profile_counts_ddp_traffic_and_the_samples_of_each_step(profiled):
    cfg, ranks = profiled
    params, buffers = _backbone_bytes(cfg)
    for rank, p in enumerate(ranks):
        assert set(p) == FIELDS
        assert (p["rank"], p["world_size"], p["strategy"], p["launcher"], p["amp"]) == (rank, 2, "ddp", "spawn", "fp32")
        assert len(p["step_s"]) == len(p["comm_bytes"]) == STEPS and min(p["step_s"]) > 0
        # 120 images, 8 per rank per micro-batch, 2 micro-batches per step: step 4 holds the epoch's 4-row batch.
        assert p["samples"] == [32, 32, 32, 24, 32, 32]
        kinds = p["comm_bytes_by_kind"]
        assert kinds["ddp_gradients"] == STEPS * params  # one all-reduce of every gradient per step (no_sync first)
        # rank 0's BN statistics, before a forward that follows a synchronised backward: once per step
        # with 2 micro-batches (DDP skips it after a no_sync() backward)
        assert cfg.grad_accum == 2 and kinds["ddp_buffers"] == STEPS * buffers
        assert kinds["all_gather"] > 0 and kinds["reduce_scatter"] > 0  # the head's
        # Where the start-up went, phase by phase, up to the end of the first step.
        phases = [name for name, _ in p["startup"]["phases"]]
        assert phases == ["process group and threads", "dataset", "sampler", "model, head and optimizers",
                          "evaluation targets", "resume", "first batch", "first step"]
        spent = [s for _, s in p["startup"]["phases"]]
        assert min(spent) >= 0 and p["startup"]["total_s"] == pytest.approx(sum(spent))
        assert p["startup"]["phases"][-1][1] >= p["step_s"][0] * 0.5  # the first step is in it
        assert sum(p["comm_bytes"]) == sum(kinds.values())
        assert p["backbone_traffic_counted"] is True
        assert p["peak_rss_bytes"] > 50 * 2**20 and p["cuda_peak_bytes"] is None
        # each step split into the loop's phases; the optimizer step within it is step_s
        assert len(p["step_phases_s"]) == STEPS
        for phases, step_s in zip(p["step_phases_s"], p["step_s"]):
            assert {"stop agreement", "loader wait", "forward", "head", "backward", "optimizer"} <= set(phases)
            assert sum(phases.values()) >= 0.9 * step_s
        # the peak after each phase: it only grows, up to the process's peak
        memory = p["memory_phases"]
        assert memory["backbone_state_bytes"] == 2 * params + buffers  # weights, BN statistics, momentum
        assert [m["after"] for m in memory["peak_after"]] == [
            "build and resume", "training to step 3", "save at step 3", "evaluation at step 3", "training to step 6",
            "save at step 6", "evaluation at step 6"]
        peaks = [m["peak_rss_bytes"] for m in memory["peak_after"]]
        assert peaks == sorted(peaks) and peaks[-1] <= p["peak_rss_bytes"]
    log = (Path(cfg.output_dir) / "train.log").read_text()
    assert "start-up (to the end of the first step)" in log and "first batch" in log


def test_profile_changes_nothing_the_run_computes(profiled, run2):
    """The counting comm hook runs torch's default all-reduce: the same losses as an unprofiled run."""
    cfg, _ = profiled
    base_cfg, _ = run2
    assert dataclasses.replace(base_cfg, output_dir=cfg.output_dir, profile=True) == cfg
    a, b = _losses(Path(cfg.output_dir)), _losses(Path(base_cfg.output_dir))
    assert sorted(a) == sorted(b) == [2, 4, 6]
    for step in a:
        assert a[step] == pytest.approx(b[step], rel=1e-5)


def test_no_profile_without_the_flag(run2):
    cfg, _ = run2
    assert not cfg.profile
    assert not profile_path(Path(cfg.output_dir), 0).parent.exists()


def test_count_horovod_gradients_counts_the_gradients_present():
    a, b = torch.nn.Parameter(torch.zeros(3)), torch.nn.Parameter(torch.zeros(5))
    c = torch.nn.Parameter(torch.zeros(7, dtype=torch.float64))
    a.grad, c.grad = torch.ones(3), torch.ones(7, dtype=torch.float64)
    opt = torch.optim.SGD([{"params": [a, b]}, {"params": [c]}], lr=0.1)
    with count_comm() as counter:
        count_horovod_gradients(opt)
    assert counter.bytes == {"horovod_gradients": 3 * 4 + 7 * 8}


def test_horovod_profile_counts_the_optimizer_all_reduce(horovodrun, tmp_path):
    out = tmp_path / "hvd"
    args = [
        "-m", "shardfc", "train", "--strategy", "horovod", "--synthetic-identities", "24",
        "--synthetic-images-per-identity", "5", "--image-size", "16", "16", "--embedding-dim", "16",
        "--batch-size", "8", "--max-steps", "3", "--warmup-steps", "1", "--synthetic-val-pairs", "0",
        "--eval-every", "0", "--ckpt-every", "0", "--no-progress", "--profile", "--output-dir", str(out),
    ]
    code, log = horovodrun(2, args, tmp_path / "hvd.log", timeout_s=300)
    assert code == 0, log[-3000:]
    cfg = dataclasses.replace(tiny_config(out), embedding_dim=16)
    params, _ = _backbone_bytes(cfg)
    for rank in range(2):
        p = json.loads(profile_path(out, rank).read_text())
        assert (p["launcher"], p["strategy"], p["world_size"]) == ("horovodrun", "horovod", 2)
        assert p["comm_bytes_by_kind"]["horovod_gradients"] == 3 * params
        assert "ddp_buffers" not in p["comm_bytes_by_kind"]  # Horovod does not broadcast buffers per step


_LAUNCH_ENV = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "HOROVOD_RANK", "OMPI_COMM_WORLD_RANK", "PMI_RANK")


@pytest.mark.parametrize("env, world, launcher", [
    ({}, 1, "one process"),
    ({}, 2, "spawn"),  # ddp or pipeline, started by shardfc train itself
    ({"RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "h", "MASTER_PORT": "1"}, 2, "torchrun"),
    ({"HOROVOD_RANK": "0"}, 2, "horovodrun"),
    ({"OMPI_COMM_WORLD_RANK": "0"}, 2, "horovodrun"),
])
def test_the_profile_says_what_started_the_process(monkeypatch, env, world, launcher):
    for key in _LAUNCH_ENV:
        monkeypatch.delenv(key, raising=False)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    summary = StepProfiler(torch.device("cpu")).summary(
        rank=0, world_size=world, cfg=TrainConfig(strategy="pipeline" if world > 1 else "dp"),
        backbone=torch.nn.Linear(2, 2), amp_dtype=None)
    assert summary["launcher"] == launcher
    assert summary["backbone_traffic_counted"] == (world > 1)  # dp's own copies are not collectives
