"""Calibration of the proxy length on the all-high reference, with scripted learning curves."""

from __future__ import annotations

import json

import optuna
import pandas as pd
import pytest
from optuna.storages import RetryHeartbeatStaleTrialCallback
from optuna.trial import TrialState
from scripted import ScriptedTrainer, curve_at

from precsearch.config.spaces import paper_space
from precsearch.errors import PrecsearchError
from precsearch.search.calibration import CalibrationSettings
from precsearch.search.context import Budget, DataSpec, SearchContext
from precsearch.search.settings import SearchConfig
from precsearch.search.storage import StudyLocation
from precsearch.search.study import SearchInterrupted, run_search

SPACE = paper_space(proxy={"batch_size": 16, "image_size": 8, "eval_batch_size": 64})
CHANCE = 0.1  # digits: 10 balanced classes (the search's chance level is this plus 3 binomial sd)
# the reference's final accuracy after a run of each length: learns between 100 and 400 steps, flat after
REFERENCE = {50: 0.1, 100: 0.6, 200: 0.9, 400: 0.95, 800: 0.955}


def _context():
    return SearchContext.create("tiny_cnn", SPACE, DataSpec("digits"), Budget(), 0, "cpu")


def _plateau(name, step, length, seed):
    """All-high follows REFERENCE (seeds 0.01 apart), reached at the end of each run; the rest at chance."""
    if name != "HHHH":
        return CHANCE
    return min(1.0, REFERENCE.get(length, 0.955) * step / length + 0.01 * (seed % 1000 - 1))


def _config(out, **changes):
    settings = {"trials": 2, "out_dir": out, "proxy_seeds": 3, "device": "cpu", "progress": False,
                **changes}
    return SearchConfig("tiny_cnn", SPACE, "digits", **settings)


def test_calibration_is_one_continuing_run_per_seed_that_stops_at_the_plateau(tmp_path):
    trainer = ScriptedTrainer(_plateau, _context())
    result = run_search(_config(tmp_path / "run"), trainer=trainer)
    reference = [call for call in trainer.calls if call["seed"] < 1000 and call["name"] == "HHHH"]
    # 200 -> 400 gains 5 points (more than the 1-point seed spread allows), 400 -> 800 half a point: 800; the
    # seeds 1 point apart cannot resolve a 1-point drop, and drew no closer since 200: a warning says what to change
    assert result.calibration.length == 800
    for seed in (0, 1, 2):  # one run per seed, each point continued from the one before, then by confirmation
        runs = [(call["start"], call["length"]) for call in reference if call["seed"] == seed]
        continued = [(800, 3 * 800)] if seed < 2 else []  # no point raced: the reference continued two runs
        assert runs == [(0, 50), (50, 100), (100, 200), (200, 400), (400, 800), *continued]
    assert not any((tmp_path / "run" / "checkpoints").iterdir())  # the third run's went: nothing continues it
    assert result.calibration.steps == 3 * 800  # L per seed (a scripted run has no decay branches)
    assert "seeds still disagree" in result.calibration.warning and "--max-accuracy-drop" in result.calibration.warning
    run = json.loads((tmp_path / "run" / "run.json").read_text())
    assert run["proxy_length"] == 800
    assert run["calibration"]["accuracies"]["400"] == pytest.approx([0.94, 0.95, 0.96])
    curves = pd.read_csv(tmp_path / "run" / "calibration.csv")
    assert set(curves[curves["chosen"]]["length"]) == {800}
    row = curves[(curves["seed"] == 0) & (curves["step"] == 400)].iloc[0]
    assert row["val_accuracy"] == pytest.approx(_plateau("HHHH", 400, 400, 0))
    # every candidate trained at the calibrated length; no checkpoint is left behind
    candidates = [call for call in trainer.calls if call["name"] not in ("HHHH", "plain") and call["seed"] < 1000]
    assert candidates and all(call["length"] == 800 for call in candidates)
    assert not list((tmp_path / "run" / "checkpoints").glob("*"))


