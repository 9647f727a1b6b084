"""Weights of a ``shardfc export`` TorchScript file, read without running it.

``torch.jit.load`` compiles and runs the file's code (its ``code/`` folder, and any TorchScript
``__setstate__``): a crafted file runs whatever it likes when loaded, which the project's loading
rule forbids. A TorchScript file is a zip, though, whose ``<archive>/data.pkl`` pickles the module
tree: ``__torch__.*`` objects whose state is a dict of attributes (submodules, parameters and
buffers as tensors), the tensors' bytes in ``<archive>/data/<key>``. This module unpickles that
with an unpickler that knows a handful of globals, all rebuilt by its own code:

* ``torch._utils._rebuild_tensor_v2`` / ``_rebuild_parameter``: a tensor viewed (bounds checked)
  on a storage read from the zip;
* ``torch.<Type>Storage`` and torch dtypes: the dtype of a storage;
* ``collections.OrderedDict`` (a tensor's empty backward hooks);
* any ``__torch__.*`` class: an inert :class:`Scripted` placeholder that only records its state.

Any other global (``os.system``, ``builtins.eval``, ...) is refused with a :class:`CheckpointError`
naming it, before anything is called. :func:`read_exported` then walks the placeholders into
``{dotted.name: tensor}``, the keys of the exported module's ``state_dict()``, and returns them
with the export's ``shardfc.json`` (backbone, embedding size, input size).
"""

from __future__ import annotations

import collections
import io
import pickle
import sys
import zipfile
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, List, Mapping, Tuple

import torch

from shardfc import files
from shardfc.checkpoint.format import CheckpointError, open_regular, short_repr
from shardfc.checkpoint.weights_only import check_stored, error_line

__all__ = ["EXPORT_METADATA", "Exported", "Scripted", "is_torchscript", "read_exported"]

#: The extra file ``shardfc export`` writes into the archive (``<archive>/extra/shardfc.json``).
EXPORT_METADATA = "shardfc.json"

#: Keys an error lists before a count of the rest.
_SHOWN = 5

#: The largest ``data.pkl`` read: it pickles the module tree (names, flags, one entry per tensor:
#: tens of kilobytes for the largest backbone; the tensors' bytes are apart). The unpickler is the
#: pure-Python one, so this also bounds its time (a few seconds of no-op opcodes).
MAX_PICKLE_BYTES = 4 << 20
#: The largest ``shardfc.json`` read (a few hundred bytes).
MAX_METADATA_BYTES = 1 << 20


class Scripted:
    """A TorchScript object as data: its ``__torch__`` class name and the state the pickle gave it.
    It has no behaviour: nothing of the file's code is looked up or run."""

    torch_class = "__torch__"

    def __new__(cls, *args: Any) -> "Scripted":
        obj = super().__new__(cls)
        obj.state = None
        return obj

    def __init__(self, *args: Any) -> None:
        pass

    def __setstate__(self, state: Any) -> None:  # pickle's BUILD: record, never interpret
        self.state = state


@dataclass(frozen=True)
class _StorageDtype:
    """What a storage-type global (``torch.FloatStorage``) stands for: only its dtype."""

    dtype: torch.dtype


def _rebuild_tensor(storage: torch.Tensor, offset: int, size: Tuple[int, ...], stride: Tuple[int, ...],
                    requires_grad: bool = False, backward_hooks: Any = None, metadata: Any = None) -> torch.Tensor:
    """torch's ``_rebuild_tensor_v2``, as a view of the storage read from the zip (as_strided checks the bounds)."""
    return torch.as_strided(storage, tuple(size), tuple(stride), int(offset))


def _rebuild_parameter(data: torch.Tensor, requires_grad: bool = False, backward_hooks: Any = None) -> torch.Tensor:
    return data


_REBUILDERS = {
    ("torch._utils", "_rebuild_tensor_v2"): _rebuild_tensor,
    ("torch._utils", "_rebuild_parameter"): _rebuild_parameter,
    ("collections", "OrderedDict"): collections.OrderedDict,
}


