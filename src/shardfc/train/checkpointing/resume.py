"""Save a run to a resharding checkpoint and resume from one, on any number of ranks."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import random
import time
from pathlib import Path
from typing import Any, Dict, Optional, Tuple

import numpy as np
import torch

from shardfc import checkpoint as ckpt
from shardfc.checkpoint import step_of
from shardfc.checkpoint.durable import restore_replaced
from shardfc.checkpoint.format import rank_file, saved_num_classes
from shardfc.checkpoint.weights_only import error_line
from shardfc.parallel.context import DistContext
from shardfc.seeding import seed_all
from shardfc.train.builder.factory import Run, rank_seed
from shardfc.train.builder.pipeline_train import restore_backbone, stage_part, stage_scaler_state
from shardfc.train.checkpointing.fine_tune import fresh_rows, head_state_for, load_kept
from shardfc.train.checkpointing.optimizer_settings import keep_run_settings, restore_run_settings
from shardfc.train.config import ConfigError, TrainConfig
from shardfc.train.schedule import apply_schedule
from shardfc.train.state import RunState

logger = logging.getLogger("shardfc.train")


def fingerprint(cfg: TrainConfig, num_classes: int, image_size: Tuple[int, int]) -> Dict[str, Any]:
    """What must match for a checkpoint to be loaded into this run."""
    return {
        "backbone": cfg.backbone,
        "embedding_dim": cfg.embedding_dim,
        "num_classes": num_classes,
        "image_size": list(image_size),
        "optimizer": cfg.optimizer,
    }


def checkpoint_root(cfg: TrainConfig) -> Path:
    return Path(cfg.output_dir) / "checkpoints"


def save(run: Run, state: RunState, cfg: TrainConfig) -> Path:
    """Save a checkpoint of the run at ``state.step`` (collective over the group). The head's
    ``sharded_state`` reads its deferred input checks first (``check_pending``): no checkpoint holds a
    step trained on a batch that failed them."""
    if run.pipeline is not None:
        return _save_pipeline(run, state, cfg)
    parts, ctx, num_classes = run.parts, run.ctx, run.num_classes
    common = None
    if ctx.is_main:
        common = _common(run, state, cfg, parts.module.state_dict(), parts.opt_backbone.state_dict())
    per_rank = {"rng": rng_state(), "world_size": ctx.world_size}
    return ckpt.save_checkpoint(
        checkpoint_root(cfg),
        state.step,
        common=common,
        per_rank=per_rank,
        head_state=parts.head.sharded_state(parts.opt_head),
        fingerprint=fingerprint(cfg, num_classes, run.image_size),
        group=ctx.group if ctx.distributed else None,
        keep_last=cfg.keep_last or None,
    )


def _common(
    run: Run, state: RunState, cfg: TrainConfig, backbone: Optional[Dict[str, Any]], optimizer: Optional[Dict[str, Any]],
    scaler: Optional[Dict[str, Any]] = None,
):
    """What rank 0 writes once: the whole backbone and its optimizer (unless saved per stage), schedules,
    scaler, run state."""
    parts = run.parts
    whole = {} if backbone is None else {"backbone": backbone, "backbone_optimizer": optimizer}
    return {
        **whole,
        "schedulers": [s.state_dict() for s in parts.schedulers],
        "scaler": parts.scaler.state_dict() if scaler is None else scaler,
        "state": dataclasses.asdict(state),
        "world_size": run.data_ctx.world_size,  # the ranks the data was partitioned over
        "batch_size": cfg.batch_size,
        # Text, read back by shardfc.train.checkpointing.artifacts.saved_config: the file stays plain data.
        "config_json": json.dumps(dataclasses.asdict(cfg)),
        # Which identity each head row is: a grown or reordered dataset keeps every identity's row.
        "class_names": run.classes.names if run.classes is not None else getattr(run.dataset, "class_names", None),
    }


def _save_pipeline(run: Run, state: RunState, cfg: TrainConfig) -> Path:
    """A pipeline run's checkpoint, per stage: every stage's replica 0 writes its share of the backbone
    and its optimizer state (the other replicas' are compared with it), the last stage's ranks their
    head shards, world rank 0 the common file; one atomic save over the world, nothing gathered.

    Every rank also writes its RNG states: a run resumed on the same layout continues their streams
    (bit for bit the uninterrupted run); on another layout every rank reseeds from (seed, replica, step).
    """
    parts, plan, ctx = run.parts, run.pipeline, run.ctx
    scaler = stage_scaler_state(parts, plan)
    per_rank = {"rng": rng_state(), "world_size": ctx.world_size, "pipeline": _pipeline_layout(run)}
    return ckpt.save_checkpoint(
        checkpoint_root(cfg), state.step,
        common=_common(run, state, cfg, None, None, scaler) if ctx.is_main else None, per_rank=per_rank,
        head_state=parts.head.sharded_state(parts.opt_head) if parts.head is not None else None,
        stage_parts=[stage_part(parts, plan)],
        fingerprint=fingerprint(cfg, run.num_classes, run.image_size),
        group=ctx.group, keep_last=cfg.keep_last or None,
    )


def resume_path(cfg: TrainConfig, ctx: DistContext) -> Optional[Path]:
    """The checkpoint to resume from (rank 0 decides, so all ranks agree), after setting aside newer ones.

    Training on from step s saves step directories after s, so any already there (a truncated
    save found by 'auto', or the future of an explicitly chosen older checkpoint) are renamed
    aside rather than overwritten: nothing saved is lost. A step that a crashed save of the same
    step left only under its scratch name is put back first (:func:`~shardfc.checkpoint.durable.restore_replaced`).
    """
    root = checkpoint_root(cfg)
    decision: Any = None
    if ctx.is_main:
        try:
            restore_replaced(root)
            path = ckpt.resolve_resume(root, cfg.resume)
            existing = ckpt.find_checkpoints(root) if root.is_dir() else []
            if path is None and cfg.resume.strip().lower() == "none" and existing:
                raise ConfigError(
                    f"resume='none' but {root} already holds checkpoints (newest: {existing[-1].name}); pass "
                    "--resume auto to continue that run, or choose another --output-dir"
                )
            start = step_of(path) if path is not None else -1
            _set_aside_newer(root, start)
            decision = ("ok", str(path) if path is not None else None)
        except Exception as e:  # every rank must learn about it, or they would wait forever
            decision = ("error", e)
    kind, value = ctx.broadcast_object(decision)
    if kind == "error":
        raise value
    if value is not None and ctx.is_main:
        logger.info("resuming from %s", value)
    return Path(value) if value is not None else None


def _set_aside_newer(root: Path, start: int) -> None:
    for step, entry in ckpt.step_dirs(root):
        if step > start:
            aside = entry.with_name(f"{entry.name}.set-aside-{time.strftime('%Y%m%d-%H%M%S')}")
            os.replace(entry, aside)
            logger.warning(
                "%s is newer than the checkpoint this run resumes from (incomplete, corrupt, or resume names an "
                "older one); renamed it to %s so that it is not overwritten", entry, aside.name,
            )


def restore(run: Run, path: Path, cfg: TrainConfig) -> RunState:
    """Load checkpoint ``path`` into ``run``'s parts; returns the run state to continue from.

    The head rows of this rank's class range are read from whichever saved shards hold them,
    so the world size may differ from the saving run's. RNG states are restored when the world
    size is unchanged, otherwise each rank reseeds from (seed, rank, step).
    """
    parts, ctx, num_classes, image_size = run.parts, run.ctx, run.num_classes, run.image_size
    batches_per_epoch, total_steps = len(run.batches), run.total_steps
    optimizers = [parts.opt_backbone, parts.opt_head]
    settings = keep_run_settings(optimizers)  # this run's momentum, weight decay...: the loads overwrite them
    # The classes the checkpoint keeps (all of them unless the dataset's identity set grew; none
    # for --on-missing-classes fresh), read by class range; a pipeline rank before the last stage
    # holds no head rows: it reads the common state only.
    plan = run.classes
    if plan is None:
        raise ValueError("restore needs the run's class plan against the checkpoint: build the run with "
                         "build_run(..., classes_from=(path, False))")
    try:
        loaded = load_kept(run, cfg, path, plan, fingerprint(cfg, saved_num_classes(path), image_size),
                           mmap=run.pipeline is not None)  # a stage takes its part of a backbone saved whole
    except ValueError as e:  # another model or class count: say how to get going
        raise ConfigError(f"cannot resume: {e}. Train it in a new --output-dir (or pass --resume none there)") from e
    common = loaded.common
    with _reading(path):
        held_optimizer = restore_backbone(run, loaded, cfg)
    if not held_optimizer and ctx.is_main:  # an imported run (shardfc import-arcface)
        logger.info("%s holds no backbone optimizer state (imported from %s): it starts fresh",
                    path, common.get("imported_from", "elsewhere"))
    if parts.head is not None:
        # The head's rows, Partial FC step and optimizer rows: this rank's classes, whatever the saved
        # sharding; new classes' rows after them (imprinted with the backbone just loaded).
        head_state = head_state_for(run, cfg, loaded, plan, with_optimizer=True)
        if head_state is None:
            fresh_rows(run, cfg)
        else:
            with _reading(path):
                parts.head.load_sharded_state(head_state, parts.opt_head)
    if plan.kept != num_classes and ctx.is_main:
        logger.info("head: %s; new rows: %s", plan.note, cfg.head_init)
    with _reading(path / ckpt.COMMON_FILE):
        for s, saved in zip(parts.schedulers, common.get("schedulers", [])):
            s.load_state_dict(saved)
        if parts.scaler.is_enabled() and common.get("scaler"):
            parts.scaler.load_state_dict(common["scaler"])
        state = RunState(**common["state"])
        saved_world, saved_batch = int(common["world_size"]), common["batch_size"]
    restore_run_settings(optimizers, settings)
    apply_schedule(parts, cfg, total_steps, state.step)
    data_ctx = run.data_ctx
    with _reading(path / rank_file(run.ctx.rank)):
        own_rng = saved_world == data_ctx.world_size and _same_layout(loaded.per_rank, run)
        if own_rng:
            set_rng_state(loaded.per_rank["rng"])
    if not own_rng:
        seed_all(rank_seed(cfg.seed, data_ctx.rank, state.step))
    if saved_world != data_ctx.world_size or saved_batch != cfg.batch_size:
        # Another partition of the data: continue at the same fraction of the epoch.
        fraction = state.batch_in_epoch / max(state.batches_per_epoch, 1)
        state.batch_in_epoch = min(round(fraction * batches_per_epoch), batches_per_epoch)
        if ctx.is_main:
            logger.info(
                "resuming with %d rank(s) x batch %d (saved with %d x %s): continuing epoch %d at %.0f%%",
                data_ctx.world_size, cfg.batch_size, saved_world,
                # an imported arcface_torch run records no batch size
                "?" if saved_batch is None else saved_batch, state.epoch, 100 * fraction,
            )
    state.batches_per_epoch = batches_per_epoch
    if ctx.is_main:
        logger.info("restored step %d (epoch %d) from %s", state.step, state.epoch, path)
    return state


@contextlib.contextmanager
def _reading(where: Path):
    """Turn what a crafted or foreign checkpoint makes a state loader raise (a key missing, a value of
    another type or shape) into one CheckpointError naming ``where``; shardfc's own errors pass."""
    try:
        yield
    except (ckpt.CheckpointError, ConfigError):
        raise
    except (KeyError, TypeError, ValueError, RuntimeError, IndexError, AttributeError) as e:
        raise ckpt.CheckpointError(f"cannot resume from {where}: it does not hold what this run saves "
                                   f"({error_line(e)})") from None


def _pipeline_layout(run: Run) -> Optional[list]:
    """What decides which random numbers a pipeline rank draws: its stage count and cuts (None: no pipeline)."""
    return None if run.pipeline is None else [run.pipeline.layout.stages, list(run.pipeline.split_points)]


def _same_layout(per_rank: Optional[Dict[str, Any]], run: Run) -> bool:
    """Whether this rank's saved RNG states are its own: the same world, strategy layout and place."""
    return (
        per_rank is not None
        and per_rank.get("world_size", run.ctx.world_size) == run.ctx.world_size
        and per_rank.get("pipeline") == _pipeline_layout(run)
    )


def rng_state() -> Dict[str, Any]:
    """This process's Python, numpy, torch (and CUDA) generator states, as tensors and plain types
    (a checkpoint file must load with ``torch.load(weights_only=True)``)."""
    version, internal, gauss = random.getstate()
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    state = {
        "python": [version, list(internal), gauss],
        # numpy's (str, uint32[624] array, int, int, float), the array as an int64 tensor.
        "numpy": (str(kind), torch.from_numpy(keys.astype(np.int64)), int(pos), int(has_gauss), float(cached)),
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: Dict[str, Any]) -> None:
    """Restore :func:`rng_state`'s states (also those of format-1 checkpoints: tuples and a numpy array)."""
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    kind, keys, pos, has_gauss, cached = state["numpy"]
    if isinstance(keys, torch.Tensor):
        keys = keys.numpy().astype(np.uint32)
    np.random.set_state((kind, keys, pos, has_gauss, cached))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])
