"""Rungs: where a candidate's proxy is looked at before its end, and the rule that stops it there.

A candidate's run passes its rungs without starting again (precsearch.train.continuing): it is read at each
point of the all-high reference's curve (precsearch.search.calibration) from the first where every
reference seed is above chance up to the proxy length L (with doubling points: L/8, L/4, L/2 when the
reference learns early), and at L. At a rung it is compared with the reference's accuracy AT THE SAME STEP
and stopped only on clear failure: it diverged (the proxy stops itself), or it is behind the reference by
more than the allowed drop plus what the seed noise allows at the budget's confidence. The noise at a rung
is the larger of the reference seeds' spread at that step and their pooled noise: early in training, seeds
"click" at different steps, and a candidate that is slow there but reaches the reference by L stays within
that spread. Before every reference seed has learned a rung would say nothing, so none stands there; with a
single reference seed the noise is unknown, so only divergence stops a candidate. Optuna's pruners are not
used: they serve single-objective studies only, and their automatic minimum resource would stop every
candidate that has not yet left chance.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np
from scipy import stats

from precsearch.search.noise import Noise

__all__ = ["RungRule", "RungStop"]


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
