"""Worker processes of one study (``--jobs``): each loads the study and runs one phase of the search (the
trials, or calibration's or confirmation's runs, which are ledger steps the workers share out), until the phase is
done, its parent dies or a stop signal arrives."""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import optuna
import torch
from optuna.trial import FrozenTrial, TrialState

from precsearch.config.compiling import CompileOptions
from precsearch.config.spaces import SearchSpace
from precsearch.errors import PrecsearchError
from precsearch.files import FULL_ERRNOS, DiskFull, full_disk
from precsearch.formats.runner import KernelRunner, KernelSettings, Runtime
from precsearch.search.calibration import CalibrationSettings
from precsearch.search.context import Budget, DataSpec, SearchContext
from precsearch.search.objective import FINISHED, Objective, TrialStep
from precsearch.search.reference import Reference
from precsearch.search.rundir import CHECKPOINTS, hold_worker_lock, quiet_optuna_interrupts
from precsearch.search.samplers import make_sampler
from precsearch.search.storage import StudyLocation
from precsearch.search.trials import TrialRecord
from precsearch.stopping import StopSignals, stop_signals

__all__ = ["SAMPLER_REPEATS", "TRIALS", "WorkerPhase", "WorkerRun", "WorkerSetup", "WorkerSteps", "budget_callback",
           "load_study", "optimize", "run_worker", "sampler", "stop_on_signal", "trials_done", "worker_disk_full",
           "worker_gpus"]

log = logging.getLogger(__name__)

SAMPLER_REPEATS = 10  # a study stops after this many x trials even if the sampler kept proposing known assignments


def sampler(context: SearchContext, worker: int | None) -> optuna.samplers.BaseSampler:
    """The space's sampler seeded from the search seed and the worker's index; unseeded (None) in a shared
    study, whose workers on several hosts would otherwise propose the same first assignments."""
    return make_sampler(context.space.sampler, None if worker is None else context.seed * 1000 + worker)


def load_study(context: SearchContext, storage: optuna.storages.BaseStorage, location: StudyLocation,
               worker: int) -> optuna.Study:
    return optuna.load_study(study_name=location.study_name, storage=storage,
                             sampler=sampler(context, None if location.shared else worker),
                             pruner=optuna.pruners.NopPruner())


def _counted(trial: FrozenTrial) -> bool:
    """A trial that used up budget: a distinct assignment finished, or a trial failed by its own error (not an
    interruption or a dead worker's: those are queued again)."""
    record = TrialRecord.from_trial(trial)
    if trial.state in FINISHED:
        return record.duplicate_of is None
    return trial.state == TrialState.FAIL and record.error != ""


def trials_done(study: optuna.Study) -> int:
    return sum(_counted(t) for t in study.get_trials(deepcopy=False))


def optimize(study: optuna.Study, objective: Objective, n_trials: int,
             callbacks: list[Callable[[optuna.Study, FrozenTrial], None]]) -> None:
    """``study.optimize`` that goes on when a trial this process trained was failed by another worker meanwhile
    (it was paused for over 3 heartbeats): the retry trains that assignment, so this result is dropped."""
    while True:
        try:
            study.optimize(objective, n_trials=n_trials, catch=(Exception,), callbacks=callbacks)
            return
        except ValueError as error:
            if not str(error).startswith("Cannot tell a "):  # Optuna's words for a trial already finished
                raise
            log.warning("a trial this worker trained was failed by another worker while this one was paused "
                        "(silent for over 3 heartbeats); its retry trains it again, this result is dropped")


def trials_wanted(study: optuna.Study, trials: int, count_running: bool) -> int:
    """How many more trials to start: what the budget of ``trials`` has left, and at least every queued retry. With
    ``count_running`` (the workers of one run, all alive) the running trials count, so that N workers do not
    start N - 1 past the budget; a shared study's may be dead hosts' until their heartbeat times out."""
    queued = study.get_trials(deepcopy=False, states=(TrialState.WAITING,))
    running = study.get_trials(deepcopy=False, states=(TrialState.RUNNING,)) if count_running else []
    retries = sum(TrialRecord.from_trial(t).retry_of is not None for t in queued)
    return max(retries, trials - trials_done(study) - len(running))


