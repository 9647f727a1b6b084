"""The head over Horovod (``horovodrun -np 2 --gloo``) against the dense float64 reference.

One horovodrun for the module (see ``horovod_worker.py``): the cases of the torch.distributed
tests, unequal and equal local batches, bad input on one rank, predict, an explicit context, a
backbone under ``hvd.DistributedOptimizer`` and the trainer's step end with it, Partial FC, and communication counts.
Skipped without Horovod unless ``SHARDFC_REQUIRE_HOROVOD=1``.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import test_module_distributed as tmd
import torch
from test_module_distributed import CASES, SIZES, TOL

import shardfc

WORLD = 2
WORKER = Path(__file__).with_name("horovod_worker.py")


@pytest.fixture(scope="module")
def results(horovodrun, tmp_path_factory):
    out = tmp_path_factory.mktemp("horovod_head")
    code, log = horovodrun(WORLD, [str(WORKER), str(out)], out / "horovodrun.log", timeout_s=600)
    assert code == 0, f"horovodrun exited with {code} (None: timed out):\n{log[-4000:]}"
    return [torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(WORLD)]


def test_horovod_world_is_found_without_a_group(results):
    for res in results:
        assert res["world"] == WORLD
        assert res["resolved_backend"] == "horovod"


@pytest.mark.parametrize("case", list(CASES))
def test_loss_and_gradients_equal_dense_reference(results, case):
    for rank, res in enumerate(results):
        errs = res["cases"][case]
        assert errs["loss_finite"]
        for key in ("loss", "grad_embeddings", "grad_weight"):
            assert errs[key] < TOL, f"rank {rank} {case}: {key} rel err {errs[key]:.3g}"


def test_equal_local_batches_through_horovod_reducescatter(results):
    for rank, res in enumerate(results):
        for case, errs in res["equal_cases"].items():
            for key in ("loss", "grad_embeddings", "grad_weight"):
                assert errs[key] < TOL, f"rank {rank} {case}: {key} rel err {errs[key]:.3g}"


def test_bad_input_raises_on_every_rank(results):
    tmd.test_bad_input_raises_on_every_rank((WORLD, results))


def test_predict_equals_dense_topk(results):
    for rank, res in enumerate(results):
        for key, (err, same_ids, shape) in res["predict"].items():
            assert shape == (SIZES[WORLD][rank], 5)
            assert err < TOL and same_ids, f"rank {rank} {key}"


def test_explicit_context(results):
    ranges = [tuple(res["context"]["range"]) for res in results]
    assert ranges == [(r.start, r.stop) for r in shardfc.head.layout.class_ranges(23, WORLD)]
    for res in results:
        c = res["context"]
        assert c["mode"] == "group" and c["backend"] == "horovod"
        for key in ("loss", "grad_embeddings", "grad_weight"):
            assert c[key] < TOL, f"{key}: {c[key]}"


def test_distributed_optimizer_backbone_gets_single_process_gradients(results):
    """hvd.DistributedOptimizer averages (op=Average), which the head's W-scaled embedding gradient expects."""
    for res in results:
        for key in ("backbone", "head", "loss"):
            assert res["optimizer"][key] < TOL, f"{key}: {res['optimizer'][key]}"


def test_trainer_step_averages_before_clipping(results):
    # The head's global norm is summed in float32 (clip_head_grad_): float32 precision there.
    # Clipping per rank before averaging would be off by ~1e-2.
    for res in results:
        for key, tol in (("backbone", TOL), ("head", 1e-6)):
            assert res["apply_gradients"][key] < tol, f"{key}: {res['apply_gradients'][key]}"


def test_partial_fc(results):
    for res in results:
        for key in ("loss", "grad_embeddings", "grad_weight"):
            assert res["partial"][key] < TOL, f"{key}: {res['partial'][key]}"


def test_collectives_are_counted(results):
    for res in results:
        calls = res["counted"]["calls"]
        assert {"all_gather", "all_reduce", "reduce_scatter"} <= set(calls), calls
        # embeddings + labels + the validation header gathered; max, sums and the backward's coefficients reduced
        assert calls["all_gather"] == 3 and calls["all_reduce"] == 3 and calls["reduce_scatter"] == 1
        assert res["counted"]["bytes"]["reduce_scatter"] == sum(SIZES[WORLD]) * 6 * 8  # [B, D] float64
