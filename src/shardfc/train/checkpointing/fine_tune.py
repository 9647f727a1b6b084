"""Starting a run from a trained model on another class set (``--init-from``), and the rows of
classes a checkpoint has none for (``--head-init``): random or imprinted, sharded, in one pass.

The class bookkeeping (which identity keeps which row) is :mod:`~shardfc.train.checkpointing.classes`'; the
head's growth is :func:`shardfc.head.grow.grown_state`; the imprinting is
:func:`shardfc.head.imprint.imprint_centres`. This module joins them to a run.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Callable, Optional

import numpy as np
import torch
from torch.utils.data import DataLoader, Subset

from shardfc import checkpoint as ckpt
from shardfc.checkpoint.exported import is_torchscript, read_exported
from shardfc.checkpoint.format import short_repr
from shardfc.data.labels import dataset_labels
from shardfc.head.grow import grown_state, shared_row_step
from shardfc.head.imprint import imprint_centres
from shardfc.head.layout import overlap, seeded_rows
from shardfc.parallel.context import DistContext
from shardfc.train.builder.factory import autocast_factory
from shardfc.train.builder.pipeline_train import restore_backbone
from shardfc.train.checkpointing.classes import (  # the last two re-exported from there
    ClassPlan,
    plan_run_classes,
    saved_classes,
)
from shardfc.train.config import ConfigError, TrainConfig

__all__ = ["resolve_init_from", "saved_classes", "plan_run_classes", "new_head_rows", "load_kept", "head_state_for",
           "fresh_rows", "init_from"]

logger = logging.getLogger("shardfc.train")


def resolve_init_from(path: str) -> Path:
    """The model ``--init-from`` names: a checkpoint's ``step_*`` folder, the newest one of a run folder
    (``<run>/checkpoints/step_*``, as ``shardfc train`` and ``shardfc import-arcface`` write), or a
    ``shardfc export`` TorchScript file (:func:`init_from` reads it without running it)."""
    p = Path(path).expanduser()
    if p.is_file() and is_torchscript(p):
        return p
    found = ckpt.checkpoint_at(p)
    if found is not None:
        return found
    raise ConfigError(
        f"init_from={path!r}: no shardfc checkpoint or exported model there (a step_* folder with meta.json, a run "
        "folder holding checkpoints/step_*, or a `shardfc export` TorchScript file; convert an arcface_torch model "
        "with `shardfc import-arcface` first)"
    )


@torch.no_grad()
def _embeddings(run, cfg: TrainConfig, wanted_from: int):
    """This rank's share of the images of classes ``>= wanted_from``, through the backbone in eval mode."""
    from shardfc.train.loader.prefetch import to_device

    ctx: DistContext = run.ctx
    labels = dataset_labels(run.dataset)
    indices = np.nonzero(labels >= wanted_from)[0][ctx.rank :: ctx.world_size]
    loader = DataLoader(Subset(run.dataset, indices.tolist()), batch_size=cfg.eval_batch_size,
                        num_workers=cfg.num_workers)
    model = run.parts.module
    was_training = model.training
    model.eval()
    autocast = autocast_factory(ctx.device, run.amp_dtype)
    try:
        for images, y in loader:
            with autocast():
                x = model(to_device(images, ctx.device, run.channels_last))
            yield x.float(), y
    finally:
        model.train(was_training)


def new_head_rows(run, cfg: TrainConfig, kept: int) -> Callable[[range], torch.Tensor]:
    """The rows of this rank's classes ``>= kept`` as ``cfg.head_init`` says (collective for 'imprint').

    Imprinted: the normalised mean embedding of each class's images (a class without images gets
    its random row); with sub-centres each centre is the imprint plus its own random row, so they differ.
    """
    head = run.parts.head
    random_rows = seeded_rows(cfg.seed, head.subcenters, head.embedding_dim)
    if cfg.head_init != "imprint":
        return random_rows
    wanted = overlap(head.class_range, range(kept, head.num_classes))
    got = imprint_centres(_embeddings(run, cfg, kept), wanted, head.embedding_dim,
                          context=run.ctx if run.ctx.distributed else None, device=run.ctx.device)
    centres, empty = got.centres.cpu(), (got.counts == 0).cpu()
    missing = int(empty.sum())
    if missing:
        logger.warning("%d class(es) of rank %d have no image to imprint from (first: %s): random rows",
                       missing, run.ctx.rank, got.missing[:5].tolist())

    def rows(r: range) -> torch.Tensor:
        rand = random_rows(r)
        lo, hi = r.start - wanted.start, r.stop - wanted.start
        c, e = centres[lo:hi], empty[lo:hi]
        if head.subcenters > 1:
            return torch.where(e.view(-1, 1, 1), rand, c.unsqueeze(1) + rand)
        return torch.where(e.view(-1, 1), rand, c)

    return rows


