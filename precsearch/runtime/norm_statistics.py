"""Batch norm's running statistics put back when the loss scaler skips a step.

A skipped step changes no weight, so it should change no statistic: but the forward that overflowed has already
folded its batch into batch norm's running averages (torch.amp's GradScaler leaves them so), and a forward that
saturated a low format folds in values at the format's largest magnitude. ``keep_running_statistics`` copies the
buffers as each training forward starts (a few small tensors: the state's ``on_training_forward``) and copies them
back from the scaler's ``on_skip``.
"""

from __future__ import annotations

import torch
from torch import nn

from precsearch.runtime.scaling import LossScaler
from precsearch.runtime.state import TensorState

__all__ = ["RunningStatistics", "batch_norms", "keep_running_statistics"]


def batch_norms(model: nn.Module) -> list[nn.modules.batchnorm._BatchNorm]:
    """The batch norms of ``model`` that keep running statistics."""
    return [module for module in model.modules()
            if isinstance(module, nn.modules.batchnorm._BatchNorm) and module.track_running_stats]


class RunningStatistics:
    """The running statistics of ``model``'s batch norms as they stood at the last ``save``."""

    def __init__(self, model: nn.Module) -> None:
        self._norms = batch_norms(model)
        self._saved: list[torch.Tensor] = []

    def _buffers(self) -> list[torch.Tensor]:  # read each time: ``model.to(device)`` replaces them
        return [buffer for norm in self._norms for buffer in (norm.running_mean, norm.running_var,
                                                               norm.num_batches_tracked) if buffer is not None]

    def save(self) -> None:
        buffers = self._buffers()
        if [b.device for b in self._saved] != [b.device for b in buffers]:
            self._saved = [buffer.clone() for buffer in buffers]
        elif buffers:
            torch._foreach_copy_(self._saved, buffers)

    def restore(self) -> None:
        if self._saved:
            torch._foreach_copy_(self._buffers(), self._saved)


def keep_running_statistics(model: nn.Module, scaler: LossScaler, state: TensorState) -> RunningStatistics:
    """``model``'s batch norm statistics saved as each training forward starts and put back when ``scaler``
    skips the step."""
    statistics = RunningStatistics(model)
    state.on_training_forward.append(statistics.save)
    scaler.on_skip.append(statistics.restore)
    return statistics
