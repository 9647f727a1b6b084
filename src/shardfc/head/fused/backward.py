"""Fused backward: ``dJ/da`` and ``dJ/dW`` of one shard, each tile's logits recomputed in registers.

Two kernels, split the way FlashAttention-2 splits its backward, so neither needs atomics (and
both are deterministic):

* :func:`grad_w_kernel`, grid ``(class tiles, sub-centre)``: a program owns ``BN`` centre rows and
  walks the whole batch, accumulating ``H_r = Σ_i dp_ir · a_i`` (``dp = dJ/dp``, the gradient of the
  raw product) and ``w_r·H_r = Σ_i dp_ir · p_ir``; its epilogue applies the normalisation backward
  ``dJ/dw_r = H_r − inv_r²·(w_r·H_r)·w_r`` and writes the rows once — into a new gradient, the
  compact Partial FC gradient, or added into an existing ``.grad`` (at the sampled rows).
* :func:`grad_a_kernel`, grid ``(row tiles, class splits)``: a program owns ``BM`` samples and one
  split of the classes, accumulating ``Σ_r dp_ir · w_r``; the launcher sums the splits.

Both hold a ``[tile, D]`` fp32 accumulator, so ``D`` is bounded (see :mod:`.autotune`).
"""

from __future__ import annotations

import triton
import triton.language as tl

from shardfc.head.fused import tiles


@triton.jit
def _row_inputs(tcol_ptr, tval_ptr, tdraw_ptr, tsub_ptr, max_ptr, cos_ptr, coef_ptr, offs_m, m_mask):
    tcol = tl.load(tcol_ptr + offs_m, mask=m_mask, other=-1)
    tval = tl.load(tval_ptr + offs_m, mask=m_mask, other=0.0)
    tdraw = tl.load(tdraw_ptr + offs_m, mask=m_mask, other=0.0)
    tsub = tl.load(tsub_ptr + offs_m, mask=m_mask, other=0)
    row_max = tl.load(max_ptr + offs_m, mask=m_mask, other=0.0)
    coef_over_sum = tl.load(cos_ptr + offs_m, mask=m_mask, other=0.0)
    coef = tl.load(coef_ptr + offs_m, mask=m_mask, other=0.0)
    return tcol, tval, tdraw, tsub, row_max, coef_over_sum, coef


@triton.jit
def grad_w_kernel(
    a_ptr, w_ptr, rows_ptr, inv_ptr, tr_ptr, tcol_ptr, tval_ptr, tdraw_ptr, tsub_ptr,
    max_ptr, cos_ptr, coef_ptr, gw_ptr,
    B, D, n_cls, K: tl.constexpr, stride_a, stride_w, stride_tr, stride_g,
    scale, threshold, eps_over_c, one_minus_eps,
    HAS_ROWS: tl.constexpr, NORM_W: tl.constexpr, FILTER: tl.constexpr, SMOOTH: tl.constexpr,
    ACCUMULATE: tl.constexpr, SCATTER: tl.constexpr,
    COMPUTE: tl.constexpr, DOT: tl.constexpr, PRECISION: tl.constexpr,
    BM: tl.constexpr, BN: tl.constexpr, BD: tl.constexpr, DP: tl.constexpr,
):
    pid_n = tl.program_id(0)
    sub = tl.program_id(1)
    offs_n = pid_n * BN + tl.arange(0, BN)
    n_mask = offs_n < n_cls
    offs_d = tl.arange(0, DP)
    d_mask = offs_d < D
    acc = tl.zeros([BN, DP], dtype=tl.float32)
    row_dot = tl.zeros([BN], dtype=tl.float32)
    if NORM_W:
        inv = tl.load(inv_ptr + offs_n.to(tl.int64) * K + sub, mask=n_mask, other=0.0)
    else:
        inv = tl.full([BN], 1.0, dtype=tl.float32)
    for m0 in range(0, B, BM):
        offs_m = m0 + tl.arange(0, BM)
        m_mask = offs_m < B
        tcol, tval, tdraw, tsub, row_max, coef_over_sum, coef = _row_inputs(
            tcol_ptr, tval_ptr, tdraw_ptr, tsub_ptr, max_ptr, cos_ptr, coef_ptr, offs_m, m_mask)
        best, arg, fmax, p = tiles.class_values(
            a_ptr, stride_a, offs_m, m_mask, w_ptr, stride_w, rows_ptr, inv_ptr, tr_ptr, stride_tr,
            offs_n, n_mask, K, D, sub,
            HAS_ROWS, NORM_W, FILTER, NORM_W, COMPUTE, DOT, PRECISION, BM, BN, BD,
        )
        z, is_t = tiles.logits(best, fmax, offs_n, n_mask, tcol, tval, scale, threshold, FILTER)
        live = m_mask[:, None] & n_mask[None, :]
        dc = tiles.dcos(z, is_t, row_max, coef_over_sum, coef, tdraw, live, scale, eps_over_c, one_minus_eps, SMOOTH)
        # A class's gradient goes to the sub-centre that gave its logit (the target's: the one
        # the margin was applied to).
        own = tl.where(is_t, tsub[:, None] == sub, arg == sub)
        dp = tl.where(own, dc, 0.0) * inv[None, :]
        a_t = tl.load(a_ptr + offs_m.to(tl.int64)[:, None] * stride_a + offs_d[None, :],
                      mask=m_mask[:, None] & d_mask[None, :], other=0.0)
        acc = tl.dot(tl.trans(tiles.operand(dp, COMPUTE, DOT)), tiles.operand(a_t, COMPUTE, DOT), acc,
                     input_precision=PRECISION)
        if NORM_W:
            row_dot += tl.sum(dp * p, axis=0)
    wrow = tiles.weight_rows(rows_ptr, offs_n, sub, K, n_mask, HAS_ROWS)
    mask = n_mask[:, None] & d_mask[None, :]
    if NORM_W:
        w_t = tl.load(w_ptr + wrow[:, None] * stride_w + offs_d[None, :], mask=mask, other=0.0)
        acc -= (inv * inv * row_dot)[:, None] * w_t.to(tl.float32)
    if SCATTER:
        out_row = wrow
    else:
        out_row = offs_n.to(tl.int64) * K + sub
    out = gw_ptr + out_row[:, None] * stride_g + offs_d[None, :]
    if ACCUMULATE:
        acc += tl.load(out, mask=mask, other=0.0).to(tl.float32)
    tl.store(out, acc.to(gw_ptr.dtype.element_ty), mask=mask)


