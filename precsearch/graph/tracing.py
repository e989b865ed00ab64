"""`trace(model, example_input, batch_size=128)`: the tensor graph of a CNN, every tensor training keeps, who
produces and uses it, and the paper's groups.

The model is traced with torch.fx (`precsearch.graph.fx_trace`), falling back to module hooks
(`precsearch.graph.hook_trace`) when FX cannot trace it, and run on the example input to learn every shape; the
result is a `precsearch.graph.types.TensorGraph` grouped as the paper does (`precsearch.graph.groups`):

- ops in execution order: the input, each leaf-module call, each function/method call that makes a new
  float tensor. Layout-only ops (pass-through in the op rules: view, reshape, flatten, contiguous, transpose,
  chunk, getitem, size, ...) create no tensor; their consumers are linked to the op that made the data. A copy
  made by `contiguous()`/`reshape()` of a transposed tensor (channel shuffle) is counted as that same
  tensor: autograd saves nothing for layout ops, so this matches the measured saved bytes.
- what each op is (GEMM, pass-through, what it saves, ...) comes from the op rules
  (`precsearch.graph.op_rules`), `rules=` to trace with another table; the graph keeps them (`rules`).
- per op (FX traces), what autograd saved while it ran (`attrs["saves"]`) and the GEMMs it ran where FX cannot
  see (`hidden_gemms`; `TensorGraph.unenforced`).

Shapes are those at the training batch size. When `batch_size` differs from the example's batch, the model
runs twice on tiny batches (the example, and the example plus one sample) and every dimension is
extrapolated linearly, which is exact for any shape that grows linearly with the batch (flatten included).
Tracing leaves the model as it found it: modes, buffers (BN running stats) and torch's global RNG state
(`training_mode`).
"""

from __future__ import annotations

import warnings
from collections.abc import Iterable

import torch
from torch import nn

from precsearch.errors import PrecsearchError, described
from precsearch.graph.fx_trace import FxTracer, trace_fx
from precsearch.graph.groups import assemble
from precsearch.graph.hook_trace import trace_hooks
from precsearch.graph.op_rules import OP_RULES, OpRules
from precsearch.graph.raw_ops import LeafSpec
from precsearch.graph.runs import extrapolate, extrapolate_save, shape_runs, training_mode
from precsearch.graph.types import TensorGraph


