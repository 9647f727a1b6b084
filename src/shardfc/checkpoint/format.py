"""What a checkpoint looks like on disk: names, the format version, ``meta.json``, step directories.

On-disk format (``format_version`` 2)
=====================================

::

    <root>/step_<step:08d>/
        meta.json     written last, by rank 0 (see below)
        common.pt     torch.save(dict) from rank 0: backbone, scheduler, scaler, config, ...
        rank_<r>.pt   torch.save(dict) from rank r, only if it passed ``per_rank``: RNG states, ...
        head_<r>.pt   torch.save({"class_range": (start, stop),
                                  "tensors": {name: Tensor with shape[0] == stop - start},
                                  "extras": {name: value}})   # e.g. Adam's scalar "step"
        backbone_stage<i>.pt   only in a per-stage save (a pipeline run): one stage's share of the
                      backbone and its optimizer state, in the unsplit model's names
                      (see :mod:`shardfc.checkpoint.stages`); common.pt then holds no backbone

Every ``.pt`` file holds only tensors and plain data (dict, list, tuple, str, int, float, bool,
None, ...), so it loads with ``torch.load(weights_only=True)``, which cannot run code; see
:mod:`shardfc.checkpoint.weights_only`. Format 1 (shardfc before this rule) has the same layout,
but its files may hold pickled objects (e.g. numpy RNG states): they are read only with
``trust_pickle=True``.

``meta.json`` holds::

    {"format": "shardfc-checkpoint", "format_version": 2,
     "step": int, "world_size": int, "num_classes": int,
     "embedding_dim": int | null,             # row width of the head weight, informative
     "class_ranges": [[start, stop], ...],    # one per saved rank, in rank order
     "head_tensors": {name: {"dtype": "float32", "row_shape": [D, ...]}},
     "head_extras": [name, ...],
     "fingerprint": {...},                    # caller's JSON dict (model name, config, ...)
     "files": {file_name: {"size": bytes, "sha256": hex}},
     "torch_version": str, "created_unix": float,
     # only in a per-stage save (whose format_version is then 3):
     "backbone_stages": {"keys": [...], "params": [...],     # the unsplit model's, in order
                         "files": {"backbone_stage<i>.pt": {"keys": [...], "params": [...]}}}}

``<r>`` of ``head_<r>.pt`` counts the ranks that hold a head shard, in rank order (in a pipeline
run: the last stage's ranks).

A checkpoint directory is named ``step_<step:08d>``; :data:`STEP_DIR_RE` is the one pattern that
recognises such names (discovery, pruning, and the trainer's setting aside of newer steps all use
it). Scratch directories of saves in progress are ``.tmp-``, ``.old-`` or ``.del-`` + the step
directory name + ``-<token>``.
"""

from __future__ import annotations

import os
import re
import reprlib
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Optional

import torch

from shardfc import files
from shardfc.checks import check_int

__all__ = [
    "saved_num_classes",
    "FORMAT_NAME",
    "FORMAT_VERSION",
    "READABLE_VERSIONS",
    "META_FILE",
    "COMMON_FILE",
    "STEP_DIR_RE",
    "CheckpointError",
    "head_file",
    "rank_file",
    "stage_file",
    "step_dir_name",
    "parse_step_dir",
    "step_dirs",
    "step_of",
    "scratch_dir_name",
    "is_scratch_dir",
    "replaced_dirs",
    "tensor_specs",
    "build_meta",
    "read_meta",
    "regular_file",
    "short_repr",
    "open_regular",
    "FILE_NAME_RE",
    "META_MAX_BYTES",
]

FORMAT_NAME = "shardfc-checkpoint"
#: 2: every .pt file loads with ``torch.load(weights_only=True)``. 1: the same layout, pickled objects allowed.
FORMAT_VERSION = 2
#: A format-2 checkpoint whose backbone is saved per stage (``backbone_stages``): a shardfc that
#: cannot read those refuses the version instead of failing on the missing backbone.
STAGED_FORMAT_VERSION = 3
READABLE_VERSIONS = (1, 2, 3)
META_FILE = "meta.json"
COMMON_FILE = "common.pt"

