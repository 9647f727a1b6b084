"""``train/checkpointing/resume.py`` in the test's process: which checkpoint a run resumes from and
what it sets aside so that nothing saved is lost, every rank learning rank 0's decision (ranks as
threads), what a foreign checkpoint's loading errors become, and whose RNG streams a rank continues.

The end-to-end resumes (other world sizes, strategies, a killed save) are in ``tests/train``; these
hold the module's own decisions, where mutation testing sees them.
"""

from __future__ import annotations

import dataclasses
import logging
import re
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from shardfc import checkpoint as ckpt
from shardfc.checkpoint.format import rank_file
from shardfc.checkpoint.weights_only import error_line
from shardfc.parallel.context import DistContext
from shardfc.train.checkpointing import resume
from shardfc.train.config import ConfigError, TrainConfig
from shardfc.train.loop import load_parts, train
from thread_world import ThreadWorld

from ..tiny import tiny_config

ASIDE = re.compile(r"^step_(\d{8})\.set-aside-\d{8}-\d{6}$")


def _one() -> DistContext:
    return DistContext(None, 0, 1, False, torch.device("cpu"))


def _cfg(out: Path, resume_: str = "auto") -> TrainConfig:
    return TrainConfig(output_dir=str(out), resume=resume_)


def _saved(out: Path, *steps: int, truncated: tuple = ()) -> Path:
    """Checkpoints of ``steps`` under ``out/checkpoints``; those in ``truncated`` lose their ``meta.json``."""
    root = out / "checkpoints"
    for step in steps:
        ckpt.save_checkpoint(root, step, common={"step": step}, per_rank=None, head_tensors={"weight": torch.ones(3, 2)},
                             class_range=range(0, 3), num_classes=3, fingerprint={})
        if step in truncated:
            (root / f"step_{step:08d}" / ckpt.META_FILE).unlink()
    return root


def _names(root: Path) -> list:
    return sorted(p.name for p in root.iterdir())


def test_the_fingerprint_is_what_must_match():
    cfg = TrainConfig(backbone="iresnet18", embedding_dim=48, optimizer="adamw")
    assert resume.fingerprint(cfg, 7, (112, 96)) == {
        "backbone": "iresnet18", "embedding_dim": 48, "num_classes": 7, "image_size": [112, 96], "optimizer": "adamw",
    }
    assert resume.checkpoint_root(cfg) == Path(cfg.output_dir) / "checkpoints"


def test_nothing_saved_resumes_from_nothing(tmp_path):
    for value in ("auto", "none", " None "):
        assert resume.resume_path(_cfg(tmp_path / "absent", value), _one()) is None
    (tmp_path / "empty" / "checkpoints").mkdir(parents=True)
    assert resume.resume_path(_cfg(tmp_path / "empty", "none"), _one()) is None
    assert resume.resume_path(_cfg(tmp_path / "empty"), _one()) is None
    assert not (tmp_path / "absent").exists()  # looking made nothing


def test_auto_resumes_from_the_newest_complete_and_sets_aside_the_newer_truncated_one(tmp_path, caplog):
    root = _saved(tmp_path, 2, 4, 6, truncated=(6,))
    with caplog.at_level(logging.INFO, logger="shardfc.train"):
        assert resume.resume_path(_cfg(tmp_path), _one()) == root / "step_00000004"
    names = _names(root)
    assert names[:2] == ["step_00000002", "step_00000004"] and len(names) == 3
    assert ASIDE.match(names[2]) and names[2].startswith("step_00000006.")
    assert not (root / names[2] / ckpt.META_FILE).exists() and (root / names[2] / ckpt.COMMON_FILE).is_file()
    warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING and r.name == "shardfc.train"]
    assert warned == [f"{root / 'step_00000006'} is newer than the checkpoint this run resumes from (incomplete, "
                      f"corrupt, or resume names an older one); renamed it to {names[2]} so that it is not overwritten"]
    said = [r.getMessage() for r in caplog.records if r.levelno == logging.INFO and r.name == "shardfc.train"]
    assert said == [f"resuming from {root / 'step_00000004'}"]


