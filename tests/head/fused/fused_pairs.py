"""One head step under ``impl="torch"`` and ``impl="triton"`` on the same weights and inputs."""

from __future__ import annotations

import copy
from typing import Dict, Optional

import torch

import shardfc
from shardfc import margins as M

#: Compiled kernels on a GPU when there is one, else the interpreter on the CPU (see conftest.py).
DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
C, D = 53, 24  # 53 classes: two class splits under the interpreter, a partial last tile
MARGINS = {
    "softmax": M.Softmax(),
    "normsoftmax": M.NormSoftmax(16.0),
    "cosface": M.CosFace(64.0, 0.35),
    "arcface": M.ArcFace(64.0, 0.5),
    "arcface_easy": M.ArcFace(32.0, 0.5, easy_margin=True),
    "combined": M.Combined(32.0, 0.9, 0.4, 0.15),
    "sphereface": M.SphereFace(4),
    "sphereface_lambda": M.SphereFace(2, lambda_=1.5),
    "adaface": M.AdaFace(),
    "magface": M.MagFace(),
}


def data(B: int = 29, seed: int = 3, ignore: bool = True, low: int = 0, high: int = C, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(B, D, generator=g, dtype=torch.float64) * 3
    y = torch.randint(low, high, (B,), generator=g)
    if ignore:
        y[::7] = -1
    up = torch.randn(B, generator=g, dtype=torch.float64)
    return x.to(dtype), y, up.to(dtype)


def step(impl: str, x, y, up, *, margin: str = "arcface", autocast: Optional[torch.dtype] = None,
         steps: int = 1, grad_first: bool = False, **head_kw) -> Dict[str, torch.Tensor]:
    """Loss, embedding gradient and weight gradient (dense ``.grad`` or the sparse rows) of
    ``steps`` forward/backward passes without zeroing (the weight gradient accumulates)."""
    head = shardfc.ShardedMarginHead(D, C, margin=_fresh(margin), impl=impl, device=DEVICE, **head_kw)
    if grad_first:  # an existing .grad: the weight gradient is added into it in place
        head.weight.grad = torch.full_like(head.weight, 0.25)
    xr = x.to(DEVICE, copy=True).requires_grad_()
    y, up = y.to(DEVICE), up.to(DEVICE)
    for _ in range(steps):
        with torch.autocast(DEVICE.type, dtype=autocast, enabled=autocast is not None):
            loss = head(xr, y)
        loss.backward(up if loss.dim() else None)
    out = {"loss": loss.detach().double().cpu(), "grad_x": xr.grad.double().cpu(), "impl": head.last_impl}
    if head.sparse_grad:
        taken = head.take_sampled_rows()[head.weight]
        out["rows"], out["grad_w"] = taken.rows.cpu(), taken.values.double().cpu()
    else:
        out["grad_w"] = head.weight.grad.double().cpu()
    return out


def _fresh(name: str) -> M.Margin:
    """A new margin object (AdaFace's running statistics must start equal on both heads)."""
    return copy.deepcopy(MARGINS[name])


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    if b.numel() == 0:
        return 0.0
    return float((a - b).abs().max() / b.abs().max().clamp(min=1e-30))


def trainer_steps(parts, cfg, ctx, steps: int = 2) -> None:
    """``steps`` of ``shardfc train``'s step on built ``parts`` (zero both optimizers, backbone and
    head forward and backward on a seeded batch of 12 16×16 images, ``apply_gradients``)."""
    from shardfc.train.step import apply_gradients

    for step in range(steps):
        parts.opt_backbone.zero_grad()
        parts.opt_head.zero_grad(set_to_none=False)
        g = torch.Generator().manual_seed(step)
        images = torch.randn(12, 3, 16, 16, generator=g).to(DEVICE)
        labels = torch.randint(0, C, (12,), generator=g).to(DEVICE)
        parts.head(parts.backbone(images), labels).backward()
        apply_gradients(parts, cfg.grad_clip, ctx, head_grad_clip=cfg.head_grad_clip)
