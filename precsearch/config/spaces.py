"""Search spaces: which formats a search may give each tensor, at what granularity, with which proxy budget.

A space is a small YAML file (see ``search_spaces/README.md``) loaded and validated into a frozen
``SearchSpace``. Validation is strict on purpose: an unknown key or an impossible format raises a one-line
``PrecsearchError`` that lists what is allowed, because a typo in a space file would otherwise silently
search the wrong thing for hours.

A space defines named *levels*. Every decision unit (a group, or a single tensor) takes one level, and a
level maps each tensor kind to a format. ``high`` and ``low`` always exist; a ``categorical`` space adds
the named ``choices``. A low or choice format may be scaled (``e4m3fn@tensor``, precsearch.formats.scaled: its
element's width is what the width checks compare); the high format, which promotion goes to, may not.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from precsearch.config import spec
from precsearch.config.checks import check_keys, choice, flag, not_wider, value_bits
from precsearch.config.loss_scaling import PAPER_LOSS_SCALING, loss_scaling
from precsearch.config.optimizer import UpdateConfig, optimizer
from precsearch.config.reading import load_yaml
from precsearch.config.spec import (
    ASSIGNABLE_KINDS,
    GRADIENT_ROUNDINGS,
    PAPER_HIGH,
    PAPER_LOW,
    PAPER_OVERFLOW,
    PAPER_PROMOTION_KINDS,
    POLICY_ROUNDINGS,
    SAMPLERS,
    SPACE_DEFAULTS,
    TIES,
    ProxyConfig,
)
from precsearch.errors import PrecsearchError
from precsearch.formats.format import OVERFLOWS, FloatFormat
from precsearch.formats.scaled import ScaledFormat, any_format, format_name

__all__ = ["GRANULARITIES", "OBJECTIVES", "SearchSpace", "PAPER_SPACE", "load_space", "paper_space", "parse_space"]

GRANULARITIES: tuple[str, ...] = ("group", "tensor", "categorical")
OBJECTIVES: tuple[str, ...] = ("val_error", "val_loss")
TOP_KEYS: tuple[str, ...] = ("name", "description", "high", "low", "granularity", "choices", "rounding", "overflow",
                             "loss_scaling", "promotion_threshold", "master_weights", "optimizer", "proxy",
                             "objectives", "promotion_kinds", "gradient_rounding", "ties", "sampler")
RESERVED_LEVELS: tuple[str, ...] = ("high", "low")

# The paper's space (Lee, Sharma, Aiken 2023) as plain data; search_spaces/hfp8.yaml says the same in YAML
# (a test holds them equal). The demo builds on it, so it works without the repository's files.
PAPER_SPACE: dict[str, Any] = {
    "name": "hfp8",
    "high": PAPER_HIGH,
    "low": dict(PAPER_LOW),
    "granularity": "group",
    "rounding": "nearest",
    "overflow": dict(PAPER_OVERFLOW),
    "ties": "even",  # the reference rounds ties away from zero: "away" reproduces it bit for bit
    "gradient_rounding": "per_use",
    "loss_scaling": {**PAPER_LOSS_SCALING, "growth_interval": "epoch"},
    "promotion_threshold": 0.01,
    "promotion_kinds": list(PAPER_PROMOTION_KINDS),
    "master_weights": True,
    "objectives": ["memory", "val_error"],
}


@dataclass(frozen=True)
class SearchSpace:
    """A validated search space. ``levels`` maps level name -> {kind: format spec}; "high" comes first."""

    name: str
    high: str
    low: dict[str, str]
    granularity: str = "group"
    choices: dict[str, dict[str, str]] = field(default_factory=dict)
    rounding: dict[str, str] = field(default_factory=lambda: {kind: "nearest" for kind in ASSIGNABLE_KINDS})
    overflow: dict[str, str] = field(default_factory=lambda: dict(PAPER_OVERFLOW))
    loss_scaling: dict[str, Any] = field(default_factory=lambda: dict(SPACE_DEFAULTS.loss_scaling))
    promotion_threshold: float | None = 0.01
    promotion_kinds: tuple[str, ...] = PAPER_PROMOTION_KINDS
    gradient_rounding: str = "sum"
    ties: str = "even"
    master_weights: bool = SPACE_DEFAULTS.master_weights
    optimizer: dict[str, Any] = field(default_factory=dict)
    proxy: ProxyConfig = field(default_factory=ProxyConfig)
    objectives: tuple[str, ...] = ("memory", "val_error")
    sampler: str = "tpe"
    description: str = ""

    @property
    def levels(self) -> dict[str, dict[str, str]]:
        """Level name -> {kind: spec}, in search order: high, low, then the categorical choices."""
        levels = {"high": {kind: self.high for kind in ASSIGNABLE_KINDS}, "low": dict(self.low)}
        if self.granularity == "categorical":
            levels.update(self.choices)
        return levels

    @property
    def accuracy_objective(self) -> str:
        """The proxy metric minimized next to memory: ``val_error`` or ``val_loss``."""
        return self.objectives[1]

    def to_dict(self) -> dict[str, Any]:
        """Plain data (YAML/JSON-ready) that ``parse_space`` turns back into an equal space."""
        data = dataclasses.asdict(self)
        data["objectives"] = list(self.objectives)
        data["promotion_kinds"] = list(self.promotion_kinds)
        if self.granularity != "categorical":
            data.pop("choices")
        return data

    def fingerprint(self) -> str:
        """Stable hash of the settings that change what a trial trains (not name, description or sampler)."""
        data = self.to_dict()
        for key in ("name", "description", "sampler"):
            data.pop(key)
        return hashlib.sha1(json.dumps(data, sort_keys=True).encode()).hexdigest()[:16]

    def with_proxy(self, **changes: Any) -> SearchSpace:
        """A copy whose proxy budget has ``changes`` applied (None values are ignored)."""
        changes = {key: value for key, value in changes.items() if value is not None}
        if not changes:
            return self
        return dataclasses.replace(self, proxy=_proxy_config({**dataclasses.asdict(self.proxy), **changes},
                                                             self.name))


def _per_kind(value: Any, where: str, check: Any, default: Mapping[str, Any]) -> dict[str, Any]:
    """A value per tensor kind from a single value (all kinds) or a {kind: value} mapping (others default)."""
    if value is None:
        return dict(default)
    if isinstance(value, Mapping):
        check_keys(value, ASSIGNABLE_KINDS, where)
        return {kind: check(value[kind], f"{where}.{kind}") if kind in value else default[kind]
                for kind in ASSIGNABLE_KINDS}
    return {kind: check(value, where) for kind in ASSIGNABLE_KINDS}


def _allowed(allowed: tuple[str, ...]) -> Any:
    """``choice`` as a per-kind check."""
    return lambda value, where: choice(value, allowed, where)


def _proxy_config(raw: Any, where: str) -> ProxyConfig:
    if not isinstance(raw, Mapping):
        raise PrecsearchError(f"{where}: proxy must be a mapping of {', '.join(ProxyConfig.KEYS)}")
    check_keys(raw, ProxyConfig.KEYS, f"{where}: proxy")
    return ProxyConfig(**{name: spec.proxy_value(name, raw[name], f"{where}: proxy") for name in ProxyConfig.KEYS
                          if name in raw})


def _optimizer_for_weights(raw: Any, weight_format: str, master_weights: bool, where: str) -> dict[str, Any]:
    """Weight-update settings, checked against the low weight format (``UpdateConfig``; a scaled one by its
    element, and only with fp32 master weights: an optimizer keeps no scales)."""
    settings = optimizer(raw, f"{where}: optimizer")
    fmt = any_format(weight_format)
    if isinstance(fmt, ScaledFormat):
        if not master_weights:
            raise PrecsearchError(f"{where}: low weight format {weight_format} is scaled, which needs fp32 master "
                                  "weights (the forward scales the rounded copy); set master_weights: true")
        fmt = fmt.element
    try:
        UpdateConfig(weight_format=fmt.name, master_weights=master_weights, **settings)
    except PrecsearchError as error:
        raise PrecsearchError(f"{where}: optimizer: {error}") from None
    return settings


def _objectives(raw: Any, where: str) -> tuple[str, ...]:
    allowed = ", ".join(f"[memory, {name}]" for name in OBJECTIVES)
    if not isinstance(raw, list | tuple) or len(raw) != 2 or raw[0] != "memory" or raw[1] not in OBJECTIVES:
        raise PrecsearchError(f"{where}: objectives {raw!r} are not supported; use one of {allowed}")
    return tuple(raw)


def _choices(raw: Any, high: str, low: Mapping[str, str], where: str) -> dict[str, dict[str, str]]:
    """The categorical levels besides high and low: none wider than high, none the same formats as another
    level (a search would then spend trials telling two names of one assignment apart)."""
    if not isinstance(raw, Mapping) or not raw:
        raise PrecsearchError(f"{where}: a categorical space needs choices: a mapping of level name -> "
                              "format (all kinds) or {kind: format}")
    levels = {"high": dict.fromkeys(ASSIGNABLE_KINDS, high), "low": dict(low)}
    for name, value in raw.items():
        if not isinstance(name, str) or not name.isidentifier() or name in RESERVED_LEVELS:
            raise PrecsearchError(f"{where}: choice name {name!r} must be an identifier other than "
                                  f"{' and '.join(RESERVED_LEVELS)}")
        level = _per_kind(value, f"{where}: choices.{name}", format_name, dict.fromkeys(ASSIGNABLE_KINDS, high))
        not_wider(high, {f"choices.{name}.{kind}": spec for kind, spec in level.items()}, where)
        same = next((other for other, formats in levels.items() if _formats(formats) == _formats(level)), None)
        if same is not None:
            raise PrecsearchError(f"{where}: choices.{name} gives every kind the format level {same} gives; drop it "
                                  "or change a format")
        levels[name] = level
    return {name: levels[name] for name in raw}


def _parameters(fmt: FloatFormat | ScaledFormat) -> tuple[Any, ...]:
    """A format by its parameters, so that two names of one format (fp16, e5m10) compare equal."""
    if isinstance(fmt, ScaledFormat):
        return (*_parameters(fmt.element), fmt.granularity, fmt.block, fmt.history)
    return fmt.exp, fmt.man, fmt.bias, fmt.special


def _formats(level: Mapping[str, str]) -> dict[str, tuple[Any, ...]]:
    """A level's formats by their parameters."""
    return {kind: _parameters(any_format(spec)) for kind, spec in level.items()}


