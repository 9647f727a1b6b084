"""The arcface_torch files ``shardfc import-arcface`` reads, at their edges: each way a backbone file
or an FC shard can be wrong (a message naming the file, word for word), what is taken from a shard
(momentum, epoch and step, notes) and what the written checkpoint holds. In the test's process with
a tiny backbone; ``test_arcface_import.py`` holds the command end to end."""

from __future__ import annotations

import argparse
import json

import pytest
import torch

from shardfc import checkpoint as ckpt
from shardfc.models import build_backbone
from shardfc.train.checkpointing.arcface_import import import_arcface, load_arcface_backbone, read_arcface_head

TINY = dict(input_size=(16, 16))


def _backbone(tmp_path, dim=8, name="backbone.pth", dtype=None):
    sd = build_backbone("tiny", dim, **TINY).state_dict()
    if dtype is not None:
        sd = {k: v.to(dtype) if v.is_floating_point() else v for k, v in sd.items()}
    torch.save(sd, tmp_path / name)
    return tmp_path / name, sd


def _shard(tmp_path, rank, weight, *, optimizer=None, name=None, **extra):
    obj = {"state_dict_softmax_fc": {"weight": weight}, **extra}
    if optimizer is not None:
        obj["state_optimizer"] = optimizer
    path = tmp_path / (name or f"checkpoint_gpu_{rank}.pt")
    torch.save(obj, path)
    return path


def _sgd(buffer):
    return {"state": {0: {"momentum_buffer": torch.zeros(1)}, 1: {"momentum_buffer": buffer}},
            "param_groups": [{"params": [0]}, {"params": [1]}]}


def _error(func, *args, **kwargs) -> str:
    with pytest.raises(ValueError) as info:
        func(*args, **kwargs)
    return str(info.value)


# ------------------------------------------------------------------ the backbone file


def test_a_missing_file_is_named(tmp_path):
    with pytest.raises(FileNotFoundError) as info:
        load_arcface_backbone(tmp_path / "nope.pth", "tiny", 8, **TINY)
    assert str(info.value) == f"arcface_torch file not found: {str(tmp_path / 'nope.pth')!r}"


def test_a_link_to_a_backbone_is_followed(tmp_path):
    path, sd = _backbone(tmp_path)
    (tmp_path / "link.pth").symlink_to(path)
    _, state = load_arcface_backbone(tmp_path / "link.pth", "tiny", 8, **TINY)
    assert all(torch.equal(state[k], v) for k, v in sd.items())


def test_the_embedding_width_is_512_unless_told(tmp_path):
    path, _ = _backbone(tmp_path, dim=512)
    model, _ = load_arcface_backbone(path, "tiny", **TINY)
    assert model.state_dict()["features.weight"].shape == (512,)


@pytest.mark.parametrize("obj", [torch.zeros(3), {"a": torch.zeros(1), "b": 3}, {"state_dict_backbone": [1]}])
def test_what_is_not_a_state_dict_is_named(tmp_path, obj):
    torch.save(obj, tmp_path / "x.pth")
    assert _error(load_arcface_backbone, tmp_path / "x.pth", "tiny", 8, **TINY) == (
        f"{tmp_path / 'x.pth'} is not a backbone state dict (a mapping of parameter names to tensors)")


def test_a_state_dict_that_does_not_fit_names_the_first_differences(tmp_path):
    sd = build_backbone("tiny", 8, **TINY).state_dict()
    keys = list(sd)
    broken = {k: v for k, v in sd.items() if k not in keys[:6]}  # six missing: five named, then " ..."
    broken.update({"extra.a": torch.zeros(1), "extra.b": torch.zeros(1)})
    broken["fc.weight"] = torch.zeros(3, 3)
    torch.save(broken, tmp_path / "x.pth")
    assert _error(load_arcface_backbone, tmp_path / "x.pth", "tiny", 8, **TINY) == (
        f"{tmp_path / 'x.pth'} does not fit shardfc's tiny with embedding_dim=8: "
        f"missing (6): {', '.join(keys[:5])} ...; unexpected (2): extra.a, extra.b; "
        f"shape (1): fc.weight (3, 3) vs {tuple(sd['fc.weight'].shape)}")
    five = {k: v for k, v in sd.items() if k not in keys[:5]}
    torch.save(five, tmp_path / "y.pth")
    assert _error(load_arcface_backbone, tmp_path / "y.pth", "tiny", 8, **TINY) == (
        f"{tmp_path / 'y.pth'} does not fit shardfc's tiny with embedding_dim=8: missing (5): {', '.join(keys[:5])}")


