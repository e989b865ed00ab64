"""How much more of a CNN's training memory can be 8-bit once each tensor has its own scale (issue 40)?

For each data set and model, in two spaces that differ only in scaling (``search_spaces/fp8_e4m3_e5m2.yaml``:
bare e4m3fn/e5m2 under one dynamic loss scale; ``search_spaces/fp8_scaled.yaml``: the same elements with a
power-of-two scale per tensor, torchao's tensorwise recipe; bf16 high in both): the search with the demo's proxy
recipe (precsearch.cli.demo: batch 32, 16x16 images, lr 0.2; calibrated proxy length, seeds chosen from the
noise, confirmation of the front), then, at the confirmation's length and on its seeds, the all-low assignment
and, in the scaled space, the torchao-style baseline (``baseline("torchao_fp8", graph)``). Memory is the cost
model's bytes as a share of all-high's (bf16 everywhere, the same in both spaces), promoted tensors counted high.

Each configuration's rows replace its earlier ones in ``benchmarks/results/scaled_formats.csv``, a space's as
soon as it is measured, and a search interrupted in ``--out`` is resumed by the next run; the markdown
``benchmarks/results/scaled_formats.md`` is rendered from every row there, so configurations can be run one at
a time (and one that never finished shows as such).

Usage: nice python benchmarks/scaled_formats.py [--configs gratings:narrow_cnn,digits:resnet18:width=0.125]
       [--trials 12] [--jobs 2] [--lr 0.2] [--out runs/scaled_formats] [--render]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np
import pandas as pd

from precsearch.cli.demo import PROXY
from precsearch.config.spaces import load_space
from precsearch.errors import PrecsearchError
from precsearch.files import atomic_write_text
from precsearch.search.confirmation import CONFIRM_SEED_OFFSET, PLAIN_FP32
from precsearch.search.context import Budget, DataSpec, SearchContext
from precsearch.search.settings import SearchConfig
from precsearch.search.strategies import baseline, uniform
from precsearch.search.study import SearchInterrupted, run_search

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
CONFIGS = ("gratings:narrow_cnn", "digits:narrow_cnn", "gratings:resnet18:width=0.125", "digits:resnet18:width=0.125")
SPACES = {"unscaled": ROOT / "search_spaces" / "fp8_e4m3_e5m2.yaml",
          "scaled": ROOT / "search_spaces" / "fp8_scaled.yaml"}
TRIALS = 12
COLUMNS = ["data", "model", "space", "lr", "assignment", "memory", "low_share", "accuracy", "accuracy_sd", "seeds",
           "steps", "diverged", "promotions", "overflow", "proxy_length", "wall_s", "note"]


def _runs_row(context: SearchContext, policy, steps: int, seeds: list[int]) -> dict:
    """``policy`` trained at the confirmation's length on its seeds: mean accuracy, promotions per run, the
    largest overflow share of any tensor, memory with each run's promotions counted high, planned 8-bit share."""
    runs = context.train_seeds(policy, steps, seeds)
    assignment = policy.assignment(context.graph)
    memories = [context.memory(assignment, run.promotions)[0] for run in runs]
    accuracies = [run.val_accuracy for run in runs]
    return {"memory": float(np.mean(memories)), "low_share": context.cost.low_share(assignment),
            "accuracy": float(np.mean(accuracies)),
            "accuracy_sd": float(np.std(accuracies, ddof=1)) if len(runs) > 1 else float("nan"),
            "seeds": len(runs), "steps": steps, "diverged": any(run.diverged for run in runs),
            "promotions": "/".join(str(len(run.promotions)) for run in runs),
            "overflow": max(run.overflow_max for run in runs)}


def run_space(data: str, model: str, space_name: str, trials: int, jobs: int, out: Path, lr: float) -> list[dict]:
    """One search and its fixed-assignment rows in one space; a search that stops with an error (a reference
    that never learns, say) is one row that says why."""
    start = time.perf_counter()
    space = load_space(SPACES[space_name]).with_proxy(**{**PROXY, "lr": lr})
    try:
        return _measured(data, model, space_name, space, trials, jobs, out, lr, start)
    except PrecsearchError as error:
        return [{"data": data, "model": model, "space": space_name, "lr": lr, "assignment": "search",
                 "note": str(error).splitlines()[0], "wall_s": round(time.perf_counter() - start)}]


