"""Tests for shardfc.checkpoint: atomic saves, validation and resharding loads."""

from __future__ import annotations

import datetime
import hashlib
import json
import logging
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import torch.distributed as dist

from shardfc import checkpoint as ck
from shardfc.checkpoint import (
    CheckpointError,
    find_checkpoints,
    latest_checkpoint,
    load_checkpoint,
    resolve_resume,
    save_checkpoint,
    verify_checkpoint,
)
from shardfc.head.layout import class_range, class_ranges
from shardfc.parallel.launch import spawn

DIM = 3
FP = {"model": "iresnet50", "embedding_dim": DIM, "margins": [1.0, 0.5, 0.0]}


def _full_state(num_classes: int) -> dict[str, torch.Tensor]:
    """The logical (unsharded) head state every test shards from; distinct value per element."""
    w = torch.arange(num_classes * DIM, dtype=torch.float32).reshape(num_classes, DIM) / 8
    return {"weight": w, "exp_avg": 1 - 2 * w, "exp_avg_sq": (w * w).double()}


def _shard(full: dict[str, torch.Tensor], rows: range) -> dict[str, torch.Tensor]:
    # Views on purpose: the saver must store only the rows, not the whole storage.
    return {k: v[rows.start : rows.stop] for k, v in full.items()}


def _save_single(root: Path, step: int, num_classes: int = 7, **overrides: Any) -> Path:
    """Save a world-of-one checkpoint of _full_state(num_classes)."""
    kwargs: dict[str, Any] = dict(
        common={"backbone": {"w": torch.ones(2)}, "step": step},
        per_rank={"rng": torch.get_rng_state(), "rank": 0},
        head_tensors=_full_state(num_classes),
        head_extras={"step": torch.tensor(float(step)), "betas": (0.9, 0.999)},
        class_range=range(num_classes),
        num_classes=num_classes,
        fingerprint=FP,
    )
    kwargs.update(overrides)
    return save_checkpoint(root, step, **kwargs)


def _assert_rows(loaded: ck.LoadedCheckpoint, full: dict[str, torch.Tensor], rows: range) -> None:
    assert set(loaded.head_tensors) == set(full)
    for name, t in full.items():
        got = loaded.head_tensors[name]
        assert got.dtype == t.dtype
        assert torch.equal(got, t[rows.start : rows.stop]), name


# --------------------------------------------------------------------------- single process


@pytest.mark.parametrize("num_classes", [7, 2])
def test_single_save_then_reshard_load(tmp_path: Path, num_classes: int) -> None:
    path = _save_single(tmp_path, 5, num_classes)
    assert path == tmp_path / "step_00000005"
    full = _full_state(num_classes)
    for world in (1, 2, 3):
        for r, rows in enumerate(class_ranges(num_classes, world)):
            loaded = load_checkpoint(path, class_range=rows, num_classes=num_classes, fingerprint=FP, rank=r)
            _assert_rows(loaded, full, rows)
            assert loaded.step == 5
            assert torch.equal(loaded.common["backbone"]["w"], torch.ones(2))
            assert torch.equal(loaded.head_extras["step"], torch.tensor(5.0))
            assert loaded.head_extras["betas"] == (0.9, 0.999)
            # Only rank index 0 existed in the saved run.
            assert (loaded.per_rank is not None) == (r == 0)
    if num_classes == 2:  # world 3 on 2 classes: the last rank has an empty range
        empty = load_checkpoint(path, class_range=range(2, 2), num_classes=2)
        assert empty.head_tensors["weight"].shape == (0, DIM)
        assert empty.head_tensors["exp_avg_sq"].dtype == torch.float64


def test_meta_contents(tmp_path: Path) -> None:
    path = _save_single(tmp_path, 3)
    meta = json.loads((path / "meta.json").read_text())
    assert meta["format_version"] == ck.FORMAT_VERSION
    assert (meta["step"], meta["world_size"], meta["num_classes"], meta["embedding_dim"]) == (3, 1, 7, DIM)
    assert meta["class_ranges"] == [[0, 7]]
    assert meta["head_tensors"]["exp_avg_sq"] == {"dtype": "float64", "row_shape": [DIM]}
    assert meta["head_extras"] == ["betas", "step"]
    assert meta["fingerprint"] == FP
    assert set(meta["files"]) == {"common.pt", "rank_0.pt", "head_0.pt"}
    for name, entry in meta["files"].items():
        assert entry["size"] == (path / name).stat().st_size
        assert len(entry["sha256"]) == 64
    assert verify_checkpoint(path) == meta
    assert [p.name for p in tmp_path.iterdir()] == ["step_00000003"]  # no temp dirs left


def test_saves_only_the_rows_of_a_view(tmp_path: Path) -> None:
    big = torch.zeros(10_000, DIM)
    path = save_checkpoint(
        tmp_path, 1, common=None, per_rank=None, head_tensors={"weight": big[5:7]}, head_extras={},
        class_range=range(2), num_classes=2, fingerprint={},
    )
    assert (path / "head_0.pt").stat().st_size < big.numel() * big.element_size() // 10
    loaded = load_checkpoint(path, class_range=range(2), num_classes=2)
    assert loaded.common == {} and loaded.per_rank is None
    assert torch.equal(loaded.head_tensors["weight"], torch.zeros(2, DIM))


def test_resave_same_step_replaces(tmp_path: Path) -> None:
    _save_single(tmp_path, 4)
    path = _save_single(tmp_path, 4, common={"version": 2})
    assert find_checkpoints(tmp_path) == [path]
    assert load_checkpoint(path, class_range=range(7), num_classes=7).common == {"version": 2}
    assert [p.name for p in tmp_path.iterdir()] == ["step_00000004"]


