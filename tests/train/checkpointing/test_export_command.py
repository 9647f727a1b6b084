"""``shardfc export``'s command line (:mod:`shardfc.cli.export`) at its edges: the TorchScript file and
its metadata, the reload check's verdict, which files ``--onnx`` and ``--fc`` name, each refusal as one
line. A stand-in backbone replaces the checkpoint; ``tests/train/test_tools.py`` exports a real one
(and its class centres)."""

from __future__ import annotations

import io
import json
import os
import warnings
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from torch import nn

from shardfc.cli import export as cli
from shardfc.train.config import TrainConfig

# torch marks torch.jit deprecated (loading here checks the file); the noisy model's trace warns by design
pytestmark = [pytest.mark.filterwarnings("ignore:`torch.jit.load` is deprecated:DeprecationWarning"),
              pytest.mark.filterwarnings("ignore::torch.jit.TracerWarning")]


class _Backbone:
    """Stands in for ``load_backbone`` (a linear embedding of 3 x 4 x 5 images) and ``export_fc``."""

    def __init__(self, monkeypatch):
        torch.manual_seed(0)
        self.model = nn.Sequential(nn.Flatten(), nn.Linear(60, 6)).eval()
        self.loaded, self.fc = [], []
        trained = SimpleNamespace(model=self.model, image_size=(4, 5), path=Path("/runs/a/step_3"),
                                  config=TrainConfig(backbone="tiny", embedding_dim=6))
        monkeypatch.setattr(cli, "load_backbone", lambda path, device, trust_pickle: self.loaded.append(
            (path, device, trust_pickle)) or trained)

        def export_fc(folder, out, *, trust_pickle=False):
            self.fc.append((folder, out, trust_pickle))
            out.write_bytes(b"fc")
            return torch.Size([10, 6])

        monkeypatch.setattr(cli, "export_fc", export_fc)


def _run(*argv):
    return cli.main([str(a) for a in argv])


def test_torchscript_with_its_metadata(monkeypatch, tmp_path, capsys):
    backbone = _Backbone(monkeypatch)
    out = tmp_path / "deep" / "er" / "model.pt"
    assert _run("--checkpoint", "ck", "--out", out) == 0
    assert backbone.loaded == [("ck", "cpu", False)] and backbone.fc == []
    extra = {"shardfc.json": ""}
    loaded = torch.jit.load(str(out), _extra_files=extra)
    assert json.loads(extra["shardfc.json"]) == {
        "backbone": "tiny", "embedding_dim": 6, "input_size": [4, 5],
        "input": "float32 [N, 3, H, W], RGB, (pixel / 255 - 0.5) / 0.5", "checkpoint": "/runs/a/step_3"}
    x = torch.randn(7, 3, 4, 5)  # any batch size, not the traced one
    torch.testing.assert_close(loaded(x), backbone.model(x))
    out_line = capsys.readouterr().out
    assert out_line.startswith(f"wrote {out} (TorchScript, tiny, input [N, 3, 4, 5] -> [N, 6]; reload check: max |diff| ")
    assert out_line.count("\n") == 1
    assert sorted(os.listdir(out.parent)) == ["model.pt"]


def test_export_torchscript_reports_the_reload_difference(tmp_path):
    class Noisy(nn.Module):  # a model whose traced graph draws new noise: the reload differs
        def forward(self, x):
            return x.flatten(1) + torch.rand(x.shape[0], 60)

    diff = cli.export_torchscript(Noisy(), torch.zeros(2, 3, 4, 5), tmp_path / "m.pt", {})
    assert 1e-3 < diff <= 1.0
    exact = cli.export_torchscript(nn.Flatten(), torch.zeros(2, 3, 4, 5), tmp_path / "m.pt", {"k": 1})
    assert exact == 0.0
    extra = {"shardfc.json": ""}
    torch.jit.load(str(tmp_path / "m.pt"), _extra_files=extra)
    assert json.loads(extra["shardfc.json"]) == {"k": 1}


