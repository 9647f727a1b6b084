"""Triton epilogues around the cuBLAS GEMMs of :mod:`.chunks`: everything of the loss that is not a
matmul, one pass over each block of products, no ``tl.dot`` anywhere.

The GEMMs (``x·Ŵᵀ``, ``E·Ŵ``, ``Eᵀ·x``) are where the FLOPs are, and cuBLAS runs them at the
device's matmul rate whatever the GPU; these kernels only stream a ``[B, chunk]`` block of
products (L2-resident at the chunk sizes :mod:`.chunks` picks) or a ``[chunk, D]`` block of rows
once each, so their speed is a bandwidth figure that follows from their byte counts:

* :func:`operand_rows_kernel`: the GEMM operand of the shard's scored centre rows — their
  ``1/‖w‖``, and the rows gathered through Partial FC's ``rows``, scaled by it when the margin
  normalises centres, cast to the compute dtype — in one read of ``W`` (the torch path makes a
  normalised copy and a cast copy), once per step (or per chunk, for a shard above
  :data:`.chunks.OPERAND_BYTES`);
* :func:`forward_epilogue_kernel`: per sample, the chunk's online ``(max, Σ exp, Σ z)`` from its
  products: max over sub-centres, the margin's target value substituted, filtered negatives
  removed — :func:`.tiles.logits`, the code the fused forward uses;
* :func:`backward_epilogue_kernel`: the products rewritten in place as the GEMM operand ``E`` of the
  backward, ``E_ij = unit · (softmax_ij − ε/C)`` at each class's arg-max sub-centre and 0 elsewhere
  and at the target column. The per-sample factors (upstream gradient, the scale ``s``) and the
  target column (the margin's derivative) stay out of ``E``, so ``E`` is bounded by ``unit`` and
  fp16 keeps the small softmax values normal (see :mod:`.chunks`);
* :func:`weight_grad_kernel`: the rows' weight gradient from the GEMM's ``H = Eᵀ·x`` (fp32): the
  normalisation backward ``dJ/dw = inv·H − inv³·(w·H)·w`` and one write per row — new, Partial FC's
  compact rows, or added into ``.grad`` (at the sampled rows);
* :func:`weight_update_kernel` (SGD) and :func:`adamw_update_kernel` (AdamW): the same gradient,
  never stored: the optimizer's step applied to each row as it is formed
  (``head_optimizer(..., fused_update=True)``), so the ``[n, D]`` gradient is not written, cleared
  or read again. Both form it with :func:`_update_grad_tile`, one description of it.
"""

from __future__ import annotations

import triton
import triton.language as tl

from shardfc.head.fused import tiles

#: The cache policy of the rows a per-row kernel streams (the weight and optimizer state the fused
#: update rewrites, the gradient rows it writes): each is touched once a step, so it goes first
#: when L2 needs room, and a chunk's products and ``H``, which the next kernels reread, stay.
STREAM: tl.constexpr = tl.constexpr("evict_first")


@triton.jit
def _row_block(rows_ptr, r0, n_rows, BR: tl.constexpr, HAS_ROWS: tl.constexpr):
    """This program's ``BR`` rows of a per-row kernel: their offsets in the chunk, the mask of those
    below ``n_rows``, their scored row ids (``r0 + offset``) and the weight rows they read (through
    ``rows_ptr``, Partial FC's sampled rows, under ``HAS_ROWS``; else the scored rows themselves)."""
    offs_r = tl.program_id(0) * BR + tl.arange(0, BR)
    r_mask = offs_r < n_rows
    scored = r0 + offs_r.to(tl.int64)
    wrow = scored
    if HAS_ROWS:
        wrow = tl.load(rows_ptr + scored, mask=r_mask, other=0).to(tl.int64)
    return offs_r, r_mask, scored, wrow