def load_kept(run, cfg: TrainConfig, path: Path, plan: ClassPlan, fingerprint: Optional[dict],
              mmap: bool = False) -> "ckpt.LoadedCheckpoint":
    """Checkpoint ``path`` with the rows of this rank's classes that the plan keeps (read by class
    range, so any saved sharding: the resharding path); no head rows when the plan keeps none.
    ``mmap``: map the common file (a pipeline stage takes its part of a backbone saved whole)."""
    head = run.parts.head
    old = overlap(head.class_range, range(plan.kept)) if head is not None and plan.kept else range(0)
    saved_count = ckpt.saved_num_classes(path)
    return ckpt.load_checkpoint(path, class_range=old, num_classes=saved_count, fingerprint=fingerprint,
                                map_location="cpu", rank=run.ctx.rank, trust_pickle=cfg.trust_checkpoint, mmap=mmap)


def head_state_for(run, cfg: TrainConfig, loaded, plan: ClassPlan, with_optimizer: bool) -> Optional[dict]:
    """This rank's head state: the kept rows of ``loaded`` (:func:`load_kept`; with their optimizer
    state or not) and the new rows after them (``--head-init``; collective for 'imprint', so the
    backbone must be loaded first). None when the plan keeps no row (a fresh head)."""
    if plan.kept == 0:
        return None
    state = loaded.head_state
    if not with_optimizer:
        state = dict(state, tensors={"weight": state["tensors"]["weight"]},
                     extras={k: v for k, v in state["extras"].items() if not k.startswith("optimizer.")})
    if plan.num_classes == plan.kept:
        return state
    head = run.parts.head
    # AdamW's step count of the new rows, as torch's AdamW over the grown head has it (collective)
    row_step = shared_row_step(state["tensors"], head.ctx if head.distributed else None) if with_optimizer else 0.0
    return grown_state(state, plan.num_classes, head.class_range, new_head_rows(run, cfg, plan.kept), row_step)


def fresh_rows(run, cfg: TrainConfig) -> None:
    """A new head for all of the run's classes: imprinted (collective), or the random rows it was built with."""
    head = run.parts.head
    if cfg.head_init != "imprint":
        return
    rows = new_head_rows(run, cfg, 0)
    with torch.no_grad():
        for w, r in zip(head.shard_weights, head.shard_ranges):
            w.copy_(rows(r).reshape(w.shape).to(w.dtype))


def _backbone_from_export(run, path: Path, cfg: TrainConfig) -> None:
    """Load the backbone weights of a ``shardfc export`` file (read without running it) into this
    rank's backbone (a pipeline stage: its share), after checking what it was exported from."""
    exported = read_exported(path)
    meta = exported.metadata
    if meta and (meta.get("backbone"), meta.get("embedding_dim")) != (cfg.backbone, cfg.embedding_dim):
        raise ConfigError(
            f"init_from={str(path)!r} was exported from backbone={meta.get('backbone')!r}, embedding_dim="
            f"{meta.get('embedding_dim')!r}; this run has backbone={cfg.backbone!r}, embedding_dim={cfg.embedding_dim}: "
            "pass the export's --backbone and --embedding-dim"
        )
    target = run.parts.backbone if run.pipeline is not None else run.parts.module
    try:
        weights = exported.weights_for(target.state_dict())
    except ckpt.CheckpointError as e:
        raise ConfigError(f"init_from={str(path)!r}: {e}") from None
    target.load_state_dict(weights)


def init_from(run, path: Path, cfg: TrainConfig) -> None:
    """Load ``--init-from``'s backbone into the run, and its head where the plan keeps its classes;
    build the other rows as ``--head-init`` says. The run starts at step 0 with fresh optimizers.
    An exported model gives the backbone alone: the head is new."""
    plan: ClassPlan = run.classes
    parts = run.parts
    if is_torchscript(path):
        _backbone_from_export(run, path, cfg)
        if parts.head is not None:
            fresh_rows(run, cfg)
        if run.ctx.is_main:
            logger.info("init from %s: backbone loaded from an exported model (read without running it); head: %s; "
                        "%d rows: %s", path, plan.note, plan.num_classes, cfg.head_init)
        return
    loaded = load_kept(run, cfg, path, plan, None, mmap=run.pipeline is not None)
    config = loaded.common.get("config_json")
    try:  # whole in the common file or per pipeline stage: the stage files this rank's keys are in
        restore_backbone(run, loaded, cfg, with_optimizer=False)
    except (RuntimeError, KeyError) as e:
        raise ConfigError(
            f"init_from={str(path)!r}: its backbone does not fit backbone={cfg.backbone!r}, embedding_dim="
            f"{cfg.embedding_dim} ({str(e).splitlines()[0][:300]}); the checkpoint's config: {short_repr(config, 2000)}"
        ) from None
    if parts.head is not None:
        state = head_state_for(run, cfg, loaded, plan, with_optimizer=False)
        if state is None:
            fresh_rows(run, cfg)
        else:
            parts.head.load_sharded_state(state)
    if run.ctx.is_main:
        logger.info("init from %s: backbone loaded; head: %s; %s rows: %s", path, plan.note, len(plan.added) if plan.kept else plan.num_classes,
                    cfg.head_init)
