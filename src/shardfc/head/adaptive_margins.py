"""Margins that adapt per sample to the feature norm before normalisation: AdaFace and MagFace.

Both read ``‖x‖``, the embedding's norm before L2 normalisation (a proxy of image quality). The
head computes it on each rank's local batch, gathers it with the embeddings (its gradient goes
back through the same reduce-scatter) and hands it to :meth:`Margin.target` as ``norm``; the
margin only touches the target logit, so it works unchanged in the chunked and Partial FC modes.

* AdaFace (Kim et al., "AdaFace: Quality Adaptive Margin for Face Recognition", CVPR 2022):
  ``ẑ = clip(h·(‖x‖ − μ)/(σ + 10⁻³), −1, 1)`` with ``μ, σ`` running statistics of the batch's norms
  (momentum 0.01); target ``s·(cos(clip(θ − m·ẑ, 0, π)) − (m + m·ẑ))``. ``ẑ`` is a constant to the
  gradient (the paper stops it), so the norm gets no gradient.
* MagFace (Meng et al., "MagFace: A Universal Representation for Face Recognition and Quality
  Assessment", CVPR 2021): ``a = clip(‖x‖, l_a, u_a)``, margin ``m(a)`` linear from ``l_m`` to
  ``u_m``; target ``s·cos(θ + m(a))`` (ArcFace's fallback ``cos θ − m·sin m`` past ``π − m``), plus
  the per-sample regulariser ``λ_g·(a/u_a² + 1/a)`` on the loss. Both depend on ``a``: the norm
  gets their gradient (inside ``[l_a, u_a]``).
"""

from __future__ import annotations

import math
from typing import Dict, Optional

import torch
from torch import Tensor

from shardfc.checks import check_real
from shardfc.head.margin_base import Margin, check_scale, sin_from_cos

__all__ = ["AdaFace", "MagFace"]


def _statistic(name: str, value, std: bool) -> float:
    """A running statistic of AdaFace as a float: finite (a NaN mean or std makes every sample's
    quality, and so every target logit and the loss, NaN), the std not negative (it would turn the
    quality around: a sharp image would count as a blurred one). A one-element tensor is read as
    its number."""
    if isinstance(value, Tensor) and value.numel() == 1:
        value = value.item()
    return check_real(name, value, nonnegative=std)


class AdaFace(Margin):
    """AdaFace's quality-adaptive margin (defaults: the paper's ``m=0.4, h=0.333, s=64``).

    ``norm_mean`` / ``norm_std`` are the running statistics (initial 20 and 100, as the authors'
    code); the head updates them in training mode with :meth:`update_statistics` from the global
    batch's norms, so every rank holds the same values, and saves them in its sharded state. Once
    updated from a batch they live on its device (a ``[2]`` float64 tensor the margin reads there),
    so a step reads nothing back to the host; reading ``norm_mean`` / ``norm_std`` or :meth:`state`
    copies them to the host (a sync on a GPU: at checkpoint time, not in a step).
    """

    normalize_embeddings = True
    normalize_weights = True
    needs_norm = True
    uses_feature_norm = True
    #: Norms are clipped to this range before the statistics and the margin (the authors' code).
    NORM_CLIP = (0.001, 100.0)
    STD_EPS = 1e-3

    def __init__(self, scale: float = 64.0, margin: float = 0.4, h: float = 0.333, momentum: float = 0.01):
        self.s = check_scale(scale)
        self.m = check_real("margin", margin, nonnegative=True)
        self.h = check_real("h", h, nonnegative=True)
        self.momentum = check_real("momentum", momentum, nonnegative=True)
        if self.momentum > 1:
            raise ValueError(f"momentum must be in [0, 1], got {momentum!r}")
        self._stats: Tensor = torch.tensor([20.0, 100.0], dtype=torch.float64)  # mean, std; moves to the norms' device

    def _params(self) -> dict:
        return {k: v for k, v in vars(self).items() if not k.startswith("_")}

    @property
    def norm_mean(self) -> float:
        return float(self._stats[0])

    @norm_mean.setter
    def norm_mean(self, value: float) -> None:
        self._stats = self._stats.clone()
        self._stats[0] = _statistic("norm_mean", value, std=False)

    @property
    def norm_std(self) -> float:
        return float(self._stats[1])

    @norm_std.setter
    def norm_std(self, value: float) -> None:
        self._stats = self._stats.clone()
        self._stats[1] = _statistic("norm_std", value, std=True)

    def _stats_on(self, device: torch.device) -> Tensor:
        """The statistics on ``device`` (moved there for good: every later step reads them there)."""
        if self._stats.device != device:
            self._stats = self._stats.to(device)
        return self._stats

    @property
    def scale(self) -> float:
        return self.s

    def state(self) -> Dict[str, float]:
        """The running statistics of the feature norms, ``{"norm_mean", "norm_std"}`` (saved in
        checkpoints)."""
        return {"norm_mean": self.norm_mean, "norm_std": self.norm_std}

    def load_state(self, state: Dict[str, float]) -> None:
        """Restore what :meth:`state` returned (raises KeyError if a key is missing, ValueError if
        a statistic is not a finite number or the std is negative)."""
        mean, std = (_statistic(f"AdaFace's saved {key}", state[key], std=key == "norm_std")
                     for key in ("norm_mean", "norm_std"))
        self._stats = torch.tensor([mean, std], dtype=torch.float64).to(self._stats.device)

    @torch.no_grad()
    def update_statistics(self, norms: Tensor, valid: Optional[Tensor] = None) -> None:
        """One momentum step of the running mean and (unbiased) std from a batch's feature norms
        (those where ``valid``, bool ``[B]``, is set; all without it); a batch of fewer than 2 such
        samples has no std and leaves both unchanged. On the norms' device, by masks: no host read."""
        if norms.device.type == "meta":  # shapes only (shardfc plan): no values to step on
            return
        safe = norms.double().clamp(*self.NORM_CLIP)
        weight = torch.ones_like(safe) if valid is None else valid.to(safe.device, torch.float64)
        n = weight.sum()
        mean = (safe * weight).sum() / n.clamp(min=1)
        std = (((safe - mean) * weight).square().sum() / (n - 1).clamp(min=1)).sqrt()
        old = self._stats_on(safe.device)
        a = self.momentum
        new = a * torch.stack([mean, std]) + (1 - a) * old
        self._stats = torch.where(n >= 2, new, old)

    def quality(self, norm: Tensor) -> Tensor:
        """``ẑ``, the normalised feature norm in ``[−1, 1]``."""
        if norm.device.type == "meta":  # shapes only (shardfc plan): the values stay where they are
            stats = torch.empty(2, dtype=torch.float64, device="meta")
        else:
            stats = self._stats_on(norm.device)
        z = (norm.clamp(*self.NORM_CLIP) - stats[0].to(norm.dtype)) / (stats[1].to(norm.dtype) + self.STD_EPS)
        return (z * self.h).clamp(-1.0, 1.0)

    def target(self, raw, norm=None):
        if norm is None:
            raise ValueError("AdaFace.target needs the feature norms (norm=None given)")
        q = self.quality(norm)
        c = raw.clamp(-1.0, 1.0)
        angle = torch.acos(c) - self.m * q
        inside = (angle > 0) & (angle < math.pi)
        value = torch.cos(angle.clamp(0.0, math.pi)) - self.m * (1.0 + q)
        # d cos(θ − m·ẑ)/d cos θ = sin(θ − m·ẑ)/sin θ; 0 where the angle is clipped.
        grad = torch.where(inside, torch.sin(angle) / sin_from_cos(c), torch.zeros_like(c))
        return self.s * value, self.s * grad, torch.zeros_like(c)


