"""Reading a ``shardfc export`` TorchScript file's weights without running it."""

from __future__ import annotations

import os
import pickle
import struct
import zipfile
from pathlib import Path

import pytest
import torch

from shardfc.checkpoint import CheckpointError
from shardfc.checkpoint.exported import is_torchscript, read_exported
from shardfc.cli.export import export_torchscript
from shardfc.models import build_backbone


@pytest.fixture(scope="module")
def exported(tmp_path_factory) -> tuple:
    """A tiny backbone whose every weight and BatchNorm statistic differs from its initialisation (positive:
    variances), exported."""
    torch.manual_seed(3)
    model = build_backbone("tiny", 16, input_size=(16, 16))
    with torch.no_grad():
        for value in model.state_dict().values():
            value.copy_(torch.randint_like(value, 1, 100) if not value.is_floating_point() else torch.rand_like(value) + 0.5)
    model.eval()
    out = tmp_path_factory.mktemp("export") / "model.pt"
    export_torchscript(model, torch.zeros(2, 3, 16, 16), out, {"backbone": "tiny", "embedding_dim": 16})
    return model, out


def test_the_weights_read_back_are_the_models_bit_for_bit(exported):
    model, path = exported
    assert is_torchscript(path)
    got = read_exported(path)
    assert got.metadata == {"backbone": "tiny", "embedding_dim": 16}
    expected = model.state_dict()
    weights = got.weights_for(expected)
    assert list(weights) == list(expected)
    for key, value in expected.items():
        assert weights[key].dtype == value.dtype and torch.equal(weights[key], value), key
    fresh = build_backbone("tiny", 16, input_size=(16, 16))
    fresh.load_state_dict(weights)
    x = torch.randn(3, 3, 16, 16)
    assert torch.equal(fresh.eval()(x), model(x))


def test_another_backbone_is_refused_naming_its_keys_and_the_exports_backbone(exported):
    _, path = exported
    wider = build_backbone("tiny", 32, input_size=(16, 16)).state_dict()
    with pytest.raises(CheckpointError, match=r"exported from backbone 'tiny', embedding_dim 16.*of another shape: "
                                              r"\S+ \[16, \d+\] \(expected \[32, \d+\]\)"):
        read_exported(path).weights_for(wider)
    with pytest.raises(CheckpointError, match=r"missing key\(s\): extra\.weight"):
        read_exported(path).weights_for({"extra.weight": torch.zeros(1)})


class _RunsCode:
    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


def _with_data_pkl(path: Path, out: Path, data: bytes) -> Path:
    """A copy of TorchScript file ``path`` whose data.pkl is ``data``."""
    with zipfile.ZipFile(path) as src, zipfile.ZipFile(out, "w") as dst:
        for info in src.infolist():
            dst.writestr(info, data if info.filename.endswith("/data.pkl") else src.read(info))
    return out


def test_a_pickle_naming_another_global_is_refused_and_nothing_runs(exported, tmp_path: Path):
    _, path = exported
    payload = _RunsCode()
    payload.marker = tmp_path / "ran"
    crafted = _with_data_pkl(path, tmp_path / "crafted.pt", pickle.dumps(payload, protocol=2))
    assert is_torchscript(crafted)
    with pytest.raises(CheckpointError, match=r"refusing to read .*crafted\.pt: its data\.pkl names the global "
                                              r"(posix|os)\.system, .* it was not called"):
        read_exported(crafted)
    assert not payload.marker.exists()

    # A tensor's own __setstate__ is code too: a state is given to TorchScript placeholders only.
    with pytest.raises(CheckpointError, match="BUILD of a Tensor"):
        read_exported(_with_data_pkl(path, tmp_path / "build.pt", _tensor_with_a_state(path)))


def _text(s: str) -> bytes:
    return b"X" + struct.pack("<I", len(s)) + s.encode()


def _tensor_with_a_state(path: Path) -> bytes:
    """A pickle (protocol 2 opcodes) that rebuilds a tensor on the export's storage 0, then gives it a state (BUILD)."""
    with zipfile.ZipFile(path) as archive:
        numel = next(i.file_size for i in archive.infolist() if i.filename.endswith("/data/0")) // 4
    storage = b"(" + _text("storage") + b"ctorch\nFloatStorage\n" + _text("0") + _text("cpu") + b"J" + struct.pack(
        "<i", numel) + b"tQ"
    tensor = (b"ctorch._utils\n_rebuild_tensor_v2\n(" + storage + b"K\x00(J" + struct.pack("<i", numel) + b"t(K\x01t"
              + b"\x89ccollections\nOrderedDict\n)RtR")
    return b"\x80\x02" + tensor + b"Nb."


def test_a_torch_save_file_is_not_taken_for_an_export(tmp_path: Path):
    torch.save({"w": torch.zeros(2)}, tmp_path / "weights.pt")
    assert not is_torchscript(tmp_path / "weights.pt") and not is_torchscript(tmp_path)
    with pytest.raises(CheckpointError, match="not a TorchScript file"):
        read_exported(tmp_path / "weights.pt")


# The allow-list, spelled out here rather than read from the reader: a change to the reader's
# list must be a change to this one too.
ALLOWED = {("torch._utils", "_rebuild_tensor_v2"), ("torch._utils", "_rebuild_parameter"), ("collections", "OrderedDict")}
STORAGES = {"DoubleStorage", "FloatStorage", "HalfStorage", "BFloat16Storage", "LongStorage", "IntStorage",
            "ShortStorage", "CharStorage", "ByteStorage", "BoolStorage"}
