"""The compiled all-low step with Inductor's layout optimization on (A) and off (B, what the compiled step uses),
timed interleaved in one process: ResNet-18 width 0.25, batch 64, SGD with momentum; medians of 9 steps each after
2 warm-up steps (which compile).

Usage: python benchmarks/compiled_layout_ab.py
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

import precsearch.runtime.compiled as compiled
from precsearch.config.compiling import CompileOptions
from precsearch.config.spec import PAPER_OVERFLOW
from precsearch.cost.policies import policy_from_assignment
from precsearch.graph.tracing import trace
from precsearch.models import build
from precsearch.runtime.model import apply_policy

ALL_LOW = {"weight": "e4m3b4s", "activation": "e4m3b4s", "activation_grad": "e5m2s", "weight_grad": "e6m9s"}


def _step(layout_optimization: bool, policy, x: torch.Tensor, y: torch.Tensor) -> Callable[[], None]:
    """A compiled all-low training step, its graphs compiled (during its warm-up) with the layout optimization
    as asked."""
    original = compiled.compile_fx

    def compile_fx(graph_module, example_inputs, config_patches):
        return original(graph_module, example_inputs,
                        config_patches={**config_patches, "layout_optimization": layout_optimization})

    compiled.compile_fx = compile_fx  # the backward's compile carries the patches with it
    try:
        model = apply_policy(build("resnet18", width=0.25), policy, x[:2], compile=CompileOptions())
        optimizer = model.wrap_optimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9))

        def step() -> None:
            optimizer.zero_grad()
            F.cross_entropy(model(x), y).backward()
            optimizer.step()

        for _ in range(2):
            step()
    finally:
        compiled.compile_fx = original
    return step


def main() -> None:
    torch.manual_seed(0)
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(64, 3, 32, 32, generator=generator)
    y = torch.randint(0, 10, (64,), generator=generator)
    graph = trace(build("resnet18", width=0.25), x[:2], batch_size=64)
    policy = policy_from_assignment(
        graph, {tid: ALL_LOW[graph.tensors[tid].kind] for tid in graph.assignable_ids()}, high_format="e6m9s",
        overflow=dict(PAPER_OVERFLOW), loss_scaling={"mode": "dynamic", "init_scale": 2.0**16},
        promotion_threshold=0.01, provenance={"strategy": "all-low"})
    steps = {"A: layout optimization on": _step(True, policy, x, y),
             "B: layout optimization off": _step(False, policy, x, y)}
    times: dict[str, list[float]] = {name: [] for name in steps}
    for _ in range(9):
        for name, step in steps.items():
            start = time.perf_counter()
            step()
            times[name].append(time.perf_counter() - start)
    medians = {name: statistics.median(values) for name, values in times.items()}
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads; ResNet-18 width 0.25, batch 64, all-low")
    for name, median in medians.items():
        print(f"{name}: {1000 * median:.1f} ms")
    a, b = medians.values()
    print(f"B / A = {b / a:.3f}")


if __name__ == "__main__":
    main()
