"""The pieces the Triton kernels share: one tile of class logits.

A *tile* is ``BM`` samples × ``BN`` classes of one shard. The fused forward (:mod:`.forward`)
computes its products with ``tl.dot``; the GEMM path's epilogues (:mod:`.epilogue`) read them from a
cuBLAS GEMM's output; both turn them into logits with :func:`logits`, so every path sees the same
numbers:

* the products ``c = a · ŵ_r`` of every centre row ``r`` of the tile's classes (``K`` sub-centres
  per class; ``ŵ = w·inv`` when the margin normalises centres, else ``w``; operands cast to the
  compute dtype, fp32 accumulation, the result rounded to the compute dtype — what cuBLAS returns;
  rows gathered through ``rows`` under Partial FC — never a copy of ``W``);
* the class value, the max of ``c`` over its sub-centres;
* the logit ``z = s · c``, except at the target column, where the margin's value ``z_t`` (an input:
  :mod:`shardfc.head.margins` computed it from the target products alone) replaces it, and the
  inter-class filter's ``−inf`` for negatives too close to the target centre.

The margin is never written here: the kernels get its per-sample value and derivative, so there is
one description of each margin, read by the torch and the Triton path alike.
"""

from __future__ import annotations

import triton
import triton.language as tl

#: Rows with a smaller L2 norm are zero vectors (``shardfc.head.normalize.NORM_EPS``).
NORM_EPS: tl.constexpr = tl.constexpr(1e-12)


@triton.jit
def rtne_bf16(x):
    """``x`` (fp32) rounded to the nearest bf16, ties to even, held in fp32 — what a GPU's
    conversion does. Triton's interpreter truncates fp32 → bf16 instead (Triton 3.9, measured:
    half of random values differ by an ulp, whatever ``fp_downcast_rounding`` says), so under the
    interpreter every bf16 rounding goes through here (finite values; the kernels make no others)."""
    bits = x.to(tl.float32).to(tl.uint32, bitcast=True)
    bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def operand(x, COMPUTE: tl.constexpr, DOT: tl.constexpr):
    """A ``tl.dot`` operand: rounded to the compute dtype, multiplied in ``DOT``. ``DOT`` is the
    compute dtype, except under Triton's interpreter for bf16, whose ``tl.dot`` on bf16 operands
    is wrong (Triton 3.9, measured: errors of 1e10 on a 16×16 product); there the bf16-rounded
    operands (:func:`rtne_bf16`) are multiplied in fp32, which gives the same products."""
    if COMPUTE == tl.bfloat16 and DOT == tl.float32:
        return rtne_bf16(x)
    return x.to(COMPUTE).to(DOT)


@triton.jit
def stored(x, out_ptr, EMULATE_RTNE: tl.constexpr):
    """``x`` converted for a store into ``out_ptr``'s dtype (``EMULATE_RTNE``: a bf16 output under
    the interpreter, rounded by :func:`rtne_bf16` first so the store's truncation changes nothing)."""
    if EMULATE_RTNE:
        x = rtne_bf16(x)
    return x.to(out_ptr.dtype.element_ty)


@triton.jit
def weight_rows(rows_ptr, cls, sub, K, n_mask, HAS_ROWS: tl.constexpr):
    """int64 row of ``W`` holding sub-centre ``sub`` of each scored class ``cls``."""
    scored = cls.to(tl.int64) * K + sub
    if HAS_ROWS:
        scored = tl.load(rows_ptr + scored, mask=n_mask, other=0).to(tl.int64)
    return scored


@triton.jit
def products(
    a_ptr, stride_a, offs_m, m_mask, w_ptr, stride_w, wrow, n_mask, D, inv, SCALE: tl.constexpr,
    COMPUTE: tl.constexpr, DOT: tl.constexpr, PRECISION: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
    BD: tl.constexpr,
):
    """``[BM, BN]`` products ``a · w_r`` (``SCALE``: ``a · (w_r·inv_r)``) with fp32 accumulation,
    rounded to the compute dtype: the numbers a cuBLAS GEMM of the same operands returns, so the
    fused forward and the GEMM backward (:mod:`.chunks`) see the same logits."""
    acc = tl.zeros([BM, BN], dtype=tl.float32)
    a_rows = a_ptr + offs_m.to(tl.int64)[:, None] * stride_a
    w_rows = w_ptr + wrow[:, None] * stride_w
    for d0 in range(0, D, BD):
        offs_d = d0 + tl.arange(0, BD)
        d_mask = offs_d < D
        a_t = tl.load(a_rows + offs_d[None, :], mask=m_mask[:, None] & d_mask[None, :], other=0.0)
        w_t = tl.load(w_rows + offs_d[None, :], mask=n_mask[:, None] & d_mask[None, :], other=0.0)
        if SCALE:
            w_t = w_t * inv[:, None]
        acc = tl.dot(operand(a_t, COMPUTE, DOT), tl.trans(operand(w_t, COMPUTE, DOT)), acc, input_precision=PRECISION)
    return operand(acc, COMPUTE, DOT).to(tl.float32)


