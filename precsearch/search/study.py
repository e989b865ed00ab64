"""The search: Optuna studies over precision assignments, scored by the cost model and proxies whose length
and worth are measured, not assumed.

``run_search(SearchConfig(...))`` traces the model once and runs four phases, each a step of the shared study
(any worker may take it; none is done twice, precsearch.search.ledger):

1. Calibration (precsearch.search.calibration): the all-high reference trains on a geometric schedule of
   lengths until every seed is clearly above chance and the last doubling gained no more than the seed
   noise; that length L is the proxy length (``--proxy-steps N`` fixes it instead). Its learning curve is
   recorded (calibration.csv) and gives the reference's accuracy at every rung.
2. Trials: the study is seeded with the paper's technique at r = 0, 0.1, ..., 1 plus all-high and all-low
   (``enqueue_trial``), and every assignment of the space when it has no more than ``trials`` of them; a
   sampler (TPE by default) proposes the rest. Each trial decides one level per unit of the space, prices
   it with ``cost.CostModel`` (no training), and trains a proxy of L steps evaluated at the rungs, where it
   is stopped only on clear failure against the reference at the same step (precsearch.search.rungs). A
   candidate that a known point already beats (less memory and within the allowed drop) is not trained.
3. Confirmation (precsearch.search.confirmation): the Pareto front and the reference train again at a
   multiple of L on fresh seeds, with a plain fp32 run beside them; best.json comes only from confirmed
   points.
4. Accounting (precsearch.search.accounting): training steps per phase and rung, next to the same search
   with every trial at full length and the paper's one run per sweep point (budget.csv).

Objectives. By default two, both minimized: memory (bytes of the assignable tensors relative to all-high,
counting tensors the divergence guard promoted as high) and the proxy's validation error (or loss, per the
space). Under a budget the study has one objective: ``max_memory=R`` maximizes accuracy among assignments
within R of the all-high memory (an assignment over R is not trained at all), ``max_accuracy_drop=D``
minimizes memory among assignments whose accuracy is within D (a fraction: 0.01 = 1 point) of all-high.

Bookkeeping rules:

* A diverged proxy, or one stopped at a rung, is a COMPLETE trial whose constraint (``diverged``, ``stopped``)
  is violated (``Trial.set_constraint``), so the sampler learns from it. A trial that raises is FAILED with
  the error in its ``error`` user attr, and the study goes on.
* Identical assignments are trained once, by every worker on every host: under a lock all workers share
  (a PostgreSQL advisory lock, or an flock on a SQLite or journal file) a trial either copies the results of
  a finished trial with its assignment key (``duplicate_of``), waits for the live trial that trains that
  key, or marks itself as the one that trains it (``trains``). The trial budget counts distinct
  assignments: a copy does not use it up.
* Storage is a PostgreSQL or SQLite URL, or a journal file (the default: ``study.journal`` in the run
  directory), so ``resume=True`` continues an interrupted search without losing a completed trial or
  calibration or confirmation run; trials a killed process left RUNNING are failed as ``interrupted`` and
  queued again. ``jobs=N`` runs N worker processes on the same study (on CUDA, one per visible GPU).
* A shared study (``study_name``) is joined by any number of workers on any number of hosts: the first
  creates and seeds it, and a worker with another model, graph, space, data, seed, budget or search setting
  is refused. A worker that dies stops heartbeating; its trial is failed after ``3 x heartbeat`` seconds
  and queued again (Optuna's ``RetryHeartbeatStaleTrialCallback``), and its calibration or confirmation run
  is taken over by another worker, so only that run's work is lost.
* After every trial the outputs are rewritten atomically from the storage (precsearch.search.export);
  the policy each proxy trained under is in ``trials/`` of the worker that ran it. ``export_study`` rebuilds
  all of it from the storage alone.
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import hashlib
import importlib.util
import itertools
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
from collections.abc import Callable, Iterator
from dataclasses import dataclass
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
from precsearch.errors import PrecsearchError
from precsearch.files import atomic_write_text
from precsearch.search.calibration import Calibration, calibrate, recorded_calibration
from precsearch.search.config import DEFAULT_HEARTBEAT, SearchConfig
from precsearch.search.confirmation import (
    CONFIRM_SEED_OFFSET,
    PLAIN_FP32,
    confirm,
    confirmation_length,
)
from precsearch.search.context import Budget, DataSpec, SearchContext, combine_seeds, seed_record, torch_threads
from precsearch.search.export import (
    Exported,
    export,
    params_of,
    policy_of,
    proxy_reference,
    study_noise,
    trials_frame,
)
from precsearch.search.ledger import Ledger
from precsearch.search.noise import Noise, pooled_noise, seeds_for
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
from precsearch.search.rungs import RungRule, RungStop, rung_steps
from precsearch.search.samplers import make_sampler
from precsearch.search.selection import choose_best, pareto_front
from precsearch.search.sensitivity import SensitivitySeeding, measure_model
from precsearch.search.strategies import (
    BASELINES,
    assign,
    assignment_key,
    baseline_policies,
    low_share,
    seed_candidates,
    sweep,
    uniform,
)
from precsearch.train.proxy import Trainer, run_proxy
from precsearch.train.trainer import ProxyResult, resolve_device

__all__ = [
    "SearchInterrupted",
    "SearchResult",
    "StudyLocation",
    "export_study",
    "run_baselines",
    "run_search",
]

log = logging.getLogger(__name__)

STUDY_NAME = "precsearch"
JOURNAL_NAME = "study.journal"
RUN_FILE = "run.json"
TRIAL_POLICIES = "trials"  # each worker's --out/trials/trial_NNNN.json: the policy each proxy it ran trained under
POSTGRES_DRIVER = "postgresql+psycopg"
MAX_RETRIES = 3  # times a trial whose worker died is queued again
CONFIG_WAIT = 30.0  # seconds a joining worker waits for a new study's creator to record its config ...
SEED_WAIT = 600.0  # ... and to queue its seeds
WORKER = f"{socket.gethostname()}:{os.getpid()}"
FINISHED = (TrialState.COMPLETE, TrialState.PRUNED)
SAMPLER_REPEATS = 10  # a study stops after this many x trials even if the sampler kept proposing known assignments
METRICS = (
    "val_accuracy", "val_loss", "diverged", "reason", "steps_run", "skipped_steps", "final_loss_scale",
    "promotions", "overflow_max", "underflow_max", "underflow_mean", "wall_time", "memory", "bytes",
    "memory_bytes", "memory_peak", "memory_planned", "low_share", "trained", "device",
    "val_accuracy_sd", "val_accuracies", "seeds", "stopped_at", "seed_steps",
)
AUTO_REFERENCE_SEEDS = 3  # with --proxy-seeds auto, the all-high reference trains this many seeds to measure noise
AUTO_MIN_SEEDS = 2  # ... and every proxy at least this many, so each trial adds to the noise estimate


def _set_constraints(trial: optuna.Trial, constraints: dict[str, float]) -> None:
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
        decisions = {unit: trial.suggest_categorical(unit, context.levels) for unit in context.units}
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
        attrs = study.user_attrs
        reference = proxy_reference(attrs)
        if context.budget.max_memory is not None and planned > context.budget.max_memory:
            return self._untrained(trial, planned, "over the memory budget")
        if key != attrs.get("reference_key"):
            beaten = _beaten_by(study, context, planned)
            if beaten is not None:
                return self._untrained(trial, planned, f"trial {int(beaten['number'])} has less memory "
                                       f"({beaten['memory']:.4f}) and is within the allowed drop: no training needed")
        policy = context.policy(assignment, {"trial": trial.number})
        stopped: RungStop | None = None
        if key == attrs.get("reference_key"):
            result = ProxyResult.from_dict({**attrs["reference_result"], "loss_curve": []})
            accuracies = attrs.get("reference_accuracies", [result.val_accuracy])
            seed_steps: list[int] = []
            trial.set_user_attr("duplicate_of", "reference")
        else:
            rule = _rung_rule(attrs, context)
            seeds = context.proxy_seed_list(int(attrs.get("proxy_seeds", 1)))
            try:
                results = context.train_seeds(policy, context.length, seeds, evaluate_at=rule.steps,
                                              on_eval=rule.check, report=self._check_signals)
            except RungStop as stop:
                stopped, results = stop, []
            if stopped is not None:
                result = ProxyResult(stopped.accuracy, math.nan, False, stopped.reason, stopped.step, [])
                accuracies, seed_steps = [stopped.accuracy], [stopped.step]
            else:
                result = combine_seeds(results)
                accuracies = [run.val_accuracy for run in results]
                seed_steps = [run.steps_run for run in results]
        ratios, size = context.memories(assignment, result.promotions)
        memory = ratios[f"memory_{context.budget.memory}"]
        path = self.out_dir / TRIAL_POLICIES / f"trial_{trial.number:04d}.json"
        path.parent.mkdir(exist_ok=True)
        proxy = {"val_accuracy": result.val_accuracy, "memory": memory, "diverged": result.diverged}
        policy.replace(provenance={**policy.provenance, "worker": WORKER, "proxy": proxy}).save(path)
        record = result.to_dict()
        for name in ("loss_curve", "val_curve"):
            record.pop(name)
        record.update(memory=memory, bytes=size, trained=True, policy=str(path.resolve()), **ratios,
                      **seed_record(accuracies), seed_steps=seed_steps)
        if stopped is not None:
            record["stopped_at"] = stopped.step
        for name, value in record.items():
            trial.set_user_attr(name, value)
        margin = 0.0
        if reference is not None:
            noise = study_noise(attrs, context, trials_frame(study, context))
            margin = float(noise.margin(len(accuracies), len(attrs.get("reference_accuracies", [0]))))
        constraints = context.constraints(result, memory, reference, margin)
        constraints["stopped"] = 1.0 if stopped is not None else 0.0
        _set_constraints(trial, constraints)
        trial.set_user_attr("loss_curve", [round(v, 5) for v in result.loss_curve])
        return context.values(memory, result)

    def _check_signals(self, step: int, loss: float) -> None:
        """Called every few proxy steps: a stop signal recorded but not raised is raised here."""
        if self.signals is not None:
            self.signals.check()

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
        worst = 1e6 if context.space.accuracy_objective == "val_loss" else 1.0
        if context.budget.max_memory is not None:
            return [worst]
        return [memory] if context.budget.max_accuracy_drop is not None else [memory, worst]


def _wait_while_running(study: optuna.Study, number: int) -> None:
    """Poll until trial ``number`` leaves RUNNING; meanwhile fail trials whose worker stopped heartbeating
    (Optuna does so only when a trial starts, and every live worker may be waiting here)."""
    while any(t.number == number for t in study.get_trials(deepcopy=False, states=(TrialState.RUNNING,))):
        time.sleep(0.5)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
            optuna.storages.fail_stale_trials(study)


def _beaten_by(study: optuna.Study, context: SearchContext, planned: float) -> pd.Series | None:
    """A trained point that makes training a candidate of ``planned`` memory pointless: the accuracy-drop pick
    among the proxies so far (least memory within the drop of all-high), when its memory is at most
    ``planned``; None under a memory budget (whose pick wants accuracy, not memory) or when there is none."""
    if context.budget.max_memory is not None:
        return None
    attrs = study.user_attrs
    frame = trials_frame(study, context)
    reference = proxy_reference(attrs)
    if frame.empty or reference is None:
        return None
    best = choose_best(frame, context.budget, reference, study_noise(attrs, context, frame),
                       len(attrs.get("reference_accuracies", [0])), attrs.get("reference_key"), context.chance)
    return best if best is not None and best["memory"] <= planned else None


def _rung_rule(attrs: dict[str, Any], context: SearchContext) -> RungRule:
    """The study's rung rule: the calibrated reference's accuracy at each rung step and its noise."""
    calibration = recorded_calibration(attrs)
    steps = rung_steps(calibration.length, attrs["config"]["rungs"])
    return RungRule({step: calibration.at(step) for step in steps}, calibration.noise(context.budget.confidence),
                    context.budget.drop, context.chance)


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


def _load_study(context: SearchContext, storage: optuna.storages.BaseStorage, location: StudyLocation,
                worker: int) -> optuna.Study:
    return optuna.load_study(study_name=location.study_name, storage=storage,
                             sampler=_sampler(context, None if location.shared else worker),
                             pruner=optuna.pruners.NopPruner())


def _new_study(context: SearchContext, storage: optuna.storages.BaseStorage, location: StudyLocation) -> optuna.Study:
    """Create the study; raises DuplicatedStudyError when the name is taken (a unique insert in RDB storages)."""
    directions = ["minimize"] if context.budget.single_objective else ["minimize", "minimize"]
    return optuna.create_study(storage=storage, study_name=location.study_name, directions=directions,
                               sampler=_sampler(context, None if location.shared else 0),
                               pruner=optuna.pruners.NopPruner())


def _check_same_config(study: optuna.Study, context: SearchContext, location: StudyLocation, fix: str) -> None:
    theirs, ours = study.user_attrs.get("config") or {}, _config(context)
    differ = [key for key in ours if theirs.get(key) != ours[key]]
    if differ:
        raise PrecsearchError(
            f"study {location.study_name} in {location.shown} was made with a different {', '.join(differ)} (it "
            f"searches {theirs.get('model')}, graph {theirs.get('graph_fingerprint')}, space "
            f"{(theirs.get('space') or {}).get('name')}); {fix}")


def _join_study(context: SearchContext, storage: optuna.storages.BaseStorage, location: StudyLocation,
                trials: int) -> optuna.Study:
    """Create and seed a shared study, or join it once its creator has seeded it.

    The database decides who creates it: study names are unique, so of any number of workers starting at
    once exactly one ``create_study`` succeeds. That one records the config, queues the seeds, then sets
    ``seeded``. Every other worker waits for ``seeded`` and refuses a study made for another model, graph,
    space, data, seed, budget or search setting. Calibration is no one's privilege: every worker takes part
    in it afterwards (``_prepare``).
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
    _seed_study(study, context, trials)
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
        **context.settings,
    }


