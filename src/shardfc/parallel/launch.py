"""Start a process group: spawn N local processes, or join one started by torchrun.

Nothing here runs at import time; callers create and destroy the group explicitly.
"""

from __future__ import annotations

import io
import logging
import os
import queue as queue_module
import socket
import sys
import tempfile
import time
import traceback
from datetime import timedelta
from multiprocessing import reduction
from typing import Any, Callable, List, Optional

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from shardfc.checks import check_timeout
from shardfc.parallel.lifecycle import die_with_parent, forward_stop_signals, signal_name


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def default_backend() -> str:
    """NCCL when CUDA is usable, else gloo."""
    return "nccl" if torch.cuda.is_available() and dist.is_nccl_available() else "gloo"


def init_from_env(backend: Optional[str] = None, timeout_s: float = 600.0) -> tuple[int, int]:
    """Join the group torchrun describes (env://): returns ``(rank, world_size)``."""
    timeout_s = check_timeout("timeout_s", timeout_s)
    backend = backend or default_backend()
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    dist.init_process_group(backend, init_method="env://", timeout=timedelta(seconds=timeout_s))
    return dist.get_rank(), dist.get_world_size()


def launched_by_torchrun() -> bool:
    return all(k in os.environ for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"))


#: The ways :func:`spawn` can start its ranks (``SHARDFC_START_METHOD`` picks one): ``forkserver``
#: forks each rank from a server process that imported torch once (a 4-rank launch starts in 0.1 s
#: instead of 4.5 on a 2-core machine: torch's import, ≈ 2 s of CPU, in each rank); ``spawn`` starts
#: a fresh interpreter per rank. The default is the first the platform has.
START_METHODS = ("forkserver", "spawn")
START_METHOD_ENV = "SHARDFC_START_METHOD"

#: The module the fork server imports (``rank_server.py`` says why it is a module of its own).
_RANK_SERVER = "shardfc.parallel.rank_server"


def start_method() -> str:
    """How :func:`spawn` starts ranks here: ``SHARDFC_START_METHOD``, else the first of
    :data:`START_METHODS` the platform has."""
    available = mp.get_all_start_methods()
    chosen = os.environ.get(START_METHOD_ENV, "").strip()
    if not chosen:
        return next(m for m in START_METHODS if m in available)
    if chosen not in START_METHODS:
        raise ValueError(f"{START_METHOD_ENV} must be one of {', '.join(START_METHODS)}, got {chosen!r}")
    if chosen not in available:
        raise ValueError(f"{START_METHOD_ENV}={chosen!r}: this platform starts processes only by {', '.join(available)}")
    return chosen


class _LauncherStdio:
    """The launcher's stdout and stderr as they are at the launch, for its ranks.

    A rank forked from the server would write to the files the server inherited when it started
    (the launcher's stdout of then: a log redirected since, or a test's captured output, would
    miss it). Pickled for the rank, each becomes a copy of the launcher's descriptor, sent with it.
    """

    def __init__(self, fds: Optional[dict] = None):
        self.fds = fds or {}

    def __reduce__(self):
        dups = tuple((fd, reduction.DupFd(fd)) for fd in (1, 2) if _is_open(fd))
        return (_LauncherStdio._received, (dups,))

    @staticmethod
    def _received(dups: tuple) -> "_LauncherStdio":
        return _LauncherStdio({fd: dup.detach() for fd, dup in dups})

    def adopt(self) -> None:
        """In the rank: its stdout / stderr become the launcher's."""
        for stream in (sys.stdout, sys.stderr):
            if stream is not None:
                stream.flush()
        for fd, copy in self.fds.items():
            if copy != fd:  # a spawned rank inherits the launcher's descriptor as it is
                os.dup2(copy, fd)
                os.close(copy)


def _is_open(fd: int) -> bool:
    try:
        os.fstat(fd)
    except OSError:
        return False
    return True


#: Marks a report from a rank whose process group never formed (nothing of ``fn`` ran).
_INIT_FAILED = "process group init failed: "


def _worker(rank, world_size, init_method, backend, fn: Callable, args: tuple, queue, timeout_s: float,
            launcher_pid: int, env: dict, stdio: "_LauncherStdio"):
    server = sys.modules.get(_RANK_SERVER)
    if server is not None:  # forked from the server: its SIGTERM hold off, its start-time state replaced
        server.release()
    stdio.adopt()
    if os.environ != env:
        os.environ.clear()
        os.environ.update(env)
    # No orphans: a launcher killed outright takes its workers along. A rank's parent is the launcher
    # (spawn) or the server (forkserver), which exits when the launcher does; the launcher is watched
    # too, for a server that was gone before this line.
    die_with_parent(os.getppid(), launcher_pid=launcher_pid)
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world_size))
    try:
        if backend == "nccl":
            torch.cuda.set_device(rank % torch.cuda.device_count())
        dist.init_process_group(
            backend,
            init_method=init_method,
            rank=rank,
            world_size=world_size,
            timeout=timedelta(seconds=timeout_s),
        )
    except BaseException as e:
        queue.put((rank, False, f"{_INIT_FAILED}{type(e).__name__}: {e}"))
        return
    try:
        result = fn(rank, world_size, *args)
        # By value: a tensor sent as-is lives in this process's shared memory, gone once it exits.
        buffer = io.BytesIO()
        torch.save(result, buffer)
        queue.put((rank, True, buffer.getvalue()))
    except BaseException as e:  # report to the parent with the worker's traceback
        queue.put((rank, False, f"{type(e).__name__}: {e}\n{traceback.format_exc()}"))
    finally:
        dist.destroy_process_group()


