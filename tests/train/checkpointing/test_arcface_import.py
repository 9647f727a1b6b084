"""``shardfc import-arcface``: arcface_torch backbones and per-rank FC shards into a resharding checkpoint.

Also ``shardfc export --fc``, the reverse: the joined class centres as one tensor."""

from __future__ import annotations

import argparse

import pytest
import torch

# torch marks TorchScript deprecated; export writes it.
pytestmark = pytest.mark.filterwarnings("ignore:`torch.jit:DeprecationWarning")

from shardfc import checkpoint as ckpt
from shardfc.cli import eval as cli_eval
from shardfc.cli import export as cli_export
from shardfc.cli import import_arcface as cli_import
from shardfc.cli import train as train_cli
from shardfc.models import build_backbone
from shardfc.train.checkpointing.arcface_import import arcface_class_range, import_arcface, load_arcface_backbone
from shardfc.train.checkpointing.artifacts import load_backbone

from ..tiny import tiny_config


def _bn(sd, prefix, c, g):
    sd[f"{prefix}.weight"] = torch.rand(c, generator=g) + 0.5
    sd[f"{prefix}.bias"] = torch.randn(c, generator=g)
    sd[f"{prefix}.running_mean"] = torch.randn(c, generator=g)
    sd[f"{prefix}.running_var"] = torch.rand(c, generator=g) + 0.5
    sd[f"{prefix}.num_batches_tracked"] = torch.tensor(1000)


def arcface_iresnet_state(layers, dim, seed=0, prefix=""):
    """A state dict with arcface_torch's iresnet names and shapes, written from its architecture."""
    g = torch.Generator().manual_seed(seed)
    sd = {"conv1.weight": torch.randn(64, 3, 3, 3, generator=g)}
    _bn(sd, "bn1", 64, g)
    sd["prelu.weight"] = torch.rand(64, generator=g)
    inplanes = 64
    for i, (planes, blocks) in enumerate(zip((64, 128, 256, 512), layers), 1):
        for b in range(blocks):
            p = f"layer{i}.{b}"
            _bn(sd, f"{p}.bn1", inplanes, g)
            sd[f"{p}.conv1.weight"] = torch.randn(planes, inplanes, 3, 3, generator=g) * 0.05
            _bn(sd, f"{p}.bn2", planes, g)
            sd[f"{p}.prelu.weight"] = torch.rand(planes, generator=g)
            sd[f"{p}.conv2.weight"] = torch.randn(planes, planes, 3, 3, generator=g) * 0.05
            _bn(sd, f"{p}.bn3", planes, g)
            if b == 0:  # every stage starts with a stride-2 block
                sd[f"{p}.downsample.0.weight"] = torch.randn(planes, inplanes, 1, 1, generator=g) * 0.05
                _bn(sd, f"{p}.downsample.1", planes, g)
            inplanes = planes
    _bn(sd, "bn2", 512, g)
    sd["fc.weight"] = torch.randn(dim, 512 * 7 * 7, generator=g) * 0.01
    sd["fc.bias"] = torch.randn(dim, generator=g)
    _bn(sd, "features", dim, g)
    return {prefix + k: v for k, v in sd.items()}


def test_arcface_iresnet_weights_load_by_name(tmp_path):
    sd = arcface_iresnet_state((2, 2, 2, 2), 32, prefix="module.")  # as saved from DDP
    torch.save(sd, tmp_path / "backbone.pth")
    model, state = load_arcface_backbone(tmp_path / "backbone.pth", "iresnet18", 32)
    assert set(state) == {k[len("module."):] for k in sd}
    for k, v in model.state_dict().items():
        assert torch.equal(v, sd["module." + k]), k
    with pytest.raises(ValueError, match=r"shape \(6\): fc.weight \(32, 25088\) vs \(64, 25088\)"):
        load_arcface_backbone(tmp_path / "backbone.pth", "iresnet18", 64)
    with pytest.raises(ValueError, match=r"missing \(.*layer2.2.*unexpected|missing \(\d+\): layer"):
        load_arcface_backbone(tmp_path / "backbone.pth", "iresnet34", 32)


