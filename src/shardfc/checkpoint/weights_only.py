"""What a checkpoint's ``.pt`` files may hold, and how they are read back without running code.

A ``.pt`` file is a pickle, and ``torch.load(weights_only=False)`` calls whatever function the
pickle names: a crafted checkpoint runs arbitrary code when loaded. shardfc therefore writes only
tensors and plain data (:func:`check_plain` refuses anything else at save time, naming it) and
reads every file with ``torch.load(weights_only=True)``, whose unpickler only rebuilds tensors
and plain containers (:func:`load_pt`).

A file that needs more (a checkpoint of format 1, written before this rule, e.g. with numpy RNG
states; or a file not written by shardfc) is refused with a :class:`CheckpointError` naming the
file and what it needs. Only with ``trust_pickle=True`` (command line: ``--trust-checkpoint``) is
it read with full unpickling, for checkpoints whose origin you trust.
"""

from __future__ import annotations

import logging
import os
import pickle
import re
import zipfile
from collections import OrderedDict
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from shardfc.checkpoint.format import FORMAT_VERSION, CheckpointError, open_regular, regular_file, short_repr

__all__ = ["PLAIN_TYPES", "check_plain", "load_pt", "check_stored", "error_line"]

logger = logging.getLogger("shardfc.checkpoint")

#: Leaf types ``torch.load(weights_only=True)`` rebuilds (tensors aside).
PLAIN_TYPES = (type(None), bool, int, float, complex, str, bytes, torch.dtype, torch.device)
_CONTAINERS = (dict, OrderedDict, list, tuple, torch.Size, set)
_TENSORS = (torch.Tensor, torch.nn.Parameter)

_HOW = "shardfc checkpoints hold only tensors and plain data (dict, list, tuple, str, int, float, bool, None)"


def check_plain(name: str, value: Any) -> None:
    """Raise ValueError naming the first value under ``name`` that ``torch.load(weights_only=True)``
    could not read back (exact types: a subclass of dict or int is refused too)."""
    stack = [(name, value)]
    while stack:
        where, v = stack.pop()
        kind = type(v)
        if kind in _TENSORS or kind in PLAIN_TYPES:
            continue
        if kind in (dict, OrderedDict):
            for key, item in v.items():
                if type(key) not in PLAIN_TYPES and type(key) is not tuple:
                    raise ValueError(f"{where} has a key {key!r} of type {_type_name(key)}; {_HOW}")
                stack.append((f"{where}[{key!r}]", item))
        elif kind in _CONTAINERS:
            stack.extend((f"{where}[{i}]", item) for i, item in enumerate(v))
        else:
            raise ValueError(
                f"{where} is a {_type_name(v)}; {_HOW}, so that they load with torch.load(weights_only=True). "
                "Store its state as plain data (e.g. a state_dict(), a tensor or a JSON string)"
            )


def _type_name(v: Any) -> str:
    kind = type(v)
    return kind.__qualname__ if kind.__module__ == "builtins" else f"{kind.__module__}.{kind.__qualname__}"


def _refusal_reason(error: BaseException) -> str:
    """What the weights-only unpickler refused, from its message (e.g. ``the global numpy...._reconstruct``)."""
    m = re.search(r"GLOBAL ([\w.]+)", str(error))
    return f"the global {m.group(1)}" if m else "objects"


def error_line(error: BaseException, limit: int = 300) -> str:
    """``Type: message`` of ``error`` on one line of at most ``limit`` characters (for a CheckpointError's text)."""
    text = " ".join(str(error).split())
    text = text if len(text) <= limit else text[: limit - 3] + "..."
    return f"{type(error).__name__}: {text}"


def check_stored(archive: zipfile.ZipFile, path: Path, names: Any = None) -> None:
    """Refuse a zip (``torch.save`` or ``torch.jit.save``) whose members ``names`` (None: all) are
    compressed or extend past the file: both writers store tensors and pickles uncompressed, so a
    member never holds more bytes than the file does (a deflated one could inflate a kilobyte to
    gigabytes before any size check)."""
    end = os.fstat(archive.fp.fileno()).st_size if hasattr(archive.fp, "fileno") else None
    for info in archive.infolist():
        if names is not None and not names(info.filename):
            continue
        if info.compress_type != zipfile.ZIP_STORED or info.compress_size != info.file_size:
            raise CheckpointError(
                f"refusing to read {path}: its member {short_repr(info.filename)} is compressed "
                f"({info.compress_size} bytes inflating to {info.file_size}); torch writes tensors and pickles stored"
            )
        if end is not None and info.header_offset + info.file_size > end:
            raise CheckpointError(f"{path} is truncated or corrupt: member {short_repr(info.filename)} "
                                  f"extends past the end of the file")