def test_an_older_checkpoint_named_sets_aside_every_newer_one_and_keeps_the_older(tmp_path):
    root = _saved(tmp_path, 1, 3, 5)
    assert resume.resume_path(_cfg(tmp_path, str(root / "step_00000003")), _one()) == root / "step_00000003"
    names = _names(root)
    assert names[:2] == ["step_00000001", "step_00000003"] and ASIDE.match(names[2]) and names[2][5:13] == "00000005"
    # named relative to the checkpoint folder: the same, and nothing more set aside
    assert resume.resume_path(_cfg(tmp_path, "step_00000001"), _one()) == root / "step_00000001"
    assert sum(bool(ASIDE.match(n)) for n in _names(root)) == 2 and (root / "step_00000001").is_dir()


def test_the_newest_named_sets_nothing_aside(tmp_path, caplog):
    root = _saved(tmp_path, 1, 3)
    with caplog.at_level(logging.WARNING, logger="shardfc.train"):
        assert resume.resume_path(_cfg(tmp_path, str(root / "step_00000003")), _one()) == root / "step_00000003"
    assert _names(root) == ["step_00000001", "step_00000003"] and not caplog.records


@pytest.mark.parametrize("value", ["none", " NONE "])
def test_resume_none_over_saved_checkpoints_is_refused_and_touches_nothing(tmp_path, value):
    root = _saved(tmp_path, 2, 4, 6, 8, truncated=(8,))
    message = (f"resume='none' but {root} already holds checkpoints (newest: step_00000006); pass --resume auto to "
               "continue that run, or choose another --output-dir")
    with pytest.raises(ConfigError, match=f"^{re.escape(message)}$"):
        resume.resume_path(_cfg(tmp_path, value), _one())
    assert _names(root) == ["step_00000002", "step_00000004", "step_00000006", "step_00000008"]


def test_auto_with_only_a_truncated_save_starts_afresh_and_sets_it_aside(tmp_path):
    """Step 0 and 1's truncated saves are newer than nothing: both set aside, none overwritten."""
    root = _saved(tmp_path, 0, 1, truncated=(0, 1))
    assert resume.resume_path(_cfg(tmp_path), _one()) is None
    names = _names(root)
    assert len(names) == 2 and all(ASIDE.match(n) for n in names) and [n[:13] for n in names] == [
        "step_00000000", "step_00000001"]


def test_a_step_a_crashed_resave_left_aside_is_put_back_and_resumed_from(tmp_path, caplog):
    """A save of step 4 over the step 4 already there, killed between its two renames (where no swap
    is possible): the only copy of step 4 is under the save's scratch name, which the next save would
    tidy away. The resume puts it back first, then takes it."""
    root = _saved(tmp_path, 2, 4)
    (root / "step_00000004").rename(root / ".old-step_00000004-0123456789abcdef")
    with caplog.at_level(logging.WARNING, logger="shardfc.checkpoint"):
        assert resume.resume_path(_cfg(tmp_path), _one()) == root / "step_00000004"
    assert _names(root) == ["step_00000002", "step_00000004"] and len(caplog.records) == 1
    assert ckpt.load_checkpoint(root / "step_00000004", class_range=range(3), num_classes=3).common == {"step": 4}


def test_every_rank_gets_rank_0s_decision_and_only_rank_0_says_it(tmp_path, monkeypatch, caplog):
    root = _saved(tmp_path, 2, 4)
    world = ThreadWorld(3)
    with caplog.at_level(logging.INFO, logger="shardfc.train"):
        got = world.results(lambda rank: resume.resume_path(_cfg(tmp_path), world.context()), monkeypatch)
    assert got == [root / "step_00000004"] * 3
    assert [r.getMessage() for r in caplog.records] == [f"resuming from {root / 'step_00000004'}"]
    # rank 0's error, raised on every rank (the others would wait for it forever)
    got = world.run(lambda rank: resume.resume_path(_cfg(tmp_path, "none"), world.context()))
    assert all(isinstance(e, ConfigError) and "already holds checkpoints (newest: step_00000004)" in str(e) for e in got)
    # the other ranks look at nothing: their own folders (here, full of checkpoints) do not count
    got = world.results(lambda rank: resume.resume_path(_cfg(tmp_path / "x" if rank == 0 else tmp_path, "none"),
                                                        world.context()))
    assert got == [None] * 3 and _names(root) == ["step_00000002", "step_00000004"]


@pytest.mark.parametrize("error", [KeyError("backbone"), TypeError("not a dict"), ValueError("size mismatch"),
                                   RuntimeError("Error(s) in loading state_dict"), IndexError("list index"),
                                   AttributeError("no attribute 'items'")])
