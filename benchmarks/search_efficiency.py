"""What each way of finding an assignment costs and what it finds, side by side on one task.

For a model and task (``--task demo``: the demo's narrow_cnn on gratings; ``--task tiny``: tiny_cnn on
gratings, the old demo), three procedures, each ending in a pick confirmed the same way (trained at the
confirmation length, 3x the calibrated proxy length, on the same fresh seeds as the search's reference):

(a) this search: calibrated proxy length, rungs, confirmation of the front (``run_search`` defaults);
(b) the fixed 150-step search of before: ``--proxy-steps 150`` (rungs at its halvings; its proxy pick is what it
    used to write; its confirmation is shown next to it);
(c) the paper's procedure: every distinct point of the size-ordered sweep r = 0, 0.1, ..., 1 trained at the
    confirmation length on those seeds, the pick by the same rule (least memory within 1 point of all-high at
    90% one-sided confidence).

It prints one table: procedure, proxy length, the pick's memory (share of the all-high assignment's bytes),
its confirmed accuracy, all-high's confirmed accuracy, training steps, and steps as a share of (c)'s.

    python benchmarks/search_efficiency.py --task demo --out runs/efficiency
"""

from __future__ import annotations

import argparse
import shutil
import time
from pathlib import Path

import numpy as np
import pandas as pd

from precsearch.config.spaces import paper_space
from precsearch.search.confirmation import CONFIRM_SEED_OFFSET, DEFAULT_CONFIRM_FACTOR, confirmation_length
from precsearch.search.context import Budget, DataSpec, SearchContext, torch_threads
from precsearch.search.noise import pooled_noise
from precsearch.search.selection import pick_pairwise
from precsearch.search.settings import SearchConfig
from precsearch.search.strategies import sweep
from precsearch.search.study import run_search

TASKS = {
    "demo": ("narrow_cnn", {"batch_size": 32, "image_size": 16, "lr": 0.2}),
    "tiny": ("tiny_cnn", {"batch_size": 64, "image_size": 16, "lr": 0.2}),
}
FIXED_STEPS = 150
DROP = 0.01


def searched(name: str, result, steps_total: int) -> dict:
    """A table row for a search's confirmed pick."""
    best = result.best
    confirmed = result.confirmation.set_index("key") if result.confirmation is not None else pd.DataFrame()
    high = result.trials[result.trials["decisions"].str.fullmatch("H+")]
    high_key = high["key"].iloc[0] if not high.empty else None
    row = {"procedure": name, "proxy_length": result.calibration.length if result.calibration else None,
           "steps": steps_total}
    if high_key is not None and high_key in confirmed.index:
        row["all_high_confirmed"] = float(confirmed.loc[high_key, "confirmed_accuracy"])
    if best is None:
        return {**row, "pick_memory": float("nan"), "pick_confirmed": float("nan"), "note": result.note}
    return {**row, "pick_memory": float(best["memory"]), "pick_proxy": float(best.get("proxy_accuracy", np.nan)),
            "pick_confirmed": float(best["val_accuracy"]), "pick_sd": float(best.get("val_accuracy_sd", np.nan)),
            "note": result.note}


def total_steps(result) -> int:
    table = result.budget.set_index("phase")
    return int(table.loc["total (this search)", "steps"])


def train_points(context: SearchContext, candidates, length: int, seeds: list[int],
                 threads: int) -> tuple[pd.DataFrame, dict[str, list[float]], int]:
    """Every distinct candidate at ``length`` steps on ``seeds``: one row per assignment (its first r, its
    memory counting what the overflow guard promoted, as the search's does), each key's seed accuracies, and
    the training steps spent."""
    rows, accuracies, steps = [], {}, 0
    with torch_threads(threads):
        for candidate in candidates:
            if candidate.key in accuracies:
                continue
            policy = context.policy(candidate.assignment, {"strategy": candidate.strategy, "r": candidate.r})
            results = context.train_seeds(policy, length, seeds)
            steps += sum(result.steps_run for result in results)
            accuracies[candidate.key] = [result.val_accuracy for result in results]
            promoted = sorted({tensor for result in results for tensor in result.promotions})
            rows.append({"key": candidate.key, "r": candidate.r, "number": len(rows), "state": "COMPLETE",
                         "memory_planned": context.memory(candidate.assignment)[0],
                         "memory": context.memory(candidate.assignment, promoted)[0],
                         "val_accuracy": float(np.mean(accuracies[candidate.key])), "seeds": len(results),
                         "val_accuracy_sd": float(np.std(accuracies[candidate.key], ddof=1)) if len(results) > 1
                         else np.nan, "diverged": any(result.diverged for result in results), "trained": True})
            print(f"  {candidate.strategy} r={candidate.r:.1f}: memory {rows[-1]['memory']:.3f} accuracy "
                  f"{rows[-1]['val_accuracy']:.4f} (sd {rows[-1]['val_accuracy_sd']:.4f}, {len(results)} seeds)",
                  flush=True)
    return pd.DataFrame(rows), accuracies, steps