def _clicking(name, step, length, seed):
    """All-high learns by 200 steps on every seed but its seeds scatter until 800 (99.8%, 74.5%, 64.2% at 200
    and 400, the mean flat), and agree from 800 on; the rest at chance."""
    if name != "HHHH":
        return CHANCE
    if step < 200:
        return CHANCE
    if step < 800:
        return (0.998, 0.745, 0.642)[seed % 3]
    return 0.99 + 0.0005 * (seed % 3)


def test_calibration_extends_past_a_flat_mean_while_the_seeds_disagree(tmp_path):
    trainer = ScriptedTrainer(_clicking, _context())
    result = run_search(_config(tmp_path / "run", max_proxy_steps=3200), trainer=trainer)
    # at 400 the mean is flat but a 19-point spread cannot resolve a 1-point drop: on; at 800 they agree but the
    # mean jumped 20 points; at 1600 it is flat and the seeds agree
    assert result.calibration.length == 1600 and result.calibration.warning == ""
    assert result.calibration.steps == 3 * 1600


def _saturating(name, step, length, seed):
    """mobilenet_v2:width=0.5's all-high reference on gratings (runs/mnv2c): 17.5%, 66.9%, 96.0% at 400 steps,
    91.2%, 90.0%, 100% at 800 and 100% on every seed at 1,600."""
    if name != "HHHH" or step < 400:
        return CHANCE
    readings = {400: (0.175, 0.669, 0.960), 800: (0.912, 0.900, 1.0)}
    return readings[step][seed % 3] if step in readings else 1.0


def test_a_reference_that_reached_100_percent_in_the_last_doubling_gets_one_more(tmp_path):
    result = run_search(_config(tmp_path / "run", max_proxy_steps=3200),
                        trainer=ScriptedTrainer(_saturating, _context()))
    # 800 -> 1600 gains 6 points, more than the seed noise allows: an assignment learning half as fast as all-high
    # would be judged on its way up at 1600, so L is the doubling after, where the reference has stayed flat
    assert result.calibration.length == 3200 and result.calibration.warning == ""


def test_a_reference_at_100_percent_only_at_the_cap_is_taken_there_with_one_warning_line(tmp_path, caplog):
    with caplog.at_level("WARNING", logger="precsearch.search.calibration"):
        result = run_search(_config(tmp_path / "run", max_proxy_steps=1600),
                            trainer=ScriptedTrainer(_saturating, _context()))
    # at the cap it cannot rise further (100% on every seed): not refused as "still improving", but the doubling
    # slower assignments would need is missing, and the line says how to give it
    assert result.calibration.length == 1600
    warning = result.calibration.warning
    assert "93.7%" in warning and "800 steps" in warning and "--max-proxy-steps to 3200" in warning
    assert [record.getMessage() for record in caplog.records if "calibration:" in record.getMessage()] == [warning]


def test_a_reference_still_rising_at_the_cap_is_refused(tmp_path):
    def rising(name, step, length, seed):
        return CHANCE if name != "HHHH" or step < 400 else {400: 0.5, 800: 0.8}.get(step, 0.95)

    with pytest.raises(PrecsearchError, match="is still improving at 1600 steps"):
        run_search(_config(tmp_path / "run", max_proxy_steps=1600), trainer=ScriptedTrainer(rising, _context()))


def test_seeds_that_stay_apart_stop_calibration_with_one_warning_line(tmp_path, caplog):
    def apart(name, step, length, seed):
        # learned, flat, 3 points apart forever; the best seed at 99.5%, where 360 validation images alone would
        # resolve a 1-point drop (see the next test), so only the stall stops it
        return CHANCE if name != "HHHH" else 0.995 - 0.03 * (seed % 3)

    with caplog.at_level("WARNING", logger="precsearch.search.calibration"):
        result = run_search(_config(tmp_path / "run"), trainer=ScriptedTrainer(apart, _context()))
    assert result.calibration.length == 200  # learned and flat from 100 on; the spread has not shrunk since 50
    warnings = [record.message for record in caplog.records if "seeds still disagree" in record.message]
    assert len(warnings) == 1 and "\n" not in warnings[0]
    assert "--max-accuracy-drop" in warnings[0] and "--proxy-seeds" in warnings[0]