def test_what_a_foreign_checkpoint_makes_a_loader_raise_is_one_error_naming_the_file(error, tmp_path):
    where = tmp_path / "step_00000003" / "common.pt"
    with pytest.raises(ckpt.CheckpointError) as raised:
        with resume._reading(where):
            raise error
    assert str(raised.value) == (f"cannot resume from {where}: it does not hold what this run saves "
                                 f"({error_line(error)})")
    assert raised.value.__cause__ is None and raised.value.__suppress_context__


@pytest.mark.parametrize("error", [ckpt.CheckpointError("hash mismatch"), ConfigError("--resume"), OSError("disk"),
                                   ZeroDivisionError("a bug")])
def test_shardfc_errors_and_others_pass_through_unchanged(error, tmp_path):
    with pytest.raises(type(error)) as raised:
        with resume._reading(tmp_path):
            raise error
    assert raised.value is error


def _run(world: int, pipeline=None):
    return SimpleNamespace(ctx=SimpleNamespace(world_size=world), pipeline=pipeline)


def test_a_rank_continues_its_own_random_streams_only_on_the_same_layout():
    two_stages = SimpleNamespace(layout=SimpleNamespace(stages=2), split_points=("layer3",))
    assert resume._pipeline_layout(_run(2)) is None
    assert resume._pipeline_layout(_run(2, two_stages)) == [2, ["layer3"]]
    assert resume._same_layout({"world_size": 2, "pipeline": None}, _run(2))
    assert resume._same_layout({}, _run(2))  # format 1: no world size or layout saved, nothing else to tell
    assert resume._same_layout({"world_size": 2, "pipeline": [2, ["layer3"]]}, _run(2, two_stages))
    assert not resume._same_layout(None, _run(2))  # no per-rank file read
    assert not resume._same_layout({"world_size": 3}, _run(2))
    assert not resume._same_layout({"world_size": 2, "pipeline": [2, ["layer2"]]}, _run(2, two_stages))
    assert not resume._same_layout({"world_size": 2}, _run(2, two_stages))  # saved without a pipeline
    assert not resume._same_layout({"world_size": 2, "pipeline": [2, ["layer3"]]}, _run(2))


# ---------------------------------------------------------------- restoring a run saved in this process


@pytest.fixture(scope="module")
def saved_run(tmp_path_factory):
    """3 steps of the tiny run on one process (120 images, batch 8: 15 micro-batches an epoch, 2 a
    step), saved at step 3, with the random draws that would follow the save."""
    out = tmp_path_factory.mktemp("resume") / "run"
    cfg = tiny_config(out, nproc=1, max_steps=3, ckpt_every=3, eval_every=0, synthetic_val_pairs=0)
    train(cfg)
    path = out / "checkpoints" / "step_00000003"
    resume.set_rng_state(torch.load(path / rank_file(0), weights_only=True)["rng"])
    return cfg, path, _draws()


def _draws():
    import random

    import numpy as np

    return random.random(), float(np.random.rand()), torch.rand(3).tolist()


def _restored(cfg, path):
    parts, state = load_parts(cfg, path)
    return state, _draws()


def test_the_same_run_continues_its_position_and_random_streams(saved_run, caplog):
    cfg, path, after_save = saved_run
    with caplog.at_level(logging.INFO, logger="shardfc.train"):
        state, draws = _restored(cfg, path)
    assert (state.step, state.epoch, state.batch_in_epoch, state.batches_per_epoch, state.samples_seen) == (3, 0, 6, 15, 48)
    assert draws == after_save
    said = [r.getMessage() for r in caplog.records if r.name == "shardfc.train"]
    assert said[-1] == f"restored step 3 (epoch 0) from {path}" and not any("resuming with" in s for s in said)


@pytest.mark.parametrize("batch, position, per_epoch", [(4, 12, 30), (16, 3, 8), (40, 1, 3)])
def test_another_batch_size_continues_at_the_same_fraction_of_the_epoch(saved_run, caplog, batch, position, per_epoch):
    """6 of 15 micro-batches done (40%): the same share of the new epoch's count, rounded."""
    cfg, path, after_save = saved_run
    with caplog.at_level(logging.INFO, logger="shardfc.train"):
        state, draws = _restored(dataclasses.replace(cfg, batch_size=batch), path)
    assert (state.step, state.batch_in_epoch, state.batches_per_epoch) == (3, position, per_epoch)
    assert draws == after_save  # the same world and layout: its own streams, whatever the batch
    said = [r.getMessage() for r in caplog.records if r.name == "shardfc.train"]
    assert f"resuming with 1 rank(s) x batch {batch} (saved with 1 x 8): continuing epoch 0 at 40%" in said