# -------------------------------------------------------------------------------------------- trial upkeep


def _counted(trial: FrozenTrial) -> bool:
    """A trial that used up budget: a distinct assignment finished (a copy of another trial's results does
    not count), or a trial failed by its own error (not by an interruption or a dead worker's missing
    heartbeat: those are queued again)."""
    if trial.state in FINISHED:
        return not isinstance(trial.user_attrs.get("duplicate_of"), int)
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
    pending = {context.key(params_of(t)) for t in trials
               if t.state in (*FINISHED, TrialState.WAITING) and len(params_of(t)) == len(context.units)}
    queued = 0
    for trial in trials:
        params = params_of(trial)
        if trial.state != TrialState.FAIL or not trial.user_attrs.get("interrupted"):
            continue
        if len(params) != len(context.units) or context.key(params) in pending:
            continue
        pending.add(context.key(params))
        origin = trial.user_attrs.get("origin", [f"requeued trial {trial.number}"])
        study.enqueue_trial(params, user_attrs={"origin": origin})
        queued += 1
    return queued


def _seed_study(study: optuna.Study, context: SearchContext, trials: int) -> None:
    """Queue the seed candidates, then, when the space holds no more than ``trials`` assignments, every
    other one (a sampler would only propose them again and again). With the ``sensitivity`` seeding the
    units' sensitivity is measured first, kept in the study (``sensitivity`` user attr) and its knapsack points
    lead the queue."""
    first = []
    if context.settings.get("seeding") == "sensitivity":
        table = measure_model(context.model, context.space, context.data, seed=context.seed, device="cpu")
        study.set_user_attr("sensitivity", table.to_dict(orient="records"))
        first.append(SensitivitySeeding(table))
    seeded = seed_candidates(context.graph, context.space, first)
    for candidate, origins in seeded:
        study.enqueue_trial(candidate.decisions, user_attrs={"origin": origins})
    if context.assignments > trials:
        return
    known = {candidate.key for candidate, _ in seeded}
    for levels in itertools.product(context.levels, repeat=len(context.units)):
        decisions = dict(zip(context.units, levels, strict=True))
        if context.key(decisions) not in known:
            study.enqueue_trial(decisions, user_attrs={"origin": ["enumerated"]})


