"""Peak memory of one training step (forward, backward, SGD step with momentum) under each policy, measured
and predicted, beside plain fp32 and plain fp32 under ``torch.autocast(bfloat16)``: what a user's device shows.

Measured: the CPU allocator's events (precsearch.cost.measured), and CUDA's ``max_memory_allocated`` with
``--device cuda``; both above what is live before the step (parameters, momentum, the batch). Predicted:
``CostModel.peak_bytes`` (autocast has none: it assigns no formats). Rows: plain fp32, plain fp32 under
``torch.autocast(bfloat16)`` (fp32 parameters, torch's own casts), then the policies ``--policies`` names, each
eager: ``all-high`` (every tensor at the paper's HFP8 space's high format, e6m9s), the ``fp32``/``fp16``/``bf16``/
``hfp8`` baselines (precsearch.search.strategies.baseline), ``all-low`` (the paper's low formats everywhere,
dynamic loss scaling, the promotion guard at 1%), ``pick`` (the demo's rule: the paper's space with the group
holding the input high and every other group low), and ``fp8-all-low`` / ``fp8-scaled-all-low`` (the all-low of
search_spaces/fp8_e4m3_e5m2.yaml and of fp8_scaled.yaml, the same elements without and with a scale per tensor).
With ``--compiled`` (a list of those policies), the same policies through ``apply_policy(compile=True)`` beside
plain ``torch.compile`` of the fp32 model; each compiled row compiles its own graph (its code widths), which takes
minutes on a CPU; the step measured is the third, after the compile. ``--time N``: each eager row's step time,
the median of N steps taken in turn (precsearch.cost.measured.median_step_times). ``--suite``: the settings a
search runs (``SUITE``), one table each. ``--min-slices N``: each eager policy again, its sliced backwards run in
at least N slices of the batch (``OpRules.with_min_slices``: less memory, more time), predicted from a graph traced
with those rules. ``--float32-grads``: each eager policy again with its weight gradients kept float32 in ``.grad``
through the backward (``hold_gradients`` off), the step as it was before gradients in formats of 16 bits without
inf or NaN codes (e6m9s) were held as codes: an A/B of memory and (with ``--time``) time in one run.
``--finer-slices``: each eager policy again with the sliced backwards at its predicted peak in more slices
(``CostModel.finer_slices``, ``apply_policy(slices=...)``), predicted with them. ``--float32-activation-grads``: each
eager policy again with its rounded activation gradients handed on float32
(``apply_policy(gradient_codes=False)``), the step as it was before they travelled as codes: the same A/B.

Usage: python benchmarks/bench_memory.py [--model resnet18] [--width W] [--image-size 32] [--batch 128]
       [--device cpu|cuda] [--policies all-high,hfp8,all-low,pick] [--compiled hfp8,all-low] [--time 5] [--suite]
       [--min-slices 4] [--finer-slices] [--float32-grads] [--float32-activation-grads]
"""

from __future__ import annotations

import argparse
import copy
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from precsearch.config.policy import Policy
from precsearch.config.spaces import SearchSpace, load_space, paper_space
from precsearch.config.spec import PAPER_LOW, PAPER_OVERFLOW
from precsearch.cost.measured import measure_peak, median_step_times, sgd_step, trace_step
from precsearch.cost.model import MIB, CostModel
from precsearch.cost.policies import policy_from_assignment
from precsearch.graph.op_rules import OP_RULES
from precsearch.graph.tracing import trace
from precsearch.graph.types import TensorGraph
from precsearch.models import build
from precsearch.runtime.gradients import no_process_group
from precsearch.runtime.model import apply_policy
from precsearch.search.strategies import assign, baseline, uniform, units

# The settings searches run at (issue 67): (model spec, image side, batch).
SUITE = (("narrow_cnn", 16, 32), ("tiny_cnn", 16, 64), ("resnet18:width=0.25", 16, 64),
         ("mobilenet_v2:width=0.5", 16, 64), ("shufflenet_v2:width=0.5", 16, 64), ("resnet18", 32, 128))
DEFAULT_POLICIES = "all-high,hfp8,all-low,pick"
BASELINE_ROWS = ("fp32", "fp16", "bf16", "hfp8")
# The all-low assignments of two spaces that differ only in a scale per tensor (issue 40: within 2%).
SPACES = Path(__file__).resolve().parent.parent / "search_spaces"
SPACE_ALL_LOW = {"fp8-all-low": SPACES / "fp8_e4m3_e5m2.yaml", "fp8-scaled-all-low": SPACES / "fp8_scaled.yaml"}
FLOAT32_GRADS = "weight gradients float32"  # a row's suffix: apply_policy(hold_gradients=...) off
FLOAT32_ACTIVATION_GRADS = "activation gradients float32"  # a row's suffix: apply_policy(gradient_codes=False)
FINER = "finer slices"  # a row's suffix: apply_policy(slices=CostModel.finer_slices(...))
POLICY_NAMES = (*BASELINE_ROWS, "all-high", "all-low", "pick", *SPACE_ALL_LOW)