def test_another_layout_reseeds_the_rank_from_seed_rank_and_step(saved_run, monkeypatch):
    from shardfc.seeding import seed_all
    from shardfc.train.builder.factory import rank_seed

    cfg, path, after_save = saved_run
    monkeypatch.setattr(resume, "_same_layout", lambda per_rank, run: False)
    _, draws = _restored(cfg, path)
    seed_all(rank_seed(cfg.seed, 0, 3))
    assert draws == _draws() and draws != after_save


def _said(caplog) -> list:
    return [r.getMessage() for r in caplog.records if r.name == "shardfc.train"]


def test_a_resume_trains_with_its_own_momentum_and_weight_decay_and_says_they_changed(saved_run, caplog):
    """The loaded optimizer states carried the saving run's settings into the param groups, so
    --weight-decay 0.05 on a resume trained on with 5e-4, silently."""
    cfg, path, _ = saved_run
    changed = dataclasses.replace(cfg, momentum=0.5, weight_decay=0.05, head_momentum=0.7)
    with caplog.at_level(logging.INFO, logger="shardfc.train"):
        parts, state = load_parts(changed, path)
    assert state.step == 3
    for opt, momentum in ((parts.opt_backbone, 0.5), (parts.opt_head, 0.7)):
        assert [(g["momentum"], g["weight_decay"]) for g in opt.param_groups] == [(momentum, 0.05)]
        assert opt.state and all(s.get("momentum_buffer") is not None for s in opt.state.values())  # the checkpoint's
    assert ("the optimizer settings differ from the checkpoint's (backbone.momentum 0.9, backbone.weight_decay 0.0005, "
            "head.momentum 0.9, head.weight_decay 0.0005); following this run's: backbone.momentum 0.5, "
            "backbone.weight_decay 0.05, head.momentum 0.7, head.weight_decay 0.05") in _said(caplog)
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="shardfc.train"):
        load_parts(cfg, path)  # the same settings: not a word
    assert not [s for s in _said(caplog) if "optimizer settings" in s]


def test_a_run_saved_here_says_nothing_of_imports_or_new_rows(saved_run, caplog):
    cfg, path, _ = saved_run
    with caplog.at_level(logging.INFO, logger="shardfc.train"):
        _restored(cfg, path)
    assert not [s for s in _said(caplog) if "backbone optimizer" in s or s.startswith("head: ")]


def test_an_imported_run_resumes_with_a_fresh_backbone_optimizer_and_says_so(tmp_path, caplog):
    """``shardfc import-arcface`` writes no backbone optimizer state: the run says where it came from."""
    from shardfc.models import build_backbone
    from shardfc.train.checkpointing.arcface_import import import_arcface

    torch.save(build_backbone("tiny", 16, input_size=(16, 16)).state_dict(), tmp_path / "backbone.pth")
    path, _ = import_arcface(tmp_path / "released", tmp_path / "backbone.pth", "tiny", num_classes=24,
                             embedding_dim=16, input_size=(16, 16))
    cfg = tiny_config(tmp_path / "released", nproc=1, eval_every=0, synthetic_val_pairs=0)
    with caplog.at_level(logging.INFO, logger="shardfc.train"):
        state, _ = _restored(cfg, path)
    assert f"{path} holds no backbone optimizer state (imported from arcface_torch): it starts fresh" in _said(caplog)
    assert state.step == resume.step_of(path)


def test_a_dataset_that_lost_identities_resumes_with_a_fresh_head_when_told(saved_run, tmp_path, caplog):
    """``--on-missing-classes fresh``: no saved row is kept, every row is new (imprinted here), the
    step and the backbone are the checkpoint's."""
    cfg, path, _ = saved_run
    fewer = dataclasses.replace(cfg, synthetic_identities=20, on_missing_classes="fresh", head_init="imprint")
    with caplog.at_level(logging.INFO, logger="shardfc.train"):
        parts, state = load_parts(fewer, path)
    saved = torch.load(path / "head_0.pt", weights_only=True)["tensors"]["weight"]
    weight = parts.head.sharded_state(parts.opt_head)["tensors"]["weight"]
    assert state.step == 3 and weight.shape == (20, 16) and not torch.isclose(weight, saved[:20]).any()
    # imprinted: each row the normalised mean embedding of its identity (unit rows, not the random init's)
    torch.testing.assert_close(weight.norm(dim=1), torch.ones(20))
    heads = [s for s in _said(caplog) if s.startswith("head: ")]
    assert heads == ["head: new head of 20 classes (--on-missing-classes fresh); new rows: imprint"]


