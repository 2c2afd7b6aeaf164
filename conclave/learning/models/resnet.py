"""GroupNorm networks for DP-SGD: a ResNet-18 (He et al. 2016) and a small CNN.

BatchNorm mixes examples within a batch, so per-example gradients (and Opacus) reject it;
GroupNorm normalises each example on its own (Wu & He 2018), which is why the sparse
fine-tuning paper (Luo et al. 2021) uses a GroupNorm ResNet-18. No operation is in-place:
Opacus's backward hooks need the activations they saw. Like every model in the registry,
``forward(x) == classifier(features(x))`` and ``classifier`` is the last ``nn.Linear``.
"""
from __future__ import annotations

import math

import torch
from torch import nn
from torch.nn import functional as F

from conclave.errors import InvalidValue
from conclave.learning.models.pooling import MaxPool2d


def group_norm(channels: int) -> nn.GroupNorm:
    """At most 32 groups, at least 2 channels per group when there are ≥ 2 channels."""
    groups = math.gcd(channels, min(32, max(1, channels // 2)))
    return nn.GroupNorm(groups, channels)


class BasicBlock(nn.Module):
    """Two 3×3 convolutions with a residual connection (1×1 projection when the shape changes)."""

    def __init__(self, in_channels: int, out_channels: int, stride: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(in_channels, out_channels, 3, stride=stride, padding=1, bias=False)
        self.norm1 = group_norm(out_channels)
        self.conv2 = nn.Conv2d(out_channels, out_channels, 3, padding=1, bias=False)
        self.norm2 = group_norm(out_channels)
        self.shortcut = nn.Sequential()
        if stride != 1 or in_channels != out_channels:
            self.shortcut = nn.Sequential(
                nn.Conv2d(in_channels, out_channels, 1, stride=stride, bias=False), group_norm(out_channels)
            )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.relu(self.norm1(self.conv1(x)))
        out = self.norm2(self.conv2(out))
        return F.relu(out + self.shortcut(x))


class GNResNet18(nn.Module):
    """ResNet-18 for small images (3×3 stem, no max-pool, as usual for CIFAR) with GroupNorm.

    ``width`` scales every layer's channels (1.0 = 64/128/256/512, ~11M parameters);
    0.25 keeps the architecture at 1/16 of the parameters for CPU runs.
    """

    def __init__(self, num_classes: int, in_channels: int = 3, width: float = 1.0) -> None:
        super().__init__()
        if width <= 0:
            raise InvalidValue(f"width must be > 0, got {width}")
        if num_classes < 2:
            raise InvalidValue(f"num_classes must be >= 2, got {num_classes}")
        channels = [max(2, round(c * width)) for c in (64, 128, 256, 512)]
        self.stem = nn.Sequential(
            nn.Conv2d(in_channels, channels[0], 3, padding=1, bias=False), group_norm(channels[0]), nn.ReLU()
        )
        blocks: list[nn.Module] = []
        previous = channels[0]
        for stage, out in enumerate(channels):
            for index in range(2):
                stride = 2 if stage > 0 and index == 0 else 1
                blocks.append(BasicBlock(previous, out, stride))
                previous = out
        self.blocks = nn.Sequential(*blocks)
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.classifier = nn.Linear(previous, num_classes)

    def features(self, x: torch.Tensor) -> torch.Tensor:
        return torch.flatten(self.pool(self.blocks(self.stem(x))), 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classifier(self.features(x))


class GNCNN(nn.Module):
    """Three conv–GroupNorm–ReLU stages and global average pooling; works from 8×8 inputs up."""

    def __init__(self, num_classes: int, in_channels: int = 1, channels: int = 16) -> None:
        super().__init__()
        if channels < 2:
            raise InvalidValue(f"channels must be >= 2, got {channels}")
        if num_classes < 2:
            raise InvalidValue(f"num_classes must be >= 2, got {num_classes}")
        widths = (channels, 2 * channels, 4 * channels)
        layers: list[nn.Module] = []
        previous = in_channels
        for stage, out in enumerate(widths):
            layers += [nn.Conv2d(previous, out, 3, padding=1, bias=False), group_norm(out), nn.ReLU()]
            if stage < len(widths) - 1:
                layers.append(MaxPool2d(2))
            previous = out
        self.body = nn.Sequential(*layers)
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.classifier = nn.Linear(previous, num_classes)

    def features(self, x: torch.Tensor) -> torch.Tensor:
        return torch.flatten(self.pool(self.body(x)), 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classifier(self.features(x))


def gn_resnet18(num_classes: int, in_channels: int = 3, width: float = 1.0) -> GNResNet18:
    return GNResNet18(num_classes, in_channels=in_channels, width=width)


def gn_cnn(num_classes: int, in_channels: int = 1, channels: int = 16) -> GNCNN:
    return GNCNN(num_classes, in_channels=in_channels, channels=channels)
