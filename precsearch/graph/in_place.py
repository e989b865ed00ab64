"""Where the runtime's rounding may write over a value rather than beside it: an op's output its backward does
not read, an activation's gradient that reaches the rounding as a tensor nothing else holds. Read from the op
rules and the traced FX graph (who reads each output, how often)."""

from __future__ import annotations

from collections.abc import Iterator

import torch

from precsearch.graph.op_rules import OpRules
from precsearch.graph.types import OpInfo, TensorGraph


def makes_fresh_output(op: OpInfo, rules: OpRules) -> bool:
    """Whether ``op`` makes new output tensors that a rounding after it may overwrite: its backward does not read
    them (a GEMM, a normalization, a pooling, an out-of-place sum or product), or reads only its own output (a
    ReLU, a sigmoid), whose save the runtime switches to the codes of that rounding, so the raw output has no
    reader after it (where the format has codes: else the save keeps the raw output, and the rounding is made beside
    it)."""
    rule = rules.op_type(op.module_type)
    return not op.attrs.get("inplace") and (op.role == "gemm" or rule.fresh_output or rule.saves == ("output",))


def _sole_readers(graph: TensorGraph) -> Iterator[tuple[OpInfo, OpInfo, int]]:
    """Each op whose output one op alone reads in the traced graph: (op, reader, times the reader reads it)."""
    ops = {op.node: op for op in graph.ops}
    for node in graph.graph_module.graph.nodes:
        users = list(node.users)
        if node.name in ops and len(users) == 1 and users[0].name in ops:
            yield ops[node.name], ops[users[0].name], _count_reads(users[0], node)


def _count_reads(user: torch.fx.Node, node: torch.fx.Node) -> int:
    reads: list[bool] = []
    torch.fx.node.map_arg((user.args, user.kwargs), lambda arg: reads.append(arg is node))
    return sum(reads)


def gradient_arrives_fresh(graph: TensorGraph) -> frozenset[str]:
    """The ops whose (single) output's gradient reaches its rounding as a new tensor nothing else holds: the
    output has one reader in the traced graph, which reads it once and whose backward makes new input
    gradients (a GEMM, a normalization, an activation function, a pooling), so that rounding may write over
    it. Empty for an untraced model."""
    if graph.graph_module is None:
        return frozenset()
    return frozenset(op.name for op, reader, reads in _sole_readers(graph) if reads == 1 and (
        reader.role == "gemm" or graph.rules.op_type(reader.module_type).fresh_input_gradient))


def gradient_passes_from(graph: TensorGraph) -> dict[str, str]:
    """The ops whose (single) output is read once, by an add and nothing else, each with that add: the output's
    gradient is the add's output gradient itself (or, for a broadcast input, a new sum of it). Where the runtime
    rounded that gradient to the output gradient's own format, rounding it again changes no value, so it may be
    rounded over itself although the add's other input holds it too. Empty for an untraced model."""
    if graph.graph_module is None:
        return {}
    return {op.name: reader.name for op, reader, reads in _sole_readers(graph)
            if reads == 1 and graph.rules.op_type(reader.module_type).passes_gradient}
