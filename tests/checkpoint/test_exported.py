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
from shardfc.models import build_backbone
from shardfc.train.cli_export import export_torchscript


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