@triton.jit
def operand_rows_kernel(
    w_ptr, rows_ptr, inv_ptr, out_ptr, n_rows, r0, D, stride_w, stride_o,
    HAS_ROWS: tl.constexpr, COMPUTE_INV: tl.constexpr, SCALE: tl.constexpr, WRITE: tl.constexpr,
    EMULATE_RTNE: tl.constexpr, BR: tl.constexpr, BD: tl.constexpr,
):
    """Scored rows ``r0 .. r0 + n_rows`` of ``w`` (through ``rows``): ``COMPUTE_INV`` stores their
    ``1/‖w‖`` at ``inv[r0 + r]`` (0 below NORM_EPS, as the torch path), else ``SCALE`` reads it;
    ``WRITE`` stores ``out[r] = w·inv`` (``SCALE``) or ``w``, in ``out``'s dtype. One read of the
    rows for the norms, the second from L1/L2."""
    offs_r, r_mask, scored, wrow = _row_block(rows_ptr, r0, n_rows, BR, HAS_ROWS)
    w_rows = w_ptr + wrow[:, None] * stride_w
    if COMPUTE_INV:
        sq = tl.zeros([BR], dtype=tl.float32)
        for d0 in range(0, D, BD):
            offs_d = d0 + tl.arange(0, BD)
            w = tl.load(w_rows + offs_d[None, :], mask=r_mask[:, None] & (offs_d < D)[None, :], other=0.0)
            w = w.to(tl.float32)
            sq += tl.sum(w * w, axis=1)
        norm = tl.sqrt(sq)
        inv = tl.where(norm >= tiles.NORM_EPS, 1.0 / tl.maximum(norm, tiles.NORM_EPS), 0.0)
        tl.store(inv_ptr + scored, inv, mask=r_mask)
    elif SCALE:
        inv = tl.load(inv_ptr + scored, mask=r_mask, other=0.0)
    if WRITE:
        for d0 in range(0, D, BD):
            offs_d = d0 + tl.arange(0, BD)
            mask = r_mask[:, None] & (offs_d < D)[None, :]
            w = tl.load(w_rows + offs_d[None, :], mask=mask, other=0.0).to(tl.float32)
            if SCALE:
                w = w * inv[:, None]
            tl.store(out_ptr + offs_r.to(tl.int64)[:, None] * stride_o + offs_d[None, :],
                     tiles.stored(w, out_ptr, EMULATE_RTNE), mask=mask)


@triton.jit
def _class_block(p_ptr, stride_p, f_ptr, stride_f, inv_ptr, r0, offs_m, m_mask, offs_n, n_mask,
                 K: tl.constexpr, FILTER: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr):
    """A ``[BM, BN]`` block of class values from the chunk's products (columns ``class·K + sub``):
    the max over sub-centres, its sub-centre, and (``FILTER``) the max cosine to the target centre
    (``F·inv``)."""
    best = tl.full([BM, BN], float("-inf"), dtype=tl.float32)
    arg = tl.zeros([BM, BN], dtype=tl.int32)
    fmax = tl.full([BM, BN], float("-inf"), dtype=tl.float32)
    mask = m_mask[:, None] & n_mask[None, :]
    rows_p = p_ptr + offs_m.to(tl.int64)[:, None] * stride_p
    for sub in tl.static_range(K):
        col = offs_n.to(tl.int64) * K + sub
        c = tl.load(rows_p + col[None, :], mask=mask, other=0.0).to(tl.float32)
        if K == 1:
            best = c
        else:
            take = c > best
            arg = tl.where(take, sub, arg)
            best = tl.where(take, c, best)
        if FILTER:
            inv = tl.load(inv_ptr + r0 + col, mask=n_mask, other=0.0)
            f = tl.load(f_ptr + offs_m.to(tl.int64)[:, None] * stride_f + col[None, :], mask=mask, other=0.0)
            fmax = tl.maximum(fmax, f * inv[None, :])
    return best, arg, fmax


