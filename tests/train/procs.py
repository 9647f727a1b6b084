"""Start ``shardfc`` in a child process and watch its process tree (Linux /proc), for the signal tests."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable, List, Optional, Set

import pytest

import shardfc

#: Where the children import shardfc from: where this test process did.
SRC = Path(shardfc.__file__).resolve().parents[1]

#: A tiny synthetic run that would take hours: it only ends by a signal (or max_steps overridden later).
TINY_FLAGS = [
    "--synthetic-identities", "24", "--synthetic-images-per-identity", "5", "--image-size", "16", "16",
    "--embedding-dim", "16", "--batch-size", "8", "--warmup-steps", "1", "--log-every", "1",
    "--synthetic-val-pairs", "40", "--no-progress", "--eval-every", "0",
]

#: Generous: the machine running the tests may be shared and slow.
START_TIMEOUT_S = 300
GONE_TIMEOUT_S = 30

needs_proc = pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads the process tree from /proc")


def child_env(**extra: str) -> dict:
    env = {**os.environ, "OMP_NUM_THREADS": "1", **extra}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(SRC), env.get("PYTHONPATH", "")]))
    return env


def start(args: List[str], logs: Path, **env: str) -> subprocess.Popen:
    """``python ARGS`` in a new session (its own process group), output in ``logs``.out / .err files."""
    out = open(str(logs) + ".out", "w")
    err = open(str(logs) + ".err", "w")
    return subprocess.Popen([sys.executable, *args], stdout=out, stderr=err, env=child_env(**env), start_new_session=True)


def _ppids() -> dict:
    ppid = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
            except OSError:
                continue
            ppid[int(entry)] = int(stat.rsplit(")", 1)[1].split()[1])
    return ppid


def descendants(pid: int) -> Set[int]:
    """Every live process below ``pid``."""
    ppid = _ppids()
    found, frontier = set(), {pid}
    while frontier:
        frontier = {p for p, parent in ppid.items() if parent in frontier} - found
        found |= frontier
    return found


def alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"  # a zombie has exited; only its parent's wait is missing


def wait_for(what: str, predicate: Callable[[], object], timeout: float = START_TIMEOUT_S):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.2)
    raise AssertionError(f"timed out after {timeout} s waiting for {what}")


def wait_gone(pids: Set[int], timeout: float = GONE_TIMEOUT_S) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not any(alive(p) for p in pids):
            return
        time.sleep(0.2)
    raise AssertionError(f"processes still alive {timeout} s later: {sorted(p for p in pids if alive(p))}")


def trained_steps(out: Path) -> int:
    """The last step train.log reports (0 before the first)."""
    log = out / "train.log"
    steps = re.findall(r"step (\d+)/\d+ ", log.read_text()) if log.exists() else []
    return int(steps[-1]) if steps else 0


def stopped_step(out: Path, signum: int) -> int:
    found = re.findall(rf"stopped at step (\d+) by signal {signal.Signals(signum).name}", (out / "train.log").read_text())
    assert len(found) == 1, (out / "train.log").read_text()[-2000:]
    return int(found[0])


def checkpoint_steps(out: Path) -> List[int]:
    """Steps of the complete checkpoints (meta.json written) in ``out``."""
    root = out / "checkpoints"
    return sorted(int(d.name.split("_")[1]) for d in root.glob("step_*") if (d / "meta.json").exists()) if root.exists() else []


def read(path: Path, suffix: str) -> str:
    return Path(str(path) + suffix).read_text()


def finish(proc: subprocess.Popen, timeout: float = START_TIMEOUT_S) -> Optional[int]:
    try:
        return proc.wait(timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        raise
