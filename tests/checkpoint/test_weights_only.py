"""Checkpoint files load with torch.load(weights_only=True); anything needing more is refused unless trusted."""

from __future__ import annotations

import json
import os
import pickle
from collections import OrderedDict
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from shardfc.checkpoint import FORMAT_VERSION, CheckpointError, load_checkpoint, load_common, save_checkpoint
from train.legacy import rewrite_file  # tests/ is on sys.path (its conftest.py): one helper for both suites

C = 5


def _save(root: Path, step: int = 1, **overrides: Any) -> Path:
    kwargs: dict[str, Any] = dict(
        common={"backbone": OrderedDict(w=torch.ones(2)), "sched": [{"lr": 0.1, "betas": (0.9, 0.99)}], "n": None},
        per_rank={"rng": {"python": [3, list(range(5)), None], "torch": torch.get_rng_state()}},
        head_tensors={"weight": torch.arange(C * 2.0).reshape(C, 2)},
        head_extras={"sample_step": 4, "step": torch.tensor(3.0), "dtype": torch.float32},
        class_range=range(C),
        num_classes=C,
        fingerprint={"model": "m"},
    )
    kwargs.update(overrides)
    return save_checkpoint(root, step, **kwargs)


class RunsCode:
    """Unpickling this runs ``touch <sentinel>``."""

    def __init__(self, sentinel: Path) -> None:
        self.sentinel = sentinel

    def __reduce__(self):
        return (os.system, (f"touch {self.sentinel}",))


class Benign:
    def __init__(self, value: int) -> None:
        self.value = value


def test_every_file_loads_with_weights_only(tmp_path: Path) -> None:
    path = _save(tmp_path)
    assert json.loads((path / "meta.json").read_text())["format_version"] == FORMAT_VERSION == 2
    for f in sorted(path.glob("*.pt")):
        torch.load(f, weights_only=True)
    loaded = load_checkpoint(path, class_range=range(C), num_classes=C)
    assert loaded.common["sched"][0]["betas"] == (0.9, 0.99) and loaded.head_extras["dtype"] is torch.float32


