"""Finding checkpoints under a root: all of them, the newest valid one, the one ``--resume`` names."""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Optional

from shardfc.checkpoint.format import META_FILE, CheckpointError, parse_step_dir, replaced_dirs, step_dirs
from shardfc.checkpoint.load import verify_checkpoint

__all__ = ["checkpoint_at", "find_checkpoints", "latest_checkpoint", "resolve_resume"]

logger = logging.getLogger("shardfc.checkpoint")


def find_checkpoints(root: str | os.PathLike[str]) -> list[Path]:
    """Return the ``step_*`` directories under ``root`` that have a ``meta.json``, oldest first.

    This does not check file sizes or hashes; see :func:`latest_checkpoint`.
    """
    return [p for _, p in step_dirs(root) if (p / META_FILE).is_file()]


def latest_checkpoint(root: str | os.PathLike[str], *, check_hashes: bool = True) -> Optional[Path]:
    """Return the newest valid checkpoint under ``root``, or None.

    Invalid ones (no/unparseable ``meta.json``, missing or truncated files, hash mismatch)
    are skipped with a warning on logger ``shardfc.checkpoint``. A step that a crashed save of the
    same step left only under its ``.old-`` scratch name (where the filesystem cannot swap two
    folders) counts, under that name, after the step's own folder if there is one: the next save, or
    the trainer's resume, renames it back (:func:`~shardfc.checkpoint.durable.restore_replaced`);
    this function only reads.
    """
    for _, path in reversed(_with_replaced(root)):
        try:
            verify_checkpoint(path, check_hashes=check_hashes)
        except CheckpointError as e:
            logger.warning("skipping invalid checkpoint %s: %s", path, e)
            continue
        return path
    return None


def _with_replaced(root: str | os.PathLike[str]) -> list[tuple[int, Path]]:
    """:func:`step_dirs` and the ``.old-step_N-*`` folders, by step; of one step, the step folder last
    (the newer save: a copy moved aside is read only where the step folder is missing or invalid)."""
    found = [(step, 1, path) for step, path in step_dirs(root)]
    found += [(parse_step_dir(name), 0, entry) for name, entry in replaced_dirs(root)]
    return [(step, path) for step, _, path in sorted(found)]


def checkpoint_at(path: str | os.PathLike[str], *, check_hashes: bool = True) -> Optional[Path]:
    """The checkpoint ``path`` names, or None: the folder itself when it holds ``meta.json``
    (verified, its hashes only with ``check_hashes``; an incomplete one raises
    :class:`CheckpointError`), else the newest complete one in a run folder (``path/checkpoints``,
    as ``shardfc train`` writes) or a checkpoint root (``path``). What ``--init-from`` and
    ``--checkpoint`` accept."""
    p = Path(path).expanduser()
    if (p / META_FILE).is_file():
        verify_checkpoint(p, check_hashes=check_hashes)
        return p
    for root in (p / "checkpoints", p):
        found = latest_checkpoint(root) if root.is_dir() else None
        if found is not None:
            return found
    return None


def resolve_resume(root: str | os.PathLike[str] | None, resume: str | os.PathLike[str] | None) -> Optional[Path]:
    """Turn a ``--resume`` value into a checkpoint directory.

    Args:
        root: The run's checkpoint directory (used by ``"auto"`` and for relative names).
        resume: ``"auto"``: the latest valid checkpoint under ``root`` (None if there is
            none); ``"none"``, ``""`` or None: None; anything else: a checkpoint directory,
            absolute, relative to the working directory, or relative to ``root``, or a run
            folder (or a checkpoint root): its newest complete checkpoint, as ``--init-from``
            and ``--checkpoint`` take them.

    Raises:
        FileNotFoundError: ``resume`` names a directory that does not exist.
        CheckpointError: The named checkpoint is incomplete or corrupt, or the folder holds none.
    """
    key = "" if resume is None else os.fspath(resume).strip()
    if key.lower() in ("", "none"):
        return None
    if key.lower() == "auto":
        if root is None:
            raise ValueError("resume='auto' needs a checkpoint root, got root=None")
        return latest_checkpoint(root)
    path = Path(key).expanduser()
    if not path.exists() and not path.is_absolute() and root is not None and (Path(root) / path).exists():
        path = Path(root) / path
    if not path.is_dir():
        raise FileNotFoundError(f"resume={key!r}: no checkpoint directory at {path} (resume is 'auto', 'none', a "
                                "checkpoint folder or a run folder)")
    found = checkpoint_at(path)  # the checkpoint itself (verified), or the newest complete one of a run folder
    if found is None:
        raise CheckpointError(f"resume={key!r}: {path} is neither a checkpoint (it has no {META_FILE}) nor a run "
                              "folder holding complete ones")
    return found
