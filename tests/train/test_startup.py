"""Start-up of a synthetic run: nothing built per identity, the verification pairs rendered at the
first evaluation (and kept), so the time to the first batch does not grow with the identities."""

from __future__ import annotations

import time

import torch

from shardfc.parallel.context import DistContext
from shardfc.train.config import TrainConfig
from shardfc.train.loader.data import micro_batches, rank_batches, train_dataset
from shardfc.train.observe.evaluate import build_targets
from shardfc.train.state import RunState


def _startup_s(identities: int, tmp_path) -> float:
    """Dataset, sampler, evaluation targets and the first batch of a synthetic run (what grows with C
    legitimately, the head's rows, is not in it)."""
    start = time.perf_counter()
    cfg = TrainConfig(synthetic_identities=identities, image_size=[32, 32], batch_size=64, synthetic_val_pairs=1000,
                      output_dir=str(tmp_path))
    ctx = DistContext()
    dataset = train_dataset(cfg, (32, 32))
    batches = rank_batches(cfg, dataset, 64, ctx)
    build_targets(cfg, (32, 32), torch.device("cpu"))
    stream = micro_batches(dataset, batches, RunState(), cfg, ctx)
    images, labels, _ = next(stream)
    assert images.shape == (64, 3, 32, 32) and int(labels.max()) < identities
    stream.close()
    return time.perf_counter() - start


def test_synthetic_startup_does_not_grow_with_the_identities(tmp_path):
    _startup_s(1000, tmp_path)  # imports and first-call costs out of the comparison
    small = min(_startup_s(1000, tmp_path) for _ in range(2))
    large = _startup_s(100_000, tmp_path)  # 2M images
    # A generous bound (a shared 2-core box): 100x the identities may cost a few times, never 100x.
    assert large < 4 * small + 1.0, f"start-up {large:.2f} s at 100k identities vs {small:.2f} s at 1k"


def test_synthetic_pairs_are_rendered_at_the_first_evaluation_and_kept(tmp_path):
    cfg = TrainConfig(synthetic_identities=10, image_size=[16, 16], synthetic_val_pairs=20, eval_batch_size=16,
                      eval_flip=False, output_dir=str(tmp_path))
    (target,) = build_targets(cfg, (16, 16), torch.device("cpu"))
    pairs = target.evaluate.__defaults__[0]
    assert not pairs.rendered  # start-up rendered nothing
    model = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(3 * 16 * 16, 8))
    first = target.evaluate(model)
    assert pairs.rendered and 0.0 <= first["accuracy"] <= 1.0
    kept = pairs.get()
    assert target.evaluate(model) == first and pairs.get() is kept  # the same tensors, not rendered again
    expected = train_dataset(cfg, (16, 16)).verification_pairs(20, seed=cfg.seed + 1, unseen_identities=True)
    assert all(torch.equal(a, b) for a, b in zip(kept, expected))
