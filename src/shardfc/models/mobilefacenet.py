"""MobileFaceNet: a ~1M-parameter face embedding network for 112x112 crops.

"MobileFaceNets: Efficient CNNs for Accurate Real-Time Face Verification on
Mobile Devices" (Chen et al., 2018). MobileNetV2 inverted-residual bottlenecks
with PReLU, and a global depthwise conv (GDC) head instead of global average
pooling: face crops are aligned, so the centre of the 7x7 map matters more than
the corners, and a learned per-position 7x7 depthwise filter can weight them.
The paper's embedding is 128-d; ``embedding_dim`` defaults to 512 to match the
other face backbones here.
"""

from __future__ import annotations

from typing import ClassVar

import torch
from torch import nn

from shardfc.models.init import init_weights

__all__ = ["MobileFaceNet", "mobilefacenet"]

INPUT_SIZE: tuple[int, int] = (112, 112)

# (expansion t, out channels c, repeats n, first stride s): Table 1 of the paper.
_BOTTLENECKS: tuple[tuple[int, int, int, int], ...] = (
    (2, 64, 5, 2),
    (4, 128, 1, 2),
    (2, 128, 6, 1),
    (4, 128, 1, 2),
    (2, 128, 2, 1),
)


def _conv_bn(
    in_ch: int, out_ch: int, kernel: int, stride: int = 1, groups: int = 1, act: bool = True
) -> nn.Sequential:
    """Conv-BN(-PReLU). ``act=False`` gives the paper's "linear" layers."""
    layers: list[nn.Module] = [
        nn.Conv2d(in_ch, out_ch, kernel, stride, padding=kernel // 2, groups=groups, bias=False),
        nn.BatchNorm2d(out_ch),
    ]
    if act:
        layers.append(nn.PReLU(out_ch))
    return nn.Sequential(*layers)


class Bottleneck(nn.Module):
    """Inverted residual: 1x1 expand -> 3x3 depthwise(stride) -> linear 1x1 project."""

    def __init__(self, in_ch: int, out_ch: int, stride: int, expansion: int) -> None:
        super().__init__()
        hidden = in_ch * expansion
        self.use_residual = stride == 1 and in_ch == out_ch
        self.block = nn.Sequential(
            _conv_bn(in_ch, hidden, 1),
            _conv_bn(hidden, hidden, 3, stride, groups=hidden),
            # No activation on the projection: a non-linearity in the narrow
            # bottleneck destroys information (MobileNetV2's linear bottleneck).
            _conv_bn(hidden, out_ch, 1, act=False),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.block(x)
        return x + out if self.use_residual else out


class MobileFaceNet(nn.Module):
    """[N,3,112,112] -> [N,embedding_dim]."""

    #: ``forward`` as named segments (see :attr:`shardfc.models.iresnet.IResNet.segments`).
    segments: ClassVar[tuple[tuple[str, tuple[str, ...]], ...]] = (
        ("stem", ("stem",)),
        ("blocks", ("blocks",)),
        ("head", ("conv_expand", "gdc", "flatten", "fc", "features")),
    )
    #: where the model may be cut (after these segments), in forward order
    split_points: ClassVar[tuple[str, ...]] = ("stem", "blocks")

    def __init__(self, embedding_dim: int = 512) -> None:
        super().__init__()
        self.input_size = INPUT_SIZE
        self.embedding_dim = embedding_dim
        self.stem = nn.Sequential(
            _conv_bn(3, 64, 3, stride=2),  # 112 -> 56
            _conv_bn(64, 64, 3, groups=64),
        )
        blocks: list[nn.Module] = []
        in_ch = 64
        for t, c, n, s in _BOTTLENECKS:
            for i in range(n):
                blocks.append(Bottleneck(in_ch, c, s if i == 0 else 1, t))
                in_ch = c
        self.blocks = nn.Sequential(*blocks)  # 56 -> 7
        self.conv_expand = _conv_bn(in_ch, 512, 1)
        # GDC: a 7x7 depthwise conv with no padding collapses the 7x7 map to 1x1
        # with a separate learned weight per channel and position.
        self.gdc = nn.Sequential(
            nn.Conv2d(512, 512, 7, groups=512, bias=False),
            nn.BatchNorm2d(512),
        )
        # The paper's final "linear conv1x1" on a 1x1 map is a Linear layer.
        self.fc = nn.Linear(512, embedding_dim, bias=False)
        self.features = nn.BatchNorm1d(embedding_dim)
        init_weights(self)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() != 4 or tuple(x.shape[-3:]) != (3, *self.input_size):
            raise ValueError(
                f"MobileFaceNet expects input of shape [N, 3, {self.input_size[0]}, "
                f"{self.input_size[1]}] (the GDC head needs a 7x7 map), got {list(x.shape)}"
            )
        x = self.conv_expand(self.blocks(self.stem(x)))
        x = torch.flatten(self.gdc(x), 1)
        return self.features(self.fc(x))




def mobilefacenet(embedding_dim: int = 512) -> MobileFaceNet:
    return MobileFaceNet(embedding_dim)
