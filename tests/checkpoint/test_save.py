"""``save_checkpoint``'s cross-rank steps in the test's own process: ranks as threads whose collectives
meet at a barrier (the gloo tests run them in spawned ranks, which mutation testing does not see)."""

from __future__ import annotations

import json
import logging
import os
import re
from pathlib import Path
from typing import Any

import pytest
import torch

from shardfc.checkpoint import CheckpointError, StagePart, load_checkpoint, save_checkpoint, verify_checkpoint
from shardfc.checkpoint import save as S
from thread_world import ThreadWorld

FP = {"model": "m"}


def _head(rows: range, num_classes: int = 4) -> dict[str, Any]:
    w = torch.arange(num_classes * 2, dtype=torch.float32).reshape(num_classes, 2)
    return dict(head_tensors={"weight": w[rows.start : rows.stop]}, class_range=rows, num_classes=num_classes)


def _save(root: Path, rank: int, **overrides: Any) -> Path:
    kwargs: dict[str, Any] = dict(common={"c": rank}, per_rank={"r": rank}, fingerprint=FP,
                                  **_head(range(2 * rank, 2 * rank + 2)))
    kwargs.update(overrides)
    return save_checkpoint(root, 3, **kwargs)


def test_two_ranks_save_one_checkpoint_with_both_shards_and_rank_files(tmp_path: Path, monkeypatch) -> None:
    out = ThreadWorld(2).run(lambda rank: _save(tmp_path, rank), monkeypatch)
    assert out == [tmp_path / "step_00000003"] * 2
    meta = verify_checkpoint(out[0])
    assert sorted(meta["files"]) == ["common.pt", "head_0.pt", "head_1.pt", "rank_0.pt", "rank_1.pt"]
    loaded = load_checkpoint(out[0], class_range=range(4), num_classes=4, rank=1)
    assert loaded.common == {"c": 0} and loaded.per_rank == {"r": 1}
    assert torch.equal(loaded.head_tensors["weight"], torch.arange(8, dtype=torch.float32).reshape(4, 2))


def test_failed_writes_on_some_ranks_fail_every_rank_and_leaves_nothing(tmp_path: Path, monkeypatch) -> None:
    real = S.save_durable

    def save_durable(obj: Any, path: Path) -> Any:
        if path.name in ("rank_1.pt", "rank_2.pt"):
            raise OSError(f"disk full at {path.name}")
        return real(obj, path)

    monkeypatch.setattr(S, "save_durable", save_durable)
    out = ThreadWorld(3).run(lambda rank: _save(tmp_path, rank, **_head(range(2 * rank, 2 * rank + 2), 6)), monkeypatch)
    for rank in (1, 2):  # a failing rank raises its own error
        assert type(out[rank]) is OSError and str(out[rank]) == f"disk full at rank_{rank}.pt"
    assert type(out[0]) is CheckpointError
    assert str(out[0]) == (f"saving checkpoint step 3 under {tmp_path} failed on rank 1: OSError: disk full at rank_1.pt; "
                           "rank 2: OSError: disk full at rank_2.pt")
    assert list(tmp_path.iterdir()) == []  # rank 0 removed the scratch directory


def test_a_scratch_directory_that_cannot_be_made_is_the_error_raised(tmp_path: Path, monkeypatch) -> None:
    real = Path.mkdir

    def mkdir(self: Path, *args: Any, **kwargs: Any) -> None:
        if self.name.startswith(".tmp-"):
            raise OSError("no space left")
        real(self, *args, **kwargs)

    monkeypatch.setattr(Path, "mkdir", mkdir)
    # Not the error of removing the directory that was never made.
    with pytest.raises(OSError, match="^no space left$"):
        save_checkpoint(tmp_path, 1, common=None, per_rank=None, fingerprint=FP, **_head(range(4)))
    assert list(tmp_path.iterdir()) == []


def test_a_bad_argument_on_one_rank_is_a_value_error_on_every_rank(tmp_path: Path, monkeypatch) -> None:
    out = ThreadWorld(3).run(lambda rank: _save(tmp_path, rank, **_head(range(2 * rank, 2 * rank + 2), 6),
                                           **({"per_rank": [rank]} if rank else {})), monkeypatch)
    for rank in (1, 2):
        assert type(out[rank]) is ValueError and str(out[rank]) == "per_rank must be a dict or None, got list"
    assert type(out[0]) is ValueError
    assert str(out[0]) == ("save_checkpoint of step 3 failed on rank 1: per_rank must be a dict or None, got list; "
                           "rank 2: per_rank must be a dict or None, got list")
    assert list(tmp_path.iterdir()) == []


