"""Seed noise of proxies, and decisions that know it.

A proxy's accuracy depends on its seed (model init, batch order, rounding draws) as much as on the precision
assignment: on the bundled digits data one 150-step proxy has a seed spread of 0.75 accuracy points, so two
single-seed proxies differ by about 1.07 points of pure noise. Here that noise is measured and used:

* ``Noise`` is the pooled standard deviation of one proxy's accuracy over seeds (every assignment trained with
  at least two seeds contributes ``seeds - 1`` degrees of freedom), with the confidence decisions are taken at.
  An assignment with a failed run (``failed_run``) adds none: it fails the drop rule through its own mean, and
  its bimodal spread would widen every other candidate's margin (on tiny_cnn one such pair raised the pooled sd
  from 0 to 32 points, so no candidate was within the drop).
* A difference of two means is judged with a one-sided bound from Student's t: ``a - b`` is "at least x" at
  confidence c when ``(mean_a - mean_b) - t_c(df) * sd * sqrt(1/n_a + 1/n_b) >= x``. Unmeasured noise (one seed
  per proxy) gives a margin of zero: the plain comparison of means, which the caller says.
* ``seeds_for`` chooses how many seeds a proxy needs so that an assignment as accurate as all-high passes a
  "within D of all-high" bound with a margin under half of D; the search takes at least 2, so that every trial
  adds to the noise estimate (a saturated all-high, 100% on every seed, would claim no noise at all).
* ``rank_correlations`` gives Spearman's and Kendall's coefficients with bootstrap intervals (explicit seed).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import pandas as pd
from scipy import stats

__all__ = ["DEFAULT_CONFIDENCE", "MAX_PROXY_SEEDS", "MAX_SEEDS", "Noise", "explained_by", "failed_run",
           "pooled_noise", "rank_correlations", "resolves", "seeds_for"]

log = logging.getLogger(__name__)

DEFAULT_CONFIDENCE = 0.9
MAX_SEEDS = 4  # a proxy never trains more seeds than this by default (each seed is a full proxy)
MAX_PROXY_SEEDS = 32  # the most a user may ask for: each seed is a full proxy of every trial


@dataclass(frozen=True)
class Noise:
    """Pooled seed standard deviation of one proxy's accuracy (a fraction), its degrees of freedom, and the
    one-sided confidence decisions are taken at. ``df == 0`` means unmeasured."""

    sd: float
    df: int
    confidence: float = DEFAULT_CONFIDENCE

    @property
    def measured(self) -> bool:
        return self.df > 0 and math.isfinite(self.sd)

    @property
    def quantile(self) -> float:
        """One-sided Student t quantile at ``confidence`` (0 when unmeasured: the plain comparison)."""
        return float(stats.t.ppf(self.confidence, self.df)) if self.measured else 0.0

    def standard_error(self, seeds_a: float | pd.Series, seeds_b: float | pd.Series) -> float | pd.Series:
        """Standard error of the difference of two means over ``seeds_a`` and ``seeds_b`` seeds."""
        if not self.measured:
            return 0.0 * seeds_a
        return self.sd * np.sqrt(1.0 / seeds_a + 1.0 / seeds_b)

    def margin(self, seeds_a: float | pd.Series, seeds_b: float | pd.Series) -> float | pd.Series:
        """What a difference of means must exceed to be believed at ``confidence``."""
        return self.quantile * self.standard_error(seeds_a, seeds_b)

    def probability_above(self, difference: float, bound: float, seeds_a: float, seeds_b: float) -> float:
        """Confidence that the true difference exceeds ``bound`` given the observed ``difference`` (NaN: unmeasured)."""
        if not self.measured:
            return math.nan
        error = float(self.standard_error(seeds_a, seeds_b))
        if error == 0.0:  # every seed agreed: the observed difference is the true one
            return 1.0 if difference > bound else 0.0
        return float(stats.t.cdf((difference - bound) / error, self.df))

    def describe(self) -> str:
        if not self.measured:
            return "seed noise not measured (one seed per proxy): the pick compares single numbers"
        return (f"seed noise {100 * self.sd:.2f} accuracy points per proxy (pooled sd, {self.df} df); decisions "
                f"at {100 * self.confidence:g}% one-sided confidence")

    def to_dict(self) -> dict[str, float]:
        return {"sd": self.sd, "df": self.df, "confidence": self.confidence}


def failed_run(accuracy: float, best: float, chance: float) -> bool:
    """Whether a run failed rather than scattered: it stands nearer chance than the best run of the same policy,
    which learned. Such a run counts against its policy; it is not seed noise to widen everyone's margin with."""
    return best > chance and accuracy < (chance + best) / 2