def _trial_budget(context: SearchContext, trials: int) -> int:
    """Distinct assignments the study trains or judges: ``trials``, or every assignment of a smaller space."""
    return min(trials, context.assignments)


def _ledger(study: optuna.Study, location: StudyLocation, storage: optuna.storages.BaseStorage) -> Ledger:
    return Ledger(study, lambda: location.lock(storage), WORKER, stale=3.0 * location.heartbeat)


def _reference_seeds(context: SearchContext) -> list[int]:
    return context.proxy_seed_list(context.proxy_seeds or AUTO_REFERENCE_SEEDS)


def _prepare(study: optuna.Study, context: SearchContext, ledger: Ledger, config: SearchConfig,
             check: Callable[[int, float], None]) -> Calibration:
    """Calibrate (or train the reference at the fixed length), then record the reference every trial compares
    with: its result at the proxy length, its seeds' accuracies and the seeds per proxy (with
    ``proxy_seeds=None`` chosen from the noise the reference shows, ``noise.seeds_for``). Every worker runs
    it; the ledger makes each run happen once."""
    calibration = calibrate(context, ledger, config.calibration, _reference_seeds(context), check, config.rungs)
    context.length = calibration.length
    if "reference_result" not in study.user_attrs:
        accuracies = calibration.accuracies
        seeds = context.proxy_seeds
        if seeds is None:
            noise = pooled_noise(pd.DataFrame(), context.budget.confidence, extra=[accuracies])
            seeds = seeds_for(noise, context.budget.drop, len(accuracies), min_seeds=AUTO_MIN_SEEDS)
            log.info("%s; %d seed(s) per proxy", noise.describe(), seeds)
        study.set_user_attr("proxy_seeds", seeds)
        study.set_user_attr("reference_key", uniform(context.graph, context.space, "high").key)
        study.set_user_attr("reference_accuracies", accuracies)
        study.set_user_attr("reference_result", {**calibration.result().to_dict(), "loss_curve": []})
    return calibration


