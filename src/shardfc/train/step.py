"""One optimizer step: micro-batches forward and backward, fp16 overflow agreement, clipping, both optimizers."""

from __future__ import annotations

import contextlib
from typing import Iterator, List, Optional, Tuple

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from shardfc.parallel.context import DistContext
from shardfc.train.builder.pipeline_train import PipelinePlan, clip_stage_grads_
from shardfc.train.builder.strategy import is_horovod_optimizer
from shardfc.train.config import TrainConfig
from shardfc.train.observe.phases import OFF, PhaseClock
from shardfc.train.observe.profile import count_horovod_gradients
from shardfc.train.state import Parts, RunState


def train_step(
    parts: Parts, stream: Iterator, state: RunState, cfg: TrainConfig, ctx: DistContext, autocast,
    clock: PhaseClock = OFF, frozen: bool = False,
) -> Tuple[torch.Tensor, List[Tuple[str, str]]]:
    """One optimizer step over ``grad_accum`` micro-batches; returns (mean loss, (name, reason) of the
    corrupt images skipped). ``clock``: where the step's time goes (:mod:`~shardfc.train.observe.phases`).
    ``frozen``: the backbone runs without autograd (head-only warm-up), so it gets no gradient and its
    optimizer moves nothing."""
    # set_to_none=True is torch's default; Horovod's DistributedOptimizer.zero_grad() takes no argument.
    parts.opt_backbone.zero_grad()
    # The head's gradient buffer is kept: its backward then adds into it in place, block by block,
    # instead of allocating a fresh [n_local, D] gradient every step.
    parts.opt_head.zero_grad(set_to_none=False)
    clock.lap("optimizer")
    loss_sum = torch.zeros((), device=ctx.device)
    corrupt: List[Tuple[str, str]] = []
    for micro in range(cfg.grad_accum):
        images, labels, skipped = next(stream)
        images = images.to(ctx.device, non_blocking=True)
        labels = labels.to(ctx.device, non_blocking=True)
        corrupt += skipped
        clock.lap("loader wait")
        # DDP all-reduces the backbone gradients on the last micro-batch only (Horovod's optimizer
        # counts grad_accum backward passes itself).
        last = micro == cfg.grad_accum - 1
        sync = contextlib.nullcontext() if last or not isinstance(parts.backbone, DDP) else parts.backbone.no_sync()
        with sync:
            with autocast():
                # Both losses are already means over the global micro-batch.
                loss = micro_batch_loss(parts, images, labels, cfg.triplet_weight, clock, frozen) / cfg.grad_accum
            parts.scaler.scale(loss).backward()
        clock.lap("backward")
        loss_sum += loss.detach().float()
        state.samples_seen += images.shape[0] * ctx.world_size
    apply_gradients(parts, cfg.grad_clip, ctx, frozen=frozen, head_grad_clip=cfg.head_grad_clip)
    clock.lap("optimizer")
    return loss_sum, corrupt


