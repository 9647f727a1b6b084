"""``head/sharded_state.py``: a head's state as one block of classes, saved and loaded whatever the
sharding. The checkpoint tests reshard whole runs across gloo ranks; these pin the function's own
contract in this process (ranks as threads where a rank's classes must not start at 0)."""

from __future__ import annotations

import pytest
import torch

import shardfc
from shardfc import margins as M
from shardfc.head.sharded_state import _optimizer_key

D, C = 4, 11


def _head(**kw) -> shardfc.ShardedMarginHead:
    torch.manual_seed(0)
    return shardfc.ShardedMarginHead(D, C, margin=M.Softmax(), dtype=torch.float64, **kw)


def test_one_cpu_shard_is_handed_out_without_a_copy_and_two_are_concatenated_in_class_order():
    one = _head()
    state = one.sharded_state()
    assert state["tensors"]["weight"].data_ptr() == one.shard_weights[0].data_ptr()  # as the docstring says
    two = _head(devices=["cpu", "cpu"])
    weight = two.sharded_state()["tensors"]["weight"]
    assert torch.equal(weight, torch.cat([w.detach() for w in two.shard_weights]))
    assert all(weight.data_ptr() != w.data_ptr() for w in two.shard_weights)


def test_a_state_for_other_classes_is_refused_naming_both():
    head = _head()
    state = head.sharded_state()
    with pytest.raises(ValueError) as err:
        _head().load_sharded_state({**state, "class_range": range(0, 6)})
    assert str(err.value) == "sharded state has class_range=range(0, 6), this head has class_range=range(0, 11)"
    with pytest.raises(ValueError) as err:
        _head().load_sharded_state({**state, "num_classes": 12})
    assert str(err.value) == "sharded state has num_classes=12, this head has num_classes=11"


@pytest.mark.parametrize("state, shown", [
    ({}, "keys []"), ({"weight": torch.zeros(C, D)}, "keys ['weight']"),  # the weight not under 'tensors'
    ({"tensors": {"w": torch.zeros(C, D)}, "num_classes": C}, "keys ['num_classes', 'tensors']"),
    ({"tensors": {"weight": [[0.0] * D] * C}}, "keys ['tensors']"), ({"tensors": None}, "keys ['tensors']"),
    ([torch.zeros(C, D)], "a list"), (None, "a NoneType"),
])
def test_a_state_that_is_no_sharded_state_is_refused_saying_what_it_holds(state, shown):
    head = _head()
    before = head.weight.detach().clone()
    with pytest.raises(ValueError) as err:  # a KeyError 'tensors' (or a TypeError) before
        head.load_sharded_state(state)
    assert str(err.value) == f"state must be a sharded_state() dict, whose 'tensors' hold the 'weight'; got {shown}"
    assert torch.equal(head.weight.detach(), before)


def test_a_state_without_extras_or_without_a_sample_step_loads_with_step_zero():
    saved = _head().sharded_state()
    for state in ({"tensors": saved["tensors"]}, {"tensors": saved["tensors"], "extras": {}}):
        head = _head()
        head.sample_step = 7
        head.load_sharded_state(state)
        assert head.sample_step == 0
        assert torch.equal(head.shard_weights[0].detach(), saved["tensors"]["weight"])
    head = _head()
    head.load_sharded_state({"tensors": saved["tensors"], "extras": {"sample_step": 5}})
    assert head.sample_step == 5


@pytest.mark.parametrize("step", [1.5, -3, "4", True, None])
def test_a_sample_step_that_is_no_step_count_is_refused_before_a_row_is_written(step):
    """``int()`` took 1.5 as step 1 (another Partial FC draw than the saved run's next), -3 as a step
    before the first, and "x" with a bare ValueError; a checkpoint's extras are a file's contents."""
    saved = _head().sharded_state()
    head = _head(sample_rate=0.5)
    head.sample_step = 7
    before = head.weight.detach().clone()
    with pytest.raises(ValueError) as err:
        head.load_sharded_state({"tensors": {"weight": torch.zeros_like(saved["tensors"]["weight"])},
                                 "extras": {"sample_step": step}})
    assert str(err.value) == ("sharded state's sample_step (the Partial FC draw's step) must be an int >= 0, got "
                              f"{step!r}")
    assert head.sample_step == 7 and torch.equal(head.weight.detach(), before)
    head.load_sharded_state({"tensors": saved["tensors"], "extras": {"sample_step": torch.tensor(9)}})
    assert head.sample_step == 9 and type(head.sample_step) is int


def test_a_rank_whose_classes_start_past_zero_loads_its_own_rows(monkeypatch):
    """Rank 1 of 2 holds classes 6..10: its rows are found by their offset from the rank's first
    class, not from class 0."""
    from thread_world import ThreadWorld

    dense = torch.randn(C, D, dtype=torch.float64)

    def rank_fn(rank):
        head = _head()
        rows = head.class_range
        head.load_sharded_state({**head.state_layout(), "tensors": {"weight": dense[rows.start:rows.stop].clone()}})
        return rows, head.shard_weights[0].detach().clone(), head.sharded_state()["tensors"]["weight"]

    results = ThreadWorld(2).results(rank_fn, monkeypatch)
    assert [r for r, _, _ in results] == [range(0, 6), range(6, 11)]
    for rows, loaded, saved in results:
        assert torch.equal(loaded, dense[rows.start:rows.stop]) and torch.equal(saved, loaded)


@pytest.mark.parametrize("name, key", [
    ("optimizer.momentum_buffer", "momentum_buffer"),
    ("optimizer.param_groups", "param_groups"),
    ("optimizer.0.momentum_buffer", "momentum_buffer"),  # checkpoint format 1: one shard, numbered
    ("optimizer.0.exp_avg_sq", "exp_avg_sq"),
])
def test_optimizer_keys_of_either_format_name_the_state(name, key):
    assert _optimizer_key(name) == key


def test_an_optimizer_key_of_another_parameter_is_refused_naming_it():
    with pytest.raises(ValueError) as err:
        _optimizer_key("optimizer.1.momentum_buffer")
    assert str(err.value) == "head state 'optimizer.1.momentum_buffer' is for a parameter other than the head weight"


def test_a_format_1_momentum_loads_as_todays():
    head = _head()
    opt = torch.optim.SGD(head.parameters(), lr=0.1, momentum=0.9)
    head(torch.randn(3, D, dtype=torch.float64), torch.tensor([0, 5, 10])).backward()
    opt.step()
    state = head.sharded_state(opt)
    old = {**state, "tensors": {("optimizer.0." + k[len("optimizer."):] if k.startswith("optimizer.") else k): v
                                for k, v in state["tensors"].items()}}
    assert "optimizer.0.momentum_buffer" in old["tensors"]
    fresh = _head()
    fresh_opt = torch.optim.SGD(fresh.parameters(), lr=0.1, momentum=0.9)
    fresh.load_sharded_state(old, fresh_opt)
    assert torch.equal(fresh_opt.state[fresh.shard_weights[0]]["momentum_buffer"],
                       opt.state[head.shard_weights[0]]["momentum_buffer"])


def test_a_weight_of_another_shape_is_refused_naming_both_shapes():
    head = _head(subcenters=2)
    with pytest.raises(ValueError) as err:
        head.load_sharded_state({"tensors": {"weight": torch.zeros(C, D)}})
    assert str(err.value) == f"sharded state weight has shape ({C}, {D}), this head's (subcenters=2) is ({C}, 2, {D})"
