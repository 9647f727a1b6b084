"""``shardfc.evaluation.finite``: embeddings holding NaN or inf are refused, naming where, before any
metric turns them into a number (verification accuracy 50%, an arbitrary re-ID order)."""

from __future__ import annotations

import re

import numpy as np
import pytest
import torch
from torch import nn

from shardfc.evaluation import reid_metrics, verification_metrics
from shardfc.evaluation.finite import NonFiniteEmbeddings, check_finite


def _refused(fn, *args, **kwargs) -> str:
    with pytest.raises(NonFiniteEmbeddings) as err:
        fn(*args, **kwargs)
    assert isinstance(err.value, ValueError)  # every caller that reports a ValueError reports it
    return str(err.value)


TAIL = "the model's outputs overflowed or diverged, and no metric of them means anything"


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_check_finite_names_the_rows_and_the_first(bad):
    x = torch.zeros(5, 3)
    x[3, 2], x[1, 0] = bad, bad
    expected = f"emb holds NaN or inf in 2 of 5 rows (the first: row 1): {TAIL}"
    assert _refused(check_finite, "emb", x) == expected
    assert _refused(check_finite, "emb", x.double().numpy()) == expected  # an array as a tensor
    assert _refused(check_finite, "emb", x.numpy().astype(np.float16)) == expected  # any float width
    assert _refused(check_finite, "emb", x.bfloat16()) == expected
    if bad != bad:  # (NaN) a tensor that requires grad is read detached
        assert _refused(check_finite, "emb", x.requires_grad_()) == expected
    check_finite("emb", torch.zeros(5, 3))
    check_finite("emb", np.zeros((0, 4)))  # nothing to check
    check_finite("emb", np.arange(6).reshape(2, 3))  # integers are finite
    check_finite("emb", torch.full((2, 3), 3.0e38))  # large but finite


def test_verification_refuses_either_side_before_any_metric():
    a, b, same = torch.randn(20, 4), torch.randn(20, 4), np.arange(20) % 2 == 0
    b[7, 1] = float("nan")  # was: accuracy 50%, a number like any other
    assert _refused(verification_metrics, a, b, same) == f"embeddings_b holds NaN or inf in 1 of 20 rows (the first: row 7): {TAIL}"
    assert _refused(verification_metrics, b, a, same).startswith("embeddings_a holds NaN or inf in 1 of 20 rows")
    assert verification_metrics(a, a.clone(), same)["num_pairs"] == 20


def test_reid_refuses_the_query_or_the_gallery():
    q, g = torch.randn(3, 4), torch.randn(5, 4)
    pids, cams = [1, 2, 3], [0, 0, 0]
    gp, gc = [1, 2, 3, 1, 2], [1, 1, 1, 1, 1]
    g[4] = float("inf")
    assert _refused(reid_metrics, q, pids, cams, g, gp, gc) == f"gallery_feats holds NaN or inf in 1 of 5 rows (the first: row 4): {TAIL}"
    assert _refused(reid_metrics, g[2:], pids, cams, q.repeat(2, 1)[:5], gp, gc).startswith(
        "query_feats holds NaN or inf in 1 of 3 rows (the first: row 2)")


def test_ijb_refuses_its_face_features(monkeypatch):
    from shardfc.evaluation import ijb

    # the faces' features as a backbone that overflowed on the second face (fp16 past 65,504, say) gives them
    monkeypatch.setattr(ijb, "embed_ijb_faces", lambda *a, **k: np.array([[1.0, 0.0], [np.nan, 1.0], [0.0, 1.0]]))
    meta = object()  # not read before the features are refused
    message = _refused(ijb.evaluate_ijb, nn.Identity(), "root", "IJBB", meta=meta)
    assert message == f"IJBB's face features holds NaN or inf in 1 of 3 rows (the first: row 1): {TAIL}"


def test_each_target_names_itself_and_training_skips_it(caplog):
    from shardfc.train.observe.evaluate import EvalTarget, run_targets

    def fine(model):
        return {"accuracy": 1.0}

    def overflowing(model):
        check_finite("embeddings_a", torch.tensor([[float("nan")]]))

    targets = [EvalTarget("lfw", "", fine), EvalTarget("agedb_30", "", overflowing), EvalTarget("cfp_fp", "", fine)]
    with pytest.raises(NonFiniteEmbeddings, match="^" + re.escape("agedb_30: embeddings_a holds NaN or inf in 1 of 1 rows")):
        run_targets(targets, None)  # shardfc eval: its error, naming the target
    with caplog.at_level("WARNING", logger="shardfc.train"):
        assert run_targets(targets, None, skip_non_finite=True) == {"lfw": {"accuracy": 1.0}, "cfp_fp": {"accuracy": 1.0}}
    assert [r.getMessage() for r in caplog.records] == [
        f"agedb_30 not evaluated: embeddings_a holds NaN or inf in 1 of 1 rows (the first: row 0): {TAIL}"]
