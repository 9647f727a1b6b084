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
    """The largest signal number any rank recorded (0: none); collective over ``ctx``."""
    flag = torch.tensor([received_signal() or 0], dtype=torch.int32, device=ctx.comm_device)
    ctx.all_reduce_(flag, "max")
    return int(flag.item())


def crash_if_asked(rank: int, step: int) -> None:
    """Simulate a worker dying mid-run (:data:`CRASH_ENV`), for the elastic-restart tests."""
    spec = os.environ.get(CRASH_ENV)
    if not spec:
        return
    crash_rank, crash_step, marker = spec.split(":", 2)
    if rank == int(crash_rank) and step == int(crash_step) and not Path(marker).exists():
        Path(marker).write_text(f"rank {rank} crashed at step {step}\n", encoding="utf-8")
        os._exit(1)


__all__ = ["CRASH_ENV", "agreed_stop_signal", "crash_if_asked"]
