"""The FX tracer: trace the model with torch.fx, run the graph with gradients on the example, and record per
op its output shapes, what autograd saved while it ran (``attrs["saves"]``, recorded with saved_tensors_hooks:
derived, not guessed) and the GEMMs it ran where FX cannot see (``attrs["hidden_gemms"]``, recorded by a
dispatch mode)."""

from __future__ import annotations

import operator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from precsearch.errors import PrecsearchError
from precsearch.graph.op_rules import OpRules, call_name
from precsearch.graph.raw_ops import (
    LeafSpec,
    OpNamer,
    ParamRef,
    RawOp,
    describe,
    flat_sources,
    live_ops,
    output_layout,
    output_leaves,
    split_sources,
)
from precsearch.graph.runs import record_runs


class FxTracer(torch.fx.Tracer):
    """torch.fx's tracer with precsearch's leaf modules, noting the innermost submodule whose forward it was
    tracing when tracing failed (``failed_in``; None: the model's own forward), which may then be traced as one
    op (precsearch.graph.tracing)."""

    def __init__(self, leaf: LeafSpec) -> None:
        super().__init__()
        self.leaf = leaf
        self.failed_in: str | None = None

    def is_leaf_module(self, m: nn.Module, module_qualified_name: str) -> bool:
        return self.leaf(m, module_qualified_name)

    def call_module(self, m: nn.Module, forward: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        try:
            return super().call_module(m, forward, args, kwargs)
        except Exception:
            if self.failed_in is None:  # the innermost: its frame unwinds first
                self.failed_in = self.path_of_module(m)
            raise


class _GemmRecorder(TorchDispatchMode):
    """Records the GEMMs torch dispatches while it is active, below FX: those run inside a leaf function."""

    def __init__(self, rules: OpRules) -> None:
        super().__init__()
        self.rules = rules
        self.seen: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if self.rules.aten_gemm(name):
            self.seen.append(f"aten.{name}")
        return func(*args, **(kwargs or {}))


@dataclass(frozen=True)
class _Saved:
    """One storage autograd saved while a node ran: a value of node `node` (output `position`, None when it is
    a storage no node made), and its whole storage's bytes and element size (the fallback price)."""

    node: str | None
    position: int
    nbytes: int
    itemsize: int


class _ShapeRecorder(torch.fx.Interpreter):
    """Runs a GraphModule with gradients and keeps, by node name: `describe` of its value, the storages
    autograd saved while it ran (`_Saved`, what the cost model prices: derived, not guessed) and the GEMMs it
    dispatched. Every value stays alive, so a storage address names one storage for the whole run."""

    def __init__(self, module: torch.fx.GraphModule, rules: OpRules) -> None:
        super().__init__(module)
        self.rules = rules
        self.extra_traceback = False
        self.records: dict[str, list[tuple[int, ...] | None] | None] = {}
        self.layouts: dict[str, Any] = {}  # node name -> its outputs' positions as its value nests them
        self.saves: dict[str, list[_Saved]] = {}
        self.gemms: dict[str, list[str]] = {}
        self._params = {p.untyped_storage().data_ptr() for p in module.parameters()}
        self._writer: dict[int, tuple[str, int]] = {}  # storage address -> (node, output) that last wrote it
        self._alive: list[Any] = []

    def run(self, *args: Any, **kwargs: Any) -> Any:
        with torch.enable_grad():
            return super().run(*args, **kwargs)

    def run_node(self, n: torch.fx.Node) -> Any:
        saved: list[torch.Tensor] = []
        recorder = _GemmRecorder(self.rules)
        with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t), recorder:
            result = super().run_node(n)
        self.records[n.name] = describe(result)
        self.layouts[n.name] = output_layout(result)
        own = {t.untyped_storage().data_ptr(): (n.name, i) for i, t in enumerate(output_leaves(result))
               if isinstance(t, torch.Tensor)}
        entries: dict[int, _Saved] = {}
        for tensor in saved:
            ptr = tensor.untyped_storage().data_ptr()
            if ptr in entries or ptr in self._params:
                continue
            node, position = own.get(ptr) or self._writer.get(ptr) or (None, 0)
            entries[ptr] = _Saved(node, position, tensor.untyped_storage().nbytes(), tensor.element_size())
        self._writer.update(own)
        self.saves[n.name] = list(entries.values())
        self.gemms[n.name] = recorder.seen
        self._alive.append((result, saved))
        return result


