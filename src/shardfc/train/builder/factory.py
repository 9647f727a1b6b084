"""Build a run's parts from its config: image size, backbone (wrapped as the strategy says), head shard, optimizers, precision.

:func:`build_model` is the one builder of every strategy: each option of the config reaches the
backbone (or, under ``--strategy pipeline``, this rank's stage of it), the head, the optimizers, the
schedules, the scaler and the triplet loss the same way, and the strategy is applied from outside
(:mod:`~shardfc.train.builder.strategy`'s wrappers; :mod:`~shardfc.train.builder.pipeline_train`'s stage cut and
schedule). A field a strategy cannot honour is refused by :meth:`TrainConfig.validate`, naming it;
``tests/train/builder/test_builder.py`` goes over every field under every strategy.
"""

from __future__ import annotations

import contextlib
import logging
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Tuple

import torch
import torch.distributed as dist
from torch.utils.data import Dataset, Sampler

from shardfc.head import ShardedMarginHead, head_optimizer
from shardfc.head.capture import CapturedHeadStep, capture_unavailable
from shardfc.head.margins import build_margin
from shardfc.head.triplet import BatchHardTripletLoss
from shardfc.models import build_backbone
from shardfc.models import input_size as default_input_size
from shardfc.parallel.context import DistContext
from shardfc.parallel.pipeline import PipelineLayout
from shardfc.seeding import mix_seed, seed_all
from shardfc.train.builder import cpu
from shardfc.train.builder.head_update import fused_head_update
from shardfc.train.builder.pipeline_train import (
    PipelinePlan,
    cut_stage,
    keep_boundaries_contiguous,
    pipeline_layout,
    pipeline_plan,
    stage_head_placement,
)
from shardfc.train.builder.strategy import (
    head_placement,
    loader_batch_size,
    wrap_backbone,
    wrap_backbone_optimizer,
)
from shardfc.train.builder.strategy import (
    run_context as strategy_context,
)
from shardfc.train.checkpointing.classes import ClassPlan, plan_run_classes
from shardfc.train.config import ConfigError, TrainConfig
from shardfc.train.loader.data import rank_batches, train_dataset
from shardfc.train.schedule import WarmupDecay
from shardfc.train.state import Parts

logger = logging.getLogger("shardfc.train")


#: Backbones whose global pooling accepts any input size (the others have a fixed-size fc layer).
_SIZE_AGNOSTIC = ("tiny", "resnet50")


def resolve_image_size(cfg: TrainConfig) -> Tuple[int, int]:
    """The backbone input ``(H, W)``: ``cfg.image_size`` or the backbone's default."""
    default = default_input_size(cfg.backbone)
    if not cfg.image_size:
        return default
    size = (int(cfg.image_size[0]), int(cfg.image_size[1]))
    if size != default and cfg.backbone not in _SIZE_AGNOSTIC:
        raise ConfigError(
            f"image_size={list(size)} but backbone={cfg.backbone!r} takes {default[0]}x{default[1]} inputs "
            f"(only {', '.join(_SIZE_AGNOSTIC)} accept other sizes)"
        )
    return size


def backbone_kwargs(cfg: TrainConfig, image_size: Tuple[int, int]) -> dict:
    """Constructor arguments of ``cfg.backbone`` beyond the embedding width (also used to rebuild it for export)."""
    return cfg.backbone_params(image_size)


def build_parts(
    cfg: TrainConfig,
    ctx: DistContext,
    num_classes: int,
    image_size: Tuple[int, int],
    total_steps: int,
    amp_dtype: Optional[torch.dtype],
) -> Parts:
    """The parts of a strategy that holds the whole backbone (ddp, dp, horovod): :func:`build_model`'s."""
    return build_model(cfg, ctx, num_classes, image_size, total_steps, amp_dtype)[0]


