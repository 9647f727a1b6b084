"""arcface_torch's MobileFaceNet (``mbf``, ``mbf_large``), parameter for parameter.

insightface's arcface_torch trains and publishes a MobileFaceNet variant that differs from the
paper's (``shardfc.models.mobilefacenet``): the channel widths are multiplied by ``scale`` (2 for
``mbf``, 4 for ``mbf_large``), the inverted residuals expand to a fixed width per stage (128, 256,
512) instead of ``t`` times their input, the stage depths are ``blocks`` and a 512-channel 1x1
conv (``conv_sep``) precedes the GDC head. This module rebuilds that network so that its
``state_dict()`` has exactly arcface_torch's keys and shapes: its published weights load by name
(``shardfc import-arcface --network mbf``). The attribute names (``layers``, ``conv_sep``,
``features``, every unit's inner ``layers``) are therefore fixed by those keys, not chosen here.

Mixed precision is not a flag here (arcface_torch's ``fp16``): wrap the forward in ``torch.autocast``.
"""

from __future__ import annotations

from typing import ClassVar, Sequence

import torch
from torch import nn

from shardfc.checks import check_positive_int
from shardfc.models.init import init_weights

__all__ = ["ArcfaceMobileFaceNet", "mbf", "mbf_large"]

INPUT_SIZE: tuple[int, int] = (112, 112)

#: the width every stage's inverted residuals expand to, whatever ``scale`` is
_EXPAND = (128, 256, 512)


class _Chain(nn.Module):
    """Runs ``layers`` in order; the extra ``layers.`` level is the one in arcface_torch's keys."""

    def __init__(self, *modules: nn.Module) -> None:
        super().__init__()
        self.layers = nn.Sequential(*modules)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layers(x)


def _conv(in_ch: int, out_ch: int, kernel: int, stride: int = 1, groups: int = 1, act: bool = True) -> _Chain:
    """Conv-BN(-PReLU); ``act=False`` is a linear unit (the bottleneck projections, the GDC)."""
    pad = kernel // 2 if kernel == 3 else 0  # 3x3 keeps the size (or halves it); 1x1 and GDC's 7x7 pad none
    units: list[nn.Module] = [
        nn.Conv2d(in_ch, out_ch, kernel, stride, pad, groups=groups, bias=False),
        nn.BatchNorm2d(out_ch),
    ]
    if act:
        units.append(nn.PReLU(out_ch))
    return _Chain(*units)


class _InvertedResidual(_Chain):
    """1x1 expand to ``hidden`` -> 3x3 depthwise(stride) -> linear 1x1 project, + x if ``residual``."""

    def __init__(self, in_ch: int, out_ch: int, hidden: int, stride: int, residual: bool) -> None:
        super().__init__(
            _conv(in_ch, hidden, 1),
            _conv(hidden, hidden, 3, stride, groups=hidden),
            _conv(hidden, out_ch, 1, act=False),
        )
        self.residual = residual

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.layers(x)
        return x + out if self.residual else out


def _stage(channels: int, depth: int, hidden: int) -> _Chain:
    """``depth`` shape-keeping residual bottlenecks."""
    return _Chain(*(_InvertedResidual(channels, channels, hidden, 1, True) for _ in range(depth)))


class ArcfaceMobileFaceNet(nn.Module):
    """[N,3,112,112] -> [N,embedding_dim], with arcface_torch's ``get_mbf`` parameter names."""

    #: ``forward`` as named segments (see :attr:`shardfc.models.iresnet.IResNet.segments`). The
    #: trunk is one child, ``layers``, because arcface_torch's keys put every stage under it.
    segments: ClassVar[tuple[tuple[str, tuple[str, ...]], ...]] = (
        ("trunk", ("layers",)),
        ("conv_sep", ("conv_sep",)),
        ("head", ("features",)),
    )
    #: where the model may be cut (after these segments), in forward order
    split_points: ClassVar[tuple[str, ...]] = ("trunk", "conv_sep")

    def __init__(self, embedding_dim: int = 512, blocks: Sequence[int] = (1, 4, 6, 2), scale: int = 2) -> None:
        super().__init__()
        check_positive_int("embedding_dim", embedding_dim)
        check_positive_int("scale", scale)
        blocks = tuple(blocks)
        if len(blocks) != 4:
            raise ValueError(f"blocks must give the depth of 4 stages, got {blocks!r}")
        for i, depth in enumerate(blocks):
            check_positive_int(f"blocks[{i}]", depth)
        self.input_size = INPUT_SIZE
        self.embedding_dim = embedding_dim
        self.blocks, self.scale = blocks, scale
        narrow, wide = 64 * scale, 128 * scale
        first = (
            # One block: a grouped 3x3 conv (64 groups), as arcface_torch has it.
            _conv(narrow, narrow, 3, groups=64) if blocks[0] == 1
            else _stage(narrow, blocks[0], _EXPAND[0])
        )
        # 112 -> 56 (stem) -> 28 -> 14 -> 7 (the three stride-2 bottlenecks).
        self.layers = nn.Sequential(
            _conv(3, narrow, 3, stride=2),
            first,
            _InvertedResidual(narrow, narrow, _EXPAND[0], 2, False),
            _stage(narrow, blocks[1], _EXPAND[0]),
            _InvertedResidual(narrow, wide, _EXPAND[1], 2, False),
            _stage(wide, blocks[2], _EXPAND[1]),
            _InvertedResidual(wide, wide, _EXPAND[2], 2, False),
            _stage(wide, blocks[3], _EXPAND[1]),
        )
        self.conv_sep = _conv(wide, 512, 1)
        # GDC: a 7x7 depthwise linear conv weights each position of the aligned face's map.
        self.features = _Chain(
            _conv(512, 512, 7, groups=512, act=False),
            nn.Flatten(1),
            nn.Linear(512, embedding_dim, bias=False),
            nn.BatchNorm1d(embedding_dim),
        )
        init_weights(self, kaiming=(nn.Conv2d, nn.Linear))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() != 4 or tuple(x.shape[-3:]) != (3, *self.input_size):
            raise ValueError(
                f"mbf expects input of shape [N, 3, {self.input_size[0]}, {self.input_size[1]}] "
                f"(the GDC head needs a 7x7 map), got {list(x.shape)}"
            )
        return self.features(self.conv_sep(self.layers(x)))


def mbf(embedding_dim: int = 512) -> ArcfaceMobileFaceNet:
    """arcface_torch's ``mbf``: ``get_mbf(fp16, num_features, blocks=(1, 4, 6, 2), scale=2)``."""
    return ArcfaceMobileFaceNet(embedding_dim, (1, 4, 6, 2), 2)


def mbf_large(embedding_dim: int = 512) -> ArcfaceMobileFaceNet:
    """arcface_torch's ``mbf_large``: ``get_mbf_large(fp16, num_features, blocks=(2, 8, 12, 4), scale=4)``."""
    return ArcfaceMobileFaceNet(embedding_dim, (2, 8, 12, 4), 4)
