"""IResNet backbones for face recognition (112x112 aligned crops).

Architecture: "Improved Residual Networks for Image and Video Recognition"
(Duta et al., 2020), in the variant used by ArcFace ("ArcFace: Additive Angular
Margin Loss for Deep Face Recognition", Deng et al., 2019) and insightface's
arcface_torch: pre-activation-style IBasicBlock (BN-conv-BN-PReLU-conv-BN), a
stride-1 stem so 112x112 ends at 7x7, and the "E" output head
BN-Dropout-FC-BN that keeps the spatial layout in the embedding.

Mixed precision is not a flag here: wrap the forward in ``torch.autocast``.
"""

from __future__ import annotations

from typing import ClassVar

import torch
from torch import nn

from shardfc.models.arguments import check_dropout
from shardfc.models.init import init_weights

__all__ = ["IBasicBlock", "IResNet", "iresnet18", "iresnet34", "iresnet50", "iresnet100"]

INPUT_SIZE: tuple[int, int] = (112, 112)


def _conv3x3(in_ch: int, out_ch: int, stride: int = 1) -> nn.Conv2d:
    # No bias: every conv is followed by BN, whose shift makes a bias redundant.
    return nn.Conv2d(in_ch, out_ch, kernel_size=3, stride=stride, padding=1, bias=False)


class IBasicBlock(nn.Module):
    """BN-conv3x3-BN-PReLU-conv3x3(stride)-BN, plus identity or conv1x1+BN shortcut."""

    expansion = 1

    def __init__(self, inplanes: int, planes: int, stride: int = 1) -> None:
        super().__init__()
        self.bn1 = nn.BatchNorm2d(inplanes)
        self.conv1 = _conv3x3(inplanes, planes)
        self.bn2 = nn.BatchNorm2d(planes)
        self.prelu = nn.PReLU(planes)
        # Downsampling happens in the second conv, after the block has widened.
        self.conv2 = _conv3x3(planes, planes, stride)
        self.bn3 = nn.BatchNorm2d(planes)
        self.downsample: nn.Module | None = None
        if stride != 1 or inplanes != planes:
            self.downsample = nn.Sequential(
                nn.Conv2d(inplanes, planes, kernel_size=1, stride=stride, bias=False),
                nn.BatchNorm2d(planes),
            )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.bn3(self.conv2(self.prelu(self.bn2(self.conv1(self.bn1(x))))))
        shortcut = x if self.downsample is None else self.downsample(x)
        return out + shortcut


class IResNet(nn.Module):
    """IResNet trunk + BN-Dropout-FC-BN embedding head; [N,3,112,112] -> [N,embedding_dim]."""

    #: ``forward`` as named segments in order, each running the listed top-level children in
    #: turn (``"flatten"`` is ``torch.flatten(x, 1)``). Model parallelism may cut the model
    #: after any segment but the last: see :func:`shardfc.parallel.model_split.stages`, whose
    #: tests check that the segments run in order reproduce ``forward`` exactly.
    segments: ClassVar[tuple[tuple[str, tuple[str, ...]], ...]] = (
        ("stem", ("conv1", "bn1", "prelu")),
        ("layer1", ("layer1",)),
        ("layer2", ("layer2",)),
        ("layer3", ("layer3",)),
        ("layer4", ("layer4",)),
        ("head", ("bn2", "dropout", "flatten", "fc", "features")),
    )
    #: where the model may be cut (after these segments), in forward order
    split_points: ClassVar[tuple[str, ...]] = ("stem", "layer1", "layer2", "layer3", "layer4")
    #: segments that are one nn.Sequential of blocks, which a pipeline may also cut between blocks
    #: (``"layer3.14"``: after block 14), so that its stages can be of about equal size
    block_segments: ClassVar[tuple[str, ...]] = ("layer1", "layer2", "layer3", "layer4")

    def __init__(
        self,
        layers: tuple[int, int, int, int],
        embedding_dim: int = 512,
        dropout: float = 0.0,
    ) -> None:
        super().__init__()
        dropout = check_dropout(dropout)  # before the layers: NaN was taken (every training output NaN)
        self.input_size = INPUT_SIZE
        self.embedding_dim = embedding_dim
        self.conv1 = _conv3x3(3, 64)
        self.bn1 = nn.BatchNorm2d(64)
        self.prelu = nn.PReLU(64)

        widths = (64, 128, 256, 512)
        inplanes = 64
        stages = []
        for width, depth in zip(widths, layers):
            blocks = [IBasicBlock(inplanes, width, stride=2)]
            blocks += [IBasicBlock(width, width) for _ in range(depth - 1)]
            stages.append(nn.Sequential(*blocks))
            inplanes = width
        self.layer1, self.layer2, self.layer3, self.layer4 = stages

        # Four stride-2 stages: 112 -> 7. The FC sees the full 7x7 map (no global
        # pooling), which is what ties the model to a fixed input size.
        self.fmap_size = (INPUT_SIZE[0] // 16, INPUT_SIZE[1] // 16)
        self.bn2 = nn.BatchNorm2d(512)
        self.dropout = nn.Dropout(p=dropout)
        self.fc = nn.Linear(512 * self.fmap_size[0] * self.fmap_size[1], embedding_dim)
        self.features = nn.BatchNorm1d(embedding_dim)
        init_weights(self)
        # As in arcface_torch: the embedding is L2-normalised by the margin loss,
        # so a learnable per-dim scale is redundant; fix it at 1 and learn only the shift.
        self.features.weight.requires_grad_(False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() != 4 or tuple(x.shape[-3:]) != (3, *self.input_size):
            raise ValueError(
                f"IResNet expects input of shape [N, 3, {self.input_size[0]}, {self.input_size[1]}], "
                f"got {list(x.shape)}"
            )
        x = self.prelu(self.bn1(self.conv1(x)))
        x = self.layer4(self.layer3(self.layer2(self.layer1(x))))
        x = self.dropout(self.bn2(x))
        x = self.fc(torch.flatten(x, 1))
        return self.features(x)




def iresnet18(embedding_dim: int = 512, dropout: float = 0.0) -> IResNet:
    return IResNet((2, 2, 2, 2), embedding_dim, dropout)


def iresnet34(embedding_dim: int = 512, dropout: float = 0.0) -> IResNet:
    return IResNet((3, 4, 6, 3), embedding_dim, dropout)


def iresnet50(embedding_dim: int = 512, dropout: float = 0.0) -> IResNet:
    return IResNet((3, 4, 14, 3), embedding_dim, dropout)


def iresnet100(embedding_dim: int = 512, dropout: float = 0.0) -> IResNet:
    return IResNet((3, 13, 30, 3), embedding_dim, dropout)