#: The first byte of a pickle of protocol 2 or later (torch.save's legacy format writes protocol 2).
_PICKLE_PROTO = b"\x80"


def _check_zip(path: Path, follow_symlinks: bool) -> None:
    """:func:`check_stored` over a ``torch.save`` file; a legacy, non-zip one must at least open as
    the pickle torch writes (PROTO first). Else it is no torch file at all (a text, an image, an
    ONNX model named by mistake): said so, not "it needs objects ... --trust-checkpoint", which
    would send the user to the unsafe opt-in for a file it could not read either."""
    try:
        with open_regular(path, follow_symlinks=follow_symlinks) as f:
            if not zipfile.is_zipfile(f):
                f.seek(0)
                head = f.read(8)
                if not head.startswith(_PICKLE_PROTO):
                    raise CheckpointError(
                        f"cannot read checkpoint file {path}: " + ("it is empty" if not head else
                        f"no torch.save file (neither a zip archive nor a pickle): it starts with {head!r}")
                    )
                return
            with zipfile.ZipFile(f) as archive:
                check_stored(archive, path)
    except (zipfile.BadZipFile, OSError, ValueError, EOFError) as e:
        raise CheckpointError(f"cannot read checkpoint file {path}: {error_line(e)}") from None


def load_pt(path: Path, map_location: Any, *, trust_pickle: bool, meta: Mapping[str, Any], mmap: bool = False,
            follow_symlinks: bool = True) -> Any:
    """``torch.load(path, weights_only=True)``; a file that needs full unpickling is refused with a
    CheckpointError saying why and how to opt in, or, with ``trust_pickle``, read anyway.

    Only a regular file is read (a FIFO or a device would never end), and only one whose zip
    members are stored (:func:`check_stored`). ``mmap``: map the file instead of reading it
    (tensors are paged in as they are used). ``follow_symlinks``: False for a file a ``meta.json``
    names, which must be the checkpoint folder's own (a file the user names may be a link)."""
    regular_file(path, follow_symlinks=follow_symlinks)
    _check_zip(path, follow_symlinks)
    try:
        return _torch_load(path, map_location, True, mmap, follow_symlinks)
    except CheckpointError:
        raise
    except pickle.UnpicklingError as e:
        if "weights only" not in str(e).lower():
            raise CheckpointError(f"cannot read checkpoint file {path}: {error_line(e)}") from None
        reason = _refusal_reason(e)
    except Exception as e:
        raise CheckpointError(f"cannot read checkpoint file {path}: {error_line(e)}") from None
    if not trust_pickle:
        version = meta.get("format_version")
        if version is not None and version < FORMAT_VERSION:
            origin = (
                f"It was written by an older shardfc (checkpoint format {version}), whose files could hold "
                "pickled objects."
            )
        else:
            origin = f"{_HOW} since checkpoint format {FORMAT_VERSION}, so shardfc's saver did not write this file."
        raise CheckpointError(
            f"refusing to load {path}: it needs {reason}, which torch.load(weights_only=True) does not allow; "
            f"unpickling it could run arbitrary code. {origin} If you trust this checkpoint, load it with "
            "trust_pickle=True (command line: --trust-checkpoint)"
        ) from None
    logger.warning("loading %s with full unpickling (trust_pickle=True): it needs %s", path, reason)
    try:
        return _torch_load(path, map_location, False, mmap, follow_symlinks)
    except CheckpointError:
        raise
    except Exception as e:
        raise CheckpointError(f"cannot read checkpoint file {path}: {error_line(e)}") from None


def _torch_load(path: Path, map_location: Any, weights_only: bool, mmap: bool, follow_symlinks: bool) -> Any:
    """torch.load of regular file ``path``: mapped by name, else from a file opened without blocking."""
    if mmap:
        return torch.load(path, map_location=map_location, weights_only=weights_only, mmap=True)
    with open_regular(path, follow_symlinks=follow_symlinks) as f:
        return torch.load(f, map_location=map_location, weights_only=weights_only)
