"""Rungs, racing seeds, confirmation and the step accounting of a search, with scripted learning curves (a
fixed proxy length of 90 steps: the reference read at 11, 22 and 45, a rung where every reference seed had
learned at half its steps, confirmation at 270)."""

from __future__ import annotations

import json
import re

import pandas as pd
import pytest
from scripted import ScriptedTrainer, curve_at

from precsearch.config.spaces import paper_space
from precsearch.search.confirmation import recorded_confirmation
from precsearch.search.context import Budget, DataSpec, SearchContext
from precsearch.search.settings import SearchConfig
from precsearch.search.strategies import assign
from precsearch.search.study import run_search
from precsearch.search.trials import copies
from precsearch.train.continuing import branch_steps, decay_steps

SPACE = paper_space(proxy={"batch_size": 16, "image_size": 8, "eval_batch_size": 64})
LENGTH, CONFIRM = 90, 270
CHANCE = 0.1
# the reference's seeds click at different steps: spread early, together at the end (seed 0 at chance at 11,
# every seed above it at 22: the one rung stands at 45, held to the reference at 22)
REFERENCE = {11: (0.1, 0.4, 0.7), 22: (0.5, 0.9, 0.95), 45: (0.9, 0.93, 0.95), 90: (0.95, 0.95, 0.96),
             270: (0.96, 0.96, 0.97)}


def _at(table, step):
    return curve_at(table, step, CHANCE)


@pytest.fixture(scope="module")
def context():
    return SearchContext.create("tiny_cnn", SPACE, DataSpec("digits"), Budget(memory="bytes"), 0, "cpu")


def _search(out, trainer, trials=16):
    config = SearchConfig("tiny_cnn", SPACE, "digits", trials=trials, out_dir=out, proxy_steps=LENGTH, proxy_seeds=3,
                          device="cpu", progress=False, budget=Budget(memory="bytes"))  # the scripts' memory order
    return run_search(config, trainer=trainer)


def _memories(context):
    """Memory of every assignment, by its decisions ("HLLL"), from the cost model."""
    memories = {}
    for code in range(16):
        decisions = "".join("HL"[(code >> index) & 1] for index in range(4))
        levels = {unit: "high" if level == "H" else "low" for unit, level in zip(context.units, decisions, strict=True)}
        memories[decisions] = context.memory(assign(context.graph, context.space, levels))[0]
    return memories


@pytest.mark.parametrize("slow_curve", [
    {11: 0.1, 22: 0.45, 45: 0.7, 90: 0.95, 270: 0.96},  # behind the reference all along
    {11: 0.1, 22: 0.1, 45: 0.6, 90: 0.95, 270: 0.96},  # still at chance where every reference seed has left it
], ids=["behind", "late"])
def test_a_slow_starter_that_reaches_the_reference_is_not_stopped_but_a_failure_is(tmp_path, context, slow_curve):
    """A candidate that learns more slowly than all-high and reaches it by L is not stopped, even one still
    at chance where every reference seed has left it (as tiny_cnn's did on gratings: 10.5% at step 200 against
    the reference's 27-41%, 100% at 400); candidates that never learn are, at the rung, on their first seed."""
    memories = _memories(context)
    slow = min((name for name in memories if name.count("L") == 1), key=memories.get)

    def curve(name, step, length, seed):
        if name in ("HHHH", "plain"):
            return _at(REFERENCE, step)[seed % 1000]
        if name == slow:
            return _at({key: (value,) * 3 for key, value in slow_curve.items()}, step)[0]
        return CHANCE  # never learns

    trainer = ScriptedTrainer(curve, context)
    result = _search(tmp_path / "run", trainer)
    trials = result.trials.set_index("decisions")
    assert pd.isna(trials.loc[slow, "stopped_at"]) and trials.loc[slow, "val_accuracy"] == pytest.approx(0.95)
    slow_runs = [call for call in trainer.calls if call["name"] == slow and call["seed"] < 1000]
    assert slow_runs[0]["start"] == 0 and slow_runs[0]["steps"] == LENGTH  # through the rung in one run
    never = trials[trials["trained"] & ~copies(trials) & ~trials.index.isin(["HHHH", slow])]
    assert len(never) > 0 and (never["stopped_at"] == 45).all()  # at chance where the reference had learned at 22
    assert "stopped at rung step 45" in never["reason"].iloc[0]
    assert (never["seed_steps"] == "45").all()  # stopped on its first seed, the others never ran


