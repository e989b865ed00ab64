"""Can an activation gradient travel between autograd nodes as its 8-bit codes? (issue 67, item 1's mechanism)

A chain of ``--layers`` elementwise layers (y = 2x) after a broadcast of one row of weights, each a
``torch.autograd.Function`` whose backward reads its output gradient ``--rows`` samples at a time, runs one backward
twice: the gradients in flight as float32 (today's runtime), and as ``GradientCodes``, a tensor autograd sees as
float32 whose storage is the e5m2 codes of the gradient (torch's own cast, round-half-to-even), written and read a
slice at a time. It prints the backward's peak by the CPU allocator's events and checks that both give the same
input gradient (every value here is exact in e5m2, so codes lose nothing). A gradient read twice (a residual branch)
reaches the engine's sum, which decodes it (``__torch_dispatch__``): correct, not smaller.

Usage: OMP_NUM_THREADS=1 python benchmarks/gradient_codes_probe.py --batch 64 --features 65536 --layers 4
"""

from __future__ import annotations

import argparse

import torch
from torch.utils._pytree import tree_map

from precsearch.cost.measured import trace_step

MIB = 2**20


class GradientCodes(torch.Tensor):
    """A float32 tensor to autograd, held as its e5m2 codes (one byte a value)."""

    @staticmethod
    def __new__(cls, codes: torch.Tensor) -> GradientCodes:
        return torch.Tensor._make_wrapper_subclass(cls, codes.shape, dtype=torch.float32, device=codes.device)

    def __init__(self, codes: torch.Tensor) -> None:
        self.codes = codes

    def rows(self, start: int, length: int) -> torch.Tensor:
        return self.codes[start:start + length].float()

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):  # anything else sees float32 values
        decode = lambda t: t.codes.float() if isinstance(t, GradientCodes) else t  # noqa: E731
        return func(*tree_map(decode, args), **tree_map(decode, kwargs or {}))


class Double(torch.autograd.Function):
    """y = 2x; its backward reads and writes the gradient ``rows`` samples at a time, as codes where told."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, rows: int, codes: bool) -> torch.Tensor:
        ctx.rows, ctx.codes = rows, codes
        return x * 2

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        if not ctx.codes:
            return grad * 2, None, None
        out = torch.empty(grad.shape, dtype=torch.float8_e5m2)
        for start in range(0, grad.shape[0], ctx.rows):
            part = grad.rows(start, ctx.rows) if isinstance(grad, GradientCodes) else grad[start:start + ctx.rows]
            out[start:start + ctx.rows] = (part * 2).to(torch.float8_e5m2)
        return GradientCodes(out), None, None


class Broadcast(torch.autograd.Function):
    """The chain's first layer: a row of weights copied to every sample; its backward sums the gradient over the
    samples a slice at a time, so the only gradient held whole is the one in flight."""

    @staticmethod
    def forward(ctx, weight: torch.Tensor, batch: int, rows: int) -> torch.Tensor:
        ctx.rows = rows
        return weight.expand(batch, -1).clone()

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        total = 0
        for start in range(0, grad.shape[0], ctx.rows):
            total = total + (grad.rows(start, ctx.rows) if isinstance(grad, GradientCodes)
                             else grad[start:start + ctx.rows]).sum(0)
        return total, None, None


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--features", type=int, default=65536)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--rows", type=int, default=8)
    args = parser.parse_args()
    grads, peaks = {}, {}
    for codes in (False, True):
        x = torch.ones(args.features, requires_grad=True)
        y = Broadcast.apply(x, args.batch, args.rows)
        for _ in range(args.layers):
            y = Double.apply(y, args.rows, codes)
        seed = torch.full_like(y, 2.0**-8)
        peaks[codes] = trace_step(lambda: y.backward(seed)).peak  # noqa: B023
        grads[codes] = x.grad.float()
    tensor = args.batch * args.features * 4
    print(f"{args.layers} layers over a {tensor / MIB:.2f} MiB float32 gradient, slices of {args.rows} samples")
    for codes, name in ((False, "float32 in flight"), (True, "e5m2 codes in flight")):
        print(f"{name:22s} backward peak {peaks[codes] / MIB:7.3f} MiB = {peaks[codes] / tensor:.3f}x the gradient")
    print(f"same input gradient: {torch.equal(grads[False], grads[True])}")
    return 0 if torch.equal(grads[False], grads[True]) else 1


if __name__ == "__main__":
    raise SystemExit(main())
