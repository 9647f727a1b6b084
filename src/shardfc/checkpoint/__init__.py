"""Atomic, resharding checkpoints for training with a class-sharded classifier head.

A run on W ranks saves every rank's head shard (weights and optimizer rows) as its own
file; a later run on any W' ranks loads only the rows of its own class range, so the
world size can change between save and resume without any collective at load time. A pipeline
run saves its backbone the same way, one file per stage, and any layout reads back the stages'
slices it needs (:mod:`shardfc.checkpoint.stages`).

    format.py       names, FORMAT_VERSION, meta.json, step directories, CheckpointError
    durable.py      hashed writes, fsync, publishing by rename (a swap over an existing step), restoring a
                    step a crashed resave left aside, pruning and tidying up
    validation.py   argument checks of save and load
    weights_only.py only tensors and plain data in .pt files; loading without unpickling code
    exported.py     the weights of a `shardfc export` TorchScript file, read without running it
    stages.py       a backbone saved per pipeline stage, read back by the keys a layout needs
    save.py         save_checkpoint (collective over the group)
    load.py         load_checkpoint, load_common, verify_checkpoint (no collectives)
    discovery.py    find_checkpoints, latest_checkpoint, checkpoint_at (a checkpoint or run folder), resolve_resume

The on-disk format is described in :mod:`shardfc.checkpoint.format`, the atomicity of a save in
:mod:`shardfc.checkpoint.durable`.
"""

from shardfc.checkpoint.discovery import checkpoint_at, find_checkpoints, latest_checkpoint, resolve_resume
from shardfc.checkpoint.format import (
    COMMON_FILE,
    FORMAT_NAME,
    FORMAT_VERSION,
    META_FILE,
    CheckpointError,
    parse_step_dir,
    saved_num_classes,
    step_dir_name,
    step_dirs,
    step_of,
)
from shardfc.checkpoint.load import LoadedCheckpoint, load_checkpoint, load_common, verify_checkpoint
from shardfc.checkpoint.save import save_checkpoint
from shardfc.checkpoint.stages import StagePart, optimizer_by_index, optimizer_by_name, read_stage_state

__all__ = [
    "FORMAT_VERSION",
    "CheckpointError",
    "LoadedCheckpoint",
    "save_checkpoint",
    "StagePart",
    "read_stage_state",
    "optimizer_by_name",
    "optimizer_by_index",
    "load_checkpoint",
    "load_common",
    "find_checkpoints",
    "latest_checkpoint",
    "checkpoint_at",
    "saved_num_classes",
    "verify_checkpoint",
    "resolve_resume",
    "step_dir_name",
    "step_of",
    "parse_step_dir",
    "step_dirs",
    "FORMAT_NAME",
    "META_FILE",
    "COMMON_FILE",
]
