"""Policies made for one traced model, with the cost model's prediction of their memory.

A ``Policy`` (precsearch.config.policy) is plain data; what ties one to a model is its identity (name, graph
fingerprint, input shape, batch size) and its ``predicted`` bytes, which only a graph and the cost model can
give. ``policy_for_graph`` fills both in; ``policy_from_assignment`` writes an assignment (tensor id -> format)
as a compact policy first.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping
from typing import Any

from precsearch.config.policy import Policy
from precsearch.config.spec import ASSIGNABLE_KINDS
from precsearch.cost.model import CostModel
from precsearch.errors import PrecsearchError
from precsearch.formats.scaled import format_name
from precsearch.graph.types import TensorGraph

__all__ = ["policy_for_graph", "policy_from_assignment", "prediction"]


def prediction(policy: Policy, graph: TensorGraph) -> dict[str, Any]:
    """A policy's ``predicted`` entry for ``graph``: its bytes, the fp32 bytes, their ratio, the low share, the
    saved activation bytes and the peak of a training step (the memory a user runs out of) beside plain fp32's,
    from the cost model."""
    cost = CostModel(graph)
    assignment = policy.assignment(graph)
    total, fp32 = cost.bytes(assignment), cost.bytes({})
    return {"bytes": int(total), "fp32_bytes": int(fp32), "ratio": float(total) / float(fp32) if fp32 else 1.0,
            "low_share": float(cost.low_share(assignment)),
            "saved_activation_bytes": int(cost.saved_activation_bytes(assignment)),
            "peak_bytes": int(cost.peak_bytes(assignment)), "fp32_peak_bytes": int(cost.peak_bytes(None))}


def policy_for_graph(graph: TensorGraph, **fields: Any) -> Policy:
    """A policy with ``fields`` for the model ``graph`` was traced from: its identity comes from the graph (``fields``
    may override it) and ``predicted`` from the cost model."""
    identity = {"model": graph.model_name, "graph_fingerprint": graph.fingerprint(),
                "input_shape": tuple(graph.input_shape) if graph.input_shape is not None else None,
                "batch_size": graph.batch_size}
    policy = Policy(**{**identity, **fields})
    return policy.replace(predicted=prediction(policy, graph))


def policy_from_assignment(graph: TensorGraph, assignment: Mapping[str, Any], **fields: Any) -> Policy:
    """A compact policy for ``graph`` giving exactly ``assignment`` (ids not named are fp32), with its prediction:
    each kind's most common format becomes its default, the rest exact-id overrides; ``fields`` set any other."""
    unknown = sorted(set(assignment) - set(graph.assignable_ids()))
    if unknown:
        raise PrecsearchError(f"assignment names {len(unknown)} id(s) the graph lacks, e.g. {unknown[0]!r}; "
                              "build it from this model's graph")
    specs = {tensor_id: format_name(assignment.get(tensor_id, "fp32"), f"assignment[{tensor_id!r}]")
             for tensor_id in graph.assignable_ids()}
    defaults: dict[str, str] = {}
    for kind in ASSIGNABLE_KINDS:
        counts = Counter(spec for tensor_id, spec in specs.items() if graph.tensors[tensor_id].kind == kind)
        if counts:
            defaults[kind] = counts.most_common(1)[0][0]
    overrides = {tensor_id: spec for tensor_id, spec in specs.items()
                 if spec != defaults[graph.tensors[tensor_id].kind]}
    return policy_for_graph(graph, **{"defaults": defaults, "overrides": overrides, **fields})
