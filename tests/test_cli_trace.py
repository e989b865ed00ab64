"""`precsearch trace`: the printed tables, the JSON file, and one-line errors with exit code 2."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from precsearch.cli import main
from precsearch.cost.model import MIB, CostModel, measure_saved_bytes
from precsearch.graph.tracing import trace
from precsearch.graph.types import TensorGraph
from precsearch.models import build


def test_trace_prints_tables_and_writes_json(tmp_path, capsys):
    path = tmp_path / "tiny.json"
    assert main(["trace", "tiny_cnn:width=0.5", "--batch-size", "8", "--json", str(path)]) == 0
    out = capsys.readouterr().out
    graph = TensorGraph.from_json(path.read_text())
    assert graph.model_name == "tiny_cnn:width=0.5" and graph.batch_size == 8
    reference = trace(build("tiny_cnn", width=0.5), torch.randn(2, 3, 32, 32), batch_size=8)
    assert graph.fingerprint() == reference.fingerprint() and graph.groups == reference.groups
    assert out.startswith(f"tiny_cnn:width=0.5: {len(reference.ops)} ops, {len(reference.groups)} groups")
    for tid in ("x:activation", "conv1:weight", "relu2:activation", "linear:bias"):
        assert tid in out
    assert "(8, 8, 32, 32)" in out  # conv1's output at batch 8 and width 0.5
    cost = CostModel(reference)
    assert f"{cost.activation_bytes() / MIB:.2f} MiB counting every op output" in out
    assert f"{cost.saved_activation_bytes() / MIB:.2f} MiB saved by autograd" in out
    assert [p.name for p in tmp_path.iterdir()] == ["tiny.json"]  # no temporary file left behind


def test_trace_leaf_option(capsys):
    assert main(["trace", "resnet18:width=0.1", "--leaf", "BasicBlock", "--batch-size", "4"]) == 0
    out = capsys.readouterr().out
    assert "layer1.0:activation" in out and "layer1.0.conv1" not in out


@pytest.mark.parametrize("argv, message", [
    (["trace", "resnet19"], "unknown model 'resnet19' (did you mean resnet18?)"),
    (["trace", "no_such_package.models:make"], "cannot import module 'no_such_package.models'"),
    (["trace", "tiny_cnn", "--leaf", "NoSuchModule"], "leaf module 'NoSuchModule' names no module"),
    (["trace", "tiny_cnn", "--input-shape", "1,32,32"], "expects (N, 3, H, W)"),
    (["trace", "tiny_cnn", "--json", "no_such_folder/graph.json"], "folder no_such_folder does not exist"),
])
def test_trace_errors_are_one_line_with_exit_code_2(argv, message, capsys):
    assert main(argv) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("precsearch trace: error: ") and message in lines[0]


def test_console_script_reports_unknown_model_without_traceback():
    script = Path(sys.executable).with_name("precsearch")
    if not script.exists():
        pytest.skip("console script not installed next to the interpreter")
    result = subprocess.run([str(script), "trace", "no_such_model"], capture_output=True, text=True,
                            timeout=120, env={**os.environ, "PYTHONWARNINGS": "ignore"})
    assert result.returncode == 2 and result.stdout == ""
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "unknown model 'no_such_model'" in lines[0]


def test_trace_check_compares_saved_bytes_and_lists_unenforced_ops(capsys):
    """`--check` on a zoo model (all within 2%, exit 0) and on a user's model whose attention runs in an FX
    leaf function (test_saves.LeafAttention): the WARNING names it."""
    assert main(["trace", "tiny_cnn:width=0.5", "--batch-size", "4", "--check"]) == 0
    out = capsys.readouterr().out
    reference = build("tiny_cnn", width=0.5)
    measured = measure_saved_bytes(reference, torch.randn((4, 3, 32, 32), generator=torch.Generator().manual_seed(1)))
    assert f"fp32: predicted {measured / MIB:.3f} MiB, measured {measured / MIB:.3f} MiB (autograd), error +0.0%" in out
    assert "hfp8: runtime kept" in out and "ratio 1.000" in out and "unenforced ops: none" in out
    assert main(["trace", "test_saves:LeafAttention", "--input-shape", "3,16,16", "--batch-size", "4", "--check"]) == 0
    out = capsys.readouterr().out
    assert "WARNING: 1 op(s) not enforced inside (rounded at their boundary only): attention (runs aten." in out
