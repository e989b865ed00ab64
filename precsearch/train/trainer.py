"""The trainer: a model from the zoo under a policy, SGD with momentum and weight decay, a cosine schedule,
the loop, and evaluation; full training (``train_policy``) and the search's proxies (precsearch.train.proxy) both
run it.

A run is deterministic: the model init, the batch order and every rounding draw come from ``seed``. It asks
for no process-wide state it does not give back: the global RNGs are seeded inside ``torch.random.fork_rng``
(restored after), and ``deterministic=True`` (the default) turns on torch's deterministic algorithms (and, on CUDA, the
cuBLAS workspace they need) for the run only.

A run watches for divergence (``Divergence``): a non-finite loss, a loss that blew up to ``blowup_factor``
times its first value, a loss scale that collapsed below ``min_loss_scale`` (the scaler had to shrink
gradients below their true size to keep them finite), or more skipped steps than the budget allows. A proxy
stops there; full training records it and goes on.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import logging
import math
import os
import time
import warnings
from collections.abc import Callable, Collection, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import Dataset

from precsearch import models
from precsearch.config.compiling import CompileOptions
from precsearch.config.policy import Policy
from precsearch.config.spec import ProxyConfig
from precsearch.errors import PrecsearchError, run_user_code
from precsearch.files import atomic_write_text
from precsearch.formats.runner import Runtime, default_runtime
from precsearch.runtime.model import ChooseSlices, apply_policy
from precsearch.runtime.scaling import LossScaler, NoLossScaler
from precsearch.stopping import raise_recorded_stop
from precsearch.train.autocast import CountingGradScaler, autocast_scaler, autocasting
from precsearch.train.continuing import (
    CHECKPOINT_EVERY,
    Progress,
    State,
    decay_lr,
    decay_steps,
    read_checkpoint,
    run_tag,
    write_checkpoint,
)
from precsearch.train.data import ImageDataset, make_loader, random_crop_flip
from precsearch.train.reading import Reading, evaluate, read_model

__all__ = ["METRICS_COLUMNS", "PAPER_LR", "PAPER_RECIPE", "Divergence", "ProxyResult", "Recipe", "build_model",
           "check_policy_inputs", "eval_interval", "determinism", "evaluate", "kaiming_fan_out_", "metrics_row",
           "resolve_device", "seeded", "train", "train_policy"]

log = logging.getLogger(__name__)

# Deterministic cuBLAS needs a fixed workspace, set before its first use (torch checks it on every call).
CUBLAS_WORKSPACE = "CUBLAS_WORKSPACE_CONFIG"


@dataclass(frozen=True)
class Recipe:
    """What full training adds to a proxy: the Lee et al. reference recipe (kuangliu's pytorch-cifar), which
    ``precsearch train`` uses for zoo models. A proxy has none of it (``train(..., recipe=None)``).

    ``augment``: random crop with black padding of 1/8 of the image side (4 pixels at 32) and a horizontal
    flip with probability 1/2, per image, seeded (precsearch.train.data.random_crop_flip); ``kaiming_init``:
    convolution weights of zoo models Kaiming-normal with fan-out (ReLU gain); ``epoch_schedule``:
    the cosine learning rate steps once per epoch (T_max = epochs), not per step.
    """

    augment: bool = True
    kaiming_init: bool = True
    epoch_schedule: bool = True


PAPER_RECIPE = Recipe()
PAPER_LR = 0.1  # the reference's peak learning rate (momentum 0.9 and weight decay 5e-4 are ProxyConfig's too)


@dataclass
class ProxyResult:
    """What one proxy measured. Accuracies are fractions in [0, 1]; ``wall_time`` is seconds."""

    val_accuracy: float  # in eval mode, batch norm's statistics recomputed (precsearch.train.reading)
    val_loss: float
    diverged: bool
    reason: str
    steps_run: int
    loss_curve: list[float]
    skipped_steps: int = 0
    final_loss_scale: float | None = None
    promotions: list[str] = field(default_factory=list)
    overflow_max: float = 0.0
    underflow_max: float = 0.0
    underflow_mean: float = 0.0
    wall_time: float = 0.0
    device: str = "cpu"
    val_curve: list[list[float]] = field(default_factory=list)  # [step, validation accuracy] at ``evaluate_at``
    steps_spent: int = 0  # steps trained since the run last returned a result, decay branches included (a run
    # continued from a result counts its own steps only; one continued after an interruption, the interrupted
    # call's too)
    branch_steps: int = 0  # steps the whole run trained in decay branches (a continued run's earlier ones too)
    batch_stats_accuracy: float | None = None  # the final reading with each validation batch's own statistics

    @property
    def val_error(self) -> float:
        return 1.0 - self.val_accuracy

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ProxyResult:
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{key: value for key, value in data.items() if key in names})


def resolve_device(device: str = "auto") -> torch.device:
    """``auto`` is CUDA when available, else the CPU; asking for CUDA without it is a user error."""
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device not in ("cpu", "cuda") and not device.startswith("cuda:"):
        raise PrecsearchError(f"unknown device {device!r}; use auto, cpu or cuda")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise PrecsearchError(f"device {device} asked for, but CUDA is not available here; use --device auto or cpu")
    return torch.device(device)


def check_policy_inputs(policy: Policy | None, train_set: ImageDataset) -> None:
    """The policy was made for the data's sample shape: another image size is a flag away, other channels
    are another dataset."""
    shape = None if policy is None else policy.input_shape
    if shape is None or tuple(shape) == tuple(train_set.image_shape):
        return
    made, data = tuple(shape), tuple(train_set.image_shape)
    if made[0] != data[0]:
        raise PrecsearchError(f"the policy was made for {made[0]}-channel inputs {made}, the data has {data[0]} "
                              f"channels {data}; make a policy for this data (precsearch search --data ...)")
    raise PrecsearchError(f"the policy was made for inputs {made}, the data has {data}; pass --image-size {made[-1]}")


def eval_interval(eval_every: int | None, per_epoch: int) -> int:
    """Steps between evaluations: ``eval_every`` (an integer >= 1), or once per epoch when None."""
    if eval_every is None:
        return per_epoch
    if isinstance(eval_every, bool) or not isinstance(eval_every, int) or eval_every < 1:
        raise PrecsearchError(f"eval_every={eval_every!r} must be a number of steps >= 1 (None: every epoch)")
    return eval_every


def _check_logits(model: nn.Module, model_spec: str, example: torch.Tensor, num_classes: int) -> None:
    """``model`` maps ``example`` to (N, num_classes) logits; run in eval mode without gradients or RNG draws."""
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad(), torch.random.fork_rng(devices=[]):
            output = run_user_code(f"model {model_spec!r} on a batch of the data of shape {tuple(example.shape)}",
                                   lambda: model(example))
    finally:
        model.train(was_training)
    wanted = (example.shape[0], num_classes)
    if not isinstance(output, torch.Tensor) or tuple(output.shape) != wanted:
        given = tuple(output.shape) if isinstance(output, torch.Tensor) else type(output).__name__
        raise PrecsearchError(f"model {model_spec!r} outputs {given} for a batch of the data of shape "
                              f"{tuple(example.shape)}, but the data has {num_classes} classes; make it return "
                              f"(N, {num_classes}) logits")


def build_model(model_spec: str, num_classes: int, example: torch.Tensor | None = None) -> nn.Module:
    """A zoo model sized for the dataset's classes (a spec that names other classes is refused, naming both); a
    user factory is called with its own options only, and with ``example`` (a few samples of the data) its
    output is checked to be one logit per class, before any training step could die of it."""
    name, options = models.parse_model_spec(model_spec)
    if ":" in name:
        model = models.build(model_spec)
        if example is not None:
            _check_logits(model, model_spec, example, num_classes)
        return model
    given = options.get("num_classes")
    if isinstance(given, int | float) and not isinstance(given, bool) and given != num_classes:
        raise PrecsearchError(f"model {model_spec!r} asks for num_classes={given:g}, but the data has {num_classes} "
                              f"classes; drop the option (the data sets it) or give data with {given:g} classes")
    return models.build(model_spec, num_classes=num_classes)


@contextlib.contextmanager
def determinism(device: torch.device) -> Iterator[None]:
    """torch.use_deterministic_algorithms (warn-only: some ops have no such kernel) and, on CUDA, the cuBLAS
    workspace it needs, for the block only: the previous settings (and environment) come back after."""
    before = torch.are_deterministic_algorithms_enabled()
    before_warn = torch.is_deterministic_algorithms_warn_only_enabled()
    workspace = os.environ.get(CUBLAS_WORKSPACE)
    if device.type == "cuda" and workspace is None:
        os.environ[CUBLAS_WORKSPACE] = ":4096:8"
    torch.use_deterministic_algorithms(True, warn_only=True)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(before, warn_only=before_warn)
        if workspace is None:
            os.environ.pop(CUBLAS_WORKSPACE, None)


@contextlib.contextmanager
def seeded(seed: int, device: torch.device) -> Iterator[None]:
    """The global generators a run draws from (the CPU's: model init; the training GPU's: dropout) seeded
    with ``seed`` for the block, as ``torch.manual_seed`` would, and restored after."""
    gpus = [device.index if device.index is not None else torch.cuda.current_device()] if device.type == "cuda" else []
    with torch.random.fork_rng(devices=gpus):
        torch.default_generator.manual_seed(seed)
        for index in gpus:
            torch.cuda.default_generators[index].manual_seed(seed)
        yield


def kaiming_fan_out_(model: nn.Module) -> None:
    """Convolution weights Kaiming-normal with fan-out (the reference recipe's init); their biases zero."""
    for module in model.modules():
        if isinstance(module, nn.Conv2d):
            nn.init.kaiming_normal_(module.weight, mode="fan_out", nonlinearity="relu")
            if module.bias is not None:
                nn.init.zeros_(module.bias)


def _batches(dataset: Dataset, batch_size: int, seed: int, start: int = 0
             ) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """Endless seeded epochs from the batch after step ``start``; epoch k reshuffles with seed + k so the order
    never depends on global RNG (nor on where a run continues)."""
    per_epoch = len(dataset) // batch_size
    epoch, skip = divmod(start, per_epoch)
    while True:
        loader = make_loader(dataset, batch_size, shuffle=True, seed=seed + epoch, drop_last=True)
        yield from itertools.islice(loader, skip, None)
        epoch, skip = epoch + 1, 0


def _stat_summary(stats: Any) -> tuple[float, float, float]:
    """(max overflow, max underflow, mean underflow) over the runtime's per-tensor statistics."""
    rows = list(stats.values()) if isinstance(stats, dict) else []
    if not rows:
        return 0.0, 0.0, 0.0
    overflow = [float(row.get("overflow", 0.0)) for row in rows]
    underflow = [float(row.get("underflow", 0.0)) for row in rows]
    return max(overflow), max(underflow), sum(underflow) / len(underflow)


class Divergence:
    """Tests each step's loss and scaler against the divergence rules of a ``ProxyConfig``."""

    def __init__(self, config: ProxyConfig, first_loss: float | None = None) -> None:
        self.config = config
        self.first_loss = first_loss

    def check(self, step: int, loss: float, scaler: LossScaler) -> str:
        if not math.isfinite(loss):
            return f"non-finite loss at step {step}"
        if self.first_loss is None:
            self.first_loss = loss
        if loss > self.config.blowup_factor * max(self.first_loss, 1e-3):
            return (f"loss blew up at step {step}: {loss:.3g} > {self.config.blowup_factor:g}x the first loss "
                    f"{self.first_loss:.3g}")
        scale = float(scaler.get_scale())
        if not isinstance(scaler, NoLossScaler) and scale < self.config.min_loss_scale:
            return f"loss scale collapsed to {scale:.3g} (< {self.config.min_loss_scale:g}) at step {step}"
        skipped = scaler.skipped_steps
        allowed = max(20, math.ceil(self.config.max_skipped_fraction * step))  # by this step: no run length needed
        if skipped > allowed:
            return f"{skipped} skipped steps by step {step} (more than {allowed})"
        return ""


Report = Callable[[int, float], None]
Evaluate = Callable[[int, Reading], None]


def train(model_spec: str, policy: Policy | None, data: tuple[ImageDataset, ImageDataset], steps: int, seed: int = 0,
          device: str = "auto", config: ProxyConfig | None = None, *, stop_on_divergence: bool = True,
          report: Report | None = None, eval_every: int | None = None, on_eval: Evaluate | None = None,
          evaluate_at: Collection[int] = (), recipe: Recipe | None = None, deterministic: bool = True,
          compile: CompileOptions | None = None, runtime: Runtime | None = None,
          on_start: Callable[[], None] | None = None, continuing: bool = False, checkpoint: Path | None = None,
          decay_from: int | None = None, autocast: torch.dtype | None = None,
          slices: ChooseSlices | None = None) -> ProxyResult:
    """Train ``model_spec`` under ``policy`` (None: plain fp32, no wrapper and no loss scaling) for ``steps``
    SGD steps and evaluate on the validation split. ``autocast`` (with no policy): the plain model's forward,
    loss and readings under ``torch.autocast(dtype)``, float16 through a GradScaler (precsearch.train.autocast).

    ``recipe`` adds full training's augmentation, init and per-epoch schedule (see ``Recipe``); a proxy
    has none. The loss scaler learns the steps per epoch (a ``growth_interval`` of ``"epoch"``).

    ``report(step, loss)`` is called every ``config.report_every`` steps with the running mean loss (the
    search passes Optuna's pruning hook; whatever it raises propagates). ``on_eval(step, reading)`` gets a
    validation reading every ``eval_every`` steps (full training's metrics) and at each step of ``evaluate_at``
    (the search's rungs; those accuracies are the result's ``val_curve``, and whatever ``on_eval`` raises there
    propagates). ``stop_on_divergence=False`` keeps training after a divergence and records it all the same.
    ``deterministic`` runs it under ``determinism`` (the search relies on a seed giving the same numbers).
    ``compile`` trains with the compiled step (precsearch.runtime.compiled; None: eagerly); ``runtime`` (default:
    ``default_runtime()``) holds its compiled graphs and is the default runtime for the call; ``slices`` (with a
    policy) chooses its sliced backwards' slices (``apply_policy``'s: e.g. ``precsearch.cost.model.finer_slices``).
    The result's ``wall_time`` counts from when the model is built (a user factory's own time is not training
    time); ``on_start()`` is called then.

    ``continuing`` trains at a constant rate and reads every evaluation off a short decay branch, so that the
    run's result at any step is that of a run of that length (precsearch.train.continuing); ``checkpoint``
    (continuing only) is where its state is kept at each evaluation and continued from. ``decay_from`` (continuing
    only) ends the run in one long decay instead: the rate falls along a cosine from that step to ``steps``, and
    the result is read at the end as it is (confirmation: a checkpoint at ``decay_from`` is a reading's state).
    """
    config = config or ProxyConfig()
    _check_request(policy, data[0], steps, config, continuing, checkpoint, decay_from, autocast, slices)
    torch_device = resolve_device(device)
    checked = determinism(torch_device) if deterministic else contextlib.nullcontext()
    runtime = runtime or default_runtime()
    with runtime.as_default(), checked, seeded(seed, torch_device):
        run = _TrainingRun(model_spec, policy, data, steps, seed, torch_device, config, recipe=recipe, compile=compile,
                           runtime=runtime, on_start=on_start, continuing=continuing, checkpoint=checkpoint,
                           decay_from=decay_from, autocast=autocast, evaluate_at=evaluate_at, slices=slices)
        run.loop(stop_on_divergence, report, eval_every, on_eval)
        reading = run.evaluate(run.steps_run, final=True, on_eval=on_eval)
    return run.result(reading)


def _check_request(policy: Policy | None, train_set: ImageDataset, steps: int, config: ProxyConfig, continuing: bool,
                   checkpoint: Path | None, decay_from: int | None, autocast: torch.dtype | None,
                   slices: ChooseSlices | None) -> None:
    """``train``'s arguments agree with each other and with the data, before anything is built."""
    if policy is not None and autocast is not None:
        raise ValueError("train under a policy or under torch.autocast, not both")
    if slices is not None and policy is None:
        raise ValueError("slices choose a policy's sliced backwards: train under a policy")
    if checkpoint is not None and not continuing:
        raise ValueError("a checkpoint continues only a continuing run (a cosine schedule spans its own length)")
    if decay_from is not None and not (continuing and 0 <= decay_from < steps):
        raise ValueError(f"decay_from={decay_from} needs a continuing run and a step before steps={steps}")
    if steps < 1:
        raise PrecsearchError(f"steps={steps} must be at least 1")
    if len(train_set) < config.batch_size:
        raise PrecsearchError(f"the training set has {len(train_set)} images, fewer than the batch size "
                              f"{config.batch_size}; lower the batch size or give more data")


class _TrainingRun:
    """One call of ``train``, set up inside its seeded block: the model under its policy, its optimizer, schedule
    and loss scaler, where the run stands (``Progress``, continued from ``checkpoint`` when it holds one) and the
    steps this call spent; ``loop`` trains, ``evaluate`` reads, ``result`` sums it up."""

    def __init__(self, model_spec: str, policy: Policy | None, data: tuple[ImageDataset, ImageDataset], steps: int,
                 seed: int, device: torch.device, config: ProxyConfig, *, recipe: Recipe | None,
                 compile: CompileOptions | None, runtime: Runtime, on_start: Callable[[], None] | None,
                 continuing: bool, checkpoint: Path | None, decay_from: int | None, autocast: torch.dtype | None,
                 evaluate_at: Collection[int], slices: ChooseSlices | None) -> None:
        self.policy, self.data, self.train_set, self.steps, self.seed = policy, data, data[0], steps, seed
        self.device, self.config, self.autocast = device, config, autocast
        self.continuing, self.checkpoint = continuing, checkpoint
        self.decay = None if decay_from is None else [decay_from, steps]
        self.model = build_model(model_spec, self.train_set.num_classes, self.train_set.images[:2]).to(device)
        if recipe is not None and recipe.kaiming_init and ":" not in models.parse_model_spec(model_spec)[0]:
            kaiming_fan_out_(self.model)  # zoo models only: a user's factory keeps its own init
        self.start = time.perf_counter()
        if on_start is not None:
            on_start()
        self.per_epoch = len(self.train_set) // config.batch_size
        if policy is not None:  # traced on real images, as the search traced it: a branch zeros skip is kept
            self.model = apply_policy(self.model, policy, self.train_set.images[:2].to(device), seed=seed,
                                      stats_every=config.stats_every, steps_per_epoch=self.per_epoch,
                                      compile=compile or False, runtime=runtime, slices=slices)
        self.model.train()
        self._set_up_optimizer(recipe)
        self._continue_from_checkpoint()
        self.rungs = {step for step in evaluate_at if 1 <= step <= steps}
        self.monitor = Divergence(config, self.progress.first_loss)
        self.window: list[float] = []  # losses since the last report

    def _set_up_optimizer(self, recipe: Recipe | None) -> None:
        """SGD (wrapped by the policy's model), the cosine schedule (none when continuing), the augmentation's
        generator and the loss scaler."""
        config = self.config
        self.sgd = torch.optim.SGD(self.model.parameters(), lr=config.lr, momentum=config.momentum,
                                   weight_decay=config.weight_decay)
        self.optimizer = self.model.wrap_optimizer(self.sgd) if self.policy is not None else self.sgd
        self.epoch_schedule = recipe is not None and recipe.epoch_schedule
        self.schedule = None if self.continuing else torch.optim.lr_scheduler.CosineAnnealingLR(
            self.sgd, T_max=math.ceil(self.steps / self.per_epoch) if self.epoch_schedule else self.steps)
        self.augment = torch.Generator().manual_seed(self.seed + 1) if recipe is not None and recipe.augment else None
        self.scaler = self.model.scaler if self.policy is not None else autocast_scaler(self.autocast, self.device)
        # not in the model's state_dict
        self.own_scaler = self.scaler if isinstance(self.scaler, CountingGradScaler) else None

    def _continue_from_checkpoint(self) -> None:
        """Where the run stands: the checkpoint's state and progress when it holds this run's, else the start."""
        self.tag = run_tag(self.policy, self.seed, self.autocast)
        saved = (read_checkpoint(self.checkpoint, self.tag, self.steps, self.decay)
                 if self.checkpoint is not None else None)
        self.progress = Progress()
        if saved is not None:
            saved[0].restore(self.model, self.optimizer, self.device, self.own_scaler)
            self.progress = saved[1]
        self.earlier_calls = self.progress.elapsed  # seconds the calls before this one trained
        self.spent = self.progress.unreported

    @property
    def steps_run(self) -> int:
        return len(self.progress.losses)

    def elapsed(self) -> float:
        """Seconds trained, this call's and the earlier calls' of a continued run."""
        return self.earlier_calls + time.perf_counter() - self.start

    def _capture(self) -> State:
        return State.capture(self.model, self.optimizer, self.device, self.own_scaler)

    def _set_lr(self, lr: float) -> None:
        for group in self.sgd.param_groups:
            group["lr"] = lr

    def sgd_step(self, images: torch.Tensor, labels: torch.Tensor) -> float:
        raise_recorded_stop()  # a stop recorded inside Optuna's frames ends the run here, branch steps included
        if self.augment is not None:
            images = random_crop_flip(images, self.train_set.mean, self.train_set.std, self.augment)
        images, labels = images.to(self.device), labels.to(self.device)
        self.optimizer.zero_grad(set_to_none=True)
        with autocasting(self.device, self.autocast):
            loss = F.cross_entropy(self.model(images), labels)
        self.scaler.scale(loss).backward()
        self.scaler.step(self.optimizer)
        self.scaler.update()
        return float(loss.detach())

    def loop(self, stop_on_divergence: bool, report: Report | None, eval_every: int | None,
             on_eval: Evaluate | None) -> None:
        """Train to ``steps``, or to a divergence where it stops the run, with the reports, the evaluations and
        the checkpoints between; the last step's evaluation is the caller's."""
        progress, config = self.progress, self.config
        batches = _batches(self.train_set, config.batch_size, self.seed, start=progress.step)
        while progress.step < self.steps and not (progress.reason and stop_on_divergence):
            step = progress.step = progress.step + 1
            if self.decay is not None and step > self.decay[0]:
                progress.decay = self.decay
                self._set_lr(decay_lr(config.lr, step - 1 - self.decay[0], self.decay[1] - self.decay[0]))
            value = self.sgd_step(*next(batches))
            self.spent += 1
            if self.schedule is not None and (not self.epoch_schedule or step % self.per_epoch == 0):
                with warnings.catch_warnings():  # a step the loss scaler skipped is no misordered scheduler
                    warnings.filterwarnings("ignore", message=r"Detected call of `lr_scheduler.step\(\)` before")
                    self.schedule.step()
            progress.losses.append(value)
            self.window.append(value)
            progress.reason = progress.reason or self.monitor.check(step, value, self.scaler)
            progress.first_loss = self.monitor.first_loss
            if progress.reason and stop_on_divergence:
                break
            if report is not None and step % config.report_every == 0:
                report(step, sum(self.window) / len(self.window))
                self.window.clear()
            if step == self.steps:
                break
            if step in self.rungs or (eval_every and step % eval_every == 0):
                self.evaluate(step, final=False, on_eval=on_eval)
            elif self.checkpoint is not None and step % CHECKPOINT_EVERY == 0:
                self._save_checkpoint()

    def _save_checkpoint(self) -> None:
        """The state and progress at this step, kept at ``checkpoint`` for a later call to continue from."""
        self.progress.elapsed, self.progress.unreported = self.elapsed(), self.spent
        write_checkpoint(self.checkpoint, self.tag, self._capture(), self.progress)

    def evaluate(self, step: int, final: bool, on_eval: Evaluate | None) -> Reading:
        """The reading at ``step`` (precsearch.train.reading: batch norm's statistics recomputed first), handed to
        ``on_eval``: of the model as it is, or, continuing, off a decay branch (precsearch.train.continuing), the
        state at ``step`` checkpointed and, unless ``final``, restored after it."""
        progress, config = self.progress, self.config
        branched = self.continuing and not progress.reason and not progress.decay  # a run in its decay is read as is
        state = self._capture() if branched else None
        if state is not None:
            length = decay_steps(step)
            branch = itertools.islice(_batches(self.train_set, config.batch_size, self.seed, start=step), length)
            for index, (images, labels) in enumerate(branch):
                self._set_lr(decay_lr(config.lr, index, length))
                self.sgd_step(images, labels)
            self.spent += length
            progress.branch_steps += length
        with autocasting(self.device, self.autocast):
            reading = read_model(self.model, self.data, self.device, bn_images=config.bn_images,
                                 eval_batch_size=config.eval_batch_size, seed=self.seed)
        if step in self.rungs and not (progress.val_curve and progress.val_curve[-1][0] == step):
            progress.val_curve.append([step, reading.accuracy])
        if state is not None:
            progress.elapsed = self.elapsed()
            progress.unreported = 0 if final else self.spent  # a final reading is returned: its result counts them
            if self.checkpoint is not None:
                write_checkpoint(self.checkpoint, self.tag, state, progress)
            if not final:
                state.restore(self.model, self.optimizer, self.device, self.own_scaler)
                self._set_lr(config.lr)
        if on_eval is not None:
            on_eval(step, reading)
        return reading

    def result(self, reading: Reading) -> ProxyResult:
        """The call's result from its final ``reading``, logged."""
        accuracy, val_loss = reading.accuracy, reading.loss
        reason = self.progress.reason
        if not reason and not math.isfinite(val_loss):
            reason = "non-finite validation loss"
        stats = self.model.tensor_stats() if self.policy is not None else {}
        overflow_max, underflow_max, underflow_mean = _stat_summary(stats)
        result = ProxyResult(
            val_accuracy=accuracy, val_loss=val_loss if math.isfinite(val_loss) else float("inf"),
            batch_stats_accuracy=reading.batch_stats_accuracy, diverged=bool(reason), reason=reason,
            steps_run=self.steps_run, loss_curve=self.progress.losses, skipped_steps=self.scaler.skipped_steps,
            final_loss_scale=float(self.scaler.get_scale()),
            promotions=[promotion.id for promotion in self.model.promotions] if self.policy is not None else [],
            overflow_max=overflow_max, underflow_max=underflow_max, underflow_mean=underflow_mean,
            wall_time=self.elapsed(), device=str(self.device), val_curve=self.progress.val_curve,
            steps_spent=self.spent, branch_steps=self.progress.branch_steps)
        log.info("proxy: acc %.4f loss %.4f%s in %.1fs", accuracy, result.val_loss,
                 f" (diverged: {reason})" if reason else "", result.wall_time)
        return result


METRICS_COLUMNS = "step,epoch,train_loss,val_accuracy,val_loss,batch_stats_accuracy,wall_time"


def metrics_row(step: int, per_epoch: int, losses: list[float], reading: Reading, wall_time: float) -> str:
    """One row of a full training's metrics CSV (``METRICS_COLUMNS``): ``losses`` are the training losses since
    the last row, ``reading`` the validation reading at ``step``; logged at INFO too."""
    train_loss = sum(losses) / len(losses) if losses else math.nan
    log.info("step %d: val accuracy %.4f (batch statistics %.4f), val loss %.4f", step, reading.accuracy,
             reading.batch_stats_accuracy, reading.loss)
    return (f"{step},{step / per_epoch:.3f},{train_loss:.8g},{reading.accuracy:.8g},{reading.loss:.8g},"
            f"{reading.batch_stats_accuracy:.8g},{wall_time:.3f}")


def train_policy(model_spec: str, policy: Policy | None, data: tuple[ImageDataset, ImageDataset], steps: int, *,
                 config: ProxyConfig | None = None, eval_every: int | None = None, metrics: str | Path | None = None,
                 recipe: Recipe | None = PAPER_RECIPE, **options: Any) -> ProxyResult:
    """Full training under a policy file (None: plain fp32, the yardstick a pick is held against): checks
    the policy was made for this model (graph fingerprint), trains without stopping at divergence with the
    paper's ``recipe`` (augmentation, Kaiming fan-out init, cosine per epoch; None: a proxy's), and rewrites the
    ``metrics`` CSV after every evaluation (``METRICS_COLUMNS``). ``options`` are ``train``'s (``seed``, ``device``,
    ``deterministic``)."""
    config = config or ProxyConfig()
    train_set = data[0]
    check_policy_inputs(policy, train_set)
    rows: list[str] = [METRICS_COLUMNS]
    losses: list[float] = []
    start = math.nan  # set when the model is built and training starts
    per_epoch = max(1, len(train_set) // config.batch_size)

    def record(step: int, reading: Reading) -> None:
        rows.append(metrics_row(step, per_epoch, losses[-eval_every:], reading, time.perf_counter() - start))
        if metrics is not None:
            atomic_write_text(metrics, "\n".join(rows) + "\n")

    def started() -> None:
        nonlocal start
        start = time.perf_counter()

    eval_every = eval_interval(eval_every, per_epoch)
    return train(model_spec, policy, data, steps, config=dataclasses.replace(config, report_every=1),
                 stop_on_divergence=False, report=lambda step, loss: losses.append(loss), eval_every=eval_every,
                 on_eval=record, recipe=recipe, on_start=started, **options)
