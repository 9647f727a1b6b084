"""When a head's input errors surface: ``validate="immediate"`` in the bad call, ``"deferred"`` (the
default on CUDA) at the next forward or ``check_pending()``, naming the same row and value and which
call's batch it was; types and shapes always at once. (Process-group mode, where the values travel
with the batch-size exchange and every rank raises at once: tests/head/test_module_distributed.py.)"""

from __future__ import annotations

import re

import pytest
import torch

import shardfc
from shardfc.head.validation import (
    VALIDATE_MODES,
    HeadOptions,
    NonFiniteEmbeddingsError,
    check_batch_deferred,
    check_head_options,
    defers,
)
from shardfc.parallel.context import DistContext

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
    assert isinstance(err.value, NonFiniteEmbeddingsError) == (case in ("non_finite", "infinite"))
    head(GOOD_X, GOOD_Y)  # reported once; the head goes on
    head.check_pending()


@pytest.mark.parametrize("case", list(BAD_VALUES))
def test_immediate_errors_surface_in_the_bad_call(case):
    x, y, text = BAD_VALUES[case]
    head = shardfc.ShardedMarginHead(D, C, validate="immediate")
    with pytest.raises(ValueError, match=re.escape(text)) as err:
        head(x, y)
    assert "deferred" not in str(err.value)
    assert isinstance(err.value, NonFiniteEmbeddingsError) == (case in ("non_finite", "infinite"))


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
    with pytest.raises(NonFiniteEmbeddingsError) as err:
        head.check_pending()
    assert str(err.value) == (
        "embeddings contain non-finite values (the tensor was changed in place since, so not which row) [the batch of "
        "forward call 1, read after that call: validate='deferred' reports the value checks at the next forward or "
        "check_pending(); see docs/head.md]")
    y = GOOD_Y.clone()
    y[0] = C
    head(GOOD_X, y)
    y.zero_()
    with pytest.raises(ValueError, match="labels hold a value outside .0, num_classes=20. that is not") as err:
        head.check_pending()
    assert not isinstance(err.value, NonFiniteEmbeddingsError)


def test_bad_validate_argument():
    with pytest.raises(ValueError, match=re.escape("validate must be one of ('auto', 'immediate', 'deferred'), got 'late'")):
        shardfc.ShardedMarginHead(D, C, validate="late")


# ---- the options that constrain each other (check_head_options: the head, the trainer's config, plan)


def test_the_options_default_and_their_closed_ends_are_taken():
    assert check_head_options() == HeadOptions(1.0, False, 1, 0.0, None)
    assert check_head_options(label_smoothing=0.999, sample_rate=1) == HeadOptions(1.0, False, 1, 0.999, None)
    assert check_head_options(sample_rate=0.5, sparse_grad=True, subcenters=255, interclass_filter_threshold=1) == \
        HeadOptions(0.5, True, 255, 0.0, 1.0)
    assert check_head_options(label_smoothing=0.0, interclass_filter_threshold=0.25).interclass_filter_threshold == 0.25


@pytest.mark.parametrize("options, kind, message", [
    (dict(label_smoothing=1.5), ValueError, "label_smoothing must be in [0, 1), got 1.5"),
    (dict(label_smoothing=1), ValueError, "label_smoothing must be in [0, 1), got 1"),  # ignores the labels
    (dict(sample_rate=0), ValueError, "sample_rate must be in (0, 1], got 0"),
    (dict(sparse_grad=1), TypeError, "sparse_grad must be True or False, got 1"),
    (dict(sparse_grad=True), ValueError, "sparse_grad needs Partial FC (sample_rate < 1), got sample_rate=1.0"),
    (dict(sparse_grad=True, sample_rate=1), ValueError, "sparse_grad needs Partial FC (sample_rate < 1), got sample_rate=1"),
    (dict(subcenters=0), ValueError, "subcenters must be a positive integer, got 0"),
    (dict(subcenters=256), ValueError, "subcenters must be <= 255, got 256"),
    (dict(interclass_filter_threshold=0), ValueError, "interclass_filter_threshold must be in (0, 1], got 0"),
    (dict(interclass_filter_threshold=1.5), ValueError, "interclass_filter_threshold must be in (0, 1], got 1.5"),
    (dict(interclass_filter_threshold=0.3, label_smoothing=0.1), ValueError,
     "interclass_filter_threshold=0.3 removes classes from the softmax, so label_smoothing=0.1 (spread over all "
     "classes) is undefined with it; use one"),
])
def test_each_bad_option_is_named_with_its_value(options, kind, message):
    with pytest.raises(kind) as e:
        check_head_options(**options)
    assert str(e.value) == message


