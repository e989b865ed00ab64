"""The report: the paper's sweep recovered from trial origins, one table of front / sweep / baselines, a PNG."""

from __future__ import annotations

import json

import pandas as pd
import pytest

from precsearch.analysis.report import load_run, summary_table, sweep_points, write_report
from precsearch.errors import PrecsearchError


def _trial(number, origin, memory, accuracy, diverged=False, trained=True):
    return {"number": number, "state": "COMPLETE", "origin": origin, "memory": memory, "bytes": memory * 2**20,
            "peak_predicted": 3 * memory * 2**20, "val_accuracy": accuracy, "val_error": 1 - accuracy,
            "val_loss": 1 - accuracy, "trained": trained, "diverged": diverged, "feasible": not diverged,
            "promotions": 0, "key": f"k{number}",
            "duplicate_of": "", "reason": "", "error": "", "decisions": ""}


@pytest.fixture
def run_dir(tmp_path):
    trials = pd.DataFrame([
        _trial(0, "all-high; paper r=0.0", 1.0, 0.95),
        _trial(1, "paper r=0.1; paper r=0.2", 0.7, 0.96),
        _trial(2, "paper r=1.0; all-low", 0.5, 0.94),
        _trial(3, "sampler", 0.6, 0.955),
        _trial(4, "sampler", 0.55, 0.2, diverged=True),
    ])
    trials.to_csv(tmp_path / "trials.csv", index=False)
    trials.iloc[[2, 3, 1]].to_csv(tmp_path / "pareto.csv", index=False)
    pd.DataFrame([
        {"source": "baseline", "name": "fp32", "r": None, "memory": 2.0, "bytes": 2 * 2**20,
         "peak_predicted": 4 * 2**20, "val_accuracy": 0.95, "val_loss": 0.05, "diverged": False, "reason": "",
         "promotions": 0, "key": "", "reused": ""},
        {"source": "baseline", "name": "fp8", "r": None, "memory": 0.5, "bytes": 2**19, "peak_predicted": 3 * 2**19,
         "val_accuracy": 0.1, "val_loss": 9.0, "diverged": True, "reason": "non-finite loss at step 3",
         "promotions": 0, "key": "", "reused": ""},
        {"source": "paper", "name": "r=0.0", "r": 0.0, "memory": 1.0, "bytes": 2**20, "peak_predicted": 3 * 2**20,
         "val_accuracy": 0.95, "val_loss": 0.05, "diverged": False, "reason": "", "promotions": 0, "key": "k0",
         "reused": "trial 0"},
        {"source": "torch", "name": "autocast_bf16", "r": None, "memory": None, "bytes": None, "peak_predicted": None,
         "peak_bytes": 2**21, "peak_x_fp32": 0.5, "val_accuracy": 0.95, "val_loss": 0.05, "diverged": False,
         "reason": "", "promotions": 0, "key": "", "reused": ""},
    ]).to_csv(tmp_path / "baselines.csv", index=False)
    (tmp_path / "run.json").write_text(json.dumps({"model": "tiny_cnn", "seed": 0, "data": {"name": "digits"},
                                                   "space": {"name": "hfp8", "proxy": {"steps": 5}}}))
    return tmp_path


def test_sweep_points_expand_shared_trials(run_dir):
    sweep = sweep_points(load_run(run_dir).trials)
    assert sweep["r"].tolist() == [0.0, 0.1, 0.2, 1.0]
    assert sweep["number"].tolist() == [0, 1, 1, 2]


def test_summary_table_puts_front_sweep_and_baselines_side_by_side(run_dir):
    table = summary_table(load_run(run_dir))
    assert table["source"].tolist() == ["pareto"] * 3 + ["paper sweep"] * 4 + ["baseline"] * 2 + ["torch.autocast"]
    front = table[table["source"] == "pareto"]
    assert front["name"].tolist() == ["trial 2", "trial 3", "trial 1"]
    fp8 = table[table["name"] == "fp8"].iloc[0]
    assert fp8["diverged"] and fp8["memory"] == 0.5 and fp8["bytes MiB"] == 0.5
    # a policy's peak is the cost model's prediction; autocast's is measured, and every row is set beside it
    assert fp8["peak MiB"] == 1.5 and fp8["x autocast"] == 0.75 and fp8["x plain fp32"] == 0.375
    autocast = table[table["name"] == "autocast_bf16"].iloc[0]
    assert autocast["peak MiB"] == 2.0 and autocast["x autocast"] == 1.0 and autocast["x plain fp32"] == 0.5
    assert pd.isna(autocast["memory"])
    assert table[table["name"] == "r=0.1"].iloc[0]["val_accuracy"] == 0.96


def test_write_report_makes_a_png_and_a_markdown_table(run_dir):
    png, md = write_report(run_dir)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000
    text = md.read_text()
    assert "![tradeoff](report.png)" in text and "| source | name | memory |" in text
    assert "| baseline | fp8 | 0.5000 |" in text and "| paper sweep | r=0.2 | 0.7000 |" in text
    assert "trials: 5 (5 COMPLETE), 1 diverged" in text and "`tiny_cnn`" in text and "steps 5" in text


def test_baselines_alone_still_report(tmp_path, run_dir):
    (run_dir / "trials.csv").unlink()
    (run_dir / "pareto.csv").unlink()
    table = summary_table(load_run(run_dir))
    assert table["source"].tolist() == ["paper sweep", "baseline", "baseline", "torch.autocast"]
    write_report(run_dir)


def test_a_truncated_trials_row_is_left_out_not_counted_as_diverged(run_dir, caplog):
    lines = (run_dir / "trials.csv").read_text().splitlines(keepends=True)
    healthy = [line for line in lines if not line.startswith("4,")]  # trials 0-3, none diverged
    (run_dir / "trials.csv").write_text("".join(healthy) + "5,COMPLETE,samp")  # a row cut short
    trials = load_run(run_dir).trials
    assert trials["number"].tolist() == [0, 1, 2, 3] and not trials["diverged"].astype(bool).any()
    assert "cut short" in caplog.text
    _, markdown = write_report(run_dir)
    assert "0 diverged" in markdown.read_text()


def test_an_empty_directory_is_a_user_error(tmp_path):
    with pytest.raises(PrecsearchError, match="no trials.csv or baselines.csv"):
        load_run(tmp_path)
