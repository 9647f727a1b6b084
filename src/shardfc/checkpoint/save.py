"""``save_checkpoint``: every rank writes its own files, rank 0 publishes them atomically.

A save is four steps, each collective over the group so that a failure on any rank makes every
rank raise instead of leaving the others waiting:

1. :func:`_agree_on_arguments`: each rank validates its own arguments; the verdicts and shard
   descriptions are all-gathered, and the shards are checked to tile ``[0, num_classes)`` (and
   the stage parts of a per-stage save to tile the backbone, its replicas to agree:
   :mod:`~shardfc.checkpoint.stages`).
2. :func:`_write_rank_files`: each rank writes its files into the scratch directory; the
   all-gather of the outcomes doubles as the barrier after writing.
3. :func:`_publish_from_first`: rank 0 writes ``meta.json`` last and renames the directory into
   place; its verdict is broadcast.
4. rank 0 prunes old checkpoints and removes leftovers of crashed saves (:func:`~.durable.tidy`).
"""

from __future__ import annotations

import json
import logging
import os
import secrets
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional

import torch

from shardfc.checkpoint.discovery import find_checkpoints
from shardfc.checkpoint.durable import check_file, fsync_dir, publish, save_durable, tidy, write_bytes_durable
from shardfc.checkpoint.format import (
    COMMON_FILE,
    META_FILE,
    CheckpointError,
    build_meta,
    head_file,
    rank_file,
    scratch_dir_name,
    stage_file,
    step_dir_name,
    tensor_specs,
)
from shardfc.checkpoint.stages import StagePart, check_parts, prepare_part
from shardfc.checkpoint.validation import (
    check_class_range,
    check_consistency,
    check_str_keys,
    json_roundtrip,
    prepare_head_tensors,
)
from shardfc.checkpoint.weights_only import check_plain
from shardfc.checks import check_int
from shardfc.outputs import blocking_file
from shardfc.parallel.context import DistContext

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

__all__ = ["save_checkpoint"]

logger = logging.getLogger("shardfc.checkpoint")


@dataclass
class _Shard:
    """This rank's validated part of a save, and what all ranks agreed on."""

    step: int
    num_classes: int
    class_range: Optional[range]
    """None: this rank holds no head shard (a pipeline stage before the last)."""
    tensors: dict[str, torch.Tensor]
    extras: dict[str, Any]
    infos: list[dict[str, Any]]
    """The shard descriptions (class range, tensor specs, extras names, fingerprint) of the ranks holding one."""
    token: str
    """Rank 0's random token: names the scratch directories of this save."""
    head_index: Optional[int] = None
    """This rank's place among the ranks holding a head shard: names its ``head_<i>.pt``."""
    parts: Optional[list[tuple[dict[str, Any], dict[str, Any]]]] = None
    """This rank's stage parts: (description, payload)."""
    backbone_stages: Optional[dict[str, Any]] = None
    """``meta.json``'s description of the stage files (a per-stage save)."""


