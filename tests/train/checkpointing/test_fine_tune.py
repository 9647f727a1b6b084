"""``shardfc train --init-from`` and a resume whose dataset gained identities, end to end; imprinted sub-centres."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from shardfc import ShardedMarginHead
from shardfc import checkpoint as ckpt
from shardfc.cli import export as cli_export
from shardfc.cli import train as train_cli
from shardfc.head.module import init_rows
from shardfc.models import build_backbone
from shardfc.parallel.context import DistContext
from shardfc.train.checkpointing.arcface_import import import_arcface
from shardfc.train.checkpointing.fine_tune import new_head_rows
from shardfc.train.config import ConfigError, TrainConfig
from shardfc.train.loop import load_parts

from ..tiny import tiny_config


def test_fine_tune_from_an_import_arcface_backbone(tmp_path: Path):
    """A released backbone imported with its own (nameless) head of 10 classes, fine-tuned on 2 ranks
    on 24 other identities: imprinted head, the backbone frozen for the whole (2-step) run."""
    torch.save(build_backbone("tiny", 16, input_size=(16, 16)).state_dict(), tmp_path / "backbone.pth")
    imported, _ = import_arcface(tmp_path / "released", tmp_path / "backbone.pth", "tiny", num_classes=10,
                                 embedding_dim=16, input_size=(16, 16))
    cfg = tiny_config(tmp_path / "ft", init_from=str(tmp_path / "released"), head_init="imprint",
                      head_warmup_steps=2, backbone_lr_mult=0.1, max_steps=2, eval_every=0, ckpt_every=0)
    summary = train_cli.run(cfg)
    assert summary["step"] == 2
    log = (tmp_path / "ft" / "train.log").read_text()
    assert f"init from {imported}: backbone loaded" in log and "new head of 24 classes" in log and "imprint" in log
    saved, _ = ckpt.load_common(summary["checkpoint"])
    released, _ = ckpt.load_common(imported)
    for key, value in released["backbone"].items():  # frozen: not a bit moved, BatchNorm statistics included
        assert torch.equal(saved["backbone"][key], value), key
    assert saved["class_names"] == [f"synthetic-s0-{i:05d}" for i in range(24)]


def test_resume_with_more_identities_keeps_every_row_and_imprints_the_new_ones(tmp_path: Path):
    out = tmp_path / "run"
    first = train_cli.run(tiny_config(out, nproc=1, max_steps=2, eval_every=0, ckpt_every=0))
    path = Path(first["checkpoint"])
    old = ckpt.load_checkpoint(path, class_range=range(24), num_classes=24)

    cfg = tiny_config(out, nproc=1, synthetic_identities=30, head_init="imprint", backbone_lr_mult=0.5)
    parts, state = load_parts(cfg, path)
    head, w = parts.head, parts.head.weight.detach()
    assert state.step == 2 and head.num_classes == 30
    assert torch.equal(w[:24], old.head_tensors["weight"])
    momentum = parts.opt_head.state[head.weight]["momentum_buffer"]
    assert torch.equal(momentum[:24], old.head_tensors["optimizer.momentum_buffer"]) and not momentum[24:].any()
    assert parts.opt_backbone.param_groups[0]["initial_lr"] == pytest.approx(cfg.lr * 0.5)

    # The new rows: the normalised mean of the normalised embeddings of each new identity's images.
    from shardfc.data import SyntheticIdentities

    data = SyntheticIdentities(30, 5, (16, 16), seed=0)
    model = parts.module.eval()
    with torch.no_grad():
        for c in range(24, 30):
            x = model(torch.stack([data[c * 5 + k][0] for k in range(5)])).double()
            mean = torch.nn.functional.normalize(x, dim=1).sum(0)
            assert (w[c].double() - mean / mean.norm()).abs().max() < 1e-5, c

    with pytest.raises(ConfigError, match=r"4 of checkpoint .* classes are not in the dataset .*'synthetic-s0-00020'"):
        train_cli.run(tiny_config(out, nproc=1, synthetic_identities=20))

    # An identity renamed since (its images now under another name): refused, then given its row by
    # --rename-classes; the relabelled dataset trains row 5 with the renamed identity's images.
    from shardfc.train.checkpointing.fine_tune import plan_run_classes

    class Renamed(SyntheticIdentities):  # identity 5 renamed, and the identities listed in reverse
        @property
        def class_names(self):
            return [("renamed-5" if n.endswith("-00005") else n) for n in super().class_names][::-1]

    renamed = Renamed(24, 5, (16, 16), seed=0)
    with pytest.raises(ConfigError, match=r"'synthetic-s0-00005'.*--rename-classes"):
        plan_run_classes(cfg, renamed, path, init=False)
    (tmp_path / "renames.tsv").write_text("synthetic-s0-00005\trenamed-5\n", encoding="utf-8")
    renaming = tiny_config(out, nproc=1, rename_classes=str(tmp_path / "renames.tsv"))
    relabelled, plan = plan_run_classes(renaming, renamed, path, init=False)
    assert plan.kept == 24 and plan.added == [] and plan.names[5] == "renamed-5"
    assert plan.label_map[renamed.class_names.index("renamed-5")] == 5


def test_fine_tune_from_an_exported_model(tmp_path: Path):
    """`shardfc export`'s TorchScript file as --init-from, under ddp and pipeline: its weights (read without
    running it) are the trained backbone's bit for bit (frozen through the 1-step run, so the saved backbone
    shows them), the head is new; another backbone or width is refused, naming what the file was exported from."""
    trained = train_cli.run(tiny_config(tmp_path / "run", nproc=1, max_steps=1, eval_every=0, ckpt_every=0))
    model = tmp_path / "model.pt"
    assert cli_export.main(["--checkpoint", trained["checkpoint"], "--out", str(model)]) == 0

    cfg = tiny_config(tmp_path / "ft", nproc=1, init_from=str(model), synthetic_identities=10, head_warmup_steps=1,
                      max_steps=1, eval_every=0, ckpt_every=0)
    summary = train_cli.run(cfg)
    log = (tmp_path / "ft" / "train.log").read_text()
    assert f"init from {model}: backbone loaded from an exported model" in log and "new head of 10 classes" in log
    saved, _ = ckpt.load_common(summary["checkpoint"])
    source, _ = ckpt.load_common(trained["checkpoint"])
    assert list(saved["backbone"]) == list(source["backbone"])
    for key, value in source["backbone"].items():
        assert torch.equal(saved["backbone"][key], value), key
    assert saved["class_names"] == [f"synthetic-s0-{i:05d}" for i in range(10)]

    # A pipeline stage takes its share of the export's weights (and keeps them through its warm-up step).
    pipe = dataclasses.replace(cfg, output_dir=str(tmp_path / "pipe"), strategy="pipeline", nproc=2, pipeline_stages=2,
                               micro_batches=2, micro_batch_stats=True, drop_last=True)
    path = Path(train_cli.run(pipe)["checkpoint"])
    stages, _ = ckpt.read_stage_state(path, ckpt.verify_checkpoint(path))
    assert list(stages) == list(source["backbone"])
    for key, value in source["backbone"].items():
        assert torch.equal(stages[key], value), key

    with pytest.raises(ConfigError, match=r"init_from=.*model\.pt' was exported from backbone='tiny', embedding_dim=16; "
                                          r"this run has backbone='tiny', embedding_dim=32"):
        train_cli.run(dataclasses.replace(cfg, output_dir=str(tmp_path / "wide"), embedding_dim=32))


def test_a_fine_tune_that_resumes_goes_on_from_its_own_checkpoint_and_says_init_from_is_ignored(tmp_path: Path):
    """``--init-from`` starts a run; once the run has a checkpoint of its own, a restart resumes from that
    (saying so), as a resume: its classes keep their rows, so another seed's identities are refused
    where a fine-tune would start a new head on them."""
    train_cli.run(tiny_config(tmp_path / "run", nproc=1, max_steps=1, eval_every=0, ckpt_every=0))
    cfg = tiny_config(tmp_path / "ft", nproc=1, init_from=str(tmp_path / "run"), max_steps=1, eval_every=0,
                      ckpt_every=0)
    first = train_cli.run(cfg)
    log = tmp_path / "ft" / "train.log"
    assert "init from " in log.read_text() and "ignored" not in log.read_text()
    second = train_cli.run(dataclasses.replace(cfg, max_steps=2))
    assert (f"init_from={tmp_path / 'run'} ignored: this run resumes from its own checkpoint {first['checkpoint']}"
            in log.read_text())
    assert ckpt.step_of(second["checkpoint"]) == 2
    with pytest.raises(ConfigError, match="classes are not in the dataset"):
        train_cli.run(dataclasses.replace(cfg, max_steps=3, seed=1))


class _Embedded(torch.utils.data.Dataset):
    """Images that are their own embeddings (under an identity backbone), labels in ``samples``."""

    def __init__(self, x: torch.Tensor, labels: list):
        self.x, self.samples = x, [(f"{i}.jpg", y) for i, y in enumerate(labels)]

    def __len__(self):
        return len(self.samples)

    def __getitem__(self, index):
        return self.x[index], self.samples[index][1]


def test_imprinted_subcentres_are_the_imprint_plus_each_centres_own_random_row():
    K, D, C, kept, seed = 3, 8, 6, 2, 7
    labels = [2, 3, 3, 4, 2, 4, 0, 1, 3]  # classes 2..4 have images, 5 none; 0 and 1 are kept rows
    x = torch.randn(len(labels), D, generator=torch.Generator().manual_seed(0))
    run = SimpleNamespace(ctx=DistContext(), dataset=_Embedded(x, labels), amp_dtype=None, channels_last=False,
                          parts=SimpleNamespace(head=ShardedMarginHead(D, C, subcenters=K), module=torch.nn.Identity()))
    cfg = TrainConfig(head_init="imprint", seed=seed, eval_batch_size=4, num_workers=0)
    rows = new_head_rows(run, cfg, kept)(range(kept, C))
    assert rows.shape == (C - kept, K, D)
    random = init_rows(kept * K, C * K, D, seed).view(C - kept, K, D)
    for c in range(kept, C):
        own = x[[i for i, y in enumerate(labels) if y == c]].double()
        if len(own):
            imprint = F.normalize(F.normalize(own, dim=1).sum(0), dim=0)
            torch.testing.assert_close(rows[c - kept].double(), imprint + random[c - kept].double(), rtol=0, atol=1e-6)
        else:
            assert torch.equal(rows[c - kept], random[c - kept])  # no image: the random centres
        assert len({tuple(centre.tolist()) for centre in rows[c - kept]}) == K  # K different centres


@pytest.mark.parametrize("sample_rate", [0.5, 1.0], ids=["row-sparse", "torch"])
def test_resume_with_more_identities_under_adamw_continues_the_step_count_on_the_new_rows(tmp_path: Path, sample_rate):
    """A Partial FC run (the row-sparse AdamW: a step count per row) resumed on a dataset with more
    identities: the new rows' count is the one every old row shares, as torch's AdamW over the grown
    head has it, whichever optimizer the resumed run builds. Before, it was 0: the row-sparse AdamW
    then bias-corrected their first step as a first step, and torch's AdamW (``--sample-rate 1``)
    refused the state as a lazy one ("differs between rows")."""
    out = tmp_path / "run"
    first = train_cli.run(tiny_config(out, nproc=1, max_steps=2, eval_every=0, ckpt_every=0, optimizer="adamw",
                                      sample_rate=0.5))
    cfg = tiny_config(out, nproc=1, synthetic_identities=30, optimizer="adamw", sample_rate=sample_rate)
    parts, state = load_parts(cfg, Path(first["checkpoint"]))
    opt_state = parts.opt_head.state[parts.head.weight]
    assert state.step == 2 and parts.head.num_classes == 30
    if sample_rate < 1:
        assert torch.equal(opt_state["row_step"], torch.full((30,), 2.0, dtype=torch.float64))
    else:
        assert isinstance(parts.opt_head, torch.optim.AdamW) and float(opt_state["step"]) == 2.0
    assert not opt_state["exp_avg"][24:].any() and opt_state["exp_avg"][:24].any()
