"""`precsearch trace MODEL`: a model's tensor graph as tables: groups and their tensors, MiB per group and
kind, and activation memory counted the paper's way and autograd's way. `--json` writes the whole graph;
`--check` measures the saved bytes against the prediction and lists the ops not enforced
(precsearch.analysis.checks)."""

from __future__ import annotations

import argparse
from typing import Any

from precsearch.cli._arguments import add_model_argument, count, input_shape, path

DEFAULT_BATCH = 128
EXAMPLE_BATCH = 2


HELP = "show a model's tensors, groups and memory"
DESCRIPTION = "Trace MODEL into its tensor graph and print its groups, tensors, shapes and memory."


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_model_argument(parser)
    parser.add_argument("--batch-size", type=count, default=DEFAULT_BATCH, metavar="N",
                        help=f"training batch size the shapes are given at (default {DEFAULT_BATCH})")
    parser.add_argument("--input-shape", type=input_shape, default=None, metavar="C,H,W",
                        help="per-sample input shape (default 3,32,32, the zoo's CIFAR form)")
    parser.add_argument("--leaf", nargs="+", action="extend", default=[], metavar="MODULE_TYPE",
                        help="module class names (or qualified module names) to keep as single ops")
    parser.add_argument("--json", type=path, metavar="FILE", help="also write the graph as JSON to FILE (atomically)")
    parser.add_argument("--check", action="store_true",
                        help="also measure one training forward at the batch size: saved bytes predicted vs "
                             "measured in fp32 and under the hfp8 and fp16 policies, and the ops not enforced "
                             "(exit status 1 when a figure is off by more than 2%%)")


def report(graph: Any, cost: Any) -> str:
    """The text `precsearch trace` prints for a TensorGraph and its CostModel."""
    import pandas as pd

    from precsearch.cost.model import MIB

    rows = [{"group": info.group, "tensor": tid, "kind": info.kind, "shape": str(info.shape),
             "MiB": info.numel * 4 / MIB}
            for tid, info in graph.tensors.items() if info.kind in ("weight", "activation")]
    tensors = pd.DataFrame(rows).sort_values("group", kind="stable")
    tensors["group"] = tensors["group"].where(tensors["group"].ne(tensors["group"].shift()), "")
    fp32_act = cost.activation_bytes() / MIB
    fp32_saved = cost.saved_activation_bytes() / MIB
    paper = cost.group_assignment([True] * cost.n_groups)
    lines = [
        f"{graph.model_name}: {len(graph.ops)} ops, {len(graph.groups)} groups, {len(graph.tensors)} tensors, batch "
        f"{graph.batch_size}, input {graph.input_shape}, traced with {graph.tracer}, fingerprint {graph.fingerprint()}",
        "",
        "Weights and activations by group (fp32; each has a gradient of the same shape):",
        tensors.to_string(index=False, float_format=lambda v: f"{v:.3f}"),
        "",
        "MiB per group and kind (fp32; master weights and momentum are the optimizer's fp32 copies):",
        cost.breakdown().to_string(float_format=lambda v: f"{v:.3f}"),
        "",
        f"Activations, fp32: {fp32_act:.2f} MiB counting every op output (the paper); "
        f"{fp32_saved:.2f} MiB saved by autograd for backward (predicted).",
        f"All groups low ({cost.high} high; {', '.join(f'{k} {v}' for k, v in cost.low.items())}): "
        f"assignable tensors {cost.bytes(paper) / MIB:.2f} MiB vs {cost.bytes() / MIB:.2f} MiB fp32 and "
        f"{cost.bytes_batch([False] * cost.n_groups)[0] / MIB:.2f} MiB all high; autograd saves "
        f"{cost.saved_activation_bytes(paper) / MIB:.2f} MiB.",
    ]
    hidden = graph.unenforced()
    if hidden:  # an nn.LSTM, a leaf function: one op, rounded at its boundary
        lines.append(f"WARNING: {len(hidden)} op(s) rounded at their boundary only, the GEMMs inside them in "
                     f"float32: {'; '.join(f'{name} ({why})' for name, why in hidden.items())}")
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    import torch

    from precsearch.cost.model import CostModel
    from precsearch.graph.tracing import trace
    from precsearch.models import INPUT_SHAPE, build

    shape = args.input_shape or INPUT_SHAPE
    model = build(args.model)
    example = torch.randn((EXAMPLE_BATCH, *shape), generator=torch.Generator().manual_seed(0))
    graph = trace(model, example, batch_size=args.batch_size, leaf_modules=args.leaf, model_name=args.model)
    if args.json:
        graph.save(args.json)
    print(report(graph, CostModel(graph)))
    if not args.check:
        return 0
    from precsearch.analysis.checks import check_model

    batch = torch.randn((args.batch_size, *shape), generator=torch.Generator().manual_seed(1))
    result = check_model(model, batch, leaf_modules=args.leaf, name=args.model)
    print(f"\n{result.summary()}")
    return 0 if result.ok else 1
