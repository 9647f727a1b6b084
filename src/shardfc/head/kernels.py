"""The loss math on one class shard, with no communication.

A shard holds classes ``[start, stop)`` as rows of ``w``. For a batch of embeddings ``a`` it
computes, per sample, the partial softmax statistics that the shards later combine:

* ``row_max``  m_s = max_j z_j over the shard (−inf for a shard with no classes);
* ``sum_exp``  Σ_j exp(z_j − m_s);
* ``target``   z_t if the sample's label is on this shard, else 0;
* ``logit_sum`` Σ_j z_j (needed only for label smoothing).

It walks the classes ``chunk`` rows at a time with an online softmax (a running max rescales the
running sum), so with a chunk size the activation memory is ``O(B · chunk)``; with no chunk size
the one ``[B, n]`` buffer holding ``exp(z − m_s)`` is kept for the backward (the softmax formed in
place, never a one-hot). Under Partial FC the shard scores the sampled ``rows`` of ``w`` only, gathered
a chunk (without a chunk size, ``SAMPLED_BLOCK`` rows) at a time, and the weight gradient is the
sampled rows' (compact, or added at those rows into an existing ``.grad``). The backward turns that buffer (or recomputed chunks) into
``dL/dz = coef · (softmax − (1−ε)·onehot − ε/C)`` in place and multiplies it back through the
margin and the weight normalisation.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional, Tuple

import torch
from torch import Tensor

from shardfc.head.margins import Margin
from shardfc.head.normalize import NORM_EPS

#: Rows per block when the weight gradient is formed: bounds its transient to WGRAD_BLOCK × D.
WGRAD_BLOCK = 8192
#: Partial FC without a chunk size walks the sampled rows this many at a time, so that only one
#: block of them is ever gathered (copied) out of the weight.
SAMPLED_BLOCK = WGRAD_BLOCK


def _columns(w: Tensor, rows: Optional[Tensor]) -> int:
    """How many classes the shard scores: every row of ``w``, or the sampled ``rows``."""
    return w.shape[0] if rows is None else rows.numel()


def _step(n: int, rows: Optional[Tensor], cfg: "ShardConfig") -> int:
    if cfg.chunk_size:
        return cfg.chunk_size
    return max(min(n, SAMPLED_BLOCK), 1) if rows is not None else max(n, 1)


def _centres(w: Tensor, rows: Optional[Tensor], start: int, stop: int) -> Tensor:
    """Classes ``[start, stop)`` of the shard's scored columns: a view of ``w``, or the gathered
    sampled rows (the only copy of them the step makes, one chunk at a time)."""
    return w[start:stop] if rows is None else w.index_select(0, rows[start:stop])

@dataclass(frozen=True)
class ShardConfig:
    """Constants of one loss evaluation, shared by every shard."""

    margin: Margin
    num_classes: int
    label_smoothing: float
    chunk_size: Optional[int]
    compute_dtype: torch.dtype  # the matmuls (bf16/fp16 under autocast)
    stats_dtype: torch.dtype  # logits, softmax statistics, loss (fp32, or fp64 for fp64 inputs)


@dataclass
class ShardStats:
    row_max: Tensor
    sum_exp: Tensor
    target: Tensor
    logit_sum: Optional[Tensor]
    # Saved for the backward:
    target_draw: Tensor  # ∂z_t/∂raw_t where the target is on this shard, else 0
    target_dnorm: Optional[Tensor]  # ∂z_t/∂‖a‖ (SphereFace)
    buffers: Optional[List[Tuple[int, int, Tensor, Tensor]]]  # (start, stop, exp(z − m_chunk), m_chunk)


def _inverse_norms(w: Tensor, cfg: ShardConfig) -> Optional[Tensor]:
    """``1/‖w_j‖`` per class row (stats dtype; 0 for rows below ``NORM_EPS``, which are treated as
    zero vectors), or None when the margin does not normalise centres.

    The normalised centres are never materialised (an ``[n, D]`` copy, twice a step):
    ``a · ŵ_j = inv_j · (a · w_j)``, so normalisation is a column scale of the ``[B, K]`` logits in
    the forward and of ``dL/dz`` in the backward, inside passes that happen anyway or one more.
    """
    if not cfg.margin.normalize_weights:
        return None
    sd = cfg.stats_dtype
    if w.dtype == sd or w.device.type != "cpu":
        norm = torch.linalg.vector_norm(w, dim=1, dtype=sd)
    else:  # on the CPU, dtype= first casts all of w ([K, D]): bound that copy to WGRAD_BLOCK rows
        norm = torch.empty(w.shape[0], dtype=sd, device=w.device)
        for b0 in range(0, w.shape[0], WGRAD_BLOCK):
            rows = slice(b0, b0 + WGRAD_BLOCK)
            torch.linalg.vector_norm(w[rows], dim=1, dtype=sd, out=norm[rows])
    return torch.where(norm >= NORM_EPS, norm.clamp(min=NORM_EPS).reciprocal(), torch.zeros_like(norm))


def _raw_products(a_s: Tensor, centres: Tensor, cfg: ShardConfig) -> Tensor:
    return (a_s @ centres.to(cfg.compute_dtype).t()).to(cfg.stats_dtype)


def _scaled_embeddings(a: Tensor, cfg: ShardConfig) -> Tensor:
    """``s·a`` in the matmul dtype: the margin's scale rides on the small ``[B, D]`` operand
    instead of costing a pass over ``[B, n]`` logits (forward) and gradients (backward)."""
    s = cfg.margin.scale
    return (a * s if s != 1.0 else a).to(cfg.compute_dtype)


def _targets_in(rows_t: Tensor, cols_t: Tensor, start: int, stop: int) -> Tuple[Tensor, Tensor]:
    sel = (cols_t >= start) & (cols_t < stop)
    return rows_t[sel], cols_t[sel] - start


def shard_forward(
    a: Tensor, w: Tensor, local_labels: Tensor, norms: Optional[Tensor], cfg: ShardConfig,
    rows: Optional[Tensor] = None,
) -> ShardStats:
    """Partial statistics of one shard. ``local_labels[i]`` is the label's column or −1: its row in
    ``w``, or with ``rows`` (Partial FC: the sampled rows of ``w``, scored in that order) its index
    in ``rows``. Without a chunk size the sampled rows are still gathered SAMPLED_BLOCK at a time."""
    B, n = a.shape[0], _columns(w, rows)
    sd, dev = cfg.stats_dtype, a.device
    margin = cfg.margin
    row_max = torch.full((B,), float("-inf"), dtype=sd, device=dev)
    sum_exp = torch.zeros(B, dtype=sd, device=dev)
    target = torch.zeros(B, dtype=sd, device=dev)
    logit_sum = torch.zeros(B, dtype=sd, device=dev) if cfg.label_smoothing > 0 else None
    target_draw = torch.zeros(B, dtype=sd, device=dev)
    target_dnorm = torch.zeros(B, dtype=sd, device=dev) if margin.needs_norm else None
    buffers: Optional[list] = None if cfg.chunk_size else []

    rows_t = torch.nonzero(local_labels >= 0).squeeze(1)
    cols_t = local_labels[rows_t]
    a_s = _scaled_embeddings(a, cfg)
    step = _step(n, rows, cfg)
    for start in range(0, n, step):
        stop = min(start + step, n)
        w_c = _centres(w, rows, start, stop)
        inv = _inverse_norms(w_c, cfg)
        z = _raw_products(a_s, w_c, cfg)
        if inv is not None:
            z.mul_(inv.unsqueeze(0))  # s·a·ŵ_j: the non-target logits
        r, c = _targets_in(rows_t, cols_t, start, stop)
        raw_t = z[r, c] / margin.scale
        if r.numel():
            value, d_raw, d_norm = margin.target(raw_t, norms[r] if norms is not None else None)
            z[r, c] = value
            target[r] = value
            target_draw[r] = d_raw
            if target_dnorm is not None:
                target_dnorm[r] = d_norm
        if logit_sum is not None:
            logit_sum += z.sum(dim=1)
        new_max = torch.maximum(row_max, z.amax(dim=1))
        z.sub_(new_max.unsqueeze(1)).exp_()  # the softmax numerator, in place
        sum_exp = sum_exp * torch.exp(row_max - new_max) + z.sum(dim=1)
        row_max = new_max
        if buffers is not None:
            buffers.append((start, stop, z, new_max))
    return ShardStats(row_max, sum_exp, target, logit_sum, target_draw, target_dnorm, buffers)


def shard_backward(
    a: Tensor,
    w: Tensor,
    local_labels: Tensor,
    norms: Optional[Tensor],
    stats: ShardStats,
    global_max: Tensor,
    global_sum: Tensor,
    coef: Tensor,
    cfg: ShardConfig,
    grad_w_out: Optional[Tensor] = None,
    rows: Optional[Tensor] = None,
) -> Tuple[Tensor, Optional[Tensor]]:
    """Gradients of ``Σ_i coef_i · loss_i`` with respect to ``a`` and this shard's ``w``.

    ``global_max``/``global_sum`` are the combined statistics over all shards; no communication.
    With ``grad_w_out`` (an existing ``[n, D]`` ``.grad``) the weight gradient is added into it
    block by block (at ``rows`` under Partial FC) and None is returned for it: the step then
    allocates nothing of size ``[n, D]``. Otherwise it is returned: ``[n, D]``, or with ``rows``
    the compact ``[len(rows), D]`` gradient of the sampled rows only, in ``rows`` order.
    """
    n = _columns(w, rows)
    margin, eps, C = cfg.margin, cfg.label_smoothing, cfg.num_classes
    rows_t = torch.nonzero(local_labels >= 0).squeeze(1)
    cols_t = local_labels[rows_t]
    a_s = _scaled_embeddings(a, cfg)
    grad_a = torch.zeros(a.shape, dtype=cfg.stats_dtype, device=a.device)
    step = _step(n, rows, cfg)
    accumulate = grad_w_out is not None
    scatter = accumulate and rows is not None  # add sampled rows' blocks into the dense .grad
    if accumulate:
        grad_w = grad_w_out
    else:
        grad_w = torch.empty((n,) + tuple(w.shape[1:]), dtype=w.dtype, device=w.device)
    coef_over_sum = coef / global_sum
    smooth = (coef * (eps / C)).unsqueeze(1) if eps > 0 else None
    # dL/dz_t for the targets on this shard, from the saved target logits alone.
    p_t = torch.exp(stats.target[rows_t] - global_max[rows_t]) * coef_over_sum[rows_t]
    dz_t = p_t - coef[rows_t] * (eps / C + 1.0 - eps)

    for k, start in enumerate(range(0, n, step)):
        stop = min(start + step, n)
        w_c = _centres(w, rows, start, stop)
        inv = _inverse_norms(w_c, cfg)
        r, c = _targets_in(rows_t, cols_t, start, stop)
        sel = (cols_t >= start) & (cols_t < stop)
        if stats.buffers is not None:
            _, _, z, chunk_max = stats.buffers[k]  # exp(z − chunk_max): rescale to coef·softmax
            z.mul_((torch.exp(chunk_max - global_max) * coef_over_sum).unsqueeze(1))
        else:
            z = _raw_products(a_s, w_c, cfg)
            if inv is not None:
                z.mul_(inv.unsqueeze(0))
            z[r, c] = stats.target[r]
            z.sub_(global_max.unsqueeze(1)).exp_().mul_(coef_over_sum.unsqueeze(1))
        if smooth is not None:
            z.sub_(smooth)
        # z is now dL/dz. Through the margin, dL/draw is s·dz off target and (∂z_t/∂raw)·dz_t on
        # target; the factor s is applied to the matmul operands/results, so targets get ÷s here.
        z[r, c] = dz_t[sel] * stats.target_draw[r] / margin.scale
        if inv is not None:
            z.mul_(inv.unsqueeze(0))  # dL/d(a·w_j) = inv_j · dL/d(a·ŵ_j)
        g = z.to(cfg.compute_dtype)
        grad_a.add_((g @ w_c.to(cfg.compute_dtype)).to(cfg.stats_dtype), alpha=margin.scale)
        for b0 in range(0, stop - start, WGRAD_BLOCK):
            b1 = min(b0 + WGRAD_BLOCK, stop - start)
            # h_j = inv_j·dL/dŵ_j (a_s = s·a carries the scale). Through the normalisation:
            # dL/dw_j = inv_j·(G_j − ŵ_j(ŵ_j·G_j)) = h_j − inv_j²·w_j·(w_j·h_j).
            out = None if scatter else grad_w[start + b0 : start + b1]
            g_t = g[:, b0:b1].t()
            if not accumulate and g_t.dtype == a_s.dtype == out.dtype:
                h = torch.mm(g_t, a_s, out=out)  # straight into the gradient, no copy
            else:
                h = (g_t @ a_s).to(w.dtype)
            if inv is not None:
                wb = w_c[b0:b1]
                dot = torch.bmm(h.unsqueeze(1), wb.unsqueeze(2)).view(-1).to(inv.dtype)
                h.addcmul_(wb, (dot * inv[b0:b1].square()).to(h.dtype).unsqueeze(1), value=-1.0)
            if scatter:
                grad_w.index_add_(0, rows[start + b0 : start + b1], h)
            elif accumulate:
                out.add_(h)
            elif h is not out:
                out.copy_(h)
        del z, g
    if stats.buffers is not None:
        stats.buffers.clear()
    if stats.target_dnorm is not None and rows_t.numel():
        # SphereFace: the target logit also depends on ‖a‖; ∂‖a‖/∂a = a/‖a‖.
        coeff = dz_t * stats.target_dnorm[rows_t] / norms[rows_t].clamp(min=NORM_EPS)
        grad_a[rows_t] += coeff.unsqueeze(1) * a[rows_t].to(cfg.stats_dtype)
    return grad_a.to(a.dtype), (None if accumulate else grad_w)