def test_foreign_pickles_are_refused_unless_trusted(tmp_path):
    sd = build_backbone("tiny", 8, input_size=(16, 16)).state_dict()
    torch.save({"state_dict_backbone": sd, "cfg": argparse.Namespace(lr=0.1)}, tmp_path / "ckpt.pt")
    with pytest.raises(ckpt.CheckpointError, match="refusing to load .*argparse.Namespace"):
        load_arcface_backbone(tmp_path / "ckpt.pt", "tiny", 8, input_size=(16, 16))
    model, _ = load_arcface_backbone(tmp_path / "ckpt.pt", "tiny", 8, trust_pickle=True, input_size=(16, 16))
    assert all(torch.equal(v, sd[k]) for k, v in model.state_dict().items())


def test_class_split_is_arcface_torchs():
    # 10 classes over 3 ranks: 4, 3, 3; over 4 ranks: 3, 3, 2, 2.
    assert [arcface_class_range(10, 3, r) for r in range(3)] == [(0, 4), (4, 7), (7, 10)]
    assert [arcface_class_range(10, 4, r) for r in range(4)] == [(0, 3), (3, 6), (6, 8), (8, 10)]


def _v2_run(tmp_path, num_classes, dim, world, step=7, with_momentum=True, seed=1):
    """checkpoint_gpu_<r>.pt files as arcface_torch's train_v2 saves them (tiny backbone, 16x16)."""
    g = torch.Generator().manual_seed(seed)
    backbone = build_backbone("tiny", dim, input_size=(16, 16)).state_dict()
    n_params = len(backbone)
    weights, moms = [], []
    for r in range(world):
        start, stop = arcface_class_range(num_classes, world, r)
        w = torch.randn(stop - start, dim, generator=g)
        m = torch.randn(stop - start, dim, generator=g)
        weights.append(w)
        moms.append(m)
        opt_state = {i: {"momentum_buffer": torch.zeros(1)} for i in range(n_params)}
        if with_momentum:
            opt_state[n_params] = {"momentum_buffer": m}
        torch.save({
            "epoch": 2, "global_step": step, "state_dict_backbone": backbone,
            "state_dict_softmax_fc": {"weight": w},
            "state_optimizer": {"state": opt_state, "param_groups": [
                {"params": list(range(n_params)), "lr": 0.1, "momentum": 0.9},
                {"params": [n_params], "lr": 0.1, "momentum": 0.9}]},
            "state_lr_scheduler": {"last_epoch": step, "base_lrs": [0.1, 0.1]},
        }, tmp_path / f"checkpoint_gpu_{r}.pt")
    return backbone, weights, moms


def test_v2_shards_become_a_checkpoint_read_by_any_split(tmp_path):
    backbone, weights, moms = _v2_run(tmp_path, 10, 8, 3)
    heads = [tmp_path / f"checkpoint_gpu_{r}.pt" for r in (2, 0, 1)]  # any order
    path, head = import_arcface(tmp_path / "run", heads[1], "tiny", heads, input_size=(16, 16))
    assert path.name == "step_00000007" and head.world_size == 3
    # Class c lives on rank r at row c - start_r: 0-3 on rank 0, 4-6 on rank 1, 7-9 on rank 2.
    full_w, full_m = torch.cat(weights), torch.cat(moms)
    for rng in (range(0, 5), range(5, 10), range(3, 8)):  # reading it as 2 ranks, and an odd range
        loaded = ckpt.load_checkpoint(path, class_range=rng, num_classes=10)
        assert torch.equal(loaded.head_tensors["weight"], full_w[rng.start:rng.stop])
        assert torch.equal(loaded.head_tensors["optimizer.momentum_buffer"], full_m[rng.start:rng.stop])
    trained = load_backbone(tmp_path / "run")
    assert trained.config.backbone == "tiny" and trained.image_size == (16, 16)
    with pytest.raises(ValueError, match="already holds checkpoints .*step_00000007"):
        import_arcface(tmp_path / "run", heads[1], "tiny", heads, input_size=(16, 16))
    for k, v in trained.model.state_dict().items():
        assert torch.equal(v, backbone[k])


