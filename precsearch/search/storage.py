"""Where a study lives: a PostgreSQL or SQLite URL or a journal file, opened with the heartbeat and retries
every worker uses, repaired after a torn write, and locked across all processes that share it.

A journal's records are chained by checksums (``JournalFile``), so one changed by hand is refused on opening,
naming its line. A PostgreSQL storage outlives a database restart or a dropped connection
(``RetryingRDBStorage``): every call retries with backoff for up to ``STORAGE_OUTAGE`` seconds, so a worker goes
on where it was; past that, or past as long a wait for a study lock a stopped worker keeps, it stops with one
line that says how to continue.
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import hashlib
import importlib.util
import json
import logging
import math
import os
import re
import socket
import time
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import optuna
import sqlalchemy
from optuna.storages import JournalStorage, RDBStorage
from optuna.storages.journal import JournalFileBackend, JournalFileSymlinkLock
from optuna.storages.journal._storage import JournalOperation
from sqlalchemy.engine import make_url

from precsearch.errors import PrecsearchError, find_cause, first_line
from precsearch.search.settings import DEFAULT_HEARTBEAT
from precsearch.search.trials import RetryStaleTrial

__all__ = ["JOURNAL_NAME", "STORAGE_OUTAGE", "STUDY_NAME", "RetryingRDBStorage", "StudyLocation", "owner_id"]

log = logging.getLogger(__name__)

STUDY_NAME = "precsearch"
JOURNAL_NAME = "study.journal"
POSTGRES_DRIVER = "postgresql+psycopg"
MAX_RETRIES = 3  # times a trial whose worker died is queued again
STORAGE_OUTAGE = 120.0  # seconds a worker retries a lost database, or waits for a lock a stopped worker keeps
MAX_BACKOFF = 8.0  # seconds between two tries, at most

T = TypeVar("T")


@dataclass(frozen=True)
class StudyLocation:
    """Where a study lives: a storage (URL or journal file path), the study's name in it, and the heartbeat. A
    ``shared`` study (``--study-name``) is joined by name from any number of processes on any number of hosts,
    so only Optuna's heartbeat decides that a RUNNING trial is dead: one silent for ``3 x heartbeat`` seconds is
    failed and queued again (``trials.RetryStaleTrial``) by whichever worker notices first."""

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
            journal = JournalFile(path)
            journal.check()
            return JournalStorage(journal)
        except PrecsearchError:
            raise
        except Exception as error:  # drivers raise anything from ArgumentError to OperationalError
            reason = first_line(error)
            fix = ("check the URL or path (leave --storage out to use a journal file in --out)" if "://" in self.target
                   else "check the file and the permissions of its folder")
            raise PrecsearchError(f"cannot open study storage {self.shown}: {reason}; {fix}") from None

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
            # the session names this worker (host:pid) in pg_stat_activity, so a held lock can be traced to it
            engine_kwargs["connect_args"] = {"connect_timeout": 10, "application_name": f"precsearch {owner_id()}"}
        kind = RetryingRDBStorage if backend == "postgresql" else RDBStorage  # SQLite has no server to lose

        def create() -> RDBStorage:
            with warnings.catch_warnings():  # Optuna marks the heartbeat and its retry callback experimental
                warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
                storage = kind(url.render_as_string(hide_password=False), engine_kwargs=engine_kwargs,
                               heartbeat_interval=self.heartbeat, grace_period=3 * self.heartbeat,
                               heartbeat_stale_trial_callback=RetryStaleTrial(MAX_RETRIES))
            if isinstance(storage, RetryingRDBStorage):
                storage.shown = self.shown
            return storage

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
        """Exclusive among all processes using this study: on PostgreSQL an advisory lock held for one transaction
        (released when a killed worker's connection drops), on SQLite and journal files (one host's) an flock."""
        if isinstance(storage, RetryingRDBStorage):
            connection = self._advisory_lock(storage)
            try:
                yield
            finally:
                try:
                    connection.rollback()  # ends the transaction, and the lock with it
                except sqlalchemy.exc.DBAPIError:
                    connection.invalidate()  # the connection dropped: the server released the lock with it
                connection.close()
            return
        path = make_url(self.target).database if "://" in self.target else self.target
        with open(path, "rb") as handle:
            fcntl.flock(handle, fcntl.LOCK_EX)
            yield

    def _advisory_lock(self, storage: RetryingRDBStorage) -> sqlalchemy.Connection:
        """The study's advisory lock, on a connection of its own, in a transaction the caller ends. Workers hold it
        for a moment, so a waiter looks who holds it every ``LOCK_POLL`` seconds: a holder that kept it a heartbeat
        is named in a WARNING; a stopped process keeps it for ever, so one that kept it ``STORAGE_OUTAGE`` seconds
        ends the wait in a PrecsearchError naming it."""
        lock_id = int(hashlib.sha1(self.study_name.encode()).hexdigest()[:15], 16)
        warned: str | None = None
        while True:
            connection = storage.retried(lambda: _try_lock(storage, lock_id))
            if connection is not None:
                return connection
            holder = storage.retried(lambda: _lock_holder(storage, lock_id))
            if holder is None:  # released between the two
                continue
            who, backend, held = holder
            if held >= STORAGE_OUTAGE:
                raise PrecsearchError(f"the lock of study {self.study_name} in {self.shown} has been held for "
                                      f"{held:.0f} s by {who}, a worker that is stopped or hung; stop that process "
                                      f"or end its session (SELECT pg_terminate_backend({backend})), then start this "
                                      "worker again")
            if held >= self.heartbeat and who != warned:
                warned = who
                log.warning("waiting for the lock of study %s, held for %.0f s by %s; giving up once it is held "
                            "for %.0f s", self.study_name, held, who, STORAGE_OUTAGE)


LOCK_POLL = 1.0  # seconds a worker waits in the server's queue for the study lock before it looks who holds it
LOCK_NOT_AVAILABLE = "55P03"  # PostgreSQL's SQLSTATE for a lock wait that reached lock_timeout


def owner_id() -> str:
    """host:pid of this process (computed per call: a forked child is another owner), as run-directory locks
    and PostgreSQL sessions name their holder."""
    return f"{socket.gethostname()}:{os.getpid()}"


def _try_lock(storage: RetryingRDBStorage, lock_id: int) -> sqlalchemy.Connection | None:
    """A connection holding the advisory lock ``lock_id`` in its transaction, or None after ``LOCK_POLL`` s."""
    connection = storage.engine.connect()
    try:
        connection.execute(sqlalchemy.text("SELECT set_config('lock_timeout', :wait, true)"),
                           {"wait": f"{LOCK_POLL * 1000:.0f}ms"})
        connection.execute(sqlalchemy.text("SELECT pg_advisory_xact_lock(:id)"), {"id": lock_id})
    except sqlalchemy.exc.OperationalError as error:
        connection.close()
        if getattr(error.orig, "sqlstate", None) == LOCK_NOT_AVAILABLE:
            return None
        raise
    except BaseException:
        connection.close()
        raise
    return connection


def _lock_holder(storage: RetryingRDBStorage, lock_id: int) -> tuple[str, int, float] | None:
    """Who holds the advisory lock ``lock_id`` (its session's application name, backend pid and client address),
    that backend's pid, and for how many seconds (since its transaction began); None when nobody does."""
    query = sqlalchemy.text(
        "SELECT a.pid, a.application_name, host(a.client_addr), "
        "EXTRACT(EPOCH FROM clock_timestamp() - a.xact_start) FROM pg_locks l "
        "JOIN pg_stat_activity a ON a.pid = l.pid JOIN pg_database d ON d.oid = l.database "
        "WHERE l.locktype = 'advisory' AND l.granted AND d.datname = current_database() "
        "AND l.classid::bigint = :high AND l.objid::bigint = :low AND l.objsubid = 1")
    with storage.engine.connect() as connection:
        row = connection.execute(query, {"high": lock_id >> 32, "low": lock_id & 0xFFFFFFFF}).first()
    if row is None:
        return None
    pid, application, address, held = row
    session = f"PostgreSQL backend {pid}" + (f" from {address}" if address else "")
    who = f"{application} ({session})" if application else session
    return who, pid, float(held or 0.0)


def _dropped(error: BaseException) -> bool:
    """Whether ``error`` (or what caused it; Optuna wraps SQLAlchemy's errors) is a lost connection or server."""
    def lost_connection(cause: BaseException) -> bool:
        return isinstance(cause, (sqlalchemy.exc.OperationalError, sqlalchemy.exc.InterfaceError)) or (
            isinstance(cause, sqlalchemy.exc.DBAPIError) and cause.connection_invalidated)

    return find_cause(error, lost_connection) is not None


class RetryingRDBStorage(RDBStorage):
    """Optuna's RDB storage whose every database call survives a server restart or a dropped connection (see
    the module docstring); past ``STORAGE_OUTAGE`` the storage is ``lost`` for good. For ``grace_period`` seconds
    after an outage no trial is judged stale: the other workers, which lost the server too, must beat again first."""

    shown = "the study storage"  # the URL, password masked, for messages (StudyLocation.open sets it)
    lost: str | None = None  # why the storage was given up, once it was
    back_since = float("-inf")  # time.monotonic() when the server came back after an outage; inf while away

    def retried(self, call: Callable[[], T]) -> T:
        """``call()``, tried again while the database is unreachable (see the class docstring)."""
        deadline, delay = None, 0.5
        while True:
            if self.lost is not None:
                raise PrecsearchError(self.lost)
            try:
                result = call()
            except Exception as error:
                if not _dropped(error):
                    raise
                self._unreachable()
                now = time.monotonic()
                deadline = deadline or now + STORAGE_OUTAGE
                if now >= deadline:
                    reason = first_line(error.__cause__ or error)
                    self.lost = (f"the study storage {self.shown} was unreachable for {STORAGE_OUTAGE:.0f} s "
                                 f"({reason}); start this worker again once the database is back (with "
                                 "--resume for a study without --study-name): it continues where it stopped")
                    raise PrecsearchError(self.lost) from None
                time.sleep(min(delay, deadline - now))
                delay = min(2 * delay, MAX_BACKOFF)
                continue
            self._reached()
            return result

    def _unreachable(self) -> None:
        if self.back_since != math.inf:
            self.back_since = math.inf
            log.warning("lost the connection to %s; retrying for up to %.0f s", self.shown, STORAGE_OUTAGE)

    def _reached(self) -> None:
        if self.back_since == math.inf:
            self.back_since = time.monotonic()
            log.warning("%s is reachable again; going on", self.shown)

    def record_heartbeat(self, trial_id: int) -> None:
        try:
            super().record_heartbeat(trial_id)
        except Exception as error:
            if not _dropped(error):
                raise
            self._unreachable()
            return
        self._reached()

    def _get_stale_trial_ids(self, study_id: int) -> list[int]:
        stale = self.retried(lambda: super(RetryingRDBStorage, self)._get_stale_trial_ids(study_id))
        return [] if time.monotonic() - self.back_since < (self.grace_period or 0) else stale


# every RDBStorage method that talks to the database, the private ones Optuna's cache calls included
_RETRIED = ("create_new_study", "delete_study", "set_study_user_attr", "set_study_system_attr",
            "get_study_id_from_name", "get_study_name_from_id", "get_study_directions", "get_study_user_attrs",
            "get_study_system_attrs", "get_trial_user_attrs", "get_trial_system_attrs", "get_all_studies",
            "create_new_trial", "_create_new_trial", "set_trial_param", "_set_trial_param", "get_trial_param",
            "set_trial_state_values", "set_trial_intermediate_value", "set_trial_user_attr",
            "set_trial_system_attr", "get_trial_id_from_study_id_trial_number", "get_trial", "get_all_trials",
            "_get_trials", "get_best_trial", "_get_best_trial_id")


def _retrying(name: str) -> Callable[..., Any]:
    method = getattr(RDBStorage, name)

    @functools.wraps(method)
    def call(self: RetryingRDBStorage, *args: Any, **kwargs: Any) -> Any:
        return self.retried(lambda: method(self, *args, **kwargs))

    return call


for _name in _RETRIED:
    setattr(RetryingRDBStorage, _name, _retrying(_name))


class JournalFile(JournalFileBackend):
    """Optuna's journal file, whose records are chained by a checksum and whose appends never leave a torn record.

    Every record precsearch appends ends in a ``"precsearch_sum"`` field, a hash of it and of the record before
    it, so a record edited, removed, duplicated, added or moved by hand breaks the chain, and ``check`` refuses
    the journal naming the line (Optuna would replay any well-formed record). It guards against accidents, not
    against someone recomputing the chain. Records of an older precsearch, without the field, are accepted only
    before the first one with it. A failed append (a full disk) is cut back to where it began, so that what is
    appended later starts on a line of its own; its OSError names the journal."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.append_lock = JournalFileSymlinkLock(str(path))  # Optuna's default lock, kept at hand
        super().__init__(str(path), self.append_lock)

    def append_logs(self, logs: list[dict[str, Any]]) -> None:
        self.append_lock.acquire()
        try:
            fd = os.open(self.path, os.O_RDWR | os.O_APPEND)
            try:
                start = os.lseek(fd, 0, os.SEEK_END)
                data = _chained(logs, _last_checksum(fd, start))
                try:
                    written = 0
                    while written < len(data):
                        written += os.write(fd, data[written:])
                    os.fsync(fd)
                except OSError as error:
                    os.ftruncate(fd, start)
                    raise OSError(error.errno, error.strerror, str(self.path)) from None
            finally:
                os.close(fd)
        finally:
            self.append_lock.release()

    def check(self) -> None:
        """Drop a torn last line (a write cut by kill -9), and refuse a journal with a line that is not the record
        precsearch wrote there, naming the line; under the journal's lock, so that a record another worker is
        appending is not taken for a torn one."""
        self.append_lock.acquire()
        try:
            _check_journal(self.path)
        finally:
            self.append_lock.release()


CHECKSUM = "precsearch_sum"  # the last field of every record precsearch appends (JournalFile)
_CHECKSUM_FIELD = re.compile(rb',"' + CHECKSUM.encode() + rb'":"([0-9a-f]{16})"\}\Z')
_OPERATIONS = frozenset(operation.value for operation in JournalOperation)


def _checksum(previous: str, body: bytes) -> str:
    """The checksum of a record whose JSON without its closing brace is ``body``, after a record of checksum
    ``previous`` ("" for the first record, or one after a record without a checksum)."""
    return hashlib.sha256(previous.encode() + body).hexdigest()[:16]


def _chained(logs: list[dict[str, Any]], previous: str) -> bytes:
    """The lines of ``logs``, each ending in its checksum, chained on from a record of checksum ``previous``."""
    lines = []
    for record in logs:
        body = json.dumps(record, separators=(",", ":")).encode()[:-1]
        previous = _checksum(previous, body)
        lines.append(body + f',"{CHECKSUM}":"{previous}"}}\n'.encode())
    return b"".join(lines)


def _stated_checksum(line: bytes) -> tuple[str, bytes] | None:
    """The checksum a line (without its newline) ends in, and the record's body it covers; None without one."""
    match = _CHECKSUM_FIELD.search(line)
    return None if match is None else (match.group(1).decode(), line[:match.start()])


def _last_checksum(fd: int, end: int) -> str:
    """The checksum of the journal open as ``fd``'s last record (ending at byte ``end``), or "" without one."""
    tail = os.pread(fd, min(end, 64), max(0, end - 64))
    stated = _stated_checksum(tail[:-1]) if tail.endswith(b"\n") else None
    return "" if stated is None else stated[0]


def _check_journal(path: Path) -> None:
    """What ``JournalFile.check`` does, under the journal's lock."""
    if not path.is_file() or path.stat().st_size == 0:
        return
    data = path.read_bytes()
    keep = data.rfind(b"\n") + 1
    if keep < len(data):
        os.truncate(path, keep)
        log.warning("journal %s ended in a partial record (interrupted write); dropped %d bytes",
                    path, len(data) - keep)
    lines = data[:keep].split(b"\n")[:-1]
    previous: str | None = None  # the checksum of the line before; None while no line had one
    unchecked = 0
    for number, line in enumerate(lines, start=1):
        problem = _record_problem(line)
        stated = _stated_checksum(line)
        if problem:
            problem = f"is garbled ({problem})"
        elif stated is None and previous is not None:
            problem = "has no checksum, unlike the lines before it (it was added by hand or by another program)"
        elif stated is not None and stated[0] != _checksum(previous or "", stated[1]):
            problem = (f"is not the record precsearch wrote {f'after line {number - 1}' if number > 1 else 'first'} "
                       "(its checksum differs: a record was edited, removed, duplicated, added or moved)")
        if problem:
            keep_part = (f"or keep the {number - 1} whole record(s) before it (head -n {number - 1}) and run again "
                         "with --resume, which reruns what the rest recorded") if number > 1 else (
                "or start again in another --out")
            raise PrecsearchError(f"journal {path} is damaged: line {number} of {len(lines)} {problem}; restore "
                                  f"the file, {keep_part}")
        if stated is None:
            unchecked += 1
        previous = None if stated is None else stated[0]
    if unchecked:
        log.warning("journal %s: its first %d record(s) have no checksum (an older precsearch wrote them), so "
                    "edits to them cannot be detected", path, unchecked)


def _record_problem(line: bytes) -> str:
    """What is wrong with one line of a journal ('' for a record)."""
    try:
        record = json.loads(line)
    except json.JSONDecodeError as error:
        return f"{error.msg} at byte {error.pos + 1}"
    except UnicodeDecodeError:
        return "not UTF-8 text"
    if not isinstance(record, dict) or "op_code" not in record:
        return "not an Optuna journal record"
    operation = record["op_code"]
    return "" if isinstance(operation, int) and operation in _OPERATIONS else (
        f"op_code {operation!r} is no journal operation")
