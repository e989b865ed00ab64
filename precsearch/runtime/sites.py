"""The site plan: where each assignable tensor of a traced graph is rounded, decided once, from the graph and the
op rules it was traced with, and read by every lowering (``instrument_fx``, ``instrument_hooks``, ``compiled``).

* a weight (``WeightSite``) is rounded where the forward reads it, its gradient when it has been accumulated;
* an op's output (``OutputSite``) is rounded after the op, its gradient in the backward: at the value, or, for a
  value with several consumers under ``gradient_rounding: per_use`` (``OpSites.per_use``), before each consumer
  (the paper's reference: each consumer's gradient rounded, their sum not);
* after a ReLU whose rule slices its backward over its output (``OpSites.relu_output``), the ReLU's backward
  reads the rounded output (its mask lies inside the ReLU's own);
* a Conv2d or BatchNorm2d called on one value, whose rule slices its backward over its input
  (``OpSites.reads_codes``: ``reads_packed_input``), runs its backward over that input's codes, a slice at a time,
  where the input is a rounded value held as codes; a layer swapped for chunked accumulation does not;
* a rounding may write over an op's output where the op makes it new and its backward does not read it, or reads
  it through a save that becomes the rounding's codes (``OpSites.fresh_output``), and over the output's gradient
  where that reaches it as a new tensor nothing else holds (``OpSites.fresh_gradient``; precsearch.graph.in_place):
  the eager lowering does, unless told not to;
* an output an add alone reads (``OpSites.gradient_from``) receives the add's output gradient itself: where the
  add's rounding rounded it as this output's gradient rounds (``Slot.rounds_again_as``), rounding it again
  changes no value, so a lowering may round it over itself (eager) or only count it (compiled);
* a layout op holding an op's rounded output as it is, from its first input (``AliasSite``), may copy it: the
  eager lowering packs the copy as that output's codes (``Alias``);
* an output's rounded gradient travels as its codes (``OpSites.gradient_codes``, precsearch.runtime.gradient_codes)
  where its op's backward hands it on (an add: it waits for the other branch as codes) or reads it a slice at a
  time (a sliced layer whose saved tensor makes several slices); elsewhere a whole decode beside the codes would
  hold more than the float32 gradient. The eager lowerings carry it out; the compiled step keeps float32.

The plan is structural: which formats are low is the state's (``TensorState``), read by each lowering as it
rounds; so is which weight gradients are held as codes to the end of the backward (``Slot.holds_codes``, a
format's width: the plan's weight sites are where they are rounded). A new op rule, tensor kind or rounding
position is a change here or in the op rules, not in a lowering.
"""

from __future__ import annotations

import operator
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, replace
from typing import NamedTuple

from torch import nn

from precsearch.config.spec import WEIGHT, TensorId
from precsearch.errors import PrecsearchError, echo
from precsearch.graph.in_place import gradient_arrives_fresh, gradient_passes_from, makes_fresh_output
from precsearch.graph.op_rules import OpRules, call_name
from precsearch.graph.types import OpInfo, TensorGraph, grad_id

__all__ = ["GRADIENT_CODES", "AliasSite", "OpSites", "OutputSite", "Site", "SitePlan", "WeightSite", "plan_sites",
           "reads_packed_input", "reads_rounded_output"]


@dataclass(frozen=True)
class Site:
    """A tensor the policy may hold low: its id, and its gradient's id (None: not assignable)."""

    value: str
    gradient: str | None


@dataclass(frozen=True)
class OutputSite(Site):
    """One output of an op, at ``position`` among its outputs."""

    position: int


@dataclass(frozen=True)
class WeightSite(Site):
    """A parameter, by its qualified name."""

    param: str


# why an op's rounded output gradient travels as its codes (``OpSites.gradient_codes``): its backward hands it on
# to its inputs, where one waits for another's backward ("waits": an add), or reads it a slice at a time, on a
# device where the sliced backwards slice ("slices": a sliced layer whose saved tensor makes several slices)
GRADIENT_CODES = ("waits", "slices")


@dataclass(frozen=True)
class OpSites:
    """The rounded outputs of one op (``node``: its FX node, empty for a hook trace)."""

    op: str
    node: str
    outputs: tuple[OutputSite, ...]
    per_use: bool  # the gradient is rounded before each consumer, not at the value (one output, several readers)
    relu_output: bool  # a ReLU whose backward reads its rounded output
    reads_codes: bool  # a layer whose backward reads its one input's codes, where that input has them
    fresh_output: bool  # its outputs are new tensors its backward does not read (or reads as the rounding's codes)
    fresh_gradient: bool  # its one output's gradient arrives as a new tensor nothing else holds: likewise
    gradient_from: str | None = None  # the add whose rounded output gradient this one output's gradient is
    gradient_codes: str | None = None  # why its outputs' rounded gradients travel as codes (``GRADIENT_CODES``)
    slices: int = 1  # its sliced backward runs in at least this many slices of the batch (``plan_sites``' slices)


