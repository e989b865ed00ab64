"""The pick: the Pareto front of a trials table, and the point a budget picks from it, never on a
difference smaller than the seed noise allows. The search picks from confirmed accuracies
(precsearch.search.confirmation, ``confirmed_pick``), so a point whose proxy looked good but whose confirmation
failed is never the pick.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import pandas as pd

from precsearch.search.confirmation import Confirmation, Decide, reference_divergence
from precsearch.search.context import Budget
from precsearch.search.noise import Noise, pooled_noise
from precsearch.search.reference import Reference, proxy_noise

__all__ = ["Pick", "choose_best", "confirmable_front", "confirmation_rule", "confirmation_verdict", "confirmed_front",
           "confirmed_pick", "drop_verdict", "mark_ties", "pareto_front", "race_settled", "untrained_reason", "usable",
           "within_drop"]


CANDIDATE_DF = 2  # degrees of freedom candidates measure before a noise of zero is believed (``race_settled``)


def usable(frame: pd.DataFrame) -> pd.Series:
    """Rows of complete, trained proxies that neither diverged nor were stopped at a rung."""
    stopped = frame["stopped_at"].notna() if "stopped_at" in frame else False
    return (frame["state"] == "COMPLETE") & frame["trained"].astype(bool) & ~frame["diverged"].astype(bool) & ~stopped


def pareto_front(frame: pd.DataFrame, objective: str = "val_error") -> pd.DataFrame:
    """Non-dominated ``usable`` trials in (memory, objective), one per assignment, by memory."""
    if frame.empty:
        return frame
    ok = frame[usable(frame)]
    ok = ok.sort_values(["memory", objective, "number"]).drop_duplicates("key")
    front, best = [], math.inf
    for index, row in ok.iterrows():
        if row[objective] < best:
            front.append(index)
            best = row[objective]
    return ok.loc[front]


def choose_best(frame: pd.DataFrame, budget: Budget, reference: float | None, noise: Noise | None = None,
                reference_seeds: int = 1, reference_key: str | None = None, chance: float = 0.0
                ) -> pd.Series | None:
    """The point the budget picks among ``usable`` trials above ``chance`` accuracy (None when none qualifies,
    or the all-high ``reference`` is None or at chance), never on a difference of means smaller than the seed
    ``noise`` allows: under ``max_memory`` ``_least_memory_among_ties``, else ``_confidently_within_drop``, where
    all-high itself (``reference_key``) always qualifies, so too much noise picks all-high rather than nothing.
    The row gets ``pick_confidence``: the confidence that the rule holds for its true accuracy (NaN when the
    noise is unmeasured or the pick is the reference itself)."""
    if frame.empty:
        return None
    noise = noise or Noise(math.nan, 0, budget.confidence)
    ok = frame[usable(frame) & (frame["val_accuracy"] > chance)]
    if budget.max_memory is not None:
        return _least_memory_among_ties(ok[ok["memory"] <= budget.max_memory + 1e-12], noise)
    if reference is None or reference <= chance:
        return None
    return _confidently_within_drop(ok, reference, reference_seeds, budget.drop, noise, reference_key)


def untrained_reason(frame: pd.DataFrame, budget: Budget, reference: Reference, key: str, planned: float,
                     chance: float) -> str | None:
    """Why a candidate with assignment ``key`` and ``planned`` memory is not trained (None: it is): it is over the
    memory budget, or the accuracy-drop pick among the proxies of ``frame`` so far has at most its memory."""
    if budget.max_memory is not None:
        return "over the memory budget" if planned > budget.max_memory else None
    if key == reference.key or frame.empty or reference.accuracy is None:
        return None
    best = choose_best(frame, budget, reference.accuracy, proxy_noise(frame, reference, budget.confidence),
                       len(reference.accuracies), reference.key, chance)
    if best is None or best["memory"] > planned:
        return None
    return (f"trial {int(best['number'])} has less memory ({best['memory']:.4f}) and is within the allowed drop: "
            "no training needed")


def race_settled(frame: pd.DataFrame, accuracies: Sequence[float], reference: Reference, budget: Budget) -> bool:
    """Whether a candidate's seeds so far (``accuracies``) settle the accuracy-drop rule (``drop_verdict``), so
    racing adds no seed (never under a memory budget, whose pick compares candidates with each other). A noise of
    zero (all-high at 100% on every seed, say) settles nothing until the candidates of ``frame`` have measured
    ``CANDIDATE_DF`` degrees of freedom of their own: low precision may scatter where all-high does not."""
    if budget.max_memory is not None or reference.accuracy is None:
        return False
    noise = proxy_noise(frame, reference, budget.confidence)
    if noise.sd == 0 and len(accuracies) < 2:
        candidates = frame[frame["key"] != reference.key] if not frame.empty else frame
        if pooled_noise(candidates, budget.confidence).df < CANDIDATE_DF:
            return False
    verdict = drop_verdict(accuracies, reference.accuracy, len(reference.accuracies), budget.drop, noise)
    return verdict is not None


def pick_pairwise(candidates: pd.DataFrame, budget: Budget, reference: float, reference_seeds: int,
                  reference_key: str, chance: float, noise_for: Callable[[str], Noise]) -> pd.Series | None:
    """``choose_best`` under an accuracy-drop budget, least memory first, each point held to the reference with
    the seed noise of those two alone (``noise_for(key)``): one point's scatter cannot sink another's pick."""
    ordered = candidates.sort_values(["memory", "val_accuracy", "number"], ascending=[True, False, True])
    for _, row in ordered.iterrows():
        pair = candidates[candidates["key"].isin([row["key"], reference_key])]
        best = choose_best(pair, budget, reference, noise_for(row["key"]), reference_seeds, reference_key, chance)
        if best is not None and best["key"] == row["key"]:
            return best
    return None


def confirmed_front(front: pd.DataFrame, confirmed: pd.DataFrame) -> pd.DataFrame:
    """The front points that were confirmed, their confirmed figures in the columns ``choose_best`` reads (the
    proxy's accuracy kept as ``proxy_accuracy``)."""
    rows = front[front["key"].isin(confirmed["key"])].copy()
    table = confirmed.set_index("key")
    rows["proxy_accuracy"] = rows["val_accuracy"]
    for column, source in (("val_accuracy", "confirmed_accuracy"), ("val_accuracy_sd", "confirmed_sd"),
                           ("seeds", "confirmed_seeds"), ("diverged", "confirmed_diverged")):
        rows[column] = rows["key"].map(table[source])
    return rows


def _seeds_of(frame: pd.DataFrame) -> pd.Series:
    return frame["seeds"].fillna(1) if "seeds" in frame else pd.Series(1, index=frame.index)


def _least_memory_among_ties(ok: pd.DataFrame, noise: Noise) -> pd.Series | None:
    """Least memory (then best accuracy) among trials not distinguishably less accurate than the best mean."""
    if ok.empty:
        return None
    seeds = _seeds_of(ok)
    top = ok["val_accuracy"].idxmax()
    gap = ok.loc[top, "val_accuracy"] - ok["val_accuracy"]
    ties = ok[gap <= noise.margin(seeds, seeds[top]) + 1e-12]
    best = ties.sort_values(["memory", "val_accuracy", "number"], ascending=[True, False, True]).iloc[0].copy()
    best["pick_confidence"] = (math.nan if best.name == top else
                               1 - noise.probability_above(gap[best.name], 0.0, seeds[best.name], seeds[top]))
    return best


def within_drop(mean: Any, seeds: Any, reference: float, reference_seeds: int, drop: float, noise: Noise) -> Any:
    """The accuracy-drop rule: the one-sided bound on (mean - reference) is at least ``-drop`` (per row of Series)."""
    return mean - noise.margin(seeds, reference_seeds) >= reference - drop - 1e-12


def drop_verdict(accuracies: Sequence[float], reference: float, reference_seeds: int, drop: float,
                 noise: Noise) -> bool | None:
    """Where the accuracy-drop rule stands on per-seed ``accuracies``: True (within the drop), False (below it by
    more than the margin: no seed more would let it pass), None (undecided: racing adds a seed)."""
    mean = float(np.mean(accuracies))
    if within_drop(mean, len(accuracies), reference, reference_seeds, drop, noise):
        return True
    if mean + noise.margin(len(accuracies), reference_seeds) < reference - drop:
        return False
    return None


def confirmation_verdict(runs: Sequence[Mapping[str, Any]], high: Sequence[Mapping[str, Any]], budget: Budget,
                         chance: float) -> bool | None:
    """``drop_verdict`` on a point's confirmation runs against all-high's, with the seed noise of those two alone;
    a point that diverged or sits at chance fails, and so does every point once all-high diverged."""
    accuracies = [run["val_accuracy"] for run in runs]
    if any(run["diverged"] for run in runs) or np.mean(accuracies) <= chance or reference_divergence(high):
        return False
    reference = [run["val_accuracy"] for run in high]
    noise = pooled_noise(pd.DataFrame(), budget.confidence, extra=[accuracies, reference])
    return drop_verdict(accuracies, float(np.mean(reference)), len(reference), budget.drop, noise)


def _confidently_within_drop(ok: pd.DataFrame, reference: float, reference_seeds: int, drop: float,
                             noise: Noise, reference_key: str | None) -> pd.Series | None:
    """Least memory (then best accuracy) among the trials ``within_drop``, and the reference assignment itself."""
    seeds = _seeds_of(ok)
    itself = ok["key"] == reference_key
    ok = ok[itself | within_drop(ok["val_accuracy"], seeds, reference, reference_seeds, drop, noise)]
    if ok.empty:
        return None
    best = ok.sort_values(["memory", "val_accuracy", "number"], ascending=[True, False, True]).iloc[0].copy()
    best["pick_confidence"] = (math.nan if best["key"] == reference_key else noise.probability_above(
        best["val_accuracy"] - reference, -drop, _seeds_of(ok)[best.name], reference_seeds))
    return best


def confirmable_front(frame: pd.DataFrame, budget: Budget, objective: str, chance: float) -> pd.DataFrame:
    """The front points confirmation trains: those that can be picked whatever their confirmation says (within the
    memory budget, neither diverged nor at chance)."""
    front = pareto_front(frame, objective)
    if budget.max_memory is not None and not front.empty:
        front = front[front["memory"] <= budget.max_memory + 1e-12]
    if not front.empty:
        front = front[(front["val_accuracy"] > chance) & ~front["diverged"].astype(bool)]
    return front


def confirmation_rule(budget: Budget, chance: float) -> Decide | None:
    """How confirmation decides a point: seed by seed under an accuracy-drop rule; under a memory budget, whose pick
    compares the points with each other, on every seed (None)."""
    if budget.max_memory is not None:
        return None
    return lambda runs, high: confirmation_verdict(runs, high, budget, chance)


def mark_ties(front: pd.DataFrame, noise: Noise) -> pd.DataFrame:
    """The front with ``within_noise_of``: for each point, the cheapest front point (trial number) it is not
    distinguishably more accurate than, or -1 (the extra memory buys measurable accuracy)."""
    front = front.sort_values("memory").copy()
    seeds = _seeds_of(front)
    marks = []
    for position, (index, row) in enumerate(front.iterrows()):
        cheaper = front.iloc[:position]
        gain = row["val_accuracy"] - cheaper["val_accuracy"]
        tied = cheaper[gain <= noise.margin(seeds[index], seeds[cheaper.index]) + 1e-12]
        marks.append(int(tied["number"].iloc[0]) if not tied.empty else -1)
    front["within_noise_of"] = marks
    return front


@dataclass(frozen=True)
class Pick:
    """The budget's pick among confirmed points: ``best`` (None: no pick, ``note`` says why), the confirmation
    ``noise`` it was decided with, and a ``note`` naming the proxy pick confirmation replaced, if any."""

    best: pd.Series | None
    note: str
    noise: Noise | None = None


def confirmed_pick(frame: pd.DataFrame, front: pd.DataFrame, confirmation: Confirmation | None,
                   reference: Reference | None, budget: Budget, chance: float, proxy_noise: Noise) -> Pick:
    """The budget's pick among the confirmed points of the trials table ``frame`` (the front's and all-high),
    each held to the confirmed all-high reference; none until confirmation has run."""
    if confirmation is None or reference is None:
        return Pick(None, "confirmation has not run (the search was interrupted: --resume finishes it)")
    confirmed = confirmation.table()
    table = confirmed.set_index("key")
    high = reference.key
    if high not in table.index:
        return Pick(None, "the all-high reference has no confirmation run: no pick; --resume finishes it")
    if (why := reference_divergence(confirmation.runs[high])) is not None:
        return Pick(None, why)
    accuracy = float(table.loc[high, "confirmed_accuracy"])
    if accuracy <= chance:
        return Pick(None, f"the all-high reference reached only {accuracy:.3f} in confirmation, no better than "
                          f"chance ({chance:.3f}): no pick")
    ok = frame[usable(frame)].sort_values("number").drop_duplicates("key") if not frame.empty else frame
    candidates = confirmed_front(ok, confirmed)
    seeds = int(table.loc[high, "confirmed_seeds"])

    def pair_noise(key: str) -> Noise:  # a point is held to all-high with the noise of those two alone
        return confirmation.noise(budget.confidence, keys=sorted({key, high}))

    if budget.max_memory is None:
        best = pick_pairwise(candidates, budget, accuracy, seeds, high, chance, pair_noise)
    else:
        best = choose_best(candidates, budget, accuracy, confirmation.noise(budget.confidence), seeds, high, chance)
    if best is None:
        return Pick(None, f"no confirmed point within the budget beats chance accuracy ({chance:.3f}): no pick")
    noise = pair_noise(best["key"]) if budget.max_memory is None else confirmation.noise(budget.confidence)
    proxy_pick = choose_best(front, budget, reference.accuracy, proxy_noise, len(reference.accuracies), high, chance)
    if proxy_pick is not None and proxy_pick["key"] != best["key"]:
        return Pick(best, f"the proxies alone would pick trial {int(proxy_pick['number'])} (memory "
                          f"{proxy_pick['memory']:.3f}); confirmation picks trial {int(best['number'])}", noise)
    return Pick(best, "", noise)
