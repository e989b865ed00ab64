"""`precsearch baselines MODEL ...`: prior-work policies and the paper's sweep under the same proxies."""

from __future__ import annotations

import argparse

from precsearch.cli._arguments import (
    add_compile_argument,
    add_data_arguments,
    add_space_arguments,
    choose_compile,
    path,
    space_argument,
)
from precsearch.config.spec import BASELINES, MEMORY_MEASURES, TORCH_BASELINES

HELP = "train prior-work baselines and the paper's sweep into one table"
DESCRIPTION = ("Proxy-train the prior-work policies, the plain model under torch.autocast (autocast_bf16; "
               "autocast_fp16 on CUDA) and the paper's technique at r = 0, 0.1, ..., 1 with the space's proxy budget "
               "(in a search run directory: the search's proxy length); writes baselines.csv and baselines/*.json into "
               "--out. The autocast rows have no policy file and no cost-model memory: their step's measured peak and "
               "time, beside plain fp32's, are in peak_bytes, peak_x_fp32, step_time and step_time_x_fp32. In a search "
               "run directory with the same settings, sweep points the search trained are reused.")
NAMES = (*BASELINES, *TORCH_BASELINES)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_compile_argument(parser)
    add_space_arguments(parser)
    parser.add_argument("--out", type=path, required=True, metavar="DIR", help="output (or search run) directory")
    parser.add_argument("--names", default=",".join(NAMES), metavar="LIST",
                        help=f"comma-separated baselines (default all: {','.join(NAMES)})")
    parser.add_argument("--ablations", action="store_true",
                        help="also sweep with groups ordered smallest-first and randomly")
    parser.add_argument("--memory", choices=MEMORY_MEASURES, default=None,
                        help="memory measure of the table's memory column: the predicted peak of a training step "
                             "or the paper's bytes (default: the search's in a search run directory, else peak); "
                             "both are columns too")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    add_data_arguments(parser)


def run(args: argparse.Namespace) -> int:
    from precsearch.cli.search import memory_text
    from precsearch.config.spec import ProxyConfig
    from precsearch.search.baselines import run_baselines
    from precsearch.search.context import DataSpec

    names = [name.strip() for name in args.names.split(",") if name.strip()]
    compile = choose_compile(args, len(names) * (args.proxy_steps or ProxyConfig.steps))
    table = run_baselines(
        args.model, space_argument(args), DataSpec(args.data, args.data_root), out_dir=args.out,
        proxy_steps=args.proxy_steps, seed=args.seed, device=args.device, names=names, ablations=args.ablations,
        batch_size=args.batch_size, image_size=args.image_size, threads=args.threads, progress=not args.no_progress,
        compile=compile, memory=args.memory)
    for _, row in table.iterrows():
        state = f"diverged: {row['reason']}" if row["diverged"] else f"accuracy {row['val_accuracy']:.4f}"
        reused = f" (reused {row['reused']})" if row["reused"] else ""
        print(f"{row['source']:>9} {row['name']:<9} {memory_text(row)}  {state}{reused}")
    print(f"table: {args.out}/baselines.csv; policies: {args.out}/baselines/")
    return 0