@pytest.mark.parametrize(
    ("overrides", "match"),
    [
        ({"head_tensors": {"weight": torch.zeros(6, DIM)}}, r"head_tensors\['weight'\] has shape \(6, 3\)"),
        ({"head_tensors": {"weight": [1, 2]}}, r"head_tensors\['weight'\] must be a torch.Tensor"),
        ({"class_range": range(0, 5)}, r"cover \[0, 5\) but num_classes=7"),
        ({"class_range": range(0, 9)}, r"class_range=range\(0, 9\) must lie within \[0, num_classes=7\]"),
        ({"keep_last": 0}, r"keep_last must be an int >= 1, got 0"),
        ({"fingerprint": {"x": object()}}, r"fingerprint must be JSON-serialisable"),
        ({"per_rank": [1]}, r"per_rank must be a dict or None, got list"),
    ],
)
def test_save_rejects_bad_arguments(tmp_path: Path, overrides: dict[str, Any], match: str) -> None:
    if "class_range" in overrides:  # keep the shapes consistent with the range under test
        rows = overrides["class_range"]
        overrides.setdefault("head_tensors", {"weight": torch.zeros(len(rows), DIM)})
    with pytest.raises(ValueError, match=match):
        _save_single(tmp_path, 1, **overrides)
    assert list(tmp_path.iterdir()) == []  # validated before anything is written


def test_save_rejects_negative_step(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"step must be an int >= 0, got -1"):
        _save_single(tmp_path, -1)


def test_num_classes_mismatch(tmp_path: Path) -> None:
    path = _save_single(tmp_path, 1)
    with pytest.raises(ValueError, match=r"checkpoint .* has num_classes=7, this run has num_classes=8"):
        load_checkpoint(path, class_range=range(8), num_classes=8)


def test_fingerprint_mismatch(tmp_path: Path) -> None:
    path = _save_single(tmp_path, 1)
    other = {"model": "iresnet100", "embedding_dim": DIM, "margins": (1.0, 0.5, 0.0), "extra": 1}
    with pytest.raises(ValueError) as info:
        load_checkpoint(path, class_range=range(7), num_classes=7, fingerprint=other)
    msg = str(info.value)
    assert "model: checkpoint='iresnet50', this run='iresnet100'" in msg
    assert "extra: checkpoint=<missing>, this run=1" in msg
    assert "margins" not in msg  # a tuple equals the list it was saved as
    load_checkpoint(path, class_range=range(7), num_classes=7, fingerprint=dict(FP))