def test_any_other_failure_while_checking_is_a_checkpoint_error_on_the_others(tmp_path: Path, monkeypatch) -> None:
    real = S._prepare

    def prepare(step: Any, keep_last: Any, common: Any, per_rank: Any, *args: Any, **kwargs: Any) -> Any:
        if per_rank == {"r": 1}:  # rank 1: its copy to the host fails
            raise RuntimeError("device lost")
        return real(step, keep_last, common, per_rank, *args, **kwargs)

    monkeypatch.setattr(S, "_prepare", prepare)
    out = ThreadWorld(2).run(lambda rank: _save(tmp_path, rank), monkeypatch)
    assert type(out[1]) is RuntimeError
    assert type(out[0]) is CheckpointError and str(out[0]) == "save_checkpoint of step 3 failed on rank 1: device lost"
    # A bad argument on one rank and another failure on the other: not only bad arguments.
    out = ThreadWorld(3).run(lambda rank: _save(tmp_path, rank, **_head(range(2 * rank, 2 * rank + 2), 6),
                                           **({"per_rank": [rank]} if rank == 2 else {})), monkeypatch)
    assert type(out[0]) is CheckpointError and type(out[1]) is RuntimeError and type(out[2]) is ValueError


def test_ranks_saving_other_steps_are_refused(tmp_path: Path, monkeypatch) -> None:
    out = ThreadWorld(3).run(lambda rank: save_checkpoint(tmp_path, 4 if rank else 3, common=None, per_rank=None,
                                                     fingerprint=FP, **_head(range(2 * rank, 2 * rank + 2), 6)),
                        monkeypatch)
    assert all(type(e) is ValueError and str(e) == "step differs across ranks: rank 0 has 3, rank 1 has 4" for e in out)


@pytest.mark.parametrize("root", ["a_file", "a_file/run"])
def test_a_root_that_is_or_lies_under_a_file_is_refused_on_every_rank_before_anything_is_written(
        tmp_path: Path, monkeypatch, root: str) -> None:
    (tmp_path / "a_file").write_text("x")  # was NotADirectoryError naming a scratch folder under it
    out = ThreadWorld(2).run(lambda rank: _save(tmp_path / root, rank), monkeypatch)
    expected = f"root {str(tmp_path / root)!r}: {str(tmp_path / 'a_file')!r} is a file, not a folder"
    assert [(type(e), str(e)) for e in out] == [(ValueError, expected)] * 2
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a_file"] and (tmp_path / "a_file").read_text() == "x"


def test_a_failed_publish_on_rank_0_fails_every_rank(tmp_path: Path, monkeypatch) -> None:
    def publish(*args: Any) -> None:
        raise OSError("rename failed")

    monkeypatch.setattr(S, "publish", publish)
    out = ThreadWorld(2).run(lambda rank: _save(tmp_path, rank), monkeypatch)
    assert type(out[0]) is OSError and str(out[0]) == "rename failed"
    assert type(out[1]) is CheckpointError
    assert str(out[1]) == f"publishing checkpoint step 3 under {tmp_path} failed on rank 0: OSError: rename failed"
    assert list(tmp_path.iterdir()) == []


def test_meta_json_is_indented_for_people(tmp_path: Path) -> None:
    path = save_checkpoint(tmp_path, 1, common=None, per_rank=None, fingerprint=FP, **_head(range(4)))
    text = (path / "meta.json").read_text()
    assert text == json.dumps(json.loads(text), indent=2)


def test_a_resave_swaps_with_the_old_step_under_the_saves_own_scratch_name(tmp_path: Path, monkeypatch) -> None:
    from shardfc.checkpoint import durable

    save_checkpoint(tmp_path, 1, common=None, per_rank=None, fingerprint=FP, **_head(range(4)))
    swaps = []
    real = durable.exchange
    monkeypatch.setattr(durable, "exchange", lambda a, b: swaps.append((a.name, b.name)) or real(a, b))
    save_checkpoint(tmp_path, 1, common=None, per_rank=None, fingerprint=FP, **_head(range(4)))
    [(scratch, final)] = swaps
    token = scratch.removeprefix(".tmp-step_00000001-")
    assert re.fullmatch("[0-9a-f]{16}", token) and final == "step_00000001"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_00000001"]