def _measured(data: str, model: str, space_name: str, space, trials: int, jobs: int, out: Path, lr: float,
              start: float) -> list[dict]:
    result = run_search(SearchConfig(model, space, data, trials=trials, out_dir=out, jobs=jobs, seed=0,
                                     device="cpu", threads=1 if jobs == 1 else None, proxy_seeds=None,
                                     progress=False, resume=(out / "run.json").is_file()))  # an interrupted run goes on
    context = SearchContext.create(model, space, DataSpec(data), Budget(), 0, "cpu")
    confirmed = result.confirmation.table().set_index("key")
    steps, count = int(confirmed["confirmed_steps"].max()), int(confirmed["confirmed_seeds"].max())
    seeds = [CONFIRM_SEED_OFFSET + index for index in range(count)]
    common = {"data": data, "model": model, "space": space_name, "lr": lr, "proxy_length": result.calibration.length}
    rows = []
    for name, key in (("plain fp32", PLAIN_FP32), ("all-high", context.all_high.key)):
        if key in confirmed.index:
            entry = confirmed.loc[key]
            rows.append({**common, "assignment": name, "accuracy": entry["confirmed_accuracy"],
                         "accuracy_sd": entry["confirmed_sd"], "seeds": entry["confirmed_seeds"], "steps": steps,
                         "diverged": entry["confirmed_diverged"]})
    if result.best is None:
        rows.append({**common, "assignment": "search pick", "note": result.note})
    else:
        best = result.best
        entry = confirmed.loc[best["key"]]
        rows.append({**common, "assignment": "search pick", "memory": best["memory"], "low_share": best["low_share"],
                     "accuracy": entry["confirmed_accuracy"], "accuracy_sd": entry["confirmed_sd"],
                     "seeds": entry["confirmed_seeds"], "steps": steps, "diverged": entry["confirmed_diverged"],
                     "promotions": str(int(best["promotions"]))})
    low = uniform(context.graph, space, "low").assignment
    rows.append({**common, "assignment": "all-low", **_runs_row(context, context.policy(low, {}), steps, seeds)})
    if space_name == "scaled":
        rows.append({**common, "assignment": "torchao_fp8",
                     **_runs_row(context, baseline("torchao_fp8", context.graph), steps, seeds)})
    wall = time.perf_counter() - start
    return [{**row, "wall_s": round(wall)} for row in rows]


def _cell(value, fmt: str) -> str:
    return "-" if pd.isna(value) or value == "" else format(value, fmt)


def _accuracy(row: pd.Series) -> str:
    if pd.isna(row["accuracy"]):
        return "-"
    sd = "" if pd.isna(row["accuracy_sd"]) else f" +- {100 * row['accuracy_sd']:.1f}"
    return f"{100 * row['accuracy']:.1f}%{sd} ({int(row['seeds'])} x {int(row['steps'])})"


def _answer(frame: pd.DataFrame) -> str:
    """The one sentence: the 8-bit share of the confirmed picks with and without scales, per configuration."""
    picks = frame[frame["assignment"] == "search pick"].dropna(subset=["low_share"])
    parts = []
    for (data, model), group in picks.groupby(["data", "model"], sort=False):
        share = group.set_index("space")["low_share"]
        memory = group.set_index("space")["memory"]
        if {"scaled", "unscaled"} <= set(share.index):
            parts.append(f"{model} on {data}: {100 * share['scaled']:.0f}% of the tensors' elements in 8 bits vs "
                         f"{100 * share['unscaled']:.0f}% unscaled ({memory['scaled']:.3f} vs "
                         f"{memory['unscaled']:.3f} of all-high's bytes)")
    if not parts:
        return "Not answered yet: no configuration has a confirmed pick in both spaces."
    return ("With a scale per tensor, the search's confirmed pick (within 1 point of all-high) holds " +
            "; ".join(parts) + ".")


