"""Reproduce the seed papers' claims about low-precision updates and accumulation at CPU scale.

    python benchmarks/reproduce_seeds.py            # the full table (a few minutes on 2 cores)
    python benchmarks/reproduce_seeds.py --quick    # fewer seeds and steps

Claims (Zamirai et al., "Revisiting BFloat16 Training"; Wang et al. 2018, 8-bit float training):

1. bf16: 1.0 + 1e-3, a thousand times: nearest rounding stays at 1.0, stochastic rounding reaches 2.0 +- 0.1,
   Kahan summation reaches 2.0 within one bf16 ulp (through LowPrecisionOptimizer + SGD).
2. Digits in pure bf16 (weights, activations, gradients), learning rate so small that most updates fall
   under half an ulp: nearest rounding measurably below fp32; stochastic rounding and Kahan within 0.5 pt.
3. Sum of 16,384 positive values accumulated in (1,6,9): sequential has a large relative error; chunk-based
   accumulation (CL = 64) is below 1e-2, against an fp64 reference.
4. Digits with FP8 (1,5,2) data, 16-bit (1,6,9) chunked accumulation in every GEMM (forward and backward),
   16-bit weights updated with stochastic rounding, first and last layer 16-bit: within 1 pt of fp32.

The functions here are also what tests/test_optim.py and tests/test_accumulate.py run, at smaller sizes.
"""

from __future__ import annotations

import argparse
import math
import time
from collections.abc import Callable
from dataclasses import dataclass

import pandas as pd
import torch
import torch.nn.functional as F
from torch import nn

from precsearch.formats.format import get_format
from precsearch.formats.kernels import quantize
from precsearch.runtime.accumulate import ChunkedLinear, chunked_matmul
from precsearch.runtime.optim import LowPrecisionOptimizer
from precsearch.runtime.scaling import DynamicLossScaler
from precsearch.train.data import load_dataset

IMAGE_SIZE = 8  # digits are 8x8: (N, 3, 8, 8) -> 192 features
MODES = ("fp32", "nearest", "stochastic", "kahan")


# ------------------------------------------------------------------------------------------ 1. bf16 sums


def bf16_sum(update: str, elements: int = 4096, steps: int = 1000, seed: int = 0) -> torch.Tensor:
    """Weights 1.0 in bf16 (no master copy), ``steps`` SGD updates of +1e-3 each; returns the final weights.

    Each element is an independent run (the stochastic-rounding draws differ per element)."""
    weight = nn.Parameter(torch.ones(elements))
    optimizer = LowPrecisionOptimizer(torch.optim.SGD([weight], lr=1e-3), "bf16", update, master_weights=False,
                                      generator=torch.Generator().manual_seed(seed))
    for _ in range(steps):
        weight.grad = torch.full_like(weight, -1.0)
        optimizer.step()
    return weight.detach()


def bf16_sum_rows() -> list[dict]:
    ulp = 2.0**-7  # bf16 spacing in [1, 2)
    rows = []
    for update in ("nearest", "stochastic", "kahan"):
        final = bf16_sum(update)
        rows.append({
            "claim": "bf16 1+1e-3 x1000", "setting": update,
            "value": f"mean {final.mean():.4f}, std {final.std():.4f}",
            "detail": f"{(final - 2).abs().le(0.1).float().mean():.0%} of runs within 2.0+-0.1; "
                      f"{(final - 2).abs().le(ulp).float().mean():.0%} within one ulp",
        })
    return rows


# ------------------------------------------------------------------------------- shared digits training


class _Round(torch.autograd.Function):
    """Forward: round to ``forward_fmt``. Backward: round the gradient to ``backward_fmt``, calling
    ``on_saturation`` when a gradient reaches that format's max (a saturating format has no inf)."""

    @staticmethod
    def forward(ctx, x, forward_fmt, backward_fmt, on_saturation=None):
        ctx.backward_fmt, ctx.on_saturation = backward_fmt, on_saturation
        return quantize(x, forward_fmt)

    @staticmethod
    def backward(ctx, grad):
        rounded = quantize(grad, ctx.backward_fmt)
        if ctx.on_saturation is not None and bool((rounded.abs() >= get_format(ctx.backward_fmt).max).any()):
            ctx.on_saturation()
        return rounded, None, None, None


class Round(nn.Module):
    """Round activations (forward) and their gradients (backward)."""

    def __init__(self, forward_fmt: str, backward_fmt: str = "fp32",
                 on_saturation: Callable[[], None] | None = None) -> None:
        super().__init__()
        self.forward_fmt = forward_fmt
        self.backward_fmt = backward_fmt
        self.on_saturation = on_saturation

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _Round.apply(x, self.forward_fmt, self.backward_fmt, self.on_saturation)


