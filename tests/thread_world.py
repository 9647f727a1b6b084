"""Ranks as threads of the test's own process, whose collectives meet at a barrier.

The gloo tests run ranks in spawned processes, which mutation testing does not see (it traces the
test's process only). A :class:`ThreadWorld` runs the same cross-rank code in threads: each rank gets
a :class:`ThreadCommunicator` (the six operations of :class:`shardfc.parallel.comm.Communicator`)
and a :class:`~shardfc.parallel.context.DistContext` over it. A rank that skips a collective breaks
the barrier after ``timeout`` seconds instead of hanging the test.

:class:`TorchThreadWorld` goes one level lower, for the code that calls ``torch.distributed`` itself
(:mod:`shardfc.parallel.collectives`, ``TorchDistCommunicator``, ``DistContext.resolve``): each thread
initialises torch.distributed with torch's in-process ``"threaded"`` backend (the one torch's own
``MultiThreadedTestCase`` uses), so ``dist.all_gather_into_tensor``, ``dist.new_group`` and the rest
run for real between the threads.
"""

from __future__ import annotations

import datetime
import threading
from typing import Any, Callable, List, Optional, Sequence

import pytest
import torch
import torch.distributed as dist
from torch import Tensor

from shardfc.parallel.comm import Communicator, ReduceOpLike, reduce_op_name
from shardfc.parallel.context import DistContext


class ThreadCommunicator(Communicator):
    """One rank's collectives over the threads of a :class:`ThreadWorld`; sums and maxima are taken
    over the ranks in rank order, so every rank gets the same bits."""

    def __init__(self, world: "ThreadWorld", rank: int) -> None:
        self.world, self.rank, self.world_size = world, rank, world.size

    @property
    def backend(self) -> str:
        return "threads"

    @property
    def comm_device(self) -> torch.device:
        return torch.device("cpu")

    def _exchange(self, obj: Any) -> List[Any]:
        """Every rank's ``obj``, in rank order, once all have arrived."""
        self.world.slots[self.rank] = obj
        self.world.barrier.wait()
        out = list(self.world.slots)
        self.world.barrier.wait()  # nobody posts the next collective's object before all have read
        return out

    def all_gather_rows(self, x: Tensor, sizes: Sequence[int]) -> Tensor:
        if x.shape[0] != sizes[self.rank]:
            raise ValueError(f"rank {self.rank} posts {x.shape[0]} rows, sizes say {sizes[self.rank]}")
        return torch.cat([p.to(x.device) for p in self._exchange(x.detach().clone())])

    def reduce_scatter_rows(self, x: Tensor, sizes: Sequence[int]) -> Tensor:
        total = torch.stack(self._exchange(x.detach().clone())).sum(dim=0)
        start = sum(sizes[: self.rank])
        return total[start : start + sizes[self.rank]].to(x.device)

    def all_reduce_(self, t: Tensor, op: ReduceOpLike = "sum") -> Tensor:
        name = reduce_op_name(op)
        parts = torch.stack([p.to(t.device) for p in self._exchange(t.detach().clone())])
        with torch.no_grad():
            t.copy_(parts.sum(dim=0) if name == "sum" else parts.amax(dim=0))
        return t

    def all_gather_object(self, obj: Any) -> List[Any]:
        return self._exchange(obj)

    def broadcast_object(self, obj: Any) -> Any:
        return self._exchange(obj)[0]

    def barrier(self) -> None:
        self._exchange(None)


