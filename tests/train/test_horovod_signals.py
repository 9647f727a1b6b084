"""``shardfc train --strategy horovod`` under ``horovodrun``: a signal stops every rank cleanly.

The Horovod counterpart of the torchrun and spawn signal tests (test_torchrun_elastic.py,
test_signals.py): SIGTERM to ``horovodrun`` (what a scheduler sends the launcher; horovodrun's
process watchers pass it on to the workers' process groups) or Ctrl-C (SIGINT to the whole
foreground process group) while training: both ranks stop after the same step (one max-reduce of
the signal through Horovod before each step), save a checkpoint there, exit 143 / 130 without a
traceback, and no process is left behind; a later run resumes from that checkpoint. horovodrun's
own exit status on a signal is its business, as torchrun's is.

Skipped without Horovod, failing instead with ``SHARDFC_REQUIRE_HOROVOD=1`` (as CI runs).
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys

import pytest

from shardfc.train import cli as train_cli

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


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_a_signal_to_horovodrun_stops_every_rank_at_one_step_saves_and_leaves_no_process(horovodrun, tmp_path, signum):
    out = tmp_path / "run"
    proc = _start(horovodrun, out, tmp_path / "horovodrun")
    console = lambda: (tmp_path / "horovodrun.out").read_text(errors="replace")  # noqa: E731
    wait_for("step 3 in train.log", lambda: trained_steps(out) >= 3 or proc.poll() is not None)
    assert proc.poll() is None, console()[-3000:]
    tree = descendants(proc.pid) | {proc.pid}
    assert len(tree) >= 3, tree  # horovodrun and its 2 workers (and the watchers between them)
    if signum == signal.SIGTERM:
        os.kill(proc.pid, signum)  # the launcher only: it must pass the stop on
    else:
        os.killpg(proc.pid, signum)  # Ctrl-C in a terminal: the whole foreground process group at once
    finish(proc)
    wait_gone(tree)  # no stray process: every worker has exited

    step = stopped_step(out, signum)  # rank 0's log: once, at one step
    assert step >= 3 and checkpoint_steps(out)[-1] == step
    saved = f"saved checkpoint {out / 'checkpoints' / f'step_{step:08d}'}"
    assert (out / "train.log").read_text().count(saved) == 1
    text = console()
    # both ranks left the loop after that same step and exited with the signal's status, no traceback
    assert re.findall(r"rank exit status (\d+)", text) == [str(EXIT[signum])] * 2, text[-3000:]
    assert "Traceback" not in text, text[-3000:]

    if signum == signal.SIGTERM:  # resume (here in one process) from the step reached
        argv = [*TINY_FLAGS, "--max-steps", str(step + 1), "--ckpt-every", "2", "--output-dir", str(out)]
        assert train_cli.main(argv) == 0
        assert f"resuming from {out / 'checkpoints' / f'step_{step:08d}'}" in (out / "train.log").read_text()
        assert checkpoint_steps(out)[-1] == step + 1
