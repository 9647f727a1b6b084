"""The fork server spawn's ranks come from: it survives a SIGTERM, a rank forked from it does not lose one.

Importing ``rank_server`` installs its SIGTERM handler: in a child interpreter, or here under a fixture
that puts the handler back and forgets the module (``spawn``'s rank side looks for it in sys.modules).
"""

from __future__ import annotations

import importlib
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import shardfc

SRC = str(Path(shardfc.__file__).resolve().parents[1])

# The server: a SIGTERM to it (one sent to the whole process group, say) is held, and kept for nobody.
# Then a rank forked from it: a SIGTERM before its worker starts is kept; release() raises it again.
_SCRIPT = """
import os, signal, sys, time
import shardfc.parallel.rank_server as server

os.kill(os.getpid(), signal.SIGTERM)
time.sleep(0.2)
print("server alive, held", server._held, flush=True)

def rank(send_early):
    if send_early:
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(0.2)
        print("rank alive, held", server._held, flush=True)
    server.release()
    print("rank released", flush=True)
    if not send_early:
        os.kill(os.getpid(), signal.SIGTERM)  # after release: SIGTERM's default again
    time.sleep(5)
    os._exit(0)

for send_early in (True, False):
    pid = os.fork()
    if pid == 0:
        rank(send_early)
    _, status = os.waitpid(pid, 0)
    print("rank ended", os.waitstatus_to_exitcode(status), flush=True)
"""


@pytest.mark.skipif(not hasattr(os, "fork"), reason="the fork server needs fork")
def test_the_server_outlives_a_sigterm_and_a_rank_keeps_one_that_came_before_its_start():
    env = {**os.environ, "PYTHONPATH": SRC}
    done = subprocess.run([sys.executable, "-c", textwrap.dedent(_SCRIPT)], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    term = -int(signal.SIGTERM)
    assert done.stdout.splitlines() == [
        "server alive, held []",
        f"rank alive, held [{int(signal.SIGTERM)}]",
        f"rank ended {term}",  # raised again by release(): it never printed "rank released"
        "rank released",
        f"rank ended {term}",
    ], done.stderr


NAME = "shardfc.parallel.rank_server"


@pytest.fixture
def server(monkeypatch):
    """The module imported in this process as if it were the server; everything put back after."""
    before = signal.getsignal(signal.SIGTERM)
    sys.modules.pop(NAME, None)
    try:
        yield importlib.import_module(NAME)
    finally:
        sys.modules.pop(NAME, None)
        if hasattr(shardfc.parallel, "rank_server"):
            delattr(shardfc.parallel, "rank_server")
        signal.signal(signal.SIGTERM, before)


def test_importing_it_makes_this_process_the_server_that_holds_sigterm(server, monkeypatch):
    assert server._SERVER_PID == os.getpid() and server._held == []
    assert signal.getsignal(signal.SIGTERM) is server._hold
    server._hold(signal.SIGTERM)  # in the server: kept for nobody
    assert server._held == []
    monkeypatch.setattr(server.os, "getpid", lambda: server._SERVER_PID + 1)  # a rank forked from it
    server._hold(signal.SIGTERM)
    assert server._held == [signal.SIGTERM]


@pytest.mark.parametrize("held", [[], [signal.SIGTERM]], ids=["none-came", "one-came-before-the-worker"])
def test_release_gives_sigterm_its_default_back_and_raises_one_that_came_before(server, monkeypatch, held):
    sent = []
    monkeypatch.setattr(server.os, "kill", lambda pid, signum: sent.append((pid, signum)))
    monkeypatch.setattr(server, "_held", list(held))
    server.release()
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL
    assert sent == [(os.getpid(), signal.SIGTERM)] * len(held)
