"""Start a process group: spawn N local processes, or join one started by torchrun.

Nothing here runs at import time; callers create and destroy the group explicitly.
"""

from __future__ import annotations

import logging
import os
import socket
import tempfile
import traceback
from datetime import timedelta
from typing import Any, Callable, List, Optional

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


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
    backend = backend or default_backend()
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    dist.init_process_group(backend, init_method="env://", timeout=timedelta(seconds=timeout_s))
    return dist.get_rank(), dist.get_world_size()


def launched_by_torchrun() -> bool:
    return all(k in os.environ for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"))


def _worker(rank: int, world_size: int, init_method: str, backend: str, fn: Callable, args: tuple, queue, timeout_s: float):
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world_size))
    if backend == "nccl":
        torch.cuda.set_device(rank % torch.cuda.device_count())
    dist.init_process_group(
        backend,
        init_method=init_method,
        rank=rank,
        world_size=world_size,
        timeout=timedelta(seconds=timeout_s),
    )
    try:
        result = fn(rank, world_size, *args)
        queue.put((rank, True, result))
    except BaseException as e:  # report to the parent with the worker's traceback
        queue.put((rank, False, f"{type(e).__name__}: {e}\n{traceback.format_exc()}"))
    finally:
        dist.destroy_process_group()


class WorkerError(RuntimeError):
    """A spawned rank raised; the message holds its traceback."""


def spawn(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    backend: Optional[str] = None,
    timeout_s: float = 300.0,
) -> List[Any]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` new processes in one process group.

    ``fn`` must be importable (module level). Returns the ranks' return values in rank order, or
    raises :class:`WorkerError` with the first failing rank's traceback.
    """
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be a positive integer, got {world_size!r}")
    backend = backend or default_backend()
    ctx = mp.get_context("spawn")
    queue = ctx.SimpleQueue()
    # Rendezvous through a file, not a TCP port picked in advance: another process may take a
    # port between our choosing it and rank 0 binding it.
    with tempfile.TemporaryDirectory(prefix="shardfc-spawn-") as tmp:
        init_method = "file://" + os.path.join(tmp, "rendezvous")
        return _run(ctx, queue, fn, world_size, init_method, backend, args, timeout_s)


def _run(ctx, queue, fn, world_size, init_method, backend, args, timeout_s) -> List[Any]:
    procs = [
        ctx.Process(target=_worker, args=(r, world_size, init_method, backend, fn, args, queue, timeout_s), daemon=False)
        for r in range(world_size)
    ]
    for p in procs:
        p.start()
    results: dict = {}
    failures: dict = {}
    for _ in range(world_size):
        rank, ok, value = queue.get()
        (results if ok else failures)[rank] = value
    for p in procs:
        p.join()
    if failures:
        first = min(failures)
        raise WorkerError(f"rank {first} of {world_size} failed:\n{failures[first]}")
    bad = [p.exitcode for p in procs if p.exitcode != 0]
    if bad:
        # Every rank returned its result; only the interpreter's teardown failed.
        logging.getLogger("shardfc.launch").warning(
            "all %d ranks finished, but worker processes exited with codes %s during teardown", world_size, bad
        )
    return [results[r] for r in range(world_size)]