@triton.jit
def grad_a_kernel(
    a_ptr, w_ptr, rows_ptr, inv_ptr, tr_ptr, tcol_ptr, tval_ptr, tdraw_ptr, tsub_ptr,
    max_ptr, cos_ptr, coef_ptr, ga_ptr,
    B, D, n_cls, K: tl.constexpr, cls_per_split, stride_a, stride_w, stride_tr,
    scale, threshold, eps_over_c, one_minus_eps,
    HAS_ROWS: tl.constexpr, NORM_W: tl.constexpr, FILTER: tl.constexpr, SMOOTH: tl.constexpr,
    COMPUTE: tl.constexpr, DOT: tl.constexpr, PRECISION: tl.constexpr,
    BM: tl.constexpr, BN: tl.constexpr, BD: tl.constexpr, DP: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_s = tl.program_id(1)
    offs_m = pid_m * BM + tl.arange(0, BM)
    m_mask = offs_m < B
    offs_d = tl.arange(0, DP)
    d_mask = offs_d < D
    tcol, tval, tdraw, tsub, row_max, coef_over_sum, coef = _row_inputs(
        tcol_ptr, tval_ptr, tdraw_ptr, tsub_ptr, max_ptr, cos_ptr, coef_ptr, offs_m, m_mask)
    acc = tl.zeros([BM, DP], dtype=tl.float32)
    c_begin = pid_s * cls_per_split
    c_end = tl.minimum(c_begin + cls_per_split, n_cls)
    for n0 in range(c_begin, c_end, BN):
        offs_n = n0 + tl.arange(0, BN)
        n_mask = offs_n < c_end
        best, arg, fmax, _ = tiles.class_values(
            a_ptr, stride_a, offs_m, m_mask, w_ptr, stride_w, rows_ptr, inv_ptr, tr_ptr, stride_tr,
            offs_n, n_mask, K, D, -1,
            HAS_ROWS, NORM_W, FILTER, False, COMPUTE, DOT, PRECISION, BM, BN, BD,
        )
        z, is_t = tiles.logits(best, fmax, offs_n, n_mask, tcol, tval, scale, threshold, FILTER)
        live = m_mask[:, None] & n_mask[None, :]
        dc = tiles.dcos(z, is_t, row_max, coef_over_sum, coef, tdraw, live, scale, eps_over_c, one_minus_eps, SMOOTH)
        for sub in tl.static_range(K):
            wrow = tiles.weight_rows(rows_ptr, offs_n, sub, K, n_mask, HAS_ROWS)
            own = tl.where(is_t, tsub[:, None] == sub, arg == sub)
            dp = tl.where(own, dc, 0.0)
            if NORM_W:
                inv = tl.load(inv_ptr + offs_n.to(tl.int64) * K + sub, mask=n_mask, other=0.0)
                dp = dp * inv[None, :]
            w_t = tl.load(w_ptr + wrow[:, None] * stride_w + offs_d[None, :],
                          mask=n_mask[:, None] & d_mask[None, :], other=0.0)
            acc = tl.dot(tiles.operand(dp, COMPUTE, DOT), tiles.operand(w_t, COMPUTE, DOT), acc,
                         input_precision=PRECISION)
    out = ga_ptr + (pid_s * B + offs_m).to(tl.int64)[:, None] * D + offs_d[None, :]
    tl.store(out, acc, mask=m_mask[:, None] & d_mask[None, :])