#: The storage types a TorchScript pickle names (``torch.FloatStorage``), by their dtype.
_STORAGE_DTYPES = {
    "DoubleStorage": torch.float64, "FloatStorage": torch.float32, "HalfStorage": torch.float16,
    "BFloat16Storage": torch.bfloat16, "LongStorage": torch.int64, "IntStorage": torch.int32,
    "ShortStorage": torch.int16, "CharStorage": torch.int8, "ByteStorage": torch.uint8, "BoolStorage": torch.bool,
}


def _storage_dtype(name: str) -> Any:
    """What ``torch.<name>`` stands for when it names a storage type or a dtype, else None."""
    value = getattr(torch, name, None) if name not in _STORAGE_DTYPES else _STORAGE_DTYPES[name]
    return _StorageDtype(value) if isinstance(value, torch.dtype) else None


class _Refused(pickle.UnpicklingError):
    """A global a ``shardfc export`` file never names."""


def _build(unpickler: "_ExportUnpickler") -> None:
    """pickle's BUILD (set an object's state), for placeholders only: on anything else (a tensor's
    ``__setstate__``, an object's ``__dict__``) it would run or change code the file should not reach."""
    state = unpickler.stack.pop()
    inst = unpickler.stack[-1]
    if not isinstance(inst, Scripted):
        raise pickle.UnpicklingError(f"BUILD of a {type(inst).__name__}: only TorchScript objects take a state")
    inst.__setstate__(state)


class _ExportUnpickler(pickle._Unpickler):
    """Unpickles ``data.pkl`` of a TorchScript archive knowing only :data:`_REBUILDERS`, storage
    dtypes and placeholders for ``__torch__`` classes; storages come from the zip. The pure-Python
    unpickler (data.pkl is small: the tensors' bytes are apart), so that BUILD can be restricted too."""

    dispatch = dict(pickle._Unpickler.dispatch)
    dispatch[pickle.BUILD[0]] = _build

    def __init__(self, data: bytes, archive: zipfile.ZipFile, prefix: str):
        super().__init__(io.BytesIO(data))
        self._archive, self._prefix = archive, prefix
        self._storages: Dict[str, torch.Tensor] = {}
        self._classes: Dict[str, type] = {}

    def find_class(self, module: str, name: str) -> Any:
        if module == "__torch__" or module.startswith("__torch__."):
            qualified = f"{module}.{name}"
            if qualified not in self._classes:  # a plain subclass, so that the tree says what each object was
                self._classes[qualified] = type(name, (Scripted,), {"torch_class": qualified})
            return self._classes[qualified]
        found = _REBUILDERS.get((module, name))
        if found is None and module == "torch":
            found = _storage_dtype(name)
        if found is None:
            raise _Refused(f"{module}.{name}")
        return found

    def persistent_load(self, pid: Any) -> torch.Tensor:
        """A storage ``('storage', dtype, key, location, numel)`` as a flat tensor of its dtype, read once per key."""
        if not (isinstance(pid, tuple) and len(pid) == 5 and pid[0] == "storage" and isinstance(pid[1], _StorageDtype)
                and isinstance(pid[2], str) and isinstance(pid[4], int)):
            raise pickle.UnpicklingError(f"unexpected persistent id {short_repr(pid)}")
        _, kind, key, _, numel = pid
        if key not in self._storages:
            try:
                info = self._archive.getinfo(f"{self._prefix}data/{key}")
            except KeyError:
                raise pickle.UnpicklingError(f"storage {short_repr(key)} is not in the archive") from None
            size = torch.tensor([], dtype=kind.dtype).element_size()
            if info.file_size != numel * size:  # stored (check_stored): its size on disk, before reading it
                raise pickle.UnpicklingError(
                    f"storage {short_repr(key)} has {info.file_size} bytes for {numel} x {kind.dtype}")
            raw = self._archive.read(info)
            self._storages[key] = torch.frombuffer(bytearray(raw), dtype=kind.dtype) if raw else torch.empty(
                0, dtype=kind.dtype)
        return self._storages[key]


