"""`precsearch demo`: a real small search on a task where assignments differ, the baselines, and the report.

The configuration (the constants below) is fixed so the run is comparable across machines, and every process
trains on one thread: a CPU's float sums depend on how many threads share them (a calibration that took the
machine's core count read another curve on 2 cores than on 1 thread). The task is one where assignments
differ: on the generated ``gratings`` an 8-bit input rounds the class signal away, so narrow_cnn's group holding
the input (2% of the bytes) must stay high in the paper's HFP8 space while the rest can go low. Proxies are
calibrated on the all-high reference with seeds chosen from the measured noise (``--proxy-seeds auto``); the
front is confirmed, then the prior-work baselines run under the same proxies. It prints the calibrated length,
the noise, the confirmed pick and its confidence, the baselines within 10% of the pick's memory held to all-high
as the pick was (``held_baselines``), the steps per phase, its wall time and the policy it would hand to
training.
"""

from __future__ import annotations

import argparse
import json
import math
import shlex
import shutil
import time
from pathlib import Path
from typing import Any

from precsearch.cli._arguments import DEVICE_HELP, add_compile_argument, choose_compile, count, device, path
from precsearch.config.reading import load_json_object
from precsearch.errors import PrecsearchError
from precsearch.files import atomic_write_text

MODEL = "narrow_cnn"
PROXY = {"batch_size": 32, "image_size": 16, "lr": 0.2}
DATA = "gratings"
TRIALS = 24
JOBS = 2
MAX_DROP = 0.01
CLAIMED_SAVING = 0.10  # the pick must hold this much less memory than every baseline within the drop


HELP = "run a small real search on the generated gratings task (a few minutes on 2 cores)"
DESCRIPTION = ("Search narrow_cnn's precision assignments in the paper's HFP8 space on the generated gratings "
               "task, train the prior-work baselines under the same proxies, and write the report.")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--out", type=path, default="runs/demo", metavar="DIR",
                        help="run directory (default runs/demo)")
    parser.add_argument("--trials", type=count, default=TRIALS, metavar="N", help=f"trials (default {TRIALS})")
    parser.add_argument("--jobs", type=count, default=JOBS, metavar="N", help=f"worker processes (default {JOBS})")
    parser.add_argument("--device", type=device, default="auto", help=DEVICE_HELP)
    add_compile_argument(parser)


def _clear_previous_demo(out: Path) -> None:
    """Start fresh over an earlier demo in the same folder; refuse to touch anything else."""
    if not out.exists() or not any(out.iterdir()):
        return
    run_file = out / "run.json"
    previous = load_json_object(run_file, "run file", "give another --out") if run_file.is_file() else {}
    if previous.get("model") != MODEL or previous.get("space", {}).get("name") != "hfp8":
        raise PrecsearchError(f"{out} exists and holds something other than a demo run; give another --out")
    shutil.rmtree(out)


HELD_FILE = "held_baselines.csv"
THREADS = 1  # torch's threads in every process of the demo: a CPU's float sums depend on them


def held_baselines(baselines, best, result, context, threads: int = THREADS) -> Any:
    """``_held_rows`` trained on ``threads`` of torch's, as the search's workers train: a CPU's float sums, and a
    borderline baseline's reading with them, depend on the thread count."""
    from precsearch.search.context import torch_threads

    with torch_threads(threads):
        return _held_rows(baselines, best, result, context)