def trace(model: nn.Module, example_input: torch.Tensor, batch_size: int | None = None,
          leaf_modules: Iterable[type | str] = (), model_name: str | None = None,
          rules: OpRules = OP_RULES) -> TensorGraph:
    """Trace `model` on `example_input` (a small batch such as (2, 3, 32, 32); 2 or more when BatchNorm sees
    (N, C) tensors) into a TensorGraph whose shapes are at `batch_size` (default: the example's batch).

    `leaf_modules` (classes, class names or qualified module names) are kept as single ops, besides torch.nn's
    own modules and those the op `rules` name (default: the table, `precsearch.graph.op_rules`), which also say
    what each op is. A submodule torch.fx cannot trace (data-dependent control flow) is traced as one op, with
    one warning naming it (`opaque_modules`); where FX cannot trace the model's own forward, the whole model is
    traced with module hooks, with one warning, and `graph_module` is None. `model_name` defaults to the class name.
    A forward that fails, or returns no float tensor, raises PrecsearchError with one line."""
    name = model_name or type(model).__name__
    if not isinstance(model, nn.Module):
        raise PrecsearchError(f"trace needs a torch.nn.Module, got {type(model).__name__}")
    if not isinstance(example_input, torch.Tensor) or example_input.dim() == 0:
        raise PrecsearchError(f"example input for {name} must be a batched tensor such as torch.randn(2, 3, 32, "
                              f"32), got {type(example_input).__name__}")
    b0 = example_input.shape[0]
    target = b0 if batch_size is None else batch_size
    if isinstance(target, bool) or not isinstance(target, int) or target < 1 or b0 < 1:
        raise PrecsearchError(f"batch size must be a positive integer, got {target!r} (example batch {b0})")
    with training_mode(model), shape_runs():
        gm, opaque, fx_error = _trace_fx_module(model, list(leaf_modules), rules, name)
        if gm is not None:
            ops, shapes1 = trace_fx(gm, name, model, example_input, b0 != target, rules)
        else:
            leaf = LeafSpec(model, list(leaf_modules), rules)
            ops, shapes1 = trace_hooks(model, leaf, name, example_input, fx_error, b0 != target)
            warnings.warn(f"torch.fx could not trace {name} ({described(fx_error)}); "  # after: a forward that
                          "tracing it with module hooks instead", stacklevel=2)  # fails says it in its error
    for op in ops:
        extrapolated = shapes1.get(op.name, op.shapes)
        op.shapes = [extrapolate(s0, s1, b0, target, op.name) if b0 != target else s0
                     for s0, s1 in zip(op.shapes, extrapolated, strict=True)]
        if b0 != target and "saves" in op.attrs:
            op.attrs["saves"] = [extrapolate_save(item, b0, target, op.name) for item in op.attrs["saves"]]
    graph = assemble(ops, name, target, tuple(example_input.shape[1:]), "fx" if gm is not None else "hooks", gm,
                     rules, opaque)
    missed = untraced_modules(model, graph, leaf_modules) if gm is None else []
    if missed:  # the hook tracer sees only the branch the example input took
        warnings.warn(f"{len(missed)} module(s) of {name} did not run on the example input, so no policy covers "
                      f"them and their memory is not counted: {', '.join(missed[:8])}; trace with a real batch "
                      "that takes every branch (PrecisionModel warns if they run)", stacklevel=2)
    return graph


def _trace_fx_module(model: nn.Module, leaf_modules: list[type | str], rules: OpRules,
                     name: str) -> tuple[torch.fx.GraphModule | None, tuple[str, ...], BaseException | None]:
    """``model``'s FX GraphModule, the submodules FX could not trace and that it keeps as single ops instead
    (one warning each: only their boundary is rounded), and, where FX cannot trace the model's own forward,
    None and the error (the hook tracer takes the whole model then)."""
    opaque: list[str] = []
    while True:
        tracer = FxTracer(LeafSpec(model, [*leaf_modules, *opaque], rules))
        try:
            graph = tracer.trace(model)
        except Exception as error:  # any FX failure: inside a submodule, trace it as one op
            if tracer.failed_in is None or tracer.failed_in in opaque:
                return None, (), error
            opaque.append(tracer.failed_in)
            module = model.get_submodule(tracer.failed_in)
            warnings.warn(f"torch.fx could not trace {tracer.failed_in} ({type(module).__name__}) of {name} "
                          f"({described(error)}): it runs as one op, its inputs, weights and output rounded, the "
                          "values inside it float32; the rest of the model is traced (and compiled) as usual",
                          stacklevel=3)
            continue
        return torch.fx.GraphModule(tracer.root, graph, name), tuple(opaque), None


def untraced_modules(model: nn.Module, graph: TensorGraph, leaf_modules: Iterable[type | str] = ()) -> list[str]:
    """Leaf modules of ``model`` that are not ops of ``graph``: they did not run when it was traced (a branch
    the example input did not take, or a module the forward never calls). Code that runs but is not in the
    graph is covered by no policy rule and counted by no memory prediction. Layout-only modules make no op."""
    leaf = LeafSpec(model, list(leaf_modules), graph.rules)
    traced = {op.module for op in graph.ops}
    leaves: list[str] = []
    missed = []
    for qualname, module in model.named_modules():
        if not qualname or not leaf(module, qualname) or any(qualname.startswith(f"{p}.") for p in leaves):
            continue
        leaves.append(qualname)
        if qualname not in traced and not graph.rules.module(module).pass_through:
            missed.append(qualname)
    return missed
