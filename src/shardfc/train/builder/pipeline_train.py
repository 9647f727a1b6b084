"""``--strategy pipeline`` in the trainer: cut a stage, schedule it, step it, evaluate through it, save it per stage.

The parts are built by the one builder of every strategy (:func:`shardfc.train.builder.factory.build_model`);
what is the pipeline's own is applied from here. Each rank cuts only its stage
(:func:`cut_stage`, :func:`shardfc.parallel.stage_build.build_stage`): the backbone is built on
the meta device, and the stage's modules get real storage with exactly the values the whole
backbone's seeded initialisation gives them (the same as every other strategy), so a rank never
holds more than its stage. The shapes crossing the stages are passed along the pipeline. The
backbone optimizer covers the stage's parameters only; the head (and its optimizer) exists on the
last stage's ranks, sharded over them (:func:`stage_head_placement`); :func:`pipeline_plan` builds the
stage's schedule around the built parts.

No rank ever holds the whole backbone, not even to save or evaluate it. A checkpoint is saved per
stage (:mod:`shardfc.checkpoint.stages`): each stage's replica 0 writes its state-dict entries and
optimizer state under the unsplit model's names (the other replicas' digests are compared with
it), in one atomic save over the world with the head shards; a resume, under any strategy and any
stage count, reads only the stage files holding its keys. Evaluation runs on world rank 0 with a
module whose forward passes the batch through replica 0's stages, forward only and micro-batched
(:mod:`shardfc.parallel.pipeline_forward`).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Tuple

import torch
from torch import nn

from shardfc import checkpoint as ckpt
from shardfc.checkpoint import StagePart, optimizer_by_index, optimizer_by_name, read_stage_state
from shardfc.models import build_backbone
from shardfc.parallel.context import DistContext
from shardfc.parallel.model_split import available_split_points, batch_stats_module
from shardfc.parallel.model_split import stages as cut_stages
from shardfc.parallel.pipeline import (
    ActivationSpec,
    PipelineLayout,
    PipelineRunner,
    average_gradients_,
    balanced_split_points,
    chained_activation_specs,
    create_layout,
    gather_object_to,
    replicas_for,
)
from shardfc.parallel.stage_build import build_stage
from shardfc.train.config import ConfigError, TrainConfig
from shardfc.train.state import Parts

logger = logging.getLogger("shardfc.train")

__all__ = [
    "STAGE_LABELS",
    "PipelinePlan",
    "StageCut",
    "check_pipeline_config",
    "clip_stage_grads_",
    "cut_stage",
    "evaluate_through_pipeline",
    "keep_boundaries_contiguous",
    "load_stage_state",
    "pipeline_layout",
    "pipeline_plan",
    "pipeline_step",
    "restore_backbone",
    "stage_head_placement",
    "stage_part",
    "stage_scaler_state",
    "stage_stream",
    "whole_optimizer_by_name",
]


def check_pipeline_config(cfg: TrainConfig, world_size: int) -> int:
    """The number of split points of ``cfg.backbone``, after refusing a layout it cannot have
    (ConfigError naming the values); cheap: the backbone is built on the meta device."""
    with torch.device("meta"):
        probe = build_backbone(cfg.backbone, cfg.embedding_dim, **cfg.backbone_params((32, 32)))
    n_points = len(available_split_points(probe, blocks=True))  # cuts between blocks count too
    try:
        replicas_for(world_size, cfg.pipeline_stages, n_points)
        if cfg.split_points:
            cut_stages(probe, list(cfg.split_points))
    except ValueError as e:
        raise ConfigError(f"strategy='pipeline' on {world_size} rank(s) with backbone={cfg.backbone!r}: {e}") from None
    found = batch_stats_module(probe) if cfg.micro_batches > 1 and not cfg.micro_batch_stats else None
    if found is not None:
        raise ConfigError(
            f"backbone={cfg.backbone!r} has BatchNorm ({found[0]!r}), which in training normalises each of the "
            f"micro_batches={cfg.micro_batches} micro-batches with its own statistics, unlike an unpipelined step of "
            "batch_size rows: pass --micro-batch-stats to accept that (the semantics of --grad-accum over "
            "micro-batches), or --micro-batches 1 --pipeline-schedule gpipe"
        )
    return n_points


def pipeline_layout(cfg: TrainConfig, ctx: DistContext) -> PipelineLayout:
    """The run's ``stages x replicas`` layout and groups (collective over the world, once)."""
    return create_layout(ctx, cfg.pipeline_stages, check_pipeline_config(cfg, ctx.world_size))


