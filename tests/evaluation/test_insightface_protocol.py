"""insightface's verification protocol: grid thresholds, first-of-ties, interpolated TAR@FAR."""

import math

import numpy as np
import pytest
import torch

from shardfc.evaluation.insightface_protocol import (
    insightface_accuracy,
    insightface_val_far,
    normalized_squared_distances,
    slinear_with_duplicates,
)
from shardfc.evaluation.verification import best_threshold, verification_metrics


def _pairs_with_distances(dists):
    """2-D embeddings whose normalised squared distances are ``dists`` (cos = 1 - d/2)."""
    cos = 1 - torch.tensor(dists, dtype=torch.float64) / 2
    a = torch.stack([torch.ones_like(cos), torch.zeros_like(cos)], dim=1) * 2.5  # norm must not matter
    b = torch.stack([cos, torch.sqrt(1 - cos**2)], dim=1)
    return a, b


def _tie_fixture():
    # 20 alternating pairs (10 folds of 2): positives at 0.205, negatives at 1.505, except fold 0:
    # a positive at 0.805 and a negative at 1.005. Folds 1..9 train on data separable anywhere in
    # (0.805, 1.005]: the first grid threshold reaching 100% is 0.81, perfect on their test pair.
    # Fold 0 trains on data separable anywhere in (0.205, 1.505]: insightface keeps the first,
    # 0.21, which rejects the 0.805 positive -> fold accuracy 1/2.
    issame = np.arange(20) % 2 == 0
    dists = np.where(issame, 0.205, 1.505)
    dists[0], dists[1] = 0.805, 1.005
    return dists, issame


def test_first_best_grid_threshold_wins_ties():
    dists, issame = _tie_fixture()
    accs, chosen = insightface_accuracy(dists, issame, nfolds=10)
    assert accs.tolist() == [0.5] + [1.0] * 9
    assert chosen[0] == pytest.approx(0.21) and chosen[1:] == pytest.approx([0.81] * 9)
    # Through the public metric, from embeddings: headline = insightface's, exact protocol beside it
    # (its midpoint split keeps the 0.805 positive: cos 0.5975 > 0.45 + (0.8975 - 0.45) / 2).
    m = verification_metrics(*_pairs_with_distances(dists.tolist()), issame, nfolds=10, far_targets=())
    assert m["accuracy"] == pytest.approx(0.95)
    assert m["accuracy_std"] == pytest.approx(0.15)
    assert m["best_distance_threshold"] == pytest.approx((0.21 + 9 * 0.81) / 10)
    assert m["exact_accuracy"] == 1.0