class WorkerError(RuntimeError):
    """A spawned rank raised or died; the message holds its traceback or exit code."""


class StoppedBySignal(WorkerError):
    """The launcher got SIGINT / SIGTERM and some rank ended without returning (killed, or a second signal)."""

    def __init__(self, signum: int, detail: str):
        super().__init__(f"stopped by signal {signal_name(signum)}: {detail}")
        self.signum = signum


class _GroupNeverFormed(WorkerError):
    """Process-group initialisation failed on some rank, so no rank got past a collective."""


#: Tries at forming the process group before spawn gives up.
INIT_ATTEMPTS = 3


#: After one rank fails, how long the others get to report before they are stopped.
FAILURE_GRACE_S = 10.0


def _collect(queue, procs, results: dict, failures: dict) -> None:
    """Gather every rank's report; stop early when a rank dies without one or another failed."""
    pending = set(range(len(procs)))
    failed_at = None
    while pending:
        try:
            rank, ok, payload = queue.get(timeout=0.5)
        except queue_module.Empty:
            dead = sorted(r for r in pending if procs[r].exitcode is not None)
            if dead and queue.empty():
                time.sleep(1.0)  # a report still in the pipe from a rank that just exited
                if queue.empty():
                    for r in dead:
                        failures[r] = f"exited with code {procs[r].exitcode} before reporting a result"
                    return
            if failed_at is not None and time.monotonic() - failed_at > FAILURE_GRACE_S:
                for r in pending:
                    failures.setdefault(r, "stopped: another rank failed first")
                return
            continue
        pending.discard(rank)
        if ok:
            # Not a file: the bytes this launcher's own child wrote into an inherited pipe, which
            # multiprocessing has just unpickled in full to deliver them (queue.get). The result of
            # ``fn`` may be any object, so weights_only=True would refuse results and protect nothing.
            results[rank] = torch.load(io.BytesIO(payload), weights_only=False)
        else:
            failures[rank] = payload
            failed_at = failed_at or time.monotonic()


