"""Width scaling shared by the zoo, so every model rounds channel counts the same way."""

from __future__ import annotations

import math

from precsearch.errors import PrecsearchError


class TooNarrow(PrecsearchError):
    """A width at which a layer would get no channels; ``smallest`` is the least width that gives it some."""

    def __init__(self, channels: int, width: float, divisor: int) -> None:
        smallest = divisor / (2 * channels)  # where channels * width / divisor rounds (halves up) to 1
        while _multiples(channels, smallest, divisor) < 1:  # the float just below the exact bound
            smallest = math.nextafter(smallest, math.inf)
        super().__init__(f"width={width!r} leaves a layer of {channels} channels (at width 1) with none; "
                         f"give width >= {smallest!r}")
        self.smallest = smallest


def _multiples(channels: int, width: float, divisor: int) -> int:
    return math.floor(channels * width / divisor + 0.5)


def scale_channels(channels: int, width: float, divisor: int = 1) -> int:
    """Channels at a width multiplier: nearest multiple of `divisor` (halves round up); a width that rounds a
    layer to no channels is refused (``TooNarrow``), not widened behind the user's back. `divisor` > 1 keeps
    counts splittable: ShuffleNetV2 halves its channels and shuffles them in 2 groups."""
    multiples = _multiples(channels, width, divisor)
    if multiples < 1:
        raise TooNarrow(channels, width, divisor)
    return divisor * multiples