@dataclass
class Exported:
    """What :func:`read_exported` found in a ``shardfc export`` file.

    Attributes:
        path: the file.
        metadata: its ``shardfc.json`` (``backbone``, ``embedding_dim``, ``input_size``, ...); empty if it has none.
        tensors: every tensor of the module tree by dotted name (the keys of its ``state_dict()``).
    """

    path: Path
    metadata: dict
    tensors: Dict[str, torch.Tensor]

    def weights_for(self, expected: Mapping[str, torch.Tensor]) -> Dict[str, torch.Tensor]:
        """The tensors under the keys of state dict ``expected``, each of its shape.

        Args:
            expected: the state dict to fill (e.g. ``backbone.state_dict()``): its keys and shapes.

        Raises:
            CheckpointError: a key missing or of another shape, naming the first few and the export's backbone.
        """
        missing = [k for k in expected if k not in self.tensors]
        wrong = [f"{k} {list(self.tensors[k].shape)} (expected {list(v.shape)})" for k, v in expected.items()
                 if k in self.tensors and self.tensors[k].shape != v.shape]
        if missing or wrong:
            found = []
            if missing:
                found.append(f"{len(missing)} missing key(s): {_shown(missing)}")
            if wrong:
                found.append(f"{len(wrong)} of another shape: {_shown(wrong)}")
            raise CheckpointError(
                f"{self.path} (exported from backbone {self.metadata.get('backbone', '?')!r}, embedding_dim "
                f"{self.metadata.get('embedding_dim', '?')}) does not hold this backbone's weights: {'; '.join(found)}"
            )
        return {k: self.tensors[k] for k in expected}


def _shown(items: List[str]) -> str:
    return ", ".join(items[:_SHOWN]) + (f" and {len(items) - _SHOWN} more" if len(items) > _SHOWN else "")


def _archive_prefix(names: List[str]) -> str:
    """``<archive>/`` of a TorchScript zip: the folder holding ``data.pkl`` and ``constants.pkl``."""
    for name in names:
        if name.endswith("/constants.pkl") and name.count("/") == 1:
            prefix = name[: -len("constants.pkl")]
            if f"{prefix}data.pkl" in names:
                return prefix
    return ""


def is_torchscript(path: Path) -> bool:
    """Whether ``path`` is a TorchScript file (a zip with ``data.pkl`` and ``constants.pkl``; a
    ``torch.save`` file has no ``constants.pkl``). Reads only the zip's listing, of a regular file
    (a FIFO or a device is not one, and is not opened).

    Args:
        path: the file (a folder or a missing path is not one).
    """
    path = Path(path)
    if not path.is_file():
        return False
    try:
        with open_regular(path, "model file", follow_symlinks=True) as f:
            if not zipfile.is_zipfile(f):
                return False
            with zipfile.ZipFile(f) as archive:
                return bool(_archive_prefix(archive.namelist()))
    except (CheckpointError, zipfile.BadZipFile, OSError, ValueError, EOFError):
        return False


def _member(archive: zipfile.ZipFile, name: str, limit: int, path: Path) -> bytes:
    """Member ``name`` of the archive, refused (before reading it) above ``limit`` bytes."""
    info = archive.getinfo(name)
    if info.file_size > limit:
        most = f"{limit >> 10} KiB" if limit % 1024 == 0 else f"{limit} bytes"
        raise CheckpointError(f"refusing to read {path}: its {name} has {info.file_size} bytes, more than the "
                              f"{most} a `shardfc export` file holds there")
    return archive.read(info)