def test_a_deferred_check_on_meta_has_nothing_to_report():
    """``shardfc plan`` replays a forward on ``meta``: the deferred check has no values to read."""
    x, y = torch.zeros(3, D, device="meta"), torch.zeros(3, dtype=torch.int64, device="meta")
    sizes, pending = check_batch_deferred(x, y, embedding_dim=D, num_classes=C, ignore_index=-1,
                                          ctx=DistContext(device="meta"), call=1)
    assert sizes == [3] and pending.error() is None


def test_deferred_checks_are_for_one_process():
    with pytest.raises(ValueError) as e:
        check_batch_deferred(GOOD_X, GOOD_Y, embedding_dim=D, num_classes=C, ignore_index=-1,
                             ctx=DistContext(None, 0, 2, True, torch.device("cpu"), None), call=1)
    assert str(e.value) == ("deferred value checks are for one process; process-group mode reads them with the "
                            "exchange")


def test_predict_checks_its_embeddings_too():
    head = shardfc.ShardedMarginHead(D, C)
    with pytest.raises(ValueError) as e:
        head.predict(_nan_row(), k=2)
    assert str(e.value) == (f"embeddings contain non-finite values (row 3: {_nan_row()[3][:4].tolist()}...); "
                            "fix the backbone or skip the batch")
    with pytest.raises(TypeError) as e:
        head.predict([[0.0] * D], k=2)
    assert str(e.value) == "embeddings must be a torch.Tensor, got list"


@pytest.mark.parametrize("validate", ["immediate", "deferred"])
def test_inputs_that_are_not_tensors_are_named(validate):
    head = shardfc.ShardedMarginHead(D, C, validate=validate)
    with pytest.raises(TypeError) as e:
        head([[0.0] * D], GOOD_Y[:1])
    assert str(e.value) == "embeddings must be a torch.Tensor, got list"
    with pytest.raises(TypeError) as e:
        head(GOOD_X, [0, 1, 2, 3, 4])
    assert str(e.value) == "labels must be a torch.Tensor, got list"


def test_a_deferred_check_starts_only_for_values_it_is_asked_for():
    """``values=False`` (a captured step, which checks values itself) or an empty batch: no check."""
    args = dict(embedding_dim=D, num_classes=C, ignore_index=-1, ctx=DistContext(device="cpu"), call=1)
    assert check_batch_deferred(GOOD_X, GOOD_Y, values=False, **args) == ([5], None)
    assert check_batch_deferred(GOOD_X[:0], GOOD_Y[:0], **args) == ([0], None)
    sizes, pending = check_batch_deferred(GOOD_X, GOOD_Y, **args)
    assert sizes == [5] and pending is not None and pending.error() is None


def test_check_device_takes_what_torch_device_takes_and_names_the_argument_otherwise():
    from shardfc.head.validation import check_device

    assert check_device("device", "cpu") == torch.device("cpu")
    assert check_device("device", torch.device("cuda", 1)) == torch.device("cuda:1")
    assert check_device("device", "meta").type == "meta"
    for bad in ("xyz", "cuda:x", "", None, 1.5, [0]):
        with pytest.raises(ValueError) as err:
            check_device("devices[2]", bad)
        assert str(err.value) == f"devices[2] must be a torch device such as 'cpu', 'cuda' or 'cuda:1', got {bad!r}"
