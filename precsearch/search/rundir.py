"""A run directory owned by one search at a time, and searches that stop cleanly on SIGINT / SIGTERM.

``RunLock`` is an exclusive ``flock`` on ``.precsearch.lock`` in the run directory, holding the owner's host
and pid for the refusal message. The kernel drops the lock when its owner dies however it dies (kill -9
included), so a lock left by a dead process is recognised as stale by simply being free, with no pid guess.
The worker processes of ``--jobs`` hold a shared lock on ``.precsearch.workers.lock`` for as long as they
live, so a new search is refused while the workers of a killed parent still train.

``StopSignals`` turns the first SIGINT or SIGTERM into a ``SearchStop`` (a KeyboardInterrupt) raised in the
main thread, except where raising is unsafe: inside a finalizer (``__del__``: Python would print and drop it)
or inside Optuna's storage code (a journal lock half released). There the signal is only recorded, and the
search raises it at its next safe point (``check()``, every few proxy steps) or stops after the trial. Later
signals are recorded, not raised, so the results are written out in peace.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import logging
import os
import re
import signal
import socket
import threading
from collections.abc import Iterator
from pathlib import Path
from types import FrameType
from typing import Any

from precsearch.errors import PrecsearchError
from precsearch.files import TEMP_SUFFIX, user_file_mode

__all__ = ["LOCK_FILES", "RunLock", "SearchStop", "StopSignals", "hold_worker_lock", "quiet_optuna_interrupts",
           "remove_stale_journal_lock", "remove_temporaries"]

log = logging.getLogger(__name__)

LOCK_NAME = ".precsearch.lock"
WORKERS_LOCK_NAME = ".precsearch.workers.lock"
LOCK_FILES = (LOCK_NAME, WORKERS_LOCK_NAME)


def owner_id() -> str:
    """host:pid of this process (computed per call: a forked child is another owner)."""
    return f"{socket.gethostname()}:{os.getpid()}"


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
    """Exclusive ownership of a run directory by this process (see the module docstring)."""

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
    """Delete the ``.<name>.*.tmp`` files an atomic write left when its process was killed mid-write.

    Called only under the run lock, when no other process of this run can be writing."""
    removed = []
    for folder in (out_dir, out_dir / "policies", out_dir / "trials"):
        for temp in folder.glob(f".*{TEMP_SUFFIX}") if folder.is_dir() else ():
            temp.unlink(missing_ok=True)
            removed.append(temp)
    if removed:
        log.warning("removed %d temporary file(s) a killed process left in %s", len(removed), out_dir)
    return removed


class SearchStop(KeyboardInterrupt):
    """A search stopped by a signal; ``signum`` says which (the exit status is 128 + signum)."""

    def __init__(self, signum: int = signal.SIGINT) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


_UNSAFE_PACKAGES = (f"{os.sep}optuna{os.sep}", f"{os.sep}sqlalchemy{os.sep}")


def _unsafe(frame: FrameType | None) -> bool:
    """Whether an exception raised at this point could be lost or leave shared state half-changed: inside a
    ``__del__`` (Python prints and drops it) or inside Optuna's or SQLAlchemy's code (a journal lock half
    released, a storage write half done)."""
    while frame is not None:
        code = frame.f_code
        if code.co_name == "__del__" or any(package in code.co_filename for package in _UNSAFE_PACKAGES):
            return True
        frame = frame.f_back
    return False


class StopSignals:
    """SIGINT and SIGTERM handlers for the duration of a ``with`` block (main thread only); see the module
    docstring. ``received`` is the first signal number seen, or None."""

    SIGNALS = (signal.SIGINT, signal.SIGTERM)

    def __init__(self) -> None:
        self.received: int | None = None
        self._raised = False
        self._previous: dict[int, Any] = {}

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if self.received is None:
            self.received = signum
        if self._raised or _unsafe(frame):
            return
        self._raised = True
        raise SearchStop(signum)

    def check(self) -> None:
        """Raise the recorded stop now if the handler could not (it arrived inside a finalizer)."""
        if self.received is not None and not self._raised:
            self._raised = True
            raise SearchStop(self.received)

    @contextlib.contextmanager
    def held(self) -> Iterator[None]:
        """Record signals without raising them for the block (files being written must be finished)."""
        raised, self._raised = self._raised, True
        try:
            yield
        finally:
            self._raised = raised or self.received is not None

    def __enter__(self) -> StopSignals:
        if threading.current_thread() is threading.main_thread():
            for signum in self.SIGNALS:
                self._previous[signum] = signal.signal(signum, self._handle)
        return self

    def __exit__(self, *exc: Any) -> None:
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)
        self._previous.clear()


@contextlib.contextmanager
def quiet_optuna_interrupts() -> Iterator[None]:
    """Optuna logs a trial stopped by Ctrl-C as a failure with its full traceback (and then its value); the
    search reports the interruption in one line instead, so those records are dropped. Other failures are
    still logged."""
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
    """Optuna's journal lock (``<journal>.lock``, a symlink) left by a process killed while holding it would
    make the next process wait 30 s and then break it. Called only under the run lock, with no worker alive,
    so nobody can hold it."""
    lock = journal.with_name(journal.name + ".lock")
    if lock.is_symlink() or lock.exists():
        lock.unlink()
        log.warning("removed the journal lock %s that a killed process left", lock)