# one reference seed stuck on a plateau (as tiny_cnn's seed 0 on gratings: 38%, 38%, 30% at 200, 400, 800): the
# seeds' spread at 22 (sd 0.40) puts the noise rule's bound at the rung (5.5%) below chance
STUCK_REFERENCE = {11: (0.1, 0.4, 0.7), 22: (0.25, 0.95, 0.95), 45: (0.25, 0.95, 0.95), 90: (0.25, 0.96, 0.96),
                   270: (0.25, 0.97, 0.97)}


def test_a_rung_stops_a_candidate_at_chance_behind_a_reference_with_a_stuck_seed(tmp_path, context):
    """Behind a reference whose seeds disagree (one stuck at 30%), the noise margin stops nothing, but a candidate
    still at chance at the rung, where every reference seed had left chance at half its steps, is stopped on its
    first seed; one that has left chance there goes on and reaches the reference."""
    memories = _memories(context)
    slow = min((name for name in memories if name.count("L") == 1), key=memories.get)

    def curve(name, step, length, seed):
        if name in ("HHHH", "plain"):
            return _at(STUCK_REFERENCE, step)[seed % 1000]
        if name == slow:  # at chance until 45, where it has just left it; the reference's best by L
            return _at({22: (0.1,) * 3, 45: (0.3,) * 3, 90: (0.96,) * 3, 270: (0.97,) * 3}, step)[0]
        return CHANCE  # never learns

    trainer = ScriptedTrainer(curve, context)
    result = _search(tmp_path / "run", trainer)
    trials = result.trials.set_index("decisions")
    assert pd.isna(trials.loc[slow, "stopped_at"]) and trials.loc[slow, "val_accuracy"] == pytest.approx(0.96)
    never = trials[trials["trained"] & ~copies(trials) & ~trials.index.isin(["HHHH", slow])]
    assert len(never) > 0 and (never["stopped_at"] == 45).all()
    assert (never["reason"].str.contains("still at chance")).all()
    assert (never["seed_steps"] == "45").all()


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
    # the reference's first two runs agree (0.96 and 0.96): the cheap point's first seed decides the race
    assert best["confirmation"]["all_high_accuracy"] == pytest.approx(0.96)
    assert best["confirmation"]["all_high_seeds"] == 2
    assert best["confirmation"]["plain_fp32_accuracy"] == pytest.approx(REFERENCE[CONFIRM][0])  # a yardstick:
    assert best["confirmation"]["plain_fp32_seeds"] == 1  # it decides nothing, so it trains the first seed alone
    pareto = pd.read_csv(tmp_path / "run" / "pareto.csv").set_index("decisions")
    assert pareto.loc[cheap, "val_accuracy"] == pytest.approx(proxy[cheap])  # proxy and confirmed side by side
    assert pareto.loc[cheap, "confirmed_accuracy"] == pytest.approx(confirmed[cheap])
    assert pd.isna(pareto.loc[dear, "confirmed_accuracy"])  # dearer than the first point confirmed: not trained
    confirmations = [call for call in trainer.calls if call["length"] == CONFIRM]
    points = [call for call in confirmations if call["name"] not in ("HHHH", "plain")]
    assert [call["seed"] for call in points] == [1000]  # a fresh seed: no proxy used it
    assert [call["seed"] for call in confirmations if call["name"] == "plain"] == [1000]
    # the reference is calibration's runs continued from the proxy length, not trained again
    assert sorted((call["seed"], call["start"]) for call in confirmations if call["name"] == "HHHH") == [
        (0, LENGTH), (1, LENGTH)]
    assert not [call for call in trainer.calls if call["name"] == "HHHH" and call["start"] == 0
                and call["length"] > LENGTH]
    # every confirmation run holds the proxies' rate to the proxy length, then decays to its end; proxies do not
    assert {call["decay_from"] for call in confirmations} == {LENGTH}
    assert {call["decay_from"] for call in trainer.calls if call["length"] < CONFIRM} == {None}


