"""The tradeoff notebook runs top to bottom (a tiny search when no run directory is given)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

NOTEBOOK = Path(__file__).resolve().parents[1] / "notebooks" / "tradeoff_curves.ipynb"


@pytest.mark.slow
def test_notebook_executes_on_a_tiny_budget(tmp_path, monkeypatch):
    nbclient = pytest.importorskip("nbclient")
    nbformat = pytest.importorskip("nbformat")
    # A kernel spec for this very interpreter, so the notebook runs in the project's environment.
    spec_dir = tmp_path / "jupyter" / "kernels" / "precsearch-test"
    spec_dir.mkdir(parents=True)
    (spec_dir / "kernel.json").write_text(json.dumps({
        "argv": [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
        "display_name": "precsearch test", "language": "python"}))
    monkeypatch.setenv("JUPYTER_PATH", str(tmp_path / "jupyter"))
    monkeypatch.delenv("PRECSEARCH_RUN_DIR", raising=False)
    monkeypatch.setenv("PRECSEARCH_NOTEBOOK_TRIALS", "4")
    monkeypatch.setenv("PRECSEARCH_NOTEBOOK_STEPS", "4")
    notebook = nbformat.read(NOTEBOOK, as_version=4)
    client = nbclient.NotebookClient(notebook, kernel_name="precsearch-test", timeout=300,
                                     resources={"metadata": {"path": str(tmp_path)}})
    client.execute()
    outputs = [output for cell in notebook.cells if cell.cell_type == "code" for output in cell.outputs]
    assert not [output for output in outputs if output.output_type == "error"]
    images = [output for output in outputs if "image/png" in output.get("data", {})]
    assert len(images) == 2  # the tradeoff plot and the sweep panels
    tables = [output for output in outputs if "text/html" in output.get("data", {})]
    assert any("val_accuracy" in output["data"]["text/html"] for output in tables)
    assert any("paper sweep" in output["data"]["text/html"] for output in tables)
