"""Growing a head by new classes: old rows and optimizer state bit-identical, in every layout, and
through a checkpoint saved on 2 ranks and grown on 3 (the resharding path)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from sgd_only import SGD_MOMENTUM
from shardfc import ShardedMarginHead, head_optimizer
from shardfc import margins as M
from shardfc.checkpoint import load_checkpoint, save_checkpoint
from shardfc.head.grow import ROW_STEP, grown_state, shared_row_step
from shardfc.head.layout import class_ranges
from shardfc.head.module import init_rows
from shardfc.parallel.launch import spawn
from thread_world import ThreadWorld

D = 8


def make_head(C, sample_rate=1.0, dtype=torch.float32, **kw) -> ShardedMarginHead:
    return ShardedMarginHead(D, C, margin=M.CosFace(16.0, 0.2), sample_rate=sample_rate, sample_seed=3,
                             init_seed=5, dtype=dtype, **kw)


def train(head, opt, steps, C, seed=0):
    for step in steps:
        g = torch.Generator().manual_seed(seed * 1000 + step)
        x, y = torch.randn(16, D, generator=g), torch.randint(0, C, (16,), generator=g)
        opt.zero_grad(set_to_none=False)
        head(x, y).backward()
        opt.step()


def logical(head, opt) -> dict:
    """This process's rows of the weight and of every per-row optimizer tensor, in class order
    (caught up first: what every reader of all rows sees)."""
    head.catch_up()
    out = {"weight": torch.cat([w.detach().cpu() for w in head.shard_weights])}
    for key, value in opt.state[head.shard_weights[0]].items():
        if isinstance(value, torch.Tensor) and value.dim() >= 1:
            out[key] = torch.cat([opt.state[w][key].cpu() for w in head.shard_weights])
    return out


def assert_grown(before: dict, after: dict, C: int, new_rows: torch.Tensor) -> None:
    assert before.keys() == after.keys()
    for key in before:
        a, b = before[key], after[key]
        assert b.dtype == a.dtype and b.shape[0] == C + new_rows.shape[0], key
        assert torch.equal(b[:C], a), f"{key}: an old row changed"
        if key == "weight":
            assert torch.equal(b[C:], new_rows.to(b.dtype))
        elif key == "row_step":  # the row-sparse AdamW's count: the one every old row shares, as torch's AdamW
            assert a.unique().numel() == 1 and torch.equal(b[C:], torch.full_like(b[C:], float(a[0]))), key
        else:
            assert not b[C:].any(), f"{key}: new rows' optimizer state is not zero"


@pytest.mark.parametrize("devices", [None, ["cpu", "cpu", "cpu"]], ids=["single", "devices"])
@pytest.mark.parametrize("name,sample_rate", [("sgd", 1.0), ("adamw", 0.5)])
def test_grow_in_memory_keeps_rows_and_state(devices, name, sample_rate):
    C, n = 20, 7
    head = make_head(C, sample_rate, devices=devices)
    opt = head_optimizer(head, name, lr=0.1, **SGD_MOMENTUM[name], weight_decay=5e-4)
    train(head, opt, range(3), C)
    before = logical(head, opt)
    rows = torch.randn(n, D)
    head.grow(n, rows, opt)
    assert head.num_classes == C + n and [len(r) for r in head.shard_ranges] == [len(r) for r in
                                                                                  class_ranges(C + n, len(head.devices))]
    assert_grown(before, logical(head, opt), C, rows)
    train(head, opt, range(3, 5), C + n)  # the grown head and its optimizer keep training
    assert all(torch.isfinite(w).all() for w in head.shard_weights)
    # The old parameters' state is gone with them: the optimizer holds state for its own parameters
    # only (a stale entry makes torch's state_dict() raise, and keeps the old rows' memory alive).
    params = {p for group in opt.param_groups for p in group["params"]}
    assert set(opt.state) <= params and all(w in opt.state for w in head.shard_weights)
    saved = opt.state_dict()
    assert len(saved["state"]) == len(opt.state)


def test_grow_default_rows_are_the_seeded_rows_of_a_bigger_head():
    head = make_head(10, subcenters=2)
    head.grow(5)
    assert torch.equal(head.weight.detach(), make_head(15, subcenters=2).weight.detach())
    assert torch.equal(head.weight.detach()[20:], init_rows(20, 30, D, 5))


def test_grow_refuses_bad_arguments():
    head = make_head(10)
    with pytest.raises(ValueError, match="n must be an int >= 0"):
        head.grow(-1)
    with pytest.raises(ValueError, match=r"rows has shape \(3, 8\), growing by 2"):
        head.grow(2, torch.zeros(3, D))
    with pytest.raises(ValueError, match="ignore_index=12 would be a class id"):
        ShardedMarginHead(D, 10, ignore_index=12).grow(5)
    with pytest.raises(ValueError, match="a head only grows"):
        grown_state(head.sharded_state(), 9, range(9), lambda r: None)



@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_new_centres_that_are_not_finite_are_refused_and_the_head_is_left_as_it_was(bad):
    # every logit against such a centre is NaN: the loss was NaN from the next step on, far from the cause
    head = make_head(10)
    before = head.weight.detach().clone()
    rows = torch.zeros(3, D)
    rows[2, 5] = bad
    tail = "every logit against such a centre is NaN, and so is the loss"
    with pytest.raises(ValueError) as err:
        head.grow(3, rows)
    assert str(err.value) == f"new rows for classes 10..12 hold NaN or inf (class 12): {tail}"
    with pytest.raises(ValueError) as err:  # a function's rows, checked as they come
        head.grow(3, lambda r: rows[r.start - 10 : r.stop - 10])
    assert str(err.value) == f"new rows for classes 10..12 hold NaN or inf (class 12): {tail}"
    assert head.num_classes == 10 and torch.equal(head.weight.detach(), before)
    rows[2, 5] = 3.0e38  # large, but a number
    assert head.grow(3, rows).num_classes == 13


C_OLD, C_NEW = 1000, 1300


def _new_rows(r: range) -> torch.Tensor:
    """The test's new centres of global ids ``r`` (a function of the id alone: any sharding)."""
    return torch.stack([torch.full((D,), float(i)) for i in r]).to(torch.bfloat16)