def save_checkpoint(
    root: str | os.PathLike[str],
    step: int,
    *,
    common: dict[str, Any] | None,
    per_rank: dict[str, Any] | None,
    head_tensors: dict[str, torch.Tensor] | None = None,
    head_extras: dict[str, Any] | None = None,
    class_range: range | None = None,
    num_classes: int | None = None,
    head_state: dict[str, Any] | None = None,
    fingerprint: dict[str, Any],
    group: ProcessGroup | None = None,
    keep_last: int | None = None,
    stage_parts: list[StagePart] | None = None,
) -> Path:
    """Atomically save a checkpoint of a class-sharded run; collective over ``group``.

    Every rank of the group must call this with the same ``step``, ``num_classes`` and
    head tensor names/dtypes/row shapes, and class ranges that are contiguous in rank order
    and cover ``[0, num_classes)``. Without torch.distributed initialised it runs as a
    world of one.

    Args:
        root: Directory holding the ``step_*`` checkpoints (created if missing).
        step: Training step (int >= 0); names the directory ``step_<step:08d>``.
        common: State shared by all ranks; only rank 0's is written (None: ``{}``).
        per_rank: This rank's own state (RNG states, ...), or None to write no rank file.
            ``common``, ``per_rank`` and ``head_extras`` may hold only tensors and plain data
            (dict, list, tuple, str, int, float, bool, None, ...): every file then loads with
            ``torch.load(weights_only=True)``; anything else is a ValueError naming it.
        head_tensors: This rank's shard tensors, each with ``shape[0] == len(class_range)``
            (weight, momentum_buffer, exp_avg, exp_avg_sq, ...).
        head_extras: Non-row shard state, equal on all ranks (e.g. Adam's scalar step); None: ``{}``.
        class_range: The class ids this rank holds.
        num_classes: Total number of classes.
        head_state: Instead of the four above: ``{"num_classes", "class_range", "tensors",
            "extras"}``, as :meth:`shardfc.head.ShardedMarginHead.sharded_state` returns it.
        fingerprint: JSON-serialisable dict identifying the model/config; rank 0's is stored
            and checked by :func:`~shardfc.checkpoint.load_checkpoint`.
        group: Process group to save over; None means the default group.
        keep_last: If set, rank 0 deletes all but the newest ``keep_last`` complete
            checkpoints after a successful save (never the one just written).
        stage_parts: This rank's shares of a backbone saved per stage (a pipeline run), each
            written as ``backbone_stage<index>.pt`` unless it is a replica that only verifies
            (:class:`~shardfc.checkpoint.stages.StagePart`); the parts of all ranks must tile
            the model. A rank that passes parts may pass no head arguments: it holds no head
            shard (at least one rank must).

    Returns:
        The final checkpoint directory (same on every rank).

    Raises:
        ValueError: Invalid or cross-rank inconsistent arguments (raised on every rank,
            before anything is written).
        CheckpointError: Writing failed on another rank or while publishing; the failing
            rank re-raises its own exception. Nothing is left under a ``step_*`` name.
    """
    ctx = DistContext.resolve(group)
    root = Path(root)
    separate = dict(num_classes=num_classes, class_range=class_range, tensors=head_tensors, extras=head_extras)

    def prepare():
        blocking = blocking_file(root)  # was NotADirectoryError naming a scratch folder under it, after agreeing
        if blocking is not None:
            raise ValueError(f"root {str(root)!r}: {str(blocking)!r} is a file, not a folder")
        head = _head_arguments(separate, head_state, optional=bool(stage_parts))
        prepared = _prepare(step, keep_last, common, per_rank, head, fingerprint, writes_common=ctx.is_main)
        if stage_parts is not None and not isinstance(stage_parts, (list, tuple)):
            raise ValueError(f"stage_parts must be a list of StagePart, got {type(stage_parts).__name__}")
        parts = [prepare_part(p, f"stage_parts[{i}]") for i, p in enumerate(stage_parts or [])]
        return (*prepared, parts)

    shard = _agree_on_arguments(ctx, step, prepare)
    tmp = root / scratch_dir_name("tmp", step_dir_name(step), shard.token)
    files = _write_rank_files(ctx, shard, tmp, root, common, per_rank)
    final = _publish_from_first(ctx, shard, tmp, root, files)
    if ctx.is_main:
        logger.info("saved checkpoint %s", final)
        # After the broadcast, so the other ranks need not wait for deletions.
        tidy(root, keep_last, final, shard.token, find_checkpoints)
    return final


# --------------------------------------------------------------------------- 1. arguments


def _head_arguments(head: dict[str, Any], head_state: Any, optional: bool = False) -> Optional[dict[str, Any]]:
    """The head shard to save, from ``head_state`` or from the separate arguments (not both);
    None when ``optional`` and none is given."""
    if optional and head_state is None and all(v is None for v in head.values()):
        return None
    if head_state is None:
        if head["tensors"] is None or head["class_range"] is None or head["num_classes"] is None:
            raise ValueError("pass head_state, or head_tensors, class_range and num_classes")
        return dict(head, extras={} if head["extras"] is None else head["extras"])
    given = [f"head_{k}" if k in ("tensors", "extras") else k for k, v in head.items() if v is not None]
    if given:
        raise ValueError(f"pass either head_state or {', '.join(given)}, not both")
    if not isinstance(head_state, dict) or not {"num_classes", "class_range", "tensors"} <= head_state.keys():
        raise ValueError("head_state must be a dict with num_classes, class_range, tensors (and extras)")
    return {k: head_state.get(k, {} if k == "extras" else None) for k in head}