@pytest.mark.parametrize("diff, code", [(cli.TOLERANCE, 0), (cli.TOLERANCE * 1.5, 1)])
def test_the_reload_check_decides(monkeypatch, tmp_path, capsys, diff, code):
    _Backbone(monkeypatch)
    monkeypatch.setattr(cli, "export_torchscript", lambda model, example, out, metadata: diff)
    assert _run("--checkpoint", "ck", "--out", tmp_path / "m.pt") == code
    captured = capsys.readouterr()
    if code:
        assert captured == ("", "shardfc export: error: the reloaded TorchScript model differs from the "
                                "checkpoint's by 0.00015\n")
    else:
        assert captured.out.endswith("reload check: max |diff| 0.0001)\n")


def test_class_centres_and_the_trusted_checkpoint(monkeypatch, tmp_path, capsys):
    backbone = _Backbone(monkeypatch)
    fc = tmp_path / "sub" / "fc.pt"
    assert _run("--checkpoint", "ck", "--trust-checkpoint", "--out", tmp_path / "m.pt", "--fc", fc) == 0
    assert backbone.loaded == [("ck", "cpu", True)]
    assert backbone.fc == [(Path("/runs/a/step_3"), fc, True)]
    assert capsys.readouterr().out.splitlines()[1] == f"wrote {fc} (class centres, one tensor [10, 6])"


@pytest.mark.parametrize("flag", [["--onnx"], ["--onnx", "{tmp}/other.onnx"]])
def test_onnx_without_its_package_is_refused_before_any_work(monkeypatch, tmp_path, capsys, flag):
    backbone = _Backbone(monkeypatch)
    monkeypatch.setattr(cli.importlib.util, "find_spec", lambda name: None)
    assert _run("--checkpoint", "ck", "--out", tmp_path / "m.pt", *[f.format(tmp=tmp_path) for f in flag]) == 2
    assert capsys.readouterr() == ("", "shardfc export: error: --onnx needs the 'onnx' package, which is not installed "
                                       "(pip install onnx)\n")
    assert os.listdir(tmp_path) == [] and backbone.loaded == []
    assert _run("--checkpoint", "ck", "--out", tmp_path / "m.pt") == 0  # without --onnx it is not needed


@pytest.mark.parametrize("flag", ["--out", "--onnx", "--fc"])
def test_a_folder_or_a_file_in_the_path_is_refused_by_flag_before_any_work(monkeypatch, tmp_path, capsys, flag):
    backbone = _Backbone(monkeypatch)
    monkeypatch.setattr(cli.importlib.util, "find_spec", lambda name: object())
    (tmp_path / "dir.pt").mkdir()
    (tmp_path / "file").write_bytes(b"keep")
    outs = {"--out": tmp_path / "m.pt", "--onnx": tmp_path / "m.onnx", "--fc": tmp_path / "fc.pt"}
    for given, said in ((tmp_path / "dir.pt", f"{str(tmp_path / 'dir.pt')!r} is a folder; name the file to write"),
                        (tmp_path / "file" / "sub" / "m.x",
                         f"{str(tmp_path / 'file' / 'sub' / 'm.x')!r}: {str(tmp_path / 'file')!r} is a file, not a folder")):
        argv = [a for f, path in {**outs, flag: given}.items() for a in (f, path)]
        assert _run("--checkpoint", "ck", *argv, "--force") == 2
        assert capsys.readouterr() == ("", f"shardfc export: error: {flag} {said}\n")
    assert sorted(os.listdir(tmp_path)) == ["dir.pt", "file"] and backbone.loaded == []
    assert (tmp_path / "file").read_bytes() == b"keep" and os.listdir(tmp_path / "dir.pt") == []


def test_a_write_that_fails_names_the_file_and_leaves_no_scratch_file(monkeypatch, tmp_path, capsys):
    _Backbone(monkeypatch)

    def full_disk(path, data):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(Path, "write_bytes", lambda self, data: full_disk(self, data))
    assert _run("--checkpoint", "ck", "--out", tmp_path / "m.pt") == 2
    assert capsys.readouterr() == ("", f"shardfc export: error: cannot write {tmp_path / 'm.pt'}: No space left on device\n")
    assert os.listdir(tmp_path) == []