def test_no_assignment_is_trained_twice_and_the_steps_add_up(tmp_path, context):
    def curve(name, step, length, seed):
        if name in ("HHHH", "plain"):
            return _at(REFERENCE, step)[seed % 1000]
        return _at(REFERENCE, step)[0] if name.count("L") <= 1 else CHANCE

    trainer = ScriptedTrainer(curve, context)
    result = _search(tmp_path / "run", trainer, trials=40)  # more trials than the space's 16 assignments
    trials = result.trials
    assert trials["key"].nunique() == 16 and len(trials) == 16  # enumerated, each once
    proxies = [call for call in trainer.calls if call["length"] < CONFIRM]
    runs = pd.Series([(call["name"], call["seed"]) for call in proxies if call["start"] == 0])
    assert runs.is_unique  # no assignment trained twice on a seed, the reference included (one continuing run)
    skipped = trials[~trials["trained"]]
    assert len(skipped) > 0 and (skipped["reason"].str.contains("no training needed")).all()
    best_memory = result.best["memory"]
    assert (skipped["memory"] >= best_memory).all()  # only candidates a known point already beats
    budget = pd.read_csv(tmp_path / "run" / "budget.csv").set_index("phase")
    calibration = sum(call["length"] - call["start"] for call in proxies if call["name"] == "HHHH")
    candidates = sum(call["steps"] for call in proxies if call["name"] != "HHHH")
    branches = sum(branch_steps(call["readings"]) for call in proxies if call["name"] != "HHHH")
    assert branches > 0
    confirmation = sum(call["length"] - call["start"] for call in trainer.calls if call["length"] == CONFIRM)
    assert confirmation < len([call for call in trainer.calls if call["length"] == CONFIRM]) * CONFIRM
    assert budget.loc["calibration", "steps"] == calibration == 3 * LENGTH
    rungs = budget[budget.index.str.startswith("rung ")]
    assert list(rungs.index) == ["rung 1 (steps 1-45)", "rung 2 (steps 46-90)"]
    assert rungs["steps"].sum() == candidates
    assert budget.loc["candidates' decay branches", "steps"] == branches  # a stopped run's too
    assert budget.loc["confirmation", "steps"] == confirmation
    assert budget.loc["total (this search)", "steps"] == calibration + candidates + branches + confirmation
    trained = trials[trials["seed_steps"] != ""]
    assert budget.loc[f"every trial at full length {LENGTH}", "steps"] == (
        calibration + len(trained) * 3 * (LENGTH + decay_steps(LENGTH)) + confirmation)
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
    confirmed = {call["name"] for call in trainer.calls if call["length"] == CONFIRM}
    front = set(result.pareto["decisions"])
    assert "LLLL" in front and "LLLL" not in confirmed
    assert {"HHHH", "plain"} <= confirmed and (front - {"LLLL"}) <= confirmed


def test_a_point_that_scatters_in_confirmation_does_not_sink_the_next(tmp_path, context):
    """The cheapest learner scatters in confirmation (its first seed fails); the next confirms exactly like
    all-high. Each is held to all-high with the noise of those two alone, so the first's scatter cannot widen
    the second's bound: the second is picked."""
    memories = _memories(context)
    ordered = sorted((name for name in memories if name not in ("HHHH", "LLLL")), key=memories.get)
    scatters, steady = ordered[0], ordered[1]

    def curve(name, step, length, seed):
        index = seed % 1000
        if name in ("HHHH", "plain", scatters, steady):
            if name == scatters and length == CONFIRM and step == length:
                return 0.5 if index == 0 else 0.99
            if name == steady and step == length == LENGTH:  # more accurate on the proxy: on the front too
                return 0.99
            return _at(REFERENCE, step)[index]
        return CHANCE

    trainer = ScriptedTrainer(curve, context)
    result = _search(tmp_path / "run", trainer)
    by_name = result.trials.drop_duplicates("decisions").set_index("decisions")
    best = json.loads((tmp_path / "run" / "best.json").read_text())["provenance"]
    assert best["trial"] == int(by_name.loc[steady, "number"])
    # the first seed sank the scattering point (no seed more could lift it within the drop): it ran once
    assert [call["seed"] for call in trainer.calls if call["name"] == scatters and call["seed"] >= 1000] == [1000]


def _racing_curves(context):
    """Three candidates, cheapest first, that keep up with the reference's slowest seed through the rungs and
    end clearly outside the drop (``bad``), on the edge on every seed (``edge``), clearly within (``good``);
    the rest at chance."""
    memories = _memories(context)
    bad, edge, good = sorted((name for name in memories if name.count("L") == 1), key=memories.get)[:3]
    final = {good: 0.97, bad: 0.5, edge: 0.945}

    def curve(name, step, length, seed):
        if name in ("HHHH", "plain"):
            return _at(REFERENCE, step)[seed % 1000]
        if name in final:
            return final[name] if step == length else _at(REFERENCE, step)[0]
        return CHANCE

    return good, bad, edge, curve


