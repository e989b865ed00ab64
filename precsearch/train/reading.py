"""A reading of a model: its validation accuracy in eval mode with batch norm's statistics recomputed from the
current weights (precise BN), beside the accuracy with each validation batch's own statistics.

Why: eval mode normalizes with the running averages training left, and under a low-precision policy those can
describe no model at all. On the demo's task under wang_fp8 the stem conv's output is held in e5m2 (two
mantissa bits) on a large constant level; the rounding breaks batch norm's scale invariance, the stem's weights
grow without a skipped step or an overflow (|w| 0.3 to 567 in 200 steps), and the batch variance of the coarse
codes swings tenfold from step to step, so a momentum average of the last few batches misstates it by orders of
magnitude and eval mode reads one class while the weights classify 96% (benchmarks/results/bn_statistics.md).
Recomputing the statistics over a fixed set of training images (Wu and Johnson's precise BN, with
``torch.optim.swa_utils.update_bn``) gives statistics of the weights being read. The batch-statistics
accuracy is the check: a reading that differs from it by more than the allowed drop is flagged by the search.
"""

from __future__ import annotations

import contextlib
import itertools
import math
from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch.optim.swa_utils import update_bn
from torch.utils.data import Dataset

from precsearch.errors import PrecsearchError
from precsearch.runtime.norm_statistics import batch_norms
from precsearch.train.data import make_loader

__all__ = ["Reading", "batch_norms", "evaluate", "flagged", "read_model", "recompute_bn_statistics"]


@dataclass(frozen=True)
class Reading:
    """Validation accuracy and mean cross-entropy in eval mode, and the accuracy with batch statistics (the same
    as ``accuracy`` for a model without batch norm). Accuracies are fractions in [0, 1]."""

    accuracy: float
    loss: float
    batch_stats_accuracy: float

    @property
    def gap(self) -> float:
        """How far the eval-mode reading is from the batch-statistics one (0 without batch norm)."""
        return abs(self.accuracy - self.batch_stats_accuracy)


def flagged(accuracy: float, batch_stats_accuracy: float | None, drop: float) -> bool:
    """Whether a reading is one the statistics may decide rather than the weights: its eval-mode accuracy and
    the batch-statistics accuracy of the same weights differ by more than the allowed ``drop`` (the tables'
    ``reading_flagged``). A reading without a batch-statistics accuracy (NaN or None) is not flagged."""
    if batch_stats_accuracy is None or math.isnan(batch_stats_accuracy) or math.isnan(accuracy):
        return False
    return abs(accuracy - batch_stats_accuracy) > drop


def recompute_bn_statistics(model: nn.Module, train_set: Dataset, device: torch.device, images: int,
                            batch_size: int, seed: int) -> None:
    """Batch norm's running statistics recomputed as equal-weight averages over the first ``images`` training
    images (rounded up to whole batches of ``batch_size``: a reading's evaluation batch, so that a per-tensor scale
    rounds them as it rounds the evaluation's) of an order seeded by ``seed``, unaugmented, in a forward without
    gradients: no rounding is counted and no training step is taken. ``images`` 0 keeps the running averages."""
    if images <= 0 or not batch_norms(model):
        return
    loader = make_loader(train_set, batch_size, shuffle=True, seed=seed)
    with torch.no_grad():
        update_bn(itertools.islice(loader, math.ceil(images / batch_size)), model, device)


@contextlib.contextmanager
def _batch_statistics(model: nn.Module) -> Iterator[None]:
    """Batch norms normalize with each batch's statistics (train mode) and their buffers come back unchanged."""
    norms = batch_norms(model)
    saved = [(norm, {name: buffer.clone() for name, buffer in norm.named_buffers(recurse=False)}) for norm in norms]
    for norm in norms:
        norm.train()
    try:
        yield
    finally:
        for norm, buffers in saved:
            norm.eval()
            for name, buffer in buffers.items():
                getattr(norm, name).copy_(buffer)


def evaluate(model: nn.Module, dataset: Dataset, device: torch.device, batch_size: int = 512,
             batch_stats: bool = False) -> tuple[float, float]:
    """(accuracy, mean cross-entropy) on ``dataset`` in eval mode (``batch_stats``: batch norms normalize with
    each batch's own statistics, their buffers untouched); NaN loss if the model emits non-finite logits."""
    was_training = model.training
    model.eval()
    correct, total, loss_sum = 0, 0, 0.0
    modes = _batch_statistics(model) if batch_stats else contextlib.nullcontext()
    with torch.no_grad(), modes:
        for images, labels in make_loader(dataset, batch_size, shuffle=False):
            images, labels = images.to(device), labels.to(device)
            logits = model(images)
            loss_sum += float(F.cross_entropy(logits, labels, reduction="sum"))
            correct += int((logits.argmax(dim=1) == labels).sum())
            total += len(labels)
    model.train(was_training)
    if total == 0:
        raise PrecsearchError("the validation set is empty; give a dataset with validation images")
    return correct / total, loss_sum / total


def read_model(model: nn.Module, data: tuple[Dataset, Dataset], device: torch.device, *, bn_images: int,
               eval_batch_size: int, seed: int) -> Reading:
    """A ``Reading`` of ``model`` on ``data`` (train, validation): statistics recomputed from ``bn_images``
    training images (``recompute_bn_statistics``; 0: the running averages as training left them), then the
    eval-mode and the batch-statistics accuracies, all in batches of ``eval_batch_size``."""
    train_set, val_set = data
    was_training = model.training
    recompute_bn_statistics(model, train_set, device, bn_images, eval_batch_size, seed)
    model.train(was_training)
    accuracy, loss = evaluate(model, val_set, device, eval_batch_size)
    batch_accuracy = (evaluate(model, val_set, device, eval_batch_size, batch_stats=True)[0]
                      if batch_norms(model) else accuracy)
    return Reading(accuracy, loss, batch_accuracy)
