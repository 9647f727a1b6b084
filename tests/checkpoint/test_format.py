"""``meta.json``'s structure (:mod:`shardfc.checkpoint.format`): a hand-made meta of two ranks, then
each field broken in turn and refused; the file names it lists and a per-stage backbone's partition
of its keys and parameters, each refusal in full."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest

from shardfc.checkpoint import CheckpointError
from shardfc.checkpoint import format as F


def _meta(**changes):
    meta = {
        "step": 5, "num_classes": 6, "world_size": 2, "class_ranges": [[0, 3], [3, 6]],
        "files": {"common.pt": {"size": 1, "sha256": "ab"}, "head_0.pt": {"size": 2}, "head_1.pt": {"size": 3},
                  "backbone_stage0.pt": {"size": 4, "keys": ["a"], "params": ["p"]},
                  "backbone_stage1.pt": {"size": 5, "keys": ["b"]}},
        "head_tensors": {}, "fingerprint": {},
        "backbone_stages": {"keys": ["a", "b"], "params": ["p"],
                            "files": {"backbone_stage0.pt": {"keys": ["a"], "params": ["p"]},
                                      "backbone_stage1.pt": {"keys": ["b"]}}},
    }
    meta.update(changes)
    return meta


def _with(path, value):
    """``_meta()`` with the item at ``path`` (keys and indices) set to ``value``, or removed for
    ``value`` ``...``."""
    meta = copy.deepcopy(_meta())
    *parents, last = path
    node = meta
    for key in parents:
        node = node[key]
    if value is ...:
        del node[last]
    else:
        node[last] = value
    return meta


BROKEN = [
    (("step",), "5"), (("step",), ...), (("num_classes",), 6.0), (("world_size",), "2"), (("world_size",), 3),
    (("class_ranges",), ((0, 3), (3, 6))), (("class_ranges",), [[0, 6]]), (("files",), []),
    (("head_tensors",), []), (("fingerprint",), []), (("fingerprint",), ...), (("files", "common.pt"), ...),
    (("files", "head_1.pt"), ...), (("files", "head_0.pt"), 2), (("files", "head_0.pt", "size"), "2"),
    (("files", "head_0.pt", "size"), ...),
    (("backbone_stages", "keys"), "ab"), (("backbone_stages", "params"), ("p",)), (("backbone_stages", "keys"), ...),
    (("backbone_stages", "files", "backbone_stage2.pt"), {"keys": []}),  # a stage file not among the files
    (("backbone_stages", "files", "backbone_stage1.pt", "keys"), "b"),
    (("backbone_stages", "files", "backbone_stage1.pt", "keys"), ...),
    (("class_ranges",), [[0, 3], [4, 6]]), (("class_ranges",), [[1, 3], [3, 6]]), (("class_ranges",), [[0, 3], [3, 5]]),
    (("class_ranges",), [[0, 3.0], [3.0, 6]]), (("class_ranges",), [[0, 3, 4], [3, 6]]), (("class_ranges",), [[0, 3], 3]),
]


def test_a_well_formed_meta_and_each_field_broken():
    assert F._well_formed(_meta()) and F._well_formed({k: v for k, v in _meta().items() if k != "backbone_stages"})
    assert F._well_formed(_meta(world_size=3, class_ranges=[[0, 3], [3, 3], [3, 6]],
                                files={**_meta()["files"], "head_2.pt": {"size": 0}}))  # an empty range
    for path, value in BROKEN:
        assert not F._well_formed(_with(path, value)), (path, value)
    # a range that ends before it starts, the next one starting there
    assert not F._well_formed(_meta(world_size=3, class_ranges=[[0, 3], [3, 2], [2, 6]],
                                    files={**_meta()["files"], "head_2.pt": {"size": 0}}))


def _refusal(meta):
    with pytest.raises(CheckpointError) as err:
        F._check_names(meta, Path("m"))
    return str(err.value)


def test_the_files_meta_names_and_the_stages_partition():
    F._check_names(_meta(), Path("m"))
    files = {**_meta()["files"], "../common.pt": {"size": 1}}
    assert _refusal(_meta(files=files)) == (
        "m lists the file '../common.pt', which is not a name shardfc writes (common.pt, head_<r>.pt, rank_<r>.pt, "
        "backbone_stage<i>.pt, directly in the checkpoint folder)")
    stages = copy.deepcopy(_meta()["backbone_stages"])
    stages["files"]["stage.pt"] = {"keys": []}
    assert _refusal(_meta(backbone_stages=stages)).startswith("m lists the file 'stage.pt', which is not a name")
    assert _refusal(_meta(files={**_meta()["files"], 3: {"size": 1}})).startswith("m lists the file 3, which")

    def stages_with(**files):
        s = copy.deepcopy(_meta()["backbone_stages"])
        for name, entry in files.items():
            s["files"][name + ".pt"] = entry
        return _meta(backbone_stages=s)

    assert _refusal(stages_with(backbone_stage1={"keys": "b"})) == "m: backbone_stages backbone_stage1.pt keys is not a list of names"
    assert _refusal(stages_with(backbone_stage1={"keys": ["b"], "params": [1]})) == (
        "m: backbone_stages backbone_stage1.pt params is not a list of names")
    assert _refusal(stages_with(backbone_stage1={"keys": ["b", "a"]})) == (
        "m: backbone_stages lists key 'a' in both backbone_stage0.pt and backbone_stage1.pt")
    assert _refusal(stages_with(backbone_stage1={"keys": ["b"], "params": ["p"]})) == (
        "m: backbone_stages lists param 'p' in both backbone_stage0.pt and backbone_stage1.pt")
    assert _refusal(stages_with(backbone_stage1={"keys": []})) == (
        "m: the stage files' keys do not partition the recorded ones: held by no file ['b'], not recorded []")
    assert _refusal(stages_with(backbone_stage1={"keys": ["b", "c"]})) == (
        "m: the stage files' keys do not partition the recorded ones: held by no file [], not recorded ['c']")
    recorded = copy.deepcopy(_meta()["backbone_stages"])
    recorded["keys"] = ["a", "b", "b"]
    assert _refusal(_meta(backbone_stages=recorded)).startswith("m: the stage files' keys do not partition")
    recorded["keys"] = ["a", "b", 1]
    assert _refusal(_meta(backbone_stages=recorded)).startswith("m: the stage files' keys do not partition")


def test_read_meta_names_the_meta_file_in_each_refusal(tmp_path: Path, monkeypatch):
    step = tmp_path / "step_00000005"
    step.mkdir()
    meta_path = step / "meta.json"
    meta_path.write_text("{not json")
    with pytest.raises(CheckpointError, match=r"^" + str(meta_path).replace(".", r"\.") + r" is not JSON: "):
        F.read_meta(step)
    meta_path.unlink()
    meta_path.symlink_to(tmp_path / "elsewhere.json")
    (tmp_path / "elsewhere.json").write_text("{}")
    with pytest.raises(CheckpointError) as err:
        F.read_meta(step)
    assert str(err.value) == f"refusing to read checkpoint meta file {meta_path}: it is a symlink, not a regular file"
    meta_path.unlink()
    monkeypatch.setattr(F, "META_MAX_BYTES", 1 << 20)
    body = '{"format": "other"}'
    meta_path.write_text(body + " " * ((1 << 20) - len(body)))  # at the limit: read
    with pytest.raises(CheckpointError, match=r"is not a shardfc-checkpoint meta file$"):
        F.read_meta(step)
    meta_path.write_text(body + " " * ((1 << 20) + 1 - len(body)))  # past it: refused unread
    with pytest.raises(CheckpointError) as err:
        F.read_meta(step)
    assert str(err.value) == f"{meta_path} is larger than 1 MiB: not a shardfc meta file"


def test_the_embedding_dim_is_the_weights_row_width_else_the_first_tensors():
    assert F._embedding_dim({"a": {"row_shape": [3]}, "weight": {"row_shape": [4, 5]}}) == 5
    assert F._embedding_dim({"c": {"row_shape": [2, 7]}, "b": {"row_shape": []}}) == 7
    assert F._embedding_dim({"weight": {"row_shape": []}, "a": {"row_shape": [3]}}) == 3
    assert F._embedding_dim({"b": {"row_shape": []}}) is None and F._embedding_dim({}) is None


def test_build_meta_records_the_version_torch_and_the_time():
    import time

    import torch

    kwargs = dict(step=1, num_classes=4, class_ranges=[(0, 4)], specs={"weight": {"dtype": "float32", "row_shape": [2]}},
                  extras=[], fingerprint={}, files={"head_0.pt": {"size": 1}, "common.pt": {"size": 2}})
    before = time.time()
    meta = F.build_meta(**kwargs)
    assert meta["format_version"] == F.FORMAT_VERSION and "backbone_stages" not in meta
    assert meta["torch_version"] == torch.__version__ and before <= meta["created_unix"] <= time.time()
    assert list(meta["files"]) == ["common.pt", "head_0.pt"] and meta["embedding_dim"] == 2 and meta["world_size"] == 1
    staged = F.build_meta(**kwargs, backbone_stages={"keys": [], "params": [], "files": {}})
    assert staged["format_version"] == F.STAGED_FORMAT_VERSION != F.FORMAT_VERSION and staged["backbone_stages"]["keys"] == []


def test_read_meta_refuses_each_wrong_meta_in_full(tmp_path: Path):
    import json

    step = tmp_path / "step_00000007"
    step.mkdir()
    meta_path = step / "meta.json"

    def refusal(meta):
        meta_path.write_text(json.dumps(meta))
        with pytest.raises(CheckpointError) as err:
            F.read_meta(step)
        return str(err.value)

    good = {**_meta(step=7), "format": "shardfc-checkpoint", "format_version": 3}
    meta_path.write_text(json.dumps(good))
    assert F.read_meta(step)["step"] == 7
    assert refusal([good]) == refusal({**good, "format": "other"}) == f"{meta_path} is not a shardfc-checkpoint meta file"
    assert refusal({**good, "format_version": 99}) == f"{meta_path} has format_version=99; this shardfc reads versions 1, 2, 3"
    assert refusal({**good, "num_classes": 7}) == f"{meta_path} is malformed or does not list all of its files"
    assert refusal({**good, "files": {**good["files"], "x.pt": {"size": 1}}}).startswith(f"{meta_path} lists the file 'x.pt'")
    assert refusal({**good, "step": 5}) == f"{meta_path} records step=5 but the directory is step_00000007"


def test_regular_file_refuses_a_symlink_unless_told_to_follow_it(tmp_path: Path):
    """By default (a file a ``meta.json`` names) a symlink is refused even to a regular file; a file the
    user names may be one."""
    target = tmp_path / "target.pt"
    target.write_bytes(b"12345")
    link = tmp_path / "link.pt"
    link.symlink_to(target)
    with pytest.raises(CheckpointError) as error:
        F.regular_file(link)
    assert str(error.value) == f"refusing to read checkpoint file {link}: it is a symlink, not a regular file"
    assert F.regular_file(link, follow_symlinks=True).st_size == 5
