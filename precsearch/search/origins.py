"""A trial's origins (the seedings that queued its assignment: ``"paper r=0.3"``, ``"all-high"``) in one cell of the
trials table: joined here, split back by the analysis. Torch-free, so the report loads no runtime."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

SEPARATOR = "; "


def origins_cell(names: Sequence[str]) -> str:
    """The cell: a sampler's trial has no seeding."""
    return SEPARATOR.join(names) or "sampler"


def origins(cell: Any) -> list[str]:
    """The origins of a trials-table row (its ``origin`` cell)."""
    return str(cell).split(SEPARATOR)
