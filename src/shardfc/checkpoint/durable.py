"""Durable, atomic file operations of a save: hashed writes, fsync, publishing by rename, tidying up.

All ranks write into ``<root>/.tmp-step_<step:08d>-<token>`` (the token comes from rank 0 of the
group), flushing and fsyncing every file. After every rank reports success, rank 0 writes
``meta.json`` last, fsyncs it and the directory, and renames the directory to ``step_<step:08d>``
with one ``os.replace`` (an existing directory for the same step is first moved aside, then
deleted), then fsyncs ``root``. A crash at any point therefore leaves earlier checkpoints untouched
and never leaves a partial directory under a ``step_*`` name; leftover ``.tmp-*``/``.old-*``/
``.del-*`` directories are removed by the next successful save. Pruning (``keep_last``) renames a
checkpoint away before deleting it for the same reason. With several nodes, ``root`` must be on a
filesystem shared by all ranks.
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, BinaryIO, Optional

import torch

from shardfc.checkpoint.format import CheckpointError, is_scratch_dir, open_regular, regular_file, scratch_dir_name

logger = logging.getLogger("shardfc.checkpoint")

_HASH_CHUNK = 1 << 22


class _HashingWriter:
    """File-like wrapper that hashes bytes as torch.save writes them (saves re-reading the file)."""

    def __init__(self, f: BinaryIO) -> None:
        self._f = f
        self.sha256 = hashlib.sha256()
        self.size = 0

    def write(self, data: bytes) -> int:
        self.sha256.update(data)
        self.size += len(data)
        return self._f.write(data)

    def flush(self) -> None:
        self._f.flush()


def sha256_file(path: Path) -> str:
    """The sha256 of regular file ``path`` (anything else is refused: see
    :func:`~shardfc.checkpoint.format.open_regular`)."""
    h = hashlib.sha256()
    with open_regular(path) as f:
        while chunk := f.read(_HASH_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def save_durable(obj: Any, path: Path) -> dict[str, Any]:
    """torch.save ``obj`` to a new file, fsync it, and return its ``{"size", "sha256"}``."""
    with open(path, "xb") as f:
        writer = _HashingWriter(f)
        torch.save(obj, writer)
        f.flush()
        os.fsync(f.fileno())
        size = os.fstat(f.fileno()).st_size
    # Only trust the streamed hash if the bytes seen are exactly the bytes on disk.
    digest = writer.sha256.hexdigest() if writer.size == size else sha256_file(path)
    return {"size": size, "sha256": digest}


def write_bytes_durable(path: Path, data: bytes) -> None:
    with open(path, "xb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def fsync_dir(path: Path) -> None:
    """fsync a directory so renames/creations in it survive a power loss (best effort)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:  # e.g. Windows cannot open directories
        return
    try:
        os.fsync(fd)
    except OSError as e:
        logger.warning("fsync of directory %s failed: %s", path, e)
    finally:
        os.close(fd)


def check_file(path: Path, entry: Mapping[str, Any], check_hash: bool) -> None:
    """Raise CheckpointError unless ``path`` is a regular file (not a symlink, FIFO or device: checked
    with ``lstat`` first) with the size (and sha256) recorded in meta.json."""
    size = regular_file(path).st_size
    expected = entry.get("size")
    if size != expected:
        raise CheckpointError(
            f"checkpoint file {path} is truncated or corrupt: {size} bytes on disk, meta.json records {expected}"
        )
    if check_hash and entry.get("sha256"):
        digest = sha256_file(path)
        if digest != entry["sha256"]:
            raise CheckpointError(
                f"checkpoint file {path} is corrupt: sha256 {digest} does not match {entry['sha256']} in meta.json"
            )


def publish(tmp: Path, final: Path, token: str) -> None:
    """Rename the finished temp dir to its final name, replacing an older save of the same step."""
    if not final.exists():
        os.replace(tmp, final)
        return
    # os.replace cannot replace a non-empty directory: move the old one aside first.
    old = final.with_name(scratch_dir_name("old", final.name, token))
    os.replace(final, old)
    try:
        os.replace(tmp, final)
    except OSError:
        os.replace(old, final)  # put the previous save of this step back
        raise
    shutil.rmtree(old, ignore_errors=True)


def tidy(root: Path, keep_last: Optional[int], current: Path, token: str, checkpoints: Sequence[Path]) -> None:
    """After a successful save: prune old ``checkpoints`` (oldest first) and remove leftovers of crashed saves.

    Failures only log: the new checkpoint is already committed.
    """
    try:
        if keep_last is not None:
            for path in checkpoints[: max(len(checkpoints) - keep_last, 0)]:
                if path == current:
                    continue
                # Rename first so a crash mid-delete never leaves a partial step_* directory.
                trash = root / scratch_dir_name("del", path.name, token)
                os.replace(path, trash)
                shutil.rmtree(trash, ignore_errors=True)
                logger.info("pruned checkpoint %s (keep_last=%d)", path, keep_last)
        # Saves are collective and serialised, so any other scratch dir is from a crashed save.
        for entry in root.iterdir():
            if is_scratch_dir(entry.name) and entry.is_dir():
                shutil.rmtree(entry, ignore_errors=True)
                logger.info("removed leftover %s", entry)
    except OSError as e:
        logger.warning("cleaning up old checkpoints under %s failed: %s", root, e)
