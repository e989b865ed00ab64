"""The rules the runtime takes from outside itself, in one place: the graph's op knowledge and the environment.

Each rule is a field of ``Rules``, a frozen object passed to ``apply_policy`` (default ``RULES``), so that a test,
or a user chasing a difference, switches one memory-saving step off by injecting another rule
(``dataclasses.replace(RULES, sliced_input=lambda layer: None)``) instead of patching a module. This is the
runtime's one import site of op knowledge (what makes a fresh output, where gradients arrive fresh, slice
sizes, which ops return no tensor).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import nn

from precsearch.graph.tracing import (
    OpInfo,
    TensorGraph,
    backward_slice_channels,
    backward_slice_rows,
    gradient_arrives_fresh,
    gradient_passes_from,
    makes_fresh_output,
)
from precsearch.runtime.sliced import packed_input_function, packed_output_function

__all__ = ["RULES", "Rules"]


def _not_distributed() -> bool:
    """No process group is up: DDP's reducer reads ``.grad`` in its own hooks during the backward, so weight
    gradients are held as codes only without one."""
    return not (torch.distributed.is_available() and torch.distributed.is_initialized())


@dataclass(frozen=True)
class Rules:
    """What the runtime asks of op knowledge and of its surroundings."""

    # layout ops whose output is no tensor: no alias module after them
    not_tensors: frozenset[str] = frozenset({"size", "dim", "numel", "stride", "storage_offset"})
    # may the rounding after the op write over its output (nothing else reads the float32 values)?
    makes_fresh_output: Callable[[OpInfo], bool] = makes_fresh_output
    # ops whose output gradient arrives as a new tensor only the rounding reads (rounded over itself)
    gradient_arrives_fresh: Callable[[TensorGraph], frozenset[str]] = gradient_arrives_fresh
    # op -> the add whose output gradient its own is (rounded alike: rounded over itself)
    gradient_passes_from: Callable[[TensorGraph], dict[str, str]] = gradient_passes_from
    # the autograd Function computing a layer's backward from its packed input / output in slices, or None
    sliced_input: Callable[[nn.Module], type[torch.autograd.Function] | None] = packed_input_function
    sliced_output: Callable[[nn.Module], type[torch.autograd.Function] | None] = packed_output_function
    # samples per slice (module type, saved shape, weight numel), input channels per group (shape, weight shape)
    slice_rows: Callable[[str, Sequence[int], int], int] = backward_slice_rows
    slice_channels: Callable[[Sequence[int], Sequence[int]], int] = backward_slice_channels
    # whether low weight gradients may be held as codes until the end of the backward
    hold_gradients: Callable[[], bool] = _not_distributed


RULES = Rules()
