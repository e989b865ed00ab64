"""The fallback tracer, for models torch.fx cannot trace (data-dependent control flow): forward hooks on leaf
modules record module calls, and a TorchFunctionMode records the torch functions and tensor methods called
outside leaf modules. It sees only the branch the example input takes, and records no saves."""

from __future__ import annotations

import inspect
from collections.abc import Iterable
from typing import Any

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from precsearch.errors import PrecsearchError
from precsearch.graph.op_rules import call_name
from precsearch.graph.raw_ops import (
    LeafSpec,
    OpNamer,
    ParamRef,
    RawOp,
    describe,
    live_ops,
    output_leaves,
    split_sources,
    tensors_in,
)
from precsearch.graph.runs import record_runs


class _HookRecorder(TorchFunctionMode):
    """The fallback tracer (see the module docstring). Data flow follows tensor identity (every tensor seen is kept
    alive, so ids are never reused while tracing)."""

    def __init__(self, model: nn.Module, leaf: LeafSpec, input_name: str) -> None:
        super().__init__()
        self.model, self.leaf, self.input_name = model, leaf, input_name
        self.ops: list[RawOp] = []
        self.sources: dict[int, Any] = {}
        self.params = {id(p): name for name, p in model.named_parameters()}
        self.alive: list[Any] = []
        self.depth = 0
        self.namer = OpNamer(model)

    def run(self, x: torch.Tensor) -> Any:
        name = self.namer.function(self.input_name)
        self.ops.append(RawOp(name, name, "input", "input", [], [], describe(x), {}))
        self._bind(x, self.ops[-1])
        handles = []
        for qualname, module in self.model.named_modules():
            if module is not self.model and self.leaf(module, qualname) and not self._inside_leaf(qualname):
                handles.append(module.register_forward_pre_hook(self._enter))
                handles.append(module.register_forward_hook(self._make_exit(qualname)))
        try:
            with self:
                output = self.model(x)
        finally:
            for handle in handles:
                handle.remove()
        self.ops = live_ops(self.ops, split_sources(map(self._source, tensors_in(output)))[0])
        return output

    def _inside_leaf(self, qualname: str) -> bool:
        parts = qualname.split(".")
        return any(self.leaf(self.model.get_submodule(".".join(parts[:i])), ".".join(parts[:i]))
                   for i in range(1, len(parts)))

    def _bind(self, value: Any, op: RawOp) -> None:
        ids = op.activation_ids()
        for leaf, tensor_id in zip(output_leaves(value), ids, strict=True):
            if isinstance(leaf, torch.Tensor):
                self.sources[id(leaf)] = tensor_id
        self.alive.append(value)

    def _source(self, tensor: torch.Tensor) -> Any:
        """A parameter's ParamRef, else the activation id (or tuple) the tensor carries, else None."""
        if id(tensor) in self.params:
            return ParamRef(self.params[id(tensor)], self.params[id(tensor)], tensor)
        return self.sources.get(id(tensor))

    def _inputs(self, args: Iterable[Any]) -> tuple[list[str], list[ParamRef]]:
        return split_sources(self._source(tensor) for tensor in tensors_in(list(args)))

    def _enter(self, module: nn.Module, args: Any) -> None:
        self.depth += 1

    def _make_exit(self, qualname: str):
        def exit_hook(module: nn.Module, args: Any, output: Any) -> None:
            self.depth -= 1
            shapes = describe(output)
            if shapes is None:
                return
            rule = self.leaf.rules.module(module)
            if rule.pass_through:
                self._pass_through(args, output)
                return
            if all(shape is None for shape in shapes):
                return
            activations, _ = self._inputs(args)
            name, call = self.namer.module(qualname)
            op = RawOp.of_module(name, call, name, module, qualname, rule, activations, shapes)
            self.ops.append(op)
            self._bind(output, op)

        return exit_hook

    def _pass_through(self, args: Iterable[Any], output: Any) -> None:
        carried = next((s for s in map(self._source, tensors_in(list(args))) if s is not None), None)
        for tensor in tensors_in(output):
            self.sources[id(tensor)] = carried
        self.alive.append(output)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        output = func(*args, **kwargs)
        if self.depth > 0:
            return output
        shapes = describe(output)
        if shapes is None:
            return output
        module_type, in_place = call_name(func)
        rule = self.leaf.rules.function(module_type)
        if rule.pass_through:
            self._pass_through([*args, *kwargs.values()], output)
            return output
        if all(shape is None for shape in shapes):
            return output
        activations, params = self._inputs([*args, *kwargs.values()])
        name = self.namer.function(module_type)
        op = RawOp.of_function(name, name, module_type, in_place, rule, activations, params, shapes, args, kwargs)
        self.ops.append(op)
        self._bind(output, op)
        return output


def trace_hooks(model: nn.Module, leaf: LeafSpec, name: str, x: torch.Tensor, fx_error: BaseException | None,
                grow: bool) -> tuple[list[RawOp], dict[str, list[Any]]]:
    """Raw ops from module hooks (see `_HookRecorder`), and shapes at one more sample if `grow`."""
    parameters = list(inspect.signature(model.forward).parameters)
    input_name = parameters[0] if parameters else "input"
    runs = [recorder.ops for recorder in
            record_runs(lambda: _HookRecorder(model, leaf, input_name), name, model, x, grow, fx_error)]
    if not grow:
        return runs[0], {}
    if [op.name for op in runs[0]] != [op.name for op in runs[1]]:
        raise PrecsearchError(f"{name} runs different ops at batch {x.shape[0]} and {x.shape[0] + 1}, so shapes at the "
                              "training batch cannot be inferred; pass an example input at the training batch size")
    return runs[0], {op.name: op.shapes for op in runs[1]}
