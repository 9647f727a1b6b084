"""spawn: results by value, errors with tracebacks, no hang when a rank dies; how its ranks start."""

import io
import multiprocessing
import os
import pickle
import queue as queue_module
import signal
import sys
import time
from datetime import timedelta
from pathlib import Path

import pytest
import torch

from shardfc.parallel import launch
from shardfc.parallel.launch import WorkerError, spawn


def _returns_tensor(rank, world):
    return {"rank": rank, "t": torch.full((3,), float(rank))}


def _raises_on_rank_1(rank, world):
    if rank == 1:
        raise ValueError("bad thing on rank 1")
    torch.distributed.barrier()  # would wait forever for rank 1
    return rank


def _dies_on_rank_0(rank, world):
    if rank == 0:
        os._exit(3)
    torch.distributed.barrier()
    return rank


def test_results_come_back_by_value():
    out = spawn(_returns_tensor, 2, backend="gloo")
    assert [o["rank"] for o in out] == [0, 1]
    assert torch.equal(out[1]["t"], torch.ones(3))


def test_a_rank_that_raises_is_reported_and_the_others_stopped():
    with pytest.raises(WorkerError, match="rank 1 of 2 failed:\nValueError: bad thing on rank 1"):
        spawn(_raises_on_rank_1, 2, backend="gloo", timeout_s=600)


def test_a_rank_that_dies_does_not_hang_the_parent():
    with pytest.raises(WorkerError, match="rank 0 of 2 failed:\nexited with code 3"):
        spawn(_dies_on_rank_0, 2, backend="gloo", timeout_s=600)


@pytest.mark.parametrize("bad", [0, -1, 1.5, 2.0, True, "2"])
def test_world_size_must_be_positive(monkeypatch, bad):
    monkeypatch.setattr(launch, "_run", lambda *args: pytest.fail("a rank was started"))
    with pytest.raises(ValueError) as e:
        spawn(_returns_tensor, bad)
    assert str(e.value) == f"world_size must be a positive integer, got {bad!r}"


@pytest.mark.parametrize("bad, message", [
    (-1, "timeout_s must be > 0, got -1.0"), (0, "timeout_s must be > 0, got 0.0"),
    (float("nan"), "timeout_s must be finite, got nan"), (float("inf"), "timeout_s must be finite, got inf"),
    (2e9, "timeout_s must be at most 1e+09 seconds (31 years), got 2000000000.0"),
])
def test_a_timeout_that_no_group_can_take_is_refused_before_any_rank_starts(monkeypatch, bad, message):
    # a negative one failed every rank's group init, INIT_ATTEMPTS times over; NaN or inf raised in each rank
    started = []
    monkeypatch.setattr(launch, "_run", lambda *args: started.append(args) or ["ran"])
    with pytest.raises(ValueError) as e:
        spawn(_returns_tensor, 1, backend="gloo", timeout_s=bad)
    assert str(e.value) == message and not started
    with pytest.raises(ValueError) as e:
        launch.init_from_env("gloo", timeout_s=bad)
    assert str(e.value) == message
    assert spawn(_returns_tensor, 1, backend="gloo", timeout_s=1e9) == ["ran"]  # the largest is taken


