"""Confirmation's runs one at a time, outside a search: does a model's recipe train to the confirmation length?

A search confirms at ``--confirm-factor`` x L with runs that hold the proxies' rate to L and then decay along
one cosine (precsearch.search.confirmation). This script trains such runs for all-high (the search's reference
policy) and plain fp32, on the search's own model, space, data and proxy recipe, with the same trainer call
confirmation makes (``context.trainer(policy, length, seed, decay_from=L)``), so that a slow model's
confirmation can be checked, seed by seed, without its hours of trials. ``--constant`` trains the same runs at
the proxies' constant rate with the usual branch at the end instead (what confirmation did before).

    python benchmarks/confirmation_schedule.py mobilenet_v2:width=0.5 --image-size 16 --length 3200 \
        --factor 3 --runs all-high:0,plain:1000

Each finished run is appended to ``--out`` (CSV), and a run already there is not trained again.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import pandas as pd

from precsearch.search.calibration import reference_policy
from precsearch.search.confirmation import confirmation_length, decay_start
from precsearch.search.context import Budget, DataSpec, SearchContext, torch_threads
from precsearch.search.settings import SearchConfig

POLICIES = ("all-high", "plain")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("model")
    parser.add_argument("--data", default="gratings")
    parser.add_argument("--image-size", type=int, default=None)
    parser.add_argument("--batch-size", type=int, default=None)
    parser.add_argument("--length", type=int, required=True, help="the proxy length L the search calibrated")
    parser.add_argument("--factor", type=float, default=3.0, help="the confirmation length as a multiple of L")
    parser.add_argument("--runs", default="all-high:0,plain:1000", help="POLICY:SEED,... (all-high or plain)")
    parser.add_argument("--constant", action="store_true", help="the proxies' constant rate to the end instead")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", default="runs/confirmation_schedule.csv")
    args = parser.parse_args()
    runs = [(name, int(seed)) for name, seed in (run.split(":") for run in args.runs.split(","))]
    if unknown := sorted({name for name, _ in runs} - set(POLICIES)):
        parser.error(f"--runs names {unknown}; use {' or '.join(POLICIES)}")
    space = SearchConfig(args.model, "search_spaces/hfp8.yaml", batch_size=args.batch_size,
                         image_size=args.image_size).resolved_space()
    context = SearchContext.create(args.model, space, DataSpec(args.data), Budget(), 0, "cpu")
    length = confirmation_length(args.length, args.factor)
    schedule = "constant" if args.constant else "decay"
    decay_from = None if args.constant else decay_start(args.length, length)
    out = Path(args.out)
    done = pd.read_csv(out) if out.is_file() else pd.DataFrame()
    for name, seed in runs:
        row = {"model": args.model, "policy": name, "seed": seed, "length": length, "schedule": schedule,
               "decay_from": decay_from or ""}
        if not done.empty and ((done[list(row)[:5]] == pd.Series(row)[list(row)[:5]]).all(axis=1)).any():
            print(f"{name} seed {seed}: in {out} already")
            continue
        policy = reference_policy(context) if name == "all-high" else None
        start = time.perf_counter()

        def report(step: int, loss: float, name: str = name, seed: int = seed) -> None:
            if step % 400 == 0:
                print(f"{name} seed {seed}: step {step}, running loss {loss:.3f}", flush=True)

        with torch_threads(args.threads):
            result = context.trainer(policy, length, seed, report=report, decay_from=decay_from)
        row.update(val_accuracy=result.val_accuracy, diverged=result.diverged, reason=result.reason,
                   steps_run=result.steps_run, wall_s=round(time.perf_counter() - start, 1))
        print(row, flush=True)
        done = pd.concat([done, pd.DataFrame([row])], ignore_index=True)
        out.parent.mkdir(parents=True, exist_ok=True)
        done.to_csv(out.with_suffix(".tmp"), index=False)
        out.with_suffix(".tmp").replace(out)


if __name__ == "__main__":
    main()
