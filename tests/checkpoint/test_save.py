"""``save_checkpoint``'s cross-rank steps in the test's own process: ranks as threads whose collectives
meet at a barrier (the gloo tests run them in spawned ranks, which mutation testing does not see)."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any, Callable

import pytest
import torch

from shardfc.checkpoint import CheckpointError, load_checkpoint, save_checkpoint, verify_checkpoint
from shardfc.checkpoint import save as S
from shardfc.parallel.context import DistContext


class _Comm:
    """One rank's collectives over threads: every rank's object, in rank order, once all have arrived."""

    def __init__(self, world: "_World", rank: int) -> None:
        self.world, self.rank = world, rank

    def all_gather_object(self, obj: Any) -> list[Any]:
        self.world.slots[self.rank] = obj
        self.world.barrier.wait()
        out = list(self.world.slots)
        self.world.barrier.wait()
        return out

    def broadcast_object(self, obj: Any) -> Any:
        return self.all_gather_object(obj)[0]


class _World:
    def __init__(self, size: int) -> None:
        self.size = size
        self.slots: list[Any] = [None] * size
        self.barrier = threading.Barrier(size, timeout=30)
        self.local = threading.local()

    def run(self, fn: Callable[[int], Any], monkeypatch: pytest.MonkeyPatch) -> list[Any]:
        """``fn(rank)`` on every rank; each rank's result or exception."""
        monkeypatch.setattr(DistContext, "resolve", classmethod(lambda cls, group=None, device=None: self.local.ctx))
        out: list[Any] = [None] * self.size

        def rank_main(rank: int) -> None:
            self.local.ctx = DistContext(None, rank, self.size, True, torch.device("cpu"), _Comm(self, rank))
            try:
                out[rank] = fn(rank)
            except Exception as e:  # noqa: BLE001 - returned to the test
                out[rank] = e

        threads = [threading.Thread(target=rank_main, args=(r,)) for r in range(self.size)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        return out


FP = {"model": "m"}


def _head(rows: range, num_classes: int = 4) -> dict[str, Any]:
    w = torch.arange(num_classes * 2, dtype=torch.float32).reshape(num_classes, 2)
    return dict(head_tensors={"weight": w[rows.start : rows.stop]}, class_range=rows, num_classes=num_classes)


def _save(root: Path, rank: int, **overrides: Any) -> Path:
    kwargs: dict[str, Any] = dict(common={"c": rank}, per_rank={"r": rank}, fingerprint=FP,
                                  **_head(range(2 * rank, 2 * rank + 2)))
    kwargs.update(overrides)
    return save_checkpoint(root, 3, **kwargs)


def test_two_ranks_save_one_checkpoint_with_both_shards_and_rank_files(tmp_path: Path, monkeypatch) -> None:
    out = _World(2).run(lambda rank: _save(tmp_path, rank), monkeypatch)
    assert out == [tmp_path / "step_00000003"] * 2
    meta = verify_checkpoint(out[0])
    assert sorted(meta["files"]) == ["common.pt", "head_0.pt", "head_1.pt", "rank_0.pt", "rank_1.pt"]
    loaded = load_checkpoint(out[0], class_range=range(4), num_classes=4, rank=1)
    assert loaded.common == {"c": 0} and loaded.per_rank == {"r": 1}
    assert torch.equal(loaded.head_tensors["weight"], torch.arange(8, dtype=torch.float32).reshape(4, 2))


def test_a_failed_write_on_one_rank_fails_every_rank_and_leaves_nothing(tmp_path: Path, monkeypatch) -> None:
    real = S.save_durable

    def save_durable(obj: Any, path: Path) -> Any:
        if path.name == "rank_1.pt":
            raise OSError("disk full")
        return real(obj, path)

    monkeypatch.setattr(S, "save_durable", save_durable)
    out = _World(2).run(lambda rank: _save(tmp_path, rank), monkeypatch)
    assert type(out[1]) is OSError and str(out[1]) == "disk full"  # the failing rank raises its own
    assert type(out[0]) is CheckpointError
    assert str(out[0]) == f"saving checkpoint step 3 under {tmp_path} failed on rank 1: OSError: disk full"
    assert list(tmp_path.iterdir()) == []  # rank 0 removed the scratch directory


def test_a_scratch_directory_that_cannot_be_made_is_the_error_raised(tmp_path: Path, monkeypatch) -> None:
    real = Path.mkdir

    def mkdir(self: Path, *args: Any, **kwargs: Any) -> None:
        if self.name.startswith(".tmp-"):
            raise OSError("no space left")
        real(self, *args, **kwargs)

    monkeypatch.setattr(Path, "mkdir", mkdir)
    # Not the error of removing the directory that was never made.
    with pytest.raises(OSError, match="^no space left$"):
        save_checkpoint(tmp_path, 1, common=None, per_rank=None, fingerprint=FP, **_head(range(4)))
    assert list(tmp_path.iterdir()) == []