@dataclass(frozen=True)
class AliasSite:
    """A layout op's FX node holding rounded outputs of ``op`` as they are: ``carries`` (its position, op's)."""

    node: str
    op: str
    carries: tuple[tuple[int, int], ...]


class SitePlan:
    """Every rounding site of a graph: per op that makes assignable tensors, per weight; the layout ops after them."""

    def __init__(self, ops: tuple[OpSites, ...], weights: tuple[WeightSite, ...],
                 aliases: tuple[AliasSite, ...] = ()) -> None:
        self.ops, self.weights, self.aliases = ops, weights, aliases
        self._by_op = {sites.op: sites for sites in ops}
        self._by_node = {sites.node: sites for sites in ops}

    def of_op(self, op: str) -> OpSites | None:
        """The sites of op ``op`` (None: it makes no assignable tensor)."""
        return self._by_op.get(op)

    def of_node(self, node: str) -> OpSites | None:
        """The sites of the op FX node ``node`` runs (None: none, or an op that makes no assignable tensor)."""
        return self._by_node.get(node)


def plan_sites(graph: TensorGraph, per_use: bool, chunked: Iterable[str] = (), gradient_codes: bool = True,
               slices: Mapping[str, int] | None = None) -> SitePlan:
    """The rounding sites of ``graph``; ``per_use``: the policy's ``gradient_rounding == "per_use"``; ``chunked``:
    the layers swapped for chunked accumulation (precsearch.runtime.accumulate), whose backward is their own;
    ``gradient_codes=False``: every rounded gradient travels float32 (``OpSites.gradient_codes`` off); ``slices``:
    op name -> at least this many slices in its sliced backward (``CostModel.finer_slices``)."""
    slices = dict(slices or {})
    unknown = sorted(set(slices) - {op.name for op in graph.ops if graph.rules.sliced_saved_tensor(op)})
    if unknown or any(not isinstance(n, int) or n < 1 for n in slices.values()):
        raise PrecsearchError(f"slices must map layers with a sliced backward to counts >= 1; got "
                              f"{echo(unknown[0]) if unknown else echo(slices)}")
    assignable = set(graph.assignable_ids())

    def gradient_of(tensor_id: str) -> str | None:
        return grad_id(tensor_id) if grad_id(tensor_id) in assignable else None

    nodes = _fx_nodes(graph, frozenset(chunked))
    fresh_gradients = gradient_arrives_fresh(graph)
    ops = {}
    for op in graph.ops:
        outputs = tuple(OutputSite(tensor_id, gradient_of(tensor_id), TensorId.parse(tensor_id).index)
                        for tensor_id in op.outputs if tensor_id in assignable)
        if outputs:
            single = len(outputs) == 1 and outputs[0].position == 0 and outputs[0].gradient is not None
            rounds_per_use = per_use and single and nodes.readers.get(op.node, 0) > 1
            at_least = slices.get(op.name, 1)
            ops[op.name] = OpSites(op.name, op.node, outputs, rounds_per_use, op.node in nodes.relus,
                                   op.node in nodes.read_codes, makes_fresh_output(op, graph.rules),
                                   op.name in fresh_gradients,
                                   gradient_codes=_reads_gradient_codes(graph, op, nodes, at_least)
                                   if gradient_codes and not rounds_per_use else None, slices=at_least)
    for name, add in gradient_passes_from(graph).items():
        if name in ops and add in ops and _one_rounded_gradient(ops[name]) and _one_rounded_gradient(ops[add]):
            ops[name] = replace(ops[name], gradient_from=add)
    weights = tuple(WeightSite(tensor_id, gradient_of(tensor_id), info.param)
                    for tensor_id, info in graph.tensors.items()
                    if tensor_id in assignable and info.kind == WEIGHT)
    return SitePlan(tuple(ops.values()), weights, _aliases(graph, ops.values()))


def _reads_gradient_codes(graph: TensorGraph, op: OpInfo, nodes: _FxNodes, at_least: int) -> str | None:
    """Why ``op``'s backward gains from reading its output's rounded gradient as codes (``GRADIENT_CODES``), or
    None: elsewhere its whole decode would be held beside the codes."""
    rule = graph.rules.op_type(op.module_type)
    if rule.passes_gradient:  # not where it would reach a leaf's .grad (a parameter or input added)
        return None if op.node in nodes.reads_leaves else "waits"
    saved = graph.rules.sliced_saved_tensor(op)
    if saved is None or not (op.node in nodes.read_codes or op.node in nodes.relus):
        return None
    return "slices" if graph.rules.sliced_rows(op, graph.tensors, at_least) < graph.tensors[saved].shape[0] else None


