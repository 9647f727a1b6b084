"""The evaluation targets of a run: one name each, enough pairs for the protocol, refused before training."""

from __future__ import annotations

import dataclasses
import io
import pickle
import re
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image
from torch import nn

from shardfc.evaluation.folds import NFOLDS
from shardfc.train.checkpointing.artifacts import check_saved_config
from shardfc.train.config import ConfigError, TrainConfig
from shardfc.train.config.targets import MAX_SYNTHETIC_PAIR_BYTES
from shardfc.train.observe.evaluate import build_targets, plan_targets, run_targets


def _png(value: int) -> bytes:
    buf = io.BytesIO()
    Image.fromarray(np.full((8, 8, 3), value, np.uint8)).save(buf, format="PNG")
    return buf.getvalue()


def _bin(path: Path, pairs: int, offset: int = 0) -> str:
    """An insightface .bin of ``pairs`` pairs of flat images (pair i: grey levels differing with ``offset``)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    images = [_png((37 * i + offset) % 256) for i in range(2 * pairs)]
    path.write_bytes(pickle.dumps((images, [i % 2 == 0 for i in range(pairs)])))
    return str(path)


def _cfg(**kw) -> TrainConfig:
    return dataclasses.replace(TrainConfig(), **kw)


CLASH = ("would both report as {name!r}, one's metrics overwriting the other's (a .bin is named by its file's stem): "
         "give one file another name, or a link to it")


def test_the_plan_names_each_target_in_build_order():
    cfg = _cfg(val_bins=["/d/lfw.bin", "cfp_fp.bin"], reid_root="/m", synthetic_val_pairs=NFOLDS)
    assert plan_targets(cfg, ijb_target="IJBB") == [
        ("synthetic", "the held-out synthetic pairs"),
        ("lfw", "the .bin file '/d/lfw.bin'"),
        ("cfp_fp", "the .bin file 'cfp_fp.bin'"),
        ("reid", "the re-ID split '/m'"),
        ("ijbb", "the IJBB release"),
    ]
    # the overrides replace the config's targets, as shardfc eval's flags do
    assert plan_targets(cfg, bins=[], reid_root="", synthetic_pairs=0) == []
    # a run on other data has no synthetic pairs, whatever synthetic_val_pairs says
    assert plan_targets(_cfg(dataset="folder", data_root="/x", synthetic_val_pairs=5)) == []


@pytest.mark.parametrize("kw, first, second, name", [
    (dict(val_bins=["/a/lfw.bin", "/b/lfw.bin"]), "the .bin file '/a/lfw.bin'", "the .bin file '/b/lfw.bin'", "lfw"),
    (dict(val_bins=["lfw.bin", "lfw.bin"]), "the .bin file 'lfw.bin'", "the .bin file 'lfw.bin'", "lfw"),
    (dict(val_bins=["/a/lfw.bin", "/b/lfw.BIN"]), "the .bin file '/a/lfw.bin'", "the .bin file '/b/lfw.BIN'", "lfw"),
    (dict(val_bins=["/v/synthetic.bin"]), "the held-out synthetic pairs", "the .bin file '/v/synthetic.bin'",
     "synthetic"),
    (dict(val_bins=["/v/reid.bin"], reid_root="/m"), "the .bin file '/v/reid.bin'", "the re-ID split '/m'", "reid"),
])
def test_two_targets_under_one_name_are_refused(kw, first, second, name):
    cfg = _cfg(**kw)
    message = f"{first} and {second} {CLASH.format(name=name)}"
    with pytest.raises(ConfigError, match="^" + re.escape(message)):
        plan_targets(cfg)
    with pytest.raises(ConfigError, match=re.escape(message)):
        cfg.validate()  # every rank, before training
    check_saved_config(cfg)  # a checkpoint of such a run still exports and embeds


def test_an_ijb_release_takes_its_name():
    with pytest.raises(ConfigError, match="^the .bin file '/v/ijbc.bin' and the IJBC release would both report as 'ijbc'"):
        plan_targets(_cfg(val_bins=["/v/ijbc.bin"]), ijb_target="IJBC")
    assert [n for n, _ in plan_targets(_cfg(val_bins=["/v/ijbc.bin"]), ijb_target="IJBB")][-2:] == ["ijbc", "ijbb"]


def test_a_synthetic_bin_is_allowed_when_the_run_has_no_synthetic_pairs():
    assert [n for n, _ in plan_targets(_cfg(val_bins=["/v/synthetic.bin"], synthetic_val_pairs=0))] == ["synthetic"]


@pytest.mark.parametrize("pairs", [-1, 1, NFOLDS - 1])
def test_fewer_synthetic_pairs_than_folds_are_refused(pairs):
    message = (f"synthetic_val_pairs must be 0 (none) or at least {NFOLDS} (the verification protocol's folds), "
               f"got {pairs}")
    with pytest.raises(ConfigError, match="^" + re.escape(message) + "$"):
        plan_targets(_cfg(), synthetic_pairs=pairs)
    if pairs > 0:  # a negative one is the field's own range rule
        with pytest.raises(ConfigError, match=re.escape(message)):
            _cfg(synthetic_val_pairs=pairs).validate()
        _cfg(synthetic_val_pairs=pairs).validate(evaluations=False)


@pytest.mark.parametrize("pairs", [0, NFOLDS])
def test_none_or_as_many_pairs_as_folds_are_taken(pairs):
    _cfg(synthetic_val_pairs=pairs).validate()
    assert len(plan_targets(_cfg(), synthetic_pairs=pairs)) == (pairs > 0)


@pytest.mark.parametrize("backbone, image_size, most", [
    ("tiny", [], (8 << 30) // (2 * 3 * 32 * 32 * 4)),           # the backbone's default size
    ("mobilefacenet", [], (8 << 30) // (2 * 3 * 112 * 112 * 4)),
    ("tiny", [64, 48], (8 << 30) // (2 * 3 * 64 * 48 * 4)),    # the run's own size
])
def test_more_synthetic_pairs_than_fit_in_memory_are_refused_before_training(backbone, image_size, most):
    """Rendered at the first evaluation (after the training) and kept, too many pairs would end the
    run out of memory there: refused by validate (every rank, at start) and by eval's flag."""
    cfg = _cfg(backbone=backbone, image_size=image_size)
    h, w = image_size or ((32, 32) if backbone == "tiny" else (112, 112))
    assert most == MAX_SYNTHETIC_PAIR_BYTES // (2 * 3 * h * w * 4)
    dataclasses.replace(cfg, synthetic_val_pairs=most).validate()
    assert len(plan_targets(cfg, synthetic_pairs=most)) == 1
    gib = (most + 1) * 2 * 3 * h * w * 4 / 2**30
    tail = (f" would render {gib:,.1f} GiB of images in memory ({h}x{w}, two float32 images a pair); "
            f"at most {most:,} pairs at this size (8 GiB)")
    with pytest.raises(ConfigError) as err:
        dataclasses.replace(cfg, synthetic_val_pairs=most + 1).validate()
    assert str(err.value) == f"synthetic_val_pairs={most + 1}" + tail
    with pytest.raises(ConfigError) as err:
        plan_targets(cfg, synthetic_pairs=most + 1)
    assert str(err.value) == f"--synthetic-pairs {most + 1}" + tail
    dataclasses.replace(cfg, synthetic_val_pairs=most + 1).validate(evaluations=False)  # a saved config read back
    assert plan_targets(_cfg(dataset="folder", data_root="/x", synthetic_val_pairs=10**9)) == []  # not synthetic: none


