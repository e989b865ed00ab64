"""The run directory, rebuilt from the study alone: trials.csv, pareto.csv, policies/, calibration.csv,
budget.csv, sensitivity.csv and best.json (each written atomically). This module decides nothing: it writes.
A pick of an earlier export that no longer holds is removed.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import optuna
import pandas as pd

from precsearch.config.policy import Policy
from precsearch.files import atomic_write_text
from precsearch.search.accounting import budget_table
from precsearch.search.calibration import Calibration, recorded_calibration
from precsearch.search.confirmation import PLAIN_FP32, Confirmation, recorded_confirmation
from precsearch.search.context import SearchContext
from precsearch.search.noise import Noise
from precsearch.search.peaks import PICK_PEAK
from precsearch.search.reference import Reference, proxy_noise
from precsearch.search.selection import Pick, confirmed_pick, mark_ties, pareto_front
from precsearch.search.sensitivity_table import recorded_table, save_table
from precsearch.search.strategies import R_GRID
from precsearch.search.trials import copies, policy_of, trials_frame
from precsearch.train.reading import flagged

__all__ = ["Decision", "SearchResult", "decide", "export", "pick_policy"]


@dataclass
class SearchResult:
    """What a search left in its run directory, as tables (``export`` writes them)."""

    out_dir: Path
    trials: pd.DataFrame
    pareto: pd.DataFrame
    best: pd.Series | None
    noise: Noise | None = None  # the pooled seed noise of the proxies
    note: str = ""  # why best is None, or which proxy pick confirmation replaced
    calibration: Calibration | None = None
    confirmation: Confirmation | None = None  # the confirmation runs (``.table()``: accuracy per key)
    budget: pd.DataFrame | None = None  # training steps per phase (precsearch.search.accounting)
    wall_time: float = 0.0  # seconds the search ran (``run_search`` sets it)
    interrupted: bool = False


def _policy_for_row(row: pd.Series, study: optuna.Study, context: SearchContext, role: str) -> Policy:
    trial = study.get_trials(deepcopy=False)[int(row["number"])]
    calibration = recorded_calibration(study.user_attrs)
    proxy = {"val_accuracy": float(row.get("proxy_accuracy", row["val_accuracy"])), "val_loss": float(row["val_loss"]),
             "memory": float(row["memory"]), "promotions": int(row["promotions"])}
    return policy_of(trial, context, {
        "strategy": str(row["origin"]), "role": role, "trial": int(row["number"]), "space": context.space.name,
        "space_fingerprint": context.space.fingerprint(), "seed": context.seed,
        "proxy_steps": None if calibration is None else calibration.length, "data": context.data_spec.name,
        "proxy": proxy})


@dataclass(frozen=True)
class Decision:
    """What the storage holds, read once, and the pick ``selection.confirmed_pick`` makes of it."""

    frame: pd.DataFrame
    front: pd.DataFrame
    noise: Noise
    calibration: Calibration | None
    confirmation: Confirmation | None
    reference: Reference
    pick: Pick


def decide(study: optuna.Study, context: SearchContext) -> Decision:
    """The trials table, the Pareto front (ties marked), the seed noise and the pick, from the storage."""
    attrs = study.user_attrs
    reference = Reference.from_study(study)
    frame = trials_frame(study, context)
    noise = proxy_noise(frame, reference, context.budget.confidence)
    confirmation = recorded_confirmation(attrs)
    front = pareto_front(frame, context.space.accuracy_objective)
    if not front.empty:
        front = mark_ties(front, noise)
    pick = confirmed_pick(frame, front, confirmation, reference, context.budget, context.chance, noise)
    return Decision(frame, front, noise, recorded_calibration(attrs), confirmation, reference, pick)


def pick_policy(study: optuna.Study, context: SearchContext, best: pd.Series) -> Policy:
    """best.json's policy, without what the export adds to its provenance."""
    return _policy_for_row(best, study, context, f"best: {context.budget.describe()}")


def export(study: optuna.Study, context: SearchContext, out_dir: Path, decision: Decision | None = None
           ) -> SearchResult:
    """Rewrite the run directory's tables, policies and pick from the storage and the search's ``decision``
    (``decide``'s, made here when the search stopped before its pick; see the module docstring)."""
    attrs = study.user_attrs
    decision = decision or decide(study, context)
    frame, front, noise, pick = decision.frame, decision.front, decision.noise, decision.pick
    calibration, confirmation, reference = decision.calibration, decision.confirmation, decision.reference
    confirmed = confirmation.table() if confirmation is not None else None
    if confirmed is not None:
        confirmed["confirmed_reading_flagged"] = [flagged(accuracy, batch, context.budget.drop) for accuracy, batch
                                                  in zip(confirmed["confirmed_accuracy"],
                                                         confirmed["confirmed_batch_stats_accuracy"], strict=True)]
        frame = frame.merge(confirmed, on="key", how="left") if not frame.empty else frame
        front = front.merge(confirmed, on="key", how="left").set_axis(front.index) if not front.empty else front
    atomic_write_text(out_dir / "trials.csv", frame.to_csv(index=False))
    atomic_write_text(out_dir / "pareto.csv", front.to_csv(index=False))
    _write_policies(front, study, context, out_dir)
    if calibration is not None:
        atomic_write_text(out_dir / "calibration.csv", calibration.frame().to_csv(index=False))
    table = recorded_table(attrs)
    if table is not None:
        save_table(table, out_dir)
    budget = None
    if calibration is not None:
        budget = _budget(frame, calibration, confirmation, reference, context)
        atomic_write_text(out_dir / "budget.csv", budget.to_csv(index=False))
    _write_pick(pick, study, context, out_dir, confirmation, reference)
    return SearchResult(out_dir, frame, front, pick.best, noise, "" if pick.best is not None else pick.note,
                        calibration, confirmation, budget)


