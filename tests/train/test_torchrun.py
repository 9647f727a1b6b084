"""``shardfc train`` under torchrun: the launcher's processes join one env:// group."""

import subprocess
import sys


def test_torchrun_two_processes(tmp_path):
    out = tmp_path / "run"
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
        "-m", "shardfc", "train",
        "--synthetic-identities", "24", "--synthetic-images-per-identity", "5", "--image-size", "16", "16",
        "--embedding-dim", "16", "--batch-size", "8", "--max-steps", "3", "--warmup-steps", "1",
        "--log-every", "1", "--synthetic-val-pairs", "40", "--no-progress", "--output-dir", str(out),
    ]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env={"OMP_NUM_THREADS": "1", **__import__("os").environ})
    assert done.returncode == 0, done.stderr[-3000:]
    log = done.stdout + done.stderr
    assert log.count("shardfc train: 2 rank(s)") == 1  # rank 0 alone prints
    assert "verification accuracy" in done.stdout
    ckpts = list((out / "checkpoints").glob("step_*"))
    assert [c.name for c in ckpts] == ["step_00000003"]
    assert {p.name for p in ckpts[0].iterdir()} >= {"head_0.pt", "head_1.pt", "meta.json"}
