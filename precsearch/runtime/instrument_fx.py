"""FX instrumentation: the traced graph rewritten with rounding modules, as torch.ao's prepare_fx inserts observers.

A copy of the traced FX graph gets a ``Rounder`` after every op that makes a rounded tensor and an ``Alias``
after every layout op that copies one; layer calls with low weights compute with them rounded at their use,
and layers over packed tensors run their sliced backward (precsearch.runtime.sliced). Ops that run GEMMs inside
an FX leaf function or module are rounded at their boundary only (``TensorGraph.unenforced``).
"""

from __future__ import annotations

import copy

from torch import fx, nn

from precsearch.graph.types import TensorGraph
from precsearch.runtime.rounding import (
    Alias,
    GradUse,
    RoundedWeight,
    RoundedWeightsCall,
    Rounder,
    Rounding,
    rounder_for,
)
from precsearch.runtime.sites import SitePlan
from precsearch.runtime.sliced import PACKED_INPUT, PackedInputCall, PackedOutputRelu, Slicing
from precsearch.runtime.state import Slot

__all__ = ["instrument_fx"]


def instrument_fx(graph: TensorGraph, plan: SitePlan, module: nn.Module, rounding: Rounding,
                  replaced: dict[str, nn.Module] | None = None, in_place: bool = True) -> fx.GraphModule:
    """A copy of ``graph``'s FX graph (calling ``module``'s submodules, with ``replaced`` swapped in) with a
    ``Rounder`` after every op that makes a rounded tensor, an ``Alias`` after every layout op (contiguous,
    reshape, ...) that may copy a rounded activation, and every call of a submodule or read of a parameter that
    uses low weights, or a layer with a sliced backward, replaced (``_layer_call``): torch.ao's prepare_fx, with
    rounding modules for observers, at the sites of ``plan``: an output whose gradient the plan rounds per use
    gets a ``GradUse`` before each consumer, which rounds that consumer's gradient instead. Where the plan
    allows it (``OpSites.fresh_output``, ``OpSites.fresh_gradient``), a rounding writes over the op's output and
    over the gradient it receives; without ``in_place``, never."""
    source = graph.graph_module
    gm = fx.GraphModule(source, copy.deepcopy(source.graph), type(module).__name__)
    traced = dict(gm.named_modules())
    for name, layer in (replaced or {}).items():
        if name in traced:
            gm.set_submodule(name, layer)
    rounders, carried = _insert_rounders(gm, graph, plan, rounding, in_place)
    _insert_aliases(gm, plan, rounding, rounders, carried)
    for name, (node, inserted) in rounders.items():
        if plan.of_op(name).per_use:
            _round_per_use(gm, node, inserted, rounding)
    for name, (_, inserted) in rounders.items():
        add = plan.of_op(name).gradient_from
        if in_place and add in rounders and set(inserted.slots) == {0}:
            inserted.grad_source = rounders[add][1].slots.get(0, (None, None))[1]
    low = {sites.node for sites in plan.ops if sites.op in rounders and 0 in carried[rounders[sites.op][0]]}
    _replace_layer_calls(gm, plan, module, rounding, Slicing(graph.rules), traced, carried, low)
    gm.graph.lint()
    gm.recompile()
    return gm


def _insert(gm: fx.GraphModule, after: fx.Node, node: fx.Node, name: str, inserted: nn.Module) -> fx.Node:
    """A call of ``inserted`` on ``node``, after ``after``, read by every other use of ``node``."""
    gm.add_submodule(name, inserted)
    with gm.graph.inserting_after(after):
        new = gm.graph.call_module(name, (node,))
    node.replace_all_uses_with(new, delete_user_cb=lambda user: user is not new)
    return new


def _insert_rounders(gm: fx.GraphModule, graph: TensorGraph, plan: SitePlan, rounding: Rounding, in_place: bool
                     ) -> tuple[dict[str, tuple[fx.Node, Rounder]], dict[fx.Node, dict[int, Slot]]]:
    """A ``Rounder`` after every op of ``graph`` that makes a rounded tensor; returns, by op, the rounding's node
    and module, and, by node, the rounded activation slot of each output it carries."""
    nodes = {node.name: node for node in gm.graph.nodes}
    last_placeholder = [node for node in gm.graph.nodes if node.op == "placeholder"][-1]
    rounders: dict[str, tuple[fx.Node, Rounder]] = {}
    carried: dict[fx.Node, dict[int, Slot]] = {}
    for index, op in enumerate(graph.ops):
        sites = plan.of_op(op.name)
        inserted = rounder_for(sites, rounding)
        if inserted is None:
            continue
        # every use of the op's output now reads the rounding's: it may overwrite an output nothing saved
        inserted.in_place = in_place and sites.fresh_output
        inserted.grad_in_place = in_place and sites.fresh_gradient and set(inserted.slots) == {0}
        node = nodes[op.node]
        after = last_placeholder if node.op == "placeholder" else node
        new = _insert(gm, after, node, f"precsearch_round_{index}", inserted)
        passes = in_place and sites.gradient_from is not None
        reader = next(iter(new.users)) if inserted.grad_in_place or passes else None  # the one
        if reader is not None and reader.op == "call_module":
            inserted.__dict__["reader"] = gm.get_submodule(reader.target)  # the user's, not a child
        carried[new] = {position: act for position, (act, _) in inserted.slots.items() if act.is_low}
        rounders[op.name] = new, inserted
    return rounders, carried


