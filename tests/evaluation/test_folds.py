"""The contiguous folds of both verification protocols (``KFold(nfolds)`` without shuffling)."""

import numpy as np
import pytest

from shardfc.evaluation.folds import kfold_indices


@pytest.mark.parametrize("n, nfolds", [(2, 2), (10, 10), (23, 10), (7, 3), (600, 10)])
def test_folds_cover_every_index_once_in_order(n, nfolds):
    folds = kfold_indices(n, nfolds)
    sizes = [len(test) for _, test in folds]
    assert sizes == [n // nfolds + (k < n % nfolds) for k in range(nfolds)]
    assert np.array_equal(np.concatenate([test for _, test in folds]), np.arange(n))
    for train, test in folds:
        assert train.dtype.kind == test.dtype.kind == "i"
        assert np.array_equal(np.sort(np.concatenate([train, test])), np.arange(n))
        assert not np.isin(train, test).any()


@pytest.mark.parametrize("n, nfolds, message", [
    (10, 1, r"^nfolds must be >= 2, got 1$"),
    (10, 0, r"^nfolds must be >= 2, got 0$"),
    (9, 10, r"^cannot split 9 pairs into nfolds=10 folds$"),
])
def test_too_few_folds_or_pairs(n, nfolds, message):
    with pytest.raises(ValueError, match=message):
        kfold_indices(n, nfolds)
