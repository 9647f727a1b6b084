"""A save's file operations (:mod:`shardfc.checkpoint.durable`): the hash streamed as torch.save writes
(the file is not read again unless the bytes seen differ from the bytes on disk), the names a
replaced or pruned checkpoint takes while it is deleted, and what is logged when a step fails."""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
from pathlib import Path

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


def test_publish_moves_the_old_save_aside_under_a_scratch_name_then_deletes_it(tmp_path: Path, monkeypatch):
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
        durable.tidy(tmp_path, 1, steps[2], "a1", steps)
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
        durable.tidy(tmp_path, 1, steps[2], "a1", steps)
    assert sorted(p.name for p in tmp_path.iterdir()) == [".del-step_00000001-a1", ".del-step_00000002-a1", "step_00000003"]
    assert caplog.records == []

    def refuse(a, b):
        raise OSError("read-only")

    monkeypatch.setattr(os, "replace", refuse)
    with caplog.at_level(logging.WARNING, logger="shardfc.checkpoint"):
        durable.tidy(tmp_path, 0, steps[2], "a1", [steps[2], tmp_path / "step_00000004"])
    assert [r.getMessage() for r in caplog.records] == [f"cleaning up old checkpoints under {tmp_path} failed: read-only"]