def _reference_accuracy(dist, issame, nfolds):
    """insightface's loop written out plainly: every grid threshold, strict '>' keeps the first best."""
    n = len(dist)
    sizes = [n // nfolds + (1 if k < n % nfolds else 0) for k in range(nfolds)]
    grid = np.arange(0, 4, 0.01)
    accs, start = [], 0
    for size in sizes:
        test = list(range(start, start + size))
        train = [i for i in range(n) if not start <= i < start + size]
        start += size
        best_t, best_acc = None, -1.0
        for t in grid:
            acc = float(sum((dist[i] < t) == issame[i] for i in train)) / len(train)
            if acc > best_acc:
                best_t, best_acc = t, acc
        accs.append(float(sum((dist[i] < best_t) == issame[i] for i in test)) / len(test))
    return accs


def _reference_val(dist, issame, far_target, nfolds):
    n = len(dist)
    sizes = [n // nfolds + (1 if k < n % nfolds else 0) for k in range(nfolds)]
    grid = np.arange(0, 4, 0.001)
    vals, fars, start = [], [], 0
    for size in sizes:
        test = list(range(start, start + size))
        train = [i for i in range(n) if not start <= i < start + size]
        start += size
        neg = [dist[i] for i in train if not issame[i]]
        far_train = [sum(d < t for d in neg) / len(neg) for t in grid]
        if max(far_train) >= far_target:
            i = max(j for j, f in enumerate(far_train) if f <= far_target)
            i = min(i, len(grid) - 2)
            lo, hi = far_train[i], far_train[i + 1]
            t = grid[i] + (grid[i + 1] - grid[i]) * (far_target - lo) / (hi - lo) if hi > lo else 0.0
        else:
            t = 0.0
        pos_t = [dist[i] for i in test if issame[i]]
        neg_t = [dist[i] for i in test if not issame[i]]
        vals.append(sum(d < t for d in pos_t) / len(pos_t))
        fars.append(sum(d < t for d in neg_t) / len(neg_t))
    return float(np.mean(vals)), float(np.std(vals)), float(np.mean(fars))


@pytest.mark.parametrize("seed", [0, 1])
def test_against_plain_reference(seed):
    rng = np.random.default_rng(seed)
    n = 63  # uneven folds
    issame = np.arange(n) % 3 != 0
    rng.shuffle(issame)
    # Quantised distances make ties between grid thresholds common.
    dist = np.round(np.where(issame, rng.normal(1.0, 0.35, n), rng.normal(1.6, 0.35, n)), 2).clip(0.001, 3.99)
    dist = dist + 0.0025  # off the grid: 'd < t' must not hinge on the last bit of arange
    accs, _ = insightface_accuracy(dist, issame, nfolds=10)
    assert accs.tolist() == _reference_accuracy(dist.tolist(), issame.tolist(), 10)  # bit-identical
    for far in (0.05, 0.2):
        got = insightface_val_far(dist, issame, far, nfolds=10)
        assert got == pytest.approx(_reference_val(dist.tolist(), issame.tolist(), far, 10), abs=1e-12)


def test_hand_computed_val_far():
    # 2 folds of 4: A = [pos 0.9, neg 1.0001, pos 1.5, neg 3.0], B = [pos 0.3, neg 1.0005, pos 0.5, neg 2.0005].
    # Either fold's training negatives give FAR 0 up to grid threshold 1.000 and 0.5 at 1.001, so
    # FAR 0.1 interpolates to 1.000 + 0.001 * 0.1 / 0.5 = 1.0002. On A that accepts 0.9 (pos) and
    # 1.0001 (neg): TAR 1/2, FAR 1/2; on B 0.3 and 0.5: TAR 1, FAR 0.
    dist = np.array([0.9, 1.0001, 1.5, 3.0, 0.3, 1.0005, 0.5, 2.0005])
    issame = np.array([True, False, True, False, True, False, True, False])
    val, val_std, far = insightface_val_far(dist, issame, 0.1, nfolds=2)
    assert (val, val_std, far) == pytest.approx((0.75, 0.25, 0.25))
    # Training negatives that no grid threshold accepts: max FAR 0 < target -> threshold 0, nothing accepted.
    dist[[1, 3, 5, 7]] = 3.9995
    assert insightface_val_far(dist, issame, 0.1, nfolds=2) == (0.0, 0.0, 0.0)


def test_slinear_with_repeated_values():
    # Values as scipy's degree-1 B-spline with knots [x0, x..., x_last] evaluates them: between the
    # last point at or below xp and the next one.
    x = np.array([0, 0, 0.1, 0.1, 0.1, 0.2, 0.2])
    y = np.arange(7.0)
    assert slinear_with_duplicates(x, y, 0.0) == 1.0  # last of the zeros, then towards x=0.1 (y=2)
    assert slinear_with_duplicates(x, y, 0.05) == pytest.approx(1.5)
    assert slinear_with_duplicates(x, y, 0.1) == 4.0
    assert slinear_with_duplicates(x, y, 0.15) == pytest.approx(4.5)
    assert slinear_with_duplicates(x, y, 0.2) == 0.0  # zero-length last segment: scipy returned 0
    assert slinear_with_duplicates(np.array([0, 0, 0.1, 0.2, 0.3]), np.arange(5.0), 0.3) == 4.0
    with pytest.raises(ValueError, match="outside"):
        slinear_with_duplicates(x, y, 0.5)


def test_distances_of_zero_and_scaled_embeddings():
    a = np.array([[3.0, 0.0], [0.0, 0.0]])
    b = np.array([[0.0, 2.0], [1.0, 0.0]])
    assert normalized_squared_distances(a, b).tolist() == [2.0, 1.0]  # a zero row stays zero


def test_best_threshold_between_adjacent_floats_reproduces_its_split():
    # Find two scores one float step apart whose midpoint rounds up onto the upper one.
    lo = 0.5
    while True:
        hi = np.nextafter(lo, 1.0)
        if (lo + hi) / 2 == hi:
            break
        lo = hi
    scores = np.array([lo, hi, lo - 0.25, hi + 0.25])
    issame = np.array([False, True, False, True])
    thr, acc = best_threshold(scores, issame)
    assert acc == 1.0
    assert ((scores > thr) == issame).all()


def test_bad_far_target_is_named():
    a, b = _pairs_with_distances([0.5] * 20)
    with pytest.raises(ValueError, match="far target"):
        verification_metrics(a, b, [True, False] * 10, far_targets=(0.0,))
    assert math.isfinite(verification_metrics(a, b, [True, False] * 10, far_targets=(0.1,))["tar@far=1e-1"])


@pytest.mark.parametrize("negatives, measurable", [(999, False), (1000, True)])
def test_tar_at_far_needs_one_over_far_negatives_in_both_protocols(negatives, measurable):
    # insightface's arithmetic gives a number whatever the count (on few negatives its 1e-4 figure
    # is its 1e-3 one); a FAR of 1e-3 takes at least 1000 negatives, so below that both protocols
    # say "not a measurement" (NaN) and the reason names the counts.
    from shardfc.evaluation.far import why_undefined

    rng = np.random.default_rng(7)
    positives = 200
    issame = np.r_[np.ones(positives, bool), np.zeros(negatives, bool)]
    rng.shuffle(issame)
    dists = np.where(issame, rng.normal(0.9, 0.3, issame.size), rng.normal(1.7, 0.3, issame.size)).clip(0.01, 3.9)
    assert math.isfinite(insightface_val_far(dists, issame, 1e-3)[0])  # the raw protocol: a number
    m = verification_metrics(*_pairs_with_distances(dists.tolist()), issame, far_targets=(1e-3, 1e-4))
    assert m["num_negative_pairs"] == negatives
    for key in ("tar@far=1e-3", "tar_std@far=1e-3", "far@far=1e-3", "exact_tar@far=1e-3",
                "exact_achieved_far@far=1e-3", "exact_threshold@far=1e-3"):
        assert math.isfinite(m[key]) == measurable, key
    if measurable:
        assert m["tar@far=1e-3"] == insightface_val_far(dists, issame, 1e-3)[0]
    else:
        assert why_undefined("tar@far=1e-3", m) == f"FAR 1e-3 needs at least 1000 negative pairs, this set has {negatives}"
    # 1e-4 takes 10000: never measurable here, in either protocol.
    assert all(math.isnan(m[k]) for k in ("tar@far=1e-4", "tar_std@far=1e-4", "far@far=1e-4", "exact_tar@far=1e-4"))
    assert "10000 negative pairs" in why_undefined("exact_tar@far=1e-4", m)


def test_distances_in_float64_whatever_the_input():
    rng = np.random.default_rng(3)
    a32, b32 = rng.normal(size=(50, 7)).astype(np.float32), rng.normal(size=(50, 7)).astype(np.float32)
    got = normalized_squared_distances(a32, b32)
    assert got.dtype == np.float64
    assert np.array_equal(got, normalized_squared_distances(a32.astype(np.float64), b32.astype(np.float64)))


def test_a_distance_on_the_chosen_grid_threshold_is_not_accepted():
    # insightface predicts "same" for distance < threshold. Fold 0 trains on pairs 2, 3 (a positive just
    # below grid threshold 0.50, a negative at 1.5): the first threshold reaching 100% is 0.50, and its
    # held-out positive at exactly 0.50 is "different" (accuracy 1/2). Fold 1 trains on 0, 1 (0.50, 1.5):
    # 0.51, both right. Ten folds by default.
    grid = np.arange(0, 4, 0.01)
    dist = np.array([grid[50], 1.5, grid[49] + 0.005, 1.5])
    issame = np.array([True, False, True, False])
    accs, chosen = insightface_accuracy(dist, issame, nfolds=2)
    assert chosen.tolist() == [grid[50], grid[51]] and accs.tolist() == [0.5, 1.0]
    assert len(insightface_accuracy(np.tile(dist, 5), np.tile(issame, 5))[0]) == 10


def test_val_far_at_the_largest_training_far_and_on_its_threshold():
    # Fold 1's negatives (3.9985, 3.9995) reach a training FAR of 1/2 only at the last grid threshold
    # 3.999: a target of 1/2, the largest FAR, is still interpolated (not 0), and fold 0's held-out
    # positive at exactly that threshold is not accepted (distance < threshold), the one at 2.0 is:
    # TAR 1/2. Fold 0's negatives (3.9995 twice) never reach 1/2: threshold 0, fold 1's TAR 0.
    grid = np.arange(0, 4, 0.001)
    far_train = np.searchsorted(np.array([3.9985, 3.9995]), grid) / 2
    t = slinear_with_duplicates(far_train, grid, 0.5)
    assert t == pytest.approx(3.999)
    dist = np.array([t, 2.0, 3.9995, 3.9995, 1.0, 1.0, 3.9985, 3.9995])
    issame = np.array([True, True, False, False, True, True, False, False])
    assert insightface_val_far(dist, issame, 0.5, nfolds=2) == (0.25, 0.25, 0.0)


def test_val_far_with_one_or_no_training_negative():
    # A fold without a training negative (here the one holding out the only negative) has no
    # threshold: NaN, not an error, and so are the means.
    dist = np.array([0.5, 1.0005, 0.7])
    issame = np.array([True, False, True])
    val, std, far = insightface_val_far(dist, issame, 0.5, nfolds=3)
    assert math.isnan(val) and math.isnan(std) and math.isnan(far)  # fold 1 trains on no negative
    dist = np.array([0.5, 0.6, 1.0005, 3.0])
    issame = np.array([True, True, False, False])
    val, std, far = insightface_val_far(dist, issame, 0.5, nfolds=2)  # each fold trains on one side only
    assert math.isnan(val) and math.isnan(far)
    # One training negative: a FAR of 1/2 is reached (FAR 1 from the first grid threshold above it).
    dist = np.array([0.5, 1.0005, 0.7, 2.5])
    issame = np.array([True, False, True, False])
    # Fold 0 trains on the negative 2.5 alone: t = 2.5005 accepts 0.5 and 1.0005 (TAR 1, FAR 1); fold 1
    # on 1.0005 alone: t = 1.0005 accepts 0.7, not 2.5 (TAR 1, FAR 0).
    assert insightface_val_far(dist, issame, 0.5, nfolds=2) == pytest.approx((1.0, 0.0, 0.5))


def test_slinear_of_two_points_and_its_range_in_the_error():
    x, y = np.array([0.0, 0.2]), np.array([1.0, 3.0])
    assert slinear_with_duplicates(x, y, 0.1) == pytest.approx(2.0)
    assert slinear_with_duplicates(x, y, 0.0) == 1.0
    with pytest.raises(ValueError, match=r"^xp=0\.3 is outside the interpolation range \[0\.0, 0\.2\]$"):
        slinear_with_duplicates(x, y, 0.3)
    with pytest.raises(ValueError, match=r"^xp=0\.5 is outside the interpolation range \[0\.5, 0\.5\]$"):
        slinear_with_duplicates(np.array([0.5]), np.array([1.0]), 0.5)  # one point: no segment


def test_metrics_use_the_folds_they_are_given():
    from shardfc.evaluation.insightface_protocol import insightface_metrics

    rng = np.random.default_rng(5)
    issame = rng.random(40) < 0.5
    dist = np.where(issame, rng.uniform(0.3, 1.6, 40), rng.uniform(1.0, 2.5, 40))
    got = insightface_metrics(dist, issame, 4, [("2e-1", 0.2)])
    accs, chosen = insightface_accuracy(dist, issame, nfolds=4)
    assert got["accuracy"] == np.mean(accs) and got["best_distance_threshold"] == np.mean(chosen)
    assert (got["tar@far=2e-1"], got["tar_std@far=2e-1"], got["far@far=2e-1"]) == insightface_val_far(dist, issame, 0.2, 4)
