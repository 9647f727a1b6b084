"""A backbone saved per stage: exact moves 2 -> 4 stages and to the unsplit model, reading only the
files a stage needs, replicas that must agree, a save killed mid-way; and on small hand-made parts
each refusal in full, what a part's description holds, the replicas' digest, the check of every
rank's parts and the reading back of chosen keys."""

from __future__ import annotations

import re
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
import torch

from shardfc import checkpoint as ck
from shardfc.checkpoint import (
    CheckpointError,
    StagePart,
    optimizer_by_index,
    optimizer_by_name,
    read_stage_state,
    save_checkpoint,
    verify_checkpoint,
)
from shardfc.checkpoint.load import COMPARE_BUDGET
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


# --------------------------------------------------------------------------- small hand-made parts

SMALL_HEAD = dict(head_tensors={"weight": torch.ones(2, 1)}, class_range=range(2), num_classes=2, fingerprint={})
KEYS = ["a", "bn", "b", "c"]  # bn: a buffer, not a parameter
PARAMS = ["a", "b", "c"]


def _part(index: int = 0, keys=("a", "bn"), writes: bool = True, **changes: Any) -> StagePart:
    params = [k for k in keys if k != "bn"]
    model = {k: torch.full((2,), float(KEYS.index(k))) for k in keys}
    optimizer = {"state": {n: {"momentum_buffer": torch.full((2,), 10.0 + i)} for i, n in enumerate(params)},
                 "param_groups": [{"lr": 0.1, "params": params}]}
    return StagePart(**{**dict(index=index, model=model, optimizer=optimizer, all_keys=KEYS, all_params=PARAMS,
                               writes=writes), **changes})


def _refused(part: Any, message: str) -> None:
    with pytest.raises(ValueError, match="^" + re.escape(message) + "$"):
        prepare_part(part, "p")


def test_optimizer_state_by_name_and_back_for_any_subset():
    sd = {"state": {0: {"m": 1}, 2: {"m": 3}}, "param_groups": [{"lr": 1, "params": [0, 1]}, {"lr": 2, "params": [2]}]}
    by_name = optimizer_by_name(sd, ["x", "y", "z"])
    assert by_name == {"state": {"x": {"m": 1}, "z": {"m": 3}},
                       "param_groups": [{"lr": 1, "params": ["x", "y"]}, {"lr": 2, "params": ["z"]}]}
    assert optimizer_by_index(by_name, ["x", "y", "z"]) == sd
    # Another order and a subset: indices in the new order, a group left empty dropped.
    assert optimizer_by_index(by_name, ["z", "x"]) == {"state": {0: {"m": 3}, 1: {"m": 1}},
                                                        "param_groups": [{"lr": 1, "params": [1]}, {"lr": 2, "params": [0]}]}
    assert optimizer_by_index(by_name, ["y"]) == {"state": {}, "param_groups": [{"lr": 1, "params": [0]}]}
    with pytest.raises(CheckpointError, match=r"^the saved optimizer state has no parameter group for \['w'\]$"):
        optimizer_by_index(by_name, ["x", "w"])
    with pytest.raises(CheckpointError, match=r"^the saved optimizer state has no parameter group for \['a', 'b', 'c', 'd', 'e'\]$"):
        optimizer_by_index(by_name, list("xabcdef"))  # the first five named


def test_a_part_is_described_and_compacted():
    whole = torch.arange(4.0)
    part = _part(model={"a": whole[2:], "bn": torch.zeros(2)},
                 optimizer={"state": {"a": {"m": [whole[:2], (whole[1:3],)]}}, "param_groups": [{"lr": 0.1, "params": ["a"]}]})
    info, payload = prepare_part(part, "p")
    assert info == {"index": 0, "writes": True, "keys": ["a", "bn"], "params": ["a"], "digest": info["digest"],
                    "all_keys": KEYS, "all_params": PARAMS}
    assert re.fullmatch("[0-9a-f]{64}", info["digest"])
    assert payload["model"]["a"].untyped_storage().nbytes() == 8  # its own two elements, not the view's storage
    m = payload["optimizer"]["state"]["a"]["m"]
    assert type(m) is list and type(m[1]) is tuple and m[0].untyped_storage().nbytes() == 8
    assert m[1][0].untyped_storage().nbytes() == 8 and payload["optimizer"]["param_groups"] == [{"lr": 0.1, "params": ["a"]}]
    assert prepare_part(_part(writes=0), "p")[0]["writes"] is False


