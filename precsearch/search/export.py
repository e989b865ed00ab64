"""The run directory, rebuilt from the study alone: trials.csv, pareto.csv, policies/, calibration.csv,
budget.csv, sensitivity.csv (with the sensitivity seeding) and best.json (each written atomically).

best.json comes only from confirmed points (precsearch.search.confirmation): until the confirmation runs
are recorded there is no pick, and a pick of an earlier export that no longer holds is removed.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import optuna
import pandas as pd
from optuna.trial import FrozenTrial, TrialState

from precsearch.config.policy import Policy
from precsearch.files import atomic_write_text
from precsearch.search.accounting import budget_table
from precsearch.search.calibration import Calibration, recorded_calibration
from precsearch.search.confirmation import PLAIN_FP32, Confirmation, recorded_confirmation
from precsearch.search.context import SearchContext
from precsearch.search.noise import Noise, pooled_noise
from precsearch.search.rungs import rung_steps
from precsearch.search.selection import choose_best, confirmed_front, mark_ties, pareto_front, pick_pairwise, usable
from precsearch.search.sensitivity_table import save_table
from precsearch.search.strategies import R_GRID, assign, uniform

__all__ = ["Exported", "export", "feasible", "params_of", "study_noise", "trials_frame"]


@dataclass
class Exported:
    """What an export wrote, as tables; ``note`` says why ``best`` is None when it is."""

    trials: pd.DataFrame
    pareto: pd.DataFrame
    best: pd.Series | None
    noise: Noise
    note: str = ""
    calibration: Calibration | None = None
    confirmation: pd.DataFrame | None = None
    budget: pd.DataFrame | None = None


def params_of(trial: FrozenTrial) -> dict[str, Any]:
    return dict(trial.system_attrs.get("fixed_params") or trial.params)


def feasible(trial: FrozenTrial) -> bool:
    """A completed trial whose constraints all hold (a trial without constraints was never judged)."""
    constraints = trial.constraints
    return trial.state == TrialState.COMPLETE and bool(constraints) and all(v <= 0 for v in constraints.values())


def _trial_row(trial: FrozenTrial, context: SearchContext) -> dict[str, Any]:
    attrs = trial.user_attrs
    params = params_of(trial)
    accuracy = attrs.get("val_accuracy")
    return {
        "number": trial.number,
        "state": trial.state.name,
        "origin": "; ".join(attrs.get("origin", [])) or "sampler",
        "memory": attrs.get("memory", math.nan),
        "memory_bytes": attrs.get("memory_bytes", math.nan),
        "memory_peak": attrs.get("memory_peak", math.nan),
        "memory_planned": attrs.get("memory_planned", math.nan),
        "bytes": attrs.get("bytes", math.nan),
        "low_share": attrs.get("low_share", math.nan),
        "val_accuracy": math.nan if accuracy is None else accuracy,
        "val_error": math.nan if accuracy is None else 1.0 - accuracy,
        "val_loss": attrs.get("val_loss", math.nan),
        "val_accuracy_sd": attrs.get("val_accuracy_sd", math.nan),
        "seeds": attrs.get("seeds", 1 if accuracy is not None else math.nan),
        "trained": bool(attrs.get("trained", False)),
        "diverged": bool(attrs.get("diverged", False)),
        "stopped_at": attrs.get("stopped_at", math.nan),
        "seed_steps": ";".join(str(steps) for steps in attrs.get("seed_steps", [])),
        "feasible": feasible(trial),
        "reason": attrs.get("reason", ""),
        "promotions": len(attrs.get("promotions", [])),
        "skipped_steps": attrs.get("skipped_steps", math.nan),
        "steps_run": attrs.get("steps_run", math.nan),
        "wall_time": attrs.get("wall_time", math.nan),
        "duplicate_of": attrs.get("duplicate_of", ""),
        "retry_of": trial.system_attrs.get("failed_trial", ""),
        "worker": attrs.get("worker", ""),
        "policy": attrs.get("policy", ""),
        "error": attrs.get("error", ""),
        "interrupted": bool(attrs.get("interrupted", False)),
        "key": attrs.get("key", context.key(params) if len(params) == len(context.units) else ""),
        "decisions": "".join(_level_code(params.get(unit, "high"), context) for unit in context.units),
    }


def _level_code(level: str, context: SearchContext) -> str:
    """One character per unit for the decisions column: H, L, or the choice's index among the levels."""
    if level == "high":
        return "H"
    if level == "low":
        return "L"
    return str(context.levels.index(level)) if level in context.levels else "?"


