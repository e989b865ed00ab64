"""A narrow plain CNN with a patch stem, sized so a demo's proxies are fast and its groups are many and small.

The stem is a 2x2 convolution of stride 2 without padding (a "patchify" stem): it halves the image at once,
so the first activations (the group that has to stay high when the input sits on a bright level, as in the
``gratings`` task) hold a small share of the training tensors, and, having no padding, it adds no border
pattern of the input's level to them. Four 3x3 conv + BN + ReLU layers follow (``LAYERS``), then a global
average pool and a Linear: seven groups in the paper's grouping.
"""

from __future__ import annotations

import torch
from torch import nn

from precsearch.models.common import scale_channels

LAYERS = ((16, 1), (16, 1), (32, 1), (32, 1))  # (channels at width 1.0, stride) of the 3x3 layers


class NarrowCNN(nn.Module):
    """patch conv(8, 2x2, stride 2) -> BN -> ReLU -> conv(16) x2 -> conv(32) x2 (each 3x3 + BN + ReLU) -> global
    average pool -> Linear (channels x width)."""

    def __init__(self, width: float = 1.0, num_classes: int = 10) -> None:
        super().__init__()
        stem = scale_channels(8, width)
        self.stem = nn.Conv2d(3, stem, kernel_size=2, stride=2, padding=0, bias=False)
        self.stem_bn = nn.BatchNorm2d(stem)
        self.stem_relu = nn.ReLU()
        layers: list[nn.Module] = []
        in_channels = stem
        for channels, stride in LAYERS:
            out = scale_channels(channels, width)
            layers += [nn.Conv2d(in_channels, out, kernel_size=3, stride=stride, padding=1, bias=False),
                       nn.BatchNorm2d(out), nn.ReLU()]
            in_channels = out
        self.features = nn.Sequential(*layers)
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.linear = nn.Linear(in_channels, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.stem_relu(self.stem_bn(self.stem(x)))
        out = self.pool(self.features(out))
        return self.linear(torch.flatten(out, 1))


def narrow_cnn(width: float = 1.0, num_classes: int = 10) -> NarrowCNN:
    """Narrow plain CNN with a 2x2 stride-2 patch stem (about 18k parameters at width 1.0)."""
    return NarrowCNN(width=width, num_classes=num_classes)
