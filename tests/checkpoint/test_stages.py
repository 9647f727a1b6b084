"""A backbone saved per stage: exact moves 2 -> 4 stages and to the unsplit model, reading only the
files a stage needs, replicas that must agree, a save killed mid-way."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from shardfc import checkpoint as ck
from shardfc.checkpoint import StagePart, optimizer_by_index, optimizer_by_name, read_stage_state, save_checkpoint
from shardfc.checkpoint.stages import check_parts, prepare_part
from shardfc.models import build_backbone
from shardfc.parallel.model_split import stages as cut_stages

TWO = ["layer2"]
TINY = ["body"]
FOUR = ["layer1", "layer2.0", "layer3"]
HEAD = dict(head_tensors={"weight": torch.ones(3, 2)}, class_range=range(3), num_classes=3, fingerprint={})


def _trained(name="iresnet18"):
    """``name`` after one SGD step with momentum: every parameter has optimizer state."""
    torch.manual_seed(0)
    model = build_backbone(name, 8, **({"input_size": (16, 16)} if name == "tiny" else {}))
    names = [n for n, p in model.named_parameters() if p.requires_grad]
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1, momentum=0.9)
    for p in model.parameters():  # distinct gradients without a forward
        p.grad = torch.randn_like(p)
    opt.step()
    return model, names, opt


def _parts(model, names, opt, points, writes=True):
    by_name = optimizer_by_name(opt.state_dict(), names)
    parts = []
    for i, stage in enumerate(cut_stages(model, points)):
        mine = [n for n, p in stage.named_parameters() if p.requires_grad]
        optimizer = {"state": {n: by_name["state"][n] for n in mine},
                     "param_groups": [dict(g, params=[n for n in g["params"] if n in mine]) for g in by_name["param_groups"]]}
        parts.append(StagePart(i, stage.state_dict(), optimizer, list(model.state_dict()), names, writes))
    return parts


def test_two_stages_load_as_four_and_whole_exactly(tmp_path, monkeypatch):
    model, names, opt = _trained()
    path = save_checkpoint(tmp_path, 1, common={}, per_rank=None, stage_parts=_parts(model, names, opt, TWO), **HEAD)
    meta = ck.verify_checkpoint(path)
    assert sorted(meta["backbone_stages"]["files"]) == ["backbone_stage0.pt", "backbone_stage1.pt"]
    assert meta["format_version"] == 3  # a shardfc that cannot read stage files refuses it by its version
    whole, saved_opt = model.state_dict(), opt.state_dict()

    opened = []
    real = ck.stages.load_file
    monkeypatch.setattr(ck.stages, "load_file", lambda p, f, *a, **k: opened.append(f) or real(p, f, *a, **k))
    for i, stage in enumerate(cut_stages(model, FOUR)):  # the 4-stage layout: each reads its slice
        opened.clear()
        keys = list(stage.state_dict())
        mine = [n for n, p in stage.named_parameters() if p.requires_grad]
        got, by_name = read_stage_state(path, meta, keys, mine)
        assert list(got) == keys and all(torch.equal(got[k], whole[k]) for k in keys)
        # 4-stage stage 2 is layer2.1 (saved in 2-stage stage 0) and layer3 (stage 1): it reads both
        assert opened == [["backbone_stage0.pt"], ["backbone_stage0.pt"], ["backbone_stage0.pt", "backbone_stage1.pt"],
                          ["backbone_stage1.pt"]][i]
        restored = optimizer_by_index(by_name, mine)
        assert len(restored["param_groups"][0]["params"]) == len(mine)
        for j, n in enumerate(mine):
            assert torch.equal(restored["state"][j]["momentum_buffer"], saved_opt["state"][names.index(n)]["momentum_buffer"])

    got, by_name = read_stage_state(path, meta)  # the unsplit model (ddp): every file, its order
    assert list(got) == list(whole) and all(torch.equal(got[k], v) for k, v in whole.items())
    model.load_state_dict(got)
    opt2 = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1, momentum=0.9)
    opt2.load_state_dict(optimizer_by_index(by_name, names))
    assert str(opt2.state_dict()) == str(saved_opt)


def test_parts_must_tile_the_model_and_replicas_agree():
    model, names, opt = _trained("tiny")
    parts = _parts(model, names, opt, TINY)
    infos = [prepare_part(p, "part")[0] for p in parts]
    assert check_parts([infos])["files"]["backbone_stage1.pt"]["keys"][0].startswith("fc")
    replica = prepare_part(StagePart(**{**vars(parts[1]), "writes": False}), "part")[0]
    assert check_parts([infos, [replica]]) is not None  # an equal replica verifies
    with torch.no_grad():
        next(iter(parts[1].model.values())).add_(1e-7)  # a parameter of stage 1 (a view of the model's)
    diverged = prepare_part(StagePart(**{**vars(parts[1]), "writes": False}), "part")[0]
    with pytest.raises(ValueError, match="rank 1 and rank 0 hold stage 1 with different parameters"):
        check_parts([infos, [diverged]])
    with pytest.raises(ValueError, match="stage 1 is written by ranks 0 and 1"):
        check_parts([infos, [infos[1]]])
    with pytest.raises(ValueError, match=r"keys do not tile the model's: held twice \[\], by none \['fc"):
        check_parts([infos[:1]])


def test_save_killed_mid_save_leaves_the_previous(tmp_path):
    model, names, opt = _trained("tiny")
    save_checkpoint(tmp_path, 1, common={}, per_rank=None, stage_parts=_parts(model, names, opt, TINY), **HEAD)
    # The process dies after the first stage file is written: before meta.json and the rename.
    script = textwrap.dedent(
        f"""
        import os, sys, torch
        sys.path.insert(0, {str(Path(__file__).parent)!r})
        import shardfc.checkpoint.save as save
        from test_stages import _trained, _parts, HEAD, TINY
        real = save.save_durable
        save.save_durable = lambda obj, path: os._exit(17) if path.name == "backbone_stage1.pt" else real(obj, path)
        model, names, opt = _trained("tiny")
        save.save_checkpoint({str(tmp_path)!r}, 2, common={{}}, per_rank=None,
                             stage_parts=_parts(model, names, opt, TINY), **HEAD)
        """
    )
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 17, proc.stderr
    assert ck.latest_checkpoint(tmp_path) == tmp_path / "step_00000001"
    assert ck.find_checkpoints(tmp_path) == [tmp_path / "step_00000001"]


def test_bad_stage_parts_are_named(tmp_path):
    model, names, opt = _trained("tiny")
    parts = _parts(model, names, opt, TINY)
    with pytest.raises(ValueError, match=r"stage_parts\[0\] must be a StagePart, got str"):
        save_checkpoint(tmp_path, 1, common={}, per_rank=None, stage_parts=["backbone"], **HEAD)
    with pytest.raises(ValueError, match="no rank passed a head shard"):
        save_checkpoint(tmp_path, 1, common={}, per_rank=None, stage_parts=parts, fingerprint={})
    stray = StagePart(**{**vars(parts[0]), "optimizer": {"state": {}, "param_groups": [{"params": ["fc.weight"]}]}})
    with pytest.raises(ValueError, match=r"stage_parts\[0\]\.optimizer names parameters that are not the stage's"):
        save_checkpoint(tmp_path, 1, common={}, per_rank=None, stage_parts=[stray, parts[1]], **HEAD)
    assert not list(tmp_path.iterdir())  # refused before anything was written


def test_a_replica_differing_in_any_parameter_or_its_optimizer_state_is_found():
    model, names, opt = _trained("tiny")
    parts = _parts(model, names, opt, TINY)
    infos = [prepare_part(p, "part")[0] for p in parts]
    tried = 0
    for part in parts:
        params = [n for g in part.optimizer["param_groups"] for n in g["params"]]
        assert len(params) >= 2  # so that "the last one" is not also "the first one"
        for name in params:
            bumped = {**part.model, name: part.model[name] + 1e-7 * part.model[name].abs().max()}
            momentum = dict(part.optimizer["state"][name], momentum_buffer=part.optimizer["state"][name]["momentum_buffer"]
                            * (1 + 1e-6))
            optimizer = {**part.optimizer, "state": {**part.optimizer["state"], name: momentum}}
            for changed in (StagePart(**{**vars(part), "model": bumped, "writes": False}),
                            StagePart(**{**vars(part), "optimizer": optimizer, "writes": False})):
                replica = prepare_part(changed, "part")[0]
                with pytest.raises(ValueError, match=f"hold stage {part.index} with different parameters"):
                    check_parts([infos, [replica]])
                tried += 1
    assert tried == 2 * len(names)


def test_stage_files_with_other_optimizer_hyperparameters_are_refused(tmp_path):
    model, names, opt = _trained("tiny")
    parts = _parts(model, names, opt, TINY)
    groups = [dict(g, lr=0.2) for g in parts[1].optimizer["param_groups"]]  # stage 0's say 0.1
    parts[1] = StagePart(**{**vars(parts[1]), "optimizer": {**parts[1].optimizer, "param_groups": groups}})
    path = save_checkpoint(tmp_path, 1, common={}, per_rank=None, stage_parts=parts, **HEAD)
    meta = ck.verify_checkpoint(path)
    with pytest.raises(ck.CheckpointError, match=r"backbone_stage1\.pt's parameter group 0 has other hyperparameters"):
        read_stage_state(path, meta)
    keys = list(cut_stages(model, TINY)[0].state_dict())
    assert list(read_stage_state(path, meta, keys, [n for n in names if n in keys])[0]) == keys  # stage 0 alone reads