def trials_frame(study: optuna.Study, context: SearchContext) -> pd.DataFrame:
    """One row per started trial (queued ones are not trials yet) with origin, memory, proxy metrics, state."""
    rows = [_trial_row(t, context) for t in study.get_trials(deepcopy=False) if t.state != TrialState.WAITING]
    if not rows:  # still a table with its header: stopped before the first trial (say, in calibration)
        return pd.DataFrame(columns=list(_trial_row(optuna.trial.create_trial(state=TrialState.FAIL), context)))
    return pd.DataFrame(rows)


def study_noise(attrs: dict[str, Any], context: SearchContext, frame: pd.DataFrame) -> Noise:
    """The pooled seed noise of the study's trained trials and the all-high reference (counted once)."""
    reference = attrs.get("reference_accuracies", [])
    counted = not frame.empty and attrs.get("reference_key") in set(frame["key"])
    return pooled_noise(frame, context.budget.confidence, extra=[] if counted else [reference])


def proxy_reference(attrs: dict[str, Any]) -> float | None:
    """The all-high proxy's mean accuracy (None when it diverged or is not trained yet)."""
    result = attrs.get("reference_result")
    return None if result is None or result.get("diverged") else float(result["val_accuracy"])


def policy_of(trial: FrozenTrial, context: SearchContext, provenance: dict[str, Any]) -> Policy:
    assignment = assign(context.graph, context.space, context.decisions(params_of(trial)))
    return context.policy(assignment, provenance)


def _policy_for_row(row: pd.Series, study: optuna.Study, context: SearchContext, role: str) -> Policy:
    trial = study.get_trials(deepcopy=False)[int(row["number"])]
    provenance = {
        "strategy": str(row["origin"]), "role": role, "trial": int(row["number"]), "space": context.space.name,
        "space_fingerprint": context.space.fingerprint(), "seed": context.seed,
        "proxy_steps": context.length, "data": context.data_spec.name,
        "proxy": {"val_accuracy": float(row.get("proxy_accuracy", row["val_accuracy"])),
                  "val_loss": float(row["val_loss"]), "memory": float(row["memory"]),
                  "promotions": int(row["promotions"])},
    }
    return policy_of(trial, context, provenance)


def export(study: optuna.Study, context: SearchContext, out_dir: Path) -> Exported:
    """Rewrite the run directory's tables, policies and pick from the storage (see the module docstring)."""
    attrs = study.user_attrs
    frame = trials_frame(study, context)
    noise = study_noise(attrs, context, frame)
    calibration = recorded_calibration(attrs)
    confirmation = recorded_confirmation(attrs)
    front = pareto_front(frame, context.space.accuracy_objective)
    if not front.empty:
        front = mark_ties(front, noise)
    confirmed = confirmation.table() if confirmation is not None else None
    if confirmed is not None:
        frame = frame.merge(confirmed, on="key", how="left") if not frame.empty else frame
        front = front.merge(confirmed, on="key", how="left").set_axis(front.index) if not front.empty else front
    atomic_write_text(out_dir / "trials.csv", frame.to_csv(index=False))
    atomic_write_text(out_dir / "pareto.csv", front.to_csv(index=False))
    _write_policies(front, study, context, out_dir)
    if calibration is not None:
        atomic_write_text(out_dir / "calibration.csv", calibration.frame().to_csv(index=False))
    if "sensitivity" in attrs:
        save_table(pd.DataFrame(attrs["sensitivity"]), out_dir)
    budget = None
    if calibration is not None:
        budget = _budget(frame, calibration, confirmation, attrs, context)
        atomic_write_text(out_dir / "budget.csv", budget.to_csv(index=False))
    best, note = None, "confirmation has not run (the search was interrupted: --resume finishes it)"
    if confirmed is not None:
        best, note = _confirmed_pick(frame, front, confirmed, confirmation, attrs, context, noise)
    if best is not None:
        policy = _policy_for_row(best, study, context, f"best: {context.budget.describe()}")
        policy.replace(provenance={**policy.provenance, **_pick_provenance(best, confirmed, confirmation,
                                                                             context, note)}
                       ).save(out_dir / "best.json")
    else:  # a pick of an earlier export that no longer holds must not stay behind
        (out_dir / "best.json").unlink(missing_ok=True)
    return Exported(frame, front, best, noise, "" if best is not None else note, calibration, confirmed, budget)


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


