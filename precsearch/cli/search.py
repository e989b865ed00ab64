"""`precsearch search MODEL ...`: search precision assignments with Optuna and short proxies; also holds the
summary texts demo shares."""

from __future__ import annotations

import argparse
import math
import os
import shlex
import signal
import sys
from pathlib import Path
from typing import Any

from precsearch.cli._arguments import (
    add_compile_argument,
    add_data_arguments,
    add_space_arguments,
    choose_compile,
    count,
    count_or_auto,
    path,
    real,
    space_argument,
)
from precsearch.config.spec import DEFAULT_MEMORY_MEASURE, MEMORY_MEASURES, SAMPLERS

NO_PICK = 3  # the exit status of a search that ended without a pick (README, "Command line")
PAUSE_AT = "PRECSEARCH_PAUSE_AT"  # test hook: a setup point where the search stops itself (SearchConfig.pause_at)
HELP = "search precision assignments (Optuna + proxy training)"
DESCRIPTION = ("Search mixed-precision assignments of MODEL: memory from the cost model, accuracy from "
               "short proxy trainings. Writes trials.csv, pareto.csv, policies/ and best.json into --out. "
               f"Exit status: 0 with a pick (best.json), {NO_PICK} when the search ends without one (its last line "
               "says why; the other files are written), 2 for an input refused before any work.")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_compile_argument(parser)
    from precsearch.search.calibration import CalibrationSettings
    from precsearch.search.confirmation import DEFAULT_CONFIRM_FACTOR, MAX_CONFIRM_FACTOR
    from precsearch.search.noise import MAX_PROXY_SEEDS

    add_space_arguments(parser, calibrated=True)
    parser.add_argument("--max-proxy-steps", type=count, default=CalibrationSettings.max_steps, metavar="S",
                        help="cap of the calibration's doubling schedule (default %(default)s)")
    parser.add_argument("--confirm-factor", type=real(1, MAX_CONFIRM_FACTOR), default=DEFAULT_CONFIRM_FACTOR,
                        metavar="F", help="confirmation runs are F x the proxy length, on fresh seeds, F in [1, "
                                          f"{MAX_CONFIRM_FACTOR}] (default %(default)s)")
    parser.add_argument("--trials", type=count, default=40, metavar="N",
                        help="distinct assignments the study tries (default 40; a smaller space is enumerated)")
    parser.add_argument("--out", type=path, required=True, metavar="DIR", help="run directory")
    parser.add_argument("--storage", type=path, default=None, metavar="URL",
                        help="Optuna storage URL (postgresql://user:password@host/db, sqlite:///f.db) or journal "
                             "file path (default: DIR/study.journal)")
    parser.add_argument("--study-name", default=None, metavar="NAME",
                        help="join the shared study NAME in --storage (creating and seeding it if new): run the "
                             "same command on every host, each with its own --out; --trials is the study's total")
    parser.add_argument("--heartbeat", type=count, default=20, metavar="S",
                        help="seconds between a worker's heartbeats on a database storage; a trial silent for 3 x S "
                             "is failed and its assignment retried (default 20)")
    parser.add_argument("--jobs", type=count, default=1, metavar="N",
                        help="worker processes on the study; with --device cuda, one per visible GPU; no more are "
                             "started than the trials and the machine's CPUs can use (-v says so)")
    parser.add_argument("--resume", action="store_true",
                        help="continue the search in --out (with no other process working on its study)")
    budget = parser.add_mutually_exclusive_group()
    budget.add_argument("--max-memory", type=real(0, 1, open_low=True), default=None, metavar="R",
                        help="single objective: best accuracy with memory <= R x all-high")
    budget.add_argument("--max-accuracy-drop", type=real(0, 1), default=None, metavar="D",
                        help="single objective: least memory with accuracy >= all-high - D (0.01 = 1 point)")
    parser.add_argument("--memory", choices=MEMORY_MEASURES, default=DEFAULT_MEMORY_MEASURE,
                        help="memory measure to minimize: the predicted peak of a training step (default; what "
                             "the device runs out of) or the bytes of the tensors training keeps (the paper's)")
    parser.add_argument("--proxy-seeds", type=count_or_auto("seeds", None, MAX_PROXY_SEEDS), default=None,
                        metavar="K", help=f"seeds per proxy (and for the all-high reference), at most "
                                          f"{MAX_PROXY_SEEDS}; auto (default): the reference trains 3, and each "
                                          "proxy as many (2-4) as the noise they show needs")
    parser.add_argument("--confidence", type=real(0.5, 1, open_high=True), default=0.9, metavar="C",
                        help="one-sided confidence of accuracy decisions against the seed noise (default 0.9)")
    parser.add_argument("--seeding", choices=list(seedings()), default="paper",
                        help="first trials: the paper's sweep with all-high and all-low (paper, the default), or the "
                             "knapsack's points over measured sensitivity ahead of them (sensitivity)")
    parser.add_argument("--sampler", choices=SAMPLERS, default=None,
                        help="Optuna sampler: multivariate TPE, NSGA-II, random or a Gaussian process (default: the "
                             "space's sampler, tpe)")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    add_data_arguments(parser)


