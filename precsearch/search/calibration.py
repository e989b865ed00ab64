"""Calibrated proxy length: one continuing run of the all-high reference per seed, read along the way until
its learning curve says how long a proxy must be to decide anything.

A fixed proxy length is either blind (an easy task: every assignment within seed noise) or pessimistic (a
hard one: at 150 steps even all-high is at chance on some seeds, while the same assignments reach 100% at
450-600 steps). So each reference seed trains ONE continuing run (precsearch.train.continuing: every point of
it is the result of a proxy of that length), read at ``start``, 2 x start, ... up to ``max_steps``, every seed
reaching a point before the curve is judged there. The proxy length L is the first point where

* every seed is clearly above chance (``SearchContext.chance``) and none diverged (learned),
* the mean gained no more than the seed noise allows (and at least the allowed drop) since the previous point
  (flat: L is one doubling past where the reference levels off, even at 100%, so that an assignment learning
  up to twice as slowly is judged where it too has levelled off; on the demo task proxies of 200 steps held
  0.63 of the all-high bytes within the drop, where proxies of 400 steps found 0.52, confirmed), and
* the seeds agree closely enough that proxies can resolve the allowed drop (``noise.resolves``): a mean
  that stopped rising over seeds that still disagree (99.8%, 74.5%, 64.2%) would hold every proxy to noise.

A minority of seeds stuck on a plateau nearer chance than the best seed (``_failed``: tiny_cnn's seed 0 on
gratings at 38%, 38%, 30% at 200, 400 and 800 steps beside 100%; mobilenet_v2's seed 1 fallen from 100% to 9.6%
without a flagged divergence) are failed runs, not seed noise: they are left out of the reference
(``Calibration.failed``, one WARNING line), since a mean that counts them would pass proxies at 77% against runs
at 100% and race every candidate to the most seeds. Calibration also stops, with one WARNING line saying what to
change, where seeds that learned and stopped rising drew no closer over two doublings, where they are apart by
no more than the validation set's sampling noise explains and that noise cannot resolve the drop
(``_sampling_floor``: no length changes it), and at the cap; a reference that reached within the drop of 100%
only in the doubling to the cap is taken there (``_late_plateau``). One that has not learned or is still rising
at the cap is refused: a one-line PrecsearchError, never a pick of noise.

The runs' checkpoints stay: confirmation continues them (``REFERENCE_RUN``) instead of training the reference
again. Every (point, seed) is a step of the study's ``Ledger``, so a resumed or joining worker does not redo it.
With a fixed length (``--proxy-steps N``) the reference trains once to N, read at N/8, N/4 and N/2 on the way
(the rungs), with no test.
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
from precsearch.search.noise import MAX_SEEDS, Noise, explained_by, failed_run, pooled_noise, resolves
from precsearch.train.trainer import ProxyResult

__all__ = ["REFERENCE_RUN", "Calibration", "CalibrationSettings", "calibrate", "recorded_calibration",
           "reference_policy", "run_record"]

log = logging.getLogger(__name__)

CALIBRATION = "calibration"  # the study user attr that says which runs the calibration is
REFERENCE_RUN = "all-high reference"  # the checkpoint key of the reference's runs, which confirmation continues


def reference_policy(context: SearchContext) -> Policy:
    """The all-high reference's policy, one definition: a checkpoint continues only a run of the same policy."""
    return context.policy(context.all_high.assignment, {"strategy": REFERENCE_RUN})


