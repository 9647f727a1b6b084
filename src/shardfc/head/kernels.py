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
sampled rows' (compact, or added at those rows into an existing ``.grad``). The backward turns
that buffer (or recomputed chunks) into
``dL/dz = coef · (softmax − (1−ε)·onehot − ε/C)`` in place and multiplies it back through the
margin and the weight normalisation.

With sub-centres (``cfg.subcenters = K``) a class is ``K`` consecutive rows and its logit the max over
them: the ``[B, K·classes]`` products of a chunk are reduced to ``[B, classes]`` at once, and the
backward scatters each class's gradient to its arg-max row. Under Partial FC ``rows`` then holds the
sampled classes' centre rows, ``K`` per class, and every walk moves in whole classes. With inter-class filtering the classes
too close to a sample's target centre get a −inf logit, i.e. no softmax mass and no gradient.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Tuple

import torch
from torch import Tensor

from shardfc.head.margins import Margin
from shardfc.head.normalize import NORM_EPS

_log = logging.getLogger(__name__)

#: Rows per block when the weight gradient is formed: bounds its transient to WGRAD_BLOCK × D.
WGRAD_BLOCK = 8192
#: Partial FC without a chunk size walks the sampled rows this many at a time, so that only one
#: block of them is ever gathered (copied) out of the weight.
SAMPLED_BLOCK = WGRAD_BLOCK


def _columns(w: Tensor, rows: Optional[Tensor]) -> int:
    """How many centre rows the shard scores: every row of ``w``, or the sampled ``rows``."""
    return w.shape[0] if rows is None else rows.numel()


