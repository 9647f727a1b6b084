"""Signals recorded instead of raised, agreed over ranks, and children that die with their parent."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch

import shardfc
from shardfc.parallel import lifecycle
from shardfc.parallel.context import DistContext
from shardfc.parallel.launch import spawn
from shardfc.train.config import TrainConfig
from shardfc.train.loader.data import ShardBatches, micro_batches
from shardfc.train.state import RunState
from shardfc.train.stopping import agreed_stop_signal

SRC = str(Path(shardfc.__file__).resolve().parents[1])


def test_stop_signals_are_recorded_inside_and_the_old_handlers_come_back():
    before = signal.getsignal(signal.SIGTERM)
    try:
        with lifecycle.record_stop_signals():
            os.kill(os.getpid(), signal.SIGTERM)
            os.kill(os.getpid(), signal.SIGINT)  # the first one is kept
            for _ in range(100):  # delivered at the next bytecode boundary of the main thread
                if lifecycle.received_signal():
                    break
                time.sleep(0.01)
            assert lifecycle.received_signal() == signal.SIGTERM
        assert signal.getsignal(signal.SIGTERM) is before
    finally:
        lifecycle._reset_for_tests()
    assert lifecycle.exit_code(signal.SIGINT) == 130 and lifecycle.exit_code(signal.SIGTERM) == 143


def _agree(rank: int, world: int, signalled_rank: int) -> int:
    if rank == signalled_rank:
        lifecycle._record(signal.SIGTERM)
    return agreed_stop_signal(DistContext.resolve())


def test_a_signal_on_one_rank_stops_every_rank():
    assert spawn(_agree, 2, 1) == [signal.SIGTERM, signal.SIGTERM]
    assert spawn(_agree, 2, -1) == [0, 0]  # nobody signalled: nobody stops


# A parent that starts a child calling die_with_parent, then waits to be killed.
_PARENT = """
import subprocess, sys, time
child = subprocess.Popen([sys.executable, "-c", sys.argv[1], *sys.argv[2:]])
open(sys.argv[2] + ".pid", "w").write(str(child.pid))
time.sleep(3600)
"""
_CHILD = """
import os, signal, sys, time
from pathlib import Path
from shardfc.parallel import lifecycle
folder, use_prctl, ignore = sys.argv[1], sys.argv[2] == "1", sys.argv[3] == "1"
handler = signal.SIG_IGN if ignore else lifecycle._record
signal.signal(signal.SIGTERM, handler)
lifecycle.die_with_parent(os.getppid(), grace_s=2.0, poll_s=0.2, use_prctl=use_prctl)
Path(folder, "ready").write_text("")
while not lifecycle.received_signal():
    time.sleep(0.1)
Path(folder, "stopped").write_text(str(lifecycle.received_signal()))
"""


@pytest.mark.skipif(sys.platform == "win32", reason="POSIX signals")
@pytest.mark.parametrize("use_prctl, ignore", [(True, False), (False, False), (False, True)],
                         ids=["prctl", "watchdog", "watchdog-ends-a-child-that-ignores-SIGTERM"])
def test_a_child_stops_when_its_parent_is_killed(tmp_path, use_prctl, ignore):
    env = {**os.environ, "PYTHONPATH": SRC}
    parent = subprocess.Popen([sys.executable, "-c", _PARENT, textwrap.dedent(_CHILD), str(tmp_path),
                               "1" if use_prctl else "0", "1" if ignore else "0"], env=env)
    pid_file, deadline = Path(str(tmp_path) + ".pid"), time.monotonic() + 120
    while not ((tmp_path / "ready").exists() and pid_file.exists()) and time.monotonic() < deadline:
        time.sleep(0.1)
    child = int(pid_file.read_text())
    os.kill(parent.pid, signal.SIGKILL)
    parent.wait(60)
    deadline = time.monotonic() + 30
    while Path(f"/proc/{child}").exists() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not Path(f"/proc/{child}").exists(), "the orphan is still running"
    if ignore:  # the watchdog ended it after the grace period
        assert not (tmp_path / "stopped").exists()
    else:  # a SIGTERM it recorded, as from a launcher
        assert (tmp_path / "stopped").read_text() == str(int(signal.SIGTERM))


# A child whose parent stays up (a fork server, here the test) but whose launcher is gone.
_LAUNCHER_GONE = """
import os, signal, subprocess, sys, time
from shardfc.parallel import lifecycle
launcher = int(sys.argv[1])
if launcher == 0:  # a launcher that has already exited
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    launcher = gone.pid
signal.signal(signal.SIGTERM, lifecycle._record)
lifecycle.die_with_parent(os.getppid(), grace_s=30.0, poll_s=0.05, use_prctl=False, launcher_pid=launcher)
deadline = time.monotonic() + 2.0
while not lifecycle.received_signal() and time.monotonic() < deadline:
    time.sleep(0.02)