def test_v1_softmax_weight_files_through_the_cli(tmp_path, capsys):
    g = torch.Generator().manual_seed(3)
    ws = [torch.randn(n, 8, generator=g) for n in (3, 3, 2, 2)]  # 10 classes on 4 ranks
    for r, w in enumerate(ws):
        torch.save(w, tmp_path / f"rank_{r}_softmax_weight.pt")
        torch.save(w * 2, tmp_path / f"rank_{r}_softmax_weight_mom.pt")
    torch.save(build_backbone("tiny", 8).state_dict(), tmp_path / "backbone.pth")
    argv = ["--backbone", str(tmp_path / "backbone.pth"), "--network", "tiny", "--out", str(tmp_path / "run"),
            "--head", str(tmp_path / "rank_*_softmax_weight.pt")]  # a quoted glob, expanded by the command
    assert cli_import.main(argv + ["--num-classes", "11"]) == 2
    assert "--num-classes 11 but the head files hold 10 classes" in capsys.readouterr().err
    assert cli_import.main(argv) == 0
    assert "10 classes x 8 from 4 arcface_torch rank(s)" in capsys.readouterr().out
    path = ckpt.latest_checkpoint(tmp_path / "run" / "checkpoints")
    loaded = ckpt.load_checkpoint(path, class_range=range(10), num_classes=10)
    assert torch.equal(loaded.head_tensors["weight"], torch.cat(ws))
    assert torch.equal(loaded.head_tensors["optimizer.momentum_buffer"], torch.cat(ws) * 2)
    # And back out as one tensor.
    fc = tmp_path / "fc.pt"
    assert cli_export.main(["--checkpoint", str(tmp_path / "run"), "--out", str(tmp_path / "m.pt"), "--fc", str(fc)]) == 0
    assert torch.equal(torch.load(fc, weights_only=True), torch.cat(ws))


def test_bad_shards_are_named(tmp_path, capsys):
    _v2_run(tmp_path, 10, 8, 3)
    heads = [tmp_path / f"checkpoint_gpu_{r}.pt" for r in range(3)]
    with pytest.raises(ValueError, match="ranks 0..1, got ranks \\[0, 2\\]"):
        import_arcface(tmp_path / "run", heads[0], "tiny", [heads[0], heads[2]], input_size=(16, 16))
    w = torch.load(heads[2], weights_only=True)
    w["state_dict_softmax_fc"]["weight"] = torch.cat([w["state_dict_softmax_fc"]["weight"], torch.zeros(1, 8)])
    torch.save(w, heads[2])  # 4, 3, 4 rows: 11 classes split 4, 4, 3 by arcface_torch
    with pytest.raises(ValueError, match="checkpoint_gpu_1.pt holds 3 classes, but arcface_torch gives rank 1 of 3 4 of 11"):
        import_arcface(tmp_path / "run", heads[1], "tiny", heads, input_size=(16, 16))
    with pytest.raises(ValueError, match="cannot tell the rank"):
        import_arcface(tmp_path / "run", heads[1], "tiny", [tmp_path / "weights.pt"], input_size=(16, 16))
    with pytest.raises(ValueError, match="--num-classes must be a positive int"):
        import_arcface(tmp_path / "run", heads[1], "tiny", input_size=(16, 16))
    assert cli_import.main(["--backbone", str(heads[1]), "--network", "tiny", "--out", str(tmp_path / "r2"),
                            "--head", str(tmp_path / "none_*.pt")]) == 2
    assert "matches no file" in capsys.readouterr().err