def _held_rows(baselines, best, result, context) -> Any:
    """Hold every prior-work baseline that holds less memory than the pick, or less than 10% more, to all-high as
    the pick was held: one that diverged at the proxy length is out; the others train on the confirmation's
    seeds at its length, seed by seed while the drop rule is undecided (``selection.confirmation_verdict``
    against all-high's confirmation runs, which race too: a seed the confirmation did not continue is trained
    from step 0, the same run). A held baseline whose reading is flagged (eval mode and batch statistics apart
    by more than the drop, precsearch.train.reading) is out only if its batch-statistics readings are below the
    drop too; else it is not ruled out (its eval-mode readings say nothing either way).
    One row per baseline (``HELD_FILE`` in the run directory): the demo's claim that its answer is not a
    prior-work recipe in disguise rests on it. ``context``: the search's model, space and data (its trainer
    trains the baselines)."""
    import pandas as pd

    from precsearch.config.policy import Policy
    from precsearch.search.calibration import reference_policy, run_record
    from precsearch.search.confirmation import race
    from precsearch.search.selection import confirmation_verdict
    from precsearch.train.reading import flagged

    confirmation = result.confirmation
    high_runs = confirmation.runs[context.all_high.key]
    reference = reference_policy(context)

    def decide(runs, high):
        return confirmation_verdict(runs, high, context.budget, context.chance)

    def trained(policy, seed):
        return run_record(context.trainer(policy, confirmation.length, seed), seed)

    rows = []
    for _, row in baselines[baselines["source"] == "baseline"].sort_values("memory").iterrows():
        entry = {"name": row["name"], "memory": row["memory"], "memory_to_pick": row["memory"] / best["memory"],
                 "peak_predicted": row.get("peak_predicted", math.nan),
                 "proxy_accuracy": row["val_accuracy"], "held": False, "steps": math.nan, "accuracies": "",
                 "batch_stats_accuracies": "", "reading_flagged": False}
        if row["diverged"]:
            entry.update(verdict="diverged at the proxy length: out", ruled_out=True)
        elif row["memory"] >= best["memory"] / (1 - CLAIMED_SAVING):
            entry.update(verdict="not held: in (it did not diverge)", ruled_out=False)
        else:
            policy = Policy.load(Path(result.out_dir) / row["policy"])
            runs, high_runs, verdict = race(lambda seed, policy=policy: trained(policy, seed),
                                            lambda seed: trained(reference, seed), confirmation.seeds,
                                            confirmation.reference_seeds, decide, high_runs)
            marked = [flagged(run["val_accuracy"], run["batch_stats_accuracy"], context.budget.drop) for run in runs]
            entry.update(held=True, steps=confirmation.length, reading_flagged=any(marked),
                         accuracies=";".join(f"{run['val_accuracy']:.4f}" for run in runs),
                         batch_stats_accuracies=";".join(f"{run['batch_stats_accuracy']:.4f}" for run in runs))
            if any(marked):  # eval mode is not to be trusted: out only if batch statistics read it out too
                batch_read = [{**run, "val_accuracy": run["batch_stats_accuracy"]} for run in runs]
                out = decide(batch_read, high_runs) is False
                entry.update(verdict="reading flagged, below the drop with batch statistics too: out" if out
                             else "reading flagged: not ruled out", ruled_out=out)
            else:
                entry.update(verdict={True: "within the drop: in", False: "below the drop: out"}.get(
                    verdict, "undecided: out"), ruled_out=verdict is not True)
        rows.append(entry)
    return pd.DataFrame(rows)