def _at_the_sampling_floor(name, step, length, seed):
    """All-high at 98% from 200 steps on, its seeds 2.4 points apart at 200 and drawing closer at every
    doubling (never stalled), never closely enough at 360 validation images; the rest at chance."""
    if name != "HHHH":
        return CHANCE
    if step < 200:
        return CHANCE
    return 0.98 + 0.012 * (seed % 3 - 1) * 200 / length


def test_calibration_stops_where_the_validation_sets_sampling_noise_alone_hides_the_drop(tmp_path, caplog):
    trainer = ScriptedTrainer(_at_the_sampling_floor, _context())
    with caplog.at_level("WARNING", logger="precsearch.search.calibration"):
        result = run_search(_config(tmp_path / "run", max_proxy_steps=3200), trainer=trainer)
    # oracle: the binomial sd of a 98.6% accuracy over digits' 360 validation images is sqrt(.986 * .014 / 360)
    # = 0.62 points; with 4 seeds per proxy against 3 reference seeds the 90% one-sided margin is
    # 1.2816 * 0.62 * sqrt(1/4 + 1/3) = 0.60 points, over half the 1-point drop: at 400 (learned, flat, the seeds
    # 0.6 points apart) no longer run could resolve it, so calibration stops there, not at the cap
    assert result.calibration.length == 400
    assert trainer.context.validation_size == 360
    assert {call["length"] for call in trainer.calls if call["name"] == "HHHH" and call["seed"] < 1000} == {
        50, 100, 200, 400, 3 * 400}  # and the confirmation's, continuing the runs
    warnings = [record.message for record in caplog.records if "seeds still disagree" in record.message]
    assert len(warnings) == 1 and "sampling noise alone (0.62 points over 360 images" in warnings[0]
    assert "validate on more images" in warnings[0] and "--max-proxy-steps" not in warnings[0]


def _one_seed_still_learning(name, step, length, seed):
    """mobilenet_v2 width 0.5's reference on gratings (benchmarks/results/search_efficiency.md): its seeds click
    at different steps, and at 800 two are at 91% while the third is at 38%; the rest at chance."""
    if name != "HHHH":
        return CHANCE
    curve = {200: (0.105, 0.087, 0.137), 400: (0.897, 0.369, 0.157), 800: (0.911, 0.912, 0.381),
             1600: (1.0, 0.998, 0.842), 3200: (1.0, 1.0, 0.999)}
    return curve_at(curve, step, CHANCE)[seed % 3]


def test_seeds_far_apart_are_not_stopped_by_the_sampling_floor(tmp_path):
    """At 800 the mean's 26-point gain is within the seeds' own huge noise (flat), and 360 images at 91% could
    not resolve a 1-point drop even between seeds apart by sampling noise alone (sd 1.5 points). But these
    seeds are 53 points apart, far more than sampling explains: a seed is still learning, so calibration goes
    on, to where all three agree (3200), instead of stopping at 800 with the sampling floor's warning."""
    trainer = ScriptedTrainer(_one_seed_still_learning, _context())
    result = run_search(_config(tmp_path / "run", max_proxy_steps=3200), trainer=trainer)
    assert result.calibration.length == 3200 and result.calibration.warning == ""


def _stuck(*stuck_seeds):
    """tiny_cnn's reference on gratings (benchmarks/results/search_efficiency.md): the ``stuck_seeds`` leave
    chance by 200 and stay on a plateau (38%, 38%, 30% at 200, 400, 800), the others read 100% by 400; every
    candidate reads 80% at any length."""
    def curve(name, step, length, seed):
        if name != "HHHH":
            return 0.8 if name != "plain" else 1.0
        table = ({200: (0.38,), 400: (0.38,), 800: (0.30,)} if seed % 1000 in stuck_seeds
                 else {200: (1.0,) if seed % 3 == 1 else (0.34,), 400: (1.0,)})
        return curve_at(table, step, CHANCE)[0]
    return curve