def test_what_cannot_be_imported_is_refused_by_flag_before_the_backbone_is_read(tmp_path, capsys, monkeypatch):
    import shardfc.train.checkpointing.arcface_import as arcface_import

    monkeypatch.setattr(arcface_import, "load_arcface_backbone", lambda *a, **k: pytest.fail("the backbone was read"))
    (tmp_path / "file").write_text("keep")
    fresh = dict(num_classes=10, input_size=(16, 16))
    with pytest.raises(ValueError) as err:
        import_arcface(tmp_path / "file", tmp_path / "b.pth", "tiny", embedding_dim=16, **fresh)
    assert str(err.value) == f"--out {str(tmp_path / 'file')!r} is a file; name the folder to create the run in"
    for dim in (0, -1, (1 << 16) + 1):
        with pytest.raises(ValueError) as err:
            import_arcface(tmp_path / "run", tmp_path / "b.pth", "tiny", embedding_dim=dim, **fresh)
        assert str(err.value) == f"--embedding-dim must be in [1, 65536], got {dim}"
    monkeypatch.setattr(arcface_import, "_physical_memory", lambda: 10 * 16 * 4 - 1)  # one byte short of the head
    with pytest.raises(ValueError) as err:
        import_arcface(tmp_path / "run", tmp_path / "b.pth", "tiny", embedding_dim=16, **fresh)
    assert str(err.value) == ("--num-classes 10 x --embedding-dim 16: the fresh head's 0.0 GiB of float32 centres "
                              "exceed this machine's 0.0 GiB of memory")
    monkeypatch.setattr(arcface_import, "_physical_memory", lambda: 3 << 29)  # 1.5 GiB; the head 2 GiB
    with pytest.raises(ValueError) as err:
        import_arcface(tmp_path / "run", tmp_path / "b.pth", "tiny", num_classes=1 << 20, input_size=(16, 16))
    assert str(err.value) == ("--num-classes 1048576 x --embedding-dim 512: the fresh head's 2.0 GiB of float32 "
                              "centres exceed this machine's 1.5 GiB of memory")
    assert (tmp_path / "file").read_text() == "keep" and not (tmp_path / "run").exists()
    assert cli_import.main(["--backbone", str(tmp_path / "b.pth"), "--network", "tiny", "--out", str(tmp_path / "file"),
                            "--num-classes", "3"]) == 2
    assert capsys.readouterr().err == (f"shardfc import-arcface: error: --out {str(tmp_path / 'file')!r} is a file; "
                                       "name the folder to create the run in\n")


@pytest.mark.parametrize("dim", [1, 1 << 16])
def test_the_widest_and_narrowest_embeddings_reach_the_backbone(tmp_path, monkeypatch, dim):
    import shardfc.train.checkpointing.arcface_import as arcface_import

    def reached(path, network, embedding_dim, **kwargs):
        raise LookupError(f"backbone asked for {embedding_dim}")

    monkeypatch.setattr(arcface_import, "load_arcface_backbone", reached)
    monkeypatch.setattr(arcface_import, "_physical_memory", lambda: None)
    with pytest.raises(LookupError, match=f"^backbone asked for {dim}$"):
        import_arcface(tmp_path / "run", tmp_path / "b.pth", "tiny", num_classes=2, embedding_dim=dim)


def test_the_machines_memory_is_read_from_the_os(monkeypatch):
    import shardfc.train.checkpointing.arcface_import as arcface_import

    values = {"SC_PHYS_PAGES": 1000, "SC_PAGE_SIZE": 4096}
    monkeypatch.setattr(arcface_import.os, "sysconf", lambda name: values[name])
    assert arcface_import._physical_memory() == 4_096_000

    def unknown(name):
        raise ValueError(f"unrecognized configuration name {name!r}")

    monkeypatch.setattr(arcface_import.os, "sysconf", unknown)
    assert arcface_import._physical_memory() is None


def test_a_head_that_fits_the_machine_exactly_is_drawn(tmp_path, monkeypatch):
    import shardfc.train.checkpointing.arcface_import as arcface_import

    torch.save(build_backbone("tiny", 16, input_size=(16, 16)).state_dict(), tmp_path / "b.pth")
    monkeypatch.setattr(arcface_import, "_physical_memory", lambda: 10 * 16 * 4)
    path, _ = import_arcface(tmp_path / "run", tmp_path / "b.pth", "tiny", num_classes=10, embedding_dim=16,
                             input_size=(16, 16))
    assert ckpt.load_checkpoint(path, class_range=range(10), num_classes=10).head_tensors["weight"].shape == (10, 16)
    monkeypatch.setattr(arcface_import, "_physical_memory", lambda: None)  # an OS that does not say: not checked
    import_arcface(tmp_path / "run2", tmp_path / "b.pth", "tiny", num_classes=10, embedding_dim=16, input_size=(16, 16))