class MagFace(Margin):
    """MagFace's magnitude-aware margin and regulariser (defaults: the paper's ``l_a=10, u_a=110,
    l_m=0.45, u_m=0.8, λ_g=35``, ``s=64``)."""

    normalize_embeddings = True
    normalize_weights = True
    needs_norm = True
    uses_feature_norm = True

    def __init__(
        self,
        scale: float = 64.0,
        l_a: float = 10.0,
        u_a: float = 110.0,
        l_m: float = 0.45,
        u_m: float = 0.8,
        lambda_g: float = 35.0,
    ):
        self.s = check_scale(scale)
        self.l_a = check_real("l_a", l_a, positive=True)
        self.u_a = check_real("u_a", u_a, positive=True)
        if self.u_a <= self.l_a:
            raise ValueError(f"u_a must be > l_a={l_a!r}, got {u_a!r}")
        self.l_m = check_real("l_m", l_m, nonnegative=True)
        self.u_m = check_real("u_m", u_m, nonnegative=True)
        if self.u_m < self.l_m:
            raise ValueError(f"u_m must be >= l_m={l_m!r}, got {u_m!r}")
        if self.u_m >= math.pi / 2:
            raise ValueError(f"u_m must be < pi/2, got {u_m!r}")
        self.lambda_g = check_real("lambda_g", lambda_g, nonnegative=True)

    @property
    def scale(self) -> float:
        return self.s

    def _magnitude(self, norm: Tensor):
        """``a = clip(‖x‖, l_a, u_a)`` and ``da/d‖x‖`` (1 inside, 0 where clipped)."""
        a = norm.clamp(self.l_a, self.u_a)
        inside = (norm > self.l_a) & (norm < self.u_a)
        return a, inside.to(norm.dtype)

    def margin_of(self, norm: Tensor) -> Tensor:
        """The margin ``m(a)`` of each sample, ``[B]``, from its feature norm ``[B]``: linear from
        ``l_m`` at ``l_a`` to ``u_m`` at ``u_a``, the norm clipped to ``[l_a, u_a]``."""
        a, _ = self._magnitude(norm)
        return (self.u_m - self.l_m) / (self.u_a - self.l_a) * (a - self.l_a) + self.l_m

    def target(self, raw, norm=None):
        if norm is None:
            raise ValueError("MagFace.target needs the feature norms (norm=None given)")
        _, da = self._magnitude(norm)
        m = self.margin_of(norm)
        dm = da * (self.u_m - self.l_m) / (self.u_a - self.l_a)
        c = raw.clamp(-1.0, 1.0)
        sin = sin_from_cos(c)
        cos_m, sin_m = torch.cos(m), torch.sin(m)
        value = c * cos_m - sin * sin_m
        d_raw = cos_m + c * sin_m / sin
        d_m = -c * sin_m - sin * cos_m
        past_pi = c < torch.cos(math.pi - m)  # θ > π − m
        value = torch.where(past_pi, c - m * sin_m, value)
        d_raw = torch.where(past_pi, torch.ones_like(c), d_raw)
        d_m = torch.where(past_pi, -(sin_m + m * cos_m), d_m)
        return self.s * value, self.s * d_raw, self.s * d_m * dm

    def regularizer(self, norm):
        """MagFace's per-sample term ``λ_g·(a/u_a² + 1/a)`` and its derivative in the norm, each
        ``[B]`` (``a``: the norm clipped to ``[l_a, u_a]``; no gradient where clipped)."""
        a, da = self._magnitude(norm)
        g = a / self.u_a**2 + 1.0 / a
        dg = (1.0 / self.u_a**2 - 1.0 / (a * a)) * da
        return self.lambda_g * g, self.lambda_g * dg
