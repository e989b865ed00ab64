"""Whether plain fp32 draws the all-high reference's learning curve, and at what cost per step.

Calibration reads the reference's curve at 50, 100, 200, ... steps on 3 seeds (one continuing run per seed,
precsearch.search.calibration). Here both the simulated all-high policy and plain fp32 (no policy) train those
runs on the same seeds, and each point shows both means, their difference and the pooled seed noise's
one-sided margin at 90% confidence (the difference calibration could not tell from noise).

    python benchmarks/reference_curves.py --task demo --max-steps 800
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import numpy as np
import pandas as pd
from search_efficiency import TASKS  # the same tasks (this script's folder is on sys.path)

from precsearch.config.spaces import paper_space
from precsearch.search.context import Budget, DataSpec, SearchContext, torch_threads
from precsearch.search.noise import pooled_noise

SEEDS = (0, 1, 2)  # the search's reference seeds (seed 0)


def curve(context: SearchContext, policy, key: str, points: list[int]) -> tuple[dict[int, list[float]], float]:
    """Each seed's continuing run read at ``points``; and seconds per step (decay branches included)."""
    accuracies: dict[int, list[float]] = {point: [] for point in points}
    seconds = steps = 0.0
    for seed in SEEDS:
        for point in points:
            start = time.perf_counter()
            result = context.trainer(policy, point, seed, checkpoint=context.checkpoint(key, seed))
            seconds += time.perf_counter() - start
            steps += result.steps_spent
            accuracies[point].append(result.val_accuracy)
    return accuracies, seconds / steps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--task", choices=sorted(TASKS), default="demo")
    parser.add_argument("--start", type=int, default=50)
    parser.add_argument("--max-steps", type=int, default=800)
    args = parser.parse_args()
    model, proxy = TASKS[args.task]
    budget = Budget(max_accuracy_drop=0.01)
    context = SearchContext.create(model, paper_space(proxy=proxy), DataSpec("gratings"), budget, 0, "cpu")
    points = [args.start]
    while 2 * points[-1] <= args.max_steps:
        points.append(2 * points[-1])
    with tempfile.TemporaryDirectory() as folder, torch_threads(1):
        context.checkpoints = Path(folder)
        high, high_cost = curve(context, context.policy(context.all_high.assignment, {"strategy": "all-high"}),
                                context.all_high.key, points)
        plain, plain_cost = curve(context, None, "plain", points)
    rows = []
    for point in points:
        noise = pooled_noise(pd.DataFrame(), budget.confidence, extra=[high[point], plain[point]])
        rows.append({"step": point, "all_high": np.mean(high[point]), "all_high_seeds": high[point],
                     "plain_fp32": np.mean(plain[point]), "plain_seeds": plain[point],
                     "difference": np.mean(plain[point]) - np.mean(high[point]),
                     "noise_margin": float(noise.margin(len(SEEDS), len(SEEDS)))})
    print(f"{args.task}: {model} on gratings, seeds {list(SEEDS)}; per step: all-high {1e3 * high_cost:.1f} ms, "
          f"plain fp32 {1e3 * plain_cost:.1f} ms ({plain_cost / high_cost:.2f}x)")
    with pd.option_context("display.width", 200, "display.max_colwidth", 40):
        print(pd.DataFrame(rows).to_string(index=False, float_format=lambda value: f"{value:.4f}"))


if __name__ == "__main__":
    main()
