"""Confirmation: the Pareto front trained again, longer and on fresh seeds, against the all-high reference
continued to the same length, before any pick is written.

Proxies earn their speed only by agreeing with longer runs, and their rank agreement is modest, so front points
(within the memory budget, if any) are trained for ``factor`` times the proxy length (default 3) on seeds no
proxy used, as many as the reference's at most. The reference is calibration's own runs continued from their
checkpoints (precsearch.train.continuing), so it costs the steps past the proxy length only; it was never
selected by its accuracy, so its seeds need not be fresh. Every confirmation run holds the proxies' rate to the
proxy length and then decays along one cosine to its end (``decay_start``): a longer run at the peak rate is
not what a user trains, and may blow up whatever the precision (mobilenet_v2's reference and plain fp32 both
did, at the constant rate past 2L). ``best.json`` is chosen from confirmed accuracies only
(precsearch.search.selection): a point whose confirmation falls short is not picked, the next confirmed one is.
A plain fp32 run on the first fresh seed is the report's yardstick; it decides nothing, so it trains one seed.

Under an accuracy-drop rule the pick is the least memory confirmed within the drop, so confirmation is
sequential: the points in memory order, stopping at the first confirmed, and seeds race (``race``): the
reference continues two of its runs first (the fewest that measure its noise), and the point or the reference
gains a seed only while the rule is undecided. Under a memory budget every point and the reference train on
every seed. Once an all-high run diverged no point is trained (``reference_divergence``). Each run is a step of
the study's ``Ledger``, taken in the order reference, plain fp32, points, so a resumed or joining worker goes on
where it stood and none waits while a run it could train is free.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import pandas as pd

from precsearch.config.policy import Policy
from precsearch.errors import PrecsearchError
from precsearch.search.calibration import REFERENCE_RUN, reference_policy, run_record
from precsearch.search.context import SearchContext
from precsearch.search.ledger import Ledger, recorded
from precsearch.search.noise import Noise, pooled_noise

__all__ = ["CONFIRM_SEED_OFFSET", "DEFAULT_CONFIRM_FACTOR", "MAX_CONFIRM_FACTOR", "PLAIN_FP32",
           "RACING_REFERENCE_SEEDS", "Confirmation", "confirm", "confirmation_length", "decay_start", "race",
           "recorded_confirmation", "reference_divergence"]

DEFAULT_CONFIRM_FACTOR = 3.0
MAX_CONFIRM_FACTOR = 100  # confirmation runs of 100 proxies each are already far longer than the search
CONFIRM_SEED_OFFSET = 1000  # confirmation seeds are the search seed + 1000, 1001, ...: no proxy used them
PLAIN_FP32 = "plain-fp32"  # the key of the plain fp32 runs
RACING_REFERENCE_SEEDS = 2  # the reference's runs continued before any point races: the fewest with a noise
CONFIRMATION = "confirmation"  # the study user attr that says which runs the confirmation is (``summary``)


def confirmation_length(length: int, factor: float) -> int:
    if factor < 1:
        raise PrecsearchError(f"confirmation factor {factor:g} must be at least 1 (a multiple of the proxy length)")
    return max(1, round(factor * length))


def decay_start(proxy_length: int, length: int) -> int | None:
    """The step after which a confirmation run of ``length`` steps ends in one long decay: the proxy length, where
    the reference's calibration runs were read (None at the proxy length itself: read off the usual branch)."""
    return proxy_length if proxy_length < length else None


Decide = Callable[[list[dict[str, Any]], list[dict[str, Any]]], bool | None]  # (a point's runs, all-high's)


def race(train_point: Callable[[int], dict[str, Any]], train_reference: Callable[[int], dict[str, Any]],
         seeds: Sequence[int], reference_seeds: Sequence[int], decide: Decide, high_runs: Sequence[dict[str, Any]]
         ) -> tuple[list[dict[str, Any]], list[dict[str, Any]], bool | None]:
    """A point's runs on ``seeds`` and all-high's on ``reference_seeds`` (``high_runs`` those it has already), a
    seed at a time while ``decide`` holds the point undecided: the side with fewer runs gains the next seed,
    all-high at a tie (its runs serve every later point too); then the verdict (None: undecided)."""
    runs, high = [train_point(seeds[0])], list(high_runs)
    while (verdict := decide(runs, high)) is None:
        if len(high) < len(reference_seeds) and (len(high) <= len(runs) or len(runs) == len(seeds)):
            high.append(train_reference(reference_seeds[len(high)]))
        elif len(runs) < len(seeds):
            runs.append(train_point(seeds[len(runs)]))
        else:
            break
    return runs, high, verdict


