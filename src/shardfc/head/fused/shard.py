"""One shard's statistics and gradients through the fused Triton kernels.

:func:`shard_forward` and :func:`shard_backward` take and return exactly what their torch
counterparts in :mod:`shardfc.head.kernels` do, so :mod:`shardfc.head.function` combines shards,
ranks and devices the same way whichever ran. What differs is inside: no ``[B, n]`` logits at any
``n`` (``chunk_size`` has nothing left to bound and is ignored), ``W`` read in place (no
normalised or gathered copy: Partial FC's sampled rows are an index vector the kernels load
through), the weight gradient written once per row (or added into ``.grad``), and no host
synchronisation: targets are handled with masks over the whole batch, never ``nonzero``.

The margin enters through :func:`target_logits`: the target products ``a·ŵ_y`` (``[B, K]``, a
gather of the label rows, ``O(B·K·D)``) go through :meth:`Margin.target` — the same code the torch
path calls — and the kernels substitute its value and derivative at the target column.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Optional, Tuple

import torch
import triton
import triton.language as tl
from torch import Tensor

from shardfc.head.fused import autotune, chunks, interpreting, shapes_only
from shardfc.head.fused.traffic import gathered, note, rows_of, span
from shardfc.head.kernels import ShardConfig, ShardStats, target_norm_gradients
from shardfc.head.normalize import NORM_EPS

_TL_DTYPES = {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}


@dataclass
class FusedShardStats(ShardStats):
    #: ``1/‖w_r‖`` of the scored centre rows, computed in the forward's pass over the rows and read
    #: by the backward (None: raw centres and no filter).
    inv: Optional[Tensor]
    #: Per sample: the label's class column in the shard (−1: elsewhere or ignored), the sub-centre
    #: the margin was applied to, and whether the label is here.
    tcol: Tensor
    tsub: Tensor
    on_shard: Tensor
    #: The scored rows in the compute dtype (normalised when the margin says so), made once in the
    #: forward and sliced by every GEMM of the backward (None: a shard above OPERAND_BYTES).
    operand: Optional[Tensor] = None


def _precision(cfg: ShardConfig) -> str:
    """fp32 matmuls as torch would do them: full fp32 unless torch allows TF32."""
    if cfg.compute_dtype == torch.float32 and not torch.backends.cuda.matmul.allow_tf32:
        return "ieee"
    return "tf32"


def _dtypes(cfg: ShardConfig) -> dict:
    """The kernels' COMPUTE (operand rounding), DOT (what ``tl.dot`` multiplies) and PRECISION."""
    compute = _TL_DTYPES[cfg.compute_dtype]
    dot = tl.float32 if compute == tl.bfloat16 and interpreting() else compute  # see tiles.operand
    return dict(COMPUTE=compute, DOT=dot, PRECISION=_precision(cfg))


def _scored(w: Tensor, rows: Optional[Tensor]) -> int:
    return w.shape[0] if rows is None else rows.numel()


def target_logits(
    a: Tensor, w: Tensor, local_labels: Tensor, norms: Optional[Tensor], cfg: ShardConfig, rows: Optional[Tensor]
) -> Tuple[Tensor, Tensor, Tensor, Tensor, Optional[Tensor]]:
    """Per sample, for labels on this shard (zeros elsewhere): ``(on_shard, sub-centre, z_t,
    ∂z_t/∂raw, ∂z_t/∂norm or None)``, from the target rows alone, in the stats dtype."""
    K, sd, margin = cfg.subcenters, cfg.stats_dtype, cfg.margin
    on = local_labels >= 0
    scored = local_labels.clamp(min=0).unsqueeze(1) * K + torch.arange(K, device=a.device)
    wrows = scored if rows is None else rows[scored]
    centres = w[wrows].to(sd)  # [B, K, D]: the label rows only
    raw = torch.bmm(centres, a.to(sd).unsqueeze(2)).squeeze(2)
    if margin.normalize_weights:
        norm = torch.linalg.vector_norm(centres, dim=2)
        raw = raw * torch.where(norm >= NORM_EPS, norm.clamp(min=NORM_EPS).reciprocal(), torch.zeros_like(norm))
    best, sub = raw.max(dim=1)
    value, d_raw, d_norm = margin.target(best, norms)
    zero = torch.zeros_like(best)
    d_norm = None if d_norm is None or not margin.needs_norm else torch.where(on, d_norm, zero)
    return on, sub.to(torch.int32), torch.where(on, value, zero), torch.where(on, d_raw, zero), d_norm


