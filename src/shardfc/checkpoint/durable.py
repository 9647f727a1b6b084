"""Durable, atomic file operations of a save: hashed writes, fsync, publishing by rename, tidying up.

All ranks write into ``<root>/.tmp-step_<step:08d>-<token>`` (the token comes from rank 0 of the
group), flushing and fsyncing every file. After every rank reports success, rank 0 writes
``meta.json`` last, fsyncs it and the directory, and renames the directory to ``step_<step:08d>``
with one ``os.replace``, then fsyncs ``root``. An existing directory for the same step is swapped
with the new one in one atomic ``renameat2(RENAME_EXCHANGE)`` (Linux), then deleted; where the OS
or the filesystem cannot swap, it is first moved aside to ``.old-*``, and a crash between the two
renames leaves that previous save there with no ``step_*`` directory: :func:`restore_replaced`
(the trainer's resume and every save's tidying call it) renames it back. A crash at any point
therefore leaves earlier checkpoints in place and never leaves a partial directory under a
``step_*`` name; leftover ``.tmp-*``/``.old-*``/``.del-*`` directories are removed by the next
successful save. Pruning (``keep_last``) renames a
checkpoint away before deleting it for the same reason. With several nodes, ``root`` must be on a
filesystem shared by all ranks.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import shutil
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, BinaryIO, Optional

import torch

from shardfc.checkpoint.format import (
    META_FILE,
    CheckpointError,
    is_scratch_dir,
    open_regular,
    regular_file,
    replaced_dirs,
    scratch_dir_name,
)

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


_AT_FDCWD = -100  # <fcntl.h>: paths relative to the working directory
_RENAME_EXCHANGE = 2  # <linux/fs.h>


@functools.cache
def _renameat2() -> Any:
    """libc's ``renameat2`` (Linux, glibc 2.28 and later), or None."""
    try:
        fn = ctypes.CDLL(None, use_errno=True).renameat2
    except (AttributeError, OSError, TypeError):  # no such symbol; no libc by that name (Windows: TypeError)
        return None
    fn.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    fn.restype = ctypes.c_int
    return fn


def exchange(a: Path, b: Path) -> bool:
    """Swap the existing paths ``a`` and ``b`` in one atomic step; False, and nothing moved, where that
    failed: an OS or a filesystem that cannot swap (NFS, some FUSE and container sandboxes answer
    EINVAL, ENOSYS, EOPNOTSUPP or EPERM), or any other error, which the caller's plain renames then
    meet and report."""
    fn, a_bytes, b_bytes = _renameat2(), os.fsencode(a), os.fsencode(b)
    if fn is None or b"\0" in a_bytes + b_bytes:  # a C string ends at a NUL: it would name another path
        return False
    return fn(_AT_FDCWD, a_bytes, _AT_FDCWD, b_bytes, _RENAME_EXCHANGE) == 0


def publish(tmp: Path, final: Path, token: str) -> None:
    """Rename the finished temp dir to its final name, replacing an older save of the same step."""
    if not final.exists():
        os.replace(tmp, final)
        return
    # os.replace cannot replace a non-empty directory. Swapped, the previous save is under the
    # scratch name at once (no moment without a step_* directory); then it is deleted.
    if exchange(tmp, final):
        shutil.rmtree(tmp, ignore_errors=True)
        return
    # No swap here: move the old one aside first (restore_replaced puts it back after a crash).
    old = final.with_name(scratch_dir_name("old", final.name, token))
    os.replace(final, old)
    try:
        os.replace(tmp, final)
    except OSError:
        os.replace(old, final)  # put the previous save of this step back
        raise
    shutil.rmtree(old, ignore_errors=True)


def restore_replaced(root: Path) -> list[Path]:
    """Rename back each previous save that a publish crashed after moving aside (an ``.old-step_N-*``
    directory holding ``meta.json`` with no ``step_N`` beside it); returns the restored paths.

    Only one process may call it (rank 0), with no save in progress: the trainer's resume and
    :func:`tidy` do.
    """
    restored = []
    for name, entry in replaced_dirs(root):
        if not (entry / META_FILE).is_file():
            continue
        step_dir = root / name
        if os.path.lexists(step_dir):
            continue
        os.replace(entry, step_dir)
        logger.warning("restored %s from %s, where a save of the same step was interrupted", step_dir, entry.name)
        restored.append(step_dir)
    return restored


def tidy(root: Path, keep_last: Optional[int], current: Path, token: str,
         find_checkpoints: Callable[[Path], Sequence[Path]]) -> None:
    """After a successful save: restore a step a crashed save left aside (:func:`restore_replaced`),
    prune old checkpoints (``find_checkpoints(root)``, oldest first) and remove leftovers of crashed saves.

    Failures only log: the new checkpoint is already committed. A failed restore deletes nothing.
    """
    try:
        restore_replaced(root)  # before the scratch folders go: one may hold the only copy of a step
        checkpoints = find_checkpoints(root) if keep_last is not None else []  # a restored step counts
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
