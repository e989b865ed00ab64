"""`precsearch validate RUN`: retrain a search's front and references at full length, measure proxy fidelity."""

from __future__ import annotations

import argparse

from precsearch.cli._arguments import (
    DEVICE_HELP,
    add_compile_argument,
    add_trust_argument,
    choose_compile,
    count,
    device,
    path,
    seed,
)

HELP = "retrain a search's front and references at full length; write fidelity.csv and a plot"
DESCRIPTION = ("Retrain the Pareto front, the all-high reference, the paper's sweep points and best.json of the run "
               "directory RUN for --steps steps, then write fidelity.csv (proxy vs long-run accuracy, memory with the "
               "long run's promotions), fidelity.json (Spearman and Kendall rank correlations with bootstrap "
               "intervals; whether best.json still meets its budget) and fidelity.png.")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("run", type=path, metavar="RUN", help="run directory of precsearch search")
    parser.add_argument("--steps", type=count, default=None, metavar="N",
                        help="training steps of each long run (default: 8 x the proxy's steps)")
    parser.add_argument("--seed", type=seed, default=None, help="seed of the long runs (default: the search's)")
    parser.add_argument("--device", type=device, default="cpu", help=DEVICE_HELP)
    parser.add_argument("--threads", type=count, default=None, metavar="N", help="torch threads")
    add_compile_argument(parser)
    add_trust_argument(parser, "RUN/run.json")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")


def run(args: argparse.Namespace) -> int:
    from precsearch.analysis.fidelity import validate_run

    result = validate_run(args.run, steps=args.steps, seed=args.seed, device=args.device, threads=args.threads,
                          progress=not args.no_progress, compile=choose_compile(args, None),  # long runs
                          trust_model=args.trust_model)
    summary = result.summary
    print(result.table[["trial", "roles", "proxy_accuracy", "proxy_sd", "long_accuracy", "long_promotions",
                        "long_memory"]].to_string(index=False))
    for name in ("spearman", "kendall"):
        value = summary.get(name)
        print(f"{name}: n/a (fewer than 3 assignments or no spread)" if value is None else
              f"{name}: {value:.3f} (90% bootstrap interval {summary[f'{name}_low']:.3f} to "
              f"{summary[f'{name}_high']:.3f})")
    high = result.table[result.table["roles"].str.contains("all-high")]
    if not high.empty:
        print(f"after {summary['long_steps']} steps: all-high {high.iloc[0]['long_accuracy']:.4f}, plain fp32 "
              f"{summary['plain_fp32_accuracy']:.4f}")
    if (best := summary.get("best")) is not None:
        state = "still meets" if best["meets_budget"] else "no longer meets"
        print(f"best.json (trial {best['trial']}) {state} its budget after {summary['long_steps']} steps: accuracy "
              f"{best['long_accuracy']:.4f}, memory {best['long_memory']:.3f} (proxy {best['proxy_memory']:.3f})")
    print("wrote " + ", ".join(str(path) for path in result.files))
    return 0