def test_keep_last_prunes_older(tmp_path: Path) -> None:
    for step in range(1, 6):
        _save_single(tmp_path, step, keep_last=2)
    assert [p.name for p in find_checkpoints(tmp_path)] == ["step_00000004", "step_00000005"]
    # A save older than existing ones is never pruned by itself.
    _save_single(tmp_path, 2, keep_last=1)
    assert [p.name for p in find_checkpoints(tmp_path)] == ["step_00000002", "step_00000005"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_00000002", "step_00000005"]


# --------------------------------------------------------------------------- crashes and corruption


def test_failed_save_leaves_previous(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _save_single(tmp_path, 1)
    real_save = torch.save
    calls = []

    def flaky_save(obj: Any, f: Any, *args: Any, **kwargs: Any) -> None:
        calls.append(1)
        if len(calls) == 2:  # common.pt is written, rank_0.pt fails half way
            f.write(b"partial")
            raise OSError("disk full")
        real_save(obj, f, *args, **kwargs)

    monkeypatch.setattr(torch, "save", flaky_save)
    with pytest.raises(OSError, match="disk full"):
        _save_single(tmp_path, 2)
    monkeypatch.setattr(torch, "save", real_save)

    def failing_replace(src: Any, dst: Any) -> None:
        raise OSError("rename failed")

    monkeypatch.setattr(os, "replace", failing_replace)
    with pytest.raises(OSError, match="rename failed"):
        _save_single(tmp_path, 3)
    monkeypatch.undo()

    assert [p.name for p in tmp_path.iterdir()] == ["step_00000001"]
    assert latest_checkpoint(tmp_path) == tmp_path / "step_00000001"
    loaded = load_checkpoint(tmp_path / "step_00000001", class_range=range(7), num_classes=7)
    _assert_rows(loaded, _full_state(7), range(7))


def test_failed_resave_restores_same_step(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from shardfc.checkpoint import durable

    path = _save_single(tmp_path, 4, common={"version": 1})
    monkeypatch.setattr(durable, "exchange", lambda a, b: False)  # a filesystem that cannot swap: two renames
    real_replace = os.replace

    def replace(src: Any, dst: Any) -> None:
        if Path(src).name.startswith(".tmp-"):  # the new save's rename fails after the old one moved aside
            raise OSError("rename failed")
        real_replace(src, dst)

    monkeypatch.setattr(os, "replace", replace)
    with pytest.raises(OSError, match="rename failed"):
        _save_single(tmp_path, 4, common={"version": 2})
    monkeypatch.undo()
    assert [p.name for p in tmp_path.iterdir()] == ["step_00000004"]
    assert load_checkpoint(path, class_range=range(7), num_classes=7).common == {"version": 1}


def test_a_step_a_crashed_resave_left_aside_is_still_the_latest_until_the_next_save_puts_it_back(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Where no swap is possible, a resave of step 4 killed between its two renames leaves step 4 only
    under ``.old-step_00000004-*``: ``latest_checkpoint`` (and what reads through it) finds it there,
    without moving anything; the next save renames it back."""
    from shardfc.checkpoint import durable

    _save_single(tmp_path, 2)
    _save_single(tmp_path, 4, common={"version": 1})
    monkeypatch.setattr(durable, "exchange", lambda a, b: False)
    real, calls = os.replace, []

    def replace(src: Any, dst: Any) -> None:
        calls.append(src)
        if len(calls) == 2:  # the new save's rename, after the old one moved aside
            raise KeyboardInterrupt
        real(src, dst)

    monkeypatch.setattr(os, "replace", replace)
    with pytest.raises(KeyboardInterrupt):
        _save_single(tmp_path, 4, common={"version": 2})
    monkeypatch.undo()
    [aside] = [p for p in tmp_path.iterdir() if p.name.startswith(".old-")]
    assert latest_checkpoint(tmp_path) == aside and not (tmp_path / "step_00000004").exists()
    assert load_checkpoint(aside, class_range=range(7), num_classes=7).common == {"version": 1}
    assert find_checkpoints(tmp_path) == [tmp_path / "step_00000002"]  # the step folders only
    _save_single(tmp_path, 2)  # any save: step 4 is back, the crashed save's scratch folders gone
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_00000002", "step_00000004"]
    assert latest_checkpoint(tmp_path) == tmp_path / "step_00000004"
    # a step folder that is there is read before a copy moved aside from it; an invalid one after
    import shutil

    copy = tmp_path / ".old-step_00000004-ff"
    shutil.copytree(tmp_path / "step_00000004", copy)
    assert latest_checkpoint(tmp_path) == tmp_path / "step_00000004"
    (tmp_path / "step_00000004" / "head_0.pt").write_bytes(b"torn")
    assert latest_checkpoint(tmp_path) == copy


def test_killed_save_leaves_previous(tmp_path: Path) -> None:
    _save_single(tmp_path, 1)
    # The process dies right before the rename: every file including meta.json is written.
    script = textwrap.dedent(
        f"""
        import os, sys, torch
        sys.path.insert(0, {str(Path(__file__).parent)!r})
        from test_checkpoint import _save_single
        os.replace = lambda *a: os._exit(17)
        _save_single({str(tmp_path)!r}, 2)
        """
    )
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 17, proc.stderr
    leftovers = [p.name for p in tmp_path.iterdir() if p.name.startswith(".tmp-step_00000002-")]
    assert len(leftovers) == 1 and (tmp_path / leftovers[0] / "meta.json").exists()
    assert find_checkpoints(tmp_path) == [tmp_path / "step_00000001"]
    assert latest_checkpoint(tmp_path) == tmp_path / "step_00000001"
    assert resolve_resume(tmp_path, "auto") == tmp_path / "step_00000001"
    # The next successful save removes the leftover.
    _save_single(tmp_path, 3)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_00000001", "step_00000003"]


def test_truncated_latest_is_skipped(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    _save_single(tmp_path, 1)
    bad = _save_single(tmp_path, 2)
    head = bad / "head_0.pt"
    with open(head, "r+b") as f:
        f.truncate(head.stat().st_size // 2)
    with caplog.at_level(logging.WARNING, logger="shardfc.checkpoint"):
        assert latest_checkpoint(tmp_path) == tmp_path / "step_00000001"
    assert any("head_0.pt" in r.getMessage() and "truncated" in r.getMessage() for r in caplog.records)
    assert any(r.getMessage().startswith(f"skipping invalid checkpoint {bad}: checkpoint file ") for r in caplog.records)
    with pytest.raises(CheckpointError, match=r"head_0\.pt is truncated"):
        load_checkpoint(bad, class_range=range(7), num_classes=7)
    with pytest.raises(CheckpointError, match=r"head_0\.pt"):
        resolve_resume(tmp_path, str(bad))


def test_corrupt_bytes_detected_by_hash(tmp_path: Path) -> None:
    _save_single(tmp_path, 1)
    bad = _save_single(tmp_path, 2)
    data = bytearray((bad / "common.pt").read_bytes())
    data[len(data) // 2] ^= 0xFF
    (bad / "common.pt").write_bytes(bytes(data))
    assert latest_checkpoint(tmp_path) == tmp_path / "step_00000001"
    assert latest_checkpoint(tmp_path, check_hashes=False) == bad
    with pytest.raises(CheckpointError, match=r"common\.pt is corrupt: sha256"):
        load_checkpoint(bad, class_range=range(7), num_classes=7)


def test_missing_or_garbled_meta_is_skipped(tmp_path: Path) -> None:
    _save_single(tmp_path, 1)
    (tmp_path / "step_00000002").mkdir()  # no meta.json
    garbled = _save_single(tmp_path, 3)
    (garbled / "meta.json").write_text("{not json")
    assert find_checkpoints(tmp_path) == [tmp_path / "step_00000001", garbled]
    assert latest_checkpoint(tmp_path) == tmp_path / "step_00000001"


def test_resolve_resume(tmp_path: Path) -> None:
    assert resolve_resume(tmp_path, "auto") is None
    assert resolve_resume(tmp_path / "missing", "auto") is None
    path = _save_single(tmp_path, 9)
    assert resolve_resume(tmp_path, "auto") == path
    assert resolve_resume(tmp_path, "none") is None
    assert resolve_resume(tmp_path, "") is None
    assert resolve_resume(tmp_path, str(path)) == path
    assert resolve_resume(tmp_path, "step_00000009") == path  # relative to root
    with pytest.raises(FileNotFoundError, match="step_00000010"):
        resolve_resume(tmp_path, "step_00000010")


def test_resume_takes_a_run_folder_or_a_root_as_init_from_does(tmp_path: Path) -> None:
    """--resume RUN was refused ('meta.json is missing') where --init-from RUN and --checkpoint RUN take it."""
    run = tmp_path / "run"
    _save_single(run / "checkpoints", 3)
    newest = _save_single(run / "checkpoints", 5)
    assert resolve_resume(tmp_path / "elsewhere", str(run)) == newest  # the run folder
    assert resolve_resume(tmp_path / "elsewhere", str(run / "checkpoints")) == newest  # its checkpoint root
    (tmp_path / "empty").mkdir()
    with pytest.raises(CheckpointError) as err:
        resolve_resume(tmp_path / "elsewhere", str(tmp_path / "empty"))
    assert str(err.value) == (f"resume={str(tmp_path / 'empty')!r}: {tmp_path / 'empty'} is neither a checkpoint (it "
                              "has no meta.json) nor a run folder holding complete ones")
    with pytest.raises(FileNotFoundError) as err:
        resolve_resume(tmp_path, "never")
    assert str(err.value) == ("resume='never': no checkpoint directory at never (resume is 'auto', 'none', a checkpoint "
                              "folder or a run folder)")


def test_resolve_resume_edge_values(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    assert resolve_resume(tmp_path, None) is None and resolve_resume(None, " NONE ") is None
    with pytest.raises(ValueError, match=r"^resume='auto' needs a checkpoint root, got root=None$"):
        resolve_resume(None, "Auto")
    here, root = tmp_path / "here", tmp_path / "root"
    mine, theirs = _save_single(here, 9), _save_single(root, 9)
    monkeypatch.chdir(here)
    assert resolve_resume(root, mine.name).resolve() == mine  # a name that exists here is not looked up under root
    assert resolve_resume(root, "step_00000009/").resolve() == mine
    (mine.parent / "elsewhere").mkdir()
    monkeypatch.chdir(mine.parent / "elsewhere")
    assert resolve_resume(root, "step_00000009") == theirs
    with pytest.raises(FileNotFoundError, match=r"^resume='step_00000009': no checkpoint directory at step_00000009 "
                                                r"\(resume is 'auto', 'none', a checkpoint folder or a run folder\)$"):
        resolve_resume(None, "step_00000009")


def test_checkpoint_at_a_checkpoint_a_run_folder_or_a_root(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from shardfc.checkpoint import checkpoint_at

    run = tmp_path / "run"
    first, second = _save_single(run / "checkpoints", 1), _save_single(run / "checkpoints", 2)
    assert checkpoint_at(first) == first and checkpoint_at(str(second)) == second
    assert checkpoint_at(run) == checkpoint_at(run / "checkpoints") == second
    (tmp_path / "empty").mkdir()
    assert checkpoint_at(tmp_path / "empty") is None and checkpoint_at(tmp_path / "missing") is None
    monkeypatch.setenv("HOME", str(tmp_path))
    assert checkpoint_at("~/run") == second
    data = bytearray((second / "common.pt").read_bytes())
    data[len(data) // 2] ^= 0xFF
    (second / "common.pt").write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match=r"common\.pt is corrupt: sha256"):
        checkpoint_at(second)
    assert checkpoint_at(second, check_hashes=False) == second
    assert checkpoint_at(run) == first  # the newest complete one


# --------------------------------------------------------------------------- two gloo processes

DIST_CLASSES = 7
DIST_WORLD = 2


def _dist_worker(rank: int, world: int, root: Path) -> dict[str, str]:
    results: dict[str, str] = {}
    full = _full_state(DIST_CLASSES)
    rows = class_range(DIST_CLASSES, world, rank)
    kwargs: dict[str, Any] = dict(
        common={"backbone": {"w": torch.ones(2)}, "step": 10} if rank == 0 else {"ignored": True},
        per_rank={"rank": rank, "rng": torch.get_rng_state()},
        head_tensors=_shard(full, rows),
        head_extras={"step": torch.tensor(5.0)},
        class_range=rows,
        num_classes=DIST_CLASSES,
        fingerprint=FP,
    )
    results["path10"] = str(save_checkpoint(root / "run", 10, **kwargs))
    pair = dist.new_group([0, 1])
    solo = dist.new_group([1])  # its rank 0 is global rank 1: exercises get_global_rank
    save_checkpoint(root / "run", 20, group=pair, **kwargs)
    if rank == 1:
        solo_kwargs = dict(kwargs, head_tensors=full, class_range=range(DIST_CLASSES))
        results["solo"] = str(save_checkpoint(root / "solo", 30, group=solo, **solo_kwargs))
    # Both ranks claim the same rows: every rank must raise, none may hang.
    try:
        save_checkpoint(root / "run", 40, **dict(kwargs, class_range=class_range(DIST_CLASSES, world, 0),
                                                 head_tensors=_shard(full, class_range(DIST_CLASSES, world, 0))))
    except ValueError as e:
        results["bad_range"] = str(e)
    # Rank 1's per-rank state is not plain data: refused on every rank before anything is written.
    try:
        save_checkpoint(root / "run", 50, **dict(kwargs, per_rank={"f": lambda: 0} if rank == 1 else {}))
    except ValueError as e:
        results["not_plain"] = str(e)
    # Writing fails on rank 1 only (e.g. its disk is full).
    real_save = torch.save
    if rank == 1:
        torch.save = lambda *args, **kw: (_ for _ in ()).throw(OSError("disk full"))
    try:
        save_checkpoint(root / "run", 55, **kwargs)
    except Exception as e:
        results["write_fail"] = type(e).__name__
    finally:
        torch.save = real_save
    # Extras that differ between shards (saved as is; detected when a load merges them).
    save_checkpoint(root / "run", 60, **dict(kwargs, head_extras={"step": torch.tensor(float(rank))}))
    return results


@pytest.fixture(scope="module")
def dist_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[dict[str, str]]]:
    root = tmp_path_factory.mktemp("dist")
    # A protocol bug fails the test (gloo's timeout) instead of hanging it.
    return root, spawn(_dist_worker, DIST_WORLD, root, backend="gloo", timeout_s=60)


def test_dist_save_loads_on_any_world(dist_run: tuple[Path, list[dict[str, str]]]) -> None:
    root, results = dist_run
    path = root / "run" / "step_00000010"
    assert results[0]["path10"] == results[1]["path10"] == str(path)
    meta = verify_checkpoint(path)
    assert meta["world_size"] == 2 and meta["class_ranges"] == [[0, 4], [4, 7]]
    full = _full_state(DIST_CLASSES)
    for step in (10, 20):
        for world in (1, 3):
            for r, rows in enumerate(class_ranges(DIST_CLASSES, world)):
                loaded = load_checkpoint(root / "run" / f"step_{step:08d}", class_range=rows,
                                         num_classes=DIST_CLASSES, fingerprint=FP, rank=r)
                _assert_rows(loaded, full, rows)
                assert loaded.common["step"] == 10  # rank 0's common, not rank 1's
                assert torch.equal(loaded.head_extras["step"], torch.tensor(5.0))
                if r < 2:
                    assert loaded.per_rank is not None and loaded.per_rank["rank"] == r
                else:
                    assert loaded.per_rank is None


def test_dist_save_with_subgroup(dist_run: tuple[Path, list[dict[str, str]]]) -> None:
    root, results = dist_run
    path = root / "solo" / "step_00000030"
    assert results[1]["solo"] == str(path)
    assert verify_checkpoint(path)["world_size"] == 1
    loaded = load_checkpoint(path, class_range=range(4, 7), num_classes=DIST_CLASSES, rank=0)
    _assert_rows(loaded, _full_state(DIST_CLASSES), range(4, 7))
    assert loaded.per_rank is not None and loaded.per_rank["rank"] == 1


def test_dist_errors_raise_on_every_rank(dist_run: tuple[Path, list[dict[str, str]]]) -> None:
    root, results = dist_run
    for res in results:
        assert "contiguous" in res["bad_range"]
    assert "save_checkpoint of step 50 failed on rank 1: per_rank['f'] is a function" in results[0]["not_plain"]
    assert results[1]["not_plain"].startswith("per_rank['f'] is a function")
    assert results[0]["write_fail"] == "CheckpointError"  # told about rank 1's failure
    assert results[1]["write_fail"] == "OSError"  # its own error
    names = sorted(p.name for p in (root / "run").iterdir())
    assert names == ["step_00000010", "step_00000020", "step_00000060"]  # nothing of steps 40/50/55


def test_dist_differing_extras_detected_on_merge(dist_run: tuple[Path, list[dict[str, str]]]) -> None:
    root, _ = dist_run
    path = root / "run" / "step_00000060"
    # Within one saved shard there is nothing to merge.
    assert torch.equal(load_checkpoint(path, class_range=range(0, 4), num_classes=7).head_extras["step"],
                       torch.tensor(0.0))
    with pytest.raises(CheckpointError, match="head extras differ between saved shards 0 and 1"):
        load_checkpoint(path, class_range=range(2, 6), num_classes=7)


def test_load_common_reads_only_the_replicated_part(tmp_path):
    from shardfc.checkpoint import CheckpointError, load_common, save_checkpoint

    path = save_checkpoint(
        tmp_path, 7, common={"backbone": {"w": torch.ones(2)}}, per_rank=None,
        head_tensors={"weight": torch.zeros(4, 3)}, head_extras={}, class_range=range(0, 4),
        num_classes=4, fingerprint={"model": "m"},
    )
    common, meta = load_common(path)
    assert torch.equal(common["backbone"]["w"], torch.ones(2)) and meta["step"] == 7
    common_file = path / "common.pt"
    data = bytearray(common_file.read_bytes())
    data[-1] ^= 0xFF  # same size, different bytes
    common_file.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match="common.pt is corrupt"):
        load_common(path)


def test_step_of_reads_the_name_or_else_meta(tmp_path: Path) -> None:
    path = _save_single(tmp_path / "run", 12)
    assert ck.step_of(path) == 12 and ck.parse_step_dir(path.name) == 12
    assert ck.parse_step_dir("step_12.set-aside-20260101") is None and ck.parse_step_dir(".tmp-step_1-ab") is None
    # only ASCII digits, and nothing after them: not another script's digits, not a trailing newline
    for other in ("step_\u0663", "step_12\n", "step_-5", "step_", "xstep_12"):
        assert ck.parse_step_dir(other) is None, other
    assert ck.parse_step_dir("step_7") == 7 and ck.step_dir_name(0) == "step_00000000"
    from shardfc.checkpoint.format import is_scratch_dir, scratch_dir_name
    assert is_scratch_dir(scratch_dir_name("tmp", "step_00000007", "ab12"))
    assert not any(map(is_scratch_dir, (".tmp-step_7-ab12\n", ".tmp-step_\u0663-ab12", "x.tmp-step_7-ab12", ".new-step_7-ab")))
    for bad in (-5, 1.5, True, "3"):
        with pytest.raises(ValueError, match=f"step must be an int >= 0, got {re.escape(repr(bad))}"):
            ck.step_dir_name(bad)
    copy = tmp_path / "best"
    path.rename(copy)  # a checkpoint kept under another name: its meta.json knows the step
    assert ck.step_of(copy) == 12
    with pytest.raises(CheckpointError, match="meta.json is missing"):
        ck.step_of(tmp_path / "run")
    # a step directory's name is its step: its meta.json is not read (a save in progress has none yet)
    assert ck.step_of(tmp_path / "run" / "step_00000007") == 7


# --------------------------------------------------------------------------- loading, file by file


def _replace(path: Path, fname: str, obj: Any) -> None:
    """``path/fname`` replaced by ``torch.save(obj)``, its size and sha256 recorded in meta.json (as a
    crafted or foreign checkpoint would have them)."""
    torch.save(obj, path / fname)
    data = (path / fname).read_bytes()
    meta = json.loads((path / ck.META_FILE).read_text())
    meta["files"][fname] = {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    (path / ck.META_FILE).write_text(json.dumps(meta))


def _resharded(path: Path, bounds: list[int], extras: list[dict[str, Any]] | None = None) -> dict[str, torch.Tensor]:
    """Rewrite the world-of-one checkpoint ``path`` (of ``_full_state(bounds[-1])``) as the shards
    ``[bounds[i], bounds[i + 1])`` a larger world would have saved; ``extras``: each shard's. Returns the full state."""
    full = _full_state(bounds[-1])
    meta = json.loads((path / ck.META_FILE).read_text())
    head = torch.load(path / "head_0.pt")
    meta["files"].pop("head_0.pt")
    (path / "head_0.pt").unlink()
    meta["class_ranges"], meta["world_size"] = [[a, b] for a, b in zip(bounds, bounds[1:])], len(bounds) - 1
    for i, (a, b) in enumerate(zip(bounds, bounds[1:])):
        torch.save({"class_range": (a, b), "tensors": {k: v[a:b].clone() for k, v in full.items()},
                    "extras": head["extras"] if extras is None else extras[i]}, path / f"head_{i}.pt")
        data = (path / f"head_{i}.pt").read_bytes()
        meta["files"][f"head_{i}.pt"] = {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    (path / ck.META_FILE).write_text(json.dumps(meta))
    return full


def _flip_a_byte(f: Path) -> None:
    data = bytearray(f.read_bytes())
    data[-1] ^= 0xFF  # same size, different bytes
    f.write_bytes(bytes(data))


@pytest.mark.parametrize("wanted, kept", [(range(3, 5), [1]), (range(4, 6), [1, 2]), (range(0, 3), [0])])
def test_only_the_shards_holding_the_rows_asked_for_are_read(tmp_path: Path, wanted: range, kept: list[int]) -> None:
    """Shards [0, 3), [3, 5), [5, 7): a shard that only touches the range's ends is not read (the
    others are deleted here), and rows inside a shard that starts past 0 are taken at its offset."""
    path = _save_single(tmp_path, 1)
    full = _resharded(path, [0, 3, 5, 7])
    for i in {0, 1, 2} - set(kept):
        (path / f"head_{i}.pt").unlink()
    _assert_rows(load_checkpoint(path, class_range=wanted, num_classes=7), full, wanted)


def test_an_empty_range_reads_only_the_smallest_shard(tmp_path: Path) -> None:
    path = _save_single(tmp_path, 1)
    full = _resharded(path, [0, 3, 4, 7])
    (path / "head_0.pt").unlink()
    (path / "head_2.pt").unlink()
    for rows in (range(0, 0), range(7, 7)):
        loaded = load_checkpoint(path, class_range=rows, num_classes=7)
        _assert_rows(loaded, full, rows)  # no rows, each tensor of its dtype
        assert loaded.head_extras["betas"] == (0.9, 0.999) and loaded.class_range == rows


def test_a_range_one_saved_shard_holds_whole_is_that_shards_tensor_uncopied(tmp_path: Path, monkeypatch) -> None:
    """A single fully used shard is handed out as read; a part of one (or rows of several) is copied,
    keeping none of the rows not asked for."""
    path = _save_single(tmp_path, 1)
    _resharded(path, [0, 3, 7])
    heads = {}
    real = ck.load.load_file

    def load_file(*args: Any, **kwargs: Any) -> Any:
        heads[args[1]] = obj = real(*args, **kwargs)
        return obj

    monkeypatch.setattr(ck.load, "load_file", load_file)
    loaded = load_checkpoint(path, class_range=range(3, 7), num_classes=7)
    assert list(heads) == ["common.pt", "rank_0.pt", "head_1.pt"]
    assert all(loaded.head_tensors[k] is t for k, t in heads["head_1.pt"]["tensors"].items())
    part = load_checkpoint(path, class_range=range(4, 7), num_classes=7).head_tensors["weight"]
    assert part.untyped_storage().nbytes() == 3 * DIM * part.element_size()


def test_a_range_of_none_reads_no_head_file(tmp_path: Path) -> None:
    path = _save_single(tmp_path, 1)
    (path / "head_0.pt").unlink()
    loaded = load_checkpoint(path, class_range=None, num_classes=7, rank=0)
    assert (loaded.head_tensors, loaded.head_extras, loaded.class_range) == ({}, {}, range(0))
    assert loaded.path == path and loaded.step == 1 and loaded.per_rank["rank"] == 0


@pytest.mark.parametrize("kwargs, message", [
    (dict(class_range=range(0, 8), num_classes=7), "class_range=range(0, 8) must lie within [0, num_classes=7]"),
    (dict(class_range=None, num_classes=0), "num_classes must be an int >= 1, got 0"),
    (dict(class_range=None, num_classes=7, rank=-1), "rank must be an int >= 0, got -1"),
])
def test_bad_load_arguments_are_refused_naming_them(tmp_path: Path, kwargs: dict[str, Any], message: str) -> None:
    path = _save_single(tmp_path, 1)
    with pytest.raises(ValueError) as error:
        load_checkpoint(path, **kwargs)
    assert str(error.value) == message


def _mapped(path: Path) -> list[str]:
    """The files of checkpoint ``path`` this process has memory-mapped now (Linux)."""
    with open("/proc/self/maps") as f:
        return sorted({Path(line.split()[-1]).name for line in f if str(path) + os.sep in line})


@pytest.mark.skipif(not Path("/proc/self/maps").exists(), reason="reads the process's mappings from /proc (Linux)")
def test_common_is_memory_mapped_only_when_asked_and_every_file_goes_where_asked(tmp_path: Path) -> None:
    path = _save_single(tmp_path, 1)
    loaded = load_checkpoint(path, class_range=range(7), num_classes=7, rank=0)
    assert _mapped(path) == []
    del loaded
    loaded = load_checkpoint(path, class_range=range(7), num_classes=7, rank=0, mmap=True)
    assert _mapped(path) == ["common.pt"]  # rank_0.pt and head_0.pt read as usual
    del loaded
    on_meta = load_checkpoint(path, class_range=range(7), num_classes=7, rank=0, map_location="meta")
    tensors = [on_meta.common["backbone"]["w"], on_meta.per_rank["rng"], *on_meta.head_tensors.values()]
    assert [t.device.type for t in tensors] == ["meta"] * 5
    common, _ = ck.load_common(path, map_location="meta")
    assert common["backbone"]["w"].device.type == "meta"


@pytest.mark.parametrize("fname", ["common.pt", "rank_0.pt", "head_0.pt"])
def test_each_file_read_is_hash_checked_unless_verify_is_false(tmp_path: Path, fname: str) -> None:
    path = _save_single(tmp_path, 1)
    _flip_a_byte(path / fname)
    with pytest.raises(CheckpointError, match=rf"^checkpoint file {path / fname} is corrupt: sha256 "):
        load_checkpoint(path, class_range=range(7), num_classes=7, rank=0)
    load_checkpoint(path, class_range=range(7), num_classes=7, rank=0, verify=False)  # the size still matches


@pytest.mark.parametrize("fname", ["common.pt", "rank_0.pt", "head_0.pt"])
def test_each_file_needing_full_unpickling_is_read_only_if_trusted(tmp_path: Path, fname: str) -> None:
    path = _save_single(tmp_path, 1)
    obj = torch.load(path / fname)
    (obj["extras"] if fname == "head_0.pt" else obj)["when"] = datetime.date(2020, 1, 2)  # not weights-only data
    _replace(path, fname, obj)
    with pytest.raises(CheckpointError, match=rf"^refusing to load {path / fname}: it needs "):
        load_checkpoint(path, class_range=range(7), num_classes=7, rank=0)
    loaded = load_checkpoint(path, class_range=range(7), num_classes=7, rank=0, trust_pickle=True)
    found = {"common.pt": loaded.common, "rank_0.pt": loaded.per_rank, "head_0.pt": loaded.head_extras}[fname]
    assert found["when"] == datetime.date(2020, 1, 2)


def test_a_common_file_that_is_not_a_dict_is_refused(tmp_path: Path) -> None:
    path = _save_single(tmp_path, 1)
    _replace(path, "common.pt", [1, 2])
    for load in (lambda: load_checkpoint(path, class_range=range(7), num_classes=7), lambda: ck.load_common(path)):
        with pytest.raises(CheckpointError) as error:
            load()
        assert str(error.value) == f"{path / 'common.pt'} does not hold a dict (got list)"


def test_load_common_checks_every_files_size_but_only_commons_hash(tmp_path: Path) -> None:
    path = _save_single(tmp_path, 1)
    _flip_a_byte(path / "head_0.pt")  # a head shard can be gigabytes: its size is checked, not its hash
    common, meta = ck.load_common(path)
    assert common["step"] == 1 and meta == verify_checkpoint(path, check_hashes=False)
    with pytest.raises(CheckpointError, match=rf"^checkpoint file {path / 'head_0.pt'} is corrupt: sha256 "):
        verify_checkpoint(path)  # hashes checked by default
    with open(path / "head_0.pt", "r+b") as f:
        f.truncate(10)
    with pytest.raises(CheckpointError, match=rf"^checkpoint file {path / 'head_0.pt'} is truncated or corrupt"):
        ck.load_common(path)


def test_load_file_refuses_a_file_meta_json_does_not_list(tmp_path: Path) -> None:
    path = _save_single(tmp_path, 1)
    with pytest.raises(CheckpointError) as error:
        ck.load.load_file(path, "rank_1.pt", verify_checkpoint(path), "cpu", True, False)
    assert str(error.value) == f"{path / 'meta.json'} does not list rank_1.pt"


def test_load_file_follows_no_symlink_swapped_in_after_its_check(tmp_path: Path, monkeypatch) -> None:
    """The size and hash are checked, then the file is opened: a symlink put in its place between the
    two (to the same bytes elsewhere) is refused, not read."""
    path = _save_single(tmp_path / "run", 1)
    other = _save_single(tmp_path / "other", 1)
    real = ck.load.check_file

    def check_then_swap(p: Path, entry: Any, check_hash: bool) -> None:
        real(p, entry, check_hash)
        p.unlink()
        p.symlink_to(other / p.name)

    monkeypatch.setattr(ck.load, "check_file", check_then_swap)
    with pytest.raises(CheckpointError) as error:
        ck.load.load_file(path, "common.pt", verify_checkpoint(other), "cpu", True, False)
    assert str(error.value) == f"refusing to read checkpoint file {path / 'common.pt'}: it is a symlink, not a regular file"


def _shard_file(path: Path, fname: str, change: Any) -> Path:
    """Replace head shard ``fname`` of ``path`` by ``change(its dict)`` (a shard file as read back)."""
    _replace(path, fname, change(torch.load(path / fname)))
    return path / fname


@pytest.mark.parametrize("change", [
    lambda h: [h],  # not a dict
    lambda h: {k: v for k, v in h.items() if k != "extras"},
    lambda h: dict(h, class_range="07"),
    lambda h: dict(h, tensors=list(h["tensors"].items())),
    lambda h: dict(h, extras=[1]),
], ids=["list", "no extras", "class_range a str", "tensors a list", "extras a list"])
def test_a_head_file_not_shaped_as_a_shard_is_refused(tmp_path: Path, change: Any) -> None:
    path = _save_single(tmp_path, 1)
    f = _shard_file(path, "head_0.pt", change)
    with pytest.raises(CheckpointError) as error:
        load_checkpoint(path, class_range=range(7), num_classes=7)
    assert str(error.value) == f"{f} is not a head shard file"


@pytest.mark.parametrize("change, message", [
    (lambda h: dict(h, class_range=(0, 6)), "holds class_range=(0, 6) but meta.json records (0, 7)"),
    (lambda h: dict(h, tensors={**h["tensors"], "bias": torch.zeros(7)}),
     "holds tensors ['bias', 'exp_avg', 'exp_avg_sq', 'weight'], meta.json lists ['exp_avg', 'exp_avg_sq', 'weight']"),
    (lambda h: dict(h, tensors={**h["tensors"], "weight": torch.zeros(7, DIM + 1)}),
     f": 'weight' is not a tensor of rows [{DIM}] as meta.json records (got [7, {DIM + 1}])"),
    (lambda h: dict(h, tensors={**h["tensors"], "weight": [1, 2]}),
     f": 'weight' is not a tensor of rows [{DIM}] as meta.json records (got [1, 2])"),
    (lambda h: dict(h, tensors={**h["tensors"], "weight": torch.tensor(1.0)}),
     f": 'weight' is not a tensor of rows [{DIM}] as meta.json records (got [])"),
    (lambda h: dict(h, tensors={**h["tensors"], "weight": torch.zeros(6, DIM)}),
     ": tensor 'weight' has 6 rows, its class range has 7"),
], ids=["class_range", "names", "row shape", "not a tensor", "0-dim", "rows"])
def test_a_head_shard_that_does_not_match_meta_json_is_refused(tmp_path: Path, change: Any, message: str) -> None:
    path = _save_single(tmp_path, 1)
    f = _shard_file(path, "head_0.pt", change)
    with pytest.raises(CheckpointError) as error:
        load_checkpoint(path, class_range=range(7), num_classes=7)
    assert str(error.value) == f"{f}{'' if message.startswith(':') else ' '}{message}"


def test_a_meta_json_recording_a_head_tensor_without_its_row_shape_refuses_it(tmp_path: Path) -> None:
    path = _save_single(tmp_path, 1)
    meta = json.loads((path / ck.META_FILE).read_text())
    meta["head_tensors"]["weight"] = "float32"  # not an object with a row_shape
    (path / ck.META_FILE).write_text(json.dumps(meta))
    with pytest.raises(CheckpointError) as error:
        load_checkpoint(path, class_range=range(7), num_classes=7)
    assert str(error.value) == (f"{path / 'head_0.pt'}: 'weight' is not a tensor of rows None as meta.json records "
                                f"(got [7, {DIM}])")


def test_head_extras_that_differ_between_shards_are_refused_naming_both(tmp_path: Path) -> None:
    path = _save_single(tmp_path, 1)
    _resharded(path, [0, 3, 5, 7], extras=[{"step": 4}, {"step": 4}, {"step": 5}])
    assert load_checkpoint(path, class_range=range(0, 5), num_classes=7).head_extras == {"step": 4}
    with pytest.raises(CheckpointError) as error:
        load_checkpoint(path, class_range=range(2, 7), num_classes=7)
    assert str(error.value) == f"head extras differ between saved shards 0 and 2 of {path}: {{'step': 4}} vs {{'step': 5}}"


def test_a_fingerprint_differing_in_any_key_is_refused_listing_each(tmp_path: Path) -> None:
    path = _save_single(tmp_path, 1, fingerprint={**FP, "note": None})
    current = {k: v for k, v in FP.items() if k != "embedding_dim"} | {"model": "x"}
    with pytest.raises(ValueError) as error:
        load_checkpoint(path, class_range=range(7), num_classes=7, fingerprint=current)
    assert str(error.value) == (
        f"checkpoint {path} was saved by a different model/config: embedding_dim: checkpoint={DIM}, this run=<missing>; "
        "model: checkpoint='iresnet50', this run='x'; note: checkpoint=None, this run=<missing>"
    )


def test_a_fingerprint_that_is_not_plain_json_is_refused_naming_it(tmp_path: Path) -> None:
    path = _save_single(tmp_path, 1)
    with pytest.raises(ValueError) as error:
        load_checkpoint(path, class_range=range(7), num_classes=7, fingerprint={1: "x"})
    assert str(error.value) == "fingerprint keys must be str, got 1"
    try:
        json.dumps({1, 2})
    except TypeError as e:
        reason = str(e)
    with pytest.raises(ValueError) as error:
        load_checkpoint(path, class_range=range(7), num_classes=7, fingerprint={"x": {1, 2}})
    assert str(error.value) == f"fingerprint must be JSON-serialisable: {reason}"


@pytest.mark.parametrize("a, b, equal", [
    (torch.ones(2), torch.ones(2), True),
    (torch.ones(2), torch.ones(2, dtype=torch.float64), False),  # torch.equal alone says True
    (torch.ones(2), torch.ones(1, 2), False),
    (torch.ones(2), torch.tensor([1.0, 2.0]), False),
    (torch.ones(1), 1.0, False),  # a tensor and a number: tensor == 1.0 is tensor([True])
    (1.0, torch.ones(1), False),
    (torch.ones(1), [1.0], False),
    ({"a": torch.ones(2), "b": [1, (2, 3)]}, {"b": [1, (2, 3)], "a": torch.ones(2)}, True),
    ({"a": 1}, {"b": 1}, False),
    ({"a": 1}, [1], False),
    ([1, 2], (1, 2), False),
    ([1], [1, 2], False),
    ([1, 2], [1, 3], False),
    (np.array([1, 2]), np.array([1, 2]), False),  # no truth value: not known equal
])
def test_objects_equal_compares_tensors_by_dtype_shape_and_values_and_containers_by_type(a, b, equal) -> None:
    assert ck.load.objects_equal(a, b) is equal
    assert ck.load.objects_equal(b, a) is equal


def test_objects_equal_visits_at_most_its_budget_of_values() -> None:
    assert ck.load.objects_equal([0] * 4, [0] * 4, budget=5)  # the lists and their 4 items: 5 values
    with pytest.raises(CheckpointError) as error:
        ck.load.objects_equal([0] * 5, [0] * 5, budget=5)
    assert str(error.value) == "the saved values are too large to compare (more than 5 values)"


def test_a_symlinked_file_is_refused_even_when_only_sizes_are_checked(tmp_path: Path) -> None:
    """``verify_checkpoint(check_hashes=False)`` (what ``load_common`` runs over the head shards, which it
    never opens) refuses a file swapped for a symlink to the same bytes elsewhere."""
    path = _save_single(tmp_path / "run", 1)
    other = _save_single(tmp_path / "other", 1)
    (path / "head_0.pt").unlink()
    (path / "head_0.pt").symlink_to(other / "head_0.pt")
    message = f"refusing to read checkpoint file {path / 'head_0.pt'}: it is a symlink, not a regular file"
    for check in (lambda: verify_checkpoint(path, check_hashes=False), lambda: ck.load_common(path)):
        with pytest.raises(CheckpointError) as error:
            check()
        assert str(error.value) == message