def test_onnx_written_or_its_failure_named(monkeypatch, tmp_path, capsys):
    backbone = _Backbone(monkeypatch)
    monkeypatch.setattr(cli.importlib.util, "find_spec", lambda name: object() if name == "onnx" else None)
    calls = []
    monkeypatch.setattr(cli, "export_onnx", lambda model, example, out: calls.append((model, example.shape, out)))
    backbone = _Backbone(monkeypatch)
    assert _run("--checkpoint", "ck", "--out", tmp_path / "m.pt", "--onnx") == 0
    assert calls == [(backbone.model, torch.Size([2, 3, 4, 5]), tmp_path / "m.onnx")]
    assert capsys.readouterr().out.splitlines()[-1] == f"wrote {tmp_path / 'm.onnx'} (ONNX, dynamic batch)"

    def fails(model, example, out):
        raise RuntimeError("unsupported operator")

    monkeypatch.setattr(cli, "export_onnx", fails)
    assert _run("--checkpoint", "ck", "--out", tmp_path / "n.pt", "--onnx") == 1
    assert capsys.readouterr().err == "shardfc export: ONNX export failed: RuntimeError: unsupported operator\n"


def test_export_onnx_hands_the_exporter_a_dynamic_batch(monkeypatch, tmp_path):
    seen = []

    def fake_export(model, args, path, **kw):
        seen.append((model, args, kw))
        warnings.warn("torch.onnx is deprecated", DeprecationWarning)  # hidden: the exporter's own notice
        warnings.warn("an operator was exported as a constant", UserWarning)  # shown: it may matter
        Path(path).write_bytes(b"onnx")

    monkeypatch.setattr(torch.onnx, "export", fake_export)
    example = torch.zeros(2, 3, 4, 5)
    model = nn.Flatten()
    with warnings.catch_warnings(record=True) as shown:
        warnings.simplefilter("always")
        cli.export_onnx(model, example, tmp_path / "m.onnx")
    assert [str(w.message) for w in shown] == ["an operator was exported as a constant"]
    (got_model, args, kw), = seen
    assert got_model is model and args[0] is example and kw == dict(
        input_names=["images"], output_names=["embeddings"],
        dynamic_axes={"images": {0: "batch"}, "embeddings": {0: "batch"}}, dynamo=False)
    assert os.listdir(tmp_path) == ["m.onnx"] and (tmp_path / "m.onnx").read_bytes() == b"onnx"


@pytest.mark.parametrize("taken, argv", [
    ("m.pt", []),
    ("m.onnx", ["--onnx"]),
    ("fc.pt", ["--fc", "{tmp}/fc.pt"]),
])
def test_an_existing_file_is_kept_unless_forced(monkeypatch, tmp_path, capsys, taken, argv):
    backbone = _Backbone(monkeypatch)
    monkeypatch.setattr(cli.importlib.util, "find_spec", lambda name: object())
    monkeypatch.setattr(cli, "export_onnx", lambda model, example, out: out.write_bytes(b"new"))
    (tmp_path / taken).write_bytes(b"keep")
    argv = ["--checkpoint", "ck", "--out", tmp_path / "m.pt", *[a.format(tmp=tmp_path) for a in argv]]
    assert _run(*argv) == 2
    assert capsys.readouterr() == ("", f"shardfc export: error: {tmp_path / taken} exists; pass --force to replace it\n")
    assert (tmp_path / taken).read_bytes() == b"keep" and backbone.loaded == []
    assert _run(*argv, "--force") == 0
    assert (tmp_path / taken).read_bytes() != b"keep"


def test_a_checkpoint_error_is_one_line(monkeypatch, tmp_path, capsys):
    def missing(path, device, trust_pickle):
        raise FileNotFoundError(f"no checkpoint under {path!r}")

    monkeypatch.setattr(cli, "load_backbone", missing)
    assert _run("--checkpoint", "nowhere", "--out", tmp_path / "m.pt") == 2
    assert capsys.readouterr() == ("", "shardfc export: error: no checkpoint under 'nowhere'\n")


def test_no_flag_taken_by_a_prefix(capsys):
    with pytest.raises(SystemExit):
        cli.main(["--checkpoint", "ck", "--out", "m.pt", "--forc"])
    assert "unrecognized arguments: --forc" in capsys.readouterr().err


