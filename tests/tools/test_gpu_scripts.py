"""The GPU machine's scripts run on the CPU too, so that a GPU's scarce minutes never go to an
import error or a bad argument: ``scripts/gpu_step.py`` at tiny shapes (the fused impls say why they
cannot run without CUDA or the interpreter) and ``scripts/gpu_check.sh``'s device part."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]


def _env():
    env = dict(os.environ, PYTHONPATH=str(ROOT / "src"))
    env.pop("TRITON_INTERPRET", None)
    return env


def test_gpu_step_runs_on_the_cpu_and_checks_the_torch_path_against_float64(tmp_path):
    out = tmp_path / "gpu_step.json"
    proc = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "gpu_step.py"), "--device", "cpu", "--batch", "8", "--dim", "16",
         "--classes", "40", "--check-classes", "30", "--steps", "2", "--warmup", "1", "--profile-impls", "torch,triton",
         "--second-classes", "50", "--json", str(out)],
        capture_output=True, text=True, env=_env(), timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(out.read_text())
    rows = {(r["dtype"], r["impl"]): r for r in result["correctness"]["rows"]}
    assert rows["float32", "torch"]["status"] == "ok" and rows["float32", "torch"]["max_rel_err"] < 1e-5
    assert rows["bfloat16", "torch"]["status"] == "ok"
    for impl in ("triton", "gemm"):  # no CUDA, no interpreter: unavailable, with the head's reason
        assert rows["float32", impl]["status"] == "unavailable"
        assert "not a CUDA device" in rows["float32", impl]["reason"]
    steps = {r["name"]: r for r in result["step"]["rows"]}
    assert steps["torch: bench step"]["status"] == "ok" and steps["torch: bench step"]["ms"] > 0
    assert steps["triton: bench step"]["status"] == "unavailable"
    assert "| C=30 float32 | torch |" in proc.stdout  # the summary table
    # the headline rows again at the second C, last (issue 40: the step at C = 1M and 250k)
    assert list(result)[-2:] == ["step2", "step2_seconds"] and result["step2"]["classes"] == 50
    second = {r["name"]: r for r in result["step2"]["rows"]}
    assert second["torch: bench step"]["status"] == "ok" and second["torch: bench step"]["ms"] > 0
    assert set(second) == {"matmul floor (3 GEMMs)"} | {f"{impl}: bench step" for impl in ("torch", "triton", "gemm")} | {
        f"{impl}: {row}" for impl in ("triton", "gemm") for row in (
            "SGD step fused into the backward", "fused SGD step, CUDA graph replay",
            "Partial FC r=0.1, bf16 centres, fused update", "Partial FC r=0.1, bf16 centres, fused update, CUDA graph replay")}
    assert "| step C=50 B=8 D=16" in proc.stdout
    # The step under torch.cuda.set_sync_debug_mode("error") is CUDA's: skipped here, cleanly.
    torch_profile = result["profile"]["impls"]["torch"]
    assert torch_profile["host_syncs"] == 0 and torch_profile["kernels"] == 0
    for key in ("sync_error_mode", "partial_fc_sync_error_mode"):
        assert torch_profile[key]["status"] == "skipped" and "CUDA only" in torch_profile[key]["reason"]
    assert "step under set_sync_debug_mode('error'): skipped" in proc.stdout


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA: the script would measure it")
def test_gpu_check_refuses_a_machine_without_cuda_in_its_first_part(tmp_path):
    env = dict(_env(), OUT=str(tmp_path), PARTS="env step", PYTHON=sys.executable)
    proc = subprocess.run(["bash", str(ROOT / "scripts" / "gpu_check.sh")], capture_output=True, text=True,
                          env=env, timeout=120)
    assert proc.returncode == 1
    assert "no CUDA device visible to torch" in proc.stdout
    assert not (tmp_path / "gpu_step.json").exists()  # it stopped before measuring anything


def test_gpu_step_runs_its_new_rows_under_the_interpreter(tmp_path):
    """Issue 42's rows — the smoke test of ``out_dtype`` first, the chunk-size sweep, the step with no
    next operand, the graph replay (refused off CUDA, naming why), the plan's chunk candidates — run
    on the CPU with the fused kernels under Triton's interpreter, so the GPU run meets no script error."""
    out = tmp_path / "gpu_step.json"
    env = dict(_env(), TRITON_INTERPRET="1")
    proc = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "gpu_step.py"), "--device", "cpu", "--batch", "8", "--dim", "16",
         "--classes", "40", "--check-classes", "30", "--steps", "2", "--warmup", "1", "--parts", "smoke,step,graph,plan",
         "--step-rows", "chunk scale,operand made by each forward,CUDA graph", "--json", str(out)],
        capture_output=True, text=True, env=env, timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(out.read_text())
    assert list(result)[2] == "smoke"  # the first part (after environment and args)
    assert result["smoke"]["rows"][-1]["op"] == "addmm_f32" and result["smoke"]["rows"][-1]["status"] == "ok"
    steps = {r["name"]: r for r in result["step"]["rows"]}
    for impl in ("triton", "gemm"):
        for scale in (1, 2, 4, 8):
            row = steps[f"{impl}: fused SGD step, chunk scale {scale}"]
            assert row["status"] == "ok" and row["chunk_scale"] == scale and row["update"] == "fused", row
            assert 0 < row["host_ms"] <= row["ms"]
        assert steps[f"{impl}: fused SGD step, operand made by each forward"]["status"] == "ok"
        for graph in (steps[f"{impl}: fused SGD step, CUDA graph replay"],
                      steps[f"{impl}: Partial FC r=0.1, bf16 centres, fused update, CUDA graph replay"]):
            assert graph["status"] == "unavailable" and "CUDA is not available" in graph["reason"]
    assert len(steps) == 1 + 14  # the matmul floor and the rows asked for, no others
    assert {r["status"] for r in result["graph"]["rows"]} == {"unavailable"}
    assert [r.get("sample_rate") for r in result["graph"]["rows"]] == [None, None, 0.1]
    candidates = result["plan"]["chunk_candidates"]
    assert [r["scale"] for r in candidates["rows"]] == [1, 2, 4, 8] and candidates["pick"] in (1, 2, 4, 8)