def space_policy(graph: TensorGraph, space: SearchSpace, assignment: dict[str, str]) -> Policy:
    """``assignment`` with the space's high format, overflow, loss scaling and guard, as a search trains it."""
    return policy_from_assignment(graph, assignment, high_format=space.high, overflow=dict(space.overflow),
                                  loss_scaling=dict(space.loss_scaling), promotion_threshold=space.promotion_threshold)


def input_high_rest_low(graph: TensorGraph, space: SearchSpace) -> dict[str, str]:
    """The demo's pick: the unit holding the model's input (``x:activation``) high, every other unit low."""
    inputs = {op.name for op in graph.ops if op.role == "input"}
    decisions = {unit: "high" if any(tid.split(":")[0] in inputs for tid in ids) else "low"
                 for unit, ids in units(graph, space).items()}
    return assign(graph, space, decisions)


def policies(graph: TensorGraph) -> dict[str, Policy]:
    """Every policy a row can name (see the module doc)."""
    paper = paper_space()
    every = {name: baseline(name, graph) for name in BASELINE_ROWS}
    every["all-high"] = space_policy(graph, paper, uniform(graph, paper, "high").assignment)
    every["all-low"] = policy_from_assignment(
        graph, {tid: PAPER_LOW[graph.tensors[tid].kind] for tid in graph.assignable_ids()}, high_format="e6m9s",
        overflow=dict(PAPER_OVERFLOW), loss_scaling={"mode": "dynamic", "init_scale": 2.0**16},
        promotion_threshold=0.01)
    every["pick"] = space_policy(graph, paper, input_high_rest_low(graph, paper))
    for name, path in SPACE_ALL_LOW.items():
        space = load_space(path)
        every[name] = space_policy(graph, space, uniform(graph, space, "low").assignment)
    return every


@dataclass
class Row:
    name: str
    measured: int
    predicted: int | None
    step: Callable[[], object]
    eager: str | None  # a compiled row's eager counterpart (None: an eager row)


def measure_row(name: str, model: torch.nn.Module, batch: tuple[torch.Tensor, torch.Tensor], device: torch.device,
                predicted: int | None, eager: str | None, autocast: torch.dtype | None, timeline: bool) -> Row:
    """The row's step measured after two steps (momentum buffers made, compiled kernels built)."""
    model = model.to(device)
    step = sgd_step(model, torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9, weight_decay=5e-4),
                    *(tensor.to(device) for tensor in batch), autocast=autocast, warmup=2)
    if device.type == "cuda":
        return Row(name, measure_peak(step, device), predicted, step, eager)
    memory = trace_step(step)
    if timeline:
        print(f"\n{name}: {memory.summary()}")
    return Row(name, memory.peak, predicted, step, eager)


def setting_rows(spec: str, image_size: int, batch_size: int, device: torch.device, args: argparse.Namespace
                 ) -> list[Row]:
    """Plain fp32, autocast bf16, the eager policies, then plain torch.compile and the compiled policies."""
    torch.manual_seed(0)
    plain = build(spec)
    g = torch.Generator().manual_seed(1)
    batch = (torch.randn(batch_size, 3, image_size, image_size, generator=g),
             torch.randint(0, 10, (batch_size,), generator=g))
    graph = trace(plain, batch[0][:2], batch_size=batch_size)
    cost, every = CostModel(graph), policies(graph)
    chosen = [name for name in args.policies.split(",") if name]
    compiled = [name for name in args.compiled.split(",") if name]
    plan: list[tuple[str, Policy | None, str | None, torch.dtype | None]] = [  # (row, policy, its eager row, autocast)
        ("plain fp32", None, None, None), ("autocast bf16", None, None, torch.bfloat16)]
    plan += [(name, every[name], None, None) for name in chosen]
    plan += [(f"{name}, {args.min_slices} slices", every[name], None, None) for name in chosen if args.min_slices > 1]
    plan += [(f"{name}, {FLOAT32_GRADS}", every[name], None, None) for name in chosen if args.float32_grads]
    plan += [(f"{name}, {FLOAT32_ACTIVATION_GRADS}", every[name], None, None) for name in chosen
             if args.float32_activation_grads]
    plan += [(f"{name}, {FINER}", every[name], None, None) for name in chosen if args.finer_slices]
    plan += [("plain fp32, torch.compile", None, "plain fp32", None)] if compiled else []
    plan += [(f"{name}, compiled", every[name], name, None) for name in compiled]
    sliced_rules = OP_RULES.with_min_slices(args.min_slices)
    sliced_cost = CostModel(trace(plain, batch[0][:2], batch_size=batch_size, rules=sliced_rules))
    rows = []
    for name, policy, eager, autocast in plan:
        model = copy.deepcopy(plain)
        row_rules, row_cost = (sliced_rules, sliced_cost) if name.endswith(" slices") else (OP_RULES, cost)
        hold = (lambda: False) if name.endswith(FLOAT32_GRADS) else no_process_group
        slices = row_cost.finer_slices(policy.assignment(graph)) if name.endswith(FINER) else None
        if policy is not None:  # the paper's space grows its loss scale once per "epoch": any length will do
            model = apply_policy(model, policy, compile=eager is not None, steps_per_epoch=100, rules=row_rules,
                                 hold_gradients=hold, gradient_codes=not name.endswith(FLOAT32_ACTIVATION_GRADS),
                                 slices=slices)
        elif eager is not None:
            model = torch.compile(model, fullgraph=True)
        unpriced = autocast or name.endswith((FLOAT32_GRADS, FLOAT32_ACTIVATION_GRADS))  # the cost model prices
        predicted = None if unpriced else row_cost.peak_bytes(  # held gradients, and gradients as codes
            None if policy is None else policy.assignment(graph), slices)
        rows.append(measure_row(name, model, batch, device, predicted, eager, autocast, args.timeline))
    return rows