def test_weights_take_the_models_dtypes(tmp_path):
    path, sd = _backbone(tmp_path, dtype=torch.float64)
    _, state = load_arcface_backbone(path, "tiny", 8, **TINY)
    assert state["fc.weight"].dtype == torch.float32 and torch.equal(state["fc.weight"], sd["fc.weight"].float())


# ------------------------------------------------------------------ the FC shards


def test_momentum_epoch_and_step_come_from_the_shards(tmp_path):
    w0, w1 = torch.randn(3, 4), torch.randn(2, 4)
    paths = [_shard(tmp_path, 0, w0, optimizer=_sgd(w0 * 2), epoch=3, global_step=40),
             _shard(tmp_path, 1, w1, optimizer=_sgd(w1 * 2), epoch=3, global_step=40)]
    head = read_arcface_head(paths)
    assert torch.equal(head.weight, torch.cat([w0, w1])) and torch.equal(head.momentum, torch.cat([w0, w1]) * 2)
    assert (head.world_size, head.epoch, head.global_step, head.notes) == (2, 3, 40, [])


def test_a_shard_without_momentum_leaves_the_head_without(tmp_path):
    w0, w1 = torch.randn(3, 4), torch.randn(2, 4)
    paths = [_shard(tmp_path, 0, w0, optimizer=_sgd(w0)), _shard(tmp_path, 1, w1, optimizer=_sgd(torch.zeros(9)))]
    head = read_arcface_head(paths)
    assert head.momentum is None and (head.epoch, head.global_step) == (0, 0)  # absent: 0


def test_adamw_moments_are_noted_once(tmp_path):
    adam = {"state": {0: {"exp_avg": torch.zeros(1)}}, "param_groups": [{"params": [0]}]}
    paths = [_shard(tmp_path, r, torch.randn(2, 4), optimizer=adam) for r in range(2)]
    head = read_arcface_head(paths)
    assert head.notes == ["AdamW moments of the FC are not imported (they restart at zero)"] and head.momentum is None
    plain = {"state": {0: {}}, "param_groups": [{"params": [0]}]}
    mixed = [paths[0], _shard(tmp_path, 1, torch.randn(2, 4), optimizer=plain)]
    assert read_arcface_head(mixed).notes == ["AdamW moments of the FC are not imported (they restart at zero)"]
    assert read_arcface_head([_shard(tmp_path, 0, torch.randn(2, 4), optimizer=plain)]).notes == []


@pytest.mark.parametrize("optimizer", [
    {"state": {}, "param_groups": [{"params": [0]}]},  # the FC's entry absent (no step taken yet)
    {"param_groups": [{"params": [0]}]},               # no state at all
])
def test_an_optimizer_without_the_fcs_state_gives_no_momentum(tmp_path, optimizer):
    head = read_arcface_head([_shard(tmp_path, 0, torch.randn(2, 4), optimizer=optimizer)])
    assert head.momentum is None and head.notes == []


@pytest.mark.parametrize("optimizer", [
    {"param_groups": [{"lr": 0.1}]},                      # no params
    {"param_groups": [{"params": []}]},                   # an empty group
    {"param_groups": "sgd"},                              # not a list of groups
    {"param_groups": [{"params": [0]}], "state": [1]},    # state not a mapping
    {"param_groups": [{"params": [0]}], "state": {0: 5}},  # an entry not a mapping
])
def test_an_optimizer_state_that_is_not_one_is_named(tmp_path, optimizer):
    path = _shard(tmp_path, 0, torch.randn(2, 4), optimizer=optimizer)
    assert _error(read_arcface_head, [path]) == (
        f"{path}: state_optimizer is not an optimizer's state_dict (param_groups[-1]['params'][-1] should name "
        "the FC weight's entry of state)")


def test_the_fc_weight_is_looked_up_in_the_last_group(tmp_path):
    w = torch.randn(2, 4)
    opt = {"state": {0: {"momentum_buffer": w * 3}, 1: {"momentum_buffer": torch.zeros(2, 4)}},
           "param_groups": [{"params": [1]}, {"params": [5, 0]}]}
    assert torch.equal(read_arcface_head([_shard(tmp_path, 0, w, optimizer=opt)]).momentum, w * 3)