def _common(a: Tensor, w: Tensor, cfg: ShardConfig, rows: Optional[Tensor]):
    """The kernels' operands: ``a`` in the compute dtype (``[B, D]``, one cast per step, so no
    kernel converts an fp32 tile of it in registers), ``w`` as stored (never copied), and the
    counts."""
    K = cfg.subcenters
    n_cls = _scored(w, rows) // K
    if w.stride(1) != 1:
        w = w.contiguous()
    return a.to(cfg.compute_dtype).contiguous(), w, n_cls, K


def shard_forward(
    a: Tensor,
    w: Tensor,
    local_labels: Tensor,
    norms: Optional[Tensor],
    cfg: ShardConfig,
    target_rows: Optional[Tensor] = None,
    rows: Optional[Tensor] = None,
    next_operand: Optional[chunks.NextOperand] = None,
) -> FusedShardStats:
    """The fused counterpart of :func:`shardfc.head.kernels.shard_forward` (same arguments).
    ``next_operand``: the shard's :class:`.chunks.NextOperand`, whose operand (written by the last
    step's fused update) replaces the pass over ``W`` while it still stands for ``W``."""
    a_k, w, n_cls, K = _common(a, w, cfg, rows)
    B, dev, sd = a.shape[0], a.device, cfg.stats_dtype
    smooth = cfg.label_smoothing > 0
    normalize = cfg.margin.normalize_weights
    if n_cls == 0:  # a shard without classes: the statistics of an empty set
        empty = torch.zeros(B, dtype=sd, device=dev)
        none_here = torch.zeros(B, dtype=torch.bool, device=dev)
        return FusedShardStats(
            torch.full((B,), float("-inf"), dtype=sd, device=dev), empty, empty, empty if smooth else None,
            empty, empty if cfg.margin.needs_norm else None, None,
            None, torch.full((B,), -1, dtype=torch.int32, device=dev), empty.int(), none_here,
        )
    on, tsub, tval, tdraw, tdnorm = target_logits(a, w, local_labels, norms, cfg, rows)
    tcol = local_labels.to(torch.int32).contiguous()
    tval = tval.float().contiguous()
    tr = target_rows.to(torch.float32).contiguous() if target_rows is not None else None
    rows = rows.contiguous() if rows is not None else None
    scale, threshold = float(cfg.margin.scale), float(cfg.filter_threshold or 0.0)
    need_inv = normalize or tr is not None
    with _on(dev):
        kept = None
        if next_operand is not None and rows is None:
            kept = next_operand.take(w, cfg.compute_dtype, normalize, need_inv)
        if kept is not None:
            operand, inv = kept
        else:
            operand, inv = chunks.scored_rows(w, rows, n_cls * K, cfg.compute_dtype, normalize, need_inv)
        if cfg.impl == "gemm":
            pmax, psum, plsum = chunks.forward_stats(a_k, w, rows, inv, tr, tcol, tval, n_cls, K, scale, threshold,
                                                     normalize, smooth, operand, chunk_scale=cfg.chunk_scale)
        else:
            if operand is not None and tr is None:
                # The step's operand: half the bytes of fp32 W, already gathered and normalised.
                pmax, psum, plsum = _fused_forward(a_k, operand, None, None, None, tcol, tval, n_cls, K, cfg,
                                                   smooth, normalize=False)
            else:  # the filter's cosines read the fp32 rows: the kernel reads W and normalises in registers
                pmax, psum, plsum = _fused_forward(a_k, w, rows, inv, tr, tcol, tval, n_cls, K, cfg, smooth,
                                                   normalize=normalize)
    row_max = pmax.amax(dim=1)
    shift = torch.where(torch.isfinite(row_max), row_max, torch.zeros_like(row_max))
    sum_exp = (psum * torch.exp(pmax - shift.unsqueeze(1))).sum(dim=1)
    logit_sum = plsum.sum(dim=1).to(sd) if smooth else None
    return FusedShardStats(
        row_max.to(sd), sum_exp.to(sd), tval.to(sd), logit_sum, tdraw, tdnorm, None, inv, tcol, tsub, on, operand,
    )


