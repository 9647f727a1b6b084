"""``train/schedule.py``: the learning-rate multiplier step by step against the formulas written out
here, and ``apply_schedule`` putting a (loaded) run's schedulers at a step of this run's schedule."""

from __future__ import annotations

import logging
import math
from types import SimpleNamespace

import pytest
import torch

from shardfc.train.config import TrainConfig
from shardfc.train.schedule import WarmupDecay, apply_schedule, current_lr


def _expected(t: int, warmup: int, total: int, kind: str, power: float) -> float:
    if t < warmup:
        return (t + 1) / (warmup + 1)
    progress = min((t - warmup) / max(total - warmup, 1), 1.0)
    return 0.5 * (1 + math.cos(math.pi * progress)) if kind == "cosine" else (1 - progress) ** power


@pytest.mark.parametrize("kind, power", [("poly", 2.0), ("poly", 0.5), ("cosine", 2.0)])
@pytest.mark.parametrize("warmup, total", [(0, 10), (3, 10), (4, 4), (6, 2)])
def test_the_multiplier_follows_the_formula_over_and_past_the_run(kind, power, warmup, total):
    schedule = WarmupDecay(TrainConfig(scheduler=kind, poly_power=power, warmup_steps=warmup), total)
    for t in range(total + 4):
        assert schedule(t) == pytest.approx(_expected(t, warmup, total, kind, power), rel=1e-12, abs=1e-15), t


def test_the_landmarks_of_each_schedule():
    poly = WarmupDecay(TrainConfig(scheduler="poly", poly_power=2.0, warmup_steps=4), 14)
    assert [poly(t) for t in range(4)] == [0.2, 0.4, 0.6, 0.8]  # linear warm-up, below 1 throughout
    assert poly(4) == 1.0 and poly(9) == 0.25 and poly(14) == 0.0 and poly(100) == 0.0
    cosine = WarmupDecay(TrainConfig(scheduler="cosine", warmup_steps=0), 10)
    assert cosine(0) == 1.0 and cosine(5) == pytest.approx(0.5, abs=1e-15) and cosine(10) == 0.0
    assert cosine(11) == cosine(10)  # past the end: stays at the bottom, not back up the cosine
    # a run no longer than its warm-up: the decay is one step long, not a division by zero
    short = WarmupDecay(TrainConfig(scheduler="poly", poly_power=1.0, warmup_steps=3), 3)
    assert short(3) == 1.0 and short(4) == 0.0


def _parts(lr_backbone: float, lr_head: float, cfg: TrainConfig, total: int) -> SimpleNamespace:
    w, v = torch.nn.Parameter(torch.zeros(2)), torch.nn.Parameter(torch.zeros(2))
    opt_backbone, opt_head = torch.optim.SGD([w], lr=lr_backbone), torch.optim.SGD([v], lr=lr_head)
    schedulers = [torch.optim.lr_scheduler.LambdaLR(o, WarmupDecay(cfg, total)) for o in (opt_backbone, opt_head)]
    return SimpleNamespace(opt_backbone=opt_backbone, opt_head=opt_head, schedulers=schedulers)


def test_apply_schedule_puts_each_optimizer_at_the_step_of_this_runs_schedule(caplog):
    saved_cfg = TrainConfig(lr=0.1, warmup_steps=2, scheduler="poly", poly_power=2.0)
    parts = _parts(0.1, 0.1, saved_cfg, 10)
    cfg = TrainConfig(lr=0.4, backbone_lr_mult=0.5, warmup_steps=3, scheduler="cosine")  # a resumed run's own
    with caplog.at_level(logging.INFO, logger="shardfc.train"):
        apply_schedule(parts, cfg, 20, 7)
    fn = WarmupDecay(cfg, 20)
    for sched, peak in zip(parts.schedulers, (0.4 * 0.5, 0.4)):  # the backbone's peak is lr x the multiplier
        group = sched.optimizer.param_groups[0]
        assert group["initial_lr"] == peak and sched.base_lrs == [peak] and sched.last_epoch == 7
        assert group["lr"] == pytest.approx(peak * _expected(7, 3, 20, "cosine", 2.0), rel=1e-12)
        assert vars(sched.lr_lambdas[0]) == vars(fn)
    assert current_lr(parts) == parts.opt_backbone.param_groups[0]["lr"]
    assert caplog.messages == [
        "the schedule differs from the checkpoint's (lr 0.1, {'warmup': 2, 'total': 10, 'kind': 'poly', 'power': 2.0}); "
        "following this run's: lr 0.2, {'warmup': 3, 'total': 20, 'kind': 'cosine', 'power': 2.0}"]
    # the next scheduler step carries on from there
    for sched in parts.schedulers:
        sched.optimizer.step()
        sched.step()
    assert parts.opt_head.param_groups[0]["lr"] == pytest.approx(0.4 * _expected(8, 3, 20, "cosine", 2.0), rel=1e-12)


def test_apply_schedule_says_nothing_when_the_schedule_is_the_checkpoints(caplog):
    cfg = TrainConfig(lr=0.1, warmup_steps=2)
    parts = _parts(0.1, 0.1, cfg, 10)
    with caplog.at_level(logging.INFO, logger="shardfc.train"):
        apply_schedule(parts, cfg, 10, 5)
    assert caplog.messages == []
    assert parts.opt_head.param_groups[0]["lr"] == pytest.approx(0.1 * _expected(5, 2, 10, "poly", 2.0), rel=1e-12)


def test_apply_schedule_with_one_optimizer_a_pipeline_rank_without_the_head(caplog):
    cfg = TrainConfig(lr=0.1, warmup_steps=2)
    parts = _parts(0.1, 0.1, cfg, 10)
    parts.opt_head, parts.schedulers = None, parts.schedulers[:1]
    with caplog.at_level(logging.INFO, logger="shardfc.train"):
        apply_schedule(parts, TrainConfig(lr=0.3, warmup_steps=2), 10, 4)
    assert current_lr(parts) == pytest.approx(0.3 * _expected(4, 2, 10, "poly", 2.0), rel=1e-12)
    assert caplog.messages == [
        "the schedule differs from the checkpoint's (lr 0.1, {'warmup': 2, 'total': 10, 'kind': 'poly', 'power': 2.0}); "
        "following this run's: lr 0.3, {'warmup': 2, 'total': 10, 'kind': 'poly', 'power': 2.0}"]