def test_built_targets_have_the_planned_names_and_keep_their_own_metrics(tmp_path):
    bins = [_bin(tmp_path / "lfw.bin", NFOLDS), _bin(tmp_path / "agedb_30.bin", 2 * NFOLDS, offset=11)]
    cfg = _cfg(val_bins=bins, synthetic_val_pairs=NFOLDS, synthetic_identities=8, eval_batch_size=16)
    targets = build_targets(cfg, (8, 8), torch.device("cpu"))
    assert [t.name for t in targets] == [n for n, _ in plan_targets(cfg)] == ["synthetic", "lfw", "agedb_30"]
    metrics = run_targets(targets, nn.Sequential(nn.Flatten(), nn.Linear(192, 4)))
    assert [metrics[name]["num_pairs"] for name in ("synthetic", "lfw", "agedb_30")] == [NFOLDS, NFOLDS, 2 * NFOLDS]


def test_two_bins_of_one_stem_are_refused_before_either_loads(tmp_path, monkeypatch):
    bins = [_bin(tmp_path / "a" / "lfw.bin", NFOLDS), _bin(tmp_path / "b" / "lfw.bin", 2 * NFOLDS)]
    import shardfc.train.observe.evaluate as evaluate

    monkeypatch.setattr(evaluate, "load_bin", lambda *a: pytest.fail("loaded before the names were checked"))
    with pytest.raises(ConfigError, match="would both report as 'lfw'"):
        build_targets(_cfg(), (8, 8), torch.device("cpu"), bins=bins, synthetic_pairs=0)