def pooled_noise(frame: pd.DataFrame, confidence: float = DEFAULT_CONFIDENCE,
                 extra: Sequence[Sequence[float]] = ()) -> Noise:
    """The pooled seed sd over a trials table's rows with ``seeds >= 2`` and no failed run (one per assignment key),
    and over the ``extra`` groups of per-seed accuracies (the all-high reference)."""
    squares, df = 0.0, 0
    if not frame.empty and {"seeds", "val_accuracy_sd", "key"} <= set(frame.columns):
        rows = frame[(frame["seeds"] >= 2) & frame["val_accuracy_sd"].notna()]
        rows = rows[rows["trained"].astype(bool) & ~rows["diverged"].astype(bool)] if "trained" in rows else rows
        rows = rows[rows["failed_runs"] == 0] if "failed_runs" in rows else rows
        rows = rows.drop_duplicates("key")
        squares += float(((rows["seeds"] - 1) * rows["val_accuracy_sd"] ** 2).sum())
        df += int((rows["seeds"] - 1).sum())
    for values in extra:
        if len(values) >= 2:
            squares += float(np.var(values, ddof=1)) * (len(values) - 1)
            df += len(values) - 1
    return Noise(math.sqrt(squares / df) if df else math.nan, df, confidence)


def explained_by(values: Sequence[float], sd: float, confidence: float = DEFAULT_CONFIDENCE) -> bool:
    """Whether ``values`` scatter no more than a known standard deviation ``sd`` explains: their sample variance
    within the one-sided chi-square bound ``sd**2 * chi2(confidence, n - 1) / (n - 1)``."""
    df = len(values) - 1
    if df < 1:
        return True
    return bool(np.var(values, ddof=1) <= sd ** 2 * stats.chi2.ppf(confidence, df) / df + 1e-15)


def resolves(noise: Noise, drop: float, reference_seeds: int, seeds: int = MAX_SEEDS) -> bool:
    """Whether ``seeds``-seed proxies can tell a ``drop`` against a ``reference_seeds``-seed reference: an
    assignment as accurate as the reference passes the "within ``drop``" bound with half the drop to spare."""
    return bool(noise.margin(seeds, reference_seeds) <= drop / 2 + 1e-12)


def seeds_for(noise: Noise, drop: float, reference_seeds: int, max_seeds: int = MAX_SEEDS,
              min_seeds: int = 1) -> int:
    """Fewest seeds (``min_seeds``..``max_seeds``) that ``resolves`` the allowed ``drop``; ``max_seeds``, with a
    warning, when even that is not enough."""
    if not noise.measured:
        return min_seeds
    for seeds in range(min_seeds, max_seeds + 1):
        if resolves(noise, drop, reference_seeds, seeds):
            return seeds
    log.warning("seed noise %.4f is too large for a %.4f accuracy drop even at %d seeds per proxy (margin %.4f); "
                "picks stay uncertain: raise --proxy-seeds or the allowed drop", noise.sd, drop, max_seeds,
                noise.margin(max_seeds, reference_seeds))
    return max_seeds


def rank_correlations(x: Sequence[float], y: Sequence[float], confidence: float = 0.9, resamples: int = 2000,
                      seed: int = 0) -> dict[str, float]:
    """Spearman's rho and Kendall's tau of paired ``x``, ``y``, each with a percentile bootstrap interval
    (pairs resampled with ``numpy.random.default_rng(seed)``); NaN where fewer than 3 pairs or no spread."""
    x, y = np.asarray(x, dtype=float), np.asarray(y, dtype=float)
    out: dict[str, float] = {}
    for name, function in (("spearman", stats.spearmanr), ("kendall", stats.kendalltau)):
        def statistic(a: np.ndarray, b: np.ndarray, function=function) -> float:
            if np.ptp(a) == 0 or np.ptp(b) == 0:
                return math.nan
            return float(function(a, b).statistic)

        value = statistic(x, y) if len(x) >= 3 else math.nan
        low = high = math.nan
        if math.isfinite(value):
            rng = np.random.default_rng(seed)
            draws = []
            for _ in range(resamples):
                index = rng.integers(0, len(x), len(x))
                draws.append(statistic(x[index], y[index]))
            draws = np.asarray(draws)
            draws = draws[np.isfinite(draws)]
            tail = (1 - confidence) / 2
            low, high = (float(v) for v in np.quantile(draws, [tail, 1 - tail]))
        out.update({name: value, f"{name}_low": low, f"{name}_high": high})
    return out