def _fused_forward(a_k, w, rows, inv, tr, tcol, tval, n_cls, K, cfg, smooth, normalize):
    """``(pmax, psum, plsum)`` of the fused online-LSE kernel (:mod:`.forward`): ``[B, splits]``;
    ``w``: the weight (rows through ``rows``, normalised in registers when ``normalize``) or the
    step's operand (compact, normalised already)."""
    B, D, dev = a_k.shape[0], a_k.shape[1], a_k.device
    per_split = autotune.class_splits(n_cls, B, dev)
    n_splits = triton.cdiv(n_cls, per_split)
    pmax = torch.empty(B, n_splits, dtype=torch.float32, device=dev)
    psum = torch.empty_like(pmax)
    plsum = torch.empty_like(pmax) if smooth else pmax
    trk = tr if tr is not None else a_k
    if shapes_only(a_k):  # the row tiles of one split share its rows through L2: one read of them
        reads = [span(a_k), gathered(w, rows, 0, n_cls * K)] + rows_of(rows, 0, n_cls * K) + rows_of(inv, 0, n_cls * K)
        reads += [span(t) for t in (tcol, tval)] + ([span(tr)] if tr is not None else [])
        outs = [span(t) for t in {id(t): t for t in (pmax, psum, plsum)}.values()]
        note("lse_forward", reads, outs, flops=2.0 * B * n_cls * K * D)
    autotune.launch(
        autotune.lse_forward(K, tr is not None, _precision(cfg), normalize), lambda meta: (triton.cdiv(B, meta["BM"]), n_splits),
        a_k, w, rows if rows is not None else tcol, inv if inv is not None else pmax, trk, tcol, tval,
        pmax, psum, plsum,
        B, D, n_cls, K, per_split, a_k.stride(0), w.stride(0), trk.stride(0), n_splits,
        float(cfg.margin.scale), float(cfg.filter_threshold or 0.0),
        autotune.bucket(n_cls), autotune.bucket(B),
        HAS_ROWS=rows is not None, NORM_W=normalize, FILTER=tr is not None, SMOOTH=smooth,
        **_dtypes(cfg),
    )
    return pmax, psum, plsum


