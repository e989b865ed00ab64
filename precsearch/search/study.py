"""The search: Optuna studies over precision assignments, scored by the cost model and short proxies.

``run_search`` traces the model once, seeds an Optuna study with the paper's technique at r = 0, 0.1, ..., 1
plus all-high and all-low (``enqueue_trial``), and lets a TPE sampler propose further assignments. Each
trial decides one level per unit of the space, prices it with ``cost.CostModel`` (no training) and trains a
proxy under the resulting policy.

Objectives. By default two, both minimized: memory (bytes of the assignable tensors relative to all-high,
counting tensors the divergence guard promoted as high) and the proxy's validation error (or loss, per the
space). Under a budget the study has one objective and can prune with Optuna's ``PercentilePruner`` on the
proxy's running training loss: ``max_memory=R`` maximizes accuracy among assignments within R of the
all-high memory (an assignment over R is not trained at all), ``max_accuracy_drop=D`` minimizes memory
among assignments whose accuracy is within D (a fraction: 0.01 = 1 point) of the all-high proxy.

Bookkeeping rules:

* A diverged proxy is a COMPLETE trial whose constraint ``diverged`` is violated (``Trial.set_constraint``,
  which replaces ``constraints_func`` in Optuna 5), so the sampler learns from it. A trial that raises is
  FAILED with the error in its ``error`` user attr, and the study goes on.
* Identical assignments are trained once, by every worker on every host: under a lock all workers share
  (a PostgreSQL advisory lock, or an flock on a SQLite or journal file) a trial either copies the results of
  a finished trial with its assignment key (``duplicate_of``), waits for the live trial that trains that
  key, or marks itself as the one that trains it (``trains``).
* Storage is a PostgreSQL or SQLite URL, or a journal file (the default: ``study.journal`` in the run
  directory), so ``resume=True`` continues an interrupted search without losing a completed trial; trials a
  killed process left RUNNING are failed as ``interrupted`` and queued again. ``jobs=N`` runs N worker
  processes on the same study (on CUDA, one per visible GPU).
* A shared study (``study_name``) is joined by any number of workers on any number of hosts: the first
  creates and seeds it, and a worker with another model, graph, space, data, seed or budget is refused. A
  worker that dies stops heartbeating; its trial is failed after ``3 x heartbeat`` seconds and queued again
  (Optuna's ``RetryHeartbeatStaleTrialCallback``), so only that trial's work is lost.
* After every trial the outputs are rewritten atomically from the storage: ``trials.csv``, ``pareto.csv``,
  ``policies/`` (one policy per Pareto point) and ``best.json`` (the point the budget picks); the policy each
  proxy trained under is in ``trials/`` of the worker that ran it. ``export_study`` rebuilds all of it from
  the storage alone.
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import hashlib
import importlib.util
import json
import logging
import math
import multiprocessing
import os
import shutil
import signal
import socket
import threading
import time
import warnings
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import optuna
import pandas as pd
import sqlalchemy
import torch
from optuna.storages import JournalStorage, RDBStorage, RetryHeartbeatStaleTrialCallback
from optuna.storages.journal import JournalFileBackend
from optuna.trial import FrozenTrial, TrialState
from sqlalchemy.engine import make_url
from tqdm.auto import tqdm

from precsearch.config.policy import Policy
from precsearch.config.spaces import SearchSpace, load_space, parse_space
from precsearch.config.spec import MEMORY_MEASURES
from precsearch.cost.model import CostModel
from precsearch.cost.policies import policy_from_assignment
from precsearch.errors import PrecsearchError
from precsearch.files import atomic_write_text
from precsearch.graph.tracing import trace
from precsearch.graph.types import TensorGraph
from precsearch.search.noise import DEFAULT_CONFIDENCE, Noise, pooled_noise, seeds_for
from precsearch.search.rundir import (
    LOCK_FILES,
    RunLock,
    SearchStop,
    StopSignals,
    hold_worker_lock,
    quiet_optuna_interrupts,
    remove_stale_journal_lock,
    remove_temporaries,
)
from precsearch.search.samplers import make_sampler
from precsearch.search.strategies import (
    BASELINES,
    assign,
    assignment_key,
    baseline_policies,
    low_share,
    seed_candidates,
    sweep,
    uniform,
    units,
)
from precsearch.train.data import ImageDataset, load_dataset
from precsearch.train.proxy import run_proxy
from precsearch.train.trainer import ProxyResult, build_model, resolve_device

__all__ = [
    "Budget",
    "DataSpec",
    "SearchContext",
    "SearchResult",
    "StudyLocation",
    "atomic_write_text",
    "export_study",
    "pareto_front",
    "run_baselines",
    "run_search",
]

log = logging.getLogger(__name__)

STUDY_NAME = "precsearch"
JOURNAL_NAME = "study.journal"
RUN_FILE = "run.json"
TRIAL_POLICIES = "trials"  # each worker's --out/trials/trial_NNNN.json: the policy each proxy it ran trained under
POSTGRES_DRIVER = "postgresql+psycopg"
DEFAULT_HEARTBEAT = 20  # seconds between heartbeats; a trial silent for 3x this is failed and retried
MAX_RETRIES = 3  # times a trial whose worker died is queued again
CONFIG_WAIT = 30.0  # seconds a joining worker waits for a new study's creator to record its config ...
SEED_WAIT = 600.0  # ... and to queue its seeds (after training the reference, for --max-accuracy-drop)
WORKER = f"{socket.gethostname()}:{os.getpid()}"
DEFAULT_ACCURACY_DROP = 0.01
FINISHED = (TrialState.COMPLETE, TrialState.PRUNED)
METRICS = (
    "val_accuracy", "val_loss", "diverged", "reason", "steps_run", "skipped_steps", "final_loss_scale",
    "promotions", "overflow_max", "underflow_max", "underflow_mean", "wall_time", "memory", "bytes",
    "memory_bytes", "memory_peak", "memory_planned", "low_share", "trained", "device",
    "val_accuracy_sd", "val_accuracies", "seeds",
)
AUTO_REFERENCE_SEEDS = 3  # with --proxy-seeds auto, the all-high reference trains this many seeds to measure noise
AUTO_MIN_SEEDS = 2  # ... and every proxy at least this many, so each trial adds to the noise estimate


# ------------------------------------------------------------------------------------------ configuration


@dataclass(frozen=True)
class DataSpec:
    """Which dataset the proxies train on: a name of ``precsearch.train.data`` and, for local data, its folder."""

    name: str = "digits"
    root: str | None = None

    def load(self, image_size: int, seed: int = 0) -> tuple[ImageDataset, ImageDataset]:
        return load_dataset(self.name, root=self.root, image_size=image_size, seed=seed)



@dataclass(frozen=True)
class Budget:
    """At most one of: ``max_memory`` (ratio of all-high memory) or ``max_accuracy_drop`` (fraction), and the
    memory measure the search minimizes: ``bytes`` (the paper's: bytes of the assignable tensors) or
    ``peak`` (the predicted peak of a training step, ``CostModel.peak_bytes``)."""

    max_memory: float | None = None
    max_accuracy_drop: float | None = None
    memory: str = "bytes"
    confidence: float = DEFAULT_CONFIDENCE  # one-sided confidence of accuracy decisions (see precsearch.search.noise)

    def __post_init__(self) -> None:
        if not 0.5 <= self.confidence < 1.0:
            raise PrecsearchError(f"confidence {self.confidence} must lie in [0.5, 1), e.g. 0.9")
        if self.memory not in MEMORY_MEASURES:
            raise PrecsearchError(f"memory measure {self.memory!r}: use one of {', '.join(MEMORY_MEASURES)}")
        if self.max_memory is not None and self.max_accuracy_drop is not None:
            raise PrecsearchError("give either --max-memory or --max-accuracy-drop, not both")
        if self.max_memory is not None and not 0.0 < self.max_memory <= 1.0:
            raise PrecsearchError(f"max memory {self.max_memory} must be a ratio of all-high memory in (0, 1]")
        if self.max_accuracy_drop is not None and not 0.0 <= self.max_accuracy_drop <= 1.0:
            raise PrecsearchError(f"max accuracy drop {self.max_accuracy_drop} must be a fraction in [0, 1] "
                                  "(0.01 = 1 point)")

    @property
    def single_objective(self) -> bool:
        return self.max_memory is not None or self.max_accuracy_drop is not None

    @property
    def drop(self) -> float:
        """The accuracy drop the pick allows (the default 1 point when the budget gives none)."""
        return DEFAULT_ACCURACY_DROP if self.max_accuracy_drop is None else self.max_accuracy_drop

    def describe(self) -> str:
        if self.max_memory is not None:
            return (f"best accuracy with memory <= {self.max_memory:g} of all-high (least memory among accuracies "
                    f"within seed noise of the best at {100 * self.confidence:g}% confidence)")
        return (f"least memory with accuracy within {100 * self.drop:g} point(s) of all-high at "
                f"{100 * self.confidence:g}% confidence")


# ---------------------------------------------------------------------------------------------- context


@dataclass
class SearchContext:
    """Everything one process needs to run trials: data, traced graph, cost model, space and budget."""

    model: str
    space: SearchSpace
    data_spec: DataSpec
    budget: Budget
    seed: int
    device: str
    data: tuple[ImageDataset, ImageDataset]
    graph: TensorGraph
    cost: CostModel
    high_bytes: float = 0.0
    high_peak: float = 0.0
    units: dict[str, list[str]] = field(default_factory=dict)
    proxy_seeds: int | None = 1  # seeds per proxy; None: chosen from the noise the reference measures

    @classmethod
    def create(cls, model: str, space: SearchSpace, data_spec: DataSpec, budget: Budget, seed: int,
               device: str, data: tuple[ImageDataset, ImageDataset] | None = None,
               proxy_seeds: int | None = 1) -> SearchContext:
        """Load the data (unless given), build and trace the model at the proxy's batch and image size."""
        if data is None:
            data = data_spec.load(space.proxy.image_size, seed=0)
        torch.manual_seed(seed)
        network = build_model(model, num_classes=data[0].num_classes)
        example = data[0].images[:2]  # real images: a data-dependent branch zeros would skip is traced
        graph = trace(network, example, batch_size=space.proxy.batch_size)
        if proxy_seeds is not None and proxy_seeds < 1:
            raise PrecsearchError(f"proxy_seeds={proxy_seeds} must be at least 1 (or auto)")
        context = cls(model=model, space=space, data_spec=data_spec, budget=budget, seed=seed, device=device,
                      data=data, graph=graph, cost=CostModel(graph), proxy_seeds=proxy_seeds)
        context.units = units(graph, space)
        high = uniform(graph, space, "high").assignment
        context.high_bytes = float(context.cost.bytes(high))
        context.high_peak = float(context.cost.peak_bytes(high))
        return context

    @property
    def levels(self) -> list[str]:
        return list(self.space.levels)

    @property
    def chance(self) -> float:
        """The validation accuracy a network that learned nothing reaches by luck: the majority class's share
        plus 3 binomial standard deviations over the validation set. An accuracy at or below it is no signal."""
        labels = self.data[1].labels
        share = float(torch.bincount(labels).max()) / len(labels)
        return share + 3.0 * math.sqrt(share * (1.0 - share) / len(labels))

    def decisions(self, params: Mapping[str, Any]) -> dict[str, str]:
        return {unit: str(params.get(unit, "high")) for unit in self.units}

    def key(self, params: Mapping[str, Any]) -> str:
        return assignment_key(assign(self.graph, self.space, self.decisions(params)))

    def memory(self, assignment: Mapping[str, str], promoted: list[str] = ()) -> tuple[float, float]:
        """(ratio to all-high in the budget's measure, bytes) of an assignment; promoted tensors count at the
        high format."""
        ratios, size = self.memories(assignment, promoted)
        return ratios[f"memory_{self.budget.memory}"], size

    def memories(self, assignment: Mapping[str, str], promoted: list[str] = ()) -> tuple[dict[str, float], float]:
        """Both measures as ratios to all-high (``memory_bytes``, ``memory_peak``), and the bytes."""
        effective = dict(assignment)
        for tensor_id in promoted:
            if tensor_id in effective:
                effective[tensor_id] = self.space.high
        size = float(self.cost.bytes(effective))
        peak = float(self.cost.peak_bytes(effective))
        return {"memory_bytes": size / self.high_bytes, "memory_peak": peak / self.high_peak}, size

    def policy(self, assignment: Mapping[str, str], provenance: Mapping[str, Any]) -> Policy:
        """The policy file for an assignment under this space's numerics (rounding, scaling, guard); the
        policy's ``predicted`` comes from the cost model (``policy_from_assignment``)."""
        space = self.space
        return policy_from_assignment(
            self.graph, dict(assignment),
            model=self.model,
            high_format=space.high,
            rounding=dict(space.rounding),
            overflow=dict(space.overflow),
            loss_scaling=dict(space.loss_scaling),
            promotion_threshold=space.promotion_threshold,
            promotion_kinds=space.promotion_kinds,
            gradient_rounding=space.gradient_rounding,
            ties=space.ties,
            master_weights=space.master_weights,
            optimizer=dict(space.optimizer),
            provenance=dict(provenance),
        )

    def constraints(self, result: ProxyResult | None, memory: float, reference: float | None,
                    margin: float = 0.0) -> dict[str, float]:
        """Constraint values (feasible when all <= 0): divergence (or untrained), then the budget's bound;
        the accuracy bound holds when the mean is within the drop by more than the noise ``margin``."""
        constraints = {"diverged": 1.0 if result is None or result.diverged else 0.0}
        if self.budget.max_memory is not None:
            constraints["memory_budget"] = memory - self.budget.max_memory
        if self.budget.max_accuracy_drop is not None:
            accuracy = result.val_accuracy if result is not None else 0.0
            constraints["accuracy_drop"] = (reference or 0.0) - self.budget.max_accuracy_drop - accuracy + margin
        return constraints

    def proxy_seed_list(self, count: int) -> list[int]:
        """The seeds of a ``count``-seed proxy: the search seed and the ones after it (same for every trial
        and for the all-high reference, so differences are not differences of seeds)."""
        return [self.seed + index for index in range(count)]

    def train_seeds(self, policy: Policy, count: int, report: Callable[[int, float], None] | None = None,
                    check: Callable[[int, float], None] | None = None) -> tuple[ProxyResult, list[float]]:
        """Train ``count`` seeded proxies of one policy; the first one calls ``report`` (the pruner), the others
        ``check`` (stop signals). Returns the combined result (``combine_seeds``) and the per-seed accuracies
        (stopping at the first divergence)."""
        results = []
        for index, seed in enumerate(self.proxy_seed_list(count)):
            results.append(run_proxy(self.model, policy, self.data, self.space.proxy.steps, seed=seed,
                                     device=self.device, config=self.space.proxy,
                                     report=report if index == 0 else check))
            if results[-1].diverged:
                break
        return combine_seeds(results), [result.val_accuracy for result in results]

    def score(self, result: ProxyResult) -> float:
        """The accuracy-side objective value (finite, so Optuna stores it even for a diverged proxy)."""
        if self.space.accuracy_objective == "val_loss":
            return min(result.val_loss, 1e6) if math.isfinite(result.val_loss) else 1e6
        return result.val_error

    def values(self, memory: float, result: ProxyResult) -> list[float]:
        if self.budget.max_memory is not None:
            return [self.score(result)]
        if self.budget.max_accuracy_drop is not None:
            return [memory]
        return [memory, self.score(result)]


# ------------------------------------------------------------------------------------------- the objective


def combine_seeds(results: list[ProxyResult]) -> ProxyResult:
    """One result for proxies of the same policy under several seeds: mean accuracy and loss, the union of
    promotions (memory counts every tensor any seed promoted), diverged if any seed diverged, worst overflow
    and underflow, summed wall time; the loss curve is the first seed's."""
    first = results[0]
    if len(results) == 1:
        return first
    diverged = [result for result in results if result.diverged]
    return dataclasses.replace(
        first,
        val_accuracy=sum(result.val_accuracy for result in results) / len(results),
        val_loss=sum(result.val_loss for result in results) / len(results),
        diverged=bool(diverged),
        reason=diverged[0].reason if diverged else "",
        steps_run=min(result.steps_run for result in results),
        skipped_steps=max(result.skipped_steps for result in results),
        promotions=sorted({tensor for result in results for tensor in result.promotions}),
        overflow_max=max(result.overflow_max for result in results),
        underflow_max=max(result.underflow_max for result in results),
        underflow_mean=sum(result.underflow_mean for result in results) / len(results),
        wall_time=sum(result.wall_time for result in results),
    )


def _seed_record(accuracies: list[float]) -> dict[str, Any]:
    """User attrs of a multi-seed proxy: per-seed accuracies, their count and sample sd (NaN for one)."""
    count = len(accuracies)
    mean = sum(accuracies) / count
    sd = math.sqrt(sum((a - mean) ** 2 for a in accuracies) / (count - 1)) if count > 1 else math.nan
    return {"val_accuracies": accuracies, "seeds": count, "val_accuracy_sd": sd}


def _feasible(trial: FrozenTrial) -> bool:
    """A completed trial whose constraints all hold (a trial without constraints was never judged)."""
    constraints = trial.constraints
    return trial.state == TrialState.COMPLETE and bool(constraints) and all(v <= 0 for v in constraints.values())


def _set_constraints(trial: optuna.Trial, constraints: Mapping[str, float]) -> None:
    for name, value in constraints.items():
        trial.set_constraint(name, value)


class Objective:
    """Optuna objective: decide, price, reuse or train, record. One instance per worker process.

    ``location`` and ``storage`` are where the study lives (the decision lock is taken there);
    ``out_dir`` is where this worker writes the policy of each proxy it trains.
    """

    def __init__(self, context: SearchContext, location: StudyLocation, storage: optuna.storages.BaseStorage,
                 out_dir: Path, signals: StopSignals | None = None) -> None:
        self.context = context
        self.location = location
        self.storage = storage
        self.out_dir = out_dir
        self.signals = signals

    def __call__(self, trial: optuna.Trial) -> Any:
        try:
            return self._run(trial)
        except optuna.TrialPruned:
            raise
        except KeyboardInterrupt:
            trial.set_user_attr("interrupted", True)
            raise
        except Exception as error:
            trial.set_user_attr("error", f"{type(error).__name__}: {error}"[:2000])
            raise

    def _run(self, trial: optuna.Trial) -> Any:
        context = self.context
        levels = context.levels
        decisions = {unit: trial.suggest_categorical(unit, levels) for unit in context.units}
        assignment = assign(context.graph, context.space, decisions)
        key = assignment_key(assignment)
        planned, _ = context.memory(assignment)
        trial.set_user_attr("key", key)
        trial.set_user_attr("memory_planned", planned)
        trial.set_user_attr("low_share", low_share(context.graph, context.space, decisions))
        trial.set_user_attr("worker", WORKER)
        study = trial.study
        previous = self._claim(trial, key)
        if previous is not None:
            return self._reuse(trial, previous)
        reference = _reference_accuracy(study)
        if context.budget.max_memory is not None and planned > context.budget.max_memory:
            return self._untrained(trial, planned, "over the memory budget")
        if context.budget.max_accuracy_drop is not None:
            best = _best_feasible_memory(study)
            if best is not None and planned >= best:
                trial.set_user_attr("reason", f"cannot beat the best feasible memory {best:.4f}")
                raise optuna.TrialPruned(f"memory {planned:.4f} >= best feasible {best:.4f}")
        policy = context.policy(assignment, {"trial": trial.number})
        if key == study.user_attrs.get("reference_key"):
            result = ProxyResult.from_dict(study.user_attrs["reference_result"])
            accuracies = study.user_attrs.get("reference_accuracies", [result.val_accuracy])
            trial.set_user_attr("duplicate_of", "reference")
        else:
            result, accuracies = context.train_seeds(
                policy, int(study.user_attrs.get("proxy_seeds", 1)), report=self._pruning_hook(trial),
                check=self._check_signals)
        ratios, size = context.memories(assignment, result.promotions)
        memory = ratios[f"memory_{context.budget.memory}"]
        path = self.out_dir / TRIAL_POLICIES / f"trial_{trial.number:04d}.json"
        path.parent.mkdir(exist_ok=True)
        proxy = {"val_accuracy": result.val_accuracy, "memory": memory, "diverged": result.diverged}
        policy.replace(provenance={**policy.provenance, "worker": WORKER, "proxy": proxy}).save(path)
        record = result.to_dict()
        record.pop("loss_curve")
        record.update(memory=memory, bytes=size, trained=True, policy=str(path.resolve()), **ratios,
                      **_seed_record(accuracies))
        for name, value in record.items():
            trial.set_user_attr(name, value)
        margin = 0.0
        if reference is not None:
            noise = _study_noise(study, context)
            margin = float(noise.margin(len(accuracies), len(study.user_attrs.get("reference_accuracies", [0]))))
        _set_constraints(trial, context.constraints(result, memory, reference, margin))
        trial.set_user_attr("loss_curve", [round(v, 5) for v in result.loss_curve])
        return context.values(memory, result)

    def _check_signals(self, step: int, loss: float) -> None:
        """Called every few proxy steps: a stop signal recorded but not raised is raised here."""
        if self.signals is not None:
            self.signals.check()

    def _pruning_hook(self, trial: optuna.Trial) -> Callable[[int, float], None]:
        """``_check_signals``, and under a single-objective budget the running loss reported to the pruner."""
        def report(step: int, loss: float) -> None:
            self._check_signals(step, loss)
            if not self.context.budget.single_objective:
                return
            trial.report(loss, step)
            if trial.should_prune():
                trial.set_user_attr("reason", f"pruned at step {step} (running loss {loss:.3g})")
                raise optuna.TrialPruned(f"pruned at step {step}")

        return report

    def _claim(self, trial: optuna.Trial, key: str) -> FrozenTrial | None:
        """Decide, under the study's lock, whether this trial trains the assignment ``key``.

        A finished trial with the key is returned for reuse. A live trial already training it is waited
        for, then the decision is taken again (it may have finished, or failed by heartbeat: then this
        trial trains). Otherwise this trial marks itself as the one training the key (``trains`` holds its
        own number, so the marker a retried copy inherits from a dead trial claims nothing). Every worker
        on every host takes the same lock, so no two trials ever train the same assignment.
        """
        study = trial.study
        while True:
            with self.location.lock(self.storage):
                others = [t for t in study.get_trials(deepcopy=False, states=(*FINISHED, TrialState.RUNNING))
                          if t.number != trial.number and t.user_attrs.get("key") == key]
                finished = [t for t in others if t.state in FINISHED]
                if finished:
                    return finished[0]
                owner = next((t for t in others if t.user_attrs.get("trains") == t.number), None)
                if owner is None:
                    trial.set_user_attr("trains", trial.number)
                    return None
            log.info("trial %d waits for trial %d, which trains the same assignment", trial.number, owner.number)
            _wait_while_running(study, owner.number)

    def _reuse(self, trial: optuna.Trial, previous: FrozenTrial) -> Any:
        """Copy a finished trial's results for the same assignment instead of training again."""
        for name in (*METRICS, "loss_curve", "reason", "policy"):
            if name in previous.user_attrs:
                trial.set_user_attr(name, previous.user_attrs[name])
        trial.set_user_attr("duplicate_of", previous.number)
        if previous.state == TrialState.PRUNED:
            raise optuna.TrialPruned(f"same assignment as pruned trial {previous.number}")
        _set_constraints(trial, previous.constraints)
        return previous.values

    def _untrained(self, trial: optuna.Trial, memory: float, reason: str) -> Any:
        """A completed, infeasible trial that was priced but not worth training."""
        context = self.context
        trial.set_user_attr("trained", False)
        trial.set_user_attr("reason", reason)
        trial.set_user_attr("memory", memory)
        _set_constraints(trial, context.constraints(None, memory, None))
        return [1e6 if context.space.accuracy_objective == "val_loss" else 1.0]


def _wait_while_running(study: optuna.Study, number: int) -> None:
    """Poll until trial ``number`` leaves RUNNING; meanwhile fail trials whose worker stopped heartbeating
    (Optuna does so only when a trial starts, and every live worker may be waiting here)."""
    while any(t.number == number for t in study.get_trials(deepcopy=False, states=(TrialState.RUNNING,))):
        time.sleep(0.5)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
            optuna.storages.fail_stale_trials(study)


def _reference_accuracy(study: optuna.Study) -> float | None:
    result = study.user_attrs.get("reference_result")
    return None if result is None else float(result["val_accuracy"])


def _best_feasible_memory(study: optuna.Study) -> float | None:
    feasible = [t.values[0] for t in study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,))
                if _feasible(t)]
    return min(feasible) if feasible else None


