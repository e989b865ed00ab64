"""What the search costs against the paper's sweep when the real training is much longer than the proxy.

For a model and task (``--task demo``: the demo's narrow_cnn on gratings; ``--task tiny``: tiny_cnn on
gratings, the old demo):

(a) this search with ``run_search``'s defaults (calibrated proxy length L, rungs, seeds that race,
    sequential confirmation at 3L); its cost is every step it trains;
(c) the paper's procedure: every distinct point of the size-ordered sweep r = 0, 0.1, ..., 1 trained at the
    full length (``--full-factor`` x L, default 10) on 3 seeds, the pick by the search's rule (least memory
    within 1 point of all-high at 90% one-sided confidence).

Both picks are then held to all-high at the full length on those 3 seeds, which no search run used: (c)'s
runs are that check for (c), and (a)'s pick is trained there too (unless it is a sweep point). The table:
steps, steps as a share of (c)'s, (a)'s budget per phase, each pick's memory (share of all-high's bytes), its
full-length accuracy against all-high's and whether the rule holds it within 1 point; ``--out``/TASK/
efficiency.csv keeps it. Each full-length point is kept in ``--out``/TASK/full_length.csv as soon as it is
trained; ``--resume`` finishes the search from its run directory and trains only the points not kept there
(the points do not depend on the search, so a new search may be run against kept points: remove
``--out``/TASK/search and give ``--resume``).

    python benchmarks/search_efficiency.py --task demo --out runs/efficiency

``--full-schedule cosine`` trains the full-length runs with their rate along one cosine over all their steps,
as a real training (and the paper's) does, instead of the proxies' constant rate with a decay only at the end;
its points are kept apart (full_length_cosine.csv, efficiency_cosine.csv), and the search is the same.
"""

from __future__ import annotations

import argparse
import json
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pandas as pd

from precsearch.config.policy import Policy
from precsearch.config.spaces import paper_space
from precsearch.search.context import Budget, DataSpec, SearchContext, torch_threads
from precsearch.search.noise import pooled_noise
from precsearch.search.selection import pick_pairwise
from precsearch.search.settings import SearchConfig
from precsearch.search.strategies import sweep
from precsearch.search.study import run_search
from precsearch.train.proxy import ProxyTrainer
from precsearch.train.trainer import ProxyResult, train

TASKS = {
    "demo": ("narrow_cnn", {"batch_size": 32, "image_size": 16, "lr": 0.2}),
    "tiny": ("tiny_cnn", {"batch_size": 64, "image_size": 16, "lr": 0.2}),
}
BUDGET = Budget(max_accuracy_drop=0.01)
FULL_SEED_OFFSET = 2000  # no proxy (seed + 0, 1, ...) or confirmation (+ 1000, ...) run used these seeds
FULL_SEEDS = 3


@dataclass(frozen=True)
class CosineTrainer:
    """A ``Trainer`` for runs trained once to their end with the rate along one cosine over all their steps (a
    real training's schedule, without ``precsearch train``'s augmentation), on the data and recipe of a
    search's ``ProxyTrainer``, where a proxy holds its rate and decays only off a branch at the end."""

    proxy: ProxyTrainer

    def __call__(self, policy: Policy | None, steps: int, seed: int, *, report=None) -> ProxyResult:
        return train(self.proxy.model_spec, policy, self.proxy.data, steps, seed=seed, device=self.proxy.device,
                     config=self.proxy.config, report=report)


class FullLengthRuns:
    """Full-length points by assignment key, read from and appended to ``path`` as each is trained."""

    def __init__(self, path: Path, length: int, seeds: list[int]) -> None:
        self.path, self.length, self.seeds = path, length, seeds
        kept = pd.read_csv(path) if path.is_file() else pd.DataFrame(columns=["key", "length", "seeds_used"])
        kept = kept[(kept["length"] == length) & (kept["seeds_used"] == json.dumps(seeds))]
        self.rows = {row["key"]: {**row, "accuracies": json.loads(row["accuracies"])}
                     for row in kept.to_dict("records")}

    def get(self, context: SearchContext, key: str, assignment, policy: Policy, label: str) -> dict:
        if key not in self.rows:
            self.rows[key] = full_length_row(context, key, assignment, policy, self.length, self.seeds, label)
            frame = pd.DataFrame([{**row, "accuracies": json.dumps(row["accuracies"]), "length": self.length,
                                   "seeds_used": json.dumps(self.seeds)} for row in self.rows.values()])
            frame.to_csv(self.path.with_suffix(".tmp"), index=False)
            self.path.with_suffix(".tmp").replace(self.path)
        return self.rows[key]


def full_length_row(context: SearchContext, key: str, assignment, policy: Policy, length: int, seeds: list[int],
                    label: str) -> dict:
    """One assignment at ``length`` steps on ``seeds``: its seed accuracies, its memory (counting what the
    overflow guard promoted, as the search's does) and the steps of its runs (the paper's procedure trains
    each run once to its end; the decay branch our trainer evaluates it with is not counted, so (c) is not
    inflated by it)."""
    results = context.train_seeds(policy, length, seeds)
    accuracies = [result.val_accuracy for result in results]
    promoted = sorted({tensor for result in results for tensor in result.promotions})
    row = {"key": key, "label": label, "state": "COMPLETE", "trained": True,
           "memory": context.memory(assignment, promoted)[0], "accuracies": accuracies,
           "val_accuracy": float(np.mean(accuracies)), "seeds": len(results),
           "val_accuracy_sd": float(np.std(accuracies, ddof=1)) if len(results) > 1 else np.nan,
           "diverged": any(result.diverged for result in results),
           "steps": sum(result.steps_run for result in results)}
    print(f"  {label}: memory {row['memory']:.3f} accuracy {row['val_accuracy']:.4f} (sd {row['val_accuracy_sd']:.4f},"
          f" {row['seeds']} seeds, {length} steps)", flush=True)
    return row


