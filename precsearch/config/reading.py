"""Reading a user's configuration file (a search space, a policy): the one door such a file comes in by.

Everything a file could make expensive is bounded before the work it would cost: its size before it is read
(``MAX_BYTES``), the nesting of its lists and mappings before a recursive parser meets it (``MAX_DEPTH``),
what YAML anchors and aliases expand to before anything is built from them (``MAX_VALUES``: a few lines of
nested aliases, the "billion laughs", expand to gigabytes), and the digits of an integer before it is
converted (``MAX_INT_DIGITS``). A file over a limit, a key given twice at any depth (YAML and JSON keep the
last one silently), or a file the parser cannot read is one ``PrecsearchError`` line naming the file, where
possible the line, and what is wrong. A UTF-8 byte order mark is accepted (editors on Windows write one).
"""

from __future__ import annotations

import itertools
import json
import os
import re
import stat
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import yaml

from precsearch.errors import PrecsearchError

__all__ = ["MAX_BYTES", "MAX_DEPTH", "MAX_INT_DIGITS", "MAX_VALUES", "REWRITE", "load_json", "load_json_object",
           "load_yaml", "parse_json", "parse_yaml", "read_text"]

MAX_BYTES = 4 * 2**20  # a space or a policy is a few KB; even a per-tensor policy of a large model is < 1 MB
MAX_DEPTH = 64  # lists and mappings inside each other; a space or a policy nests 4 deep
MAX_VALUES = 10_000  # YAML scalars, lists and mappings, counting each alias as what it stands for
# what to do about a damaged file of a run directory (run.json, best.json, its tables)
REWRITE = ("write it again (precsearch report RUN_DIR --storage STUDY rebuilds a search's files from its study) or "
           "restore it")
MAX_INT_DIGITS = 100  # a seed or a step count has 20; Python refuses to convert more than 4300 at all

_MERGE = "tag:yaml.org,2002:merge"
_JSON_STRING = re.compile(r'"[^"\\]*(?:\\.[^"\\]*)*"')  # escapes included: a bracket inside one does not nest
_NESTING = {ord("["): 1, ord("{"): 1, ord("]"): -1, ord("}"): -1, ord("\n"): 0}
_NOT_NESTING = bytes(sorted(set(range(256)) - set(_NESTING)))


def read_text(path: str | Path, what: str, fix: str) -> str:
    """The text of the ``what`` file at ``path`` (UTF-8, a byte order mark dropped), its size checked before
    it is read; anything wrong is one line ending in ``fix`` (what the user should do)."""
    path = Path(path)
    where = f"{what} {path}"
    try:
        # non-blocking: opening a FIFO no one writes to returns at once (and is refused below) instead of waiting
        with os.fdopen(os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0)), "rb") as file:
            status = os.fstat(file.fileno())
            if stat.S_ISDIR(status.st_mode):
                raise IsADirectoryError
            if not stat.S_ISREG(status.st_mode):  # a FIFO, a socket, a device such as /dev/zero
                raise PrecsearchError(f"{where} is not a regular file (a pipe, socket or device); {fix}")
            size = status.st_size
            data = file.read(MAX_BYTES + 1) if size <= MAX_BYTES else b""
    except FileNotFoundError:
        raise PrecsearchError(f"{where} does not exist; {fix}") from None
    except IsADirectoryError:
        raise PrecsearchError(f"{where} is a folder; {fix}") from None
    except OSError as error:
        raise PrecsearchError(f"cannot read {where}: {error.strerror or error}; {fix}") from None
    size = max(size, len(data))
    if size > MAX_BYTES:
        raise PrecsearchError(f"{where} is {size:,} bytes, over the {MAX_BYTES // 2**20} MiB limit of a configuration "
                              f"file; check it is the right file (a {what} is a few KB)")
    try:
        return data.decode("utf-8-sig")
    except UnicodeDecodeError as error:
        raise PrecsearchError(f"{where}: not a text file (byte {error.start} is not UTF-8; corrupted?); "
                              f"{fix}") from None


def load_yaml(path: str | Path, what: str, fix: str) -> Any:
    """The YAML document in the ``what`` file at ``path`` (``read_text``, then ``parse_yaml``)."""
    return parse_yaml(read_text(path, what, fix), f"{what} {path}")


def load_json(path: str | Path, what: str, fix: str) -> Any:
    """The JSON value in the ``what`` file at ``path`` (``read_text``, then ``parse_json``)."""
    return parse_json(read_text(path, what, fix), f"{what} {path}", fix)


def load_json_object(path: str | Path, what: str, fix: str) -> dict[str, Any]:
    """``load_json`` of a file that holds one JSON object (a run's run.json and best.json)."""
    value = load_json(path, what, fix)
    if not isinstance(value, dict):
        raise PrecsearchError(f"{what} {path} is a JSON {type(value).__name__}, not an object; {fix}")
    return value