@pytest.mark.parametrize("key, value", [("epoch", "2"), ("global_step", -1), ("global_step", 1.5),
                                        ("epoch", True), ("global_step", torch.tensor(3))])
def test_an_epoch_or_step_that_is_not_a_count_is_named(tmp_path, key, value):
    path = _shard(tmp_path, 0, torch.randn(2, 4), **{key: value})
    assert _error(read_arcface_head, [path]) == f"{path}: {key} must be an int >= 0, got {value!r}"


@pytest.mark.parametrize("fc", [[1, 2], {"bias": torch.zeros(2)}, {"weight": [[1.0]]}])
def test_a_softmax_fc_without_a_weight_is_named(tmp_path, fc):
    torch.save({"state_dict_softmax_fc": fc}, tmp_path / "checkpoint_gpu_0.pt")
    assert _error(read_arcface_head, [tmp_path / "checkpoint_gpu_0.pt"]) == (
        f"{tmp_path / 'checkpoint_gpu_0.pt'}: state_dict_softmax_fc holds no 'weight' tensor")


def test_shards_that_do_not_join_are_named(tmp_path):
    a = _shard(tmp_path, 0, torch.randn(2, 4))
    assert _error(read_arcface_head, [a, tmp_path / "sub" / "checkpoint_gpu_0.pt"]) == (
        "two head files for rank 0: checkpoint_gpu_0.pt and checkpoint_gpu_0.pt")
    assert _error(read_arcface_head, []) == "no head files given"
    flat = _shard(tmp_path, 0, torch.randn(8), name="rank_0_softmax_weight.pt")
    assert _error(read_arcface_head, [flat]) == (
        f"{flat}: the FC weight must be [classes, embedding_dim], got shape (8,)")
    b = _shard(tmp_path, 1, torch.randn(2, 5))
    assert _error(read_arcface_head, [a, b]) == "the head shards have different embedding sizes: [4, 5]"
    c = _shard(tmp_path, 1, torch.randn(2, 4), global_step=9)
    assert _error(read_arcface_head, [a, c]) == "the head files were saved at different (epoch, step): [(0, 0), (0, 9)]"
    d = _shard(tmp_path, 2, torch.randn(2, 4), global_step=9, name="checkpoint_gpu_2.pt")
    e = _shard(tmp_path, 0, torch.randn(2, 4), global_step=9, name="checkpoint_gpu_0.pt")
    assert read_arcface_head([e, c, d]).global_step == 9  # three ranks, one step
    torch.save([1, 2], tmp_path / "rank_0_softmax_weight.pt")
    assert _error(read_arcface_head, [tmp_path / "rank_0_softmax_weight.pt"]) == (
        f"{tmp_path / 'rank_0_softmax_weight.pt'} is neither an arcface_torch checkpoint_gpu_<r>.pt nor a softmax "
        "weight tensor")


def test_old_softmax_weight_files_with_and_without_momentum(tmp_path):
    w0, w1 = torch.randn(3, 4), torch.randn(2, 4)
    torch.save(w0, tmp_path / "rank_0_softmax_weight.pt")
    torch.save(w1, tmp_path / "rank_1_softmax_weight.pt")
    paths = [tmp_path / "rank_0_softmax_weight.pt", tmp_path / "rank_1_softmax_weight.pt"]
    head = read_arcface_head(paths)
    assert torch.equal(head.weight, torch.cat([w0, w1])) and head.momentum is None  # no _mom files
    assert (head.epoch, head.global_step, head.notes) == (0, 0, [])
    torch.save(w0 * 2, tmp_path / "rank_0_softmax_weight_mom.pt")
    assert read_arcface_head(paths).momentum is None  # one rank's is not enough
    torch.save(w1 * 2, tmp_path / "rank_1_softmax_weight_mom.pt")
    assert torch.equal(read_arcface_head(paths).momentum, torch.cat([w0, w1]) * 2)
    torch.save({"cfg": argparse.Namespace(lr=0.1)}, tmp_path / "rank_1_softmax_weight_mom.pt")
    with pytest.raises(ckpt.CheckpointError, match="refusing to load .*argparse.Namespace"):
        read_arcface_head(paths)  # the momentum file goes through the same check
    assert read_arcface_head(paths, trust_pickle=True).momentum is None  # trusted, but not a tensor


