"""What a run tells the person watching it: the setup, loss / lr / throughput windows, evaluations."""

from __future__ import annotations

import logging
import math
import os
import time
from typing import Dict, List, Optional, Set, Tuple

import torch

from shardfc.parallel.context import DistContext
from shardfc.train.observe.evaluate import run_targets
from shardfc.train.observe.runlog import RunLog, format_metrics
from shardfc.train.schedule import current_lr
from shardfc.train.state import Parts, RunState

logger = logging.getLogger("shardfc.train")


def log_setup(cfg, ctx: DistContext, run) -> None:
    """Rank 0: where the run is, its data, model, head and optimisation, in a few lines."""
    dataset, parts, image_size, amp_dtype = run.dataset, run.parts, run.image_size, run.amp_dtype
    batches_per_epoch, total_steps = len(run.batches), run.total_steps
    plan = run.pipeline
    n_backbone = sum(p.numel() for p in parts.module.parameters())
    head = parts.head
    devices = f"{len(head.devices)} {ctx.device.type} devices" if head is not None and head.mode == "devices" else ctx.device.type
    logger.info(
        "shardfc train: %d rank(s) on %s (%s), strategy %s, output %s",
        ctx.world_size, devices, ctx.backend or "no process group", cfg.strategy,
        os.path.abspath(cfg.output_dir),
    )
    logger.info("data: %s, %d images, %d classes, %dx%d input", dataset, len(dataset), dataset.num_classes, *image_size)
    if plan is not None:  # rank 0 holds stage 0 and no head shard
        layout = plan.layout
        logger.info(
            "pipeline: %d stages x %d replicas, cut after %s; %s schedule over %d micro-batches; head sharded over "
            "the last stage's %d rank(s) (ranks %d..%d); rank 0's stage: %.2fM parameters",
            layout.stages, layout.replicas, ", ".join(plan.split_points), cfg.pipeline_schedule, cfg.micro_batches,
            layout.replicas, layout.rank_of(layout.stages - 1, 0), ctx.world_size - 1, n_backbone / 1e6,
        )
        logger.info("model: %s -> %d-d embeddings; head %s over %d classes", cfg.backbone, cfg.embedding_dim,
                    cfg.margin, dataset.num_classes)
    else:
        logger.info(
            "model: %s (%.2fM parameters) -> %d-d embeddings; head %s over %d classes, %d per rank (rank 0: %s)%s%s",
            cfg.backbone, n_backbone / 1e6, cfg.embedding_dim, head.margin, head.num_classes,
            len(head.class_range), f"{head.class_range.start}..{head.class_range.stop - 1}",
            f", {cfg.subcenters} sub-centres per class" if cfg.subcenters > 1 else "",
            f", inter-class filter at cos > {cfg.interclass_filter_threshold}" if cfg.interclass_filter_threshold else "",
        )
    per_rank = run.batches.batch_size
    replicas = run.data_ctx.world_size
    global_batch = per_rank * replicas * cfg.grad_accum
    logger.info(
        "optimisation: %s lr %g, %s schedule, %d warm-up steps; %d steps of %d images (%d per rank x %d rank(s) x "
        "%d accumulated), %d micro-batches per epoch per rank; precision %s%s",
        cfg.optimizer, cfg.lr, cfg.scheduler, cfg.warmup_steps, total_steps, global_batch, per_rank,
        replicas, cfg.grad_accum, batches_per_epoch, "fp32" if amp_dtype is None else str(amp_dtype)[6:],
        f"; Partial FC sample_rate {cfg.sample_rate}" if cfg.sample_rate < 1 else "",
    )
    if ctx.device.type == "cuda" or cfg.compile:
        logger.info(
            "speed: backbone in %s memory format%s; %d loader worker(s) per rank%s",
            "channels_last" if getattr(run, "channels_last", False) else "contiguous (NCHW)",
            ", torch.compile'd" if cfg.compile else "", cfg.num_workers,
            ", the next batch copied to the GPU on a side stream" if ctx.device.type == "cuda" else "",
        )
    if parts.triplet is not None or cfg.sampler == "pk" or cfg.random_erasing > 0:
        logger.info(
            "re-ID recipe: %s; sampler %s; random erasing p=%g",
            f"+ {cfg.triplet_weight:g} x batch-hard triplet ({parts.triplet}) on the pre-neck features"
            if parts.triplet is not None else "no triplet loss",
            f"pk ({run.batches.p} identities x {run.batches.k} images per global batch)" if cfg.sampler == "pk" else cfg.sampler,
            cfg.random_erasing,
        )
    per_rank_images = getattr(getattr(run.batches, "sampler", None), "num_samples", None)  # ShardBatches' epoch
    if per_rank_images is not None and per_rank_images < per_rank:
        logger.warning(
            "batch_size=%d exceeds the %d images each rank gets per epoch (%d in the set over %d rank(s)): every "
            "micro-batch is a whole epoch of %d, not %d",
            per_rank, per_rank_images, len(dataset), replicas, per_rank_images, per_rank,
        )
    if cfg.warmup_steps >= total_steps:
        logger.warning(
            "warmup_steps=%d >= the %d steps of this run: the learning rate never reaches lr=%g",
            cfg.warmup_steps, total_steps, cfg.lr,
        )


