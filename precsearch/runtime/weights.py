"""Weights without fp32 masters (``master_weights=False``): their first rounding, and the optimizers keeping them.

With master weights the parameters stay fp32 and the forward rounds them (precsearch.runtime.rounding); an
optimizer ``update="stochastic"`` then rounds the working copy stochastically (Wang et al.'s stochastic weight
update). Without, the parameters themselves are rounded once here, and ``Optimizers.wrap`` returns a
precsearch.runtime.optim ``LowPrecisionOptimizer`` that keeps them so; a promoted weight moves to the high
format in those optimizers too (``Optimizers.promote``).
"""

from __future__ import annotations

import logging
from typing import Any

import torch
from torch import nn

from precsearch.config.policy import Policy
from precsearch.formats import kernels
from precsearch.runtime.optim import LowPrecisionOptimizer, from_config
from precsearch.runtime.state import Slot, TensorState

__all__ = ["Optimizers", "round_pure_weights"]

log = logging.getLogger(__name__)


def round_pure_weights(weights: dict[str, tuple[nn.Parameter, Slot]], state: TensorState) -> list[str]:
    """Round the parameters (the low-precision weights themselves) once; "id fraction%" of those it clipped.
    This first rounding counts its overflow like any other, so the guard promotes a weight the format cannot
    hold before its values are clipped; values clipped anyway (below the threshold) are reported."""
    with torch.no_grad():
        rounded = {name: state.round(param.detach(), slot)[0] for name, (param, slot) in weights.items()}
        state.flush()  # settles the counts: promotes at step 0
        clipped = []
        for name, (param, slot) in weights.items():
            param.copy_(rounded[name] if not slot.promoted else
                        kernels.quantize(param.detach(), slot.fmt, overflow=slot.overflow_mode))
            if slot.overflowed and not slot.promoted:
                clipped.append(f"{slot.id} {100 * slot.overflowed / slot.counted:.2g}%")
            slot.reset()
    if clipped:
        log.warning("master_weights=False: rounding the starting weights clipped values past their format's "
                    "range in %d tensor(s) (%s)%s", len(clipped), ", ".join(clipped),
                    "" if state.threshold is None else
                    ", each below the promotion threshold; lower it or give these weights a wider format")
    return clipped


class Optimizers:
    """The optimizers the policy's optimizer settings wrap, told about weight promotions."""

    def __init__(self, policy: Policy, weights: dict[str, tuple[nn.Parameter, Slot]],
                 generator: torch.Generator) -> None:
        self.policy, self.weights, self.generator = policy, weights, generator
        self.wrapped: list[LowPrecisionOptimizer] = []

    def wrap(self, optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
        """``optimizer`` itself with fp32 masters and no optimizer settings, else a ``LowPrecisionOptimizer``
        keeping pure low-precision weights (and rounded state)."""
        settings = dict(self.policy.optimizer)
        if self.policy.master_weights:
            if "state_format" not in settings:
                return optimizer
            settings.pop("update", None)  # with masters, the weight update is the forward's rounding
            formats: dict[torch.Tensor, Any] = {}
        else:
            formats = {param: slot.fmt for param, slot in self.weights.values()}
        settings["master_weights"] = self.policy.master_weights
        wrapped = from_config(optimizer, settings, weight_format=formats, generator=self.generator)
        self.wrapped.append(wrapped)
        return wrapped

    def promote(self, slot: Slot) -> None:
        """Pure low-precision weights: the optimizers must now keep the promoted weight in its new format."""
        if slot.kind != "weight":
            return
        params = [param for param, weight_slot in self.weights.values() if weight_slot is slot]
        for optimizer in self.wrapped:
            held = {id(p) for group in optimizer.param_groups for p in group["params"]}
            for param in params:
                if id(param) in held:
                    optimizer.set_format(param, slot.fmt)