def test_a_seed_stuck_near_chance_is_a_failed_run_left_out_of_the_reference(tmp_path, caplog):
    """At 800 seed 0 has gained nothing over two doublings and stands nearer chance (14.7%) than the other seeds
    (100%): a failed run. Calibration stops there with the two seeds that learned as the reference (one WARNING
    line names the failed one); its checkpoint goes, confirmation continues seeds 1 and 2 only, and a candidate
    at 80% is held to 100%: two seeds settle it (with seed 0 counted, the reference's mean was 76.7% at an sd of
    40 points, and candidates raced to every seed)."""
    trainer = ScriptedTrainer(_stuck(0), _context())
    with caplog.at_level("WARNING", logger="precsearch.search.calibration"):
        result = run_search(_config(tmp_path / "run", max_proxy_steps=3200), trainer=trainer)
    calibration = result.calibration
    assert (calibration.length, calibration.failed, calibration.accuracies) == (800, (0,), [1.0, 1.0])
    warnings = [record.message for record in caplog.records if "failed run" in record.message]
    assert len(warnings) == 1 and "\n" not in warnings[0]
    assert "seed 0 at 0.300 (0.380 at 200)" in warnings[0] and "proxy lr" in warnings[0]
    continued = {call["seed"] for call in trainer.calls if call["name"] == "HHHH" and call["length"] == 3 * 800}
    assert continued == {1, 2}
    assert not list((tmp_path / "run" / "checkpoints").glob("*"))
    candidates = result.trials[result.trials["trained"] & (result.trials["decisions"] != "HHHH")]
    assert len(candidates) > 0 and (candidates["seeds"] == 2).all()
    best = json.loads((tmp_path / "run" / "best.json").read_text())["provenance"]
    assert best["trial"] not in set(candidates["number"])  # 80% is not within a point of 100%
    curves = pd.read_csv(tmp_path / "run" / "calibration.csv")
    assert set(curves[curves["failed"]]["seed"]) == {0}
    run = json.loads((tmp_path / "run" / "run.json").read_text())
    assert run["calibration"]["failed"] == [0]


def test_a_seed_that_learned_and_fell_back_to_chance_is_a_failed_run(tmp_path, caplog):
    """runs/mnv2c: mobilenet_v2's seed 1 read 90% and 100% at 800 and 1,600 steps and 9.6% at 3,200 (a spike of
    the constant rate it never came back from, not flagged diverged) while seeds 0 and 2 read 100% at both. It is
    a failed run like a stuck one: left out with one WARNING line, L = 3200 on the seeds that learned, not a
    refusal as "not above chance on every seed" at the cap."""
    def collapsing(name, step, length, seed):
        accuracy = _saturating(name, step, length, seed)
        return 0.096 if name == "HHHH" and seed % 1000 == 1 and step >= 3200 else accuracy

    trainer = ScriptedTrainer(collapsing, _context())
    with caplog.at_level("WARNING", logger="precsearch.search.calibration"):
        result = run_search(_config(tmp_path / "run", max_proxy_steps=3200), trainer=trainer)
    calibration = result.calibration
    assert (calibration.length, calibration.failed, calibration.accuracies) == (3200, (1,), [1.0, 1.0])
    warnings = [record.message for record in caplog.records if "failed run" in record.message]
    assert len(warnings) == 1 and "seed 1 at 0.096 (0.900 at 800)" in warnings[0]
    continued = {call["seed"] for call in trainer.calls if call["name"] == "HHHH" and call["length"] == 3 * 3200}
    assert continued == {0, 2}


def test_stuck_seeds_that_are_the_majority_stay_in_the_reference(tmp_path):
    """Two seeds of three on the plateau are not failed runs to leave out but the reference's own behaviour: the
    seeds disagree and drew no closer, so calibration stops at 800 with that warning, every seed kept."""
    result = run_search(_config(tmp_path / "run", max_proxy_steps=3200), trainer=ScriptedTrainer(_stuck(0, 2),
                                                                                                 _context()))
    assert result.calibration.length == 800 and result.calibration.failed == ()
    assert len(result.calibration.accuracies) == 3 and "seeds still disagree" in result.calibration.warning


def test_a_reference_that_never_learns_is_refused_and_nothing_is_picked(tmp_path):
    trainer = ScriptedTrainer(lambda name, step, length, seed: CHANCE, _context())
    with pytest.raises(PrecsearchError) as error:
        run_search(_config(tmp_path / "run", max_proxy_steps=400), trainer=trainer)
    message = str(error.value)
    assert "\n" not in message and "not above chance on every seed at 400 steps" in message
    assert "--max-proxy-steps" in message and "learning rate" in message
    assert not (tmp_path / "run" / "best.json").exists()
    assert {call["length"] for call in trainer.calls} == {50, 100, 200, 400}