@pytest.mark.parametrize("from_eval", [False, True])
def test_a_bin_of_fewer_pairs_than_folds_is_refused_when_loaded(tmp_path, from_eval):
    """Named as the user gave it: the run's val_bins, or shardfc eval's --bin."""
    small = _bin(tmp_path / "small.bin", NFOLDS - 1)
    given = "--bin" if from_eval else "val_bins:"
    cfg, bins = (_cfg(), [small]) if from_eval else (_cfg(val_bins=[small]), None)
    with pytest.raises(ConfigError, match=f"^{given} {re.escape(repr(small))} holds {NFOLDS - 1} "
                                          rf"pair\(s\); the verification protocol needs at least {NFOLDS} "
                                          r"\(one per fold\)$"):
        build_targets(cfg, (8, 8), torch.device("cpu"), bins=bins, synthetic_pairs=0)


@pytest.mark.parametrize("from_eval", [False, True])
def test_a_file_that_is_no_bin_is_named_as_the_user_gave_it(tmp_path, from_eval):
    junk = tmp_path / "junk.bin"
    junk.write_bytes(b"not a pickle")
    cfg, bins = (_cfg(), [str(junk)]) if from_eval else (_cfg(val_bins=[str(junk)]), None)
    with pytest.raises(ConfigError) as err:
        build_targets(cfg, (8, 8), torch.device("cpu"), bins=bins, synthetic_pairs=0)
    assert str(err.value).startswith(f"{'--bin' if from_eval else 'val_bins:'} cannot load {str(junk)!r}: ValueError: ")


@pytest.mark.parametrize("from_eval", [False, True])
@pytest.mark.parametrize("layout, said", [
    ({}, "ReIDFolder root '{root}/query' does not exist or is not a directory"),
    ({"query": [], "bounding_box_test": []}, "ReIDFolder root '{root}/query' contains no usable images"),
    ({"query": ["0001_c1s1_000100_01.jpg"], "bounding_box_test": ["photo.jpg"]}, "photo.jpg"),
])
def test_a_reid_root_that_is_no_split_is_named_as_the_user_gave_it_before_training(tmp_path, from_eval, layout, said):
    root = tmp_path / "market"
    root.mkdir()
    for folder, names in layout.items():
        (root / folder).mkdir()
        for name in names:
            (root / folder / name).write_bytes(_png(3))
    cfg, override = (_cfg(), str(root)) if from_eval else (_cfg(reid_root=str(root)), None)
    with pytest.raises(ConfigError) as err:
        build_targets(cfg, (8, 8), torch.device("cpu"), reid_root=override, synthetic_pairs=0)
    given = f"--reid-root {str(root)!r}" if from_eval else f"reid_root={str(root)!r}"
    assert str(err.value).startswith(f"{given}: ") and said.format(root=root) in str(err.value)


