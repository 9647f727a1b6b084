"""``train/run_lock.py``: one run at a time in a run folder, refused on every rank, before anything is
read or written there; the lock gone with its process; folders where no lock is to be had."""

from __future__ import annotations

import errno
import logging
import os
import re
import socket
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from shardfc.cli import train as train_cli
from shardfc.parallel.context import DistContext
from shardfc.train import run_lock
from shardfc.train.config import ConfigError
from shardfc.train.run_lock import LOCK_FILE, run_folder_lock
from thread_world import ThreadWorld

from .tiny import tiny_config


def _one() -> DistContext:
    return DistContext(None, 0, 1, False, torch.device("cpu"))


def _refusal(out: Path) -> str:
    return (f"output_dir={str(out)!r} is in use by another shardfc train (pid {os.getpid()} on "
            f"{socket.gethostname()}, since ")


def test_a_second_run_into_a_held_folder_is_refused_naming_the_holder_and_the_folder_is_free_after(tmp_path: Path):
    out = tmp_path / "run"
    with run_folder_lock(out, _one()):
        holder = (out / LOCK_FILE).read_text()
        assert re.fullmatch(rf"pid {os.getpid()} on {re.escape(socket.gethostname())}, since "
                            r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d\n", holder)
        with pytest.raises(ConfigError) as err:
            with run_folder_lock(out, _one()):
                raise AssertionError("entered a held folder")
        assert str(err.value) == (f"output_dir={str(out)!r} is in use by another shardfc train ({holder.strip()}): "
                                  "two runs in one folder would interleave their checkpoints and logs; wait for it to "
                                  "end, stop it, or choose another --output-dir")
    with run_folder_lock(out, _one()):  # released at the end of the first
        pass
    with pytest.raises(RuntimeError, match="^inside$"):
        with run_folder_lock(out, _one()):
            raise RuntimeError("inside")
    with run_folder_lock(out, _one()):  # ... and when the run fails
        pass


def test_every_rank_learns_rank_0s_refusal_and_only_rank_0_locks(tmp_path: Path, monkeypatch):
    world = ThreadWorld(3)
    locked = []
    real = run_lock._lock
    monkeypatch.setattr(run_lock, "_lock", lambda out: locked.append(out) or real(out))
    with run_folder_lock(tmp_path, _one()):
        def rank(r: int):
            with run_folder_lock(tmp_path, world.context()):
                return "entered"

        out = world.run(rank)
    assert all(isinstance(e, ConfigError) and str(e).startswith(_refusal(tmp_path)) for e in out), out
    assert locked == [tmp_path, tmp_path]  # this test's own lock, then rank 0's only
    assert world.run(rank) == ["entered"] * 3


def test_the_lock_goes_with_its_process_however_it_ends(tmp_path: Path):
    script = textwrap.dedent(f"""
        import os, sys
        from pathlib import Path
        import torch
        from shardfc.parallel.context import DistContext
        from shardfc.train.run_lock import run_folder_lock
        with run_folder_lock(Path({str(tmp_path)!r}), DistContext(None, 0, 1, False, torch.device("cpu"))):
            print("held", flush=True)
            sys.stdin.readline()
            os._exit(9)  # no clean-up: killed as good as
        """)
    proc = subprocess.Popen([sys.executable, "-c", script], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline() == "held\n"
        with pytest.raises(ConfigError, match=f"^output_dir={re.escape(repr(str(tmp_path)))} is in use by another "
                                              rf"shardfc train \(pid {proc.pid} on "):
            with run_folder_lock(tmp_path, _one()):
                pass
        proc.stdin.write("\n")
        proc.stdin.flush()
        assert proc.wait(timeout=60) == 9
    finally:
        proc.kill()
    with run_folder_lock(tmp_path, _one()):
        assert (tmp_path / LOCK_FILE).read_text().startswith(f"pid {os.getpid()} ")


def test_a_lock_file_that_is_a_fifo_or_a_link_is_refused_without_waiting(tmp_path: Path):
    fifo = tmp_path / "fifo"
    fifo.mkdir()
    os.mkfifo(fifo / LOCK_FILE)
    with pytest.raises(ConfigError) as err:
        with run_folder_lock(fifo, _one()):
            pass
    assert str(err.value) == f"output_dir={str(fifo)!r}: its lock file {LOCK_FILE} is not a regular file; remove it"
    link = tmp_path / "link"
    link.mkdir()
    (tmp_path / "elsewhere").write_text("keep")
    (link / LOCK_FILE).symlink_to(tmp_path / "elsewhere")
    with pytest.raises(ConfigError) as err:
        with run_folder_lock(link, _one()):
            pass
    assert str(err.value) == (f"output_dir={str(link)!r}: cannot open its lock file {LOCK_FILE} "
                              f"({os.strerror(errno.ELOOP)}); remove whatever stands at that name")
    assert (tmp_path / "elsewhere").read_text() == "keep"


def test_where_no_lock_is_to_be_had_the_run_goes_on_and_says_so(tmp_path: Path, monkeypatch, caplog):
    class NoLocks:
        LOCK_EX, LOCK_NB = 2, 4

        @staticmethod
        def flock(fd, how):
            raise OSError(errno.ENOLCK, os.strerror(errno.ENOLCK))

    monkeypatch.setattr(run_lock, "fcntl", NoLocks)
    with caplog.at_level(logging.WARNING, logger="shardfc.train"):
        with run_folder_lock(tmp_path, _one()), run_folder_lock(tmp_path, _one()):
            pass
    assert [r.getMessage() for r in caplog.records] == [
        f"could not lock {tmp_path / LOCK_FILE} ({os.strerror(errno.ENOLCK)}): a second run started into this "
        "folder would not be refused"] * 2
    caplog.clear()
    monkeypatch.setattr(run_lock, "fcntl", None)  # Windows
    with caplog.at_level(logging.WARNING, logger="shardfc.train"):
        with run_folder_lock(tmp_path / "new", _one()):
            pass
    assert [r.getMessage() for r in caplog.records] == [
        f"no flock on this OS: a second run started into {tmp_path / 'new'} would not be refused"]
    assert not (tmp_path / "new").exists()


def test_shardfc_train_into_a_folder_in_use_stops_before_it_writes_there(tmp_path: Path):
    out = tmp_path / "run"
    cfg = tiny_config(out, nproc=1, max_steps=1, eval_every=0, ckpt_every=0)
    with run_folder_lock(out, _one()):
        with pytest.raises(ConfigError, match="^" + re.escape(_refusal(out))):
            train_cli.run(cfg)
        assert sorted(p.name for p in out.iterdir()) == [LOCK_FILE]  # no log, no config, no checkpoint
    assert train_cli.run(cfg)["step"] == 1


def test_a_forked_child_does_not_keep_the_folder_held(tmp_path: Path):
    """A DataLoader worker is a fork of its rank: it must not hold the lock past the run (a worker that
    outlives a killed rank 0 would refuse the restarted run)."""
    import multiprocessing

    fork = multiprocessing.get_context("fork")
    go, child_up = fork.Event(), fork.Event()

    def child():
        child_up.set()
        go.wait(60)

    with run_folder_lock(tmp_path, _one()):
        proc = fork.Process(target=child)
        proc.start()
        assert child_up.wait(60)
    try:
        with run_folder_lock(tmp_path, _one()):  # the child still runs: the folder is free all the same
            assert proc.is_alive()
    finally:
        go.set()
        proc.join(60)


def test_a_folder_rank_0_cannot_make_stops_every_rank(tmp_path: Path):
    (tmp_path / "file").write_text("not a folder")
    world = ThreadWorld(2)

    def rank(r: int):
        with run_folder_lock(tmp_path / "file" / "run", world.context()):
            return "entered"

    out = world.run(rank)
    assert [type(e) for e in out] == [NotADirectoryError, NotADirectoryError], out  # rank 1 waited for no one
    assert str(out[0]) == str(out[1]) == f"[Errno 20] Not a directory: {str(tmp_path / 'file' / 'run')!r}"


def test_the_refusal_quotes_what_the_holder_wrote_as_far_as_it_reads(tmp_path: Path):
    """The holder's line as text whatever its bytes (the file is in the user's folder), its first line,
    at most 300 bytes; before the holder has written it, a placeholder."""
    out = tmp_path / "a" / "b"  # a run folder whose parents do not exist yet
    lock = out / LOCK_FILE
    with run_folder_lock(out, _one()):
        umask = os.umask(0)
        os.umask(umask)
        assert os.stat(lock).st_mode & 0o777 == 0o644 & ~umask
        for written, quoted in ((b"\xffpid 1\nsecond line", "\ufffdpid 1"), (b"", "no holder written yet"),
                                (b" \n", "no holder written yet"), (b"x" * 400, "x" * 300)):
            lock.write_bytes(written)
            with pytest.raises(ConfigError) as err:
                with run_folder_lock(out, _one()):
                    pass
            assert str(err.value).startswith(f"output_dir={str(out)!r} is in use by another shardfc train ({quoted}): ")