def _settle(study: optuna.Study, objective: Objective) -> None:
    """Before confirmation (which freezes the front), wait for the trials other workers of a shared study
    are running, and run here the retries of those whose worker died (found stale by their heartbeat)."""
    while True:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
            optuna.storages.fail_stale_trials(study)
        retries = [t for t in study.get_trials(deepcopy=False, states=(TrialState.WAITING,))
                   if "failed_trial" in t.system_attrs]
        if retries:
            study.optimize(objective, n_trials=len(retries), catch=(Exception,))
        elif not study.get_trials(deepcopy=False, states=(TrialState.RUNNING,)):
            return
        else:
            time.sleep(0.5)


def _confirm(study: optuna.Study, context: SearchContext, ledger: Ledger, config: SearchConfig,
             check: Callable[[int, float], None]) -> None:
    """Train the front's points (within the memory budget), all-high and plain fp32 at the confirmation
    length on fresh seeds (precsearch.search.confirmation). A front point whose proxy diverged or stayed at
    chance cannot be picked whatever its confirmation says, so it is not trained again."""
    frame = trials_frame(study, context)
    front = pareto_front(frame, context.space.accuracy_objective)
    if context.budget.max_memory is not None and not front.empty:
        front = front[front["memory"] <= context.budget.max_memory + 1e-12]
    if not front.empty:
        front = front[(front["val_accuracy"] > context.chance) & ~front["diverged"].astype(bool)]
    trials = study.get_trials(deepcopy=False)
    high = uniform(context.graph, context.space, "high")
    policies: dict[str, Policy | None] = {high.key: context.policy(high.assignment, {"strategy": "all-high"})}
    for _, row in front.iterrows():
        policies[row["key"]] = policy_of(trials[int(row["number"])], context, {"trial": int(row["number"])})
    policies[PLAIN_FP32] = None
    seeds = [context.seed + CONFIRM_SEED_OFFSET + index for index in range(len(_reference_seeds(context)))]
    confirm(context, ledger, policies, confirmation_length(context.length, config.confirm_factor), seeds, check)


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
    context.settings = {name: config[name] for name in SearchConfig.SETTINGS}
    if context.graph.fingerprint() != config["graph_fingerprint"]:
        raise PrecsearchError(f"model {config['model']} now traces to graph {context.graph.fingerprint()}, not the "
                              f"study's {config['graph_fingerprint']}; rebuild with the code that ran the study")
    out_dir.mkdir(parents=True, exist_ok=True)
    atomic_write_text(out_dir / RUN_FILE, json.dumps(
        {**config, "storage": location.shown, "study": location.study_name}, indent=2))
    calibration = recorded_calibration(study.user_attrs)
    context.length = calibration.length if calibration is not None else None
    return SearchResult.of(out_dir, export(study, context, out_dir), time.perf_counter() - start)


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


