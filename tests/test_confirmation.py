"""Rungs, confirmation and the step accounting of a search, with scripted learning curves (a fixed proxy
length of 90 steps: rungs at 10 and 30, confirmation at 270)."""

from __future__ import annotations

import json

import pandas as pd
import pytest
from scripted import ScriptedTrainer

from precsearch.config.spaces import paper_space
from precsearch.search.context import Budget, DataSpec, SearchContext
from precsearch.search.settings import SearchConfig
from precsearch.search.strategies import assign
from precsearch.search.study import run_search

SPACE = paper_space(proxy={"batch_size": 16, "image_size": 8, "eval_batch_size": 64})
LENGTH, CONFIRM = 90, 270
CHANCE = 0.1
# the reference's seeds click at different steps: spread early, together at the end
REFERENCE = {10: (0.1, 0.4, 0.7), 30: (0.5, 0.9, 0.95), 90: (0.95, 0.95, 0.96), 270: (0.96, 0.96, 0.97)}


def _at(table, step):
    """A curve given at a few steps, held constant between them (chance before the first)."""
    known = [key for key in table if key <= step]
    return table[max(known)] if known else (CHANCE,) * 3


@pytest.fixture(scope="module")
def context():
    return SearchContext.create("tiny_cnn", SPACE, DataSpec("digits"), Budget(), 0, "cpu")


def _search(out, trainer, trials=16):
    config = SearchConfig("tiny_cnn", SPACE, "digits", trials=trials, out_dir=out, proxy_steps=LENGTH, proxy_seeds=3,
                          device="cpu", progress=False)
    return run_search(config, trainer=trainer)


def _memories(context):
    """Memory of every assignment, by its decisions ("HLLL"), from the cost model."""
    memories = {}
    for code in range(16):
        decisions = "".join("HL"[(code >> index) & 1] for index in range(4))
        levels = {unit: "high" if level == "H" else "low" for unit, level in zip(context.units, decisions, strict=True)}
        memories[decisions] = context.memory(assign(context.graph, context.space, levels))[0]
    return memories


def test_a_slow_starter_that_reaches_the_reference_is_not_stopped_but_a_failure_is(tmp_path, context):
    memories = _memories(context)
    slow = min((name for name in memories if name.count("L") == 1), key=memories.get)
    slow_curve = {10: 0.1, 30: 0.45, 90: 0.95, 270: 0.96}  # at chance at the first rung, far behind at the second

    def curve(name, step, length, seed):
        index = seed % 1000 if name in ("HHHH", "plain") else 0
        if name in ("HHHH", "plain") or name == slow:
            table = REFERENCE if name != slow else {key: (value,) * 3 for key, value in slow_curve.items()}
            return _at(table, step)[index]
        return CHANCE  # never learns

    trainer = ScriptedTrainer(curve, context)
    result = _search(tmp_path / "run", trainer)
    trials = result.trials.set_index("decisions")
    assert pd.isna(trials.loc[slow, "stopped_at"]) and trials.loc[slow, "val_accuracy"] == pytest.approx(0.95)
    never = trials[trials["trained"] & trials["duplicate_of"].eq("") & ~trials.index.isin(["HHHH", slow])]
    assert len(never) > 0 and (never["stopped_at"] == 30).all()  # at chance while every reference seed learned
    assert "stopped at rung step 30" in never["reason"].iloc[0]
    assert (never["seed_steps"] == "30").all()  # stopped on its first seed, the others never ran


def test_confirmation_corrects_a_proxy_that_ranks_two_candidates_the_wrong_way(tmp_path, context):
    memories = _memories(context)
    ordered = sorted((name for name in memories if name not in ("HHHH",)), key=memories.get)
    cheap, dear = ordered[0], ordered[-1]  # the proxy says dear is as good as all-high and cheap is not
    proxy = {cheap: 0.5, dear: 0.95}
    confirmed = {cheap: 0.96, dear: 0.5}

    def curve(name, step, length, seed):
        index = seed % 1000
        if name in ("HHHH", "plain"):
            return _at(REFERENCE, step)[index]
        if name in proxy:
            if step < LENGTH:
                return _at(REFERENCE, step)[0]  # keeps up with the slowest reference seed: no rung stops it
            return proxy[name] if length == LENGTH else confirmed[name]
        return CHANCE

    trainer = ScriptedTrainer(curve, context)
    result = _search(tmp_path / "run", trainer)
    best = json.loads((tmp_path / "run" / "best.json").read_text())["provenance"]
    by_name = result.trials.drop_duplicates("decisions").set_index("decisions")
    assert best["trial"] == int(by_name.loc[cheap, "number"])  # the proxies alone would have picked dear
    assert f"the proxies alone would pick trial {int(by_name.loc[dear, 'number'])}" in best["confirmation"]["note"]
    assert best["confirmation"]["proxy_accuracy"] == pytest.approx(0.5)
    assert best["confirmation"]["confirmed_accuracy"] == pytest.approx(0.96)
    assert best["confirmation"]["all_high_accuracy"] == pytest.approx(sum(REFERENCE[CONFIRM]) / 3)
    assert best["confirmation"]["plain_fp32_accuracy"] == pytest.approx(sum(REFERENCE[CONFIRM]) / 3)
    pareto = pd.read_csv(tmp_path / "run" / "pareto.csv", keep_default_na=False).set_index("decisions")
    for name in (cheap, dear):  # proxy and confirmed accuracy side by side
        assert pareto.loc[name, "val_accuracy"] == pytest.approx(proxy[name])
        assert pareto.loc[name, "confirmed_accuracy"] == pytest.approx(confirmed[name])
    confirmations = [call for call in trainer.calls if call["seed"] >= 1000]
    assert {call["length"] for call in confirmations} == {CONFIRM}
    assert {call["seed"] for call in confirmations} == {1000, 1001, 1002}  # fresh seeds: no proxy used them