def test_the_digest_holds_the_parameters_and_their_optimizer_state_only():
    digest = prepare_part(_part(), "p")[0]["digest"]
    same = [_part(model={"a": torch.full((2,), 0.0), "bn": torch.ones(2)}),  # a buffer is not compared
            _part(optimizer={"param_groups": [{"params": ["a"], "lr": 0.1}], "state": {"a": {"momentum_buffer": torch.full((2,), 10.0)}}})]
    for part in same:
        assert prepare_part(part, "p")[0]["digest"] == digest
    other = [_part(model={"a": torch.full((2,), 1.0), "bn": torch.zeros(2)}),
             _part(model={"a": torch.full((2,), 0.0, dtype=torch.float64), "bn": torch.zeros(2)}),
             _part(model={"a": torch.full((1, 2), 0.0), "bn": torch.zeros(2)}),
             _part(model={"a": torch.zeros(0), "bn": torch.zeros(2)}),
             _part(optimizer={"state": {"a": {"momentum_buffer": torch.full((2,), 11.0)}}, "param_groups": [{"lr": 0.1, "params": ["a"]}]}),
             _part(optimizer={"state": {"a": {"other_buffer": torch.full((2,), 10.0)}}, "param_groups": [{"lr": 0.1, "params": ["a"]}]}),
             _part(optimizer={"state": {}, "param_groups": [{"lr": 0.2, "params": ["a"]}]}),
             _part(optimizer={"state": {"a": {"momentum_buffer": torch.full((2,), 10.0)}},
                              "param_groups": [{"lr": 0.2, "params": ["a"]}]}),  # a hyperparameter alone
             _part(optimizer={"state": {}, "param_groups": [{"lr": 0.1, "params": ["a"]}, {"lr": 0.1, "params": []}]}),
             _part(optimizer={"state": {}, "param_groups": [{"lr": 0.1, "params": ["a"]}], "x": 1})]
    # Keys of several types (plain data allows them below the top level) are ordered by their repr.
    mixed = _part(optimizer={"state": {}, "param_groups": [{"lr": 0.1, 0: "x", "params": ["a"]}]})
    assert prepare_part(mixed, "p")[0]["digest"] != digest
    digests = {prepare_part(part, "p")[0]["digest"] for part in other if part.optimizer.keys() == {"state", "param_groups"}}
    assert digest not in digests and len(digests) == len(other) - 1


def test_a_bad_part_is_refused_naming_it():
    _refused("x", "p must be a StagePart, got str")
    _refused(_part(index=-1), "p.index must be an int >= 0, got -1")
    _refused(_part(model={1: torch.zeros(1)}), "p.model keys must be str, got 1")
    _refused(_part(model={"a": [0.0]}), "p.model['a'] must be a torch.Tensor, got list")
    _refused(_part(optimizer=[]), "p.optimizer must be a dict, got list")
    _refused(_part(optimizer={"state": {}}), "p.optimizer must have the keys 'state' and 'param_groups', got ['state']")
    _refused(_part(optimizer={"state": {}, "param_groups": [], "x": 1}),
             "p.optimizer must have the keys 'state' and 'param_groups', got ['param_groups', 'state', 'x']")
    _refused(_part(optimizer={"state": {"a": 1, "z": 1}, "param_groups": [{"params": ["a", "y"]}]}),
             "p.optimizer names parameters that are not the stage's: ['y', 'z']")
    _refused(_part(all_keys=["a"], all_params=["b"]), "p holds keys the whole model does not have: ['bn', 'a']")
    with pytest.raises(ValueError, match=re.escape("p.optimizer['param_groups'][0]['x'] is a object; ")):
        prepare_part(_part(optimizer={"state": {}, "param_groups": [{"params": ["a"], "x": object()}]}), "p")
    _refused(_part(optimizer={"state": dict.fromkeys("stuvwz", 1), "param_groups": [{"params": ["a"]}]}),
             "p.optimizer names parameters that are not the stage's: ['s', 't', 'u', 'v', 'w']")  # the first five
    _refused(_part(model={k: torch.zeros(1) for k in "abcdef"}, optimizer={"state": {}, "param_groups": []}, all_keys=[]),
             "p holds keys the whole model does not have: ['a', 'b', 'c', 'd', 'e']")


def _info(index: int, keys: list[str], writes: bool = True, digest: str = "d", **changes: Any) -> dict[str, Any]:
    return {"index": index, "writes": writes, "keys": keys, "params": [k for k in keys if k != "bn"], "digest": digest,
            "all_keys": KEYS, "all_params": PARAMS, **changes}


def _check_refused(infos: list, message: str) -> None:
    with pytest.raises(ValueError, match="^" + re.escape(message) + "$"):
        check_parts(infos)


