"""The shared vocabulary is defined once (precsearch.spec), and the configuration layer stays light."""

from __future__ import annotations

import ast
import dataclasses
import subprocess
import sys
from pathlib import Path

import pytest

from precsearch import spec
from precsearch.optim import UpdateConfig

PACKAGE = Path(spec.__file__).parent


def _module_level_names(path: Path) -> set[str]:
    """Names a module binds at its top level by assignment, class or function definition."""
    names: set[str] = set()
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.Assign):
            names |= {target.id for target in node.targets if isinstance(target, ast.Name)}
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            names.add(node.target.id)
        elif isinstance(node, ast.ClassDef | ast.FunctionDef):
            names.add(node.name)
    return names


def test_every_shared_name_is_defined_in_spec_alone():
    defined_elsewhere = {
        str(path.relative_to(PACKAGE)): sorted(_module_level_names(path) & set(spec.__all__))
        for path in PACKAGE.rglob("*.py") if path.name != "spec.py"
    }
    assert {path: names for path, names in defined_elsewhere.items() if names} == {}
    assert set(spec.__all__) <= _module_level_names(PACKAGE / "spec.py")


def test_a_policys_optimizer_settings_are_the_update_configs():
    fields = {field.name for field in dataclasses.fields(UpdateConfig)}
    assert set(spec.OPTIMIZER_KEYS) == fields - {"weight_format", "master_weights"}


@pytest.mark.parametrize("module", ["precsearch.report", "precsearch.spaces", "precsearch.spec"])
def test_configuration_modules_load_neither_the_runtime_nor_the_model_zoo(module):
    probe = (f"import sys, {module}; "
             "print(sorted(n for n in sys.modules if n.startswith(('precsearch.runtime', 'precsearch.models', "
             "'precsearch.proxy', 'precsearch.data'))))")
    loaded = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True).stdout
    assert loaded.strip() == "[]"