def _check_narrower(high: str, low: Mapping[str, str], where: str) -> None:
    """Every low format at most as wide as high, and one narrower: else "low" saves nothing (or costs more)."""
    not_wider(high, {f"low.{kind}": spec for kind, spec in low.items()}, where)
    high_bits = value_bits(high)
    if all(value_bits(spec) == high_bits for spec in low.values()):
        raise PrecsearchError(f"{where}: every low format is as wide as high {high} ({high_bits} bits), so no "
                              "assignment saves memory; give at least one low format narrower than the high one")


def _check_scaled_rounding(levels: list[Mapping[str, str]], rounding: Mapping[str, str], where: str) -> None:
    """A kind that a level gives a scaled format rounds to nearest: the runtime has no stochastic scaled rounding."""
    for level in levels:
        for kind, format_spec in level.items():
            if rounding[kind] == "stochastic" and isinstance(any_format(format_spec), ScaledFormat):
                raise PrecsearchError(f"{where}: {kind} may be {format_spec}, a scaled format, which rounds to "
                                      f"nearest only; set rounding.{kind}: nearest")


def _description(raw: Any, where: str) -> str:
    """Free text; ``description:`` with nothing after it is no description (YAML reads it as null)."""
    if raw is None:
        return ""
    if not isinstance(raw, str):
        raise PrecsearchError(f"{where}: description must be text, not {type(raw).__name__}; quote it")
    return raw.strip()


