"""`precsearch formats`: the named formats and their ranges, or how values round in chosen formats."""

from __future__ import annotations

import argparse
import logging
import math

import pandas as pd
import torch

from precsearch.formats import format as formats
from precsearch.formats.kernels import quantize

log = logging.getLogger(__name__)

HELP = "list float formats, or round values in them"
DESCRIPTION = f"List float formats, or round values in them. Spec grammar: {formats.GRAMMAR}."


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("specs", nargs="*", help="formats to show (default: every named format)")
    parser.add_argument("--round", nargs="+", type=float, metavar="X",
                        help="values to round in each format (each first becomes a float32: beyond +-3.4e38, +-inf)")
    parser.add_argument("--rounding", default="nearest", choices=formats.ROUNDINGS)
    parser.add_argument("--overflow", default=None, choices=formats.OVERFLOWS)


def run(args: argparse.Namespace) -> int:
    fmts = [formats.get_format(s) for s in args.specs] or list(formats.NAMED_FORMATS.values())
    if args.round:
        values = torch.tensor(args.round, dtype=torch.float32)
        beyond = [f"{given:g}" for given, held in zip(args.round, values.tolist(), strict=True)
                  if math.isfinite(given) and math.isinf(held)]
        if beyond:
            log.warning("%s: beyond float32's range, rounded as infinite (every format is simulated in float32)",
                        ", ".join(beyond))
        table = pd.DataFrame({"x": values.tolist()})
        generator = torch.Generator().manual_seed(0)
        for fmt in fmts:
            overflow = args.overflow or fmt.default_overflow
            table[f"{fmt.name} (overflow {overflow})"] = quantize(values, fmt, args.rounding, overflow,
                                                                  generator).tolist()
    else:
        table = pd.DataFrame(
            {
                "format": f.name,
                "E": f.exp,
                "M": f.man,
                "bias": f.bias,
                "bits": f.bits,
                "max": f.max,
                "min_normal": f.min_normal,
                "min_subnormal": f.min_subnormal,
                "inf": f.has_inf,
                "nan": f.has_nan,
                "overflow default": f.default_overflow,
            }
            for f in fmts
        )
    print(table.to_string(index=False, float_format="{:.8g}".format))
    return 0
