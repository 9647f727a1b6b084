"""The sm_90 build of every registered kernel (``python -m shardfc.head.fused.aot``) for test_aot.py,
started in a subprocess as soon as collection finds that module's tests (conftest.py), so that its
half a minute of compiling overlaps the tests that run before them instead of adding to the
session. :func:`result` waits for it (or starts it, when nothing did)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from typing import List, Optional

_proc: Optional[subprocess.Popen] = None
_out = None


def start() -> None:
    """Start the build (once)."""
    global _proc, _out
    if _proc is not None:
        return
    env = {**os.environ, "TRITON_INTERPRET": "0", "TRITON_DEFAULT_FP_FUSION": "1"}
    _out = tempfile.TemporaryFile(mode="w+")
    _proc = subprocess.Popen([sys.executable, "-m", "shardfc.head.fused.aot", "--variants", "all", "--json"],
                             env=env, stdout=_out, stderr=subprocess.STDOUT, text=True)


def result(timeout: float = 600.0) -> List[dict]:
    """The build's JSON lines, one per kernel × config × variant; fails with its output if it failed."""
    start()
    try:
        code = _proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        _proc.kill()
        raise
    _out.seek(0)
    text = _out.read()
    assert code == 0, text[-3000:]
    return [json.loads(line) for line in text.splitlines() if line.startswith("{")]


def stop() -> None:
    """End a build nobody waited for (the session was interrupted)."""
    if _proc is not None and _proc.poll() is None:
        _proc.kill()
        _proc.wait()
