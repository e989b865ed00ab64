"""`precsearch formats`: the named formats and their ranges, or how values round in chosen formats, scaled ones
(``e4m3fn@tensor``, precsearch.formats.scaled) included: the values given are one tensor, scaled as such."""

from __future__ import annotations

import argparse
import logging
import math
from typing import Any

import pandas as pd
import torch

from precsearch.errors import PrecsearchError
from precsearch.formats import format as formats
from precsearch.formats.kernels import quantize
from precsearch.formats.scaled import SCALED_GRAMMAR, ScaledFormat, any_format, expand_scales, quantize_scaled

log = logging.getLogger(__name__)

HELP = "list float formats, or round values in them"
DESCRIPTION = (f"List float formats, or round values in them. Spec grammar: {formats.GRAMMAR}; scaled: "
               f"{SCALED_GRAMMAR}. With --round the values are one tensor (one row): a scaled format takes its scale "
               "from their amax (per tensor and per row alike), or each block's from that block's.")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("specs", nargs="*", help="formats to show (default: every named format)")
    parser.add_argument("--round", nargs="+", type=float, metavar="X",
                        help="values to round in each format (each first becomes a float32: beyond +-3.4e38, +-inf)")
    parser.add_argument("--rounding", default="nearest", choices=formats.ROUNDINGS)
    parser.add_argument("--overflow", default=None, choices=formats.OVERFLOWS,
                        help="of an unscaled format (default: its own); a scaled format saturates")


def run(args: argparse.Namespace) -> int:
    fmts = [any_format(s) for s in args.specs] or list(formats.NAMED_FORMATS.values())
    table = _rounding_table(fmts, args) if args.round else _format_table(fmts)
    print(table.to_string(index=False, float_format="{:.8g}".format))
    return 0


def _format_table(fmts: list[Any]) -> pd.DataFrame:
    """One row per format: its parameters (a scaled format's element's, and how it scales)."""
    rows = []
    for fmt in fmts:
        f = fmt.element if isinstance(fmt, ScaledFormat) else fmt
        row = {"format": fmt.name, "E": f.exp, "M": f.man, "bias": f.bias, "bits": f.bits, "max": f.max,
               "min_normal": f.min_normal, "min_subnormal": f.min_subnormal, "inf": f.has_inf, "nan": f.has_nan,
               "overflow default": f.default_overflow}
        if any(isinstance(other, ScaledFormat) for other in fmts):
            row["scale"] = _scale_text(fmt)
        rows.append(row)
    return pd.DataFrame(rows)


def _scale_text(fmt: Any) -> str:
    if not isinstance(fmt, ScaledFormat):
        return "-"
    if fmt.granularity == "block":
        return f"per block of {fmt.block}"
    return f"per {fmt.granularity}" + (f", delayed {fmt.history}" if fmt.history else "")


def _rounding_table(fmts: list[Any], args: argparse.Namespace) -> pd.DataFrame:
    """The values, and their rounding in each format; a scaled format's column is followed by each value's scale."""
    values = torch.tensor(args.round, dtype=torch.float32)
    beyond = [f"{given:g}" for given, held in zip(args.round, values.tolist(), strict=True)
              if math.isfinite(given) and math.isinf(held)]
    if beyond:
        log.warning("%s: beyond float32's range, rounded as infinite (every format is simulated in float32)",
                    ", ".join(beyond))
    table = pd.DataFrame({"x": values.tolist()})
    generator = torch.Generator().manual_seed(0)
    for fmt in fmts:
        if isinstance(fmt, ScaledFormat):
            rounded, scales = _round_scaled(values, fmt, args, generator)
            table[fmt.name] = rounded.tolist()
            table[f"{fmt.name} scale"] = scales.tolist()
        else:
            overflow = args.overflow or fmt.default_overflow
            table[f"{fmt.name} (overflow {overflow})"] = quantize(values, fmt, args.rounding, overflow,
                                                                  generator).tolist()
    return table


def _round_scaled(values: torch.Tensor, fmt: ScaledFormat, args: argparse.Namespace,
                  generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """``values`` rounded to the scaled ``fmt`` as one tensor, and each value's scale."""
    if fmt.history:
        raise PrecsearchError(f"{fmt.name}: a delayed scale comes from the amaxes of earlier roundings, and --round "
                              f"rounds once (with no history its scale is 1); give {fmt.element.name}@tensor for the "
                              "scale of these values")
    if args.overflow not in (None, "saturate"):
        raise PrecsearchError(f"--overflow {args.overflow}: {fmt.name} is scaled, and a scaled format saturates; "
                              "drop --overflow or give unscaled formats only")
    rounded, scales, _ = quantize_scaled(values, fmt, args.rounding, generator=generator)
    return rounded, expand_scales(scales, fmt, values.shape).expand_as(values)
