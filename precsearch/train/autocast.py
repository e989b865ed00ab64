"""Training under torch's own ``torch.autocast``: the yardstick a policy's memory is held against (issue 67).

fp32 parameters and optimizer, the forward and the loss under ``torch.autocast(device, dtype)``, and for float16
a ``torch.amp.GradScaler`` (bfloat16 has float32's range and needs none); no precsearch runtime, nothing emulated:
what a user gets from torch alone. ``train(..., autocast=dtype)`` (precsearch.train.trainer) trains so; the
``baselines`` command's ``autocast_bf16`` and ``autocast_fp16`` rows (``AUTOCAST_DTYPES``) are such runs.
"""

from __future__ import annotations

import contextlib
from collections.abc import Mapping
from typing import Any

import torch

from precsearch.config.spec import TORCH_BASELINES
from precsearch.runtime.scaling import NoLossScaler

__all__ = ["AUTOCAST_DTYPES", "CountingGradScaler", "autocast_scaler", "autocasting"]

AUTOCAST_DTYPES: dict[str, torch.dtype] = dict(zip(TORCH_BASELINES, (torch.bfloat16, torch.float16), strict=True))


def autocasting(device: torch.device, dtype: torch.dtype | None) -> contextlib.AbstractContextManager[Any]:
    """``torch.autocast(device.type, dtype)``, or nothing when ``dtype`` is None (plain fp32)."""
    return contextlib.nullcontext() if dtype is None else torch.autocast(device.type, dtype=dtype)


class CountingGradScaler(torch.amp.GradScaler):
    """``torch.amp.GradScaler`` that counts the steps it skipped, which the trainer's divergence test and result
    read (``skipped_steps``, as precsearch's own scalers have it). A step was skipped exactly when ``update`` lowered
    the scale: an inf or NaN gradient backs it off, and nothing else lowers it."""

    def __init__(self, device: str) -> None:
        super().__init__(device)
        self.skipped_steps = 0

    def update(self, new_scale: float | torch.Tensor | None = None) -> None:
        before = self.get_scale()
        super().update(new_scale)
        self.skipped_steps += int(self.get_scale() < before)

    def state_dict(self) -> dict[str, Any]:
        return {**super().state_dict(), "skipped_steps": self.skipped_steps}

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        super().load_state_dict(dict(state_dict))
        self.skipped_steps = int(state_dict["skipped_steps"])


def autocast_scaler(dtype: torch.dtype | None, device: torch.device) -> CountingGradScaler | NoLossScaler:
    """The loss scaler a plain run under ``torch.autocast(dtype)`` trains with: GradScaler for float16, else none."""
    return CountingGradScaler(device.type) if dtype == torch.float16 else NoLossScaler()
