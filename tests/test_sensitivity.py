"""Sensitivity before search: the faint-signal group ranks first, the knapsack is exact against brute force,
the sensitivity order demotes the least sensitive bytes first, and the CLI writes its table."""

from __future__ import annotations

import itertools
import math
import random
from pathlib import Path

import pandas as pd
import pytest
import torch
from scripted import ScriptedTrainer

from precsearch.analysis.report import plot_sensitivity
from precsearch.cli import main
from precsearch.config.spaces import load_space, paper_space
from precsearch.graph.tracing import trace
from precsearch.search.context import Budget, DataSpec, SearchContext
from precsearch.search.seeding import PAPER_SEEDING
from precsearch.search.sensitivity import (
    SENSITIVITY_SEEDING,
    _rounded,
    least_sensitive,
    measure_model,
    sensitivity_sweep,
)
from precsearch.search.sensitivity_table import SENSITIVITY_CSV, group_order, unit_table
from precsearch.search.settings import SearchConfig
from precsearch.search.strategies import paper_assignment
from precsearch.search.study import run_search
from precsearch.train.data import load_dataset
from precsearch.train.trainer import build_model

SPACE = paper_space().with_proxy(batch_size=16, image_size=16)


@pytest.fixture(scope="module")
def gratings():
    return load_dataset("gratings", image_size=16, train_size=64, val_size=16)


@pytest.fixture(scope="module")
def narrow_table(gratings):
    return measure_model("narrow_cnn", SPACE, gratings, batches=2)


def test_the_group_holding_the_faint_input_ranks_first(narrow_table):
    # gratings: a 0.1 signal on a level of 6, below e4m3's step of 1/2 there; only the input (group 0) holds it
    # at that level (the patch stem's batch norm removes the level), so demoting g0 erases the signal.
    ranked = unit_table(narrow_table)
    assert ranked["unit"].iloc[-1] == "g0"
    row = narrow_table[(narrow_table["unit"] == "g0") & (narrow_table["kind"] == "activation")].iloc[0]
    assert row["error"] > 0.1  # the rounding error is a large share of the input's spread
    assert set(narrow_table["kind"]) == {"activation", "weight", "activation_grad", "weight_grad"}
    # the paper's low weight-gradient format is its high one: demoting it saves and costs nothing
    assert (narrow_table.loc[narrow_table["kind"] == "weight_grad", ["score", "bytes_saved"]] == 0).all().all()


def _brute_force(scores: dict[str, float], saved: dict[str, float], need: float) -> float:
    best = sum(scores.values())
    for count in range(len(scores) + 1):
        for subset in itertools.combinations(scores, count):
            if sum(saved[u] for u in subset) >= need:
                best = min(best, sum(scores[u] for u in subset))
    return best


def test_the_knapsack_equals_brute_force_over_every_subset():
    rng = random.Random(0)
    for _ in range(20):
        names = [f"g{i}" for i in range(8)]
        scores = {name: rng.choice([0.0, rng.random(), 10 * rng.random()]) for name in names}
        saved = {name: float(rng.randint(1, 1000)) for name in names}
        need = rng.random() * sum(saved.values())
        chosen = least_sensitive(scores, saved, need)
        assert sum(saved[u] for u in chosen) >= need
        assert sum(scores[u] for u in chosen) == pytest.approx(_brute_force(scores, saved, need), abs=1e-9)


def test_the_sensitivity_ladder_is_the_exact_optimum_at_every_target(narrow_table, gratings):
    model = build_model("narrow_cnn", num_classes=10)
    graph = trace(model, gratings[0].images[:2], batch_size=16)
    units = unit_table(narrow_table)
    scores = dict(zip(units["unit"], units["score"], strict=True))
    saved = dict(zip(units["unit"], units["bytes_saved"], strict=True))
    for candidate in sensitivity_sweep(graph, SPACE, narrow_table, rs=(0.0, 0.3, 0.6, 0.9, 1.0)):
        demoted = [unit for unit, level in candidate.decisions.items() if level == "low"]
        need = candidate.r * sum(saved.values())
        assert sum(saved[u] for u in demoted) >= need - 1e-6
        assert sum(scores[u] for u in demoted) == pytest.approx(_brute_force(scores, saved, need), rel=1e-9)


