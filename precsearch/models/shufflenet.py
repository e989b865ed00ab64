"""ShuffleNetV2 (1.0x stage widths 116-232-464, head 1024) in its CIFAR form: 3x3 stride-1 stem, no max-pool.
Written in functional style: `x.chunk` for the channel split, `torch.cat`, `F.relu`, and a channel
shuffle through `view` / `transpose` / `reshape` on sizes read from the tensor, as torchvision does."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from precsearch.models.common import scale_channels

STAGE_CHANNELS = (116, 232, 464)
STAGE_REPEATS = (4, 8, 4)
STEM_CHANNELS = 24
HEAD_CHANNELS = 1024


def channel_shuffle(x: torch.Tensor, groups: int) -> torch.Tensor:
    """Interleave channels of `groups` groups: (N, g*c, H, W) -> (N, g, c, H, W) -> swap -> (N, c*g, H, W)."""
    n, c, h, w = x.size()
    return x.view(n, groups, c // groups, h, w).transpose(1, 2).reshape(n, c, h, w)


def _conv_bn(in_ch: int, out_ch: int, kernel_size: int, stride: int = 1, depthwise: bool = False) -> nn.Sequential:
    """Conv (no bias) + BN; `depthwise` makes a per-channel 3x3 conv (groups == channels)."""
    conv = nn.Conv2d(in_ch, out_ch, kernel_size, stride=stride, padding=kernel_size // 2,
                     groups=in_ch if depthwise else 1, bias=False)
    return nn.Sequential(conv, nn.BatchNorm2d(out_ch))


class BasicUnit(nn.Module):
    """Stride-1 unit: split channels in half, transform one half (1x1, dw 3x3, 1x1), concatenate, shuffle."""

    def __init__(self, channels: int) -> None:
        super().__init__()
        half = channels // 2
        self.pw1 = _conv_bn(half, half, 1)
        self.dw = _conv_bn(half, half, 3, depthwise=True)
        self.pw2 = _conv_bn(half, half, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        kept, branch = x.chunk(2, dim=1)
        branch = F.relu(self.pw1(branch))
        branch = F.relu(self.pw2(self.dw(branch)))
        return channel_shuffle(torch.cat([kept, branch], dim=1), 2)


class DownUnit(nn.Module):
    """Stride-2 unit: both branches see the whole input; each gives half of `out_channels`."""

    def __init__(self, in_channels: int, out_channels: int) -> None:
        super().__init__()
        half = out_channels // 2
        self.left_dw = _conv_bn(in_channels, in_channels, 3, stride=2, depthwise=True)
        self.left_pw = _conv_bn(in_channels, half, 1)
        self.right_pw1 = _conv_bn(in_channels, half, 1)
        self.right_dw = _conv_bn(half, half, 3, stride=2, depthwise=True)
        self.right_pw2 = _conv_bn(half, half, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        left = F.relu(self.left_pw(self.left_dw(x)))
        right = F.relu(self.right_pw1(x))
        right = F.relu(self.right_pw2(self.right_dw(right)))
        return channel_shuffle(torch.cat([left, right], dim=1), 2)


class ShuffleNetV2(nn.Module):
    """Stem, three stages (one DownUnit then BasicUnits), 1x1 conv head, pool, Linear; channels times `width`.
    Stage channels are kept even (at least 2) so they split in half and shuffle in 2 groups."""

    def __init__(self, width: float = 1.0, num_classes: int = 10) -> None:
        super().__init__()
        in_ch = scale_channels(STEM_CHANNELS, width)
        self.conv1 = nn.Conv2d(3, in_ch, kernel_size=3, stride=1, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(in_ch)
        for index, (channels, repeats) in enumerate(zip(STAGE_CHANNELS, STAGE_REPEATS, strict=True), start=2):
            out_ch = scale_channels(channels, width, divisor=2)
            units = [DownUnit(in_ch, out_ch)] + [BasicUnit(out_ch) for _ in range(repeats - 1)]
            self.add_module(f"stage{index}", nn.Sequential(*units))
            in_ch = out_ch
        head = scale_channels(HEAD_CHANNELS, width)
        self.conv5 = nn.Conv2d(in_ch, head, kernel_size=1, bias=False)
        self.bn5 = nn.BatchNorm2d(head)
        self.linear = nn.Linear(head, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.relu(self.bn1(self.conv1(x)))
        out = self.stage4(self.stage3(self.stage2(out)))
        out = F.relu(self.bn5(self.conv5(out)))
        out = F.adaptive_avg_pool2d(out, 1)
        return self.linear(out.view(out.size(0), -1))


def shufflenet_v2(width: float = 1.0, num_classes: int = 10) -> ShuffleNetV2:
    """ShuffleNetV2 1.0x, CIFAR form."""
    return ShuffleNetV2(width=width, num_classes=num_classes)