class _Stop(Exception):
    pass


def _spy_run(saved_run, pipeline=None, classes="planned"):
    cfg, path, _ = saved_run
    from shardfc.train.checkpointing.classes import ClassPlan

    plan = ClassPlan([str(i) for i in range(24)], None, 24) if classes == "planned" else None
    return SimpleNamespace(parts=SimpleNamespace(opt_backbone=None, opt_head=None), ctx=_one(), num_classes=24, image_size=(16, 16), batches=[0] * 15,
                           total_steps=3, classes=plan, pipeline=pipeline), path, cfg


@pytest.mark.parametrize("pipeline", [None, SimpleNamespace(layout=SimpleNamespace(stages=2), split_points=())])
def test_a_pipeline_stage_maps_the_saved_files_instead_of_reading_them_whole(saved_run, monkeypatch, pipeline):
    run, path, cfg = _spy_run(saved_run, pipeline)
    asked = {}

    def load_kept(run_, cfg_, path_, plan, fingerprint, mmap):
        asked.update(plan=plan, fingerprint=fingerprint, mmap=mmap, path=path_)
        raise _Stop

    monkeypatch.setattr(resume, "load_kept", load_kept)
    with pytest.raises(_Stop):
        resume.restore(run, path, cfg)
    assert asked["mmap"] is (pipeline is not None) and asked["plan"] is run.classes and asked["path"] == path
    assert asked["fingerprint"] == resume.fingerprint(cfg, 24, (16, 16))


def test_a_checkpoint_of_another_model_says_how_to_get_going(saved_run, monkeypatch):
    run, path, cfg = _spy_run(saved_run)

    def load_kept(*a, **k):
        raise ValueError("checkpoint does not match this run: embedding_dim: checkpoint=16, this run=32")

    monkeypatch.setattr(resume, "load_kept", load_kept)
    with pytest.raises(ConfigError) as raised:
        resume.restore(run, path, cfg)
    assert str(raised.value) == ("cannot resume: checkpoint does not match this run: embedding_dim: checkpoint=16, "
                                 "this run=32. Train it in a new --output-dir (or pass --resume none there)")


def test_a_run_built_without_its_class_plan_is_a_programming_error(saved_run):
    run, path, cfg = _spy_run(saved_run, classes=None)
    with pytest.raises(ValueError, match=r"^restore needs the run's class plan against the checkpoint: build the run "
                                         r"with build_run\(\.\.\., classes_from=\(path, False\)\)$"):
        resume.restore(run, path, cfg)


@pytest.mark.parametrize("failing", ["restore_backbone", "head"])
def test_what_the_backbone_or_head_loader_raises_names_the_checkpoint(saved_run, monkeypatch, failing):
    """A foreign checkpoint whose backbone or head state does not fit: one CheckpointError naming it."""
    cfg, path, _ = saved_run

    def broken(*a, **k):
        raise KeyError("layer1.0.weight")

    if failing == "restore_backbone":
        monkeypatch.setattr(resume, "restore_backbone", broken)
    else:
        monkeypatch.setattr("shardfc.head.module.ShardedMarginHead.load_sharded_state", broken)
    with pytest.raises(ckpt.CheckpointError, match=rf"^cannot resume from {re.escape(str(path))}: it does not hold "
                                                   r"what this run saves \(KeyError: 'layer1.0.weight'\)$"):
        load_parts(cfg, path)