#: Modules any pickle can name besides those the reader allows, as (the name a pickle uses, the
#: module it stands for): protocol 2's Python 2 spellings too.
ALWAYS_REACHABLE = (("builtins", "builtins"), ("__builtin__", "builtins"), ("copy_reg", "copyreg"), ("os", "os"),
                    ("posix", "posix"), ("subprocess", "subprocess"), ("sys", "sys"), ("pickle", "pickle"))


def _allowed(module: str, name: str) -> bool:
    if (module, name) in ALLOWED or module == "__torch__" or module.startswith("__torch__."):
        return True
    return module == "torch" and (name in STORAGES or isinstance(getattr(torch, name, None), torch.dtype))


def _reachable() -> set:
    """(module, name) for every name of the modules the reader allows (torch, torch._utils,
    collections), of the modules those hold as attributes (torch.os, torch._utils.sys, ...), and of
    :data:`ALWAYS_REACHABLE`; each also dotted from the allowed module (``torch``, ``os.system``),
    as a protocol-4 pickle can name it."""
    import collections
    import importlib
    import types

    import torch._utils

    names = set()
    for root in (torch, torch._utils, collections):
        for attr in dir(root):
            names.add((root.__name__, attr))
            value = getattr(root, attr, None)
            if isinstance(value, types.ModuleType):
                names.update((value.__name__, inner) for inner in dir(value))
                names.update((root.__name__, f"{attr}.{inner}") for inner in dir(value))
    for spelled, module in ALWAYS_REACHABLE:
        names.update((spelled, attr) for attr in dir(importlib.import_module(module)))
    names.add(("torch", "__torch__"))  # not a TorchScript class: its module is torch
    names.add(("__torch__evil", "x"))  # the __torch__ prefix is a package, not a string prefix
    return names


def test_every_reachable_global_outside_the_allow_list_is_refused_before_use(exported):
    from shardfc.checkpoint.exported import _ExportUnpickler, _Refused

    _, path = exported
    reachable = _reachable()
    dangerous = {("builtins", "getattr"), ("builtins", "eval"), ("os", "system"), ("torch", "save"), ("torch", "load"),
                 ("torch", "os.system"), ("torch._utils", "sys"), ("collections", "_sys"), ("torch", "_C")}
    assert dangerous <= reachable and len(reachable) > 5000  # the walk reaches what it should
    accepted, wrong = [], []
    with zipfile.ZipFile(path) as archive:
        unpickler = _ExportUnpickler(b"", archive, "")
        for module, name in sorted(reachable):
            try:
                found = unpickler.find_class(module, name)
            except _Refused as e:
                if str(e) != f"{module}.{name}":
                    wrong.append((module, name, str(e)))
                continue
            accepted.append((module, name, found))
    assert wrong == []
    assert [(m, n) for m, n, _ in accepted if not _allowed(m, n)] == []
    # A storage type or dtype stands for its dtype: inert data, nothing to call.
    dtypes = [(n, found) for m, n, found in accepted if m == "torch"]
    assert [n for n, found in dtypes if callable(found) or not isinstance(getattr(found, "dtype", None), torch.dtype)] == []
    assert len(dtypes) > 20  # the dtypes and storages themselves still resolve


class _Op:
    """Protocol 2 opcodes for the crafted pickles below."""

    @staticmethod
    def getattr(obj: bytes, attr: str) -> bytes:  # memo 0 holds builtins.getattr
        return b"h\x00" + obj + _text(attr) + b"\x86R"

    @staticmethod
    def call(fn: bytes, *args: str) -> bytes:
        return fn + b"(" + b"".join(_text(a) for a in args) + b"tR"


def _exploits(marker: Path) -> dict:
    """Pickles that run a command (touching ``marker``) if their first global were allowed."""
    getattr_ = b"cbuiltins\ngetattr\nq\x000"
    # _rebuild_tensor_v2 is the reader's own function: its module globals hold torch, which holds os.
    module_globals = _Op.getattr(b"ctorch._utils\n_rebuild_tensor_v2\n", "__globals__")
    torch_module = _Op.call(_Op.getattr(module_globals, "get"), "torch")
    system = _Op.getattr(_Op.getattr(torch_module, "os"), "system")
    return {
        "builtins.getattr": b"\x80\x02" + getattr_ + _Op.call(system, f"touch {marker}") + b".",
        "torch.save": b"\x80\x02" + _Op.call(b"ctorch\nsave\n", "payload", str(marker)) + b".",
        "posix.system": b"\x80\x02" + _Op.call(b"cposix\nsystem\n", f"touch {marker}") + b".",
        "builtins.exec": b"\x80\x02" + _Op.call(b"cbuiltins\nexec\n", f"open({str(marker)!r}, 'w')") + b".",
    }


@pytest.mark.parametrize("name", ["builtins.getattr", "torch.save", "posix.system", "builtins.exec"])
def test_crafted_exports_that_would_run_code_are_refused_and_nothing_runs(exported, tmp_path: Path, name):
    _, path = exported
    marker = tmp_path / "ran"
    crafted = _with_data_pkl(path, tmp_path / "crafted.pt", _exploits(marker)[name])
    with pytest.raises(CheckpointError, match=rf"names the global {name}, .* it was not called"):
        read_exported(crafted)
    assert not marker.exists()
