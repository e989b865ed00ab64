"""Simulated low-precision GEMM accumulation with chunk-based sums (Wang et al. 2018), forward and backward.

``chunked_matmul(a, b, acc_format, chunk)`` splits the reduction dimension K into chunks of length ``chunk`` (the
paper's CL, default 64): inside a chunk the products are added one after another, the running sum rounded to
``acc_format`` after every add; then the chunk sums likewise. ``chunk=None`` (or ``>= K``) is plain sequential
accumulation, whose error chunking fixes: once the sum is large, each small addend is below half its ulp and is
lost ("swamping").

Exactness: products are formed in float32, exact for inputs of at most 12 significant bits (any 8- or 16-bit
format of the papers); each add is a float32 add rounded to the format (half to even), which equals a correctly
rounded add unless the float32 sum is inexact and lands on a format midpoint (operands more than 2**(23 - M)
apart).

Vectorized, not fast: Python loops over CL steps, then K/CL steps, each a pass over an (M, K/CL, N) tensor plus a
rounding: one to two orders of magnitude over the plain layer on CPU (``benchmarks/bench_accumulate.py``).

``ChunkedLinear`` and ``ChunkedConv2d`` use it for all three GEMMs of training (bias sums alike). Conv2d is unfold
+ GEMM; its input gradient folds the column gradients back with ``F.fold`` (an fp32 scatter-add of at most kh*kw
terms per pixel) and rounds that sum once. ``swap_chunked_layers`` swaps them into a model in place.
"""

from __future__ import annotations

import fnmatch
import logging
from collections.abc import Callable, Iterable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from precsearch.config.policy import ACCUMULATION_CHUNK, ACCUMULATION_FORMAT, ACCUMULATION_LAYER_TYPES
from precsearch.errors import PrecsearchError
from precsearch.formats.format import FloatFormat, get_format
from precsearch.formats.kernels import quantize

__all__ = ["CHUNKED_LAYERS", "chunked_matmul", "chunked_sum", "ChunkedLinear", "ChunkedConv2d", "swap_chunked_layers"]

log = logging.getLogger(__name__)

FormatSpec = str | FloatFormat
# The layer types with a chunked twin (swap_chunked_layers swaps exactly these; subclasses are left alone).
CHUNKABLE_LAYERS: tuple[type[nn.Module], ...] = tuple(getattr(nn, name) for name in ACCUMULATION_LAYER_TYPES)


def _check_chunk(chunk: int | None) -> None:
    if chunk is not None and (not isinstance(chunk, int) or chunk < 1):
        raise PrecsearchError(f"chunk length {chunk!r}: must be an integer >= 1, or None for sequential sums")


def chunked_matmul(a: torch.Tensor, b: torch.Tensor, acc_format: FormatSpec = ACCUMULATION_FORMAT,
                   chunk: int | None = ACCUMULATION_CHUNK) -> torch.Tensor:
    """``a @ b`` (shapes ``(..., M, K)`` and ``(..., K, N)``, batch dims broadcast) with sums in ``acc_format``."""
    _check_chunk(chunk)
    fmt = get_format(acc_format)
    a, b = a.float(), b.float()
    if fmt.is_fp32:
        return a @ b
    k = a.shape[-1]
    if b.shape[-2] != k:
        raise PrecsearchError(f"chunked_matmul: inner dimensions differ ({a.shape[-1]} vs {b.shape[-2]})")
    cl = k if chunk is None else min(chunk, k)
    n_chunks = -(-k // cl)
    pad = n_chunks * cl - k
    if pad:  # zero products leave every partial sum unchanged
        a, b = F.pad(a, (0, pad)), F.pad(b, (0, 0, 0, pad))
    a = a.unflatten(-1, (n_chunks, cl)).unsqueeze(-1)  # (..., M, C, CL, 1)
    b = b.unflatten(-2, (n_chunks, cl)).unsqueeze(-4)  # (..., 1, C, CL, N)
    acc = quantize(a[..., 0, :] * b[..., 0, :], fmt)  # (..., M, C, N): running sums of every chunk
    for i in range(1, cl):
        acc = quantize(acc + a[..., i, :] * b[..., i, :], fmt)
    total = acc[..., 0, :]
    for c in range(1, n_chunks):
        total = quantize(total + acc[..., c, :], fmt)
    return total


def chunked_sum(x: torch.Tensor, acc_format: FormatSpec = ACCUMULATION_FORMAT,
                chunk: int | None = ACCUMULATION_CHUNK) -> torch.Tensor:
    """Sum of a (N, F) tensor over its first dimension, accumulated like ``chunked_matmul``."""
    return chunked_matmul(x.new_ones(1, x.shape[0]), x, acc_format, chunk).squeeze(0)


class _ChunkedLinearFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, fmt, chunk):
        ctx.save_for_backward(x, weight)
        ctx.fmt, ctx.chunk, ctx.has_bias = fmt, chunk, bias is not None
        flat = x.reshape(-1, x.shape[-1])
        out = chunked_matmul(flat, weight.t(), fmt, chunk)
        if bias is not None:
            out = quantize(out + bias, fmt)
        return out.reshape(*x.shape[:-1], weight.shape[0])

    @staticmethod
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        flat_x = x.reshape(-1, x.shape[-1])
        flat_g = grad.reshape(-1, grad.shape[-1])
        grad_x = grad_w = grad_b = None
        if ctx.needs_input_grad[0]:
            grad_x = chunked_matmul(flat_g, weight, ctx.fmt, ctx.chunk).reshape(x.shape)
        if ctx.needs_input_grad[1]:
            grad_w = chunked_matmul(flat_g.t(), flat_x, ctx.fmt, ctx.chunk)
        if ctx.has_bias and ctx.needs_input_grad[2]:
            grad_b = chunked_sum(flat_g, ctx.fmt, ctx.chunk)
        return grad_x, grad_w, grad_b, None, None