@pytest.mark.parametrize(
    ("overrides", "match"),
    [
        ({"common": {"opt": {"state": np.zeros(3)}}}, r"common\['opt'\]\['state'\] is a numpy.ndarray"),
        ({"per_rank": {"rng": (1, np.uint32(7))}}, r"per_rank\['rng'\]\[1\] is a numpy.uint32"),
        ({"head_extras": {"fn": Benign(1)}}, r"head_extras\['fn'\] is a .*Benign"),
        ({"common": {"cfg": {Benign(1): 1}}}, r"common\['cfg'\] has a key .* of type .*Benign"),
        ({"common": {"ids": range(3)}}, r"common\['ids'\] is a range; "),  # a builtin by its bare name
        ({"common": {"cfg": {frozenset(): 1}}}, r"common\['cfg'\] has a key frozenset\(\) of type frozenset; "),
    ],
)
def test_save_refuses_what_weights_only_cannot_read(tmp_path: Path, overrides: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        _save(tmp_path, **overrides)
    assert list(tmp_path.iterdir()) == []  # refused before anything is written


@pytest.mark.parametrize("victim", ["common.pt", "rank_0.pt", "head_0.pt"])
def test_crafted_file_is_refused_without_running_its_code(tmp_path: Path, victim: str) -> None:
    path = _save(tmp_path / "ckpt")
    sentinel = tmp_path / "SENTINEL"
    original = torch.load(path / victim, weights_only=True)
    rewrite_file(path, victim, {**original, "payload": RunsCode(sentinel)})
    with pytest.raises(CheckpointError) as info:
        load_checkpoint(path, class_range=range(C), num_classes=C, rank=0)
    message = str(info.value)
    assert str(path / victim) in message and "posix.system" in message
    assert "shardfc's saver did not write this file" in message and "trust_pickle=True" in message
    assert "--trust-checkpoint" in message
    if victim == "common.pt":
        with pytest.raises(CheckpointError, match="refusing to load .*common.pt"):
            load_common(path)
    assert not sentinel.exists()  # nothing ran


def test_format_1_checkpoint_needs_the_opt_in(tmp_path: Path) -> None:
    """Format 1 stored numpy's RNG state as a pickled array: readable only when trusted."""
    path = _save(tmp_path)
    numpy_state = np.random.get_state()
    rewrite_file(path, "rank_0.pt", {"rng": {"numpy": numpy_state}}, format_version=1)
    with pytest.raises(CheckpointError) as info:
        load_checkpoint(path, class_range=range(C), num_classes=C, rank=0)
    message = str(info.value)
    assert str(path / "rank_0.pt") in message and "numpy" in message
    assert "older shardfc (checkpoint format 1)" in message and "trust_pickle=True" in message
    loaded = load_checkpoint(path, class_range=range(C), num_classes=C, rank=0, trust_pickle=True)
    assert np.array_equal(loaded.per_rank["rng"]["numpy"][1], numpy_state[1])
    assert torch.equal(loaded.head_tensors["weight"], torch.arange(C * 2.0).reshape(C, 2))
    # Its plain files need no opt-in: load_common reads common.pt alone.
    assert torch.equal(load_common(path)[0]["backbone"]["w"], torch.ones(2))


def test_opt_in_reads_a_trusted_pickled_object(tmp_path: Path) -> None:
    path = _save(tmp_path)
    rewrite_file(path, "common.pt", {"thing": Benign(5)})
    with pytest.raises(CheckpointError, match=r"needs the global .*Benign"):
        load_common(path)
    common, _ = load_common(path, trust_pickle=True)
    assert common["thing"].value == 5


def test_what_the_unpickler_refused_is_named_or_else_called_objects() -> None:
    from shardfc.checkpoint.weights_only import _refusal_reason

    named = pickle.UnpicklingError("Weights only load failed. Unsupported global: GLOBAL os.system was not an allowed")
    assert _refusal_reason(named) == "the global os.system"
    assert _refusal_reason(pickle.UnpicklingError("Weights only load failed. Unsupported operand 149")) == "objects"


@pytest.mark.parametrize("mmap", [False, True])
def test_load_pt_maps_to_the_location_asked_and_unpickles_only_when_trusted(tmp_path: Path, mmap: bool,
                                                                             monkeypatch) -> None:
    from shardfc.checkpoint.weights_only import load_pt

    torch.save({"w": torch.ones(3)}, tmp_path / "plain.pt")
    assert load_pt(tmp_path / "plain.pt", "meta", trust_pickle=False, meta={}, mmap=mmap)["w"].device.type == "meta"
    asked = []
    real = torch.load
    monkeypatch.setattr(torch, "load", lambda *a, **k: asked.append(k.get("mmap", False)) or real(*a, **k))
    assert torch.equal(load_pt(tmp_path / "plain.pt", "cpu", trust_pickle=False, meta={}, mmap=mmap)["w"], torch.ones(3))
    assert asked == [mmap]  # torch maps the file (tensors paged in as used), or reads it
    torch.save({"b": Benign(4)}, tmp_path / "pickled.pt")
    with pytest.raises(CheckpointError, match="refusing to load"):
        load_pt(tmp_path / "pickled.pt", "cpu", trust_pickle=False, meta={}, mmap=mmap)
    assert load_pt(tmp_path / "pickled.pt", "cpu", trust_pickle=True, meta={}, mmap=mmap)["b"].value == 4


@pytest.mark.parametrize("mmap", [False, True])
def test_load_pt_reads_a_link_the_user_names_but_not_one_a_meta_json_names(tmp_path: Path, mmap: bool) -> None:
    from shardfc.checkpoint.weights_only import load_pt

    torch.save({"w": torch.ones(3)}, tmp_path / "plain.pt")
    (tmp_path / "link.pt").symlink_to(tmp_path / "plain.pt")
    assert torch.equal(load_pt(tmp_path / "link.pt", "cpu", trust_pickle=False, meta={}, mmap=mmap)["w"], torch.ones(3))
    with pytest.raises(CheckpointError, match="link.pt: it is a symlink"):
        load_pt(tmp_path / "link.pt", "cpu", trust_pickle=False, meta={}, mmap=mmap, follow_symlinks=False)


def test_check_plain_walks_every_value_and_takes_tuple_keys() -> None:
    from shardfc.checkpoint.weights_only import _HOW, check_plain

    check_plain("x", {(1, "a"): [1, 2.0, None], "t": torch.ones(1)})
    with pytest.raises(ValueError) as err:
        check_plain("x", [object(), 1])  # a plain value after the bad one on the walk's stack
    assert str(err.value) == (f"x[0] is a object; {_HOW}, so that they load with torch.load(weights_only=True). "
                              "Store its state as plain data (e.g. a state_dict(), a tensor or a JSON string)")


def test_load_pt_says_what_failed_and_what_the_trusted_load_does(tmp_path: Path, monkeypatch, caplog) -> None:
    import logging

    from shardfc.checkpoint import weights_only as W

    torch.save({"b": Benign(4), "w": torch.ones(2)}, tmp_path / "pickled.pt")
    (tmp_path / "link.pt").symlink_to(tmp_path / "pickled.pt")
    asked = []
    real = torch.load
    monkeypatch.setattr(torch, "load", lambda *a, **k: asked.append(k.get("mmap", False)) or real(*a, **k))
    with caplog.at_level(logging.WARNING, logger="shardfc.checkpoint"):
        got = W.load_pt(tmp_path / "link.pt", "meta", trust_pickle=True, meta={})  # a link the user names, mapped or not
    assert got["b"].value == 4 and got["w"].device.type == "meta" and asked == [False, False]
    assert [r.getMessage() for r in caplog.records] == [
        f"loading {tmp_path / 'link.pt'} with full unpickling (trust_pickle=True): it needs the global test_weights_only.Benign"]
    assert W.load_pt(tmp_path / "pickled.pt", "cpu", trust_pickle=True, meta={}, mmap=True)["b"].value == 4
    assert asked[2:] == [True, True]

    path = tmp_path / "pickled.pt"
    failures = []

    def torch_load(*args):
        raise failures.pop(0)

    monkeypatch.setattr(W, "_torch_load", torch_load)

    def refusal(*errors, **kw):
        failures[:] = errors
        with pytest.raises(CheckpointError) as err:
            W.load_pt(path, "cpu", meta=kw.pop("meta", {}), **{"trust_pickle": False, **kw})
        return str(err.value)

    assert refusal(pickle.UnpicklingError("bad  pickle")) == f"cannot read checkpoint file {path}: UnpicklingError: bad pickle"
    assert refusal(RuntimeError("no")) == f"cannot read checkpoint file {path}: RuntimeError: no"
    assert refusal(pickle.UnpicklingError("Weights only load failed"), RuntimeError("no"), trust_pickle=True) == (
        f"cannot read checkpoint file {path}: RuntimeError: no")
    assert refusal(pickle.UnpicklingError("Weights only load failed"), meta={"format_version": 1}) == (
        f"refusing to load {path}: it needs objects, which torch.load(weights_only=True) does not allow; unpickling it "
        "could run arbitrary code. It was written by an older shardfc (checkpoint format 1), whose files could hold "
        "pickled objects. If you trust this checkpoint, load it with trust_pickle=True (command line: --trust-checkpoint)")


def test_torchs_default_turned_off_by_its_variable_does_not_turn_off_the_check(tmp_path: Path, monkeypatch) -> None:
    """load_pt asks torch for ``weights_only=True`` itself: torch's default (None) follows
    ``TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD`` (and was False before torch 2.6)."""
    from shardfc.checkpoint.weights_only import load_pt

    torch.save({"b": Benign(4)}, tmp_path / "pickled.pt")
    monkeypatch.setenv("TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD", "1")
    with pytest.raises(CheckpointError, match="refusing to load"):
        load_pt(tmp_path / "pickled.pt", "cpu", trust_pickle=False, meta={})


@pytest.mark.parametrize("trust", [False, True])
@pytest.mark.parametrize("content, said", [
    (b"", "it is empty"),
    (b"2026-11-29 a log line\n", "no torch.save file (neither a zip archive nor a pickle): it starts with b'2026-11-'"),
    (b"\x08\x07ONNX", "no torch.save file (neither a zip archive nor a pickle): it starts with b'\\x08\\x07ONNX'"),
])
def test_a_file_that_is_no_torch_file_is_said_to_be_so_not_sent_to_the_unsafe_opt_in(tmp_path: Path, monkeypatch,
                                                                                      content: bytes, said: str,
                                                                                      trust: bool) -> None:
    from shardfc.checkpoint import weights_only as W

    path = tmp_path / "model.pt"
    path.write_bytes(content)
    monkeypatch.setattr(W, "_torch_load", lambda *a: pytest.fail("torch.load of a file that is no torch file"))
    with pytest.raises(CheckpointError) as err:
        W.load_pt(path, "cpu", trust_pickle=trust, meta={})
    assert str(err.value) == f"cannot read checkpoint file {path}: {said}"


def test_a_legacy_non_zip_torch_file_still_loads(tmp_path: Path) -> None:
    from shardfc.checkpoint.weights_only import load_pt

    torch.save({"w": torch.arange(3.0)}, tmp_path / "legacy.pt", _use_new_zipfile_serialization=False)
    assert (tmp_path / "legacy.pt").read_bytes()[:1] == b"\x80"
    assert torch.equal(load_pt(tmp_path / "legacy.pt", "cpu", trust_pickle=False, meta={})["w"], torch.arange(3.0))
