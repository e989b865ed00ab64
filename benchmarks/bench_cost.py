"""Cost-model throughput: assignments priced per second by `CostModel.bytes_batch` (one matrix product over
group decisions) against `CostModel.bytes` on one dict assignment at a time, timed side by side in one run.

    .venv/bin/python benchmarks/bench_cost.py [--model resnet18] [--batch-size 128] [--n 100000] [--repeats 7]

Prints medians. Goal (issue 3): >= 1e5 assignments per second for ResNet-18.
"""

from __future__ import annotations

import argparse

import numpy as np
import torch
from timing import median_seconds  # benchmarks/timing.py (the script's folder is on sys.path)

from precsearch.cost.model import CostModel
from precsearch.graph.tracing import trace
from precsearch.models import INPUT_SHAPE, build


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="resnet18")
    parser.add_argument("--batch-size", type=int, default=128)
    parser.add_argument("--n", type=int, default=100_000, help="assignments per bytes_batch call")
    parser.add_argument("--dicts", type=int, default=200, help="assignments priced one dict at a time")
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()

    graph = trace(build(args.model), torch.randn(2, *INPUT_SHAPE), batch_size=args.batch_size)
    cost = CostModel(graph)
    decisions = np.random.default_rng(0).random((args.n, cost.n_groups)) < 0.5
    dicts = [cost.group_assignment(row) for row in decisions[: args.dicts]]
    batch = cost.bytes_batch(decisions[: args.dicts])
    assert batch.tolist() == [cost.bytes(d) for d in dicts], "bytes_batch disagrees with bytes"

    batch_s = median_seconds(lambda: cost.bytes_batch(decisions), args.repeats)
    dict_s = median_seconds(lambda: [cost.bytes(d) for d in dicts], args.repeats)
    batch_rate, dict_rate = args.n / batch_s, args.dicts / dict_s
    print(f"{args.model} at batch {args.batch_size}: {cost.n_groups} groups, {len(graph.assignable_ids())} "
          f"assignable tensors; {torch.get_num_threads()} threads, numpy {np.__version__}")
    print(f"bytes_batch: {batch_rate:,.0f} assignments/s ({args.n:,} per call, median of {args.repeats})")
    print(f"bytes (one dict at a time): {dict_rate:,.0f} assignments/s ({args.dicts} dicts)")
    print(f"ratio: {batch_rate / dict_rate:,.0f}x; goal >= 100,000 assignments/s: "
          f"{'met' if batch_rate >= 1e5 else 'NOT met'}")


if __name__ == "__main__":
    main()