# ------------------------------------------------------------------------------------------------ storage


@dataclass(frozen=True)
class StudyLocation:
    """Where a study lives: a storage (URL or journal file path), the study's name in it, and the heartbeat.

    A ``shared`` study (``--study-name``) is joined by name from any number of processes on any number of
    hosts: the first creates and seeds it, the others load it (``_join_study``), and only Optuna's heartbeat
    decides that a RUNNING trial is dead. On an RDB storage every trial records a heartbeat each
    ``heartbeat`` seconds; a trial silent for ``3 x heartbeat`` seconds is failed and its assignment queued
    again (``RetryHeartbeatStaleTrialCallback``), by whichever worker notices first.
    """

    target: str
    study_name: str = STUDY_NAME
    heartbeat: int = DEFAULT_HEARTBEAT
    shared: bool = False

    @classmethod
    def of(cls, storage: str | None, out_dir: Path, study_name: str | None = None,
           heartbeat: int = DEFAULT_HEARTBEAT) -> StudyLocation:
        """``storage`` as given on the command line (None: the journal file in ``out_dir``)."""
        if heartbeat < 1:
            raise PrecsearchError(f"heartbeat={heartbeat} must be a whole number of seconds >= 1")
        if study_name is not None and not study_name.strip():
            raise PrecsearchError("--study-name must not be empty")
        return cls(storage or str(out_dir / JOURNAL_NAME), study_name or STUDY_NAME, heartbeat, study_name is not None)

    @property
    def shown(self) -> str:
        """The target with its password masked, for messages and run.json."""
        if "://" not in self.target:
            return self.target
        with contextlib.suppress(Exception):
            return make_url(self.target).render_as_string(hide_password=True)
        return self.target

    def open(self) -> optuna.storages.BaseStorage:
        """The Optuna storage; one that cannot be opened or reached is a one-line PrecsearchError."""
        try:
            if "://" in self.target:
                return self._open_rdb()
            path = Path(self.target)
            if not path.parent.is_dir():
                raise FileNotFoundError(f"folder {path.parent} does not exist")
            _repair_journal(path)
            return JournalStorage(JournalFileBackend(str(path)))
        except PrecsearchError:
            raise
        except Exception as error:  # drivers raise anything from ArgumentError to OperationalError
            text = str(error).strip()
            reason = text.splitlines()[0] if text else type(error).__name__
            raise PrecsearchError(f"cannot open study storage {self.shown}: {reason}; check the URL or path "
                                  "(leave --storage out to use a journal file in --out)") from None

    def _open_rdb(self) -> RDBStorage:
        """A plain ``postgresql://`` URL uses psycopg 3 (SQLAlchemy's default PostgreSQL driver is psycopg2)."""
        url = make_url(self.target)
        backend = url.get_backend_name()
        if url.drivername == "postgresql":
            url = url.set(drivername=POSTGRES_DRIVER)
        if backend not in ("postgresql", "sqlite"):
            raise PrecsearchError(f"study storage {self.shown}: precsearch shares studies through PostgreSQL "
                                  f"(postgresql://...), SQLite (sqlite:///FILE) or a journal file, not {backend}")
        engine_kwargs: dict[str, Any] = {"pool_pre_ping": True}
        if backend == "postgresql":
            if importlib.util.find_spec("psycopg") is None:
                raise PrecsearchError(f"study storage {self.shown} needs psycopg 3; install it with "
                                      "pip install 'precsearch[postgres]'")
            engine_kwargs["connect_args"] = {"connect_timeout": 10}
        def create() -> RDBStorage:
            with warnings.catch_warnings():  # Optuna marks the heartbeat and its retry callback experimental
                warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
                return RDBStorage(url.render_as_string(hide_password=False), engine_kwargs=engine_kwargs,
                                  heartbeat_interval=self.heartbeat, grace_period=3 * self.heartbeat,
                                  heartbeat_stale_trial_callback=RetryHeartbeatStaleTrialCallback(MAX_RETRIES))

        attempts = 3
        while True:
            try:
                return create()
            except (sqlalchemy.exc.IntegrityError, sqlalchemy.exc.ProgrammingError, sqlalchemy.exc.OperationalError
                    ) as error:
                attempts -= 1  # workers creating Optuna's tables at once collide ("already exists"); retry
                if attempts == 0 or (isinstance(error, sqlalchemy.exc.OperationalError)
                                     and "already exists" not in str(error)):
                    raise
                time.sleep(0.5)

    @contextlib.contextmanager
    def lock(self, storage: optuna.storages.BaseStorage) -> Iterator[None]:
        """Exclusive among all processes using this study: on PostgreSQL an advisory lock held for one
        transaction (the server releases it when a killed worker's connection drops), on SQLite and journal
        files an flock on the file (they are shared on one host only)."""
        if isinstance(storage, RDBStorage) and storage.engine.dialect.name == "postgresql":
            lock_id = int(hashlib.sha1(self.study_name.encode()).hexdigest()[:15], 16)
            with storage.engine.begin() as connection:
                connection.execute(sqlalchemy.text("SELECT pg_advisory_xact_lock(:id)"), {"id": lock_id})
                yield
            return
        path = make_url(self.target).database if "://" in self.target else self.target
        with open(path, "rb") as handle:
            fcntl.flock(handle, fcntl.LOCK_EX)
            yield