@dataclass(frozen=True)
class Confirmation:
    """Confirmation runs (``run_record``s) by assignment key (``PLAIN_FP32`` for plain training): the
    ``reference`` key's on ``reference_seeds`` (calibration's, continued), every other key's on fresh ``seeds``."""

    length: int
    runs: dict[str, list[dict[str, Any]]]
    seeds: tuple[int, ...]
    reference: str
    reference_seeds: tuple[int, ...]

    def summary(self) -> dict[str, Any]:
        """Which runs these are (recorded in the study, and in run.json)."""
        return {"length": self.length, "seeds": list(self.seeds), "reference": self.reference,
                "reference_seeds": list(self.reference_seeds),
                "runs": {key: len(runs) for key, runs in self.runs.items()}}

    def table(self) -> pd.DataFrame:
        """One row per key: confirmed mean accuracy, sd, seeds, diverged, steps, and batch-statistics accuracy."""
        rows = []
        for key, runs in self.runs.items():
            accuracies = [run["val_accuracy"] for run in runs]
            batch = [run.get("batch_stats_accuracy") for run in runs]
            rows.append({"key": key, "confirmed_accuracy": float(np.mean(accuracies)),
                         "confirmed_batch_stats_accuracy": math.nan if None in batch else float(np.mean(batch)),
                         "confirmed_sd": float(np.std(accuracies, ddof=1)) if len(runs) > 1 else float("nan"),
                         "confirmed_seeds": len(runs), "confirmed_diverged": any(run["diverged"] for run in runs),
                         "confirmed_steps": self.length})
        return pd.DataFrame(rows, columns=["key", "confirmed_accuracy", "confirmed_batch_stats_accuracy",
                                           "confirmed_sd", "confirmed_seeds", "confirmed_diverged", "confirmed_steps"])

    def noise(self, confidence: float, keys: Sequence[str] | None = None) -> Noise:
        """The pooled seed noise of the confirmation runs of ``keys`` (default: every confirmed policy, not fp32)."""
        chosen = [key for key in self.runs if key != PLAIN_FP32] if keys is None else keys
        return pooled_noise(pd.DataFrame(), confidence, extra=[[run["val_accuracy"] for run in self.runs[key]]
                                                                 for key in chosen])

    @property
    def steps(self) -> int:
        return sum(run["steps_spent"] for runs in self.runs.values() for run in runs)


def recorded_confirmation(attrs: Mapping[str, Any]) -> Confirmation | None:
    """The confirmation among a study's user ``attrs`` (``confirm`` records its summary when done), or None."""
    summary = attrs.get(CONFIRMATION)
    if summary is None:
        return None
    # a study recorded before the reference continued calibration's runs trained it on the fresh seeds too
    seeds, reference = tuple(summary["seeds"]), summary.get("reference", "")
    reference_seeds = tuple(summary.get("reference_seeds", seeds))
    runs = {key: [recorded(attrs, _step(key, seed))
                  for seed in (reference_seeds if key == reference else seeds)[:count]]
            for key, count in summary["runs"].items()}
    return Confirmation(summary["length"], runs, seeds, reference, reference_seeds)


def reference_divergence(high: Sequence[Mapping[str, Any]]) -> str | None:
    """Why nothing can be picked when one of all-high's confirmation runs (``run_record``s) diverged, or None:
    no point is confirmed against a reference that does not train at that length."""
    run = next((run for run in high if run["diverged"]), None)
    if run is None:
        return None
    return (f"the all-high reference diverged in confirmation (seed {run['seed']}: {run['reason'] or 'diverged'}): "
            "no pick; lower the space's proxy lr or --confirm-factor")


def _step(key: str, seed: int) -> str:
    return f"confirm:{key}:{seed}"


def confirm(context: SearchContext, ledger: Ledger, high: str, reference_seeds: Sequence[int],
            front: Mapping[str, Policy], proxy_length: int, length: int, seeds: Sequence[int],
            report: Callable[[int, float], None], decide: Decide | None) -> Confirmation:
    """Continue the all-high reference's runs (key ``high``) to ``length`` steps, train plain fp32 and the
    ``front`` points in memory order (raced when ``decide`` is given); the study records which runs at the end."""
    recorded_before = recorded_confirmation(ledger.study.user_attrs)
    if recorded_before is not None:
        return recorded_before

    def trained(key: str, policy: Policy | None, chosen: Sequence[int], checkpoint_key: str | None = None,
                wait: bool = True) -> list[dict[str, Any]]:
        """``key``'s runs on ``chosen`` seeds, each continuing its checkpoint under ``checkpoint_key`` (default
        ``key``); ``wait=False``: see ``Ledger.run``."""
        checkpoint_key = checkpoint_key or key

        def work(seed: int) -> dict[str, Any]:
            result = context.trainer(policy, length, seed, report=report, decay_from=decay_start(proxy_length, length),
                                     checkpoint=context.checkpoint(checkpoint_key, seed))
            context.drop_checkpoint(checkpoint_key, seed)
            return run_record(result, seed)

        return ledger.run_seeds(lambda seed: _step(key, seed), chosen, work, wait)

    def reference(chosen: Sequence[int], wait: bool = True) -> list[dict[str, Any]]:
        return trained(high, reference_policy(context), chosen, REFERENCE_RUN, wait)

    first = reference_seeds if decide is None else reference_seeds[:RACING_REFERENCE_SEEDS]
    reference(first, wait=False)  # the runs no other worker holds: a worker finding none free trains plain fp32
    runs = {high: [], PLAIN_FP32: trained(PLAIN_FP32, None, seeds[:1], wait=False)}
    runs[high] = reference(first)
    for key, policy in front.items():
        if reference_divergence(runs[high]) is not None:  # the search says why, once (precsearch.search.study)
            break
        if decide is None:
            runs[key] = trained(key, policy, seeds)
            continue
        runs[key], runs[high], verdict = race(lambda seed, key=key, policy=policy: trained(key, policy, [seed])[0],
                                              lambda seed: reference([seed])[0], seeds, reference_seeds, decide,
                                              runs[high])
        if verdict:
            break
    runs[PLAIN_FP32] = trained(PLAIN_FP32, None, seeds[:1])  # waited for here if another worker trains it
    for seed in reference_seeds[len(runs[high]):]:  # runs the race did not need: nothing continues them
        context.drop_checkpoint(REFERENCE_RUN, seed)
    confirmation = Confirmation(length, runs, tuple(seeds), high, tuple(reference_seeds))
    ledger.study.set_user_attr(CONFIRMATION, confirmation.summary())
    return confirmation
