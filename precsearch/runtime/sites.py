"""The site plan: where each assignable tensor of a traced graph is rounded, decided once, from the graph and the
op rules it was traced with, and read by every lowering (``instrument_fx``, ``instrument_hooks``, ``compiled``).

* a weight (``WeightSite``) is rounded where the forward reads it, its gradient when it has been accumulated;
* an op's output (``OutputSite``) is rounded after the op, its gradient in the backward: at the value, or, for a
  value with several consumers under ``gradient_rounding: per_use`` (``OpSites.per_use``), before each consumer
  (the paper's reference: each consumer's gradient rounded, their sum not);
* after a ReLU whose rule slices its backward over its output (``OpSites.relu_output``), the ReLU's backward
  reads the rounded output (its mask lies inside the ReLU's own);
* an output an add alone reads (``OpSites.gradient_from``) receives the add's output gradient itself: where the
  add's rounding rounded it as this output's gradient rounds (``Slot.rounds_again_as``), rounding it again
  changes no value, so a lowering may round it over itself (eager) or only count it (compiled).

The plan is structural: which formats are low is the state's (``TensorState``), read by each lowering as it
rounds. A new op rule, tensor kind or rounding position is a change here or in the op rules, not in a lowering.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from torch import nn

from precsearch.config.spec import WEIGHT, TensorId
from precsearch.graph.in_place import gradient_passes_from
from precsearch.graph.op_rules import OpRules
from precsearch.graph.types import TensorGraph, grad_id

__all__ = ["OpSites", "OutputSite", "SitePlan", "WeightSite", "plan_sites", "reads_rounded_output"]


@dataclass(frozen=True)
class OutputSite:
    """One output of an op: which (``position``), its tensor id, and its gradient's id (None: not assignable)."""

    position: int
    value: str
    gradient: str | None


@dataclass(frozen=True)
class OpSites:
    """The rounded outputs of one op (``node``: its FX node, empty for a hook trace)."""

    op: str
    node: str
    outputs: tuple[OutputSite, ...]
    per_use: bool  # the gradient is rounded before each consumer, not at the value (one output, several readers)
    relu_output: bool  # a ReLU whose backward reads its rounded output
    gradient_from: str | None = None  # the add whose rounded output gradient this one output's gradient is


@dataclass(frozen=True)
class WeightSite:
    """A parameter the policy may hold low: its qualified name, tensor id and gradient's id."""

    param: str
    value: str
    gradient: str | None


class SitePlan:
    """Every rounding site of a graph: per op that makes assignable tensors, and per weight."""

    def __init__(self, ops: tuple[OpSites, ...], weights: tuple[WeightSite, ...]) -> None:
        self.ops, self.weights = ops, weights
        self._by_op = {sites.op: sites for sites in ops}

    def of_op(self, op: str) -> OpSites | None:
        """The sites of op ``op`` (None: it makes no assignable tensor)."""
        return self._by_op.get(op)


def plan_sites(graph: TensorGraph, per_use: bool) -> SitePlan:
    """The rounding sites of ``graph``; ``per_use``: the policy's ``gradient_rounding == "per_use"``."""
    assignable = set(graph.assignable_ids())

    def gradient_of(tensor_id: str) -> str | None:
        return grad_id(tensor_id) if grad_id(tensor_id) in assignable else None

    readers, relus = _fx_nodes(graph)
    ops = {}
    for op in graph.ops:
        outputs = tuple(OutputSite(TensorId.parse(tensor_id).index, tensor_id, gradient_of(tensor_id))
                        for tensor_id in op.outputs if tensor_id in assignable)
        if outputs:
            single = len(outputs) == 1 and outputs[0].position == 0 and outputs[0].gradient is not None
            ops[op.name] = OpSites(op.name, op.node, outputs, per_use and single and readers.get(op.node, 0) > 1,
                                   op.node in relus)
    for name, add in gradient_passes_from(graph).items():
        if name in ops and add in ops and _one_rounded_gradient(ops[name]) and _one_rounded_gradient(ops[add]):
            ops[name] = replace(ops[name], gradient_from=add)
    weights = tuple(WeightSite(info.param, tensor_id, gradient_of(tensor_id))
                    for tensor_id, info in graph.tensors.items()
                    if tensor_id in assignable and info.kind == WEIGHT)
    return SitePlan(tuple(ops.values()), weights)


def _one_rounded_gradient(sites: OpSites) -> bool:
    """Whether ``sites`` round one output, at position 0, and its gradient at the value (not per use)."""
    return ([out.position for out in sites.outputs] == [0] and sites.outputs[0].gradient is not None
            and not sites.per_use)


def reads_rounded_output(rules: OpRules, layer: nn.Module) -> bool:
    """Whether ``layer``'s backward may read its rounded output: a plain ``nn.ReLU`` whose rule slices the
    backward over its output (its mask where the rounded output is positive lies inside its own)."""
    sliced = rules.module(layer).sliced
    return type(layer) is nn.ReLU and sliced is not None and sliced.reads == "output"


def _fx_nodes(graph: TensorGraph) -> tuple[dict[str, int], set[str]]:
    """FX node name -> how many nodes read it, and the nodes that call a ReLU whose backward reads its rounded
    output; both empty for a hook trace."""
    if graph.graph_module is None:
        return {}, set()
    nodes = graph.graph_module.graph.nodes
    relus = {node.name for node in nodes if node.op == "call_module"
             and reads_rounded_output(graph.rules, graph.graph_module.get_submodule(node.target))}
    return {node.name: len(node.users) for node in nodes}, relus
