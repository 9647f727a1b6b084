"""ResNet-50 with a BNNeck head for person re-identification (256x128 crops).

Trunk: "Deep Residual Learning for Image Recognition" (He et al., 2016),
bottleneck blocks [3, 4, 6, 3], with the stride on the 3x3 conv. Re-ID tweaks
from "Bag of Tricks and A Strong Baseline for Deep Person Re-identification"
(Luo et al., 2019): last stride 1, so a 256x128 input leaves a 16x8 map rather
than 8x4 before pooling, and a BNNeck (BatchNorm1d after global pooling) whose
output is the embedding fed to the classifier, while a metric loss (triplet) reads
the feature before it (``forward(x, with_features=True)``). ``neck="none"`` drops
the BN: the pooled feature is the embedding. Weights are randomly initialised;
no ImageNet checkpoint is loaded.
"""

from __future__ import annotations

from typing import ClassVar

import torch
from torch import nn

from shardfc.models.init import init_weights

__all__ = ["NECKS", "Bottleneck", "ReIDResNet", "resnet50"]

INPUT_SIZE: tuple[int, int] = (256, 128)

#: What may sit between the pooled feature and the embedding.
NECKS = ("bnneck", "none")


class Bottleneck(nn.Module):
    """conv1x1-BN-ReLU, conv3x3(stride)-BN-ReLU, conv1x1(4x)-BN, + shortcut, ReLU."""

    expansion = 4

    def __init__(self, inplanes: int, planes: int, stride: int = 1) -> None:
        super().__init__()
        out = planes * self.expansion
        self.conv1 = nn.Conv2d(inplanes, planes, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(planes)
        self.conv2 = nn.Conv2d(planes, planes, 3, stride, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(planes)
        self.conv3 = nn.Conv2d(planes, out, 1, bias=False)
        self.bn3 = nn.BatchNorm2d(out)
        self.relu = nn.ReLU(inplace=True)
        self.downsample: nn.Module | None = None
        if stride != 1 or inplanes != out:
            self.downsample = nn.Sequential(
                nn.Conv2d(inplanes, out, 1, stride, bias=False), nn.BatchNorm2d(out)
            )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shortcut = x if self.downsample is None else self.downsample(x)
        y = self.relu(self.bn1(self.conv1(x)))
        y = self.relu(self.bn2(self.conv2(y)))
        y = self.bn3(self.conv3(y))
        return self.relu(y + shortcut)


class ReIDResNet(nn.Module):
    """ResNet trunk -> global average pool -> [Linear] -> BNNeck; [N,3,H,W] -> [N,embedding_dim].

    ``forward(x, with_features=True)`` returns ``(feature before the neck, embedding)``.

    Global pooling makes the trunk size-agnostic; ``input_size`` only records the
    resolution the model is meant to be fed (data pipelines read it).
    """

    #: ``forward`` as named segments in order, each running the listed top-level children in
    #: turn (``"flatten"`` is ``torch.flatten(x, 1)``). Model parallelism may cut the model
    #: after any segment but the last: see :func:`shardfc.parallel.model_split.stages`.
    segments: ClassVar[tuple[tuple[str, tuple[str, ...]], ...]] = (
        ("stem", ("stem",)),
        ("layer1", ("layer1",)),
        ("layer2", ("layer2",)),
        ("layer3", ("layer3",)),
        ("layer4", ("layer4",)),
        ("head", ("pool", "flatten", "reduce", "neck")),
    )
    #: where the model may be cut (after these segments), in forward order
    split_points: ClassVar[tuple[str, ...]] = ("stem", "layer1", "layer2", "layer3", "layer4")
    #: segments that are one nn.Sequential of blocks, which a pipeline may also cut between blocks
    #: (``"layer3.14"``: after block 14), so that its stages can be of about equal size
    block_segments: ClassVar[tuple[str, ...]] = ("layer1", "layer2", "layer3", "layer4")

    def __init__(
        self,
        layers: tuple[int, int, int, int] = (3, 4, 6, 3),
        embedding_dim: int = 2048,
        last_stride: int = 1,
        neck: str = "bnneck",
    ) -> None:
        super().__init__()
        if neck not in NECKS:
            raise ValueError(f"neck must be one of {', '.join(NECKS)}; got {neck!r}")
        if last_stride not in (1, 2) or isinstance(last_stride, bool):  # 0 failed in the first forward
            raise ValueError(f"last_stride must be 1 (re-ID's 16x8 final map) or 2 (ImageNet's), got {last_stride!r}")
        self.input_size = INPUT_SIZE
        self.embedding_dim = embedding_dim
        self.stem = nn.Sequential(
            nn.Conv2d(3, 64, 7, 2, padding=3, bias=False),
            nn.BatchNorm2d(64),
            nn.ReLU(inplace=True),
            nn.MaxPool2d(3, 2, padding=1),
        )
        inplanes = 64
        stages = []
        for planes, depth, stride in zip((64, 128, 256, 512), layers, (1, 2, 2, last_stride)):
            blocks = [Bottleneck(inplanes, planes, stride)]
            inplanes = planes * Bottleneck.expansion
            blocks += [Bottleneck(inplanes, planes) for _ in range(depth - 1)]
            stages.append(nn.Sequential(*blocks))
        self.layer1, self.layer2, self.layer3, self.layer4 = stages
        self.pool = nn.AdaptiveAvgPool2d(1)
        # Reduce only when asked: the Bag-of-Tricks baseline uses the 2048-d
        # pooled feature directly. No bias, since the BN below re-centres anyway.
        self.reduce: nn.Module = (
            nn.Linear(inplanes, embedding_dim, bias=False)
            if embedding_dim != inplanes
            else nn.Identity()
        )
        self.neck: nn.Module = nn.BatchNorm1d(embedding_dim) if neck == "bnneck" else nn.Identity()
        init_weights(self, kaiming=(nn.Conv2d, nn.Linear))
        if neck == "bnneck":
            # Luo et al. freeze the BNNeck shift so the embedding stays centred at the
            # origin, where a bias-free (cosine) classifier separates it best.
            self.neck.bias.requires_grad_(False)

    def forward(self, x: torch.Tensor, with_features: bool = False):
        x = self.layer4(self.layer3(self.layer2(self.layer1(self.stem(x)))))
        feature = self.reduce(torch.flatten(self.pool(x), 1))
        embedding = self.neck(feature)
        return (feature, embedding) if with_features else embedding


def resnet50(embedding_dim: int = 2048, last_stride: int = 1, neck: str = "bnneck") -> ReIDResNet:
    return ReIDResNet((3, 4, 6, 3), embedding_dim, last_stride, neck)