class Interrupting(ScriptedTrainer):
    """Stops the search (as Ctrl-C would) at its ``stop_at``-th run."""

    stop_at = 0

    def __call__(self, *args, **kwargs):
        if len(self.calls) + 1 == self.stop_at:
            raise KeyboardInterrupt
        return super().__call__(*args, **kwargs)


def test_a_resumed_calibration_continues_its_runs_from_their_checkpoints(tmp_path):
    out = tmp_path / "run"
    first = Interrupting(_plateau, _context())
    first.stop_at = 8  # 50, 100 on 3 seeds, then 200 on one seed, then stopped
    with pytest.raises(SearchInterrupted):
        run_search(_config(out), trainer=first)
    study = _journal_study(out)
    done = {name for name in study.user_attrs if name.startswith("step:calibration:")}
    assert done == {f"step:calibration:{length}:{seed}" for length in (50, 100) for seed in (0, 1, 2)} | {
        "step:calibration:200:0"}
    second = ScriptedTrainer(_plateau, _context())
    result = run_search(_config(out, resume=True), trainer=second)
    again = [(call["start"], call["length"], call["seed"]) for call in second.calls if call["name"] == "HHHH"
             and call["seed"] < 1000 and call["length"] <= 200]
    assert sorted(again) == [(100, 200, 1), (100, 200, 2)]  # from the checkpoints at 100; 200 on seed 0 was done
    assert result.calibration.length == 800


def test_a_fixed_proxy_length_reads_its_reference_at_its_halvings():
    """--proxy-steps N trains N steps whatever --max-proxy-steps says, read at N/8, N/4, N/2 (the rungs)."""
    assert CalibrationSettings(start=1, max_steps=1, fixed=1).points() == [1]
    assert CalibrationSettings(fixed=90).points() == [11, 22, 45, 90]
    with pytest.raises(PrecsearchError, match="at least two lengths"):
        CalibrationSettings(start=1, max_steps=1)
    assert CalibrationSettings(start=50, max_steps=400).points() == [50, 100, 200, 400]


class PausedPastItsLease(ScriptedTrainer):
    """Trains as scripted, but while training its first trial another worker (simulated through a second handle
    on the journal) fails that trial and queues its retry, as a worker does to one silent for 3 heartbeats."""

    taken_over: int | None = None

    def __call__(self, policy, steps, seed, **kwargs):
        study = _journal_study(self.out)
        running = study.get_trials(deepcopy=False, states=(TrialState.RUNNING,))
        if running and self.taken_over is None:
            trial = running[0]
            self.taken_over = trial.number
            study.tell(trial.number, state=TrialState.FAIL)
            RetryHeartbeatStaleTrialCallback()(study, study.trials[trial.number])  # what the heartbeat does
        return super().__call__(policy, steps, seed, **kwargs)


def _journal_study(out):
    """The run's study, opened as precsearch opens it (its records checksummed: plain Optuna's are refused)."""
    return optuna.load_study(study_name="precsearch", storage=StudyLocation.of(None, out).open())


def test_a_trial_taken_over_while_its_worker_was_paused_is_dropped_and_its_retry_counts(tmp_path, caplog):
    """Optuna refuses to record a result for a trial another worker already failed; the worker says so once and
    carries on, and the retry gives the study that assignment's result."""
    out = tmp_path / "run"
    trainer = PausedPastItsLease(_plateau, _context())
    trainer.out = out
    with caplog.at_level("WARNING", logger="precsearch.search.workers"):
        run_search(_config(out, trials=3, proxy_steps=100, proxy_seeds=1), trainer=trainer)
    assert trainer.taken_over is not None
    assert sum("was failed by another worker while this one was paused" in r.message for r in caplog.records) == 1
    trials = _journal_study(out).get_trials(deepcopy=False)
    taken = trials[trainer.taken_over]
    assert taken.state == TrialState.FAIL
    assert [t.state for t in trials if t.params == taken.params and t.number != taken.number] == [TrialState.COMPLETE]
    assert not [t for t in trials if t.state in (TrialState.RUNNING, TrialState.WAITING)]