def _prepare(
    step: Any,
    keep_last: Any,
    common: Any,
    per_rank: Any,
    head: Optional[dict[str, Any]],
    fingerprint: Any,
    *,
    writes_common: bool,
) -> tuple[dict[str, Any], dict[str, torch.Tensor], dict[str, Any]]:
    """This rank's arguments checked: ``(shard description, compact CPU tensors, extras)``.

    ``head``: ``{"num_classes", "class_range", "tensors", "extras"}`` of this rank's shard (None:
    it holds none, the description's ``class_range`` is None); ``writes_common``: this rank
    writes ``common`` (rank 0).
    """
    check_int("step", step, 0)
    if keep_last is not None:
        check_int("keep_last", keep_last, 1)
    if head is None:
        head = {"num_classes": None, "class_range": None, "tensors": {}, "extras": {}}
    num_classes, class_range = head["num_classes"], head["class_range"]
    if class_range is not None:
        check_int("num_classes", num_classes, 1)
        check_class_range(class_range, num_classes)
    if common is not None and not isinstance(common, dict):
        raise ValueError(f"common must be a dict or None, got {type(common).__name__}")
    if per_rank is not None and not isinstance(per_rank, dict):
        raise ValueError(f"per_rank must be a dict or None, got {type(per_rank).__name__}")
    # Only what torch.load(weights_only=True) reads back, so that loading never needs to unpickle.
    if writes_common:
        check_plain("common", common)
    check_plain("per_rank", per_rank)
    extras = check_str_keys("head_extras", head["extras"])
    check_plain("head_extras", extras)
    fp = json_roundtrip("fingerprint", check_str_keys("fingerprint", fingerprint))
    tensors = prepare_head_tensors(head["tensors"], len(class_range) if class_range is not None else 0)
    info = {
        "step": step,
        "num_classes": num_classes,
        "class_range": (class_range.start, class_range.stop) if class_range is not None else None,
        "specs": tensor_specs(tensors),
        "extras": sorted(extras),
        "fingerprint": fp,
    }
    return info, tensors, extras


def _failures(statuses: list[dict[str, Any]]) -> list[str]:
    return [f"rank {r}: {s['error']}" for r, s in enumerate(statuses) if s["error"] is not None]


def _agree_on_arguments(ctx: DistContext, step: Any, prepare) -> _Shard:
    """Run ``prepare`` here, then share every rank's verdict: a bad argument on one rank raises on
    every rank (instead of hanging the others in the next collective)."""
    info: Optional[dict[str, Any]] = None
    tensors: dict[str, torch.Tensor] = {}
    extras: dict[str, Any] = {}
    parts: list[tuple[dict[str, Any], dict[str, Any]]] = []
    local_error: Optional[Exception] = None
    try:
        info, tensors, extras, parts = prepare()
    except Exception as e:  # not only ValueError: e.g. a failing device-to-host copy
        local_error = e
    statuses = ctx.all_gather_object(
        {
            "error": None if local_error is None else str(local_error),
            "invalid": isinstance(local_error, ValueError),
            "info": info,
            "parts": [description for description, _ in parts],
            "token": secrets.token_hex(8) if ctx.is_main else None,
        }
    )
    failures = _failures(statuses)
    if failures:
        if local_error is not None:
            raise local_error
        message = f"save_checkpoint of step {step} failed on " + "; ".join(failures)
        if all(s["invalid"] for s in statuses if s["error"]):
            raise ValueError(message)
        raise CheckpointError(message)
    for r, s in enumerate(statuses):
        if s["info"]["step"] != statuses[0]["info"]["step"]:
            raise ValueError(f"step differs across ranks: rank 0 has {statuses[0]['info']['step']!r}, rank {r} has "
                             f"{s['info']['step']!r}")
    # The ranks that hold a head shard, in rank order: ``head_<i>.pt`` numbers them.
    holders = [r for r, s in enumerate(statuses) if s["info"]["class_range"] is not None]
    if not holders:
        raise ValueError("no rank passed a head shard: at least one must")
    infos = [statuses[r]["info"] for r in holders]
    check_consistency(infos)
    backbone_stages = check_parts([s["parts"] for s in statuses])
    assert info is not None
    head_range = info["class_range"]
    return _Shard(
        info["step"], infos[0]["num_classes"], range(*head_range) if head_range is not None else None, tensors,
        extras, infos, statuses[0]["token"], holders.index(ctx.rank) if ctx.rank in holders else None, parts,
        backbone_stages,
    )


