"""``shardfc train --nproc 2`` and its workers live and die together, and stop cleanly on a signal.

SIGTERM / Ctrl-C: every rank stops after the same step, the run saves a checkpoint there, logs
why, exits 143 / 130 without a traceback, and leaves no process behind; a later run resumes from
that checkpoint. SIGKILL to the launcher: the workers notice and exit by themselves.
"""

from __future__ import annotations

import os
import re
import signal

from shardfc.cli import train as train_cli

from .procs import (
    TINY_FLAGS,
    checkpoint_steps,
    descendants,
    finish,
    needs_proc,
    read,
    start,
    stopped_step,
    trained_steps,
    wait_for,
    wait_gone,
)

pytestmark = needs_proc


def _launch(tmp_path, *extra: str):
    out = tmp_path / "run"
    args = ["-m", "shardfc", "train", *TINY_FLAGS, "--max-steps", "100000", "--nproc", "2", "--output-dir", str(out), *extra]
    return start(args, tmp_path / "launcher"), out


def _running_tree(proc, out, min_step: int = 3) -> set:
    """Wait until training is under way; the launcher and its children (2 ranks, a resource tracker)."""
    wait_for(f"step {min_step} in train.log", lambda: trained_steps(out) >= min_step or proc.poll() is not None)
    assert proc.poll() is None, f"the run ended early: {(out / 'train.log').read_text()[-2000:] if (out / 'train.log').exists() else ''}"
    tree = descendants(proc.pid)
    assert len(tree) >= 2, tree
    return tree | {proc.pid}


def _clean_exit(tmp_path, code: int, expected: int) -> None:
    err = read(tmp_path / "launcher", ".err")
    assert code == expected, err[-3000:]
    assert "Traceback" not in err, err[-3000:]
    assert "leaked" not in err, err[-3000:]  # multiprocessing's resource tracker found nothing left over


def test_sigterm_to_the_launcher_stops_every_rank_at_one_step_saves_and_resumes(tmp_path):
    proc, out = _launch(tmp_path, "--ckpt-every", "1")  # so the step it stops at was just saved
    tree = _running_tree(proc, out)
    os.kill(proc.pid, signal.SIGTERM)
    code = finish(proc)
    wait_gone(tree)
    _clean_exit(tmp_path, code, 143)

    step = stopped_step(out, signal.SIGTERM)
    assert step >= 3 and checkpoint_steps(out)[-1] == step
    saved = f"saved checkpoint {out / 'checkpoints' / f'step_{step:08d}'}"
    assert (out / "train.log").read_text().count(saved) == 1  # not saved again on the signal
    console = read(tmp_path / "launcher", ".out") + read(tmp_path / "launcher", ".err")
    assert f"stopped at step {step} by signal SIGTERM" in console

    # Resume: the same run with an end in sight continues from the step the signal stopped it at.
    argv = [*TINY_FLAGS, "--max-steps", str(step + 2), "--nproc", "2", "--output-dir", str(out), "--ckpt-every", "2"]
    assert train_cli.main(argv) == 0
    log = (out / "train.log").read_text()
    assert f"resuming from {out / 'checkpoints' / f'step_{step:08d}'}" in log
    assert re.search(rf"step {step + 1}/{step + 2} ", log) and checkpoint_steps(out)[-1] == step + 2


def test_ctrl_c_to_the_process_group_stops_every_rank_without_saving_when_told(tmp_path):
    # Ctrl-C in a terminal signals the whole foreground process group: launcher and workers at once.
    # A DataLoader worker per rank gets the SIGINT too, and must not die of it mid-epoch.
    proc, out = _launch(tmp_path, "--ckpt-every", "0", "--no-save-on-signal", "--num-workers", "1")
    tree = _running_tree(proc, out)
    os.killpg(proc.pid, signal.SIGINT)
    code = finish(proc)
    wait_gone(tree)
    _clean_exit(tmp_path, code, 130)
    step = stopped_step(out, signal.SIGINT)
    assert step >= 3 and checkpoint_steps(out) == []
    assert "checkpoint not saved (save_on_signal is off)" in (out / "train.log").read_text()


def test_workers_exit_by_themselves_when_the_launcher_is_killed(tmp_path):
    proc, out = _launch(tmp_path, "--ckpt-every", "0")
    tree = _running_tree(proc, out)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait(60)
    wait_gone(tree)  # nobody forwards anything: the workers see their parent die
    # They stopped as on SIGTERM: at one agreed step, with a checkpoint there.
    step = stopped_step(out, signal.SIGTERM)
    assert checkpoint_steps(out) == [step]
