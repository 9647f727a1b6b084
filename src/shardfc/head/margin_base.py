"""What every margin shares: the :class:`Margin` interface and ``sin θ`` from ``cos θ``.

The margins themselves live in :mod:`shardfc.head.margins` (ArcFace, CosFace, SphereFace, ...) and
:mod:`shardfc.head.adaptive_margins` (AdaFace, MagFace); both build on this module, and
``shardfc.head.margins`` re-exports :class:`Margin`.
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch
from torch import Tensor

from shardfc.checks import FLOAT32_MAX, check_real

__all__ = ["Margin", "TargetLogit", "check_scale", "sin_from_cos"]

TargetLogit = Tuple[Tensor, Tensor, Optional[Tensor]]


def check_scale(scale) -> float:
    """A margin's ``scale`` as a finite float in ``(0, float32's largest]``: the logits are ``s·cos θ``
    in fp32, so a larger scale made each one inf (a NaN loss, or torch's "cannot be converted to type
    float without overflow" in the first forward)."""
    s = check_real("scale", scale, positive=True)
    if s > FLOAT32_MAX:
        raise ValueError(f"scale must be at most {FLOAT32_MAX:.4g} (float32's largest: the logits are fp32), got {scale!r}")
    return s


def sin_from_cos(c: Tensor) -> Tensor:
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
