"""Calibrated proxy length: train the all-high reference until its learning curve says how long a proxy
must be to decide anything.

A fixed proxy length is either blind (an easy task: every assignment within seed noise) or pessimistic (a
hard one: at 150 steps even all-high is at chance on some seeds, while the same assignments reach 100% at
450-600 steps). So the length comes from the reference's own learning curve: the all-high policy trains on
a geometric schedule of lengths (``start``, 2 x start, ... up to ``max_steps``), each a full proxy run whose
schedule spans that length, evaluated at every ninth of it and at the rungs (so the reference's accuracy
at a rung step of the chosen length is known), on the reference seeds. The proxy length L is the first
length at which every seed is clearly above chance (``SearchContext.chance``) and the mean gain over the
previous length is within the seed noise (the one-sided margin at the budget's confidence, and at least
the accuracy drop the pick tolerates). Not reached within ``max_steps``: a one-line PrecsearchError that
says so and what to change, never a pick of noise.

Every run is a step of the study's ``Ledger``, so a resumed or joining worker does not redo it. With a fixed
length (``--proxy-steps N``) the reference trains once, at N, with the same evaluations and no test.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import pandas as pd

from precsearch.config.policy import Policy
from precsearch.errors import PrecsearchError
from precsearch.search.context import SearchContext, combine_seeds
from precsearch.search.ledger import Ledger, recorded
from precsearch.search.noise import Noise, pooled_noise
from precsearch.search.rungs import DEFAULT_RUNGS, curve_steps
from precsearch.train.trainer import ProxyResult

__all__ = ["Calibration", "CalibrationSettings", "calibrate", "recorded_calibration", "run_record"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class CalibrationSettings:
    """The schedule of lengths (``start`` doubled up to ``max_steps``), or one ``fixed`` length."""

    start: int = 50
    max_steps: int = 3200
    fixed: int | None = None

    def __post_init__(self) -> None:
        if self.fixed is not None and self.fixed < 1:
            raise PrecsearchError(f"--proxy-steps {self.fixed} must be at least 1 (or auto)")
        if self.fixed is None and not 1 <= self.start <= self.max_steps // 2:
            raise PrecsearchError(f"calibration needs at least two lengths: start {self.start} must be at least 1 "
                                  f"and at most half of --max-proxy-steps {self.max_steps}")

    def schedule(self) -> list[int]:
        if self.fixed is not None:
            return [self.fixed]
        lengths = [self.start]
        while 2 * lengths[-1] <= self.max_steps:
            lengths.append(2 * lengths[-1])
        return lengths


def run_record(result: ProxyResult, seed: int) -> dict[str, Any]:
    """A run as a study user attr: the result without its loss curve (kept small), and its seed."""
    return {**result.to_dict(), "loss_curve": [], "seed": seed}


@dataclass(frozen=True)
class Calibration:
    """The reference's runs by length (each a list of per-seed ``run_record``s) and the chosen ``length``."""

    length: int
    fixed: bool
    runs: dict[int, list[dict[str, Any]]]

    @property
    def reference(self) -> list[dict[str, Any]]:
        return self.runs[self.length]

    @property
    def accuracies(self) -> list[float]:
        return [run["val_accuracy"] for run in self.reference]

    def result(self) -> ProxyResult:
        """The reference at the proxy length, all seeds combined."""
        return combine_seeds([ProxyResult.from_dict(run) for run in self.reference])

    def at(self, step: int) -> list[float]:
        """The reference seeds' accuracies ``step`` steps into their run of the proxy length."""
        return [value for run in self.reference for at, value in run["val_curve"] if at == step]

    def noise(self, confidence: float) -> Noise:
        """The seed noise the reference shows at its final step, pooled over every length."""
        return pooled_noise(pd.DataFrame(), confidence, extra=[[run["val_accuracy"] for run in runs]
                                                                 for runs in self.runs.values()])

    @property
    def steps(self) -> int:
        """Training steps spent calibrating."""
        return sum(run["steps_run"] for runs in self.runs.values() for run in runs)

    def frame(self) -> pd.DataFrame:
        """calibration.csv: one row per (length, seed, evaluated step)."""
        rows = [{"length": length, "seed": run["seed"], "step": step, "val_accuracy": value,
                 "chosen": length == self.length, "diverged": run["diverged"]}
                for length, runs in self.runs.items() for run in runs for step, value in run["val_curve"]]
        return pd.DataFrame(rows)

    def to_dict(self) -> dict[str, Any]:
        """For run.json: the length, how it was chosen, and the per-seed final accuracy at each length."""
        return {"length": self.length, "fixed": self.fixed, "steps": self.steps,
                "accuracies": {str(length): [run["val_accuracy"] for run in runs]
                               for length, runs in self.runs.items()}}


