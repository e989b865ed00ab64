"""The paper's groups: ops, tensors and groups of a TensorGraph from the raw ops a tracer recorded.

In execution order each input or GEMM op opens a group and other ops join the current one (see `Group`).
"""

from __future__ import annotations

import math
from dataclasses import replace

import torch

from precsearch.config.spec import TensorId
from precsearch.graph.op_rules import OpRules
from precsearch.graph.raw_ops import RawOp
from precsearch.graph.types import Group, OpInfo, TensorGraph, TensorInfo, grad_id


def assemble(raw_ops: list[RawOp], model_name: str, batch_size: int, input_shape: tuple[int, ...],
             tracer: str, gm: torch.fx.GraphModule | None, rules: OpRules,
             opaque_modules: tuple[str, ...] = ()) -> TensorGraph:
    """Groups, tensors and ops from raw ops whose shapes are at the training batch."""
    group_of_op: dict[str, int] = {}
    producer: dict[str, str] = {}
    consumers: dict[str, list[str]] = {}
    group = -1
    for op in raw_ops:
        if op.role in ("input", "gemm") or group < 0:
            group += 1
        group_of_op[op.name] = group
        for tensor_id in op.activation_ids():
            if tensor_id is not None:
                producer[tensor_id] = op.name
        for tensor_id in op.inputs:
            consumers.setdefault(tensor_id, []).append(op.name)
    param_users: dict[int, list[str]] = {}
    for op in raw_ops:
        for ref in op.params:
            users = param_users.setdefault(id(ref.param), [])
            if op.name not in users:
                users.append(op.name)

    tensors: dict[str, TensorInfo] = {}
    ops: list[OpInfo] = []
    weight_ids: dict[int, str] = {}
    for op in raw_ops:
        own = group_of_op[op.name]
        input_groups = {group_of_op[producer[t]] for t in op.inputs}
        weight_group = input_groups.pop() if len(input_groups) == 1 else own
        param_ids = []
        for ref in op.params:
            if id(ref.param) not in weight_ids:
                weight = TensorId(op.name, "weight", param=ref.local)
                weight_ids[id(ref.param)] = str(weight)
                shape = tuple(ref.param.shape)
                users = tuple(param_users[id(ref.param)])
                kinds = ["weight"]
                if ref.param.requires_grad:
                    kinds += ["weight_grad", "master_weight", "optimizer_state"]
                for kind in kinds:
                    tensor_id = str(replace(weight, kind=kind))
                    tensors[tensor_id] = TensorInfo(tensor_id, kind, op.name, op.node, op.module_type,
                                                    ref.qualname, shape, math.prod(shape), weight_group, None, users)
            if weight_ids[id(ref.param)] not in param_ids:
                param_ids.append(weight_ids[id(ref.param)])
        outputs = []
        for tensor_id, shape in zip(op.activation_ids(), op.shapes, strict=True):
            if tensor_id is None or shape is None:
                continue
            outputs.append(tensor_id)
            kinds = ["activation"] if op.role == "input" else ["activation", "activation_grad"]
            for kind in kinds:
                full_id = tensor_id if kind == "activation" else grad_id(tensor_id)
                tensors[full_id] = TensorInfo(full_id, kind, op.name, op.node, op.module_type, None, shape,
                                              math.prod(shape), own, op.name, tuple(consumers.get(tensor_id, ())))
        ops.append(OpInfo(op.name, op.node, op.role, op.module_type, own,
                          tuple(dict.fromkeys(producer[t] for t in op.inputs)), tuple(outputs), tuple(op.inputs),
                          tuple(param_ids), dict(op.attrs), op.module, op.call))
    groups = [Group(index, tuple(o.name for o in ops if o.group == index),
                    tuple(tid for tid, info in tensors.items() if info.group == index))
              for index in range(group + 1)]
    return TensorGraph(model_name, batch_size, input_shape, tensors, ops, groups, tracer, gm, rules, opaque_modules)
