"""The search: Optuna studies over precision assignments, scored by the cost model and proxies whose length
and worth are measured, not assumed.

``run_search(SearchConfig(...))`` traces the model once and runs four phases, each a step of the shared study
(any worker may take it; none is done twice, precsearch.search.ledger):

1. Calibration (precsearch.search.calibration): the all-high reference's continuing runs, read at doubling
   points until its learning curve says how long a proxy must be (L; ``--proxy-steps N`` fixes it). With its
   key, accuracies and the seeds per proxy it is the ``Reference`` every trial is held to
   (precsearch.search.reference).
2. Trials: the study is seeded with the config's ``seeding`` (precsearch.search.seeding), and with every
   assignment of a space that holds no more than ``trials``; a sampler (TPE by default) proposes the rest. Each
   trial decides one level per unit, prices it with ``cost.CostModel`` (no training) and trains a continuing
   proxy of L steps, stopped only on clear failure against the reference at a rung (precsearch.search.rungs);
   it gains seeds only while the budget's decision on it is open (racing), and a candidate that a known point
   already beats is not trained (precsearch.search.objective).
3. Confirmation (precsearch.search.confirmation): the Pareto front trained longer on fresh seeds, against the
   reference's runs continued to the same length; best.json comes only from confirmed points
   (precsearch.search.selection).
4. Accounting (precsearch.search.accounting): training steps per phase and rung, next to the same search
   with every trial at full length and the paper's one run per sweep point (budget.csv).

Objectives. By default two, both minimized: memory (the budget's measure relative to all-high: the predicted
peak of a training step by default, or the bytes of the assignable tensors; tensors the divergence guard
promoted count as high) and the proxy's validation error (or loss, per the space). Under a budget the study
has one objective: ``max_memory=R`` maximizes accuracy among assignments within R of the all-high memory (an
assignment over R is not trained at all), ``max_accuracy_drop=D`` minimizes memory among assignments whose
accuracy is within D (a fraction: 0.01 = 1 point) of all-high.

Bookkeeping rules:

* Storage is a PostgreSQL or SQLite URL, or a journal file (the default: ``study.journal`` in the run
  directory), so ``resume=True`` continues an interrupted search without losing a finished trial or run
  (``_requeue_interrupted``). ``jobs=N`` runs N worker processes (on CUDA, one per visible GPU) for the
  trials and for calibration's and confirmation's runs (precsearch.search.workers).
* A shared study (``study_name``) is joined by any number of workers on any number of hosts (``join_study``).
  A worker that dies stops heartbeating: its trial is failed after ``3 x heartbeat`` seconds and queued again
  (``trials.RetryStaleTrial``), and another worker takes over its setup step or run from what it recorded. A
  run keeps a checkpoint in ``checkpoints/`` while it trains, which --resume or a worker of the same run
  directory continues; a PostgreSQL restart is ridden out (precsearch.search.storage.RetryingRDBStorage).
* The outputs are written atomically from the storage once the search ends or stops (precsearch.search.export);
  ``export_study`` rebuilds them from the storage alone, any time.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import logging
import multiprocessing
import os
import signal
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import optuna
import pandas as pd
from optuna.distributions import CategoricalDistribution
from optuna.trial import FrozenTrial, TrialState
from tqdm.auto import tqdm

from precsearch.config.spaces import parse_space
from precsearch.errors import PrecsearchError
from precsearch.files import DiskFull, atomic_write_text, full_disk
from precsearch.formats.runner import default_runtime
from precsearch.models import check_trusted
from precsearch.search.calibration import Calibration, calibrate, recorded_calibration
from precsearch.search.confirmation import (
    CONFIRM_SEED_OFFSET,
    Confirmation,
    confirm,
    confirmation_length,
    recorded_confirmation,
    reference_divergence,
)
from precsearch.search.context import Budget, DataSpec, SearchContext, torch_threads
from precsearch.search.export import Decision, SearchResult, decide, export, pick_policy
from precsearch.search.ledger import Ledger, pause_point
from precsearch.search.noise import pooled_noise, seeds_for
from precsearch.search.objective import FINISHED, Objective
from precsearch.search.peaks import PICK_PEAK, measure_step_peaks
from precsearch.search.reference import Reference
from precsearch.search.rundir import (
    CHECKPOINTS,
    RUN_FILE,
    SEARCH_FORMAT,
    RunLock,
    check_journal_kept,
    check_resume,
    earlier_search,
    lost_study,
    make_run_dir,
    missing_lock_files,
    quiet_optuna_interrupts,
    remove_new_run_dir,
    remove_stale_journal_lock,
    remove_temporaries,
    write_run_file,
)
from precsearch.search.seeding import seed_study
from precsearch.search.selection import confirmable_front, confirmation_rule, pareto_front
from precsearch.search.settings import SearchConfig
from precsearch.search.storage import JOURNAL_NAME, STUDY_NAME, StudyLocation, owner_id
from precsearch.search.trials import TrialRecord, fail_stale, params_of, policy_of, reopen, retry_trial, trials_frame
from precsearch.search.workers import (
    SAMPLER_REPEATS,
    TRIALS,
    WorkerPhase,
    WorkerRun,
    WorkerSetup,
    WorkerSteps,
    budget_callback,
    load_study,
    optimize,
    run_worker,
    sampler,
    stop_on_signal,
    trials_done,
    trials_wanted,
    worker_disk_full,
    worker_gpus,
)
from precsearch.stopping import SignalStop, StopSignals, stop_signals
from precsearch.train.continuing import check_checkpoints
from precsearch.train.proxy import Trainer
from precsearch.train.trainer import resolve_device

__all__ = ["SearchInterrupted", "SearchResult", "export_study", "join_study", "quiet", "run_search", "study_config",
           "study_ledger"]

log = logging.getLogger(__name__)

CONFIG = "config"  # the study user attr that records ``study_config``
AUTO_REFERENCE_SEEDS = 3  # with --proxy-seeds auto, the all-high reference trains this many seeds to measure noise
AUTO_MIN_SEEDS = 2  # ... and every proxy at least this many, so each trial adds to the noise estimate


def _new_study(context: SearchContext, storage: optuna.storages.BaseStorage, location: StudyLocation) -> optuna.Study:
    """Create the study; raises DuplicatedStudyError when the name is taken (a unique insert in RDB storages)."""
    directions = ["minimize"] if context.budget.single_objective else ["minimize", "minimize"]
    return optuna.create_study(storage=storage, study_name=location.study_name, directions=directions,
                               sampler=sampler(context, None if location.shared else 0),
                               pruner=optuna.pruners.NopPruner())


def _check_same_config(study: optuna.Study, context: SearchContext, location: StudyLocation, fix: str) -> None:
    theirs, ours = study.user_attrs.get(CONFIG) or {}, study_config(context)
    earlier = earlier_search(theirs, f"study {location.study_name} in {location.shown}", fix)
    if earlier is not None:
        raise earlier
    differ = [key for key in ours if theirs.get(key) != ours[key]]
    if differ:
        raise PrecsearchError(
            f"study {location.study_name} in {location.shown} was made with a different {', '.join(differ)} (it "
            f"searches {theirs.get('model')}, graph {theirs.get('graph_fingerprint')}, space "
            f"{(theirs.get('space') or {}).get('name')}); {fix}")


def join_study(context: SearchContext, storage: optuna.storages.BaseStorage, location: StudyLocation,
               pause_at: str | None = None) -> optuna.Study:
    """Create a shared study or join it; refuse one made for another model, graph, space, data, seed, budget
    or search setting, or one that is not a precsearch study. Study names are unique, so exactly one of the
    workers starting at once creates it, and it records the config under the study's lock: the next worker sees
    the config, or an empty study whose creator died, which it takes over. ``pause_at``: the test hook's setup
    point (``ledger.pause_point``): ``join``, ``created`` or ``config``."""
    pause_point(pause_at, "join")
    with location.lock(storage):
        try:
            study = _new_study(context, storage, location)
        except optuna.exceptions.DuplicatedStudyError:
            study = load_study(context, storage, location, 0)
        pause_point(pause_at, "created")
        if CONFIG not in study.user_attrs:
            _adopt(study, context, location)
        pause_point(pause_at, "config")
    _check_same_config(study, context, location,
                       "join it with the same model and settings, or choose another --study-name")
    return study


def _adopt(study: optuna.Study, context: SearchContext, location: StudyLocation) -> None:
    """Record the config in a study without one: only an empty study with our objectives, which a creator
    that died before recording its config left (or this worker just created)."""
    ours = ["minimize"] * (1 if context.budget.single_objective else 2)
    if study.user_attrs or study.get_trials(deepcopy=False) or [d.name.lower() for d in study.directions] != ours:
        raise PrecsearchError(f"study {location.study_name} in {location.shown} is not a precsearch study; delete "
                              "it (optuna delete-study) or choose another --study-name")
    study.set_user_attr(CONFIG, study_config(context))


def study_config(context: SearchContext) -> dict[str, Any]:
    """What must match for a resumed study to mean the same thing."""
    return {"search_format": SEARCH_FORMAT, "model": context.model, "space": context.space.to_dict(),
            "data": dataclasses.asdict(context.data_spec), "seed": context.seed,
            "budget": dataclasses.asdict(context.budget), "graph_fingerprint": context.graph.fingerprint(),
            "proxy_seeds": context.proxy_seeds, **context.settings}


# -------------------------------------------------------------------------------------------- trial upkeep


def _requeue_interrupted(study: optuna.Study, storage: optuna.storages.BaseStorage, context: SearchContext) -> int:
    """Queue again what a dead process left unfinished (called on --resume before any worker starts, so every
    RUNNING trial is a dead process's); the number of trials queued. A RUNNING trial goes back to WAITING as it
    is: taken in trial order, it runs next, once, under its own number. A trial failed as interrupted (Ctrl-C)
    cannot be reopened: its assignment is queued as a retry, which the budget waits for (``budget_callback``)."""
    study_id = storage.get_study_id_from_name(study.study_name)
    reopened = study.get_trials(deepcopy=False, states=(TrialState.RUNNING,))
    for trial in reopened:
        reopen(storage, storage.get_trial_id_from_study_id_trial_number(study_id, trial.number), trial)
    trials = study.get_trials(deepcopy=False)
    pending = {context.key(params_of(t)) for t in trials
               if t.state in (*FINISHED, TrialState.WAITING) and len(params_of(t)) == len(context.units)}
    queued = 0
    for trial in trials:
        params, record = params_of(trial), TrialRecord.from_trial(trial)
        if (trial.state != TrialState.FAIL or not record.interrupted or len(params) != len(context.units)
                or context.key(params) in pending):
            continue
        pending.add(context.key(params))
        study.add_trial(retry_trial(params, {unit: CategoricalDistribution(context.levels) for unit in context.units},
                                    record.origin or (f"requeued trial {trial.number}",), trial.number))
        queued += 1
    return len(reopened) + queued


def study_ledger(study: optuna.Study, location: StudyLocation, storage: optuna.storages.BaseStorage,
                 run_id: str = "", index: int = 0, pause_at: str | None = None) -> Ledger:
    """This process's ledger of ``study``'s steps. In a shared study a dead worker's claim is taken over after the
    heartbeat timeout. A study of one run is used only by the processes of run ``run_id``, which holds its run
    lock: the parent (``index`` 0) takes steps only while none of its workers (1, 2, ...) runs, and the workers
    honour each other's claims as leases, so a step an earlier run's process claimed is taken up at once."""
    lock = functools.partial(location.lock, storage)
    if location.shared:
        return Ledger(study, lock, owner_id(), stale=3.0 * location.heartbeat, pause_at=pause_at)
    ours = f"run {run_id}/"
    return Ledger(study, lock, f"{ours}{index}", stale=3.0 * location.heartbeat,
                  alive=lambda other: index > 0 and other.startswith(ours), pause_at=pause_at)


def _reference_seeds(context: SearchContext) -> list[int]:
    return context.proxy_seed_list(context.proxy_seeds or AUTO_REFERENCE_SEEDS)


def _reference(study: optuna.Study, context: SearchContext, calibration: Calibration) -> Reference:
    """The reference every trial compares with, recorded once per study by whichever worker gets here first
    (with ``proxy_seeds=None`` its seeds per proxy chosen from the noise it shows, ``noise.seeds_for``)."""
    recorded = Reference.from_study(study)
    if recorded is not None:
        return recorded
    seeds = context.proxy_seeds
    if seeds is None:
        noise = pooled_noise(pd.DataFrame(), context.budget.confidence, extra=[calibration.accuracies])
        seeds = seeds_for(noise, context.budget.drop, len(calibration.accuracies), min_seeds=AUTO_MIN_SEEDS)
        log.info("%s; %d seed(s) per proxy", noise.describe(), seeds)
    reference = Reference.of(calibration, context.all_high.key, seeds)
    reference.record(study)
    return reference


def _settle(study: optuna.Study, objective: Objective) -> None:
    """Before confirmation (which freezes the front), wait for the trials other workers of a shared study
    are running, and run here the retries of those whose worker died (found stale by their heartbeat)."""
    while True:
        fail_stale(study)
        retries = [t for t in study.get_trials(deepcopy=False, states=(TrialState.WAITING,))
                   if TrialRecord.from_trial(t).retry_of is not None]
        if retries:
            optimize(study, objective, len(retries), [])
        elif not study.get_trials(deepcopy=False, states=(TrialState.RUNNING,)):
            return
        else:
            time.sleep(0.5)


def _confirm(study: optuna.Study, context: SearchContext, reference: Reference, ledger: Ledger,
             confirm_factor: float, report: Callable[[int, float], None]) -> Confirmation:
    """Confirm the front's points that can be picked (``selection.confirmable_front``), in memory order, on
    fresh seeds against all-high's runs continued (precsearch.search.confirmation)."""
    budget = context.budget
    front = confirmable_front(trials_frame(study, context), budget, context.space.accuracy_objective, context.chance)
    trials = study.get_trials(deepcopy=False)
    high = context.all_high.key
    points = {row["key"]: policy_of(trials[int(row["number"])], context, {"trial": int(row["number"])})
              for _, row in front.sort_values("memory").iterrows() if row["key"] != high}

    reference_seeds = [seed for seed in _reference_seeds(context) if seed not in reference.calibration.failed]
    seeds = [context.seed + CONFIRM_SEED_OFFSET + index for index in range(len(reference_seeds))]
    length = confirmation_length(reference.length, confirm_factor)
    return confirm(context, ledger, high, reference_seeds, points, reference.length, length, seeds, report,
                   confirmation_rule(budget, context.chance))


def export_study(storage: str, out_dir: str | Path, study_name: str = STUDY_NAME,
                 trust_model: str | None = None) -> SearchResult:
    """Rebuild a run directory from a study in ``storage`` (a shared study that workers on several hosts
    filled, say), tracing the model again from its config (a factory only when ``trust_model`` names it)."""
    start = time.perf_counter()
    out_dir = Path(out_dir)
    location = StudyLocation.of(storage, out_dir, study_name)
    if "://" not in location.target and not Path(location.target).is_file():  # opening it would create it
        raise PrecsearchError(f"no journal file {location.target}; give the study.journal of a search run (or the "
                              "database URL its workers shared)")
    backend = location.open()
    try:
        study = optuna.load_study(study_name=location.study_name, storage=backend)
    except KeyError:
        raise PrecsearchError(f"no study {location.study_name} in {location.shown}; list them with optuna "
                              "studies --storage URL") from None
    config = study.user_attrs.get(CONFIG)
    if config is None:
        raise PrecsearchError(f"study {location.study_name} in {location.shown} is not a precsearch study")
    model = check_trusted(config.get("model"), f"study {location.study_name} in {location.shown}", trust_model)
    context = SearchContext.create(model, parse_space(config["space"]), DataSpec(**config["data"]),
                                   Budget(**config["budget"]), config["seed"], "cpu")
    context.settings = {name: config[name] for name in SearchConfig.SETTINGS}
    if context.graph.fingerprint() != config["graph_fingerprint"]:
        raise PrecsearchError(f"model {config['model']} now traces to graph {context.graph.fingerprint()}, not the "
                              f"study's {config['graph_fingerprint']}; rebuild with the code that ran the study")
    out_dir.mkdir(parents=True, exist_ok=True)
    atomic_write_text(out_dir / RUN_FILE, json.dumps(
        {**config, "storage": location.shown, "study": location.study_name}, indent=2))
    return dataclasses.replace(export(study, context, out_dir), wall_time=time.perf_counter() - start)


# ------------------------------------------------------------------------------------------------ running


@contextlib.contextmanager
def quiet() -> Iterator[None]:
    """Optuna's per-trial INFO lines would tear the progress bar; trials are recorded in the trials table."""
    verbosity = optuna.logging.get_verbosity()
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    try:
        yield
    finally:
        optuna.logging.set_verbosity(verbosity)


PHASE_REFRESH_S = 1.0  # a run reports every few steps; the bar shows it at most once a second


class _Progress:
    """A tqdm bar of counted trials; its postfix holds the size of the proxy front and what trains now: runs are
    long (a slow model's proxy most of an hour), and the bar would otherwise stand still for them."""

    def __init__(self, total: int, done: int, enabled: bool) -> None:
        self.bar = tqdm(total=total, initial=min(done, total), desc="search", unit="trial", disable=not enabled,
                        dynamic_ncols=True)
        self.done = done
        self.front: int | None = None
        self.activity = ""
        self.shown = -PHASE_REFRESH_S  # when phase() last drew the bar

    def update(self, done: int, front: pd.DataFrame) -> None:
        if done > self.done:
            self.bar.update(min(done, self.bar.total) - min(self.done, self.bar.total))
            self.done = done
        self.front = len(front)
        self._draw(refresh=True)

    def phase(self, text: str) -> None:
        """What trains now; drawn at most once every ``PHASE_REFRESH_S``."""
        self.activity = text
        now = time.monotonic()
        due = now - self.shown >= PHASE_REFRESH_S
        self._draw(refresh=due)
        if due:
            self.shown = now

    def _draw(self, refresh: bool) -> None:
        parts = ([] if self.front is None else [f"front={self.front}"]) + ([self.activity] if self.activity else [])
        self.bar.set_postfix_str(", ".join(parts), refresh=refresh)

    def close(self) -> None:
        self.bar.close()


def run_search(config: SearchConfig, *, trainer: Trainer | None = None) -> SearchResult:
    """Run the search ``config`` describes; outputs go to its ``out_dir`` (see the module docstring).
    Everything a user can get wrong is checked before ``out_dir`` is created, so a bad call leaves nothing
    behind. Ctrl-C stops after the running trial is marked interrupted; what finished is written out, and
    ``resume=True`` picks up from there. ``trainer`` replaces the real proxies (tests; ``jobs=1`` only)."""
    start = time.perf_counter()
    space = config.resolved_space()
    data_spec, budget, jobs = config.data_spec, config.budget, config.jobs
    if trainer is not None and jobs > 1:
        raise PrecsearchError("an injected trainer runs in this process only; use jobs=1")
    cuda = resolve_device(config.device).type == "cuda"  # an unusable device is refused before out_dir is made
    gpus = worker_gpus(jobs, cuda) if jobs > 1 else [None]
    out_dir = Path(config.out_dir)
    location = StudyLocation.of(config.storage, out_dir, config.study_name, config.heartbeat)
    with stop_signals() as signals, quiet_optuna_interrupts():
        context = SearchContext.create(config.model, space, data_spec, budget, config.seed, config.device,
                                       proxy_seeds=config.proxy_seeds, trainer=trainer, compile=config.compile)
        context.settings = config.settings()
        context.checkpoints = out_dir / CHECKPOINTS
        if config.proxy_seeds == 1:
            log.warning("one seed per proxy: the pick compares single-seed accuracies and cannot state its "
                        "confidence; use --proxy-seeds auto (or K >= 2)")
        run_config = {**study_config(context), **({"storage": location.shown, "study": location.study_name}
                                             if location.shared else {})}
        backend = location.open() if config.storage is not None else None  # fail on a bad URL before writing
        created = make_run_dir(out_dir)
        new_locks = missing_lock_files(out_dir)
        with quiet(), torch_threads(config.threads), RunLock(out_dir):
            try:
                check_resume(out_dir, config.resume, run_config, location.shared)
                check_journal_kept(out_dir, location, config.resume)
                remove_temporaries(out_dir)
                check_checkpoints(out_dir / CHECKPOINTS)  # each bad one named now, not as its trial fails
                if location.target == str(out_dir / JOURNAL_NAME):  # this run's own journal
                    remove_stale_journal_lock(Path(location.target))
                backend = backend or location.open()
                study = _create_study(context, location, backend, config.resume, out_dir, config.pause_at)
                write_run_file(out_dir, run_config, location, study)
            except BaseException:
                if created:
                    remove_new_run_dir(out_dir)
                for path in new_locks:  # a folder this search may not use is left as it was
                    path.unlink(missing_ok=True)
                raise
            trials = min(config.trials, context.assignments)  # or every assignment of a smaller space
            run = _Run(out_dir, run_config, location, backend, signals,
                       _Progress(trials, trials_done(study), config.progress), trials, gpus, uuid.uuid4().hex[:8])
            stopped_by: int | None = None
            decision: Decision | None = None  # none when the search stopped before its pick
            full: OSError | None = None
            try:
                decision = _search(study, context, config, run)
            except KeyboardInterrupt as stop:
                stopped_by = getattr(stop, "signum", signal.SIGINT)
            except (Exception, DiskFull) as error:
                full = full_disk(error)
                if full is None:
                    raise
            finally:
                with signals.held():  # a second Ctrl-C must not tear the files being written
                    run.bar.close()
                    if full is None:  # on a full disk, --resume writes them
                        exported = export(study, context, out_dir, decision)  # a lost storage raises its one line here
    if full is not None:
        raise PrecsearchError(f"{full.strerror or 'no space left'} writing {full.filename}; the search stopped and "
                              f"every finished trial is kept in {location.shown}: free some space (or raise the "
                              "file-size limit), then continue with --resume") from full
    stopped_by = stopped_by or signals.received  # a signal recorded after the last check
    result = dataclasses.replace(exported, wall_time=time.perf_counter() - start, interrupted=stopped_by is not None)
    if stopped_by is not None:
        raise SearchInterrupted(result, stopped_by)
    return result


@dataclass(frozen=True)
class _Run:
    """Where this process searches, and with what: what every phase of ``_search`` reads."""

    out_dir: Path
    config: dict[str, Any]
    location: StudyLocation
    backend: optuna.storages.BaseStorage
    signals: StopSignals
    bar: _Progress
    trials: int
    gpus: list[str | None]
    run_id: str  # tells this run's processes from an earlier run's in the ledger (``study_ledger``)

    def record(self, study: optuna.Study) -> None:
        """run.json, with the calibration and confirmation the study has recorded so far."""
        write_run_file(self.out_dir, self.config, self.location, study)


def _search(study: optuna.Study, context: SearchContext, config: SearchConfig, run: _Run) -> Decision:
    """The search, top-down, run by every worker of a study (the ledger runs each setup and wrap-up step once);
    with ``--jobs N`` the workers train the runs and this process reads what they recorded. It ends in the pick."""
    ledger = study_ledger(study, run.location, run.backend, run.run_id, pause_at=config.pause_at)
    run.signals.check()  # each phase starts with the stop a signal recorded meanwhile (or before the search)
    if recorded_calibration(study.user_attrs) is None:
        _in_workers(CALIBRATION, study, context, config, run)
    calibration = calibrate(context, ledger, config.calibration, _reference_seeds(context),
                            _phase_progress(run.bar, "calibrating the all-high reference"))
    if calibration.warning:  # said here, once, not by each worker that took part
        log.warning("%s", calibration.warning)
    reference = _reference(study, context, calibration)
    log.info("proxy length %d steps (%s)", reference.length, "fixed" if calibration.fixed else "calibrated")
    run.record(study)
    seed_study(study, context, config.seeding, run.trials, ledger)
    objective = Objective(context, reference, run.location, run.backend, run.out_dir,
                          lambda where: run.bar.phase(str(where)))
    run.signals.check()
    _trials(study, context, objective, config, run)
    run.signals.check()
    if recorded_confirmation(study.user_attrs) is None:
        _in_workers(CONFIRMATION, study, context, config, run)
    confirmation = _confirm(study, context, reference, ledger, config.confirm_factor,
                            _phase_progress(run.bar, "confirming"))
    if (why := reference_divergence(confirmation.runs.get(confirmation.reference, []))) is not None:
        log.warning("%s; the front's points are not trained", why)
    decision = decide(study, context)  # precsearch.search.selection's pick, on the confirmed figures
    with torch_threads(config.threads):
        _measure_pick(study, context, decision.pick.best)
    run.record(study)
    return decision


def _measure_pick(study: optuna.Study, context: SearchContext, best: pd.Series | None) -> None:
    """The pick's step peak beside plain fp32's and torch.autocast's, measured once on the proxy's batch
    (precsearch.search.peaks), with finer slices too, for best.json and the summary."""
    recorded = study.user_attrs.get(PICK_PEAK)
    if best is None or (recorded is not None and recorded["key"] == best["key"]):
        return
    policy = pick_policy(study, context, best)
    train_set, batch = context.data[0], context.space.proxy.batch_size
    assignment = policy.assignment(context.graph)
    slices = context.cost.finer_slices(assignment)
    peaks = measure_step_peaks(context.model, policy, train_set.images[:batch], train_set.labels[:batch],
                               train_set.num_classes, context.cost.peak_bytes(assignment), context.device,
                               context.seed, (slices, context.cost.peak_bytes(assignment, slices)) if slices else None)
    log.info("the pick's %s", peaks.describe())
    study.set_user_attr(PICK_PEAK, {"key": best["key"], "peaks": peaks.to_dict()})


def _calibrate_in_worker(run: WorkerRun) -> None:
    """A worker's share of calibration: the runs no other worker has taken, at each length until it decides."""
    setup = run.setup
    ledger = study_ledger(run.study, setup.location, run.storage, setup.run_id, run.index, setup.pause_at)
    calibrate(run.context, ledger, setup.calibration, _reference_seeds(run.context), run.report("calibrating"))


def _confirm_in_worker(run: WorkerRun) -> None:
    """A worker's share of confirmation: the runs no other worker has taken, while the race is undecided."""
    setup, study = run.setup, run.study
    reference = Reference.from_study(study)
    ledger = study_ledger(study, setup.location, run.storage, setup.run_id, run.index, setup.pause_at)
    _confirm(study, run.context, reference, ledger, setup.confirm_factor, run.report("confirming"))


CALIBRATION = WorkerPhase(_calibrate_in_worker, replayed=True)
CONFIRMATION = WorkerPhase(_confirm_in_worker, replayed=True)


def _trials(study: optuna.Study, context: SearchContext, objective: Objective, config: SearchConfig,
            run: _Run) -> None:
    """The trial budget's trials, here (``jobs=1``) or in no more worker processes than trials are wanted (each
    starts one before any budget check); in a shared study, then those other workers still run (``_settle``)."""
    wanted = trials_wanted(study, run.trials, not run.location.shared)
    if wanted > 0 and config.jobs == 1:
        def after(study: optuna.Study, trial: FrozenTrial) -> None:
            run.bar.update(trials_done(study), _front(study, context))

        optimize(study, objective, SAMPLER_REPEATS * wanted,
                 [after, budget_callback(run.trials, not run.location.shared), stop_on_signal(run.signals)])
    elif wanted > 0:
        if wanted < len(run.gpus):
            log.info("starting %d of %d workers: %d trial(s) left to run", wanted, len(run.gpus), wanted)
        _run_workers(TRIALS, study, context, _worker_setup(context, config, run), run.gpus[:wanted], run.bar)
    if run.location.shared:
        _settle(study, objective)


def _worker_setup(context: SearchContext, config: SearchConfig, run: _Run) -> WorkerSetup:
    created = (context.model, context.space, context.data_spec, context.budget, context.seed)
    return WorkerSetup(created, context.settings, context.device, run.location, run.out_dir, run.trials,
                       config.threads or max(1, (os.cpu_count() or 1) // config.jobs), config.compile,
                       default_runtime().kernels.settings, config.proxy_seeds, config.calibration,
                       config.confirm_factor, run.run_id, config.pause_at)


def _phase_progress(bar: _Progress, phase: str) -> Callable[[int, float], None]:
    """A ``report`` hook for calibration and confirmation runs: the bar shows the ``phase`` and the run's step."""
    return lambda step, loss: bar.phase(f"{phase}: step {step}, loss {loss:.3f}")


class SearchInterrupted(SignalStop):
    """SIGINT (Ctrl-C) or SIGTERM during a search; ``result`` holds what was saved, ``signum`` the signal."""

    def __init__(self, result: SearchResult, signum: int = signal.SIGINT) -> None:
        super().__init__(signum)
        self.result = result


def _create_study(context: SearchContext, location: StudyLocation, backend: optuna.storages.BaseStorage,
                  resume: bool, out_dir: Path, pause_at: str | None) -> optuna.Study:
    """A shared study is joined (``join_study``); a study of one run is created, or loaded with --resume, which
    never starts a new one: a missing study (a deleted or cut journal) would overwrite the old one's results."""
    if location.shared:
        return join_study(context, backend, location, pause_at)
    names = {summary.study_name for summary in optuna.get_all_study_summaries(backend)}
    taken = PrecsearchError(f"storage {location.shown} already holds a precsearch study; pass --resume, give "
                            "another --storage, or join it with --study-name")
    if location.study_name in names and not resume:
        raise taken
    if location.study_name not in names and resume:
        raise lost_study(out_dir, location)
    if location.study_name not in names:
        try:
            study = _new_study(context, backend, location)
        except optuna.exceptions.DuplicatedStudyError:
            raise taken from None  # another process created it between the listing and here
        study.set_user_attr(CONFIG, study_config(context))
        return study
    study = load_study(context, backend, location, 0)
    if CONFIG not in study.user_attrs:  # the journal was cut right after the study was made; run.json matched
        study.set_user_attr(CONFIG, study_config(context))
    _check_same_config(study, context, location, "resume with the same settings or give another --storage")
    queued = _requeue_interrupted(study, backend, context)
    if queued:
        log.info("queued %d interrupted trial(s) again", queued)
    return study


def _front(study: optuna.Study, context: SearchContext) -> pd.DataFrame:
    """The proxies' Pareto front so far, for the bar: read from the storage, nothing written."""
    return pareto_front(trials_frame(study, context), context.space.accuracy_objective)


def _in_workers(phase: WorkerPhase, study: optuna.Study, context: SearchContext, config: SearchConfig,
                run: _Run) -> None:
    """With ``--jobs N``, ``phase``'s runs trained in N worker processes at once; nothing with one job."""
    if config.jobs > 1:
        _run_workers(phase, study, context, _worker_setup(context, config, run), run.gpus, run.bar)


def _run_workers(phase: WorkerPhase, study: optuna.Study, context: SearchContext, setup: WorkerSetup,
                 gpus: list[str | None], bar: _Progress) -> None:
    """One worker process per entry of ``gpus`` running ``phase``; the bar shows where each stands until all end."""
    spawn = multiprocessing.get_context("spawn")
    steps = WorkerSteps(spawn, len(gpus))
    workers = [spawn.Process(target=run_worker, args=(setup, index + 1, gpu, os.getpid(), steps, phase),
                             daemon=False) for index, gpu in enumerate(gpus)]
    for worker in workers:
        worker.start()
    seen = -1
    try:
        while any(worker.is_alive() for worker in workers):
            for worker in workers:
                worker.join(timeout=1.0 / len(workers))
            done = trials_done(study)
            if phase is TRIALS and done != seen:
                seen = done
                bar.update(done, _front(study, context))
            bar.phase(steps.shown())
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
    for worker in workers:
        worker_disk_full(worker.exitcode, setup.out_dir)


