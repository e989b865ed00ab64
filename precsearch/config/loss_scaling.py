"""Loss-scaling settings as data: the modes, each mode's options with their defaults and allowed ranges,
defined once and checked without torch.

A policy's or a space's ``loss_scaling`` entry is a mode, or ``{"mode": ..., **options}``. The options a mode
takes are those of its scaler in precsearch.runtime.scaling, which takes its defaults from ``OPTIONS`` and
checks its arguments with ``check_option``, so a file and a Python call are held to the same rules and
refused with the same words. ``growth_interval`` may also be ``"epoch"``: once per epoch, as the Lee et al.
reference doubles its scale (resolved by ``precsearch.runtime.scaling.epoch_growth``).
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType
from typing import Any

from precsearch.config.checks import check_keys, choice, number
from precsearch.errors import PrecsearchError
from precsearch.formats.format import spec_name

__all__ = ["EPOCH", "LOSS_SCALING_KEYS", "LOSS_SCALING_MODES", "OPTIONS", "PAPER_LOSS_SCALING", "REQUIRED",
           "check_option", "loss_scaling"]


class _Required:
    """The default of an option that has none: the entry must give it."""

    def __repr__(self) -> str:
        return "REQUIRED"


REQUIRED = _Required()
EPOCH = "epoch"
_GRAD_SCALER = {"growth_factor": 2.0, "backoff_factor": 0.5, "growth_interval": 2000}  # torch.amp.GradScaler's
# Mode -> the options its scaler takes -> their defaults (overflow_format None: overflow means inf/NaN only).
OPTIONS: Mapping[str, Mapping[str, Any]] = MappingProxyType({
    "none": MappingProxyType({}),
    "static": MappingProxyType({"init_scale": REQUIRED, "overflow_format": None}),
    "dynamic": MappingProxyType({"init_scale": 2.0**16, **_GRAD_SCALER, "overflow_format": None}),
    # Zhao et al. 2019: underflow rate 1e-3; the global scale starts at 1 (the per-layer factors do the work)
    "adaptive": MappingProxyType({"grad_format": "fp16", "underflow_rate": 1e-3, "init_scale": 1.0,
                                  "max_scale": 2.0**24, **_GRAD_SCALER, "overflow_format": None}),
})
LOSS_SCALING_MODES: tuple[str, ...] = tuple(OPTIONS)
LOSS_SCALING_KEYS: tuple[str, ...] = ("mode", *dict.fromkeys(key for options in OPTIONS.values() for key in options))
# The paper (Lee et al.): GradScaler's dynamic scaling from 2^16.
PAPER_LOSS_SCALING: Mapping[str, Any] = MappingProxyType(
    {"mode": "dynamic", "init_scale": OPTIONS["dynamic"]["init_scale"]})


def check_option(key: str, value: Any, where: str) -> Any:
    """``value`` if it is allowed for option ``key`` (numbers as float, ``growth_interval`` as int or
    ``"epoch"``, formats as their spec names); ``where`` names the option in the error."""
    if key in ("grad_format", "overflow_format"):
        return None if value is None and key == "overflow_format" else spec_name(value, where)
    if key in ("init_scale", "max_scale"):
        return number(value, where, 0.0, open_low=True)
    if key == "growth_factor":
        return number(value, where, 1.0, open_low=True)
    if key == "backoff_factor":
        return number(value, where, 0.0, 1.0, open_low=True, open_high=True)
    if key == "underflow_rate":
        return number(value, where, 0.0, 0.5, open_low=True)
    if key == "growth_interval":
        if value == EPOCH:
            return value
        try:
            return number(value, where, 1, integer=True)
        except PrecsearchError:
            raise PrecsearchError(f"{where}={value!r} must be a whole number of steps >= 1 or \"epoch\"") from None
    raise PrecsearchError(f"{where}: unknown loss scaling option; use one of {', '.join(LOSS_SCALING_KEYS[1:])}")


def loss_scaling(raw: Any, where: str, default_mode: str, canonical: bool = False) -> dict[str, Any]:
    """A ``loss_scaling`` entry: a mode, or ``{"mode": ..., **options}`` with the mode first and only the
    options that mode takes (``default_mode`` when it names none). ``where`` names the entry
    (``"policy x.json: loss_scaling"``).

    ``canonical`` writes the checked values (numbers as floats, ``growth_interval`` as int), so that equal
    settings hash equal (a space's fingerprint); without it they stay as the file wrote them, so a policy
    saved again is byte for byte the file it was read from."""
    if isinstance(raw, str):
        raw = {"mode": raw}
    if not isinstance(raw, Mapping):
        raise PrecsearchError(f"{where} must be a mode ({', '.join(LOSS_SCALING_MODES)}) or a mapping with a mode")
    mode = choice(raw.get("mode", default_mode), LOSS_SCALING_MODES, f"{where}.mode")
    takes = OPTIONS[mode]
    settings: dict[str, Any] = {"mode": mode}
    for key, value in raw.items():
        if key == "mode":
            continue
        if key not in takes:
            if key not in LOSS_SCALING_KEYS:
                check_keys([key], ("mode", *takes), where)  # a misspelling: the closest option of this mode
            allowed = f"it takes {', '.join(takes)}" if takes else "it takes no options"
            raise PrecsearchError(f"{where}: mode {mode} takes no option {key!r}; {allowed}")
        checked = check_option(key, value, f"{where}.{key}")
        settings[key] = checked if canonical or key.endswith("_format") else value
    missing = [key for key, default in takes.items() if default is REQUIRED and key not in settings]
    if missing:
        raise PrecsearchError(f"{where}: mode {mode} needs {missing[0]} (e.g. {missing[0]}: 1024)")
    return settings
