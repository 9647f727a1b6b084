"""Block sizes of the fused kernels: a few autotuned configs on a GPU, one small fixed config under
Triton's interpreter (which is slow and checks no resource limit, so tests use the smallest legal
tiles: ``tl.dot`` needs every dimension ≥ 16).

The configs are the ones that compile for an H100 (sm_90, D = 512, bf16) without spilling
registers, as measured from this CPU by :mod:`.aot` (``python -m shardfc.head.fused.aot``:
Triton's bundled ptxas, read back with cuobjdump):
- forward: 128×128×32 and 64×128×64 at 8 warps use 210–216 registers, no stack. 128×128×64 spilled
  104 bytes and 64×64 at 4 warps sat at 254 registers. Shared memory is 56–88 KB of the 227 KB.
- embedding gradient: 32×32 at 8 warps uses 254 registers, no stack. Every 64-row tile spilled,
  since its ``[BM, D]`` fp32 accumulator alone is 128 registers per thread.
- weight gradient: 32×32 at 8 warps spills 256 bytes, and only in its once-per-program epilogue
  (``w``, ``.grad`` and the accumulator live together). Without that epilogue it spills 24 bytes;
  its loop does not spill.
The backward kernels hold a ``[tile, D]`` fp32 accumulator, so ``D`` is bounded
(:data:`shardfc.head.fused.MAX_DIM`); larger embeddings use the torch path.
"""

from __future__ import annotations

import functools

import torch
import triton

from shardfc.head.fused import backward, forward, interpreting, shapes_only

#: Class splits are multiples of this (the largest ``BN``), so every config tiles them exactly.
SPLIT_QUANTUM = 128
#: Programs per SM the split count aims at (enough to hide a tile's latency, few partial rows).
PROGRAMS_PER_SM = 4
#: The SM count assumed on the ``meta`` device, where a step is replayed for its shapes (``shardfc
#: plan --sms``): an H100 SXM's. The split count, so the embedding gradient's ``[splits, B, D]``
#: partial sums, depends on it.
META_SMS = 132


INTERPRETER_TILES = {"BM": 16, "BN": 16, "BD": 16}


def _configs(tiles):
    return [triton.Config(dict(zip(("BM", "BN", "BD"), t)), num_warps=w, num_stages=s) for *t, w, s in tiles]


FORWARD_CONFIGS = _configs([(128, 128, 32, 8, 4), (64, 128, 64, 8, 3), (128, 64, 64, 8, 3)])
GRAD_A_CONFIGS = _configs([(32, 32, 64, 8, 2), (16, 64, 64, 8, 2), (64, 16, 64, 8, 2)])
GRAD_W_CONFIGS = _configs([(32, 32, 64, 8, 2), (64, 16, 64, 8, 2), (64, 32, 64, 8, 2)])
_FLAGS = ["K", "HAS_ROWS", "NORM_W", "FILTER", "SMOOTH", "COMPUTE", "DOT", "PRECISION"]

lse_forward = triton.autotune(FORWARD_CONFIGS, key=["D"] + _FLAGS)(forward.lse_forward_kernel)
grad_a = triton.autotune(GRAD_A_CONFIGS, key=["D"] + _FLAGS)(backward.grad_a_kernel)
# The weight-gradient kernel may add into an existing .grad: tuning runs it several times, so the
# autotuner restores that buffer after each trial.
grad_w = triton.autotune(GRAD_W_CONFIGS, key=["D", "ACCUMULATE", "SCATTER"] + _FLAGS, restore_value=["gw_ptr"])(
    backward.grad_w_kernel
)


def launch(tuned, grid, *args, **kwargs):
    """Run an autotuned kernel; under the interpreter, its kernel at the fixed small tiles; on the
    meta device, nothing (the caller has allocated the outputs)."""
    if any(isinstance(a, torch.Tensor) and shapes_only(a) for a in args):
        return
    if interpreting():
        meta = dict(INTERPRETER_TILES)
        tuned.fn[grid(meta)](*args, **kwargs, **meta)
    else:
        tuned[grid](*args, **kwargs)


@functools.lru_cache(maxsize=None)
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def class_splits(n_cls: int, batch: int, device: torch.device) -> int:
    """Classes per split for the kernels whose grid is ``(row tiles, class splits)``.

    On a GPU, enough splits for ``PROGRAMS_PER_SM`` programs per SM over the batch's row tiles (on
    the meta device, for :data:`META_SMS` SMs); under the interpreter, three splits (so the tests
    fold partial statistics across splits).
    """
    quantum = INTERPRETER_TILES["BN"] if interpreting() else SPLIT_QUANTUM
    if interpreting() or device.type not in ("cuda", "meta"):
        wanted = 3
    else:
        row_tiles = triton.cdiv(max(batch, 1), 64)
        sms = META_SMS if device.type == "meta" else _sm_count(device.index or 0)
        wanted = triton.cdiv(PROGRAMS_PER_SM * sms, row_tiles)
    per_split = triton.cdiv(max(n_cls, 1), max(wanted, 1))
    return triton.cdiv(per_split, quantum) * quantum