@triton.jit
def forward_epilogue_kernel(
    p_ptr, f_ptr, inv_ptr, tcol_ptr, tval_ptr, pmax_ptr, psum_ptr, plsum_ptr,
    B, n_c, c0, r0, cls_per_prog, stride_p, stride_f, part0, n_parts, scale, threshold,
    K: tl.constexpr, FILTER: tl.constexpr, SMOOTH: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
):
    """Grid ``(row tiles, splits of the chunk)``: one ``(max, Σ exp, Σ z)`` per sample and split,
    written at column ``part0 + split`` of the ``[B, n_parts]`` partials."""
    pid_m = tl.program_id(0)
    pid_s = tl.program_id(1)
    offs_m = pid_m * BM + tl.arange(0, BM)
    m_mask = offs_m < B
    # The label's class column within this chunk (out of range: the label is elsewhere).
    tcol = tl.load(tcol_ptr + offs_m, mask=m_mask, other=-1) - c0
    tval = tl.load(tval_ptr + offs_m, mask=m_mask, other=0.0)
    run_max = tl.full([BM], float("-inf"), dtype=tl.float32)
    run_sum = tl.zeros([BM], dtype=tl.float32)
    run_lsum = tl.zeros([BM], dtype=tl.float32)
    begin = pid_s * cls_per_prog
    end = tl.minimum(begin + cls_per_prog, n_c)
    for n0 in range(begin, end, BN):
        offs_n = n0 + tl.arange(0, BN)
        n_mask = offs_n < end
        best, arg, fmax = _class_block(p_ptr, stride_p, f_ptr, stride_f, inv_ptr, r0, offs_m, m_mask,
                                       offs_n, n_mask, K, FILTER, BM, BN)
        z, is_t = tiles.logits(best, fmax, offs_n, n_mask, tcol, tval, scale, threshold, FILTER)
        run_max, run_sum, run_lsum = tiles.online_fold(z, n_mask, run_max, run_sum, run_lsum, SMOOTH)
    out = offs_m.to(tl.int64) * n_parts + part0 + pid_s
    tl.store(pmax_ptr + out, run_max, mask=m_mask)
    tl.store(psum_ptr + out, run_sum, mask=m_mask)
    if SMOOTH:
        tl.store(plsum_ptr + out, run_lsum, mask=m_mask)


@triton.jit
def backward_epilogue_kernel(
    p_ptr, f_ptr, inv_ptr, tcol_ptr, tval_ptr, max_ptr, rsum_ptr,
    B, n_c, c0, r0, stride_p, stride_f, scale, threshold, eps_over_c, unit,
    K: tl.constexpr, FILTER: tl.constexpr, SMOOTH: tl.constexpr, EMULATE_RTNE: tl.constexpr,
    BM: tl.constexpr, BN: tl.constexpr,
):
    """Grid ``(row tiles, class tiles of the chunk)``: the products of a tile replaced in place by
    ``E = unit · (softmax − ε/C)`` at each class's arg-max sub-centre (0 at the others, at the
    target column and for filtered negatives), in the products' dtype."""
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    offs_m = pid_m * BM + tl.arange(0, BM)
    offs_n = pid_n * BN + tl.arange(0, BN)
    m_mask = offs_m < B
    n_mask = offs_n < n_c
    tcol = tl.load(tcol_ptr + offs_m, mask=m_mask, other=-1) - c0
    tval = tl.load(tval_ptr + offs_m, mask=m_mask, other=0.0)
    row_max = tl.load(max_ptr + offs_m, mask=m_mask, other=0.0)
    inv_sum = tl.load(rsum_ptr + offs_m, mask=m_mask, other=0.0)
    best, arg, fmax = _class_block(p_ptr, stride_p, f_ptr, stride_f, inv_ptr, r0, offs_m, m_mask,
                                   offs_n, n_mask, K, FILTER, BM, BN)
    z, is_t = tiles.logits(best, fmax, offs_n, n_mask, tcol, tval, scale, threshold, FILTER)
    u = tl.exp(z - row_max[:, None]) * inv_sum[:, None]
    if SMOOTH:
        u = u - eps_over_c
    mask = m_mask[:, None] & n_mask[None, :]
    e = tl.where(mask & ~is_t, u * unit, 0.0)
    rows_p = p_ptr + offs_m.to(tl.int64)[:, None] * stride_p
    for sub in tl.static_range(K):
        col = offs_n.to(tl.int64) * K + sub
        if K == 1:
            own = e
        else:
            own = tl.where(arg == sub, e, 0.0)
        tl.store(rows_p + col[None, :], tiles.stored(own, p_ptr, EMULATE_RTNE), mask=mask)


