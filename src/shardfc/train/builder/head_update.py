"""Who applies the head's optimizer step in a training run: its backward (fused) or ``step()``.

One decision for every strategy, in the one builder (:func:`.build.build_model`), from the
configuration's ``head_update`` and what the run is: see
:meth:`shardfc.train.config.TrainConfig.head_update_not_fusable` for the conditions.
"""

from __future__ import annotations

import importlib.util
from typing import Optional

import torch

from shardfc.train.config import ConfigError, TrainConfig


def fused_head_update(cfg: TrainConfig, device: torch.device, amp_dtype: Optional[torch.dtype]) -> bool:
    """Whether the head's backward applies its optimizer's step (``cfg.head_update``): 'fused' where
    every condition holds (else a :class:`ConfigError` saying which fails), 'auto' where they do,
    'optimizer' never. The head still falls back to the optimizer's step by itself where a forward
    runs impl='torch' (``head.last_update``, logged, says which ran)."""
    if cfg.head_update == "optimizer":
        return False
    why = cfg.head_update_not_fusable(torch.device(device).type)
    if why is None and amp_dtype == torch.float16:
        why = "the run computes in fp16 (its loss scaler unscales and checks the stored gradient)"
    if why is None and importlib.util.find_spec("triton") is None:
        why = "Triton is not installed (pip install 'shardfc[gpu]')"
    if why is not None and cfg.head_update == "fused":
        raise ConfigError(f"head_update='fused': {why}; use head_update 'auto' or 'optimizer'")
    return why is None
