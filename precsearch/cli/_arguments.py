"""The one place where command-line values are checked, before any work: argparse types with a range for every
number, and the argument groups several commands share (data, space).

A value outside its range is refused by argparse in the user's words (``argument --batch-size: '0': give an
integer >= 1``, exit 2); nothing replaces it with a default. NaN and infinity are refused wherever a finite
number is meant. The module's name starts with ``_`` so command discovery (precsearch.cli) skips it.
"""

from __future__ import annotations

import argparse
import logging
import math
import re
from collections.abc import Callable
from typing import Any, NoReturn

from precsearch.config.checks import number, requirement
from precsearch.config.compiling import CompileOptions
from precsearch.errors import PrecsearchError
from precsearch.train.data import DATASETS

__all__ = ["COMPILE_MIN_STEPS", "DEVICE_HELP", "SEED_MAX", "OneLineParser", "add_compile_argument",
           "add_data_arguments", "add_space_arguments", "add_trust_argument", "choose_compile", "count",
           "count_or_auto", "device", "input_shape", "path", "proxy_steps", "read_negative_numbers", "real", "seed",
           "space_argument", "whole"]

log = logging.getLogger(__name__)

SEED_MAX = 2**32 - 1  # numpy's generators take seeds in [0, 2^32)
DEVICE_HELP = "auto (CUDA when available), cpu, cuda or cuda:N"
_DEVICE = re.compile(r"auto|cpu|cuda(:\d+)?")
# A value starting with "-" that float() reads: -2, -.5, -1e39, -inf, -nan
_NEGATIVE_NUMBER = re.compile(r"^-(\d+\.?\d*|\.\d+)(e[-+]?\d+)?$|^-(inf|infinity|nan)$", re.IGNORECASE)


class OneLineParser(argparse.ArgumentParser):
    """An argparse parser whose refusals are the one line the README promises (``precsearch train: error: argument
    --lr: 'nan' is not a finite number; ...``, exit 2), without the usage block argparse prints first; ``--help``
    shows the usage. Its subcommand parsers are of its class too (``add_subparsers`` makes them so)."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message.replace(chr(10), ' ')}\n")


def read_negative_numbers(parser: argparse.ArgumentParser) -> None:
    """Make ``parser`` take every negative number as a value: argparse's own pattern knows only -2 and -1.5, so
    ``--round -1e39`` was refused as an unknown option. argparse has no public setting for it; its parsers hold
    the pattern in ``_negative_number_matcher`` (no command has an option that looks like a number)."""
    parser._negative_number_matcher = _NEGATIVE_NUMBER


def whole(low: int = 1, high: float = math.inf) -> Callable[[str], int]:
    """An argparse type: an integer in [low, high]."""
    wanted = requirement(low, high, integer=True)

    def parse(text: str) -> int:
        try:
            return number(int(text), "", low, high, integer=True)
        except (ValueError, PrecsearchError):
            raise argparse.ArgumentTypeError(f"{text!r}: give {wanted}") from None

    return parse


def real(low: float = -math.inf, high: float = math.inf, *, open_low: bool = False,
         open_high: bool = False) -> Callable[[str], float]:
    """An argparse type: a finite number in the interval (``open_*``: that end excluded)."""
    wanted = requirement(low, high, open_low=open_low, open_high=open_high)

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a number; give {wanted}") from None
        if not math.isfinite(value):
            raise argparse.ArgumentTypeError(f"{text!r} is not a finite number; give {wanted}")
        try:
            return number(value, "", low, high, open_low=open_low, open_high=open_high)
        except PrecsearchError:
            raise argparse.ArgumentTypeError(f"{text!r}: give {wanted}") from None

    return parse


def count_or_auto(unit: str, auto: Any, high: float = math.inf) -> Callable[[str], Any]:
    """An argparse type: ``auto`` (given back as ``auto``) or a count of ``unit`` in [1, high]."""
    counted = whole(1, high)
    wanted = ">= 1" if high == math.inf else f"in [1, {high}]"

    def parse(text: str) -> Any:
        if text == "auto":
            return auto
        try:
            return counted(text)
        except argparse.ArgumentTypeError:
            raise argparse.ArgumentTypeError(f"{text!r}: give a number of {unit} {wanted}, or auto") from None

    return parse


def device(text: str) -> str:
    """An argparse type: a device name (whether CUDA is there is checked by the command, before any write)."""
    if not _DEVICE.fullmatch(text):
        raise argparse.ArgumentTypeError(f"{text!r}: give {DEVICE_HELP}")
    return text


def path(text: str) -> str:
    """An argparse type: a file or folder path, not empty (the OS would read ``""`` as the current folder)."""
    if not text.strip():
        raise argparse.ArgumentTypeError(f"{text!r}: give a path (an empty one would mean the current folder)")
    return text


def input_shape(text: str) -> tuple[int, int, int]:
    """An argparse type: one sample's shape as C,H,W, three positive integers."""
    parts = text.split(",")
    try:
        shape = tuple(count(part.strip()) for part in parts)
    except argparse.ArgumentTypeError:
        shape = ()
    if len(shape) != 3:
        raise argparse.ArgumentTypeError(f"{text!r}: give C,H,W (channels, height, width), three positive "
                                         "integers such as 3,32,32")
    return shape