#: The name of a checkpoint directory: ``step_`` and the step in ASCII decimal (zero-padded when
#: written; ``\d`` would also read other scripts' digits, ``step_٣`` as step 3).
STEP_DIR_RE = re.compile(r"^step_([0-9]+)\Z")  # "\Z": "$" would also take "step_1\n"
#: The names of the files shardfc writes into a checkpoint folder (besides ``meta.json``): a
#: ``meta.json`` naming anything else (a path, ``..``, another file) is refused.
FILE_NAME_RE = re.compile(r"(common|head_[0-9]+|rank_[0-9]+|backbone_stage[0-9]+)\.pt")
#: The largest ``meta.json`` read (it lists file names, class ranges and stage keys: kilobytes).
META_MAX_BYTES = 64 << 20
_SCRATCH_DIR_RE = re.compile(r"\.(tmp|old|del)-(step_[0-9]+)-[0-9a-f]+")


class CheckpointError(RuntimeError):
    """A checkpoint is missing, truncated, corrupt, inconsistent or unsafe to read, or a save failed on another rank."""


def regular_file(path: "str | os.PathLike[str]", what: str = "checkpoint file", *,
                 follow_symlinks: bool = False) -> os.stat_result:
    """``os.lstat(path)`` of a regular file; anything else (missing, a symlink, a FIFO, a device, a
    folder) is a CheckpointError naming it, before anything opens, stats through or hashes it (a
    FIFO or ``/dev/zero`` would never end a read). ``follow_symlinks``: a file the user names
    himself (not one a ``meta.json`` names) may be a symlink to a regular file. The rule is the
    gate's (:func:`shardfc.files.regular_file`); only the error type is the checkpoint's."""
    try:
        return files.regular_file(path, what, follow_symlinks=follow_symlinks)
    except files.FileRefused as e:
        raise CheckpointError(str(e)) from None


def open_regular(path: "str | os.PathLike[str]", what: str = "checkpoint file", *, follow_symlinks: bool = False):
    """``path`` opened for reading in binary, if it is a regular file (:func:`regular_file`; opened
    without following a symlink and without blocking on a FIFO swapped in since, then checked again:
    :func:`shardfc.files.open_file`). No size cap here: every checkpoint reader bounds what it reads
    (``meta.json`` by :data:`META_MAX_BYTES`, a ``.pt`` by its records' sizes)."""
    try:
        return files.open_file(path, "checkpoint", what, follow_symlinks=follow_symlinks)
    except files.FileRefused as e:
        raise CheckpointError(str(e)) from None


def head_file(rank: int) -> str:
    return f"head_{rank}.pt"


def rank_file(rank: int) -> str:
    return f"rank_{rank}.pt"


def stage_file(index: int) -> str:
    return f"backbone_stage{index}.pt"


# --------------------------------------------------------------------------- step directories


def step_dir_name(step: int) -> str:
    """Directory name of the checkpoint for ``step`` (``step_00001234``), an int >= 0 (``-5`` would
    name ``step_-0000005``, which no reader takes for a checkpoint)."""
    check_int("step", step, 0)
    return f"step_{step:08d}"


def parse_step_dir(name: str) -> Optional[int]:
    """The step a checkpoint directory name ``step_<N>`` encodes; None for any other name."""
    m = STEP_DIR_RE.fullmatch(name)
    return int(m.group(1)) if m else None


def step_dirs(root: "str | os.PathLike[str]") -> list[tuple[int, Path]]:
    """``(step, path)`` of every ``step_<N>`` directory directly under ``root``, by step (``[]`` if no root)."""
    root = Path(root)
    if not root.is_dir():
        return []
    found = []
    for entry in root.iterdir():
        step = parse_step_dir(entry.name)
        if step is not None and entry.is_dir():
            found.append((step, entry))
    return sorted(found)


def step_of(path: "str | os.PathLike[str]") -> int:
    """The step of checkpoint directory ``path``: from its ``step_<N>`` name, else from its ``meta.json``
    (a checkpoint copied under another name).

    Raises:
        CheckpointError: The name is not a step directory and ``meta.json`` is missing or malformed.
    """
    path = Path(path)
    step = parse_step_dir(path.name)
    return step if step is not None else read_meta(path)["step"]


def scratch_dir_name(kind: str, step_dir: str, token: str) -> str:
    """Name of a save's scratch directory: ``kind`` is ``tmp`` (being written), ``old`` (being
    replaced) or ``del`` (being pruned)."""
    return f".{kind}-{step_dir}-{token}"


