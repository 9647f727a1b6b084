"""``shardfc train`` end to end on tiny synthetic data, resume on other world sizes, and bad input.

One 2-process training run (the session fixture ``run2`` in conftest.py) feeds the resume tests;
the other runs train in-process (``nproc=1``) where one process is enough.
"""

from __future__ import annotations

import csv
import dataclasses
import logging
import os
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from shardfc.checkpoint import CheckpointError, find_checkpoints
from shardfc.cli import train as train_cli
from shardfc.head.validation import NonFiniteEmbeddingsError
from shardfc.parallel.context import DistContext
from shardfc.parallel.launch import spawn
from shardfc.train.builder.factory import build_parts, resolve_amp_dtype
from shardfc.train.config import ConfigError, TrainConfig
from shardfc.train.loader.data import ShardBatches
from shardfc.train.loop import _divergence_named, load_parts, train
from shardfc.train.state import RunState
from shardfc.train.step import apply_gradients, clip_head_grad_

from .legacy import as_format_1
from .tiny import STEPS, tiny_config


def _copy_run(cfg: TrainConfig, dest: Path, **overrides) -> TrainConfig:
    shutil.copytree(cfg.output_dir, dest)
    return dataclasses.replace(cfg, output_dir=str(dest), **overrides)


def _saved_head(path: Path, world: int) -> dict:
    """The logical head state exactly as the saving ranks wrote it: their files, concatenated."""
    shards = [torch.load(path / f"head_{r}.pt", weights_only=True)["tensors"] for r in range(world)]
    return {k: torch.cat([s[k] for s in shards]) for k in shards[0]}


# ---------------------------------------------------------------------------- end to end


def test_two_process_run_trains_logs_checkpoints_and_evaluates(run2):
    cfg, summary = run2
    out = Path(cfg.output_dir)
    assert summary["step"] == STEPS
    assert [p.name for p in find_checkpoints(out / "checkpoints")] == ["step_00000003", "step_00000006"]
    assert summary["checkpoint"].endswith("step_00000006")
    acc = summary["metrics"]["synthetic"]["accuracy"]
    rows = list(csv.DictReader(open(out / "metrics.csv")))
    # The summary's accuracy is the final evaluation's, the one logged at the last step.
    logged = [r for r in rows if r["name"] == "val/synthetic/accuracy"]
    assert int(logged[-1]["step"]) == STEPS and float(logged[-1]["value"]) == pytest.approx(acc, abs=1e-9)
    names = {r["name"] for r in rows}
    assert {"train/loss", "train/lr", "train/images_per_s", "val/synthetic/accuracy"} <= names
    assert [int(r["step"]) for r in rows if r["name"] == "train/loss"] == [2, 4, 6]
    log = (out / "train.log").read_text()
    assert "step 6/6" in log and "2 rank(s) on cpu (gloo)" in log
    assert (out / "config.toml").is_file()


def _restore_and_continue(rank: int, world: int, cfg: TrainConfig, ckpt: str) -> dict:
    """Load the checkpoint on this world size, report the logical state, then train 2 more steps."""
    parts, state = load_parts(cfg, Path(ckpt))
    head = parts.head.sharded_state(parts.opt_head)
    # numpy, not tensors: a tensor sent back from a process that then exits cannot be received.
    report = {
        "rows": (head["class_range"].start, head["class_range"].stop),
        "weight": head["tensors"]["weight"].numpy().copy(),
        "momentum": head["tensors"]["optimizer.momentum_buffer"].numpy().copy(),
        "step": state.step,
        "lr": [g["lr"] for g in parts.opt_head.param_groups + parts.opt_backbone.param_groups],
        "backbone": {k: v.numpy().copy() for k, v in parts.module.state_dict().items()},
    }
    del parts
    report["continued"] = train(dataclasses.replace(cfg, max_steps=STEPS + 2, eval_every=0))["step"]
    return report


def _check_restored(reports, saved_dir: Path, saved_lr: float):
    saved = _saved_head(saved_dir, world=2)
    common = torch.load(saved_dir / "common.pt", weights_only=True)
    ranges = [r["rows"] for r in reports]
    assert ranges[0][0] == 0 and ranges[-1][1] == 24 and all(a[1] == b[0] for a, b in zip(ranges, ranges[1:]))
    assert np.array_equal(np.concatenate([r["weight"] for r in reports]), saved["weight"].numpy())
    momentum = np.concatenate([r["momentum"] for r in reports])
    assert np.array_equal(momentum, saved["optimizer.momentum_buffer"].numpy())
    for r in reports:
        assert r["step"] == 3
        assert r["lr"] == pytest.approx([saved_lr, saved_lr])
        assert all(np.array_equal(v, common["backbone"][k].numpy()) for k, v in r["backbone"].items())
        assert r["continued"] == STEPS + 2