@triton.jit
def class_values(
    a_ptr, stride_a, offs_m, m_mask, w_ptr, stride_w, rows_ptr, inv_ptr, tr_ptr, stride_tr,
    offs_n, n_mask, K: tl.constexpr, D,
    HAS_ROWS: tl.constexpr, NORM_W: tl.constexpr, FILTER: tl.constexpr,
    COMPUTE: tl.constexpr, DOT: tl.constexpr, PRECISION: tl.constexpr,
    BM: tl.constexpr, BN: tl.constexpr, BD: tl.constexpr,
):
    """The tile's class values before scale and margin.

    Returns ``best`` (max over sub-centres of ``c``) and ``fmax`` (max over sub-centres of
    the cosine to the sample's target centre, for the filter); ``inv`` (the rows' ``1/‖w‖``) comes
    from the step's pass over the rows (:func:`.chunks.scored_rows`). ``K`` is a compile-time constant: the sub-centre loop
    unrolls, so with one centre per class no tile beyond the products stays live.
    """
    best = tl.full([BM, BN], float("-inf"), dtype=tl.float32)
    fmax = tl.full([BM, BN], float("-inf"), dtype=tl.float32)
    SCALE_W: tl.constexpr = NORM_W and COMPUTE != tl.float32
    for sub in tl.static_range(K):
        wrow = weight_rows(rows_ptr, offs_n, sub, K, n_mask, HAS_ROWS)
        inv = tl.full([BN], 1.0, dtype=tl.float32)
        if NORM_W or FILTER:
            inv = tl.load(inv_ptr + offs_n.to(tl.int64) * K + sub, mask=n_mask, other=0.0)
        # c = a·ŵ: in a 16-bit compute dtype the centre rows are normalised before the cast, as the
        # GEMM path's operand is; in fp32 nothing is rounded, and the column scale after the
        # product keeps the scaled tile out of registers (scaled in the loop, fp32 IEEE spills).
        c = products(a_ptr, stride_a, offs_m, m_mask, w_ptr, stride_w, wrow, n_mask, D, inv, SCALE_W,
                     COMPUTE, DOT, PRECISION, BM, BN, BD)
        if NORM_W and not SCALE_W:
            c = c * inv[None, :]
        if FILTER:
            # The cosine to the target centre: fp32 operands (TF32 on a GPU), so the mask hardly
            # depends on the compute dtype.
            f = products(tr_ptr, stride_tr, offs_m, m_mask, w_ptr, stride_w, wrow, n_mask, D, inv, False,
                         tl.float32, tl.float32, "tf32", BM, BN, BD)
            fmax = tl.maximum(fmax, f * inv[None, :])
        if K == 1:  # no max to take: no second tile alive
            best = c
        else:
            best = tl.maximum(best, c)
    return best, fmax


@triton.jit
def logits(best, fmax, offs_n, n_mask, tcol, tval, scale, threshold, FILTER: tl.constexpr):
    """``z`` of the tile (−inf outside the shard's classes and for filtered negatives) and the
    target mask."""
    is_t = offs_n[None, :] == tcol[:, None]
    z = tl.where(is_t, tval[:, None], best * scale)
    if FILTER:
        z = tl.where((fmax > threshold) & (~is_t), float("-inf"), z)
    z = tl.where(n_mask[None, :], z, float("-inf"))
    return z, is_t


@triton.jit
def online_fold(z, n_mask, run_max, run_sum, run_lsum, SMOOTH: tl.constexpr):
    """A tile of logits folded into each row's running ``(max, Σ exp(z − max), Σ z)``: the running
    sum rescaled to the new max (FlashAttention's online softmax); rows whose logits are all
    ``−inf`` so far keep ``(−inf, 0)``."""
    if SMOOTH:
        run_lsum += tl.sum(tl.where(n_mask[None, :], z, 0.0), axis=1)
    new_max = tl.maximum(run_max, tl.max(z, axis=1))
    shift = tl.where(new_max > float("-inf"), new_max, 0.0)
    run_sum = run_sum * tl.exp(run_max - shift) + tl.sum(tl.exp(z - shift[:, None]), axis=1)
    return new_max, run_sum, run_lsum
