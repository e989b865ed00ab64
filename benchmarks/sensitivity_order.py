"""Sensitivity order against size order (issue 30): the paper's sweep demoting groups largest first against
the knapsack of least sensitivity, at equal memory and confirmed by training; how soon a search seeded each
way first trains the assignment it confirms as its pick; and what the score ranks most sensitive.

For each task (``gratings``: the demo's narrow_cnn, batch 32, 16x16, lr 0.2; ``digits``: the same model and
recipe, which learns the bundled digits to 97% in 100 steps; its proxies are fixed at that length):

1. the sensitivity table (``measure_model``, as ``--seeding sensitivity`` measures it), timed against one
   all-high proxy run of the calibrated length;
2. the search twice, ``--seeding paper`` and ``--seeding sensitivity``, same trials, seed and budget (least
   memory within 1 point of all-high at 90% one-sided confidence), proxies (calibrated on gratings) and
   confirmation as ``run_search`` does by default: the trial at which each first trains its confirmed pick,
   and the training steps spent up to it (calibration included);
3. every distinct point of the size-ordered sweep (``strategies.sweep``) and of the knapsack's
   (``sensitivity_sweep``) for r = 0, 0.1, ..., 1, trained at the confirmation length (3x the proxy
   length) on the confirmation seeds, each order's pick by the search's confirmed rule, and the points of
   the two orders paired by nearest memory.

Then the groups of narrow ResNet-18 (``resnet18:width=0.125``) and tiny_cnn on gratings ranked by score per
byte saved and by summed score. Runs identical in policy, length and seed are trained once and shared
(``RunCache``): the second search's calibration, and sweep points a search confirmed already; step counts are
what each procedure spends alone.

    python benchmarks/sensitivity_order.py                 # both tasks side by side (--jobs 2), 3 seeds
    python benchmarks/sensitivity_order.py --quick         # 30-step proxies, 4 trials, 2 seeds: a run check
"""

from __future__ import annotations

import argparse
import datetime
import json
import multiprocessing
import os
import platform
import shutil
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import torch
from search_efficiency import DROP, TASKS, pick_confirmed, total_steps, train_points  # benchmarks/ is on sys.path

from precsearch.analysis.report import markdown_table
from precsearch.config.spaces import paper_space
from precsearch.files import atomic_write_text
from precsearch.search.accounting import seed_steps
from precsearch.search.confirmation import CONFIRM_SEED_OFFSET, DEFAULT_CONFIRM_FACTOR, confirmation_length
from precsearch.search.context import Budget, DataSpec, SearchContext, torch_threads
from precsearch.search.noise import pooled_noise
from precsearch.search.seeding import PAPER_SEEDING
from precsearch.search.sensitivity import DEFAULT_BATCHES, SENSITIVITY_SEEDING, measure_model, sensitivity_sweep
from precsearch.search.sensitivity_table import unit_table
from precsearch.search.settings import SearchConfig
from precsearch.search.strategies import sweep, uniform
from precsearch.search.study import run_search

DEMO_MODEL, DEMO_PROXY = TASKS["demo"]
# task -> (model, data, proxy recipe, proxy length): on digits the calibration doubles to 400 steps (each doubling
# still gains a point), which would make the sweep 36,000 steps; 100 steps reach 97% there
ORDER_TASKS = {"gratings": (DEMO_MODEL, "gratings", DEMO_PROXY, "auto"),
               "digits": (DEMO_MODEL, "digits", DEMO_PROXY, 100)}
RANKED = (("resnet18:width=0.125", DEMO_PROXY), TASKS["tiny"])  # ranked on gratings
QUICK_PROXY_STEPS = 30


class RunCache:
    """A ``Trainer`` that trains each (policy, length, seed, evaluation steps) once and returns that result to
    every later request; runs checked at rungs (``on_eval``) always train, since a replay could not stop where
    the original stopped."""

    def __init__(self, trainer: Any) -> None:
        self.trainer = trainer
        self.results: dict[tuple, Any] = {}
        self.shared_steps = 0

    def __call__(self, policy, steps, seed, *, evaluate_at=(), on_eval=None, report=None, checkpoint=None,
                 decay_from=None):
        if on_eval is not None:
            return self.trainer(policy, steps, seed, evaluate_at=evaluate_at, on_eval=on_eval, report=report,
                                checkpoint=checkpoint, decay_from=decay_from)
        described = None if policy is None else json.dumps({**policy.to_dict(), "provenance": {}}, sort_keys=True)
        key = (described, steps, seed, tuple(sorted(evaluate_at)), decay_from)
        if key in self.results:
            self.shared_steps += self.results[key].steps_spent
        else:
            self.results[key] = self.trainer(policy, steps, seed, evaluate_at=evaluate_at, report=report,
                                             checkpoint=checkpoint, decay_from=decay_from)
        return self.results[key]


