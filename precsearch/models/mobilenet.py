"""MobileNetV2 in its CIFAR form (kuangliu/pytorch-cifar): stride 1 in the stem and in the first stride-2 stage,
so a 32x32 input ends at 4x4. Written in functional style (`F.relu`, `F.adaptive_avg_pool2d`, residual
`out + shortcut`) with depthwise convolutions (groups == channels)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from precsearch.models.common import scale_channels

# (expansion, out_channels, num_blocks, stride); the second row's stride is 1 instead of ImageNet's 2.
CONFIG = ((1, 16, 1, 1), (6, 24, 2, 1), (6, 32, 3, 2), (6, 64, 4, 2), (6, 96, 3, 1), (6, 160, 3, 2), (6, 320, 1, 1))


class InvertedResidual(nn.Module):
    """1x1 expand, 3x3 depthwise, 1x1 projection; residual at stride 1 (1x1 conv + BN if widths differ)."""

    def __init__(self, in_planes: int, out_planes: int, expansion: int, stride: int) -> None:
        super().__init__()
        planes = expansion * in_planes
        self.stride = stride
        self.conv1 = nn.Conv2d(in_planes, planes, kernel_size=1, bias=False)
        self.bn1 = nn.BatchNorm2d(planes)
        self.conv2 = nn.Conv2d(planes, planes, kernel_size=3, stride=stride, padding=1, groups=planes, bias=False)
        self.bn2 = nn.BatchNorm2d(planes)
        self.conv3 = nn.Conv2d(planes, out_planes, kernel_size=1, bias=False)
        self.bn3 = nn.BatchNorm2d(out_planes)
        self.shortcut: nn.Sequential | None = None
        if stride == 1 and in_planes != out_planes:
            self.shortcut = nn.Sequential(nn.Conv2d(in_planes, out_planes, kernel_size=1, bias=False),
                                          nn.BatchNorm2d(out_planes))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.relu(self.bn1(self.conv1(x)))
        out = F.relu(self.bn2(self.conv2(out)))
        out = self.bn3(self.conv3(out))
        if self.stride != 1:
            return out
        return out + (x if self.shortcut is None else self.shortcut(x))


class MobileNetV2(nn.Module):
    """Stem 3x3 conv (32), 17 inverted residuals, 1x1 conv to 1280, pool, Linear; channels times `width`."""

    def __init__(self, width: float = 1.0, num_classes: int = 10) -> None:
        super().__init__()
        in_planes = scale_channels(32, width)
        self.conv1 = nn.Conv2d(3, in_planes, kernel_size=3, stride=1, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(in_planes)
        blocks = []
        for expansion, out_channels, num_blocks, stride in CONFIG:
            out_planes = scale_channels(out_channels, width)
            for block_stride in [stride] + [1] * (num_blocks - 1):
                blocks.append(InvertedResidual(in_planes, out_planes, expansion, block_stride))
                in_planes = out_planes
        self.layers = nn.Sequential(*blocks)
        last = scale_channels(1280, width)
        self.conv2 = nn.Conv2d(in_planes, last, kernel_size=1, bias=False)
        self.bn2 = nn.BatchNorm2d(last)
        self.linear = nn.Linear(last, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.relu(self.bn1(self.conv1(x)))
        out = self.layers(out)
        out = F.relu(self.bn2(self.conv2(out)))
        out = F.adaptive_avg_pool2d(out, 1)
        return self.linear(torch.flatten(out, 1))


def mobilenet_v2(width: float = 1.0, num_classes: int = 10) -> MobileNetV2:
    """MobileNetV2, CIFAR form."""
    return MobileNetV2(width=width, num_classes=num_classes)
