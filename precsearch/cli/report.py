"""`precsearch report RUN_DIR`: the memory-accuracy plot (report.png) and table (report.md) of a run."""

from __future__ import annotations

import argparse

from precsearch.cli._arguments import add_trust_argument, path

HELP = "plot and tabulate a run directory"
DESCRIPTION = ("Write RUN_DIR/report.png (memory vs proxy accuracy: trials, Pareto front, the paper's "
               "sweep, baselines) and RUN_DIR/report.md (the same points as a table). With --storage, "
               "first rebuild RUN_DIR's trials.csv, pareto.csv, policies/ and best.json from the study.")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("run_dir", type=path, metavar="RUN_DIR",
                        help="directory written by precsearch search / baselines")
    parser.add_argument("--storage", type=path, default=None, metavar="URL",
                        help="read the study from this storage (e.g. the PostgreSQL URL the workers shared)")
    parser.add_argument("--study-name", default=None, metavar="NAME",
                        help="the study's name in --storage (default: precsearch, a search's own study)")
    add_trust_argument(parser, "the study in --storage")


def run(args: argparse.Namespace) -> int:
    from precsearch.analysis.report import write_report
    from precsearch.errors import PrecsearchError
    from precsearch.search.storage import STUDY_NAME
    from precsearch.search.study import export_study

    for given, name in ((args.study_name, "--study-name"), (args.trust_model, "--trust-model")):
        if given is not None and args.storage is None:
            raise PrecsearchError(f"{name} needs --storage (the URL the study is in)")
    if args.storage is not None:
        result = export_study(args.storage, args.run_dir, args.study_name or STUDY_NAME, args.trust_model)
        print(f"rebuilt from the storage: {len(result.trials)} trials, {len(result.pareto)} Pareto point(s)")
    png, md = write_report(args.run_dir)
    print(f"plot: {png}\ntable: {md}")
    return 0
