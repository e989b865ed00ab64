"""The shared vocabulary, defined once: the names of tensor kinds, modes and settings that files, spaces,
policies and the runtime all speak, and the paper's constants.

Plain data and no torch, so configuration code (spaces, policies, reports) can import it without loading
the training stack. Every other module imports these names from here (or re-exports them).
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import re
from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any, ClassVar

from precsearch.errors import PrecsearchError
from precsearch.formats.format import spec_name

__all__ = [
    "ASSIGNABLE_KINDS",
    "BASELINES",
    "COMPRESSIONS",
    "EXTRA_KINDS",
    "GRADIENT_ROUNDINGS",
    "GRAD_KINDS",
    "KINDS",
    "LOSS_SCALING_KEYS",
    "LOSS_SCALING_MODES",
    "OPTIMIZER_KEYS",
    "OVERFLOWS",
    "PAPER_HIGH",
    "PAPER_LOW",
    "PAPER_OVERFLOW",
    "PAPER_PROMOTION_KINDS",
    "POLICY_DEFAULTS",
    "POLICY_ROUNDINGS",
    "ProxyConfig",
    "ROUNDINGS",
    "SAMPLERS",
    "SPACE_DEFAULTS",
    "TIES",
    "TensorId",
    "UPDATES",
    "Defaults",
    "check_keys",
    "choice",
    "flag",
    "kinds_list",
    "loss_scaling",
    "number",
    "optimizer",
    "promotion_threshold",
]

# Tensor kinds. An assignment gives a format to the four assignable kinds (the paper's P, Y, GP, GY); the
# optimizer's master copy and state are training memory too, always fp32 unless the optimizer says otherwise.
ASSIGNABLE_KINDS: tuple[str, ...] = ("weight", "activation", "weight_grad", "activation_grad")
EXTRA_KINDS: tuple[str, ...] = ("master_weight", "optimizer_state")
KINDS: tuple[str, ...] = ASSIGNABLE_KINDS + EXTRA_KINDS
GRAD_KINDS: tuple[str, ...] = ("weight_grad", "activation_grad")

# Rounding. A kernel's modes (formats); what a policy's per-kind ``rounding`` may say (ties are the policy-wide
# ``ties``: half to even, the IEEE default, or away from zero as the paper's QPyTorch fork rounds).
ROUNDINGS: tuple[str, ...] = ("nearest", "nearest_away", "stochastic")
POLICY_ROUNDINGS: tuple[str, ...] = ("nearest", "stochastic")
TIES: tuple[str, ...] = ("even", "away")
OVERFLOWS: tuple[str, ...] = ("inf", "saturate", "nan")
# How an activation with several consumers has its gradient rounded: once on the sum, or per use (the paper).
GRADIENT_ROUNDINGS: tuple[str, ...] = ("sum", "per_use")

# Training settings.
LOSS_SCALING_MODES: tuple[str, ...] = ("none", "static", "dynamic", "adaptive")
# The options of a ``loss_scaling`` entry (precsearch.runtime.scaling's scaler arguments that a file can hold).
LOSS_SCALING_KEYS: tuple[str, ...] = (
    "mode", "scale", "init_scale", "growth_factor", "backoff_factor", "growth_interval", "underflow_rate",
    "max_scale", "grad_format", "overflow_format",
)
UPDATES: tuple[str, ...] = ("nearest", "stochastic", "kahan")
# The settings of a policy's ``optimizer`` entry (precsearch.runtime.optim.UpdateConfig's, less the weight format and
# master_weights, which are policy fields of their own).
OPTIMIZER_KEYS: tuple[str, ...] = ("update", "state_format", "compensation_format", "seed")
COMPRESSIONS: tuple[str, ...] = ("none", "adacomp")
BASELINES: tuple[str, ...] = ("fp32", "fp16", "bf16", "fp8", "mpt", "hfp8", "wang_fp8")
# Optuna samplers a search can use (precsearch.search.samplers): multivariate TPE, NSGA-II, random, Gaussian process.
SAMPLERS: tuple[str, ...] = ("tpe", "nsga2", "random", "gp")

# The paper (Lee, Sharma, Aiken 2023): its high format and per-kind low formats, forward tensors saturating
# and gradients overflowing to inf (so the loss scaler sees them), promotion of weights and activations only.
PAPER_HIGH = "e6m9s"
PAPER_LOW: dict[str, str] = {
    "weight": "e4m3b4s", "activation": "e4m3b4s", "activation_grad": "e5m2s", "weight_grad": "e6m9s",
}
PAPER_OVERFLOW: dict[str, str] = {
    "weight": "saturate", "activation": "saturate", "weight_grad": "inf", "activation_grad": "inf",
}
PAPER_PROMOTION_KINDS: tuple[str, ...] = ("weight", "activation")


# The suffixes a parameter's id takes for the tensors that belong to it (the weight's own id has none).
_PARAM_SUFFIXES: dict[str, str] = {"weight": "", "weight_grad": "_grad", "master_weight": "_master",
                                   "optimizer_state": "_momentum"}
_ACTIVATION = re.compile(r"(activation(?:_grad)?)(\d*)")


@dataclass(frozen=True)
class TensorId:
    """A tensor of the graph: the op that produces (or first uses) it, its kind, and which of the op's outputs
    (an activation) or parameters (a weight and its gradient, master copy and optimizer state) it is.

    ``str(tid)`` is the id files and policies use: ``conv1:activation``, ``var_mean:activation_grad1`` (the
    output index last, none for output 0), ``layer1.0.conv1:weight``, ``fc:bias_grad``, ``fc:weight_master``,
    ``fc:weight_momentum``; ``TensorId.parse`` reads it back. A parameter whose own name is ``activation<k>``
    or ends in one of those suffixes would read back as another kind; torch's modules have none.
    """

    op: str
    kind: str
    index: int = 0  # which output of the op (activations)
    param: str = ""  # the parameter's name as the op sees it (weights and what belongs to them)

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"unknown tensor kind {self.kind!r}; use one of {', '.join(KINDS)}")
        if (self.kind in _PARAM_SUFFIXES) != bool(self.param):
            raise ValueError(f"a {self.kind} id {'needs' if self.kind in _PARAM_SUFFIXES else 'takes no'} "
                             "parameter name")

    def __str__(self) -> str:
        if self.kind in _PARAM_SUFFIXES:
            return f"{self.op}:{self.param}{_PARAM_SUFFIXES[self.kind]}"
        return f"{self.op}:{self.kind}{self.index or ''}"

    @classmethod
    def parse(cls, text: str) -> TensorId:
        """The id ``str`` wrote (``op:activation1``, ``op:weight_grad``, ...)."""
        op, colon, rest = text.rpartition(":")
        if not colon or not op or not rest:
            raise ValueError(f"tensor id {text!r} is not op:name, e.g. conv1:activation or conv1:weight")
        match = _ACTIVATION.fullmatch(rest)
        if match:
            return cls(op, match[1], int(match[2] or 0))
        for kind, suffix in _PARAM_SUFFIXES.items():
            if suffix and rest.endswith(suffix) and len(rest) > len(suffix):
                return cls(op, kind, param=rest.removesuffix(suffix))
        return cls(op, "weight", param=rest)

    def grad(self) -> TensorId:
        """The gradient of an activation or a weight."""
        kinds = {"activation": "activation_grad", "weight": "weight_grad"}
        if self.kind not in kinds:
            raise ValueError(f"{self} ({self.kind}) has no gradient id; only activations and weights do")
        return dataclasses.replace(self, kind=kinds[self.kind])

    def forward(self) -> TensorId:
        """The forward tensor this one belongs to: an activation for its gradient, a weight for its gradient,
        master copy and optimizer state (itself for a forward tensor)."""
        kind = "activation" if self.kind.startswith("activation") else "weight"
        return dataclasses.replace(self, kind=kind)


@dataclass(frozen=True)
class ProxyConfig:
    """The proxy training recipe and its divergence tests (keys of a space file's ``proxy:`` section)."""

    KEYS: ClassVar[tuple[str, ...]] = (
        "steps", "batch_size", "image_size", "lr", "momentum", "weight_decay", "eval_batch_size",
        "blowup_factor", "min_loss_scale", "max_skipped_fraction", "report_every", "stats_every",
    )
    steps: int = 150
    batch_size: int = 64
    image_size: int = 16
    lr: float = 0.2
    momentum: float = 0.9
    weight_decay: float = 5e-4
    eval_batch_size: int = 512
    blowup_factor: float = 10.0
    min_loss_scale: float = 1.0
    max_skipped_fraction: float = 0.25
    report_every: int = 10
    stats_every: int = 50


@dataclass(frozen=True)
class Defaults:
    """What a layer assumes for a shared setting its file leaves out.

    ``loss_scaling`` is what an absent ``loss_scaling`` key means; its mode is also the mode of an entry that
    names none. The two layers differ on purpose: ``SPACE_DEFAULTS`` describe what a search trains, and
    ``POLICY_DEFAULTS`` what an absent key means in a policy file, which must keep meaning what it meant when
    the file was written.
    """

    loss_scaling: Mapping[str, Any]
    master_weights: bool

    @property
    def loss_scaling_mode(self) -> str:
        return str(self.loss_scaling["mode"])


# A search trains as the paper does unless its space says otherwise: dynamic loss scaling from 2^16; low
# weights updated in place (a space turns fp32 master copies on with ``master_weights: true``).
SPACE_DEFAULTS = Defaults(loss_scaling=MappingProxyType({"mode": "dynamic", "init_scale": 2.0**16}),
                          master_weights=False)
# A policy file without these keys predates them: it trained unscaled, with fp32 master weights.
POLICY_DEFAULTS = Defaults(loss_scaling=MappingProxyType({"mode": "none"}), master_weights=True)


# ----------------------------------------------------------------------------------------------- validators
# Shared by spaces and policies, so a bad value gets the same one-line message from both: ``where`` names the
# file and key, the rest says what is allowed.


def check_keys(keys: Any, allowed: tuple[str, ...], where: str) -> None:
    """Raise on the first key not in ``allowed``, with the closest allowed key as a hint."""
    unknown = [str(key) for key in keys if key not in allowed]
    if unknown:
        close = difflib.get_close_matches(unknown[0], allowed, n=1)
        hint = f" (did you mean {close[0]}?)" if close else ""
        raise PrecsearchError(f"{where}: unknown key {unknown[0]!r}{hint}; allowed keys: {', '.join(allowed)}")


def choice(value: Any, allowed: tuple[str, ...], where: str) -> str:
    """``value`` if it is one of ``allowed``."""
    if value not in allowed:
        raise PrecsearchError(f"{where}: {value!r} is not allowed; use one of {', '.join(allowed)}")
    return value


def flag(value: Any, where: str) -> bool:
    """``value`` if it is a bool (YAML and JSON ``true``/``false``)."""
    if not isinstance(value, bool):
        raise PrecsearchError(f"{where} must be true or false, not {value!r}")
    return value


def number(value: Any, where: str, low: float, high: float = math.inf, integer: bool = False) -> Any:
    """A finite number in [low, high] as float (int if ``integer``; a float with an integral value is one)."""
    ok = isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)
    if ok and integer:
        ok = float(value).is_integer()
    if not ok or not low <= value <= high:
        kind = "an integer" if integer else "a number"
        bounds = f">= {low}" if high == math.inf else f"in [{low}, {high}]"
        raise PrecsearchError(f"{where}={value!r} must be {kind} {bounds}")
    return int(value) if integer else float(value)


