"""TinyNet: a few-layer CNN for the synthetic default dataset and CPU smoke runs.

Three strided conv-BN-ReLU layers (16/32/64 channels), global average pooling and
a Linear-BN embedding head, the same head shape as the real backbones, so a run
on TinyNet exercises the whole training path in seconds on a laptop CPU. The
conv-BN-ReLU blocks follow the ResNet recipe (He et al., 2016) without the
residuals, which buy nothing at this depth.
"""

from __future__ import annotations

from typing import ClassVar

import torch
from torch import nn

from shardfc.models.arguments import check_input_size, check_width
from shardfc.models.init import init_weights

__all__ = ["TinyNet", "tiny"]

INPUT_SIZE: tuple[int, int] = (32, 32)


class TinyNet(nn.Module):
    """[N,3,H,W] -> [N,embedding_dim]; global pooling makes it work at any H, W.

    ``forward(x, with_features=True)`` returns ``(feature before the final BN, embedding)``, as
    the re-ID ResNet does for its BNNeck, so CPU tests can train the triplet recipe.
    """

    #: ``forward`` as named segments in order, each running the listed top-level children in
    #: turn (``"flatten"`` is ``torch.flatten(x, 1)``). Model parallelism may cut the model
    #: after any segment but the last: see :func:`shardfc.parallel.model_split.stages`.
    segments: ClassVar[tuple[tuple[str, tuple[str, ...]], ...]] = (
        ("body", ("body",)),
        ("head", ("pool", "flatten", "fc", "features")),
    )
    #: where the model may be cut (after these segments), in forward order
    split_points: ClassVar[tuple[str, ...]] = ("body",)

    def __init__(
        self,
        embedding_dim: int = 512,
        input_size: int | tuple[int, int] = INPUT_SIZE,
        width: int = 16,
    ) -> None:
        super().__init__()
        # Recorded for data pipelines; the net itself does not depend on it.
        self.input_size = check_input_size(input_size)
        width = check_width(width)
        self.embedding_dim = embedding_dim
        chans = (3, width, 2 * width, 4 * width)
        layers: list[nn.Module] = []
        for cin, cout in zip(chans[:-1], chans[1:]):
            # Stride 2 everywhere: 32x32 -> 4x4 keeps a CPU step in milliseconds.
            layers += [
                nn.Conv2d(cin, cout, 3, stride=2, padding=1, bias=False),
                nn.BatchNorm2d(cout),
                nn.ReLU(inplace=True),
            ]
        self.body = nn.Sequential(*layers)
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(chans[-1], embedding_dim, bias=False)
        self.features = nn.BatchNorm1d(embedding_dim)
        init_weights(self)

    def forward(self, x: torch.Tensor, with_features: bool = False):
        feature = self.fc(torch.flatten(self.pool(self.body(x)), 1))
        embedding = self.features(feature)
        return (feature, embedding) if with_features else embedding


def tiny(
    embedding_dim: int = 512, input_size: int | tuple[int, int] = INPUT_SIZE, width: int = 16
) -> TinyNet:
    return TinyNet(embedding_dim, input_size, width)