def _repair_journal(path: Path) -> None:
    """Drop a torn last line (a write cut by kill -9) so appends after it stay readable."""
    if not path.is_file() or path.stat().st_size == 0:
        return
    with path.open("rb+") as journal:
        journal.seek(-1, os.SEEK_END)
        if journal.read(1) == b"\n":
            return
        journal.seek(0)
        data = journal.read()
        keep = data.rfind(b"\n") + 1
        journal.truncate(keep)
        log.warning("journal %s ended in a partial record (interrupted write); dropped %d bytes",
                    path, len(data) - keep)


def _sampler(context: SearchContext, worker: int | None) -> optuna.samplers.BaseSampler:
    """The space's sampler seeded from the search seed and the worker's index; unseeded (None) in a shared
    study, whose workers on several hosts would otherwise propose the same first assignments."""
    return make_sampler(context.space.sampler, None if worker is None else context.seed * 1000 + worker)


def _pruner(context: SearchContext) -> optuna.pruners.BasePruner:
    if not context.budget.single_objective:
        return optuna.pruners.NopPruner()
    steps = context.space.proxy.steps
    return optuna.pruners.PercentilePruner(75.0, n_startup_trials=5, n_warmup_steps=steps // 4)


def _load_study(context: SearchContext, storage: optuna.storages.BaseStorage, location: StudyLocation,
                worker: int) -> optuna.Study:
    return optuna.load_study(study_name=location.study_name, storage=storage,
                             sampler=_sampler(context, None if location.shared else worker), pruner=_pruner(context))


def _new_study(context: SearchContext, storage: optuna.storages.BaseStorage, location: StudyLocation) -> optuna.Study:
    """Create the study; raises DuplicatedStudyError when the name is taken (a unique insert in RDB storages)."""
    directions = ["minimize"] if context.budget.single_objective else ["minimize", "minimize"]
    return optuna.create_study(storage=storage, study_name=location.study_name, directions=directions,
                               sampler=_sampler(context, None if location.shared else 0), pruner=_pruner(context))


def _check_same_config(study: optuna.Study, context: SearchContext, location: StudyLocation, fix: str) -> None:
    theirs, ours = study.user_attrs.get("config") or {}, _config(context)
    differ = [key for key in ours if theirs.get(key) != ours[key]]
    if differ:
        raise PrecsearchError(
            f"study {location.study_name} in {location.shown} was made with a different {', '.join(differ)} (it "
            f"searches {theirs.get('model')}, graph {theirs.get('graph_fingerprint')}, space "
            f"{(theirs.get('space') or {}).get('name')}); {fix}")


def _join_study(context: SearchContext, storage: optuna.storages.BaseStorage, location: StudyLocation) -> optuna.Study:
    """Create and seed a shared study, or join it once its creator has seeded it.

    The database decides who creates it: study names are unique, so of any number of workers starting at
    once exactly one ``create_study`` succeeds. That one records the config, trains the all-high reference
    (when the budget needs it), queues the seeds, then sets ``seeded``. Every other worker waits for
    ``seeded`` and refuses a study made for another model, graph, space, data, seed or budget.
    """
    try:
        study = _new_study(context, storage, location)
    except optuna.exceptions.DuplicatedStudyError:
        study = _load_study(context, storage, location, 0)
        _wait_for_attr(study, "config", CONFIG_WAIT, location, "is not a precsearch study")
        _check_same_config(study, context, location,
                           "join it with the same model and settings, or choose another --study-name")
        _wait_for_attr(study, "seeded", SEED_WAIT, location, "was never seeded (its creator stopped while "
                       "setting it up)")
        return study
    study.set_user_attr("config", _config(context))
    _ensure_reference(study, context)
    _seed_study(study, context)
    study.set_user_attr("seeded", True)
    return study


def _wait_for_attr(study: optuna.Study, name: str, timeout: float, location: StudyLocation, problem: str) -> None:
    deadline = time.monotonic() + timeout
    while name not in study.user_attrs:
        if time.monotonic() > deadline:
            raise PrecsearchError(f"study {location.study_name} in {location.shown} {problem}; delete it (optuna "
                                  "delete-study) or choose another --study-name")
        time.sleep(0.5)


def _config(context: SearchContext) -> dict[str, Any]:
    """What must match for a resumed study to mean the same thing."""
    return {
        "model": context.model,
        "space": context.space.to_dict(),
        "data": dataclasses.asdict(context.data_spec),
        "seed": context.seed,
        "budget": dataclasses.asdict(context.budget),
        "graph_fingerprint": context.graph.fingerprint(),
        "proxy_seeds": context.proxy_seeds,
    }


# -------------------------------------------------------------------------------------------- trial upkeep


def _counted(trial: FrozenTrial) -> bool:
    """A trial that used up budget: finished, or failed by its own error (not by an interruption or a dead
    worker's missing heartbeat: those are queued again)."""
    if trial.state in FINISHED:
        return True
    return trial.state == TrialState.FAIL and "error" in trial.user_attrs


def _done(study: optuna.Study) -> int:
    return sum(_counted(t) for t in study.get_trials(deepcopy=False))


def _requeue_interrupted(study: optuna.Study, storage: optuna.storages.BaseStorage, context: SearchContext) -> int:
    """Fail trials a dead process left RUNNING, and queue again every interrupted assignment not done yet.

    Called only when resuming, before any worker starts, so every RUNNING trial belongs to a dead process.
    """
    study_id = storage.get_study_id_from_name(study.study_name)
    for trial in study.get_trials(deepcopy=False, states=(TrialState.RUNNING,)):
        trial_id = storage.get_trial_id_from_study_id_trial_number(study_id, trial.number)
        storage.set_trial_user_attr(trial_id, "interrupted", True)
        storage.set_trial_state_values(trial_id, TrialState.FAIL)
    trials = study.get_trials(deepcopy=False)
    pending = {context.key(_params_of(t)) for t in trials
               if t.state in (*FINISHED, TrialState.WAITING) and len(_params_of(t)) == len(context.units)}
    queued = 0
    for trial in trials:
        params = _params_of(trial)
        if trial.state != TrialState.FAIL or not trial.user_attrs.get("interrupted"):
            continue
        if len(params) != len(context.units) or context.key(params) in pending:
            continue
        pending.add(context.key(params))
        origin = trial.user_attrs.get("origin", [f"requeued trial {trial.number}"])
        study.enqueue_trial(params, user_attrs={"origin": origin})
        queued += 1
    return queued


def _params_of(trial: FrozenTrial) -> dict[str, Any]:
    return dict(trial.system_attrs.get("fixed_params") or trial.params)


def _seed_study(study: optuna.Study, context: SearchContext) -> None:
    for candidate, origins in seed_candidates(context.graph, context.space):
        study.enqueue_trial(candidate.decisions, user_attrs={"origin": origins})


def _ensure_reference(study: optuna.Study, context: SearchContext) -> None:
    """Train the all-high proxy first, with the seeds every trial will use, so that every trial can test an
    accuracy-drop constraint against it and the seed noise is measured before the first trial. Needed for an
    accuracy-drop budget and for several seeds per proxy; with ``proxy_seeds=None`` the reference trains
    ``AUTO_REFERENCE_SEEDS`` seeds and the seeds per proxy are chosen from the noise they show
    (``noise.seeds_for``). The seed count is a study attribute, so every worker trains the same seeds."""
    if "reference_result" in study.user_attrs:
        return
    requested = context.proxy_seeds
    if context.budget.max_accuracy_drop is None and requested == 1:
        study.set_user_attr("proxy_seeds", 1)
        return
    candidate = uniform(context.graph, context.space, "high")
    policy = context.policy(candidate.assignment, {"strategy": "all-high reference"})
    result, accuracies = context.train_seeds(policy, requested or AUTO_REFERENCE_SEEDS)
    seeds = requested
    if seeds is None:
        noise = pooled_noise(pd.DataFrame(), context.budget.confidence, extra=[accuracies])
        seeds = seeds_for(noise, context.budget.drop, len(accuracies), min_seeds=AUTO_MIN_SEEDS)
        log.info("%s; %d seed(s) per proxy", noise.describe(), seeds)
    study.set_user_attr("proxy_seeds", seeds)
    study.set_user_attr("reference_key", candidate.key)
    study.set_user_attr("reference_accuracies", accuracies)
    study.set_user_attr("reference_result", result.to_dict())


def _study_noise(study: optuna.Study, context: SearchContext, frame: pd.DataFrame | None = None) -> Noise:
    """The pooled seed noise of the study's trained trials and the all-high reference (counted once)."""
    frame = trials_frame(study, context) if frame is None else frame
    reference = study.user_attrs.get("reference_accuracies", [])
    counted = not frame.empty and study.user_attrs.get("reference_key") in set(frame["key"])
    return pooled_noise(frame, context.budget.confidence, extra=[] if counted else [reference])


# ------------------------------------------------------------------------------------------------ outputs


def _trial_row(trial: FrozenTrial, context: SearchContext) -> dict[str, Any]:
    attrs = trial.user_attrs
    params = _params_of(trial)
    accuracy = attrs.get("val_accuracy")
    row = {
        "number": trial.number,
        "state": trial.state.name,
        "origin": "; ".join(attrs.get("origin", [])) or "sampler",
        "memory": attrs.get("memory", math.nan),
        "memory_bytes": attrs.get("memory_bytes", math.nan),
        "memory_peak": attrs.get("memory_peak", math.nan),
        "memory_planned": attrs.get("memory_planned", math.nan),
        "bytes": attrs.get("bytes", math.nan),
        "low_share": attrs.get("low_share", math.nan),
        "val_accuracy": math.nan if accuracy is None else accuracy,
        "val_error": math.nan if accuracy is None else 1.0 - accuracy,
        "val_loss": attrs.get("val_loss", math.nan),
        "val_accuracy_sd": attrs.get("val_accuracy_sd", math.nan),
        "seeds": attrs.get("seeds", 1 if accuracy is not None else math.nan),
        "trained": bool(attrs.get("trained", False)),
        "diverged": bool(attrs.get("diverged", False)),
        "feasible": _feasible(trial),
        "reason": attrs.get("reason", ""),
        "promotions": len(attrs.get("promotions", [])),
        "skipped_steps": attrs.get("skipped_steps", math.nan),
        "steps_run": attrs.get("steps_run", math.nan),
        "wall_time": attrs.get("wall_time", math.nan),
        "duplicate_of": attrs.get("duplicate_of", ""),
        "retry_of": trial.system_attrs.get("failed_trial", ""),
        "worker": attrs.get("worker", ""),
        "policy": attrs.get("policy", ""),
        "error": attrs.get("error", ""),
        "interrupted": bool(attrs.get("interrupted", False)),
        "key": attrs.get("key", context.key(params) if len(params) == len(context.units) else ""),
        "decisions": "".join(_level_code(params.get(unit, "high"), context) for unit in context.units),
    }
    return row


def _level_code(level: str, context: SearchContext) -> str:
    """One character per unit for the decisions column: H, L, or the choice's index among the levels."""
    if level == "high":
        return "H"
    if level == "low":
        return "L"
    return str(context.levels.index(level)) if level in context.levels else "?"


def trials_frame(study: optuna.Study, context: SearchContext) -> pd.DataFrame:
    """One row per started trial (queued ones are not trials yet) with origin, memory, proxy metrics, state."""
    rows = [_trial_row(t, context) for t in study.get_trials(deepcopy=False) if t.state != TrialState.WAITING]
    return pd.DataFrame(rows)


def pareto_front(frame: pd.DataFrame, objective: str = "val_error") -> pd.DataFrame:
    """Non-dominated trained, non-diverged trials in (memory, objective), one per assignment, by memory."""
    if frame.empty:
        return frame
    ok = frame[(frame["state"] == "COMPLETE") & frame["trained"] & ~frame["diverged"]]
    ok = ok.sort_values(["memory", objective, "number"]).drop_duplicates("key")
    front, best = [], math.inf
    for index, row in ok.iterrows():
        if row[objective] < best:
            front.append(index)
            best = row[objective]
    return ok.loc[front]


def _reference(frame: pd.DataFrame, context: SearchContext, study: optuna.Study) -> float | None:
    """The all-high proxy accuracy, from the reference run or the all-high trial; None when that proxy
    did not train (not run yet, or diverged): accuracy drops are then measured from nothing."""
    result = study.user_attrs.get("reference_result")
    if result is not None:
        return None if result.get("diverged") else float(result["val_accuracy"])
    key = uniform(context.graph, context.space, "high").key
    rows = frame[(frame["key"] == key) & frame["trained"]] if not frame.empty else frame
    if rows.empty or bool(rows["diverged"].iloc[0]):
        return None
    return float(rows["val_accuracy"].iloc[0])


def pick_note(frame: pd.DataFrame, context: SearchContext, study: optuna.Study) -> str:
    """Why ``choose_best`` picked nothing, in one line ('' when it picked or nothing explains it)."""
    chance = context.chance
    if context.budget.max_memory is None:
        reference = _reference(frame, context, study)
        if reference is None:
            return ("the all-high proxy diverged or did not train, so no accuracy drop can be measured: no pick; "
                    "lower the learning rate or lengthen the proxies")
        if reference <= chance:
            return (f"the all-high proxy reached accuracy {reference:.3f}, no better than chance ({chance:.3f}): no "
                    "pick; lengthen the proxies (--proxy-steps) or check the data")
    return f"no trained, non-diverged trial within the budget beats chance accuracy ({chance:.3f}): no pick"


def choose_best(frame: pd.DataFrame, budget: Budget, reference: float | None, noise: Noise | None = None,
                reference_seeds: int = 1, reference_key: str | None = None, chance: float = 0.0
                ) -> pd.Series | None:
    """The point the budget picks among trained, non-diverged trials above ``chance`` accuracy (None when none
    qualifies, or when the all-high ``reference`` is None or itself at chance level), never on a difference of
    proxy means smaller than the seed ``noise`` allows at the budget's confidence.

    ``max_memory``: within the memory bound, the least memory among the trials whose accuracy is not
    distinguishably below the best mean (``_least_memory_among_ties``). Otherwise least memory among the
    trials whose accuracy is within the allowed drop (default 1 point) of the ``reference_seeds``-seed
    all-high mean ``reference`` with the budget's confidence (``_confidently_within_drop``), then best
    accuracy; the all-high assignment itself (``reference_key``) always qualifies, so too much noise picks
    all-high rather than nothing. The row gets ``pick_confidence``: the confidence that its true accuracy is
    within the drop (accuracy-drop rule) or no worse than the best mean (memory rule); NaN when the noise is
    unmeasured or the pick is the reference itself.
    """
    if frame.empty:
        return None
    noise = noise or Noise(math.nan, 0, budget.confidence)
    ok = frame[(frame["state"] == "COMPLETE") & frame["trained"] & ~frame["diverged"]
               & (frame["val_accuracy"] > chance)]
    if budget.max_memory is not None:
        return _least_memory_among_ties(ok[ok["memory"] <= budget.max_memory + 1e-12], noise)
    if reference is None or reference <= chance:
        return None
    return _confidently_within_drop(ok, reference, reference_seeds, budget.drop, noise, reference_key)


def _seeds_of(frame: pd.DataFrame) -> pd.Series:
    return frame["seeds"].fillna(1) if "seeds" in frame else pd.Series(1, index=frame.index)


def _least_memory_among_ties(ok: pd.DataFrame, noise: Noise) -> pd.Series | None:
    """Least memory (then best accuracy) among trials not distinguishably less accurate than the best mean."""
    if ok.empty:
        return None
    seeds = _seeds_of(ok)
    top = ok["val_accuracy"].idxmax()
    gap = ok.loc[top, "val_accuracy"] - ok["val_accuracy"]
    ties = ok[gap <= noise.margin(seeds, seeds[top]) + 1e-12]
    best = ties.sort_values(["memory", "val_accuracy", "number"], ascending=[True, False, True]).iloc[0].copy()
    best["pick_confidence"] = (math.nan if best.name == top else
                               1 - noise.probability_above(gap[best.name], 0.0, seeds[best.name], seeds[top]))
    return best


def _confidently_within_drop(ok: pd.DataFrame, reference: float, reference_seeds: int, drop: float,
                             noise: Noise, reference_key: str | None) -> pd.Series | None:
    """Least memory (then best accuracy) among trials whose one-sided bound on (mean - reference) is at
    least ``-drop``, and the reference assignment itself."""
    seeds = _seeds_of(ok)
    itself = ok["key"] == reference_key
    ok = ok[itself | (ok["val_accuracy"] - noise.margin(seeds, reference_seeds) >= reference - drop - 1e-12)]
    if ok.empty:
        return None
    best = ok.sort_values(["memory", "val_accuracy", "number"], ascending=[True, False, True]).iloc[0].copy()
    best["pick_confidence"] = (math.nan if best["key"] == reference_key else noise.probability_above(
        best["val_accuracy"] - reference, -drop, _seeds_of(ok)[best.name], reference_seeds))
    return best


def mark_ties(front: pd.DataFrame, noise: Noise) -> pd.DataFrame:
    """The front with ``within_noise_of``: for each point, the cheapest front point (trial number) it is not
    distinguishably more accurate than at the noise's confidence, or -1 when it is distinguishable from every
    cheaper point (the extra memory buys measurable accuracy)."""
    front = front.sort_values("memory").copy()
    seeds = _seeds_of(front)
    marks = []
    for position, (index, row) in enumerate(front.iterrows()):
        cheaper = front.iloc[:position]
        gain = row["val_accuracy"] - cheaper["val_accuracy"]
        tied = cheaper[gain <= noise.margin(seeds[index], seeds[cheaper.index]) + 1e-12]
        marks.append(int(tied["number"].iloc[0]) if not tied.empty else -1)
    front["within_noise_of"] = marks
    return front


def _policy_for_row(row: pd.Series, study: optuna.Study, context: SearchContext, role: str) -> Policy:
    trial = study.get_trials(deepcopy=False)[int(row["number"])]
    assignment = assign(context.graph, context.space, context.decisions(_params_of(trial)))
    provenance = {
        "strategy": str(row["origin"]), "role": role, "trial": int(row["number"]), "space": context.space.name,
        "space_fingerprint": context.space.fingerprint(), "seed": context.seed,
        "proxy_steps": context.space.proxy.steps, "data": context.data_spec.name,
        "proxy": {"val_accuracy": float(row["val_accuracy"]), "val_loss": float(row["val_loss"]),
                  "memory": float(row["memory"]), "promotions": int(row["promotions"])},
    }
    return context.policy(assignment, provenance)


def export(study: optuna.Study, context: SearchContext, out_dir: Path) -> tuple[pd.DataFrame, pd.DataFrame,
                                                                                   pd.Series | None]:
    """Rewrite trials.csv, pareto.csv, policies/ and best.json from the storage (each file atomically)."""
    frame = trials_frame(study, context)
    objective = context.space.accuracy_objective
    noise = _study_noise(study, context, frame)
    front = pareto_front(frame, objective)
    if not front.empty:
        front = mark_ties(front, noise)
    atomic_write_text(out_dir / "trials.csv", frame.to_csv(index=False))
    atomic_write_text(out_dir / "pareto.csv", front.to_csv(index=False))
    policies = out_dir / "policies"
    policies.mkdir(exist_ok=True)
    wanted = set()
    for _, row in front.iterrows():
        name = f"trial_{int(row['number']):04d}.json"
        wanted.add(name)
        if not (policies / name).is_file():
            _policy_for_row(row, study, context, "pareto").save(policies / name)
    for stale in policies.glob("trial_*.json"):
        if stale.name not in wanted:
            stale.unlink()
    best = choose_best(frame, context.budget, _reference(frame, context, study), noise,
                       len(study.user_attrs.get("reference_accuracies", [0])),
                       uniform(context.graph, context.space, "high").key, context.chance)
    if best is not None:
        policy = _policy_for_row(best, study, context, f"best: {context.budget.describe()}")
        pick = {**noise.to_dict(), "seeds": int(best.get("seeds", 1)),
                "pick_confidence": float(best["pick_confidence"]), "statement": _pick_statement(best, noise)}
        pick = {name: None if isinstance(value, float) and math.isnan(value) else value  # JSON has no NaN
                for name, value in pick.items()}
        policy.replace(provenance={**policy.provenance, "noise": pick}).save(out_dir / "best.json")
    else:  # a pick of an earlier export that no longer holds must not stay behind
        (out_dir / "best.json").unlink(missing_ok=True)
    return frame, front, best


def _pick_statement(best: pd.Series, noise: Noise) -> str:
    """One sentence on how sure the pick is."""
    if not noise.measured:
        return noise.describe()
    confidence = best["pick_confidence"]
    sure = "no bound needed (it is all-high or the best mean)" if math.isnan(confidence) else \
        f"{100 * confidence:.0f}% confidence"
    return f"{noise.describe()}; trial {int(best['number'])} picked with {sure}"


def export_study(storage: str, out_dir: str | Path, study_name: str = STUDY_NAME) -> SearchResult:
    """Rebuild a run directory (run.json, trials.csv, pareto.csv, policies/, best.json) from a study in
    ``storage``, e.g. a shared study that workers on several hosts filled. The model is traced again from
    the study's config; a graph that no longer matches its fingerprint is an error."""
    start = time.perf_counter()
    out_dir = Path(out_dir)
    location = StudyLocation.of(storage, out_dir, study_name)
    backend = location.open()
    try:
        study = optuna.load_study(study_name=location.study_name, storage=backend)
    except KeyError:
        raise PrecsearchError(f"no study {location.study_name} in {location.shown}; list them with optuna "
                              "studies --storage URL") from None
    config = study.user_attrs.get("config")
    if config is None:
        raise PrecsearchError(f"study {location.study_name} in {location.shown} is not a precsearch study")
    context = SearchContext.create(config["model"], parse_space(config["space"]), DataSpec(**config["data"]),
                                   Budget(**config["budget"]), config["seed"], "cpu")
    if context.graph.fingerprint() != config["graph_fingerprint"]:
        raise PrecsearchError(f"model {config['model']} now traces to graph {context.graph.fingerprint()}, not the "
                              f"study's {config['graph_fingerprint']}; rebuild with the code that ran the study")
    out_dir.mkdir(parents=True, exist_ok=True)
    atomic_write_text(out_dir / RUN_FILE, json.dumps(
        {**config, "storage": location.shown, "study": location.study_name}, indent=2))
    frame, front, best = export(study, context, out_dir)
    return SearchResult(out_dir, frame, front, best, time.perf_counter() - start)


# ------------------------------------------------------------------------------------------------ running


@contextlib.contextmanager
def _quiet() -> Iterator[None]:
    """Optuna's per-trial INFO lines would tear the progress bar; trials are recorded in the trials table."""
    verbosity = optuna.logging.get_verbosity()
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    try:
        yield
    finally:
        optuna.logging.set_verbosity(verbosity)


@contextlib.contextmanager
def _threads(count: int | None) -> Iterator[None]:
    """torch's intra-op threads for the duration (None: leave as is). Small proxies run best on one."""
    before = torch.get_num_threads()
    if count is not None:
        torch.set_num_threads(count)
    try:
        yield
    finally:
        torch.set_num_threads(before)


@dataclass
class SearchResult:
    """What a search left in its run directory, as tables."""

    out_dir: Path
    trials: pd.DataFrame
    pareto: pd.DataFrame
    best: pd.Series | None
    wall_time: float
    interrupted: bool = False
    noise: Noise | None = None  # the pooled seed noise the pick was taken with
    note: str = ""  # why best is None, when it is


class _Progress:
    """A tqdm bar of counted trials with the budget's best-so-far in its postfix."""

    def __init__(self, total: int, done: int, enabled: bool) -> None:
        self.bar = tqdm(total=total, initial=min(done, total), desc="search", unit="trial", disable=not enabled,
                        dynamic_ncols=True)
        self.done = done

    def update(self, done: int, front: pd.DataFrame, best: pd.Series | None) -> None:
        if done > self.done:
            self.bar.update(min(done, self.bar.total) - min(self.done, self.bar.total))
            self.done = done
        postfix = {"front": len(front)}
        if best is not None:
            postfix["best"] = f"mem {best['memory']:.3f} acc {best['val_accuracy']:.3f}"
        self.bar.set_postfix(postfix, refresh=True)

    def close(self) -> None:
        self.bar.close()


def _budget_callback(trials: int, count_running: bool) -> Callable[[optuna.Study, FrozenTrial], None]:
    """Stop once ``trials`` trials counted and no retry of a dead worker's trial is still queued. With
    ``count_running`` (the workers of one run, all alive) the trials other workers are running count too,
    so that N workers do not start N - 1 trials past the budget; a shared study may hold RUNNING trials of
    dead hosts until their heartbeat times out, so there they do not count."""

    def stop(study: optuna.Study, trial: FrozenTrial) -> None:
        queued = study.get_trials(deepcopy=False, states=(TrialState.WAITING,))
        running = study.get_trials(deepcopy=False, states=(TrialState.RUNNING,)) if count_running else []
        if _done(study) + len(running) >= trials and not any("failed_trial" in t.system_attrs for t in queued):
            study.stop()

    return stop


def _stop_on_signal(signals: StopSignals) -> Callable[[optuna.Study, FrozenTrial], None]:
    """Stop before the next trial when a signal was recorded but not raised (it came inside Optuna's code)."""

    def stop(study: optuna.Study, trial: FrozenTrial) -> None:
        if signals.received is not None:
            study.stop()

    return stop


def _parent_watch(parent: int) -> Callable[[optuna.Study, FrozenTrial], None]:
    def watch(study: optuna.Study, trial: FrozenTrial) -> None:
        if os.getppid() != parent:
            study.stop()

    return watch


@dataclass(frozen=True)
class _WorkerSetup:
    """What a worker process rebuilds its context from (``SearchContext.create``'s model, space, data spec,
    budget and seed; the device is the worker's own) and where it runs."""

    context: tuple[str, SearchSpace, DataSpec, Budget, int]
    device: str
    location: StudyLocation
    out_dir: Path
    trials: int
    threads: int


def _worker(setup: _WorkerSetup, index: int, gpu: str | None, parent: int) -> None:
    """One ``--jobs`` worker process: its own context and sampler on the study; ``gpu`` (an entry of the
    parent's CUDA_VISIBLE_DEVICES) becomes the only GPU it sees."""
    device = setup.device
    if gpu is not None:  # before anything initializes CUDA in this process
        os.environ["CUDA_VISIBLE_DEVICES"] = gpu
        device = "cuda"
    torch.set_num_threads(setup.threads)
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    hold_worker_lock(setup.out_dir)
    _stop_when_orphaned(parent)
    # the parent reports the interruption
    with StopSignals() as signals, quiet_optuna_interrupts(), contextlib.suppress(KeyboardInterrupt):
        context = SearchContext.create(*setup.context, device)
        storage = setup.location.open()
        study = _load_study(context, storage, setup.location, index)
        study.optimize(Objective(context, setup.location, storage, setup.out_dir, signals), n_trials=setup.trials,
                       catch=(Exception,), callbacks=[_budget_callback(setup.trials, not setup.location.shared),
                                                      _parent_watch(parent), _stop_on_signal(signals)])


def _stop_when_orphaned(parent: int) -> None:
    """A worker whose parent died (kill -9) SIGTERMs itself, so its running trial is marked interrupted
    at once instead of training on with nobody to export its results."""
    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(0.5)
        os.kill(os.getpid(), signal.SIGTERM)

    threading.Thread(target=watch, name="parent-watch", daemon=True).start()


def worker_gpus(jobs: int, cuda: bool) -> list[str | None]:
    """The GPU each of ``jobs`` workers sees: the visible GPUs (CUDA_VISIBLE_DEVICES, else every device)
    one per worker, in turn when there are more workers than GPUs; None for every worker on the CPU."""
    if not cuda:
        return [None] * jobs
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    gpus = ([entry.strip() for entry in visible.split(",") if entry.strip()] if visible is not None
            else [str(index) for index in range(torch.cuda.device_count())])
    if not gpus:
        raise PrecsearchError("CUDA_VISIBLE_DEVICES hides every GPU; unset it or use --device cpu")
    if jobs > len(gpus):
        log.warning("%d workers share %d GPU(s); --jobs %d gives each its own", jobs, len(gpus), len(gpus))
    return [gpus[index % len(gpus)] for index in range(jobs)]


def _check_resume(out_dir: Path, resume: bool, config: dict[str, Any], shared: bool) -> None:
    """Rules for --out: a new search needs it empty; --resume needs the same search in it; a worker of a
    shared study may come back to its own --out (same study, same settings) without --resume."""
    run_file = out_dir / RUN_FILE
    if (resume and not shared) or (shared and run_file.is_file()):
        if not run_file.is_file():
            raise PrecsearchError(f"nothing to resume in {out_dir} (no {RUN_FILE}); drop --resume to start a search")
        try:
            previous = json.loads(run_file.read_text(encoding="utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError):
            raise PrecsearchError(f"{run_file} is corrupted; rebuild it from the study with export_study, or "
                                  "choose another --out") from None
        differ = [key for key in config if previous.get(key) != config[key]]
        if differ:
            raise PrecsearchError(f"{out_dir} holds a search with different {', '.join(differ)}; resume it with "
                                  "the same model, space, data, seed, budget and study, or choose another --out")
    elif out_dir.exists() and any(path.name not in LOCK_FILES for path in out_dir.iterdir()):
        raise PrecsearchError(f"{out_dir} is not empty; pass --resume to continue the search in it, or choose "
                              "another --out")


def run_search(
    model_spec: str,
    space: SearchSpace | str | Path,
    data: DataSpec | str = "digits",
    trials: int = 40,
    proxy_steps: int | None = None,
    out_dir: str | Path = "runs/search",
    storage: str | None = None,
    jobs: int = 1,
    resume: bool = False,
    budget: Budget | None = None,
    seed: int = 0,
    device: str = "auto",
    *,
    batch_size: int | None = None,
    image_size: int | None = None,
    threads: int | None = None,
    progress: bool = True,
    study_name: str | None = None,
    heartbeat: int = DEFAULT_HEARTBEAT,
    proxy_seeds: int | None = 1,
    sampler: str | None = None,
) -> SearchResult:
    """Search assignments of ``model_spec`` in ``space``; outputs go to ``out_dir`` (see the module docstring).

    Everything a user can get wrong (model, data, space, storage, budget) is checked before ``out_dir`` is
    created, so a bad call leaves nothing behind. Ctrl-C stops after the running trial is marked
    interrupted; completed trials are kept and written out, and ``resume=True`` picks up from there.

    With ``study_name`` the process joins the shared study of that name in ``storage`` (a PostgreSQL URL
    for several hosts), creating and seeding it if it is the first; ``trials`` is the study's total.

    ``proxy_seeds`` seeds train each proxy and the all-high reference (None: 3 for the reference, then 2 to
    4, as many as the noise they show needs, see ``noise.seeds_for``); the pick is then taken at the budget's
    confidence. One seed keeps the single-number comparison, with a warning that its confidence is unknown.

    ``sampler`` (one of ``precsearch.config.spec.SAMPLERS``) replaces the space's Optuna sampler (default TPE).
    """
    start = time.perf_counter()
    if isinstance(space, str | Path):
        space = load_space(space)
    space = space.with_proxy(steps=proxy_steps, batch_size=batch_size, image_size=image_size)
    if sampler is not None:  # checked like a space file's key
        space = parse_space({**space.to_dict(), "sampler": sampler}, "--sampler")
    data_spec = DataSpec(data) if isinstance(data, str) else data
    budget = budget or Budget()
    if trials < 1 or jobs < 1 or (threads is not None and threads < 1):
        raise PrecsearchError(f"trials={trials}, jobs={jobs} and threads={threads} must be at least 1")
    gpus = worker_gpus(jobs, resolve_device(device).type == "cuda") if jobs > 1 else [None]
    out_dir = Path(out_dir)
    location = StudyLocation.of(storage, out_dir, study_name, heartbeat)
    with StopSignals() as signals, quiet_optuna_interrupts():
        context = SearchContext.create(model_spec, space, data_spec, budget, seed, device, proxy_seeds=proxy_seeds)
        if proxy_seeds == 1:
            log.warning("one seed per proxy: the pick compares single-seed accuracies and cannot state its "
                        "confidence; use --proxy-seeds auto (or K >= 2)")
        config = {**_config(context), **({"storage": location.shown, "study": location.study_name}
                                         if location.shared else {})}
        backend = location.open() if storage is not None else None  # fail on a bad URL before anything is written
        created = _make_run_dir(out_dir)
        with _quiet(), _threads(threads), _owned(out_dir):
            try:
                _check_resume(out_dir, resume, config, location.shared)
                _check_journal_kept(out_dir, location, resume)
                remove_temporaries(out_dir)
                if location.target == str(out_dir / JOURNAL_NAME):  # this run's own journal
                    remove_stale_journal_lock(Path(location.target))
                backend = backend or location.open()
                study = _create_study(context, location, backend, resume, out_dir)
            except BaseException:
                if created:
                    _remove_new_run_dir(out_dir)
                raise
            atomic_write_text(out_dir / RUN_FILE, json.dumps(
                {**config, "storage": location.shown, "study": location.study_name}, indent=2))
            bar = _Progress(trials, _done(study), progress)
            stopped_by: int | None = None
            try:
                _ensure_reference(study, context)
                if jobs == 1:
                    _optimize_here(study, context, location, backend, trials, out_dir, bar, signals)
                else:
                    created = (context.model, context.space, context.data_spec, context.budget, context.seed)
                    setup = _WorkerSetup(created, context.device, location, out_dir, trials,
                                         threads or max(1, (os.cpu_count() or 1) // jobs))
                    _optimize_workers(study, context, setup, gpus, bar)
            except KeyboardInterrupt as stop:
                stopped_by = getattr(stop, "signum", signal.SIGINT)
            finally:
                with signals.held():  # a second Ctrl-C must not tear the files being written
                    bar.close()
                    frame, front, best = export(study, context, out_dir)
    stopped_by = stopped_by or signals.received  # a signal Python dropped (raised inside a finalizer)
    result = SearchResult(out_dir, frame, front, best, time.perf_counter() - start, stopped_by is not None,
                          noise=_study_noise(study, context, frame),
                          note="" if best is not None else pick_note(frame, context, study))
    if stopped_by is not None:
        raise SearchInterrupted(result, stopped_by)
    return result


def _make_run_dir(out_dir: Path) -> bool:
    """Create ``out_dir`` (and its parents); True when this call created it, so only this call may remove it."""
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    try:
        out_dir.mkdir()
    except FileExistsError:
        if not out_dir.is_dir():
            raise PrecsearchError(f"--out {out_dir} is a file; give a folder") from None
        return False
    return True


@contextlib.contextmanager
def _owned(out_dir: Path) -> Iterator[None]:
    """The run directory's lock for the block. A process refused the lock removes nothing, not even a
    folder it created a moment ago: the owner got in first and writes there."""
    lock = RunLock(out_dir)
    lock.acquire()
    try:
        yield
    finally:
        lock.release()


_RESULTS = ("trials.csv", "pareto.csv", "best.json", RUN_FILE)


def _remove_new_run_dir(out_dir: Path) -> None:
    """Undo the folder this call created for a search that could not start, unless it somehow holds results."""
    kept = [name for name in _RESULTS if (out_dir / name).exists()]
    if kept:
        log.warning("%s holds %s: left in place", out_dir, ", ".join(kept))
        return
    shutil.rmtree(out_dir, ignore_errors=True)


class SearchInterrupted(SearchStop):
    """SIGINT (Ctrl-C) or SIGTERM during a search; ``result`` holds what was saved, ``signum`` the signal."""

    def __init__(self, result: SearchResult, signum: int = signal.SIGINT) -> None:
        super().__init__(signum)
        self.result = result


def _create_study(context: SearchContext, location: StudyLocation, backend: optuna.storages.BaseStorage,
                  resume: bool, out_dir: Path) -> optuna.Study:
    """A shared study is joined (``_join_study``); a study of one run is created, or loaded with --resume
    after failing and queueing again what a killed process left RUNNING. --resume never starts a new study:
    one that is missing (a deleted, emptied or cut journal) would overwrite the results left of the old one."""
    if location.shared:
        return _join_study(context, backend, location)
    names = {summary.study_name for summary in optuna.get_all_study_summaries(backend)}
    taken = PrecsearchError(f"storage {location.shown} already holds a precsearch study; pass --resume, give "
                            "another --storage, or join it with --study-name")
    if location.study_name in names and not resume:
        raise taken
    if location.study_name not in names and resume:
        raise _lost_study(out_dir, location)
    if location.study_name not in names:
        try:
            study = _new_study(context, backend, location)
        except optuna.exceptions.DuplicatedStudyError:
            raise taken from None  # another process created it between the listing and here
        study.set_user_attr("config", _config(context))
        _seed_study(study, context)
        return study
    study = _load_study(context, backend, location, 0)
    _check_same_config(study, context, location, "resume with the same settings or give another --storage")
    queued = _requeue_interrupted(study, backend, context)
    if queued:
        log.info("queued %d interrupted trial(s) again", queued)
    return study


def _lost_study(out_dir: Path, location: StudyLocation) -> PrecsearchError:
    kept = [name for name in _RESULTS if (out_dir / name).exists()]
    return PrecsearchError(f"cannot resume {out_dir}: study {location.study_name} is missing from {location.shown} "
                           f"(deleted, emptied or cut?) while {', '.join(kept)} remain; restore the storage, or "
                           "start a new search in another --out")


def _check_journal_kept(out_dir: Path, location: StudyLocation, resume: bool) -> None:
    """With --resume, a journal file that is gone or empty is refused before opening it (which creates it)."""
    if not resume or location.shared or "://" in location.target:
        return
    journal = Path(location.target)
    if not journal.is_file() or journal.stat().st_size == 0:
        raise _lost_study(out_dir, location)


def _optimize_here(study: optuna.Study, context: SearchContext, location: StudyLocation,
                   backend: optuna.storages.BaseStorage, trials: int, out_dir: Path, bar: _Progress,
                   signals: StopSignals) -> None:
    def after(study: optuna.Study, trial: FrozenTrial) -> None:
        _, front, best = export(study, context, out_dir)
        bar.update(_done(study), front, best)

    remaining = trials - _done(study)
    if remaining <= 0:
        return
    study.optimize(Objective(context, location, backend, out_dir, signals), n_trials=remaining, catch=(Exception,),
                   callbacks=[after, _budget_callback(trials, not location.shared), _stop_on_signal(signals)])


def _optimize_workers(study: optuna.Study, context: SearchContext, setup: _WorkerSetup, gpus: list[str | None],
                      bar: _Progress) -> None:
    if _done(study) >= setup.trials:
        return
    spawn = multiprocessing.get_context("spawn")
    workers = [spawn.Process(target=_worker, args=(setup, index + 1, gpu, os.getpid()), daemon=False)
               for index, gpu in enumerate(gpus)]
    for worker in workers:
        worker.start()
    seen = -1
    try:
        while any(worker.is_alive() for worker in workers):
            for worker in workers:
                worker.join(timeout=1.0 / len(workers))
            done = _done(study)
            if done != seen:
                seen = done
                _, front, best = export(study, context, setup.out_dir)
                bar.update(done, front, best)
    except KeyboardInterrupt:
        for worker in workers:  # SIGTERM reaches this process only; Ctrl-C reached them all (once is enough)
            if worker.is_alive():
                with contextlib.suppress(ProcessLookupError):
                    os.kill(worker.pid, signal.SIGINT)
        for worker in workers:
            worker.join(timeout=30)
        raise
    finally:
        for worker in workers:
            if worker.is_alive():
                worker.terminate()
                worker.join()


# ---------------------------------------------------------------------------------------------- baselines


def _reusable_trials(out_dir: Path, context: SearchContext) -> dict[str, dict[str, Any]]:
    """Trained rows of a search in ``out_dir`` made with the same proxies, by assignment key."""
    run_file, trials_file = out_dir / RUN_FILE, out_dir / "trials.csv"
    if not run_file.is_file() or not trials_file.is_file():
        return {}
    previous = json.loads(run_file.read_text(encoding="utf-8"))
    config = _config(context)
    if any(previous.get(key) != config[key] for key in config if key not in ("budget", "proxy_seeds")):
        return {}
    frame = pd.read_csv(trials_file)
    frame = frame[frame["trained"].astype(bool) & (frame["state"] == "COMPLETE")].sort_values("number")
    reusable: dict[str, dict[str, Any]] = {}
    for _, row in frame.iterrows():
        reusable.setdefault(row["key"], row.to_dict())  # the trial that trained it, not a later duplicate
    return reusable


_COPIED = ("memory", "bytes", "val_accuracy", "val_loss", "diverged", "reason", "promotions", "wall_time")
_SEED_FIELDS = ("seeds", "val_accuracy_sd")  # copied when the reused trial has them (a multi-seed search)


def run_baselines(
    model_spec: str,
    space: SearchSpace | str | Path,
    data: DataSpec | str = "digits",
    out_dir: str | Path = "runs/baselines",
    proxy_steps: int | None = None,
    seed: int = 0,
    device: str = "auto",
    *,
    names: tuple[str, ...] | list[str] = BASELINES,
    ablations: bool = False,
    batch_size: int | None = None,
    image_size: int | None = None,
    threads: int | None = None,
    progress: bool = True,
) -> pd.DataFrame:
    """Train the prior-work baselines and the paper's sweep (plus its ablations) under the same proxies.

    Writes ``baselines.csv`` (rewritten after each proxy) and ``baselines/<source>_<name>.json`` policies.
    In a search's run directory made with the same model, space, data and seed, sweep points the search
    already trained are reused, not trained again; so are sweep points that coincide with each other.
    """
    if isinstance(space, str | Path):
        space = load_space(space)
    space = space.with_proxy(steps=proxy_steps, batch_size=batch_size, image_size=image_size)
    data_spec = DataSpec(data) if isinstance(data, str) else data
    unknown = [name for name in names if name not in BASELINES]
    if unknown:
        raise PrecsearchError(f"unknown baseline {unknown[0]!r}; use any of {', '.join(BASELINES)}")
    if threads is not None and threads < 1:
        raise PrecsearchError(f"threads={threads} must be at least 1")
    resolve_device(device)
    context = SearchContext.create(model_spec, space, data_spec, Budget(), seed, device)
    out_dir = Path(out_dir)
    known = {key: {**row, "reused": f"trial {int(row['number'])}"}
             for key, row in _reusable_trials(out_dir, context).items()}
    todo: list[tuple[str, str, Policy, float | None, str]] = [
        ("baseline", name, policy.replace(model=model_spec), None, "")
        for name, policy in baseline_policies(context.graph, names).items()]
    for order in ("largest", "smallest", "random") if ablations else ("largest",):
        for candidate in sweep(context.graph, space, order=order, seed=seed):
            policy = context.policy(candidate.assignment, {"strategy": candidate.strategy, "r": candidate.r})
            todo.append(("paper" if order == "largest" else order, f"r={candidate.r:.1f}", policy, candidate.r,
                         candidate.key))
    (out_dir / "baselines").mkdir(parents=True, exist_ok=True)
    rows: list[dict[str, Any]] = []
    with _quiet(), _threads(threads):
        for source, name, policy, r, key in tqdm(todo, desc="baselines", unit="proxy", disable=not progress):
            row: dict[str, Any] = {"source": source, "name": name, "r": math.nan if r is None else r, "key": key}
            if key in known:
                row.update({field: known[key][field] for field in (*_COPIED, "reused")})
                row.update({field: known[key][field] for field in _SEED_FIELDS if field in known[key]})
            else:
                result = run_proxy(model_spec, policy, context.data, space.proxy.steps, seed=seed, device=device,
                                   config=space.proxy)
                memory, size = context.memory(policy.assignment(context.graph), result.promotions)
                row.update(memory=memory, bytes=size, val_accuracy=result.val_accuracy, val_loss=result.val_loss,
                           diverged=result.diverged, reason=result.reason, promotions=len(result.promotions),
                           wall_time=result.wall_time, reused="")
                if key:
                    known[key] = {**row, "reused": f"{source} {name}"}
            path = out_dir / "baselines" / f"{source}_{name.replace('=', '')}.json"
            proxy = {"val_accuracy": float(row["val_accuracy"]), "memory": float(row["memory"]),
                     "diverged": bool(row["diverged"])}
            policy.replace(provenance={**policy.provenance, "source": source, "name": name, "proxy": proxy}).save(path)
            rows.append({**row, "policy": str(path.relative_to(out_dir))})
            atomic_write_text(out_dir / "baselines.csv", pd.DataFrame(rows).to_csv(index=False))
    return pd.DataFrame(rows)
