"""A save's file operations (:mod:`shardfc.checkpoint.durable`): the hash streamed as torch.save writes
(the file is not read again unless the bytes seen differ from the bytes on disk), the names a
replaced or pruned checkpoint takes while it is deleted, and what is logged when a step fails."""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
from pathlib import Path

import pytest
import torch

from shardfc.checkpoint import durable


def test_save_durable_trusts_the_streamed_hash_of_the_bytes_on_disk(tmp_path: Path, monkeypatch):
    def no_reread(path):
        raise AssertionError(f"{path} read again")

    monkeypatch.setattr(durable, "sha256_file", no_reread)
    entry = durable.save_durable({"w": torch.arange(1000.0)}, tmp_path / "a.pt")
    data = (tmp_path / "a.pt").read_bytes()
    assert entry == {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}


def test_save_durable_hashes_the_file_when_the_streamed_bytes_differ(tmp_path: Path, monkeypatch):
    class Miscounting(durable._HashingWriter):
        def write(self, data: bytes) -> int:
            n = super().write(data)
            self.size += 1
            return n

    read = []
    real = durable.sha256_file
    monkeypatch.setattr(durable, "_HashingWriter", Miscounting)
    monkeypatch.setattr(durable, "sha256_file", lambda path: read.append(path) or real(path))
    entry = durable.save_durable({"w": torch.arange(10.0)}, tmp_path / "a.pt")
    data = (tmp_path / "a.pt").read_bytes()
    assert read == [tmp_path / "a.pt"] and entry == {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}


def test_a_failed_directory_fsync_is_logged(tmp_path: Path, monkeypatch, caplog):
    def fail(fd):
        raise OSError("no fsync here")

    monkeypatch.setattr(os, "fsync", fail)
    with caplog.at_level(logging.WARNING, logger="shardfc.checkpoint"):
        durable.fsync_dir(tmp_path)
    assert [r.getMessage() for r in caplog.records] == [f"fsync of directory {tmp_path} failed: no fsync here"]


def _recorded_replaces(monkeypatch):
    moves = []
    real = os.replace
    monkeypatch.setattr(os, "replace", lambda a, b: moves.append((Path(a).name, Path(b).name)) or real(a, b))
    return moves


def _rmtree_failing_unless_ignored(monkeypatch):
    """shutil.rmtree as on a filesystem where every delete fails: the caller asked to ignore that or not."""
    def rmtree(path, ignore_errors=False):
        if not ignore_errors:
            raise OSError(f"cannot delete {path}")

    monkeypatch.setattr(shutil, "rmtree", rmtree)


def test_publish_where_no_swap_moves_the_old_save_aside_under_a_scratch_name_then_deletes_it(
        tmp_path: Path, monkeypatch):
    monkeypatch.setattr(durable, "exchange", lambda a, b: False)
    final, tmp = tmp_path / "step_00000001", tmp_path / ".tmp-step_00000001-a1"
    final.mkdir()
    (final / "old").write_text("old")
    tmp.mkdir()
    (tmp / "new").write_text("new")
    moves = _recorded_replaces(monkeypatch)
    durable.publish(tmp, final, "a1")
    assert moves == [("step_00000001", ".old-step_00000001-a1"), (".tmp-step_00000001-a1", "step_00000001")]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_00000001"] and (final / "new").exists()
    again = tmp_path / ".tmp-step_00000001-b2"
    again.mkdir()
    _rmtree_failing_unless_ignored(monkeypatch)
    durable.publish(again, final, "b2")  # the old save cannot be deleted: published all the same
    assert sorted(p.name for p in tmp_path.iterdir()) == [".old-step_00000001-b2", "step_00000001"]


def test_tidy_prunes_under_a_scratch_name_and_logs_each_removal(tmp_path: Path, monkeypatch, caplog):
    steps = [tmp_path / f"step_0000000{i}" for i in (1, 2, 3)]
    for p in steps:
        p.mkdir()
    (tmp_path / ".tmp-step_00000009-ff").mkdir()
    moves = _recorded_replaces(monkeypatch)
    with caplog.at_level(logging.INFO, logger="shardfc.checkpoint"):
        durable.tidy(tmp_path, 1, steps[2], "a1", lambda root: steps)
    assert moves == [("step_00000001", ".del-step_00000001-a1"), ("step_00000002", ".del-step_00000002-a1")]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_00000003"]
    assert [r.getMessage() for r in caplog.records] == [
        f"pruned checkpoint {steps[0]} (keep_last=1)", f"pruned checkpoint {steps[1]} (keep_last=1)",
        f"removed leftover {tmp_path / '.tmp-step_00000009-ff'}"]


