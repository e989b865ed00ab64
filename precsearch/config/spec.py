"""The shared vocabulary, defined once: the names of tensor kinds, modes and settings that files, spaces,
policies and the runtime all speak, and the paper's constants.

Plain data and no torch, so configuration code (spaces, policies, reports) can import it without loading
the training stack. Every other module imports these names from here. The settings with a schema of their own
live beside it: float formats in precsearch.formats.format, loss scaling in precsearch.config.loss_scaling,
weight updates in precsearch.config.optimizer, and the shared validators in precsearch.config.checks.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any, ClassVar

from precsearch.config.checks import number
from precsearch.config.loss_scaling import PAPER_LOSS_SCALING
from precsearch.errors import PrecsearchError, echo

__all__ = ["ACTIVATION", "ACTIVATION_GRAD", "ASSIGNABLE_KINDS", "BASELINES", "COMPRESSIONS", "EXTRA_KINDS",
           "GRADIENT_ROUNDINGS", "GRAD_KINDS", "KINDS", "MEMORY_MEASURES", "PAPER_HIGH", "PAPER_LOW", "PAPER_OVERFLOW",
           "PAPER_PROMOTION_KINDS", "POLICY_DEFAULTS", "POLICY_ROUNDINGS", "ProxyConfig", "SAMPLERS", "SPACE_DEFAULTS",
           "TIES", "TORCH_BASELINES", "TensorId", "WEIGHT", "WEIGHT_GRAD", "Defaults", "kinds_list",
           "promotion_threshold", "proxy_value"]

# Tensor kinds. An assignment gives a format to the four assignable kinds (the paper's P, Y, GP, GY); the
# optimizer's master copy and state are training memory too, always fp32 unless the optimizer says otherwise.
WEIGHT = "weight"
ACTIVATION = "activation"
WEIGHT_GRAD = "weight_grad"
ACTIVATION_GRAD = "activation_grad"
ASSIGNABLE_KINDS: tuple[str, ...] = (WEIGHT, ACTIVATION, WEIGHT_GRAD, ACTIVATION_GRAD)
EXTRA_KINDS: tuple[str, ...] = ("master_weight", "optimizer_state")
KINDS: tuple[str, ...] = ASSIGNABLE_KINDS + EXTRA_KINDS
GRAD_KINDS: tuple[str, ...] = ("weight_grad", "activation_grad")

# Rounding. What a policy's per-kind ``rounding`` may say (ties are the policy-wide ``ties``: half to even, the
# IEEE default, or away from zero as the paper's QPyTorch fork rounds); a kernel's modes and the overflow modes
# are the formats' (precsearch.formats.format.ROUNDINGS, OVERFLOWS).
POLICY_ROUNDINGS: tuple[str, ...] = ("nearest", "stochastic")
TIES: tuple[str, ...] = ("even", "away")
# How an activation with several consumers has its gradient rounded: once on the sum, or per use (the paper).
GRADIENT_ROUNDINGS: tuple[str, ...] = ("sum", "per_use")

# Training and search settings.
COMPRESSIONS: tuple[str, ...] = ("none", "adacomp")
BASELINES: tuple[str, ...] = ("fp32", "fp16", "bf16", "fp8", "mpt", "hfp8", "wang_fp8", "torchao_fp8")
# Torch's own mixed precision beside them: plain torch.autocast, no policy file (precsearch.train.autocast).
TORCH_BASELINES: tuple[str, ...] = ("autocast_bf16", "autocast_fp16")
# Optuna samplers a search can use (precsearch.search.samplers): multivariate TPE, NSGA-II, random, Gaussian process.
SAMPLERS: tuple[str, ...] = ("tpe", "nsga2", "random", "gp")
# What a search's memory objective measures: the predicted peak of a training step (the default: what a user's
# device runs out of), or the paper's bytes of the tensors training keeps, each as a ratio to all-high's.
MEMORY_MEASURES: tuple[str, ...] = ("peak", "bytes")
DEFAULT_MEMORY_MEASURE = "peak"

# The paper (Lee, Sharma, Aiken 2023): its high format and per-kind low formats, forward tensors saturating
# and gradients overflowing to inf (so the loss scaler sees them), promotion of weights and activations only.
PAPER_HIGH = "e6m9s"
PAPER_LOW: dict[str, str] = {"weight": "e4m3b4s", "activation": "e4m3b4s", "activation_grad": "e5m2s",
                             "weight_grad": "e6m9s"}
PAPER_OVERFLOW: dict[str, str] = {"weight": "saturate", "activation": "saturate", "weight_grad": "inf",
                                  "activation_grad": "inf"}
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
            raise ValueError(f"tensor id {echo(text)} is not op:name, e.g. conv1:activation or conv1:weight")
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

    KEYS: ClassVar[tuple[str, ...]] = ("steps", "batch_size", "image_size", "lr", "momentum", "weight_decay",
                                       "eval_batch_size", "blowup_factor", "min_loss_scale", "max_skipped_fraction",
                                       "report_every", "stats_every", "bn_images")
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
    bn_images: int = 1024  # training images batch norm's statistics are recomputed from before each reading
    # (precsearch.train.reading; 0: read with the running averages as training left them)

    def __post_init__(self) -> None:  # a recipe built in code is held to a space file's ranges
        for name in self.KEYS:
            proxy_value(name, getattr(self, name), "proxy")


# Each proxy setting's range as ``number`` takes it (low, high, open_low, open_high); a setting not listed is a
# finite number >= 0. The same ranges as the train command's options (--lr > 0, --momentum in [0, 1)).
_PROXY_RANGES: dict[str, tuple[float, float, bool, bool]] = {
    **dict.fromkeys(("steps", "batch_size", "image_size", "eval_batch_size", "report_every"),
                    (1, math.inf, False, False)),
    "lr": (0, math.inf, True, False),
    "momentum": (0, 1, False, True),
    "blowup_factor": (1, math.inf, True, False),  # a loss above 1x its first value is no blow-up
    "max_skipped_fraction": (0, 1, False, False),
}


def proxy_value(name: str, value: Any, where: str) -> Any:
    """A proxy setting checked (``where``: ``proxy`` or a file's ``proxy``) against its range (``_PROXY_RANGES``),
    an integer where the default is one."""
    low, high, open_low, open_high = _PROXY_RANGES.get(name, (0, math.inf, False, False))
    integer = isinstance(getattr(ProxyConfig, name), int)
    return number(value, f"{where}.{name}", low, high, integer=integer, open_low=open_low, open_high=open_high)


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
SPACE_DEFAULTS = Defaults(loss_scaling=PAPER_LOSS_SCALING, master_weights=False)
# A policy file without these keys predates them: it trained unscaled, with fp32 master weights.
POLICY_DEFAULTS = Defaults(loss_scaling=MappingProxyType({"mode": "none"}), master_weights=True)


# ----------------------------------------------------------------------------------------------- validators


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
        raise PrecsearchError(f"{where} must be a list of tensor kinds ({', '.join(ASSIGNABLE_KINDS)}), not "
                              f"{echo(value)}")
    unknown = sorted(set(value) - set(ASSIGNABLE_KINDS))
    if unknown:
        raise PrecsearchError(f"{where}: unknown tensor kind {echo(unknown[0])}; use {', '.join(ASSIGNABLE_KINDS)}")
    return tuple(kind for kind in ASSIGNABLE_KINDS if kind in value)
