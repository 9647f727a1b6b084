"""When a head's input errors surface: ``validate="immediate"`` in the bad call, ``"deferred"`` (the
default on CUDA) at the next forward or ``check_pending()``, naming the same row and value and which
call's batch it was; types and shapes always at once. (Process-group mode, where the values travel
with the batch-size exchange and every rank raises at once: tests/head/test_module_distributed.py.)"""

from __future__ import annotations

import re

import pytest
import torch

import shardfc
from shardfc.head.validation import VALIDATE_MODES, defers

C, D = 20, 6
GOOD_X, GOOD_Y = torch.randn(5, D), torch.tensor([0, 4, -1, C - 1, 7])


def _nan_row(row=3):
    x = GOOD_X.clone()
    x[row, 2] = float("nan")
    return x


BAD_VALUES = {
    "label_too_large": (GOOD_X, torch.tensor([0, 4, -1, C, 7]), f"labels[3] = {C} is outside [0, num_classes={C})"),
    "negative_label": (GOOD_X, torch.tensor([0, -3, -1, 2, 7]), "labels[1] = -3 is outside"),
    "non_finite": (_nan_row(), GOOD_Y, "embeddings contain non-finite values (row 3"),
    "infinite": (torch.full((5, D), float("inf")), GOOD_Y, "embeddings contain non-finite values (row 0"),
}


@pytest.mark.parametrize("case", list(BAD_VALUES))
@pytest.mark.parametrize("options", [{}, dict(devices=["cpu", "cpu"]), dict(reduction="none"),
                                     dict(sample_rate=0.5, sparse_grad=True)], ids=["single", "devices", "none", "pfc"])
def test_deferred_errors_surface_at_the_next_forward(case, options):
    x, y, text = BAD_VALUES[case]
    head = shardfc.ShardedMarginHead(D, C, validate="deferred", **options)
    head(GOOD_X, GOOD_Y)  # call 1
    loss = head(x.clone().requires_grad_(), y)  # call 2: runs (nothing read back), no error yet
    loss.backward(torch.ones_like(loss) if loss.dim() else None)  # a bad label or value crashes nothing
    with pytest.raises(ValueError, match=re.escape(text)) as err:
        head(GOOD_X, GOOD_Y)  # call 3 reads call 2's checks first
    assert "forward call 2" in str(err.value) and "validate='deferred'" in str(err.value)
    head(GOOD_X, GOOD_Y)  # reported once; the head goes on
    head.check_pending()


@pytest.mark.parametrize("case", list(BAD_VALUES))
def test_immediate_errors_surface_in_the_bad_call(case):
    x, y, text = BAD_VALUES[case]
    head = shardfc.ShardedMarginHead(D, C, validate="immediate")
    with pytest.raises(ValueError, match=re.escape(text)) as err:
        head(x, y)
    assert "deferred" not in str(err.value)


def test_auto_is_immediate_on_the_cpu():
    head = shardfc.ShardedMarginHead(D, C)
    assert head.validate == "auto"
    x, y, text = BAD_VALUES["label_too_large"]
    with pytest.raises(ValueError, match=re.escape(text)):
        head(x, y)


def test_defers_where():
    cpu, cuda, meta = torch.device("cpu"), torch.device("cuda", 0), torch.device("meta")
    assert defers("auto", cuda, False) and not defers("auto", cpu, False) and not defers("auto", meta, False)
    assert defers("deferred", cpu, False) and not defers("immediate", cuda, False)
    for mode in VALIDATE_MODES:  # process-group mode: with the exchange, at once
        assert not defers(mode, cuda, True)


def test_check_pending_flushes_the_last_batch():
    """A run's last batch has no next forward: check_pending() (the trainer calls it at the end and
    before each checkpoint) reports it; sharded_state() calls it too."""
    x, y, text = BAD_VALUES["non_finite"]
    head = shardfc.ShardedMarginHead(D, C, validate="deferred")
    head(x, y)
    with pytest.raises(ValueError, match=re.escape(text)):
        head.check_pending()
    head.check_pending()  # nothing left
    head(x, y)
    with pytest.raises(ValueError, match=re.escape(text)):
        head.sharded_state()
    head.sharded_state()


def test_the_next_forward_reads_it_in_eval_and_no_grad_too():
    x, y, text = BAD_VALUES["label_too_large"]
    head = shardfc.ShardedMarginHead(D, C, validate="deferred")
    head(x, y)
    with torch.no_grad(), pytest.raises(ValueError, match=re.escape(text)):
        head.eval()(GOOD_X, GOOD_Y)


def test_ignore_index_and_empty_batches_are_not_errors():
    head = shardfc.ShardedMarginHead(D, C, validate="deferred", ignore_index=-100)
    head(GOOD_X, torch.tensor([0, -100, 3, -100, 19]))
    head(GOOD_X[:0], GOOD_Y[:0])
    head(GOOD_X, torch.full((5,), -100))
    head.check_pending()


def test_host_checks_stay_immediate():
    head = shardfc.ShardedMarginHead(D, C, validate="deferred")
    with pytest.raises(TypeError, match="labels must be an integer tensor"):
        head(GOOD_X, GOOD_Y.float())
    with pytest.raises(ValueError, match="labels has 4 entries but embeddings has 5 rows"):
        head(GOOD_X, GOOD_Y[:4])
    with pytest.raises(ValueError, match=f"width {D + 1} but the head's embedding_dim is {D}"):
        head(torch.randn(5, D + 1), GOOD_Y)


def test_a_pending_error_comes_before_the_next_calls_own():
    head = shardfc.ShardedMarginHead(D, C, validate="deferred")
    head(*BAD_VALUES["negative_label"][:2])
    with pytest.raises(ValueError, match=re.escape("labels[1] = -3")):
        head(GOOD_X, GOOD_Y.float())  # its own TypeError waits: the earlier batch is reported first
    with pytest.raises(TypeError):
        head(GOOD_X, GOOD_Y.float())


def test_inputs_changed_in_place_are_not_described_with_their_new_values():
    """The check keeps references, not copies: a tensor written in place since is noticed, and the
    error says which check failed without naming a row it can no longer see."""
    x = _nan_row()
    head = shardfc.ShardedMarginHead(D, C, validate="deferred")
    head(x, GOOD_Y)
    x.zero_()
    with pytest.raises(ValueError, match="embeddings contain non-finite values .the tensor was changed in place"):
        head.check_pending()


def test_bad_validate_argument():
    with pytest.raises(ValueError, match=re.escape("validate must be one of ('auto', 'immediate', 'deferred'), got 'late'")):
        shardfc.ShardedMarginHead(D, C, validate="late")
