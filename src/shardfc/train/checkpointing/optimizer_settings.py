"""A resumed run trains with *its own* optimizer settings, not the checkpoint's.

Loading an optimizer's saved state (torch's ``load_state_dict``, the head's
:func:`~shardfc.head.partial_fc.load_optimizer_rows`) also restores its param groups: the saving run's
momentum, weight decay, Nesterov, betas, eps, rounding, and torch's implementation choices (``fused``,
``foreach``) made for the saving run's device. A run resumed with ``--weight-decay 0.05`` would train
on with the checkpoint's 5e-4 and say nothing: a flag dropped. As :func:`~shardfc.train.schedule.apply_schedule`
does for the learning rate, :func:`keep_run_settings` notes each group's settings as this run built
them, before anything is loaded, and :func:`restore_run_settings` puts them back afterwards, with one
log line naming what differed from the checkpoint. The moments, momentum buffers and step counts (the
optimizer's *state*) stay the checkpoint's.
"""

from __future__ import annotations

import logging
from typing import Any, Dict, List, Optional, Sequence

import torch

logger = logging.getLogger("shardfc.train")

#: Param-group entries that are not settings: the parameters, what the schedule sets
#: (``apply_schedule``), and the row-sparse optimizers' count of rounding draws (state, kept).
NOT_SETTINGS = frozenset({"params", "lr", "initial_lr", "rounding_step"})

#: The settings a user sets (flags of ``shardfc train``); a change in any other (``fused``, ``foreach``:
#: torch's choice for this run's device) is applied without a word.
NAMED = ("momentum", "nesterov", "weight_decay", "betas", "eps", "rounding", "rounding_seed")

Settings = List[List[Dict[str, Any]]]


def keep_run_settings(optimizers: Sequence[Optional[torch.optim.Optimizer]]) -> Settings:
    """Each optimizer's param groups' settings as built for this run (``[]`` for a None)."""
    return [
        [{k: v for k, v in group.items() if k not in NOT_SETTINGS} for group in opt.param_groups] if opt else []
        for opt in optimizers
    ]


def restore_run_settings(optimizers: Sequence[Optional[torch.optim.Optimizer]], kept: Settings,
                         names: Sequence[str] = ("backbone", "head")) -> Dict[str, Any]:
    """Put ``kept`` back into ``optimizers``' param groups; returns ``{"<name>.<key>": (saved, this
    run's)}`` for each named setting that the loaded state had changed, logged in one line."""
    changed: Dict[str, Any] = {}
    for opt, groups, name in zip(optimizers, kept, names):
        if opt is None:
            continue
        for i, (group, mine) in enumerate(zip(opt.param_groups, groups)):
            where = name if len(opt.param_groups) == 1 else f"{name}[{i}]"
            for key, value in mine.items():
                if key in NAMED and key in group and _differs(group[key], value):
                    changed.setdefault(f"{where}.{key}", (group[key], value))
                group[key] = value
    if changed:
        logger.info(
            "the optimizer settings differ from the checkpoint's (%s); following this run's: %s",
            ", ".join(f"{k} {_show(v[0])}" for k, v in changed.items()),
            ", ".join(f"{k} {_show(v[1])}" for k, v in changed.items()),
        )
    return changed


def _differs(saved: Any, mine: Any) -> bool:
    if isinstance(saved, (list, tuple)) and isinstance(mine, (list, tuple)):
        return list(saved) != list(mine)
    return saved != mine


def _show(value: Any) -> str:
    return f"{tuple(value)}" if isinstance(value, (list, tuple)) else f"{value!r}"


__all__ = ["NAMED", "NOT_SETTINGS", "keep_run_settings", "restore_run_settings"]