def test_foreign_pickles_in_a_shard_are_refused_unless_trusted(tmp_path):
    path = _shard(tmp_path, 0, torch.randn(2, 4), cfg=argparse.Namespace(lr=0.1))
    with pytest.raises(ckpt.CheckpointError, match="refusing to load .*argparse.Namespace"):
        read_arcface_head([path])
    assert read_arcface_head([path], trust_pickle=True).weight.shape == (2, 4)
    backbone, _ = _backbone(tmp_path, dim=4)
    with pytest.raises(ckpt.CheckpointError, match="refusing to load .*argparse.Namespace"):
        import_arcface(tmp_path / "run", backbone, "tiny", [path], **TINY)
    path2, head = import_arcface(tmp_path / "run", backbone, "tiny", [path], trust_pickle=True, **TINY)
    assert head.weight.shape == (2, 4)
    sd = build_backbone("tiny", 4, **TINY).state_dict()
    torch.save({"state_dict_backbone": sd, "cfg": argparse.Namespace(lr=0.1)}, tmp_path / "ckpt.pt")
    with pytest.raises(ckpt.CheckpointError, match="refusing to load .*argparse.Namespace"):
        import_arcface(tmp_path / "run2", tmp_path / "ckpt.pt", "tiny", num_classes=2, embedding_dim=4, **TINY)
    path3, _ = import_arcface(tmp_path / "run2", tmp_path / "ckpt.pt", "tiny", num_classes=2, embedding_dim=4,
                              trust_pickle=True, **TINY)
    assert torch.equal(ckpt.load_checkpoint(path3, class_range=range(2), num_classes=2).common["backbone"]["fc.weight"],
                       sd["fc.weight"])


# ------------------------------------------------------------------ the checkpoint written


def test_a_fresh_head_is_drawn_from_seed_0_and_saved_as_a_world_of_one(tmp_path):
    backbone, _ = _backbone(tmp_path, dim=512)
    path, head = import_arcface(tmp_path / "run", backbone, "tiny", num_classes=1, **TINY)
    assert head is None
    loaded = ckpt.load_checkpoint(path, class_range=range(1), num_classes=1)
    expected = torch.normal(0.0, 0.01, (1, 512), generator=torch.Generator().manual_seed(0))
    assert torch.equal(loaded.head_tensors["weight"], expected)
    assert loaded.common["state"] == {"step": 0, "epoch": 0, "batch_in_epoch": 0, "batches_per_epoch": 0,
                                      "samples_seen": 0}
    assert loaded.common["world_size"] == 1 and loaded.common["imported_from"] == "arcface_torch"
    assert loaded.head_extras == {"sample_step": 0}  # Partial FC's draw counter starts from 0
    assert json.loads(loaded.common["config_json"]) == {"backbone": "tiny", "embedding_dim": 512, "optimizer": "sgd"}
    assert loaded.meta["fingerprint"] == {"backbone": "tiny", "embedding_dim": 512, "num_classes": 1,
                                          "image_size": [16, 16], "optimizer": "sgd"}
    for bad in (0, None):
        assert _error(import_arcface, tmp_path / f"r{bad}", backbone, "tiny", num_classes=bad, **TINY) == (
            f"without --head, --num-classes must be a positive int (the classes to fine-tune on), got {bad!r}")


def test_an_imported_head_keeps_its_step_world_and_momentum_for_sgd_only(tmp_path):
    backbone, _ = _backbone(tmp_path, dim=4)
    w0, w1 = torch.randn(3, 4), torch.randn(2, 4)
    shards = [_shard(tmp_path, 0, w0, optimizer=_sgd(w0 * 2), epoch=1, global_step=6),
              _shard(tmp_path, 1, w1, optimizer=_sgd(w1 * 2), epoch=1, global_step=6)]
    path, _ = import_arcface(tmp_path / "sgd", backbone, "tiny", shards, num_classes=5, embedding_dim=4, **TINY)
    loaded = ckpt.load_checkpoint(path, class_range=range(5), num_classes=5)
    assert set(loaded.head_tensors) == {"weight", "optimizer.momentum_buffer"}
    assert loaded.common["state"]["step"] == 6 and loaded.common["state"]["epoch"] == 1
    assert loaded.common["world_size"] == 2
    path, _ = import_arcface(tmp_path / "adamw", backbone, "tiny", shards, optimizer="adamw", **TINY)
    loaded = ckpt.load_checkpoint(path, class_range=range(5), num_classes=5)
    assert set(loaded.head_tensors) == {"weight"}
    assert loaded.meta["fingerprint"]["optimizer"] == "adamw"
    assert json.loads(loaded.common["config_json"])["optimizer"] == "adamw"
    assert _error(import_arcface, tmp_path / "x", backbone, "tiny", shards, embedding_dim=5, **TINY) == (
        "--embedding-dim 5 but the head files hold 4-d centres")
    assert _error(import_arcface, tmp_path / "y", backbone, "tiny", shards, num_classes=4, **TINY) == (
        "--num-classes 4 but the head files hold 5 classes")