@triton.jit
def _normalisation_projection(h_rows, w_rows, inv_ptr, scored, r_mask, D,
                              W_HAT: tl.constexpr, BR: tl.constexpr, BD: tl.constexpr):
    """``(inv, proj)`` per row of the block: ``1/‖w‖`` and the coefficient of the normalisation
    backward's projection, ``inv·(ŵ·H)`` from the normalised rows (``W_HAT``) or ``inv³·(w·H)``."""
    inv = tl.load(inv_ptr + scored, mask=r_mask, other=0.0)
    wh = tl.zeros([BR], dtype=tl.float32)
    for d0 in range(0, D, BD):
        offs_d = d0 + tl.arange(0, BD)
        mask = r_mask[:, None] & (offs_d < D)[None, :]
        h = tl.load(h_rows + offs_d[None, :], mask=mask, other=0.0)
        w = tl.load(w_rows + offs_d[None, :], mask=mask, other=0.0).to(tl.float32)
        wh += tl.sum(h * w, axis=1)
    proj = inv * wh if W_HAT else inv * inv * inv * wh
    return inv, proj


@triton.jit
def _gradient_rows(h_ptr, w_ptr, rows_ptr, inv_ptr, hscale_ptr, n_rows, r0, D, stride_h, stride_w,
                   HAS_ROWS: tl.constexpr, NORM_W: tl.constexpr, W_HAT: tl.constexpr,
                   BR: tl.constexpr, BD: tl.constexpr):
    """What a per-row kernel of the weight gradient needs before its tiles: the block's rows (mask,
    scored ids, weight rows), ``hscale``, the row pointers into ``H`` and the rows the projection
    reads (the operand's ``ŵ`` under ``W_HAT``, else the weight), and ``(inv, proj)`` (zeros
    without ``NORM_W``)."""
    offs_r, r_mask, scored, wrow = _row_block(rows_ptr, r0, n_rows, BR, HAS_ROWS)
    hscale = tl.load(hscale_ptr)
    h_rows = h_ptr + offs_r.to(tl.int64)[:, None] * stride_h
    w_rows = w_ptr + (scored if W_HAT else wrow)[:, None] * stride_w
    inv = tl.zeros([BR], dtype=tl.float32)
    proj = inv
    if NORM_W:
        inv, proj = _normalisation_projection(h_rows, w_rows, inv_ptr, scored, r_mask, D, W_HAT, BR, BD)
    return r_mask, scored, wrow, hscale, h_rows, w_rows, inv, proj


@triton.jit
def _grad_tile(h_rows, w_rows, offs_d, mask, inv, proj, hscale, NORM_W: tl.constexpr):
    """One ``[BR, BD]`` tile of the rows' weight gradient from ``H``: ``hscale·(inv·H − proj·w)``
    (``NORM_W``) or ``hscale·H`` — the one description of it, for the gradient and the update."""
    g = tl.load(h_rows + offs_d[None, :], mask=mask, other=0.0)
    if NORM_W:
        w = tl.load(w_rows + offs_d[None, :], mask=mask, other=0.0).to(tl.float32)
        g = inv[:, None] * g - proj[:, None] * w
    return g * hscale


@triton.jit
def weight_grad_kernel(
    h_ptr, w_ptr, rows_ptr, inv_ptr, g_ptr, hscale_ptr, sq_ptr, n_rows, r0, D, stride_h, stride_w, stride_g,
    HAS_ROWS: tl.constexpr, NORM_W: tl.constexpr, W_HAT: tl.constexpr, ACCUMULATE: tl.constexpr,
    SCATTER: tl.constexpr, SQ: tl.constexpr, EMULATE_RTNE: tl.constexpr, BR: tl.constexpr, BD: tl.constexpr,
):
    """``dJ/dw`` of rows ``r0 .. r0 + n_rows`` of the shard's scored rows from ``H`` (fp32,
    ``[n_rows, D]``, in units of ``hscale``): ``hscale·(inv·H − inv³·(w·H)·w)`` (``NORM_W``) or
    ``hscale·H``, written once at the scored row (``SCATTER``: at the weight row, Partial FC's
    dense ``.grad``), added to what is there (``ACCUMULATE``). ``W_HAT``: ``w_ptr`` holds the
    normalised scored rows ``ŵ`` (the step's operand, indexed by scored row), and the projection
    is ``inv·(ŵ·H)·ŵ``: the fp32 rows are not read again. ``SQ``: the program also writes the sum
    of squares of the values it stored at ``sq_ptr[program]`` (the head's clipping norm, from
    this pass instead of another over the stored gradient)."""
    r_mask, scored, wrow, hscale, h_rows, w_rows, inv, proj = _gradient_rows(
        h_ptr, w_ptr, rows_ptr, inv_ptr, hscale_ptr, n_rows, r0, D, stride_h, stride_w, HAS_ROWS, NORM_W, W_HAT, BR, BD)
    out_rows = g_ptr + (wrow if SCATTER else scored)[:, None] * stride_g
    sq = tl.zeros([BR], dtype=tl.float32)
    for d0 in range(0, D, BD):
        offs_d = d0 + tl.arange(0, BD)
        mask = r_mask[:, None] & (offs_d < D)[None, :]
        g = _grad_tile(h_rows, w_rows, offs_d, mask, inv, proj, hscale, NORM_W)
        if ACCUMULATE:
            g += tl.load(out_rows + offs_d[None, :], mask=mask, other=0.0, eviction_policy=STREAM).to(tl.float32)
        v = tiles.stored(g, g_ptr, EMULATE_RTNE)
        tl.store(out_rows + offs_d[None, :], v, mask=mask, eviction_policy=STREAM)
        if SQ:
            v32 = tl.where(mask, v.to(tl.float32), 0.0)
            sq += tl.sum(v32 * v32, axis=1)
    if SQ:
        tl.store(sq_ptr + tl.program_id(0), tl.sum(sq, axis=0))


