"""insightface's verification protocol, reproduced number for number.

insightface (``recognition/arcface_torch/eval/verification.py``, after FaceNet's LFW helper) scores
a pair by the squared Euclidean distance of the L2-normalised embeddings and predicts "same" when
``distance < threshold``. Its figures depend on choices that the exact protocol of
:mod:`shardfc.evaluation.verification` does not make, so they are reproduced here to give the
numbers its logs give on the same embeddings:

* accuracy: 10 contiguous folds (``KFold(10)`` without shuffle); on the nine training folds every
  threshold of the grid ``np.arange(0, 4, 0.01)`` is tried and ``np.argmax`` keeps the *first*
  (smallest) one of those reaching the best training accuracy; that threshold is applied to the
  held-out fold;
* TAR@FAR ("VAL"): per fold, the FAR of every threshold of ``np.arange(0, 4, 0.001)`` on the
  training folds; if the largest reaches the target, the threshold is interpolated linearly from
  (FAR, threshold) with ``scipy.interpolate.interp1d(kind="slinear")``, else it is 0; TAR and FAR
  of that threshold on the held-out fold are averaged over folds. The FAR curve has runs of equal
  values; the scipy versions insightface ran on evaluated it as a degree-1 B-spline with those
  duplicate knots (newer scipy refuses duplicates), which :func:`slinear_with_duplicates`
  reproduces: between the *last* point at or below the target and the point after it.

:func:`insightface_metrics` reports a TAR@FAR only where the set has at least ``1/FAR`` negative
pairs (the rule of both protocols, :func:`shardfc.evaluation.verification.far_measurable`); below
that insightface prints a number (on 500 negatives its FAR=1e-4 figure is its FAR=1e-3 one) that
measures nothing, and the metric is NaN here. :func:`insightface_val_far` itself stays insightface's
arithmetic, number for number.

Counting ``distance < threshold`` on sorted distances with ``searchsorted`` gives the same
integer counts as insightface's loop over thresholds, hence bit-identical accuracies and ties.
"""

from __future__ import annotations

import math
from typing import Dict, List, Tuple

import numpy as np

from shardfc.evaluation.far import far_measurable
from shardfc.evaluation.folds import NFOLDS, kfold_indices

__all__ = [
    "ACCURACY_THRESHOLDS",
    "VAL_THRESHOLDS",
    "normalized_squared_distances",
    "insightface_accuracy",
    "insightface_val_far",
    "slinear_with_duplicates",
    "insightface_metrics",
]

ACCURACY_THRESHOLDS = np.arange(0, 4, 0.01)
VAL_THRESHOLDS = np.arange(0, 4, 0.001)


