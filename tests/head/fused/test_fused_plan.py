"""``shardfc plan --head-impl triton|gemm``: the GPU path's step replayed on the meta device allocates what
the fused step allocates on real tensors (here CPU tensors under Triton's interpreter).

The interpreter copies a kernel's arguments into tensors of its own while it runs, and its closures
keep them (and the arguments) in reference cycles until Python's garbage collector runs; a GPU
launch allocates nothing and holds nothing. So the measured step runs each launch with the dispatch
modes suspended and collects the interpreter's cycles after it: what is counted is what the
launchers allocate, which is what ``plan`` claims to know.
"""

from __future__ import annotations

import gc

import pytest
import torch
from torch.utils._python_dispatch import _disable_current_modes

from shardfc.tools.plan import plan

C, D, B = 400, 32, 32

# On a CUDA machine the kernels are compiled and refuse CPU tensors, and the CUDA allocator rounds
# small blocks up to 512 bytes: there scripts/gpu_step.py (its plan part) holds the plan to
# torch.cuda.max_memory_allocated at full size instead (equal to the byte on an H200 at C = 1M).
pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="interpreter-only: on a GPU, scripts/gpu_step.py "
                                "compares the plan with torch.cuda.max_memory_allocated at full size")


@pytest.fixture
def launches_unseen(monkeypatch):
    """Every kernel launch runs outside the dispatch modes and leaves nothing behind (the
    interpreter's own copies and cycles)."""
    from shardfc.head import kernels
    from shardfc.head.fused import autotune, chunks, epilogue, optimizer

    real_launch = autotune.launch

    def launch(*args, **kwargs):
        with _disable_current_modes():
            real_launch(*args, **kwargs)
            gc.collect()

    class Unseen:
        def __init__(self, kernel):
            self.kernel = kernel

        def __getitem__(self, grid):
            def run(*args, **kwargs):
                with _disable_current_modes():
                    self.kernel[grid](*args, **kwargs)
                    gc.collect()

            return run

    monkeypatch.setattr(autotune, "launch", launch)
    monkeypatch.setattr(optimizer, "row_sgd_kernel", Unseen(optimizer.row_sgd_kernel))
    # 128-class chunks (4 here, not 25): the same code in fewer interpreted launches.
    monkeypatch.setattr(chunks, "INTERPRETER_CHUNK", 128)
    # The measured step runs on the CPU, whose fp32-result matmuls of 16-bit operands copy them to
    # fp32 first (cuBLAS writes fp32 from bf16 directly): the replay follows the CPU here.
    monkeypatch.setattr(kernels, "MM_F32_META", "cpu")
    for name in ("operand_rows_kernel", "forward_epilogue_kernel", "backward_epilogue_kernel", "weight_grad_kernel"):
        monkeypatch.setattr(epilogue, name, Unseen(getattr(epilogue, name)))
    # What exists now is out of the collector's sight while the test runs: each collection after a
    # launch then walks the launch's own objects only, not the whole session's heap.
    gc.collect()
    gc.freeze()
    yield
    gc.unfreeze()


OPTIONS = [
    dict(),
    dict(grads_kept=False),
    dict(sample_rate=0.25),
    dict(sample_rate=0.25, sparse_grad=True),
    dict(dtype="bfloat16", margin="sphereface"),
    dict(dtype="bfloat16", sample_rate=0.25, sparse_grad=True, optimizer="adamw"),
    dict(optimizer="adamw"),
    dict(subcenters=2, sample_rate=0.25, sparse_grad=True),
    dict(chunk_size=64),  # ignored by the GPU path, in the plan as in the head
]
#: impl="gemm" differs from "triton" in its forward only (the backward is shared): a few options.
CASES = [("triton", o) for o in OPTIONS] + [("gemm", OPTIONS[i]) for i in (0, 5, 7)]


@pytest.mark.parametrize("impl,options", CASES, ids=[f"{i}-{n}" for n, (i, _) in enumerate(CASES)])
def test_fused_plan_equals_the_fused_step_measured(launches_unseen, measured_step_peak, impl, options):
    options = dict(options)
    kept = options.pop("grads_kept", True)
    optimizer = options.pop("optimizer", "sgd")
    predicted = plan(C, D, B, 1, optimizer=optimizer, grad_in_place=kept, impl=impl, **options)
    assert predicted["step_peak"] == measured_step_peak(C, D, B, kept, optimizer, impl=impl, **options)