def build_model(
    cfg: TrainConfig,
    ctx: DistContext,
    num_classes: int,
    image_size: Tuple[int, int],
    total_steps: int,
    amp_dtype: Optional[torch.dtype],
    layout: Optional[PipelineLayout] = None,
) -> Tuple[Parts, Optional[PipelinePlan]]:
    """The one builder of every strategy: the backbone (in DDP / DataParallel as the strategy says; with
    a pipeline ``layout``, this rank's stage of it), head shard(s), optimizers, schedules, scaler and
    triplet loss, and (pipeline) the stage's schedule.

    Every option of ``cfg`` that shapes these is read here once, for every strategy: the backbone's
    (``backbone``, ``embedding_dim``, ``neck``, the image size, ``channels_last``, ``compile``, the
    ``seed`` of its initialisation), the head's (:func:`build_head`), the optimizers'
    (:func:`backbone_optimizer`, :func:`build_head_optimizer`: ``backbone_lr_mult``, rounding,
    ``head_update``), the schedules', the scaler's and the triplet loss's. What differs by strategy is
    applied to the result: :func:`~shardfc.train.builder.strategy.wrap_backbone` and
    :func:`~shardfc.train.builder.strategy.wrap_backbone_optimizer` (DDP, DataParallel, Horovod), where the
    head's shards live, and the pipeline's stage cut (:func:`~shardfc.train.builder.pipeline_train.cut_stage`)
    and schedule (:func:`~shardfc.train.builder.pipeline_train.pipeline_plan`).
    """
    seed_all(cfg.seed)  # the backbone's initialisation: the same on every rank, under every strategy

    def new_backbone() -> torch.nn.Module:
        return build_backbone(cfg.backbone, cfg.embedding_dim, **backbone_kwargs(cfg, image_size))

    stage = None
    if layout is None:
        module = prepare_backbone(cfg, ctx.device, new_backbone().to(ctx.device))
        backbone = wrap_backbone(cfg, ctx, module)
        placement: Optional[dict] = head_placement(cfg, ctx)
    else:
        stage = cut_stage(cfg, ctx, layout, new_backbone, image_size, autocast_factory(ctx.device, amp_dtype))
        module = backbone = prepare_backbone(cfg, ctx.device, stage.module, pipeline_stage=True)
        placement = stage_head_placement(layout)
    head = build_head(cfg, num_classes, placement) if placement is not None else None
    if head is not None and cfg.head_grad_clip > 0:
        head.measure_weight_grad_norm()  # the clip's norm from the weight-gradient pass (GPU impls)
    trainable = [p for p in module.parameters() if p.requires_grad]
    opt_backbone = wrap_backbone_optimizer(cfg, ctx, backbone, backbone_optimizer(cfg, trainable))
    opt_head = build_head_optimizer(cfg, head, ctx.device, amp_dtype) if head is not None else None
    schedulers = [
        torch.optim.lr_scheduler.LambdaLR(o, WarmupDecay(cfg, total_steps))
        for o in (opt_backbone, opt_head) if o is not None
    ]
    scaler = torch.amp.GradScaler(ctx.device.type, enabled=amp_dtype == torch.float16)
    # W x gradient (the triplet's default), like the head's: the backbone's wrapper averages over ranks.
    # (strategy 'pipeline' refuses the triplet loss: TrainConfig.validate)
    triplet = BatchHardTripletLoss(cfg.triplet_margin, cfg.triplet_soft, context=ctx) if cfg.triplet_weight > 0 else None
    parts = Parts(backbone, head, opt_backbone, opt_head, schedulers, scaler, triplet,
                  build_head_step(cfg, head, opt_head, ctx.device))
    plan = pipeline_plan(cfg, ctx, layout, stage, parts) if layout is not None else None
    return parts, plan