# ---------------------------------------------------------------- what each target hands the evaluation
# (the untouched lines the fifty-sixth mutation round found unread: the run's evaluation settings
# reaching each target, and a .bin looked up beside the dataset)


def _record(monkeypatch, name):
    import shardfc.train.observe.evaluate as evaluate

    calls = []
    monkeypatch.setattr(evaluate, name, lambda *args, **kw: calls.append((args, kw)) or {"accuracy": 1.0})
    return calls


def test_each_verification_target_gets_the_runs_batch_size_flip_device_and_folds(tmp_path, monkeypatch):
    calls = _record(monkeypatch, "evaluate_verification")
    cfg = _cfg(eval_batch_size=7, eval_flip=False, synthetic_val_pairs=NFOLDS, synthetic_identities=4,
               synthetic_images_per_identity=2)
    path = _bin(tmp_path / "lfw.bin", NFOLDS)
    targets = build_targets(cfg, (8, 8), torch.device("cpu"), bins=[path])
    assert [t.name for t in targets] == ["synthetic", "lfw"]
    assert targets[0].description == f"{NFOLDS} held-out synthetic pairs of unseen identities"
    assert targets[1].description == f"{NFOLDS} pairs of {path}"
    model = nn.Flatten()
    for t in targets:
        assert t.evaluate(model) == {"accuracy": 1.0}
    for args, kw in calls:
        assert args[0] is model and kw == dict(batch_size=7, flip=False, device=torch.device("cpu"), nfolds=NFOLDS)
        assert len(args) == 3  # model, the images, issame
    assert len(calls[0][1]) == 4 and isinstance(calls[0][0][1], tuple)  # the synthetic pairs: (images_a, images_b)


def test_a_relative_bin_missing_here_is_looked_up_beside_the_dataset(tmp_path, monkeypatch, caplog):
    import logging

    data = tmp_path / "ms1m"
    beside = _bin(data / "agedb_30.bin", NFOLDS)
    monkeypatch.chdir(tmp_path)
    cfg = _cfg(dataset="folder", data_root=str(data), synthetic_val_pairs=0)
    with caplog.at_level(logging.INFO, logger="shardfc.train"):
        targets = build_targets(cfg, (8, 8), torch.device("cpu"), bins=["agedb_30.bin"])
    assert [t.name for t in targets] == ["agedb_30"]
    assert f"loaded {beside}: {NFOLDS} pairs" in caplog.messages
    # one that is here is read here, and an absolute one is never looked up beside the dataset
    _bin(tmp_path / "agedb_30.bin", 2 * NFOLDS)
    with caplog.at_level(logging.INFO, logger="shardfc.train"):
        build_targets(cfg, (8, 8), torch.device("cpu"), bins=["agedb_30.bin"])
    assert f"loaded agedb_30.bin: {2 * NFOLDS} pairs" in caplog.messages
    (tmp_path / "agedb_30.bin").unlink()
    with pytest.raises(FileNotFoundError):
        build_targets(cfg, (8, 8), torch.device("cpu"), bins=[str(tmp_path / "agedb_30.bin")])
    with pytest.raises(FileNotFoundError) as err:  # found nowhere: the name as given
        build_targets(_cfg(dataset="folder", data_root=str(tmp_path / "none"), synthetic_val_pairs=0), (8, 8),
                      torch.device("cpu"), bins=["agedb_30.bin"])
    assert str(err.value) == "verification bin file not found: 'agedb_30.bin'"


