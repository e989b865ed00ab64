"""Width scaling shared by the zoo, so every model rounds channel counts the same way."""

from __future__ import annotations

import math


def scale_channels(channels: int, width: float, divisor: int = 1) -> int:
    """Channels at a width multiplier: nearest multiple of `divisor` (halves round up), never below `divisor`.

    `divisor` > 1 keeps counts splittable: ShuffleNetV2 halves its channels and shuffles them in 2 groups.
    """
    return max(divisor, divisor * math.floor(channels * width / divisor + 0.5))
