"""Row-wise L2 normalisation with a gradient that stays finite for zero rows.

``torch.nn.functional.normalize`` divides by ``max(‖x‖, eps)``, so a zero row gets a gradient of
size ``1/eps`` (1e12). A zero embedding has ``cos θ = 0`` with every class and no meaningful
direction, so here it simply receives no gradient.
"""

from __future__ import annotations

from typing import Tuple

import torch
from torch import Tensor

#: Rows with a smaller L2 norm are treated as zero vectors (the eps of F.normalize).
NORM_EPS = 1e-12


def normalized_rows(w: Tensor) -> Tuple[Tensor, Tensor]:
    """``w / max(‖w‖, eps)`` row-wise, and the norms."""
    norm = torch.linalg.vector_norm(w, dim=1)
    return w * norm.clamp(min=NORM_EPS).reciprocal().unsqueeze(1), norm


def normalized_rows_backward_(grad_hat: Tensor, w_hat: Tensor, norm: Tensor) -> Tensor:
    """Gradient through :func:`normalized_rows`, ``(g − ŵ(ŵ·g)) / ‖w‖``, written over ``grad_hat``.

    Rows below ``NORM_EPS`` get none. Three in-place passes over ``[n, D]`` (a batched dot, a
    fused multiply-add, a scale): this runs on a whole weight shard every step.
    """
    dot = torch.bmm(w_hat.unsqueeze(1), grad_hat.unsqueeze(2)).view(-1, 1)
    inv = torch.where(norm >= NORM_EPS, norm.clamp(min=NORM_EPS).reciprocal(), torch.zeros_like(norm))
    return grad_hat.addcmul_(w_hat, dot, value=-1.0).mul_(inv.unsqueeze(1))


class _L2Normalize(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor) -> Tensor:
        # Low-precision inputs (bf16/fp16 under autocast) are normalised in fp32.
        xf = x.float() if x.dtype in (torch.float16, torch.bfloat16) else x
        y, norm = normalized_rows(xf)
        ctx.save_for_backward(y, norm)
        ctx.in_dtype = x.dtype
        return y.to(x.dtype)

    @staticmethod
    def backward(ctx, grad: Tensor) -> Tensor:
        y, norm = ctx.saved_tensors
        return normalized_rows_backward_(grad.to(y.dtype, copy=True), y, norm).to(ctx.in_dtype)


def l2_normalize(x: Tensor) -> Tensor:
    """Rows of ``x`` scaled to unit L2 norm (zero rows stay zero and get no gradient)."""
    return _L2Normalize.apply(x)