@dataclass(frozen=True)
class CalibrationSettings:
    """The points the reference is read at (``start`` doubled up to ``max_steps``), or one ``fixed`` length."""

    start: int = 50
    max_steps: int = 3200
    fixed: int | None = None

    def __post_init__(self) -> None:
        if self.fixed is not None and self.fixed < 1:
            raise PrecsearchError(f"--proxy-steps {self.fixed} must be at least 1 (or auto)")
        if self.fixed is None and not 1 <= self.start <= self.max_steps // 2:
            raise PrecsearchError(f"calibration needs at least two lengths: start {self.start} must be at least 1 "
                                  f"and at most half of --max-proxy-steps {self.max_steps}")

    def points(self) -> list[int]:
        """The doubling schedule, or a fixed length and its halvings down to an eighth (where rungs may stand)."""
        if self.fixed is not None:
            return sorted({self.fixed // 8, self.fixed // 4, self.fixed // 2, self.fixed} - {0})
        points = [self.start]
        while 2 * points[-1] <= self.max_steps:
            points.append(2 * points[-1])
        return points


def run_record(result: ProxyResult, seed: int) -> dict[str, Any]:
    """A run as a study user attr: the result without its loss curve (kept small), and its seed."""
    return {**result.to_dict(), "loss_curve": [], "seed": seed}


@dataclass(frozen=True)
class Calibration:
    """The reference's runs read at each point (per-seed ``run_record``s), the chosen ``length``, ``warning``: what
    to change when its seeds could not be made to agree, and ``failed``: the seeds left out as failed runs."""

    length: int
    fixed: bool
    runs: dict[int, list[dict[str, Any]]]
    warning: str = ""
    failed: tuple[int, ...] = ()

    def _kept(self, runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
        return [run for run in runs if run["seed"] not in self.failed]

    @property
    def reference(self) -> list[dict[str, Any]]:
        """The runs at the proxy length of the seeds the reference keeps."""
        return self._kept(self.runs[self.length])

    @property
    def accuracies(self) -> list[float]:
        return [run["val_accuracy"] for run in self.reference]

    def result(self) -> ProxyResult:
        """The reference at the proxy length, all seeds combined."""
        return combine_seeds([ProxyResult.from_dict(run) for run in self.reference])

    def at(self, step: int) -> list[float]:
        """The kept reference seeds' accuracies at point ``step`` of their runs."""
        return [run["val_accuracy"] for run in self._kept(self.runs.get(step, []))]

    def learned_at(self, point: int, chance: float) -> bool:
        """Whether every kept reference seed is above chance (and none diverged) at ``point``."""
        return _learned(self._kept(self.runs.get(point, [])), chance)

    def noise(self, confidence: float) -> Noise:
        """The seed noise pooled over every point up to the proxy length: seeds that click at different steps are
        the noise a rung must allow, and a reference saturated at L claims none on its own."""
        return pooled_noise(pd.DataFrame(), confidence, extra=[self.at(point) for point in self.runs
                                                                 if point <= self.length])

    @property
    def steps(self) -> int:
        """Training steps spent calibrating (decay branches included)."""
        return sum(run["steps_spent"] for runs in self.runs.values() for run in runs)

    def frame(self) -> pd.DataFrame:
        """calibration.csv: one row per (point, seed): the result of a proxy of that length."""
        rows = [{"length": point, "seed": run["seed"], "step": point, "val_accuracy": run["val_accuracy"],
                 "chosen": point == self.length, "diverged": run["diverged"], "failed": run["seed"] in self.failed}
                for point, runs in self.runs.items() for run in runs]
        return pd.DataFrame(rows)

    def summary(self) -> dict[str, Any]:
        """Which runs these are (the study records it when calibration is done)."""
        return {"length": self.length, "fixed": self.fixed, "lengths": list(self.runs),
                "seeds": [run["seed"] for run in self.runs[self.length]], "warning": self.warning,
                "failed": list(self.failed)}

    def to_dict(self) -> dict[str, Any]:
        """For run.json: the length, how it was chosen, and the per-seed accuracy at each point."""
        return {"length": self.length, "fixed": self.fixed, "steps": self.steps, "warning": self.warning,
                "failed": list(self.failed),
                "accuracies": {str(point): [run["val_accuracy"] for run in runs] for point, runs in self.runs.items()}}


def recorded_calibration(attrs: Mapping[str, Any]) -> Calibration | None:
    """The calibration among a study's user ``attrs`` (``calibrate`` records its summary when done), or None."""
    summary = attrs.get(CALIBRATION)
    if summary is None:
        return None
    runs = {point: [recorded(attrs, _step(point, seed)) for seed in summary["seeds"]] for point in summary["lengths"]}
    return Calibration(summary["length"], summary["fixed"], runs, summary.get("warning", ""),
                       tuple(summary.get("failed", ())))


def calibrate(context: SearchContext, ledger: Ledger, settings: CalibrationSettings, seeds: Sequence[int],
              report: Callable[[int, float], None]) -> Calibration:
    """Train the all-high reference's runs until the curve decides the length; the study records the outcome."""
    recorded_before = recorded_calibration(ledger.study.user_attrs)
    if recorded_before is not None:
        return recorded_before
    calibration = _calibrate(context, ledger, settings, seeds, report)
    for seed in calibration.failed:  # nothing continues a failed run
        context.drop_checkpoint(REFERENCE_RUN, seed)
    ledger.study.set_user_attr(CALIBRATION, calibration.summary())
    return calibration


def _step(point: int, seed: int) -> str:
    return f"calibration:{point}:{seed}"


def _calibrate(context: SearchContext, ledger: Ledger, settings: CalibrationSettings, seeds: Sequence[int],
               report: Callable[[int, float], None]) -> Calibration:
    policy = reference_policy(context)
    runs: dict[int, list[dict[str, Any]]] = {}
    points = settings.points()
    for index, point in enumerate(points):
        runs[point] = _advance(context, ledger, policy, point, seeds, report)
        if settings.fixed is not None:
            if point == settings.fixed:
                return Calibration(point, True, runs)
            continue
        log.info("calibration: %d steps, all-high accuracy per seed %s", point,
                 ", ".join(f"{run['val_accuracy']:.3f}" for run in runs[point]))
        if index == 0:
            continue
        failed = _failed(runs, points, index, context)
        if failed:
            kept = Calibration(point, False, runs, failed=failed)
            before, now = kept.at(points[index - 1]), kept.at(point)
            noise = pooled_noise(pd.DataFrame(), context.budget.confidence, extra=[now])
            if (_learned(kept.reference, context.chance)
                    and _flat(before, now, context.budget.confidence, context.budget.drop)
                    and resolves(noise, context.budget.drop, len(now))):
                return Calibration(point, False, runs, _failed_line(point, points[index - 2], runs, failed), failed)
        if not _learned(runs[point], context.chance):
            continue
        before, now = _accuracies(runs[points[index - 1]]), _accuracies(runs[point])
        noise = pooled_noise(pd.DataFrame(), context.budget.confidence, extra=[now])
        if not _flat(before, now, context.budget.confidence, context.budget.drop):
            if (point == points[-1] and 1.0 - float(np.mean(now)) <= context.budget.drop
                    and resolves(noise, context.budget.drop, len(now))):
                return Calibration(point, False, runs, _late_plateau(points[index - 1], point, before, now))
            continue
        if resolves(noise, context.budget.drop, len(now)):
            return Calibration(point, False, runs)
        earlier = runs[points[index - 2]] if index >= 2 else []
        stalled = _learned(earlier, context.chance) and np.std(now) >= np.std(_accuracies(earlier))
        floor = _sampling_floor(now, context)
        if floor or stalled or point == points[-1]:
            cause = floor or ("reached the cap" if point == points[-1]
                              else "drew no closer over the last two doublings")
            return Calibration(point, False, runs, _disagreement(point, now, noise, context, cause, longer=not floor))
    last = _accuracies(runs[points[-1]])
    problem = ("is not above chance on every seed" if not _learned(runs[points[-1]], context.chance)
               else "is still improving")
    raise PrecsearchError(
        f"calibration: the all-high reference {problem} at {points[-1]} steps (accuracy per seed "
        f"{', '.join(f'{value:.3f}' for value in last)}; chance {context.chance:.3f}), the cap; raise "
        "--max-proxy-steps, change the learning rate (the space's proxy.lr), or use a task the model can learn")


def _advance(context: SearchContext, ledger: Ledger, policy: Policy, point: int, seeds: Sequence[int],
             report: Callable[[int, float], None]) -> list[dict[str, Any]]:
    """Every seed's run continued to ``point`` (each a ledger step)."""
    def work(seed: int) -> dict[str, Any]:
        return run_record(context.trainer(policy, point, seed, report=report,
                                          checkpoint=context.checkpoint(REFERENCE_RUN, seed)), seed)

    return ledger.run_seeds(lambda seed: _step(point, seed), seeds, work)


def _failed(runs: dict[int, list[dict[str, Any]]], points: list[int], index: int,
            context: SearchContext) -> tuple[int, ...]:
    """The seeds stuck on a plateau at ``points[index]``, when a minority that leaves at least two; else none."""
    now, earlier = runs[points[index]], runs[points[index - 2]] if index >= 2 else []
    if len(earlier) != len(now):
        return ()
    best = max(_accuracies(now))
    stuck = [run["seed"] for run, before in zip(now, earlier, strict=True)
             if not run["diverged"] and before["val_accuracy"] > context.chance
             and run["val_accuracy"] <= before["val_accuracy"]
             + context.budget.drop and failed_run(run["val_accuracy"], best, context.chance)]
    kept = len(now) - len(stuck)
    return tuple(stuck) if kept >= 2 and kept > len(stuck) else ()


def _failed_line(point: int, earlier: int, runs: dict[int, list[dict[str, Any]]], failed: tuple[int, ...]) -> str:
    """The calibration's one WARNING line when it leaves failed runs out."""
    def reading(seed: int, step: int) -> float:
        return next(run["val_accuracy"] for run in runs[step] if run["seed"] == seed)

    stuck = "; ".join(f"seed {seed} at {reading(seed, point):.3f} ({reading(seed, earlier):.3f} at {earlier})"
                      for seed in failed)
    kept = ", ".join(f"{run['val_accuracy']:.3f}" for run in runs[point] if run["seed"] not in failed)
    return (f"calibration: at {point} steps all-high stands nearer chance than its other seeds on {stuck}: a "
            f"failed run, left out of the reference; proxies are held to the seeds that learned ({kept}); if "
            "runs fail this often, lower the space's proxy lr")


def _sampling_floor(accuracies: list[float], context: SearchContext) -> str:
    """Why no length resolves the allowed drop, or "": the seeds differ by no more than the validation set's own
    sampling noise explains (at the best seed's accuracy), and even that noise would leave a margin over half the
    drop. Seeds further apart (one still learning: 91%, 91% and 38%) may yet draw together."""
    sd = context.sampling_sd(max(accuracies))
    if not explained_by(accuracies, sd, context.budget.confidence):  # seeds further apart than sampling explains
        return ""
    if resolves(Noise(sd, context.validation_size - 1, context.budget.confidence), context.budget.drop,
                len(accuracies)):
        return ""
    return (f"the validation set's sampling noise alone ({100 * sd:.2f} points over {context.validation_size} "
            "images at this accuracy) is too large for that, which more steps do not shrink")


def _late_plateau(earlier: int, point: int, before: list[float], now: list[float]) -> str:
    """The calibration's one WARNING line when the reference reached 100% only in the doubling to the cap."""
    return (f"calibration: the all-high reference reached {100 * float(np.mean(now)):.1f}% (from "
            f"{100 * float(np.mean(before)):.1f}% at {earlier} steps) only by {point} steps, the cap: proxies of "
            f"{point} steps judge assignments that learn more slowly than all-high before they level off, so "
            f"picks lean high; raise --max-proxy-steps to {2 * point} to give them a doubling")


def _disagreement(point: int, accuracies: list[float], noise: Noise, context: SearchContext, cause: str,
                  longer: bool) -> str:
    """The calibration's one WARNING line; ``longer``: whether more steps could still help."""
    budget = context.budget
    margin = 100 * float(noise.margin(MAX_SEEDS, len(accuracies)))
    remedy = "raise --max-proxy-steps" if longer else "validate on more images"
    return (f"calibration: at {point} steps the all-high reference's seeds still disagree (accuracy per seed "
            f"{', '.join(f'{value:.3f}' for value in accuracies)}; margin {margin:.2f} points with {MAX_SEEDS} "
            f"seeds per proxy) and {cause}: proxies cannot resolve a {100 * budget.drop:g}-point drop at "
            f"{100 * budget.confidence:g}% confidence, so picks stay close to all-high; allow a larger drop "
            f"(--max-accuracy-drop), give more reference seeds (--proxy-seeds N) or {remedy}")


def _accuracies(runs: list[dict[str, Any]]) -> list[float]:
    return [run["val_accuracy"] for run in runs]


def _learned(runs: list[dict[str, Any]], chance: float) -> bool:
    return bool(runs) and all(not run["diverged"] and run["val_accuracy"] > chance for run in runs)


def _flat(before: list[float], after: list[float], confidence: float, drop: float) -> bool:
    """The mean gain from ``before`` to ``after`` is within the seed noise (and at most ``drop`` if less)."""
    noise = pooled_noise(pd.DataFrame(), confidence, extra=[before, after])
    gain = float(np.mean(after) - np.mean(before))
    return gain <= max(float(noise.margin(len(after), len(before))), drop) + 1e-12
