"""Proxy fidelity study: can short proxies tell the paper's sweep apart from seed noise, and do they rank it as
longer training does?

For each task (the bundled digits data and the procedurally generated ``gratings`` task), the paper's
technique at r = 0, 0.2, 0.4, 0.6, 0.8, 0.9, 1.0 (coinciding assignments trained once), and for a model
of at most 5 units (tiny_cnn has 4 groups, whose sweep gives only 4 distinct points) further high/low
combinations of its units (labelled H/L per unit), ``--assignments`` in all, is trained as
``--seeds`` proxies of ``--proxy-steps`` steps and one long run of ``--long-steps`` steps (seed 0). Printed
per task: per-assignment proxy mean +- sd over seeds, the long run's accuracy and promotions, a one-way ANOVA
of proxy accuracy over assignments, the assignment effect (range of the per-assignment proxy means) as a
multiple of the pooled seed sd, and Spearman / Kendall correlations of proxy mean against the long runs with
90% bootstrap intervals (seed 0). Runs on one thread:

    python benchmarks/proxy_fidelity.py --out runs/fidelity   # both tasks, tiny_cnn, 16x16
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import pandas as pd
import torch
from scipy import stats

from precsearch.analysis.fidelity import long_run
from precsearch.config.spaces import paper_space
from precsearch.search.context import Budget, DataSpec, SearchContext, seed_record
from precsearch.search.noise import pooled_noise, rank_correlations
from precsearch.search.strategies import assign, assignment_key, sweep
from precsearch.train.data import load_dataset

RS = (0.0, 0.2, 0.4, 0.6, 0.8, 0.9, 1.0)
EXHAUSTIVE_UNITS = 5  # models with at most this many units also get every high/low combination of them


def candidates(context: SearchContext, limit: int) -> list[tuple[str, dict[str, str]]]:
    """(label, assignment) pairs: the paper's sweep, then (small models) other high/low combinations in
    binary order, at most ``limit`` in all; an assignment reached twice is listed once, under all its labels."""
    space, graph = context.space, context.graph
    found: dict[str, tuple[str, dict[str, str]]] = {}
    for candidate in sweep(graph, space, rs=RS):
        label, assignment = found.get(candidate.key, ("", candidate.assignment))
        found[candidate.key] = (f"{label}, r={candidate.r:.1f}".lstrip(", "), assignment)
    names = list(context.units)
    if len(names) <= EXHAUSTIVE_UNITS:
        for code in range(2 ** len(names)):
            decisions = {unit: "low" if code >> bit & 1 else "high" for bit, unit in enumerate(names)}
            assignment = assign(graph, space, decisions)
            key = assignment_key(assignment)
            if key not in found:
                found[key] = ("".join("L" if decisions[unit] == "low" else "H" for unit in names), assignment)
    return list(found.values())[:limit]


def study(task: str, model: str, proxy_steps: int, long_steps: int, seeds: int,
          limit: int) -> tuple[pd.DataFrame, dict]:
    space = paper_space().with_proxy(steps=proxy_steps)
    data = load_dataset(task, image_size=space.proxy.image_size)
    context = SearchContext.create(model, space, DataSpec(task), Budget(), 0, "cpu", data=data)
    rows, groups = [], []
    for label, assignment in candidates(context, limit):
        policy = context.policy(assignment, {"benchmark": label})
        start = time.perf_counter()
        proxy, accuracies = context.train_seeds(policy, seeds)
        proxy_time = time.perf_counter() - start
        long = long_run(context, policy, long_steps, seed=0)
        memory, _ = context.memory(assignment, long.promotions)
        groups.append(accuracies)
        rows.append({"task": task, "assignment": label, "key": assignment_key(assignment),
                     "val_accuracy": proxy.val_accuracy,
                     **seed_record(accuracies), "proxy_diverged": proxy.diverged,
                     "proxy_promotions": len(proxy.promotions), "long_accuracy": long.val_accuracy,
                     "long_diverged": long.diverged, "long_promotions": len(long.promotions),
                     "long_memory": memory, "proxy_seconds": proxy_time / seeds, "trained": True, "diverged": False})
        print(f"  {task} {label}: proxy {proxy.val_accuracy:.4f} +- {rows[-1]['val_accuracy_sd']:.4f}, "
              f"long {long.val_accuracy:.4f} ({proxy_time / seeds:.1f} s per proxy)", flush=True)
    frame = pd.DataFrame(rows)
    noise = pooled_noise(frame)
    means = frame["val_accuracy"]
    anova = stats.f_oneway(*groups) if len(groups) >= 2 else None
    stats_row = {
        "assignments": len(frame), "seed_sd": noise.sd, "effect_range": float(means.max() - means.min()),
        "effect_over_noise": float((means.max() - means.min()) / noise.sd),
        "anova_F": float(anova.statistic) if anova is not None else float("nan"),
        "anova_p": float(anova.pvalue) if anova is not None else float("nan"),
        **rank_correlations(frame["val_accuracy"], frame["long_accuracy"], seed=0),
    }
    return frame, stats_row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tasks", default="gratings,digits")
    parser.add_argument("--model", default="tiny_cnn")
    parser.add_argument("--proxy-steps", type=int, default=150)
    parser.add_argument("--long-steps", type=int, default=450)
    parser.add_argument("--seeds", type=int, default=2)
    parser.add_argument("--assignments", type=int, default=7, help="at most this many assignments per task")
    parser.add_argument("--out", default=None, help="folder for fidelity_runs.csv and fidelity_stats.csv")
    args = parser.parse_args()
    torch.set_num_threads(1)
    frames, summaries = [], []
    for task in args.tasks.split(","):
        print(f"{task}: {args.model}, proxies {args.proxy_steps} steps x {args.seeds} seeds, long runs "
              f"{args.long_steps} steps", flush=True)
        frame, summary = study(task, args.model, args.proxy_steps, args.long_steps, args.seeds, args.assignments)
        frames.append(frame)
        summaries.append({"task": task, **summary})
    runs, table = pd.concat(frames), pd.DataFrame(summaries)
    pd.set_option("display.width", 200)
    print(runs[["task", "assignment", "val_accuracy", "val_accuracy_sd", "seeds", "long_accuracy", "proxy_promotions",
                "long_promotions", "long_memory"]].to_string(index=False, float_format="%.4f"))
    print(table.to_string(index=False, float_format="%.3f"))
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        runs.to_csv(Path(args.out) / "fidelity_runs.csv", index=False)
        table.to_csv(Path(args.out) / "fidelity_stats.csv", index=False)


if __name__ == "__main__":
    main()
