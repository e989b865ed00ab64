"""ResNet-18 in its CIFAR form (3x3 stem, stride 1, no stem max-pool), as in kuangliu/pytorch-cifar. Written in
module style (nn.ReLU modules, one per use) with a functional residual `out + shortcut`."""

from __future__ import annotations

import torch
from torch import nn

from precsearch.models.common import scale_channels


class BasicBlock(nn.Module):
    """Two 3x3 convs with a residual; a 1x1 conv + BN shortcut when the shape changes."""

    def __init__(self, in_planes: int, planes: int, stride: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(in_planes, planes, kernel_size=3, stride=stride, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(planes)
        self.relu1 = nn.ReLU()
        self.conv2 = nn.Conv2d(planes, planes, kernel_size=3, stride=1, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(planes)
        self.shortcut: nn.Sequential | None = None
        if stride != 1 or in_planes != planes:
            self.shortcut = nn.Sequential(nn.Conv2d(in_planes, planes, kernel_size=1, stride=stride, bias=False),
                                          nn.BatchNorm2d(planes))
        self.relu2 = nn.ReLU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.relu1(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        shortcut = x if self.shortcut is None else self.shortcut(x)
        return self.relu2(out + shortcut)


class ResNet18(nn.Module):
    """BasicBlock x [2, 2, 2, 2] at 64-128-256-512 channels (times `width`), global average pool, Linear."""

    def __init__(self, width: float = 1.0, num_classes: int = 10) -> None:
        super().__init__()
        channels = [scale_channels(c, width) for c in (64, 128, 256, 512)]
        self.conv1 = nn.Conv2d(3, channels[0], kernel_size=3, stride=1, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(channels[0])
        self.relu = nn.ReLU()
        in_planes = channels[0]
        for index, (planes, stride) in enumerate(zip(channels, (1, 2, 2, 2), strict=True), start=1):
            blocks = nn.Sequential(BasicBlock(in_planes, planes, stride), BasicBlock(planes, planes, 1))
            self.add_module(f"layer{index}", blocks)
            in_planes = planes
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.linear = nn.Linear(in_planes, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.layer4(self.layer3(self.layer2(self.layer1(out))))
        return self.linear(torch.flatten(self.pool(out), 1))


def resnet18(width: float = 1.0, num_classes: int = 10) -> ResNet18:
    """ResNet-18, CIFAR form; 11,173,962 parameters at width 1.0 and 10 classes."""
    return ResNet18(width=width, num_classes=num_classes)
