"""Running the command line in a test: its exit status, stdout and stderr."""

from __future__ import annotations

from precsearch.cli import main


def run_cli(argv: list[str], capsys) -> tuple[int, str, str]:
    """main's exit status (argparse's refusals exit through SystemExit), stdout and stderr."""
    try:
        code = main(argv)
    except SystemExit as stop:
        code = stop.code
    captured = capsys.readouterr()
    return code, captured.out, captured.err