# ------------------------------------------------------------------ the command


def test_the_command_passes_its_flags_on_and_says_what_it_wrote(tmp_path, monkeypatch, capsys):
    from shardfc.cli import import_arcface as cli
    from shardfc.train.checkpointing.arcface_import import ArcfaceHead

    for r in (1, 0):
        (tmp_path / f"checkpoint_gpu_{r}.pt").write_bytes(b"")
    seen = []
    head = ArcfaceHead(torch.zeros(5, 4), None, 2, 1, 30, ["note one", "note two"])
    path = _checkpoint_dir(tmp_path)

    def fake(out, backbone, network, heads, **kw):
        seen.append((out, backbone, network, heads, kw))
        return path, head

    monkeypatch.setattr(cli, "import_arcface", fake)
    argv = ["--backbone", "b.pth", "--network", "iresnet50", "--out", "run", "--head", str(tmp_path / "checkpoint_gpu_*.pt"),
            "x.pt", "--num-classes", "5", "--embedding-dim", "4", "--optimizer", "adamw", "--trust-checkpoint"]
    assert cli.main(argv) == 0
    assert seen == [("run", "b.pth", "iresnet50", [str(tmp_path / "checkpoint_gpu_0.pt"), str(tmp_path / "checkpoint_gpu_1.pt"),
                                                   "x.pt"],
                     dict(num_classes=5, embedding_dim=4, optimizer="adamw", trust_pickle=True))]
    assert capsys.readouterr().out == (
        f"wrote {path}: iresnet50, 3 classes x 8 from 2 arcface_torch rank(s), step 30\n"
        "  note: note one\n  note: note two\n"
        "continue with: shardfc train --output-dir run --backbone iresnet50 --resume auto ...\n")
    seen.clear()
    monkeypatch.setattr(cli, "import_arcface", lambda *a, **kw: seen.append((a, kw)) or (path, None))
    assert cli.main(["--backbone", "b.pth", "--network", "mbf", "--out", "r2", "--num-classes", "3"]) == 0
    assert seen == [(("r2", "b.pth", "mbf", []), dict(num_classes=3, embedding_dim=None, optimizer="sgd",
                                                       trust_pickle=False))]
    assert capsys.readouterr().out == (f"wrote {path}: mbf, 3 classes x 8 from a fresh head\n"
                                       "continue with: shardfc train --output-dir r2 --backbone mbf --resume auto ...\n")


def _checkpoint_dir(tmp_path):
    return ckpt.save_checkpoint(tmp_path / "ck", 0, common={}, per_rank=None, head_tensors={"weight": torch.zeros(3, 8)},
                                head_extras={}, class_range=range(3), num_classes=3, fingerprint={})


def test_the_commands_errors_are_one_line(tmp_path, monkeypatch, capsys):
    from shardfc.cli import import_arcface as cli

    with pytest.raises(SystemExit):  # no flag is taken by a prefix
        cli.main(["--backbone", "b", "--network", "mbf", "--out", "o", "--num-class", "2"])
    assert "unrecognized arguments: --num-class" in capsys.readouterr().err

    assert cli.main(["--backbone", "b", "--network", "mbf", "--out", "o", "--head", str(tmp_path / "none_*.pt")]) == 2
    assert capsys.readouterr().err == (
        f"shardfc import-arcface: error: --head {str(tmp_path / 'none_*.pt')!r} matches no file\n")
    for error in (ValueError("bad shard"), FileNotFoundError("gone"), ckpt.CheckpointError("refusing")):
        def fail(*a, _e=error, **kw):
            raise _e

        monkeypatch.setattr(cli, "import_arcface", fail)
        assert cli.main(["--backbone", "b", "--network", "mbf", "--out", "o", "--num-classes", "2"]) == 2
        assert capsys.readouterr().err == f"shardfc import-arcface: error: {error}\n"
