"""Block sizes of the fused forward kernel: a few autotuned configs on a GPU, one small fixed config
under Triton's interpreter (which is slow and checks no resource limit, so tests use the smallest
legal tiles: ``tl.dot`` needs every dimension ≥ 16).

Every config has ≥ 64 rows per warpgroup, so its ``tl.dot`` lowers to Hopper's wgmma (``HGMMA``)
on sm_90, never to the Ampere-style mma.sync (``HMMA``) Triton falls back to below that; and none
spills: :mod:`.aot` builds each one for an H100 from this CPU with the JIT's specialisation and
reads the SASS back, and ``tests/head/fused/test_aot.py`` holds both. The backward has no tuned
kernel: its matmuls are cuBLAS GEMMs and its epilogues fixed-tile elementwise kernels
(:mod:`.chunks`).

The autotune key holds what changes the best config: the embedding width, the option flags and
the class and batch counts rounded up to a power of two (:func:`bucket`), so a new shard size tunes
again but 1,000,000 and 1,000,003 classes share a choice. The forward writes fresh outputs only, so
a trial clones nothing.
"""

from __future__ import annotations

import functools

import torch
import triton

from shardfc.head.fused import forward, interpreting, shapes_only

#: Class splits are multiples of this (the largest ``BN``), so every config tiles them exactly.
SPLIT_QUANTUM = 256
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
#: Wider tiles for the plain bf16/fp16 forward: more work per wgmma between the online-softmax
#: updates. Added after the first H200 run (the forward took 2.96 ms at C = 1M, twice a cuBLAS
#: GEMM of the shape); 187 and 248-254 registers, no spills under Triton 3.6 and 3.9.
WIDE_FORWARD_CONFIGS = _configs([(128, 128, 64, 8, 4), (128, 256, 32, 8, 4)])
#: With sub-centres or the filter a tile keeps more alive (the running max over sub-centres, the
#: filter's second product): smaller tiles, which keep it in registers.
HEAVY_FORWARD_CONFIGS = _configs([(64, 64, 64, 8, 3), (64, 128, 32, 8, 3)])
_FLAGS = ["K", "HAS_ROWS", "NORM_W", "FILTER", "SMOOTH", "COMPUTE", "DOT", "PRECISION"]
_KEY = ["D", "cls_bucket", "batch_bucket"] + _FLAGS


def forward_configs(K: int, filter_: bool, precision: str = "tf32", norm_w: bool = False):
    """The forward's autotune configs for ``K`` sub-centres, the filter on or off, the dot's
    precision (fp32 ``"ieee"`` runs on FMA units: its 128×128 tile spills 16 bytes) and whether the
    kernel reads the fp32 rows and normalises them itself (``norm_w``: a shard above the operand
    budget; the 128×256 tile spills there, so the wide tiles are for the step's operand only).

    The filter reads fp32 rows beside the operand: there Triton 3.6's build of the 64×128×32 tile
    spills (152 bytes with sub-centres, seen in the sm_90 build on the first H200 run), so the
    filter keeps the 64×64×64 tile alone."""
    if filter_:
        return HEAVY_FORWARD_CONFIGS[:1]
    if K > 1:
        return HEAVY_FORWARD_CONFIGS
    if precision == "ieee":
        return FORWARD_CONFIGS[1:]
    return FORWARD_CONFIGS if norm_w else FORWARD_CONFIGS + WIDE_FORWARD_CONFIGS


@functools.lru_cache(maxsize=None)
def _tuned(configs: tuple):
    return triton.autotune(list(configs), key=_KEY)(forward.lse_forward_kernel)


def lse_forward(K: int, filter_: bool, precision: str = "tf32", norm_w: bool = False):
    """The autotuned forward kernel over :func:`forward_configs` (one tuner per config list)."""
    return _tuned(tuple(forward_configs(K, filter_, precision, norm_w)))


def bucket(n: int) -> int:
    """``n`` rounded up to a power of two (at least 1): the autotune key's class and batch counts."""
    return 1 << max(int(n) - 1, 0).bit_length()


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
def sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def splits_wanted(batch: int, row_tile: int, device: torch.device, off_gpu: int) -> int:
    """How many class splits give ``PROGRAMS_PER_SM`` programs per SM over the batch's row tiles
    of ``row_tile`` rows (on the meta device, for :data:`META_SMS` SMs); ``off_gpu`` under the
    interpreter or on the CPU, where the tests want a few splits to fold."""
    if interpreting() or device.type not in ("cuda", "meta"):
        return off_gpu
    sms = META_SMS if device.type == "meta" else sm_count(device.index or 0)
    return triton.cdiv(PROGRAMS_PER_SM * sms, triton.cdiv(max(batch, 1), row_tile))


def class_splits(n_cls: int, batch: int, device: torch.device) -> int:
    """Classes per split for the kernels whose grid is ``(row tiles, class splits)``.

    On a GPU, enough splits for ``PROGRAMS_PER_SM`` programs per SM over the batch's row tiles (on
    the meta device, for :data:`META_SMS` SMs); under the interpreter, three splits (so the tests
    fold partial statistics across splits).
    """
    quantum = INTERPRETER_TILES["BN"] if interpreting() else SPLIT_QUANTUM
    wanted = splits_wanted(batch, 64, device, off_gpu=3)
    per_split = triton.cdiv(max(n_cls, 1), max(wanted, 1))
    return triton.cdiv(per_split, quantum) * quantum