def held_text(held: Any, best) -> str:
    """The held baselines as the demo prints them, and its claim: the least-memory baseline still in (or not
    ruled out) and how much less memory the pick holds; under 10%, the search matched that baseline's rule."""
    from precsearch.cli.search import memory_text

    lines = [f"baselines held to all-high (memory below {1 / (1 - CLAIMED_SAVING):.2f}x the pick's), "
             f"also in {HELD_FILE}:"]
    for _, row in held[held["held"] | (held["ruled_out"] & ~held["held"])].iterrows():
        readings = (f"  confirmed {row['accuracies'].replace(';', ', ')} (batch statistics "
                    f"{row['batch_stats_accuracies'].replace(';', ', ')}; {int(row['steps'])} steps)"
                    if row["held"] else "")
        lines.append(f"  {row['name']:<11} {memory_text(row)}{readings}: {row['verdict']}")
    kept = held[~held["ruled_out"].astype(bool)]
    if kept.empty:
        lines.append("every baseline is out: the pick holds less memory than any prior-work recipe that holds")
        return "\n".join(lines)
    least = kept.loc[kept["memory"].idxmin()]
    saving = 1 - best["memory"] / least["memory"]
    lines.append(f"the least-memory baseline not ruled out: {least['name']}, {least['memory']:.3f} "
                 f"({least['verdict']}); the pick holds {saving:.0%} less memory")
    if saving < CLAIMED_SAVING:
        lines.append(f"on this task the search matches {least['name']}'s rule: the pick is within "
                     f"{CLAIMED_SAVING:.0%} of its memory")
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    from precsearch.analysis.report import MEASURE_LABELS, write_report
    from precsearch.cli.search import (
        accuracy_text,
        confidence_text,
        confirmed_text,
        memory_text,
        peak_text,
        tie_text,
        yardsticks_text,
    )
    from precsearch.config.spaces import paper_space
    from precsearch.config.spec import DEFAULT_MEMORY_MEASURE
    from precsearch.search.accounting import describe_budget
    from precsearch.search.baselines import run_baselines
    from precsearch.search.context import Budget, DataSpec, SearchContext
    from precsearch.search.settings import SearchConfig, usable_jobs
    from precsearch.search.study import run_search
    from precsearch.search.trials import copies
    from precsearch.train.trainer import resolve_device

    start = time.perf_counter()
    out = Path(args.out)
    resolve_device(args.device)  # before an earlier demo in --out is cleared
    _clear_previous_demo(out)
    space = paper_space(proxy=PROXY)
    jobs = usable_jobs(args.jobs, args.trials)  # what SearchConfig starts (it says so at INFO)
    compile = choose_compile(args, args.trials * space.proxy.steps // jobs)  # each worker compiles once
    print(f"precsearch demo: {MODEL} on {DATA} ({space.proxy.image_size}x{space.proxy.image_size}), space "
          f"{space.name}, {args.trials} trials of calibrated proxies on {jobs} worker(s)")
    result = run_search(SearchConfig(MODEL, space, DATA, trials=args.trials, out_dir=out, jobs=args.jobs, seed=0,
                                     device=args.device, threads=THREADS, proxy_seeds=None, compile=compile))
    search_time = time.perf_counter() - start
    baselines = run_baselines(MODEL, space, DATA, out_dir=out, seed=0, device=args.device, threads=THREADS,
                              compile=compile)
    png, md = write_report(out)
    trials = result.trials
    high = trials[trials["decisions"].str.fullmatch("H+")]
    front = result.pareto
    print(f"\nproxy length: {result.calibration.length} steps (calibrated on the all-high reference)")
    print(f"search: {len(trials)} trials ({int(trials['trained'].sum() - copies(trials).sum())} "
          f"assignments trained) in {search_time:.0f} s; all-high proxy accuracy {accuracy_text(high.iloc[0])}")
    print(result.noise.describe())
    print(f"Pareto front (memory: {MEASURE_LABELS[DEFAULT_MEMORY_MEASURE]}, as a share of all-high's):")
    for _, row in front.iterrows():
        print(f"  trial {int(row['number']):3d}  {memory_text(row)}  accuracy {accuracy_text(row)}"
              f"{confirmed_text(row)}  [{row['origin']}]{tie_text(row)}")
    print(yardsticks_text(result))
    print("baselines (same proxies):")
    for _, row in baselines[baselines["source"].isin(("baseline", "torch"))].iterrows():
        state = "diverged" if row["diverged"] else f"accuracy {row['val_accuracy']:.4f}"
        print(f"  {row['name']:<9} {memory_text(row)}  {state}")
    if result.best is not None:
        best = result.best
        print(f"best.json: trial {int(best['number'])}, {memory_text(best)}, confirmed accuracy {accuracy_text(best)} "
              f"(least memory within {100 * MAX_DROP:g} point of all-high at {100 * result.noise.confidence:g}% "
              f"confidence){confidence_text(best)}")
        print(f"  {json.loads((out / 'best.json').read_text())['provenance']['noise']['statement']}")
        print(peak_text(out))
        context = SearchContext.create(MODEL, space, DataSpec(DATA), Budget(max_accuracy_drop=MAX_DROP), 0,
                                       args.device)
        held = held_baselines(baselines, best, result, context)
        atomic_write_text(out / HELD_FILE, held.to_csv(index=False))
        print(held_text(held, best))
    else:
        print(f"best.json not written: {result.note}")
    print(describe_budget(result.budget))
    print(f"\npolicies: {out / 'policies'}/ and {out / 'best.json'}\nreport:   {md} and {png}")
    train = ["precsearch", "train", MODEL, "--policy", str(out / "best.json"), "--data", DATA, "--batch-size",
             str(PROXY["batch_size"]), "--image-size", str(PROXY["image_size"]), "--recipe", "proxy", "--steps", "1200",
             "--metrics", str(out / "train.csv")]
    print(f"train under the best policy (the proxies' recipe; the paper's learns no gratings in 10 epochs, fp32 "
          f"included): {shlex.join(train)}")
    print(f"demo wall time: {time.perf_counter() - start:.0f} s")
    return 0