def test_every_ranks_parts_checked_together():
    s0, s1 = _info(0, ["a", "bn"]), _info(1, ["b", "c"])
    assert check_parts([None, [], None]) is None
    expected = {"keys": KEYS, "params": PARAMS, "files": {"backbone_stage0.pt": {"keys": ["a", "bn"], "params": ["a"]},
                                                        "backbone_stage1.pt": {"keys": ["b", "c"], "params": ["b", "c"]}}}
    assert check_parts([[s1], None, [s0], [_info(0, ["a", "bn"], writes=False)]]) == expected
    _check_refused([[s0], [_info(1, ["b", "c"], all_keys=["x"])]], "rank 1's stage part describes another model than rank 0's")
    _check_refused([None, [s0], [_info(1, ["b", "c"], all_params=["x"])]],
                   "rank 2's stage part describes another model than rank 1's")
    _check_refused([[s0, s1], [_info(2, [], writes=False)]], "stage 2 (rank 1) is written by no rank")
    _check_refused([[s0, s1], [_info(1, ["b", "c"], digest="e", writes=False)]],
                   "rank 1 and rank 0 hold stage 1 with different parameters or optimizer state: its replicas have "
                   "diverged, so no checkpoint of it is written")
    _check_refused([[s0, s1], [_info(1, ["c", "b"], writes=False)]],
                   "rank 1 and rank 0 hold stage 1 with different parameters or optimizer state: its replicas have "
                   "diverged, so no checkpoint of it is written")
    _check_refused([[s0, _info(2, ["b", "c"])]], "the stages saved are [0, 2]; expected 0 to 1")
    _check_refused([[_info(1, ["b", "c"]), _info(2, ["a", "bn"])]], "the stages saved are [1, 2]; expected 0 to 1")
    _check_refused([[s0, _info(1, ["b", "c", "a"])]], "the stages' keys do not tile the model's: held twice ['a'], by none []")
    _check_refused([[s0, _info(1, ["b", "c"], params=["b"])]],
                   "the stages' params do not tile the model's: held twice [], by none ['c']")
    many = dict(all_keys=list("abcdefghijkl"), all_params=[], params=[])  # the first five of each named
    _check_refused([[_info(0, list("abcdef"), **many), _info(1, list("abcdef"), **many)]],
                   "the stages' keys do not tile the model's: held twice ['a', 'b', 'c', 'd', 'e'], "
                   "by none ['g', 'h', 'i', 'j', 'k']")


@pytest.fixture
def saved(tmp_path: Path) -> tuple[Path, dict[str, Any]]:
    groups = lambda params: [{"lr": 0.1, "params": params[:1]}, {"lr": 0.2, "params": params[1:]}]  # noqa: E731
    parts = [_part(0, optimizer={"state": {"a": {"m": torch.ones(1)}}, "param_groups": groups(["a"])}),
             _part(1, ("b", "c"), optimizer={"state": {"c": {"m": torch.zeros(1)}}, "param_groups": groups(["b", "c"])})]
    path = save_checkpoint(tmp_path, 1, common=None, per_rank=None, stage_parts=parts, **SMALL_HEAD)
    return path, verify_checkpoint(path)


def test_chosen_keys_and_parameters_read_back_in_the_models_order(saved):
    path, meta = saved
    model, opt = read_stage_state(path, meta, ["c", "a"], ["c", "a"])
    assert list(model) == ["a", "c"] and [t.tolist() for t in model.values()] == [[0.0, 0.0], [3.0, 3.0]]
    assert opt == {"state": {"a": {"m": torch.ones(1)}, "c": {"m": torch.zeros(1)}},
                   "param_groups": [{"lr": 0.1, "params": ["a"]}, {"lr": 0.2, "params": ["c"]}]}
    model, opt = read_stage_state(path, meta, ["bn"], [])  # a buffer alone: stage 0's file only
    assert list(model) == ["bn"] and opt == {"state": {}, "param_groups": [{"lr": 0.1, "params": []}, {"lr": 0.2, "params": []}]}
    model, opt = read_stage_state(path, meta, [], ["b"])  # a parameter's optimizer state without its weight
    assert model == {} and opt["param_groups"] == [{"lr": 0.1, "params": ["b"]}, {"lr": 0.2, "params": []}]
    assert list(read_stage_state(path, meta)[0]) == KEYS