def test_nccl_without_a_cuda_device_per_rank_is_refused_before_any_rank_starts(monkeypatch):
    started = []
    monkeypatch.setattr(launch, "_run", lambda *args: started.append(args[3]) or ["ran"])
    devices = 0 if not torch.cuda.is_available() else torch.cuda.device_count()
    with pytest.raises(ValueError, match=rf"^backend 'nccl' needs a CUDA device per rank: world_size={devices + 1} "
                                         rf"but {devices} CUDA device\(s\) are visible \(use backend 'gloo', or "
                                         r"fewer ranks\)$"):
        spawn(_returns_tensor, devices + 1, backend="nccl")
    monkeypatch.setattr(launch.torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(launch.torch.cuda, "device_count", lambda: 2)
    with pytest.raises(ValueError, match="world_size=3 but 2 CUDA device"):
        spawn(_returns_tensor, 3, backend="nccl")
    assert started == []
    assert spawn(_returns_tensor, 2, backend="nccl") == ["ran"] and started == [2]  # one rank a device: launched
    monkeypatch.setattr(launch.torch.cuda, "is_available", lambda: False)  # gloo needs no device
    assert spawn(_returns_tensor, 3, backend="gloo") == ["ran"]


def test_group_that_never_forms_is_retried_then_reported(monkeypatch):
    import shardfc.parallel.launch as launch

    monkeypatch.setattr(launch, "INIT_ATTEMPTS", 2)
    with pytest.raises(WorkerError, match="did not form in 2 attempts: rank .*process group init failed"):
        spawn(_returns_tensor, 2, backend="no-such-backend")


# --- how ranks start: a fork server with torch imported, or a fresh interpreter each ---------------

METHODS = [m for m in launch.START_METHODS if m in multiprocessing.get_all_start_methods()]


def test_the_start_method_is_the_first_the_platform_has_unless_the_environment_names_one(monkeypatch):
    monkeypatch.delenv(launch.START_METHOD_ENV, raising=False)
    monkeypatch.setattr(launch.mp, "get_all_start_methods", lambda: ["fork", "spawn", "forkserver"])
    assert launch.start_method() == "forkserver"
    monkeypatch.setenv(launch.START_METHOD_ENV, " spawn ")
    assert launch.start_method() == "spawn"
    monkeypatch.setattr(launch.mp, "get_all_start_methods", lambda: ["spawn"])  # as on Windows
    monkeypatch.delenv(launch.START_METHOD_ENV)
    assert launch.start_method() == "spawn"
    monkeypatch.setenv(launch.START_METHOD_ENV, "forkserver")
    with pytest.raises(ValueError, match="SHARDFC_START_METHOD='forkserver': this platform starts processes only by spawn"):
        launch.start_method()
    monkeypatch.setenv(launch.START_METHOD_ENV, "fork")  # fork after torch's threads: not offered
    with pytest.raises(ValueError, match="SHARDFC_START_METHOD must be one of forkserver, spawn, got 'fork'"):
        spawn(_returns_tensor, 2)


def _what_a_rank_sees(rank, world):
    for name, stream in (("stdout", sys.stdout), ("stderr", sys.stderr)):
        stream.write(f"rank {rank} to {name}\n")  # one write: print's text and end can interleave
        stream.flush()
    return {
        "set": os.environ.get("SHARDFC_TEST_SET_AFTER_START"),
        "unset": os.environ.get("SHARDFC_TEST_UNSET_AFTER_START"),
        "parent": os.getppid(),
        "forked": "shardfc.parallel.rank_server" in sys.modules,
        "sigterm": signal.getsignal(signal.SIGTERM),
    }


@pytest.mark.parametrize("method", METHODS)
def test_a_rank_has_the_launchers_environment_and_output_of_the_launch_not_of_the_servers_start(tmp_path, monkeypatch, method):
    monkeypatch.setenv(launch.START_METHOD_ENV, method)
    monkeypatch.setenv("SHARDFC_TEST_UNSET_AFTER_START", "stale")
    spawn(_returns_tensor, 1)  # the server (if any) starts now, with this environment and output
    monkeypatch.delenv("SHARDFC_TEST_UNSET_AFTER_START")
    monkeypatch.setenv("SHARDFC_TEST_SET_AFTER_START", "fresh")
    saved = {fd: os.dup(fd) for fd in (1, 2)}
    files = {fd: open(tmp_path / f"fd{fd}", "wb") for fd in (1, 2)}
    try:
        sys.stdout.flush(), sys.stderr.flush()
        for fd, f in files.items():  # the launcher's output redirected after the server started
            os.dup2(f.fileno(), fd)
        seen = spawn(_what_a_rank_sees, 2)
    finally:
        for fd, copy in saved.items():
            os.dup2(copy, fd)
            os.close(copy)
        for f in files.values():
            f.close()
    assert [s["set"] for s in seen] == ["fresh", "fresh"]
    assert [s["unset"] for s in seen] == [None, None]
    assert sorted((tmp_path / "fd1").read_text().splitlines()) == ["rank 0 to stdout", "rank 1 to stdout"]
    assert sorted((tmp_path / "fd2").read_text().splitlines()) == ["rank 0 to stderr", "rank 1 to stderr"]
    assert all(s["sigterm"] == signal.SIG_DFL for s in seen)  # the server's hold is not a rank's
    if method == "spawn":
        assert all(s["parent"] == os.getpid() and not s["forked"] for s in seen)
    else:  # the server is the parent, a child of this process; torch came with the fork
        server = seen[0]["parent"]
        assert server != os.getpid() and all(s["parent"] == server and s["forked"] for s in seen)
        assert Path(f"/proc/{server}/stat").read_text().rsplit(")", 1)[1].split()[1] == str(os.getpid())


def _signals_the_server_then_returns(rank, world):
    if rank == 0:
        os.kill(os.getppid(), signal.SIGTERM)  # as a SIGTERM to the whole process group would
    time.sleep(2.0)  # time for a dying server to take its ranks' exit codes with it
    return os.getppid()


@pytest.mark.skipif("forkserver" not in METHODS, reason="no fork server on this platform")
def test_a_sigterm_to_the_server_loses_no_rank(monkeypatch):
    monkeypatch.setenv(launch.START_METHOD_ENV, "forkserver")
    first = spawn(_signals_the_server_then_returns, 2)
    assert spawn(_signals_the_server_then_returns, 1) == first[:1]  # the same server, still up


# --- a rank's side, run in this process (where mutmut sees it) --------------------------------------


class _Recorded:
    """Stands in for the launcher's stdout/stderr, or for the fork server's module."""

    def __init__(self):
        self.calls = 0

    def adopt(self):
        self.calls += 1

    release = adopt


@pytest.fixture
def rank_side(monkeypatch):
    """``_worker``'s surroundings: the parent watch and the thread count recorded, not applied; the
    environment restored after."""
    calls = {}
    monkeypatch.setattr(launch, "die_with_parent", lambda parent, **kw: calls.setdefault("watch", (parent, kw)))
    monkeypatch.setattr(launch.torch, "set_num_threads", lambda n: calls.setdefault("threads", n))
    monkeypatch.setattr(launch.os, "cpu_count", lambda: 7)
    saved = dict(os.environ)
    yield calls
    os.environ.clear()
    os.environ.update(saved)


def _reduced(rank, world, k):
    t = torch.full((2,), float(k))
    torch.distributed.all_reduce(t)
    return {"t": t, "rank": rank, "world": world, "env": os.environ.get("SHARDFC_TEST_RANK_ENV")}


def _raises(rank, world):
    raise ValueError("bad thing in the rank")


def _run_worker(tmp_path, fn, *args, world=1, backend="gloo", env=None, rank=0):
    reports, stdio = queue_module.Queue(), _Recorded()
    launch._worker(rank, world, "file://" + str(tmp_path / "rendezvous"), backend, fn, args, reports, 60.0,
                   4242, dict(os.environ) if env is None else env, stdio)
    assert stdio.calls == 1
    assert not torch.distributed.is_initialized()  # a rank leaves no group behind, whatever happened
    report = reports.get_nowait()
    assert reports.empty()
    return report


def test_a_rank_takes_the_launch_environment_and_sends_its_result_by_value(rank_side, tmp_path, monkeypatch):
    monkeypatch.setenv("SHARDFC_TEST_STALE", "from the server's start")
    env = {k: v for k, v in os.environ.items() if k != "SHARDFC_TEST_STALE"} | {"SHARDFC_TEST_RANK_ENV": "launch"}
    rank, ok, payload = _run_worker(tmp_path, _reduced, 3, env=env)
    assert (rank, ok) == (0, True) and isinstance(payload, bytes)
    out = torch.load(io.BytesIO(payload), weights_only=False)
    assert torch.equal(out["t"], torch.full((2,), 3.0)) and (out["rank"], out["world"], out["env"]) == (0, 1, "launch")
    assert dict(os.environ) == env
    assert rank_side == {"watch": (os.getppid(), {"launcher_pid": 4242}), "threads": 7}


def test_a_rank_that_raises_reports_its_traceback(rank_side, tmp_path):
    rank, ok, message = _run_worker(tmp_path, _raises)
    assert (rank, ok) == (0, False)
    assert message.startswith("ValueError: bad thing in the rank\nTraceback (most recent call last):")
    assert 'raise ValueError("bad thing in the rank")' in message


@pytest.mark.filterwarnings("ignore:Device capability of no-such-backend unknown")
@pytest.mark.parametrize("cpus, world, threads", [(7, 3, 2), (None, 1, 1), (2, 4, 1)])
def test_a_group_that_does_not_form_is_reported_as_such_and_fn_never_runs(rank_side, tmp_path, monkeypatch, cpus, world, threads):
    monkeypatch.setattr(launch.os, "cpu_count", lambda: cpus)
    rank, ok, message = _run_worker(tmp_path, _raises, world=world, backend="no-such-backend", rank=2)
    assert (rank, ok) == (2, False)
    assert message.startswith(launch._INIT_FAILED) and "bad thing" not in message
    assert rank_side["threads"] == threads  # the cores shared between the ranks, at least one each


def test_an_nccl_rank_takes_the_device_of_its_rank(rank_side, tmp_path, monkeypatch):
    devices, groups = [], []
    monkeypatch.setattr(launch.torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(launch.torch.cuda, "set_device", devices.append)

    def init_process_group(*args, **kwargs):
        groups.append((args, kwargs))
        raise RuntimeError("no NCCL here")

    monkeypatch.setattr(launch.dist, "init_process_group", init_process_group)
    rank, ok, message = _run_worker(tmp_path, _raises, world=4, backend="nccl", rank=3)
    assert devices == [1] and (rank, ok, message) == (3, False, launch._INIT_FAILED + "RuntimeError: no NCCL here")
    assert groups == [(("nccl",), {"init_method": "file://" + str(tmp_path / "rendezvous"), "rank": 3, "world_size": 4,
                                   "timeout": timedelta(seconds=60)})]


def test_a_rank_forked_from_the_server_releases_its_sigterm_hold_first(rank_side, tmp_path, monkeypatch):
    server = _Recorded()
    monkeypatch.setitem(sys.modules, launch._RANK_SERVER, server)
    assert _run_worker(tmp_path, _reduced, 1)[1] is True
    assert server.calls == 1


def test_the_launchers_stdout_travels_as_it_was_when_sent(tmp_path, monkeypatch):
    saved = {fd: os.dup(fd) for fd in (1, 2)}
    monkeypatch.setattr(sys, "stdout", open(1, "w", closefd=False, buffering=1 << 16))  # as a rank's: fd 1, buffered
    first, later = (open(tmp_path / name, "wb") for name in ("at-the-launch", "since"))
    try:
        sys.stdout.flush(), sys.stderr.flush()
        for fd in (1, 2):
            os.dup2(first.fileno(), fd)
        sent = pickle.dumps(launch._LauncherStdio())  # outside a launch: through multiprocessing's fd sharer
        for fd in (1, 2):
            os.dup2(later.fileno(), fd)
        stdio = pickle.loads(sent)
        assert sorted(stdio.fds) == [1, 2] and all(copy not in (1, 2) for copy in stdio.fds.values())
        sys.stdout.write("before\n")  # still buffered: adopt() flushes it to where it was headed
        stdio.adopt()
        os.write(1, b"out\n")
        os.write(2, b"err\n")
    finally:
        for fd, copy in saved.items():
            os.dup2(copy, fd)
            os.close(copy)
        first.close(), later.close()
    assert (tmp_path / "at-the-launch").read_bytes() == b"out\nerr\n"
    assert (tmp_path / "since").read_bytes() == b"before\n"
    for copy in stdio.fds.values():  # each copy closed once in place
        with pytest.raises(OSError):
            os.fstat(copy)


# --- the small pieces: a free port, torchrun's group, the signal error ------------------------------


def test_a_free_port_can_be_bound_on_the_loopback():
    import socket

    port = launch.free_port()
    assert isinstance(port, int) and 1024 <= port < 65536
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", port))


def test_torchrun_is_recognised_by_all_four_of_its_variables(monkeypatch):
    names = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
    for name in names:
        monkeypatch.setenv(name, "1")
    assert launch.launched_by_torchrun()
    for name in names:
        monkeypatch.delenv(name)
        assert not launch.launched_by_torchrun()
        monkeypatch.setenv(name, "1")


@pytest.mark.parametrize("backend, device", [("gloo", []), ("nccl", [3]), (None, [])])
def test_a_torchrun_rank_joins_its_group_on_its_local_device(monkeypatch, backend, device):
    calls, devices = [], []
    monkeypatch.setenv("LOCAL_RANK", "3")
    monkeypatch.setattr(launch.torch.cuda, "set_device", devices.append)
    monkeypatch.setattr(launch.dist, "init_process_group", lambda *a, **kw: calls.append((a, kw)))
    monkeypatch.setattr(launch.dist, "get_rank", lambda: 5)
    monkeypatch.setattr(launch.dist, "get_world_size", lambda: 8)
    monkeypatch.setattr(launch, "default_backend", lambda: "gloo")
    assert launch.init_from_env(backend, timeout_s=42.0) == (5, 8)
    assert calls == [((backend or "gloo",), {"init_method": "env://", "timeout": timedelta(seconds=42)})]
    assert devices == device
    monkeypatch.delenv("LOCAL_RANK")
    calls.clear()
    launch.init_from_env("nccl")  # no LOCAL_RANK: device 0, the default timeout
    assert devices[-1] == 0 and calls[0][1]["timeout"] == timedelta(seconds=600)


def test_stopped_by_signal_says_which_and_keeps_its_number():
    e = launch.StoppedBySignal(signal.SIGTERM, "rank 1: killed")
    assert str(e) == "stopped by signal SIGTERM: rank 1: killed" and e.signum == signal.SIGTERM
    assert isinstance(e, WorkerError)
