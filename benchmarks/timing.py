"""The one timing rule every benchmark here uses: one warm-up call, then the median of ``repeats`` calls."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable


def median_seconds(fn: Callable[[], object], repeats: int = 5) -> float:
    fn()  # warm-up (and any compilation)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)
