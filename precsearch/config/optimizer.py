"""How weights are stored and updated, as data: a policy's ``optimizer`` entry and ``UpdateConfig``, checked
without torch (precsearch.runtime.optim's ``LowPrecisionOptimizer`` carries them out; its module docstring
says what each update does)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any

from precsearch.config.checks import check_keys, choice
from precsearch.errors import PrecsearchError
from precsearch.formats.format import FloatFormat, get_format, spec_name

__all__ = ["OPTIMIZER_KEYS", "STATE_MIN_EXP", "UPDATES", "UpdateConfig", "optimizer", "state_specs"]

UPDATES: tuple[str, ...] = ("nearest", "stochastic", "kahan")
# Minimum exponent bits of a state format, per state tensor name: a state holding gradient-sized values needs
# fp16's range; Adam's second moments hold squared gradients, whose exponents span twice the range.
STATE_MIN_EXP: Mapping[str, int] = {"momentum_buffer": 5, "exp_avg": 5, "exp_avg_sq": 8, "max_exp_avg_sq": 8}


def state_specs(state_format: str | FloatFormat | Mapping[str, str] | None) -> dict[str, str]:
    """``{state name: format}``; a single spec applies to every known state name."""
    if state_format is None:
        return {}
    if isinstance(state_format, str | FloatFormat):
        return dict.fromkeys(STATE_MIN_EXP, str(state_format))
    unknown = sorted(set(state_format) - set(STATE_MIN_EXP))
    if unknown:
        raise PrecsearchError(f"unknown optimizer state {', '.join(unknown)} in state_format: use "
                              f"{', '.join(STATE_MIN_EXP)}")
    return {name: str(spec) for name, spec in state_format.items()}


@dataclass(frozen=True)
class UpdateConfig:
    """How weights are stored and updated: the ``optimizer`` entry of a policy (plus ``master_weights``)."""

    weight_format: str = "bf16"
    update: str = "nearest"
    master_weights: bool = True
    state_format: str | dict[str, str] | None = None
    compensation_format: str | None = None
    seed: int | None = None  # seeds the stochastic-rounding generator when none is passed

    def __post_init__(self) -> None:
        if self.update not in UPDATES:
            raise PrecsearchError(f"unknown weight update {self.update!r}: use one of {', '.join(UPDATES)}")
        if self.update == "kahan" and self.master_weights:
            raise PrecsearchError("update 'kahan' compensates low-precision weights; with master_weights=True the fp32 "
                                  "master needs none: set master_weights=False or update='nearest'")
        weight = get_format(self.weight_format)
        if self.compensation_format is not None:
            if self.update != "kahan":
                raise PrecsearchError("compensation_format is only used by update='kahan': drop it or use kahan")
            comp = get_format(self.compensation_format)
            if comp.bits > weight.bits:
                raise PrecsearchError(f"Kahan buffer format {comp} ({comp.bits} bits) is wider than the weight format "
                                      f"{weight} ({weight.bits} bits): use the weight's format or a narrower one")
        for spec in state_specs(self.state_format).values():
            get_format(spec)

    @classmethod
    def from_dict(cls, config: Mapping[str, Any]) -> UpdateConfig:
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(config) - known)
        if unknown:
            raise PrecsearchError(f"unknown optimizer setting(s) {', '.join(unknown)}: use {', '.join(sorted(known))}")
        return cls(**dict(config))


# The settings of a policy's ``optimizer`` entry: UpdateConfig's, less the weight format and master_weights,
# which are policy fields of their own.
OPTIMIZER_KEYS: tuple[str, ...] = tuple(
    f.name for f in fields(UpdateConfig) if f.name not in ("weight_format", "master_weights"))


def optimizer(raw: Any, where: str) -> dict[str, Any]:
    """An ``optimizer`` entry (``OPTIMIZER_KEYS``); its fit to the weight format is ``UpdateConfig``'s check."""
    if not isinstance(raw, Mapping):
        raise PrecsearchError(f"{where} must be a mapping of {', '.join(OPTIMIZER_KEYS)}")
    check_keys(raw, OPTIMIZER_KEYS, where)
    settings = dict(raw)
    if "update" in settings:
        choice(settings["update"], UPDATES, f"{where}.update")
    for key in ("state_format", "compensation_format"):
        if key in settings:
            settings[key] = spec_name(settings[key], f"{where}.{key}")
    seed = settings.get("seed")
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int) or seed < 0):
        raise PrecsearchError(f"{where}.seed must be a non-negative integer or null, not {seed!r}")
    return settings