def test_a_candidate_gains_seeds_only_while_its_decision_depends_on_them(tmp_path, context):
    good, bad, edge, curve = _racing_curves(context)
    trainer = ScriptedTrainer(curve, context)
    _search(tmp_path / "run", trainer)

    def seeds(name):
        return sorted(call["seed"] for call in trainer.calls if call["name"] == name and call["seed"] < 1000)

    assert seeds(good) == [0]  # 0.97 against 0.953: within the 1-point drop on one seed
    assert seeds(bad) == [0]  # 0.5: outside on one seed, whatever more seeds would say
    assert seeds(edge) == [0, 1, 2]  # 0.945 against 0.953: undecided on one seed and on two


def test_a_reference_without_seed_noise_decides_nothing_until_candidates_measured_theirs(tmp_path, context):
    """All-high at 100% on every seed claims no noise; the first candidates then train a second seed until
    candidates have measured two degrees of freedom of their own (``CANDIDATE_DF``), and only then does one
    seed decide."""
    saturated = {step: (1.0, 1.0, 1.0) for step in REFERENCE}

    def curve(name, step, length, seed):  # every candidate keeps up through the rungs; two or more L fail at the end
        if name in ("HHHH", "plain") or name.count("L") == 1 or step < length:
            return _at(saturated, step)[0]
        return 0.5

    trainer = ScriptedTrainer(curve, context)
    _search(tmp_path / "run", trainer)
    runs = {}
    for call in trainer.calls:
        if call["seed"] < 1000 and call["name"] not in ("HHHH", "plain") and call["steps"] == LENGTH:
            runs.setdefault(call["name"], []).append(call["seed"])
    in_order = [seeds for name, seeds in runs.items()]
    assert in_order[:2] == [[0, 1], [0, 1]] and all(seeds == [0] for seeds in in_order[2:]) and len(in_order) > 2


def test_sequential_confirmation_stops_at_the_first_point_confirmed(tmp_path, context):
    """Confirmation trains the front in memory order: the cheapest point is confirmed, and every dearer point
    is left untrained (the scattering point above shows a point that fails on its first seed: the next one
    is tried)."""
    memories = _memories(context)
    learners = sorted((name for name in memories if name.count("L") <= 2 and name != "HHHH"), key=memories.get)

    def curve(name, step, length, seed):
        if name not in learners and name not in ("HHHH", "plain"):
            return CHANCE
        if name in learners and step == length == LENGTH:  # dearer learners look a little better on the proxy
            return 0.955 + 0.001 * learners.index(name)
        return _at(REFERENCE, step)[seed % 1000]

    trainer = ScriptedTrainer(curve, context)
    result = _search(tmp_path / "run", trainer)
    front = list(result.pareto.sort_values("memory")["decisions"])
    assert len(front) >= 2
    confirmed = {call["name"] for call in trainer.calls if call["length"] == CONFIRM}
    assert confirmed == {"HHHH", "plain", front[0]}  # no dearer point trained
    best = json.loads((tmp_path / "run" / "best.json").read_text())["provenance"]
    assert best["trial"] == int(result.pareto.sort_values("memory")["number"].iloc[0])


@pytest.mark.parametrize("reference_at_confirm", [(0.96, 0.96, 0.97), (0.95, 0.97, 0.96)], ids=["agree", "disagree"])
def test_the_reference_gains_its_third_seed_only_while_a_point_is_undecided(tmp_path, context, reference_at_confirm):
    """Confirmation continues two of the reference's runs, then races: a point at 0.96 on every seed is decided
    on its first seed against two reference runs that agree; against two 2 points apart it stays undecided, and
    the side with fewer runs gains the next seed (the reference at a tie) until the rule decides."""
    memories = _memories(context)
    point = min((name for name in memories if name.count("L") == 1), key=memories.get)
    reference = {**REFERENCE, CONFIRM: reference_at_confirm}

    def curve(name, step, length, seed):
        if name in ("HHHH", "plain"):
            return _at(reference, step)[seed % 1000]
        if name == point:
            return 0.96 if step == length else _at(REFERENCE, step)[0]
        return CHANCE

    trainer = ScriptedTrainer(curve, context)
    _search(tmp_path / "run", trainer)
    order = [(call["name"], call["seed"]) for call in trainer.calls if call["length"] == CONFIRM]
    first = [("HHHH", 0), ("HHHH", 1), ("plain", 1000)]
    if reference_at_confirm[0] == reference_at_confirm[1]:
        assert order == [*first, (point, 1000)]
    else:  # undecided on (1 point seed, 2 reference), (2, 2) and (2, 3); decided on (3, 3)
        assert order == [*first, (point, 1000), (point, 1001), ("HHHH", 2), (point, 1002)]
    assert not any((tmp_path / "run" / "checkpoints").iterdir())  # an unraced reference run's checkpoint went too
    best = json.loads((tmp_path / "run" / "best.json").read_text())["provenance"]
    assert best["confirmation"]["confirmed_accuracy"] == pytest.approx(0.96)


