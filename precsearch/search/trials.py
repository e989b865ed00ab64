"""The trials table: one row per started trial of a study, as trials.csv has it, and the policy a trial's
assignment makes."""

from __future__ import annotations

import math
from typing import Any

import optuna
import pandas as pd
from optuna.trial import FrozenTrial, TrialState

from precsearch.config.policy import Policy
from precsearch.search.context import SearchContext
from precsearch.search.noise import failed_run
from precsearch.search.strategies import assign
from precsearch.train.reading import flagged

__all__ = ["feasible", "params_of", "policy_of", "trials_frame"]


def params_of(trial: FrozenTrial) -> dict[str, Any]:
    return dict(trial.system_attrs.get("fixed_params") or trial.params)


def feasible(trial: FrozenTrial) -> bool:
    """A completed trial whose constraints all hold (a trial without constraints was never judged)."""
    constraints = trial.constraints
    return trial.state == TrialState.COMPLETE and bool(constraints) and all(v <= 0 for v in constraints.values())


def _trial_row(trial: FrozenTrial, context: SearchContext, chance: float) -> dict[str, Any]:
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
        "peak_predicted": attrs.get("peak_predicted", math.nan),
        "memory_planned": attrs.get("memory_planned", math.nan),
        "bytes": attrs.get("bytes", math.nan),
        "low_share": attrs.get("low_share", math.nan),
        "val_accuracy": math.nan if accuracy is None else accuracy,
        "val_error": math.nan if accuracy is None else 1.0 - accuracy,
        "val_loss": attrs.get("val_loss", math.nan),
        "batch_stats_accuracy": _or_nan(attrs.get("batch_stats_accuracy")),
        "reading_flagged": flagged(math.nan if accuracy is None else accuracy, attrs.get("batch_stats_accuracy"),
                                   context.budget.drop),
        "val_accuracy_sd": attrs.get("val_accuracy_sd", math.nan),
        "seeds": attrs.get("seeds", 1 if accuracy is not None else math.nan),
        "failed_runs": _failed_runs(attrs.get("val_accuracies", []), chance),
        "trained": bool(attrs.get("trained", False)),
        "diverged": bool(attrs.get("diverged", False)),
        "stopped_at": attrs.get("stopped_at", math.nan),
        "seed_steps": ";".join(str(steps) for steps in attrs.get("seed_steps", [])),
        "branch_steps": attrs.get("branch_steps", 0),
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


def _or_nan(value: float | None) -> float:
    return math.nan if value is None else value


def _failed_runs(accuracies: list[float], chance: float) -> int:
    """How many of a trial's seeds failed (``noise.failed_run``) beside its best one."""
    return sum(failed_run(accuracy, max(accuracies), chance) for accuracy in accuracies)


def _level_code(level: str, context: SearchContext) -> str:
    """One character per unit for the decisions column: H, L, or the choice's index among the levels."""
    if level == "high":
        return "H"
    if level == "low":
        return "L"
    return str(context.levels.index(level)) if level in context.levels else "?"


def trials_frame(study: optuna.Study, context: SearchContext) -> pd.DataFrame:
    """One row per started trial (queued ones are not trials yet) with origin, memory, proxy metrics, state."""
    chance = context.chance  # read once: it counts the validation labels
    rows = [_trial_row(t, context, chance) for t in study.get_trials(deepcopy=False) if t.state != TrialState.WAITING]
    if not rows:  # still a table with its header: stopped before the first trial (say, in calibration)
        return pd.DataFrame(columns=list(_trial_row(optuna.trial.create_trial(state=TrialState.FAIL), context,
                                                    chance)))
    return pd.DataFrame(rows)


def policy_of(trial: FrozenTrial, context: SearchContext, provenance: dict[str, Any]) -> Policy:
    assignment = assign(context.graph, context.space, context.decisions(params_of(trial)))
    return context.policy(assignment, provenance)