def pattern(decisions: dict[str, str], units: list[str]) -> str:
    """One character per unit, in the search's trials.csv style: H high, L low."""
    return "".join("H" if decisions.get(unit, "high") == "high" else "L" for unit in units)


def accuracy_text(mean: float, sd: float) -> str:
    return f"{100 * mean:.2f}% +- {100 * sd:.2f}" if np.isfinite(sd) else f"{100 * mean:.2f}%"


def group_label(graph, group: int) -> str:
    ops = {entry.index: entry.ops for entry in graph.groups}[group]
    return ops[0] if len(ops) == 1 else f"{ops[0]} .. {ops[-1]} ({len(ops)} ops)"


def ranking(table: pd.DataFrame, graph) -> pd.DataFrame:
    """Groups most sensitive first (score per byte saved), with their rank by summed score."""
    summed = unit_table(table)
    summed["rank by score"] = summed["score"].rank(ascending=False, method="min").astype(int)
    summed = summed.iloc[::-1].reset_index(drop=True)
    return pd.DataFrame({"rank per byte": range(1, len(summed) + 1), "rank by score": summed["rank by score"],
                         "group": summed["unit"], "ops": [group_label(graph, int(g)) for g in summed["group"]],
                         "bytes saved": [f"{value:,.0f}" for value in summed["bytes_saved"]],
                         "score": [f"{value:.3g}" for value in summed["score"]],
                         "score per byte": [f"{value:.3g}" for value in summed["per_byte"]]})


def search_row(seeding: str, result) -> dict[str, Any]:
    """When the search first trained the assignment it confirmed as its pick, and what that cost."""
    trials = result.trials.sort_values("number")
    calibration = int(result.budget.set_index("phase").loc["calibration", "steps"])
    row = {"seeding": seeding, "proxy length": result.calibration.length, "trials": len(trials),
           "trained": int(trials["trained"].astype(bool).sum()), "total steps": f"{total_steps(result):,}"}
    best = result.best
    if best is None:
        return {**row, "pick": f"none ({result.note})"}
    first = trials[(trials["key"] == best["key"]) & trials["trained"].astype(bool)].iloc[0]
    before = trials[trials["number"] <= first["number"]]
    spent = calibration + sum(sum(seed_steps(value)) for value in before["seed_steps"])
    return {**row, "pick": first["decisions"], "pick memory": f"{best['memory']:.3f}",
            "pick confirmed": accuracy_text(best["val_accuracy"], best.get("val_accuracy_sd", np.nan)),
            "first trained at trial": int(first["number"]) + 1, "its origin": first["origin"],
            "trained trials to then": int(before["trained"].astype(bool).sum()), "steps to then": f"{spent:,}"}


def order_points(candidates, frame: pd.DataFrame, units: list[str]) -> pd.DataFrame:
    """One row per distinct assignment of one order: the targets r that give it, its memory and accuracy."""
    targets: dict[str, list[float]] = {}
    decisions: dict[str, dict[str, str]] = {}
    for candidate in candidates:
        targets.setdefault(candidate.key, []).append(candidate.r)
        decisions[candidate.key] = candidate.decisions
    rows = frame.set_index("key").loc[list(targets)].reset_index()
    rows["r"] = [", ".join(f"{r:.1f}" for r in targets[key]) for key in rows["key"]]
    rows["decisions"] = [pattern(decisions[key], units) for key in rows["key"]]
    return rows


def shown(points: pd.DataFrame) -> pd.DataFrame:
    return pd.DataFrame({"r": points["r"], "decisions": points["decisions"],
                         "memory (planned)": [f"{value:.3f}" for value in points["memory_planned"]],
                         "memory": [f"{value:.3f}" for value in points["memory"]],
                         "confirmed accuracy": [accuracy_text(mean, sd) for mean, sd in
                                                zip(points["val_accuracy"], points["val_accuracy_sd"], strict=True)],
                         "seeds": points["seeds"]})


