"""The sensitivity table as data: its columns, its file in a run directory, and the per-unit view the report,
the CLI and the sweep order read. Torch-free, so reading a run's sensitivity.csv loads no model code."""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from precsearch.files import atomic_write_text

__all__ = ["COLUMNS", "SENSITIVITY_CSV", "group_order", "keep_table", "recorded_table", "save_table", "unit_table"]

SENSITIVITY_CSV = "sensitivity.csv"  # in a run directory; the report plots it
SENSITIVITY = "sensitivity"  # the study user attr that keeps a search's measured table (its rows)
COLUMNS: tuple[str, ...] = ("unit", "group", "kind", "tensors", "numel", "bytes_saved", "score", "error",
                            "overflow", "underflow")


def unit_table(table: pd.DataFrame) -> pd.DataFrame:
    """One row per unit: summed score and bytes saved, and ``per_byte`` (score per byte saved; 0 when both are
    0, inf when demoting saves nothing yet costs), sorted least sensitive per byte first."""
    summed = table.groupby(["unit", "group"], sort=False)[["bytes_saved", "score"]].sum(min_count=1).reset_index()
    summed["score"] = summed["score"].fillna(0.0)
    saved, score = summed["bytes_saved"].to_numpy(), summed["score"].to_numpy()
    with np.errstate(divide="ignore", invalid="ignore"):
        summed["per_byte"] = np.where(saved > 0, score / np.where(saved > 0, saved, 1.0),
                                      np.where(score > 0, np.inf, 0.0))
    return summed.sort_values("per_byte", kind="stable").reset_index(drop=True)


def group_order(table: pd.DataFrame) -> dict[int, float]:
    """Group -> score per byte saved: the key ``paper_assignment(order="sensitivity", scores=...)`` sorts by."""
    per_group = table.assign(unit=table["group"].map(lambda group: f"g{group}"))
    return {int(row.group): float(row.per_byte) for row in unit_table(per_group).itertuples()}


def save_table(table: pd.DataFrame, directory: str | os.PathLike[str]) -> Path:
    """Write ``table`` as ``SENSITIVITY_CSV`` in ``directory`` (created if missing), atomically."""
    path = Path(directory) / SENSITIVITY_CSV
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(path, table.to_csv(index=False))
    return path


def keep_table(study: Any, table: pd.DataFrame) -> None:
    """Keep a search's measured table in its Optuna ``study`` (a user attr), for every worker and the export."""
    study.set_user_attr(SENSITIVITY, table.to_dict(orient="records"))


def recorded_table(attrs: Mapping[str, Any]) -> pd.DataFrame | None:
    """The table ``keep_table`` kept among a study's user ``attrs``, or None."""
    rows = attrs.get(SENSITIVITY)
    return None if rows is None else pd.DataFrame(rows)