# --------------------------------------------------------------------------- 2. files


def _write_rank_files(
    ctx: DistContext,
    shard: _Shard,
    tmp: Path,
    root: Path,
    common: Optional[dict[str, Any]],
    per_rank: Optional[dict[str, Any]],
) -> dict[str, dict[str, Any]]:
    """Write this rank's files into ``tmp``; returns every rank's ``{file: {"size", "sha256"}}``."""
    files: dict[str, dict[str, Any]] = {}
    write_error: Optional[Exception] = None
    try:
        tmp.mkdir(parents=True, exist_ok=True)
        if ctx.is_main:
            files[COMMON_FILE] = save_durable(dict(common or {}), tmp / COMMON_FILE)
        if per_rank is not None:
            files[rank_file(ctx.rank)] = save_durable(per_rank, tmp / rank_file(ctx.rank))
        if shard.head_index is not None:
            head = {
                "class_range": (shard.class_range.start, shard.class_range.stop),
                "tensors": shard.tensors,
                "extras": shard.extras,
            }
            files[head_file(shard.head_index)] = save_durable(head, tmp / head_file(shard.head_index))
        for description, payload in shard.parts or []:
            if description["writes"]:  # a replica's part was only compared (its digest)
                name = stage_file(description["index"])
                files[name] = save_durable(payload, tmp / name)
    except Exception as e:  # report, so that other ranks fail too rather than hang
        write_error = e
    # Doubles as the barrier: every rank has finished writing once this returns.
    statuses = ctx.all_gather_object(
        {"error": None if write_error is None else f"{type(write_error).__name__}: {write_error}", "files": files}
    )
    failures = _failures(statuses)
    if failures:
        if ctx.is_main:
            shutil.rmtree(tmp, ignore_errors=True)
        if write_error is not None:
            raise write_error
        raise CheckpointError(f"saving checkpoint step {shard.step} under {root} failed on " + "; ".join(failures))
    all_files: dict[str, dict[str, Any]] = {}
    for s in statuses:
        all_files.update(s["files"])
    return all_files


# --------------------------------------------------------------------------- 3. publish


def _publish_from_first(
    ctx: DistContext, shard: _Shard, tmp: Path, root: Path, files: dict[str, dict[str, Any]]
) -> Path:
    """Rank 0 writes ``meta.json`` and renames ``tmp`` to the step directory; every rank learns how it went."""
    final = root / step_dir_name(shard.step)
    publish_error: Optional[Exception] = None
    if ctx.is_main:
        try:
            for fname, entry in files.items():
                # Catches a rank whose writes are not visible here (e.g. root not shared).
                check_file(tmp / fname, entry, check_hash=False)
            first = shard.infos[0]
            meta = build_meta(
                step=shard.step,
                num_classes=shard.num_classes,
                class_ranges=[tuple(i["class_range"]) for i in shard.infos],
                specs=first["specs"],
                extras=first["extras"],
                fingerprint=first["fingerprint"],
                files=files,
                backbone_stages=shard.backbone_stages,
            )
            # meta.json last: its presence marks a checkpoint whose other files are complete.
            write_bytes_durable(tmp / META_FILE, json.dumps(meta, indent=2).encode())
            fsync_dir(tmp)
            publish(tmp, final, shard.token)
            fsync_dir(root)
        except Exception as e:
            publish_error = e
            shutil.rmtree(tmp, ignore_errors=True)
    error = None if publish_error is None else f"{type(publish_error).__name__}: {publish_error}"
    verdict = ctx.broadcast_object(error)
    if publish_error is not None:
        raise publish_error
    if verdict is not None:
        raise CheckpointError(f"publishing checkpoint step {shard.step} under {root} failed on rank 0: {verdict}")
    return final
