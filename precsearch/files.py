"""Writing files so that nothing half-written is ever seen: a temporary file in the same folder, fsync, rename.

The temporary is created with mode 0600 (as ``tempfile.mkstemp`` would); outputs get the mode any other new
file of the user would get (0666 minus the umask), so a shared results folder stays readable by the group.
"""

from __future__ import annotations

import contextlib
import errno
import os
import secrets
from pathlib import Path

from precsearch.errors import find_cause

__all__ = ["DiskFull", "atomic_write_bytes", "atomic_write_text", "full_disk", "user_file_mode"]

TEMP_SUFFIX = ".tmp"
FULL_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EFBIG})  # no space, a quota, the file-size limit


class DiskFull(BaseException):
    """A write inside an Optuna trial found the disk full. A BaseException, so that Optuna's trial runner,
    which handles every Exception by recording the trial as failed (a write to the same full disk), lets it
    through: the trial stays RUNNING in the study and ``--resume`` runs it again. Its cause is the OSError."""


def full_disk(error: BaseException | None) -> OSError | None:
    """The OSError of a full disk, a quota or the file-size limit behind ``error``, if any. Causes and
    contexts are followed: a library that fails while handling it (Optuna recording a trial on the same full
    disk, then asserting) raises something else."""
    return find_cause(error, lambda cause: isinstance(cause, OSError) and cause.errno in FULL_ERRNOS)


def user_file_mode() -> int:
    """0666 minus the process umask (read without changing it for good: os.umask only has a setter)."""
    umask = os.umask(0o022)
    os.umask(umask)
    return 0o666 & ~umask


def atomic_write_text(path: str | os.PathLike[str], text: str) -> None:
    """``atomic_write_bytes`` of ``text`` in UTF-8."""
    atomic_write_bytes(path, text.encode("utf-8"))


def atomic_write_bytes(path: str | os.PathLike[str], data: bytes) -> None:
    """Write ``data`` to ``path`` through ``.<name>.<random>.tmp`` in the same folder, fsync and a rename; on
    any failure (a full disk, a read-only file system, Ctrl-C) the temporary is removed and ``path`` is as
    it was. The folder is created if missing. An OSError names ``path``: the temporary is gone, and a failed
    write names no file."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    # named before it exists: a Ctrl-C between creating the file and learning its name would leave it behind
    temp = path.parent / f".{path.name}.{secrets.token_hex(6)}{TEMP_SUFFIX}"
    try:
        with os.fdopen(os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600), "wb") as out:
            out.write(data)
            out.flush()
            os.fsync(out.fileno())
        os.chmod(temp, user_file_mode())
        os.replace(temp, path)
    except BaseException as error:
        with contextlib.suppress(OSError):
            os.unlink(temp)
        if isinstance(error, OSError):
            raise OSError(error.errno, error.strerror, str(path)) from error
        raise