def test_no_assignment_is_trained_twice_and_the_steps_add_up(tmp_path, context):
    def curve(name, step, length, seed):
        if name in ("HHHH", "plain"):
            return _at(REFERENCE, step)[seed % 1000]
        return _at(REFERENCE, step)[0] if name.count("L") <= 1 else CHANCE

    trainer = ScriptedTrainer(curve, context)
    result = _search(tmp_path / "run", trainer, trials=40)  # more trials than the space's 16 assignments
    trials = result.trials
    assert trials["key"].nunique() == 16 and len(trials) == 16  # enumerated, each once
    proxies = [call for call in trainer.calls if call["seed"] < 1000]
    runs = pd.Series([(call["name"], call["seed"]) for call in proxies])
    assert runs.is_unique  # no assignment trained twice on a seed, the reference included
    skipped = trials[~trials["trained"]]
    assert len(skipped) > 0 and (skipped["reason"].str.contains("no training needed")).all()
    best_memory = result.best["memory"]
    assert (skipped["memory"] >= best_memory).all()  # only candidates a known point already beats
    budget = pd.read_csv(tmp_path / "run" / "budget.csv").set_index("phase")
    calibration = sum(call["length"] for call in proxies if call["name"] == "HHHH")
    candidates = sum(call["steps"] for call in proxies if call["name"] != "HHHH")
    confirmation = sum(call["length"] for call in trainer.calls if call["seed"] >= 1000)
    assert budget.loc["calibration", "steps"] == calibration == 3 * LENGTH
    rungs = budget[budget.index.str.startswith("rung ")]
    assert list(rungs.index) == ["rung 1 (steps 1-10)", "rung 2 (steps 11-30)", "rung 3 (steps 31-90)"]
    assert rungs["steps"].sum() == candidates
    assert budget.loc["confirmation", "steps"] == confirmation
    assert budget.loc["total (this search)", "steps"] == calibration + candidates + confirmation
    trained = trials[trials["seed_steps"] != ""]
    assert budget.loc[f"every trial at full length {LENGTH}", "steps"] == (
        calibration + len(trained) * 3 * LENGTH + confirmation)
    assert budget.loc[f"paper: one run per sweep point at {CONFIRM} steps", "steps"] == 11 * CONFIRM


def test_a_front_point_at_chance_is_not_confirmed(tmp_path, context):
    """All-low is the front's cheapest point but its proxy stayed at chance: confirming it would buy nothing,
    since no rule can pick it; the points that learned are confirmed."""

    def curve(name, step, length, seed):
        if name == "LLLL":  # keeps up with the slowest reference seed at the rungs, then falls to chance
            return _at(REFERENCE, step)[0] if step < LENGTH else CHANCE
        return _at(REFERENCE, step)[seed % 1000]

    trainer = ScriptedTrainer(curve, context)
    result = _search(tmp_path / "run", trainer)
    confirmed = {call["name"] for call in trainer.calls if call["seed"] >= 1000}
    front = set(result.pareto["decisions"])
    assert "LLLL" in front and "LLLL" not in confirmed
    assert {"HHHH", "plain"} <= confirmed and (front - {"LLLL"}) <= confirmed


def test_a_point_that_scatters_in_confirmation_does_not_widen_the_bound_of_another(tmp_path, context):
    """The cheapest learner confirms exactly like all-high on every seed; a dearer one scatters (one seed
    fails). Each is held to all-high with the noise of those two alone, so the scatter of one cannot sink
    the other: the cheap point is picked."""
    memories = _memories(context)
    ordered = sorted((name for name in memories if name not in ("HHHH", "LLLL")), key=memories.get)
    cheap, dear = ordered[0], ordered[-1]

    def curve(name, step, length, seed):
        index = seed % 1000
        if name in ("HHHH", "plain", cheap, dear):
            if name == dear and step == length:  # the proxy ranks it first (on the front); confirmation scatters
                return 0.5 if length == CONFIRM and index == 0 else 0.99
            return _at(REFERENCE, step)[index]
        return CHANCE

    trainer = ScriptedTrainer(curve, context)
    result = _search(tmp_path / "run", trainer)
    by_name = result.trials.drop_duplicates("decisions").set_index("decisions")
    best = json.loads((tmp_path / "run" / "best.json").read_text())["provenance"]
    pareto = pd.read_csv(tmp_path / "run" / "pareto.csv", keep_default_na=False).set_index("decisions")
    assert pareto.loc[dear, "confirmed_sd"] > 0.2  # the scatter is there, and pooled it would sink cheap
    assert best["trial"] == int(by_name.loc[cheap, "number"])
