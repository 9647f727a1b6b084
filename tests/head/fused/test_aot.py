"""The kernels compile for an H100 (sm_90) on this CPU machine (``shardfc.head.fused.aot``): every
option path builds and fits the SM's shared memory, and the default path keeps its loops in
registers — what the interpreter, which runs the same code as numpy, cannot check. It runs in a
subprocess: this test session runs the kernels under the interpreter, which cannot compile them.
(Register figures as measured with Triton 3.9; a new compiler that spills more is worth knowing.)"""

from __future__ import annotations

import json
import os
import subprocess
import sys

from shardfc.head.fused import aot

#: Stack bytes (spilled registers) of each kernel's first config on the default path (bf16,
#: D = 512): none in the matmul loops; the weight gradient's once-per-program epilogue spills a little.
STACK = {"lse_forward_kernel": 0, "grad_a_kernel": 0, "grad_w_kernel": 512}


def test_every_path_compiles_for_h100():
    env = {**os.environ, "TRITON_INTERPRET": "0", "TRITON_DEFAULT_FP_FUSION": "1"}
    proc = subprocess.run(
        [sys.executable, "-m", "shardfc.head.fused.aot", "--variants", "all", "--first-config", "--json"],
        env=env, capture_output=True, text=True, timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    built = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    assert {(b["variant"], b["kernel"]) for b in built} == {(v, k) for v in aot.VARIANTS for k in STACK}
    for b in built:
        assert 0 < b["shared"] <= aot.H100_SHARED_BYTES, b
        assert b["registers"] is not None and b["registers"] <= 255, b
        if b["variant"] == "default":
            assert b["stack_bytes"] is not None and b["stack_bytes"] <= STACK[b["kernel"]], b
