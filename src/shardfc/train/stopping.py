"""When the training loop stops early: a stop signal agreed by all ranks, and a test-only crash.

A rank acts on SIGINT / SIGTERM only at a step boundary, and only once every rank knows: a tiny
max all-reduce of the recorded signal (0: none) at each boundary. Ranks that got the signal at
different moments (torchrun signals its workers one after another) still leave after the same
step, and none is left waiting in a collective its peers abandoned.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

from shardfc.parallel.context import DistContext
from shardfc.parallel.lifecycle import received_signal

#: Test hook ``RANK:STEP:MARKER``: that rank ends itself (exit 1, no cleanup) before training step
#: STEP + 1, once -- the marker file it creates stops it from crashing again after a restart.
CRASH_ENV = "SHARDFC_TEST_CRASH"


def agreed_stop_signal(ctx: DistContext) -> int:
    """The largest signal number any rank recorded (0: none); collective over ``ctx``.

    One process (no communicator) has nothing to agree on: the recorded signal is read directly,
    with no tensor and no read back from one.
    """
    if ctx.communicator is None:
        return received_signal() or 0
    flag = torch.tensor([received_signal() or 0], dtype=torch.int32, device=ctx.comm_device)
    ctx.all_reduce_(flag, "max")
    return int(flag.item())


class StopAgreement:
    """:func:`agreed_stop_signal` at every step boundary, without a host sync per step under NCCL.

    With a CPU communicator (gloo, or none) each call is :func:`agreed_stop_signal`. With a CUDA
    one the flag's ``.item()`` would wait for everything queued on the device, the step just
    launched included, and leave the GPU idle while the next step is queued. There (or with
    ``lagged=True``) a call reads the agreement the *previous* call launched, waiting only for that
    one's event (queued before the previous step's kernels, so long done), then launches this
    step's: a fill kernel (no host-to-device copy), the max all-reduce, a non-blocking copy into
    pinned host memory and an event. Every rank reads the same agreed value at the same step, so
    all still leave after the same step: one step after a signal that an unlagged check would see.
    One process (no communicator) is never lagged: it reads its own recorded signal, nothing else.
    """

    def __init__(self, ctx: DistContext, lagged: "bool | None" = None) -> None:
        self.ctx = ctx
        self.device = ctx.comm_device
        if lagged is None:  # one process needs no lag: it agrees with itself, on the host
            lagged = self.device.type == "cuda" and ctx.communicator is not None
        self.lagged = bool(lagged)
        self._host = torch.zeros(1, dtype=torch.int32, pin_memory=self.device.type == "cuda")
        self._pending = False
        self._event = None

    def __call__(self) -> int:
        if not self.lagged:
            return agreed_stop_signal(self.ctx)
        previous = 0
        if self._pending:
            if self._event is not None:
                self._event.synchronize()
            previous = int(self._host[0])
        flag = torch.full((1,), received_signal() or 0, dtype=torch.int32, device=self.device)
        self.ctx.all_reduce_(flag, "max")
        self._host.copy_(flag, non_blocking=True)
        if self.device.type == "cuda":
            self._event = torch.cuda.Event()
            self._event.record()
        self._pending = True
        return previous


def crash_if_asked(rank: int, step: int) -> None:
    """Simulate a worker dying mid-run (:data:`CRASH_ENV`), for the elastic-restart tests."""
    spec = os.environ.get(CRASH_ENV)
    if not spec:
        return
    crash_rank, crash_step, marker = spec.split(":", 2)
    if rank == int(crash_rank) and step == int(crash_step) and not Path(marker).exists():
        Path(marker).write_text(f"rank {rank} crashed at step {step}\n", encoding="utf-8")
        os._exit(1)


__all__ = ["CRASH_ENV", "StopAgreement", "agreed_stop_signal", "crash_if_asked"]
