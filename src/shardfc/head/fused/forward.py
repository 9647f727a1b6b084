"""Fused forward: one shard's softmax statistics with no ``[B, C]`` tensor.

Grid ``(row tiles, class splits)``. A program walks its split of the shard's classes ``BN`` at a
time, forms each tile's logits in registers (:mod:`.tiles`) and folds them into a running max and
a rescaled running sum of exponentials (FlashAttention's online softmax), plus the logit sum for
label smoothing. It writes one ``(max, sum-exp, logit sum)`` per sample and split; the launcher
folds the splits exactly as the shards are folded (``Σ_k σ_k·e^{m_k − M}``). Each centre row's
``1/‖w‖`` comes from the step's one pass over the rows (:func:`.chunks.scored_rows`, kept for the
backward), so ``W`` is never normalised into a copy. ``cls_bucket`` and ``batch_bucket`` are not
read: they are the autotune key's class and batch counts (:func:`.autotune.bucket`).
"""

from __future__ import annotations

import triton
import triton.language as tl

from shardfc.head.fused import tiles


@triton.jit
def lse_forward_kernel(
    a_ptr, w_ptr, rows_ptr, inv_ptr, tr_ptr, tcol_ptr, tval_ptr,
    pmax_ptr, psum_ptr, plsum_ptr,
    B, D, n_cls, K: tl.constexpr, cls_per_split, stride_a, stride_w, stride_tr, n_splits,
    scale, threshold, cls_bucket, batch_bucket,
    HAS_ROWS: tl.constexpr, NORM_W: tl.constexpr, FILTER: tl.constexpr, SMOOTH: tl.constexpr,
    COMPUTE: tl.constexpr, DOT: tl.constexpr, PRECISION: tl.constexpr,
    BM: tl.constexpr, BN: tl.constexpr, BD: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_s = tl.program_id(1)
    offs_m = pid_m * BM + tl.arange(0, BM)
    m_mask = offs_m < B
    tcol = tl.load(tcol_ptr + offs_m, mask=m_mask, other=-1)
    tval = tl.load(tval_ptr + offs_m, mask=m_mask, other=0.0)
    run_max = tl.full([BM], float("-inf"), dtype=tl.float32)
    run_sum = tl.zeros([BM], dtype=tl.float32)
    run_lsum = tl.zeros([BM], dtype=tl.float32)
    c_begin = pid_s * cls_per_split
    c_end = tl.minimum(c_begin + cls_per_split, n_cls)
    for n0 in range(c_begin, c_end, BN):
        offs_n = n0 + tl.arange(0, BN)
        n_mask = offs_n < c_end
        best, fmax = tiles.class_values(
            a_ptr, stride_a, offs_m, m_mask, w_ptr, stride_w, rows_ptr, inv_ptr, tr_ptr, stride_tr,
            offs_n, n_mask, K, D,
            HAS_ROWS, NORM_W, FILTER, COMPUTE, DOT, PRECISION, BM, BN, BD,
        )
        z, is_t = tiles.logits(best, fmax, offs_n, n_mask, tcol, tval, scale, threshold, FILTER)
        run_max, run_sum, run_lsum = tiles.online_fold(z, n_mask, run_max, run_sum, run_lsum, SMOOTH)
    out = offs_m * n_splits + pid_s
    tl.store(pmax_ptr + out, run_max, mask=m_mask)
    tl.store(psum_ptr + out, run_sum, mask=m_mask)
    if SMOOTH:
        tl.store(plsum_ptr + out, run_lsum, mask=m_mask)
