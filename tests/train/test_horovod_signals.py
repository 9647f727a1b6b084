"""``shardfc train --strategy horovod`` under ``horovodrun``: a signal stops every rank cleanly.

The Horovod counterpart of the torchrun and spawn signal tests (test_torchrun_elastic.py,
test_signals.py). Three ways a Horovod run is asked to stop:

* SIGTERM to ``horovodrun`` (what a scheduler sends the launcher): horovodrun terminates its
  workers with SIGTERM;
* Ctrl-C (SIGINT to the terminal's foreground process group): horovodrun runs each worker in a
  process group of its own, so the SIGINT reaches horovodrun alone, which terminates the workers
  with SIGTERM too;
* SIGINT to every rank (a cluster tool signalling the training processes themselves).

Each time both ranks stop after the same step (one max-reduce of the signal through Horovod
before each step), save a checkpoint there, exit 143 / 130 (for the signal they received) without
a traceback, and no process is left behind; a later run resumes from that checkpoint.
horovodrun's own exit status and report on a signal are its business, as torchrun's are.

Skipped without Horovod, failing instead with ``SHARDFC_REQUIRE_HOROVOD=1`` (as CI runs).
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from shardfc.cli import train as train_cli

from .procs import (
    TINY_FLAGS,
    checkpoint_steps,
    child_env,
    descendants,
    finish,
    needs_proc,
    stopped_step,
    trained_steps,
    wait_for,
    wait_gone,
)

pytestmark = needs_proc

#: The process exit status of a run stopped by each signal (128 + its number), as every rank reports it.
EXIT = {signal.SIGTERM: 143, signal.SIGINT: 130}


def _start(horovodrun, out, logs):
    # Each rank prints its own exit status on the way out, so the test can see it through
    # horovodrun (which reports only the first non-zero one, and nothing once it is signalled).
    probe = ("import runpy, sys\n"
             "sys.argv = ['shardfc'] + sys.argv[1:]\n"
             "try:\n"
             "    runpy.run_module('shardfc', run_name='__main__')\n"
             "except SystemExit as e:\n"
             "    print(f'rank exit status {e.code}', flush=True)\n"
             "    raise\n")
    cmd = [horovodrun.launcher, "-np", "2", "--gloo", sys.executable, "-c", probe, "train", "--strategy", "horovod",
           *TINY_FLAGS, "--max-steps", "100000", "--ckpt-every", "2", "--output-dir", str(out)]
    with open(str(logs) + ".out", "w") as stdout:
        return subprocess.Popen(cmd, stdout=stdout, stderr=subprocess.STDOUT, env=child_env(PYTHONUNBUFFERED="1"),
                                start_new_session=True)


def _workers(tree) -> list:
    """The training processes (python running ``train --strategy horovod``) among ``tree``."""
    found = []
    for pid in tree:
        try:
            argv = open(f"/proc/{pid}/cmdline", "rb").read().split(b"\0")
        except OSError:
            continue
        launcher = b"--gloo" in argv  # horovodrun itself (a python script) carries the command too
        if Path(argv[0].decode()).name.startswith("python") and b"--strategy" in argv and b"horovod" in argv and not launcher:
            found.append(pid)
    return found


#: (what is signalled, the signal sent, the signal the ranks receive and stop by)
CASES = {
    "SIGTERM-to-horovodrun": ("launcher", signal.SIGTERM, signal.SIGTERM),
    "ctrl-c": ("group", signal.SIGINT, signal.SIGTERM),
    "SIGINT-to-the-ranks": ("ranks", signal.SIGINT, signal.SIGINT),
}


@pytest.mark.parametrize("case", list(CASES))
def test_a_signal_stops_every_rank_at_one_step_saves_and_leaves_no_process(horovodrun, tmp_path, case):
    target, sent, received = CASES[case]
    out = tmp_path / "run"
    proc = _start(horovodrun, out, tmp_path / "horovodrun")
    console = lambda: (tmp_path / "horovodrun.out").read_text(errors="replace")  # noqa: E731
    wait_for("step 3 in train.log", lambda: trained_steps(out) >= 3 or proc.poll() is not None)
    assert proc.poll() is None, console()[-3000:]
    tree = descendants(proc.pid) | {proc.pid}
    ranks = _workers(tree)
    assert len(ranks) == 2, (tree, ranks)  # horovodrun's 2 workers (beside the watchers between them)
    if target == "launcher":
        os.kill(proc.pid, sent)  # the launcher only: it must pass the stop on
    elif target == "group":
        os.killpg(proc.pid, sent)  # Ctrl-C in a terminal: the foreground process group at once
    else:
        for pid in ranks:
            os.kill(pid, sent)
    finish(proc)
    wait_gone(tree)  # no stray process: workers, watchers and horovodrun have exited

    step = stopped_step(out, received)  # rank 0's log: once, at one step
    assert step >= 3 and checkpoint_steps(out)[-1] == step
    saved = f"saved checkpoint {out / 'checkpoints' / f'step_{step:08d}'}"
    assert (out / "train.log").read_text().count(saved) == 1
    text = console()
    # both ranks left the loop after that same step and exited with the signal's status, no traceback
    assert re.findall(r"rank exit status (\d+)", text) == [str(EXIT[received])] * 2, text[-3000:]
    workers = "\n".join(line for line in text.splitlines() if re.match(r"\[\d+\]<std(out|err)>:", line))
    assert "Traceback" not in workers, workers[-3000:]  # (horovodrun's own report of a non-zero exit is its business)

    if case == "SIGTERM-to-horovodrun":  # resume (here in one process) from the step reached
        argv = [*TINY_FLAGS, "--max-steps", str(step + 1), "--ckpt-every", "2", "--output-dir", str(out)]
        assert train_cli.main(argv) == 0
        assert f"resuming from {out / 'checkpoints' / f'step_{step:08d}'}" in (out / "train.log").read_text()
        assert checkpoint_steps(out)[-1] == step + 1