def head_loss(parts: Parts, embeddings: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """The head's loss of ``embeddings``: its captured step replayed (``cuda_graph='head'``: the
    update applied already, the backward hands the embeddings their gradient), or its forward."""
    if parts.head_step is not None:
        return parts.head_step.loss(embeddings, labels)
    return parts.head(embeddings, labels)


def micro_batch_loss(
    parts: Parts, images: torch.Tensor, labels: torch.Tensor, triplet_weight: float, clock: PhaseClock = OFF,
    frozen: bool = False,
) -> torch.Tensor:
    """The head's classification loss of the embeddings, plus the weighted triplet loss of the
    features before the neck when the run has one (the re-ID strong baseline).

    ``clock`` laps the backbone's forward, then the losses' forward; their backward is lapped when
    the gradient reaches the embeddings (the rest of the backward is the backbone's). ``frozen``: the
    backbone's forward without autograd, the head's loss alone (the triplet would train nothing)."""
    if frozen:
        with torch.no_grad():
            embeddings = parts.backbone(images)
        clock.lap("forward")
        loss = head_loss(parts, embeddings, labels)
        clock.lap("head")
        return loss
    if parts.triplet is None:
        embeddings = parts.backbone(images)
        clock.lap("forward")
        clock.lap_on_backward(embeddings, "head")
        loss = head_loss(parts, embeddings, labels)
    else:
        features, embeddings = parts.backbone(images, with_features=True)
        clock.lap("forward")
        clock.lap_on_backward(embeddings, "head")
        loss = head_loss(parts, embeddings, labels) + triplet_weight * parts.triplet(features, labels)
    clock.lap("head")
    return loss


def apply_gradients(parts: Parts, grad_clip: float, ctx: DistContext, pipeline: Optional[PipelinePlan] = None,
                    frozen: bool = False, head_grad_clip: float = 0.0) -> None:
    """Average (Horovod), unscale (fp16), clip, and step both optimizers and their schedules: the end of a step.

    ``grad_clip`` clips the backbone's gradient norm (0: not), ``head_grad_clip`` the head's global
    norm over its shards (0, the default: not; arcface_torch clips the backbone only, and the
    head's gradient is the step's largest tensor).
    ``pipeline``: this rank holds one stage (and the head only on the last stage), so the backbone's
    gradient norm is summed over the stages and the head's over the last stage's ranks.
    ``frozen``: a head-only warm-up step; the backbone optimizer does not step (Horovod's would
    all-reduce zero gradients and let weight decay move the frozen weights).
    """
    horovod = is_horovod_optimizer(parts.opt_backbone)
    if horovod and not frozen:
        # The averaged backbone gradients now, before the overflow check and the clipping read them;
        # the optimizer's step must then not synchronise again.
        parts.opt_backbone.synchronize()
        count_horovod_gradients(parts.opt_backbone)
    if parts.scaler.is_enabled():
        _agree_on_overflow(parts, ctx)
    # One scaler for both optimizers: unscale both before clipping, step both, update once.
    parts.scaler.unscale_(parts.opt_backbone)
    if parts.opt_head is not None:
        parts.scaler.unscale_(parts.opt_head)
    if grad_clip > 0:
        params = [p for p in parts.backbone.parameters() if p.grad is not None]
        if pipeline is None:
            torch.nn.utils.clip_grad_norm_(params, grad_clip)
        else:
            clip_stage_grads_(params, grad_clip, pipeline)
    head_scale = None
    if head_grad_clip > 0 and parts.head is not None:
        head_ctx = ctx if pipeline is None else pipeline.layout.replica_ctx
        # A loss scaler sets grad_scale on torch's fused optimizers itself: then the clip's own mul_.
        in_step = parts.opt_head is not None and not parts.scaler.is_enabled() and scales_in_step(parts.opt_head)
        _, coef = head_clip_factor(parts.head, head_grad_clip, head_ctx)
        if in_step:
            head_scale = coef.reciprocal()
        else:
            scale_head_grad_(parts.head, coef)
    if not frozen:
        with parts.opt_backbone.skip_synchronize() if horovod else contextlib.nullcontext():
            parts.scaler.step(parts.opt_backbone)
    if parts.opt_head is not None:
        with grads_divided_by(parts.opt_head, head_scale):
            parts.scaler.step(parts.opt_head)
    parts.scaler.update()
    for s in parts.schedulers:
        s.step()


def head_grads(head: nn.Module) -> list:
    """The tensors holding the head's gradient: its ``.grad``s and, with ``sparse_grad``, the
    sampled rows' compact gradients (merged over the micro-batches, changed in place by clipping)."""
    grads = [p.grad for p in head.parameters() if p.grad is not None]
    return grads + list(getattr(head, "row_grad_values", lambda: [])())


def clip_head_grad_(head: nn.Module, max_norm: float, ctx: DistContext) -> torch.Tensor:
    """Clip the head's gradient by its norm over *all* shards, in place; returns that global norm
    (:func:`head_clip_factor`, then :func:`scale_head_grad_`)."""
    total, coef = head_clip_factor(head, max_norm, ctx)
    scale_head_grad_(head, coef)
    return total


def head_clip_factor(head: nn.Module, max_norm: float, ctx: DistContext) -> Tuple[torch.Tensor, torch.Tensor]:
    """``(global norm, factor)`` of the head's gradient: the norm over *all* shards and
    ``min(1, max_norm / norm)``, the same on every rank (no host sync).

    Each rank holds different rows, so its norm is only a part: the squared norms are summed over
    the group. A rank's part comes from the weight-gradient pass itself when the head measured it
    (:meth:`~shardfc.head.module.ShardedMarginHead.take_weight_grad_sq_norm`: the GPU
    implementations, one backward since the last step), else from one reduction over the stored
    gradient."""
    take = getattr(head, "take_weight_grad_sq_norm", None)
    measured = take() if take is not None else None
    if measured is not None:
        sq = measured.to(ctx.device, torch.float32).reshape(())
    else:
        sq = torch.zeros((), device=ctx.device, dtype=torch.float32)
        for g in head_grads(head):  # the shards may sit on several devices (dp)
            # One reduction pass in fp32, no temporary: g.float().pow(2) made a copy of the whole
            # gradient (2 GB at 1M classes, D = 512), measured on an H200 as the trainer step's extra peak.
            # (fp64 gradients reduce in fp64: vector_norm refuses to narrow)
            acc = torch.promote_types(g.dtype, torch.float32)
            sq += torch.linalg.vector_norm(g.detach(), dtype=acc).square().to(sq.device, torch.float32)
    ctx.all_reduce_(sq)
    total = sq.sqrt()
    return total, (max_norm / (total + 1e-6)).clamp(max=1.0)


def scale_head_grad_(head: nn.Module, coef: torch.Tensor) -> None:
    """Multiply the head's stored gradient by ``coef`` in place (one pass over it)."""
    for g in head_grads(head):
        g.mul_(coef.to(g.device, g.dtype))


def scales_in_step(optimizer: torch.optim.Optimizer) -> bool:
    """Whether ``optimizer.step()`` divides the gradients it reads by a ``grad_scale`` attribute:
    torch's fused SGD / AdamW (``fused=True``) and shardfc's row-sparse optimizers. Clipping then
    costs no pass of its own over the gradient (:func:`grads_divided_by`)."""
    return bool(getattr(optimizer, "accepts_grad_scale", False) or getattr(optimizer, "_step_supports_amp_scaling", False))


@contextlib.contextmanager
def grads_divided_by(optimizer: torch.optim.Optimizer, scale: Optional[torch.Tensor]):
    """While open, ``optimizer.step()`` divides every gradient by ``scale`` (a tensor; None: nothing
    changes) as it reads it: the ``grad_scale`` attribute torch's fused optimizers read (as a loss
    scaler sets it), removed on the way out."""
    if scale is None:
        yield
        return
    if not scales_in_step(optimizer):
        raise TypeError(f"{type(optimizer).__name__} does not read a grad_scale in its step")
    optimizer.grad_scale = scale.reshape(())
    try:
        yield
    finally:
        del optimizer.grad_scale


def _agree_on_overflow(parts: Parts, ctx: DistContext) -> None:
    """Make every rank's fp16 loss scaler see an overflow if any rank's gradients hold inf/NaN.

    Backbone gradients are equal on all ranks (DDP, Horovod after synchronize()), but head shards differ, so one rank may
    overflow alone; the scaler would then skip the step on that rank only and the scales would
    drift apart. After this, every optimizer on every rank holds a non-finite gradient or none does.
    """
    groups = [
        [p.grad for p in parts.backbone.parameters() if p.grad is not None and p.grad.numel()],
        [g for g in (head_grads(parts.head) if parts.head is not None else ()) if g.numel()],
    ]
    # [backbone overflowed, head overflowed, any rank overflowed]; one host sync for all of it.
    flags = torch.zeros(3, device=ctx.device)
    for i, grads in enumerate(groups):
        if grads:
            flags[i] = torch.stack([(~torch.isfinite(g).all()).to(flags.device) for g in grads]).any().float()
    flags[2] = flags[:2].max()
    ctx.all_reduce_(flags[2:], op="max")
    bad_backbone, bad_head, bad_anywhere = flags.tolist()
    if bad_anywhere:
        for grads, bad in zip(groups, (bad_backbone, bad_head)):
            if grads and not bad:
                grads[0].view(-1)[0] = float("inf")
