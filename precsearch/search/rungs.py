"""Rungs: where a candidate's proxy is looked at before its end, and the rule that stops it there.

A candidate's run passes its rungs without starting again (precsearch.train.continuing): it is read at the points
of the all-high reference's curve before the proxy length L (doubling points: L/8, L/4, L/2 when the reference
learns early), and at L. At a rung of step s it is compared with where the reference stood at s/2, the curve's
previous point, and stopped only on clear failure: it diverged, or it is behind the reference's s/2 accuracy by
more than the allowed drop plus what the seed noise allows, or it is still at chance where every reference seed
had left chance at s/2. So a candidate that learns up to twice as slowly as the slowest reference seed is never
stopped: assignments click later than all-high (tiny_cnn on gratings: a candidate at 10.5% at step 200, where the
reference's seeds stood at 27-41%, reached 100% by 400). A rung stands only where every reference seed had left
chance at its previous point; the noise there is the larger of those seeds' spread and their pooled noise. That
margin alone would never stop a candidate behind a reference with a stuck seed (a margin of 59 points on
tiny_cnn), hence the chance test beside it. Optuna's pruners are not used: they serve single-objective studies
only, and their automatic minimum resource would stop every candidate that has not yet left chance.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np
from scipy import stats

from precsearch.search.noise import Noise
from precsearch.train.reading import Reading

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
    """The stopping rule: ``reference`` holds, for each rung step, the all-high seeds' accuracies at half
    that step (the curve's previous point)."""

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
        if accuracy <= self.chance < min(seeds):
            return (f"stopped at rung step {step}: accuracy {accuracy:.4f} is still at chance ({self.chance:.4f}) "
                    f"where every all-high reference seed had left it at half that step")
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
                f"{mean:.4f} at half that step by more than the drop and the seed noise allow (bound {bound:.4f})")

    def check(self, step: int, reading: Reading) -> None:
        """A ``Trainer`` ``on_eval``: raises ``RungStop`` at a rung where ``verdict`` says stop."""
        reason = self.verdict(step, reading.accuracy)
        if reason:
            raise RungStop(step, reading.accuracy, reason)
