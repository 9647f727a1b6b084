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
feature norm before normalisation, live in :mod:`shardfc.head.adaptive_margins` and are exported here.
"""

from __future__ import annotations

import math
import numbers
from typing import Optional, Tuple

import torch
from torch import Tensor

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

TargetLogit = Tuple[Tensor, Tensor, Optional[Tensor]]


def _check_real(name: str, value, *, positive: bool = False, nonnegative: bool = False) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be a real number, got {value!r} ({type(value).__name__})")
    value = float(value)
    if not math.isfinite(value):
        raise ValueError(f"{name} must be finite, got {value!r}")
    if positive and value <= 0:
        raise ValueError(f"{name} must be > 0, got {value!r}")
    if nonnegative and value < 0:
        raise ValueError(f"{name} must be >= 0, got {value!r}")
    return value


def _sin_from_cos(c: Tensor) -> Tensor:
    """sin θ for θ = arccos c, kept away from 0 so that d/dc arccos stays finite at |c| = 1."""
    eps = torch.finfo(c.dtype).eps
    return torch.sqrt(torch.clamp(1.0 - c * c, min=eps))


class Margin:
    """Base class. Subclasses set the normalisation flags and implement :meth:`target`."""

    #: L2-normalise the embedding before the product.
    normalize_embeddings: bool = True
    #: L2-normalise the class centres before the product.
    normalize_weights: bool = True
    #: :meth:`target` needs the embedding norm.
    needs_norm: bool = False
    #: That norm is the feature norm *before* normalisation (AdaFace, MagFace): the head passes it
    #: through the sharded loss as an input of its own, and gradients flow back to it.
    uses_feature_norm: bool = False

    @property
    def scale(self) -> float:
        """Multiplier of the non-target products."""
        raise NotImplementedError

    def target(self, raw: Tensor, norm: Optional[Tensor] = None) -> TargetLogit:
        """Target logits for target products ``raw`` ``[N]``: ``(value, d value/d raw, d value/d norm)``."""
        raise NotImplementedError

    def regularizer(self, norm: Tensor) -> Optional[Tuple[Tensor, Tensor]]:
        """A per-sample term added to the loss, a function of the feature norm: ``(value, d/d norm)``
        (MagFace), or None."""
        return None

    def _params(self) -> dict:
        """The hyper-parameters (what repr, == and hash compare; running state excluded)."""
        return dict(vars(self))

    def __repr__(self) -> str:
        fields = ", ".join(f"{k}={v!r}" for k, v in self._params().items())
        return f"{type(self).__name__}({fields})"

    def __eq__(self, other) -> bool:
        return type(self) is type(other) and self._params() == other._params()

    def __hash__(self) -> int:
        return hash((type(self).__name__, tuple(sorted(self._params().items()))))


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
        self.s = _check_real("scale", scale, positive=True)

    @property
    def scale(self) -> float:
        return self.s

    def target(self, raw, norm=None):
        return self.s * raw, torch.full_like(raw, self.s), None


class CosFace(Margin):
    """CosFace / AM-Softmax: target ``s · (cos θ − m)``."""

    def __init__(self, scale: float = 64.0, margin: float = 0.35):
        self.s = _check_real("scale", scale, positive=True)
        self.m = _check_real("margin", margin, nonnegative=True)

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
        self.s = _check_real("scale", scale, positive=True)
        self.m = _check_real("margin", margin, nonnegative=True)
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
        sin = _sin_from_cos(c)
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
        self.s = _check_real("scale", scale, positive=True)
        self.m1 = _check_real("m1", m1, positive=True)
        self.m2 = _check_real("m2", m2)
        self.m3 = _check_real("m3", m3)

    @property
    def scale(self) -> float:
        return self.s

    def target(self, raw, norm=None):
        c = raw.clamp(-1.0, 1.0)
        theta = torch.acos(c)
        angle = self.m1 * theta + self.m2
        value = torch.cos(angle) - self.m3
        grad = self.m1 * torch.sin(angle) / _sin_from_cos(c)
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
        self.lambda_ = _check_real("lambda_", lambda_, nonnegative=True)

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


from shardfc.head.adaptive_margins import AdaFace, MagFace  # noqa: E402  (they subclass Margin)

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