count = whole(1)  # steps, batches, trials, processes, threads, a batch or image size: at least one
seed = whole(0, SEED_MAX)
proxy_steps = count_or_auto("steps", "auto")  # --proxy-steps of a search: a fixed length, or calibrated


def add_data_arguments(parser: argparse.ArgumentParser) -> None:
    """--data, --data-root, --image-size, --batch-size, --device, --seed, --threads."""
    parser.add_argument("--data", default="digits", metavar="NAME",
                        help=f"dataset: {', '.join(DATASETS)} (default digits, bundled, no download)")
    parser.add_argument("--data-root", type=path, default=None, metavar="DIR",
                        help="folder of a local dataset (cifar10, cifar100, imagefolder)")
    parser.add_argument("--image-size", type=count, default=None, metavar="PX",
                        help="resize images to PX x PX (default: the space's proxy.image_size)")
    parser.add_argument("--batch-size", type=count, default=None, metavar="N", help="training batch size")
    parser.add_argument("--device", type=device, default="auto", help=DEVICE_HELP)
    parser.add_argument("--seed", type=seed, default=0, help="seed of model init, batches, rounding, sampler")
    parser.add_argument("--threads", type=count, default=None, metavar="N",
                        help="torch threads per process (default: torch's own; with --jobs, cores / jobs); "
                             "1 is fastest for small proxies")


def add_model_argument(parser: argparse.ArgumentParser) -> None:
    """MODEL: a zoo model with its options, or a factory."""
    parser.add_argument("model", metavar="MODEL",
                        help="zoo model with options (tiny_cnn, resnet18:width=0.25, ...) or package.module:factory")


def add_space_arguments(parser: argparse.ArgumentParser, calibrated: bool = False) -> None:
    """MODEL, --space, --proxy-steps (``calibrated``: auto, the default, or a number; else a number)."""
    add_model_argument(parser)
    parser.add_argument("--space", type=path, default=None, metavar="YAML",
                        help="search space file (see search_spaces/README.md; default: the paper's HFP8 space, "
                             "as search_spaces/hfp8.yaml)")
    if calibrated:
        parser.add_argument("--proxy-steps", type=proxy_steps, default="auto", metavar="S",
                            help="SGD steps per proxy: auto (default) calibrates them from the all-high reference's "
                                 "learning curve; a number fixes them")
    else:
        parser.add_argument("--proxy-steps", type=count, default=None, metavar="S",
                            help="SGD steps per proxy (default: a search run directory's, else the space's "
                                 "proxy.steps)")


def add_trust_argument(parser: argparse.ArgumentParser, source: str) -> None:
    """--trust-model: the one way to let a model factory named in a file run (precsearch.models.check_trusted)."""
    parser.add_argument("--trust-model", default=None, metavar="SPEC",
                        help=f"run the model factory (package.module:function[:options]) that {source} names, "
                             "if it is SPEC; files are data, so without this a file naming code instead of a zoo "
                             "model is refused (read that code first)")


def space_argument(args: argparse.Namespace) -> Any:
    """The --space file, or the built-in paper space when none is given."""
    from precsearch.config.spaces import paper_space

    return args.space if args.space is not None else paper_space()


# Training steps (a process's) from which a command compiles its step by default on CUDA, where a compile of minutes
# must be repaid; on a CPU the compiled step is not the faster one (benchmarks/results/bench_runtime.md: the
# all-low and hfp8 steps within the noise of the eager ones) and holds 0-4% more, so it compiles only when asked.
COMPILE_MIN_STEPS = 2000


def add_compile_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--compile", action=argparse.BooleanOptionalAction, default=None,
                        help="compile the training step (precsearch.runtime.compiled: once per model, code widths "
                             "and process; its peak memory 0-4%% above the eager step's) or not (--no-compile); by "
                             f"default a command compiles on CUDA when its processes each train {COMPILE_MIN_STEPS} "
                             "steps or more, and trains eagerly on a CPU, where the compiled step measured no "
                             "faster (README, 'Peak memory' and 'Step time')")


def choose_compile(args: argparse.Namespace, steps: int | None) -> CompileOptions | None:
    """How this command's runs (and the workers it starts) compile their step (None: eagerly): as ``--compile`` or
    ``--no-compile`` says, else on CUDA when each of its processes trains ``steps`` (all its runs together; None:
    long runs) of at least ``COMPILE_MIN_STEPS``, and never on a CPU (``args.device``, resolved)."""
    from precsearch.train.trainer import resolve_device

    if args.compile is not None:
        on, reason = args.compile, " (asked)"
    elif resolve_device(args.device).type != "cuda":
        on, reason = False, " (on a CPU the compiled step is no faster; --compile to compile it)"
    else:
        on = steps is None or steps >= COMPILE_MIN_STEPS
        reason = "" if on else f" ({steps} steps, fewer than {COMPILE_MIN_STEPS})"
    log.info("training step: %s%s", "compiled (its peak memory 0-4% above the eager step's)" if on else "eager",
             reason)
    return CompileOptions() if on else None
