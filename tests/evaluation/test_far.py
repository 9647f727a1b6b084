"""When a TAR@FAR is a measurement (``far_measurable``) and the words for a missing value (``why_undefined``)."""

import math

import pytest

from shardfc.evaluation.far import far_measurable, why_undefined


@pytest.mark.parametrize("negatives, far, measurable", [
    (1000, 1e-3, True),  # 1e-3 * 1000 is 1 up to the decimal's rounding
    (999, 1e-3, False),
    (10_000, 1e-4, True),
    (9_999, 1e-4, False),
    (3, 0.34, True),
    (2, 0.34, False),
    (0, 0.5, False),
    (0, math.inf, False),
    (1, 1 - 1e-12, True),
])
def test_one_over_far_negatives_measure_a_far(negatives, far, measurable):
    assert far_measurable(negatives, far) is measurable


def test_why_a_tar_at_far_is_missing():
    few = {"num_pairs": 700.0, "num_negative_pairs": 600.0}
    assert why_undefined("tar@far=1e-3", few) == "FAR 1e-3 needs at least 1000 negative pairs, this set has 600"
    fifty = {"num_pairs": 100.0, "num_negative_pairs": 50.0}
    assert why_undefined("exact_tar@far=1.5e-2", fifty) == "FAR 1.5e-2 needs at least 67 negative pairs, this set has 50"
    # no count, or one that is not a number: the need alone
    for values in ({}, {"num_negative_pairs": math.nan}, {"num_negative_pairs": math.inf}):
        assert why_undefined("tar@far=1e-4", values) == "FAR 1e-4 needs at least 10000 negative pairs"
    # enough negatives but no positives: no true-accept rate
    only_negatives = {"num_pairs": 2000.0, "num_negative_pairs": 2000.0}
    assert why_undefined("tar@far=1e-3", only_negatives) == "no positive pairs: there is no true-accept rate"


@pytest.mark.parametrize("name, values", [
    ("tar@far=1e-3", {"num_pairs": 3000.0, "num_negative_pairs": 2000.0}),  # measurable: something else
    ("tar@far=1e-3", {"num_negative_pairs": 2000.0}),  # and the pair count unknown
    ("tar@far=abc", {"num_negative_pairs": 10.0}),  # not a FAR
    ("tar@far=0", {"num_negative_pairs": 10.0}),
    ("accuracy", {"num_pairs": 0.0, "num_negative_pairs": 0.0}),  # not a TAR@FAR at all
])
def test_otherwise_not_defined_for_the_data(name, values):
    assert why_undefined(name, values) == "not defined for this data"
