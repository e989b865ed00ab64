"""Calibration of the proxy length on the all-high reference, with scripted learning curves."""

from __future__ import annotations

import json

import optuna
import pandas as pd
import pytest
from optuna.storages import RetryHeartbeatStaleTrialCallback
from optuna.trial import TrialState
from scripted import ScriptedTrainer

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


def test_calibration_stops_at_the_plateau_and_records_the_curves(tmp_path):
    trainer = ScriptedTrainer(_plateau, _context())
    result = run_search(_config(tmp_path / "run"), trainer=trainer)
    calibration = [call for call in trainer.calls if call["seed"] < 1000 and call["name"] == "HHHH"]
    # 200 -> 400 gains 5 points (more than the 1-point seed spread allows), 400 -> 800 half a point: 800
    assert sorted({call["length"] for call in calibration}) == [50, 100, 200, 400, 800]
    assert len(calibration) == 5 * 3  # every length on the 3 reference seeds, once
    assert result.calibration.length == 800
    run = json.loads((tmp_path / "run" / "run.json").read_text())
    assert run["proxy_length"] == 800
    assert run["calibration"]["accuracies"]["400"] == pytest.approx([0.94, 0.95, 0.96])
    curves = pd.read_csv(tmp_path / "run" / "calibration.csv")
    chosen = curves[curves["chosen"]]
    assert set(chosen["length"]) == {800} and {89, 267, 800} <= set(chosen["step"])  # the rungs L/9, L/3 and L
    row = chosen[(chosen["seed"] == 0) & (chosen["step"] == 267)].iloc[0]
    assert row["val_accuracy"] == pytest.approx(_plateau("HHHH", 267, 800, 0))
    # every candidate trained at the calibrated length (its schedule spans it, whether or not a rung stopped it)
    candidates = [call for call in trainer.calls if call["name"] not in ("HHHH", "plain") and call["seed"] < 1000]
    assert candidates and all(call["length"] == 800 for call in candidates)


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


def test_a_resumed_calibration_does_not_redo_finished_runs(tmp_path):
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
    again = {(call["length"], call["seed"]) for call in second.calls if call["name"] == "HHHH"}
    assert not again & {(50, 0), (50, 1), (50, 2), (100, 0), (100, 1), (100, 2), (200, 0)}
    assert result.calibration.length == 800


def test_a_fixed_proxy_length_needs_no_calibration_schedule():
    """--proxy-steps N trains N steps whatever --max-proxy-steps says; only calibration needs two lengths."""
    fixed = CalibrationSettings(start=1, max_steps=1, fixed=1)
    assert fixed.schedule() == [1]
    with pytest.raises(PrecsearchError, match="at least two lengths"):
        CalibrationSettings(start=1, max_steps=1)
    assert CalibrationSettings(start=50, max_steps=400).schedule() == [50, 100, 200, 400]


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
            study._storage.set_trial_state_values(trial._trial_id, TrialState.FAIL)
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