def pick_confirmed(frame: pd.DataFrame, accuracies: dict[str, list[float]], reference_key: str,
                   chance: float) -> pd.Series | None:
    """The search's confirmed rule over trained points (least memory within ``DROP`` of all-high, the
    ``reference_key`` row, at 90% one-sided confidence, each point held to all-high with the noise of the two)."""
    reference = frame.set_index("key").loc[reference_key]
    confidence = Budget().confidence

    def pair_noise(key: str):
        return pooled_noise(pd.DataFrame(), confidence, extra=[accuracies[key], accuracies[reference_key]])

    return pick_pairwise(frame, Budget(max_accuracy_drop=DROP), float(reference["val_accuracy"]),
                         int(reference["seeds"]), reference_key, chance, pair_noise)


def paper_sweep(model: str, space, data: str, length: int, seeds: list[int], threads: int) -> dict:
    """(c): every distinct sweep point at ``length`` steps on ``seeds``, picked by the search's confirmed rule."""
    context = SearchContext.create(model, space, DataSpec(data), Budget(max_accuracy_drop=DROP), 0, "cpu")
    frame, accuracies, steps = train_points(context, sweep(context.graph, space), length, seeds, threads)
    reference = frame.iloc[0]  # r = 0: all-high
    best = pick_confirmed(frame, accuracies, reference["key"], context.chance)
    row = {"procedure": "(c) paper: sweep at full length", "proxy_length": None, "steps": steps,
           "all_high_confirmed": float(reference["val_accuracy"])}
    if best is None:
        return {**row, "pick_memory": float("nan"), "pick_confirmed": float("nan"), "note": "no pick"}
    return {**row, "pick_memory": float(best["memory"]), "pick_confirmed": float(best["val_accuracy"]),
            "pick_sd": float(best["val_accuracy_sd"]), "note": f"r={best['r']:.1f}"}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--task", choices=sorted(TASKS), default="demo")
    parser.add_argument("--trials", type=int, default=24)
    parser.add_argument("--jobs", type=int, default=2)
    parser.add_argument("--out", default="runs/efficiency", help="folder for the two searches' run directories")
    parser.add_argument("--resume", action="store_true",
                        help="finish the two searches from their run directories (a finished one is only re-read)")
    args = parser.parse_args()
    model, proxy = TASKS[args.task]
    space = paper_space(proxy=proxy)
    out = Path(args.out) / args.task
    if not args.resume:
        shutil.rmtree(out, ignore_errors=True)
    rows = []
    start = time.perf_counter()
    common = dict(model=model, space=space, data="gratings", trials=args.trials, jobs=args.jobs, seed=0,
                  device="cpu", threads=1, proxy_seeds=None, progress=False,
                  budget=Budget(max_accuracy_drop=DROP), resume=args.resume)
    new = run_search(SearchConfig(out_dir=out / "new", **common))
    rows.append(searched("(a) calibrated, rungs, confirmed", new, total_steps(new)))
    print(f"(a) done in {time.perf_counter() - start:.0f} s", flush=True)
    fixed = run_search(SearchConfig(out_dir=out / "fixed", proxy_steps=FIXED_STEPS, **common))
    rows.append(searched(f"(b) fixed {FIXED_STEPS}-step proxies", fixed, total_steps(fixed)))
    print(f"(b) done in {time.perf_counter() - start:.0f} s", flush=True)
    length = confirmation_length(new.calibration.length, DEFAULT_CONFIRM_FACTOR)
    reference_seeds = int(new.confirmation["confirmed_seeds"].max())
    seeds = [CONFIRM_SEED_OFFSET + index for index in range(reference_seeds)]
    rows.append(paper_sweep(model, space, "gratings", length, seeds, threads=1))
    table = pd.DataFrame(rows)
    table["steps_vs_paper"] = table["steps"] / table["steps"].iloc[-1]
    print(f"\n{args.task}: {model} on gratings, confirmation {length} steps on {reference_seeds} fresh seeds; "
          f"wall {time.perf_counter() - start:.0f} s")
    with pd.option_context("display.width", 200, "display.max_columns", 20):
        print(table.to_string(index=False, float_format=lambda value: f"{value:.4f}"))


if __name__ == "__main__":
    main()
