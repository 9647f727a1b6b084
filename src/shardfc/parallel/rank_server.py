"""Imported once by the fork server that starts :func:`~shardfc.parallel.launch.spawn`'s ranks.

Each rank is forked from that server with torch already imported, instead of starting a fresh
interpreter that imports torch again (≈ 2 s of CPU a rank). Nothing else imports this module:
importing it is what makes a process the server.

The server lives as long as the process that started it (it exits when that one does), and it
must not die of a SIGTERM sent to the whole process group (Slurm's ``scancel``, ``kill -- -PGID``):
the launcher reads its ranks' exit codes through it and would see them all gone while they are
still saving. So the server holds SIGTERM; a rank forked from it gets the handler too, and a SIGTERM
that reaches a rank before its worker starts is kept and raised again by :func:`release`.
"""

from __future__ import annotations

import os
import signal
from typing import List

import torch  # noqa: F401 -- the point of this module: ranks forked from the server start with it
import torch.distributed  # noqa: F401

_SERVER_PID = os.getpid()
_held: List[int] = []


def _hold(signum: int, frame=None) -> None:
    if os.getpid() != _SERVER_PID:
        _held.append(signum)  # a rank between its fork and release()


def release() -> None:
    """In a rank forked from the server, first thing: SIGTERM back to its default, and one that came
    before now raised again."""
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    if _held:
        os.kill(os.getpid(), _held[0])


signal.signal(signal.SIGTERM, _hold)
