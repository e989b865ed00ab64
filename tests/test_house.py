"""The house's shape, checked: functions a reader can hold (issue 68, item 5)."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "precsearch"
LONGEST = 80  # lines, from ``def`` to the function's last line


def _long_functions(root: Path, longest: int) -> list[str]:
    """Every function (or method) under ``root`` longer than ``longest`` lines, as ``path:line name (N lines)``."""
    found = []
    for path in sorted(root.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                lines = node.end_lineno - node.lineno + 1
                if lines > longest:
                    found.append(f"{path.relative_to(root.parent)}:{node.lineno} {node.name} ({lines} lines)")
    return found


def test_no_function_in_precsearch_is_over_80_lines():
    assert _long_functions(PACKAGE, LONGEST) == []


def test_the_count_names_a_long_function(tmp_path):
    """The check sees a function of 81 lines (a method's too), and passes one of 80."""
    body = "\n".join(f"    x{i} = {i}" for i in range(79))
    (tmp_path / "long.py").write_text(f"def held():\n{body}\n\n\nclass A:\n    def method(self):\n"
                                      + "\n".join(f"        y{i} = {i}" for i in range(80)) + "\n")
    assert _long_functions(tmp_path, LONGEST) == [f"{tmp_path.name}/long.py:84 method (81 lines)"]
