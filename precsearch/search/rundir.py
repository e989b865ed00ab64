"""A run directory owned by one search at a time, and what a search stopped by a signal leaves in it.

``RunLock`` is an exclusive ``flock`` on ``.precsearch.lock`` in the run directory, holding the owner's host
and pid for the refusal message. The kernel drops the lock when its owner dies however it dies (kill -9
included), so a stale lock is simply free, with no pid guess. The worker processes of ``--jobs`` hold a shared
lock on ``.precsearch.workers.lock`` for as long as they live, so a new search is refused while the workers of a
killed parent still train. ``check_resume`` decides whether a search may use --out; ``run.json`` records the
config and where the study lives (``write_run_file``).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import logging
import os
import re
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import optuna

from precsearch.config.reading import load_json_object
from precsearch.errors import PrecsearchError
from precsearch.files import TEMP_SUFFIX, atomic_write_text, user_file_mode
from precsearch.search.calibration import recorded_calibration
from precsearch.search.confirmation import recorded_confirmation
from precsearch.search.storage import StudyLocation, owner_id

__all__ = ["CHECKPOINTS", "LOCK_FILES", "RUN_FILE", "SEARCH_FORMAT", "RunLock", "check_journal_kept", "check_resume",
           "earlier_search", "hold_worker_lock", "lost_study", "make_run_dir", "missing_lock_files",
           "quiet_optuna_interrupts", "remove_new_run_dir", "remove_stale_journal_lock", "remove_temporaries",
           "write_run_file"]

log = logging.getLogger(__name__)

LOCK_NAME = ".precsearch.lock"
WORKERS_LOCK_NAME = ".precsearch.workers.lock"
LOCK_FILES = (LOCK_NAME, WORKERS_LOCK_NAME)
RUN_FILE = "run.json"
# What a recorded search means (calibration, rungs, seeds, budget): raised when that changes, so that a search
# recorded by an earlier precsearch is refused with a line that says so, not resumed under other rules.
SEARCH_FORMAT = 4  # 3: rungs held to the reference at half their step; 4: confirmation decays from L
CHECKPOINTS = "checkpoints"  # the runs' checkpoints (precsearch.train.continuing), removed as each run is recorded


def _open_lock(path: Path) -> int:
    return os.open(path, os.O_RDWR | os.O_CREAT, user_file_mode())


def _try_flock(fd: int, mode: int) -> bool:
    try:
        fcntl.flock(fd, mode | fcntl.LOCK_NB)
    except OSError as error:
        if error.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
            return False
        raise
    return True


class RunLock:
    """Exclusive ownership of a run directory by this process (see the module docstring). A process refused the
    lock removes nothing, not even a folder it created a moment ago: the owner got in first and writes there."""

    def __init__(self, out_dir: Path) -> None:
        self.out_dir = out_dir
        self.path = out_dir / LOCK_NAME
        self._fd: int | None = None

    def acquire(self) -> None:
        """Take the lock or raise a one-line PrecsearchError naming the owner; never blocks."""
        fd = _open_lock(self.path)
        if not _try_flock(fd, fcntl.LOCK_EX):
            owner = os.pread(fd, 200, 0).decode(errors="replace").strip() or "another process"
            os.close(fd)
            raise PrecsearchError(f"{self.out_dir} is in use by the search of {owner}; wait for it to end or stop "
                                  "it, then pass --resume (or choose another --out)")
        previous = os.pread(fd, 200, 0).decode(errors="replace").strip()
        workers = _open_lock(self.out_dir / WORKERS_LOCK_NAME)
        try:
            if not _try_flock(workers, fcntl.LOCK_EX):
                os.close(fd)
                raise PrecsearchError(f"worker processes of the search of {previous or 'another process'} still "
                                      f"run on {self.out_dir}; stop them, then pass --resume")
        finally:
            os.close(workers)
        if previous:
            log.info("%s: the lock of %s was stale (that process is gone); taking it over", self.out_dir, previous)
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{owner_id()}\n".encode(), 0)
        self._fd = fd

    def release(self) -> None:
        """Drop the lock; the file stays (unlinking it would let two processes lock two different files)."""
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    def __enter__(self) -> RunLock:
        self.acquire()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.release()


def hold_worker_lock(out_dir: Path) -> int:
    """A ``--jobs`` worker's shared lock on the run directory, held until the process ends (the fd is kept)."""
    fd = _open_lock(out_dir / WORKERS_LOCK_NAME)
    fcntl.flock(fd, fcntl.LOCK_SH)
    return fd


def remove_temporaries(out_dir: Path) -> list[Path]:
    """Delete the ``.<name>.*.tmp`` files an atomic write left when its process was killed mid-write (under the
    run lock: no other process of this run can be writing)."""
    removed = []
    for folder in (out_dir, out_dir / "policies", out_dir / "trials", out_dir / CHECKPOINTS):
        for temp in folder.glob(f".*{TEMP_SUFFIX}") if folder.is_dir() else ():
            temp.unlink(missing_ok=True)
            removed.append(temp)
    if removed:
        log.warning("removed %d temporary file(s) a killed process left in %s", len(removed), out_dir)
    return removed