def test_a_resave_where_no_swap_moves_the_old_step_aside_under_the_saves_own_scratch_name(
        tmp_path: Path, monkeypatch) -> None:
    from shardfc.checkpoint import durable

    save_checkpoint(tmp_path, 1, common=None, per_rank=None, fingerprint=FP, **_head(range(4)))
    monkeypatch.setattr(durable, "exchange", lambda a, b: False)
    moves = []
    real = os.replace
    monkeypatch.setattr(os, "replace", lambda src, dst: moves.append((Path(src).name, Path(dst).name)) or real(src, dst))
    save_checkpoint(tmp_path, 1, common=None, per_rank=None, fingerprint=FP, **_head(range(4)))
    (aside, into), (scratch, final) = moves[:2]
    token = scratch.removeprefix(".tmp-step_00000001-")
    assert re.fullmatch("[0-9a-f]{16}", token)
    # A name tidy() recognises as a crashed save's leftover, should the process die before it is removed.
    assert (aside, into, final) == ("step_00000001", f".old-step_00000001-{token}", "step_00000001")


def test_a_failure_after_the_rename_is_the_error_raised(tmp_path: Path, monkeypatch) -> None:
    real = S.fsync_dir

    def fsync_dir(path: Path) -> None:
        if path == tmp_path:  # the root, after the scratch directory was renamed into place
            raise OSError("fsync failed")
        real(path)

    monkeypatch.setattr(S, "fsync_dir", fsync_dir)
    # Not the error of removing the scratch directory, which is gone by then.
    with pytest.raises(OSError, match="^fsync failed$"):
        save_checkpoint(tmp_path, 1, common=None, per_rank=None, fingerprint=FP, **_head(range(4)))


def test_num_classes_is_checked_in_full_and_one_class_is_enough(tmp_path: Path) -> None:
    for bad in (0, "2"):
        with pytest.raises(ValueError, match="^" + re.escape(f"num_classes must be an int >= 1, got {bad!r}") + "$"):
            save_checkpoint(tmp_path, 1, common=None, per_rank=None, fingerprint=FP, head_tensors={"w": torch.zeros(0, 1)},
                            class_range=range(0), num_classes=bad)
    path = save_checkpoint(tmp_path, 1, common=None, per_rank=None, fingerprint=FP, **_head(range(1), 1))
    assert verify_checkpoint(path)["num_classes"] == 1


@pytest.mark.parametrize(("overrides", "start"), [
    ({"common": [1]}, "common must be a dict or None, got list"),
    ({"common": {"x": object()}}, "common['x'] is"),
    ({"per_rank": {"x": object()}}, "per_rank['x'] is"),
    ({"head_extras": {1: 2}}, "head_extras keys must be str, got 1"),
    ({"head_extras": {"x": object()}}, "head_extras['x'] is"),
    ({"fingerprint": {1: 2}}, "fingerprint keys must be str, got 1"),
    ({"fingerprint": {"x": {1}}}, "fingerprint must be JSON-serialisable"),
    ({"stage_parts": "parts"}, "stage_parts must be a list of StagePart, got str"),
])
def test_each_bad_argument_is_named(tmp_path: Path, overrides: dict[str, Any], start: str) -> None:
    kwargs: dict[str, Any] = dict(common=None, per_rank=None, fingerprint=FP, **_head(range(4)))
    with pytest.raises(ValueError, match="^" + re.escape(start)):
        save_checkpoint(tmp_path, 1, **{**kwargs, **overrides})


def test_only_rank_0_writes_common_so_only_its_common_is_checked(tmp_path: Path, monkeypatch) -> None:
    out = ThreadWorld(2).run(lambda rank: _save(tmp_path, rank, common={"x": object()} if rank else {"c": 0}), monkeypatch)
    assert out == [tmp_path / "step_00000003"] * 2


