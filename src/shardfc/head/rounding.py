"""Rounding an fp32 update back into low-precision (bf16 / fp16) storage.

Class centres kept in bf16 lose any update smaller than half a unit in the last place of the
weight (with ``|w| ≈ 0.01`` a bf16 ulp is ~6e-5): rounded to nearest, ``w - lr·g`` is ``w`` again
and the centre stops learning. The head's optimizers therefore compute each update in fp32 and
round the result once; stochastic rounding rounds up with probability equal to the distance to the
lower neighbour over the gap, so the stored value is the fp32 result *in expectation* and small
updates survive on average.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

ROUNDINGS = ("nearest", "stochastic")


def check_rounding(rounding: str) -> str:
    """``rounding`` if it is one of :data:`ROUNDINGS`, else a ValueError naming it."""
    if rounding not in ROUNDINGS:
        raise ValueError(f"rounding must be one of {', '.join(map(repr, ROUNDINGS))}, got {rounding!r}")
    return rounding


def stochastic_round(x: Tensor, dtype: torch.dtype, generator: Optional[torch.Generator] = None) -> Tensor:
    """``x`` (fp32/fp64) rounded to ``dtype`` up or down at random, unbiased: E[result] = x.

    The two candidates are the nearest ``dtype`` value and its neighbour on the other side of ``x``;
    the neighbour is taken with probability ``|x − nearest| / |neighbour − nearest|``. Draws come from
    ``generator`` (on ``x``'s device), so a seed reproduces the result. NaN stays NaN; a value whose
    neighbour overflows rounds to nearest.
    """
    near = x.to(dtype)
    near_x = near.to(x.dtype)
    beyond = torch.where(near_x > x, float("-inf"), float("inf")).to(dtype)
    other = torch.nextafter(near, beyond)
    gap = other.to(x.dtype) - near_x
    prob = torch.nan_to_num((x - near_x) / gap, nan=0.0, posinf=0.0, neginf=0.0)
    u = torch.rand(x.shape, generator=generator, dtype=x.dtype, device=x.device)
    return torch.where(u < prob, other, near)


def round_to(x: Tensor, dtype: torch.dtype, rounding: str, generator: Optional[torch.Generator]) -> Tensor:
    """``x`` in ``dtype``: as is when it already is, else rounded to nearest or stochastically."""
    if x.dtype == dtype:
        return x
    if rounding == "stochastic" and dtype in (torch.bfloat16, torch.float16):
        return stochastic_round(x, dtype, generator)
    return x.to(dtype)


def update_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype an update of a ``dtype`` parameter is computed in: at least fp32."""
    return torch.promote_types(dtype, torch.float32)


__all__ = ["ROUNDINGS", "check_rounding", "stochastic_round", "round_to", "update_dtype"]
