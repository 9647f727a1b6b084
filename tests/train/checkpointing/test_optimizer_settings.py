"""``train/checkpointing/optimizer_settings.py``: after a load, each param group's settings are this
run's again (named in one log line when they differ), its state and the schedule's entries untouched."""

from __future__ import annotations

import logging

import pytest
import torch

import shardfc
from shardfc.train.checkpointing.optimizer_settings import NAMED, keep_run_settings, restore_run_settings


def _sgd(**kw) -> torch.optim.SGD:
    torch.manual_seed(0)
    return torch.optim.SGD([torch.nn.Parameter(torch.randn(3))], **{"lr": 0.1, **kw})


def _stepped(opt):
    for g in opt.param_groups:
        for p in g["params"]:
            p.grad = torch.ones_like(p)
    opt.step()
    return opt


def test_a_load_keeps_the_state_and_this_runs_settings_and_says_what_changed(caplog):
    saved = _stepped(_sgd(lr=0.3, momentum=0.9, weight_decay=5e-4, nesterov=True)).state_dict()
    mine = _sgd(lr=0.2, momentum=0.5, weight_decay=0.05)
    kept = keep_run_settings([mine, None])
    mine.load_state_dict(saved)
    assert mine.param_groups[0]["weight_decay"] == 5e-4  # what torch's load does
    with caplog.at_level(logging.INFO, logger="shardfc.train"):
        changed = restore_run_settings([mine, None], kept)
    group = mine.param_groups[0]
    assert (group["momentum"], group["weight_decay"], group["nesterov"]) == (0.5, 0.05, False)
    assert group["lr"] == 0.3  # the schedule's to set (apply_schedule), not this
    assert torch.equal(mine.state[group["params"][0]]["momentum_buffer"], saved["state"][0]["momentum_buffer"])
    assert changed == {"backbone.momentum": (0.9, 0.5), "backbone.nesterov": (True, False),
                       "backbone.weight_decay": (5e-4, 0.05)}
    assert caplog.messages == [
        "the optimizer settings differ from the checkpoint's (backbone.momentum 0.9, backbone.weight_decay 0.0005, "
        "backbone.nesterov True); following this run's: backbone.momentum 0.5, backbone.weight_decay 0.05, "
        "backbone.nesterov False"]


def test_the_same_settings_say_nothing_and_torchs_own_choices_follow_this_run_silently(caplog):
    saved = _sgd(momentum=0.9).state_dict()
    saved["param_groups"][0]["foreach"] = True  # e.g. chosen on the saving run's device
    mine = _sgd(momentum=0.9)
    kept = keep_run_settings([mine])
    mine.load_state_dict(saved)
    with caplog.at_level(logging.INFO, logger="shardfc.train"):
        assert restore_run_settings([mine], kept) == {}
    assert mine.param_groups[0]["foreach"] is None and caplog.messages == []


def test_betas_compare_as_numbers_whatever_sequence_holds_them(caplog):
    p = torch.nn.Parameter(torch.zeros(2))
    mine = torch.optim.AdamW([p], betas=(0.9, 0.99))
    kept = keep_run_settings([mine])
    mine.param_groups[0]["betas"] = [0.9, 0.99]  # a list, as a JSON or TOML round trip gives
    assert restore_run_settings([mine], kept) == {}
    assert mine.param_groups[0]["betas"] == (0.9, 0.99)
    mine.param_groups[0]["betas"] = [0.8, 0.99]
    with caplog.at_level(logging.INFO, logger="shardfc.train"):
        assert restore_run_settings([mine], kept) == {"backbone.betas": ([0.8, 0.99], (0.9, 0.99))}
    assert caplog.messages == ["the optimizer settings differ from the checkpoint's (backbone.betas (0.8, 0.99)); "
                               "following this run's: backbone.betas (0.9, 0.99)"]  # one spelling for both


def test_the_row_sparse_optimizers_count_of_rounding_draws_is_state_and_stays_the_checkpoints(caplog):
    head = shardfc.ShardedMarginHead(4, 9, sample_rate=0.5, dtype=torch.bfloat16)
    mine = shardfc.head_optimizer(head, "sgd", lr=0.1, rounding="stochastic", rounding_seed=3)
    kept = keep_run_settings([None, mine])
    group = mine.param_groups[0]
    group.update(rounding_step=17, rounding="nearest", rounding_seed=1)  # as a load of another run's leaves it
    with caplog.at_level(logging.INFO, logger="shardfc.train"):
        changed = restore_run_settings([None, mine], kept)
    assert (group["rounding_step"], group["rounding"], group["rounding_seed"]) == (17, "stochastic", 3)
    assert changed == {"head.rounding": ("nearest", "stochastic"), "head.rounding_seed": (1, 3)}
    assert caplog.messages == ["the optimizer settings differ from the checkpoint's (head.rounding 'nearest', "
                               "head.rounding_seed 1); following this run's: head.rounding 'stochastic', "
                               "head.rounding_seed 3"]


def test_several_groups_are_named_by_index():
    a, b = torch.nn.Parameter(torch.zeros(2)), torch.nn.Parameter(torch.zeros(2))
    mine = torch.optim.SGD([{"params": [a]}, {"params": [b], "weight_decay": 0.1}], lr=0.1)
    kept = keep_run_settings([mine])
    for g in mine.param_groups:
        g["weight_decay"] = 0.0
    assert restore_run_settings([mine], kept) == {"backbone[1].weight_decay": (0.0, 0.1)}
    assert [g["weight_decay"] for g in mine.param_groups] == [0, 0.1]


@pytest.mark.parametrize("key", NAMED)
def test_each_named_setting_is_one_a_flag_of_shardfc_train_sets(key):
    from shardfc.train.config.fields import FIELDS

    flag = {"rounding": "head_rounding", "rounding_seed": "seed"}.get(key, key)
    assert flag in FIELDS
