"""Processes that live and die together and stop cleanly on SIGINT / SIGTERM.

Three pieces, used by the launcher (:func:`~shardfc.parallel.launch.spawn`), its workers and the
trainer:

* :func:`record_stop_signals` -- while inside, SIGINT and SIGTERM are *recorded*
  (:func:`received_signal`) instead of raising ``KeyboardInterrupt`` or killing the process, so
  the trainer can stop at a step boundary that every rank agrees on (a rank interrupted inside a
  collective would leave its peers waiting in it).
* :func:`die_with_parent` -- a worker gets SIGTERM when its parent dies, even by SIGKILL:
  ``prctl(PR_SET_PDEATHSIG)`` on Linux, and a watchdog thread on ``os.getppid()`` everywhere (it
  also ends the process outright if the graceful stop does not finish in time).
* :func:`forward_stop_signals` -- the launcher passes SIGINT / SIGTERM on to its workers; a second
  one kills them.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys
import threading
import time
from contextlib import contextmanager
from typing import Callable, Iterator, Optional, Sequence

#: The signals that ask a run to stop (Ctrl-C, and what schedulers and torchrun send).
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)

_received: Optional[int] = None


def received_signal() -> Optional[int]:
    """The first stop signal this process recorded (a number), or None."""
    return _received


def exit_code(signum: int) -> int:
    """The shell's exit status of a process ended by ``signum``: 130 for SIGINT, 143 for SIGTERM."""
    return 128 + int(signum)


def signal_name(signum: int) -> str:
    return signal.Signals(signum).name


def _record(signum: int, frame=None) -> None:
    global _received
    if _received is None:
        _received = signum


def _reset_for_tests() -> None:
    global _received
    _received = None


@contextmanager
def _handlers(handler: Callable) -> Iterator[None]:
    """``handler`` for the stop signals while inside; the previous handlers after. Off the main
    thread (where Python cannot install handlers) nothing changes."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = {s: signal.signal(s, handler) for s in STOP_SIGNALS}
    try:
        yield
    finally:
        for s, h in previous.items():
            signal.signal(s, h)


@contextmanager
def record_stop_signals() -> Iterator[None]:
    """Record SIGINT / SIGTERM for :func:`received_signal` instead of acting on them, while inside."""
    with _handlers(_record):
        yield


def ignore_stop_signals(worker_id: int = 0) -> None:
    """``worker_init_fn`` of DataLoader workers: Ctrl-C (and Slurm's SIGTERM) reach the whole process
    group, and a loader worker dying of it would fail its trainer's step before the agreed stop. The
    loader still ends its workers itself (shutdown message, or they see their parent gone)."""
    for s in STOP_SIGNALS:
        signal.signal(s, signal.SIG_IGN)


#: After the parent died, how long a worker has to stop gracefully (save its checkpoint) before it
#: ends itself.
ORPHAN_GRACE_S = 120.0

_PR_SET_PDEATHSIG = 1


def die_with_parent(
    parent_pid: int,
    grace_s: float = ORPHAN_GRACE_S,
    poll_s: float = 1.0,
    use_prctl: bool = True,
    launcher_pid: Optional[int] = None,
) -> None:
    """Send this process SIGTERM when ``parent_pid`` (its parent now) dies; end it ``grace_s`` later.

    SIGTERM, not SIGKILL: a trainer that records it stops at the next step boundary and saves a
    checkpoint, as on a SIGTERM from the launcher. Call once, early in the child. ``use_prctl``
    False leaves the watchdog alone (as off Linux). ``launcher_pid``: the process that asked for this
    one, when a fork server stands between them; the watchdog also stops the child once it is gone
    (the server exits with the launcher, but may have done so before this call).
    """
    if use_prctl and sys.platform.startswith("linux"):
        try:
            libc = ctypes.CDLL(None, use_errno=True)
            libc.prctl(_PR_SET_PDEATHSIG, int(signal.SIGTERM), 0, 0, 0)
        except (OSError, AttributeError):  # no prctl: the watchdog alone
            pass

    def watch() -> None:
        while os.getppid() == parent_pid and (launcher_pid is None or _exists(launcher_pid)):
            time.sleep(poll_s)
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(grace_s)
        os._exit(exit_code(signal.SIGTERM))  # the graceful stop hung (a dead peer in a collective)

    threading.Thread(target=watch, name="shardfc-parent-watchdog", daemon=True).start()
    # The parent may have died before prctl was set: the watchdog sees it within poll_s.


def _exists(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process
        return True
    return True


class _Forwarder:
    """Sends the stop signals this process gets on to ``children()``; a second one kills them."""

    def __init__(self, children: Callable[[], Sequence]):
        self.children = children
        self.got: list = []

    @property
    def received(self) -> Optional[int]:
        return self.got[0] if self.got else None

    def __call__(self, signum: int, frame=None) -> None:
        _record(signum)
        self.got.append(signum)
        self.send(signal.SIGKILL if len(self.got) > 1 else signum)

    def send(self, signum: int) -> None:
        for p in self.children():
            if p.pid is None or p.exitcode is not None:
                continue
            try:
                os.kill(p.pid, signum)
            except ProcessLookupError:
                pass


@contextmanager
def forward_stop_signals(children: Callable[[], Sequence]) -> Iterator[_Forwarder]:
    """While inside, a SIGINT / SIGTERM to this process is recorded and sent on to ``children()``
    (``multiprocessing.Process`` objects); a second one kills them (SIGKILL).

    Yields the forwarder: ``.received`` is the first signal (None while none); ``.send(signum)``
    signals the children again (for those started after the signal came).
    """
    forwarder = _Forwarder(children)
    with _handlers(forwarder):
        yield forwarder


__all__ = [
    "ORPHAN_GRACE_S",
    "STOP_SIGNALS",
    "die_with_parent",
    "exit_code",
    "forward_stop_signals",
    "ignore_stop_signals",
    "received_signal",
    "record_stop_signals",
    "signal_name",
]
