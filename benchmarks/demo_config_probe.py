"""Probe a candidate `precsearch demo` configuration: does the task separate assignments, and how fast is it?

For a model, the gratings task at an image size, a batch and a learning rate, this trains a few named
assignments of the paper's HFP8 space (plus plain fp32) with the proxy recipe (SGD momentum 0.9, weight
decay 5e-4, cosine over the whole run) for L and 3L steps on several seeds, and prints one table:
assignment, memory (the search's ``memory`` column: bytes of the assignable tensors as a share of all-high,
precsearch.cost), validation accuracy per seed at L and at 3L, and ms per training step on 1 and 2 threads.

Assignments (``--assignments``, comma-separated): ``fp32`` (the fp32 baseline policy), ``high`` (all-high),
``low`` (all-low), ``input_high`` (group 0, the input, high; the rest low), ``stem_high`` (groups 0 and 1,
the input and the first activations, high; the rest low), ``input_low`` / ``stem_low`` (all high but group
0 / group 1 low).

    python benchmarks/demo_config_probe.py --model narrow_cnn --image-size 16 --batch 32 --steps 150

Runs on one thread for the training (``--threads``); timings are taken on 1 and 2 threads.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch

from precsearch.config.spaces import paper_space
from precsearch.search.context import Budget, DataSpec, SearchContext
from precsearch.search.strategies import assign, baseline
from precsearch.train.data import load_dataset
from precsearch.train.trainer import train

ASSIGNMENTS = ("fp32", "high", "low", "input_high", "stem_high", "input_low", "stem_low")


def decisions(units: list[str], name: str) -> dict[str, str] | None:
    """Level per group for a named assignment (None: the fp32 baseline policy). Group g0 holds the input
    (and the stem's weight), g1 the first activations (the stem's output, its BN and ReLU)."""
    if name == "fp32":
        return None
    if name in ("high", "low"):
        return dict.fromkeys(units, name)
    keep = {"input_high": 1, "stem_high": 2}.get(name)
    if keep is not None:  # the first `keep` groups high, the rest low
        return {unit: "high" if index < keep else "low" for index, unit in enumerate(units)}
    flip = {"input_low": 0, "stem_low": 1}.get(name)
    if flip is not None:  # all high but one group
        return {unit: "low" if index == flip else "high" for index, unit in enumerate(units)}
    raise SystemExit(f"unknown assignment {name!r}; use {', '.join(ASSIGNMENTS)}")


def step_ms(context: SearchContext, policy, data, config, threads: int, steps: int) -> tuple[float, float]:
    """Median (wall, CPU) milliseconds of a training step (after 5 warm-up steps) on ``threads`` threads.

    The CPU time is the process's (all its threads): on one thread it is the step's cost even when other
    work shares the cores, which the wall time is not."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    stamps: list[tuple[float, float]] = []
    try:
        train(context.model, policy, data, steps, seed=0, device="cpu", stop_on_divergence=False,
              config=config.__class__(**{**config.__dict__, "report_every": 1}),
              report=lambda step, loss: stamps.append((time.perf_counter(), time.process_time())))
    finally:
        torch.set_num_threads(before)
    walls = [b[0] - a[0] for a, b in zip(stamps[5:], stamps[6:], strict=False)]
    cpus = [b[1] - a[1] for a, b in zip(stamps[5:], stamps[6:], strict=False)]
    return 1000 * statistics.median(walls), 1000 * statistics.median(cpus)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="narrow_cnn")
    parser.add_argument("--image-size", type=int, default=16)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--lr", type=float, default=0.2)
    parser.add_argument("--steps", type=int, default=150, help="L; runs go to L and 3L")
    parser.add_argument("--factors", default="1,3", help="run lengths as multiples of L")
    parser.add_argument("--seeds", default="0,1,2")
    parser.add_argument("--assignments", default="fp32,high,input_high,stem_high,low,input_low,stem_low")
    parser.add_argument("--contrast", type=float, default=None)
    parser.add_argument("--train-size", type=int, default=None)
    parser.add_argument("--val-size", type=int, default=None)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--timing-steps", type=int, default=25, help="0: skip timings")
    parser.add_argument("--no-two-threads", dest="two_threads", action="store_false",
                        help="time on one thread only")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    space = paper_space().with_proxy(image_size=args.image_size, batch_size=args.batch, lr=args.lr,
                                      steps=args.steps)
    data = load_dataset("gratings", image_size=args.image_size, contrast=args.contrast,
                        train_size=args.train_size, val_size=args.val_size)
    context = SearchContext.create(args.model, space, DataSpec("gratings"), Budget(), 0, "cpu", data=data)
    units = list(context.units)
    print(f"{args.model} on gratings {args.image_size}x{args.image_size} (contrast {args.contrast}), batch "
          f"{args.batch}, lr {args.lr}, L={args.steps}; {len(units)} groups; train {len(data[0])} / val "
          f"{len(data[1])}")
    seeds = [int(s) for s in args.seeds.split(",") if s]
    factors = [int(f) for f in args.factors.split(",") if f]
    header = f"{'assignment':<9} {'memory':>6} " + " ".join(
        f"{'acc@' + str(f) + 'L':>{7 * len(seeds)}}" for f in factors) + "  ms/step: cpu-1t wall-1t wall-2t  run-1t"
    rows = []
    for name in args.assignments.split(","):
        levels = decisions(units, name)
        if levels is None:
            policy, memory = baseline("fp32", context.graph), float("nan")
        else:
            assignment = assign(context.graph, space, levels)
            policy = context.policy(assignment, {"strategy": name})
            memory = context.memory(assignment)[0]
        cells = []
        per_step: list[float] = []
        for factor in factors:
            for seed in seeds:
                result = train(args.model, policy, data, factor * args.steps, seed=seed, device="cpu",
                               config=space.proxy, stop_on_divergence=False)
                mark = "*" if result.diverged else " "
                per_step.append(1000 * result.wall_time / max(1, result.steps_run))
                cells.append(f"{100 * result.val_accuracy:6.1f}{mark}")
        timing = ""
        if args.timing_steps:
            (wall1, cpu1), *two = (step_ms(context, policy, data, space.proxy, t, args.timing_steps)
                                   for t in (1, 2)[:2 if args.two_threads else 1])
            timing = f"{cpu1:6.1f} {wall1:6.1f} " + (f"{two[0][0]:6.1f}" if two else "     -")
        run_ms = f"{statistics.mean(per_step):7.1f}" if per_step else "      -"
        row = f"{name:<9} {memory:6.3f} " + " ".join(cells) + "  " + timing + " " + run_ms
        rows.append(row)
        print(row, flush=True)
    print("\n" + header)
    print("\n".join(rows))
    print("(* = the run's divergence monitor fired; memory is the share of the all-high assignment's bytes; "
          "cpu-1t is the process CPU time of a step on one thread, wall-1t / wall-2t wall time on 1 / 2 "
          "threads (medians of steps 6..N, no statistics step); run-1t is a whole run's wall time (trace, "
          "compile, statistics every 50 steps, evaluation) per step, mean over its runs; load average now "
          f"{os.getloadavg()[0]:.1f} on {os.cpu_count()} cores)")


if __name__ == "__main__":
    main()
