"""Weight initialisation shared by the backbones."""

from __future__ import annotations

from typing import Tuple, Type

from torch import nn


def init_weights(model: nn.Module, kaiming: Tuple[Type[nn.Module], ...] = (nn.Conv2d,)) -> None:
    """Kaiming-normal (fan-out, ReLU gain) for ``kaiming`` layers, which keeps activation variance
    stable through deep ReLU/PReLU trunks; batch norms start as the identity (weight 1, bias 0)."""
    for m in model.modules():
        if isinstance(m, kaiming):
            nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")
        elif isinstance(m, (nn.BatchNorm2d, nn.BatchNorm1d)):
            nn.init.ones_(m.weight)
            nn.init.zeros_(m.bias)
