"""What both tracers share: an op as a tracer sees it, which modules are one op, op names, and the facts the
op rules say to record about a call."""

from __future__ import annotations

import itertools
from collections import Counter
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from precsearch.config.spec import TensorId
from precsearch.errors import PrecsearchError
from precsearch.graph.op_rules import OpRule, OpRules


@dataclass(frozen=True, eq=False)
class ParamRef:
    """A parameter reaching an op: qualified name, name as the op sees it, the object (identity dedupes it)."""

    qualname: str
    local: str
    param: nn.Parameter


@dataclass
class RawOp:
    """An op as a tracer sees it, with output shapes at the example batch (None: not a float tensor)."""

    name: str
    node: str
    role: str
    module_type: str
    inputs: list[str]
    params: list[ParamRef]
    shapes: list[tuple[int, ...] | None]
    attrs: dict[str, Any]
    module: str | None = None  # the qualified name of the module it calls (None: a function call or the input)
    call: int = 0  # which call of that module (0: the first)

    @classmethod
    def of_module(cls, name: str, call: int, node: str, module: nn.Module, qualname: str, rule: OpRule,
                  inputs: list[str], shapes: list[tuple[int, ...] | None]) -> RawOp:
        """The ``call``-th call of leaf module ``module`` (at ``qualname``), whose rule is ``rule``."""
        return cls(name, node, _role(rule), type(module).__name__, inputs, _module_params(module, qualname), shapes,
                   _module_attrs(module, rule), qualname, call)

    @classmethod
    def of_function(cls, name: str, node: str, module_type: str, in_place: bool, rule: OpRule, inputs: list[str],
                    params: list[ParamRef], shapes: list[tuple[int, ...] | None], args: Sequence[Any],
                    kwargs: dict[str, Any]) -> RawOp:
        """A call of function or method ``module_type`` (as ``call_name`` gives it) with ``args``/``kwargs``."""
        return cls(name, node, _role(rule), module_type, inputs, params, shapes,
                   _function_attrs(rule, in_place, args, kwargs))

    def activation_ids(self) -> list[str | None]:
        return [None if shape is None else str(TensorId(self.name, "activation", index))
                for index, shape in enumerate(self.shapes)]


def _role(rule: OpRule) -> str:
    """An op's role in the graph: ``gemm`` opens a group (the input op's role is ``input``)."""
    return "gemm" if rule.gemm else "other"


def output_leaves(value: Any) -> list[Any]:
    """An op's outputs by position: the value itself, or the items of its (nested) tuples and lists in order
    (an LSTM's ``(out, (h, c))`` is out, h, c). Tracers and the runtime number outputs by this one order."""
    if isinstance(value, tuple | list):
        return [leaf for item in value for leaf in output_leaves(item)]
    return [value]


def with_leaves(value: Any, leaves: Iterable[Any]) -> Any:
    """``value`` with its ``output_leaves`` replaced, in order, by ``leaves`` (same nesting and container types)."""
    remaining = iter(leaves)

    def rebuild(item: Any) -> Any:
        if not isinstance(item, tuple | list):
            return next(remaining)
        items = [rebuild(inner) for inner in item]
        return type(item)(*items) if hasattr(item, "_fields") else type(item)(items)  # a namedtuple's fields

    return rebuild(value)


def output_layout(value: Any) -> Any:
    """The ``output_leaves`` positions of ``value`` as plain tuples nested as the value nests them: 0 for one value,
    ``(0, (1, 2))`` for an LSTM's ``(out, (h, c))``: what a ``getitem`` of the value picks."""
    positions = itertools.count()

    def walk(item: Any) -> Any:
        return tuple(walk(inner) for inner in item) if isinstance(item, tuple | list) else next(positions)

    return walk(value)


def flat_sources(source: Any) -> list[Any]:
    """The sources of a value's ``output_leaves`` positions, from its sources nested as its ``output_layout``."""
    return [leaf for item in source for leaf in flat_sources(item)] if isinstance(source, tuple) else [source]


def describe(value: Any) -> list[tuple[int, ...] | None] | None:
    """Output shapes of a value, one entry per ``output_leaves`` position: a float tensor's shape, else None; None
    when it holds no tensor at all."""
    leaves = output_leaves(value)
    if not any(isinstance(leaf, torch.Tensor) for leaf in leaves):
        return None
    return [tuple(leaf.shape) if isinstance(leaf, torch.Tensor) and leaf.is_floating_point() else None
            for leaf in leaves]


def tensors_in(value: Any) -> Iterator[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, (tuple, list)):
        for item in value:
            yield from tensors_in(item)
    elif isinstance(value, dict):
        for item in value.values():
            yield from tensors_in(item)