def _save_on_two(rank, world, root):
    """Train a bf16 Partial FC head of 1,000 classes on 2 ranks, save it, then grow it in memory."""
    head = make_head(C_OLD, 0.3, torch.bfloat16)
    opt = head_optimizer(head, "sgd", lr=0.1, momentum=0.9, weight_decay=5e-4)
    train(head, opt, range(4), C_OLD, seed=rank)
    before = logical(head, opt)
    save_checkpoint(root, 4, common={}, per_rank=None, head_state=head.sharded_state(opt), fingerprint={})
    head.grow(C_NEW - C_OLD, _new_rows, opt)  # in process-group mode: rebalanced over the same 2 ranks
    return before, head.class_range, logical(head, opt)


def _grow_on_three(rank, world, path):
    """Load the 2-rank checkpoint on 3 ranks as a 1,300-class head: the resharding path."""
    head = make_head(C_NEW, 0.3, torch.bfloat16)
    opt = head_optimizer(head, "sgd", lr=0.1, momentum=0.9, weight_decay=5e-4)
    mine = head.class_range
    old = range(mine.start, min(mine.stop, C_OLD)) if mine.start < C_OLD else range(C_OLD, C_OLD)
    loaded = load_checkpoint(path, class_range=old, num_classes=C_OLD, rank=rank)
    head.load_sharded_state(grown_state(loaded.head_state, C_NEW, mine, _new_rows), opt)
    out = (mine, logical(head, opt))
    train(head, opt, range(2), C_NEW)  # and it trains on
    return out


def test_grow_1000_to_1300_while_moving_from_2_to_3_ranks(tmp_path: Path):
    saved = spawn(_save_on_two, 2, str(tmp_path), backend="gloo")
    before = {k: torch.cat([b[k] for b, _, _ in saved]) for k in saved[0][0]}
    assert set(before) == {"weight", "momentum_buffer"} and before["weight"].dtype == torch.bfloat16
    new_rows = _new_rows(range(C_OLD, C_NEW))

    in_memory = {k: torch.cat([after[k] for _, _, after in saved]) for k in before}
    assert [r for _, r, _ in saved] == class_ranges(C_NEW, 2)
    assert_grown(before, in_memory, C_OLD, new_rows)

    path = next(tmp_path.glob("step_*"))
    grown = spawn(_grow_on_three, 3, str(path), backend="gloo")
    assert [r for r, _ in grown] == class_ranges(C_NEW, 3)
    assert_grown(before, {k: torch.cat([rows[k] for _, rows in grown]) for k in before}, C_OLD, new_rows)