@triton.jit
def _target_terms(slot_ptr, t_ptr, scored, r_mask, stride_t):
    """The block's rows of the target column's terms: ``(has_t, t_rows)``, whether a row is some
    sample's target (``slot[scored] ≥ 0``) and the pointers to its row of ``t`` (the summed target
    terms of the samples whose label it is; :func:`.chunks._target_slots`)."""
    slot = tl.load(slot_ptr + scored, mask=r_mask, other=-1)
    has_t = slot >= 0
    t_rows = t_ptr + tl.maximum(slot, 0).to(tl.int64)[:, None] * stride_t
    return has_t, t_rows


@triton.jit
def _update_grad_tile(h_rows, w_rows, t_rows, has_t, offs_d, mask, inv, proj, hscale, NORM_W: tl.constexpr):
    """One ``[BR, BD]`` tile of the rows' whole gradient for a fused update: :func:`_grad_tile`
    plus the target column's terms at the rows that are targets."""
    g = _grad_tile(h_rows, w_rows, offs_d, mask, inv, proj, hscale, NORM_W)
    return g + tl.load(t_rows + offs_d[None, :], mask=mask & has_t[:, None], other=0.0)


@triton.jit
def _stored_row(p_rows, offs_d, mask, w, sq, p_ptr, EMULATE_RTNE: tl.constexpr, NEXT: tl.constexpr):
    """Store a tile of the updated rows into the weight; ``NEXT``: also add the squares of the
    values as stored (rounded to the weight's dtype) to ``sq``, the rows' squared norms."""
    w = tiles.stored(w, p_ptr, EMULATE_RTNE)
    tl.store(p_rows + offs_d[None, :], w, mask=mask, eviction_policy=STREAM)
    if NEXT:
        wf = tl.where(mask, w.to(tl.float32), 0.0)
        sq += tl.sum(wf * wf, axis=1)
    return sq


@triton.jit
def _next_operand(p_rows, op_ptr, inv_ptr, scored, r_mask, sq, D, stride_o, NORM_W: tl.constexpr,
                  EMULATE_OP: tl.constexpr, BR: tl.constexpr, BD: tl.constexpr):
    """The next step's operand of the rows just updated, as :func:`operand_rows_kernel` would make
    it from them: ``1/‖w‖`` from their squared norms ``sq`` stored at ``inv[scored]`` and the rows
    times it (``NORM_W``; else the rows as they are) in the operand's dtype at ``op[scored]`` — a
    second pass over rows this program has just written, from L1/L2. Nothing of this step reads
    these operand rows or norms again (the chunk's GEMMs and this kernel's first passes have)."""
    if NORM_W:
        norm = tl.sqrt(sq)
        inv = tl.where(norm >= tiles.NORM_EPS, 1.0 / tl.maximum(norm, tiles.NORM_EPS), 0.0)
        tl.store(inv_ptr + scored, inv, mask=r_mask)
    tl.debug_barrier()  # the rows' stores before their reads, whichever threads held them
    o_rows = op_ptr + scored[:, None] * stride_o
    for d0 in range(0, D, BD):
        offs_d = d0 + tl.arange(0, BD)
        mask = r_mask[:, None] & (offs_d < D)[None, :]
        w = tl.load(p_rows + offs_d[None, :], mask=mask, other=0.0).to(tl.float32)
        if NORM_W:
            w = w * inv[:, None]
        tl.store(o_rows + offs_d[None, :], tiles.stored(w, op_ptr, EMULATE_OP), mask=mask)