def _module_attrs(module: nn.Module, rule: OpRule) -> dict[str, Any]:
    """What the cost model's autograd rules need of a module call (see `OpInfo`)."""
    attrs: dict[str, Any] = {}
    if getattr(module, "inplace", False):
        attrs["inplace"] = True
    if rule.records == "running_stats":
        attrs["running_stats"] = bool(module.track_running_stats)
    if rule.records == "dropout":
        attrs["p"] = float(module.p)
    return attrs


def _function_attrs(rule: OpRule, in_place: bool, args: Sequence[Any], kwargs: dict[str, Any]) -> dict[str, Any]:
    """What the cost model's autograd rules need of a function call, read from its arguments."""
    attrs: dict[str, Any] = {}
    if in_place or kwargs.get("inplace") is True:
        attrs["inplace"] = True
    if rule.records == "running_stats":
        running = kwargs.get("running_mean", args[1] if len(args) > 1 else None)
        attrs["running_stats"] = running is not None
    if rule.records == "dropout":
        attrs["p"] = float(kwargs.get("p", args[1] if len(args) > 1 else 0.5))
        attrs["training"] = bool(kwargs.get("training", args[2] if len(args) > 2 else True))
    return attrs


def _module_params(module: nn.Module, qualname: str) -> list[ParamRef]:
    prefix = f"{qualname}." if qualname else ""
    return [ParamRef(prefix + local, local, param) for local, param in module.named_parameters()]


class LeafSpec:
    """Which modules are traced as one op: torch.nn's own modules (FX's default), GEMM layers (subclasses too,
    e.g. precsearch.runtime.accumulate's chunked layers) and modules whose own class the op rules name, plus the
    user's choice, given as module classes, class names or qualified module names."""

    def __init__(self, model: nn.Module, leaf_modules: Iterable[type | str], rules: OpRules) -> None:
        self.rules = rules
        self.types: tuple[type, ...] = tuple(item for item in leaf_modules if isinstance(item, type))
        self.names = {item for item in leaf_modules if isinstance(item, str)}
        bad = [item for item in leaf_modules if not isinstance(item, (type, str))]
        if bad:
            raise PrecsearchError(f"leaf module {bad[0]!r} is neither a module class nor a name; give "
                                  "classes, class names or qualified module names")
        present = {type(m).__name__ for m in model.modules()} | {name for name, _ in model.named_modules()}
        missing = sorted(self.names - present)
        if missing:
            raise PrecsearchError(f"leaf module {missing[0]!r} names no module type or module of "
                                  f"{type(model).__name__}; types present: "
                                  f"{', '.join(sorted({type(m).__name__ for m in model.modules()}))}")
        self.default = torch.fx.Tracer()

    def __call__(self, module: nn.Module, qualname: str) -> bool:
        if isinstance(module, self.types) or type(module).__name__ in self.names or qualname in self.names:
            return True
        if self.rules.knows_module(module) or self.rules.module(module).gemm:
            return True
        return self.default.is_leaf_module(module, qualname)


class OpNamer:
    """Unique op names: a module call is named by its qualified name (`#k` added on its k-th later call, which
    the op also carries as fields: ``RawOp.module``, ``RawOp.call``); a function call by an FX-style name (`add`,
    `add_1`, ...) that is never a module's qualified name or an earlier op's name."""

    def __init__(self, model: nn.Module) -> None:
        self.modules = {qualname for qualname, _ in model.named_modules()}
        self.used: set[str] = set()
        self.calls: Counter[str] = Counter()

    def module(self, qualname: str) -> tuple[str, int]:
        """The name of this call of module ``qualname``, and which call it is (0: the first)."""
        call = self.calls[qualname]
        self.calls[qualname] += 1
        name = qualname if call == 0 else f"{qualname}#{call}"
        self.used.add(name)
        return name, call

    def function(self, candidate: str) -> str:
        name, suffix = candidate, 0
        while name in self.used or name in self.modules:
            suffix += 1
            name = f"{candidate}_{suffix}"
        self.used.add(name)
        return name


def live_ops(ops: list[RawOp], outputs: Iterable[str]) -> list[RawOp]:
    """The input op and the ops whose outputs reach the model's output: an op computed only for control flow
    (`x.sum() > 0`) or left unused gets no gradient and is not a training tensor."""
    live = set(outputs)
    kept = []
    for op in reversed(ops):
        if op.role == "input" or any(tensor_id in live for tensor_id in op.activation_ids()):
            kept.append(op)
            live.update(op.inputs)
    return kept[::-1]


def split_sources(arg_sources: Iterable[Any]) -> tuple[list[str], list[ParamRef]]:
    """Activation ids (deduplicated, in order) and parameters among an op's argument sources."""
    activations: list[str] = []
    params: list[ParamRef] = []
    for source in arg_sources:
        for item in flat_sources(source):
            if isinstance(item, str) and item not in activations:
                activations.append(item)
            elif isinstance(item, ParamRef):
                params.append(item)
    return activations, params