def test_stage_files_that_do_not_match_meta_json_are_refused(saved):
    path, meta = saved
    with pytest.raises(CheckpointError, match=f"^{re.escape(str(path))} holds no per-stage backbone "
                                              r"\(its common\.pt holds it whole\)$"):
        read_stage_state(path, {k: v for k, v in meta.items() if k != "backbone_stages"})
    with pytest.raises(CheckpointError, match=re.escape(f"the backbone saved in {path} has no ['z', 'y'] (another architecture?)")):
        read_stage_state(path, meta, ["z", "a"], ["y"])
    with pytest.raises(CheckpointError, match=re.escape("has no ['d', 'e', 'f', 'g', 'h'] (another")):
        read_stage_state(path, meta, list("adefghi"))  # the first five named
    stages = meta["backbone_stages"]
    wider = {**meta, "backbone_stages": {**stages, "keys": [*stages["keys"], "d"]}}
    with pytest.raises(CheckpointError, match=re.escape(f"{path}'s stage files hold no ['d']")):
        read_stage_state(path, wider, ["d", "a"])
    wider = {**meta, "backbone_stages": {**stages, "keys": [*stages["keys"], *"defghi"]}}
    with pytest.raises(CheckpointError, match=re.escape(f"{path}'s stage files hold no ['d', 'e', 'f', 'g', 'h']")):
        read_stage_state(path, wider)
    files = dict(stages["files"], **{"backbone_stage1.pt": {"keys": ["c", "b"], "params": ["b", "c"]}})
    with pytest.raises(CheckpointError, match=re.escape(f"{path / 'backbone_stage1.pt'} does not hold the stage part")):
        read_stage_state(path, {**meta, "backbone_stages": {**stages, "files": files}})


def test_stage_files_with_other_numbers_of_parameter_groups_are_refused(tmp_path: Path):
    parts = [_part(0), _part(1, ("b", "c"), optimizer={"state": {}, "param_groups": [{"params": ["b"]}, {"params": ["c"]}]})]
    path = save_checkpoint(tmp_path, 1, common=None, per_rank=None, stage_parts=parts, **SMALL_HEAD)
    with pytest.raises(CheckpointError, match="^" + re.escape(f"{path / 'backbone_stage1.pt'} has 2 parameter groups, "
                                                               "another stage file 1") + "$"):
        read_stage_state(path, verify_checkpoint(path))


def test_a_stage_file_changed_in_one_bit_is_refused_by_default(saved):
    path, meta = saved
    f = path / "backbone_stage1.pt"
    data = bytearray(f.read_bytes())
    data[data.find(torch.full((2,), 2.0).numpy().tobytes()) + 3] ^= 1  # b's value, same size
    f.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match=re.escape(f"checkpoint file {f} is corrupt: sha256 ")):
        read_stage_state(path, meta)


def test_stage_files_are_read_on_the_cpu_memory_mapped_weights_only_and_verified_by_default(saved, monkeypatch):
    """What ``read_stage_state`` asks of each file: the CPU as its map location, a memory map (a
    stage's file is read for the few keys a rank holds), pickles refused unless trusted, the sha256
    checked — and ``verify``/``trust_pickle`` passed on when given."""
    path, meta = saved
    asked = []
    real = ck.stages.load_file
    monkeypatch.setattr(ck.stages, "load_file", lambda *a, **k: asked.append((a[3:], k)) or real(*a, **k))
    read_stage_state(path, meta)
    assert asked and all(args == ("cpu", True, False) and kw == {"mmap": True} for args, kw in asked), asked
    asked.clear()
    read_stage_state(path, meta, verify=False, trust_pickle=True)
    assert asked and all(args == ("cpu", False, True) for args, _ in asked), asked


@pytest.mark.parametrize("saved, shaped", [
    ({"state": {}, "param_groups": [{"params": ["a"]}, {"params": []}]}, True),
    ({"state": {}, "param_groups": []}, True),
    ([], False),  # not a dict
    ({"state": [], "param_groups": []}, False),  # its state not a dict
    ({"param_groups": []}, False),  # no state
    ({"state": {}, "param_groups": {}}, False),  # its groups not a list
    ({"state": {}}, False),  # no groups
    ({"state": {}, "param_groups": [{"params": ["a"]}, ["a"]]}, False),  # a group not a dict
    ({"state": {}, "param_groups": [{"params": ("a",)}]}, False),  # a group's params not a list
    ({"state": {}, "param_groups": [{"params": ["a"]}, {"lr": 0.1}]}, False),  # a group without params
])
def test_only_an_optimizer_state_by_name_is_taken_for_one(saved, shaped):
    """A stage file's ``optimizer`` part is read only if it has the shape ``_merge_groups`` reads."""
    assert ck.stages._optimizer_shaped(saved) is shaped


def test_parameter_groups_too_large_to_compare_are_refused_naming_the_stage_file():
    """Two stages' group hyperparameters holding more values than ``objects_equal`` visits: the
    refusal names the stage file whose group was being merged."""
    where = Path("ckpt") / "backbone_stage1.pt"
    big = list(range(COMPARE_BUDGET))  # with the group dict and its key, past the budget
    groups = [{"lr": 0.1, "betas": big, "params": ["a"]}]
    saved = [{"lr": 0.1, "betas": list(big), "params": ["b"]}]
    with pytest.raises(CheckpointError) as error:
        ck.stages._merge_groups(groups, saved, {"b"}, where)
    assert str(error.value) == (f"the parameter groups of {where} are too large to compare "
                                f"(more than {COMPARE_BUDGET} values)")
    assert groups[0]["params"] == ["a"]  # nothing merged
