"""A throwaway PostgreSQL server on a free local port, for the tests and the workers benchmark.

``local_postgres()`` runs ``initdb`` and ``pg_ctl`` from the server binaries on PATH (or the newest
``/usr/lib/postgresql/<version>/bin`` of the Debian package) in a fresh temporary folder, listening on
127.0.0.1 only, with trust authentication for the ``postgres`` user, and yields a SQLAlchemy URL for
psycopg 3 (``local_server()`` yields the server itself, which can be stopped and started again). The
server is stopped and its folder removed on exit. PostgreSQL refuses to run as root, so under root the
commands run as the ``postgres`` system user (``runuser``) and the folder is handed to it.

Anything that prevents a server from starting raises ``PostgresUnavailable`` with a one-line reason.
"""

from __future__ import annotations

import contextlib
import os
import pwd
import shutil
import socket
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

SERVER_USER = "postgres"


class PostgresUnavailable(RuntimeError):
    """No local PostgreSQL server can be started here (the message says why)."""


def server_binaries() -> Path | None:
    """The folder holding initdb and pg_ctl, or None."""
    found = shutil.which("pg_ctl")
    if found and shutil.which("initdb"):
        return Path(found).resolve().parent
    versions = sorted(Path("/usr/lib/postgresql").glob("*/bin/pg_ctl"), key=lambda p: int(p.parent.parent.name))
    return versions[-1].parent if versions else None


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def _run(command: list[str], prefix: list[str]) -> None:
    done = subprocess.run([*prefix, *command], capture_output=True, text=True, timeout=120)
    if done.returncode != 0:
        lines = (done.stderr or done.stdout).strip().splitlines() or [f"exit {done.returncode}"]
        raise PostgresUnavailable(f"{Path(command[0]).name} failed: {lines[-1]}")


class LocalPostgres:
    """A running throwaway server: its ``url``, and ``stop``/``start`` to take it away and bring it back (the
    tests of a database restart under running workers)."""

    def __init__(self, binaries: Path, data: Path, log: Path, options: str, prefix: list[str], url: str) -> None:
        self.binaries, self.data, self.log, self.options, self.prefix, self.url = (
            binaries, data, log, options, prefix, url)

    def start(self) -> None:
        _run([str(self.binaries / "pg_ctl"), "-D", str(self.data), "-l", str(self.log), "-o", self.options, "-w",
              "-t", "60", "start"], self.prefix)

    def stop(self, mode: str = "fast") -> None:
        """``pg_ctl stop -m mode``: "immediate" is a crash (no shutdown checkpoint; recovery on the next start)."""
        _run([str(self.binaries / "pg_ctl"), "-D", str(self.data), "-m", mode, "-w", "stop"], self.prefix)


@contextlib.contextmanager
def local_postgres() -> Iterator[str]:
    """Start a server, yield ``postgresql+psycopg://postgres@127.0.0.1:PORT/postgres``, stop it."""
    with local_server() as server:
        yield server.url


@contextlib.contextmanager
def local_server() -> Iterator[LocalPostgres]:
    """Start a server, yield it (``LocalPostgres``), stop it and remove its folder."""
    binaries = server_binaries()
    if binaries is None:
        raise PostgresUnavailable("no PostgreSQL server binaries (initdb, pg_ctl) on PATH or in "
                                  "/usr/lib/postgresql; install the Debian package postgresql")
    prefix: list[str] = []
    owner = None
    if os.geteuid() == 0:
        try:
            owner = pwd.getpwnam(SERVER_USER)
        except KeyError:
            raise PostgresUnavailable(f"running as root and there is no {SERVER_USER!r} user to run the server "
                                      "as (the Debian package postgresql creates it)") from None
        prefix = ["runuser", "-u", SERVER_USER, "--"]
    folder = Path(tempfile.mkdtemp(prefix="precsearch-pg-"))
    if owner is not None:
        os.chown(folder, owner.pw_uid, owner.pw_gid)
    data, log = folder / "data", folder / "server.log"
    port = free_port()
    options = f"-p {port} -k {folder} -c listen_addresses=127.0.0.1 -c fsync=off -c max_connections=200"
    server = LocalPostgres(binaries, data, log, options, prefix,
                           f"postgresql+psycopg://{SERVER_USER}@127.0.0.1:{port}/postgres")
    started = False
    try:
        _run([str(binaries / "initdb"), "-D", str(data), "-U", SERVER_USER, "--auth=trust", "-E", "UTF8",
              "--no-sync"], prefix)
        server.start()
        started = True
        yield server
    finally:
        if started:
            subprocess.run([*prefix, str(binaries / "pg_ctl"), "-D", str(data), "-m", "fast", "-w", "stop"],
                           capture_output=True, timeout=120)
        shutil.rmtree(folder, ignore_errors=True)
