"""Reading checkpoints back: verify one, read its replicated part, or load the head rows of any class range."""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import torch

from shardfc.checkpoint.durable import check_file
from shardfc.checkpoint.format import (
    COMMON_FILE,
    META_FILE,
    CheckpointError,
    head_file,
    rank_file,
    read_meta,
    short_repr,
)
from shardfc.checkpoint.validation import check_class_range, check_str_keys, json_roundtrip
from shardfc.checkpoint.weights_only import load_pt
from shardfc.checks import check_int
from shardfc.parallel.context import DistContext

__all__ = ["LoadedCheckpoint", "verify_checkpoint", "load_common", "load_checkpoint", "load_file"]


@dataclass
class LoadedCheckpoint:
    """What :func:`load_checkpoint` returns for one rank.

    Attributes:
        step: Training step the checkpoint was saved at.
        common: The dict rank 0 saved as ``common`` (``{}`` if it passed None).
        per_rank: The dict saved by the rank with this rank's index, or None if the
            saved run had no such rank or that rank saved no per-rank dict.
        head_tensors: ``{name: tensor}`` holding exactly the rows of the requested class range.
        head_extras: Non-row head state (equal across saved shards), e.g. Adam's ``step``.
        meta: The parsed ``meta.json``.
        path: The checkpoint directory.
        class_range: The class range the head rows were loaded for.
    """

    step: int
    common: dict[str, Any]
    per_rank: Optional[dict[str, Any]]
    head_tensors: dict[str, torch.Tensor]
    head_extras: dict[str, Any]
    meta: dict[str, Any]
    path: Path
    class_range: range = range(0)

    @property
    def head_state(self) -> dict[str, Any]:
        """The head rows as ``{"num_classes", "class_range", "tensors", "extras"}``: what
        :meth:`shardfc.head.ShardedMarginHead.load_sharded_state` takes."""
        return {
            "num_classes": self.meta["num_classes"],
            "class_range": self.class_range,
            "tensors": self.head_tensors,
            "extras": self.head_extras,
        }


def verify_checkpoint(path: str | os.PathLike[str], *, check_hashes: bool = True) -> dict[str, Any]:
    """Check that ``path`` is a complete checkpoint and return its parsed ``meta.json``.

    Every file listed in ``meta.json`` must exist with the recorded size and, if
    ``check_hashes``, the recorded sha256 (this reads every file).

    Raises:
        CheckpointError: Naming the first missing, truncated or corrupt file.
    """
    path = Path(path)
    meta = read_meta(path)
    for fname, entry in meta["files"].items():
        check_file(path / fname, entry, check_hash=check_hashes)
    return meta


def load_file(
    path: Path, fname: str, meta: Mapping[str, Any], map_location: Any, verify: bool, trust_pickle: bool,
    mmap: bool = False,
) -> Any:
    """Check ``path/fname`` against ``meta.json`` (size always, sha256 if ``verify``) and read it
    with ``weights_only=True`` (see :func:`~shardfc.checkpoint.weights_only.load_pt`), memory-mapped
    if ``mmap``."""
    fpath = path / fname
    entry = meta["files"].get(fname)
    if entry is None:
        raise CheckpointError(f"{path / META_FILE} does not list {fname}")
    check_file(fpath, entry, check_hash=verify)
    return load_pt(fpath, map_location, trust_pickle=trust_pickle, meta=meta, mmap=mmap, follow_symlinks=False)


def load_common(
    path: str | os.PathLike[str], map_location: Any = "cpu", *, trust_pickle: bool = False
) -> tuple[dict[str, Any], dict[str, Any]]:
    """``(common dict, meta)`` of a checkpoint without reading its head shards.

    For inference tools: the head shards can be gigabytes. Every listed file must be present at
    its recorded size; ``common.pt`` is also hash-checked. ``trust_pickle``: as for
    :func:`load_checkpoint`.

    Raises:
        CheckpointError: The checkpoint is incomplete, or ``common.pt`` is corrupt, unreadable or
            needs full unpickling without ``trust_pickle``.
    """
    path = Path(path)
    meta = verify_checkpoint(path, check_hashes=False)
    common = load_file(path, COMMON_FILE, meta, map_location, verify=True, trust_pickle=trust_pickle)
    if not isinstance(common, dict):
        raise CheckpointError(f"{path / COMMON_FILE} does not hold a dict (got {type(common).__name__})")
    return common, meta


#: The most values :func:`objects_equal` visits: saved extras and parameter groups hold a few dozen;
#: a crafted file's shared subtrees can stand for 2^40 of them.
COMPARE_BUDGET = 100_000