class _LimitedLoader(yaml.SafeLoader):
    """PyYAML's safe loader, refusing a mapping key given twice (merge keys ``<<`` may still be overridden)
    and a document over ``MAX_DEPTH``, ``MAX_VALUES`` or ``MAX_INT_DIGITS``, while it is composed: before
    the recursive composer nests too deep, and before anything is built from the aliases."""

    def __init__(self, text: str, where: str) -> None:
        super().__init__(text)
        self.where = where
        self.nesting = 0  # collections being composed around the current node
        self.values = 0  # values composed so far, each alias counted as the values it stands for
        # id of a composed node -> (values, lists and mappings deep), aliases expanded
        self.sizes: dict[int, tuple[int, int]] = {}

    def _refuse(self, mark: yaml.Mark, problem: str, fix: str) -> PrecsearchError:
        return PrecsearchError(f"{self.where}:{mark.line + 1}: {problem}; {fix}")

    def _count(self, values: int, mark: yaml.Mark) -> None:
        self.values += values
        if self.values > MAX_VALUES:
            raise self._refuse(mark, f"over {MAX_VALUES:,} values once its aliases are expanded",
                               "give fewer values or aliases (a configuration holds a few hundred values)")

    def compose_node(self, parent: yaml.Node | None, index: Any) -> yaml.Node:
        event = self.peek_event()
        if isinstance(event, yaml.AliasEvent):
            target = self.anchors.get(event.anchor)
            if target is None:
                return super().compose_node(parent, index)  # the parser's error for an undefined alias
            if id(target) not in self.sizes:
                raise self._refuse(event.start_mark, f"alias *{event.anchor} stands inside the &{event.anchor} "
                                   "it names (a value holding itself)", "write the value out")
            values, depth = self.sizes[id(target)]
            if self.nesting + depth > MAX_DEPTH:
                raise self._refuse(event.start_mark, f"alias *{event.anchor} nests lists and mappings over "
                                   f"{MAX_DEPTH} deep", "write the values out instead of nesting aliases")
            self._count(values, event.start_mark)
            return super().compose_node(parent, index)
        if isinstance(event, yaml.ScalarEvent):
            self._count(1, event.start_mark)
            node = super().compose_node(parent, index)
            self.sizes[id(node)] = 1, 0
            return node
        self.nesting += 1
        if self.nesting > MAX_DEPTH:
            raise self._refuse(event.start_mark, f"lists and mappings nested over {MAX_DEPTH} deep",
                               "flatten it (a configuration nests a few levels)")
        before = self.values
        self._count(1, event.start_mark)
        try:
            node = super().compose_node(parent, index)
        finally:
            self.nesting -= 1
        children = [child for pair in node.value for child in pair] if isinstance(node, yaml.MappingNode) else (
            node.value)
        depth = 1 + max((self.sizes[id(child)][1] for child in children), default=0)
        self.sizes[id(node)] = self.values - before, depth
        return node

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

    def construct_yaml_int(self, node: yaml.ScalarNode) -> int:
        digits = len(node.value.replace("_", "").lstrip("+-"))
        if digits > MAX_INT_DIGITS:
            raise self._refuse(node.start_mark, f"an integer of {digits} digits (over {MAX_INT_DIGITS})",
                               "give a number a configuration can mean")
        return super().construct_yaml_int(node)


_LimitedLoader.add_constructor("tag:yaml.org,2002:int", _LimitedLoader.construct_yaml_int)


def parse_yaml(text: str, where: str) -> Any:
    """The YAML document in ``text``, within the limits; ``where`` names the file in errors
    (``search space x.yaml``)."""
    try:
        loader = _LimitedLoader(text, where)  # its reader refuses a character YAML does not allow, such as NUL
    except yaml.reader.ReaderError as error:
        line = text.count("\n", 0, error.position) + 1
        code = error.character if isinstance(error.character, int) else ord(error.character)
        raise PrecsearchError(f"{where}:{line}: character U+{code:04X} (at offset {error.position}) is not allowed "
                              "in YAML; remove it (is it a text file?)") from None
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


def parse_json(text: str, where: str, fix: str) -> Any:
    """The JSON value in ``text``, within the limits and refusing a key given twice in any object (naming the
    lines it is on); a malformed document is one line ending in ``fix``."""
    _check_json_depth(text, where)

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

    def integer(digits: str) -> int:
        count = len(digits.lstrip("-"))
        if count > MAX_INT_DIGITS:
            raise PrecsearchError(f"{where}: an integer of {count} digits ({digits[:12]}...; over "
                                  f"{MAX_INT_DIGITS}); give a number a configuration can mean")
        return int(digits)

    try:
        return json.loads(text, object_pairs_hook=unique, parse_int=integer)
    except json.JSONDecodeError as error:
        state = "empty" if not text.strip() else "truncated or corrupted"
        # json's messages either end in " at" ("Unterminated string starting at") or do not
        at = "" if error.msg.endswith(" at") else " at"
        raise PrecsearchError(f"{where}: {state} JSON ({error.msg}{at} line {error.lineno} column "
                              f"{error.colno}); {fix}") from None


def _check_json_depth(text: str, where: str) -> None:
    """Refuse arrays and objects nested over ``MAX_DEPTH``, counted on the text before json (whose decoder
    recurses once per level) meets them."""
    structure = _JSON_STRING.sub("", text).encode().translate(None, _NOT_NESTING)  # brackets and newlines

    def depths() -> Iterator[int]:
        return itertools.accumulate(map(_NESTING.__getitem__, structure))

    if max(depths(), default=0) > MAX_DEPTH:  # a pass in C, keeping nothing
        over = next(index for index, depth in enumerate(depths()) if depth > MAX_DEPTH)
        line = structure.count(b"\n", 0, over) + 1
        raise PrecsearchError(f"{where}:{line}: arrays and objects nested over {MAX_DEPTH} deep; flatten it (a "
                              "configuration nests a few levels)")
