"""The P x K identity sampler: batch structure, rank slices, determinism, resume, errors."""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest

from shardfc.train.config import ConfigError
from shardfc.train.loader.identity_sampler import IdentityBatches, dataset_labels

K = 4


def _labels(seed: int = 0) -> np.ndarray:
    """40 identities with 1 to 23 images each (several below K), shuffled so indices are not grouped."""
    rng = np.random.default_rng(seed)
    counts = [1, 2, 3, 23] + list(rng.integers(1, 15, size=36))
    labels = np.repeat(np.arange(len(counts)) * 3 + 5, counts)  # sparse, non-contiguous class ids
    return labels[rng.permutation(len(labels))]


def _epoch(labels, batch_size, world, epoch, seed=7, start=0):
    """Each rank's batches of one epoch, from samplers built independently per rank."""
    per_rank = []
    for rank in range(world):
        s = IdentityBatches(labels, batch_size, K, rank, world, seed)
        s.set_epoch(epoch, start)
        batches = list(s)
        assert len(batches) == len(s)
        per_rank.append(batches)
    return per_rank


@pytest.mark.parametrize("batch_size,world", [(16, 1), (8, 2), (4, 3), (6, 2), (10, 2)])
def test_global_batches_are_p_identities_times_k_images(batch_size, world):
    labels = _labels()
    count = Counter(labels.tolist())
    p = batch_size * world // K
    for epoch in (0, 1):
        per_rank = _epoch(labels, batch_size, world, epoch)
        assert len({len(b) for b in per_rank}) == 1  # every rank has the same number of batches
        used = Counter()
        for step in zip(*per_rank):
            assert all(len(part) == batch_size for part in step)
            glob = [i for part in step for i in part]
            ids = Counter(labels[glob].tolist())
            # every identity's K images are in this one global batch, P identities in all
            assert len(ids) == p and set(ids.values()) == {K}, ids
            # an identity with K images or more never repeats an image inside the batch
            for ident in ids:
                images = [i for i in glob if labels[i] == ident]
                if count[ident] >= K:
                    assert len(set(images)) == K
                else:  # fewer than K: all its images, topped up with repeats
                    assert set(images) == set(np.flatnonzero(labels == ident).tolist())
            used.update(glob)
            if batch_size % K == 0:  # whole identities per rank: the rank slices are disjoint sets
                sets = [set(part) for part in step]
                assert sum(len(s) for s in sets) == len(set().union(*sets))
        # over the epoch, no image of an identity with >= K images is used twice
        assert all(n == 1 for i, n in used.items() if count[labels[i]] >= K)


def test_deterministic_per_seed_and_epoch_and_resumable():
    labels = _labels()
    a = _epoch(labels, 8, 2, epoch=3)
    assert a == _epoch(labels, 8, 2, epoch=3)
    assert a != _epoch(labels, 8, 2, epoch=4)
    assert a != _epoch(labels, 8, 2, epoch=3, seed=8)
    resumed = _epoch(labels, 8, 2, epoch=3, start=5)
    assert resumed == [batches[5:] for batches in a]


def test_epoch_length_is_fixed_and_uses_the_data():
    labels = _labels()
    s = IdentityBatches(labels, 8, K, 0, 2, seed=1)
    chunks = sum(max(n // K, 1) for n in Counter(labels.tolist()).values())
    assert len(s) == chunks // (16 // K)
    for epoch in range(5):
        s.set_epoch(epoch)
        assert len(list(s)) == len(s)


def test_dominant_identity_is_capped_not_stranded():
    # One identity with 200 images, 5 with 4: at most one chunk of each identity per batch.
    labels = np.repeat(np.arange(6), [200, 4, 4, 4, 4, 4])
    s = IdentityBatches(labels, 8, K, 0, 1, seed=0)
    batches = list(s)
    assert len(batches) == len(s) == 5  # 5 batches: the big identity pairs with each small one once
    for b in batches:
        assert sorted(Counter(labels[b].tolist()).values()) == [K, K]


def test_errors_name_the_values():
    labels = _labels()
    with pytest.raises(ConfigError, match=r"batch_size=6 x 1 rank\(s\) = 6.*pk_instances=4"):
        IdentityBatches(labels, 6, K, 0, 1, seed=0)
    with pytest.raises(ConfigError, match="needs at least 50 identities; the dataset has 40"):
        IdentityBatches(labels, 100, K, 0, 2, seed=0)


def test_dataset_labels_of_the_synthetic_set():
    from shardfc.data import SyntheticIdentities

    ds = SyntheticIdentities(5, 3, (8, 8), seed=0)
    assert dataset_labels(ds).tolist() == [ds[i][1] for i in range(len(ds))]


def test_a_new_sampler_is_epoch_0_from_its_start_and_set_epoch_starts_at_0_by_default():
    labels = _labels()
    fresh = IdentityBatches(labels, 8, K, 1, 2, seed=7)
    assert len(fresh) == fresh.num_batches and list(fresh) == _epoch(labels, 8, 2, epoch=0)[1]
    fresh.set_epoch(3, 5)
    assert len(fresh) == fresh.num_batches - 5
    fresh.set_epoch(4)  # a new epoch: from its first batch, not where the last resume began
    assert len(fresh) == fresh.num_batches and list(fresh) == _epoch(labels, 8, 2, epoch=4)[1]


def test_exactly_as_many_identities_as_a_batch_needs_is_enough():
    labels = np.repeat(np.arange(4), [4, 5, 8, 4])  # P = 16 / K = 4 identities, no more
    s = IdentityBatches(labels, 16, K, 0, 1, seed=0)
    [batch] = list(s)  # 5 chunks fill one batch of 4: the third identity's second sits out
    assert len(s) == 1 and sorted(Counter(labels[batch].tolist()).values()) == [K] * 4