def test_the_written_bytes_are_the_checked_ones(monkeypatch, tmp_path):
    # the reload check reads the bytes it wrote, not the file by its name
    opened = []
    real_load = torch.jit.load
    monkeypatch.setattr(torch.jit, "load", lambda f, **kw: opened.append(type(f)) or real_load(f, **kw))
    cli.export_torchscript(nn.Flatten(), torch.zeros(2, 3, 4, 5), tmp_path / "m.pt", {})
    assert opened == [io.BytesIO]


def test_the_tracers_warnings_reach_the_user(tmp_path):
    class Noisy(nn.Module):
        def forward(self, x):
            return x.flatten(1) + torch.rand(x.shape[0], 60)

    with warnings.catch_warnings(record=True) as shown:
        warnings.simplefilter("always")
        cli.export_torchscript(Noisy(), torch.zeros(2, 3, 4, 5), tmp_path / "m.pt", {})
    kinds = {type(w.message) for w in shown}
    assert torch.jit.TracerWarning in kinds and DeprecationWarning not in kinds


def _saved_head(root, weight):
    from shardfc.checkpoint import save_checkpoint

    return save_checkpoint(root, 5, common={"note": "x"}, per_rank=None, head_tensors={"weight": weight},
                           class_range=range(len(weight)), num_classes=len(weight), fingerprint={"model": "m"})


def test_export_fc_writes_every_class_centre(tmp_path):
    weight = torch.randn(7, 4)
    folder = _saved_head(tmp_path / "ck", weight)
    out = tmp_path / "fc.pt"
    assert cli.export_fc(folder, out) == torch.Size([7, 4])
    assert torch.equal(torch.load(out, weights_only=True), weight)
    assert sorted(os.listdir(tmp_path)) == ["ck", "fc.pt"]


def test_export_fc_trusts_a_pickle_only_when_told(tmp_path):
    import argparse

    from shardfc import checkpoint as ckpt
    from train.legacy import rewrite_file  # tests/ is on sys.path (its conftest.py)

    weight = torch.randn(3, 4)
    folder = _saved_head(tmp_path / "ck", weight)
    obj = torch.load(folder / ckpt.COMMON_FILE, weights_only=True)
    rewrite_file(folder, ckpt.COMMON_FILE, {**obj, "cfg": argparse.Namespace(lr=0.1)})
    with pytest.raises(ckpt.CheckpointError, match="refusing to load"):
        cli.export_fc(folder, tmp_path / "fc.pt")
    assert not (tmp_path / "fc.pt").exists()
    assert cli.export_fc(folder, tmp_path / "fc.pt", trust_pickle=True) == torch.Size([3, 4])
    assert torch.equal(torch.load(tmp_path / "fc.pt", weights_only=True), weight)


def test_arguments_from_the_command_line(monkeypatch, tmp_path):
    backbone = _Backbone(monkeypatch)
    monkeypatch.setattr("sys.argv", ["shardfc export", "--checkpoint", "from-argv", "--out", str(tmp_path / "m.pt")])
    assert cli.main() == 0
    assert backbone.loaded[0][0] == "from-argv"


@pytest.mark.parametrize("argv, first, second, name", [
    (["--out", "{d}/m.onnx", "--onnx"], "--out", "--onnx", "{d}/m.onnx"),  # the ONNX default: --out's own name
    (["--out", "{d}/m.pt", "--onnx", "{d}/m.pt"], "--out", "--onnx", "{d}/m.pt"),
    (["--out", "{d}/m.pt", "--fc", "{d}/./m.pt"], "--out", "--fc", "{d}/m.pt"),
    (["--out", "{d}/m.pt", "--onnx", "{d}/c.pt", "--fc", "{d}/c.pt"], "--onnx", "--fc", "{d}/c.pt"),
])
def test_two_outputs_of_one_name_are_refused_before_loading(monkeypatch, tmp_path, capsys, argv, first, second, name):
    # the later write replaced the earlier one: a "model.onnx" that was no TorchScript, or centres instead of a model
    backbone = _Backbone(monkeypatch)
    assert _run("--checkpoint", "ck", *[a.format(d=tmp_path) for a in argv]) == 2
    assert capsys.readouterr().err == (f"shardfc export: error: {first} and {second} name one file, "
                                       f"{name.format(d=tmp_path)!r}: each output needs its own\n")
    assert backbone.loaded == [] and list(tmp_path.iterdir()) == []
