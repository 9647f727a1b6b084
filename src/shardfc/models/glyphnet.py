"""GlyphNet: a small CNN for glyph identities (``shardfc data glyphs``) that trains on a CPU.

A character is told from its neighbours by where its strokes are, so, unlike TinyNet's global
average pooling, the embedding keeps the layout: a stem and three strided stages of conv-BN-ReLU
pairs (``width``, 2·, 4·, 4· channels; 32×32 -> 4×4), then insightface's IResNet output head —
BN, flatten, Linear, BN — over the ``4·width × H/8 × W/8`` map. About 13 MFLOP a 32×32 image at
the default width 16: a 2-core CPU trains thousands of images a second.
"""

from __future__ import annotations

from typing import ClassVar

import torch
from torch import nn

from shardfc.models.arguments import check_input_size, check_width
from shardfc.models.init import init_weights

__all__ = ["GlyphNet", "glyphnet"]

INPUT_SIZE: tuple[int, int] = (32, 32)


def _conv(cin: int, cout: int, stride: int) -> list[nn.Module]:
    return [nn.Conv2d(cin, cout, 3, stride=stride, padding=1, bias=False), nn.BatchNorm2d(cout), nn.ReLU(inplace=True)]


class GlyphNet(nn.Module):
    """[N,3,H,W] -> [N,embedding_dim] for inputs of ``input_size`` (the flatten fixes it)."""

    segments: ClassVar[tuple[tuple[str, tuple[str, ...]], ...]] = (
        ("body", ("body",)),
        ("head", ("bn", "flatten", "fc", "features")),
    )
    split_points: ClassVar[tuple[str, ...]] = ("body",)

    def __init__(self, embedding_dim: int = 512, input_size: int | tuple[int, int] = INPUT_SIZE, width: int = 16) -> None:
        super().__init__()
        self.input_size = h, w = check_input_size(input_size)
        width = check_width(width)
        self.embedding_dim = embedding_dim
        c1, c2, c3 = width, 2 * width, 4 * width
        self.body = nn.Sequential(
            *_conv(3, c1, 1),
            *_conv(c1, c2, 2), *_conv(c2, c2, 1),
            *_conv(c2, c3, 2), *_conv(c3, c3, 1),
            *_conv(c3, c3, 2), *_conv(c3, c3, 1),
        )
        side = lambda n: (n + 7) // 8  # noqa: E731 - three stride-2 convs with padding 1
        self.bn = nn.BatchNorm2d(c3)
        self.fc = nn.Linear(c3 * side(h) * side(w), embedding_dim, bias=False)
        self.features = nn.BatchNorm1d(embedding_dim)
        init_weights(self)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.features(self.fc(torch.flatten(self.bn(self.body(x)), 1)))


def glyphnet(embedding_dim: int = 512, input_size: int | tuple[int, int] = INPUT_SIZE, width: int = 16) -> GlyphNet:
    return GlyphNet(embedding_dim, input_size, width)