@dataclass
class SearchResult:
    """What a search left in its run directory, as tables."""

    out_dir: Path
    trials: pd.DataFrame
    pareto: pd.DataFrame
    best: pd.Series | None
    wall_time: float
    interrupted: bool = False
    noise: Noise | None = None  # the pooled seed noise of the proxies
    note: str = ""  # why best is None, or which proxy pick confirmation replaced
    calibration: Calibration | None = None
    confirmation: pd.DataFrame | None = None  # confirmed accuracy per key (precsearch.search.confirmation)
    budget: pd.DataFrame | None = None  # training steps per phase (precsearch.search.accounting)

    @classmethod
    def of(cls, out_dir: Path, exported: Exported, wall_time: float, interrupted: bool = False) -> SearchResult:
        return cls(out_dir, exported.trials, exported.pareto, exported.best, wall_time, interrupted, exported.noise,
                   exported.note, exported.calibration, exported.confirmation, exported.budget)


class _Progress:
    """A tqdm bar of counted trials with the size of the proxy front in its postfix (no pick before
    confirmation)."""

    def __init__(self, total: int, done: int, enabled: bool) -> None:
        self.bar = tqdm(total=total, initial=min(done, total), desc="search", unit="trial", disable=not enabled,
                        dynamic_ncols=True)
        self.done = done

    def update(self, done: int, front: pd.DataFrame) -> None:
        if done > self.done:
            self.bar.update(min(done, self.bar.total) - min(self.done, self.bar.total))
            self.done = done
        self.bar.set_postfix({"front": len(front)}, refresh=True)

    def close(self) -> None:
        self.bar.close()