@triton.jit
def weight_update_kernel(
    h_ptr, w_ptr, rows_ptr, inv_ptr, hscale_ptr, slot_ptr, t_ptr, p_ptr, buf_ptr, op_ptr, hyper_ptr,
    n_rows, r0, D, stride_h, stride_w, stride_t, stride_p, stride_b, stride_o,
    HAS_ROWS: tl.constexpr, NORM_W: tl.constexpr, W_HAT: tl.constexpr, MOMENTUM: tl.constexpr,
    NESTEROV: tl.constexpr, NEXT: tl.constexpr, EMULATE_RTNE: tl.constexpr, EMULATE_OP: tl.constexpr,
    BR: tl.constexpr, BD: tl.constexpr,
):
    """The optimizer's step on rows ``r0 .. r0 + n_rows`` of the shard's scored rows, from their
    gradient as :func:`weight_grad_kernel` forms it, which is never stored: plus the target
    column's rows (``slot[scored] ≥ 0``: row ``slot`` of ``t``, the summed target terms of the
    samples whose label is that row), SGD with weight decay, momentum and Nesterov in fp32, the
    weight row ``p[wrow]`` and its momentum ``buf[wrow]`` rounded once (to nearest) into their
    dtype — :class:`shardfc.head.partial_fc.RowSparseSGD`'s update. With ``NORM_W`` and not
    ``W_HAT``, ``w_ptr`` is ``p``: each tile is read for the gradient before it is written.
    ``NEXT`` (every row scored, the step's operand in ``op``): the updated rows' operand and
    ``1/‖w‖`` for the next step written over this step's (:func:`_next_operand`). ``hyper``: fp32
    ``[lr, momentum, weight_decay]`` on the device (:data:`SGD_HYPER`), read here rather than
    passed as numbers, so a captured CUDA graph replays with the values of the step it replays."""
    lr = tl.load(hyper_ptr)
    momentum = tl.load(hyper_ptr + 1)
    weight_decay = tl.load(hyper_ptr + 2)
    r_mask, scored, wrow, hscale, h_rows, w_rows, inv, proj = _gradient_rows(
        h_ptr, w_ptr, rows_ptr, inv_ptr, hscale_ptr, n_rows, r0, D, stride_h, stride_w, HAS_ROWS, NORM_W, W_HAT, BR, BD)
    has_t, t_rows = _target_terms(slot_ptr, t_ptr, scored, r_mask, stride_t)
    p_rows = p_ptr + wrow[:, None] * stride_p
    b_rows = buf_ptr + wrow[:, None] * stride_b
    sq = tl.zeros([BR], dtype=tl.float32)
    for d0 in range(0, D, BD):
        offs_d = d0 + tl.arange(0, BD)
        mask = r_mask[:, None] & (offs_d < D)[None, :]
        g = _update_grad_tile(h_rows, w_rows, t_rows, has_t, offs_d, mask, inv, proj, hscale, NORM_W)
        w = tl.load(p_rows + offs_d[None, :], mask=mask, other=0.0, eviction_policy=STREAM).to(tl.float32)
        g = g + weight_decay * w
        if MOMENTUM:
            b = tl.load(b_rows + offs_d[None, :], mask=mask, other=0.0, eviction_policy=STREAM).to(tl.float32)
            b = b * momentum + g
            tl.store(b_rows + offs_d[None, :], tiles.stored(b, buf_ptr, EMULATE_RTNE), mask=mask, eviction_policy=STREAM)
            if NESTEROV:
                g = g + momentum * b
            else:
                g = b
        sq = _stored_row(p_rows, offs_d, mask, w - lr * g, sq, p_ptr, EMULATE_RTNE, NEXT)
    if NEXT:
        _next_operand(p_rows, op_ptr, inv_ptr, scored, r_mask, sq, D, stride_o, NORM_W, EMULATE_OP, BR, BD)