def budget_callback(trials: int, count_running: bool) -> Callable[[optuna.Study, FrozenTrial], None]:
    """Stop once no more trials are wanted (``trials_wanted``), or once the sampler has had
    ``SAMPLER_REPEATS`` x ``trials`` turns."""

    def stop(study: optuna.Study, trial: FrozenTrial) -> None:
        if trials_wanted(study, trials, count_running) <= 0:
            study.stop()
        elif len(study.get_trials(deepcopy=False)) >= SAMPLER_REPEATS * trials:
            log.warning("the sampler keeps proposing assignments already known; stopping at %d distinct",
                        trials_done(study))
            study.stop()

    return stop


def _stop_when(condition: Callable[[], bool]) -> Callable[[optuna.Study, FrozenTrial], None]:
    """A callback that stops the study before its next trial once ``condition()`` holds."""
    def stop(study: optuna.Study, trial: FrozenTrial) -> None:
        if condition():
            study.stop()

    return stop


def stop_on_signal(signals: StopSignals) -> Callable[[optuna.Study, FrozenTrial], None]:
    """Stop before the next trial when a signal was recorded but not raised (it came inside Optuna's code)."""
    return _stop_when(lambda: signals.received is not None)


@dataclass(frozen=True)
class WorkerSetup:
    """What a worker process rebuilds its context from (``SearchContext.create``'s first arguments), where it
    runs, and the search's settings its phases read."""

    context: tuple[str, SearchSpace, DataSpec, Budget, int]
    settings: dict[str, Any]
    device: str
    location: StudyLocation
    out_dir: Path
    trials: int
    threads: int
    compile: CompileOptions | None
    kernels: KernelSettings  # the parent's runtime's: the worker's runtime runs the format kernels alike
    proxy_seeds: int | None
    calibration: CalibrationSettings
    confirm_factor: float
    run_id: str
    pause_at: str | None


@dataclass(frozen=True)
class WorkerRun:
    """A worker process's view of the search: the study, its own context and storage, its index (from 1)."""

    setup: WorkerSetup
    index: int
    parent: int
    study: optuna.Study
    context: SearchContext
    storage: optuna.storages.BaseStorage
    steps: WorkerSteps
    signals: StopSignals = field(repr=False)

    def report(self, phase: str) -> Callable[[int, float], None]:
        """A trainer's ``report`` hook: this worker's slot on the parent's bar shows ``phase`` and the step."""
        return lambda step, loss: self.steps.record_run(self.index, phase, step)


@dataclass(frozen=True)
class WorkerPhase:
    """What a worker process runs: ``run``, a module-level function (a spawned process imports it by name). A
    ``replayed`` phase is run again by the parent (a no-op on what the workers recorded), which reports its errors."""

    run: Callable[[WorkerRun], None]
    replayed: bool = False


class WorkerSteps:
    """Where each local worker stands, in memory shared with the parent's bar: each writes only its own slot, and
    a reading torn by a write is redrawn within a second."""

    PHASES = ("", "trial", "calibrating", "confirming")  # a slot's first value: none yet, a trial, a named run

    def __init__(self, spawn: Any, workers: int) -> None:
        self.values = spawn.Array("q", 5 * workers, lock=False)  # phase, trial, seed, step, steps

    def record(self, index: int, where: TrialStep) -> None:
        """``index``: the worker's, from 1."""
        self.values[5 * (index - 1):5 * index] = [1, where.trial, where.seed, where.step, where.steps]

    def record_run(self, index: int, phase: str, step: int) -> None:
        self.values[5 * (index - 1):5 * index] = [self.PHASES.index(phase), 0, 0, step, 0]

    def clear(self, index: int) -> None:
        """A worker that exits shows nothing: not the last step of a trial it no longer trains."""
        self.values[5 * (index - 1):5 * index] = [0, 0, 0, 0, 0]

    def shown(self) -> str:
        rows = [self.values[start:start + 5] for start in range(0, len(self.values), 5)]
        return "; ".join(f"worker {index}: " + (str(TrialStep(*row[1:])) if row[0] == 1
                                                 else f"{self.PHASES[row[0]]}: step {row[3]}")
                         for index, row in enumerate(rows, 1) if row[0])


