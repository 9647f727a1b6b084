"""``shardfc train`` under torchrun: signals, an elastic restart after a worker dies, and flags that
torchrun's own parser would otherwise take ('--m' as '--max-restarts', '--nproc' as '--nproc-per-node')."""

from __future__ import annotations

import os
import signal

import pytest
import torch

from shardfc.cli import train as train_cli
from shardfc.parallel.torchrun import SHARE_STORE_ENV
from shardfc.train.stopping import CRASH_ENV

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

TORCHRUN = ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_a_signal_to_torchrun_stops_every_rank_at_one_step_and_leaves_no_process(tmp_path, signum):
    out = tmp_path / "run"
    # After `--`, torchrun passes '--m' and '--nproc' on instead of failing on them as ambiguous.
    args = [*TORCHRUN, "-m", "shardfc", "train", "--", *TINY_FLAGS, "--max-steps", "100000", "--ckpt-every", "2",
            "--m", "0.25", "--nproc", "2", "--output-dir", str(out)]
    proc = start(args, tmp_path / "torchrun")
    wait_for("step 3 in train.log", lambda: trained_steps(out) >= 3 or proc.poll() is not None)
    assert proc.poll() is None, read(tmp_path / "torchrun", ".err")[-3000:]
    tree = descendants(proc.pid) | {proc.pid}
    assert len(tree) >= 3, tree  # torchrun and its 2 workers
    os.kill(proc.pid, signum)
    finish(proc)  # torchrun's own exit status and messages on a signal are torchrun's business
    wait_gone(tree)

    step = stopped_step(out, signum)
    assert step >= 3 and checkpoint_steps(out)[-1] == step
    assert "m = 0.25" in (out / "config.toml").read_text()
    if signum == signal.SIGTERM:  # resume (here on spawned processes) from the step reached
        argv = [*TINY_FLAGS, "--max-steps", str(step + 1), "--ckpt-every", "2", "--margin-m", "0.25",
                "--output-dir", str(out)]
        assert train_cli.main(argv) == 0
        assert f"resuming from {out / 'checkpoints' / f'step_{step:08d}'}" in (out / "train.log").read_text()
        assert checkpoint_steps(out)[-1] == step + 1


def _final_tensors(out, step: int) -> dict:
    folder = out / "checkpoints" / f"step_{step:08d}"
    common = torch.load(folder / "common.pt", weights_only=True)
    tensors = {f"backbone.{k}": v for k, v in common["backbone"].items()}
    for rank in (0, 1):
        head = torch.load(folder / f"head_{rank}.pt", weights_only=True)["tensors"]
        tensors.update({f"head_{rank}.{k}": v for k, v in head.items()})
    return tensors


def test_torchrun_restarts_after_a_worker_dies_and_ends_with_the_weights_of_an_uninterrupted_run(tmp_path):
    flags = [*TINY_FLAGS, "--max-steps", "6", "--ckpt-every", "2", "--margin-m", "0.3"]
    reference = tmp_path / "reference"
    assert train_cli.main([*flags, "--nproc", "2", "--output-dir", str(reference)]) == 0

    out, marker = tmp_path / "restarted", tmp_path / "crashed"
    # Rank 1 dies (os._exit) before step 4, once; torchrun restarts both ranks, which resume from step 2.
    # One restart is needed; the spare ones absorb a gloo connect that times out on a loaded machine.
    args = ["-m", "shardfc", "torchrun", "--standalone", "--nproc-per-node", "2", "--max-restarts", "3", "--",
            *flags, "--output-dir", str(out)]
    proc = start(args, tmp_path / "torchrun", **{CRASH_ENV: f"1:3:{marker}"})
    code = finish(proc)
    err = read(tmp_path / "torchrun", ".err")
    log = (out / "train.log").read_text() if (out / "train.log").exists() else ""
    assert code == 0, f"{err[-4000:]}\n--- train.log:\n{log[-3000:]}"
    assert marker.exists(), "the worker never crashed: the test proves nothing"
    assert f"resuming from {out / 'checkpoints' / 'step_00000002'}" in log
    assert SHARE_STORE_ENV not in err  # the wrapper set it: no warning

    expected, got = _final_tensors(reference, 6), _final_tensors(out, 6)
    assert expected.keys() == got.keys()
    for name in expected:
        torch.testing.assert_close(got[name], expected[name], rtol=0, atol=0, msg=name)
