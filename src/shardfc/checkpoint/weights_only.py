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
import pickle
import re
from collections import OrderedDict
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from shardfc.checkpoint.format import FORMAT_VERSION, CheckpointError

__all__ = ["PLAIN_TYPES", "check_plain", "load_pt"]

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


def load_pt(path: Path, map_location: Any, *, trust_pickle: bool, meta: Mapping[str, Any], mmap: bool = False) -> Any:
    """``torch.load(path, weights_only=True)``; a file that needs full unpickling is refused with a
    CheckpointError saying why and how to opt in, or, with ``trust_pickle``, read anyway.

    ``mmap``: map the file instead of reading it (tensors are paged in as they are used)."""
    try:
        return torch.load(path, map_location=map_location, weights_only=True, mmap=mmap)
    except pickle.UnpicklingError as e:
        if "weights only" not in str(e).lower():
            raise CheckpointError(f"cannot read checkpoint file {path}: {type(e).__name__}: {e}") from e
        reason = _refusal_reason(e)
    except Exception as e:
        raise CheckpointError(f"cannot read checkpoint file {path}: {type(e).__name__}: {e}") from e
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
        return torch.load(path, map_location=map_location, weights_only=False, mmap=mmap)
    except Exception as e:
        raise CheckpointError(f"cannot read checkpoint file {path}: {type(e).__name__}: {e}") from e
