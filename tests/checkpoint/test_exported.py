"""Reading a ``shardfc export`` TorchScript file's weights without running it."""

from __future__ import annotations

import os
import pickle
import struct
import sys
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


# --------------------------------------------------------------------------- the reader piece by piece


class _Shared(torch.nn.Module):
    """Buffers that share a storage (one a view at an offset), empty ones of two dtypes, and a
    layer registered under two names (TorchScript saves it twice over the same storages)."""

    def __init__(self) -> None:
        super().__init__()
        self.a = torch.nn.Linear(2, 2)
        self.b = self.a
        whole = torch.arange(10.0)
        self.register_buffer("whole", whole)
        self.register_buffer("view", whole[3:6])
        self.register_buffer("empty", torch.zeros(0))
        self.register_buffer("empty_int", torch.zeros(0, dtype=torch.int64))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(self.a(x)) + self.view.sum()


def test_views_at_an_offset_and_empty_tensors_read_back_as_saved(tmp_path: Path):
    torch.manual_seed(0)
    model = _Shared().eval()
    out = tmp_path / "shared.pt"
    export_torchscript(model, torch.zeros(1, 2), out, {"backbone": "shared"})
    got = read_exported(out)
    assert got.path == out and got.metadata == {"backbone": "shared"}
    expected = model.state_dict()
    weights = got.weights_for(expected)
    assert list(weights) == list(expected)
    for key, value in expected.items():
        assert weights[key].dtype == value.dtype and torch.equal(weights[key], value), key
    assert weights["view"].tolist() == [3.0, 4.0, 5.0]  # at its offset in the storage it shares with whole


def test_a_symlink_the_user_names_is_read_and_a_file_swapped_after_the_check_is_refused(exported, tmp_path: Path,
                                                                                        monkeypatch):
    from shardfc.checkpoint import exported as module

    _, path = exported
    link = tmp_path / "link.pt"
    link.symlink_to(path)
    assert is_torchscript(link) and read_exported(link).tensors.keys() == read_exported(path).tensors.keys()

    swapped = tmp_path / "swapped.pt"
    swapped.write_bytes(path.read_bytes())
    real = module.is_torchscript

    def check_then_swap(p: Path) -> bool:
        found = real(p)
        p.unlink()
        os.mkfifo(p)  # a FIFO would block a reader for ever
        return found

    monkeypatch.setattr(module, "is_torchscript", check_then_swap)
    with pytest.raises(CheckpointError) as error:
        read_exported(swapped)
    assert str(error.value) == f"refusing to read model file {swapped}: it is a FIFO, not a regular file"


def _zip(out: Path, members: dict) -> Path:
    with zipfile.ZipFile(out, "w") as archive:
        for name, data in members.items():
            archive.writestr(name, data)
    return out


def test_only_a_zip_with_one_folder_of_data_pkl_and_constants_pkl_is_torchscript(tmp_path: Path):
    assert is_torchscript(_zip(tmp_path / "ok.pt", {"a/data.pkl": b"", "a/constants.pkl": b""}))
    assert not is_torchscript(_zip(tmp_path / "deep.pt", {"a/b/data.pkl": b"", "a/b/constants.pkl": b""}))
    assert not is_torchscript(_zip(tmp_path / "top.pt", {"data.pkl": b"", "a/b": b""}))
    assert not is_torchscript(_zip(tmp_path / "no_data.pt", {"a/constants.pkl": b""}))
    (tmp_path / "text.pt").write_text("not a zip")
    assert not is_torchscript(tmp_path / "text.pt")
    # an end-of-archive record (what is_zipfile looks for) whose central directory is not there
    (tmp_path / "broken.pt").write_bytes(b"x" * 46 + b"PK\x05\x06" + struct.pack("<HHHHIIH", 0, 0, 1, 1, 46, 0, 0))
    assert zipfile.is_zipfile(tmp_path / "broken.pt") and not is_torchscript(tmp_path / "broken.pt")
    with pytest.raises(CheckpointError) as error:
        read_exported(tmp_path / "text.pt")
    assert str(error.value) == (f"{tmp_path / 'text.pt'} is not a TorchScript file (a zip with data.pkl and "
                                "constants.pkl), as `shardfc export` writes")


def test_weights_for_names_what_is_missing_and_what_differs_five_at_most():
    from shardfc.checkpoint.exported import Exported

    held = Exported(Path("m.pt"), {}, {f"w{i}": torch.zeros(2) for i in range(6)})
    with pytest.raises(CheckpointError) as error:
        held.weights_for({**{f"w{i}": torch.zeros(3) for i in range(5)}, **{f"x{i}": torch.zeros(1) for i in range(7)}})
    wrong = ", ".join(f"w{i} [2] (expected [3])" for i in range(5))
    assert str(error.value) == ("m.pt (exported from backbone '?', embedding_dim ?) does not hold this backbone's "
                                f"weights: 7 missing key(s): x0, x1, x2, x3, x4 and 2 more; 5 of another shape: {wrong}")
    assert held.weights_for({"w5": torch.ones(2)}) == {"w5": held.tensors["w5"]}


