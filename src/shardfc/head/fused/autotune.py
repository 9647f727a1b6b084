"""Block sizes of the fused kernels: a few autotuned configs on a GPU, one small fixed config under
Triton's interpreter (which is slow and checks no resource limit, so tests use the smallest legal
tiles: ``tl.dot`` needs every dimension ≥ 16).

Shared-memory budget (H100: ~228 KB per SM): the forward's pipelined stages hold an ``a`` tile
``BM×BD`` and a weight tile ``BN×BD`` (fp32 centres: 4 bytes) each — 3 × (16 + 32) KB at the
largest config. The backward kernels hold a ``[tile, D]`` fp32 accumulator in registers, so ``D``
is bounded by :data:`shardfc.head.fused.MAX_DIM`; larger embeddings use the torch path.
"""

from __future__ import annotations

import functools

import torch
import triton

from shardfc.head.fused import backward, forward, interpreting

#: Class splits are multiples of this (the largest ``BN``), so every config tiles them exactly.
SPLIT_QUANTUM = 128
#: Programs per SM the split count aims at (enough to hide a tile's latency, few partial rows).
PROGRAMS_PER_SM = 4


INTERPRETER_TILES = {"BM": 16, "BN": 16, "BD": 16}


def _configs(tiles):
    return [triton.Config(dict(zip(("BM", "BN", "BD"), t)), num_warps=w, num_stages=s) for *t, w, s in tiles]


FORWARD_CONFIGS = _configs([(128, 128, 64, 8, 3), (64, 128, 64, 4, 4), (128, 64, 64, 4, 4)])
BACKWARD_CONFIGS = _configs([(64, 64, 64, 8, 2), (32, 64, 64, 4, 2), (64, 32, 64, 4, 2)])
_FLAGS = ["K", "HAS_ROWS", "NORM_W", "FILTER", "SMOOTH", "COMPUTE", "DOT", "PRECISION"]

lse_forward = triton.autotune(FORWARD_CONFIGS, key=["D"] + _FLAGS)(forward.lse_forward_kernel)
grad_a = triton.autotune(BACKWARD_CONFIGS, key=["D"] + _FLAGS)(backward.grad_a_kernel)
# The weight-gradient kernel may add into an existing .grad: tuning runs it several times, so the
# autotuner restores that buffer after each trial.
grad_w = triton.autotune(BACKWARD_CONFIGS, key=["D", "ACCUMULATE", "SCATTER"] + _FLAGS, restore_value=["gw_ptr"])(
    backward.grad_w_kernel
)


def launch(tuned, grid, *args, **kwargs):
    """Run an autotuned kernel; under the interpreter, its kernel at the fixed small tiles."""
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

    On a GPU, enough splits for ``PROGRAMS_PER_SM`` programs per SM over the batch's row tiles;
    under the interpreter, three splits (so the tests fold partial statistics across splits).
    """
    quantum = INTERPRETER_TILES["BN"] if interpreting() else SPLIT_QUANTUM
    if interpreting() or device.type != "cuda":
        wanted = 3
    else:
        row_tiles = triton.cdiv(max(batch, 1), 64)
        wanted = triton.cdiv(PROGRAMS_PER_SM * _sm_count(device.index or 0), row_tiles)
    per_split = triton.cdiv(max(n_cls, 1), max(wanted, 1))
    return triton.cdiv(per_split, quantum) * quantum
