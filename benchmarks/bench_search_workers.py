"""Search throughput with 1, 2 and 4 workers on one PostgreSQL study, and what the storage costs per trial.

    .venv/bin/python benchmarks/bench_search_workers.py [--workers 1 2 4] [--trials 24] [--proxy-steps 20]

Starts a throwaway local PostgreSQL server (benchmarks/local_postgres.py) and, for each worker count, a new
study that that many `precsearch search ... --study-name` processes share (tiny_cnn, 8x8 digits, one decision
per tensor so assignments rarely repeat, eager rounding, one thread each). Per run it prints:

- trials per minute, from the first trial's start to the last trial's end (process start-up excluded);
- the median share of a trained trial's time spent outside its proxy (sampling, deduplication under the
  database lock, heartbeats, writing results and outputs);
- the storage alone: the same number of processes running empty trials against the same server, in trials
  per minute: each suggests as many decisions, takes the decision lock, reads the study's trials and sets
  an attribute, as a search trial does, with the same storage settings (heartbeat on); random sampling,
  so that the sampler's own cost does not count.

If the storage-alone rate is far above the search rate and the overhead share is small, the storage is not
the bottleneck: the proxies are.
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import optuna
import yaml
from local_postgres import local_postgres  # benchmarks/local_postgres.py (the script's folder is on sys.path)
from optuna.trial import TrialState

from precsearch.config.spaces import PAPER_SPACE
from precsearch.search.storage import StudyLocation
from precsearch.search.trials import TrialRecord

UNITS = 40  # decisions per empty trial, about tiny_cnn's tensor count


def _search_run(url: str, study: str, workers: int, trials: int, steps: int, space: Path, folder: Path) -> dict:
    command = [sys.executable, "-m", "precsearch", "--eager-kernels", "search", "tiny_cnn", "--space", str(space),
               "--storage", url, "--study-name", study, "--trials", str(trials), "--proxy-steps", str(steps),
               "--image-size", "8", "--batch-size", "16", "--device", "cpu", "--threads", "1", "--no-progress"]
    env = dict(os.environ)
    processes = [subprocess.Popen([*command, "--out", str(folder / f"{study}_{index}")], env=env,
                                  stdout=subprocess.DEVNULL) for index in range(workers)]
    for process in processes:
        if process.wait() != 0:
            raise SystemExit(f"a worker of {study} exited with {process.returncode}")
    done = [t for t in optuna.load_study(study_name=study, storage=url).get_trials()
            if t.state == TrialState.COMPLETE]
    span = (max(t.datetime_complete for t in done) - min(t.datetime_start for t in done)).total_seconds()
    records = [TrialRecord.from_trial(t) for t in done]
    trained = [t for t, record in zip(done, records, strict=True)
               if record.trained and record.duplicate_of is None and not record.reference_copy]
    overhead = [1 - t.user_attrs["wall_time"] / (t.datetime_complete - t.datetime_start).total_seconds()
                for t in trained]
    return {"trials": len(done), "trained": len(trained), "per_minute": 60 * len(done) / span,
            "overhead": statistics.median(overhead)}


def _empty_trials(url: str, study: str, count: int) -> None:
    location = StudyLocation.of(url, Path("."), study, heartbeat=20)
    storage = location.open()
    study_object = optuna.load_study(study_name=study, storage=storage, sampler=optuna.samplers.RandomSampler())

    def objective(trial: optuna.Trial) -> float:
        values = [trial.suggest_categorical(f"u{index}", ["high", "low"]) == "low" for index in range(UNITS)]
        with location.lock(storage):
            trial.study.get_trials(deepcopy=False)
            trial.set_user_attr("trains", trial.number)
        return float(sum(values))

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    study_object.optimize(objective, n_trials=count)


def _storage_run(url: str, study: str, workers: int, trials: int) -> float:
    optuna.create_study(study_name=study, storage=url)
    spawn = multiprocessing.get_context("spawn")
    processes = [spawn.Process(target=_empty_trials, args=(url, study, trials // workers)) for _ in range(workers)]
    for process in processes:
        process.start()
    for process in processes:
        process.join()
    done = optuna.load_study(study_name=study, storage=url).get_trials(states=(TrialState.COMPLETE,))
    span = (max(t.datetime_complete for t in done) - min(t.datetime_start for t in done)).total_seconds()
    return 60 * len(done) / span


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--trials", type=int, default=24)
    parser.add_argument("--proxy-steps", type=int, default=20)
    args = parser.parse_args()
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    with tempfile.TemporaryDirectory() as folder, local_postgres() as url:
        space = Path(folder) / "tensor.yaml"
        space.write_text(yaml.safe_dump({**PAPER_SPACE, "granularity": "tensor"}))
        print(f"{os.cpu_count()} CPU cores; tiny_cnn, {args.trials} trials of {args.proxy_steps}-step proxies")
        print("| workers | search trials/min | proxies trained | time outside the proxy (median) "
              "| storage alone, empty trials/min |")
        print("|---|---|---|---|---|")
        for workers in args.workers:
            search = _search_run(url, f"search{workers}", workers, args.trials, args.proxy_steps, space,
                                 Path(folder))
            alone = _storage_run(url, f"empty{workers}", workers, 10 * args.trials)
            print(f"| {workers} | {search['per_minute']:.1f} | {search['trained']} of {search['trials']} "
                  f"| {100 * search['overhead']:.1f}% | {alone:.0f} |", flush=True)


if __name__ == "__main__":
    start = time.perf_counter()
    main()
    print(f"({time.perf_counter() - start:.0f} s)")