def _fx_ops(gm: torch.fx.GraphModule, run: _ShapeRecorder, rules: OpRules) -> list[RawOp]:
    """Raw ops of a traced graph, with pass-throughs resolved to the activations they carry, that reach the
    graph's output. Each op's attrs hold what autograd saved while it ran (`saves`, see `_saved_items`) and,
    for an op that is no GEMM itself, the GEMMs it ran inside (`hidden_gemms`): FX cannot see into it."""
    records = run.records
    sources: dict[str, Any] = {}  # node name -> activation id, ParamRef, tuple of those, or None
    ops: list[RawOp] = []
    namer = OpNamer(gm)
    outputs: list[str] = []
    for node in gm.graph.nodes:
        out = records.get(node.name)
        if node.op == "output":
            outputs = split_sources(sources.get(n.name) for n in node.all_input_nodes)[0]
        if node.op == "placeholder":
            if not ops and out is not None:
                ops.append(RawOp(namer.function(node.name), node.name, "input", "input", [], [], out, {}))
                sources[node.name] = ops[-1].activation_ids()[0]
            continue
        if node.op == "get_attr":
            value = operator.attrgetter(node.target)(gm)
            is_param = isinstance(value, nn.Parameter)
            sources[node.name] = ParamRef(node.target, node.target, value) if is_param else None
            continue
        if node.op not in ("call_module", "call_function", "call_method") or out is None:
            continue
        arg_sources = [sources.get(n.name) for n in node.all_input_nodes]
        if node.op == "call_module":
            module = gm.get_submodule(node.target)
            module_type, rule = type(module).__name__, rules.module(module)
        else:
            module_type, in_place = call_name(node.target)
            rule = rules.function(module_type)
        if rule.pass_through:
            sources[node.name] = _select(node, sources, arg_sources)
            continue
        if all(shape is None for shape in out):
            continue
        activations, params = split_sources(arg_sources)
        if node.op == "call_module":
            op = RawOp.of_module(*namer.module(node.target), node.name, module, node.target, rule, activations, out)
        else:
            op = RawOp.of_function(namer.function(node.name), node.name, module_type, in_place, rule, activations,
                                   params, out, node.args, node.kwargs)
        ops.append(op)
        sources[node.name] = _nested(run.layouts[node.name], op.activation_ids())
        op.attrs["saves"] = _saved_items(run.saves[node.name], sources)
        if not rule.gemm and run.gemms[node.name]:
            op.attrs["hidden_gemms"] = sorted(set(run.gemms[node.name]))
    return live_ops(ops, outputs)


def _saved_items(saves: list[_Saved], sources: dict[str, Any]) -> list[list[Any]]:
    """What an op saved, for the cost model: ["activation", id] for a storage holding an activation of the
    graph (views and layout copies included), else ["new", numel, itemsize] for a storage autograd or the op
    made (a clone of an in-place op's input, BN statistics, a dropout mask, indices, values computed inside
    a leaf function), at its own dtype."""
    items: list[list[Any]] = []
    for saved in saves:
        source = sources.get(saved.node) if saved.node is not None else None
        if isinstance(source, tuple):
            flat = flat_sources(source)
            source = flat[saved.position] if saved.position < len(flat) else None
        if isinstance(source, str):
            items.append(["activation", source])
        else:
            items.append(["new", saved.nbytes // saved.itemsize, saved.itemsize])
    return items


def _nested(layout: Any, ids: list[str | None]) -> Any:
    """An op's activation ids nested as its value nests its outputs (``output_layout``): getitem picks from it."""
    return tuple(_nested(item, ids) for item in layout) if isinstance(layout, tuple) else ids[layout]


def _select(node: torch.fx.Node, sources: dict[str, Any], arg_sources: list[Any]) -> Any:
    """What a pass-through carries: the element of a multi-output op for getitem, else its first input's data."""
    if node.target is operator.getitem and isinstance(node.args[1], int):
        carried = sources.get(node.args[0].name) if isinstance(node.args[0], torch.fx.Node) else None
        if isinstance(carried, tuple):
            return carried[node.args[1]]
    return next((source for source in arg_sources if source is not None), None)


def trace_fx(gm: torch.fx.GraphModule, name: str, model: nn.Module, x: torch.Tensor, grow: bool,
             rules: OpRules) -> tuple[list[RawOp], dict[str, list[Any]]]:
    """Raw ops of the traced graph with shapes at the example batch, and shapes at one more sample if `grow`
    (the numel of each storage an op saved then holds both points, for `trace` to extrapolate)."""
    runs = record_runs(lambda: _ShapeRecorder(gm, rules), name, model, x, grow, None)
    ops = _fx_ops(gm, runs[0], rules)
    if not grow:
        return ops, {}
    grown = {op.name: op for op in _fx_ops(gm, runs[1], rules)}
    for op in ops:
        if "saves" in op.attrs:
            op.attrs["saves"] = _grow_saves(op, grown.get(op.name), x.shape[0])
    return ops, {op.name: runs[1].records.get(op.node) or [None] * len(op.shapes) for op in ops}


def _grow_saves(op: RawOp, grown: RawOp | None, b0: int) -> list[list[Any]]:
    """`op`'s saves with each new storage's numel as [numel at b0, numel at b0 + 1], extrapolated by `trace`."""
    saves = op.attrs["saves"]
    other = grown.attrs["saves"] if grown is not None else None
    if other is None or [item[:1] for item in other] != [item[:1] for item in saves]:
        raise PrecsearchError(f"op {op.name} saves different tensors for backward at batch {b0} and {b0 + 1}, so "
                              "its saved bytes at the training batch cannot be inferred; pass an example input "
                              "at the training batch size")
    return [[item[0], [item[1], more[1]], item[2]] if item[0] == "new" else item
            for item, more in zip(saves, other, strict=True)]