@dataclass
class PipelinePlan:
    """What a pipeline rank knows beyond its :class:`Parts`: its place, schedule and the whole model's layout."""

    layout: PipelineLayout
    runner: PipelineRunner
    split_points: Tuple[str, ...]
    state_keys: Tuple[str, ...]
    """The whole backbone's state-dict keys, in order."""
    param_names: Tuple[str, ...]
    """The whole backbone's trainable parameters, in order: the optimizer's parameter indices."""
    stage_param_names: Tuple[str, ...]
    """This stage's trainable parameters, in its optimizer's order."""
    losses: List[torch.Tensor]
    """Loss values recorded by the last stage's loss function during a step (unscaled)."""
    specs: Tuple[ActivationSpec, ...]
    """Every stage's input and the last output (shapes per row, dtypes): what crosses the stages."""


@dataclass
class StageCut:
    """This rank's stage of the backbone, cut by :func:`cut_stage`, and what it knows of the whole."""

    module: nn.Module
    """The stage's modules (on the run's device), the only real part of the backbone on this rank."""
    split_points: Tuple[str, ...]
    state_keys: Tuple[str, ...]
    param_names: Tuple[str, ...]
    stage_param_names: Tuple[str, ...]
    specs: Tuple[ActivationSpec, ...]


def cut_stage(
    cfg: TrainConfig, ctx: DistContext, layout: PipelineLayout, new_backbone: Callable[[], nn.Module],
    image_size: Tuple[int, int], autocast,
) -> StageCut:
    """This rank's stage of ``new_backbone()`` (the builder's backbone, every option of ``cfg`` in it),
    built alone at the cuts ``cfg.split_points`` (else balanced), on ``ctx.device``, and the activation
    specs of every stage (collective over the replica's pipeline group, under ``autocast``)."""
    def points_of(model: nn.Module) -> List[str]:
        return list(cfg.split_points) or balanced_split_points(model, layout.stages)

    try:
        built = build_stage(new_backbone, layout.stage, points_of)
    except ValueError as e:
        raise ConfigError(f"split_points: {e}") from None
    points = built.split_points
    state_keys = tuple(built.model.state_dict().keys())
    param_names = tuple(n for n, p in built.model.named_parameters() if p.requires_grad)
    module = built.stages[layout.stage].to(ctx.device)
    del built  # the other stages were never allocated (or, where the build could not be replayed, are freed)
    specs = chained_activation_specs(module, layout, ((3, *image_size), torch.float32), ctx.device, autocast)
    stage_names = tuple(n for n, p in module.named_parameters() if p.requires_grad)
    return StageCut(module, tuple(points), state_keys, param_names, stage_names, tuple(specs))


def keep_boundaries_contiguous(module: nn.Module) -> None:
    """A channels_last stage (:func:`shardfc.train.builder.factory.use_channels_last`) whose input and output
    stay NCHW: the pipeline's buffers and its checks of what crosses a stage (strides included)
    are contiguous, so the stage converts its input to channels_last itself and hands on a
    contiguous output (a copy each way, as ddp's loader converts its batches)."""
    def to_channels_last(_module, args):
        return tuple(a.contiguous(memory_format=torch.channels_last) if torch.is_tensor(a) and a.dim() == 4 else a
                     for a in args)

    def to_contiguous(_module, _args, output):
        return output.contiguous() if torch.is_tensor(output) else output

    module.register_forward_pre_hook(to_channels_last)
    module.register_forward_hook(to_contiguous)