def prepare_backbone(cfg: TrainConfig, device: torch.device, module: torch.nn.Module,
                     pipeline_stage: bool = False) -> torch.nn.Module:
    """``module`` (the whole backbone, or a pipeline stage of it, on ``device``) as the run trains it:
    in channels_last where :func:`use_channels_last` says (a stage's input and output stay NCHW:
    :func:`~shardfc.train.builder.pipeline_train.keep_boundaries_contiguous`), compiled in place with ``cfg.compile``."""
    if use_channels_last(cfg, device, module):
        module = module.to(memory_format=torch.channels_last)
        if pipeline_stage:
            keep_boundaries_contiguous(module)
    elif cfg.channels_last and cfg.strategy == "horovod" and torch.device(device).type == "cuda":
        logger.info("channels_last is off under strategy 'horovod': its collectives take contiguous tensors only")
    if cfg.compile:
        module.compile()  # in place: state_dict() keys stay the module's own (no '_orig_mod.')
    return module


def build_head(cfg: TrainConfig, num_classes: int, placement: dict) -> ShardedMarginHead:
    """This rank's shard(s) of the margin head, with every head option of ``cfg``; ``placement``: the
    keyword arguments that say where the shards live (the strategy's)."""
    return ShardedMarginHead(
        cfg.embedding_dim,
        num_classes,
        margin=build_margin(cfg.margin, **cfg.margin_params()),
        label_smoothing=cfg.label_smoothing,
        chunk_size={0: None, -1: "auto"}.get(cfg.chunk_size, cfg.chunk_size),
        sample_rate=cfg.sample_rate,
        sample_seed=cfg.seed,
        sparse_grad=cfg.sparse_grad,
        dtype=getattr(torch, cfg.head_dtype),
        init_seed=cfg.seed,
        subcenters=cfg.subcenters,
        interclass_filter_threshold=cfg.interclass_filter_threshold or None,
        impl=cfg.head_impl,
        **placement,
    )


def backbone_optimizer(cfg: TrainConfig, params) -> torch.optim.Optimizer:
    """torch SGD / AdamW over the backbone's trainable ``params`` (a pipeline stage's: its own) at
    ``lr x backbone_lr_mult``."""
    backbone_lr = cfg.lr * cfg.backbone_lr_mult  # fine-tuning: a gentler backbone than head
    if cfg.optimizer == "sgd":
        return torch.optim.SGD(
            params, lr=backbone_lr, momentum=cfg.momentum, weight_decay=cfg.weight_decay, nesterov=cfg.nesterov
        )
    return torch.optim.AdamW(params, lr=backbone_lr, betas=tuple(cfg.betas), eps=cfg.eps, weight_decay=cfg.weight_decay)


def build_head_optimizer(cfg: TrainConfig, head: ShardedMarginHead, device: torch.device,
                         amp_dtype: Optional[torch.dtype]) -> torch.optim.Optimizer:
    """The head's optimizer (row-sparse under Partial FC or a bf16/fp16 head), its rounding, and
    whether the head's backward applies its step (:func:`~shardfc.train.builder.head_update.fused_head_update`)."""
    if cfg.optimizer == "sgd":  # each optimizer's own settings only: head_optimizer refuses the other's
        own = dict(momentum=cfg.head_momentum if cfg.head_momentum >= 0 else cfg.momentum, nesterov=cfg.nesterov)
    else:
        own = dict(betas=tuple(cfg.betas), eps=cfg.eps)
    return head_optimizer(
        head, cfg.optimizer, lr=cfg.lr, weight_decay=cfg.weight_decay, **own,
        rounding=cfg.head_rounding, rounding_seed=cfg.seed, fused_update=fused_head_update(cfg, device, amp_dtype),
        idle_rows=cfg.head_idle_rows,
    )


def build_head_step(cfg: TrainConfig, head: Optional[ShardedMarginHead], opt_head,
                    device: torch.device) -> Optional[CapturedHeadStep]:
    """``cuda_graph='head'``: the head's step captured as a CUDA graph (:mod:`shardfc.head.capture`),
    or a :class:`ConfigError` naming what the run lacks for it; None with ``cuda_graph='off'``."""
    if cfg.cuda_graph != "head" or head is None:
        return None
    if torch.device(device).type != "cuda":
        raise ConfigError(f"cuda_graph='head': the run is on {torch.device(device).type} (a CUDA graph needs CUDA); "
                          "use cuda_graph 'off'")
    why = capture_unavailable(head, opt_head)
    if why is not None:
        raise ConfigError(f"cuda_graph='head': {why}; use cuda_graph 'off'")
    return CapturedHeadStep(head, opt_head)