def test_a_checkpoint_saved_on_a_gpu_restores_its_cuda_stream_only_where_there_is_one(monkeypatch):
    """The CUDA generator's state is saved and restored beside the others where CUDA is; a checkpoint
    saved on a GPU resumes on a CPU-only machine (its CUDA state left unread), and one saved on a CPU
    touches no CUDA state on a GPU."""
    restored = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_rng_state", lambda: torch.tensor([7, 8], dtype=torch.uint8))
    monkeypatch.setattr(torch.cuda, "set_rng_state", lambda s: restored.append(s.tolist()))
    on_gpu = resume.rng_state()
    assert on_gpu["cuda"].tolist() == [7, 8]
    resume.set_rng_state(on_gpu)
    assert restored == [[7, 8]]
    resume.set_rng_state({k: v for k, v in on_gpu.items() if k != "cuda"})  # saved on a CPU
    assert restored == [[7, 8]]
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert "cuda" not in resume.rng_state()
    resume.set_rng_state(on_gpu)  # saved on a GPU, resumed here
    assert restored == [[7, 8]]


def test_keep_last_leaves_that_many_newest_checkpoints(tmp_path):
    cfg = tiny_config(tmp_path / "run", nproc=1, max_steps=4, ckpt_every=1, keep_last=2, eval_every=0,
                      synthetic_val_pairs=0)
    train(cfg)
    assert [p.name for p in ckpt.find_checkpoints(resume.checkpoint_root(cfg))] == ["step_00000003", "step_00000004"]


def _altered(monkeypatch, common=None, per_rank=None):
    """load_kept as it is, then the common / this rank's saved dicts changed as a crafted file would."""
    real = resume.load_kept

    def load_kept(*args, **kwargs):
        loaded = real(*args, **kwargs)
        if common is not None:
            loaded.common = common(dict(loaded.common))
        if per_rank is not None:
            loaded.per_rank = per_rank(dict(loaded.per_rank))
        return loaded

    monkeypatch.setattr(resume, "load_kept", load_kept)


@pytest.mark.parametrize("where", ["common", "rank"])
def test_a_common_or_rank_file_that_does_not_hold_a_run_state_names_that_file(saved_run, monkeypatch, where):
    cfg, path, _ = saved_run
    if where == "common":
        _altered(monkeypatch, common=lambda c: {k: v for k, v in c.items() if k != "state"})
        named, error = path / ckpt.COMMON_FILE, "KeyError: 'state'"
    else:
        _altered(monkeypatch, per_rank=lambda r: {**r, "rng": {"python": "not a state"}})
        named, error = path / rank_file(0), "ValueError: too many values to unpack"
    with pytest.raises(ckpt.CheckpointError, match=rf"^cannot resume from {re.escape(str(named))}: it does not hold "
                                                   rf"what this run saves \({error}"):
        load_parts(cfg, path)


def test_a_run_without_its_batch_size_resumed_at_the_end_of_a_one_batch_epoch(saved_run, monkeypatch, caplog):
    """An imported arcface_torch run records no batch size (shown as ``?``); an epoch saved as one
    micro-batch, done: the new epoch's count, all of it (100%)."""
    cfg, path, _ = saved_run

    def one_batch_done(common):
        return {**common, "batch_size": None, "state": {**common["state"], "batch_in_epoch": 1, "batches_per_epoch": 1}}

    _altered(monkeypatch, common=one_batch_done)
    with caplog.at_level(logging.INFO, logger="shardfc.train"):
        state, _ = _restored(cfg, path)
    assert (state.batch_in_epoch, state.batches_per_epoch) == (15, 15)
    assert "resuming with 1 rank(s) x batch 8 (saved with 1 x ?): continuing epoch 0 at 100%" in _said(caplog)


def test_the_backbone_is_restored_with_the_runs_config(saved_run, monkeypatch):
    """Pipeline stages and format-1 checkpoints read it (which part of the backbone, which names)."""
    cfg, path, _ = saved_run
    seen = []
    real = resume.restore_backbone
    monkeypatch.setattr(resume, "restore_backbone", lambda run, loaded, c: seen.append(c) or real(run, loaded, c))
    load_parts(cfg, path)
    assert seen == [cfg]


def test_a_run_without_a_class_plan_saves_its_datasets_class_names(saved_run):
    cfg, _, _ = saved_run
    parts = SimpleNamespace(schedulers=[], scaler=SimpleNamespace(state_dict=lambda: {}))
    state = resume.RunState()
    run = SimpleNamespace(parts=parts, classes=None, dataset=SimpleNamespace(class_names=["ann", "bob"]),
                          data_ctx=SimpleNamespace(world_size=1))
    assert resume._common(run, state, cfg, None, None)["class_names"] == ["ann", "bob"]
    run.dataset = object()  # a dataset that names no classes (the synthetic one)
    assert resume._common(run, state, cfg, None, None)["class_names"] is None
