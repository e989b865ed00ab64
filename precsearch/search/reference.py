"""The all-high reference every trial is measured against, as one value the steps of a search hand each other:
calibration's runs, the all-high key, its seeds' accuracies and combined result at the proxy length, and the
seeds each proxy trains. A study keeps it as user attrs (named, written and read here only), so a resumed run or
a worker on another host reads it back.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import optuna
import pandas as pd

from precsearch.search.calibration import Calibration, recorded_calibration
from precsearch.search.context import Budget
from precsearch.search.noise import Noise, pooled_noise
from precsearch.search.rungs import RungRule
from precsearch.train.trainer import ProxyResult

__all__ = ["Reference", "proxy_noise"]

PROXY_SEEDS, KEY, ACCURACIES, RESULT = "proxy_seeds", "reference_key", "reference_accuracies", "reference_result"


@dataclass(frozen=True)
class Reference:
    """The calibrated all-high reference: ``key`` (the all-high assignment's), the per-seed ``accuracies`` and
    the seeds-combined ``result`` at the proxy length, and ``proxy_seeds``, the seeds of every proxy."""

    calibration: Calibration
    key: str
    accuracies: tuple[float, ...]
    result: ProxyResult
    proxy_seeds: int

    @classmethod
    def of(cls, calibration: Calibration, key: str, proxy_seeds: int) -> Reference:
        """The reference that ``calibration`` trained, its loss curve left out (a study keeps it small)."""
        result = ProxyResult.from_dict({**calibration.result().to_dict(), "loss_curve": []})
        return cls(calibration, key, tuple(calibration.accuracies), result, proxy_seeds)

    @classmethod
    def from_study(cls, study: optuna.Study) -> Reference | None:
        """The reference ``record`` kept in ``study`` (None until it is recorded)."""
        attrs = study.user_attrs
        calibration = recorded_calibration(attrs)
        if calibration is None or RESULT not in attrs:
            return None
        return cls(calibration, attrs[KEY], tuple(attrs[ACCURACIES]), ProxyResult.from_dict(attrs[RESULT]),
                   int(attrs[PROXY_SEEDS]))

    def record(self, study: optuna.Study) -> None:
        """Keep it in ``study`` (calibration keeps itself), the result last: its presence marks it complete."""
        for name, value in self.to_attrs().items():
            study.set_user_attr(name, value)

    def to_attrs(self) -> dict[str, Any]:
        return {PROXY_SEEDS: self.proxy_seeds, KEY: self.key, ACCURACIES: list(self.accuracies),
                RESULT: self.result.to_dict()}

    @property
    def length(self) -> int:
        """The proxy length."""
        return self.calibration.length

    @property
    def accuracy(self) -> float | None:
        """The mean accuracy of its proxy (None when it diverged: nothing to compare with)."""
        return None if self.result.diverged else float(self.result.val_accuracy)

    def rung_steps(self, chance: float) -> list[int]:
        """Where the rungs stand (precsearch.search.rungs)."""
        return list(self._rung_points(chance))

    def rung_rule(self, budget: Budget, chance: float) -> RungRule:
        """The rule that stops a proxy at a rung: the reference's accuracies at the curve's previous point (where a
        candidate learning twice as slowly would stand), and its noise."""
        calibration = self.calibration
        return RungRule({step: calibration.at(previous) for step, previous in self._rung_points(chance).items()},
                        calibration.noise(budget.confidence), budget.drop, chance)

    def _rung_points(self, chance: float) -> dict[int, int]:
        """Rung step -> the curve's point before it, for the points before L whose previous point learned."""
        points = list(self.calibration.runs)
        return {point: previous for previous, point in zip(points, points[1:], strict=False)
                if point < self.length and self.calibration.learned_at(previous, chance)}


def proxy_noise(frame: pd.DataFrame, reference: Reference | None, confidence: float) -> Noise:
    """The pooled seed noise of the trained trials in ``frame`` and the reference (once: all-high copies it)."""
    counted = reference is None or (not frame.empty and reference.key in set(frame["key"]))
    return pooled_noise(frame, confidence, extra=[] if counted else [list(reference.accuracies)])
