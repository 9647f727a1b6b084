"""A 4-stage pipeline run (iresnet18 over 4 ranks, one replica) saves per stage, is killed while saving,
resumes bit for bit, evaluates through its stages as the unsplit model does, and exports.

The kill leaves what a save killed after its first stage files leaves on disk (the protocol itself
is killed mid-save in tests/checkpoint/test_stages.py): a scratch folder with some stage files and
no ``meta.json``, and no ``step_*`` folder for that step.
"""

from __future__ import annotations

import dataclasses
import shutil
import warnings
from pathlib import Path

import pytest
import torch

from shardfc.checkpoint import read_stage_state, verify_checkpoint
from shardfc.cli import export as cli_export
from shardfc.cli import train as train_cli
from shardfc.evaluation import evaluate_verification
from shardfc.train.checkpointing.artifacts import load_backbone
from shardfc.train.observe.evaluate import LazyPairs

from ..tiny import tiny_config


def _tensors(value, prefix=""):
    """Every tensor under ``value`` (a checkpoint file's content), by its path."""
    if isinstance(value, torch.Tensor):
        return {prefix: value}
    if isinstance(value, dict):
        return {k: t for key, v in value.items() for k, t in _tensors(v, f"{prefix}/{key}").items()}
    if isinstance(value, (list, tuple)):
        return {k: t for i, v in enumerate(value) for k, t in _tensors(v, f"{prefix}/{i}").items()}
    return {}


def _saved(step_dir: Path) -> dict:
    return {f"{p.name}{k}": t for p in sorted(step_dir.glob("*.pt"))
            for k, t in _tensors(torch.load(p, weights_only=True)).items()}


def test_four_stages_save_killed_resume_evaluate_export(tmp_path):
    cfg = tiny_config(
        tmp_path / "whole", backbone="iresnet18", image_size=[112, 112], embedding_dim=16, strategy="pipeline",
        nproc=4, pipeline_stages=4, pipeline_schedule="gpipe", micro_batches=2, micro_batch_stats=True, batch_size=4,
        grad_accum=1, max_steps=2, warmup_steps=1, ckpt_every=1, eval_every=0, log_every=1,
        synthetic_identities=8, synthetic_images_per_identity=2, synthetic_val_pairs=20, eval_batch_size=8,
        eval_flip=False,
    )
    whole = train_cli.run(cfg)
    saved = Path(cfg.output_dir) / "checkpoints"
    meta = verify_checkpoint(saved / "step_00000002")
    assert sorted(meta["backbone_stages"]["files"]) == [f"backbone_stage{i}.pt" for i in range(4)]

    # killed while saving step 2: two stage files written into the scratch folder, nothing published
    out = tmp_path / "killed"
    shutil.copytree(saved / "step_00000001", out / "checkpoints" / "step_00000001")
    scratch = out / "checkpoints" / ".tmp-step_00000002-0123456789abcdef"
    scratch.mkdir()
    for name in ("common.pt", "backbone_stage0.pt", "backbone_stage1.pt"):
        shutil.copy(saved / "step_00000002" / name, scratch / name)
    resumed = train_cli.run(dataclasses.replace(cfg, output_dir=str(out), resume="auto"))
    assert not scratch.exists()  # the next complete save removed the leftover

    mine, theirs = _saved(out / "checkpoints" / "step_00000002"), _saved(saved / "step_00000002")
    assert mine.keys() == theirs.keys()
    differ = [k for k in theirs if not torch.equal(mine[k], theirs[k])]
    assert not differ, f"the resumed run differs from the uninterrupted one in {differ[:5]}"
    # evaluated through the stages after the same training: the same metrics (repr: tar@far is nan here)
    assert repr(resumed["metrics"]) == repr(whole["metrics"])

    # the unsplit model, assembled from the stage files one at a time: their weights, exactly, and the
    # metrics the pipeline computed
    model = load_backbone(out).model
    stage_files, _ = read_stage_state(out / "checkpoints" / "step_00000002", meta)
    assert all(torch.equal(v, stage_files[k]) for k, v in model.state_dict().items())
    images_a, images_b, issame = LazyPairs(cfg, (112, 112), cfg.synthetic_val_pairs).get()
    unsplit = evaluate_verification(model, (images_a, images_b), issame, batch_size=8, flip=cfg.eval_flip)
    for key, value in whole["metrics"]["synthetic"].items():
        assert unsplit[key] == pytest.approx(value, rel=1e-4, abs=1e-5, nan_ok=True), key
    assert cli_export.main(["--checkpoint", str(out), "--out", str(tmp_path / "model.pt")]) == 0
    with warnings.catch_warnings(), torch.no_grad():
        warnings.simplefilter("ignore", DeprecationWarning)  # torch.jit.load
        torch.testing.assert_close(torch.jit.load(str(tmp_path / "model.pt"))(images_a[:2]), model(images_a[:2]))