def promotion_threshold(value: Any, where: str) -> float | None:
    """The divergence guard's overflow fraction in (0, 1], or None (the guard off)."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value) or not 0 < value <= 1:
        raise PrecsearchError(f"{where}: promotion_threshold must be in (0, 1], or null to turn the guard off, "
                              f"not {value!r}")
    return float(value)


def kinds_list(value: Any, where: str) -> tuple[str, ...]:
    """A list of tensor kinds (each once), kept in the order of ``ASSIGNABLE_KINDS``."""
    if isinstance(value, str) or not isinstance(value, list | tuple) or not all(isinstance(k, str) for k in value):
        raise PrecsearchError(f"{where} must be a list of tensor kinds ({', '.join(ASSIGNABLE_KINDS)}), not {value!r}")
    unknown = sorted(set(value) - set(ASSIGNABLE_KINDS))
    if unknown:
        raise PrecsearchError(f"{where}: unknown tensor kind {unknown[0]!r}; use {', '.join(ASSIGNABLE_KINDS)}")
    return tuple(kind for kind in ASSIGNABLE_KINDS if kind in value)


def loss_scaling(raw: Any, where: str, defaults: Defaults, canonical: bool = False) -> dict[str, Any]:
    """A ``loss_scaling`` entry: a mode, or ``{"mode": ..., **options}`` with the mode first and the options
    numbers (``growth_interval`` a whole number or ``"epoch"``) or format names; checked by building the scaler
    once. ``where`` names the entry (``"policy x.json: loss_scaling"``).

    ``canonical`` writes the numbers as floats (``growth_interval`` as int), so that equal settings hash
    equal (a space's fingerprint); without it they stay as the file wrote them, so a policy saved again is
    byte for byte the file it was read from."""
    if isinstance(raw, str):
        raw = {"mode": raw}
    if not isinstance(raw, Mapping):
        raise PrecsearchError(f"{where} must be a mode ({', '.join(LOSS_SCALING_MODES)}) or a mapping with a mode")
    check_keys(raw, LOSS_SCALING_KEYS, where)
    settings = {"mode": choice(raw.get("mode", defaults.loss_scaling_mode), LOSS_SCALING_MODES, f"{where}.mode")}
    for key, value in raw.items():
        if key in ("grad_format", "overflow_format"):
            settings[key] = _format_name(value, f"{where}.{key}")
        elif key == "growth_interval":
            interval = _growth_interval(value, f"{where}.{key}")
            settings[key] = interval if canonical else value
        elif key != "mode":
            amount = number(value, f"{where}.{key}", 0.0)
            settings[key] = amount if canonical else value
    from precsearch.runtime.scaling import epoch_growth, make_scaler  # torch: loaded when a file is checked, not here

    try:
        make_scaler(settings["mode"], **epoch_growth({k: v for k, v in settings.items() if k != "mode"}, 1))
    except PrecsearchError as error:
        raise PrecsearchError(f"{where}: {error}") from None
    return settings


def _growth_interval(value: Any, where: str) -> int | str:
    """Clean steps between scale growths, or ``"epoch"`` (resolved by the trainer: scaling.epoch_growth)."""
    if value == "epoch":
        return value
    try:
        return number(value, where, 0, integer=True)
    except PrecsearchError:
        raise PrecsearchError(f"{where} {value!r} must be a whole number of steps or \"epoch\"") from None


def optimizer(raw: Any, where: str) -> dict[str, Any]:
    """An ``optimizer`` entry (``OPTIMIZER_KEYS``); its fit to the weight format is runtime.optim's check."""
    if not isinstance(raw, Mapping):
        raise PrecsearchError(f"{where} must be a mapping of {', '.join(OPTIMIZER_KEYS)}")
    check_keys(raw, OPTIMIZER_KEYS, where)
    settings = dict(raw)
    if "update" in settings:
        choice(settings["update"], UPDATES, f"{where}.update")
    for key in ("state_format", "compensation_format"):
        if key in settings:
            settings[key] = _format_name(settings[key], f"{where}.{key}")
    seed = settings.get("seed")
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int) or seed < 0):
        raise PrecsearchError(f"{where}.seed must be a non-negative integer or null, not {seed!r}")
    return settings


def _format_name(value: Any, where: str) -> str:
    return spec_name(value, where)
