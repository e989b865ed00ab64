"""Steps of a study's setup and wrap-up (calibration runs, confirmation runs) that any worker may take.

Each step has a name. Its result is a study user attr ``step:<name>`` (so a resumed or joining worker never
redoes a finished step); a worker about to run it first claims it (``claim:<name>``: worker and time) under
the study's lock, and refreshes the claim while it trains (``beat``). A claim not refreshed for ``stale``
seconds belonged to a worker that died: any other worker takes the step over. Runs are seeded, so a step
run twice gives the same numbers.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import optuna

__all__ = ["Ledger", "recorded"]

log = logging.getLogger(__name__)

RESULT = "step:"
CLAIM = "claim:"
POLL = 0.5  # seconds between looks at steps other workers run


def recorded(attrs: Mapping[str, Any], name: str) -> dict[str, Any] | None:
    """The result of step ``name`` among a study's user ``attrs`` (None while it is not done)."""
    return attrs.get(RESULT + name)


class Ledger:
    """Named steps of one study; ``lock()`` is the study's cross-process lock, ``worker`` this process's name."""

    def __init__(self, study: optuna.Study, lock: Callable[[], contextlib.AbstractContextManager[Any]],
                 worker: str, stale: float) -> None:
        self.study = study
        self.lock = lock
        self.worker = worker
        self.stale = stale

    def result(self, name: str) -> dict[str, Any] | None:
        return recorded(self.study.user_attrs, name)

    def run(self, names: Sequence[str], work: Callable[[str, Callable[[], None]], dict[str, Any]]
            ) -> dict[str, dict[str, Any]]:
        """The results of every step in ``names``: recorded ones as they are, the others run here by
        ``work(name, beat)`` (``beat()`` keeps the claim alive) or waited for while another worker runs them."""
        while True:
            missing = [name for name in names if self.result(name) is None]
            if not missing:
                return {name: self.result(name) for name in names}
            ran = False
            for name in missing:
                if self._claim(name):
                    with self._claimed(name) as beat:
                        self.study.set_user_attr(RESULT + name, work(name, beat))
                    ran = True
            if not ran:
                time.sleep(POLL)

    def _claim(self, name: str) -> bool:
        with self.lock():
            if self.result(name) is not None:
                return False
            claim = self.study.user_attrs.get(CLAIM + name)
            if claim is not None and claim["worker"] != self.worker and time.time() - claim["time"] < self.stale:
                return False
            if claim is not None and claim["worker"] != self.worker:
                log.warning("step %s: its worker %s went silent; taking it over", name, claim["worker"])
            self.study.set_user_attr(CLAIM + name, {"worker": self.worker, "time": time.time()})
            return True

    @contextlib.contextmanager
    def _claimed(self, name: str) -> Iterator[Callable[[], None]]:
        last = [time.time()]

        def beat() -> None:
            now = time.time()
            if now - last[0] >= self.stale / 3:
                self.study.set_user_attr(CLAIM + name, {"worker": self.worker, "time": now})
                last[0] = now

        yield beat