def test_grow_keeps_the_state_that_is_not_per_row():
    """Partial FC's sample step, AdaFace's running norm statistics, the optimizer's scalar step and
    hyper-parameters: kept by an in-place grow and by :func:`grown_state` loaded into a new head (the
    fine-tuning path)."""
    C, n = 20, 7

    def build(classes):
        return ShardedMarginHead(D, classes, margin=M.AdaFace(momentum=0.5), sample_rate=0.5, sample_seed=3, init_seed=5)

    head = build(C)
    opt = torch.optim.AdamW(head.parameters(), lr=0.1)
    train(head, opt, range(3), C)
    opt.param_groups[0]["lr"] = 0.0123
    stats, step = head.margin.state(), opt.state[head.weight]["step"].clone()
    assert head.sample_step == 3 and int(step) == 3
    assert stats != build(C).margin.state()  # trained away from the initial values, so a reset shows

    state = grown_state(head.sharded_state(opt), C + n, range(C + n), lambda r: torch.zeros(len(r), D))
    fresh = build(C + n)
    fresh_opt = torch.optim.AdamW(fresh.parameters(), lr=0.1)
    fresh.load_sharded_state(state, fresh_opt)
    head.grow(n, torch.zeros(n, D), opt)
    for grown, grown_opt in ((fresh, fresh_opt), (head, opt)):
        assert grown.sample_step == 3
        assert grown.margin.state() == stats
        assert torch.equal(grown_opt.state[grown.weight]["step"], step)
        assert grown_opt.param_groups[0]["lr"] == 0.0123


def _adamw_head(C, sample_rate, sparse, classes_dtype=torch.float64, **kw):
    head = make_head(C, sample_rate, classes_dtype)
    if sparse:
        return head, head_optimizer(head, "adamw", lr=0.05, weight_decay=0.05, **kw)
    return head, torch.optim.AdamW(head.parameters(), lr=0.05, weight_decay=0.05)


def _train64(head, opt, steps, C):
    for step in steps:
        g = torch.Generator().manual_seed(step)
        x, y = torch.randn(16, D, generator=g, dtype=torch.float64), torch.randint(0, C, (16,), generator=g)
        opt.zero_grad(set_to_none=False)
        head(x, y).backward()
        opt.step()


@pytest.mark.parametrize("sample_rate,kw", [(0.3, {}), (1.0, {"fused_update": True})], ids=["partial-fc", "fused"])
def test_a_head_grown_under_the_row_sparse_adamw_trains_on_as_under_torchs(sample_rate, kw):
    """torch's AdamW keeps one step count for all rows: a grown head's new rows take their first
    update bias-corrected as step T + 1. The row-sparse AdamW (Partial FC, the fused update, bf16
    centres) gave them a count of 0 (a first step: an update about 3x smaller at beta2 = 0.999), so the
    same grow trained the new classes, and through the softmax the old ones, otherwise (new rows off
    by 0.11 after 7 steps here). Now the two heads stay equal through the grow and after it."""
    C, n = 30, 11
    (ours, ours_opt), (theirs, theirs_opt) = (_adamw_head(C, sample_rate, True, **kw),
                                              _adamw_head(C, sample_rate, False))
    _train64(ours, ours_opt, range(5), C)
    _train64(theirs, theirs_opt, range(5), C)
    rows = torch.randn(n, D, dtype=torch.float64, generator=torch.Generator().manual_seed(9))
    ours.grow(n, rows, ours_opt)
    theirs.grow(n, rows, theirs_opt)
    assert torch.equal(ours_opt.state[ours.weight]["row_step"], torch.full((C + n,), 5.0, dtype=torch.float64))
    _train64(ours, ours_opt, range(5, 12), C + n)
    _train64(theirs, theirs_opt, range(5, 12), C + n)
    ours.catch_up()
    torch.testing.assert_close(ours.weight.detach(), theirs.weight.detach(), rtol=0, atol=1e-12)
    # and the checkpoint's way (grown_state from a sharded state, the resume path) gives the same state
    fresh, fresh_opt = _adamw_head(C + n, sample_rate, True, **kw)
    saved, saved_opt = _adamw_head(C, sample_rate, True, **kw)
    _train64(saved, saved_opt, range(5), C)
    state = saved.sharded_state(saved_opt)
    fresh.load_sharded_state(grown_state(state, C + n, range(C + n), lambda r: rows, shared_row_step(state["tensors"])),
                             fresh_opt)
    assert torch.equal(fresh_opt.state[fresh.weight]["row_step"], torch.full((C + n,), 5.0, dtype=torch.float64))


