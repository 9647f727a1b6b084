"""Seeds derived from several integers, identically in every process.

Every random stream of shardfc (weight initialisation per block of classes, Partial FC sampling per
shard and step, per-rank augmentation, the synthetic data, the bench's inputs) takes its seed from
:func:`mix_seed` of the run's seed and the coordinates of the stream, so streams are independent,
reproducible and the same whatever the number of processes.
"""

from __future__ import annotations

import random

import numpy as np
import torch

__all__ = ["mix_seed", "seed_all"]

_MASK64 = (1 << 64) - 1


def _splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def mix_seed(*parts: int) -> int:
    """Hash integers into a 63-bit seed (torch seeds must fit a signed int64)."""
    h = 0
    for p in parts:
        h = _splitmix64(h ^ (int(p) & _MASK64))
    return h >> 1


def seed_all(seed: int) -> None:
    """Seed Python's, numpy's and torch's global generators."""
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)