def parse_space(raw: Any, where: str = "search space") -> SearchSpace:
    """Validate a space given as plain data (a parsed YAML mapping); ``where`` names it in errors."""
    if not isinstance(raw, Mapping):
        raise PrecsearchError(f"{where} must be a YAML mapping with keys {', '.join(TOP_KEYS)}")
    check_keys(raw, TOP_KEYS, where)
    if "high" not in raw or "low" not in raw:
        raise PrecsearchError(f"{where} must name a high format and low formats (keys high and low)")
    high = format_name(raw["high"], f"{where}: high", scaled=False)
    low = _per_kind(raw["low"], f"{where}: low", format_name, {kind: high for kind in ASSIGNABLE_KINDS})
    _check_narrower(high, low, where)
    granularity = choice(raw.get("granularity", "group"), GRANULARITIES, f"{where}: granularity")
    if "choices" in raw and granularity != "categorical":
        raise PrecsearchError(f"{where}: choices apply only to granularity categorical; drop them or set it")
    choices = _choices(raw.get("choices"), high, low, where) if granularity == "categorical" else {}
    defaults = SearchSpace(name="", high=high, low=low)
    master_weights = flag(raw.get("master_weights", defaults.master_weights), f"{where}: master_weights")
    name = raw.get("name", "space")
    if not isinstance(name, str) or not name:
        raise PrecsearchError(f"{where}: name must be a non-empty string")
    rounding = _per_kind(raw.get("rounding"), f"{where}: rounding", _allowed(POLICY_ROUNDINGS), defaults.rounding)
    _check_scaled_rounding([low, *choices.values()], rounding, where)
    return SearchSpace(
        name=name, description=_description(raw.get("description"), where), high=high, low=low,
        granularity=granularity, choices=choices, rounding=rounding,
        overflow=_per_kind(raw.get("overflow"), f"{where}: overflow", _allowed(OVERFLOWS), defaults.overflow),
        loss_scaling=loss_scaling(raw.get("loss_scaling", defaults.loss_scaling), f"{where}: loss_scaling",
                                  SPACE_DEFAULTS.loss_scaling_mode, canonical=True),
        promotion_threshold=spec.promotion_threshold(raw.get("promotion_threshold", defaults.promotion_threshold),
                                                     where),
        promotion_kinds=spec.kinds_list(raw.get("promotion_kinds", list(defaults.promotion_kinds)),
                                        f"{where}: promotion_kinds"),
        gradient_rounding=choice(raw.get("gradient_rounding", defaults.gradient_rounding), GRADIENT_ROUNDINGS,
                                 f"{where}: gradient_rounding"),
        ties=choice(raw.get("ties", defaults.ties), TIES, f"{where}: ties"),
        master_weights=master_weights,
        optimizer=_optimizer_for_weights(raw.get("optimizer", {}), low["weight"], master_weights, where),
        proxy=_proxy_config(raw.get("proxy", {}), where),
        objectives=_objectives(raw.get("objectives", list(defaults.objectives)), where),
        sampler=choice(raw.get("sampler", defaults.sampler), SAMPLERS, f"{where}: sampler"),
    )


def load_space(path: str | Path) -> SearchSpace:
    """Read and validate a space YAML file (precsearch.config.reading's limits); anything wrong with it is a
    PrecsearchError."""
    raw = load_yaml(path, "search space", "give a UTF-8 YAML file such as search_spaces/hfp8.yaml")
    return parse_space(raw, where=f"search space {path}")


def paper_space(**changes: Any) -> SearchSpace:
    """The paper's HFP8 space, with top-level keys of a space file replaced by ``changes``."""
    return parse_space({**PAPER_SPACE, **changes}, where="the paper's space")