def channels_last_wanted(cfg: TrainConfig, backbone: torch.nn.Module) -> bool:
    """``cfg.channels_last``, where it means something and the strategy can carry it: a backbone with
    2-D convolutions, not under strategy 'horovod' (Horovod's broadcast and gradient all-reduce take
    contiguous tensors only: a channels_last weight or gradient is refused there)."""
    return (
        bool(cfg.channels_last)
        and cfg.strategy != "horovod"
        and any(isinstance(m, torch.nn.Conv2d) for m in backbone.modules())
    )


def use_channels_last(cfg: TrainConfig, device: torch.device, backbone: torch.nn.Module) -> bool:
    """Whether the run holds ``backbone`` and its inputs in channels_last: :func:`channels_last_wanted`,
    on a CUDA device (the layout changes nothing elsewhere)."""
    return torch.device(device).type == "cuda" and channels_last_wanted(cfg, backbone)


def resolve_amp_dtype(cfg: TrainConfig, device: torch.device) -> Optional[torch.dtype]:
    """The autocast dtype, after falling back where the hardware cannot do what was asked.

    'auto': bf16 on a CUDA GPU with bf16 (no loss scaling, no host sync for an overflow check), fp16
    with loss scaling on one without (fp32 with ``sparse_grad``, which fp16's scaler cannot unscale),
    fp32 on the CPU (the exactness of the CPU runs is the default's)."""
    if cfg.amp == "auto":
        if device.type != "cuda":
            return None
        if torch.cuda.is_bf16_supported():
            return torch.bfloat16
        if cfg.sparse_grad:
            logger.info("amp='auto' on a GPU without bf16, with sparse_grad (fp16's loss scaler cannot unscale it): fp32")
            return None
        return torch.float16
    if cfg.amp == "none":
        return None
    if device.type == "cpu" and cfg.amp in ("fp16", "bf16"):
        native, found = cpu.bf16_support()
        if cfg.amp == "fp16" and native is False:
            logger.warning(
                "amp='fp16' asked for, but this run is on the CPU, where fp16 autocast is slow and covers few ops, "
                "and this CPU has no native bf16 (%s), so bf16 autocast would be slower than fp32 too: "
                "training in fp32, the faster of the two", found,
            )
            return None
        if cfg.amp == "fp16":
            logger.warning(
                "amp='fp16' asked for, but this run is on the CPU, where fp16 autocast is slow and covers few ops: "
                "using bf16 autocast instead (fp32's range, so no loss scaling)"
            )
        elif native is False:
            logger.warning(
                "amp='bf16' on a CPU without native bf16 (%s): every bf16 op is converted through fp32 in "
                "software, so steps are slower than in fp32, not faster; pass --amp none unless you want bf16's "
                "numerics", found,
            )
        return torch.bfloat16
    if cfg.amp == "bf16" and device.type == "cuda" and not torch.cuda.is_bf16_supported():
        logger.warning("amp='bf16' asked for, but this GPU lacks bf16: using fp16 autocast with loss scaling instead")
        return torch.float16
    return torch.float16 if cfg.amp == "fp16" else torch.bfloat16


def autocast_factory(device: torch.device, dtype: Optional[torch.dtype]):
    if dtype is None:
        return contextlib.nullcontext
    return lambda: torch.autocast(device_type=device.type, dtype=dtype)


