"""`precsearch report RUN_DIR`: the memory-accuracy plot (report.png) and table (report.md) of a run."""

from __future__ import annotations

import argparse
from typing import Any


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "report", help="plot and tabulate a run directory",
        description="Write RUN_DIR/report.png (memory vs proxy accuracy: trials, Pareto front, the paper's "
                    "sweep, baselines) and RUN_DIR/report.md (the same points as a table).")
    parser.add_argument("run_dir", metavar="RUN_DIR", help="directory written by precsearch search / baselines")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from precsearch.report import write_report

    png, md = write_report(args.run_dir)
    print(f"plot: {png}\ntable: {md}")
    return 0