def stage_head_placement(layout: PipelineLayout) -> Optional[Dict[str, Any]]:
    """Keyword arguments of :class:`~shardfc.ShardedMarginHead` that say where its shards live: over the
    last stage's ranks, where the embeddings appear; None on the other stages (they hold no head)."""
    return {"context": layout.replica_ctx} if layout.is_last else None


def pipeline_plan(cfg: TrainConfig, ctx: DistContext, layout: PipelineLayout, stage: StageCut, parts: Parts) -> PipelinePlan:
    """The stage's schedule around the built ``parts`` (its loss, on the last stage, is ``parts.head``'s
    through ``parts.scaler``) and what a pipeline rank knows of the whole model."""
    losses: List[torch.Tensor] = []
    weight = 1.0 / (cfg.micro_batches * cfg.grad_accum)
    head, scaler = parts.head, parts.scaler

    def loss_fn(embeddings: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        # The head's loss is the mean over the replicas' micro-batch: weighted, the step's mean.
        loss = head(embeddings, labels) * weight
        losses.append(loss.detach().float())
        return scaler.scale(loss)

    runner = PipelineRunner(
        parts.backbone, layout, ctx.device, schedule=cfg.pipeline_schedule, micro_batches=cfg.micro_batches,
        local_batch=cfg.batch_size, specs=(stage.specs[layout.stage], stage.specs[layout.stage + 1]),
        loss_fn=loss_fn if head is not None else None, allow_micro_batch_stats=cfg.micro_batch_stats,
    )
    return PipelinePlan(layout, runner, stage.split_points, stage.state_keys, stage.param_names,
                        stage.stage_param_names, losses, stage.specs)


# ---------------------------------------------------------------------- step


def stage_stream(dataset, batches, state, cfg: TrainConfig, data_ctx: DistContext, layout: PipelineLayout,
                 clock=None):
    """This stage's data: the first stage reads and decodes its replica's batches
    (:func:`shardfc.train.loader.data.micro_batches`); every other stage walks the same batch order
    without loading anything (it gets activations from the pipeline, and the last stage the labels
    from the first), yielding each batch's row count and advancing ``state`` exactly alike.
    ``clock`` (``--profile``'s :class:`~shardfc.train.observe.phases.PhaseClock`): the first stage's loader
    wait and copies are charged to their own phases, not to the pipeline schedule they run inside."""
    from shardfc.train.loader.data import micro_batches
    from shardfc.train.observe.phases import OFF

    if layout.is_first:
        return micro_batches(dataset, batches, state, cfg, data_ctx, clock=clock or OFF)
    return _batch_sizes(batches, state)


def _batch_sizes(batches, state):
    while True:  # micro_batches' epoch bookkeeping, on the sampler's indices alone
        batches.set_epoch(state.epoch, state.batch_in_epoch)
        for batch in batches:
            state.batch_in_epoch += 1
            yield len(batch)
        state.epoch += 1
        state.batch_in_epoch = 0


#: ``count_comm`` kind of the labels the first stage sends to the last
STAGE_LABELS = "pipeline_labels"


def _labels_to_last_stage(layout: PipelineLayout, labels: Optional[torch.Tensor], rows: int, device: torch.device):
    """The first stage's labels of this batch on the last stage (None elsewhere): one point-to-point
    int64 message over the replica's pipeline group, before the schedule's own traffic."""
    import torch.distributed as dist

    from shardfc.parallel.collectives import record_comm_bytes

    last = layout.rank_of(layout.stages - 1, layout.replica)
    if layout.is_first:
        labels = labels.to(device=device, dtype=torch.int64).contiguous()
        record_comm_bytes(STAGE_LABELS, labels.numel() * labels.element_size())
        dist.send(labels, dst=last, group=layout.pipe_group)
        return None
    if layout.is_last:
        out = torch.empty(rows, dtype=torch.int64, device=device)
        dist.recv(out, src=layout.rank_of(0, layout.replica), group=layout.pipe_group)
        return out
    return None


def pipeline_step(parts: Parts, plan: PipelinePlan, stream, state, cfg: TrainConfig, ctx: DistContext, autocast):
    """Forward and backward of ``grad_accum`` local batches through the pipeline, then the data-parallel
    average of the stage's gradients; returns (the step's mean loss on every rank, the corrupt images
    skipped, as ``(name, reason)`` pairs: reported by the first stage only, where the images are used).

    ``stream``: :func:`stage_stream`'s (images, labels, skipped) on the first stage, row counts on the others."""
    layout = plan.layout
    parts.opt_backbone.zero_grad()
    if parts.opt_head is not None:
        parts.opt_head.zero_grad(set_to_none=False)
    plan.losses.clear()
    corrupt: List[Tuple[str, str]] = []
    for _ in range(cfg.grad_accum):
        images = labels = None
        if layout.is_first:  # the only stage that reads images: each is decoded once
            images, labels, skipped = next(stream)
            rows = images.shape[0]
            corrupt += skipped
            images = images.to(ctx.device, non_blocking=True)
        else:
            rows = next(stream)
        if rows != plan.runner.local_batch:  # every stage walks the same batches: all raise, none waits
            raise ValueError(
                f"pipeline: a local batch of {rows} rows, but the schedule was built for local_batch="
                f"{plan.runner.local_batch} (micro-batches have a fixed shape: every step needs the same batch)"
            )
        labels = _labels_to_last_stage(layout, labels, rows, ctx.device)
        with autocast():
            plan.runner.step(images, labels)
        state.samples_seen += rows * layout.replicas
    average_gradients_([p for p in parts.backbone.parameters() if p.requires_grad], layout.replica_ctx)
    return share_loss(plan, ctx), corrupt


def share_loss(plan: PipelinePlan, ctx: DistContext) -> torch.Tensor:
    """The step's loss, known on the last stage, on every rank (one rank contributes: exact)."""
    loss = torch.zeros((), device=ctx.comm_device)
    if plan.layout.is_last and plan.layout.replica == 0:
        loss += torch.stack(plan.losses).sum().to(loss.device)
    ctx.all_reduce_(loss)
    return loss.to(ctx.device)


def clip_stage_grads_(params: Sequence[nn.Parameter], max_norm: float, plan: PipelinePlan) -> torch.Tensor:
    """Clip the backbone's gradient by its norm over *all* stages (each rank holds one stage's part)."""
    grads = [p.grad for p in params if p.grad is not None]
    sq = torch.zeros((), device=plan.layout.pipe_ctx.comm_device, dtype=torch.float32)
    for g in grads:
        sq += g.detach().float().pow(2).sum().to(sq.device)
    plan.layout.pipe_ctx.all_reduce_(sq)
    total = sq.sqrt()
    coef = (max_norm / (total + 1e-6)).clamp(max=1.0)
    for g in grads:
        g.mul_(coef.to(g.device, g.dtype))
    return total


# ---------------------------------------------------------------------- evaluation through the stages


def evaluate_through_pipeline(run, evaluate: Callable[[nn.Module], Dict[str, Any]], autocast) -> Dict[str, Any]:
    """``evaluate(backbone)`` on world rank 0 with a backbone whose forward runs through replica 0's
    stages (:class:`~shardfc.parallel.pipeline_forward.PipelinedForward`, forward only, micro-batched
    as the training), while the other stages of replica 0 serve it; ``{}`` elsewhere. Collective over
    replica 0's pipeline group; the other replicas return at once."""
    from shardfc.parallel.pipeline_forward import PipelinedForward, serve_forward

    plan, device = run.pipeline, run.ctx.device
    layout, micro = plan.layout, plan.runner.micro_batches
    if layout.replica != 0:
        return {}
    if layout.stage != 0:
        serve_forward(run.parts.backbone, layout, plan.specs, device, micro, autocast)
        return {}
    backbone = PipelinedForward(run.parts.backbone, layout, plan.specs, device, micro)
    try:
        return evaluate(backbone)
    finally:  # also after an error here: the other stages must stop waiting
        backbone.close()


# ---------------------------------------------------------------------- checkpoints: per stage


def stage_part(parts: Parts, plan: PipelinePlan) -> StagePart:
    """This rank's share of a per-stage checkpoint: its stage's state-dict entries and optimizer state,
    under the unsplit model's names (written by replica 0, compared by the other replicas)."""
    return StagePart(
        index=plan.layout.stage,
        model=parts.backbone.state_dict(),
        optimizer=optimizer_by_name(parts.opt_backbone.state_dict(), plan.stage_param_names),
        all_keys=plan.state_keys,
        all_params=plan.param_names,
        writes=plan.layout.replica == 0,
    )


def stage_scaler_state(parts: Parts, plan: PipelinePlan) -> Optional[Dict[str, Any]]:
    """The last stage's fp16 loss-scaler state on world rank 0 (which writes the common file; the
    loss, hence the first scaling, is on the last stage), None elsewhere or when the scaler is off
    (then no collective)."""
    if not parts.scaler.is_enabled():
        return None
    states = gather_object_to(plan.layout, parts.scaler.state_dict(), dst_stage=0)
    return None if states is None or plan.layout.stage != 0 else states[-1]


def load_stage_state(
    parts: Parts, plan: PipelinePlan, model: Mapping[str, torch.Tensor], optimizer: Optional[Mapping[str, Any]]
) -> None:
    """Load this stage's share of a backbone's state: ``model`` holds (at least) its state-dict entries
    under the unsplit model's keys, ``optimizer`` (at least) its parameters' state by name
    (:func:`shardfc.checkpoint.optimizer_by_name`); None: an imported run's weights alone, the
    optimizer starts fresh."""
    own = list(parts.backbone.state_dict())
    missing = [k for k in own if k not in model]
    if missing:
        raise ConfigError(f"the checkpoint's backbone has no {missing[:5]}: saved by another architecture?")
    parts.backbone.load_state_dict({k: model[k] for k in own})
    if optimizer is not None:
        parts.opt_backbone.load_state_dict(optimizer_by_index(optimizer, plan.stage_param_names))


def whole_optimizer_by_name(optimizer: Mapping[str, Any], plan: PipelinePlan) -> Dict[str, Any]:
    """An unsplit backbone optimizer's state (as ddp saves it whole) by parameter name."""
    saved = len(optimizer["param_groups"][0]["params"]) if optimizer["param_groups"] else 0
    if saved != len(plan.param_names):
        raise ConfigError(
            f"the checkpoint's backbone optimizer covers {saved} parameters, the backbone has {len(plan.param_names)}"
        )
    return optimizer_by_name(optimizer, plan.param_names)


def restore_backbone(run, loaded: "ckpt.LoadedCheckpoint", cfg: TrainConfig, with_optimizer: bool = True) -> bool:
    """Load the backbone and (``with_optimizer``) its optimizer, whichever layout saved them and
    whichever this run has: whole in the common file (ddp, dp, horovod, an older pipeline run, an
    import) or per stage (a pipeline run; only the stage files holding this rank's keys are read).
    Returns whether the checkpoint held optimizer state."""
    parts, plan, common = run.parts, run.pipeline, loaded.common
    if "backbone" in common:
        model, optimizer = common["backbone"], common.get("backbone_optimizer")
        if not with_optimizer:
            optimizer = None
        if plan is None:
            parts.module.load_state_dict(model)
            if optimizer is not None:
                parts.opt_backbone.load_state_dict(optimizer)
            return optimizer is not None
        by_name = None if optimizer is None else whole_optimizer_by_name(optimizer, plan)
        load_stage_state(parts, plan, model, by_name)
        return optimizer is not None
    if plan is None:  # the unsplit model: every stage file, then the whole optimizer by index
        model, by_name = read_stage_state(loaded.path, loaded.meta, trust_pickle=cfg.trust_checkpoint)
        parts.module.load_state_dict(model)
        if with_optimizer:
            names = [n for n, p in parts.module.named_parameters() if p.requires_grad]
            parts.opt_backbone.load_state_dict(optimizer_by_index(by_name, names))
        return True
    model, by_name = read_stage_state(
        loaded.path, loaded.meta, list(parts.backbone.state_dict()), plan.stage_param_names,
        trust_pickle=cfg.trust_checkpoint,
    )
    load_stage_state(parts, plan, model, by_name if with_optimizer else None)
    return True
