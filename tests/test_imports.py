"""The package's import graph, read from the source: no module reaches back to one that imports it (not even from
inside a function), every module imports on its own, and the configuration layer loads no torch."""

from __future__ import annotations

import ast
import graphlib
import subprocess
import sys
from pathlib import Path

import pytest

import precsearch

PACKAGE = Path(precsearch.__file__).parent
# Plain data: a policy, a space or a format name is read, checked and written without the training stack.
TORCH_FREE = ["precsearch.config.checks", "precsearch.config.loss_scaling", "precsearch.config.optimizer",
              "precsearch.config.policy", "precsearch.config.reading", "precsearch.config.spaces",
              "precsearch.config.spec", "precsearch.errors", "precsearch.files", "precsearch.formats.format"]


def _modules() -> dict[str, Path]:
    """Every module of the package by its dotted name (a package by its own name)."""
    names = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        names[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return names


def _imported(path: Path, modules: dict[str, Path]) -> set[str]:
    """The package's modules that ``path`` imports anywhere (module level, functions, TYPE_CHECKING blocks)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            found |= {node.module} | {f"{node.module}.{alias.name}" for alias in node.names}
    return {name for name in found if name in modules}


def import_graph() -> dict[str, set[str]]:
    modules = _modules()
    return {name: _imported(path, modules) - {name, "precsearch"} for name, path in modules.items()}


def test_the_reader_sees_the_imports_of_every_form():
    graph = import_graph()
    assert "precsearch.formats.kernels" in graph["precsearch.runtime.state"]  # from a package import a module
    assert "precsearch.config.policy" in graph["precsearch.runtime.state"]  # from a module import a name
    assert "precsearch.search.study" in graph["precsearch.cli.search"]  # inside a function
    assert graph["precsearch.formats.format"] == {"precsearch.errors"}


def test_no_module_imports_one_that_imports_it_back():
    try:
        graphlib.TopologicalSorter(import_graph()).prepare()
    except graphlib.CycleError as error:
        pytest.fail(f"import cycle: {' -> '.join(error.args[1])}")


@pytest.mark.parametrize("module", TORCH_FREE)
def test_the_configuration_layer_loads_no_torch(module):
    probe = f"import sys, {module}; print(sorted(m for m in ('torch', 'numpy') if m in sys.modules))"
    loaded = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True).stdout
    assert "torch" not in loaded


@pytest.mark.slow
def test_every_module_imports_on_its_own_in_a_fresh_interpreter():
    failed = {}
    for module in _modules():
        if module == "precsearch.__main__":
            continue  # the command line itself: importing it runs it
        run = subprocess.run([sys.executable, "-c", f"import {module}"], capture_output=True, text=True)
        if run.returncode:
            failed[module] = (run.stderr or run.stdout).strip().splitlines()[-1:]
    assert failed == {}
