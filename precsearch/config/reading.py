"""Parsing configuration files strictly: a key given twice at any depth is refused (YAML and JSON keep the last
one silently), and a file the parser cannot read is one line with the file, the line and what is wrong."""

from __future__ import annotations

import json
import re
from typing import Any

import yaml

from precsearch.errors import PrecsearchError

__all__ = ["parse_json", "parse_yaml"]

_MERGE = "tag:yaml.org,2002:merge"


class _UniqueKeyLoader(yaml.SafeLoader):
    """PyYAML's safe loader, refusing a mapping key given twice (merge keys ``<<`` may still be overridden)."""

    where = ""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        lines: dict[Any, int] = {}
        for key_node, _ in node.value:
            if key_node.tag == _MERGE:
                continue
            key = self.construct_object(key_node, deep=True)
            line = key_node.start_mark.line + 1
            try:
                first = lines.get(key)
            except TypeError:  # an unhashable key: the base loader says so
                continue
            if first is not None:
                raise PrecsearchError(f"{self.where}:{line}: key {key!r} given twice (first at line {first}); "
                                      "give it once")
            lines[key] = line
        return super().construct_mapping(node, deep)


def parse_yaml(text: str, where: str) -> Any:
    """The YAML document in ``text``; ``where`` names the file in errors (``search space x.yaml``)."""
    loader = _UniqueKeyLoader(text)
    loader.where = where
    try:
        return loader.get_single_data()
    except yaml.MarkedYAMLError as error:
        mark = error.problem_mark or error.context_mark
        line = f":{mark.line + 1}" if mark is not None else ""
        problem = error.problem or error.context or "not valid YAML"
        opened = (f" ({error.context} at line {error.context_mark.line + 1})"
                  if error.context and error.problem and error.context_mark is not None else "")
        raise PrecsearchError(f"{where}{line}: {problem}{opened}; fix the YAML") from None
    except yaml.YAMLError as error:
        raise PrecsearchError(f"{where}: {str(error).splitlines()[0]}; fix the YAML") from None
    finally:
        loader.dispose()


def parse_json(text: str, where: str) -> Any:
    """The JSON value in ``text``, refusing a key given twice in any object (naming the lines it is on);
    malformed JSON raises ``json.JSONDecodeError`` for the caller to word."""

    def unique(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
        result: dict[str, Any] = {}
        for key, value in pairs:
            if key in result:
                pattern = re.escape(json.dumps(key)) + r"\s*:"
                lines = sorted({text.count("\n", 0, match.start()) + 1 for match in re.finditer(pattern, text)})
                at = f" (lines {', '.join(map(str, lines))})" if lines else ""
                raise PrecsearchError(f"{where}: key {key!r} given twice in one object{at}; give it once")
            result[key] = value
        return result

    return json.loads(text, object_pairs_hook=unique)
