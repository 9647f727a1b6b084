"""ShardedMarginHead.sharded_state / load_sharded_state through a checkpoint, across shardings and modes."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from sgd_only import SGD_MOMENTUM
from shardfc import ShardedMarginHead, head_optimizer
from shardfc import margins as M
from shardfc.checkpoint import load_checkpoint, save_checkpoint

C, D = 50, 6


def make_head(devices=None, sample_rate=0.3, init_seed=0) -> ShardedMarginHead:
    return ShardedMarginHead(D, C, margin=M.CosFace(16.0, 0.2), devices=devices, sample_rate=sample_rate,
                             sample_seed=4, init_seed=init_seed, dtype=torch.float64)


def train(head: ShardedMarginHead, opt: torch.optim.Optimizer, steps: range) -> None:
    for step in steps:
        g = torch.Generator().manual_seed(step)
        x, y = torch.randn(12, D, generator=g, dtype=torch.float64), torch.randint(0, C, (12,), generator=g)
        opt.zero_grad()
        head(x, y).backward()
        opt.step()


def logical(head: ShardedMarginHead, opt: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    """The whole head's weight and per-row optimizer state, read from the shards (caught up first,
    as every reader of all rows is: Partial FC's idle rows)."""
    head.catch_up()
    out = {"weight": torch.cat([w.detach() for w in head.shard_weights])}
    for key in opt.state[head.shard_weights[0]]:
        values = [opt.state[w][key] for w in head.shard_weights]
        if values[0].dim() >= 1:
            out[key] = torch.cat(values)
    return out


def assert_same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for key in a:
        assert a[key].dtype == b[key].dtype and torch.equal(a[key], b[key]), key


@pytest.mark.parametrize("name", ["sgd", "adamw"])
@pytest.mark.parametrize("sample_rate", [0.3, 1.0])
def test_devices_head_saved_and_loaded_with_another_sharding(tmp_path: Path, name: str, sample_rate: float) -> None:
    head = make_head(["cpu", "cpu"], sample_rate)
    opt = head_optimizer(head, name, lr=0.1, **SGD_MOMENTUM[name], weight_decay=5e-4)
    train(head, opt, range(3))
    expected = logical(head, opt)
    path = save_checkpoint(tmp_path, 3, common=None, per_rank=None, head_state=head.sharded_state(opt), fingerprint={})

    for devices in (None, ["cpu"] * 3):  # single shard; three shards on devices
        other = make_head(devices, sample_rate, init_seed=7)  # another initialisation, lr and step count
        other_opt = head_optimizer(other, name, lr=0.5, **SGD_MOMENTUM[name], weight_decay=5e-4)
        train(other, other_opt, range(10, 11))
        loaded = load_checkpoint(path, **other.state_layout())
        other.load_sharded_state(loaded.head_state, other_opt)
        assert_same(logical(other, other_opt), expected)
        assert other.sample_step == head.sample_step == (3 if sample_rate < 1 else 0)
        assert other_opt.param_groups[0]["lr"] == 0.1
        if sample_rate == 1.0:  # no sampling: the next step is the same step whatever the sharding
            train(other, other_opt, range(3, 4))
            reference = make_head(["cpu", "cpu"], sample_rate)
            reference_opt = head_optimizer(reference, name, lr=0.1, **SGD_MOMENTUM[name], weight_decay=5e-4)
            reference.load_sharded_state(head.sharded_state(opt), reference_opt)
            train(reference, reference_opt, range(3, 4))
            for key, value in logical(reference, reference_opt).items():
                torch.testing.assert_close(logical(other, other_opt)[key], value, rtol=1e-12, atol=1e-14)