def test_resume_on_one_and_three_ranks_restores_the_logical_state(run2, tmp_path):
    cfg, _ = run2
    ckpt = Path(cfg.output_dir) / "checkpoints" / "step_00000003"
    head_extras = torch.load(ckpt / "head_0.pt", weights_only=True)["extras"]
    saved_lr = head_extras["optimizer.param_groups"][0]["lr"]
    assert saved_lr > 0

    # W=2 -> W=1, in this process (no process group): one shard holds every row.
    cfg1 = _copy_run(cfg, tmp_path / "w1", nproc=1, eval_every=0)
    report1 = _restore_and_continue(0, 1, cfg1, str(Path(cfg1.output_dir) / "checkpoints" / "step_00000003"))
    _check_restored([report1], ckpt, saved_lr)

    # W=2 -> W=3: 24 classes become 3 shards of 8.
    cfg3 = _copy_run(cfg, tmp_path / "w3", nproc=3, eval_every=0)
    reports3 = spawn(_restore_and_continue, 3, cfg3, str(Path(cfg3.output_dir) / "checkpoints" / "step_00000003"))
    assert [r["rows"] for r in reports3] == [(0, 8), (8, 16), (16, 24)]
    _check_restored(reports3, ckpt, saved_lr)


def _clip_worker(rank: int, world: int) -> tuple:
    torch.manual_seed(0)
    full = torch.randn(10, 4)
    rows = [(0, 5), (5, 10)][rank]
    head = torch.nn.Linear(4, rows[1] - rows[0], bias=False)
    head.weight.grad = full[rows[0] : rows[1]].clone()
    ctx = DistContext(None, rank, world, True, torch.device("cpu"))
    norm = clip_head_grad_(head, 1.0, ctx)
    return float(norm), head.weight.grad.numpy().copy()