#: The fp32 values of :func:`weight_update_kernel`'s ``hyper``, in order.
SGD_HYPER = ("lr", "momentum", "weight_decay")
#: ... and of :func:`adamw_update_kernel`'s.
ADAMW_HYPER = ("lr", "decay", "beta1_hi", "beta1_lo", "beta2_hi", "beta2_lo", "one_minus_beta1", "one_minus_beta2", "eps")

#: Bits of a row's step count :func:`beta_powers` reads at most: every count an fp64 holds exactly.
STEP_BITS: tl.constexpr = tl.constexpr(53)


@triton.jit
def step_bits(t_max):
    """How many bits of the step counts up to ``t_max`` (integer-valued fp64, ≥ 0) :func:`beta_powers`
    must read: the bit length of ``t_max``, read exactly from its fp64 exponent (a ``log2`` may
    round up or down at a power of two); at most :data:`STEP_BITS`. A million steps read
    20 bits, not 53: the squaring's loop follows the counts, not the type. The catch-up kernel
    (``idle_rows``) squares once per missed step; :func:`adamw_update_kernel` once per row and
    keeps the 53 (its loop bound read from the rows' counts cost it a register spill at 8x64)."""
    top = tl.maximum(t_max, 1.0).to(tl.float64)
    exponent = ((top.to(tl.int64, bitcast=True) >> 52) & 0x7FF) - 1023  # ⌊log2 top⌋, exactly
    return tl.minimum(exponent + 1, STEP_BITS).to(tl.int32)


@triton.jit
def beta_powers(beta1, beta2, t, bits):
    """``(beta1 ** t, beta2 ** t)`` per row in fp64, for the integer-valued fp64 step counts ``t``
    (below ``2 ** bits``, ``bits`` from :func:`step_bits`): by squaring, one bit of ``t`` per
    iteration: ``b ** t`` to a relative ``t·ε`` of fp64 (each squaring doubles the relative error),
    so ``1 − b^t`` is at most ``t·ε·b^t ≤ ε / (e·ln(1/b))`` off, far below a unit of the fp32 it
    is rounded to."""
    e = t.to(tl.int64)
    pow1 = t * 0.0 + 1.0
    pow2 = pow1
    for _ in range(bits):
        odd = (e & 1) != 0
        pow1 = tl.where(odd, pow1 * beta1, pow1)
        pow2 = tl.where(odd, pow2 * beta2, pow2)
        beta1 = beta1 * beta1
        beta2 = beta2 * beta2
        e = e >> 1
    return pow1, pow2


