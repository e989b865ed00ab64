"""The shared vocabulary, defined once: the names of tensor kinds, modes and settings that files, spaces,
policies and the runtime all speak, and the paper's constants.

Plain data and no torch, so configuration code (spaces, policies, reports) can import it without loading
the training stack. Every other module imports these names from here (or re-exports them).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

__all__ = [
    "ASSIGNABLE_KINDS",
    "BASELINES",
    "COMPRESSIONS",
    "EXTRA_KINDS",
    "GRADIENT_ROUNDINGS",
    "GRAD_KINDS",
    "KINDS",
    "LOSS_SCALING_MODES",
    "OPTIMIZER_KEYS",
    "OVERFLOWS",
    "PAPER_HIGH",
    "PAPER_LOW",
    "PAPER_OVERFLOW",
    "PAPER_PROMOTION_KINDS",
    "POLICY_ROUNDINGS",
    "ProxyConfig",
    "ROUNDINGS",
    "SAMPLERS",
    "TIES",
    "UPDATES",
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
UPDATES: tuple[str, ...] = ("nearest", "stochastic", "kahan")
# The settings of a policy's ``optimizer`` entry (precsearch.optim.UpdateConfig's, less the weight format and
# master_weights, which are policy fields of their own).
OPTIMIZER_KEYS: tuple[str, ...] = ("update", "state_format", "compensation_format", "seed")
COMPRESSIONS: tuple[str, ...] = ("none", "adacomp")
BASELINES: tuple[str, ...] = ("fp32", "fp16", "bf16", "fp8", "mpt", "hfp8", "wang_fp8")
# Optuna samplers a search can use (precsearch.samplers): multivariate TPE, NSGA-II, random, Gaussian process.
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
