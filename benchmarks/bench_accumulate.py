"""Cost of simulated chunk-based 16-bit accumulation: one forward + backward of ChunkedLinear / ChunkedConv2d
(e6m9s accumulation, CL = 64, and sequential) as a ratio to the plain layer timed in the same run (medians).

    python benchmarks/bench_accumulate.py
"""

from __future__ import annotations

from collections.abc import Callable

import pandas as pd
import torch
from timing import median_seconds  # benchmarks/timing.py (the script's folder is on sys.path)
from torch import nn

from precsearch.runtime.accumulate import ChunkedConv2d, ChunkedLinear


def step(layer: nn.Module, x: torch.Tensor) -> Callable[[], None]:
    def run() -> None:
        layer.zero_grad()
        x.grad = None
        layer(x).square().mean().backward()

    return run


def main() -> None:
    torch.manual_seed(0)
    cases = {
        "Linear 256->256, batch 128": (nn.Linear(256, 256), torch.randn(128, 256, requires_grad=True)),
        "Conv2d 16->32 3x3, 16x16, batch 32": (nn.Conv2d(16, 32, 3, padding=1),
                                               torch.randn(32, 16, 16, 16, requires_grad=True)),
    }
    rows = []
    for name, (layer, x) in cases.items():
        base = median_seconds(step(layer, x), repeats=21)
        for chunk in (64, None):
            if isinstance(layer, nn.Linear):
                chunked = ChunkedLinear.from_linear(layer, "e6m9s", chunk)
            else:
                chunked = ChunkedConv2d.from_conv(layer, "e6m9s", chunk)
            seconds = median_seconds(step(chunked, x), repeats=3)
            rows.append({"layer": name, "accumulation": f"e6m9s, CL={chunk or 'K (sequential)'}",
                         "plain ms": round(base * 1e3, 2), "chunked ms": round(seconds * 1e3, 1),
                         "ratio": round(seconds / base, 1)})
    print(pd.DataFrame(rows).to_string(index=False))
    print(f"\nforward + backward (3 GEMMs), medians; torch {torch.__version__}, {torch.get_num_threads()} threads")


if __name__ == "__main__":
    main()
