"""Quantizer speed as a ratio to torch's native fp8_e5m2 cast round trip, timed side by side in one run.

    .venv/bin/python benchmarks/bench_formats.py [--numel 16777216] [--repeats 7] [--threads N]

Prints medians. Goal (issue 2): nearest <= 1.0x the native cast, stochastic <= 1.5x. QPyTorch's
float_quantize is timed too when it happens to be importable (it is not a dependency).
"""

from __future__ import annotations

import argparse

import pandas as pd
import torch
from timing import median_seconds  # benchmarks/timing.py (the script's folder is on sys.path)

from precsearch.formats import kernels as formats


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--numel", type=int, default=1 << 24)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--threads", type=int, default=None,
                        help="torch.set_num_threads (default: torch's); a copy of x is timed as the memory-bound row")
    args = parser.parse_args()
    if args.threads is not None:
        torch.set_num_threads(args.threads)

    x = torch.randn(args.numel, generator=torch.Generator().manual_seed(0))
    gen = torch.Generator().manual_seed(1)
    cases = {"native x.to(float8_e5m2).float()": lambda: x.to(torch.float8_e5m2).float(), "x.clone()": x.clone}
    for spec in ("fp8_e5m2", "e4m3b4s"):
        cases[f"quantize {spec} nearest"] = lambda s=spec: formats.quantize(x, s)
        cases[f"quantize {spec} stochastic"] = lambda s=spec: formats.quantize(x, s, "stochastic", generator=gen)
    codes = formats.encode(x, "e4m3b4s")
    cases["encode e4m3b4s (round + pack to uint8)"] = lambda: formats.encode(x, "e4m3b4s")
    cases["decode e4m3b4s"] = lambda: formats.decode(codes, "e4m3b4s")
    try:
        from qtorch.quant import float_quantize

        cases["qtorch float_quantize e5m2 nearest"] = lambda: float_quantize(x, 5, 2, rounding="nearest")
        cases["qtorch float_quantize e5m2 stochastic"] = lambda: float_quantize(x, 5, 2, rounding="stochastic")
    except ImportError:
        print("QPyTorch (qtorch) not importable: skipped")

    rows = [{"case": name, "median_ms": 1e3 * median_seconds(fn, args.repeats)} for name, fn in cases.items()]
    table = pd.DataFrame(rows)
    table["x_native"] = table["median_ms"] / table["median_ms"].iloc[0]
    print(f"{args.numel:,} float32 values, {torch.get_num_threads()} threads, torch {torch.__version__}")
    print(table.to_string(index=False, float_format=lambda v: f"{v:.2f}"))


if __name__ == "__main__":
    main()