def test_lazy_rows_counts_differ_so_new_rows_count_their_own_updates():
    head, opt = _adamw_head(30, 0.3, True, idle_rows="lazy")
    _train64(head, opt, range(4), 30)
    counts = opt.state[head.weight]["row_step"].clone()
    assert counts.unique().numel() > 1  # rows sampled a different number of times
    head.grow(5, torch.randn(5, D, dtype=torch.float64), opt)
    assert torch.equal(opt.state[head.weight]["row_step"], torch.cat([counts, torch.zeros(5, dtype=torch.float64)]))


@pytest.mark.parametrize("held,expected", [
    ([[5.0, 5.0], [], [5.0]], 5.0),     # a rank without a row learns the count from the others
    ([[5.0, 5.0], [4.0], []], 0.0),     # counts that differ between ranks: the new rows' own, 0
    ([[3.0, 4.0], [], []], 0.0),        # ... or within a rank
    ([[], [], []], 0.0),                # no row anywhere
    ([None, None, None], 0.0),          # no count (SGD, torch's AdamW): nothing to share
])
def test_the_shared_row_step_is_agreed_over_every_rank(held, expected):
    def rank(r):
        tensors = {} if held[r] is None else {ROW_STEP: torch.tensor(held[r], dtype=torch.float64)}
        return shared_row_step(tensors, ThreadWorld.context(world))

    world = ThreadWorld(3)
    assert world.results(rank) == [expected] * 3
    assert shared_row_step({ROW_STEP: torch.tensor([7.0, 7.0], dtype=torch.float64)}) == 7.0  # one process
    # counts past float32's integers (2**24) survive the exchange whole
    assert shared_row_step({ROW_STEP: torch.full((2,), 2.0**24 + 1, dtype=torch.float64)}) == 2.0**24 + 1


@pytest.mark.parametrize("sample_rate,kw", [(1.0, {"fused_update": True}), (0.5, {})], ids=["fused", "partial-fc"])
def test_grow_over_ranks_where_one_held_no_old_row_gives_every_new_row_the_count(monkeypatch, sample_rate, kw):
    """Two classes over three ranks: rank 2 holds none before the grow, yet its new rows get the
    count the old rows share (one all-reduce in ``grow_head``). Before, that rank's optimizer kept no
    state (no row to update made none), so the ranks gathered different keys and the grow's
    collectives paired up wrongly (a hang between processes); Partial FC's draw failed on it."""
    world = ThreadWorld(3)

    def rank(r):
        head, opt = _adamw_head(2, sample_rate, True, **kw)
        _train64(head, opt, range(3), 2)
        head.grow(7, lambda classes: torch.zeros(len(classes), D, dtype=torch.float64), opt)
        return head.class_range, opt.state[head.weight]["row_step"].tolist()

    out = world.results(rank, monkeypatch)
    assert [r for r, _ in out] == class_ranges(9, 3)
    assert [steps for _, steps in out] == [[3.0] * 3] * 3