def test_sharded_state_layout_and_direct_round_trip() -> None:
    head = make_head(["cpu", "cpu"])
    opt = head_optimizer(head, "adamw", lr=0.01)
    train(head, opt, range(2))
    state = head.sharded_state(opt)
    assert state["num_classes"] == C and state["class_range"] == range(0, C)
    assert set(state["tensors"]) == {"weight", "optimizer.exp_avg", "optimizer.exp_avg_sq", "optimizer.row_step"}
    assert state["tensors"]["optimizer.row_step"].dtype == torch.float64 and state["tensors"]["weight"].shape == (C, D)
    assert state["extras"]["sample_step"] == 2 and state["extras"]["optimizer.param_groups"][0]["lr"] == 0.01

    single = make_head()
    single_opt = head_optimizer(single, "adamw", lr=0.01)
    single.load_sharded_state(state, single_opt)
    assert_same(logical(single, single_opt), logical(head, opt))
    # The loaded state is the optimizer's own: stepping it leaves the saved dict alone.
    before = state["tensors"]["optimizer.exp_avg"].clone()
    train(single, single_opt, range(5, 6))
    assert torch.equal(state["tensors"]["optimizer.exp_avg"], before)


def test_torch_adamw_scalar_step_is_an_extra_given_to_every_shard() -> None:
    head = make_head(["cpu", "cpu"], sample_rate=1.0)
    opt = head_optimizer(head, "adamw", lr=0.01)
    assert isinstance(opt, torch.optim.AdamW)
    train(head, opt, range(2))
    state = head.sharded_state(opt)
    assert torch.equal(state["extras"]["optimizer.step"], torch.tensor(2.0))
    three = make_head(["cpu"] * 3, sample_rate=1.0)
    three_opt = head_optimizer(three, "adamw", lr=0.01)
    three.load_sharded_state(state, three_opt)
    steps = [three_opt.state[w]["step"] for w in three.shard_weights]
    assert all(torch.equal(s, torch.tensor(2.0)) for s in steps)
    assert len({s.data_ptr() for s in steps}) == 3  # each shard steps its own counter


def test_load_refuses_state_of_other_classes() -> None:
    state = make_head().sharded_state()
    part = {**state, "class_range": range(0, 25), "tensors": {"weight": state["tensors"]["weight"][:25]}}
    with pytest.raises(ValueError, match=r"class_range=range\(0, 25\), this head has class_range=range\(0, 50\)"):
        make_head().load_sharded_state(part)
    with pytest.raises(ValueError, match=r"weight has shape \(25, 6\)"):
        make_head().load_sharded_state({"tensors": part["tensors"]})


def test_save_takes_head_state_or_separate_arguments_not_both(tmp_path: Path) -> None:
    state = make_head().sharded_state()
    with pytest.raises(ValueError, match="either head_state or head_tensors, not both"):
        save_checkpoint(tmp_path, 1, common=None, per_rank=None, head_state=state, head_tensors=state["tensors"],
                        fingerprint={})
    with pytest.raises(ValueError, match="pass head_state, or head_tensors, class_range and num_classes"):
        save_checkpoint(tmp_path, 1, common=None, per_rank=None, fingerprint={})


def _group_worker(rank: int, world: int, devices_ckpt: str, out_root: str) -> dict:
    """Process-group mode: load the devices-mode checkpoint, train on, save this rank's shard."""
    head = make_head(None, init_seed=9)
    opt = head_optimizer(head, "adamw", lr=0.5)
    loaded = load_checkpoint(devices_ckpt, **head.state_layout())
    head.load_sharded_state(loaded.head_state, opt)
    report = {"rows": (head.class_range.start, head.class_range.stop), "mode": head.mode,
              "lr": opt.param_groups[0]["lr"], "loaded": {k: v.numpy().copy() for k, v in logical(head, opt).items()}}
    train(head, opt, range(3, 5))
    save_checkpoint(out_root, 5, common=None, per_rank=None, head_state=head.sharded_state(opt), fingerprint={})
    # numpy, not tensors: a tensor sent back from a process that then exits cannot be received.
    report["trained"] = {k: v.numpy().copy() for k, v in logical(head, opt).items()}
    return report


