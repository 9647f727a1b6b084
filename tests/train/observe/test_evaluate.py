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
    assert str(err.value).startswith(f"{'--bin' if from_eval else 'val_bins:'} cannot load {str(junk)!r}: ")


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