def _step(n: int, rows: Optional[Tensor], cfg: "ShardConfig") -> int:
    """Classes per chunk: the chunk size, or all ``n`` (sampled: SAMPLED_BLOCK rows' worth of whole
    classes, so a gathered block never splits a class's sub-centres)."""
    if cfg.chunk_size:
        return cfg.chunk_size
    if rows is None:
        return max(n, 1)
    return max(min(n, SAMPLED_BLOCK // cfg.subcenters), 1)


def _centres(w: Tensor, rows: Optional[Tensor], start: int, stop: int) -> Tensor:
    """Centre rows ``[start, stop)`` of the shard's scored columns: a view of ``w``, or the gathered
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
    #: Sub-center ArcFace: each class owns this many consecutive weight rows (class-major); its
    #: logit is the max over them. ``chunk_size`` counts classes, not rows.
    subcenters: int = 1
    #: Inter-class filtering: a negative class whose cosine to the sample's target centre exceeds
    #: this is left out of the softmax (its logit is −inf). None: off.
    filter_threshold: Optional[float] = None
    #: Which implementation computes the shard's statistics and gradients: ``"torch"`` (this
    #: module) or ``"triton"`` (:mod:`shardfc.head.fused`); resolved by the head from its ``impl``.
    impl: str = "torch"
    #: The GPU paths' chunk size as a multiple of the L2-sized one
    #: (:data:`shardfc.head.fused.chunks.CHUNK_SCALES`; None: their default); the torch path has
    #: ``chunk_size``.
    chunk_scale: Optional[int] = None


@dataclass
class ShardStats:
    row_max: Tensor
    sum_exp: Tensor
    target: Tensor
    logit_sum: Optional[Tensor]
    # Saved for the backward:
    target_draw: Tensor  # ∂z_t/∂raw_t where the target is on this shard, else 0
    target_dnorm: Optional[Tensor]  # ∂z_t/∂‖a‖ (SphereFace)
    # (start, stop, exp(z − m_chunk), m_chunk, arg-max centre per class or None); None when chunked
    buffers: Optional[List[Tuple[int, int, Tensor, Tensor, Optional[Tensor]]]]


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


#: Which device's :func:`mm_f32` a meta tensor replays (``shardfc plan``): ``"cuda"`` (one GEMM
#: with an fp32 output) for the GPU paths, ``"cpu"`` (fp32 copies of the operands) for the torch
#: path's plan, which predicts the CPU step.
MM_F32_META = "cuda"


#: Per ``(operator, device type)``: whether torch takes ``out_dtype=torch.float32`` with 16-bit
#: operands there (one cuBLAS GEMM with an fp32 output); None until the first call tries it. A
#: RuntimeError or TypeError there (a torch build without the overload) falls back to the plain
#: fp32 products, chosen once for the process and logged once.
OUT_DTYPE_WORKS: Dict[Tuple[str, str], Optional[bool]] = {}


def _gemm_device(a: Tensor) -> str:
    """Whose GEMMs :func:`mm_f32` and :func:`addmm_f32` run for ``a``: ``"cuda"``, ``"cpu"``, or for a
    meta tensor :data:`MM_F32_META`."""
    return MM_F32_META if a.device.type == "meta" else a.device.type


def _with_out_dtype(op: str, device: str, fast: Callable[[], Tensor], slow: Callable[[], Tensor]) -> Tensor:
    """``fast()`` (the ``out_dtype`` GEMM) while it works on ``device`` (the operands' device type:
    a meta replay learns nothing about CUDA), else ``slow()`` (see
    :data:`OUT_DTYPE_WORKS`). A failure is raised by torch's dispatch before any output is written."""
    key = (op, device)
    works = OUT_DTYPE_WORKS.get(key)
    if works is False:
        return slow()
    if works:
        return fast()
    try:
        out = fast()
    except (RuntimeError, TypeError) as e:
        OUT_DTYPE_WORKS[key] = False
        why = str(e).splitlines()[0] if str(e) else type(e).__name__
        if device == "meta":  # the plan's replay: nothing runs slower, a stand-in is counted
            _log.info("torch.%s(..., out_dtype=torch.float32) is not available on meta (%s): the plan's replay "
                      "counts a stand-in for it", op, why)
        else:
            _log.warning("torch.%s(..., out_dtype=torch.float32) is not available on %s (%s): the fp32 products "
                         "are made from fp32 copies of the operands instead (slower, same accuracy)", op, device, why)
        return slow()
    OUT_DTYPE_WORKS[key] = True
    return out


def mm_f32(a: Tensor, b: Tensor) -> Tensor:
    """``a @ b`` with fp32 accumulation and an fp32 result: cuBLAS's ``out_dtype`` on CUDA for
    bf16/fp16 operands (no rounding of the output to 16 bits), else the same products in fp32."""
    if a.dtype == torch.float32:
        return a @ b
    device = _gemm_device(a)
    if device == "cuda":
        return _with_out_dtype("mm", a.device.type, lambda: torch.mm(a, b, out_dtype=torch.float32),
                               lambda: a.float() @ b.float())
    return a.float() @ b.float()


def addmm_f32(c: Tensor, a: Tensor, b: Tensor) -> Tensor:
    """``c += a @ b`` in place, ``c`` fp32, with fp32 accumulation: one GEMM whose epilogue adds into
    ``c`` (cuBLAS's ``beta = 1``) where torch has it for 16-bit operands, instead of a GEMM into a
    new ``[M, N]`` tensor and an add that reads both again."""
    if a.dtype == torch.float32:
        return c.addmm_(a, b)
    device = _gemm_device(a)
    if device == "cuda":
        slow = (lambda: _meta_gemm_into(c, a, b)) if a.device.type == "meta" else (lambda: c.add_(mm_f32(a, b)))
        return _with_out_dtype("addmm", a.device.type, lambda: torch.addmm(c, a, b, out_dtype=torch.float32, out=c),
                               slow)
    return c.add_(mm_f32(a, b))


def _meta_gemm_into(c: Tensor, a: Tensor, b: Tensor) -> Tensor:
    """The meta replay's stand-in for CUDA's ``addmm(out_dtype=float32, out=c)`` where torch's meta
    path refuses it (torch 2.11 sends it to the plain addmm decomposition, which takes ``out_dtype``
    for ``beta``; ``mm``'s own ``out_dtype`` works there): one GEMM with an fp32 output written into
    ``c``, as the plan must count it — no ``[M, N]`` product and no add, which CUDA does not run
    either. A meta tensor holds no values, so nothing is lost by not adding."""
    try:
        return torch.mm(a, b, out_dtype=torch.float32, out=c)
    except (RuntimeError, TypeError):  # no out_dtype on meta at all: the products in fp32, then the add
        return c.add_(mm_f32(a, b))


def fp16_operand_scale(g: Tensor) -> Tensor:
    """A power of two (a 0-d tensor, no host sync) that puts ``max |g|`` in ``[2^13, 2^14)``, so
    ``g`` times it keeps its small entries normal in fp16 (1 for an all-zero ``g``)."""
    amax = g.abs().amax().float()
    exp = torch.floor(torch.log2(torch.where(amax > 0, amax, torch.ones_like(amax))))
    return torch.exp2(13.0 - exp)


def _raw_products(a_s: Tensor, centres: Tensor, cfg: ShardConfig) -> Tensor:
    return (a_s @ centres.to(cfg.compute_dtype).t()).to(cfg.stats_dtype)


def _scaled_embeddings(a: Tensor, cfg: ShardConfig) -> Tensor:
    """``s·a`` in the matmul dtype: the margin's scale rides on the small ``[B, D]`` operand
    instead of costing a pass over ``[B, n]`` logits (forward) and gradients (backward)."""
    s = cfg.margin.scale
    return (a * s if s != 1.0 else a).to(cfg.compute_dtype)


def _targets_in(cols: Tensor, start: int, stop: int) -> Tuple[Tensor, Tensor]:
    """Which samples' target class is in the chunk ``[start, stop)`` (bool ``[B]``) and each sample's
    column in the chunk (``[B, 1]``; an arbitrary valid column where it is not): masks over the
    whole batch, never ``nonzero``, so nothing is read back to the host."""
    sel = (cols >= start) & (cols < stop)
    return sel, (cols - start).clamp(0, stop - start - 1).unsqueeze(1)


def _put_targets(z: Tensor, sel: Tensor, at: Tensor, values: Tensor) -> None:
    """``z[i, at[i]] = values[i]`` where ``sel[i]``; the other rows keep their entry."""
    z.scatter_(1, at, torch.where(sel, values.to(z.dtype), z.gather(1, at).squeeze(1)).unsqueeze(1))


def _class_logits(a_s: Tensor, w_c: Tensor, inv: Optional[Tensor], cfg: ShardConfig) -> Tuple[Tensor, Optional[Tensor]]:
    """``[B, classes]`` logits of a chunk of centre rows, and with sub-centres the arg-max centre of
    each class (uint8; its logit is the class logit, and the class gradient goes to it alone)."""
    z = _raw_products(a_s, w_c, cfg)
    if inv is not None:
        z.mul_(inv.unsqueeze(0))  # s·a·ŵ_j: the non-target logits
    K = cfg.subcenters
    if K == 1:
        return z, None
    z, arg = z.view(z.shape[0], -1, K).max(dim=2)
    return z, arg.to(torch.uint8)


def _filtered_classes(target_rows: Tensor, w_c: Tensor, cfg: ShardConfig) -> Tensor:
    """``[B, classes]``: True where the class's cosine to the sample's target centre (the unit rows
    ``target_rows``; zero for samples without a target here) exceeds the filter threshold. The best
    sub-centre counts. Computed in the stats dtype: the mask must be the same forward and backward."""
    sd = cfg.stats_dtype
    norm = torch.linalg.vector_norm(w_c, dim=1, dtype=sd)
    inv = torch.where(norm >= NORM_EPS, norm.clamp(min=NORM_EPS).reciprocal(), torch.zeros_like(norm))
    cos = (target_rows @ w_c.to(sd).t()).mul_(inv.unsqueeze(0))
    if cfg.subcenters > 1:
        cos = cos.view(cos.shape[0], -1, cfg.subcenters).amax(dim=2)
    return cos > cfg.filter_threshold


def _finite_or_zero(m: Tensor) -> Tensor:
    """A row max to subtract: −inf (a chunk whose classes were all filtered out) becomes 0."""
    return torch.where(torch.isfinite(m), m, torch.zeros_like(m))


def shard_forward(
    a: Tensor,
    w: Tensor,
    local_labels: Tensor,
    norms: Optional[Tensor],
    cfg: ShardConfig,
    target_rows: Optional[Tensor] = None,
    rows: Optional[Tensor] = None,
) -> ShardStats:
    """Partial statistics of one shard. ``local_labels[i]`` is the label's class column or −1: its
    class in ``w``, or with ``rows`` (Partial FC: the centre rows of the sampled classes, ``K`` per
    class, class-major, scored in that order) its class index in ``rows``. Without a chunk size the
    sampled rows are still gathered SAMPLED_BLOCK rows at a time. ``target_rows``: the unit target
    centres ``[B, D]`` for inter-class filtering."""
    K = cfg.subcenters
    B, n = a.shape[0], _columns(w, rows) // K
    sd, dev = cfg.stats_dtype, a.device
    margin = cfg.margin
    row_max = torch.full((B,), float("-inf"), dtype=sd, device=dev)
    sum_exp = torch.zeros(B, dtype=sd, device=dev)
    target = torch.zeros(B, dtype=sd, device=dev)
    logit_sum = torch.zeros(B, dtype=sd, device=dev) if cfg.label_smoothing > 0 else None
    target_draw = torch.zeros(B, dtype=sd, device=dev)
    target_dnorm = torch.zeros(B, dtype=sd, device=dev) if margin.needs_norm else None
    buffers: Optional[list] = None if cfg.chunk_size else []

    a_s = _scaled_embeddings(a, cfg)
    step = _step(n, rows, cfg)
    for start in range(0, n, step):
        stop = min(start + step, n)
        w_c = _centres(w, rows, start * K, stop * K)
        z, arg = _class_logits(a_s, w_c, _inverse_norms(w_c, cfg), cfg)
        sel, at = _targets_in(local_labels, start, stop)
        # The margin on every sample's candidate column, kept where it is the target (masks: no sync).
        raw_t = z.gather(1, at).squeeze(1) / margin.scale
        value, d_raw, d_norm = margin.target(raw_t, norms)
        _put_targets(z, sel, at, value)
        target = torch.where(sel, value.to(sd), target)
        target_draw = torch.where(sel, d_raw.to(sd), target_draw)
        if target_dnorm is not None and d_norm is not None:
            target_dnorm = torch.where(sel, d_norm.to(sd), target_dnorm)
        if target_rows is not None:
            drop = _filtered_classes(target_rows, w_c, cfg)
            drop.scatter_(1, at, drop.gather(1, at) & ~sel.unsqueeze(1))  # the target itself always stays
            z.masked_fill_(drop, float("-inf"))
        if logit_sum is not None:
            logit_sum += z.sum(dim=1)
        new_max = torch.maximum(row_max, z.amax(dim=1))
        shift = _finite_or_zero(new_max)
        z.sub_(shift.unsqueeze(1)).exp_()  # the softmax numerator, in place
        sum_exp = sum_exp * torch.exp(row_max - shift) + z.sum(dim=1)
        row_max = new_max
        if buffers is not None:
            buffers.append((start, stop, z, shift, arg))
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
    target_rows: Optional[Tensor] = None,
    feature_norms: bool = False,
    rows: Optional[Tensor] = None,
) -> Tuple[Tensor, Optional[Tensor], Optional[Tensor]]:
    """Gradients of ``Σ_i coef_i · loss_i`` with respect to ``a``, this shard's ``w`` and, with
    ``feature_norms`` (``norms`` are then the embeddings' norms before normalisation, an input of
    their own), ``norms``.

    ``global_max``/``global_sum`` are the combined statistics over all shards; no communication.
    With ``grad_w_out`` (an existing ``[n, D]`` ``.grad``) the weight gradient is added into it
    block by block (at ``rows`` under Partial FC) and None is returned for it: the step then
    allocates nothing of size ``[n, D]``. Otherwise it is returned: ``[n, D]``, or with ``rows``
    the compact ``[len(rows), D]`` gradient of the sampled rows only, in ``rows`` order.
    """
    K = cfg.subcenters
    n = _columns(w, rows) // K
    margin, eps, C = cfg.margin, cfg.label_smoothing, cfg.num_classes
    on_shard = local_labels >= 0
    a_s = _scaled_embeddings(a, cfg)
    grad_a = torch.zeros(a.shape, dtype=cfg.stats_dtype, device=a.device)
    step = _step(n, rows, cfg)
    accumulate = grad_w_out is not None
    scatter = accumulate and rows is not None  # add sampled rows' blocks into the dense .grad
    if accumulate:
        grad_w = grad_w_out
    else:
        grad_w = torch.empty((n * K,) + tuple(w.shape[1:]), dtype=w.dtype, device=w.device)
    coef_over_sum = coef / global_sum
    smooth = (coef * (eps / C)).unsqueeze(1) if eps > 0 else None
    # dL/dz_t for the targets on this shard (0 for the other samples), from the saved target logits alone.
    p_t = torch.exp(stats.target - global_max) * coef_over_sum
    dz_t = torch.where(on_shard, p_t - coef * (eps / C + 1.0 - eps), torch.zeros_like(p_t))

    for k, start in enumerate(range(0, n, step)):
        stop = min(start + step, n)
        w_c = _centres(w, rows, start * K, stop * K)
        inv = _inverse_norms(w_c, cfg)
        sel, at = _targets_in(local_labels, start, stop)
        if stats.buffers is not None:
            _, _, z, chunk_max, arg = stats.buffers[k]  # exp(z − chunk_max): rescale to coef·softmax
            z.mul_((torch.exp(chunk_max - global_max) * coef_over_sum).unsqueeze(1))
        else:
            z, arg = _class_logits(a_s, w_c, inv, cfg)
            _put_targets(z, sel, at, stats.target)
            if target_rows is not None:
                drop = _filtered_classes(target_rows, w_c, cfg)
                drop.scatter_(1, at, drop.gather(1, at) & ~sel.unsqueeze(1))
                z.masked_fill_(drop, float("-inf"))
            z.sub_(global_max.unsqueeze(1)).exp_().mul_(coef_over_sum.unsqueeze(1))
        if smooth is not None:
            z.sub_(smooth)
        # z is now dL/dz. Through the margin, dL/draw is s·dz off target and (∂z_t/∂raw)·dz_t on
        # target; the factor s is applied to the matmul operands/results, so targets get ÷s here.
        _put_targets(z, sel, at, dz_t * stats.target_draw / margin.scale)
        if arg is not None:  # a class's gradient goes to its arg-max centre; the others get none
            full = torch.zeros(z.shape[0], z.shape[1], K, dtype=z.dtype, device=z.device)
            z = full.scatter_(2, arg.long().unsqueeze(2), z.unsqueeze(2)).view(z.shape[0], -1)
        if inv is not None:
            z.mul_(inv.unsqueeze(0))  # dL/d(a·w_j) = inv_j · dL/d(a·ŵ_j)
        unscale = None
        if cfg.compute_dtype == torch.float16:
            # coef·softmax at a million classes (≈ 1e-10) is below fp16's normal range and would
            # flush to zero in the operand: scale the chunk by a power of two that puts its largest
            # entry near 2^14 (exact), multiply with fp32 results, and undo the scale after.
            g_scale = fp16_operand_scale(z)
            g, unscale = (z * g_scale).to(torch.float16), g_scale.reciprocal()
            grad_a.add_(mm_f32(g, w_c.to(torch.float16)).to(cfg.stats_dtype) * unscale, alpha=margin.scale)
        else:
            g = z.to(cfg.compute_dtype)
            grad_a.add_((g @ w_c.to(cfg.compute_dtype)).to(cfg.stats_dtype), alpha=margin.scale)
        r0, r1 = start * K, stop * K
        for b0 in range(0, r1 - r0, WGRAD_BLOCK):
            b1 = min(b0 + WGRAD_BLOCK, r1 - r0)
            # h_j = inv_j·dL/dŵ_j (a_s = s·a carries the scale). Through the normalisation:
            # dL/dw_j = inv_j·(G_j − ŵ_j(ŵ_j·G_j)) = h_j − inv_j²·w_j·(w_j·h_j).
            out = None if scatter else grad_w[r0 + b0 : r0 + b1]
            g_t = g[:, b0:b1].t()
            if unscale is not None:
                h = (mm_f32(g_t, a_s) * unscale).to(w.dtype)
            elif not accumulate and g_t.dtype == a_s.dtype == out.dtype:
                h = torch.mm(g_t, a_s, out=out)  # straight into the gradient, no copy
            else:
                h = (g_t @ a_s).to(w.dtype)
            if inv is not None:
                wb = w_c[b0:b1]
                dot = torch.bmm(h.unsqueeze(1), wb.unsqueeze(2)).view(-1).to(inv.dtype)
                h.addcmul_(wb, (dot * inv[b0:b1].square()).to(h.dtype).unsqueeze(1), value=-1.0)
            if scatter:
                grad_w.index_add_(0, rows[r0 + b0 : r0 + b1], h)
            elif accumulate:
                out.add_(h)
            elif h is not out:
                out.copy_(h)
        del z, g
    if stats.buffers is not None:
        stats.buffers.clear()
    grad_norm = target_norm_gradients(a, norms, on_shard, dz_t, stats.target_dnorm, coef, cfg, feature_norms, grad_a)
    return grad_a.to(a.dtype), (None if accumulate else grad_w), grad_norm


def target_norm_gradients(
    a: Tensor,
    norms: Optional[Tensor],
    on_shard: Tensor,
    dz_t: Tensor,
    target_dnorm: Optional[Tensor],
    coef: Tensor,
    cfg: ShardConfig,
    feature_norms: bool,
    grad_a: Tensor,
) -> Optional[Tensor]:
    """The part of a shard's gradient that flows through the embedding norm of its targets.

    ``dz_t`` ``[B]`` is ``dL/dz_t`` where the label is on this shard (``on_shard``), 0 elsewhere.
    With ``feature_norms`` (AdaFace, MagFace: ``norms`` are the norms before normalisation, an input
    of their own) returns their gradient: the target logit's, plus MagFace's regulariser, counted
    once, by the label's owner. Otherwise, for a margin whose target reads ``‖a‖`` (SphereFace),
    adds ``dz_t·∂z_t/∂‖a‖·a/‖a‖`` into ``grad_a`` and returns None. Masks, not indices: no host sync.
    """
    margin = cfg.margin
    zero = torch.zeros_like(dz_t)
    if feature_norms:
        grad_norm = torch.where(on_shard, dz_t * target_dnorm, zero)
        reg = margin.regularizer(norms)
        if reg is not None:
            grad_norm = grad_norm + torch.where(on_shard, coef * reg[1], zero)
        return grad_norm
    if target_dnorm is not None:
        coeff = torch.where(on_shard, dz_t * target_dnorm / norms.clamp(min=NORM_EPS), zero)
        grad_a.add_(coeff.unsqueeze(1) * a.to(cfg.stats_dtype))
    return None