def paired(size: pd.DataFrame, sensitivity: pd.DataFrame) -> pd.DataFrame:
    """Each sensitivity-order point with the size-order point of nearest memory."""
    rows = []
    for _, point in sensitivity.iterrows():
        nearest = size.iloc[int(np.argmin(np.abs(size["memory"].to_numpy() - point["memory"])))]
        rows.append({"sensitivity r": point["r"], "sensitivity": point["decisions"],
                     "its memory": f"{point['memory']:.3f}",
                     "its accuracy": accuracy_text(point["val_accuracy"], point["val_accuracy_sd"]),
                     "size r": nearest["r"], "size": nearest["decisions"], "size memory": f"{nearest['memory']:.3f}",
                     "size accuracy": accuracy_text(nearest["val_accuracy"], nearest["val_accuracy_sd"]),
                     "difference (points)": "same assignment" if point["key"] == nearest["key"] else
                     f"{100 * (point['val_accuracy'] - nearest['val_accuracy']):+.2f}"})
    return pd.DataFrame(rows)


def pick_line(name: str, points: pd.DataFrame, accuracies: dict[str, list[float]], reference: str,
              chance: float) -> str:
    best = pick_confirmed(points, accuracies, reference, chance)
    if best is None:
        return f"- {name}: no point within {100 * DROP:g} point of all-high"
    return (f"- {name}: {best['decisions']} (r = {best['r']}), memory {best['memory']:.3f}, "
            f"{accuracy_text(best['val_accuracy'], best['val_accuracy_sd'])}")


def run_task(task: str, args: argparse.Namespace, out: Path) -> list[str]:
    """One task's sections of the results file."""
    model, data, proxy, proxy_steps = ORDER_TASKS[task]
    space = paper_space(proxy=proxy)
    context = SearchContext.create(model, space, DataSpec(data), Budget(max_accuracy_drop=DROP), 0, "cpu")
    cache = RunCache(context.trainer)
    context.trainer = cache
    units = list(context.units)
    start = time.perf_counter()
    results = {}
    for seeding in (PAPER_SEEDING, SENSITIVITY_SEEDING):
        results[seeding.name] = run_search(SearchConfig(
            model=model, space=space, data=data, trials=args.trials, out_dir=out / task / seeding.name, jobs=1,
            seed=0, device="cpu", threads=args.threads, proxy_seeds=None, progress=False, seeding=seeding,
            budget=Budget(max_accuracy_drop=DROP), proxy_steps=QUICK_PROXY_STEPS if args.quick else proxy_steps),
            trainer=cache)
        print(f"{task}: search seeded {seeding.name} done at {time.perf_counter() - start:.0f} s", flush=True)
    with torch_threads(args.threads):  # after the searches: the rounding kernels are compiled, as in a search
        measured = time.perf_counter()
        table = measure_model(model, space, context.data, seed=0)
        measure_seconds = time.perf_counter() - measured
    calibration = results["paper"].calibration
    length = confirmation_length(calibration.length, DEFAULT_CONFIRM_FACTOR)
    seeds = [CONFIRM_SEED_OFFSET + index for index in range(args.seeds)]
    size = sweep(context.graph, space)
    knapsack = sensitivity_sweep(context.graph, space, table)
    frame, accuracies, steps = train_points(context, [*size, *knapsack], length, seeds, args.threads)
    size_points, knapsack_points = order_points(size, frame, units), order_points(knapsack, frame, units)
    reference = uniform(context.graph, space, "high").key
    noise = pooled_noise(frame, Budget().confidence)
    proxy_seconds = float(np.median([run["wall_time"] for run in calibration.reference]))  # the first compiles

    point_counts = f"size order {len(size_points)}, sensitivity order {len(knapsack_points)}"
    searches = pd.DataFrame([search_row(name, result) for name, result in results.items()])
    how = "fixed" if calibration.fixed else "calibrated"
    lines = [
        f"## {task}: {model} on {data}, batch {proxy['batch_size']}, {proxy['image_size']}x{proxy['image_size']}, "
        f"lr {proxy['lr']} (proxy length L = {calibration.length}, {how}; confirmation {length} steps on seeds "
        f"{seeds[0]}..{seeds[-1]})", "",
        f"Units {', '.join(units)} (decisions below: one letter per unit in this order, H high, L low).", "",
        f"Sensitivity ({DEFAULT_BATCHES} batches): {measure_seconds:.2f} s, {measure_seconds / proxy_seconds:.3f}x "
        f"one all-high proxy run of L = {calibration.length} steps ({proxy_seconds:.2f} s).", "",
        markdown_table(ranking(table, context.graph)),
        "### Size order (the paper: largest group first)", "", markdown_table(shown(size_points)),
        "### Sensitivity order (the knapsack: least summed score saving r of what all-low saves)", "",
        markdown_table(shown(knapsack_points)),
        "### Paired by nearest memory", "", markdown_table(paired(size_points, knapsack_points)),
        f"Seed noise of one confirmed run, pooled over every point: sd {100 * noise.sd:.2f} points ({noise.df} df); "
        f"two points at {args.seeds} seeds each differ by noise alone up to "
        f"{100 * float(noise.margin(args.seeds, args.seeds)):.2f} points at 90% one-sided confidence.", "",
        "Each order's pick (least memory within 1 point of all-high at 90% one-sided confidence):",
        pick_line("size order", size_points, accuracies, reference, context.chance),
        pick_line("sensitivity order", knapsack_points, accuracies, reference, context.chance), "",
        f"Sweep steps: {steps:,} for {len(frame)} distinct points ({point_counts}).", "",
        "### The search seeded each way", "", markdown_table(searches),
        f"Steps to then: calibration plus every trial up to and including that one; the sensitivity seeding also "
        f"ran {DEFAULT_BATCHES} measurement batches first. Runs shared between the procedures (trained once here): "
        f"{cache.shared_steps:,} steps.", ""]
    print(f"{task} done at {time.perf_counter() - start:.0f} s", flush=True)
    return lines