def shard_backward(
    a: Tensor,
    w: Tensor,
    local_labels: Tensor,
    norms: Optional[Tensor],
    stats: FusedShardStats,
    global_max: Tensor,
    global_sum: Tensor,
    coef: Tensor,
    cfg: ShardConfig,
    grad_w_out: Optional[Tensor] = None,
    target_rows: Optional[Tensor] = None,
    feature_norms: bool = False,
    rows: Optional[Tensor] = None,
    update: Optional[chunks.RowUpdate] = None,
    next_operand: Optional[chunks.NextOperand] = None,
    grad_sq: Optional[Tensor] = None,
) -> Tuple[Tensor, Optional[Tensor], Optional[Tensor]]:
    """The counterpart of :func:`shardfc.head.kernels.shard_backward` (same arguments and results:
    ``grad_a``, the weight gradient unless added into ``grad_w_out``, ``grad_norm``), for both
    ``impl="triton"`` and ``impl="gemm"``: cuBLAS GEMMs over class chunks with Triton epilogues
    (:mod:`.chunks`). ``update``: the optimizer's step, applied to ``w``'s scored rows in place
    as their gradient is formed; the weight gradient is then never stored (None is returned).
    ``next_operand``: with ``update``, every row scored and the step's operand, the update writes
    the next step's operand over this one's and keeps it there (:class:`.chunks.NextOperand`).
    ``grad_sq`` (fp32 ``[1]``, no ``update``): set to the sum of squares of the weight-gradient
    rows stored, summed by the pass that stores them (:func:`.chunks.backward`)."""
    a_in = a
    a, w, n_cls, K = _common(a, w, cfg, rows)
    if update is not None and w.data_ptr() != update.param.data_ptr():
        raise ValueError("a fused update needs the shard's weight itself (contiguous rows), not a copy of it")
    B, D, dev, sd = a.shape[0], a.shape[1], a.device, cfg.stats_dtype
    eps, C = cfg.label_smoothing, cfg.num_classes
    accumulate = grad_w_out is not None and update is None
    if update is not None:
        grad_w = None
    else:
        grad_w = grad_w_out if accumulate else torch.empty((n_cls * K, D), dtype=w.dtype, device=dev)
    coef = coef.to(torch.float32).contiguous()
    row_max = global_max.to(torch.float32).contiguous()
    inv_sum = global_sum.to(torch.float32).reciprocal().contiguous()
    normalize = cfg.margin.normalize_weights
    write_next = (next_operand is not None and update is not None and rows is None and stats.operand is not None
                  and (stats.inv is not None) == normalize)
    if next_operand is not None and not write_next:
        next_operand.clear()  # what it holds no longer matches the weight this backward updates
    if n_cls > 0:
        with _on(dev):
            grad_a = chunks.backward(
                a, w, rows.contiguous() if rows is not None else None, stats.inv,
                target_rows.to(torch.float32).contiguous() if target_rows is not None else None,
                stats.tcol, stats.target.float().contiguous(), stats.tsub, stats.target_draw.float(),
                stats.on_shard, row_max, inv_sum, coef, grad_w, n_cls=n_cls, K=K,
                scale=float(cfg.margin.scale), threshold=float(cfg.filter_threshold or 0.0),
                eps_over_c=eps / C, one_minus_eps=1.0 - eps, normalize=cfg.margin.normalize_weights,
                accumulate=accumulate, scatter=accumulate and rows is not None, a_exact=a_in,
                operand=stats.operand, update=update, next_operand=write_next, grad_sq=grad_sq,
                chunk_scale=cfg.chunk_scale,
            )
        if update is not None:
            # An in-place update, as torch's optimizers' and the row-sparse SGD kernel's are: the
            # version counter says so, so what is keyed on it sees the new weights — the kept operand
            # (keyed below, after the bump), the head's step bookkeeping, a captured step's check
            # for changes from outside (which bumps it after each replay in the same way).
            torch.autograd.graph.increment_version(update.param)
        if write_next:
            next_operand.keep(w, stats.operand, stats.inv, cfg.compute_dtype, normalize, target_rows is not None or normalize)
    else:
        grad_a = torch.zeros(B, D, dtype=torch.float32, device=dev)
        if grad_w is not None and not accumulate:
            grad_w.zero_()
        if grad_sq is not None:  # no rows written (what is stored was there before)
            grad_sq.zero_()
    # The target's dL/dz, for the norm's gradient (SphereFace, AdaFace, MagFace).
    on = stats.on_shard
    p_t = torch.exp(stats.target - global_max) * coef / global_sum
    dz_t = torch.where(on, p_t - coef * (eps / C + 1.0 - eps), torch.zeros_like(p_t))
    grad_a = grad_a.to(sd)
    grad_norm = target_norm_gradients(a_in, norms, on, dz_t, stats.target_dnorm, coef.to(sd), cfg, feature_norms, grad_a)
    return grad_a.to(a_in.dtype), (None if accumulate or update is not None else grad_w), grad_norm


def _on(dev: torch.device):
    """Triton launches on the current CUDA device: make it the tensors' (devices mode)."""
    return torch.cuda.device(dev) if dev.type == "cuda" else contextlib.nullcontext()