@dataclass
class Run:
    """A built run: where it is, its data and batches, its length, its precision and its parts."""

    ctx: DistContext
    image_size: Tuple[int, int]
    dataset: Dataset
    batches: Sampler
    total_steps: int
    amp_dtype: Optional[torch.dtype]
    parts: Parts
    pipeline: Optional[PipelinePlan] = None
    """Strategy 'pipeline': this rank's stage, schedule and the whole backbone's layout."""
    channels_last: bool = False
    """The backbone is in channels_last, so its input batches are made so too (:func:`use_channels_last`)."""
    classes: Optional[ClassPlan] = None
    """Which head row each identity has, against the checkpoint the run starts from (None: none)."""

    @property
    def num_classes(self) -> int:
        return self.dataset.num_classes

    @property
    def data_ctx(self) -> DistContext:
        """The ranks the data is partitioned over: the world, or a pipeline stage's replicas."""
        return self.pipeline.layout.replica_ctx if self.pipeline is not None else self.ctx


def build_run(cfg: TrainConfig, ctx: DistContext, clock=None, classes_from: Optional[Tuple[Path, bool]] = None) -> Run:
    """Data, batches, schedule length and parts; the backbone initialisation is the same on every rank.

    ``clock``: a :class:`~shardfc.train.observe.profile.StartupClock` that gets a mark per phase (``--profile``).
    ``classes_from``: ``(checkpoint, is --init-from)`` the run starts from: its recorded class names
    decide the head's classes and the dataset's labels (:mod:`~shardfc.train.checkpointing.classes`).
    """
    mark = clock.mark if clock is not None else (lambda name: None)
    amp_dtype = resolve_amp_dtype(cfg, ctx.device)
    image_size = resolve_image_size(cfg)
    dataset = train_dataset(cfg, image_size)
    class_plan = None
    if classes_from is not None:
        dataset, class_plan = plan_run_classes(cfg, dataset, *classes_from)
    mark("dataset")
    layout = pipeline_layout(cfg, ctx) if cfg.strategy == "pipeline" else None
    data_ctx = layout.replica_ctx if layout is not None else ctx  # also the head's ranks
    if dataset.num_classes < data_ctx.world_size:
        head_ranks = " (the last pipeline stage's)" if layout is not None else ""
        nproc = dataset.num_classes * (cfg.pipeline_stages if layout is not None else 1)
        raise ConfigError(
            f"the dataset has {dataset.num_classes} class(es) for {data_ctx.world_size} ranks{head_ranks}: every rank "
            f"must hold at least one class of the head; use --nproc {nproc} or fewer"
        )
    # Pipeline micro-batches have a fixed shape: an epoch's partial last batch is dropped.
    batches = rank_batches(cfg, dataset, loader_batch_size(cfg), data_ctx, drop_last=cfg.drop_last or layout is not None)
    if cfg.triplet_weight > 0 and cfg.sampler != "pk" and ctx.is_main:
        logger.warning("triplet_weight > 0 with sampler=%r: few batches hold two images of one identity; "
                       "use --sampler pk", cfg.sampler)
    total_steps = cfg.max_steps or math.ceil(cfg.epochs * len(batches) / cfg.grad_accum)
    mark("sampler")
    parts, plan = build_model(cfg, ctx, dataset.num_classes, image_size, total_steps, amp_dtype, layout)
    mark("model, head and optimizers" if layout is None else "pipeline stage, head and optimizers")
    # A pipeline stage converts its own input (keep_boundaries_contiguous): its batches stay NCHW.
    channels_last = layout is None and use_channels_last(cfg, ctx.device, parts.module)
    return Run(ctx, image_size, dataset, batches, total_steps, amp_dtype, parts, plan,
               channels_last=channels_last, classes=class_plan)


def run_context(cfg: TrainConfig, group: Optional[dist.ProcessGroup]) -> DistContext:
    """The run's :class:`DistContext` for its strategy, on the device ``cfg.device`` asks for."""
    return strategy_context(cfg, group)


def rank_seed(seed: int, rank: int, step: int) -> int:
    """Seed of rank ``rank``'s own random stream (augmentation, dropout) from ``step`` on."""
    return mix_seed(seed, rank, step)