def test_fresh_head_for_fine_tuning_and_resume_on_another_world_size(tmp_path):
    """A released backbone with a fresh head, then an arcface run of 3 ranks resumed by 2 processes."""
    sd = build_backbone("tiny", 16, input_size=(16, 16)).state_dict()
    torch.save(sd, tmp_path / "backbone.pth")
    path, _ = import_arcface(tmp_path / "ft", tmp_path / "backbone.pth", "tiny", num_classes=24, embedding_dim=16,
                             input_size=(16, 16))
    w = ckpt.load_checkpoint(path, class_range=range(24), num_classes=24).head_tensors["weight"]
    assert w.shape == (24, 16) and 0.005 < float(w.std()) < 0.015  # N(0, 0.01) as arcface_torch draws it

    _v2_run(tmp_path, 24, 16, 3, step=4)
    heads = [tmp_path / f"checkpoint_gpu_{r}.pt" for r in range(3)]
    import_arcface(tmp_path / "run", heads[0], "tiny", heads, input_size=(16, 16))
    cfg = tiny_config(tmp_path / "run", max_steps=6, eval_every=0, ckpt_every=6)
    summary = train_cli.run(cfg)
    assert summary["step"] == 6  # continued from the imported step 4 on 2 processes
    assert ckpt.step_of(ckpt.latest_checkpoint(tmp_path / "run" / "checkpoints")) == 6


def arcface_mbf_state(dim, seed=0, prefix="module."):
    """An arcface_torch ``mbf`` state dict as its DDP run saves it: its keys with ``prefix``, random values.

    The keys and shapes are those tests/models/test_arcface_mbf.py checks against arcface_torch's structure."""
    g = torch.Generator().manual_seed(seed)
    sd = {}
    for k, v in build_backbone("mbf", dim).state_dict().items():
        if k.endswith("num_batches_tracked"):
            sd[prefix + k] = torch.tensor(5000)
        elif k.endswith("running_var"):
            sd[prefix + k] = torch.rand(v.shape, generator=g) + 0.5
        else:
            sd[prefix + k] = torch.randn(v.shape, generator=g) * 0.05
    return sd


def test_arcface_mbf_imports_trains_evaluates_and_exports(tmp_path, capsys):
    sd = arcface_mbf_state(16)
    assert "module.layers.1.layers.0.weight" in sd and "module.features.layers.2.weight" in sd
    torch.save(sd, tmp_path / "model.pt")
    run = tmp_path / "run"
    argv = ["--backbone", str(tmp_path / "model.pt"), "--network", "mbf", "--num-classes", "6",
            "--embedding-dim", "16", "--out", str(run)]
    assert cli_import.main(argv) == 0, capsys.readouterr().err
    assert "mbf, 6 classes x 16" in capsys.readouterr().out
    imported = load_backbone(run)
    assert imported.config.backbone == "mbf" and imported.image_size == (112, 112)
    for k, v in imported.model.state_dict().items():
        assert torch.equal(v, sd["module." + k]), k
    # The wrong arcface network is named, not loaded.
    with pytest.raises(ValueError, match=r"does not fit shardfc's mbf_large .*missing \(\d+\): layers.1.layers.0.layers"):
        load_arcface_backbone(tmp_path / "model.pt", "mbf_large", 16)

    cfg = tiny_config(run, backbone="mbf", image_size=[112, 112], synthetic_identities=6,
                      synthetic_images_per_identity=2, batch_size=4, grad_accum=1, max_steps=1, warmup_steps=0,
                      eval_every=0, ckpt_every=1, synthetic_val_pairs=20, eval_batch_size=8, nproc=1)
    assert train_cli.run(cfg)["step"] == 1  # resumed at the imported step 0, one step on
    trained = load_backbone(run)
    assert trained.config.backbone == "mbf"
    moved = [k for k, v in trained.model.state_dict().items() if not torch.equal(v, sd["module." + k])]
    assert "features.layers.2.weight" in moved  # the imported weights were trained, not replaced
    assert cli_eval.main(["--checkpoint", str(run)]) == 0, capsys.readouterr().err
    assert "synthetic: accuracy" in capsys.readouterr().out
    out = tmp_path / "mbf.pt"
    assert cli_export.main(["--checkpoint", str(run), "--out", str(out)]) == 0, capsys.readouterr().err
    assert out.is_file()