def test_the_reid_target_gets_the_runs_size_batch_flip_and_device(tmp_path, monkeypatch, caplog):
    import logging

    calls = _record(monkeypatch, "evaluate_reid")
    root = tmp_path / "market"
    for folder, cam in (("query", 1), ("bounding_box_test", 2)):
        (root / folder).mkdir(parents=True)
        for pid in (1, 2):
            (root / folder / f"{pid:04d}_c{cam}s1_000{pid}00_01.jpg").write_bytes(_png(40 * pid))
    cfg = _cfg(eval_batch_size=5, eval_flip=False, synthetic_val_pairs=0)
    with caplog.at_level(logging.INFO, logger="shardfc.train"):
        (target,) = build_targets(cfg, (16, 8), torch.device("cpu"), reid_root=str(root))
    assert (target.name, target.description) == ("reid", f"re-ID query/gallery of {root}")
    assert f"loaded re-ID split {root}: 2 query, 2 gallery images" in caplog.messages
    model = nn.Flatten()
    assert target.evaluate(model) == {"accuracy": 1.0}
    assert calls == [((model, str(root)), dict(image_size=(16, 8), batch_size=5, flip=False,
                                               device=torch.device("cpu")))]


def test_the_plan_sees_every_target_asked_for(tmp_path, monkeypatch):
    """A .bin named like the re-ID or the IJB target clashes with it before anything loads."""
    import shardfc.train.observe.evaluate as evaluate

    monkeypatch.setattr(evaluate, "load_bin", lambda *a: pytest.fail("loaded before the names were checked"))
    with pytest.raises(ConfigError, match="would both report as 'reid'"):
        build_targets(_cfg(), (8, 8), torch.device("cpu"), bins=["/v/reid.bin"], reid_root=str(tmp_path),
                      synthetic_pairs=0)
    with pytest.raises(ConfigError, match="would both report as 'synthetic'"):  # eval's count, not the run's 0
        build_targets(_cfg(synthetic_val_pairs=0), (8, 8), torch.device("cpu"), bins=["/v/synthetic.bin"],
                      synthetic_pairs=NFOLDS)
    with pytest.raises(ConfigError, match="would both report as 'ijbb'"):
        build_targets(_cfg(), (8, 8), torch.device("cpu"), bins=["/v/ijbb.bin"], synthetic_pairs=0,
                      ijb=evaluate.IJBOptions(root=str(tmp_path), target="IJBB"))


def test_run_targets_labels_each_targets_bar_only_when_asked(bars):
    from shardfc import progress
    from shardfc.train.observe.evaluate import EvalTarget

    def target(name):
        return EvalTarget(name, name, lambda model: {"batches": len(list(progress.labelled_bar([model], 1)))})

    targets = [target("lfw"), target("cfp_fp")]
    assert run_targets(targets, "m") == {"lfw": {"batches": 1}, "cfp_fp": {"batches": 1}}
    assert bars == []  # training's evaluations: under the training bar, none of their own
    assert run_targets(targets, "m", bars=True) == {"lfw": {"batches": 1}, "cfp_fp": {"batches": 1}}
    assert [kw["desc"] for kw in bars] == ["lfw", "cfp_fp"]


def test_the_held_out_pairs_draw_from_the_runs_seed_plus_one_and_the_largest_seed_wraps():
    from shardfc.checks import MAX_SEED
    from shardfc.train.observe.evaluate import LazyPairs, pairs_seed, synthetic_dataset

    assert [pairs_seed(s) for s in (0, 41, MAX_SEED - 1, MAX_SEED)] == [1, 42, MAX_SEED, 0]
    for seed, pairs in ((41, 42), (MAX_SEED, 0)):  # the config's largest: its plus one is no seed
        cfg = _cfg(synthetic_identities=8, seed=seed)
        images_a, _, issame = LazyPairs(cfg, (8, 8), NFOLDS).get()
        expected = synthetic_dataset(cfg, (8, 8)).verification_pairs(NFOLDS, seed=pairs, unseen_identities=True)
        assert torch.equal(images_a, expected[0]) and (issame == expected[2]).all()
