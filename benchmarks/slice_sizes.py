"""Peak and CPU time of a policy's step when every sliced backward decodes smaller slices (issue 67's next steps).

The op rules give each sliced backward a slice size (precsearch.graph.op_rules: 1 MiB for Conv2d and ReLU, 4 MiB
for BatchNorm2d). This script runs the all-high and all-low steps of one model under the table's rules and under
tables whose sliced backwards all decode ``--sizes`` bytes a slice (``OP_RULES.with_modules``), eagerly: each
step's peak by the CPU allocator's events (``trace_step``) as a ratio to plain fp32's and autocast bf16's, the
cost model's prediction under the same rules, and the median CPU seconds of the step (``time.process_time``, so a
busy machine moves it less than wall time; steps interleaved) as a ratio to the same policy under the table's
rules.

Usage: OMP_NUM_THREADS=1 python benchmarks/slice_sizes.py --model resnet18:width=0.25 --image-size 16 --batch 64
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import statistics
import time

import torch
from bench_memory import policies  # benchmarks/bench_memory.py (the script's folder is on sys.path)

from precsearch.cost.measured import sgd_step, trace_step
from precsearch.cost.model import CostModel
from precsearch.graph.op_rules import OP_RULES, OpRules
from precsearch.graph.tracing import trace
from precsearch.models import build
from precsearch.runtime.model import apply_policy

MIB = 2**20


def with_slice_bytes(size: int) -> OpRules:
    """The table with every sliced backward decoding slices of ``size`` bytes."""
    return OP_RULES.with_modules({
        kind: dataclasses.replace(rule, sliced=dataclasses.replace(rule.sliced, slice_bytes=size))
        for kind, rule in OP_RULES.modules.items() if rule.sliced is not None})


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="resnet18:width=0.25")
    parser.add_argument("--image-size", type=int, default=16)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--sizes", default="262144,131072,65536", help="slice sizes in bytes, comma-separated")
    parser.add_argument("--repeats", type=int, default=21, help="timed steps per row (median)")
    args = parser.parse_args()
    torch.manual_seed(0)
    plain = build(args.model)
    generator = torch.Generator().manual_seed(1)
    batch = (torch.randn(args.batch, 3, args.image_size, args.image_size, generator=generator),
             torch.randint(0, 10, (args.batch,), generator=generator))
    graph = trace(plain, batch[0][:2], batch_size=args.batch)
    every = policies(graph)

    def step(model: torch.nn.Module, autocast: torch.dtype | None = None):
        optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9, weight_decay=5e-4)
        return sgd_step(model, optimizer, *batch, autocast=autocast, warmup=2)

    steps = {"plain fp32": step(copy.deepcopy(plain)), "autocast bf16": step(copy.deepcopy(plain), torch.bfloat16)}
    predicted, defaults = {}, {}
    tables = {"table's rules": OP_RULES, **{f"{int(size) // 1024} KiB slices": with_slice_bytes(int(size))
                                            for size in args.sizes.split(",")}}
    for label, rules in tables.items():
        cost = CostModel(trace(plain, batch[0][:2], batch_size=args.batch, rules=rules))
        for name in ("all-high", "all-low"):
            row = f"{name}, {label}"
            model = apply_policy(copy.deepcopy(plain), every[name], steps_per_epoch=100, rules=rules)
            steps[row], predicted[row], defaults[row] = step(model), cost.peak_bytes(every[name].assignment(graph)), \
                f"{name}, table's rules"
    peaks = {row: trace_step(run).peak for row, run in steps.items()}
    seconds: dict[str, list[float]] = {row: [] for row in steps}
    for _ in range(args.repeats):
        for row, run in steps.items():
            start = time.process_time()
            run()
            seconds[row].append(time.process_time() - start)
    medians = {row: statistics.median(times) for row, times in seconds.items()}
    print(f"{args.model}, {args.image_size}x{args.image_size}, batch {args.batch}, torch {torch.__version__}, "
          f"{torch.get_num_threads()} thread(s)")
    print("| step | peak (MiB) | x plain fp32 | x autocast bf16 | predicted/measured | CPU ms | x table's rules |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for row, peak in peaks.items():
        ratio = predicted[row] / peak if row in predicted else float("nan")
        own = medians[row] / medians[defaults[row]] if row in defaults else float("nan")
        print(f"| {row} | {peak / MIB:.3f} | {peak / peaks['plain fp32']:.3f} | {peak / peaks['autocast bf16']:.3f} "
              f"| {ratio:.3f} | {1000 * medians[row]:.1f} | {own:.2f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