print(lifecycle.received_signal())
"""


@pytest.mark.skipif(sys.platform == "win32", reason="POSIX signals")
@pytest.mark.parametrize("launcher_alive", [False, True], ids=["launcher-gone", "launcher-alive"])
def test_a_child_of_a_fork_server_stops_when_its_launcher_is_gone(launcher_alive):
    env = {**os.environ, "PYTHONPATH": SRC}
    launcher = os.getpid() if launcher_alive else 0
    done = subprocess.run([sys.executable, "-c", textwrap.dedent(_LAUNCHER_GONE), str(launcher)],
                          env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == ("None" if launcher_alive else str(int(signal.SIGTERM)))


class _WorkerPids(torch.utils.data.Dataset):
    """Each sample: the pid of the process that loaded it."""

    def __len__(self):
        return 64

    def __getitem__(self, i):
        return torch.tensor(os.getpid()), torch.tensor(0)


def test_the_training_loaders_workers_outlive_a_signal_to_the_process_group(tmp_path):
    cfg = TrainConfig(num_workers=1, seed=0, output_dir=str(tmp_path))
    batches = ShardBatches(64, 4, 0, 1, seed=0, drop_last=False)
    stream = micro_batches(_WorkerPids(), batches, RunState(batches_per_epoch=len(batches)), cfg, DistContext())
    worker = int(next(stream)[0][0])
    assert worker != os.getpid()
    os.kill(worker, signal.SIGTERM)  # as Ctrl-C or Slurm reach every process of the group
    os.kill(worker, signal.SIGINT)
    time.sleep(1.0)
    for _ in range(20):  # the loader goes on; the trainer stops when its ranks agree, not here
        assert int(next(stream)[0][0]) == worker


# --- the same pieces in this process, their system calls stood in for (mutmut sees only this one) ---


class _Stop(Exception):
    """os._exit, stood in for."""


@pytest.fixture
def watched(monkeypatch):
    """die_with_parent's calls recorded: prctl, the watchdog thread (run by hand), kill, sleep, _exit."""
    log = {"prctl": [], "kill": [], "sleep": [], "threads": []}

    class Libc:
        def prctl(self, *args):
            log["prctl"].append(args)

    class Thread:
        def __init__(self, target, name, daemon):
            log["threads"].append((name, daemon))
            self.target = target

        def start(self):
            log["watch"] = self.target

    def _exit(code):
        raise _Stop(code)

    monkeypatch.setattr(lifecycle.ctypes, "CDLL", lambda name, use_errno: Libc())
    monkeypatch.setattr(lifecycle.threading, "Thread", Thread)
    monkeypatch.setattr(lifecycle.time, "sleep", log["sleep"].append)
    monkeypatch.setattr(lifecycle.os, "_exit", _exit)
    monkeypatch.setattr(lifecycle.os, "getpid", lambda: 500)
    return log


def _kills(log, gone=()):
    def kill(pid, signum):
        log["kill"].append((pid, signum))
        if pid in gone:
            raise ProcessLookupError(pid)
    return kill


def test_the_watchdog_waits_for_its_parent_then_stops_this_process_gracefully_then_for_good(watched, monkeypatch):
    parents = iter([100, 100, 100, 1])  # the parent dies after two polls
    monkeypatch.setattr(lifecycle.os, "getppid", lambda: next(parents))
    monkeypatch.setattr(lifecycle.os, "kill", _kills(watched))
    lifecycle.die_with_parent(100, grace_s=7.0, poll_s=0.25)
    assert watched["prctl"] == ([(1, int(signal.SIGTERM), 0, 0, 0)] if sys.platform.startswith("linux") else [])
    assert watched["threads"] == [("shardfc-parent-watchdog", True)] and watched["sleep"] == []  # not waited on here
    with pytest.raises(_Stop) as stop:
        watched["watch"]()
    assert watched["sleep"] == [0.25, 0.25, 0.25, 7.0] and watched["kill"] == [(500, signal.SIGTERM)]
    assert stop.value.args == (143,)