@pytest.mark.parametrize("max_memory", [None, 0.9], ids=["drop", "memory-budget"])
def test_once_the_reference_diverges_in_confirmation_no_point_is_trained_and_none_is_picked(
        tmp_path, context, caplog, max_memory):
    """All-high's first continued run diverges at the confirmation length: no point can be confirmed against
    it, so none trains (hours on a slow model) and the search says why in one line: the seed and the reason."""
    memories = _memories(context)
    point = min((name for name in memories if name.count("L") == 1), key=memories.get)

    def curve(name, step, length, seed):
        if name == "HHHH" and length == CONFIRM and step == length and seed == 0:
            return None
        if name in ("HHHH", "plain", point):
            return _at(REFERENCE, step)[seed % 1000]
        return CHANCE

    trainer = ScriptedTrainer(curve, context)
    config = SearchConfig("tiny_cnn", SPACE, "digits", trials=16, out_dir=tmp_path / "run", proxy_steps=LENGTH,
                          proxy_seeds=3, device="cpu", progress=False,
                          budget=Budget(max_memory=max_memory, memory="bytes"))
    result = run_search(config, trainer=trainer)
    confirmed = [(call["name"], call["seed"]) for call in trainer.calls if call["length"] == CONFIRM]
    reference = [("HHHH", 0), ("HHHH", 1)] if max_memory is None else [("HHHH", 0), ("HHHH", 1), ("HHHH", 2)]
    assert confirmed == [*reference, ("plain", 1000)]  # the yardstick trains: is it the recipe or the format?
    assert result.best is None and not (tmp_path / "run" / "best.json").exists()
    why = "the all-high reference diverged in confirmation (seed 0: scripted divergence at step 270): no pick"
    assert result.note.startswith(why)
    warned = [record for record in caplog.records if record.levelname == "WARNING" and why in record.message]
    assert len(warned) == 1


def test_the_progress_bar_shows_calibration_trial_and_confirmation_runs(tmp_path, context, capsys):
    """Calibration and confirmation train for long and count no trial, and a slow model's proxy trains for most
    of an hour: the bar names the run and its step, so a search is not a bar standing still for that long."""
    trainer = ScriptedTrainer(lambda name, step, length, seed: _at(REFERENCE, step)[seed % 1000], context)
    config = SearchConfig("tiny_cnn", SPACE, "digits", trials=4, out_dir=tmp_path / "run", proxy_seeds=3,
                          device="cpu", progress=True, max_proxy_steps=200)
    run_search(config, trainer=trainer)
    shown = capsys.readouterr().err
    assert "calibrating the all-high reference: step 50, loss" in shown
    trials = set(re.findall(r"trial (\d+), seed (\d+): step 200/200", shown))  # a scripted run reports at its end
    assert trials and {int(seed) for _, seed in trials} <= {0, 1, 2}
    assert f"confirming: step {3 * 200}, loss" in shown


def test_a_confirmation_recorded_before_the_reference_continued_its_runs_reads_back_on_its_fresh_seeds():
    """A study whose confirmation trained all-high on the fresh seeds (recorded without ``reference_seeds``)
    still reads back each key's runs from the steps it recorded; the current record names the reference's."""
    accuracy = {0: 0.90, 1: 0.91, 1000: 0.95, 1001: 0.96}
    steps = {f"step:confirm:HHHH:{seed}": {"val_accuracy": value} for seed, value in accuracy.items()}
    steps["step:confirm:plain-fp32:1000"] = {"val_accuracy": 0.5}
    old = {**steps, "confirmation": {"length": 30, "seeds": [1000, 1001], "runs": {"HHHH": 2, "plain-fp32": 1}}}
    read = recorded_confirmation(old)
    assert [run["val_accuracy"] for run in read.runs["HHHH"]] == [0.95, 0.96]  # its fresh seeds
    assert read.runs["plain-fp32"] == [{"val_accuracy": 0.5}]
    new = {**steps, "confirmation": {**old["confirmation"], "reference": "HHHH", "reference_seeds": [0, 1]}}
    read = recorded_confirmation(new)
    assert [run["val_accuracy"] for run in read.runs["HHHH"]] == [0.90, 0.91]  # calibration's seeds, continued
    assert read.runs["plain-fp32"] == [{"val_accuracy": 0.5}]