def _write_pick(pick: Pick, study: optuna.Study, context: SearchContext, out_dir: Path,
                confirmation: Confirmation | None, reference: Reference | None) -> None:
    """best.json, or none: a pick of an earlier export that no longer holds must not stay behind."""
    if pick.best is None:
        (out_dir / "best.json").unlink(missing_ok=True)
        return
    policy = pick_policy(study, context, pick.best)
    provenance = _pick_provenance(pick, confirmation, reference.key)
    measured = study.user_attrs.get(PICK_PEAK)
    if measured is not None and measured["key"] == pick.best["key"]:
        provenance["peak"] = measured["peaks"]
    policy.replace(provenance={**policy.provenance, **provenance}).save(out_dir / "best.json")


def _write_policies(front: pd.DataFrame, study: optuna.Study, context: SearchContext, out_dir: Path) -> None:
    policies = out_dir / "policies"
    policies.mkdir(exist_ok=True)
    wanted = set()
    for _, row in front.iterrows():
        name = f"trial_{int(row['number']):04d}.json"
        wanted.add(name)
        if not (policies / name).is_file():
            _policy_for_row(row, study, context, "pareto").save(policies / name)
    for stale in policies.glob("trial_*.json"):
        if stale.name not in wanted:
            stale.unlink()


def _pick_provenance(pick: Pick, confirmation: Confirmation, high: str) -> dict[str, Any]:
    """best.json's ``noise`` (the decision's statement) and ``confirmation`` (the runs it rests on)."""
    best, noise = pick.best, pick.noise
    table = confirmation.table().set_index("key")

    def confirmed(key: str, column: str) -> float | int | None:  # a Python number, for JSON
        return table.loc[key, column].item() if key in table.index else None

    statement = {**noise.to_dict(), "seeds": int(best["seeds"]), "pick_confidence": float(best["pick_confidence"]),
                 "statement": _pick_statement(best, noise)}
    record = {"steps": confirmation.length, "seeds": int(best["seeds"]),
              "proxy_accuracy": float(best["proxy_accuracy"]), "confirmed_accuracy": float(best["val_accuracy"]),
              "confirmed_sd": float(best["val_accuracy_sd"]),
              "all_high_accuracy": confirmed(high, "confirmed_accuracy"),
              "all_high_seeds": confirmed(high, "confirmed_seeds"),
              "plain_fp32_accuracy": confirmed(PLAIN_FP32, "confirmed_accuracy"),
              "plain_fp32_seeds": confirmed(PLAIN_FP32, "confirmed_seeds"), "note": pick.note}
    return {"noise": _no_nan(statement), "confirmation": _no_nan(record)}


def _no_nan(values: dict[str, Any]) -> dict[str, Any]:
    """JSON has no NaN."""
    return {name: None if isinstance(value, float) and math.isnan(value) else value for name, value in values.items()}


def _pick_statement(best: pd.Series, noise: Noise) -> str:
    """One sentence on how sure the pick is."""
    if not noise.measured:
        return noise.describe()
    confidence = best["pick_confidence"]
    sure = "no bound needed (it is all-high or the best mean)" if math.isnan(confidence) else \
        f"{100 * confidence:.0f}% confidence"
    return f"{noise.describe()} (confirmation runs); trial {int(best['number'])} picked with {sure}"


def _budget(frame: pd.DataFrame, calibration: Calibration, confirmation: Confirmation | None,
            reference: Reference | None, context: SearchContext) -> pd.DataFrame:
    fresh = frame[~copies(frame)] if not frame.empty else frame
    factor = context.settings["confirm_factor"]
    confirm_length = confirmation.length if confirmation is not None else round(factor * calibration.length)
    return budget_table(
        fresh, calibration_runs=sum(len(runs) for runs in calibration.runs.values()),
        calibration_steps=calibration.steps, rungs=reference.rung_steps(context.chance) if reference else [],
        length=calibration.length, proxy_seeds=reference.proxy_seeds if reference is not None else 1,
        confirmation_runs=sum(len(runs) for runs in confirmation.runs.values()) if confirmation else 0,
        confirmation_steps=confirmation.steps if confirmation else 0, confirmation_length=confirm_length,
        sweep_points=len(R_GRID))