def _budget_callback(trials: int, count_running: bool) -> Callable[[optuna.Study, FrozenTrial], None]:
    """Stop once ``trials`` trials counted (distinct assignments, ``_counted``) and no retry of a dead worker's
    trial is still queued, or once the sampler has had ``SAMPLER_REPEATS`` x ``trials`` turns. With
    ``count_running`` (the workers of one run, all alive) the trials other workers are running count too,
    so that N workers do not start N - 1 trials past the budget; a shared study may hold RUNNING trials of
    dead hosts until their heartbeat times out, so there they do not count."""

    def stop(study: optuna.Study, trial: FrozenTrial) -> None:
        queued = study.get_trials(deepcopy=False, states=(TrialState.WAITING,))
        running = study.get_trials(deepcopy=False, states=(TrialState.RUNNING,)) if count_running else []
        if _done(study) + len(running) >= trials and not any("failed_trial" in t.system_attrs for t in queued):
            study.stop()
        elif len(study.get_trials(deepcopy=False)) >= SAMPLER_REPEATS * trials:
            log.warning("the sampler keeps proposing assignments already known; stopping at %d distinct",
                        _done(study))
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
    settings: dict[str, Any]
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
        context.settings = setup.settings
        storage = setup.location.open()
        study = _load_study(context, storage, setup.location, index)
        context.length = recorded_calibration(study.user_attrs).length  # the parent calibrated before
        study.optimize(Objective(context, setup.location, storage, setup.out_dir, signals),
                       n_trials=SAMPLER_REPEATS * setup.trials,
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


def run_search(config: SearchConfig, *, trainer: Trainer | None = None) -> SearchResult:
    """Run the search ``config`` describes; outputs go to its ``out_dir`` (see the module docstring).

    Everything a user can get wrong (model, data, space, storage, budget, settings) is checked before
    ``out_dir`` is created, so a bad call leaves nothing behind. Ctrl-C stops after the running trial is
    marked interrupted; completed trials and runs are kept and written out, and ``resume=True`` picks up
    from there. ``trainer`` replaces the real proxies (tests inject scripted learning curves; only with
    ``jobs=1``, since worker processes build their own).
    """
    start = time.perf_counter()
    space = config.resolved_space()
    data_spec, budget, jobs = config.data_spec, config.budget, config.jobs
    if trainer is not None and jobs > 1:
        raise PrecsearchError("an injected trainer runs in this process only; use jobs=1")
    gpus = worker_gpus(jobs, resolve_device(config.device).type == "cuda") if jobs > 1 else [None]
    out_dir = Path(config.out_dir)
    location = StudyLocation.of(config.storage, out_dir, config.study_name, config.heartbeat)
    with StopSignals() as signals, quiet_optuna_interrupts():
        context = SearchContext.create(config.model, space, data_spec, budget, config.seed, config.device,
                                       proxy_seeds=config.proxy_seeds, trainer=trainer)
        context.settings = config.settings()
        if config.proxy_seeds == 1:
            log.warning("one seed per proxy: the pick compares single-seed accuracies and cannot state its "
                        "confidence; use --proxy-seeds auto (or K >= 2)")
        run_config = {**_config(context), **({"storage": location.shown, "study": location.study_name}
                                             if location.shared else {})}
        backend = location.open() if config.storage is not None else None  # fail on a bad URL before writing
        created = _make_run_dir(out_dir)
        with _quiet(), torch_threads(config.threads), _owned(out_dir):
            try:
                _check_resume(out_dir, config.resume, run_config, location.shared)
                _check_journal_kept(out_dir, location, config.resume)
                remove_temporaries(out_dir)
                if location.target == str(out_dir / JOURNAL_NAME):  # this run's own journal
                    remove_stale_journal_lock(Path(location.target))
                backend = backend or location.open()
                study = _create_study(context, location, backend, config.resume, out_dir, config.trials)
            except BaseException:
                if created:
                    _remove_new_run_dir(out_dir)
                raise
            _write_run_file(out_dir, run_config, location, study)
            trials = _trial_budget(context, config.trials)
            bar = _Progress(trials, _done(study), config.progress)
            stopped_by: int | None = None
            ledger = _ledger(study, location, backend)
            check = _signal_check(signals)
            try:
                calibration = _prepare(study, context, ledger, config, check)
                log.info("proxy length %d steps (%s)", calibration.length,
                         "fixed" if calibration.fixed else "calibrated")
                _write_run_file(out_dir, run_config, location, study)
                if jobs == 1:
                    _optimize_here(study, context, location, backend, trials, out_dir, bar, signals)
                else:
                    created = (context.model, context.space, context.data_spec, context.budget, context.seed)
                    setup = _WorkerSetup(created, context.settings, context.device, location, out_dir, trials,
                                         config.threads or max(1, (os.cpu_count() or 1) // jobs))
                    _optimize_workers(study, context, setup, gpus, bar)
                bar.close()
                if location.shared:
                    _settle(study, Objective(context, location, backend, out_dir, signals))
                _confirm(study, context, ledger, config, check)
                _write_run_file(out_dir, run_config, location, study)
            except KeyboardInterrupt as stop:
                stopped_by = getattr(stop, "signum", signal.SIGINT)
            finally:
                with signals.held():  # a second Ctrl-C must not tear the files being written
                    bar.close()
                    exported = export(study, context, out_dir)
    stopped_by = stopped_by or signals.received  # a signal Python dropped (raised inside a finalizer)
    result = SearchResult.of(out_dir, exported, time.perf_counter() - start, stopped_by is not None)
    if stopped_by is not None:
        raise SearchInterrupted(result, stopped_by)
    return result


def _signal_check(signals: StopSignals) -> Callable[[int, float], None]:
    """A ``report`` hook for calibration and confirmation runs: a recorded stop signal is raised there."""
    def check(step: int, loss: float) -> None:
        signals.check()

    return check


def _write_run_file(out_dir: Path, run_config: dict[str, Any], location: StudyLocation, study: optuna.Study) -> None:
    """run.json: the config, where the study lives, and the calibration and confirmation once recorded."""
    attrs = study.user_attrs
    calibration = recorded_calibration(attrs)
    confirmation = attrs.get("confirmation")
    extra: dict[str, Any] = {}
    if calibration is not None:
        extra["proxy_length"] = calibration.length
        extra["calibration"] = calibration.to_dict()
    if confirmation is not None:
        extra["confirmation"] = confirmation
    atomic_write_text(out_dir / RUN_FILE, json.dumps(
        {**run_config, "storage": location.shown, "study": location.study_name, **extra}, indent=2))


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
                  resume: bool, out_dir: Path, trials: int) -> optuna.Study:
    """A shared study is joined (``_join_study``); a study of one run is created, or loaded with --resume
    after failing and queueing again what a killed process left RUNNING. --resume never starts a new study:
    one that is missing (a deleted, emptied or cut journal) would overwrite the results left of the old one."""
    if location.shared:
        return _join_study(context, backend, location, trials)
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
        _seed_study(study, context, trials)
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
        bar.update(_done(study), export(study, context, out_dir).pareto)

    remaining = trials - _done(study)
    if remaining <= 0:
        return
    study.optimize(Objective(context, location, backend, out_dir, signals), n_trials=SAMPLER_REPEATS * remaining,
                   catch=(Exception,),
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
                bar.update(done, export(study, context, setup.out_dir).pareto)
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
    length = previous.get("proxy_length")
    config = _config(context)
    ignored = ("budget", "proxy_seeds", "space", *SearchConfig.SETTINGS)
    if length != context.space.proxy.steps or any(previous.get(key) != config[key] for key in config
                                                  if key not in ignored):
        return {}
    if parse_space(previous["space"]).with_proxy(steps=length).to_dict() != config["space"]:
        return {}
    frame = pd.read_csv(trials_file)
    stopped = frame["stopped_at"].notna() if "stopped_at" in frame else False
    frame = frame[frame["trained"].astype(bool) & (frame["state"] == "COMPLETE") & ~stopped].sort_values("number")
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
    In a search's run directory made with the same model, space, data and seed, the proxies are as long as
    the search's (unless ``proxy_steps`` says otherwise), and sweep points the search already trained are
    reused, not trained again; so are sweep points that coincide with each other.
    """
    if isinstance(space, str | Path):
        space = load_space(space)
    run_file = Path(out_dir) / RUN_FILE
    if proxy_steps is None and run_file.is_file():
        proxy_steps = json.loads(run_file.read_text(encoding="utf-8")).get("proxy_length")
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
    with _quiet(), torch_threads(threads):
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
