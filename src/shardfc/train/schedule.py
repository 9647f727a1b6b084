"""The learning-rate schedule: linear warm-up, then polynomial or cosine decay, per optimizer step."""

from __future__ import annotations

import logging
import math

from shardfc.train.config import TrainConfig
from shardfc.train.state import Parts

logger = logging.getLogger("shardfc.train")


class WarmupDecay:
    """LR multiplier at step t: linear warm-up to 1, then poly ``(1 - p)^power`` or cosine to 0.

    A callable object rather than a lambda so that LambdaLR's state_dict stores its fields.
    """

    def __init__(self, cfg: TrainConfig, total_steps: int) -> None:
        self.warmup = cfg.warmup_steps
        self.total = total_steps
        self.kind = cfg.scheduler
        self.power = cfg.poly_power

    def __call__(self, step: int) -> float:
        if step < self.warmup:
            return (step + 1) / (self.warmup + 1)
        span = max(self.total - self.warmup, 1)
        progress = min(max(step - self.warmup, 0) / span, 1.0)
        if self.kind == "cosine":
            return 0.5 * (1.0 + math.cos(math.pi * progress))
        return (1.0 - progress) ** self.power


def apply_schedule(parts: Parts, cfg: TrainConfig, total_steps: int, step: int) -> None:
    """Put the schedulers at ``step`` of *this* run's schedule.

    A loaded scheduler state carries the saving run's peak lr, warm-up and length; the current
    config wins so that a resumed run can, e.g., be extended with a larger --max-steps.
    """
    saved = parts.schedulers[0]
    before = (saved.base_lrs[0], vars(saved.lr_lambdas[0]))
    for s in parts.schedulers:
        # The backbone's peak is lr x backbone_lr_mult (fine-tuning), the head's lr.
        peak = cfg.lr * (cfg.backbone_lr_mult if s.optimizer is parts.opt_backbone else 1.0)
        s.lr_lambdas = [WarmupDecay(cfg, total_steps) for _ in s.optimizer.param_groups]
        s.base_lrs = [peak for _ in s.optimizer.param_groups]
        s.last_epoch = step
        for group, fn in zip(s.optimizer.param_groups, s.lr_lambdas):
            group["initial_lr"] = peak
            group["lr"] = peak * fn(step)
    if before != (saved.base_lrs[0], vars(parts.schedulers[0].lr_lambdas[0])):
        logger.info(
            "the schedule differs from the checkpoint's (lr %g, %s); following this run's: lr %g, %s",
            before[0], before[1], saved.base_lrs[0], vars(parts.schedulers[0].lr_lambdas[0]),
        )


def current_lr(parts: Parts) -> float:
    return parts.opt_backbone.param_groups[0]["lr"]
