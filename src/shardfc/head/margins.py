"""Margin-based softmax logits: ArcFace, CosFace / AM-Softmax, SphereFace, combined.

Every margin here works on the product ``raw = a · b`` of an embedding ``a`` and a class centre
``b`` (each L2-normalised or not, as the margin says) and changes only the *target* logit. A
margin answers two questions, used by every shard identically:

* ``scale``: non-target logits are ``scale * raw``;
* ``target(raw_t, norm)``: the target logit and its two partial derivatives, with respect to
  ``raw_t`` and to the embedding norm ``norm = ‖a‖`` (only SphereFace depends on the latter).

The derivatives are the true derivatives of the piecewise functions below (ArcFace's margin is not
treated as a constant), so the sharded loss can back-propagate without autograd over ``[B, C]``.

Usage::

    from shardfc import margins
    head = shardfc.ShardedMarginHead(512, 1_000_000, margin=margins.ArcFace(scale=64.0, margin=0.5))

References: ArcFace (Deng et al., CVPR 2019), CosFace (Wang et al., CVPR 2018), AM-Softmax
(Wang et al., IEEE SPL 2018), SphereFace (Liu et al., CVPR 2017), NormFace (Wang et al., 2017).
AdaFace (Kim et al., CVPR 2022) and MagFace (Meng et al., CVPR 2021), whose margins depend on the
feature norm before normalisation, live in :mod:`shardfc.head.adaptive_margins` and are exported here;
the interface they all implement, :class:`Margin`, lives in :mod:`shardfc.head.margin_base`.
"""

from __future__ import annotations

import math
import numbers

import torch

from shardfc.checks import check_real
from shardfc.head.adaptive_margins import AdaFace, MagFace
from shardfc.head.margin_base import Margin, check_scale, sin_from_cos

__all__ = [
    "Margin",
    "Softmax",
    "NormSoftmax",
    "CosFace",
    "AMSoftmax",
    "ArcFace",
    "SphereFace",
    "Combined",
    "AdaFace",
    "MagFace",
    "build_margin",
    "MARGINS",
]

class Softmax(Margin):
    """Plain softmax: logits ``x · wᵀ``; nothing normalised, no margin."""

    normalize_embeddings = False
    normalize_weights = False

    @property
    def scale(self) -> float:
        return 1.0

    def target(self, raw, norm=None):
        return raw, torch.ones_like(raw), None


class NormSoftmax(Margin):
    """NormFace: ``s · cos θ`` for every class, no margin."""

    def __init__(self, scale: float = 64.0):
        self.s = check_scale(scale)

    @property
    def scale(self) -> float:
        return self.s

    def target(self, raw, norm=None):
        return self.s * raw, torch.full_like(raw, self.s), None


class CosFace(Margin):
    """CosFace / AM-Softmax: target ``s · (cos θ − m)``."""

    def __init__(self, scale: float = 64.0, margin: float = 0.35):
        self.s = check_scale(scale)
        self.m = check_real("margin", margin, nonnegative=True)

    @property
    def scale(self) -> float:
        return self.s

    def target(self, raw, norm=None):
        return self.s * (raw - self.m), torch.full_like(raw, self.s), None


AMSoftmax = CosFace


class ArcFace(Margin):
    """ArcFace: target ``s · cos(θ + m)``.

    Where ``θ + m`` would pass π (``θ > π − m``) the target is ``s · (cos θ − m · sin m)`` instead,
    which keeps it decreasing in θ; with ``easy_margin`` the target is plain ``s · cos θ`` wherever
    ``cos θ ≤ 0``. The derivative ``d cos(θ+m)/d cos θ = cos m + cos θ · sin m / sin θ`` is exact
    except within machine epsilon of ``|cos θ| = 1`` where ``sin θ`` is kept from reaching 0.
    """

    def __init__(self, scale: float = 64.0, margin: float = 0.5, easy_margin: bool = False):
        self.s = check_scale(scale)
        self.m = check_real("margin", margin, nonnegative=True)
        if self.m >= math.pi:
            raise ValueError(f"margin must be < pi, got {margin!r}")
        if not isinstance(easy_margin, bool):
            raise TypeError(f"easy_margin must be a bool, got {easy_margin!r}")
        self.easy_margin = easy_margin

    @property
    def scale(self) -> float:
        return self.s

    def target(self, raw, norm=None):
        s, m = self.s, self.m
        c = raw.clamp(-1.0, 1.0)
        sin = sin_from_cos(c)
        value = c * math.cos(m) - sin * math.sin(m)
        grad = math.cos(m) + c * math.sin(m) / sin
        if self.easy_margin:
            keep = c <= 0
            value = torch.where(keep, c, value)
            grad = torch.where(keep, torch.ones_like(c), grad)
        else:
            past_pi = c < math.cos(math.pi - m)  # θ > π − m
            value = torch.where(past_pi, c - m * math.sin(m), value)
            grad = torch.where(past_pi, torch.ones_like(c), grad)
        return s * value, s * grad, None


