"""Command-line entry point: a thin layer over the Python API.

Each subcommand lives in its own module in this package, named as the command, with ``HELP``, ``DESCRIPTION``,
``add_arguments(parser)`` and ``run(args)``. Modules are discovered, so adding a command never touches this
file; a module whose name starts with ``_`` is a helper, not a command (``_arguments``: the checked values).
Errors a user can fix (``PrecsearchError``, missing files) print one line and exit 2; with ``-v``, an error
raised by user code also prints that code's traceback.
"""

from __future__ import annotations

import argparse
import errno
import importlib
import logging
import pkgutil
import signal
import sys
import traceback
from pathlib import Path

from precsearch import __version__
from precsearch.cli._arguments import OneLineParser, read_negative_numbers
from precsearch.errors import PrecsearchError
from precsearch.files import DiskFull, full_disk
from precsearch.formats.runner import default_runtime
from precsearch.stopping import stop_signals


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineParser(prog="precsearch", description="Search mixed low-precision float assignments for "
                           "training CNNs, and train under them.")
    parser.add_argument("--version", action="version", version=f"precsearch {__version__}")
    parser.add_argument("-v", "--verbose", action="store_true", help="log progress details")
    parser.add_argument("--eager-kernels", action="store_true",
                        help="run the format kernels eagerly, not compiled one by one: slower on large tensors, "
                             "but no compile time (for tiny runs, or to chase a difference)")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    for module_info in sorted(pkgutil.iter_modules(__path__), key=lambda m: m.name):
        if module_info.name.startswith("_"):
            continue
        module = importlib.import_module(f"{__name__}.{module_info.name}")
        command = subparsers.add_parser(module_info.name, help=module.HELP, description=module.DESCRIPTION)
        read_negative_numbers(command)
        module.add_arguments(command)
        command.set_defaults(func=module.run)
    return parser


def main(argv: list[str] | None = None) -> int:
    with stop_signals():  # from the first line: no moment of a command is left to Python's own SIGINT handler
        return _command(argv)


def _command(argv: list[str] | None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING, format="%(message)s")
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    if hasattr(signal, "SIGXFSZ"):
        # Past a file-size limit (ulimit -f) the kernel kills the writer with SIGXFSZ; ignored, the write fails
        # with EFBIG instead, which is reported in one line below. CPython ignores it at startup already; this
        # keeps it so when the CLI is entered from a host that restored the default.
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    try:
        with default_runtime().kernels.configured(enabled=not args.eager_kernels):  # a search hands it to its workers
            return int(args.func(args) or 0)
    except PrecsearchError as error:
        if args.verbose and error.__cause__ is not None:  # user code raised it: show where
            traceback.print_exception(error.__cause__, file=sys.stderr)
        print(f"precsearch {args.command}: error: {error}", file=sys.stderr)
        return 2
    except BrokenPipeError:  # output piped into `head` and the like
        sys.stderr.close()
        return 0
    except OSError as error:  # a read-only file system, a full disk, a folder where a file goes, ...
        print(f"precsearch {args.command}: error: {os_error_line(error)}", file=sys.stderr)
        return 2
    except KeyboardInterrupt as stop:
        signum = getattr(stop, "signum", signal.SIGINT)
        print(f"precsearch {args.command}: stopped by {signal.Signals(signum).name}", file=sys.stderr)
        return 128 + signum
    except (Exception, DiskFull) as error:  # a library that failed while handling a full disk says something else
        full = full_disk(error)
        if full is None:
            raise
        print(f"precsearch {args.command}: error: {os_error_line(full)}", file=sys.stderr)
        return 2


def os_error_line(error: OSError) -> str:
    """One line for an OSError a user can cause: what failed, on which path, and what to do."""
    blocker = _in_the_way(error)
    if blocker is not None:
        what = "a file, not a directory" if blocker.is_file() else "not a directory"
        return f"{blocker} is {what}; choose another path"
    where = " -> ".join(str(name) for name in (error.filename, error.filename2) if name is not None)
    reason = error.strerror or str(error) or type(error).__name__
    return f"{reason}: {where}; check the path, its permissions and free space" if where else (
        f"{reason}; check the paths, their permissions and free space")


def _in_the_way(error: OSError) -> Path | None:
    """What is not a folder where ``error``'s path needs one: a file a folder was to be made at (mkdir's EEXIST;
    precsearch creates no file exclusively, so EEXIST always means a folder), or that a path goes through
    (ENOTDIR); None for other errors."""
    if error.errno not in (errno.EEXIST, errno.ENOTDIR) or not isinstance(error.filename, str):
        return None
    path = Path(error.filename)
    return next((part for part in (*reversed(path.parents), path) if part.exists() and not part.is_dir()), None)


if __name__ == "__main__":
    sys.exit(main())
