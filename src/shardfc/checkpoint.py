"""Atomic, resharding checkpoints for training with a class-sharded classifier head.

A run on W ranks saves every rank's head shard (weights and optimizer rows) as its own
file; a later run on any W' ranks loads only the rows of its own class range, so the
world size can change between save and resume without any collective at load time.

On-disk format (``format_version`` 1)
=====================================

::

    <root>/step_<step:08d>/
        meta.json     written last, by rank 0 (see below)
        common.pt     torch.save(dict) from rank 0: backbone, scheduler, scaler, config, ...
        rank_<r>.pt   torch.save(dict) from rank r, only if it passed ``per_rank``: RNG states, ...
        head_<r>.pt   torch.save({"class_range": (start, stop),
                                  "tensors": {name: Tensor with shape[0] == stop - start},
                                  "extras": {name: object}})   # e.g. Adam's scalar "step"

``meta.json`` holds::

    {"format": "shardfc-checkpoint", "format_version": 1,
     "step": int, "world_size": int, "num_classes": int,
     "embedding_dim": int | null,             # row width of the head weight, informative
     "class_ranges": [[start, stop], ...],    # one per saved rank, in rank order
     "head_tensors": {name: {"dtype": "float32", "row_shape": [D, ...]}},
     "head_extras": [name, ...],
     "fingerprint": {...},                    # caller's JSON dict (model name, config, ...)
     "files": {file_name: {"size": bytes, "sha256": hex}},
     "torch_version": str, "created_unix": float}

Atomicity
=========

All ranks write into ``<root>/.tmp-step_<step:08d>-<token>`` (the token comes from
rank 0 of the group), flushing and fsyncing every file. After every rank reports success,
rank 0 writes ``meta.json`` last, fsyncs it and the directory, and renames the directory
to ``step_<step:08d>`` with one ``os.replace`` (an existing directory for the same step
is first moved aside, then deleted), then fsyncs ``root``. A crash at any point therefore
leaves earlier checkpoints untouched and never leaves a partial directory under a
``step_*`` name; leftover ``.tmp-*``/``.old-*``/``.del-*`` directories are removed by the
next successful save. Pruning (``keep_last``) renames a checkpoint away before deleting it
for the same reason. With several nodes, ``root`` must be on a filesystem shared by all
ranks.

``.pt`` files are read with ``torch.load(weights_only=False)`` because ``common`` and
``per_rank`` hold arbitrary picklable objects: only load checkpoints you trust.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import secrets
import shutil
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, BinaryIO

import torch

from shardfc.parallel.context import DistContext

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

__all__ = [
    "FORMAT_VERSION",
    "CheckpointError",
    "LoadedCheckpoint",
    "save_checkpoint",
    "load_checkpoint",
    "load_common",
    "find_checkpoints",
    "latest_checkpoint",
    "verify_checkpoint",
    "resolve_resume",
    "step_dir_name",
]

logger = logging.getLogger("shardfc.checkpoint")

FORMAT_NAME = "shardfc-checkpoint"
FORMAT_VERSION = 1
META_FILE = "meta.json"
COMMON_FILE = "common.pt"

_STEP_DIR_RE = re.compile(r"^step_(\d+)$")
_SCRATCH_DIR_RE = re.compile(r"^\.(tmp|old|del)-step_\d+-(?P<token>[0-9a-f]+)$")
_HASH_CHUNK = 1 << 22


class CheckpointError(RuntimeError):
    """A checkpoint is missing, truncated, corrupt or inconsistent, or a save failed on another rank."""


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
    """

    step: int
    common: dict[str, Any]
    per_rank: dict[str, Any] | None
    head_tensors: dict[str, torch.Tensor]
    head_extras: dict[str, Any]
    meta: dict[str, Any]
    path: Path


def step_dir_name(step: int) -> str:
    """Directory name of the checkpoint for ``step`` (``step_00001234``)."""
    return f"step_{step:08d}"