def is_scratch_dir(name: str) -> bool:
    return _SCRATCH_DIR_RE.fullmatch(name) is not None


def replaced_step_dir(name: str) -> Optional[str]:
    """The step directory name a save's ``.old-`` scratch directory ``name`` was moved aside from
    (the previous save of a step being replaced); None for any other name."""
    m = _SCRATCH_DIR_RE.fullmatch(name)
    return m.group(2) if m is not None and m.group(1) == "old" else None


def replaced_dirs(root: "str | os.PathLike[str]") -> list[tuple[str, Path]]:
    """``(step directory name, path)`` of each ``.old-`` scratch directory directly under ``root``
    (a previous save moved aside by a resave), by name (``[]`` if no root)."""
    root = Path(root)
    if not root.is_dir():
        return []
    found = ((replaced_step_dir(entry.name), entry) for entry in sorted(root.iterdir()))
    return [(name, entry) for name, entry in found if name is not None and entry.is_dir()]


# --------------------------------------------------------------------------- meta.json


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def tensor_specs(tensors: Mapping[str, torch.Tensor]) -> dict[str, dict[str, Any]]:
    """``{name: {"dtype", "row_shape"}}`` of head shard tensors, as ``meta.json`` records them."""
    return {n: {"dtype": _dtype_name(t.dtype), "row_shape": list(t.shape[1:])} for n, t in sorted(tensors.items())}


def _embedding_dim(specs: Mapping[str, Mapping[str, Any]]) -> Optional[int]:
    """Row width of the head: that of "weight" if present, else of the first tensor by name."""
    names = (["weight"] if "weight" in specs else []) + sorted(specs)
    for name in names:
        row_shape = specs[name]["row_shape"]
        if row_shape:
            return int(row_shape[-1])
    return None


def build_meta(
    *,
    step: int,
    num_classes: int,
    class_ranges: list[tuple[int, int]],
    specs: dict[str, Any],
    extras: list[str],
    fingerprint: dict[str, Any],
    files: Mapping[str, Mapping[str, Any]],
    backbone_stages: Optional[dict[str, Any]] = None,
) -> dict[str, Any]:
    """The ``meta.json`` of a checkpoint whose head was saved on ``len(class_ranges)`` ranks."""
    meta = {
        "format": FORMAT_NAME,
        "format_version": FORMAT_VERSION if backbone_stages is None else STAGED_FORMAT_VERSION,
        "step": step,
        "world_size": len(class_ranges),
        "num_classes": num_classes,
        "embedding_dim": _embedding_dim(specs),
        "class_ranges": [list(r) for r in class_ranges],
        "head_tensors": specs,
        "head_extras": extras,
        "fingerprint": fingerprint,
        "files": dict(sorted(files.items())),
        "torch_version": torch.__version__,
        "created_unix": time.time(),
    }
    if backbone_stages is not None:
        meta["backbone_stages"] = backbone_stages
    return meta


def saved_num_classes(path: "str | os.PathLike[str]") -> int:
    """The class count of checkpoint ``path``'s head, from its ``meta.json`` (:func:`read_meta`)."""
    return int(read_meta(path)["num_classes"])


def read_meta(path: "str | os.PathLike[str]") -> dict[str, Any]:
    """Parse and structurally validate ``path/meta.json``.

    Raises:
        CheckpointError: It is missing, unparseable, of another format or a newer version, or
            does not describe a complete checkpoint (ranges tiling the classes, every file listed).
    """
    path = Path(path)
    meta_path = path / META_FILE
    if not os.path.lexists(meta_path):
        raise CheckpointError(f"{path} is not a checkpoint: {meta_path} is missing")
    with open_regular(meta_path, "checkpoint meta file") as f:
        size = os.fstat(f.fileno()).st_size
        if size > META_MAX_BYTES:
            raise CheckpointError(f"{meta_path} is larger than {META_MAX_BYTES >> 20} MiB: not a shardfc meta file")
        text = f.read(size + 1)
    try:  # the gate's JSON rules: nested at most files.MAX_DEPTH deep (meta.json is 4)
        meta = files.parse_json(text, str(meta_path))
    except files.FileRefused as e:
        raise CheckpointError(str(e)) from None
    if not isinstance(meta, dict) or meta.get("format") != FORMAT_NAME:
        raise CheckpointError(f"{meta_path} is not a {FORMAT_NAME} meta file")
    version = meta.get("format_version")
    if version not in READABLE_VERSIONS:
        raise CheckpointError(
            f"{meta_path} has format_version={version!r}; this shardfc reads versions "
            f"{', '.join(map(str, READABLE_VERSIONS))}"
        )
    if not _well_formed(meta):
        raise CheckpointError(f"{meta_path} is malformed or does not list all of its files")
    _check_names(meta, meta_path)
    step = parse_step_dir(path.name)
    if step is not None and step != meta["step"]:
        raise CheckpointError(f"{meta_path} records step={meta['step']} but the directory is {path.name}")
    return meta