def test_the_watchdog_also_stops_this_process_when_the_launcher_behind_a_fork_server_is_gone(watched, monkeypatch):
    monkeypatch.setattr(lifecycle.os, "getppid", lambda: 100)  # the server: still there
    monkeypatch.setattr(lifecycle.os, "kill", _kills(watched, gone={77}))
    lifecycle.die_with_parent(100, grace_s=3.0, poll_s=0.5, use_prctl=False, launcher_pid=77)
    assert watched["prctl"] == []
    with pytest.raises(_Stop):
        watched["watch"]()
    assert watched["kill"] == [(77, 0), (500, signal.SIGTERM)] and watched["sleep"] == [3.0]


def test_a_platform_without_prctl_keeps_the_watchdog_at_its_default_pace(watched, monkeypatch):
    def no_libc(name, use_errno):
        raise OSError("no libc here")

    monkeypatch.setattr(lifecycle.ctypes, "CDLL", no_libc)
    parents = iter([100, 1])
    monkeypatch.setattr(lifecycle.os, "getppid", lambda: next(parents))
    monkeypatch.setattr(lifecycle.os, "kill", _kills(watched))
    lifecycle.die_with_parent(100)
    assert watched["threads"] == [("shardfc-parent-watchdog", True)]
    with pytest.raises(_Stop):
        watched["watch"]()
    assert watched["sleep"] == [1.0, lifecycle.ORPHAN_GRACE_S] == [1.0, 120.0]  # polled each second


def test_a_process_exists_while_it_can_be_signalled_or_belongs_to_someone_else(monkeypatch):
    assert lifecycle._exists(os.getpid())
    done = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    assert not lifecycle._exists(int(done.stdout))  # exited and reaped

    def refused(pid, signum):
        raise PermissionError(pid)

    monkeypatch.setattr(lifecycle.os, "kill", refused)
    assert lifecycle._exists(1)


class _Child:
    def __init__(self, pid, exitcode=None):
        self.pid, self.exitcode = pid, exitcode


def test_the_forwarder_passes_the_first_signal_on_to_live_children_and_kills_them_on_the_second(monkeypatch):
    sent = []
    monkeypatch.setattr(lifecycle.os, "kill", _kills({"kill": sent}, gone={13}))
    children = [_Child(11), _Child(None), _Child(12, exitcode=0), _Child(13)]  # not started, ended, just gone
    try:
        with lifecycle.forward_stop_signals(lambda: children) as forwarder:
            assert forwarder.received is None
            forwarder(signal.SIGINT)
            assert forwarder.received == signal.SIGINT and lifecycle.received_signal() == signal.SIGINT
            assert sent == [(11, signal.SIGINT), (13, signal.SIGINT)]
            forwarder(signal.SIGTERM)
            assert forwarder.received == signal.SIGINT  # the first one is what the launcher reports
            assert sent[2:] == [(11, signal.SIGKILL), (13, signal.SIGKILL)]
            forwarder.send(signal.SIGTERM)
            assert sent[4:] == [(11, signal.SIGTERM), (13, signal.SIGTERM)]
    finally:
        lifecycle._reset_for_tests()
    assert lifecycle.received_signal() is None


def test_loader_workers_ignore_the_stop_signals_and_names_read_as_the_shell_writes_them():
    before = {s: signal.getsignal(s) for s in lifecycle.STOP_SIGNALS}
    try:
        lifecycle.ignore_stop_signals(3)
        assert all(signal.getsignal(s) is signal.SIG_IGN for s in lifecycle.STOP_SIGNALS)
    finally:
        for s, h in before.items():
            signal.signal(s, h)
    assert lifecycle.signal_name(signal.SIGTERM) == "SIGTERM" and lifecycle.signal_name(2) == "SIGINT"
