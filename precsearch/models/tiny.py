"""A very small CNN for fast tests and the demo: two conv+BN+ReLU stages, pools, a Linear."""

from __future__ import annotations

import torch
from torch import nn

from precsearch.models.common import scale_channels


class TinyCNN(nn.Module):
    """conv(16) -> BN -> ReLU -> max-pool -> conv(32, stride 2) -> BN -> ReLU -> global avg-pool -> Linear.

    Its receptive field is small (10 pixels), so it suits small images: on the embedded digits at 16x16
    it learns well in a couple of hundred steps, at 32x32 it learns slowly.
    """

    def __init__(self, width: float = 1.0, num_classes: int = 10) -> None:
        super().__init__()
        c1, c2 = scale_channels(16, width), scale_channels(32, width)
        self.conv1 = nn.Conv2d(3, c1, kernel_size=3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(c1)
        self.relu1 = nn.ReLU()
        self.pool1 = nn.MaxPool2d(2)
        self.conv2 = nn.Conv2d(c1, c2, kernel_size=3, stride=2, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(c2)
        self.relu2 = nn.ReLU()
        self.pool2 = nn.AdaptiveAvgPool2d(1)
        self.linear = nn.Linear(c2, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.pool1(self.relu1(self.bn1(self.conv1(x))))
        out = self.pool2(self.relu2(self.bn2(self.conv2(out))))
        return self.linear(torch.flatten(out, 1))


def tiny_cnn(width: float = 1.0, num_classes: int = 10) -> TinyCNN:
    """Tiny CNN (about 5.5k parameters at width 1.0) for tests and the demo."""
    return TinyCNN(width=width, num_classes=num_classes)
