"""Short, seeded proxy training under a policy: the search's measure of whether an assignment trains.

A proxy is the full training recipe scaled down (a few hundred steps on small images) with a schedule whose every
point is a result: a constant rate, read off a short cosine decay branch wherever it is evaluated
(precsearch.train.continuing). It runs through ``runtime.apply_policy``, so its numerics, loss scaling and
promotion guard are the final training's; it is deterministic in ``seed`` (the search relies on that never to
train an assignment twice), and it stops at the first sign of divergence (precsearch.train.trainer.Divergence),
saying why. The trainer itself is precsearch.train.trainer; its names are re-exported here.

The default recipe (``ProxyConfig``) is the paper's (SGD, momentum 0.9, weight decay 5e-4, decaying to zero)
shrunk to 150 steps of batch 64 on 16x16 images, with lr 0.2: a sweep of lr {0.05, 0.1, 0.2} x steps
{100, 150, 200} for ``tiny_cnn`` on digits gave 78-94% validation accuracy at lr 0.05 / 100 steps and
about 98% at lr 0.2 / 150 steps (99% at 200), so the short proxy gets close to converged accuracy, where
differences between assignments mean something.
"""

from __future__ import annotations

from collections.abc import Callable, Collection
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from precsearch.config.compiling import CompileOptions
from precsearch.config.policy import Policy
from precsearch.config.spec import ProxyConfig  # re-exported: a space's proxy section
from precsearch.train.data import ImageDataset
from precsearch.train.reading import Reading
from precsearch.train.trainer import (
    PAPER_LR,
    PAPER_RECIPE,
    ProxyResult,
    Recipe,
    build_model,
    evaluate,
    resolve_device,
    train,
    train_policy,
)

__all__ = ["PAPER_LR", "PAPER_RECIPE", "ProxyConfig", "ProxyResult", "ProxyTrainer", "Recipe", "build_model",
           "evaluate", "resolve_device", "run_proxy", "train", "train_policy", "Trainer"]


def run_proxy(model_spec: str, policy: Policy | None, data: tuple[ImageDataset, ImageDataset], steps: int,
              **options: Any) -> ProxyResult:
    """One proxy: a continuing ``train`` (with its ``seed``, ``device``, ``config``, ``report``, ``checkpoint``,
    ``decay_from``) that stops at the first sign of divergence; what the search calls per trial."""
    return train(model_spec, policy, data, steps, stop_on_divergence=True, continuing=True, **options)


class Trainer(Protocol):
    """What the search trains with: one seeded continuing run of ``policy`` (None: plain fp32) up to ``steps``
    steps (its result there is a run of that length's), evaluated at each step of ``evaluate_at``
    (``on_eval(step, reading)``, a precsearch.train.reading ``Reading``; its exception stops the run) and at
    the end; ``report(step, loss)`` every few steps; ``checkpoint``: where the run keeps its state and
    continues from (a later call for more steps goes on from there); ``decay_from``: the step after which the
    run ends in one long decay (precsearch.train.continuing). Tests inject scripted learning curves through it."""

    def __call__(self, policy: Policy | None, steps: int, seed: int, *, evaluate_at: Collection[int] = (),
                 on_eval: Callable[[int, Reading], None] | None = None,
                 report: Callable[[int, float], None] | None = None,
                 checkpoint: Path | None = None, decay_from: int | None = None) -> ProxyResult: ...


@dataclass(frozen=True)
class ProxyTrainer:
    """The real ``Trainer``: ``run_proxy`` of one model on one data set and device with a space's proxy recipe."""

    model_spec: str
    data: tuple[ImageDataset, ImageDataset]
    device: str
    config: ProxyConfig
    compile: CompileOptions | None = None

    def __call__(self, policy: Policy | None, steps: int, seed: int, *, evaluate_at: Collection[int] = (),
                 on_eval: Callable[[int, Reading], None] | None = None,
                 report: Callable[[int, float], None] | None = None,
                 checkpoint: Path | None = None, decay_from: int | None = None) -> ProxyResult:
        return run_proxy(self.model_spec, policy, self.data, steps, seed=seed, device=self.device,
                         config=self.config, evaluate_at=evaluate_at, on_eval=on_eval, report=report,
                         compile=self.compile, checkpoint=checkpoint, decay_from=decay_from)
