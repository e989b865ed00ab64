"""`precsearch validate`: long runs of a search's front and references, fidelity.csv / .json / .png."""

from __future__ import annotations

import json

import pandas as pd
import pytest

from precsearch.analysis.fidelity import long_run
from precsearch.cli import main
from precsearch.config.policy import Policy
from precsearch.config.spaces import paper_space
from precsearch.search.context import Budget, DataSpec, SearchContext, torch_threads
from precsearch.search.settings import SearchConfig
from precsearch.search.study import run_search

PROXY = {"steps": 4, "batch_size": 16, "image_size": 8, "eval_batch_size": 64}
LONG = 10


@pytest.fixture(scope="module")
def validated(tmp_path_factory):
    out = tmp_path_factory.mktemp("fidelity") / "run"
    with torch_threads(1):
        run_search(SearchConfig("tiny_cnn", paper_space(proxy=PROXY), "digits", trials=4, out_dir=out,
                                proxy_steps=PROXY["steps"], device="cpu", progress=False, proxy_seeds=2,
                                budget=Budget(max_accuracy_drop=0.3)))
        code = main(["validate", str(out), "--steps", str(LONG), "--threads", "1", "--no-progress"])
    return out, code


@pytest.mark.slow  # the module's validate run: 64 s
def test_validate_writes_fidelity_files_for_front_references_and_best(validated):
    out, code = validated
    assert code == 0
    table = pd.read_csv(out / "fidelity.csv", keep_default_na=False)
    pareto = pd.read_csv(out / "pareto.csv")
    roles = "; ".join(table["roles"])
    assert "all-high" in roles and "best" in roles and "paper r=0.5" in roles
    assert set(pareto["number"]) <= set(table["trial"])  # every front point was retrained
    assert table["key"].is_unique and (table["long_steps"] == LONG).all()
    assert (out / "fidelity.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    summary = json.loads((out / "fidelity.json").read_text())
    assert summary["long_steps"] == LONG and summary["assignments"] == len(table)
    agree = (table["proxy_diverged"].astype(str) == table["long_diverged"].astype(str)).sum()
    assert summary["divergence_predicted"] == agree


@pytest.mark.slow  # the module's validate run: 64 s
def test_long_runs_are_the_policy_trained_for_the_given_steps(validated):
    """The recorded long-run accuracy is what training the trial's policy for LONG steps gives."""
    out, _ = validated
    table = pd.read_csv(out / "fidelity.csv", keep_default_na=False)
    row = table.iloc[-1]
    trials = pd.read_csv(out / "trials.csv", keep_default_na=False).set_index("number")
    policy = Policy.load(trials.loc[int(row["trial"]), "policy"])
    context = SearchContext.create("tiny_cnn", paper_space(proxy=PROXY), DataSpec(), Budget(), 0, "cpu")
    with torch_threads(1):
        result = long_run(context, policy, LONG, seed=0)
        plain = long_run(context, None, LONG, seed=0)
    assert row["long_accuracy"] == pytest.approx(result.val_accuracy)
    assert row["long_promotions"] == len(result.promotions)
    summary = json.loads((out / "fidelity.json").read_text())
    assert summary["plain_fp32_accuracy"] == pytest.approx(plain.val_accuracy)  # the yardstick, no policy


@pytest.mark.slow  # the module's validate run: 64 s
def test_best_verdict_follows_the_long_runs(validated):
    out, _ = validated
    table = pd.read_csv(out / "fidelity.csv", keep_default_na=False)
    verdict = json.loads((out / "fidelity.json").read_text())["best"]
    best = table[table["roles"].str.contains("best")].iloc[0]
    high = table[table["roles"].str.contains("all-high")].iloc[0]
    expected = not bool(best["long_diverged"]) and best["long_accuracy"] >= high["long_accuracy"] - 0.3 - 1e-12
    assert verdict["trial"] == best["trial"] and verdict["meets_budget"] == expected


def test_validate_refuses_a_folder_that_is_not_a_run(tmp_path, capsys):
    assert main(["validate", str(tmp_path)]) == 2
    assert "precsearch search" in capsys.readouterr().err
