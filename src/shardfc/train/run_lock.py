"""One run at a time in a run folder.

Two ``shardfc train`` runs started into one ``--output-dir`` (a job launched twice, a requeued job
while the first still runs) would both resume from the same checkpoint, then save the same step
names in turn, interleaving two trajectories under one run; append to one ``train.log`` and
``metrics.csv``; and each save's tidying would delete the other's save in progress. So rank 0 holds
an exclusive ``flock`` on ``<output_dir>/.shardfc-train.lock`` for the whole run, and a second run
is refused on every rank, before it reads or writes anything else there, naming the process that
holds the folder.

The kernel releases the lock when its process ends, however it ends (a crash, SIGKILL, a torchrun
restart): a lock file left behind is no obstacle. A forked child (a DataLoader worker) closes its
copy of the descriptor at once: a ``flock`` belongs to the open file, shared over ``fork``, and a
worker outliving a killed rank 0 by a second would otherwise hold the folder against the restart.
Where the filesystem has no locks (``ENOLCK`` on an NFS mount without lockd) or the OS has no
``flock`` (Windows), the run goes on unguarded, saying so.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import stat
import time
from pathlib import Path
from typing import Iterator, Optional, Set

from shardfc.parallel.context import DistContext
from shardfc.train.config import ConfigError

__all__ = ["LOCK_FILE", "run_folder_lock"]

logger = logging.getLogger("shardfc.train")

#: The lock file's name in the run folder.
LOCK_FILE = ".shardfc-train.lock"

#: The most of the holder's line a refusal quotes.
_HOLDER_BYTES = 300

try:
    import fcntl
except ImportError:  # Windows
    fcntl = None  # type: ignore[assignment]

#: The lock descriptors this process holds (see the module docstring: closed in a forked child).
_HELD: Set[int] = set()


def _close_held_in_child() -> None:
    for fd in _HELD:
        with contextlib.suppress(OSError):
            os.close(fd)
    _HELD.clear()


if hasattr(os, "register_at_fork"):  # (not on Windows, which neither forks nor has flock)
    os.register_at_fork(after_in_child=_close_held_in_child)


@contextlib.contextmanager
def run_folder_lock(out: Path, ctx: DistContext) -> Iterator[None]:
    """Hold run folder ``out`` for the run (rank 0 locks; every rank calls it: the verdict is
    broadcast, so a refused run stops on every rank alike).

    Raises:
        ConfigError: Another process holds the folder, or the lock file is not a regular file.
        OSError: The folder cannot be made (on every rank: rank 0's error).
    """
    fd: Optional[int] = None
    mine: Optional[Exception] = None
    if ctx.is_main:
        try:
            fd = _lock(Path(out))
        except Exception as e:  # every rank must learn of it (a folder it cannot make, too), or they would wait
            mine = e
    error = ctx.broadcast_object(mine)
    if error is not None:
        raise mine if mine is not None else error
    if fd is not None:
        _HELD.add(fd)
    try:
        yield
    finally:
        if fd is not None:
            _HELD.discard(fd)
            os.close(fd)  # closing the last descriptor of the open file releases the lock


def _lock(out: Path) -> Optional[int]:
    """The locked lock file's descriptor; None where locks are not to be had (a warning said so)."""
    if fcntl is None:
        logger.warning("no flock on this OS: a second run started into %s would not be refused", out)
        return None
    out.mkdir(parents=True, exist_ok=True)
    path = out / LOCK_FILE
    # Not through a link, not blocking on a FIFO planted there: the folder is the user's.
    flags = os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0)
    try:
        fd = os.open(path, flags, 0o644)
    except OSError as e:
        raise ConfigError(f"output_dir={str(out)!r}: cannot open its lock file {LOCK_FILE} ({e.strerror}); "
                          "remove whatever stands at that name") from None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise ConfigError(f"output_dir={str(out)!r}: its lock file {LOCK_FILE} is not a regular file; remove it")
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise ConfigError(
                f"output_dir={str(out)!r} is in use by another shardfc train ({_holder(fd)}): two runs in one folder "
                "would interleave their checkpoints and logs; wait for it to end, stop it, or choose another "
                "--output-dir") from None
        except OSError as e:  # ENOLCK: a filesystem without locks
            logger.warning("could not lock %s (%s): a second run started into this folder would not be refused",
                           path, e.strerror)
            os.close(fd)
            return None
        line = f"pid {os.getpid()} on {socket.gethostname()}, since {time.strftime('%Y-%m-%d %H:%M:%S')}\n"
        os.ftruncate(fd, 0)
        os.pwrite(fd, line.encode(), 0)
        return fd
    except BaseException:
        with contextlib.suppress(OSError):
            os.close(fd)
        raise


def _holder(fd: int) -> str:
    """The holder's line (``pid N on HOST, since T``), as it wrote it; a placeholder if there is none."""
    text = os.pread(fd, _HOLDER_BYTES, 0).decode("utf-8", errors="replace").strip()
    return text.splitlines()[0] if text else "no holder written yet"
