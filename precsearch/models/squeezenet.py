"""SqueezeNet 1.0 with BatchNorm after every hidden conv, in a CIFAR form: 3x3 stride-1 stem, no stem
max-pool, 2x2 max-pools after fire4 and fire8 (32 -> 16 -> 8), a 1x1 conv classifier, global average pool.
Written in module style (nn.ReLU modules, nn.MaxPool2d) with `torch.cat` joining the two expand branches. No
dropout, so a seeded proxy run depends only on the seed and the data order."""

from __future__ import annotations

from collections import OrderedDict

import torch
from torch import nn

from precsearch.models.common import scale_channels

# (squeeze, expand) channels of fire2..fire9; each expand branch (1x1 and 3x3) has `expand` channels.
FIRE_CONFIG = ((16, 64), (16, 64), (32, 128), (32, 128), (48, 192), (48, 192), (64, 256), (64, 256))
POOL_AFTER = ("fire4", "fire8")
STEM_CHANNELS = 96


class Fire(nn.Module):
    """1x1 squeeze, then 1x1 and 3x3 expands concatenated; each conv followed by BN and ReLU."""

    def __init__(self, in_channels: int, squeeze: int, expand: int) -> None:
        super().__init__()
        self.squeeze = nn.Conv2d(in_channels, squeeze, kernel_size=1, bias=False)
        self.squeeze_bn = nn.BatchNorm2d(squeeze)
        self.squeeze_relu = nn.ReLU()
        self.expand1x1 = nn.Conv2d(squeeze, expand, kernel_size=1, bias=False)
        self.expand1x1_bn = nn.BatchNorm2d(expand)
        self.expand1x1_relu = nn.ReLU()
        self.expand3x3 = nn.Conv2d(squeeze, expand, kernel_size=3, padding=1, bias=False)
        self.expand3x3_bn = nn.BatchNorm2d(expand)
        self.expand3x3_relu = nn.ReLU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.squeeze_relu(self.squeeze_bn(self.squeeze(x)))
        left = self.expand1x1_relu(self.expand1x1_bn(self.expand1x1(x)))
        right = self.expand3x3_relu(self.expand3x3_bn(self.expand3x3(x)))
        return torch.cat([left, right], 1)


class SqueezeNet(nn.Module):
    """Stem conv (96), fire2..fire9, 1x1 conv to `num_classes`, avg pool; hidden channels times `width`."""

    def __init__(self, width: float = 1.0, num_classes: int = 10) -> None:
        super().__init__()
        in_ch = scale_channels(STEM_CHANNELS, width)
        layers: list[tuple[str, nn.Module]] = [
            ("conv1", nn.Conv2d(3, in_ch, kernel_size=3, stride=1, padding=1, bias=False)),
            ("bn1", nn.BatchNorm2d(in_ch)), ("relu1", nn.ReLU())]
        for index, (squeeze, expand) in enumerate(FIRE_CONFIG, start=2):
            name = f"fire{index}"
            fire = Fire(in_ch, scale_channels(squeeze, width), scale_channels(expand, width))
            layers.append((name, fire))
            in_ch = 2 * scale_channels(expand, width)
            if name in POOL_AFTER:
                layers.append((f"pool{index}", nn.MaxPool2d(kernel_size=2, stride=2)))
        self.features = nn.Sequential(OrderedDict(layers))
        self.classifier = nn.Conv2d(in_ch, num_classes, kernel_size=1)
        self.pool = nn.AdaptiveAvgPool2d(1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.flatten(self.pool(self.classifier(self.features(x))), 1)


def squeezenet(width: float = 1.0, num_classes: int = 10) -> SqueezeNet:
    """SqueezeNet 1.0 with BatchNorm, CIFAR form."""
    return SqueezeNet(width=width, num_classes=num_classes)