def recorded_calibration(attrs: Mapping[str, Any]) -> Calibration | None:
    """The calibration among a study's user ``attrs`` (``calibrate`` sets ``calibration`` when done), or None."""
    summary = attrs.get("calibration")
    if summary is None:
        return None
    runs = {length: [recorded(attrs, f"calibration:{length}:{seed}") for seed in summary["seeds"]]
            for length in summary["lengths"]}
    return Calibration(summary["length"], summary["fixed"], runs)


def calibrate(context: SearchContext, ledger: Ledger, settings: CalibrationSettings, seeds: Sequence[int],
              check: Callable[[int, float], None], rungs: Sequence[float] = DEFAULT_RUNGS) -> Calibration:
    """Train the all-high reference on ``settings``' schedule until the plateau (see the module docstring);
    the study records the outcome as its ``calibration`` user attr."""
    calibration = _calibrate(context, ledger, settings, seeds, check, rungs)
    ledger.study.set_user_attr("calibration", {"length": calibration.length, "fixed": calibration.fixed,
                                               "lengths": list(calibration.runs), "seeds": list(seeds)})
    return calibration


def _calibrate(context: SearchContext, ledger: Ledger, settings: CalibrationSettings, seeds: Sequence[int],
               check: Callable[[int, float], None], rungs: Sequence[float]) -> Calibration:
    high = {tensor_id: context.space.high for tensor_id in context.graph.assignable_ids()}
    policy = context.policy(high, {"strategy": "all-high reference"})
    runs: dict[int, list[dict[str, Any]]] = {}
    lengths = settings.schedule()
    for index, length in enumerate(lengths):
        runs[length] = _train_length(context, ledger, policy, length, seeds, check, rungs)
        if settings.fixed is not None:
            return Calibration(length, True, runs)
        accuracies = [run["val_accuracy"] for run in runs[length]]
        log.info("calibration: %d steps, all-high accuracy per seed %s", length,
                 ", ".join(f"{value:.3f}" for value in accuracies))
        if index and _learned(runs[length], context.chance) and _flat(runs[lengths[index - 1]], runs[length],
                                                                      context.budget.confidence,
                                                                      context.budget.drop):
            return Calibration(length, False, runs)
    last = [run["val_accuracy"] for run in runs[lengths[-1]]]
    problem = ("is not above chance on every seed" if not _learned(runs[lengths[-1]], context.chance)
               else "is still improving")
    raise PrecsearchError(
        f"calibration: the all-high reference {problem} at {lengths[-1]} steps (accuracy per seed "
        f"{', '.join(f'{value:.3f}' for value in last)}; chance {context.chance:.3f}), the cap; raise "
        "--max-proxy-steps, change the learning rate (the space's proxy.lr), or use a task the model can learn")


def _train_length(context: SearchContext, ledger: Ledger, policy: Policy, length: int, seeds: Sequence[int],
                  check: Callable[[int, float], None], rungs: Sequence[float]) -> list[dict[str, Any]]:
    names = {f"calibration:{length}:{seed}": seed for seed in seeds}

    def work(name: str) -> dict[str, Any]:
        seed = names[name]
        result = context.trainer(policy, length, seed, evaluate_at=curve_steps(length, rungs), report=check)
        return run_record(result, seed)

    results = ledger.run(list(names), work)
    return [results[name] for name in names]


def _learned(runs: list[dict[str, Any]], chance: float) -> bool:
    return all(not run["diverged"] and run["val_accuracy"] > chance for run in runs)


def _flat(before: list[dict[str, Any]], after: list[dict[str, Any]], confidence: float, drop: float) -> bool:
    """The mean gain from ``before`` to ``after`` is within the seed noise (and at most ``drop`` if less)."""
    early = [run["val_accuracy"] for run in before]
    late = [run["val_accuracy"] for run in after]
    noise = pooled_noise(pd.DataFrame(), confidence, extra=[early, late])
    gain = float(np.mean(late) - np.mean(early))
    return gain <= max(float(noise.margin(len(late), len(early))), drop) + 1e-12
