"""Cross-validation folds of the verification protocols."""

from __future__ import annotations

from typing import List, Tuple

import numpy as np

__all__ = ["NFOLDS", "kfold_indices"]

#: The folds of the verification protocols (insightface's 10-fold LFW protocol): a set of fewer pairs
#: cannot be evaluated.
NFOLDS = 10


def kfold_indices(n: int, nfolds: int) -> List[Tuple[np.ndarray, np.ndarray]]:
    """Contiguous, unshuffled folds like ``sklearn.model_selection.KFold(nfolds)``:
    the first ``n % nfolds`` folds hold one extra element. Returns a list of
    ``(train_idx, test_idx)`` index arrays."""
    if nfolds < 2:
        raise ValueError(f"nfolds must be >= 2, got {nfolds!r}")
    if n < nfolds:
        raise ValueError(f"cannot split {n} pairs into nfolds={nfolds} folds")
    sizes = np.full(nfolds, n // nfolds)
    sizes[: n % nfolds] += 1
    bounds = np.concatenate([[0], np.cumsum(sizes)])
    idx = np.arange(n)
    return [
        (np.concatenate([idx[: bounds[k]], idx[bounds[k + 1] :]]), idx[bounds[k] : bounds[k + 1]])
        for k in range(nfolds)
    ]