def _insert_aliases(gm: fx.GraphModule, plan: SitePlan, rounding: Rounding,
                    rounders: dict[str, tuple[fx.Node, Rounder]], carried: dict[fx.Node, dict[int, Slot]]) -> None:
    """An ``Alias`` after every layout op of the plan (``SitePlan.aliases``) whose value holds a low rounded
    activation at position 0; ``carried`` gains the nodes that carry one on."""
    nodes = {node.name: node for node in gm.graph.nodes}
    for index, site in enumerate(plan.aliases):
        made = carried.get(rounders[site.op][0], {}) if site.op in rounders else {}
        slots = {position: made[source] for position, source in site.carries if source in made}
        node = nodes[site.node]
        if 0 in slots:
            carried[_insert(gm, node, node, f"precsearch_alias_{index}", Alias(rounding, slots[0]))] = slots
        elif slots:
            carried[node] = slots


def _replace_layer_calls(gm: fx.GraphModule, plan: SitePlan, module: nn.Module, rounding: Rounding,
                         slicing: Slicing, traced: dict[str, nn.Module], carried: dict[fx.Node, dict[int, Slot]],
                         low: set[str]) -> None:
    """Every call of one of the user's modules (``traced``) and every parameter read replaced where
    ``_layer_call`` says: a layer whose backward the plan says reads its input's codes (``OpSites.reads_codes``)
    reading a low value (``carried``: a rounding or its alias), or a ReLU whose backward reads its rounded output
    (``OpSites.relu_output``) making one (its node in ``low``: its output rounded low)."""
    for node in list(gm.graph.nodes):
        if node.op == "call_module" and node.target in traced:  # the user's modules, not those inserted
            names = [name for name, _ in gm.get_submodule(node.target).named_parameters()]
            sites = plan.of_node(node.name)
            low_input = sites is not None and sites.reads_codes and bool(carried.get(node.args[0]))
            low_output = sites is not None and sites.relu_output and node.name in low
            inserted = _layer_call(module, rounding, slicing, node.target, names, low_input, low_output,
                                   sites.slices if sites is not None else 1)
            if inserted is not None:
                name = f"precsearch_weights_{node.target.replace('.', '_')}"
                if not hasattr(gm, name):
                    gm.add_submodule(name, inserted)
                node.target = name
        elif node.op == "get_attr":
            inserted = _layer_call(module, rounding, slicing, node.target, None, False, False)
            if inserted is not None:
                _insert(gm, node, node, f"precsearch_weight_{node.target.replace('.', '_')}", inserted)


def _round_per_use(gm: fx.GraphModule, node: fx.Node, inserted: Rounder, rounding: Rounding) -> None:
    """Give each consumer of ``node`` (the rounding node of an op's one output) its own gradient rounding module,
    and take the rounding of the summed gradient off ``inserted``."""
    act, grad = inserted.slots[0]
    users = list(node.users)
    if grad is None:  # the gradient's format is not low
        return
    inserted.slots[0] = (act, None)
    for user in users:
        name = f"precsearch_use_{node.name}_{user.name}"
        gm.add_submodule(name, GradUse(rounding, grad))
        with gm.graph.inserting_before(user):
            use = gm.graph.call_module(name, (node,))
        user.replace_input_with(node, use)


def _layer_call(module: nn.Module, rounding: Rounding, slicing: Slicing, target: str,
                names: list[str] | None, low_input: bool, low_output: bool, slices: int = 1) -> nn.Module | None:
    """What replaces a layer call (``names``: its parameters) or a parameter read (``names`` None): a read of a
    low weight becomes its rounding; a layer whose backward reads the codes of the low activation it reads
    (``low_input``) a ``PackedInputCall``, a ReLU whose backward reads the low activation it makes
    (``low_output``) a ``PackedOutputRelu`` (either in at least ``slices`` slices: ``OpSites.slices``), and another
    call with low weights a ``RoundedWeightsCall``; None when none applies."""
    if names is None:
        rounding.at_use.add(target)
        return RoundedWeight(rounding, target) if target in rounding.weights else None
    layer = module.get_submodule(target)
    if low_output:
        return PackedOutputRelu(rounding.packer, slicing, layer, target, slices)
    params = {name: f"{target}.{name}" for name in names if f"{target}.{name}" in rounding.weights}
    rounding.at_use.update(params.values())
    if low_input:
        return PackedInputCall(rounding, slicing, layer, target, params, PACKED_INPUT[type(layer)], slices)
    return RoundedWeightsCall(rounding, layer, params) if params else None