def test_head_gradient_is_clipped_by_its_global_norm():
    results = spawn(_clip_worker, 2)
    torch.manual_seed(0)
    full = torch.randn(10, 4)
    expected = full * (1.0 / (full.norm() + 1e-6))
    assert results[0][0] == pytest.approx(float(full.norm()), rel=1e-6)
    assert np.allclose(np.concatenate([r[1] for r in results]), expected.numpy(), atol=1e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_clipping_the_head_makes_no_copy_of_its_gradient(dtype):
    """The head's gradient is the largest tensor of a step (2 GB at a million classes, D = 512):
    its norm is one reduction, with nothing of the gradient's size allocated (the first H200 run
    measured a 2 GB temporary, ``g.float().pow(2)``, as the trainer step's extra peak)."""
    from shardfc.tools.bench.memory import LiveTensorBytes

    head = torch.nn.Linear(64, 4096, bias=False, dtype=dtype)
    head.weight.grad = torch.randn_like(head.weight)
    expected = float(head.weight.grad.double().norm())
    with LiveTensorBytes() as mode:
        norm = clip_head_grad_(head, 1.0, DistContext())
    assert mode.peak < 1024  # a few scalars, not 1 MiB (fp32) or 0.5 MiB (bf16) of squares
    assert float(norm) == pytest.approx(expected, rel=1e-5)
    assert float(head.weight.grad.double().norm()) == pytest.approx(1.0, rel=1e-2 if dtype == torch.bfloat16 else 1e-5)


def _overflow_worker(rank: int, world: int) -> list:
    """Two fp16-style steps with the loss scaler on: rank 1's head overflows in the first."""
    cfg = TrainConfig(image_size=[16, 16], embedding_dim=8, synthetic_identities=10, warmup_steps=0, max_steps=10)
    ctx = DistContext(None, rank, world, True, torch.device("cpu"))
    torch.manual_seed(0)
    parts = build_parts(cfg, ctx, 10, (16, 16), total_steps=10, amp_dtype=torch.float16)
    out = []
    for poison in (True, False):
        before = [p.detach().clone() for p in (parts.head.weight, *parts.module.parameters())]
        images = torch.randn(4, 3, 16, 16, generator=torch.Generator().manual_seed(rank))
        loss = parts.head(parts.backbone(images), torch.arange(4) + 4 * rank)
        parts.scaler.scale(loss).backward()
        if poison and rank == 1:
            parts.head.weight.grad[0, 0] = float("inf")
        apply_gradients(parts, cfg.grad_clip, ctx)
        after = [parts.head.weight, *parts.module.parameters()]
        out.append((not torch.equal(before[0], after[0]),
                    any(not torch.equal(b, a) for b, a in zip(before[1:], after[1:])),
                    parts.scaler.get_scale()))
        parts.opt_backbone.zero_grad()
        parts.opt_head.zero_grad()
    return out


def test_fp16_overflow_on_one_rank_skips_the_step_on_every_rank():
    results = spawn(_overflow_worker, 2)
    scale = results[0][0][2]
    # Step 1: skipped everywhere, scale halved everywhere; step 2: applied everywhere, same scale.
    assert results[0] == results[1] == [(False, False, scale), (True, True, scale)]


# ---------------------------------------------------------------------------- in-process runs and bad input


def test_fp16_on_cpu_falls_back_to_bf16_with_a_message(tmp_path, caplog, monkeypatch):
    from shardfc.train.builder import cpu

    monkeypatch.setattr(cpu, "bf16_support", lambda: (True, "a CPU with native bf16"))  # see test_cpu_defaults.py
    with caplog.at_level(logging.WARNING, logger="shardfc.train"):
        assert resolve_amp_dtype(TrainConfig(amp="fp16"), torch.device("cpu")) is torch.bfloat16
    assert "using bf16 autocast instead" in caplog.text
    cfg = tiny_config(tmp_path / "fp16", amp="fp16", nproc=1, max_steps=2, grad_accum=1, synthetic_val_pairs=0)
    assert train(cfg)["step"] == 2
    assert "amp='fp16' asked for, but this run is on the CPU" in (tmp_path / "fp16" / "train.log").read_text()


def test_one_unread_checkpoint_setting_is_said_in_the_singular(caplog):
    from shardfc.train.loop import _warn_unread_class_settings

    with caplog.at_level(logging.WARNING, logger="shardfc.train"):
        _warn_unread_class_settings(TrainConfig(head_init="imprint"))
        _warn_unread_class_settings(TrainConfig())  # nothing set: nothing said
    assert [r.getMessage() for r in caplog.records] == [
        "head_init='imprint': read only when the run starts from a checkpoint (--init-from, or a resume); this run "
        "starts fresh, so it is unused"]


def test_a_fresh_run_says_its_checkpoint_settings_go_unread_and_a_resume_reads_them(tmp_path):
    # --resume auto may find a checkpoint or not: the flag parser cannot refuse these, the run says it
    cfg = tiny_config(tmp_path / "run", nproc=1, max_steps=1, grad_accum=1, synthetic_val_pairs=0,
                      head_init="imprint", rename_classes=str(tmp_path / "renames.tsv"))
    assert train(cfg)["step"] == 1
    log = (tmp_path / "run" / "train.log").read_text()
    assert (f"head_init='imprint', rename_classes={cfg.rename_classes!r}: read only when the run starts from a "
            "checkpoint (--init-from, or a resume); this run starts fresh, so they are unused") in log
    (tmp_path / "renames.tsv").write_text("# nothing renamed\n", encoding="utf-8")
    assert train(dataclasses.replace(cfg, max_steps=2))["step"] == 2  # resumed: read, nothing said
    assert (tmp_path / "run" / "train.log").read_text().count("read only when the run starts") == 1


def test_the_run_flushes_the_heads_deferred_input_checks(tmp_path, monkeypatch):
    """One process on CUDA defers the head's value checks one forward (validate="auto"): every
    checkpoint reads the pending ones first (sharded_state), and the loop reads the last batch's when
    it ends, so a bad final batch is reported. Here on the CPU, with the deferred mode forced."""
    import inspect

    from shardfc.head import module

    monkeypatch.setattr(module, "defers", lambda *args: True)
    callers = []
    real = module.ShardedMarginHead.check_pending

    def check_pending(self):
        callers.append(inspect.stack()[1].function)
        return real(self)

    monkeypatch.setattr(module.ShardedMarginHead, "check_pending", check_pending)
    cfg = tiny_config(tmp_path / "run", nproc=1, max_steps=2, grad_accum=2, synthetic_val_pairs=0, ckpt_every=1,
                      eval_every=0)
    assert train(cfg)["step"] == 2
    assert callers.count("_check_and_exchange") == 4  # each forward reads the previous one's first
    assert callers.count("sharded_state") == 2  # the checkpoints at steps 1 and 2
    assert callers.index("train") < len(callers) - 1 and callers[-1] == "sharded_state"  # loop end, then the last save


def test_checkpoint_of_another_model_or_lost_classes_is_refused(run2, tmp_path):
    cfg, _ = run2
    other_model = _copy_run(cfg, tmp_path / "a", nproc=1, embedding_dim=32)
    with pytest.raises(ConfigError, match=r"embedding_dim: checkpoint=16, this run=32.*new --output-dir"):
        train(other_model)
    # fewer identities than the checkpoint's (more would grow the head: tests/train/checkpointing/test_fine_tune.py)
    lost_classes = _copy_run(cfg, tmp_path / "b", nproc=1, synthetic_identities=20)
    with pytest.raises(ConfigError, match=r"4 of .* 24 classes are not in the dataset.*on-missing-classes"):
        train(lost_classes)
    fresh = _copy_run(cfg, tmp_path / "c", nproc=1, resume="none")
    with pytest.raises(ConfigError, match=r"resume='none' but .* already holds checkpoints"):
        train(fresh)
    # Nothing was touched by the refused runs.
    assert [p.name for p in find_checkpoints(tmp_path / "a" / "checkpoints")] == ["step_00000003", "step_00000006"]


def test_truncated_checkpoint_is_skipped_and_kept_aside(run2, tmp_path):
    cfg, _ = run2
    cfg1 = _copy_run(cfg, tmp_path / "run", nproc=1, eval_every=0, synthetic_val_pairs=0)
    root = Path(cfg1.output_dir) / "checkpoints"
    head = root / "step_00000006" / "head_1.pt"
    head.write_bytes(head.read_bytes()[:100])
    summary = train(cfg1)
    assert summary["step"] == STEPS and summary["checkpoint"].endswith("step_00000006")
    aside = [p for p in root.iterdir() if p.name.startswith("step_00000006.set-aside-")]
    assert len(aside) == 1 and (aside[0] / "head_1.pt").stat().st_size == 100
    log = (Path(cfg1.output_dir) / "train.log").read_text()
    assert "resuming from" in log and "step_00000003" in log


def test_format_1_checkpoint_resumes_only_when_trusted(run2, tmp_path):
    """A checkpoint of shardfc before format 2 holds pickled RNG states: refused, naming the way in."""
    cfg, _ = run2
    cfg1 = _copy_run(cfg, tmp_path / "old", nproc=1, eval_every=0, synthetic_val_pairs=0)
    root = Path(cfg1.output_dir) / "checkpoints"
    shutil.rmtree(root / "step_00000006")
    as_format_1(root / "step_00000003")
    with pytest.raises(CheckpointError, match=r"rank_0\.pt: .*checkpoint format 1.*--trust-checkpoint"):
        train(cfg1)
    trusted = dataclasses.replace(cfg1, trust_checkpoint=True)
    parts, state = load_parts(trusted, root / "step_00000003")
    head = parts.head.sharded_state(parts.opt_head)
    saved = _saved_head(Path(cfg.output_dir) / "checkpoints" / "step_00000003", world=2)
    assert state.step == 3 and torch.equal(head["tensors"]["weight"], saved["weight"])
    assert torch.equal(head["tensors"]["optimizer.momentum_buffer"], saved["optimizer.momentum_buffer"])
    del parts
    assert train(trusted)["step"] == STEPS


def test_rng_state_is_plain_data_and_restores_every_generator(tmp_path):
    import random

    from shardfc.train.checkpointing.resume import rng_state, set_rng_state

    def draws():
        return random.random(), float(np.random.rand()), float(torch.rand(()))

    random.seed(1), np.random.seed(2), torch.manual_seed(3)
    torch.save(rng_state(), tmp_path / "rng.pt")
    expected = draws()
    set_rng_state(torch.load(tmp_path / "rng.pt", weights_only=True))
    assert draws() == expected
    # Format 1 stored the states as they come: a tuple and a numpy array.
    old = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    expected = draws()
    set_rng_state(old)
    assert draws() == expected


def _png(path: Path, color) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.new("RGB", (16, 16), color).save(path)


def test_folder_dataset_with_a_corrupt_image_and_empty_folder(tmp_path, capsys):
    data = tmp_path / "faces"
    for ident in range(4):
        for k in range(3):
            _png(data / f"id{ident}" / f"{k}.png", (60 * ident, 20 * k, 100))
    (data / "id0" / "broken.png").write_bytes(b"not an image at all")
    # 13 images, 3 batches an epoch, 2 workers: broken.png is met in 3 epochs, by either worker.
    cfg = tiny_config(tmp_path / "run", dataset="folder", data_root=str(data), nproc=1, batch_size=4, grad_accum=1,
                      max_steps=8, log_every=4, ckpt_every=0, eval_every=0, synthetic_val_pairs=0, num_workers=2)
    assert train(cfg)["step"] == 8
    log = (tmp_path / "run" / "train.log").read_text()
    named = [line for line in log.splitlines() if "broken.png" in line]
    assert len(named) == 1 and "corrupt image skipped" in named[0], named  # once per run, with its name
    assert "corrupt image(s) skipped" in log

    empty = tmp_path / "empty"
    empty.mkdir()
    argv = ["--dataset", "folder", "--data-root", str(empty), "--nproc", "1", "--output-dir", str(tmp_path / "e")]
    assert train_cli.main(argv) == 2
    assert "contains no images" in capsys.readouterr().err


def test_a_run_stops_past_max_corrupt_images_naming_the_count(tmp_path):
    """One broken file is noise; a folder of them is a data problem: past max_corrupt_images different
    ones, the run stops at the next report with one line (issue 43)."""
    data = tmp_path / "faces"
    for ident in range(2):
        for k in range(3):
            _png(data / f"id{ident}" / f"{k}.png", (60 * ident, 20 * k, 100))
    (data / "id0" / "broken.png").write_bytes(b"not an image at all")
    os.mkfifo(data / "id1" / "pipe.png")  # not a regular file: skipped as corrupt, never opened
    cfg = tiny_config(tmp_path / "run", dataset="folder", data_root=str(data), nproc=1, batch_size=4, grad_accum=1,
                      max_steps=4, log_every=2, ckpt_every=0, eval_every=0, synthetic_val_pairs=0,
                      max_corrupt_images=1)
    with pytest.raises(ValueError, match=r"^2 different corrupt images skipped by step 2, more than "
                                         r"max_corrupt_images=1") as info:
        train(cfg)
    assert "\n" not in str(info.value)
    assert train(dataclasses.replace(cfg, max_corrupt_images=2, output_dir=str(tmp_path / "ok")))["step"] == 4


def test_a_run_whose_backbone_diverges_stops_saying_so_and_keeps_its_checkpoint(tmp_path):
    """The head refuses non-finite embeddings; in a run, after its first step, that is the backbone
    diverging: the run stops with what to change, the head's error as the cause, the last checkpoint kept."""
    cfg = tiny_config(tmp_path / "run", nproc=1, lr=1e30, warmup_steps=0, max_steps=6, ckpt_every=1, eval_every=0,
                      synthetic_val_pairs=0)
    with pytest.raises(FloatingPointError) as info:
        train(cfg)
    assert str(info.value) == ("the backbone's embeddings are not finite at step 2: training diverged; lower --lr, "
                               "raise --warmup-steps or set --grad-clip")
    assert isinstance(info.value.__cause__, NonFiniteEmbeddingsError)
    assert [p.name for p in find_checkpoints(tmp_path / "run" / "checkpoints")] == ["step_00000001"]


@pytest.mark.parametrize("step", [0, 4])
def test_only_after_a_step_is_a_refusal_of_the_embeddings_a_divergence(step):
    refused = NonFiniteEmbeddingsError("embeddings contain non-finite values (row 0: [nan]...)")
    with pytest.raises((NonFiniteEmbeddingsError, FloatingPointError)) as info, _divergence_named(RunState(step=step)):
        raise refused
    if step == 0:  # nothing trained yet: the data or the starting weights, as the head says
        assert info.value is refused
    else:
        assert str(info.value).startswith("the backbone's embeddings are not finite at step 5: training diverged")
    with pytest.raises(ValueError, match="^labels"), _divergence_named(RunState(step=step)):
        raise ValueError("labels[0] = 9 is outside [0, num_classes=3)")  # other refusals pass as they are


# ---------------------------------------------------------------------------- data order


def test_shard_batches_fold_single_image_tails_and_resume_mid_epoch():
    # 2 ranks x 9 images, batch 4: 4 + 4 + 1 -> the lone image joins the last batch.
    a, b = (ShardBatches(18, 4, r, 2, seed=0, drop_last=False) for r in range(2))
    assert [len(x) for x in a] == [4, 5] and len(a) == len(b) == 2
    assert sorted(i for batch in list(a) + list(b) for i in batch) == list(range(18))
    a.set_epoch(1, start=1)
    assert len(a) == 1 and list(a) == ShardBatches._all(a)[1:]
    dropped = ShardBatches(22, 4, 0, 2, seed=0, drop_last=True)
    assert [len(x) for x in dropped] == [4, 4] and len(dropped) == 2
    with pytest.raises(ConfigError, match="fewer than 2 per rank"):
        ShardBatches(3, 4, 0, 3, seed=0, drop_last=False)


def test_one_process_run_evaluates_on_schedule_records_it_and_times_no_start_up_unasked(tmp_path):
    """Every ``eval_every`` steps the evaluation is logged to metrics.csv (the final one too, once), and
    a run without ``--profile`` neither times its start-up nor says so."""
    cfg = tiny_config(tmp_path / "run", nproc=1, grad_accum=1, max_steps=4, eval_every=2, ckpt_every=0,
                      synthetic_val_pairs=20)
    summary = train(cfg)
    with open(tmp_path / "run" / "metrics.csv", newline="") as f:
        evaluated = [int(r["step"]) for r in csv.DictReader(f) if r["name"] == "val/synthetic/accuracy"]
    assert evaluated == [2, 4] and "accuracy" in summary["metrics"]["synthetic"]
    log = (tmp_path / "run" / "train.log").read_text()
    assert "start-up" not in log and not (tmp_path / "run" / "profile").exists()


def test_the_backbone_trains_and_is_evaluated_under_the_runs_autocast(tmp_path):
    """``--amp bf16``: the backbone's forward passes, in training and in the evaluation, all run under
    bf16 autocast (a hook on every module records the autocast state at the backbone's own forward)."""
    from shardfc.models.tiny import TinyNet

    seen = []

    def hook(module, args):
        if isinstance(module, TinyNet):
            dtype = torch.get_autocast_dtype("cpu") if torch.is_autocast_enabled("cpu") else None
            seen.append((module.training, dtype))

    handle = torch.nn.modules.module.register_module_forward_pre_hook(hook)
    try:
        cfg = tiny_config(tmp_path / "run", nproc=1, grad_accum=1, max_steps=2, eval_every=0, ckpt_every=0,
                          synthetic_val_pairs=20, amp="bf16")
        train(cfg)
    finally:
        handle.remove()
    assert {training for training, _ in seen} == {True, False}  # both kinds of forward were seen
    assert all(dtype == torch.bfloat16 for _, dtype in seen), seen


def test_the_runs_config_toml_is_written_whole_or_not_at_all(tmp_path, monkeypatch):
    out = tmp_path / "run"
    out.mkdir()
    (out / "config.toml").write_text("# the earlier run's\n")
    real = Path.write_text

    def full_disk(self, text, *args, **kwargs):  # half the file, then the disk is full
        if self.name.startswith(".config.toml"):
            real(self, text[: len(text) // 2], *args, **kwargs)
            raise OSError(28, "No space left on device")
        return real(self, text, *args, **kwargs)

    monkeypatch.setattr(Path, "write_text", full_disk)
    cfg = tiny_config(out, nproc=1, max_steps=1, eval_every=0, ckpt_every=0, synthetic_val_pairs=0)
    with pytest.raises(OSError, match=f"cannot write {out / 'config.toml'}: No space left on device"):
        train(cfg)
    assert (out / "config.toml").read_text() == "# the earlier run's\n"  # whole, as it was: no half-written config
    assert not [p.name for p in out.iterdir() if p.name.startswith(".config.toml")]  # nor a scratch file
    monkeypatch.setattr(Path, "write_text", real)
    train(cfg)
    assert (out / "config.toml").read_text().startswith("[data]\n") and "max_steps = 1\n" in (out / "config.toml").read_text()
