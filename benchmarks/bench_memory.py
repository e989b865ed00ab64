"""Peak memory of one training step (forward, backward, SGD step with momentum) under each policy, measured
and predicted, beside the bytes autograd saves, all as ratios to the plain fp32 model's measured peak.

Measured: the CPU allocator's events (precsearch.cost.measured), and CUDA's ``max_memory_allocated`` with
``--device cuda``; both above what is live before the step (parameters, momentum, the batch). Predicted:
``CostModel.peak_bytes``. Saved: ``CostModel.saved_activation_bytes``. Rows: plain fp32, plain under
``torch.autocast(bfloat16)`` (CUDA only), the fp32/fp16/bf16/hfp8 baselines and the paper's all-low policy, each
eager; then, with ``--compiled`` (a list of policies), the same policies through ``apply_policy(compile=True)``:
the compiled step with each rounded tensor's codes saved for the backward (precsearch.runtime.compiled), beside
plain ``torch.compile`` of the fp32 model. Each compiled row compiles its own graph (its code widths), which
takes minutes on a CPU; the step measured is the third, after the compile.

Usage: python benchmarks/bench_memory.py [--width 1.0] [--batch 128] [--device cpu|cuda]
       [--policies fp32,fp16,bf16,hfp8,all-low] [--compiled fp16,hfp8,all-low]
       (also fp8-all-low and fp8-scaled-all-low: the all-low of search_spaces/fp8_e4m3_e5m2.yaml and of
       fp8_scaled.yaml, the same elements without and with a scale per tensor)
"""

from __future__ import annotations

import argparse
import copy
import sys
from pathlib import Path

import torch

from precsearch.config.policy import Policy
from precsearch.config.spaces import load_space
from precsearch.config.spec import PAPER_OVERFLOW
from precsearch.cost.measured import measure_peak, sgd_step, trace_step
from precsearch.cost.model import MIB, CostModel
from precsearch.cost.policies import policy_from_assignment
from precsearch.graph.tracing import trace
from precsearch.models import build
from precsearch.runtime.model import apply_policy
from precsearch.search.strategies import baseline, uniform

ALL_LOW = {"weight": "e4m3b4s", "activation": "e4m3b4s", "activation_grad": "e5m2s", "weight_grad": "e6m9s"}
# The all-low assignments of two spaces that differ only in a scale per tensor (issue 40: within 2%).
SPACES = Path(__file__).resolve().parent.parent / "search_spaces"
SPACE_ALL_LOW = {"fp8-all-low": SPACES / "fp8_e4m3_e5m2.yaml", "fp8-scaled-all-low": SPACES / "fp8_scaled.yaml"}


def space_all_low(graph, path: Path) -> Policy:
    """Every tensor at the space's low format, with its high format, overflow, loss scaling and guard."""
    space = load_space(path)
    return policy_from_assignment(graph, uniform(graph, space, "low").assignment, high_format=space.high,
                                  overflow=dict(space.overflow), loss_scaling=dict(space.loss_scaling),
                                  promotion_threshold=space.promotion_threshold)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--width", type=float, default=1.0)
    parser.add_argument("--batch", type=int, default=128)
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    parser.add_argument("--timeline", action="store_true", help="print the blocks at each measured peak")
    parser.add_argument("--policies", default="fp32,fp16,bf16,hfp8,all-low", help="eager policy rows")
    parser.add_argument("--compiled", default="", help="policies also measured compiled (e.g. fp16,hfp8,all-low)")
    args = parser.parse_args()
    device = torch.device(args.device)

    torch.manual_seed(0)
    plain = build("resnet18", width=args.width)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(args.batch, 3, 32, 32, generator=g)
    y = torch.randint(0, 10, (args.batch,), generator=g)
    graph = trace(plain, x[:2], batch_size=args.batch)
    cost = CostModel(graph)
    every: dict[str, Policy] = {name: baseline(name, graph) for name in ("fp32", "fp16", "bf16", "hfp8")}
    every["all-low"] = policy_from_assignment(
        graph, {tid: ALL_LOW[graph.tensors[tid].kind] for tid in graph.assignable_ids()}, high_format="e6m9s",
        overflow=dict(PAPER_OVERFLOW), loss_scaling={"mode": "dynamic", "init_scale": 2.0**16},
        promotion_threshold=0.01)
    every.update({name: space_all_low(graph, path) for name, path in SPACE_ALL_LOW.items()})
    chosen = [name for name in args.policies.split(",") if name]
    compiled = [name for name in args.compiled.split(",") if name]
    unknown = sorted(set(chosen + compiled) - set(every))
    if unknown:
        parser.error(f"unknown policy {unknown[0]!r}; use any of {', '.join(every)}")
    # (row, policy, compiled)
    rows_to_run: list[tuple[str, Policy | None, bool]] = [("plain fp32", None, False)]
    rows_to_run += [(name, every[name], False) for name in chosen]
    if compiled:
        rows_to_run.append(("plain fp32, torch.compile", None, True))
    rows_to_run += [(f"{name}, compiled", every[name], True) for name in compiled]

    print(f"torch {torch.__version__}, ResNet-18 width {args.width}, batch {args.batch}, 32x32, "
          f"SGD(momentum=0.9, wd=5e-4); {torch.cuda.get_device_name(device) if device.type == 'cuda' else 'CPU'}")
    rows = []
    for name, policy, compiling in rows_to_run:
        model = copy.deepcopy(plain)
        if policy is not None:
            model = apply_policy(model, policy, compile=compiling)
        elif compiling:
            model = torch.compile(model, fullgraph=True)
        model = model.to(device)
        step = sgd_step(model, torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9, weight_decay=5e-4),
                        x.to(device), y.to(device))
        step()  # momentum buffers, compiled kernels
        step()
        memory = trace_step(step) if device.type == "cpu" else None
        cuda = measure_peak(step, device) if device.type == "cuda" else None
        assignment = None if policy is None else policy.assignment(graph)
        rows.append((name, memory, cuda, cost.peak_bytes(assignment),
                     cost.saved_activation_bytes(assignment)))
        if args.timeline and memory is not None:
            print(f"\n{name}: {memory.summary()}")
    if device.type == "cuda":
        model = copy.deepcopy(plain).to(device)
        autocast_step = sgd_step(model, torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9,
                                                        weight_decay=5e-4), x.to(device), y.to(device),
                                 autocast=torch.bfloat16)
        autocast_step()
        rows.insert(1, ("autocast bf16", None, measure_peak(autocast_step, device), None, None))

    base = rows[0][2] if device.type == "cuda" else rows[0][1].peak
    measured_of = {name: cuda if device.type == "cuda" else memory.peak for name, memory, cuda, _, _ in rows}
    print("\n| step | peak measured (MiB) | x fp32 | x its eager row | peak predicted | x fp32 | saved bytes "
          "| x fp32 |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for name, _, _, predicted, saved in rows:
        measured = measured_of[name]
        eager = measured_of.get(name.removesuffix(", compiled")) if name.endswith(", compiled") else None
        cells = [f"{measured / MIB:.1f}", f"{measured / base:.3f}", "-" if eager is None else f"{measured / eager:.3f}"]
        cells += ["-", "-"] if predicted is None else [f"{predicted / MIB:.1f}", f"{predicted / base:.3f}"]
        cells += ["-", "-"] if saved is None else [f"{saved / MIB:.1f}", f"{saved / base:.3f}"]
        print(f"| {name} | " + " | ".join(cells) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
