"""Where a search's training steps went, next to what it would have cost without rungs, and what the
paper's procedure costs.

Phases: calibration, each rung (the steps candidates trained between the previous rung and this one, on every
seed they raced), the candidates' decay branches, and confirmation. The two yardsticks: the same search with
every trained candidate run to the full proxy length on all its seeds, and the paper's procedure, which uses no
proxies: one full run per sweep point, here at the confirmation length.
"""

from __future__ import annotations

from collections.abc import Sequence

import pandas as pd

from precsearch.train.continuing import decay_steps

__all__ = ["budget_table", "describe_budget", "seed_steps"]


def seed_steps(value: object) -> list[int]:
    """The ``seed_steps`` cell of a trials row ("150;150;50") as steps per seed run."""
    text = "" if value is None or value != value else str(value)
    return [int(float(part)) for part in text.split(";") if part]


def budget_table(trials: pd.DataFrame, calibration_runs: int, calibration_steps: int, rungs: Sequence[int],
                 length: int, proxy_seeds: int, confirmation_runs: int, confirmation_steps: int,
                 confirmation_length: int, sweep_points: int) -> pd.DataFrame:
    """budget.csv: phase, runs, steps and share of this search's total (see the module docstring)."""
    per_trial = [seed_steps(value) for value in trials.get("seed_steps", [])]
    runs = [steps for trial in per_trial for steps in trial]
    candidates = sum(bool(trial) for trial in per_trial)
    rows = [{"phase": "calibration", "runs": calibration_runs, "steps": calibration_steps}]
    bounds = [0, *rungs, length]
    for index in range(1, len(bounds)):
        low, high = bounds[index - 1], bounds[index]
        rows.append({"phase": f"rung {index} (steps {low + 1}-{high})", "runs": sum(steps > low for steps in runs),
                     "steps": sum(min(steps, high) - min(steps, low) for steps in runs)})
    rows.append({"phase": "candidates' decay branches", "runs": len(runs),
                 "steps": int(pd.to_numeric(trials.get("branch_steps", pd.Series(dtype=float))).fillna(0).sum())})
    rows.append({"phase": "confirmation", "runs": confirmation_runs, "steps": confirmation_steps})
    total = sum(row["steps"] for row in rows)
    rows.append({"phase": "total (this search)", "runs": sum(row["runs"] for row in rows if row["phase"] in (
        "calibration", "confirmation")) + len(runs), "steps": total})
    rows.append({"phase": f"every trial at full length {length}", "runs": calibration_runs + candidates * proxy_seeds
                 + confirmation_runs, "steps": calibration_steps + candidates * proxy_seeds
                 * (length + decay_steps(length)) + confirmation_steps})
    rows.append({"phase": f"paper: one run per sweep point at {confirmation_length} steps", "runs": sweep_points,
                 "steps": sweep_points * confirmation_length})
    table = pd.DataFrame(rows)
    table["share_of_total"] = table["steps"] / total if total else float("nan")
    return table


def describe_budget(table: pd.DataFrame) -> str:
    """The table as aligned text lines, for the end of a search."""
    width = max(len(phase) for phase in table["phase"])
    lines = ["training steps:"]
    for _, row in table.iterrows():
        lines.append(f"  {row['phase']:<{width}}  {int(row['runs']):5d} runs  {int(row['steps']):9d} steps  "
                     f"{row['share_of_total']:6.2f}x")
    return "\n".join(lines)
