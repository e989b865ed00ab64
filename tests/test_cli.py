"""The CLI entry point: version, help, the formats command, and user errors as one line with exit code 2."""

from __future__ import annotations

import subprocess
import sys

import pytest

from precsearch import __version__
from precsearch.cli import main


def test_version_and_help(capsys):
    with pytest.raises(SystemExit) as stop:
        main(["--version"])
    assert stop.value.code == 0
    assert __version__ in capsys.readouterr().out
    proc = subprocess.run([sys.executable, "-m", "precsearch", "--help"], capture_output=True, text=True)
    assert proc.returncode == 0 and "formats" in proc.stdout


def test_formats_lists_named_formats_and_rounds_values(capsys):
    assert main(["formats"]) == 0
    out = capsys.readouterr().out
    assert "fp8_e4m3fn" in out and "448" in out
    assert main(["formats", "e4m3b4s", "--round", "29", "31"]) == 0
    lines = capsys.readouterr().out.splitlines()
    # 29 is a tie between 28 and 30 (even mantissa wins); 31 saturates to max 30.
    assert [float(v) for v in lines[1].split()] == [29.0, 28.0]
    assert [float(v) for v in lines[2].split()] == [31.0, 30.0]


def test_bad_format_exits_2_with_one_line_and_no_traceback():
    proc = subprocess.run(
        [sys.executable, "-m", "precsearch", "formats", "e9m2"], capture_output=True, text=True
    )
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1 and "E must be in 1..8" in proc.stderr


@pytest.mark.parametrize("flag", [[], ["--eager-kernels"]])
def test_eager_kernels_hold_for_the_command_alone(monkeypatch, flag):
    """``--eager-kernels`` is read by the default runtime's kernel runner while the command runs (a search hands
    its settings to its workers with the rest of their setup), and the caller's own setting is back afterwards."""
    import precsearch.cli.formats as formats_command
    from precsearch.formats.runner import default_runtime

    kernels = default_runtime().kernels
    seen = []
    monkeypatch.setattr(formats_command, "run", lambda args: seen.append(default_runtime().kernels.enabled) or 0)
    with kernels.configured(enabled="the caller's"):
        assert main([*flag, "formats"]) == 0
        assert seen == [not flag] and kernels.enabled == "the caller's"