def _head_file(rank: int) -> str:
    return f"head_{rank}.pt"


def _rank_file(rank: int) -> str:
    return f"rank_{rank}.pt"


# --------------------------------------------------------------------------- collectives


class _Comm:
    """The few collectives a save needs, through the group's DistContext (torch.distributed, or
    Horovod's world when no torch group exists); a no-op world of one without either."""

    def __init__(self, group: ProcessGroup | None) -> None:
        self.ctx = DistContext.resolve(group)
        self.distributed, self.group = self.ctx.distributed, group
        self.rank, self.world_size = self.ctx.rank, self.ctx.world_size

    def all_gather(self, obj: Any) -> list[Any]:
        return self.ctx.all_gather_object(obj)

    def broadcast_from_first(self, obj: Any) -> Any:
        return self.ctx.broadcast_object(obj)


def _default_rank() -> int:
    return DistContext.resolve().rank


# --------------------------------------------------------------------------- file helpers


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


def _sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_HASH_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def _save_durable(obj: Any, path: Path) -> dict[str, Any]:
    """torch.save ``obj`` to a new file, fsync it, and return its size and sha256."""
    with open(path, "xb") as f:
        writer = _HashingWriter(f)
        torch.save(obj, writer)
        f.flush()
        os.fsync(f.fileno())
        size = os.fstat(f.fileno()).st_size
    # Only trust the streamed hash if the bytes seen are exactly the bytes on disk.
    digest = writer.sha256.hexdigest() if writer.size == size else _sha256_file(path)
    return {"size": size, "sha256": digest}