def test_tidy_goes_on_when_a_delete_fails_and_logs_what_stops_it(tmp_path: Path, monkeypatch, caplog):
    steps = [tmp_path / f"step_0000000{i}" for i in (1, 2, 3)]
    for p in steps:
        p.mkdir()
    _rmtree_failing_unless_ignored(monkeypatch)
    with caplog.at_level(logging.WARNING, logger="shardfc.checkpoint"):
        durable.tidy(tmp_path, 1, steps[2], "a1", lambda root: steps)
    assert sorted(p.name for p in tmp_path.iterdir()) == [".del-step_00000001-a1", ".del-step_00000002-a1", "step_00000003"]
    assert caplog.records == []

    def refuse(a, b):
        raise OSError("read-only")

    monkeypatch.setattr(os, "replace", refuse)
    with caplog.at_level(logging.WARNING, logger="shardfc.checkpoint"):
        durable.tidy(tmp_path, 0, steps[2], "a1", lambda root: [steps[2], tmp_path / "step_00000004"])
    assert [r.getMessage() for r in caplog.records] == [f"cleaning up old checkpoints under {tmp_path} failed: read-only"]


def _step(path: Path, text: str, meta: bool = True) -> Path:
    """A folder standing for a checkpoint: one file saying which save it is, and ``meta.json`` unless told."""
    path.mkdir()
    (path / "which").write_text(text)
    if meta:
        (path / "meta.json").write_text("{}")
    return path


def test_publish_swaps_the_old_save_in_one_step_then_deletes_it(tmp_path: Path, monkeypatch):
    final = _step(tmp_path / "step_00000001", "old")
    tmp = _step(tmp_path / ".tmp-step_00000001-a1", "new")
    moves = _recorded_replaces(monkeypatch)
    durable.publish(tmp, final, "a1")
    assert moves == [] and sorted(p.name for p in tmp_path.iterdir()) == ["step_00000001"]
    assert (final / "which").read_text() == "new"
    again = _step(tmp_path / ".tmp-step_00000001-b2", "newer")
    _rmtree_failing_unless_ignored(monkeypatch)
    durable.publish(again, final, "b2")  # the old save cannot be deleted: published all the same
    assert sorted(p.name for p in tmp_path.iterdir()) == [".tmp-step_00000001-b2", "step_00000001"]
    assert (final / "which").read_text() == "newer"


def test_a_crash_right_after_the_swap_leaves_the_new_save_in_place(tmp_path: Path, monkeypatch):
    final = _step(tmp_path / "step_00000001", "old")
    tmp = _step(tmp_path / ".tmp-step_00000001-a1", "new")

    def killed(path, ignore_errors=False):
        raise KeyboardInterrupt

    monkeypatch.setattr(shutil, "rmtree", killed)
    try:
        durable.publish(tmp, final, "a1")
    except KeyboardInterrupt:
        pass
    assert (final / "which").read_text() == "new" and (tmp / "which").read_text() == "old"  # tidy's to delete


def test_exchange_swaps_two_folders_and_says_so(tmp_path: Path):
    a, b = _step(tmp_path / "a", "a"), _step(tmp_path / "b", "b")
    if durable._renameat2() is None:
        assert durable.exchange(a, b) is False and (a / "which").read_text() == "a"
        return
    assert durable.exchange(a, b) is True
    assert (a / "which").read_text() == "b" and (b / "which").read_text() == "a"


def test_exchange_moves_nothing_and_says_so_where_it_fails(tmp_path: Path, monkeypatch):
    """A missing path, or a filesystem or sandbox that cannot swap: False, both paths as they were
    (publish then renames as it would without a swap, and reports that error if there is one)."""
    a = _step(tmp_path / "a", "a")
    assert durable.exchange(a, tmp_path / "b") is False and (a / "which").read_text() == "a"
    calls = []

    def refusing(*args):
        calls.append(args)
        return -1

    monkeypatch.setattr(durable, "_renameat2", lambda: refusing)
    b = _step(tmp_path / "b", "b")
    assert durable.exchange(a, b) is False and (a / "which").read_text() == "a"
    assert calls == [(-100, os.fsencode(a), -100, os.fsencode(b), 2)]
    calls.clear()
    for x, y in ((tmp_path / "a\0x", b), (a, tmp_path / "b\0y")):  # as C strings: a and b
        assert durable.exchange(x, y) is False and calls == []
    monkeypatch.setattr(durable, "_renameat2", lambda: None)  # not Linux
    assert durable.exchange(a, b) is False and (b / "which").read_text() == "b"


def test_a_resave_where_the_swap_fails_falls_back_to_two_renames(tmp_path: Path, monkeypatch):
    final = _step(tmp_path / "step_00000001", "old")
    tmp = _step(tmp_path / ".tmp-step_00000001-a1", "new")
    monkeypatch.setattr(durable, "_renameat2", lambda: (lambda *args: -1))  # EPERM from a sandbox, say
    moves = _recorded_replaces(monkeypatch)
    durable.publish(tmp, final, "a1")
    assert moves == [("step_00000001", ".old-step_00000001-a1"), (".tmp-step_00000001-a1", "step_00000001")]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_00000001"] and (final / "which").read_text() == "new"


