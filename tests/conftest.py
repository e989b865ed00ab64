"""Fixtures shared by several test modules."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import pytest


@pytest.fixture(scope="session")
def seeds() -> ModuleType:
    """benchmarks/reproduce_seeds.py: the seed papers' claims harness, run by tests at test size (one source of
    truth). Registered in sys.modules so its dataclasses resolve their module."""
    if "reproduce_seeds" not in sys.modules:
        path = Path(__file__).resolve().parents[1] / "benchmarks" / "reproduce_seeds.py"
        spec = importlib.util.spec_from_file_location("reproduce_seeds", path)
        module = importlib.util.module_from_spec(spec)
        sys.modules["reproduce_seeds"] = module
        spec.loader.exec_module(module)
    return sys.modules["reproduce_seeds"]