def _confirmed_pick(frame: pd.DataFrame, front: pd.DataFrame, confirmed: pd.DataFrame, confirmation: Confirmation,
                    attrs: dict[str, Any], context: SearchContext, proxy_noise: Noise) -> tuple[pd.Series | None, str]:
    """The budget's pick among confirmed points (the front's and all-high), and a note: why there is none, or
    which proxy pick confirmation replaced."""
    high = uniform(context.graph, context.space, "high").key
    table = confirmed.set_index("key")
    if high not in table.index or bool(table.loc[high, "confirmed_diverged"]):
        return None, "the all-high reference diverged in confirmation: no pick; lower the learning rate"
    reference = float(table.loc[high, "confirmed_accuracy"])
    chance = context.chance
    if reference <= chance:
        return None, (f"the all-high reference reached only {reference:.3f} in confirmation, no better than chance "
                      f"({chance:.3f}): no pick")
    ok = frame[usable(frame)].sort_values("number").drop_duplicates("key") if not frame.empty else frame
    candidates = confirmed_front(ok.drop(columns=list(confirmed.columns.drop("key"))), confirmed)
    reference_seeds = int(table.loc[high, "confirmed_seeds"])
    if context.budget.max_memory is None:  # each point against all-high with the noise of those two
        best = pick_pairwise(candidates, context.budget, reference, reference_seeds, high, chance,
                             lambda key: _pair_noise(confirmation, key, high, context))
    else:
        best = choose_best(candidates, context.budget, reference, confirmation.noise(context.budget.confidence),
                           reference_seeds, high, chance)
    if best is None:
        return None, f"no confirmed point within the budget beats chance accuracy ({chance:.3f}): no pick"
    proxy_front = front.drop(columns=list(confirmed.columns.drop("key")))
    proxy_pick = choose_best(proxy_front, context.budget, proxy_reference(attrs), proxy_noise,
                             len(attrs.get("reference_accuracies", [0])), high, chance)
    if proxy_pick is not None and proxy_pick["key"] != best["key"]:
        return best, (f"the proxies alone would pick trial {int(proxy_pick['number'])} (memory "
                      f"{proxy_pick['memory']:.3f}); confirmation picks trial {int(best['number'])}")
    return best, ""


def _pair_noise(confirmation: Confirmation, key: str, high: str, context: SearchContext) -> Noise:
    """The confirmation noise a point is held to all-high with: pooled over the two alone."""
    return confirmation.noise(context.budget.confidence, keys=sorted({key, high}))


def _pick_provenance(best: pd.Series, confirmed: pd.DataFrame, confirmation: Confirmation, context: SearchContext,
                     note: str) -> dict[str, Any]:
    """best.json's ``noise`` (the decision's statement) and ``confirmation`` (the runs it rests on)."""
    table = confirmed.set_index("key")
    high = uniform(context.graph, context.space, "high").key
    noise = (_pair_noise(confirmation, best["key"], high, context) if context.budget.max_memory is None
             else confirmation.noise(context.budget.confidence))

    def accuracy(key: str) -> float | None:
        return float(table.loc[key, "confirmed_accuracy"]) if key in table.index else None

    pick = {**noise.to_dict(), "seeds": int(best["seeds"]), "pick_confidence": float(best["pick_confidence"]),
            "statement": _pick_statement(best, noise)}
    record = {"steps": confirmation.length, "seeds": int(best["seeds"]),
              "proxy_accuracy": float(best["proxy_accuracy"]), "confirmed_accuracy": float(best["val_accuracy"]),
              "confirmed_sd": float(best["val_accuracy_sd"]),
              "all_high_accuracy": accuracy(high), "plain_fp32_accuracy": accuracy(PLAIN_FP32), "note": note}
    return {"noise": _no_nan(pick), "confirmation": _no_nan(record)}


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


def _budget(frame: pd.DataFrame, calibration: Calibration, confirmation: Confirmation | None, attrs: dict[str, Any],
            context: SearchContext) -> pd.DataFrame:
    fresh = frame[frame["duplicate_of"] == ""] if not frame.empty else frame
    factor = attrs["config"]["confirm_factor"]
    confirm_length = confirmation.length if confirmation is not None else round(factor * calibration.length)
    return budget_table(
        fresh, calibration_runs=sum(len(runs) for runs in calibration.runs.values()),
        calibration_steps=calibration.steps, rungs=rung_steps(calibration.length, attrs["config"]["rungs"]),
        length=calibration.length, proxy_seeds=int(attrs.get("proxy_seeds", 1)),
        confirmation_runs=sum(len(runs) for runs in confirmation.runs.values()) if confirmation else 0,
        confirmation_steps=confirmation.steps if confirmation else 0, confirmation_length=confirm_length,
        sweep_points=len(R_GRID))
