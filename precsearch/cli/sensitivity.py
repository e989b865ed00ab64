"""`precsearch sensitivity MODEL ...`: which groups and tensor kinds the space's low format hurts, measured on
a few all-high training steps (precsearch.search.sensitivity), as a table and sensitivity.csv."""

from __future__ import annotations

import argparse

from precsearch.cli._arguments import add_data_arguments, add_model_argument, count, path, space_argument
from precsearch.search.sensitivity import DEFAULT_BATCHES

HELP = "measure how much the low format hurts each group and tensor kind"
DESCRIPTION = ("Score, per decision unit and tensor kind, the error the space's low format would add in a few "
               "seeded fp32 SGD steps of MODEL (gradient-weighted; on the update for gradients) and its overflow and "
               "underflow shares; list the units least sensitive per byte saved first; write sensitivity.csv to --out.")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_model_argument(parser)
    parser.add_argument("--space", type=path, default=None, metavar="YAML",
                        help="search space file (default: the paper's HFP8 space)")
    parser.add_argument("--batches", type=count, default=DEFAULT_BATCHES, metavar="N",
                        help="training batches measured (default %(default)s)")
    parser.add_argument("--out", type=path, required=True, metavar="DIR",
                        help="directory for sensitivity.csv (a run directory)")
    add_data_arguments(parser)


def run(args: argparse.Namespace) -> int:
    from precsearch.config.spaces import load_space
    from precsearch.models import check_fits
    from precsearch.search.context import DataSpec, torch_threads
    from precsearch.search.sensitivity import measure_model
    from precsearch.search.sensitivity_table import save_table, unit_table
    from precsearch.train.trainer import resolve_device

    space = space_argument(args)
    space = load_space(space) if isinstance(space, str) else space
    space = space.with_proxy(batch_size=args.batch_size, image_size=args.image_size)
    device = resolve_device(args.device)
    check_fits(args.model, space.proxy.batch_size, space.proxy.image_size)  # before the data is loaded at that size
    with torch_threads(args.threads):
        data = DataSpec(args.data, args.data_root).load(space.proxy.image_size, seed=args.seed)
        table = measure_model(args.model, space, data, batches=args.batches, seed=args.seed, device=str(device))
    path = save_table(table, args.out)
    print(unit_table(table).to_string(index=False, float_format=lambda value: f"{value:.3g}"))
    print(f"table: {path}")
    return 0