def rankings(args: argparse.Namespace) -> list[str]:
    lines = ["## What the score ranks most sensitive on gratings", ""]
    for model, proxy in RANKED:
        space = paper_space(proxy=proxy)
        context = SearchContext.create(model, space, DataSpec("gratings"), Budget(), 0, "cpu")
        with torch_threads(args.threads):
            table = measure_model(model, space, context.data, seed=0)
        lines += [f"### {model}, batch {proxy['batch_size']}, {proxy['image_size']}x{proxy['image_size']}", "",
                  markdown_table(ranking(table, context.graph))]
    return lines


def cpu_model() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines() if Path("/proc/cpuinfo").exists() else []:
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor() or "unknown"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--task", choices=[*ORDER_TASKS, "all"], default="all")
    parser.add_argument("--seeds", type=int, default=3, help="confirmation seeds per sweep point (default 3, as "
                        "the search confirms)")
    parser.add_argument("--trials", type=int, default=24, help="trials of each search (default 24)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads per task (default 1)")
    parser.add_argument("--jobs", type=int, default=2, help="tasks run side by side, one process each (default 2)")
    parser.add_argument("--quick", action="store_true", help=f"fixed {QUICK_PROXY_STEPS}-step proxies, 4 trials, "
                        "2 seeds: a check that the script runs, not a measurement")
    parser.add_argument("--out", default="runs/sensitivity_order", help="folder for the searches' run directories")
    parser.add_argument("--results", default=None, help="markdown file written at the end (default "
                        "benchmarks/results/sensitivity_order.md; with --quick, sensitivity_order.md in --out)")
    args = parser.parse_args()
    if args.quick:
        args.trials, args.seeds = min(args.trials, 4), min(args.seeds, 2)
    out = Path(args.out)
    results = Path(args.results or (out / "sensitivity_order.md" if args.quick else
                                    Path(__file__).parent / "results" / "sensitivity_order.md"))
    tasks = list(ORDER_TASKS) if args.task == "all" else [args.task]
    for task in tasks:
        shutil.rmtree(out / task, ignore_errors=True)
    start = time.perf_counter()
    with ProcessPoolExecutor(min(args.jobs, len(tasks)), mp_context=multiprocessing.get_context("spawn")) as pool:
        sections = list(pool.map(run_task, tasks, [args] * len(tasks), [out] * len(tasks)))
    lines = [line for section in sections for line in section] + rankings(args)
    wall = time.perf_counter() - start
    command = " ".join(["python benchmarks/sensitivity_order.py", *sys.argv[1:]])
    header = ["# Sensitivity order against size order", "", "```", command, "```", "",
              f"Machine: {cpu_model()}, {os.cpu_count()} cores, {args.threads} torch thread(s), torch "
              f"{torch.__version__}; "
              f"{datetime.date.today().isoformat()}; wall time {wall:.0f} s.", "",
              "Memory: share of the all-high assignment's bytes, counting tensors the overflow guard promoted "
              "(planned: before promotion). Accuracies: mean +- sd over seeds at the confirmation length.", ""]
    atomic_write_text(results, "\n".join(header + lines))
    print("\n".join(header + lines))
    print(f"results: {results}")


if __name__ == "__main__":
    main()