def test_a_member_is_read_up_to_its_limit_and_refused_past_it(tmp_path: Path):
    from shardfc.checkpoint.exported import _member

    path = _zip(tmp_path / "m.pt", {"a/x": b"y" * 2048, "a/z": b"y" * 2049})
    with zipfile.ZipFile(path) as archive:
        assert _member(archive, "a/x", 2048, path) == b"y" * 2048
        with pytest.raises(CheckpointError) as error:
            _member(archive, "a/z", 2048, path)
    assert str(error.value) == (f"refusing to read {path}: its a/z has 2049 bytes, more than the 2 KiB a "
                                "`shardfc export` file holds there")


def test_torchscript_classes_become_one_placeholder_class_per_qualified_name(exported):
    from shardfc.checkpoint.exported import Scripted, _ExportUnpickler

    _, path = exported
    with zipfile.ZipFile(path) as archive:
        unpickler = _ExportUnpickler(b"", archive, "")
        top = unpickler.find_class("__torch__", "Net")
        inner = unpickler.find_class("__torch__.torch.nn.modules.linear", "Linear")
        assert issubclass(top, Scripted) and issubclass(inner, Scripted) and top is not inner
        assert (top.torch_class, top.__name__) == ("__torch__.Net", "Net")
        assert inner.torch_class == "__torch__.torch.nn.modules.linear.Linear"
        assert unpickler.find_class("__torch__", "Net") is top


def test_a_persistent_id_not_shaped_as_torch_writes_it_is_refused_naming_it(exported):
    from shardfc.checkpoint.exported import _ExportUnpickler, _StorageDtype
    from shardfc.checkpoint.format import short_repr

    _, path = exported
    with zipfile.ZipFile(path) as archive:
        prefix = next(n for n in archive.namelist() if n.endswith("/data.pkl"))[: -len("data.pkl")]
        numel = archive.getinfo(f"{prefix}data/0").file_size // 4
        unpickler = _ExportUnpickler(b"", archive, prefix)
        f32 = _StorageDtype(torch.float32)
        assert unpickler.persistent_load(("storage", f32, "0", "cpu", numel)).shape == (numel,)
        for pid in [("storage", "float", "0", "cpu", numel), ("blob", f32, "0", "cpu", numel),
                    ("storage", f32, 0, "cpu", numel), ("storage", f32, "0", "cpu", float(numel)), ["storage"]]:
            with pytest.raises(pickle.UnpicklingError) as error:
                unpickler.persistent_load(pid)
            assert str(error.value) == f"unexpected persistent id {short_repr(pid)}"
        with pytest.raises(pickle.UnpicklingError) as error:
            unpickler.persistent_load(("storage", f32, "99", "cpu", 1))
        assert str(error.value) == "storage '99' is not in the archive"
        with pytest.raises(pickle.UnpicklingError) as error:
            unpickler.persistent_load(("storage", f32, "1", "cpu", 10**6))
        size = archive.getinfo(f"{prefix}data/1").file_size
        assert str(error.value) == f"storage '1' has {size} bytes for 1000000 x torch.float32"


def test_the_tensors_of_a_placeholder_tree_each_object_walked_once():
    from shardfc.checkpoint.exported import Scripted, _tensors

    def placeholder(state):
        obj = Scripted()
        obj.__setstate__(state)
        return obj

    w, v = torch.zeros(1), torch.ones(1)
    shared = placeholder({"w": w})
    stateless = placeholder(None)
    root = placeholder({1: v, "child": placeholder({"v": v, "up": None}), "a": shared, "b": shared,
                        "stateless": stateless, "w": w})
    found = _tensors(root)
    assert found.pop("w") is w and found.pop("child.v") is v
    assert list(found) in (["a.w"], ["b.w"])  # a crafted tree's shared object: walked once
    assert _tensors(placeholder([w])) == {}


def _member_names(path: Path) -> tuple:
    with zipfile.ZipFile(path) as archive:
        names = archive.namelist()
    prefix = next(n for n in names if n.endswith("/data.pkl"))[: -len("data.pkl")]
    return prefix, names