def test_the_sensitivity_order_demotes_the_least_sensitive_groups_first():
    graph = trace(build_model("tiny_cnn", num_classes=10), torch.randn(2, 3, 16, 16), batch_size=16)
    scores = {0: 3.0, 1: 1.0, 2: 2.0, 3: 0.5}  # per byte: group 3, then 1, 2, 0
    order = [3, 1, 2, 0]
    prefixes = set()
    for r in [i / 20 for i in range(21)]:
        candidate = paper_assignment(graph, r, SPACE, order="sensitivity", scores=scores)
        low = {int(unit[1:]) for unit, level in candidate.decisions.items() if level == "low"}
        assert low == set(order[:len(low)])  # always the least sensitive groups
        prefixes.add(len(low))
    assert prefixes >= {0, 2, 3, 4}  # group 3 is too small to reach r = 0.05 alone
    with pytest.raises(Exception, match="scores"):
        paper_assignment(graph, 0.5, SPACE, order="sensitivity")


def test_group_order_is_score_per_byte_saved(narrow_table):
    order = group_order(narrow_table)
    by_group = narrow_table.groupby("group")[["score", "bytes_saved"]].sum()
    for group, key in order.items():
        assert key == pytest.approx(by_group.loc[group, "score"] / by_group.loc[group, "bytes_saved"])


def test_cli_writes_the_table_and_refuses_a_bad_model_in_one_line(tmp_path, capsys):
    code = main(["sensitivity", "tiny_cnn", "--data", "gratings", "--batches", "1", "--batch-size", "16",
                 "--image-size", "8", "--threads", "1", "--out", str(tmp_path)])
    assert code == 0
    table = pd.read_csv(tmp_path / SENSITIVITY_CSV)
    assert {"unit", "kind", "bytes_saved", "score", "overflow", "underflow"} <= set(table.columns)
    assert "g0" in capsys.readouterr().out
    assert main(["sensitivity", "no_such_model", "--out", str(tmp_path / "bad")]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "no_such_model" in err


def test_the_report_plots_each_unit_at_its_bytes_and_score(narrow_table):
    figure = plot_sensitivity(narrow_table)
    points = figure.axes[0].collections[0].get_offsets()
    units = unit_table(narrow_table)
    assert sorted(map(tuple, points.tolist())) == sorted(zip(units["bytes_saved"], units["score"], strict=True))


@pytest.mark.parametrize("seeding", [PAPER_SEEDING, SENSITIVITY_SEEDING], ids=lambda seeding: seeding.name)
def test_the_sensitivity_seeding_queues_the_knapsacks_points_first_and_keeps_the_table(tmp_path, seeding):
    """With ``seeding=SENSITIVITY_SEEDING`` the search measures before its first trial: the knapsack's points lead
    the queue and sensitivity.csv is in the run directory; the paper's seeding is unchanged (scripted proxies)."""
    space = paper_space(proxy={"batch_size": 16, "image_size": 8, "eval_batch_size": 64})
    context = SearchContext.create("tiny_cnn", space, DataSpec("digits"), Budget(), 0, "cpu")
    trainer = ScriptedTrainer(lambda name, step, length, seed: 0.9, context)
    config = SearchConfig("tiny_cnn", space, "digits", trials=4, out_dir=tmp_path / "run", proxy_steps=20,
                          proxy_seeds=1, device="cpu", progress=False, seeding=seeding)
    result = run_search(config, trainer=trainer)
    first = result.trials.sort_values("number")["origin"].iloc[0]
    table = tmp_path / "run" / SENSITIVITY_CSV
    if seeding is PAPER_SEEDING:
        assert "sensitivity" not in " ".join(result.trials["origin"]) and not table.exists()
    else:
        assert first.startswith("sensitivity r=0.0")
        assert set(pd.read_csv(table)["kind"]) >= {"activation", "weight"}


def test_the_sensitivity_table_measures_a_scaled_space(gratings):
    """On the tensorwise-scaled FP8 space every unit gets a finite score, and a delayed recipe is scored with
    the value's own scale (one value has no earlier amaxes), as torch's float8 cast with that scale gives it:
    ``(x / s).to(float8_e4m3fn) * s``, ``s = 2**ceil(log2(amax / 448))``."""
    space = load_space(Path(__file__).parent.parent / "search_spaces" / "fp8_scaled.yaml").with_proxy(
        batch_size=16, image_size=16)
    table = measure_model("tiny_cnn", space, gratings, batches=1)
    assert len(table) > 0 and table["score"].map(math.isfinite).all() and (table["score"] > 0).any()
    x = torch.randn(64, 8, generator=torch.Generator().manual_seed(3)) * 1000
    s = 2.0 ** math.ceil(math.log2(x.abs().max().item() / 448))
    expected = (x / s).to(torch.float8_e4m3fn).float() * s
    assert torch.equal(_rounded(x, "e4m3fn@tensor:delayed16", "saturate"), expected)