def test_renameat2_is_none_where_the_libc_has_none(monkeypatch):
    class NoRenameat2:
        def __init__(self, name, use_errno=False):
            pass

    durable._renameat2.cache_clear()
    try:
        monkeypatch.setattr(durable.ctypes, "CDLL", NoRenameat2)
        assert durable._renameat2() is None
    finally:
        monkeypatch.undo()
        durable._renameat2.cache_clear()


def _crash_between_the_renames(tmp_path: Path, monkeypatch) -> Path:
    """A resave of step 1 where no swap is possible, killed after the old save was moved aside."""
    final = _step(tmp_path / "step_00000001", "old")
    tmp = _step(tmp_path / ".tmp-step_00000001-a1", "new")
    monkeypatch.setattr(durable, "exchange", lambda a, b: False)
    real, seen = os.replace, []

    def replace(a, b):
        seen.append(a)
        if len(seen) == 2:
            raise KeyboardInterrupt  # a signal, between the two renames
        real(a, b)

    monkeypatch.setattr(os, "replace", replace)
    try:
        durable.publish(tmp, final, "a1")
    except KeyboardInterrupt:
        pass
    monkeypatch.undo()
    assert sorted(p.name for p in tmp_path.iterdir()) == [".old-step_00000001-a1", ".tmp-step_00000001-a1"]
    return final


def test_restore_replaced_puts_back_the_step_a_crash_left_aside(tmp_path: Path, monkeypatch, caplog):
    final = _crash_between_the_renames(tmp_path, monkeypatch)
    with caplog.at_level(logging.WARNING, logger="shardfc.checkpoint"):
        assert durable.restore_replaced(tmp_path) == [final]
    assert (final / "which").read_text() == "old"
    assert [r.getMessage() for r in caplog.records] == [
        f"restored {final} from .old-step_00000001-a1, where a save of the same step was interrupted"]
    assert durable.restore_replaced(tmp_path) == []  # done once


def test_restore_replaced_takes_only_a_whole_save_moved_aside_from_a_step_now_missing(tmp_path: Path):
    _step(tmp_path / "step_00000002", "kept")
    odd = [_step(tmp_path / ".old-step_00000002-a1", "replaced by a step that is there"),
           _step(tmp_path / ".old-step_00000003-a1", "no meta.json", meta=False),
           _step(tmp_path / ".del-step_00000004-a1", "pruned"),
           _step(tmp_path / ".tmp-step_00000005-a1", "not published"),
           _step(tmp_path / "old-step_00000006-a1", "not a scratch name")]
    assert durable.restore_replaced(tmp_path) == [] and all(p.is_dir() for p in odd)
    assert (tmp_path / "step_00000002" / "which").read_text() == "kept"
    _step(tmp_path / ".old-step_00000009-a1", "after the others")  # they are passed over, not the end
    assert durable.restore_replaced(tmp_path) == [tmp_path / "step_00000009"] and all(p.is_dir() for p in odd)
    assert durable.restore_replaced(tmp_path / "absent") == []


@pytest.mark.parametrize("keep_last", [4, 3])
def test_tidy_restores_a_step_left_aside_before_pruning_and_counts_it(tmp_path: Path, monkeypatch, keep_last):
    from shardfc.checkpoint.discovery import find_checkpoints

    first = _crash_between_the_renames(tmp_path, monkeypatch)
    steps = [first] + [_step(tmp_path / f"step_0000000{i}", str(i)) for i in (2, 3, 4)]
    durable.tidy(tmp_path, keep_last, steps[-1], "b2", find_checkpoints)
    assert sorted(p.name for p in tmp_path.iterdir()) == [p.name for p in steps[4 - keep_last:]]
    assert keep_last == 3 or (first / "which").read_text() == "old"


def test_tidy_deletes_nothing_when_the_restore_fails(tmp_path: Path, monkeypatch, caplog):
    _crash_between_the_renames(tmp_path, monkeypatch)
    current = _step(tmp_path / "step_00000004", "4")

    def refuse(a, b):
        raise OSError("read-only")

    monkeypatch.setattr(os, "replace", refuse)
    with caplog.at_level(logging.WARNING, logger="shardfc.checkpoint"):
        durable.tidy(tmp_path, None, current, "b2", lambda root: [])
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        ".old-step_00000001-a1", ".tmp-step_00000001-a1", "step_00000004"]
    assert [r.getMessage() for r in caplog.records] == [f"cleaning up old checkpoints under {tmp_path} failed: read-only"]


def test_tidy_without_pruning_lists_no_checkpoints(tmp_path: Path):
    """Listing reads every step's folder: without ``keep_last`` nothing needs it."""
    current = _step(tmp_path / "step_00000004", "4")
    _step(tmp_path / ".tmp-step_00000005-a1", "crashed")

    def listing(root):
        raise AssertionError("listed")

    durable.tidy(tmp_path, None, current, "b2", listing)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_00000004"]