class ReportWindow:
    """Loss, throughput and corrupt-image skips since the last report."""

    def __init__(self, state: RunState, max_corrupt: int = -1) -> None:
        self.state = state
        self.named: Set[str] = set()
        """Corrupt images met so far on any rank (every rank holds the same set): each is named once per run."""
        self.max_corrupt = max_corrupt
        """Distinct corrupt images the run tolerates (``max_corrupt_images``); -1: no limit."""
        self._reset()

    def _reset(self) -> None:
        self.t0, self.samples0 = time.time(), self.state.samples_seen
        self.loss: Optional[torch.Tensor] = None
        self.steps = 0
        self.corrupt: List[Tuple[str, str]] = []

    def add(self, loss: torch.Tensor, corrupt: List[Tuple[str, str]]) -> None:
        self.loss = loss if self.loss is None else self.loss + loss  # no host sync until the report
        self.steps += 1
        self.corrupt += corrupt

    def take(self) -> Tuple[float, float, List[Tuple[str, str]]]:
        """(mean loss, images/s, (name, reason) of corrupt skips on this rank) since the previous take; resets."""
        loss = float(self.loss) / self.steps if self.steps else float("nan")
        rate = (self.state.samples_seen - self.samples0) / max(time.time() - self.t0, 1e-9)
        corrupt = self.corrupt
        self._reset()
        return loss, rate, corrupt


def report(runlog: RunLog, window: ReportWindow, parts: Parts, state: RunState, total: int, ctx: DistContext) -> None:
    """Log loss, lr, throughput and the corrupt images skipped on all ranks since the last report."""
    loss, rate, corrupt = window.take()
    if not math.isfinite(loss):
        raise diverged(f"the training loss is {loss}", state.step)
    skipped = torch.tensor([len(corrupt)], dtype=torch.int64, device=ctx.device)
    ctx.all_reduce_(skipped)
    skipped_total = int(skipped)
    if skipped_total:  # every rank knows the total, so all take part in the gather
        _name_corrupt_images(corrupt, window.named, ctx)
        # every rank holds the same set, so all stop here together (no rank left in a collective)
        if 0 <= window.max_corrupt < len(window.named):
            raise ValueError(
                f"{len(window.named)} different corrupt images skipped by step {state.step}, more than "
                f"max_corrupt_images={window.max_corrupt} (train.log names each): fix or remove them, or raise "
                "--max-corrupt-images (-1: no limit)"
            )
    if not ctx.is_main:
        return
    lr = current_lr(parts)
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


def diverged(what: str, step: int) -> FloatingPointError:
    """The error that stops a run whose numbers went non-finite at ``step``, with what to change."""
    return FloatingPointError(f"{what} at step {step}: training diverged; lower --lr, raise --warmup-steps or set "
                              "--grad-clip")


def _name_corrupt_images(corrupt: List[Tuple[str, str]], named: Set[str], ctx: DistContext) -> None:
    """Rank 0 names each corrupt image once per run, whichever rank and worker met it (collective);
    every rank adds them to ``named``, so that all count the same."""
    mine = sorted(set(corrupt))
    found = ctx.all_gather_object(mine)
    for name, reason in sorted({item for per_rank in found for item in per_rank}):
        if name not in named:
            named.add(name)
            if ctx.is_main:
                logger.warning("corrupt image skipped (the next valid sample is used instead): %s (%s)", name, reason)


def evaluate_targets(targets, parts: Parts, step: int, runlog: RunLog, record: bool = True) -> Dict[str, Dict[str, float]]:
    """Rank 0 evaluates the plain backbone (no collective); the others move on and wait in the next one.

    ``record``: append the metrics to metrics.csv (off for a re-evaluation of a logged step)."""
    if not targets:
        return {}
    t0 = time.time()
    metrics = run_targets(targets, parts.module, skip_non_finite=True)  # such a target is logged, not fatal
    for t in targets:
        if t.name not in metrics:
            continue
        logger.info("eval step %d  %s: %s  (%s)", step, t.name, format_metrics(metrics[t.name]), t.description)
        if record:
            runlog.scalars(step, {f"val/{t.name}/{k}": v for k, v in metrics[t.name].items()})
    logger.info("evaluation took %.1f s", time.time() - t0)
    return metrics