def objects_equal(a: Any, b: Any, where: str = "the saved values", budget: int = COMPARE_BUDGET) -> bool:
    """Whether saved structures ``a`` and ``b`` (tensors, plain data) are equal, visiting at most
    ``budget`` values: beyond that a CheckpointError naming ``where`` (a crafted file's shared
    subtrees would otherwise make the comparison endless)."""
    stack = [(a, b)]
    visited = 0
    while stack:
        a, b = stack.pop()
        visited += 1
        if visited > budget:
            raise CheckpointError(f"{where} are too large to compare (more than {budget} values)")
        if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
            if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.dtype == b.dtype
                    and a.shape == b.shape and torch.equal(a.cpu(), b.cpu())):
                return False
        elif isinstance(a, Mapping) and isinstance(b, Mapping):
            if a.keys() != b.keys():
                return False
            stack.extend((a[k], b[k]) for k in a)
        elif isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
            if type(a) is not type(b) or len(a) != len(b):
                return False
            stack.extend(zip(a, b))
        else:
            try:
                if not bool(a == b):
                    return False
            except Exception:  # e.g. numpy arrays: ambiguous truth value
                return False
    return True


def _check_fingerprint(saved: Mapping[str, Any], current: Mapping[str, Any], path: Path) -> None:
    current = json_roundtrip("fingerprint", check_str_keys("fingerprint", current))
    missing = object()
    diffs = []
    for key in sorted(set(saved) | set(current)):
        old, new = saved.get(key, missing), current.get(key, missing)
        if old != new:
            old_s = "<missing>" if old is missing else repr(old)
            new_s = "<missing>" if new is missing else repr(new)
            diffs.append(f"{key}: checkpoint={old_s}, this run={new_s}")
    if diffs:
        raise ValueError(f"checkpoint {path} was saved by a different model/config: " + "; ".join(diffs))


def load_checkpoint(
    path: str | os.PathLike[str],
    *,
    class_range: Optional[range],
    num_classes: int,
    fingerprint: Optional[dict[str, Any]] = None,
    map_location: Any = "cpu",
    rank: Optional[int] = None,
    verify: bool = True,
    trust_pickle: bool = False,
    mmap: bool = False,
) -> LoadedCheckpoint:
    """Load the rows of ``class_range`` from a checkpoint saved on any number of ranks.

    Only the saved head files whose class ranges overlap ``class_range`` are read, and their
    row slices are concatenated; no collective is involved, so each rank of a run with a
    different world size loads its own rows independently.

    Args:
        path: Checkpoint directory (``.../step_XXXXXXXX``).
        class_range: Class ids this rank holds now (may be empty); None: this rank holds no head
            (a pipeline stage before the last), no head file is read.
        num_classes: Total classes of this run; must match the checkpoint.
        fingerprint: If given, must equal the saved fingerprint (compared after a JSON round trip).
        map_location: Passed to ``torch.load``.
        rank: Index whose ``rank_<r>.pt`` is returned as ``per_rank``; defaults to this
            process's rank in the default group, or 0 without torch.distributed.
        verify: Check size and sha256 of every file read (size is always checked).
        trust_pickle: Every file is read with ``torch.load(weights_only=True)``; one that needs
            more (checkpoint format 1, or a file not written by shardfc) is refused unless this is
            True, which reads it with full unpickling: that can run arbitrary code, so only for
            checkpoints you trust.
        mmap: Map ``common.pt`` instead of reading it (a rank that needs a part of a whole
            backbone saved there pages in only that part); needs ``map_location`` "cpu".

    Raises:
        ValueError: Bad arguments, ``num_classes`` or fingerprint mismatch.
        CheckpointError: Missing, truncated, corrupt or inconsistent checkpoint files, or a file
            that needs full unpickling without ``trust_pickle``.
    """
    path = Path(path)
    check_int("num_classes", num_classes, 1)
    if class_range is not None:
        check_class_range(class_range, num_classes)
    rank = DistContext.resolve().rank if rank is None else check_int("rank", rank, 0)
    meta = read_meta(path)
    if meta["num_classes"] != num_classes:
        raise ValueError(
            f"checkpoint {path} has num_classes={meta['num_classes']}, this run has num_classes={num_classes}"
        )
    if fingerprint is not None:
        _check_fingerprint(meta["fingerprint"], fingerprint, path)

    common = load_file(path, COMMON_FILE, meta, map_location, verify, trust_pickle, mmap=mmap)
    if not isinstance(common, dict):
        raise CheckpointError(f"{path / COMMON_FILE} does not hold a dict (got {type(common).__name__})")
    per_rank = None
    if rank_file(rank) in meta["files"]:
        per_rank = load_file(path, rank_file(rank), meta, map_location, verify, trust_pickle)
    tensors: dict[str, torch.Tensor] = {}
    extras: dict[str, Any] = {}
    if class_range is not None:
        tensors, extras = _load_head_rows(path, meta, class_range, map_location, verify, trust_pickle)
    return LoadedCheckpoint(
        step=meta["step"],
        common=common,
        per_rank=per_rank,
        head_tensors=tensors,
        head_extras=extras,
        meta=meta,
        path=path,
        class_range=range(0) if class_range is None else class_range,
    )


