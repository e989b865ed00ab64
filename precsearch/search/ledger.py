"""Steps of a study's setup and wrap-up (queuing the seeds, calibration runs, confirmation runs) that any
worker may take.

A step's result is a study user attr ``step:<name>``, so a resumed or joining worker never redoes a finished
step. A worker about to run it first claims it (``claim:<name>``) under the study's lock and renews the claim
from a thread while the step runs: the claim is a lease. A claim not renewed for ``stale`` seconds belonged to
a worker that died: the next worker takes the step over from what it recorded so far (a step that records as it
goes checks that it still holds the claim, ``holding``). Runs are seeded, so a step run twice gives the same
numbers.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import optuna

from precsearch.errors import PrecsearchError

__all__ = ["Ledger", "LeaseLost", "pause_point", "recorded"]

log = logging.getLogger(__name__)

RESULT = "step:"
CLAIM = "claim:"
POLL = 0.5  # seconds between looks at steps other workers run


def recorded(attrs: Mapping[str, Any], name: str) -> dict[str, Any] | None:
    """The result of step ``name`` among a study's user ``attrs`` (None while it is not done)."""
    return attrs.get(RESULT + name)


def pause_point(pause_at: str | None, name: str) -> None:
    """A test hook at ``name``, a point of a study's setup: when ``pause_at`` (``SearchConfig.pause_at``) names
    it, the process stops itself here (SIGSTOP) until the test kills it; None, as in every real search, never."""
    if pause_at == name:
        os.kill(os.getpid(), signal.SIGSTOP)


class LeaseLost(Exception):
    """Another worker took over a step this one held: this one had gone silent for longer than the lease."""


class Ledger:
    """Named steps of one study; ``lock()`` is the study's cross-process lock, ``worker`` this process's name,
    ``alive(other)`` whether the worker named ``other`` may still be running (else its claim is taken over at
    once); ``pause_at`` the test hook (``pause_point``): a step is ``claimed:<name>`` once claimed."""

    def __init__(self, study: optuna.Study, lock: Callable[[], contextlib.AbstractContextManager[Any]],
                 worker: str, stale: float, alive: Callable[[str], bool] = lambda other: True,
                 pause_at: str | None = None) -> None:
        self.study = study
        self.lock = lock
        self.worker = worker
        self.stale = stale
        self.alive = alive
        self.pause_at = pause_at
        self._waiting_for: dict[str, str] = {}  # step -> the worker it was last seen held by

    def result(self, name: str) -> dict[str, Any] | None:
        return recorded(self.study.user_attrs, name)

    def run(self, names: Sequence[str], work: Callable[[str], dict[str, Any]], wait: bool = True
            ) -> dict[str, dict[str, Any]]:
        """The results of every step in ``names``: recorded ones as they are, the others run here by
        ``work(name)`` or waited for while another worker runs them. With ``wait=False`` one pass: the steps no
        other worker holds are run here, and the results recorded by then returned, so this worker goes on."""
        while True:
            missing = [name for name in names if self.result(name) is None]
            if not missing:
                return {name: self.result(name) for name in names}
            ran = False
            for name in missing:
                if not self._claim(name, wait):
                    continue
                pause_point(self.pause_at, f"claimed:{name}")
                try:
                    with self._renewed(name):
                        result = work(name)
                except LeaseLost:
                    log.warning("step %s: another worker took it over while this one was silent", name)
                    continue
                self.study.set_user_attr(RESULT + name, result)
                ran = True
            if not wait:
                return {name: done for name in names if (done := self.result(name)) is not None}
            if not ran:
                time.sleep(POLL)

    def run_seeds(self, step: Callable[[int], str], seeds: Sequence[int], work: Callable[[int], dict[str, Any]],
                  wait: bool = True) -> list[dict[str, Any]]:
        """``run`` with one step per seed (named ``step(seed)``, run by ``work(seed)``): the results in seed order."""
        names = {step(seed): seed for seed in seeds}
        results = self.run(list(names), lambda name: work(names[name]), wait)
        return [results[name] for name in names if name in results]

    @contextlib.contextmanager
    def holding(self, name: str) -> Iterator[None]:
        """The study's lock, taken only while this worker still holds step ``name`` (else LeaseLost): what a
        step records under it never collides with a worker that took the step over."""
        with self.lock():
            if (self.study.user_attrs.get(CLAIM + name) or {}).get("worker") != self.worker:
                raise LeaseLost(name)
            yield

    def _claim(self, name: str, waiting: bool = True) -> bool:
        with self.lock():
            if self.result(name) is not None:
                return False
            claim = self.study.user_attrs.get(CLAIM + name)
            other = claim is not None and claim["worker"] != self.worker
            if other and not self.alive(claim["worker"]):
                log.info("step %s: continuing it where %s, an earlier process of this run, left it", name,
                         claim["worker"])
            elif other and time.time() - claim["time"] < self.stale:
                if waiting:
                    self._log_wait(name, claim)
                return False
            elif other:
                log.warning("step %s: its worker %s went silent %.0f s ago; taking it over", name, claim["worker"],
                            time.time() - claim["time"])
            now = time.time()
            self.study.set_user_attr(CLAIM + name, {"worker": self.worker, "since": now, "time": now})
            return True

    def _log_wait(self, name: str, claim: Mapping[str, Any]) -> None:
        """Say once per holder what this worker waits for, held by whom, since when."""
        if self._waiting_for.get(name) == claim["worker"]:
            return
        self._waiting_for[name] = claim["worker"]
        since = claim.get("since", claim["time"])
        log.info("waiting for step %s, which worker %s runs since %s (%.0f s); taken over if it is silent for "
                 "%.0f s", name, claim["worker"], time.strftime("%H:%M:%S", time.localtime(since)),
                 time.time() - since, self.stale)

    @contextlib.contextmanager
    def _renewed(self, name: str) -> Iterator[None]:
        """Renew the claim on ``name`` every ``stale / 3`` seconds from a thread while the step runs: its heartbeat."""
        done = threading.Event()

        def renew() -> None:
            while not done.wait(self.stale / 3):
                try:
                    with self.holding(name):
                        claim = self.study.user_attrs[CLAIM + name]
                        self.study.set_user_attr(CLAIM + name, {**claim, "time": time.time()})
                except (LeaseLost, PrecsearchError):  # taken over, or the storage is lost (the step meets it too)
                    return

        thread = threading.Thread(target=renew, name=f"lease {name}", daemon=True)
        thread.start()
        try:
            yield
        finally:
            done.set()
            thread.join()