class Combined(Margin):
    """insightface's combined margin: target ``s · (cos(m1·θ + m2) − m3)``.

    ``Combined(s, 1, 0, m)`` is CosFace and ``Combined(s, 1, m, 0)`` is ArcFace without its
    ``θ > π − m`` fallback.
    """

    def __init__(self, scale: float = 64.0, m1: float = 1.0, m2: float = 0.5, m3: float = 0.0):
        self.s = check_scale(scale)
        self.m1 = check_real("m1", m1, positive=True)
        self.m2 = check_real("m2", m2)
        self.m3 = check_real("m3", m3)

    @property
    def scale(self) -> float:
        return self.s

    def target(self, raw, norm=None):
        c = raw.clamp(-1.0, 1.0)
        theta = torch.acos(c)
        angle = self.m1 * theta + self.m2
        value = torch.cos(angle) - self.m3
        grad = self.m1 * torch.sin(angle) / sin_from_cos(c)
        return self.s * value, self.s * grad, None


class SphereFace(Margin):
    """SphereFace's A-Softmax: centres normalised, embeddings not.

    Non-target logits ``‖x‖ · cos θ``; target ``‖x‖ · (λ·cos θ + ψ(θ)) / (1 + λ)`` with
    ``ψ(θ) = (−1)^k · cos(mθ) − 2k``, ``k = ⌊mθ/π⌋``. ``cos(mθ)`` is the Chebyshev polynomial
    ``T_m(cos θ)`` and its derivative ``m · U_{m−1}(cos θ)``, so the gradient has no arccos
    singularity. ``lambda_`` is the annealing weight of the paper (0 = the full margin).
    """

    normalize_embeddings = False
    normalize_weights = True
    needs_norm = True

    def __init__(self, margin: int = 4, lambda_: float = 0.0):
        if isinstance(margin, bool) or not isinstance(margin, numbers.Real):
            raise TypeError(f"margin must be an integer >= 1, got {margin!r}")
        if float(margin) != int(margin) or int(margin) < 1:
            raise ValueError(f"margin must be an integer >= 1, got {margin!r}")
        self.m = int(margin)
        self.lambda_ = check_real("lambda_", lambda_, nonnegative=True)

    @property
    def scale(self) -> float:
        return 1.0

    def target(self, raw, norm=None):
        if norm is None:
            raise ValueError("SphereFace.target needs the embedding norms (norm=None given)")
        m, lam = self.m, self.lambda_
        safe_norm = norm.clamp(min=torch.finfo(norm.dtype).tiny)
        c = (raw / safe_norm).clamp(-1.0, 1.0)
        # Chebyshev recurrences: T_m(c) = cos(mθ), U_{m-1}(c) = sin(mθ) / sin θ.
        t_prev, t_cur = torch.ones_like(c), c
        u_prev, u_cur = torch.zeros_like(c), torch.ones_like(c)  # U_{-1}, U_0
        for _ in range(m - 1):
            t_prev, t_cur = t_cur, 2 * c * t_cur - t_prev
            u_prev, u_cur = u_cur, 2 * c * u_cur - u_prev
        k = torch.floor(m * torch.acos(c) / math.pi).clamp(0, m)
        sign = 1.0 - 2.0 * torch.remainder(k, 2)
        psi = sign * t_cur - 2 * k
        dpsi = sign * m * u_cur
        h = (lam * c + psi) / (1 + lam)
        dh = (lam + dpsi) / (1 + lam)
        # z = ‖x‖·h(raw/‖x‖): ∂z/∂raw = h'(c), ∂z/∂‖x‖ = h(c) − c·h'(c).
        return norm * h, dh, h - c * dh


MARGINS = {
    "softmax": Softmax,
    "normsoftmax": NormSoftmax,
    "cosface": CosFace,
    "amsoftmax": CosFace,
    "arcface": ArcFace,
    "sphereface": SphereFace,
    "combined": Combined,
    "adaface": AdaFace,
    "magface": MagFace,
}


def build_margin(name: str, **params) -> Margin:
    """Margin from its name (``arcface``, ``cosface``, ``amsoftmax``, ``sphereface``, ``combined``,
    ``adaface``, ``magface``, ``normsoftmax``, ``softmax``; case-insensitive) and keyword parameters."""
    key = str(name).lower().replace("-", "").replace("_", "")
    if key not in MARGINS:
        import difflib

        close = difflib.get_close_matches(key, MARGINS, n=1)
        hint = f"; did you mean {close[0]!r}?" if close else ""
        raise ValueError(f"margin name {name!r} is not one of {sorted(MARGINS)}{hint}")
    try:
        return MARGINS[key](**params)
    except TypeError as e:
        if "unexpected keyword" in str(e):
            raise TypeError(f"margin {name!r}: {e}") from None
        raise