def render(frame: pd.DataFrame, trials: int, jobs: int) -> str:
    lines = [
        "# Scaled vs unscaled 8-bit formats (issue 40)", "",
        "```", f"nice python benchmarks/scaled_formats.py --trials {trials} --jobs {jobs} --configs CONFIG", "```", "",
        f"**Answer.** {_answer(frame)}", "",
        "Settings: spaces `search_spaces/fp8_e4m3_e5m2.yaml` (unscaled: fp8_e4m3fn saturating / fp8_e5m2, one "
        "dynamic loss scale from 2^16) and `search_spaces/fp8_scaled.yaml` (scaled: e4m3fn@tensor / e5m2@tensor, "
        "a power-of-two scale per tensor from its own amax, no loss scaling); bf16 high and fp32 master weights in "
        f"both; the demo's proxy recipe (batch {PROXY['batch_size']}, {PROXY['image_size']}x{PROXY['image_size']} "
        f"images, lr {PROXY['lr']} unless a section says otherwise), proxy length calibrated on all-high, seeds "
        "per proxy from the measured noise, "
        f"{trials} trials on {jobs} workers, the front confirmed at 3x the proxy length on fresh seeds (1000, "
        "1001, ...) against all-high's calibration runs continued to that length (seeds 0, 1, 2; the sections "
        "measured before that change trained all-high on the fresh seeds too); all-low and torchao_fp8 (every "
        "GEMM's weight, input and output gradient scaled fp8, the rest "
        "bf16, no promotion guard) trained at that length on those seeds. CPU, 2 cores shared with other jobs.",
        "",
        "Columns: memory = the cost model's bytes as a share of all-high's (bf16 everywhere), promoted tensors "
        "counted high; 8-bit = planned share of the training tensors' elements in 8 bits; accuracy = mean "
        "validation accuracy (+- sd) of seeds x steps; promotions = tensors the overflow guard promoted, per "
        "seed (the pick: on its proxy); overflow = the largest share of one tensor's values that overflowed, "
        "over the run.", "",
    ]
    for config in CONFIGS:
        data, model = config.split(":", 1)
        rows = frame[(frame["data"] == data) & (frame["model"] == model)]
        lines += [f"## {model} on {data}", ""]
        if rows.empty:
            lines += ["Not measured: no run of this configuration has finished.", ""]
            continue
        per_space = rows.groupby("space", sort=False)[["proxy_length", "wall_s", "lr"]].first()
        length = ", ".join(f"{space} {_cell(n, '.0f')}" for space, n in per_space["proxy_length"].items())
        wall = ", ".join(f"{space} {int(n)} s" for space, n in per_space["wall_s"].items())
        rates = ", ".join(sorted({_cell(lr, 'g') for lr in per_space["lr"]}))
        lines += [f"Learning rate {rates}; calibrated proxy length: {length} steps; wall time: {wall}.", "",
                  "| space | assignment | memory | 8-bit | accuracy | promotions | overflow | diverged |",
                  "| --- | --- | --- | --- | --- | --- | --- | --- |"]
        for _, row in rows.iterrows():
            note = f" ({row['note']})" if isinstance(row["note"], str) and row["note"] else ""
            lines.append(f"| {row['space']} | {row['assignment']}{note} | {_cell(row['memory'], '.3f')} | "
                         f"{_cell(row['low_share'], '.1%')} | {_accuracy(row)} | {_cell(row['promotions'], '')} | "
                         f"{_cell(row['overflow'], '.2e')} | {_cell(row['diverged'], '')} |")
        lines.append("")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--configs", default=",".join(CONFIGS[:1]), help="data:model,... (default %(default)s)")
    parser.add_argument("--trials", type=int, default=TRIALS)
    parser.add_argument("--jobs", type=int, default=2)
    parser.add_argument("--out", type=Path, default=Path("runs/scaled_formats"))
    parser.add_argument("--lr", type=float, default=PROXY["lr"], help="the proxies' learning rate (default: the "
                        "demo's, %(default)s)")
    parser.add_argument("--render", action="store_true", help="only render the markdown from the csv")
    args = parser.parse_args()
    table = RESULTS / "scaled_formats.csv"
    frame = pd.read_csv(table) if table.is_file() else pd.DataFrame(columns=COLUMNS)
    configs = [] if args.render else [config for config in args.configs.split(",") if config]
    unknown = sorted(set(configs) - set(CONFIGS))
    if unknown:
        parser.error(f"unknown config {unknown[0]!r}; use any of {', '.join(CONFIGS)}")
    for config in configs:
        data, model = config.split(":", 1)
        frame = frame[~((frame["data"] == data) & (frame["model"] == model))]
        for space_name in SPACES:  # each space's rows kept as soon as they are measured
            out = args.out / f"{data}_{model.replace(':', '_').replace('=', '')}_{space_name}"
            try:
                rows = run_space(data, model, space_name, args.trials, args.jobs, out, args.lr)
            except SearchInterrupted as stopped:
                print(f"interrupted: the search in {out} goes on from where it stopped when this command runs "
                      "again with the same --out", file=sys.stderr)
                return 128 + stopped.signum
            print(pd.DataFrame(rows).to_string(), flush=True)
            frame = pd.concat([frame, pd.DataFrame(rows, columns=COLUMNS)], ignore_index=True)
            atomic_write_text(table, frame.to_csv(index=False))
    atomic_write_text(RESULTS / "scaled_formats.md", render(frame, args.trials, args.jobs))
    return 0


if __name__ == "__main__":
    sys.exit(main())
