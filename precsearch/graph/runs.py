"""Running a model for tracing: training mode that leaves no trace, the small shape runs, errors a forward
raises as one line, and the linear extrapolation of shapes from the example batch to the training batch."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn

from precsearch.errors import PrecsearchError, described, raised_at
from precsearch.graph.raw_ops import tensors_in


@contextmanager
def training_mode(model: nn.Module) -> Iterator[None]:
    """Put `model` in training mode; afterwards restore its modules' modes, its buffers (BN running stats)
    and torch's global RNG state, so tracing or measuring leaves no trace."""
    modes = [(module, module.training) for module in model.modules()]
    buffers = [(buffer, buffer.detach().clone()) for buffer in model.buffers()]
    rng = torch.random.get_rng_state()
    model.train()
    try:
        yield
    finally:
        with torch.no_grad():
            for buffer, saved in buffers:
                buffer.copy_(saved)
        for module, mode in modes:
            module.training = mode
        torch.random.set_rng_state(rng)


@contextmanager
def shape_runs() -> Iterator[None]:
    """No gradients and one intra-op thread: the tiny shape-run batches gain nothing from more threads, and on a
    busy 2-core machine OpenMP's spinning made a batch-2 ResNet-18 forward 20x slower with 2 threads than 1."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with torch.no_grad():
            yield
    finally:
        torch.set_num_threads(threads)


def _expected_input(model: nn.Module, given: tuple[int, ...]) -> str:
    """'; its first layer ... expects ...' when the first conv/linear layer cannot take the given shape, else ''."""
    for qualname, module in model.named_modules():
        if isinstance(module, nn.modules.conv._ConvNd):
            spatial = len(module.kernel_size)
            expected = "(N, " + ", ".join([str(module.in_channels), *"DHW"[3 - spatial:]]) + ")"
            if len(given) != spatial + 2 or given[1] != module.in_channels:
                return f"; its first layer {qualname} ({type(module).__name__}) expects {expected}"
            return ""
        if isinstance(module, nn.Linear):
            if not given or given[-1] != module.in_features:
                return f"; its first layer {qualname} (Linear) expects (N, ..., {module.in_features})"
            return ""
    return ""


def forward_error(name: str, model: nn.Module, x: torch.Tensor, error: BaseException,
                  fx_error: BaseException | None = None) -> PrecsearchError:
    """One line for a forward that raised: the input shape, the error and the line it came from, the first
    layer's expected input. Raised ``from error``, so the CLI's -v prints the traceback."""
    given = tuple(x.shape)
    message = (f"{name} failed on the example input of shape {given} ({described(error)}{raised_at(error)})"
               f"{_expected_input(model, given)}")
    if fx_error is not None:
        message += f"; torch.fx could not trace it either ({described(fx_error)})"
    return PrecsearchError(message.replace("\n", " "))


def extrapolate(shape0: tuple[int, ...] | None, shape1: tuple[int, ...] | None, b0: int, target: int,
                 op: str) -> tuple[int, ...] | None:
    """Shape at batch `target` from shapes at b0 and b0 + 1, assuming each dimension is linear in the batch."""
    if shape0 is None and shape1 is None:
        return None
    if shape0 is not None and shape1 is not None and len(shape0) == len(shape1):
        result = tuple(d0 + (target - b0) * (d1 - d0) for d0, d1 in zip(shape0, shape1, strict=True))
        if all(d >= 0 for d in result):
            return result
    raise PrecsearchError(f"op {op} changes shape irregularly with the batch size, so shapes at the training "
                          "batch cannot be inferred; pass an example input at the training batch size")


def record_runs(make_recorder: Callable[[], Any], name: str, model: nn.Module, x: torch.Tensor, grow: bool,
                fx_error: BaseException | None) -> list[Any]:
    """Run a fresh recorder on the example, and if `grow` on the example plus one more sample (its first: the second
    point of the shape extrapolation); the recorders, in that order."""
    recorders = []
    for sample in (x, torch.cat([x, x[:1]])) if grow else (x,):
        recorder = make_recorder()
        try:
            output = recorder.run(sample)
        except Exception as error:  # whatever the model raises becomes one clear line
            raise forward_error(name, model, sample, error, fx_error) from error
        if not any(t.is_floating_point() for t in tensors_in(output)):
            raise PrecsearchError(f"{name} returns {type(output).__name__}, not a float tensor; trace needs a model "
                                  "whose forward returns a tensor (or a tuple of tensors)")
        recorders.append(recorder)
    return recorders


def extrapolate_save(item: list[Any], b0: int, target: int, op: str) -> list[Any]:
    """A ``precsearch.graph.fx_trace.grow_saves`` item at the training batch: a new storage's numel
    extrapolated like a shape."""
    if item[0] != "new":
        return item
    kind, (numel0, numel1), itemsize = item
    return [kind, extrapolate((numel0,), (numel1,), b0, target, op)[0], itemsize]
