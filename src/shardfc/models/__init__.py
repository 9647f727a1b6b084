"""Embedding backbones and their registry.

Every backbone maps ``[N, 3, H, W]`` images to ``[N, embedding_dim]`` embeddings
ending in a BatchNorm1d; the (sharded) classifier and margin loss live elsewhere.
Each model records the resolution it expects in ``model.input_size``.
"""

from __future__ import annotations

import difflib
from typing import Any, Callable

from torch import nn

from shardfc.checks import check_positive_int
from shardfc.models.arcface_mbf import ArcfaceMobileFaceNet, mbf, mbf_large
from shardfc.models.glyphnet import GlyphNet, glyphnet
from shardfc.models.iresnet import IResNet, iresnet18, iresnet34, iresnet50, iresnet100
from shardfc.models.mobilefacenet import MobileFaceNet, mobilefacenet
from shardfc.models.resnet import ReIDResNet, resnet50
from shardfc.models.tiny import TinyNet, tiny

__all__ = [
    "BACKBONES",
    "WITH_FEATURES",
    "ArcfaceMobileFaceNet",
    "GlyphNet",
    "IResNet",
    "MobileFaceNet",
    "ReIDResNet",
    "TinyNet",
    "build_backbone",
    "input_size",
]

BACKBONES: dict[str, Callable[..., nn.Module]] = {
    "glyphnet": glyphnet,
    "iresnet18": iresnet18,
    "iresnet34": iresnet34,
    "iresnet50": iresnet50,
    "iresnet100": iresnet100,
    "mbf": mbf,
    "mbf_large": mbf_large,
    "mobilefacenet": mobilefacenet,
    "resnet50": resnet50,
    "tiny": tiny,
}

#: Backbones whose ``forward(x, with_features=True)`` also returns the feature before their final
#: BN (the BNNeck of resnet50), which a metric loss such as the triplet reads.
WITH_FEATURES: tuple[str, ...] = ("resnet50", "tiny")

# Default (H, W) per backbone; tiny's can be overridden via its ``input_size`` kwarg,
# in which case the built model's ``input_size`` attribute is authoritative.
_INPUT_SIZES: dict[str, tuple[int, int]] = {
    "glyphnet": (32, 32),
    "iresnet18": (112, 112),
    "iresnet34": (112, 112),
    "iresnet50": (112, 112),
    "iresnet100": (112, 112),
    "mbf": (112, 112),
    "mbf_large": (112, 112),
    "mobilefacenet": (112, 112),
    "resnet50": (256, 128),
    "tiny": (32, 32),
}


def _check_name(name: str) -> None:
    if name in BACKBONES:
        return
    close = difflib.get_close_matches(name, BACKBONES, n=1)
    hint = f"; did you mean {close[0]!r}?" if close else ""
    raise ValueError(
        f"unknown backbone {name!r}; valid names: {', '.join(sorted(BACKBONES))}{hint}"
    )


def build_backbone(name: str, embedding_dim: int = 512, **kwargs: Any) -> nn.Module:
    """Build backbone ``name`` producing ``embedding_dim``-d embeddings.

    Extra kwargs go to the constructor (e.g. ``dropout`` for iresnet*,
    ``last_stride`` for resnet50, ``input_size``/``width`` for tiny).
    """
    _check_name(name)
    embedding_dim = check_positive_int("embedding_dim", embedding_dim)  # 0 built a 0-wide model; -1, 1.5 torch errors
    return BACKBONES[name](embedding_dim=embedding_dim, **kwargs)


def input_size(name: str) -> tuple[int, int]:
    """Default input resolution ``(H, W)`` of backbone ``name``."""
    _check_name(name)
    return _INPUT_SIZES[name]
