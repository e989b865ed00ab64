"""The validators every configuration file shares, so a bad value gets the same one-line message from a space
and a policy: ``where`` names the file and key, the rest says what is allowed."""

from __future__ import annotations

import difflib
import math
from collections.abc import Mapping
from typing import Any

from precsearch.errors import PrecsearchError, echo
from precsearch.formats.scaled import ScaledFormat, any_format

__all__ = ["check_keys", "choice", "flag", "not_wider", "number", "requirement", "value_bits"]


def check_keys(keys: Any, allowed: tuple[str, ...], where: str) -> None:
    """Raise on the first key not in ``allowed``, with the closest allowed key as a hint."""
    unknown = [str(key) for key in keys if key not in allowed]
    if unknown:
        close = difflib.get_close_matches(unknown[0], allowed, n=1)
        hint = f" (did you mean {close[0]}?)" if close else ""
        raise PrecsearchError(f"{where}: unknown key {echo(unknown[0])}{hint}; allowed keys: {', '.join(allowed)}")


def choice(value: Any, allowed: tuple[str, ...], where: str) -> str:
    """``value`` if it is one of ``allowed``."""
    if value not in allowed:
        raise PrecsearchError(f"{where}: {echo(value)} is not allowed; use one of {', '.join(allowed)}")
    return value


def flag(value: Any, where: str) -> bool:
    """``value`` if it is a bool (YAML and JSON ``true``/``false``)."""
    if not isinstance(value, bool):
        raise PrecsearchError(f"{where} must be true or false, not {echo(value)}")
    return value


def number(value: Any, where: str, low: float, high: float = math.inf, integer: bool = False, *,
           open_low: bool = False, open_high: bool = False) -> Any:
    """A finite number in [low, high] (``open_low``/``open_high``: excluding that end) as float (int if
    ``integer``; a float with an integral value is one)."""
    ok = isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)
    if ok and integer:
        ok = float(value).is_integer()
    if ok:
        ok = (low < value if open_low else low <= value) and (value < high if open_high else value <= high)
    if not ok:
        wanted = requirement(low, high, integer, open_low=open_low, open_high=open_high)
        raise PrecsearchError(f"{where}={echo(value)} must be {wanted}")
    return int(value) if integer else float(value)


def requirement(low: float, high: float = math.inf, integer: bool = False, *, open_low: bool = False,
                open_high: bool = False) -> str:
    """What ``number`` accepts, in words: ``an integer >= 1``, ``a number in (0, 1]``, ``a number``."""
    kind = "an integer" if integer else "a number"
    if low == -math.inf and high == math.inf:
        return kind
    if high == math.inf:
        return f"{kind} {'>' if open_low else '>='} {low}"
    if low == -math.inf:
        return f"{kind} {'<' if open_high else '<='} {high}"
    return f"{kind} in {'(' if open_low else '['}{low}, {high}{')' if open_high else ']'}"


def value_bits(spec: str) -> int:
    """Bits of one value: a scaled format's element's (its scales are a byte per tensor, row or block)."""
    fmt = any_format(spec)
    return (fmt.element if isinstance(fmt, ScaledFormat) else fmt).bits


def not_wider(high: str, formats: Mapping[str, str], where: str, high_key: str = "high") -> None:
    """No format of ``formats`` (label -> spec) wider than ``high``, the format promotion goes to: a search space's
    levels and a policy's rules alike, or "promoting" would narrow a tensor (and a level cost more than all-high)."""
    high_bits = value_bits(high)
    for label, format_spec in formats.items():
        width = value_bits(format_spec)
        if width > high_bits:
            raise PrecsearchError(f"{where}: {label} {format_spec} ({width} bits) is wider than {high_key} {high} "
                                  f"({high_bits} bits); give a format at most as wide as the high one")
