"""spawn: results by value, errors with tracebacks, no hang when a rank dies."""

import os

import pytest
import torch

from shardfc.parallel.launch import WorkerError, spawn


def _returns_tensor(rank, world):
    return {"rank": rank, "t": torch.full((3,), float(rank))}


def _raises_on_rank_1(rank, world):
    if rank == 1:
        raise ValueError("bad thing on rank 1")
    torch.distributed.barrier()  # would wait forever for rank 1
    return rank


def _dies_on_rank_0(rank, world):
    if rank == 0:
        os._exit(3)
    torch.distributed.barrier()
    return rank


def test_results_come_back_by_value():
    out = spawn(_returns_tensor, 2, backend="gloo")
    assert [o["rank"] for o in out] == [0, 1]
    assert torch.equal(out[1]["t"], torch.ones(3))


def test_a_rank_that_raises_is_reported_and_the_others_stopped():
    with pytest.raises(WorkerError, match="rank 1 of 2 failed:\nValueError: bad thing on rank 1"):
        spawn(_raises_on_rank_1, 2, backend="gloo", timeout_s=600)


def test_a_rank_that_dies_does_not_hang_the_parent():
    with pytest.raises(WorkerError, match="rank 0 of 2 failed:\nexited with code 3"):
        spawn(_dies_on_rank_0, 2, backend="gloo", timeout_s=600)


def test_world_size_must_be_positive():
    with pytest.raises(ValueError, match="world_size must be a positive integer, got 0"):
        spawn(_returns_tensor, 0)


def test_group_that_never_forms_is_retried_then_reported(monkeypatch):
    import shardfc.parallel.launch as launch

    monkeypatch.setattr(launch, "INIT_ATTEMPTS", 2)
    with pytest.raises(WorkerError, match="did not form in 2 attempts: rank .*process group init failed"):
        spawn(_returns_tensor, 2, backend="no-such-backend")
