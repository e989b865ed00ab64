"""Stopping on SIGINT / SIGTERM without losing the signal.

``StopSignals`` turns the first SIGINT or SIGTERM into a ``SignalStop`` (a KeyboardInterrupt) raised in the
main thread, except where raising is unsafe: inside a finalizer (``__del__``) or inside Optuna's or
SQLAlchemy's code (a journal lock half released). There the signal is only recorded, and the command raises it
at its next safe point (``check()``: the search calls it every few proxy steps). A stop raised where Python
cannot deliver it (a weakref callback run by the garbage collector: Python reports it as unraisable and drops
it) is caught by the block's ``sys.unraisablehook`` and kept for ``check()`` the same way. Later signals are
recorded, not raised, so the results are written out in peace. A search's trials run inside Optuna's
``study.optimize``, so there every signal is recorded; the trainer raises it at its next step
(``raise_recorded_stop``), decay branches and confirmation's long runs included.

One ``StopSignals`` serves a process: ``stop_signals()`` enters a new one, or hands out the one already in force
(the CLI enters it before parsing its arguments, so no moment of a command falls to Python's default handler).
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
from collections.abc import Iterator
from types import FrameType
from typing import Any

__all__ = ["SignalStop", "StopSignals", "raise_recorded_stop", "signals_in_force", "stop_signals"]


class SignalStop(KeyboardInterrupt):
    """A command stopped by a signal; ``signum`` says which (the exit status is 128 + signum)."""

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
        self._previous_hook: Any = None

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if self.received is None:
            self.received = signum
        if self._raised or _unsafe(frame):
            return
        self._raised = True
        raise SignalStop(signum)

    def _unraisable(self, unraisable: Any) -> None:
        """Python dropped an exception it could not raise; if it was our stop, ``check()`` raises it again."""
        if isinstance(unraisable.exc_value, SignalStop):
            self._raised = False
            return
        self._previous_hook(unraisable)

    def check(self) -> None:
        """Raise the recorded stop now if the handler could not (or Python dropped what it raised)."""
        if self.received is not None and not self._raised:
            self._raised = True
            raise SignalStop(self.received)

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
            self._previous_hook, sys.unraisablehook = sys.unraisablehook, self._unraisable
        return self

    def __exit__(self, *exc: Any) -> None:
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)
        self._previous.clear()
        if self._previous_hook is not None:
            sys.unraisablehook, self._previous_hook = self._previous_hook, None


_in_force: list[StopSignals] = []  # the process's StopSignals while its block runs


@contextlib.contextmanager
def stop_signals() -> Iterator[StopSignals]:
    """The ``StopSignals`` in force in this process, or a new one for the block."""
    if _in_force:
        yield _in_force[-1]
        return
    with StopSignals() as signals:
        _in_force.append(signals)
        try:
            yield signals
        finally:
            _in_force.pop()


def signals_in_force() -> bool:
    """Whether a ``stop_signals`` block runs in this process (its handlers installed)."""
    return bool(_in_force)


def raise_recorded_stop() -> None:
    """Raise the stop that the process's ``StopSignals`` recorded but could not raise (``check()``); nothing when
    none is in force (a user's own script). The trainer calls it before every step."""
    if _in_force:
        _in_force[-1].check()