class _ChunkedConv2dFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, geometry, fmt, chunk):
        stride, padding, dilation, groups = geometry
        ctx.save_for_backward(x, weight)
        ctx.geometry, ctx.fmt, ctx.chunk, ctx.has_bias = geometry, fmt, chunk, bias is not None
        n, _, h, w = x.shape
        out_ch, cin_g, kh, kw = weight.shape
        cols = F.unfold(x, (kh, kw), dilation=dilation, padding=padding, stride=stride)  # (N, C*kh*kw, L)
        length = cols.shape[-1]
        cols = cols.view(n, groups, cin_g * kh * kw, length).permute(1, 0, 3, 2).reshape(groups, n * length, -1)
        w_mat = weight.view(groups, out_ch // groups, -1).transpose(1, 2)  # (G, Cg*kh*kw, Og)
        out = chunked_matmul(cols, w_mat, fmt, chunk)  # (G, N*L, Og)
        out = out.view(groups, n, length, -1).permute(1, 0, 3, 2).reshape(n, out_ch, length)
        if bias is not None:
            out = quantize(out + bias.view(1, -1, 1), fmt)
        oh = (h + 2 * padding[0] - dilation[0] * (kh - 1) - 1) // stride[0] + 1
        ow = (w + 2 * padding[1] - dilation[1] * (kw - 1) - 1) // stride[1] + 1
        return out.view(n, out_ch, oh, ow)

    @staticmethod
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        stride, padding, dilation, groups = ctx.geometry
        n, _, h, w = x.shape
        out_ch, cin_g, kh, kw = weight.shape
        og = out_ch // groups
        # (G, N*L, Og): the output gradient as GEMM rows, one group per batch entry of the GEMM.
        g_rows = grad.reshape(n, groups, og, -1).permute(1, 0, 3, 2).reshape(groups, -1, og)
        length = grad.shape[-2] * grad.shape[-1]
        w_mat = weight.view(groups, og, -1)  # (G, Og, Cg*kh*kw)
        grad_x = grad_w = grad_b = None
        if ctx.needs_input_grad[0]:
            cols = chunked_matmul(g_rows, w_mat, ctx.fmt, ctx.chunk)  # (G, N*L, Cg*kh*kw)
            cols = cols.view(groups, n, length, -1).permute(1, 0, 3, 2).reshape(n, -1, length)
            folded = F.fold(cols, (h, w), (kh, kw), dilation=dilation, padding=padding, stride=stride)
            grad_x = quantize(folded, ctx.fmt)
        if ctx.needs_input_grad[1]:
            x_cols = F.unfold(x, (kh, kw), dilation=dilation, padding=padding, stride=stride)
            x_cols = x_cols.view(n, groups, cin_g * kh * kw, length).permute(1, 0, 3, 2).reshape(groups, n * length, -1)
            grad_w = chunked_matmul(g_rows.transpose(1, 2), x_cols, ctx.fmt, ctx.chunk).reshape(weight.shape)
        if ctx.has_bias and ctx.needs_input_grad[2]:
            grad_b = chunked_sum(grad.transpose(0, 1).reshape(out_ch, -1).t(), ctx.fmt, ctx.chunk)
        return grad_x, grad_w, grad_b, None, None, None


class ChunkedLinear(nn.Linear):
    """``nn.Linear`` whose forward and backward GEMMs accumulate in ``acc_format`` with chunk length ``chunk``."""

    def __init__(self, in_features: int, out_features: int, bias: bool = True,
                 acc_format: FormatSpec = ACCUMULATION_FORMAT, chunk: int | None = ACCUMULATION_CHUNK,
                 **factory: Any) -> None:
        super().__init__(in_features, out_features, bias, **factory)
        _check_chunk(chunk)
        self.acc_format, self.chunk = get_format(acc_format), chunk

    @classmethod
    def from_linear(cls, layer: nn.Linear, acc_format: FormatSpec = ACCUMULATION_FORMAT,
                    chunk: int | None = ACCUMULATION_CHUNK) -> ChunkedLinear:
        """A ChunkedLinear sharing ``layer``'s Parameter objects (optimizers built on them keep working)."""
        new = cls(layer.in_features, layer.out_features, layer.bias is not None, acc_format, chunk, device="meta")
        new.weight, new.bias = layer.weight, layer.bias
        return new

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _ChunkedLinearFn.apply(x, self.weight, self.bias, self.acc_format, self.chunk)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, acc_format={self.acc_format}, chunk={self.chunk}"


class ChunkedConv2d(nn.Conv2d):
    """``nn.Conv2d`` (zero padding, numeric padding) computed as unfold + chunked GEMMs, forward and backward."""

    def __init__(self, *args: Any, acc_format: FormatSpec = ACCUMULATION_FORMAT, chunk: int | None = ACCUMULATION_CHUNK,
                 **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        _check_chunk(chunk)
        if self.padding_mode != "zeros" or isinstance(self.padding, str):
            raise PrecsearchError(f"ChunkedConv2d supports numeric zero padding only, not padding={self.padding!r} "
                                  f"padding_mode={self.padding_mode!r}: give explicit padding sizes")
        self.acc_format, self.chunk = get_format(acc_format), chunk

    @classmethod
    def from_conv(cls, layer: nn.Conv2d, acc_format: FormatSpec = ACCUMULATION_FORMAT,
                  chunk: int | None = ACCUMULATION_CHUNK) -> ChunkedConv2d:
        """A ChunkedConv2d sharing ``layer``'s Parameter objects."""
        new = cls(layer.in_channels, layer.out_channels, layer.kernel_size, stride=layer.stride,
                  padding=layer.padding, dilation=layer.dilation, groups=layer.groups,
                  bias=layer.bias is not None, padding_mode=layer.padding_mode,
                  acc_format=acc_format, chunk=chunk, device="meta")
        new.weight, new.bias = layer.weight, layer.bias
        return new

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        geometry = (self.stride, self.padding, self.dilation, self.groups)
        return _ChunkedConv2dFn.apply(x, self.weight, self.bias, geometry, self.acc_format, self.chunk)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, acc_format={self.acc_format}, chunk={self.chunk}"


# Traced as single GEMM ops, so a model whose layers were already swapped traces like the plain one.
CHUNKED_LAYERS: tuple[type[nn.Module], ...] = (ChunkedLinear, ChunkedConv2d)


def swap_chunked_layers(model: nn.Module,
                        names_or_filter: Iterable[str] | Callable[[str, nn.Module], bool] | None = None,
                        acc_format: FormatSpec = ACCUMULATION_FORMAT,
                        chunk: int | None = ACCUMULATION_CHUNK) -> list[str]:
    """Replace Linear/Conv2d layers of ``model`` in place by chunked ones (sharing the old Parameters); returns the
    swapped names. ``names_or_filter``: qualified names or glob patterns over them (``"layer1.*"``), a predicate
    ``(name, module) -> bool``, or None for every Linear/Conv2d."""
    _check_chunk(chunk)
    get_format(acc_format)
    layers = {name: m for name, m in model.named_modules() if type(m) in CHUNKABLE_LAYERS and name}
    if names_or_filter is None:
        chosen = list(layers)
    elif callable(names_or_filter):
        chosen = [name for name, m in layers.items() if names_or_filter(name, m)]
    else:
        chosen = []
        for pattern in names_or_filter:
            hits = [name for name in layers if fnmatch.fnmatchcase(name, pattern)]
            if not hits:
                raise PrecsearchError(f"no Linear/Conv2d layer of the model matches {pattern!r}: check the name")
            chosen += [name for name in hits if name not in chosen]
    for name in chosen:
        layer = layers[name]
        parent_name, _, attr = name.rpartition(".")
        new = (ChunkedLinear.from_linear(layer, acc_format, chunk) if isinstance(layer, nn.Linear)
               else ChunkedConv2d.from_conv(layer, acc_format, chunk))
        new.train(layer.training)
        setattr(model.get_submodule(parent_name), attr, new)
    log.debug("chunked accumulation (%s, CL=%s) in %d layers", acc_format, chunk, len(chosen))
    return chosen