def _write_bytes_durable(path: Path, data: bytes) -> None:
    with open(path, "xb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def _fsync_dir(path: Path) -> None:
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


def _check_file(path: Path, entry: Mapping[str, Any], check_hash: bool) -> None:
    """Raise CheckpointError unless ``path`` has the size (and sha256) recorded in meta.json."""
    try:
        size = path.stat().st_size
    except FileNotFoundError:
        raise CheckpointError(f"checkpoint file {path} is missing") from None
    expected = entry.get("size")
    if size != expected:
        raise CheckpointError(
            f"checkpoint file {path} is truncated or corrupt: {size} bytes on disk, meta.json records {expected}"
        )
    if check_hash and entry.get("sha256"):
        digest = _sha256_file(path)
        if digest != entry["sha256"]:
            raise CheckpointError(
                f"checkpoint file {path} is corrupt: sha256 {digest} does not match {entry['sha256']} in meta.json"
            )


# --------------------------------------------------------------------------- validation


def _check_int(name: str, value: Any, minimum: int) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise ValueError(f"{name} must be an int >= {minimum}, got {value!r}")
    return value


def _check_class_range(class_range: Any, num_classes: int) -> range:
    if not isinstance(class_range, range) or class_range.step != 1:
        raise ValueError(f"class_range must be a range with step 1, got {class_range!r}")
    if not 0 <= class_range.start <= class_range.stop <= num_classes:
        raise ValueError(f"class_range={class_range!r} must lie within [0, num_classes={num_classes}]")
    return class_range


def _check_str_keys(name: str, value: Any) -> dict[str, Any]:
    if not isinstance(value, Mapping):
        raise ValueError(f"{name} must be a dict, got {type(value).__name__}")
    bad = [k for k in value if not isinstance(k, str)]
    if bad:
        raise ValueError(f"{name} keys must be str, got {bad[0]!r}")
    return dict(value)


def _json_roundtrip(name: str, value: Any) -> Any:
    """Normalise through JSON (tuples -> lists) so saved and live values compare equal."""
    try:
        return json.loads(json.dumps(value))
    except (TypeError, ValueError) as e:
        raise ValueError(f"{name} must be JSON-serialisable: {e}") from e


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _prepare_head_tensors(head_tensors: Any, rows: int) -> dict[str, torch.Tensor]:
    """Validate shard tensors and make them compact CPU tensors.

    torch.save writes a view's whole storage, so views are copied to store only their rows.
    """
    tensors = _check_str_keys("head_tensors", head_tensors)
    out: dict[str, torch.Tensor] = {}
    for name, t in tensors.items():
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"head_tensors[{name!r}] must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() < 1 or t.shape[0] != rows:
            raise ValueError(
                f"head_tensors[{name!r}] has shape {tuple(t.shape)}; its first dim must equal "
                f"len(class_range)={rows}"
            )
        t = t.detach()
        if t.device.type != "cpu":
            t = t.cpu()
        elif not (
            t.is_contiguous()
            and t.storage_offset() == 0
            and t.untyped_storage().nbytes() == t.numel() * t.element_size()
        ):
            t = t.clone(memory_format=torch.contiguous_format)
        out[name] = t
    return out


def _embedding_dim(specs: Mapping[str, Mapping[str, Any]]) -> int | None:
    """Row width of the head: that of "weight" if present, else of the first tensor by name."""
    names = (["weight"] if "weight" in specs else []) + sorted(specs)
    for name in names:
        row_shape = specs[name]["row_shape"]
        if row_shape:
            return int(row_shape[-1])
    return None


def _check_consistency(infos: list[dict[str, Any]]) -> None:
    """Cross-rank checks, run identically on every rank so all ranks raise together."""
    first = infos[0]
    expected_start = 0
    for r, info in enumerate(infos):
        for key in ("step", "num_classes"):
            if info[key] != first[key]:
                raise ValueError(f"{key} differs across ranks: rank 0 has {first[key]!r}, rank {r} has {info[key]!r}")
        start, stop = info["class_range"]
        if start != expected_start:
            raise ValueError(
                f"class ranges must be contiguous in rank order: rank {r} has class_range=range({start}, {stop}) "
                f"but the previous rank ends at {expected_start}"
            )
        expected_start = stop
        if info["specs"] != first["specs"]:
            raise ValueError(
                f"head_tensors differ across ranks: rank 0 has {first['specs']!r}, rank {r} has {info['specs']!r}"
            )
        if info["extras"] != first["extras"]:
            raise ValueError(
                f"head_extras names differ across ranks: rank 0 has {first['extras']!r}, "
                f"rank {r} has {info['extras']!r}"
            )
    if expected_start != first["num_classes"]:
        raise ValueError(
            f"class ranges of all ranks cover [0, {expected_start}) but num_classes={first['num_classes']}"
        )


def _failure_summary(statuses: list[dict[str, Any]]) -> list[str]:
    return [f"rank {r}: {s['error']}" for r, s in enumerate(statuses) if s["error"] is not None]


# --------------------------------------------------------------------------- save


def save_checkpoint(
    root: str | os.PathLike[str],
    step: int,
    *,
    common: dict[str, Any] | None,
    per_rank: dict[str, Any] | None,
    head_tensors: dict[str, torch.Tensor],
    head_extras: dict[str, Any],
    class_range: range,
    num_classes: int,
    fingerprint: dict[str, Any],
    group: ProcessGroup | None = None,
    keep_last: int | None = None,
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
        head_tensors: This rank's shard tensors, each with ``shape[0] == len(class_range)``
            (weight, momentum_buffer, exp_avg, exp_avg_sq, ...).
        head_extras: Non-row shard state, equal on all ranks (e.g. Adam's scalar step).
        class_range: The class ids this rank holds.
        num_classes: Total number of classes.
        fingerprint: JSON-serialisable dict identifying the model/config; rank 0's is stored
            and checked by :func:`load_checkpoint`.
        group: Process group to save over; None means the default group.
        keep_last: If set, rank 0 deletes all but the newest ``keep_last`` complete
            checkpoints after a successful save (never the one just written).

    Returns:
        The final checkpoint directory (same on every rank).

    Raises:
        ValueError: Invalid or cross-rank inconsistent arguments (raised on every rank,
            before anything is written).
        CheckpointError: Writing failed on another rank or while publishing; the failing
            rank re-raises its own exception. Nothing is left under a ``step_*`` name.
    """
    comm = _Comm(group)
    root = Path(root)

    # Validate locally, but share the verdict through the first collective so a bad
    # argument on one rank raises on every rank instead of hanging the others.
    info: dict[str, Any] | None = None
    local_error: Exception | None = None
    prepared: dict[str, torch.Tensor] = {}
    extras: dict[str, Any] = {}
    try:
        _check_int("step", step, 0)
        _check_int("num_classes", num_classes, 1)
        if keep_last is not None:
            _check_int("keep_last", keep_last, 1)
        _check_class_range(class_range, num_classes)
        if common is not None and not isinstance(common, dict):
            raise ValueError(f"common must be a dict or None, got {type(common).__name__}")
        if per_rank is not None and not isinstance(per_rank, dict):
            raise ValueError(f"per_rank must be a dict or None, got {type(per_rank).__name__}")
        extras = _check_str_keys("head_extras", head_extras)
        fp = _json_roundtrip("fingerprint", _check_str_keys("fingerprint", fingerprint))
        prepared = _prepare_head_tensors(head_tensors, len(class_range))
        info = {
            "step": step,
            "num_classes": num_classes,
            "class_range": (class_range.start, class_range.stop),
            "specs": {
                n: {"dtype": _dtype_name(t.dtype), "row_shape": list(t.shape[1:])} for n, t in sorted(prepared.items())
            },
            "extras": sorted(extras),
            "fingerprint": fp,
        }
    except Exception as e:  # not only ValueError: e.g. a failing device-to-host copy
        local_error = e
    token = secrets.token_hex(8) if comm.rank == 0 else None
    infos = comm.all_gather(
        {
            "error": None if local_error is None else str(local_error),
            "invalid": isinstance(local_error, ValueError),
            "info": info,
            "token": token,
        }
    )
    failures = _failure_summary(infos)
    if failures:
        if local_error is not None:
            raise local_error
        message = f"save_checkpoint of step {step} failed on " + "; ".join(failures)
        raise ValueError(message) if all(i["invalid"] for i in infos if i["error"]) else CheckpointError(message)
    all_info = [i["info"] for i in infos]
    _check_consistency(all_info)
    token = infos[0]["token"]

    name = step_dir_name(step)
    tmp = root / f".tmp-{name}-{token}"
    files: dict[str, dict[str, Any]] = {}
    write_error: Exception | None = None
    try:
        tmp.mkdir(parents=True, exist_ok=True)
        if comm.rank == 0:
            files[COMMON_FILE] = _save_durable(dict(common or {}), tmp / COMMON_FILE)
        if per_rank is not None:
            files[_rank_file(comm.rank)] = _save_durable(per_rank, tmp / _rank_file(comm.rank))
        head = {"class_range": (class_range.start, class_range.stop), "tensors": prepared, "extras": extras}
        files[_head_file(comm.rank)] = _save_durable(head, tmp / _head_file(comm.rank))
    except Exception as e:  # report, so that other ranks fail too rather than hang
        write_error = e
    # Doubles as the barrier: every rank has finished writing once this returns.
    statuses = comm.all_gather(
        {"error": None if write_error is None else f"{type(write_error).__name__}: {write_error}", "files": files}
    )
    failures = _failure_summary(statuses)
    if failures:
        if comm.rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        if write_error is not None:
            raise write_error
        raise CheckpointError(f"saving checkpoint step {step} under {root} failed on " + "; ".join(failures))

    final = root / name
    publish_error: Exception | None = None
    if comm.rank == 0:
        try:
            all_files: dict[str, dict[str, Any]] = {}
            for s in statuses:
                all_files.update(s["files"])
            for fname, entry in all_files.items():
                # Catches a rank whose writes are not visible here (e.g. root not shared).
                _check_file(tmp / fname, entry, check_hash=False)
            specs = all_info[0]["specs"]
            meta = {
                "format": FORMAT_NAME,
                "format_version": FORMAT_VERSION,
                "step": step,
                "world_size": comm.world_size,
                "num_classes": num_classes,
                "embedding_dim": _embedding_dim(specs),
                "class_ranges": [list(i["class_range"]) for i in all_info],
                "head_tensors": specs,
                "head_extras": all_info[0]["extras"],
                "fingerprint": all_info[0]["fingerprint"],
                "files": dict(sorted(all_files.items())),
                "torch_version": torch.__version__,
                "created_unix": time.time(),
            }
            # meta.json last: its presence marks a checkpoint whose other files are complete.
            _write_bytes_durable(tmp / META_FILE, json.dumps(meta, indent=2).encode())
            _fsync_dir(tmp)
            _publish(tmp, final, token)
            _fsync_dir(root)
        except Exception as e:
            publish_error = e
            shutil.rmtree(tmp, ignore_errors=True)
    verdict = comm.broadcast_from_first(
        None if publish_error is None else f"{type(publish_error).__name__}: {publish_error}"
    )
    if publish_error is not None:
        raise publish_error
    if verdict is not None:
        raise CheckpointError(f"publishing checkpoint step {step} under {root} failed on rank 0: {verdict}")
    if comm.rank == 0:
        logger.info("saved checkpoint %s", final)
        # After the broadcast, so the other ranks need not wait for deletions.
        _tidy(root, keep_last, final, token)
    return final


def _publish(tmp: Path, final: Path, token: str) -> None:
    """Rename the finished temp dir to its final name, replacing an older save of the same step."""
    if not final.exists():
        os.replace(tmp, final)
        return
    # os.replace cannot replace a non-empty directory: move the old one aside first.
    old = final.with_name(f".old-{final.name}-{token}")
    os.replace(final, old)
    try:
        os.replace(tmp, final)
    except OSError:
        os.replace(old, final)  # put the previous save of this step back
        raise
    shutil.rmtree(old, ignore_errors=True)


def _tidy(root: Path, keep_last: int | None, current: Path, token: str) -> None:
    """After a successful save: prune old checkpoints and remove leftovers of crashed saves.

    Failures only log: the new checkpoint is already committed.
    """
    try:
        if keep_last is not None:
            ckpts = find_checkpoints(root)
            for path in ckpts[: max(len(ckpts) - keep_last, 0)]:
                if path == current:
                    continue
                # Rename first so a crash mid-delete never leaves a partial step_* directory.
                trash = root / f".del-{path.name}-{token}"
                os.replace(path, trash)
                shutil.rmtree(trash, ignore_errors=True)
                logger.info("pruned checkpoint %s (keep_last=%d)", path, keep_last)
        # Saves are collective and serialised, so any other scratch dir is from a crashed save.
        for entry in root.iterdir():
            if _SCRATCH_DIR_RE.match(entry.name) and entry.is_dir():
                shutil.rmtree(entry, ignore_errors=True)
                logger.info("removed leftover %s", entry)
    except OSError as e:
        logger.warning("cleaning up old checkpoints under %s failed: %s", root, e)


# --------------------------------------------------------------------------- discovery


def _step_dirs(root: Path) -> list[tuple[int, Path]]:
    if not root.is_dir():
        return []
    found = []
    for entry in root.iterdir():
        m = _STEP_DIR_RE.match(entry.name)
        if m and entry.is_dir():
            found.append((int(m.group(1)), entry))
    return sorted(found)


def find_checkpoints(root: str | os.PathLike[str]) -> list[Path]:
    """Return the ``step_*`` directories under ``root`` that have a ``meta.json``, oldest first.

    This does not check file sizes or hashes; see :func:`latest_checkpoint`.
    """
    return [p for _, p in _step_dirs(Path(root)) if (p / META_FILE).is_file()]


def _read_meta(path: Path) -> dict[str, Any]:
    """Parse and structurally validate ``path/meta.json``."""
    meta_path = path / META_FILE
    try:
        meta = json.loads(meta_path.read_text())
    except FileNotFoundError:
        raise CheckpointError(f"{path} is not a checkpoint: {meta_path} is missing") from None
    except (OSError, ValueError) as e:
        raise CheckpointError(f"cannot parse {meta_path}: {e}") from e
    if not isinstance(meta, dict) or meta.get("format") != FORMAT_NAME:
        raise CheckpointError(f"{meta_path} is not a {FORMAT_NAME} meta file")
    version = meta.get("format_version")
    if not isinstance(version, int) or version > FORMAT_VERSION:
        raise CheckpointError(
            f"{meta_path} has format_version={version!r}; this shardfc reads up to {FORMAT_VERSION}"
        )
    try:
        world = meta["world_size"]
        ranges = meta["class_ranges"]
        files = meta["files"]
        ok = (
            isinstance(meta["step"], int)
            and isinstance(meta["num_classes"], int)
            and isinstance(world, int)
            and isinstance(ranges, list)
            and len(ranges) == world
            and isinstance(files, dict)
            and isinstance(meta["head_tensors"], dict)
            and isinstance(meta["fingerprint"], dict)
            and COMMON_FILE in files
            and all(_head_file(r) in files for r in range(world))
            and all(isinstance(e, dict) and isinstance(e.get("size"), int) for e in files.values())
        )
        # Saved ranges must tile [0, num_classes) in rank order, as the saver enforces.
        bounds = [0] + [b for a, b in ranges]
        ok = ok and all(
            isinstance(a, int) and isinstance(b, int) and a == bounds[i] and a <= b for i, (a, b) in enumerate(ranges)
        )
        ok = ok and bounds[-1] == meta["num_classes"]
    except (KeyError, TypeError, ValueError):
        ok = False
    if not ok:
        raise CheckpointError(f"{meta_path} is malformed or does not list all of its files")
    m = _STEP_DIR_RE.match(path.name)
    if m and int(m.group(1)) != meta["step"]:
        raise CheckpointError(f"{meta_path} records step={meta['step']} but the directory is {path.name}")
    return meta


def verify_checkpoint(path: str | os.PathLike[str], *, check_hashes: bool = True) -> dict[str, Any]:
    """Check that ``path`` is a complete checkpoint and return its parsed ``meta.json``.

    Every file listed in ``meta.json`` must exist with the recorded size and, if
    ``check_hashes``, the recorded sha256 (this reads every file).

    Raises:
        CheckpointError: Naming the first missing, truncated or corrupt file.
    """
    path = Path(path)
    meta = _read_meta(path)
    for fname, entry in meta["files"].items():
        _check_file(path / fname, entry, check_hash=check_hashes)
    return meta


def load_common(path: str | os.PathLike[str], map_location: Any = "cpu") -> tuple[dict[str, Any], dict[str, Any]]:
    """``(common dict, meta)`` of a checkpoint without reading its head shards.

    For inference tools: the head shards can be gigabytes. Every listed file must be present at
    its recorded size; ``common.pt`` is also hash-checked.

    Raises:
        CheckpointError: The checkpoint is incomplete, or ``common.pt`` is corrupt or unreadable.
    """
    path = Path(path)
    meta = verify_checkpoint(path, check_hashes=False)
    if COMMON_FILE not in meta["files"]:
        raise CheckpointError(f"{path} has no {COMMON_FILE}")
    common_path = path / COMMON_FILE
    _check_file(common_path, meta["files"][COMMON_FILE], check_hash=True)
    try:
        common = torch.load(common_path, map_location=map_location, weights_only=False)
    except Exception as e:
        raise CheckpointError(f"cannot read {common_path}: {type(e).__name__}: {e}") from e
    return common, meta


def latest_checkpoint(root: str | os.PathLike[str], *, check_hashes: bool = True) -> Path | None:
    """Return the newest valid checkpoint under ``root``, or None.

    Invalid ones (no/unparseable ``meta.json``, missing or truncated files, hash mismatch)
    are skipped with a warning on logger ``shardfc.checkpoint``.
    """
    for _, path in reversed(_step_dirs(Path(root))):
        try:
            verify_checkpoint(path, check_hashes=check_hashes)
        except CheckpointError as e:
            logger.warning("skipping invalid checkpoint %s: %s", path, e)
            continue
        return path
    return None


def resolve_resume(root: str | os.PathLike[str] | None, resume: str | os.PathLike[str] | None) -> Path | None:
    """Turn a ``--resume`` value into a checkpoint directory.

    Args:
        root: The run's checkpoint directory (used by ``"auto"`` and for relative names).
        resume: ``"auto"``: the latest valid checkpoint under ``root`` (None if there is
            none); ``"none"``, ``""`` or None: None; anything else: a checkpoint directory,
            absolute, relative to the working directory, or relative to ``root``.

    Raises:
        FileNotFoundError: ``resume`` names a directory that does not exist.
        CheckpointError: The named checkpoint is incomplete or corrupt.
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
        raise FileNotFoundError(f"resume={key!r}: no checkpoint directory at {path}")
    verify_checkpoint(path)
    return path


# --------------------------------------------------------------------------- load


def _objects_equal(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return (
            isinstance(a, torch.Tensor)
            and isinstance(b, torch.Tensor)
            and a.dtype == b.dtype
            and a.shape == b.shape
            and torch.equal(a.cpu(), b.cpu())
        )
    if isinstance(a, Mapping) and isinstance(b, Mapping):
        return a.keys() == b.keys() and all(_objects_equal(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(_objects_equal(x, y) for x, y in zip(a, b))
    try:
        return bool(a == b)
    except Exception:  # e.g. numpy arrays: ambiguous truth value
        return False


def _check_fingerprint(saved: Mapping[str, Any], current: Mapping[str, Any], path: Path) -> None:
    current = _json_roundtrip("fingerprint", _check_str_keys("fingerprint", current))
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


def _load_file(path: Path, fname: str, meta: Mapping[str, Any], map_location: Any, verify: bool) -> Any:
    fpath = path / fname
    entry = meta["files"].get(fname)
    if entry is None:
        raise CheckpointError(f"{path / META_FILE} does not list {fname}")
    _check_file(fpath, entry, check_hash=verify)
    try:
        return torch.load(fpath, map_location=map_location, weights_only=False)
    except Exception as e:
        raise CheckpointError(f"cannot read checkpoint file {fpath}: {type(e).__name__}: {e}") from e


def load_checkpoint(
    path: str | os.PathLike[str],
    *,
    class_range: range,
    num_classes: int,
    fingerprint: dict[str, Any] | None = None,
    map_location: Any = "cpu",
    rank: int | None = None,
    verify: bool = True,
) -> LoadedCheckpoint:
    """Load the rows of ``class_range`` from a checkpoint saved on any number of ranks.

    Only the saved head files whose class ranges overlap ``class_range`` are read, and their
    row slices are concatenated; no collective is involved, so each rank of a run with a
    different world size loads its own rows independently.

    Args:
        path: Checkpoint directory (``.../step_XXXXXXXX``).
        class_range: Class ids this rank holds now (may be empty).
        num_classes: Total classes of this run; must match the checkpoint.
        fingerprint: If given, must equal the saved fingerprint (compared after a JSON round trip).
        map_location: Passed to ``torch.load``.
        rank: Index whose ``rank_<r>.pt`` is returned as ``per_rank``; defaults to the
            default-group rank, or 0 without torch.distributed.
        verify: Check size and sha256 of every file read (size is always checked).

    Raises:
        ValueError: Bad arguments, ``num_classes`` or fingerprint mismatch.
        CheckpointError: Missing, truncated, corrupt or inconsistent checkpoint files.
    """
    path = Path(path)
    _check_int("num_classes", num_classes, 1)
    _check_class_range(class_range, num_classes)
    rank = _default_rank() if rank is None else _check_int("rank", rank, 0)
    meta = _read_meta(path)
    if meta["num_classes"] != num_classes:
        raise ValueError(
            f"checkpoint {path} has num_classes={meta['num_classes']}, this run has num_classes={num_classes}"
        )
    if fingerprint is not None:
        _check_fingerprint(meta["fingerprint"], fingerprint, path)

    common = _load_file(path, COMMON_FILE, meta, map_location, verify)
    if not isinstance(common, dict):
        raise CheckpointError(f"{path / COMMON_FILE} does not hold a dict (got {type(common).__name__})")
    per_rank = None
    if _rank_file(rank) in meta["files"]:
        per_rank = _load_file(path, _rank_file(rank), meta, map_location, verify)

    saved = [range(int(a), int(b)) for a, b in meta["class_ranges"]]
    wanted = [i for i, r in enumerate(saved) if r.start < class_range.stop and class_range.start < r.stop]
    if not wanted:
        # Empty request: still need extras and dtypes/devices, so read the smallest shard.
        wanted = [min(range(len(saved)), key=lambda i: meta["files"][_head_file(i)]["size"])]
    names = set(meta["head_tensors"])

    # Per tensor: the row slices taken from each shard read, plus the shard tensor when the
    # slice is all of it (so a single fully used shard needs no copy).
    pieces: dict[str, list[torch.Tensor]] = {n: [] for n in sorted(names)}
    whole: dict[str, torch.Tensor] = {}
    extras: dict[str, Any] | None = None
    extras_from = -1
    for i in wanted:
        fname = _head_file(i)
        head = _load_file(path, fname, meta, map_location, verify)
        if not (isinstance(head, dict) and {"class_range", "tensors", "extras"} <= head.keys()):
            raise CheckpointError(f"{path / fname} is not a head shard file")
        if tuple(head["class_range"]) != (saved[i].start, saved[i].stop):
            raise CheckpointError(
                f"{path / fname} holds class_range={tuple(head['class_range'])} but meta.json records "
                f"{(saved[i].start, saved[i].stop)}"
            )
        if set(head["tensors"]) != names:
            raise CheckpointError(
                f"{path / fname} holds tensors {sorted(head['tensors'])}, meta.json lists {sorted(names)}"
            )
        lo = max(class_range.start, saved[i].start) - saved[i].start
        hi = max(min(class_range.stop, saved[i].stop) - saved[i].start, lo)
        for name, t in head["tensors"].items():
            if t.shape[0] != len(saved[i]):
                raise CheckpointError(
                    f"{path / fname}: tensor {name!r} has {t.shape[0]} rows, its class range has {len(saved[i])}"
                )
            pieces[name].append(t[lo:hi])
            if lo == 0 and hi == t.shape[0]:
                whole[name] = t
        if extras is None:
            extras, extras_from = head["extras"], i
        elif not _objects_equal(extras, head["extras"]):
            raise CheckpointError(
                f"head extras differ between saved shards {extras_from} and {i} of {path}: "
                f"{extras!r} vs {head['extras']!r}"
            )

    tensors: dict[str, torch.Tensor] = {}
    for name, parts in pieces.items():
        # Otherwise cat copies, which also releases the unused rows of partially read shards.
        tensors[name] = whole[name] if len(parts) == 1 and name in whole else torch.cat(parts)
    return LoadedCheckpoint(
        step=meta["step"],
        common=common,
        per_rank=per_rank,
        head_tensors=tensors,
        head_extras=dict(extras or {}),
        meta=meta,
        path=path,
    )