def pick(frame: pd.DataFrame, reference_key: str, chance: float) -> pd.Series | None:
    """The search's confirmed rule over full-length points (``pick_pairwise``): least memory within the drop
    of all-high (``reference_key``), each point held to it with the seed noise of those two alone."""
    frame = frame.assign(number=range(len(frame)))
    by_key = frame.set_index("key")
    reference = by_key.loc[reference_key]

    def pair_noise(key: str):
        return pooled_noise(pd.DataFrame(), BUDGET.confidence,
                            extra=[by_key.loc[key, "accuracies"], reference["accuracies"]])

    return pick_pairwise(frame, BUDGET, float(reference["val_accuracy"]), int(reference["seeds"]), reference_key,
                         chance, pair_noise)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--task", choices=sorted(TASKS), default="demo")
    parser.add_argument("--trials", type=int, default=24)
    parser.add_argument("--jobs", type=int, default=2)
    parser.add_argument("--full-factor", type=float, default=10.0,
                        help="the full length as a multiple of the calibrated proxy length (default 10)")
    parser.add_argument("--out", default="runs/efficiency", help="folder for the search's run directory")
    parser.add_argument("--resume", action="store_true", help="finish the search from its run directory")
    parser.add_argument("--full-schedule", choices=["constant", "cosine"], default="constant",
                        help="the full-length runs' rate: the proxies' constant one (default), or one cosine over "
                             "each run")
    args = parser.parse_args()
    suffix = "_cosine" if args.full_schedule == "cosine" else ""
    model, proxy = TASKS[args.task]
    space = paper_space(proxy=proxy)
    out = Path(args.out) / args.task
    if not args.resume:
        shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    result = run_search(SearchConfig(
        model=model, space=space, data="gratings", trials=args.trials, jobs=args.jobs, seed=0, device="cpu",
        threads=1, proxy_seeds=None, progress=False, budget=BUDGET, resume=args.resume, out_dir=out / "search"))
    search_wall = time.perf_counter() - start
    budget = result.budget.set_index("phase")["steps"]
    proxy_length = result.calibration.length
    length = round(args.full_factor * proxy_length)
    seeds = [FULL_SEED_OFFSET + index for index in range(FULL_SEEDS)]
    print(f"(a) {search_wall:.0f} s: L = {proxy_length}, {int(budget['total (this search)'])} steps; full length "
          f"{length} on seeds {seeds}", flush=True)

    context = SearchContext.create(model, space, DataSpec("gratings"), BUDGET, 0, "cpu")
    if args.full_schedule == "cosine":
        context.trainer = CosineTrainer(context.trainer)
    runs = FullLengthRuns(out / f"full_length{suffix}.csv", length, seeds)
    points: dict[str, dict] = {}
    with torch_threads(1):
        search_pick = None
        if result.best is not None:  # first: the search's own check
            policy = Policy.load(out / "search" / "best.json")
            search_pick = runs.get(context, result.best["key"], policy.assignment(context.graph), policy, "pick (a)")
        for candidate in sweep(context.graph, space):
            if candidate.key not in points:
                policy = context.policy(candidate.assignment, {"strategy": candidate.strategy, "r": candidate.r})
                points[candidate.key] = runs.get(context, candidate.key, candidate.assignment, policy,
                                                 f"r={candidate.r:.1f}")
        sweep_frame = pd.DataFrame(list(points.values()))
        high_key = sweep_frame["key"].iloc[0]  # r = 0: all-high
        sweep_pick = pick(sweep_frame, high_key, context.chance)
    rows = runs.rows
    high = rows[high_key]
    sweep_steps = int(sweep_frame["steps"].sum())

    def held(row: dict | pd.Series | None) -> dict:
        if row is None:
            return {"pick_memory": np.nan, "pick_full_accuracy": np.nan, "within_drop_of_all_high": False}
        pair = pd.DataFrame([rows[row["key"]], high]).drop_duplicates("key")
        verdict = pick(pair, high_key, context.chance)
        return {"pick_memory": float(row["memory"]), "pick_full_accuracy": float(row["val_accuracy"]),
                "pick_full_sd": float(row["val_accuracy_sd"]),
                "within_drop_of_all_high": verdict is not None and verdict["key"] == row["key"]}

    phases = {f"steps: {phase}": int(steps) for phase, steps in budget.items()
              if phase != "total (this search)" and not phase.startswith(("every trial", "paper"))}
    table = pd.DataFrame([
        {"procedure": "(a) this search", "proxy_length": proxy_length, "steps": int(budget["total (this search)"]),
         **held(search_pick), **phases},
        {"procedure": f"(c) paper's sweep at {length} steps", "proxy_length": None, "steps": sweep_steps,
         **held(sweep_pick), "note": "" if sweep_pick is None else sweep_pick["label"]},
    ])
    table["steps_vs_sweep"] = table["steps"] / sweep_steps
    table["all_high_full_accuracy"] = high["val_accuracy"]
    table["full_length"] = length
    table["full_schedule"] = args.full_schedule
    table.to_csv(out / f"efficiency{suffix}.csv", index=False)
    print(f"\n{args.task}: {model} on gratings, L = {proxy_length}, full length {length} ({args.full_factor:g}x L, "
          f"{args.full_schedule} rate) "
          f"on {FULL_SEEDS} fresh seeds; all-high there {high['val_accuracy']:.4f}; "
          f"wall {time.perf_counter() - start:.0f} s")
    with pd.option_context("display.width", 250, "display.max_columns", 30):
        print(table.T.to_string(float_format=lambda value: f"{value:.4f}"))


if __name__ == "__main__":
    main()