def _check_names(meta: dict[str, Any], meta_path: Path) -> None:
    """Every file ``meta.json`` names is one shardfc writes, directly in the folder (no path, no
    ``..``), and a per-stage backbone's files partition its keys and parameters: each in exactly one
    file (a key in none would stay at its initialisation, one in two would be loaded twice)."""
    for name in list(meta["files"]) + list((meta.get("backbone_stages") or {}).get("files", {})):
        if not (isinstance(name, str) and FILE_NAME_RE.fullmatch(name)):
            raise CheckpointError(
                f"{meta_path} lists the file {short_repr(name)}, which is not a name shardfc writes (common.pt, "
                "head_<r>.pt, rank_<r>.pt, backbone_stage<i>.pt, directly in the checkpoint folder)"
            )
    stages = meta.get("backbone_stages")
    if stages is None:
        return
    for what in ("keys", "params"):
        recorded = stages[what]
        held: dict[Any, str] = {}
        for fname, entry in stages["files"].items():
            names = entry.get(what, [])
            if not isinstance(names, list) or not all(isinstance(n, str) for n in names):
                raise CheckpointError(f"{meta_path}: backbone_stages {fname} {what} is not a list of names")
            for n in names:
                if n in held:
                    raise CheckpointError(
                        f"{meta_path}: backbone_stages lists {what[:-1]} {short_repr(n)} in both {held[n]} and {fname}"
                    )
                held[n] = fname
        if not all(isinstance(n, str) for n in recorded) or len(set(recorded)) != len(recorded) \
                or set(held) != set(recorded):
            known = set(map(str, recorded))
            none = [n for n in recorded if n not in held][:5]
            extra = [n for n in held if n not in known][:5]
            raise CheckpointError(
                f"{meta_path}: the stage files' {what} do not partition the recorded ones: held by no file "
                f"{short_repr(none)}, not recorded {short_repr(extra)}"
            )


_REPR = reprlib.Repr()
_REPR.maxlevel, _REPR.maxdict, _REPR.maxlist, _REPR.maxtuple, _REPR.maxset = 3, 4, 4, 4, 4
_REPR.maxstring, _REPR.maxother, _REPR.maxlong = 80, 80, 40


def short_repr(value: Any, limit: int = 200) -> str:
    """A repr of ``value`` for an error message, built in bounded time and memory whatever it is (a
    few items per container, three levels deep: a pickle's nested shared tuples have a repr of
    astronomical length), at most ``limit`` characters."""
    try:
        text = _REPR.repr(value)
    except Exception:  # a placeholder or an object whose repr fails
        text = f"<{type(value).__name__}>"
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _well_formed(meta: dict[str, Any]) -> bool:
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
            and all(head_file(r) in files for r in range(world))
            and all(isinstance(e, dict) and isinstance(e.get("size"), int) for e in files.values())
        )
        stages = meta.get("backbone_stages")
        if stages is not None:
            ok = ok and isinstance(stages["keys"], list) and isinstance(stages["params"], list)
            ok = ok and all(f in files and isinstance(e["keys"], list) for f, e in stages["files"].items())
        # Saved ranges must tile [0, num_classes) in rank order, as the saver enforces.
        bounds = [0] + [b for a, b in ranges]
        ok = ok and all(
            isinstance(a, int) and isinstance(b, int) and a == bounds[i] and a <= b for i, (a, b) in enumerate(ranges)
        )
        return ok and bounds[-1] == meta["num_classes"]
    except (KeyError, TypeError, ValueError):
        return False