class RoundedWeight(nn.Module):
    """Parametrization: the layer computes with its weight rounded to ``fmt`` (the gradient passes straight)."""

    def __init__(self, fmt: str) -> None:
        super().__init__()
        self.fmt = fmt

    def forward(self, weight: torch.Tensor) -> torch.Tensor:
        return _Round.apply(weight, self.fmt, "fp32")


@dataclass
class DigitsRun:
    accuracy: float  # validation accuracy, percent
    unchanged: float  # share of weights with a nonzero gradient that a step left unchanged (last 100 steps)


def train_digits(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    steps: int,
    seed: int,
    batch_size: int = 32,
    grad_format: str = "fp32",
    scaler: DynamicLossScaler | None = None,
) -> DigitsRun:
    """Seeded minibatch training on the digits data; weight gradients rounded to ``grad_format``.

    Runs on one thread: these models are so small that a second thread only adds contention."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return _train_digits(model, optimizer, steps, seed, batch_size, grad_format, scaler)
    finally:
        torch.set_num_threads(threads)


def _train_digits(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    steps: int,
    seed: int,
    batch_size: int,
    grad_format: str,
    scaler: DynamicLossScaler | None,
) -> DigitsRun:
    train, val = load_dataset("digits", image_size=IMAGE_SIZE)
    generator = torch.Generator().manual_seed(seed)
    params = [p for p in model.parameters() if p.requires_grad]
    unchanged = moved = 0
    for step in range(steps):
        index = torch.randint(0, len(train.labels), (batch_size,), generator=generator)
        loss = F.cross_entropy(model(train.images[index]), train.labels[index])
        optimizer.zero_grad()
        (scaler.scale(loss) if scaler else loss).backward()
        for p in params:
            p.grad = quantize(p.grad, grad_format)
        before = [p.detach().clone() for p in params] if step >= steps - 100 else None
        if scaler:
            scaler.step(optimizer)
            scaler.update()
        else:
            optimizer.step()
        if before is not None:
            for p, old in zip(params, before, strict=True):
                nonzero = p.grad != 0
                unchanged += int((nonzero & (p.detach() == old)).sum())
                moved += int(nonzero.sum())
    model.eval()
    with torch.no_grad():
        accuracy = (model(val.images).argmax(1) == val.labels).float().mean().item() * 100
    return DigitsRun(accuracy, unchanged / max(moved, 1))


# ----------------------------------------------------------------------------------- 2. pure bf16 digits


def bf16_mlp(mode: str, seed: int, hidden: int = 64) -> nn.Sequential:
    """192-hidden-10 MLP; outside fp32 mode every activation and activation gradient is rounded to bf16."""
    fmt = "fp32" if mode == "fp32" else "bf16"
    torch.manual_seed(seed)
    return nn.Sequential(nn.Flatten(), Round(fmt, fmt), nn.Linear(3 * IMAGE_SIZE**2, hidden), Round(fmt, fmt),
                         nn.ReLU(), nn.Linear(hidden, 10), Round(fmt, fmt))


def bf16_digits(mode: str, seed: int, steps: int, lr: float) -> DigitsRun:
    """Pure bf16 training (no fp32 master) with the given update rule, or the fp32 reference."""
    model = bf16_mlp(mode, seed)
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    if mode != "fp32":
        optimizer = LowPrecisionOptimizer(optimizer, "bf16", mode, master_weights=False,
                                          generator=torch.Generator().manual_seed(seed))
    return train_digits(model, optimizer, steps, seed, grad_format="fp32" if mode == "fp32" else "bf16")


# ------------------------------------------------------------------------------------- 3. accumulation


def accumulation_errors(n: int = 16384, seed: int = 0, fmt: str = "e6m9s") -> dict[str, float]:
    """Relative error of summing ``n`` uniform(0, 1) values in ``fmt``: sequentially and with CL = 64."""
    values = torch.rand(n, generator=torch.Generator().manual_seed(seed))
    exact = values.double().sum().item()
    ones = torch.ones(n, 1)

    def error(chunk: int | None) -> float:
        return abs(chunked_matmul(values.view(1, -1), ones, fmt, chunk).item() - exact) / exact

    return {"sequential": error(None), "chunk 64": error(64)}


# ------------------------------------------------------------------------------------------ 4. FP8 digits


def fp8_mlp(seed: int, fp8: bool, on_saturation: Callable[[], None] | None = None, hidden: int = 64,
            acc: str = "e6m9s", chunk: int = 64) -> nn.Sequential:
    """192-h-h-h-10 MLP. fp8: GEMM inputs (weights, activations) in e5m2s and activation gradients in e5m2s,
    except the first and last layer (e6m9s); every GEMM accumulates in ``acc`` with chunk ``chunk``."""
    torch.manual_seed(seed)
    sizes = [3 * IMAGE_SIZE**2, hidden, hidden, hidden, 10]
    layers: list[nn.Module] = [nn.Flatten()]
    for i, (n_in, n_out) in enumerate(zip(sizes[:-1], sizes[1:], strict=True)):
        if not fp8:
            layers.append(nn.Linear(n_in, n_out))
        else:
            data = "e6m9s" if i in (0, len(sizes) - 2) else "e5m2s"
            layer = ChunkedLinear(n_in, n_out, acc_format=acc, chunk=chunk)
            torch.nn.utils.parametrize.register_parametrization(layer, "weight", RoundedWeight(data))
            layers += [Round(data, data, on_saturation), layer]
        if i < len(sizes) - 2:
            layers.append(nn.ReLU())
    if fp8:
        layers.append(Round("e6m9s", "e6m9s"))  # the loss gradient enters the last layer in 16 bits
    return nn.Sequential(*layers)


def fp8_digits(fp8: bool, seed: int, steps: int, lr: float) -> DigitsRun:
    """Wang et al.'s recipe (or the fp32 reference): SGD with momentum; in FP8 mode 16-bit (1,6,9) weights
    and momentum updated with stochastic rounding, and a dynamic loss scale that also reacts to e5m2s
    saturation of activation gradients (the format has no inf)."""
    scaler = DynamicLossScaler(init_scale=2.0**10, growth_interval=200, overflow_format="e6m9s")
    model = fp8_mlp(seed, fp8, scaler.record_overflow)
    optimizer = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
    if not fp8:
        return train_digits(model, optimizer, steps, seed)
    optimizer = LowPrecisionOptimizer(optimizer, "e6m9s", "stochastic", master_weights=False,
                                      state_format="e6m9s", generator=torch.Generator().manual_seed(seed))
    return train_digits(model, optimizer, steps, seed, grad_format="e6m9s", scaler=scaler)


# ---------------------------------------------------------------------------------------------- the table


def _mean(runs: Callable[[int], DigitsRun], seeds: int) -> tuple[float, float, list[float]]:
    results = [runs(seed) for seed in range(seeds)]
    accuracies = [r.accuracy for r in results]
    return sum(accuracies) / seeds, sum(r.unchanged for r in results) / seeds, accuracies


def digits_rows(seeds: int, bf16_steps: int, fp8_steps: int) -> list[dict]:
    rows = []
    lr = 0.002
    reference = None
    for mode in MODES:
        accuracy, unchanged, each = _mean(lambda seed, mode=mode: bf16_digits(mode, seed, bf16_steps, lr), seeds)
        reference = accuracy if mode == "fp32" else reference
        rows.append({
            "claim": f"digits pure bf16, SGD lr {lr}, {bf16_steps} steps", "setting": mode,
            "value": f"{accuracy:.2f}% ({accuracy - reference:+.2f} pt)",
            "detail": f"seeds {[round(a, 1) for a in each]}; a step leaves {unchanged:.0%} of weights unchanged",
        })
    base = None
    for fp8 in (False, True):
        accuracy, _, each = _mean(lambda seed, fp8=fp8: fp8_digits(fp8, seed, fp8_steps, 0.01), seeds)
        base = accuracy if not fp8 else base
        rows.append({
            "claim": f"digits FP8 (Wang et al.), SGD+momentum lr 0.01, {fp8_steps} steps",
            "setting": "e5m2s data, e6m9s chunked acc, SR" if fp8 else "fp32",
            "value": f"{accuracy:.2f}% ({accuracy - base:+.2f} pt)",
            "detail": f"seeds {[round(a, 1) for a in each]}",
        })
    return rows


def accumulation_rows() -> list[dict]:
    errors = accumulation_errors()
    fmt = get_format("e6m9s")
    return [{"claim": "sum of 16384 U(0,1) in e6m9s", "setting": setting, "value": f"rel. error {err:.2e}",
             "detail": f"{fmt.man} mantissa bits; vs fp64"} for setting, err in errors.items()]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="1 seed and fewer steps")
    args = parser.parse_args()
    seeds, bf16_steps, fp8_steps = (1, 1000, 300) if args.quick else (3, 2000, 600)
    start = time.perf_counter()
    rows = bf16_sum_rows() + accumulation_rows() + digits_rows(seeds, bf16_steps, fp8_steps)
    table = pd.DataFrame(rows)
    with pd.option_context("display.max_colwidth", 90, "display.width", 250):
        print(table.to_string(index=False))
    print(f"\n{seeds} seed(s); {time.perf_counter() - start:.0f} s; torch {torch.__version__}; "
          f"bf16 ulp in [1,2) = {math.ldexp(1, -7)}")


if __name__ == "__main__":
    main()