def normalized_squared_distances(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """``sum((a/|a| - b/|b|)**2)`` per row, in float64; a zero row stays zero (as sklearn's normalize)."""
    a = np.asarray(a, dtype=np.float64)
    b = np.asarray(b, dtype=np.float64)

    def unit(x: np.ndarray) -> np.ndarray:
        norm = np.linalg.norm(x, axis=1, keepdims=True)
        return x / np.where(norm == 0, 1.0, norm)

    return np.sum(np.square(unit(a) - unit(b)), axis=1)


def _count_below(sorted_values: np.ndarray, thresholds: np.ndarray) -> np.ndarray:
    """How many values are ``< t`` for each threshold ``t`` (values sorted ascending)."""
    return np.searchsorted(sorted_values, thresholds, side="left")


def insightface_accuracy(
    dist: np.ndarray, issame: np.ndarray, nfolds: int = NFOLDS, thresholds: np.ndarray = ACCURACY_THRESHOLDS
) -> Tuple[np.ndarray, np.ndarray]:
    """Per-fold held-out accuracies and the threshold chosen on each fold's training pairs."""
    accs: List[float] = []
    chosen: List[float] = []
    for train, test in kfold_indices(len(dist), nfolds):
        d, y = dist[train], issame[train]
        true_accepts = _count_below(np.sort(d[y]), thresholds)
        true_rejects = int((~y).sum()) - _count_below(np.sort(d[~y]), thresholds)
        train_acc = (true_accepts + true_rejects) / d.size
        best = thresholds[int(np.argmax(train_acc))]  # argmax: the first of tied maxima
        chosen.append(float(best))
        predicted_same = dist[test] < best
        accs.append(float(np.sum(predicted_same == issame[test])) / test.size)
    return np.asarray(accs), np.asarray(chosen)


def slinear_with_duplicates(x: np.ndarray, y: np.ndarray, xp: float) -> float:
    """``interp1d(x, y, kind="slinear")(xp)`` as old scipy computed it for non-decreasing ``x``
    with repeated values: a degree-1 B-spline with knots ``[x0, x..., x_last]`` and coefficients
    ``y``. Inside the range, it interpolates between the last point with ``x <= xp`` and the next
    one; at ``xp == x[-1]`` it uses the last segment, and when that segment has zero length
    (the maximum repeated) scipy's evaluation returned 0, which is kept."""
    m = len(x)
    if m < 2 or not x[0] <= xp <= x[-1]:
        raise ValueError(f"xp={float(xp)!r} is outside the interpolation range [{float(x[0])!r}, {float(x[-1])!r}]")
    i = min(int(np.searchsorted(x, xp, side="right")) - 1, m - 2)
    span = x[i + 1] - x[i]
    if span == 0:
        return 0.0
    return float(y[i] + (y[i + 1] - y[i]) * ((xp - x[i]) / span))


def insightface_val_far(
    dist: np.ndarray,
    issame: np.ndarray,
    far_target: float,
    nfolds: int = NFOLDS,
    thresholds: np.ndarray = VAL_THRESHOLDS,
) -> Tuple[float, float, float]:
    """insightface's ``calculate_val``: ``(mean TAR, std of TAR, mean FAR)`` over the folds.

    A fold without positive (or negative) held-out pairs, where insightface divides by zero,
    gives NaN; so does a fold without negative training pairs.
    """
    vals: List[float] = []
    fars: List[float] = []
    for train, test in kfold_indices(len(dist), nfolds):
        neg_train = np.sort(dist[train][~issame[train]])
        if neg_train.size == 0:
            vals.append(math.nan)
            fars.append(math.nan)
            continue
        far_train = _count_below(neg_train, thresholds) / neg_train.size
        if far_train.max() >= far_target:
            threshold = slinear_with_duplicates(far_train, thresholds, far_target)
        else:
            threshold = 0.0
        d, y = dist[test], issame[test]
        accepted = d < threshold
        n_same, n_diff = int(y.sum()), int((~y).sum())
        vals.append(float(np.sum(accepted & y)) / n_same if n_same else math.nan)
        fars.append(float(np.sum(accepted & ~y)) / n_diff if n_diff else math.nan)
    return float(np.mean(vals)), float(np.std(vals)), float(np.mean(fars))


def insightface_metrics(
    dist: np.ndarray, issame: np.ndarray, nfolds: int, far_key_targets: List[Tuple[str, float]]
) -> Dict[str, float]:
    """The metrics dict entries of insightface's protocol (see :func:`verification_metrics`); a
    TAR@FAR the set has fewer than ``1/far`` negative pairs for is NaN, with its std and FAR."""
    accs, chosen = insightface_accuracy(dist, issame, nfolds)
    out = {
        "accuracy": float(np.mean(accs)),
        "accuracy_std": float(np.std(accs)),
        "best_distance_threshold": float(np.mean(chosen)),
    }
    negatives = int(np.count_nonzero(~np.asarray(issame, dtype=bool)))
    for key, far in far_key_targets:
        if far_measurable(negatives, far):
            val, val_std, far_mean = insightface_val_far(dist, issame, far, nfolds)
        else:
            val = val_std = far_mean = math.nan
        out[f"tar@far={key}"] = val
        out[f"tar_std@far={key}"] = val_std
        out[f"far@far={key}"] = far_mean
    return out