def _load_head_rows(
    path: Path, meta: Mapping[str, Any], class_range: range, map_location: Any, verify: bool, trust_pickle: bool
) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """The rows of ``class_range`` of every head tensor, from the saved shards that hold them, and the extras."""
    saved = [range(int(a), int(b)) for a, b in meta["class_ranges"]]
    wanted = [i for i, r in enumerate(saved) if r.start < class_range.stop and class_range.start < r.stop]
    if not wanted:
        # Empty request: still need extras and dtypes/devices, so read the smallest shard.
        wanted = [min(range(len(saved)), key=lambda i: meta["files"][head_file(i)]["size"])]
    names = set(meta["head_tensors"])

    # Per tensor: the row slices taken from each shard read, plus the shard tensor when the
    # slice is all of it (so a single fully used shard needs no copy).
    pieces: dict[str, list[torch.Tensor]] = {n: [] for n in sorted(names)}
    whole: dict[str, torch.Tensor] = {}
    extras: Optional[dict[str, Any]] = None
    extras_from = -1
    for i in wanted:
        fname = head_file(i)
        head = load_file(path, fname, meta, map_location, verify, trust_pickle)
        if not (isinstance(head, dict) and {"class_range", "tensors", "extras"} <= head.keys()):
            raise CheckpointError(f"{path / fname} is not a head shard file")
        if not (isinstance(head["class_range"], (tuple, list)) and isinstance(head["tensors"], dict)
                and isinstance(head["extras"], dict)):
            raise CheckpointError(f"{path / fname} is not a head shard file")
        if tuple(head["class_range"]) != (saved[i].start, saved[i].stop):
            raise CheckpointError(
                f"{path / fname} holds class_range={short_repr(head['class_range'])} but meta.json records "
                f"{(saved[i].start, saved[i].stop)}"
            )
        if set(head["tensors"]) != names:
            raise CheckpointError(
                f"{path / fname} holds tensors {short_repr(sorted(map(str, head['tensors'])))}, meta.json lists "
                f"{short_repr(sorted(names))}"
            )
        lo = max(class_range.start, saved[i].start) - saved[i].start
        hi = max(min(class_range.stop, saved[i].stop) - saved[i].start, lo)
        for name, t in head["tensors"].items():
            row_shape = meta["head_tensors"][name].get("row_shape") if isinstance(meta["head_tensors"][name], dict) \
                else None
            if not isinstance(t, torch.Tensor) or t.dim() < 1 or list(t.shape[1:]) != row_shape:
                raise CheckpointError(
                    f"{path / fname}: {name!r} is not a tensor of rows {row_shape} as meta.json records (got "
                    f"{short_repr(list(t.shape) if isinstance(t, torch.Tensor) else t)})"
                )
            if t.shape[0] != len(saved[i]):
                raise CheckpointError(
                    f"{path / fname}: tensor {name!r} has {t.shape[0]} rows, its class range has {len(saved[i])}"
                )
            pieces[name].append(t[lo:hi])
            if lo == 0 and hi == t.shape[0]:
                whole[name] = t
        if extras is None:
            extras, extras_from = head["extras"], i
        elif not objects_equal(extras, head["extras"], f"the head extras of {path / fname}"):
            raise CheckpointError(
                f"head extras differ between saved shards {extras_from} and {i} of {path}: "
                f"{short_repr(extras)} vs {short_repr(head['extras'])}"
            )

    tensors: dict[str, torch.Tensor] = {}
    for name, parts in pieces.items():
        # Otherwise cat copies, which also releases the unused rows of partially read shards.
        tensors[name] = whole[name] if len(parts) == 1 and name in whole else torch.cat(parts)
    return tensors, dict(extras or {})