def test_grown_state_names_what_it_returns_and_refuses_by_name():
    """The state it returns carries the grown layout (load_sharded_state checks it only where it is
    given); the new rows take the old rows' dtype; a state without extras has none; growing by 0 is
    the state itself; and a state of other rows, or new rows of the wrong shape, are refused naming
    both."""
    head = make_head(10)
    state = head.sharded_state()
    grown = grown_state(state, 13, range(13), lambda r: torch.ones(len(r), D, dtype=torch.float64))
    assert grown["num_classes"] == 13 and grown["class_range"] == range(13)
    assert grown["tensors"]["weight"].dtype == torch.float32 and grown["extras"] == state["extras"]
    bare = grown_state({"num_classes": 10, "tensors": state["tensors"]}, 12, range(12), lambda r: torch.ones(len(r), D))
    assert bare["extras"] == {} and bare["tensors"]["weight"].shape == (12, D)
    same = grown_state(state, 10, range(10), lambda r: torch.ones(len(r), D))
    assert torch.equal(same["tensors"]["weight"], state["tensors"]["weight"]) and same["num_classes"] == 10
    with pytest.raises(ValueError) as err:
        grown_state(state, 13, range(4, 13), lambda r: torch.ones(len(r), D))
    assert str(err.value) == "the old state holds 10 rows, class range range(4, 10) of the old head has 6"
    with pytest.raises(ValueError) as err:
        grown_state(state, 13, range(13), lambda r: torch.ones(len(r), D + 1))
    assert str(err.value) == "new rows for classes 10..12 have shape (3, 9), expected (3, 8)"
    # a per-row step count of the new rows: 0 unless one is given
    with_steps = dict(state, tensors={**state["tensors"], ROW_STEP: torch.full((10,), 4.0, dtype=torch.float64)})
    assert grown_state(with_steps, 12, range(12), lambda r: torch.ones(len(r), D))["tensors"][ROW_STEP].tolist() == \
        [4.0] * 10 + [0.0] * 2


def test_grow_by_one_by_none_and_by_what_is_no_count():
    head = make_head(10)
    before = head.weight.detach().clone()
    assert head.grow(0) is head and head.num_classes == 10 and torch.equal(head.weight.detach(), before)
    head.grow(1)
    assert head.num_classes == 11 and head.weight.shape == (11, D)
    for bad in (1.5, True, "2"):
        with pytest.raises(ValueError, match=rf"^n must be an int >= 0 \(classes to add\), got {re.escape(repr(bad))}$"):
            head.grow(bad)


def test_grow_with_subcentres_takes_rows_of_each_centre():
    head = make_head(6, subcenters=2)
    rows = torch.randn(3, 2, D)
    head.grow(3, rows)
    assert torch.equal(head.weight.detach()[12:], rows.reshape(6, D))
    with pytest.raises(ValueError, match=r"rows has shape \(3, 8\), growing by 3 classes needs \(3, 2, 8\)"):
        head.grow(3, torch.randn(3, D))


def test_grow_over_ranks_hands_each_rank_its_slice_of_the_rows_given(monkeypatch):
    """In process-group mode each rank takes its own new classes' rows out of the tensor given (every
    rank gives all of them)."""
    rows = torch.arange(7 * D, dtype=torch.float64).reshape(7, D)

    def rank(r):
        head = make_head(5, dtype=torch.float64)
        head.grow(7, rows)
        return head.class_range, head.weight.detach().clone()

    out = ThreadWorld(3).results(rank, monkeypatch)
    assert [r for r, _ in out] == class_ranges(12, 3)
    grown = torch.cat([w for _, w in out])
    assert torch.equal(grown[5:], rows)


def test_grow_up_to_the_ignore_index_and_not_past_it():
    head = ShardedMarginHead(D, 10, ignore_index=15)
    assert head.grow(5).num_classes == 15  # 15 stays outside 0..14
    with pytest.raises(ValueError) as err:
        head.grow(1)
    assert str(err.value) == "ignore_index=15 would be a class id of the grown head (0..15)"


def test_grow_keeps_an_optimizers_other_parameters_and_one_that_never_stepped():
    """One optimizer over a backbone and the head (as a single-optimizer training loop builds it):
    the grow swaps the head's parameters and leaves the backbone's; an optimizer without any state
    yet (grown before the first step) is fine too."""
    head = make_head(10)
    backbone = torch.nn.Linear(D, D)
    opt = torch.optim.SGD([{"params": backbone.parameters()}, {"params": head.parameters()}], lr=0.1, momentum=0.9)
    head.grow(3, torch.zeros(3, D), opt)
    assert opt.param_groups[0]["params"] == list(backbone.parameters())
    assert opt.param_groups[1]["params"] == [head.weight] and head.weight.shape == (13, D)
    x, y = torch.randn(4, D), torch.randint(0, 13, (4,))
    opt.zero_grad()
    head(backbone(x), y).backward()
    opt.step()
    assert set(opt.state) == set(backbone.parameters()) | {head.weight}