@contextlib.contextmanager
def quiet_optuna_interrupts() -> Iterator[None]:
    """Drop Optuna's records of a trial stopped by Ctrl-C (a failure with its full traceback, then its value): the
    search reports the interruption in one line."""
    logger = logging.getLogger("optuna.study._optimize")
    interrupted: set[str] = set()

    def keep(record: logging.LogRecord) -> bool:
        trial = re.match(r"Trial (\d+) failed", record.getMessage())
        if record.exc_info and isinstance(record.exc_info[1], KeyboardInterrupt):
            if trial:
                interrupted.add(trial.group(1))
            return False
        return not (trial and trial.group(1) in interrupted)

    logger.addFilter(keep)
    try:
        yield
    finally:
        logger.removeFilter(keep)


def remove_stale_journal_lock(journal: Path) -> None:
    """Optuna's journal lock (``<journal>.lock``) left by a killed process would make the next one wait 30 s and
    then break it; under the run lock, with no worker alive, nobody can hold it."""
    lock = journal.with_name(journal.name + ".lock")
    if lock.is_symlink() or lock.exists():
        lock.unlink()
        log.warning("removed the journal lock %s that a killed process left", lock)


def write_run_file(out_dir: Path, run_config: dict[str, Any], location: StudyLocation, study: optuna.Study) -> None:
    """run.json: the config, where the study lives, and the calibration and confirmation once recorded."""
    calibration, confirmation = recorded_calibration(study.user_attrs), recorded_confirmation(study.user_attrs)
    extra: dict[str, Any] = {}
    if calibration is not None:
        extra.update(proxy_length=calibration.length, calibration=calibration.to_dict())
    if confirmation is not None:
        extra["confirmation"] = confirmation.summary()
    atomic_write_text(out_dir / RUN_FILE, json.dumps(
        {**run_config, "storage": location.shown, "study": location.study_name, **extra}, indent=2))


def make_run_dir(out_dir: Path) -> bool:
    """Create ``out_dir`` (and its parents); True when this call created it, so only this call may remove it."""
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    try:
        out_dir.mkdir()
    except FileExistsError:
        if not out_dir.is_dir():
            raise PrecsearchError(f"--out {out_dir} is not a directory; give a folder") from None
        return False
    return True


def missing_lock_files(out_dir: Path) -> list[Path]:
    """The lock files ``out_dir`` lacks: a search that takes the lock and then cannot start removes them."""
    return [out_dir / name for name in LOCK_FILES if not (out_dir / name).exists()]


_RESULTS = ("trials.csv", "pareto.csv", "best.json", RUN_FILE)


def remove_new_run_dir(out_dir: Path) -> None:
    """Undo the folder this call created for a search that could not start, unless it somehow holds results."""
    kept = [name for name in _RESULTS if (out_dir / name).exists()]
    if kept:
        log.warning("%s holds %s: left in place", out_dir, ", ".join(kept))
        return
    shutil.rmtree(out_dir, ignore_errors=True)


def lost_study(out_dir: Path, location: StudyLocation) -> PrecsearchError:
    kept = [name for name in _RESULTS if (out_dir / name).exists()]
    return PrecsearchError(f"cannot resume {out_dir}: study {location.study_name} is missing from {location.shown} "
                           f"(deleted, emptied or cut?) while {', '.join(kept)} remain; restore the storage, or "
                           "start a new search in another --out")


def check_journal_kept(out_dir: Path, location: StudyLocation, resume: bool) -> None:
    """With --resume, a journal file that is gone or empty is refused before opening it (which creates it)."""
    if not resume or location.shared or "://" in location.target:
        return
    journal = Path(location.target)
    if not journal.is_file() or journal.stat().st_size == 0:
        raise lost_study(out_dir, location)


def earlier_search(theirs: dict[str, Any], where: str, fix: str) -> PrecsearchError | None:
    """The refusal of a search recorded (``theirs``: its config) under another ``SEARCH_FORMAT``, else None."""
    recorded = theirs.get("search_format", 1)
    if recorded == SEARCH_FORMAT:
        return None
    return PrecsearchError(f"{where} was recorded by {'an earlier' if recorded < SEARCH_FORMAT else 'a later'} "
                           f"precsearch (search format {recorded}, this one reads {SEARCH_FORMAT}: calibration, "
                           f"rungs, seeds and confirmation follow other rules), so it cannot be resumed; {fix}")


def check_resume(out_dir: Path, resume: bool, config: dict[str, Any], shared: bool) -> None:
    """Rules for --out: a new search needs it empty; --resume needs the same search in it; a worker of a
    shared study may come back to its own --out (same study, same settings) without --resume."""
    run_file = out_dir / RUN_FILE
    if (resume and not shared) or (shared and run_file.is_file()):
        if not run_file.is_file():
            raise PrecsearchError(f"nothing to resume in {out_dir} (no {RUN_FILE}); drop --resume to start a search")
        previous = load_json_object(run_file, "run file", "rebuild it from the study with export_study, or "
                                    "choose another --out")
        earlier = earlier_search(previous, str(out_dir), "start a new search in another --out (its trials.csv, "
                                 "pareto.csv and policies stay readable)")
        if earlier is not None:
            raise earlier
        differ = [key for key in config if previous.get(key) != config[key]]
        if differ:
            raise PrecsearchError(f"{out_dir} holds a search with different {', '.join(differ)}; resume it with "
                                  "the same model, space, data, seed, budget and study, or choose another --out")
    elif out_dir.exists() and any(path.name not in LOCK_FILES for path in out_dir.iterdir()):
        raise PrecsearchError(f"{out_dir} is not empty; pass --resume to continue the search in it, or choose "
                              "another --out")