def seedings() -> dict[str, Any]:
    """--seeding's choices: each seeding by its name (the one a study's config records)."""
    from precsearch.search.seeding import PAPER_SEEDING
    from precsearch.search.sensitivity import SENSITIVITY_SEEDING

    return {seeding.name: seeding for seeding in (PAPER_SEEDING, SENSITIVITY_SEEDING)}


def run(args: argparse.Namespace) -> int:
    from precsearch.config.spec import ProxyConfig
    from precsearch.search.context import Budget, DataSpec
    from precsearch.search.settings import SearchConfig, usable_jobs
    from precsearch.search.study import SearchInterrupted, run_search

    proxy_steps = args.proxy_steps if isinstance(args.proxy_steps, int) else ProxyConfig.steps  # calibrated: longer
    compile = choose_compile(args, args.trials * proxy_steps // usable_jobs(args.jobs, args.trials))  # once a worker
    budget = Budget(max_memory=args.max_memory, max_accuracy_drop=args.max_accuracy_drop, memory=args.memory,
                    confidence=args.confidence)
    config = SearchConfig(
        args.model, space_argument(args), DataSpec(args.data, args.data_root), trials=args.trials, out_dir=args.out,
        proxy_steps=args.proxy_steps, max_proxy_steps=args.max_proxy_steps, confirm_factor=args.confirm_factor,
        storage=args.storage, jobs=args.jobs, resume=args.resume, budget=budget, seed=args.seed, device=args.device,
        batch_size=args.batch_size, image_size=args.image_size, threads=args.threads, progress=not args.no_progress,
        study_name=args.study_name, heartbeat=args.heartbeat, proxy_seeds=args.proxy_seeds, sampler=args.sampler,
        seeding=seedings()[args.seeding], compile=compile, pause_at=os.environ.get(PAUSE_AT))
    try:
        result = run_search(config)
    except SearchInterrupted as stop:
        done = int(stop.result.trials["state"].isin(["COMPLETE", "PRUNED"]).sum()) if len(stop.result.trials) else 0
        name = signal.Signals(stop.signum).name
        print(f"precsearch search: stopped by {name}; {done} finished trial(s) saved in {args.out}; "
              "continue with --resume", file=sys.stderr)
        return 128 + stop.signum
    print(summarize(result))
    if result.best is None:
        print(f"precsearch search: no pick, best.json not written: {result.note or 'no trial meets the budget'}",
              file=sys.stderr)
        return NO_PICK
    return 0


def accuracy_text(row: Any) -> str:
    """Mean accuracy, with +- the seed sd and the seed count when the proxy ran several seeds."""
    seeds = row.get("seeds", 1)
    if seeds != seeds or seeds < 2:  # NaN or one seed
        return f"{row['val_accuracy']:.4f}"
    return f"{row['val_accuracy']:.4f} +- {row['val_accuracy_sd']:.4f} ({int(seeds)} seeds)"


def tie_text(row: Any) -> str:
    cheaper = row.get("within_noise_of", -1)
    return f"  (within noise of trial {int(cheaper)})" if cheaper == cheaper and cheaper >= 0 else ""


def confidence_text(best: Any) -> str:
    confidence = best.get("pick_confidence", float("nan"))
    return "" if confidence != confidence else f", picked with {100 * confidence:.0f}% confidence"


def confirmed_text(row: Any) -> str:
    """', confirmed A +- sd (K seeds, S steps)' for a row with a confirmation, else ''."""
    accuracy = row.get("confirmed_accuracy", float("nan"))
    if accuracy != accuracy:
        return ""
    sd = row.get("confirmed_sd", float("nan"))
    spread = f" +- {sd:.4f}" if sd == sd else ""
    return (f", confirmed {accuracy:.4f}{spread} ({int(row['confirmed_seeds'])} seeds, "
            f"{int(row['confirmed_steps'])} steps)")


def yardsticks_text(result: Any) -> str:
    """The confirmed all-high and plain fp32 accuracies, the pick's yardsticks."""
    from precsearch.search.confirmation import PLAIN_FP32

    if result.confirmation is None:
        return ""
    table = result.confirmation.table()
    if table.empty:
        return ""
    high = result.trials[result.trials["decisions"].str.fullmatch("H+")]
    names = {PLAIN_FP32: "plain fp32"}
    if not high.empty:
        names[high.iloc[0]["key"]] = "all-high"
    parts = [f"{names[row['key']]} {row['confirmed_accuracy']:.4f}" for _, row in table.iterrows()
             if row["key"] in names]
    return "confirmed yardsticks: " + ", ".join(parts)


def memory_text(row: Any) -> str:
    """A row's memory as the summaries print it. A policy's: the step's peak the cost model predicts, in MiB, then
    the ratio to all-high of the measure the search minimized; a torch.autocast row's (``source`` torch, no
    formats): its step's measured peak and time beside plain fp32's."""
    if row.get("source") == "torch":
        return (f"step peak {row['peak_bytes'] / 2**20:.2f} MiB measured ({row['peak_x_fp32']:.3f}x plain fp32, "
                f"step time {row['step_time_x_fp32']:.2f}x)")
    peak = float(row.get("peak_predicted", math.nan))
    lead = "" if math.isnan(peak) else f"step peak {peak / 2**20:.2f} MiB predicted, "
    return f"{lead}memory {row['memory']:.3f} of all-high"


def peak_text(out_dir: str | Path) -> str:
    """The pick's measured step peak beside plain fp32's and torch.autocast's (best.json's ``peak``), or ''."""
    from precsearch.config.reading import load_json_object
    from precsearch.search.peaks import StepPeaks

    best = Path(out_dir) / "best.json"
    peak = load_json_object(best, "policy file", "run the search again").get("provenance", {}).get("peak") \
        if best.is_file() else None
    return "" if peak is None else f"  {StepPeaks(**peak).describe()}"


def summarize(result: Any) -> str:
    """A few lines: the proxy length, trials, the front (proxy and confirmed), the pick, the budget, files."""
    from precsearch.search.accounting import describe_budget

    trials = result.trials
    interrupted = trials["interrupted"] if "interrupted" in trials else trials["state"] != trials["state"]
    failed = (trials["state"] == "FAIL") & ~interrupted
    lines = []
    if result.calibration is not None:
        how = "fixed" if result.calibration.fixed else "calibrated on the all-high reference"
        lines.append(f"proxy length: {result.calibration.length} steps ({how})")
        if result.calibration.warning:
            lines.append(f"WARNING: {result.calibration.warning}")
    stopped = int(trials["stopped_at"].notna().sum()) if "stopped_at" in trials else 0
    lines.append(f"{len(trials)} trials ({int((trials['state'] == 'COMPLETE').sum())} complete, "
                 f"{int(trials['diverged'].sum())} diverged, {stopped} stopped at a rung, {int(failed.sum())} failed, "
                 f"{int(interrupted.sum())} interrupted and retried) "
                 f"in {result.wall_time:.1f} s; Pareto front: {len(result.pareto)} point(s)")
    for _, row in result.pareto.iterrows():
        lines.append(f"  trial {int(row['number']):4d}: {memory_text(row)}, "
                     f"proxy accuracy {accuracy_text(row)}{confirmed_text(row)}  [{row['origin']}]{tie_text(row)}")
    if result.noise is not None:
        lines.append(result.noise.describe())
    if yardsticks := yardsticks_text(result):
        lines.append(yardsticks)
    if result.best is not None:
        lines.append(f"best.json: trial {int(result.best['number'])} ({memory_text(result.best)}, "
                     f"confirmed accuracy {accuracy_text(result.best)}){confidence_text(result.best)}")
        if peak := peak_text(result.out_dir):
            lines.append(peak)
        if result.note:
            lines.append(f"  {result.note}")
    else:
        lines.append(f"best.json not written: {result.note or 'no trial meets the budget'}")
    if result.budget is not None:
        lines.append(describe_budget(result.budget))
    best = ", best.json" if result.best is not None else ""
    lines.append(f"outputs: {result.out_dir}/trials.csv, pareto.csv, calibration.csv, budget.csv, policies/{best}; "
                 f"plot with: {shlex.join(['precsearch', 'report', str(result.out_dir)])}")
    return "\n".join(lines)
