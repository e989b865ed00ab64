"""The pick's step peak, measured once: the memory a user's device will show, beside plain fp32 and torch.autocast.

The search prices assignments with the cost model; what a user runs out of is the peak of a training step. So
once the pick is known, one SGD-momentum step of it is measured at the proxy's batch on the search's device
(``precsearch.cost.measured.measure_peak``), as are plain fp32 and ``torch.autocast(bfloat16)`` of the same model
and batch: best.json records the three and the prediction. On a CPU, where the cost model names sliced backwards
to run finer at the pick's peak, the pick's step with them (``precsearch train --finer-slices``) is measured too.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from typing import Any

import torch

from precsearch.config.policy import Policy
from precsearch.cost.measured import measure_peak, sgd_step
from precsearch.runtime.model import apply_policy
from precsearch.train.trainer import build_model, resolve_device, seeded

__all__ = ["MIB", "PICK_PEAK", "StepPeaks", "measure_step_peaks"]

PICK_PEAK = "pick_peak"  # the study user attr: the pick's key and its ``StepPeaks``
MIB = 2**20


@dataclass(frozen=True)
class StepPeaks:
    """Bytes above what is live before one training step (parameters, momentum, the batch): the policy's
    predicted and measured peak, plain fp32's and torch.autocast(bfloat16)'s, at ``batch`` on ``device``; and the
    policy's with finer slices (``finer_*``: None where no layer slices finer, or off a CPU)."""

    predicted: int
    measured: int
    plain_fp32: int
    autocast_bf16: int
    batch: int
    device: str
    finer_predicted: int | None = None
    finer_measured: int | None = None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def describe(self) -> str:
        """One line for a summary."""
        line = (f"step peak {self.measured / MIB:.2f} MiB measured (predicted {self.predicted / MIB:.2f}) at batch "
                f"{self.batch} on {self.device}: {self.measured / self.plain_fp32:.3f}x plain fp32 "
                f"({self.plain_fp32 / MIB:.2f} MiB), {self.measured / self.autocast_bf16:.3f}x "
                f"torch.autocast(bf16) ({self.autocast_bf16 / MIB:.2f} MiB)")
        if self.finer_measured is None or self.finer_predicted is None:
            return line
        return (f"{line}; with train --finer-slices {self.finer_measured / MIB:.2f} MiB (predicted "
                f"{self.finer_predicted / MIB:.2f}), {self.finer_measured / self.autocast_bf16:.3f}x "
                "torch.autocast(bf16), for a slower step")


def measure_step_peaks(model_spec: str, policy: Policy, images: torch.Tensor, labels: torch.Tensor, num_classes: int,
                       predicted: int, device: str = "auto", seed: int = 0,
                       finer: tuple[Mapping[str, int], int] | None = None) -> StepPeaks:
    """``StepPeaks`` of ``policy`` on one batch (``images``, ``labels``): each step measured runs two steps first
    (the momentum buffers made). ``finer``: the slices ``CostModel.finer_slices`` names and the peak it predicts
    with them, measured on a CPU."""
    torch_device = resolve_device(device)
    with seeded(seed, torch_device):
        plain = build_model(model_spec, num_classes, images[:2]).to(torch_device)
    images, labels = images.to(torch_device), labels.to(torch_device)

    def peak(model: torch.nn.Module, autocast: torch.dtype | None = None) -> int:
        optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9, weight_decay=5e-4)
        if hasattr(model, "wrap_optimizer"):
            optimizer = model.wrap_optimizer(optimizer)
        return measure_peak(sgd_step(model, optimizer, images, labels, autocast=autocast, warmup=2), torch_device)

    # the loss scaler's growth per epoch needs some epoch: one step's memory does not depend on its length
    wrapped = apply_policy(copy.deepcopy(plain), policy, images[:2], steps_per_epoch=1)
    finer_peaks: tuple[int | None, int | None] = (None, None)
    if finer is not None and torch_device.type == "cpu":
        sliced = apply_policy(copy.deepcopy(plain), policy, images[:2], steps_per_epoch=1, slices=finer[0])
        finer_peaks = (int(finer[1]), peak(sliced))
    return StepPeaks(predicted=int(predicted), measured=peak(wrapped), plain_fp32=peak(copy.deepcopy(plain)),
                     autocast_bf16=peak(copy.deepcopy(plain), torch.bfloat16), batch=int(images.shape[0]),
                     device=str(torch_device), finer_predicted=finer_peaks[0], finer_measured=finer_peaks[1])
