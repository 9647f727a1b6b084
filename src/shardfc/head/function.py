"""The sharded softmax cross-entropy: per-shard statistics combined across devices and ranks.

One autograd function covers every layout. It gets the *global* batch (embeddings already
gathered over the process group, copied to each local shard's device) and the local shards'
weights; it returns the per-sample losses of the whole global batch, the same on every rank.

Forward, per sample (``s`` runs over every shard of every rank)::

    M = max_s m_s                      one all-reduce MAX of [B]
    S = Σ_s Σ_j exp(z_sj − M)          ┐ one all-reduce SUM of [2, B] ([3, B] with smoothing)
    T = z_target,  Z = Σ_j z_j         ┘
    loss = log S + M − (1 − ε)·T − (ε / C)·Z

Backward: the upstream gradients of the per-sample losses are summed over ranks (one all-reduce of
[B]) so every shard sees the whole objective; each shard then forms its ``dL/dz`` locally. The
weight gradient stays on its shard; the embedding gradient goes back through the caller's gather.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any, Callable, List, Optional, Sequence

import torch
from torch import Tensor

from shardfc.head.kernels import ShardConfig, shard_backward, shard_forward
from shardfc.head.normalize import NORM_EPS
from shardfc.parallel.comm import Communicator


@dataclass
class ShardedLossPlan:
    """What the autograd function needs beyond tensors."""

    config: ShardConfig
    num_shards: int  # local shards (devices) in this process
    distributed: bool  # shards on the ranks of ``comm``'s group (else: this process only)
    comm: Optional[Communicator]  # the collectives over those ranks (torch.distributed or Horovod)
    world_size: int  # ranks in the group (1 when not distributed)
    #: Add weight gradients straight into an existing ``.grad`` of a leaf weight (no ``[n, D]``
    #: transient); autograd then sees no gradient for that weight.
    weight_grad_in_place: bool = True
    #: Partial FC: per shard, the sampled rows of its weight the loss scores (None: every row); with
    #: sub-centres the sampled classes' centre rows, K per class, class-major. The weights stay
    #: whole; the kernels gather the sampled rows one chunk at a time.
    rows: Optional[List[Optional[Tensor]]] = None
    #: Row-sparse weight gradients: called as ``sink(shard index, compact gradient)`` with the
    #: ``[len(rows), D]`` gradient of a sampled shard, which autograd then never sees.
    row_grad_sink: Optional[Callable[[int, Tensor], None]] = None
    #: The optimizer's step fused into the backward (the fused impls only): called once per shard
    #: when the backward starts, ``row_update(shard index)`` returns the step to apply to its
    #: scored rows as their gradient is formed (:class:`shardfc.head.fused.chunks.RowUpdate`; the
    #: weight then gets no gradient at all), or None for an ordinary gradient.
    row_update: Optional[Callable[[int], Optional[object]]] = None
    #: The fused impls only: per shard, the operand the last step's fused update wrote for this
    #: one (:class:`shardfc.head.fused.chunks.NextOperand`), which the forward reuses while it
    #: stands for the weight and the backward's fused update rewrites.
    next_operands: Optional[List[Any]] = None
    #: The fused impls only, with a stored gradient: called as ``sink(shard index, squared norm)``
    #: with the sum of squares (fp32 ``[1]``) of the weight-gradient rows the backward stored for
    #: that shard, summed by the weight-gradient pass itself (the head's clipping norm).
    grad_sq_sink: Optional[Callable[[int, Tensor], None]] = None

    def rows_of(self, shard: int) -> Optional[Tensor]:
        return None if self.rows is None else self.rows[shard]


def shard_kernels(cfg: ShardConfig):
    """``(shard_forward, shard_backward)`` of the implementation the plan resolved: the torch
    reference (:mod:`shardfc.head.kernels`) or the fused Triton kernels (:mod:`shardfc.head.fused`),
    (``impl="triton"`` or ``"gemm"``), which take and return the same things."""
    if cfg.impl in ("triton", "gemm"):
        from shardfc.head.fused import shard as fused  # imports Triton: only when chosen

        return fused.shard_forward, fused.shard_backward
    return shard_forward, shard_backward


def local_labels_for_range(labels: Tensor, r: range) -> Tensor:
    """Row of each label within the shard holding classes ``r``, or −1 (not there / ignored)."""
    inside = (labels >= r.start) & (labels < r.stop)
    return torch.where(inside, labels - r.start, torch.full_like(labels, -1))


def _autocast_off(device_type: str):
    """Autocast disabled on ``device_type``. The ``meta`` device (where ``shardfc plan`` replays the
    step) has no autocast, and torch raises when asked about it."""
    return contextlib.nullcontext() if device_type == "meta" else torch.autocast(device_type, enabled=False)


def _existing_grad(w: Tensor) -> Optional[Tensor]:
    """``w.grad`` when the weight gradient can be added into it in place."""
    g = w.grad if (w.is_leaf and w.requires_grad) else None
    if g is None or g.shape != w.shape or g.dtype != w.dtype or g.device != w.device or g.is_sparse:
        return None
    return g


class _ShardedSoftmaxCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx, plan: ShardedLossPlan, valid: Tensor, local_labels: List[Tensor], feature_norms: Optional[Tensor],
        *tensors: Tensor,
    ) -> Tensor:
        n_shards = plan.num_shards
        embeds, weights = tensors[:n_shards], tensors[n_shards:]
        cfg = plan.config
        home = valid.device
        sd = cfg.stats_dtype
        with _autocast_off(home.type):
            target_rows = None
            if cfg.filter_threshold is not None:
                target_rows = gather_target_centres(plan, embeds, weights, local_labels, home)
            forward_shard = shard_kernels(cfg)[0]
            norms, stats, targets_on = [], [], []
            for i, (a, w, lab) in enumerate(zip(embeds, weights, local_labels)):
                if feature_norms is not None:
                    norm = feature_norms.to(a.device, sd)
                else:
                    norm = torch.linalg.vector_norm(a.to(sd), dim=1) if cfg.margin.needs_norm else None
                norms.append(norm)
                targets = None if target_rows is None else target_rows.to(a.device)
                targets_on.append(targets)
                extra = {} if targets is None else {"target_rows": targets}
                if plan.next_operands is not None and cfg.impl in ("triton", "gemm"):
                    extra["next_operand"] = plan.next_operands[i]
                with _autocast_off(a.device.type):
                    stats.append(forward_shard(a, w, lab, norm, cfg, rows=plan.rows_of(i), **extra))

            row_max = torch.stack([s.row_max.to(home) for s in stats]).amax(dim=0)
            if plan.distributed:
                plan.comm.all_reduce_(row_max, "max")
            parts = []
            for s in stats:
                rescale = torch.exp(s.row_max.to(home) - row_max)
                fields = [s.sum_exp.to(home) * rescale, s.target.to(home)]
                if s.logit_sum is not None:
                    fields.append(s.logit_sum.to(home))
                parts.append(torch.stack(fields))
            combined = torch.stack(parts).sum(dim=0)
            if plan.distributed:
                plan.comm.all_reduce_(combined, "sum")
            sum_exp, target = combined[0], combined[1]
            eps = cfg.label_smoothing
            loss = torch.log(sum_exp) + row_max - (1.0 - eps) * target
            if eps > 0:
                loss = loss - (eps / cfg.num_classes) * combined[2]
            if feature_norms is not None:
                reg = cfg.margin.regularizer(feature_norms.to(home, sd))
                if reg is not None:  # MagFace's per-sample norm regulariser
                    loss = loss + reg[0]
            loss = torch.where(valid, loss, torch.zeros_like(loss))

        ctx.plan = plan
        ctx.stats, ctx.local_labels, ctx.norms, ctx.target_rows = stats, local_labels, norms, targets_on
        ctx.feature_norms = feature_norms is not None
        ctx.norm_dtype = None if feature_norms is None else feature_norms.dtype
        ctx.save_for_backward(valid, row_max, sum_exp, *tensors)
        return loss

    @staticmethod
    def backward(ctx, grad_loss: Tensor):
        plan: ShardedLossPlan = ctx.plan
        if ctx.stats is None:
            raise RuntimeError(
                "the sharded head's backward ran twice for one forward; its softmax buffer is "
                "consumed in place (run the forward again instead of retain_graph=True)"
            )
        n_shards = plan.num_shards
        # Claimed before the saved tensors are unpacked: a second backward into an update already
        # applied (gradient accumulation) gets the optimizer's own error, not autograd's.
        updates = [plan.row_update(i) if plan.row_update is not None else None for i in range(n_shards)]
        valid, row_max, sum_exp, *tensors = ctx.saved_tensors
        embeds, weights = tensors[:n_shards], tensors[n_shards:]
        cfg = plan.config
        # The objective is the average over ranks of what each rank back-propagates.
        coef = grad_loss.to(cfg.stats_dtype).contiguous()
        if plan.distributed:
            # Summed in a copy: ``grad_loss`` may be the caller's own tensor (``losses.backward(g)``).
            coef = coef.clone()
            plan.comm.all_reduce_(coef, "sum")
            coef = coef / plan.world_size
        coef = torch.where(valid, coef, torch.zeros_like(coef))
        backward_shard = shard_kernels(cfg)[1]
        grads_a: List[Tensor] = []
        grads_w: List[Tensor] = []
        grad_norms = None
        zipped = zip(embeds, weights, ctx.local_labels, ctx.norms, ctx.stats, ctx.target_rows)
        for i, (a, w, lab, norm, stats, targets) in enumerate(zipped):
            dev = a.device
            rows = plan.rows_of(i)
            sparse = rows is not None and plan.row_grad_sink is not None
            out = _existing_grad(w) if plan.weight_grad_in_place and not sparse else None
            extra = {} if updates[i] is None else {"update": updates[i]}
            if plan.next_operands is not None and cfg.impl in ("triton", "gemm"):
                extra["next_operand"] = plan.next_operands[i]
            grad_sq = None
            if plan.grad_sq_sink is not None and updates[i] is None and cfg.impl in ("triton", "gemm"):
                extra["grad_sq"] = grad_sq = torch.zeros(1, dtype=torch.float32, device=dev)
            with _autocast_off(dev.type):
                ga, gw, gn = backward_shard(
                    a, w, lab, norm, stats, row_max.to(dev), sum_exp.to(dev), coef.to(dev), cfg, out,
                    target_rows=targets, feature_norms=ctx.feature_norms, rows=rows, **extra,
                )
            if gw is not None and rows is not None:
                if sparse:
                    plan.row_grad_sink(i, gw)
                    gw = None
                else:  # no .grad to add into: autograd gets the dense gradient it expects
                    gw = torch.zeros_like(w).index_add_(0, rows, gw)
            if grad_sq is not None:
                plan.grad_sq_sink(i, grad_sq)
            grads_a.append(ga)
            grads_w.append(gw)
            if gn is not None:
                gn = gn.to(valid.device)
                grad_norms = gn if grad_norms is None else grad_norms + gn
        if grad_norms is not None:
            grad_norms = grad_norms.to(ctx.norm_dtype)
        ctx.stats = ctx.local_labels = ctx.norms = ctx.target_rows = None
        return (None, None, None, grad_norms, *grads_a, *grads_w)


def gather_target_centres(
    plan: ShardedLossPlan, embeds: Sequence[Tensor], weights: Sequence[Tensor], local_labels: Sequence[Tensor], home
) -> Tensor:
    """Each sample's unit target centre ``[B, D]`` (stats dtype; zero for ignored samples), on every
    shard: the label's owner fills its rows, and one all-reduce of ``[B, D]`` (the others hold zeros)
    hands them to every rank. With sub-centres the centre is the one closest to the sample."""
    cfg = plan.config
    sd, K = cfg.stats_dtype, cfg.subcenters
    B, D = embeds[0].shape[0], weights[0].shape[1]
    total = torch.zeros(B, D, dtype=sd, device=home)
    for i, (a, w, lab) in enumerate(zip(embeds, weights, local_labels)):
        if w.shape[0] == 0:  # a shard without classes holds no target
            continue
        # Every sample's candidate centres (class 0's for a sample whose label is elsewhere), kept
        # where the label is here: a mask, not nonzero, so nothing is read back to the host.
        here = lab >= 0
        ids = (lab.clamp(min=0).unsqueeze(1) * K + torch.arange(K, device=lab.device)).view(-1)
        sampled = plan.rows_of(i)
        if sampled is not None:  # Partial FC: labels index the sampled classes, whose rows these are
            ids = sampled[ids]
        centres = w[ids].to(sd).view(-1, K, D)
        unit = centres / torch.linalg.vector_norm(centres, dim=2, keepdim=True).clamp(min=NORM_EPS)
        if K > 1:
            # The class logit's own measure: a·ŵ (or a·w for a margin that keeps centres raw).
            pick = unit if cfg.margin.normalize_weights else centres
            best = (pick @ a.to(sd).unsqueeze(2)).squeeze(2).argmax(dim=1)
            unit = unit[torch.arange(B, device=unit.device), best]
        else:
            unit = unit.view(-1, D)
        total.add_(torch.where(here.unsqueeze(1), unit, torch.zeros_like(unit)).to(home))
    if plan.distributed:
        plan.comm.all_reduce_(total, "sum")
    return total


def sharded_cross_entropy(
    plan: ShardedLossPlan,
    valid: Tensor,
    local_labels: Sequence[Tensor],
    embeds: Sequence[Tensor],
    weights: Sequence[Tensor],
    feature_norms: Optional[Tensor] = None,
) -> Tensor:
    """Per-sample losses ``[B]`` of the global batch (0 where ``valid`` is False).

    ``embeds[i]`` is the global batch's (normalised, if the margin says so) embeddings on the
    device of ``weights[i]``; ``local_labels[i]`` the row of each sample's label in ``weights[i]``
    or −1; ``valid`` marks the samples that are not ``ignore_index``. ``feature_norms`` ``[B]``:
    the embeddings' norms before normalisation, for margins with ``uses_feature_norm`` (AdaFace,
    MagFace); gradients flow back to them.
    """
    n = plan.num_shards
    if not (len(embeds) == len(weights) == len(local_labels) == n):
        raise ValueError(
            f"need one embedding copy, one label map and one weight per shard: {n} shards, "
            f"{len(embeds)} embeddings, {len(local_labels)} label maps, {len(weights)} weights"
        )
    return _ShardedSoftmaxCrossEntropy.apply(plan, valid, list(local_labels), feature_norms, *embeds, *weights)


def stats_dtype_for(*tensors: Tensor) -> torch.dtype:
    """fp64 statistics when any input is fp64 (verification), else fp32."""
    return torch.float64 if any(t.dtype == torch.float64 for t in tensors) else torch.float32


#: The compute dtype of a step on the ``meta`` device, which has no autocast: set by ``shardfc plan
#: --compute-dtype`` to replay a step under autocast (None: the inputs' promoted dtype).
META_COMPUTE_DTYPE: Optional[torch.dtype] = None


def compute_dtype_for(device: torch.device, *tensors: Tensor) -> torch.dtype:
    """The autocast dtype when autocast is on for ``device``, else the inputs' promoted dtype."""
    if device.type == "meta" and META_COMPUTE_DTYPE is not None:
        return META_COMPUTE_DTYPE
    if device.type != "meta" and torch.is_autocast_enabled(device.type):
        return torch.get_autocast_dtype(device.type)
    dtype = tensors[0].dtype
    for t in tensors[1:]:
        dtype = torch.promote_types(dtype, t.dtype)
    return dtype


__all__ = [
    "ShardedLossPlan",
    "local_labels_for_range",
    "sharded_cross_entropy",
    "stats_dtype_for",
    "compute_dtype_for",
]