def _rewritten(path: Path, out: Path, change: dict) -> Path:
    """A copy of zip ``path`` with members (by name after the archive folder) replaced, or dropped for None."""
    prefix, _ = _member_names(path)
    with zipfile.ZipFile(path) as src, zipfile.ZipFile(out, "w") as dst:
        for info in src.infolist():
            rest = info.filename[len(prefix):]
            if rest in change and change[rest] is None:
                continue
            dst.writestr(info, change.get(rest, src.read(info)))
        for rest, data in change.items():
            if data is not None and prefix + rest not in src.namelist():
                dst.writestr(prefix + rest, data)
    return out


def test_the_byte_order_recorded_must_be_this_machines(exported, tmp_path: Path):
    _, path = exported
    prefix, _ = _member_names(path)
    other = "big" if sys.byteorder == "little" else "little"
    for recorded, shown in [(other.encode(), repr(other)), (b"\xff", repr("\ufffd"))]:
        crafted = _rewritten(path, tmp_path / "order.pt", {"byteorder": recorded})
        with pytest.raises(CheckpointError) as error:
            read_exported(crafted)
        assert str(error.value) == f"{crafted} was written on a {shown}-endian machine; this one is {sys.byteorder}-endian"
    crafted = _rewritten(path, tmp_path / "long.pt", {"byteorder": sys.byteorder.encode() + b" " * (65 - len(sys.byteorder))})
    with pytest.raises(CheckpointError) as error:
        read_exported(crafted)
    assert str(error.value) == (f"refusing to read {crafted}: its {prefix}byteorder has 65 bytes, more than the "
                                "64 bytes a `shardfc export` file holds there")
    # torch's files from before the byteorder record are little-endian
    unrecorded = read_exported(_rewritten(path, tmp_path / "none.pt", {"byteorder": None}))
    if sys.byteorder == "little":
        assert unrecorded.tensors.keys() == read_exported(path).tensors.keys()


def test_refusals_of_a_crafted_data_pkl_in_full(exported, tmp_path: Path):
    _, path = exported
    crafted = _with_data_pkl(path, tmp_path / "long.pt", b"\x80\x02cbuiltins\n" + b"x" * 300 + b"\n.")
    with pytest.raises(CheckpointError) as error:
        read_exported(crafted)
    assert str(error.value) == (
        f"refusing to read {crafted}: its data.pkl names the global {('builtins.' + 'x' * 300)[:200]}, which a "
        "`shardfc export` file never holds (only tensors and TorchScript modules); it was not called. shardfc reads "
        "exported models without running them: export the model again with `shardfc export`, or start from its checkpoint"
    )
    crafted = _with_data_pkl(path, tmp_path / "int.pt", pickle.dumps(5, protocol=2))
    with pytest.raises(CheckpointError) as error:
        read_exported(crafted)
    assert str(error.value) == f"{crafted}: its data.pkl holds a int, not a TorchScript module"


def test_the_metadata_is_empty_without_a_shardfc_json_and_a_large_one_is_refused(exported, tmp_path: Path):
    from shardfc.checkpoint.exported import MAX_METADATA_BYTES

    _, path = exported
    prefix, _ = _member_names(path)
    assert read_exported(_rewritten(path, tmp_path / "none.pt", {"extra/shardfc.json": None})).metadata == {}
    crafted = _rewritten(path, tmp_path / "big.pt", {"extra/shardfc.json": b" " * (MAX_METADATA_BYTES + 1)})
    with pytest.raises(CheckpointError) as error:
        read_exported(crafted)
    assert str(error.value) == (f"refusing to read {crafted}: its {prefix}extra/shardfc.json has {MAX_METADATA_BYTES + 1} "
                                f"bytes, more than the {MAX_METADATA_BYTES >> 10} KiB a `shardfc export` file holds there")


def test_a_tensor_past_the_end_of_an_empty_storage_is_refused(exported, tmp_path: Path):
    """A storage of 0 bytes is an empty tensor: a crafted tensor of one element on it is refused by the
    bounds check, not read from memory the file never held."""
    from shardfc.checkpoint.weights_only import error_line

    _, path = exported
    storage = b"(" + _text("storage") + b"ctorch\nFloatStorage\n" + _text("e") + _text("cpu") + b"K\x00tQ"
    tensor = (b"ctorch._utils\n_rebuild_tensor_v2\n(" + storage + b"K\x00(K\x01t(K\x01t"
              + b"\x89ccollections\nOrderedDict\n)RtR")
    crafted = _rewritten(path, tmp_path / "empty.pt", {"data/e": b"", "data.pkl": b"\x80\x02" + tensor + b"."})
    with pytest.raises(RuntimeError) as reference:
        torch.as_strided(torch.empty(0), (1,), (1,), 0)
    with pytest.raises(CheckpointError) as error:
        read_exported(crafted)
    assert str(error.value) == f"cannot read {crafted}: its data.pkl is malformed ({error_line(reference.value)})"