def _one_rounded_gradient(sites: OpSites) -> bool:
    """Whether ``sites`` round one output, at position 0, and its gradient at the value (not per use)."""
    return ([out.position for out in sites.outputs] == [0] and sites.outputs[0].gradient is not None
            and not sites.per_use)


def _aliases(graph: TensorGraph, ops: Iterable[OpSites]) -> tuple[AliasSite, ...]:
    """The layout ops (the rules' pass-throughs) carrying a rounded output on from their first input, whose values
    they hold: not ``y``'s in ``x.type_as(y)``, nor ``y``'s through an op the tracer keeps none of (``y > 0``)."""
    gm, aliases = graph.graph_module, []
    carried = {sites.node: (sites.op, {out.position: out.position for out in sites.outputs}) for sites in ops}
    for node in gm.graph.nodes if gm is not None else ():
        source = carried.get(node.all_input_nodes[0].name) if node.all_input_nodes else None
        if source is None or node.target is getattr:  # getattr: x.shape, no tensor
            continue
        rule = (graph.rules.module(gm.get_submodule(node.target)) if node.op == "call_module"
                else graph.rules.function(call_name(node.target)[0]))
        if not rule.pass_through or rule.no_tensor:
            continue
        op, positions = source
        if node.target is operator.getitem and isinstance(node.args[1], int):  # it picks one position
            positions = {0: positions[node.args[1]]} if node.args[1] in positions else {}
        if positions:
            carried[node.name] = op, positions
            aliases.append(AliasSite(node.name, op, tuple(positions.items())))
    return tuple(aliases)


def reads_rounded_output(rules: OpRules, layer: nn.Module) -> bool:
    """Whether ``layer``'s backward may read its rounded output: a plain ``nn.ReLU`` whose rule slices the
    backward over its output (its mask where the rounded output is positive lies inside its own)."""
    sliced = rules.module(layer).sliced
    return type(layer) is nn.ReLU and sliced is not None and sliced.reads == "output"


def reads_packed_input(rules: OpRules, layer: nn.Module) -> bool:
    """Whether ``layer``'s backward may read its input's codes a slice at a time: its rule slices the backward over
    its input, and it is a plain ``nn.Conv2d`` with zero padding given as numbers (``padding="same"`` may pad
    unevenly, which ``aten.convolution_backward`` cannot) or a plain ``nn.BatchNorm2d`` with running statistics
    and a set momentum."""
    sliced = rules.module(layer).sliced
    if sliced is None or sliced.reads != "input":
        return False
    if type(layer) is nn.Conv2d:
        return layer.padding_mode == "zeros" and not isinstance(layer.padding, str)
    return type(layer) is nn.BatchNorm2d and layer.track_running_stats and layer.momentum is not None


class _FxNodes(NamedTuple):
    """What the plan reads off the FX graph's nodes (all empty for a hook trace)."""

    readers: dict[str, int]  # node name -> how many nodes read it
    relus: frozenset[str]  # the calls of a ReLU whose backward reads its rounded output
    read_codes: frozenset[str]  # the calls of a layer, on one value, whose backward may read that value's codes
    reads_leaves: frozenset[str]  # the nodes reading a graph input or a parameter as it is


def _fx_nodes(graph: TensorGraph, chunked: frozenset[str]) -> _FxNodes:
    """The readers of each FX node of ``graph``, its ReLUs that read their rounded output, its calls of a layer
    (not ``chunked``) that may read their one input's codes, and its nodes that read a graph input or parameter."""
    if graph.graph_module is None:
        return _FxNodes({}, frozenset(), frozenset(), frozenset())
    calls = {node: graph.graph_module.get_submodule(node.target)
             for node in graph.graph_module.graph.nodes if node.op == "call_module"}
    return _FxNodes({node.name: len(node.users) for node in graph.graph_module.graph.nodes},
                    frozenset(node.name for node, layer in calls.items() if reads_rounded_output(graph.rules, layer)),
                    frozenset(node.name for node, layer in calls.items()
                              if len(node.args) == 1 and not node.kwargs and node.target not in chunked
                              and reads_packed_input(graph.rules, layer)),
                    frozenset(node.name for node in graph.graph_module.graph.nodes
                              if any(read.op in ("placeholder", "get_attr") for read in node.all_input_nodes)))