def _optimize_trials(run: WorkerRun) -> None:
    """The trials phase: optimize with this worker's own sampler until the trial budget is used up."""
    setup, context = run.setup, run.context
    reference = Reference.from_study(run.study)  # the parent recorded it before starting the workers
    objective = Objective(context, reference, setup.location, run.storage, setup.out_dir,
                          functools.partial(run.steps.record, run.index))
    optimize(run.study, objective, SAMPLER_REPEATS * setup.trials,
             [budget_callback(setup.trials, not setup.location.shared),
              _stop_when(lambda: os.getppid() != run.parent), stop_on_signal(run.signals)])


TRIALS = WorkerPhase(_optimize_trials)


def run_worker(setup: WorkerSetup, index: int, gpu: str | None, parent: int, steps: WorkerSteps,
               phase: WorkerPhase) -> None:
    """One ``--jobs`` worker process running ``phase`` with its own context; ``gpu`` (an entry of the parent's
    CUDA_VISIBLE_DEVICES) becomes the only GPU it sees."""
    device = setup.device
    if gpu is not None:  # before anything initializes CUDA in this process
        os.environ["CUDA_VISIBLE_DEVICES"] = gpu
        device = "cuda"
    torch.set_num_threads(setup.threads)
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    hold_worker_lock(setup.out_dir)
    _stop_when_orphaned(parent)
    # the parent reports the interruption
    with (Runtime(KernelRunner(setup.kernels)).as_default(), stop_signals() as signals, quiet_optuna_interrupts(),
          contextlib.suppress(KeyboardInterrupt)):
        context = SearchContext.create(*setup.context, device, proxy_seeds=setup.proxy_seeds, compile=setup.compile)
        context.settings = setup.settings
        context.checkpoints = setup.out_dir / CHECKPOINTS
        storage = setup.location.open()
        study = load_study(context, storage, setup.location, index)
        try:
            phase.run(WorkerRun(setup, index, parent, study, context, storage, steps, signals))
        except (Exception, DiskFull) as error:
            full = full_disk(error)
            if full is not None:
                sys.exit(full.errno)  # the parent reports it (worker_disk_full), in one line
            if isinstance(error, PrecsearchError):  # the storage lost for good: one line, not a traceback
                log.log(logging.DEBUG if phase.replayed else logging.ERROR, "worker %d: %s", index, error)
                raise SystemExit(2) from None
            raise
        finally:
            steps.clear(index)


def worker_disk_full(exitcode: int | None, out_dir: Path) -> None:
    """Raise the OSError of a worker that stopped on a full disk (it exits with the errno: ENOSPC, EDQUOT or
    EFBIG, which no other exit of a worker gives)."""
    if exitcode in FULL_ERRNOS:
        raise OSError(exitcode, os.strerror(exitcode), f"{out_dir} (in a worker process)")


def _stop_when_orphaned(parent: int) -> None:
    """A worker whose parent died (kill -9) SIGTERMs itself, so its running trial is marked interrupted
    at once instead of training on with nobody to export its results."""
    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(0.5)
        os.kill(os.getpid(), signal.SIGTERM)

    threading.Thread(target=watch, name="parent-watch", daemon=True).start()


def worker_gpus(jobs: int, cuda: bool) -> list[str | None]:
    """The GPU each of ``jobs`` workers sees: the visible GPUs in turn; None for every worker on the CPU."""
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