@triton.jit
def adamw_update_kernel(
    h_ptr, w_ptr, rows_ptr, inv_ptr, hscale_ptr, slot_ptr, t_ptr, p_ptr, m_ptr, v_ptr, step_ptr, op_ptr, hyper_ptr,
    n_rows, r0, D, stride_h, stride_w, stride_t, stride_p, stride_m, stride_v, stride_o,
    HAS_ROWS: tl.constexpr, NORM_W: tl.constexpr, W_HAT: tl.constexpr, NEXT: tl.constexpr,
    EMULATE_RTNE: tl.constexpr, EMULATE_OP: tl.constexpr, BR: tl.constexpr, BD: tl.constexpr,
):
    """AdamW's step on rows ``r0 .. r0 + n_rows`` of the shard's scored rows, from the gradient
    :func:`weight_update_kernel` forms (never stored): :class:`shardfc.head.partial_fc.RowSparseAdamW`'s
    update, in fp32 — the weight row decayed by ``decay = 1 − lr·wd`` (decoupled), the moments
    ``m ← m + (1−β₁)(g − m)`` and ``v ← β₂·v + (1−β₂)·g²``, the row's own step count
    ``step[wrow]`` (fp64) advanced by one and its bias corrections ``1 − β₁ᵗ``, ``√(1 − β₂ᵗ)``
    computed in fp64 and rounded to fp32 as the optimizer does, then
    ``w ← w − (lr / (1 − β₁ᵗ))·m / (√v / √(1 − β₂ᵗ) + eps)``; the row, ``m`` and ``v`` rounded once
    (to nearest) into their dtype. The hyper-parameters are fp32 values on the device, ``hyper``
    (:data:`ADAMW_HYPER`: ``lr``, ``decay``, each β as two fp32 halves ``hi + lo``, exact to 2⁻⁴⁸
    in fp64 — ``beta2_hi`` is also β₂ in fp32 —, ``1 − β₁``, ``1 − β₂``, ``eps``), read here so a
    captured CUDA graph replays with the values of the step it replays. With ``NORM_W`` and not
    ``W_HAT``, ``w_ptr`` is ``p``: each tile is read for the gradient before it is written.
    ``NEXT``: the next step's operand, as :func:`weight_update_kernel`'s."""
    lr = tl.load(hyper_ptr)
    decay = tl.load(hyper_ptr + 1)
    beta1_hi = tl.load(hyper_ptr + 2)
    beta1_lo = tl.load(hyper_ptr + 3)
    beta2_hi = tl.load(hyper_ptr + 4)
    beta2_lo = tl.load(hyper_ptr + 5)
    one_minus_beta1 = tl.load(hyper_ptr + 6)
    one_minus_beta2 = tl.load(hyper_ptr + 7)
    eps = tl.load(hyper_ptr + 8)
    r_mask, scored, wrow, hscale, h_rows, w_rows, inv, proj = _gradient_rows(
        h_ptr, w_ptr, rows_ptr, inv_ptr, hscale_ptr, n_rows, r0, D, stride_h, stride_w, HAS_ROWS, NORM_W, W_HAT, BR, BD)
    has_t, t_rows = _target_terms(slot_ptr, t_ptr, scored, r_mask, stride_t)
    t = tl.load(step_ptr + wrow, mask=r_mask, other=0.0) + 1.0
    tl.store(step_ptr + wrow, t, mask=r_mask)
    pow1, pow2 = beta_powers(tl.cast(beta1_hi, tl.float64) + tl.cast(beta1_lo, tl.float64),
                             tl.cast(beta2_hi, tl.float64) + tl.cast(beta2_lo, tl.float64), t, STEP_BITS)
    step_size = tl.div_rn(tl.full([BR], 1.0, tl.float32), (1.0 - pow1).to(tl.float32)) * lr
    bias2_sqrt = tl.sqrt(1.0 - pow2).to(tl.float32)  # fp64: correctly rounded
    p_rows = p_ptr + wrow[:, None] * stride_p
    m_rows = m_ptr + wrow[:, None] * stride_m
    v_rows = v_ptr + wrow[:, None] * stride_v
    sq = tl.zeros([BR], dtype=tl.float32)
    for d0 in range(0, D, BD):
        offs_d = d0 + tl.arange(0, BD)
        mask = r_mask[:, None] & (offs_d < D)[None, :]
        g = _update_grad_tile(h_rows, w_rows, t_rows, has_t, offs_d, mask, inv, proj, hscale, NORM_W)
        w = tl.load(p_rows + offs_d[None, :], mask=mask, other=0.0, eviction_policy=STREAM).to(tl.float32) * decay
        m = tl.load(m_rows + offs_d[None, :], mask=mask, other=0.0, eviction_policy=STREAM).to(tl.float32)
        m = m + one_minus_beta1 * (g - m)
        v = tl.load(v_rows + offs_d[None, :], mask=mask, other=0.0, eviction_policy=STREAM).to(tl.float32)
        v = v * beta2_hi + one_minus_beta2 * g * g
        tl.store(m_rows + offs_d[None, :], tiles.stored(m, m_ptr, EMULATE_RTNE), mask=mask, eviction_policy=STREAM)
        tl.store(v_rows + offs_d[None, :], tiles.stored(v, v_ptr, EMULATE_RTNE), mask=mask, eviction_policy=STREAM)
        denom = tl.div_rn(tl.sqrt_rn(v), bias2_sqrt[:, None]) + eps
        sq = _stored_row(p_rows, offs_d, mask, w - tl.div_rn(step_size[:, None] * m, denom), sq, p_ptr,
                         EMULATE_RTNE, NEXT)
    if NEXT:
        _next_operand(p_rows, op_ptr, inv_ptr, scored, r_mask, sq, D, stride_o, NORM_W, EMULATE_OP, BR, BD)
