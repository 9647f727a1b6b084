"""Dense float64 references for sub-center ArcFace, inter-class filtering, AdaFace and MagFace.

Written from the papers with full ``[B, C]`` logits and autograd (no code shared with the sharded
kernels): Sub-center ArcFace (Deng et al., ECCV 2020) takes a class's logit as the max over its K
centres; inter-class filtering masks negatives close to the target centre; AdaFace (Kim et al.,
CVPR 2022) eq. 9-10; MagFace (Meng et al., CVPR 2021) eq. 4-6.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from shardfc import margins as M


def _target_logit(margin, c, norm):
    """The margin's target logit for target cosines ``c`` and feature norms ``norm`` (both [N])."""
    s = margin.s
    if isinstance(margin, M.NormSoftmax):
        return s * c
    if isinstance(margin, M.CosFace):
        return s * (c - margin.m)
    if isinstance(margin, M.ArcFace):
        theta = torch.acos(c.clamp(-1, 1))
        phi = torch.where(theta <= math.pi - margin.m, torch.cos(theta + margin.m), c - margin.m * math.sin(margin.m))
        return s * phi
    if isinstance(margin, M.AdaFace):
        # ẑ: the batch-normalised feature norm, a constant to the gradient (stop-gradient).
        safe = norm.detach().clamp(0.001, 100.0)
        q = (margin.h * (safe - margin.norm_mean) / (margin.norm_std + 1e-3)).clamp(-1, 1)
        g_angle, g_add = -margin.m * q, margin.m * q + margin.m
        theta = torch.acos(c.clamp(-1, 1))
        return s * (torch.cos((theta + g_angle).clamp(0, math.pi)) - g_add)
    if isinstance(margin, M.MagFace):
        a = norm.clamp(margin.l_a, margin.u_a)
        m = (margin.u_m - margin.l_m) / (margin.u_a - margin.l_a) * (a - margin.l_a) + margin.l_m
        theta = torch.acos(c.clamp(-1, 1))
        return s * torch.where(theta <= math.pi - m, torch.cos(theta + m), c - m * torch.sin(m))
    raise TypeError(f"no dense reference for {margin!r}")


def dense_loss(
    x, weight, labels, margin, *, subcenters=1, filter_threshold=None, ignore_index=-1, reduction="mean",
    classes=None,
):
    """Loss of the sharded head on one process. ``weight``: every centre row ``[C·K, D]``, class-major.
    ``classes``: score only these classes (Partial FC's sample; labels must be among them)."""
    K = subcenters
    C = weight.shape[0] // K
    norm = torch.linalg.vector_norm(x, dim=1)
    centres = F.normalize(weight, dim=1).view(C, K, -1)
    if classes is None:
        classes = torch.arange(C)
    centres = centres[classes]
    cos_all = torch.einsum("bd,ckd->bck", F.normalize(x, dim=1), centres)
    cos = cos_all.amax(dim=2)  # a class's best centre
    valid = labels != ignore_index
    col = torch.searchsorted(classes, labels.clamp(min=0))
    rows = torch.nonzero(valid).squeeze(1)
    logits = margin.s * cos
    logits = logits.index_put((rows, col[rows]), _target_logit(margin, cos[rows, col[rows]], norm[rows]))
    if filter_threshold is not None:
        with torch.no_grad():
            best = cos_all[rows, col[rows]].argmax(dim=1)
            target_centre = centres[col[rows], best]  # [N, D]
            near = torch.einsum("nd,ckd->nck", target_centre, centres).amax(dim=2) > filter_threshold
            near[torch.arange(rows.numel()), col[rows]] = False
            mask = torch.zeros_like(logits, dtype=torch.bool)
            mask[rows] = near
        logits = logits.masked_fill(mask, float("-inf"))
    losses = torch.zeros_like(norm)
    losses = losses.index_put((rows,), F.cross_entropy(logits[rows], col[rows], reduction="none"))
    reg = margin.regularizer(norm) if isinstance(margin, M.MagFace) else None
    if reg is not None:  # the dense form of λ_g·g(a), a = clip(‖x‖, l_a, u_a)
        a = norm.clamp(margin.l_a, margin.u_a)
        losses = losses + torch.where(valid, margin.lambda_g * (a / margin.u_a**2 + 1 / a), torch.zeros_like(a))
    if reduction == "none":
        return losses
    if reduction == "sum":
        return losses.sum()
    return losses.sum() / valid.sum().clamp(min=1)