def spawn(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    backend: Optional[str] = None,
    timeout_s: float = 300.0,
) -> List[Any]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` new processes in one process group.

    ``fn`` must be importable (module level). ``backend`` defaults to NCCL where CUDA is usable,
    else gloo; NCCL takes one CUDA device per rank (rank r on device r), so more ranks than visible
    devices is a ValueError before any rank starts. Returns the ranks' return values in rank order
    (sent by value through ``torch.save``), or raises :class:`WorkerError` with the failing rank's
    traceback. A rank that dies without reporting, or fails while its peers wait in a collective,
    does not hang the caller: the others are stopped. SIGINT / SIGTERM to the caller are sent on to
    the ranks (a second one kills them); if a rank then ends without returning,
    :class:`StoppedBySignal` is raised. If the process group fails to form
    (gloo's connect can fail on a loaded machine), the whole launch is retried up to
    ``INIT_ATTEMPTS`` times. The ranks are forked from a server with torch imported, or started as
    fresh interpreters (:func:`start_method`); either way each gets this process's environment and
    stdout / stderr as they are now.
    """
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be a positive integer, got {world_size!r}")
    timeout_s = check_timeout("timeout_s", timeout_s)  # each rank's group would fail to form, every attempt
    backend = backend or default_backend()
    if backend == "nccl":  # refused here, not by a rank: each would fail alone, the launch retried in vain
        devices = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if world_size > devices:
            raise ValueError(
                f"backend 'nccl' needs a CUDA device per rank: world_size={world_size} but {devices} CUDA device(s) "
                "are visible (use backend 'gloo', or fewer ranks)"
            )
    method = start_method()
    ctx = mp.get_context(method)
    if method == "forkserver":
        ctx.set_forkserver_preload([_RANK_SERVER])  # read when the server starts (the first launch)
    # Rendezvous through a file, not a TCP port picked in advance: another process may take a
    # port between our choosing it and rank 0 binding it.
    for attempt in range(INIT_ATTEMPTS):
        with tempfile.TemporaryDirectory(prefix="shardfc-spawn-") as tmp:
            init_method = "file://" + os.path.join(tmp, "rendezvous")
            try:
                return _run(ctx, ctx.Queue(), fn, world_size, init_method, backend, args, timeout_s)
            except _GroupNeverFormed as e:
                # gloo's full-mesh connect can fail on a loaded machine (seen with 2 cores shared by
                # many process groups); fn is run again from the start on a fresh group.
                logging.getLogger("shardfc.launch").warning("attempt %d: %s; retrying", attempt + 1, e)
                last = e
    raise WorkerError(f"the process group did not form in {INIT_ATTEMPTS} attempts: {last}")


def _run(ctx, queue, fn, world_size, init_method, backend, args, timeout_s) -> List[Any]:
    args = (world_size, init_method, backend, fn, args, queue, timeout_s, os.getpid(), dict(os.environ), _LauncherStdio())
    procs = [ctx.Process(target=_worker, args=(r, *args), daemon=False) for r in range(world_size)]
    results: dict = {}
    failures: dict = {}
    # SIGINT / SIGTERM reach every worker (a trainer stops at an agreed step and returns); a second kills them.
    with forward_stop_signals(lambda: procs) as signals:
        for p in procs:
            p.start()
        if signals.received is not None:  # it came while some ranks were not started yet
            signals.send(signals.received)
        try:
            _collect(queue, procs, results, failures)
        finally:
            for p in procs:  # a rank stuck in a collective with a dead peer never returns by itself
                if p.is_alive() and (failures or len(results) < world_size):
                    p.kill()  # not SIGTERM: a trainer records that one and would wait for its peers
        for p in procs:
            p.join()
    if failures and signals.received is not None:
        raise StoppedBySignal(signals.received, "; ".join(f"rank {r}: {m.splitlines()[0]}" for r, m in failures.items()))
    if failures:
        # The cause: a rank that died without a word, else the first to report; the others'
        # errors are usually its echo (a peer's connection reset).
        # A rank whose group never formed: the others cannot have got past their first collective.
        if any(m.startswith(_INIT_FAILED) for m in failures.values()):
            raise _GroupNeverFormed("; ".join(f"rank {r}: {m}" for r, m in failures.items()))
        died = [r for r, m in failures.items() if m.startswith("exited with code")]
        first = died[0] if died else next(iter(failures))
        raise WorkerError(f"rank {first} of {world_size} failed:\n{failures[first]}")
    bad = [p.exitcode for p in procs if p.exitcode != 0]
    if bad:
        # Every rank returned its result; only the interpreter's teardown failed.
        logging.getLogger("shardfc.launch").warning(
            "all %d ranks finished, but worker processes exited with codes %s during teardown", world_size, bad
        )
    return [results[r] for r in range(world_size)]