def _tensors(root: Any) -> Dict[str, torch.Tensor]:
    """The tensors of a placeholder tree by dotted attribute path; other state (flags, names) is skipped."""
    out: Dict[str, torch.Tensor] = {}
    stack, seen = [("", root)], set()
    while stack:
        prefix, obj = stack.pop()
        if id(obj) in seen or not isinstance(obj.state, dict):
            continue
        seen.add(id(obj))
        for key, value in obj.state.items():
            if not isinstance(key, str):
                continue
            if isinstance(value, torch.Tensor):
                out[prefix + key] = value
            elif isinstance(value, Scripted):
                stack.append((f"{prefix}{key}.", value))
    return out


def read_exported(path: Path) -> Exported:
    """The weights and ``shardfc.json`` of TorchScript file ``path``, without running any of it.

    Args:
        path: a ``shardfc export`` file (``model.pt``).

    Raises:
        CheckpointError: not a TorchScript file, a pickle naming a global other than tensor
            rebuilding (refused before it is called), or a damaged archive.
    """
    path = Path(path)
    if not is_torchscript(path):
        raise CheckpointError(f"{path} is not a TorchScript file (a zip with data.pkl and constants.pkl), as "
                              "`shardfc export` writes")
    try:
        with open_regular(path, "model file", follow_symlinks=True) as f, zipfile.ZipFile(f) as archive:
            root, metadata = _read_archive(archive, path)
    except CheckpointError:
        raise
    except (zipfile.BadZipFile, zipfile.LargeZipFile, OSError, EOFError, ValueError, KeyError, zlib.error) as e:
        raise CheckpointError(f"cannot read {path}: the archive is damaged ({error_line(e)})") from None
    if not isinstance(root, Scripted):
        raise CheckpointError(f"{path}: its data.pkl holds a {type(root).__name__}, not a TorchScript module")
    return Exported(path, metadata, _tensors(root))


def _read_archive(archive: zipfile.ZipFile, path: Path) -> Tuple[Any, dict]:
    """The unpickled module tree and the ``shardfc.json`` of an open TorchScript archive."""
    names = archive.namelist()
    prefix = _archive_prefix(names)
    # What is read must be stored as torch writes it (its code/ folder, never read, is deflated).
    check_stored(archive, path, lambda name: not name.startswith(f"{prefix}code/"))
    order = _member(archive, f"{prefix}byteorder", 64, path).decode("ascii", "replace").strip() \
        if f"{prefix}byteorder" in names else "little"
    if order != sys.byteorder:
        raise CheckpointError(f"{path} was written on a {short_repr(order)}-endian machine; this one is "
                              f"{sys.byteorder}-endian")
    data = _member(archive, f"{prefix}data.pkl", MAX_PICKLE_BYTES, path)
    try:
        root = _ExportUnpickler(data, archive, prefix).load()
    except _Refused as e:
        raise CheckpointError(
            f"refusing to read {path}: its data.pkl names the global {str(e)[:200]}, which a `shardfc export` "
            "file never holds (only tensors and TorchScript modules); it was not called. shardfc reads exported models "
            "without running them: export the model again with `shardfc export`, or start from its checkpoint"
        ) from None
    except CheckpointError:
        raise
    except (zipfile.BadZipFile, zlib.error, OSError) as e:  # a storage member damaged
        raise CheckpointError(f"cannot read {path}: the archive is damaged ({error_line(e)})") from None
    except Exception as e:  # a malformed pickle fails in many ways (IndexError, KeyError, RecursionError, ...)
        raise CheckpointError(f"cannot read {path}: its data.pkl is malformed ({error_line(e)})") from None
    meta_name = f"{prefix}extra/{EXPORT_METADATA}"
    metadata: Any = {}
    if meta_name in names:
        try:  # the gate's JSON rules: nested at most files.MAX_DEPTH deep
            metadata = files.parse_json(_member(archive, meta_name, MAX_METADATA_BYTES, path),
                                        f"its {EXPORT_METADATA}")
        except files.FileRefused as e:
            raise CheckpointError(f"cannot read {path}: {e}") from None
        if not isinstance(metadata, dict):
            raise CheckpointError(f"{path}: its {EXPORT_METADATA} holds a {type(metadata).__name__}, not an object")
    return root, metadata
