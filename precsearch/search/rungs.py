"""Rungs: where a candidate's proxy is looked at before its end, and the rule that stops it there.

A candidate trains at the proxy length L (its schedule spans L) and is evaluated at the rungs, by default
L/9 and L/3, then at L. At a rung it is compared with the all-high reference's accuracy AT THE SAME STEP,
known from calibration, and stopped only on clear failure: it diverged (the proxy stops itself), or it is
behind the reference by more than the allowed drop plus what the seed noise allows at the budget's
confidence. The noise at a rung is the larger of the reference seeds' spread at that step and the pooled
noise at L: early in training, seeds "click" at different steps, and a candidate that is slow there but
reaches the reference by L stays within that spread. While the reference itself is at chance a rung says
nothing (no candidate is stopped), and with a single reference seed the noise is unknown, so only
divergence stops a candidate. Optuna's pruners are not used: they serve single-objective studies only, and
their automatic minimum resource would stop every candidate that has not yet left chance.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np
from scipy import stats

from precsearch.search.noise import Noise

__all__ = ["DEFAULT_RUNGS", "RungRule", "RungStop", "curve_steps", "rung_steps"]

DEFAULT_RUNGS = (1 / 9, 1 / 3)  # fractions of the proxy length (the last rung is the length itself)
CURVE_POINTS = 9  # a calibration run is evaluated at every ninth of its length (and at the rungs)


def rung_steps(length: int, fractions: Sequence[float] = DEFAULT_RUNGS) -> list[int]:
    """The steps (>= 1, < length) of the rungs of a ``length``-step proxy."""
    return sorted({round(length * fraction) for fraction in fractions} - {0} - {length})


def curve_steps(length: int, fractions: Sequence[float] = DEFAULT_RUNGS) -> list[int]:
    """Where a calibration run of ``length`` steps is evaluated: every ninth of it and the rungs."""
    points = {round(length * index / CURVE_POINTS) for index in range(1, CURVE_POINTS + 1)}
    return sorted((points | set(rung_steps(length, fractions))) - {0})


class RungStop(Exception):
    """Raised from a proxy's evaluation at a rung: the candidate failed clearly there."""

    def __init__(self, step: int, accuracy: float, reason: str) -> None:
        super().__init__(reason)
        self.step = step
        self.accuracy = accuracy
        self.reason = reason


@dataclass(frozen=True)
class RungRule:
    """The stopping rule: ``reference`` holds the all-high seeds' accuracies at each rung step."""

    reference: Mapping[int, Sequence[float]]
    noise: Noise
    drop: float
    chance: float

    @property
    def steps(self) -> list[int]:
        return sorted(self.reference)

    def verdict(self, step: int, accuracy: float) -> str:
        """Why a one-seed candidate at ``accuracy`` after ``step`` steps must stop ('' to go on)."""
        seeds = list(self.reference.get(step, ()))
        if not seeds or not math.isfinite(accuracy):
            return ""
        mean = float(np.mean(seeds))
        if mean <= self.chance:
            return ""  # the reference has not learned by this step either: nothing to compare with
        spread = float(np.std(seeds, ddof=1)) if len(seeds) > 1 else math.nan
        known = [value for value in (spread, self.noise.sd) if math.isfinite(value)]
        if not known:
            return ""  # unknown noise: only divergence stops a candidate
        sd = max(known)
        df = max(len(seeds) - 1, self.noise.df)
        margin = float(stats.t.ppf(self.noise.confidence, df)) * sd * math.sqrt(1.0 + 1.0 / len(seeds))
        bound = mean - self.drop - margin
        if accuracy >= bound:
            return ""
        return (f"stopped at rung step {step}: accuracy {accuracy:.4f} is below the all-high reference's "
                f"{mean:.4f} at that step by more than the drop and the seed noise allow (bound {bound:.4f})")

    def check(self, step: int, accuracy: float, loss: float) -> None:
        """A ``Trainer`` ``on_eval``: raises ``RungStop`` at a rung where ``verdict`` says stop."""
        reason = self.verdict(step, accuracy)
        if reason:
            raise RungStop(step, accuracy, reason)