def test_devices_checkpoint_into_process_group_and_back(tmp_path: Path) -> None:
    from shardfc.parallel.launch import spawn

    head = make_head(["cpu", "cpu"])
    opt = head_optimizer(head, "adamw", lr=0.1)
    train(head, opt, range(3))
    devices_ckpt = save_checkpoint(tmp_path / "devices", 3, common=None, per_rank=None,
                                   head_state=head.sharded_state(opt), fingerprint={})
    reports = spawn(_group_worker, 2, str(devices_ckpt), str(tmp_path / "group"))
    assert [r["mode"] for r in reports] == ["group", "group"] and [r["rows"] for r in reports] == [(0, 25), (25, 50)]
    assert all(r["lr"] == 0.1 for r in reports)
    loaded = {k: torch.cat([torch.from_numpy(r["loaded"][k]) for r in reports]) for k in reports[0]["loaded"]}
    assert_same(loaded, logical(head, opt))

    trained = {k: torch.cat([torch.from_numpy(r["trained"][k]) for r in reports]) for k in reports[0]["trained"]}
    for devices in (["cpu"] * 3, None):
        other = make_head(devices)
        other_opt = head_optimizer(other, "adamw", lr=0.1)
        other.load_sharded_state(load_checkpoint(tmp_path / "group" / "step_00000005", **other.state_layout()).head_state,
                                 other_opt)
        assert_same(logical(other, other_opt), trained)
        assert other.sample_step == 5


def test_adamw_step_counts_cross_between_the_row_sparse_and_torchs_forms() -> None:
    """A dense head's row-sparse AdamW (what fused_update=True builds even without Partial FC)
    keeps a count per row, all equal: torch's AdamW takes it as its scalar step, and the next step
    is the same as the row-sparse one's. Counts that differ (Partial FC) are refused with the
    reason, and the row-sparse AdamW takes torch's scalar step back."""
    from shardfc.head.partial_fc import RowSparseAdamW

    head = make_head(["cpu", "cpu"], sample_rate=1.0)
    opt = RowSparseAdamW(head.parameters(), lr=0.01)
    train(head, opt, range(2))
    state = head.sharded_state(opt)
    other = make_head(["cpu"], sample_rate=1.0)
    other_opt = head_optimizer(other, "adamw", lr=0.01)
    assert isinstance(other_opt, torch.optim.AdamW)
    other.load_sharded_state(state, other_opt)
    assert torch.equal(other_opt.state[other.shard_weights[0]]["step"], torch.tensor(2.0))
    train(head, opt, range(2, 3))
    train(other, other_opt, range(2, 3))
    torch.testing.assert_close(logical(other, other_opt)["weight"], logical(head, opt)["weight"], rtol=1e-12, atol=1e-14)
    # and back: torch's scalar step becomes every row's count
    back = make_head(["cpu"], sample_rate=1.0)
    back_opt = RowSparseAdamW(back.parameters(), lr=0.01)
    back.load_sharded_state(other.sharded_state(other_opt), back_opt)
    train(back, back_opt, range(3, 4))
    train(head, opt, range(3, 4))
    assert torch.equal(back_opt.state[back.shard_weights[0]]["row_step"], torch.full((C,), 4.0, dtype=torch.float64))
    torch.testing.assert_close(logical(back, back_opt)["weight"], logical(head, opt)["weight"], rtol=1e-12, atol=1e-14)

    # Partial FC's lazy update: the counts differ between rows, which torch's AdamW cannot keep
    sampled = make_head(["cpu"], sample_rate=0.3)
    sampled_opt = head_optimizer(sampled, "adamw", lr=0.01, idle_rows="lazy")
    train(sampled, sampled_opt, range(2))
    dense = make_head(["cpu"], sample_rate=1.0)
    with pytest.raises(ValueError, match=r"a step count per row that differs between rows .* torch's AdamW"):
        dense.load_sharded_state(sampled.sharded_state(sampled_opt), head_optimizer(dense, "adamw", lr=0.01))
    # the exact update: every row caught up has the global count, so torch's AdamW takes it
    sampled = make_head(["cpu"], sample_rate=0.3)
    sampled_opt = head_optimizer(sampled, "adamw", lr=0.01)
    train(sampled, sampled_opt, range(2))
    dense_opt = head_optimizer(dense, "adamw", lr=0.01)
    dense.load_sharded_state(sampled.sharded_state(sampled_opt), dense_opt)
    assert torch.equal(dense_opt.state[dense.shard_weights[0]]["step"], torch.tensor(2.0))