def test_a_group_without_torch_distributed_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"^group='g' was given but torch\.distributed is not initialised$"):
        save_checkpoint(tmp_path, 1, common=None, per_rank=None, fingerprint=FP, group="g", **_head(range(4)))


def test_rank_0_logs_the_checkpoint_it_saved(tmp_path: Path, monkeypatch, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="shardfc.checkpoint")
    out = ThreadWorld(2).run(lambda rank: _save(tmp_path, rank), monkeypatch)
    assert [(r.name, r.levelno, r.getMessage()) for r in caplog.records] == [
        ("shardfc.checkpoint", logging.INFO, f"saved checkpoint {out[0]}")]


def test_a_pruned_step_is_moved_aside_under_the_saves_own_scratch_name(tmp_path: Path, monkeypatch) -> None:
    save_checkpoint(tmp_path, 1, common=None, per_rank=None, fingerprint=FP, **_head(range(4)))
    moves = []
    real = os.replace
    monkeypatch.setattr(os, "replace", lambda src, dst: moves.append((Path(src).name, Path(dst).name)) or real(src, dst))
    save_checkpoint(tmp_path, 2, common=None, per_rank=None, fingerprint=FP, keep_last=1, **_head(range(4)))
    (scratch, final), (pruned, trash) = moves
    token = scratch.removeprefix(".tmp-step_00000002-")
    assert re.fullmatch("[0-9a-f]{16}", token)
    assert (final, pruned, trash) == ("step_00000002", "step_00000001", f".del-step_00000001-{token}")


def test_the_head_from_head_state_or_from_all_three_separate_arguments():
    none = dict(num_classes=None, class_range=None, tensors=None, extras=None)
    assert S._head_arguments(none, None, optional=True) is None
    for given in ({}, {"tensors": {}}, {"tensors": {}, "class_range": range(1)}, {"tensors": {}, "num_classes": 1},
                  {"class_range": range(1), "num_classes": 1}):
        with pytest.raises(ValueError, match="^pass head_state, or head_tensors, class_range and num_classes$"):
            S._head_arguments({**none, **given}, None)
    separate = {**none, "tensors": {}, "class_range": range(1), "num_classes": 1}
    assert S._head_arguments(separate, None) == {**separate, "extras": {}}
    assert S._head_arguments({**separate, "extras": {"e": 1}}, None)["extras"] == {"e": 1}
    state = {"num_classes": 1, "class_range": range(1), "tensors": {}}
    assert S._head_arguments(none, state) == {**state, "extras": {}}
    with pytest.raises(ValueError, match="^pass either head_state or class_range, head_tensors, head_extras, not both$"):
        S._head_arguments({**none, "tensors": {}, "class_range": range(1), "extras": {}}, state)
    for bad in ([], {"num_classes": 1, "class_range": range(1)}):
        with pytest.raises(ValueError, match=r"^head_state must be a dict with num_classes, class_range, tensors \(and extras\)$"):
            S._head_arguments(none, bad)


def _stage(index: int, key: str) -> StagePart:
    return StagePart(index, {key: torch.zeros(1)}, {"state": {}, "param_groups": [{"params": [key]}]}, ["a", "b"], ["a", "b"])


def test_a_rank_holding_only_a_stage_writes_no_head_file(tmp_path: Path, monkeypatch) -> None:
    out = ThreadWorld(2).run(lambda rank: save_checkpoint(tmp_path, 1, common=None, per_rank=None, fingerprint=FP,
                                                     stage_parts=[_stage(rank, "ab"[rank])],
                                                     **(_head(range(4)) if rank == 0 else {})), monkeypatch)
    assert out == [tmp_path / "step_00000001"] * 2
    meta = verify_checkpoint(out[0])
    assert sorted(meta["files"]) == ["backbone_stage0.pt", "backbone_stage1.pt", "common.pt", "head_0.pt"]
    assert meta["class_ranges"] == [[0, 4]]


def test_a_save_without_any_head_shard_is_refused(tmp_path: Path) -> None:
    parts = [_stage(0, "a"), _stage(1, "b")]
    with pytest.raises(ValueError, match="^no rank passed a head shard: at least one must$"):
        save_checkpoint(tmp_path, 1, common=None, per_rank=None, fingerprint=FP, stage_parts=parts)
