"""The training loop of ``shardfc train``, readable top to bottom in :func:`train`.

One process per rank. Every rank holds a replica of the backbone (in DDP when there are several
ranks) and one class shard of the :class:`~shardfc.ShardedMarginHead` (never in DDP: its
embedding gradient is already scaled so that DDP's averaging gives the backbone exact
gradients). A step:

1. ``grad_accum`` micro-batches: backbone -> head (a collective over the group) -> backward,
   with DDP's gradient all-reduce only on the last micro-batch (``no_sync`` before);
2. fp16 only: the ranks agree on whether any gradient overflowed, then unscale;
3. clip the backbone gradient norm (identical on every rank after DDP) and the head's *global*
   gradient norm (squared shard norms all-reduced over the group);
4. step both optimizers (the head's from :func:`shardfc.head.partial_fc.head_optimizer`, row-sparse
   under Partial FC), then the warm-up + poly/cosine schedule of both.

Checkpoints (:mod:`shardfc.checkpoint`) store the head shard and its per-row optimizer state as
row tensors, so a run resumes on any number of ranks; everything else is replicated (rank 0
saves it) except the RNG states, saved per rank.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
import os
import random
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, Iterator, List, Optional, Tuple

import numpy as np
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, DistributedSampler, Sampler

from shardfc import checkpoint as ckpt
from shardfc.head.module import ShardedMarginHead
from shardfc.head.margins import build_margin
from shardfc.models import build_backbone, input_size as default_input_size
from shardfc.head.partial_fc import head_optimizer
from shardfc.train.config import ConfigError, TrainConfig, to_toml
from shardfc.train.evaluate import build_targets, run_targets, synthetic_dataset
from shardfc.train.runlog import RunLog, format_metrics

__all__ = [
    "Parts",
    "RunState",
    "ShardBatches",
    "WarmupDecay",
    "apply_gradients",
    "build_parts",
    "clip_head_grad_",
    "fingerprint",
    "load_parts",
    "resolve_image_size",
    "restore",
    "save",
    "train",
]

logger = logging.getLogger("shardfc.train")

#: Backbones whose global pooling accepts any input size (the others have a fixed-size fc layer).
_SIZE_AGNOSTIC = ("tiny", "resnet50")


# ---------------------------------------------------------------------------- state


@dataclass
class RunState:
    """Where training stands; saved in every checkpoint."""

    step: int = 0
    """Optimizer steps completed."""
    epoch: int = 0
    """Current pass over the data (the DistributedSampler's epoch)."""
    batch_in_epoch: int = 0
    """Micro-batches of ``epoch`` this rank has consumed."""
    batches_per_epoch: int = 0
    """Micro-batches per epoch per rank for the world size and batch size that saved this."""
    samples_seen: int = 0
    """Training images consumed over all ranks."""


@dataclass
class Context:
    """The process's place in the run."""

    rank: int
    """Rank in ``group``."""
    world_size: int
    """Ranks in ``group``."""
    group: Optional[dist.ProcessGroup]
    """Process group of the run (None: torch's default group, or no group at all)."""
    distributed: bool
    """torch.distributed is initialised (even with one rank)."""
    device: torch.device
    """Where this rank computes."""

    @property
    def is_main(self) -> bool:
        return self.rank == 0


@dataclass
class Parts:
    """The trainable parts of a run and their optimizers."""

    backbone: nn.Module
    """The backbone, in DDP when the run has several ranks."""
    head: ShardedMarginHead
    """This rank's class shard of the margin head."""
    opt_backbone: torch.optim.Optimizer
    """torch SGD/AdamW over the backbone's trainable parameters."""
    opt_head: torch.optim.Optimizer
    """:func:`shardfc.head.partial_fc.head_optimizer` over the head shard."""
    schedulers: List[torch.optim.lr_scheduler.LambdaLR]
    """Warm-up + decay schedule of each optimizer (backbone first)."""
    scaler: torch.amp.GradScaler
    """fp16 loss scaler (disabled for other precisions)."""

    @property
    def module(self) -> nn.Module:
        """The plain backbone (unwrapped from DDP): what is evaluated, saved and exported."""
        return self.backbone.module if isinstance(self.backbone, DDP) else self.backbone


# ---------------------------------------------------------------------------- the loop


def train(cfg: TrainConfig, group: Optional[dist.ProcessGroup] = None) -> Dict[str, Any]:
    """Train as ``cfg`` says; collective over ``group`` when torch.distributed is initialised.

    Returns a summary: ``step``, ``wall_time_s``, ``checkpoint`` and (rank 0) the last
    evaluation's ``metrics`` (``{target: {metric: value}}``) with their ``descriptions``.
    """
    started = time.time()
    cfg.validate()
    ctx = _context(cfg, group)
    out = Path(cfg.output_dir)
    with RunLog(out, ctx.is_main, cfg.progress) as runlog:
        # ---- setup: precision, data, model and optimizers, evaluation targets
        amp_dtype = _amp_dtype(cfg, ctx.device)
        image_size = resolve_image_size(cfg)
        dataset = _train_dataset(cfg, image_size)
        batches = ShardBatches(len(dataset), cfg.batch_size, ctx.rank, ctx.world_size, cfg.seed, cfg.drop_last)
        total_steps = cfg.max_steps or math.ceil(cfg.epochs * len(batches) / cfg.grad_accum)
        _seed_all(cfg.seed)  # the same backbone initialisation on every rank
        parts = build_parts(cfg, ctx, dataset.num_classes, image_size, total_steps, amp_dtype)
        _seed_all(_rank_seed(cfg.seed, ctx.rank, 0))  # then per-rank augmentation / dropout streams
        autocast = _autocast_factory(ctx.device, amp_dtype)
        targets = build_targets(cfg, image_size, ctx.device, autocast) if ctx.is_main else []
        if ctx.is_main:
            _log_setup(cfg, ctx, dataset, parts, len(batches), total_steps, image_size, amp_dtype)

        # ---- resume: the newest complete checkpoint, saved on any number of ranks
        state = RunState(batches_per_epoch=len(batches))
        resume_from = _resume_path(cfg, ctx)
        if resume_from is not None:
            state = restore(parts, resume_from, cfg, ctx, dataset.num_classes, image_size, len(batches), total_steps)
        if ctx.is_main:  # only now: a refused resume leaves the earlier run's config.toml alone
            (out / "config.toml").write_text(to_toml(cfg), encoding="utf-8")
        stream = _micro_batches(dataset, batches, state, cfg, ctx)

        # ---- train
        metrics: Dict[str, Dict[str, float]] = {}
        last_saved = resume_from
        window = _Window(state)
        runlog.open_bar(state.step, total_steps)
        parts.backbone.train()
        parts.head.train()
        while state.step < total_steps:
            loss, corrupt = _train_step(parts, stream, state, cfg, ctx, autocast)
            state.step += 1
            window.add(loss, corrupt)
            runlog.advance()
            if state.step % cfg.log_every == 0 or state.step == total_steps:
                _report(runlog, window, parts, state, total_steps, ctx)
            if cfg.ckpt_every and state.step % cfg.ckpt_every == 0 and state.step != total_steps:
                last_saved = save(parts, state, cfg, ctx, dataset.num_classes, image_size)
            if cfg.eval_every and state.step % cfg.eval_every == 0 and state.step != total_steps:
                metrics = _evaluate(targets, parts, state.step, runlog)
        runlog.close_bar()

        # ---- finish: a final checkpoint (unless resumed at the end) and a final evaluation
        if resume_from is None or state.step > _step_of(resume_from):
            last_saved = save(parts, state, cfg, ctx, dataset.num_classes, image_size)
        elif ctx.is_main:
            logger.info("%s is at step %d; max %d steps: nothing to train", resume_from, state.step, total_steps)
        metrics = _evaluate(targets, parts, state.step, runlog)
        if ctx.distributed:
            dist.barrier(group=ctx.group)  # leave together: no rank tears the group down under another
        wall = time.time() - started
        if ctx.is_main:
            logger.info("done: step %d in %.1f s; checkpoint %s", state.step, wall, last_saved)
    return {
        "step": state.step,
        "wall_time_s": wall,
        "checkpoint": str(last_saved) if last_saved else None,
        "metrics": metrics,
        "descriptions": {t.name: t.description for t in targets},
        "output_dir": str(out),
    }


def load_parts(cfg: TrainConfig, path: Path, group: Optional[dist.ProcessGroup] = None) -> Tuple[Parts, RunState]:
    """Build the parts of a run as :func:`train` does and load checkpoint ``path`` into them.

    For inspecting a checkpoint on any number of ranks; each rank gets its own head rows.
    Collective over ``group`` (DDP's construction broadcasts the backbone): call it on every rank.
    """
    cfg.validate()
    ctx = _context(cfg, group)
    image_size = resolve_image_size(cfg)
    dataset = _train_dataset(cfg, image_size)
    batches = ShardBatches(len(dataset), cfg.batch_size, ctx.rank, ctx.world_size, cfg.seed, cfg.drop_last)
    total_steps = cfg.max_steps or math.ceil(cfg.epochs * len(batches) / cfg.grad_accum)
    parts = build_parts(cfg, ctx, dataset.num_classes, image_size, total_steps, _amp_dtype(cfg, ctx.device))
    state = restore(parts, Path(path), cfg, ctx, dataset.num_classes, image_size, len(batches), total_steps)
    return parts, state


def _train_step(
    parts: Parts, stream: Iterator, state: RunState, cfg: TrainConfig, ctx: Context, autocast
) -> Tuple[torch.Tensor, int]:
    """One optimizer step over ``grad_accum`` micro-batches; returns (mean loss, corrupt images skipped)."""
    parts.opt_backbone.zero_grad(set_to_none=True)
    # The head's gradient buffer is kept: its backward then adds into it in place, block by block,
    # instead of allocating a fresh [n_local, D] gradient every step.
    parts.opt_head.zero_grad(set_to_none=False)
    loss_sum = torch.zeros((), device=ctx.device)
    corrupt = 0
    for micro in range(cfg.grad_accum):
        images, labels, skipped = next(stream)
        images = images.to(ctx.device, non_blocking=True)
        labels = labels.to(ctx.device, non_blocking=True)
        corrupt += int(skipped.sum())
        # DDP all-reduces the backbone gradients on the last micro-batch only.
        last = micro == cfg.grad_accum - 1
        sync = contextlib.nullcontext() if last or not isinstance(parts.backbone, DDP) else parts.backbone.no_sync()
        with sync:
            with autocast():
                # The head's loss is already the mean over the global micro-batch.
                loss = parts.head(parts.backbone(images), labels) / cfg.grad_accum
            parts.scaler.scale(loss).backward()
        loss_sum += loss.detach().float()
        state.samples_seen += images.shape[0] * ctx.world_size
    apply_gradients(parts, cfg.grad_clip, ctx)
    return loss_sum, corrupt


def apply_gradients(parts: Parts, grad_clip: float, ctx: Context) -> None:
    """Unscale (fp16), clip, and step both optimizers and their schedules: the end of a step."""
    if parts.scaler.is_enabled():
        _agree_on_overflow(parts, ctx)
    # One scaler for both optimizers: unscale both before clipping, step both, update once.
    parts.scaler.unscale_(parts.opt_backbone)
    parts.scaler.unscale_(parts.opt_head)
    if grad_clip > 0:
        params = [p for p in parts.backbone.parameters() if p.grad is not None]
        torch.nn.utils.clip_grad_norm_(params, grad_clip)
        clip_head_grad_(parts.head, grad_clip, ctx)
    parts.scaler.step(parts.opt_backbone)
    parts.scaler.step(parts.opt_head)
    parts.scaler.update()
    for s in parts.schedulers:
        s.step()


# ---------------------------------------------------------------------------- setup


def _context(cfg: TrainConfig, group: Optional[dist.ProcessGroup]) -> Context:
    distributed = dist.is_available() and dist.is_initialized()
    if group is not None and not distributed:
        raise ValueError(f"group={group!r} was given but torch.distributed is not initialised")
    rank = dist.get_rank(group) if distributed else 0
    world = dist.get_world_size(group) if distributed else 1
    want_cuda = cfg.device == "cuda" or (cfg.device == "auto" and torch.cuda.is_available())
    if want_cuda and not torch.cuda.is_available():
        raise ConfigError("device='cuda' but CUDA is not available here; use --device cpu or auto")
    if want_cuda:
        device = torch.device("cuda", torch.cuda.current_device())
        torch.backends.cudnn.benchmark = True
    else:
        device = torch.device("cpu")
    if distributed and device.type == "cpu" and dist.get_backend(group) == "nccl":
        raise ConfigError("the process group uses NCCL but device is the CPU; use gloo for CPU runs")
    return Context(rank, world, group, distributed, device)


def _amp_dtype(cfg: TrainConfig, device: torch.device) -> Optional[torch.dtype]:
    """The autocast dtype, after falling back where the hardware cannot do what was asked."""
    if cfg.amp == "none":
        return None
    if cfg.amp == "fp16" and device.type == "cpu":
        logger.warning(
            "amp='fp16' asked for, but this run is on the CPU, where fp16 autocast is slow and covers few ops: "
            "using bf16 autocast instead (fp32's range, so no loss scaling)"
        )
        return torch.bfloat16
    if cfg.amp == "bf16" and device.type == "cuda" and not torch.cuda.is_bf16_supported():
        logger.warning("amp='bf16' asked for, but this GPU lacks bf16: using fp16 autocast with loss scaling instead")
        return torch.float16
    return torch.float16 if cfg.amp == "fp16" else torch.bfloat16


def _autocast_factory(device: torch.device, dtype: Optional[torch.dtype]):
    if dtype is None:
        return contextlib.nullcontext
    return lambda: torch.autocast(device_type=device.type, dtype=dtype)


def _seed_all(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def _rank_seed(seed: int, rank: int, step: int) -> int:
    """Seed of rank ``rank``'s own random stream (augmentation, dropout) from ``step`` on."""
    return seed + 1_000_003 * (rank + 1) + step


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


def _train_dataset(cfg: TrainConfig, image_size: Tuple[int, int]) -> Dataset:
    if cfg.dataset == "synthetic":
        return synthetic_dataset(cfg, image_size)
    from shardfc.data import ImageFolderDataset, ListFileDataset

    if cfg.dataset == "folder":
        inner = ImageFolderDataset(cfg.data_root, image_size, train=True)
    else:
        inner = ListFileDataset(cfg.list_file, cfg.data_root or None, image_size, train=True)
    return _CountCorrupt(inner)


class _CountCorrupt(Dataset):
    """Adds to each sample how many corrupt images were skipped to produce it.

    The dataset's own counter lives in whichever DataLoader worker decoded the image; passing
    the count along with the batch lets rank 0 report a total over all workers and ranks.
    """

    def __init__(self, inner: Dataset) -> None:
        self.inner = inner
        self.num_classes = inner.num_classes

    def __len__(self) -> int:
        return len(self.inner)

    def __getitem__(self, index: int):
        before = self.inner.corrupt_count
        image, label = self.inner[index]
        return image, label, self.inner.corrupt_count - before

    def __repr__(self) -> str:
        return repr(self.inner)


def build_parts(
    cfg: TrainConfig,
    ctx: Context,
    num_classes: int,
    image_size: Tuple[int, int],
    total_steps: int,
    amp_dtype: Optional[torch.dtype],
) -> Parts:
    """Backbone (DDP when several ranks), head shard, optimizers, schedules and scaler."""
    kwargs = {"input_size": image_size} if cfg.backbone == "tiny" else {}
    backbone = build_backbone(cfg.backbone, cfg.embedding_dim, **kwargs).to(ctx.device)
    if ctx.distributed and ctx.world_size > 1:
        # Frozen BN weights (requires_grad=False) are simply not reduced; no parameter goes unused.
        backbone = DDP(
            backbone,
            device_ids=[ctx.device] if ctx.device.type == "cuda" else None,
            process_group=ctx.group,
        )
    head = ShardedMarginHead(
        cfg.embedding_dim,
        num_classes,
        margin=build_margin(cfg.margin, **cfg.margin_params()),
        group=ctx.group if ctx.distributed else None,
        label_smoothing=cfg.label_smoothing,
        chunk_size={0: None, -1: "auto"}.get(cfg.chunk_size, cfg.chunk_size),
        sample_rate=cfg.sample_rate,
        sample_seed=cfg.seed,
        init_seed=cfg.seed,
        device=ctx.device,
    )
    trainable = [p for p in backbone.parameters() if p.requires_grad]
    if cfg.optimizer == "sgd":
        opt_backbone: torch.optim.Optimizer = torch.optim.SGD(
            trainable, lr=cfg.lr, momentum=cfg.momentum, weight_decay=cfg.weight_decay, nesterov=cfg.nesterov
        )
    else:
        opt_backbone = torch.optim.AdamW(
            trainable, lr=cfg.lr, betas=tuple(cfg.betas), eps=cfg.eps, weight_decay=cfg.weight_decay
        )
    opt_head = head_optimizer(
        head, cfg.optimizer, lr=cfg.lr, momentum=cfg.momentum, weight_decay=cfg.weight_decay,
        nesterov=cfg.nesterov, betas=tuple(cfg.betas), eps=cfg.eps,
    )
    schedulers = [
        torch.optim.lr_scheduler.LambdaLR(o, WarmupDecay(cfg, total_steps)) for o in (opt_backbone, opt_head)
    ]
    scaler = torch.amp.GradScaler(ctx.device.type, enabled=amp_dtype == torch.float16)
    return Parts(backbone, head, opt_backbone, opt_head, schedulers, scaler)


class WarmupDecay:
    """LR multiplier at step t: linear warm-up to 1, then poly ``(1 - p)^power`` or cosine to 0.

    A callable object rather than a lambda so that LambdaLR's state_dict stores its fields.
    """

    def __init__(self, cfg: TrainConfig, total_steps: int) -> None:
        self.warmup = cfg.warmup_steps
        self.total = total_steps
        self.kind = cfg.scheduler
        self.power = cfg.poly_power

    def __call__(self, step: int) -> float:
        if step < self.warmup:
            return (step + 1) / (self.warmup + 1)
        span = max(self.total - self.warmup, 1)
        progress = min(max(step - self.warmup, 0) / span, 1.0)
        if self.kind == "cosine":
            return 0.5 * (1.0 + math.cos(math.pi * progress))
        return (1.0 - progress) ** self.power


def _apply_schedule(parts: Parts, cfg: TrainConfig, total_steps: int, step: int) -> None:
    """Put the schedulers at ``step`` of *this* run's schedule.

    A loaded scheduler state carries the saving run's peak lr, warm-up and length; the current
    config wins so that a resumed run can, e.g., be extended with a larger --max-steps.
    """
    saved = parts.schedulers[0]
    before = (saved.base_lrs[0], vars(saved.lr_lambdas[0]))
    for s in parts.schedulers:
        s.lr_lambdas = [WarmupDecay(cfg, total_steps) for _ in s.optimizer.param_groups]
        s.base_lrs = [cfg.lr for _ in s.optimizer.param_groups]
        s.last_epoch = step
        for group, fn in zip(s.optimizer.param_groups, s.lr_lambdas):
            group["initial_lr"] = cfg.lr
            group["lr"] = cfg.lr * fn(step)
    if before != (cfg.lr, vars(parts.schedulers[0].lr_lambdas[0])):
        logger.info(
            "the schedule differs from the checkpoint's (lr %g, %s); following this run's: lr %g, %s",
            before[0], before[1], cfg.lr, vars(parts.schedulers[0].lr_lambdas[0]),
        )


def _lr(parts: Parts) -> float:
    return parts.opt_backbone.param_groups[0]["lr"]


def _log_setup(cfg, ctx, dataset, parts, batches_per_epoch, total_steps, image_size, amp_dtype) -> None:
    n_backbone = sum(p.numel() for p in parts.module.parameters())
    logger.info(
        "shardfc train: %d rank(s) on %s (%s), output %s",
        ctx.world_size, ctx.device.type, dist.get_backend(ctx.group) if ctx.distributed else "no process group",
        os.path.abspath(cfg.output_dir),
    )
    logger.info("data: %s, %d images, %d classes, %dx%d input", dataset, len(dataset), dataset.num_classes, *image_size)
    logger.info(
        "model: %s (%.2fM parameters) -> %d-d embeddings; head %s over %d classes, %d per rank (rank 0: %s)",
        cfg.backbone, n_backbone / 1e6, cfg.embedding_dim, parts.head.margin, parts.head.num_classes,
        len(parts.head.class_range), f"{parts.head.class_range.start}..{parts.head.class_range.stop - 1}",
    )
    global_batch = cfg.batch_size * ctx.world_size * cfg.grad_accum
    logger.info(
        "optimisation: %s lr %g, %s schedule, %d warm-up steps; %d steps of %d images (%d per rank x %d rank(s) x "
        "%d accumulated), %d micro-batches per epoch per rank; precision %s%s",
        cfg.optimizer, cfg.lr, cfg.scheduler, cfg.warmup_steps, total_steps, global_batch, cfg.batch_size,
        ctx.world_size, cfg.grad_accum, batches_per_epoch, "fp32" if amp_dtype is None else str(amp_dtype)[6:],
        f"; Partial FC sample_rate {cfg.sample_rate}" if cfg.sample_rate < 1 else "",
    )
    if cfg.warmup_steps >= total_steps:
        logger.warning(
            "warmup_steps=%d >= the %d steps of this run: the learning rate never reaches lr=%g",
            cfg.warmup_steps, total_steps, cfg.lr,
        )


# ---------------------------------------------------------------------------- data


class ShardBatches(Sampler):
    """This rank's micro-batches of one epoch, resumable mid-epoch.

    Indices come from a :class:`DistributedSampler` (shuffled per epoch, padded so every rank has
    the same number of batches, which the head's per-step collectives need). A last batch of a
    single image is folded into the one before (BatchNorm cannot train on one sample); with
    ``drop_last`` a partial last batch is dropped. ``start`` skips batches of the current epoch
    without loading them (resume).
    """

    def __init__(self, size: int, batch_size: int, rank: int, world_size: int, seed: int, drop_last: bool) -> None:
        self.sampler = DistributedSampler(
            range(size), num_replicas=world_size, rank=rank, shuffle=True, seed=seed, drop_last=False
        )
        self.batch_size = batch_size
        self.drop_last = drop_last
        self.start = 0
        per_rank = self.sampler.num_samples
        if per_rank < 2:
            raise ConfigError(
                f"the dataset has {size} images, fewer than 2 per rank for {world_size} rank(s); "
                "BatchNorm needs at least 2 images per batch"
            )
        if drop_last and per_rank < batch_size:
            raise ConfigError(
                f"drop_last with batch_size={batch_size} leaves no batch: each of {world_size} rank(s) gets "
                f"{per_rank} images per epoch"
            )

    def set_epoch(self, epoch: int, start: int = 0) -> None:
        self.sampler.set_epoch(epoch)
        self.start = start

    def _all(self) -> List[List[int]]:
        idx = list(self.sampler)
        out = [idx[i : i + self.batch_size] for i in range(0, len(idx), self.batch_size)]
        if self.drop_last and len(out[-1]) < self.batch_size:
            out.pop()
        elif len(out) > 1 and len(out[-1]) == 1:
            out[-2].extend(out.pop())
        return out

    def __iter__(self):
        return iter(self._all()[self.start :])

    def __len__(self) -> int:
        n, b = self.sampler.num_samples, self.batch_size
        full = n // b if self.drop_last else (n // b + (1 if n % b > 1 or n < b else 0))
        return full - self.start


def _micro_batches(dataset: Dataset, batches: ShardBatches, state: RunState, cfg: TrainConfig, ctx: Context):
    """Endless ``(images, labels, corrupt skips)`` over epochs; advances ``state.epoch``/``batch_in_epoch``."""
    use_workers = cfg.num_workers > 0
    loader = DataLoader(
        dataset,
        batch_sampler=batches,
        num_workers=cfg.num_workers,
        pin_memory=ctx.device.type == "cuda",
        persistent_workers=use_workers,
        generator=torch.Generator().manual_seed(cfg.seed + ctx.rank),
    )
    counted = isinstance(dataset, _CountCorrupt)
    while True:
        batches.set_epoch(state.epoch, state.batch_in_epoch)
        for batch in loader:
            state.batch_in_epoch += 1
            if counted:
                yield batch
            else:
                yield batch[0], batch[1], torch.zeros(1, dtype=torch.int64)
        state.epoch += 1
        state.batch_in_epoch = 0


# ---------------------------------------------------------------------------- gradients


def clip_head_grad_(head: nn.Module, max_norm: float, ctx: Context) -> torch.Tensor:
    """Clip the head's gradient by its norm over *all* shards; returns that global norm.

    Each rank holds different rows, so the local norm is only a part: the squared norms are
    summed over the group first, and every rank scales its rows by the same factor.
    """
    grads = [p.grad for p in head.parameters() if p.grad is not None]
    sq = torch.zeros((), device=ctx.device, dtype=torch.float32)
    for g in grads:
        sq += g.detach().float().pow(2).sum()
    if ctx.distributed:
        dist.all_reduce(sq, group=ctx.group)
    total = sq.sqrt()
    coef = (max_norm / (total + 1e-6)).clamp(max=1.0)
    for g in grads:
        g.mul_(coef.to(g.dtype))
    return total


def _agree_on_overflow(parts: Parts, ctx: Context) -> None:
    """Make every rank's fp16 loss scaler see an overflow if any rank's gradients hold inf/NaN.

    Backbone gradients are equal on all ranks (DDP), but head shards differ, so one rank may
    overflow alone; the scaler would then skip the step on that rank only and the scales would
    drift apart. After this, every optimizer on every rank holds a non-finite gradient or none does.
    """
    groups = [
        [p.grad for p in parts.backbone.parameters() if p.grad is not None and p.grad.numel()],
        [p.grad for p in parts.head.parameters() if p.grad is not None and p.grad.numel()],
    ]
    # [backbone overflowed, head overflowed, any rank overflowed]; one host sync for all of it.
    flags = torch.zeros(3, device=ctx.device)
    for i, grads in enumerate(groups):
        if grads:
            flags[i] = torch.stack([~torch.isfinite(g).all() for g in grads]).any().float()
    flags[2] = flags[:2].max()
    if ctx.distributed:
        dist.all_reduce(flags[2:], op=dist.ReduceOp.MAX, group=ctx.group)
    bad_backbone, bad_head, bad_anywhere = flags.tolist()
    if bad_anywhere:
        for grads, bad in zip(groups, (bad_backbone, bad_head)):
            if grads and not bad:
                grads[0].view(-1)[0] = float("inf")


# ---------------------------------------------------------------------------- logging and eval


class _Window:
    """Loss, throughput and corrupt-image skips since the last report."""

    def __init__(self, state: RunState) -> None:
        self.state = state
        self._reset()

    def _reset(self) -> None:
        self.t0, self.samples0 = time.time(), self.state.samples_seen
        self.loss: Optional[torch.Tensor] = None
        self.steps = 0
        self.corrupt = 0

    def add(self, loss: torch.Tensor, corrupt: int) -> None:
        self.loss = loss if self.loss is None else self.loss + loss  # no host sync until the report
        self.steps += 1
        self.corrupt += corrupt

    def take(self) -> Tuple[float, float, int]:
        """(mean loss, images/s, corrupt skips on this rank) since the previous take; resets."""
        loss = float(self.loss) / self.steps if self.steps else float("nan")
        rate = (self.state.samples_seen - self.samples0) / max(time.time() - self.t0, 1e-9)
        corrupt = self.corrupt
        self._reset()
        return loss, rate, corrupt


def _report(runlog: RunLog, window: _Window, parts: Parts, state: RunState, total: int, ctx: Context) -> None:
    """Log loss, lr, throughput and the corrupt images skipped on all ranks since the last report."""
    loss, rate, corrupt = window.take()
    if not math.isfinite(loss):
        raise FloatingPointError(
            f"the training loss is {loss} at step {state.step}: training diverged; lower --lr, raise "
            "--warmup-steps or set --grad-clip"
        )
    skipped = torch.tensor([corrupt], dtype=torch.int64, device=ctx.device)
    if ctx.distributed:
        dist.all_reduce(skipped, group=ctx.group)
    skipped_total = int(skipped)
    if not ctx.is_main:
        return
    lr = _lr(parts)
    extra = f"  ({skipped_total} corrupt image(s) skipped)" if skipped_total else ""
    logger.info(
        "step %d/%d  epoch %d  loss %.4f  lr %.4g  %.0f images/s%s",
        state.step, total, state.epoch, loss, lr, rate, extra,
    )
    runlog.set_postfix({"loss": loss, "lr": lr, "img/s": rate})
    values = {"train/loss": loss, "train/lr": lr, "train/images_per_s": rate, "train/epoch": state.epoch}
    if skipped_total:
        values["data/corrupt_skipped"] = skipped_total
    if parts.scaler.is_enabled():
        values["train/loss_scale"] = parts.scaler.get_scale()
    runlog.scalars(state.step, values)


def _evaluate(targets, parts: Parts, step: int, runlog: RunLog) -> Dict[str, Dict[str, float]]:
    """Rank 0 evaluates the plain backbone (no collective); the others move on and wait in the next one."""
    if not targets:
        return {}
    t0 = time.time()
    metrics = run_targets(targets, parts.module)
    for t in targets:
        logger.info("eval step %d  %s: %s  (%s)", step, t.name, format_metrics(metrics[t.name]), t.description)
        runlog.scalars(step, {f"val/{t.name}/{k}": v for k, v in metrics[t.name].items()})
    logger.info("evaluation took %.1f s", time.time() - t0)
    return metrics


# ---------------------------------------------------------------------------- checkpoints


def fingerprint(cfg: TrainConfig, num_classes: int, image_size: Tuple[int, int]) -> Dict[str, Any]:
    """What must match for a checkpoint to be loaded into this run."""
    return {
        "backbone": cfg.backbone,
        "embedding_dim": cfg.embedding_dim,
        "num_classes": num_classes,
        "image_size": list(image_size),
        "optimizer": cfg.optimizer,
    }


def _checkpoint_root(cfg: TrainConfig) -> Path:
    return Path(cfg.output_dir) / "checkpoints"


def _step_of(path: Path) -> int:
    return int(path.name.split("_")[-1])


def _head_optimizer_rows(opt: torch.optim.Optimizer, rows: int) -> Tuple[Dict[str, torch.Tensor], Dict[str, Any]]:
    """Split the head optimizer's state into row tensors (resharded on load) and the rest."""
    tensors, extras = {}, {}
    for index, pstate in opt.state_dict()["state"].items():
        for key, value in pstate.items():
            name = f"optimizer.{index}.{key}"
            if isinstance(value, torch.Tensor) and value.dim() >= 1 and value.shape[0] == rows:
                tensors[name] = value
            else:
                extras[name] = value
    return tensors, extras


def save(parts: Parts, state: RunState, cfg: TrainConfig, ctx: Context, num_classes: int, image_size) -> Path:
    """Save a checkpoint of the run at ``state.step`` (collective over the group)."""
    rows = len(parts.head.class_range)
    opt_tensors, opt_extras = _head_optimizer_rows(parts.opt_head, rows)
    common = None
    if ctx.is_main:
        common = {
            "backbone": parts.module.state_dict(),
            "backbone_optimizer": parts.opt_backbone.state_dict(),
            "head_optimizer_param_groups": parts.opt_head.state_dict()["param_groups"],
            "schedulers": [s.state_dict() for s in parts.schedulers],
            "scaler": parts.scaler.state_dict(),
            "state": dataclasses.asdict(state),
            "world_size": ctx.world_size,
            "batch_size": cfg.batch_size,
            "config": dataclasses.asdict(cfg),
        }
    per_rank = {"rng": _rng_state(), "world_size": ctx.world_size}
    return ckpt.save_checkpoint(
        _checkpoint_root(cfg),
        state.step,
        common=common,
        per_rank=per_rank,
        head_tensors={"weight": parts.head.weight.detach(), **opt_tensors},
        head_extras={"sample_step": parts.head.sample_step, **opt_extras},
        class_range=parts.head.class_range,
        num_classes=num_classes,
        fingerprint=fingerprint(cfg, num_classes, image_size),
        group=ctx.group if ctx.distributed else None,
        keep_last=cfg.keep_last or None,
    )


def _resume_path(cfg: TrainConfig, ctx: Context) -> Optional[Path]:
    """The checkpoint to resume from (rank 0 decides, so all ranks agree), after setting aside newer ones.

    Training on from step s saves step directories after s, so any already there (a truncated
    save found by 'auto', or the future of an explicitly chosen older checkpoint) are renamed
    aside rather than overwritten: nothing saved is lost.
    """
    root = _checkpoint_root(cfg)
    decision: List[Any] = [None]
    if ctx.is_main:
        try:
            path = ckpt.resolve_resume(root, cfg.resume)
            existing = ckpt.find_checkpoints(root) if root.is_dir() else []
            if path is None and cfg.resume.strip().lower() == "none" and existing:
                raise ConfigError(
                    f"resume='none' but {root} already holds checkpoints (newest: {existing[-1].name}); pass "
                    "--resume auto to continue that run, or choose another --output-dir"
                )
            start = _step_of(path) if path is not None else -1
            _set_aside_newer(root, start)
            decision[0] = ("ok", str(path) if path is not None else None)
        except Exception as e:  # every rank must learn about it, or they would wait forever
            decision[0] = ("error", e)
    if ctx.distributed:
        dist.broadcast_object_list(decision, src=dist.get_global_rank(ctx.group, 0) if ctx.group else 0, group=ctx.group)
    kind, value = decision[0]
    if kind == "error":
        raise value
    if value is not None and ctx.is_main:
        logger.info("resuming from %s", value)
    return Path(value) if value is not None else None


def _set_aside_newer(root: Path, start: int) -> None:
    if not root.is_dir():
        return
    for entry in sorted(root.iterdir()):
        name = entry.name
        if entry.is_dir() and name.startswith("step_") and name[5:].isdigit() and int(name[5:]) > start:
            aside = entry.with_name(f"{name}.set-aside-{time.strftime('%Y%m%d-%H%M%S')}")
            os.replace(entry, aside)
            logger.warning(
                "%s is newer than the checkpoint this run resumes from (incomplete, corrupt, or resume names an "
                "older one); renamed it to %s so that it is not overwritten", entry, aside.name,
            )


def restore(
    parts: Parts,
    path: Path,
    cfg: TrainConfig,
    ctx: Context,
    num_classes: int,
    image_size: Tuple[int, int],
    batches_per_epoch: int,
    total_steps: int,
) -> RunState:
    """Load checkpoint ``path`` into ``parts``; returns the run state to continue from.

    The head rows of this rank's class range are read from whichever saved shards hold them,
    so the world size may differ from the saving run's. RNG states are restored when the world
    size is unchanged, otherwise each rank reseeds from (seed, rank, step).
    """
    try:
        loaded = ckpt.load_checkpoint(
            path,
            class_range=parts.head.class_range,
            num_classes=num_classes,
            fingerprint=fingerprint(cfg, num_classes, image_size),
            map_location="cpu",
            rank=ctx.rank,
        )
    except ValueError as e:  # another model or class count: say how to get going
        raise ConfigError(f"cannot resume: {e}. Train it in a new --output-dir (or pass --resume none there)") from e
    common = loaded.common
    parts.module.load_state_dict(common["backbone"])
    parts.opt_backbone.load_state_dict(common["backbone_optimizer"])
    with torch.no_grad():
        parts.head.weight.copy_(loaded.head_tensors["weight"])
    parts.head.sample_step = int(loaded.head_extras.get("sample_step", 0))
    head_state: Dict[int, Dict[str, Any]] = {}
    for source in (loaded.head_tensors, loaded.head_extras):
        for name, value in source.items():
            if name.startswith("optimizer."):
                _, index, key = name.split(".", 2)
                head_state.setdefault(int(index), {})[key] = value
    parts.opt_head.load_state_dict({"state": head_state, "param_groups": common["head_optimizer_param_groups"]})
    for s, saved in zip(parts.schedulers, common["schedulers"]):
        s.load_state_dict(saved)
    if parts.scaler.is_enabled() and common.get("scaler"):
        parts.scaler.load_state_dict(common["scaler"])

    state = RunState(**common["state"])
    _apply_schedule(parts, cfg, total_steps, state.step)
    saved_world = common["world_size"]
    if saved_world == ctx.world_size and loaded.per_rank is not None:
        _set_rng_state(loaded.per_rank["rng"])
    else:
        _seed_all(_rank_seed(cfg.seed, ctx.rank, state.step))
    if saved_world != ctx.world_size or common["batch_size"] != cfg.batch_size:
        # Another partition of the data: continue at the same fraction of the epoch.
        fraction = state.batch_in_epoch / max(state.batches_per_epoch, 1)
        state.batch_in_epoch = min(round(fraction * batches_per_epoch), batches_per_epoch)
        if ctx.is_main:
            logger.info(
                "resuming with %d rank(s) x batch %d (saved with %d x %d): continuing epoch %d at %.0f%%",
                ctx.world_size, cfg.batch_size, saved_world, common["batch_size"], state.epoch, 100 * fraction,
            )
    state.batches_per_epoch = batches_per_epoch
    if ctx.is_main:
        logger.info("restored step %d (epoch %d) from %s", state.step, state.epoch, path)
    return state


def _rng_state() -> Dict[str, Any]:
    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def _set_rng_state(state: Dict[str, Any]) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])