class ThreadWorld:
    """``size`` ranks as threads; :meth:`run` calls ``fn(rank)`` on each."""

    def __init__(self, size: int, timeout: float = 30.0) -> None:
        self.size = size
        self.slots: List[Any] = [None] * size
        self.barrier = threading.Barrier(size, timeout=timeout)
        self.local = threading.local()

    def context(self) -> DistContext:
        """The calling rank's context (inside :meth:`run`)."""
        return self.local.ctx

    def run(self, fn: Callable[[int], Any], monkeypatch: Optional[pytest.MonkeyPatch] = None) -> List[Any]:
        """``fn(rank)`` on every rank; each rank's result or exception. With ``monkeypatch``,
        ``DistContext.resolve()`` answers the calling rank's context (code that finds its own group)."""
        if monkeypatch is not None:
            monkeypatch.setattr(DistContext, "resolve", classmethod(lambda cls, group=None, device=None: self.context()))
        out: List[Any] = [None] * self.size

        def rank_main(rank: int) -> None:
            self.local.ctx = DistContext.from_comm(ThreadCommunicator(self, rank))
            try:
                out[rank] = fn(rank)
            except Exception as e:  # noqa: BLE001 - returned to the test
                out[rank] = e  # (not barrier.abort(): ranks just released from a wait would see it)

        threads = [threading.Thread(target=rank_main, args=(r,)) for r in range(self.size)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        return out

    def results(self, fn: Callable[[int], Any], monkeypatch: Optional[pytest.MonkeyPatch] = None) -> List[Any]:
        """:meth:`run`, raising the first rank's exception (the one that did not just see the barrier break)."""
        out = self.run(fn, monkeypatch)
        errors = [e for e in out if isinstance(e, Exception)]
        if errors:
            raise next((e for e in errors if not isinstance(e, threading.BrokenBarrierError)), errors[0])
        return out


class TorchThreadWorld:
    """``size`` ranks as threads, each with torch.distributed initialised over them (backend
    ``"threaded"``, from ``torch.testing._internal``: the test is skipped where that torch lacks it).

    :meth:`run` calls ``fn(rank)`` on every rank inside its own default group and returns each rank's
    result or exception. torch's threaded collectives wait without a limit, so a rank that skips one
    (or one that raised while the others wait) is ended after ``timeout`` seconds: the waiting ranks
    are woken and report a :class:`TimeoutError` instead of hanging the test.
    """

    def __init__(self, size: int, timeout: float = 30.0) -> None:
        self.size, self.timeout = size, timeout

    def run(self, fn: Callable[[int], Any]) -> List[Any]:
        threaded = pytest.importorskip("torch.testing._internal.distributed.multi_threaded_pg")
        isolation = getattr(torch._C._distributed_c10d, "_set_thread_isolation_mode", None)
        if isolation is None:
            pytest.skip("this torch has no thread-isolated process groups")
        out: List[Any] = [TimeoutError(f"rank {r} did not finish in {self.timeout} s") for r in range(self.size)]
        store = dist.HashStore()

        def rank_main(rank: int) -> None:
            try:
                dist.init_process_group("threaded", rank=rank, world_size=self.size, store=store,
                                        timeout=datetime.timedelta(seconds=self.timeout))
                out[rank] = fn(rank)
            except Exception as e:  # noqa: BLE001 - returned to the test
                out[rank] = e
                threaded.ProcessLocalGroup.exception_handle(e)  # wake the ranks waiting for this one
            except SystemExit:  # torch's threaded group ends a rank woken by another's failure so
                out[rank] = TimeoutError(f"rank {rank} was waiting in a collective when another rank failed")
            finally:
                if dist.is_initialized():
                    dist.destroy_process_group()

        isolation(True)
        threaded._install_threaded_pg()
        try:
            threads = [threading.Thread(target=rank_main, args=(r,), daemon=True) for r in range(self.size)]
            for t in threads:
                t.start()
            for t in threads:
                t.join(self.timeout)
                if t.is_alive():  # a rank waits for a collective another skipped: wake them all
                    threaded.ProcessLocalGroup.exception_handle(TimeoutError())
                    t.join(self.timeout)
        finally:
            threaded.ProcessLocalGroup.reset()
            threaded._uninstall_threaded_pg()
            isolation(False)
        return out

    def results(self, fn: Callable[[int], Any]) -> List[Any]:
        """:meth:`run`, raising the first rank's own exception (not a wait it ended)."""
        out = self.run(fn)
        errors = [e for e in out if isinstance(e, Exception)]
        if errors:
            raise next((e for e in errors if not isinstance(e, TimeoutError)), errors[0])
        return out