def table(rows: list[Row], device: torch.device, repeats: int) -> str:
    """The markdown table: each row against plain fp32, autocast bf16 and (compiled) its eager row; step times."""
    measured = {row.name: row.measured for row in rows}
    fp32, autocast = measured["plain fp32"], measured["autocast bf16"]
    eager = [row for row in rows if row.eager is None]
    times = dict(zip([row.name for row in eager], median_step_times([row.step for row in eager], device, repeats),
                     strict=True)) if repeats else {}
    head = ("| step | peak measured (MiB) | x plain fp32 | x autocast bf16 | x its eager row | peak predicted (MiB) "
            "| predicted/measured |" + (" step time (ms) | x plain fp32 |" if times else ""))
    lines = [head, "|" + " --- |" * (head.count("|") - 1)]
    for row in rows:
        cells = [f"{row.measured / MIB:.3f}", f"{row.measured / fp32:.3f}", f"{row.measured / autocast:.3f}",
                 "-" if row.eager is None else f"{row.measured / measured[row.eager]:.3f}"]
        cells += (["-", "-"] if row.predicted is None else
                  [f"{row.predicted / MIB:.3f}", f"{row.predicted / row.measured:.3f}"])
        if times:
            seconds = times.get(row.name)
            cells += ["-", "-"] if seconds is None else [f"{1000 * seconds:.1f}",
                                                         f"{seconds / times['plain fp32']:.2f}"]
        lines.append(f"| {row.name} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="resnet18", help="zoo spec, e.g. resnet18:width=0.25")
    parser.add_argument("--width", type=float, default=None, help="the model's width (or give it in --model)")
    parser.add_argument("--image-size", type=int, default=32)
    parser.add_argument("--batch", type=int, default=128)
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    parser.add_argument("--suite", action="store_true", help="every setting of SUITE (ignores model, size, batch)")
    parser.add_argument("--timeline", action="store_true", help="print the blocks at each measured peak")
    parser.add_argument("--policies", default=DEFAULT_POLICIES, help="eager policy rows")
    parser.add_argument("--compiled", default="", help="policies also measured compiled (e.g. hfp8,all-low)")
    parser.add_argument("--time", type=int, default=0, metavar="N", help="eager step times, median of N")
    parser.add_argument("--float32-grads", action="store_true",
                        help="also each eager policy with its weight gradients kept in .grad as float32 during the "
                             "backward (hold_gradients off: the step before they were held as codes), for an A/B")
    parser.add_argument("--finer-slices", action="store_true",
                        help="also each eager policy with the sliced backwards at its predicted peak in more slices "
                             "(CostModel.finer_slices)")
    parser.add_argument("--float32-activation-grads", action="store_true",
                        help="also each eager policy with its rounded activation gradients handed on float32 "
                             "(gradient_codes off: the step before they travelled as codes), for an A/B")
    parser.add_argument("--min-slices", type=int, default=1, metavar="N",
                        help="also each eager policy with its sliced backwards in at least N slices of the batch "
                             "(OpRules.with_min_slices)")
    args = parser.parse_args()
    device = torch.device(args.device)
    spec = args.model if args.width is None else f"{args.model}{',' if ':' in args.model else ':'}width={args.width}"
    settings = SUITE if args.suite else ((spec, args.image_size, args.batch),)
    unknown = sorted(set(args.policies.split(",") + args.compiled.split(",")) - {""} - set(POLICY_NAMES))
    if unknown:
        parser.error(f"unknown policy {unknown[0]!r}; use any of {', '.join(POLICY_NAMES)}")
    where = torch.cuda.get_device_name(device) if device.type == "cuda" else (
        f"CPU, kernels {torch.backends.cpu.get_cpu_capability()}")
    for model_spec, image_size, batch_size in settings:
        print(f"\n{model_spec}, {image_size}x{image_size}, batch {batch_size}: torch {torch.__version__}, "
              f"SGD(momentum=0.9, wd=5e-4); {where}\n")
        rows = setting_rows(model_spec, image_size, batch_size, device, args)
        print(table(rows, device, args.time), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
