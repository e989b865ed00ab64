"""An activation gradient in flight as the codes of its rounding (issue 67: every tensor in its format for its
whole life).

A rounding in the backward (``RoundActivation``) hands autograd a ``GradientCodes``: a tensor autograd and every
op see as float32, whose storage is the codes of the rounded values (``ops.Codes``, the packer's encoding, so the
values are bit for bit the rounded float32 ones). It waits in the engine's buffers at code width, and a backward
that reads its output gradient a slice at a time (precsearch.runtime.sliced) decodes it a slice at a time
(``gradient_rows``). Any other op, the engine's sum of two gradients included, is given the decoded values
(``__torch_dispatch__``): correct, a float32 copy for that op's call. An op that would write into it (``add_``) is
refused: the write would reach a decoded copy, not the codes. The site plan never hands one to a leaf's ``.grad``.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.utils._pytree import tree_map

from precsearch.errors import PrecsearchError
from precsearch.runtime import ops

__all__ = ["GradientCodes", "decoded", "gradient_rows", "new_gradient", "slices_on"]


class GradientCodes(torch.Tensor):
    """A float32 gradient held as its codes; ``args`` the rounding that made them (``Slot.args()``)."""

    codes: ops.Codes
    args: tuple[str, str, str]

    @staticmethod
    def __new__(cls, codes: ops.Codes, args: tuple[str, str, str]) -> GradientCodes:
        return torch.Tensor._make_wrapper_subclass(cls, codes.codes.shape, dtype=torch.float32,
                                                   device=codes.codes.device)

    def __init__(self, codes: ops.Codes, args: tuple[str, str, str]) -> None:
        self.codes, self.args = codes, args

    __torch_function__ = torch._C._disabled_torch_function_impl  # results are plain tensors, never this class

    @classmethod
    def __torch_dispatch__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        for index, argument in enumerate(func._schema.arguments):
            value = args[index] if index < len(args) else kwargs.get(argument.name)
            if isinstance(value, GradientCodes) and argument.alias_info is not None and argument.alias_info.is_write:
                raise PrecsearchError(f"{func.__name__} would write into a gradient held as its codes, which a "
                                      "write cannot reach; write into a copy (g = g.clone()), or train with "
                                      "apply_policy(..., gradient_codes=False)")
        return func(*tree_map(decoded, args), **tree_map(decoded, kwargs))

    def __repr__(self) -> str:
        return f"GradientCodes({tuple(self.shape)}, {self.args[0]})"


def slices_on(device: torch.device) -> bool:
    """Whether the sliced backwards read their tensors a slice at a time on ``device``: on CPU, where their slices
    were measured (elsewhere they decode whole)."""
    return device.type == "cpu"


def decoded(t: Any) -> Any:
    """``t``'s float32 values: a new tensor where ``t`` is held as codes, else ``t`` itself."""
    return t.codes.whole() if isinstance(t, GradientCodes) else t


def gradient_rows(g: torch.Tensor, start: int, length: int) -> torch.Tensor:
    """Samples ``start`` to ``start + length`` of the gradient ``g`` (fewer at its end): decoded alone where ``g`` is
    held as codes."""
    if isinstance(g, GradientCodes):
        return g.codes.part(0, start, min(length, g.shape[0] - start))
    return g[start:start + length]


def new_gradient(like: torch.Tensor, shape: Any = None) -> torch.Tensor:
    """An uninitialized float32 tensor on ``like``'s device (of ``like``'s shape by default), made without
    decoding ``like`` (``torch.empty_like`` of a ``GradientCodes`` would)."""
    return torch.empty(like.shape if shape is None else shape, dtype=torch.float32, device=like.device)
