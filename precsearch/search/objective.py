"""The Optuna objective: decide a trial's assignment, price it, reuse a trial that already has it or train its
proxy against the reference at the rungs, and record the result and constraints on the trial.

* A write that finds the disk full stops the search (``files.DiskFull``) and leaves the trial RUNNING, so
  ``--resume`` runs it again; it is no failure of the trial.
* A diverged proxy, or one stopped at a rung, is a COMPLETE trial whose constraint (``diverged``, ``stopped``)
  is violated, so the sampler learns from it. A trial that raises is FAILED with the error in its ``error``
  user attr, and the study goes on.
* Identical assignments are trained once, by every worker on every host (``Objective._claim``); a copy
  (``duplicate_of``) does not use up the trial budget.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import optuna
from optuna.trial import TrialState

from precsearch.config.policy import Policy
from precsearch.files import DiskFull, full_disk
from precsearch.search.context import SearchContext, combine_seeds, seed_record
from precsearch.search.reference import Reference, proxy_noise
from precsearch.search.rungs import RungStop
from precsearch.search.selection import race_settled, untrained_reason
from precsearch.search.storage import StudyLocation, owner_id
from precsearch.search.strategies import assign, assignment_key, low_share
from precsearch.search.trials import TrialRecord, fail_stale, set_attrs, set_constraints, trials_frame
from precsearch.train.continuing import branch_steps
from precsearch.train.trainer import ProxyResult

__all__ = ["FINISHED", "Objective", "TrialStep"]

log = logging.getLogger(__name__)

TRIAL_POLICIES = "trials"  # each worker's --out/trials/trial_NNNN.json: the policy each proxy it ran trained under
FINISHED = (TrialState.COMPLETE, TrialState.PRUNED)


@dataclass(frozen=True)
class TrialStep:
    """Where a trial's proxy stands: the step of its run on ``seed`` out of ``steps`` (the progress bar's)."""

    trial: int
    seed: int
    step: int
    steps: int

    def __str__(self) -> str:
        return f"trial {self.trial}, seed {self.seed}: step {self.step}/{self.steps}"


class Objective:
    """Optuna objective: decide, price, reuse or train, record; one instance per worker process. Every trial is
    held to ``reference``; the decision lock is taken in ``storage``; the policy of each proxy is written under
    ``out_dir``; ``progress`` is told every few steps where the proxy stands."""

    def __init__(self, context: SearchContext, reference: Reference, location: StudyLocation,
                 storage: optuna.storages.BaseStorage, out_dir: Path,
                 progress: Callable[[TrialStep], None] | None = None) -> None:
        self.context = context
        self.reference = reference
        self.rungs = reference.rung_rule(context.budget, context.chance)
        self.location = location
        self.storage = storage
        self.out_dir = out_dir
        self.progress = progress

    def __call__(self, trial: optuna.Trial) -> Any:
        try:
            return self._run(trial)
        except optuna.TrialPruned:
            raise
        except KeyboardInterrupt:
            set_attrs(trial, TrialRecord(interrupted=True))
            raise
        except Exception as error:
            if full_disk(error) is not None:  # not the trial's fault: stop, and leave it RUNNING for --resume
                raise DiskFull() from error
            set_attrs(trial, TrialRecord(error=f"{type(error).__name__}: {error}"[:2000]))
            raise

    def _run(self, trial: optuna.Trial) -> Any:
        context = self.context
        decisions = {unit: trial.suggest_categorical(unit, context.levels) for unit in context.units}
        assignment = assign(context.graph, context.space, decisions)
        key = assignment_key(assignment)
        planned, _ = context.memory(assignment)
        set_attrs(trial, TrialRecord(key=key, memory_planned=planned, worker=owner_id(),
                                     low_share=low_share(context.graph, context.space, decisions)))
        study = trial.study
        previous = self._claim(trial, key)
        if previous is not None:
            return self._reuse(trial, previous)
        reference = self.reference
        skipped = untrained_reason(trials_frame(study, context), context.budget, reference, key, planned,
                                   context.chance)
        if skipped is not None:
            return self._untrained(trial, planned, skipped)
        policy = context.policy(assignment, {"trial": trial.number})
        stopped: RungStop | None = None
        if key == reference.key:
            result = reference.result
            accuracies = list(reference.accuracies)
            seed_steps: list[int] = []
            branches = 0
            set_attrs(trial, TrialRecord(reference_copy=True))
        else:
            stopped, results = self._race(study, policy, key, trial.number)
            if stopped is not None:
                result = ProxyResult(stopped.accuracy, math.nan, False, stopped.reason, stopped.step, [])
                accuracies, seed_steps = [stopped.accuracy], [stopped.step]
                branches = branch_steps(step for step in self.rungs.steps if step <= stopped.step)
            else:
                result = combine_seeds(results)
                accuracies = [run.val_accuracy for run in results]
                seed_steps = [run.steps_run for run in results]
                branches = sum(run.branch_steps for run in results)
        measures, size = context.memories(assignment, result.promotions)
        memory = measures[f"memory_{context.budget.memory}"]
        path = self.out_dir / TRIAL_POLICIES / f"trial_{trial.number:04d}.json"
        path.parent.mkdir(exist_ok=True)
        proxy = {"val_accuracy": result.val_accuracy, "memory": memory, "diverged": result.diverged}
        policy.replace(provenance={**policy.provenance, "worker": owner_id(), "proxy": proxy}).save(path)
        set_attrs(trial, TrialRecord.from_result(
            result, memory=memory, bytes=size, trained=True, policy=str(path.resolve()), **measures,
            **seed_record(accuracies), seed_steps=tuple(seed_steps), branch_steps=branches,
            stopped_at=None if stopped is None else stopped.step))
        margin = 0.0
        if reference.accuracy is not None:
            noise = proxy_noise(trials_frame(study, context), reference, context.budget.confidence)
            margin = float(noise.margin(len(accuracies), len(reference.accuracies)))
        constraints = context.constraints(result, memory, reference.accuracy, margin)
        constraints["stopped"] = 1.0 if stopped is not None else 0.0
        set_constraints(trial, constraints)
        for seed in context.proxy_seed_list(reference.proxy_seeds):
            context.drop_checkpoint(key, seed)
        return context.values(memory, result)

    def _race(self, study: optuna.Study, policy: Policy, key: str, number: int
              ) -> tuple[RungStop | None, list[ProxyResult]]:
        """Train a candidate seed by seed, the first through the rungs (whose stop ends it), adding a seed only
        while the budget's decision on it depends on one (``selection.race_settled``); each run continues the
        checkpoint a stopped process left, if any."""
        context = self.context
        results: list[ProxyResult] = []
        for seed in context.proxy_seed_list(self.reference.proxy_seeds):
            first = not results
            try:
                results.append(context.trainer(policy, self.reference.length, seed, report=self._reporter(number, seed),
                                               evaluate_at=self.rungs.steps if first else (),
                                               on_eval=self.rungs.check if first else None,
                                               checkpoint=context.checkpoint(key, seed)))
            except RungStop as stop:
                return stop, []
            accuracies = [run.val_accuracy for run in results]
            if results[-1].diverged or race_settled(trials_frame(study, context), accuracies, self.reference,
                                                    context.budget):
                break
        return None, results

    def _reporter(self, number: int, seed: int) -> Callable[[int, float], None] | None:
        progress, steps = self.progress, self.reference.length
        if progress is None:
            return None
        return lambda step, loss: progress(TrialStep(number, seed, step, steps))

    def _claim(self, trial: optuna.Trial, key: str) -> TrialRecord | None:
        """Decide, under the study's lock (every worker's), whether this trial trains the assignment ``key``: a
        finished trial with the key is returned for reuse; a live one training it is waited for, then the decision
        is taken again; else this trial claims the key (``trains`` holds its own number, so the marker a retried
        copy inherits from a dead trial claims nothing)."""
        study = trial.study
        while True:
            with self.location.lock(self.storage):
                others = [TrialRecord.from_trial(t) for t in study.get_trials(
                    deepcopy=False, states=(*FINISHED, TrialState.RUNNING)) if t.number != trial.number]
                others = [t for t in others if t.key == key]
                finished = [t for t in others if t.state != TrialState.RUNNING.name]
                if finished:
                    return finished[0]
                owner = next((t for t in others if t.trains == t.number), None)
                if owner is None:
                    set_attrs(trial, TrialRecord(trains=trial.number))
                    return None
            log.info("trial %d waits for trial %d, which trains the same assignment", trial.number, owner.number)
            _wait_while_running(study, owner.number)

    def _reuse(self, trial: optuna.Trial, previous: TrialRecord) -> Any:
        """Copy a finished trial's results for the same assignment instead of training again."""
        set_attrs(trial, previous.copied())
        if previous.state == TrialState.PRUNED.name:
            raise optuna.TrialPruned(f"same assignment as pruned trial {previous.number}")
        set_constraints(trial, previous.constraints)
        return list(previous.values)

    def _untrained(self, trial: optuna.Trial, memory: float, reason: str) -> Any:
        """A completed, infeasible trial that was priced but not worth training."""
        context = self.context
        set_attrs(trial, TrialRecord(trained=False, reason=reason, memory=memory))
        set_constraints(trial, context.constraints(None, memory, None))
        return context.values(memory, None)


def _wait_while_running(study: optuna.Study, number: int) -> None:
    """Poll until trial ``number`` leaves RUNNING, failing meanwhile the trials whose worker died (Optuna does so
    only when a trial starts, and every live worker may be waiting here)."""
    while any(t.number == number for t in study.get_trials(deepcopy=False, states=(TrialState.RUNNING,))):
        time.sleep(0.5)
        fail_stale(study)

