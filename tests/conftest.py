"""Fixtures shared by several test modules."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import pytest
import yaml

from precsearch.config.spaces import PAPER_SPACE


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


@pytest.fixture(scope="module")
def space_file(tmp_path_factory) -> Path:
    """The paper's space with a larger evaluation batch, for the fastest CLI searches (with the options tiny_cnn,
    --image-size 8, --batch-size 16, --proxy-steps 4)."""
    path = tmp_path_factory.mktemp("spaces") / "tiny.yaml"
    path.write_text(yaml.safe_dump({**PAPER_SPACE, "proxy": {"eval_batch_size": 64}}))
    return path
