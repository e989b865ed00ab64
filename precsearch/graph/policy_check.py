"""A policy held against a traced model's graph: the rules that name nothing in it, the tensors no rule covers,
and whether the policy was made for this graph at all.

``check_policy`` reports; ``verify_policy`` raises where training under the policy would silently do something
else than it says (precsearch.runtime.model.apply_policy calls it). A module is checked by tracing it first
(precsearch.analysis.checks.check_policy_on_model, which also names the modules the trace did not see).
"""

from __future__ import annotations

import difflib
import fnmatch
import logging
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from torch import nn

from precsearch.config.policy import ACCUMULATION_LAYER_TYPES, Policy, is_glob
from precsearch.errors import PrecsearchError, echo
from precsearch.graph.types import TensorGraph

log = logging.getLogger(__name__)

__all__ = ["PolicyReport", "check_policy", "policy_example_input", "verify_policy"]


@dataclass
class PolicyReport:
    """What ``check_policy`` found: rules naming nothing in the model, tensors no rule covers, graph identity."""

    model: str
    policy_fingerprint: str | None
    graph_fingerprint: str
    missing: list[str] = field(default_factory=list)
    uncovered: list[str] = field(default_factory=list)
    unenforced: list[str] = field(default_factory=list)  # ops the runtime rounds only at their boundary
    hints: dict[str, list[str]] = field(default_factory=dict)  # missing rule -> the closest names in the model
    untraced: list[str] = field(default_factory=list)  # modules of the model that are not in the graph

    def named(self, item: str) -> str:
        """A missing rule with its closest names, e.g. ``override 'conv9:weight' (closest: conv2:weight)``."""
        close = self.hints.get(item)
        return f"{item} (closest: {', '.join(close)})" if close else item

    @property
    def fingerprint_matches(self) -> bool:
        return self.policy_fingerprint is None or self.policy_fingerprint == self.graph_fingerprint

    @property
    def ok(self) -> bool:
        return self.fingerprint_matches and not self.missing and not self.uncovered and not self.untraced

    def summary(self) -> str:
        """A few human-readable lines (what ``precsearch`` commands print)."""
        lines = [f"policy for {self.model or '<unnamed model>'}: graph fingerprint "
                 + ("matches" if self.fingerprint_matches
                    else f"differs ({self.policy_fingerprint} in the policy, {self.graph_fingerprint} here)")]
        if self.missing:
            lines.append(f"{len(self.missing)} rule(s) name nothing in this model: "
                         + ", ".join(self.named(item) for item in self.missing))
        if self.untraced:
            lines.append(f"{len(self.untraced)} module(s) did not run when the model was traced, so no rule "
                         f"covers them and their memory is not counted: {', '.join(self.untraced)}")
        if self.uncovered:
            lines.append(f"{len(self.uncovered)} tensor(s) covered by no rule (kept fp32): "
                         + ", ".join(self.uncovered))
        if self.unenforced:
            lines.append(f"WARNING: {len(self.unenforced)} op(s) not enforced inside (rounded at their boundary "
                         f"only): {'; '.join(self.unenforced)}")
        return "\n".join(lines)


def check_policy(policy: Policy, graph: TensorGraph, untraced: Sequence[str] = ()) -> PolicyReport:
    """Report the rules of ``policy`` that name nothing in ``graph`` and the tensors no rule covers, by name;
    ``untraced`` names the model's modules the trace did not see (passed on to the report)."""
    ids = set(graph.tensors)
    missing = [f"override {echo(key)}" for key in sorted(policy.overrides)
               if (key not in ids if not is_glob(key) else not fnmatch.filter(ids, key))]
    types = {info.module_type for info in graph.tensors.values()}
    missing += [f"module type {echo(name)}" for name in sorted(policy.module_types) if name not in types]
    if policy.accumulation is not None:
        layers = {op.module for op in graph.ops if op.module is not None and op.module_type in ACCUMULATION_LAYER_TYPES}
        missing += [f"accumulation layers {echo(pattern)}" for pattern in policy.accumulation.layers
                    if not fnmatch.filter(layers, pattern)]
    missing += [f"module type {echo(name)} {kind}" for name, rules in sorted(policy.module_types.items())
                if name in types for kind in sorted(rules)
                if not any(t.module_type == name and t.kind == kind for t in graph.tensors.values())]
    uncovered = [tensor_id for tensor_id in graph.assignable_ids()
                 if policy.explain(graph.tensors[tensor_id])[1] == "no rule"]
    unenforced = [f"{name} ({why})" for name, why in graph.unenforced().items()]
    hints = {item: _closest(item, ids, types) for item in missing}
    return PolicyReport(policy.model, policy.graph_fingerprint, graph.fingerprint(), missing, uncovered, unenforced,
                        {item: close for item, close in hints.items() if close}, list(untraced))


def verify_policy(policy: Policy, graph: TensorGraph, strict: bool = True) -> PolicyReport:
    """``check_policy`` that raises when the policy was made for another graph (unless ``strict`` is False) or
    names what the graph lacks (unless the policy allows unmatched rules)."""
    report = check_policy(policy, graph)
    if strict and not report.fingerprint_matches:
        lacking = [item for item in report.missing if item.startswith("override")]
        detail = f"; {len(lacking)} override(s) name nothing here, e.g. {lacking[0]}" if lacking else ""
        raise PrecsearchError(f"policy was made for {policy.model or 'another model'} (graph "
                              f"{policy.graph_fingerprint}), but this model's graph is {report.graph_fingerprint}"
                              f"{detail}; make a policy for this model (or pass strict=False to apply_policy, in "
                              "Python, to apply it anyway)")
    if report.missing:
        named = "; ".join(report.named(item) for item in report.missing[:3])
        if policy.allow_unmatched_rules or not strict:
            log.warning("policy rule(s) name nothing in this model, ignored: %s", named)
        else:
            raise PrecsearchError(f"{len(report.missing)} policy rule(s) name nothing in this model: {named}; "
                                  "fix the names (precsearch trace MODEL lists them), or set "
                                  '"allow_unmatched_rules": true in the policy')
    return report


def policy_example_input(policy: Policy, model: nn.Module | None = None, batch: int = 2) -> torch.Tensor:
    """Zeros of ``(batch, *policy.input_shape)`` on the model's device, for tracing."""
    if policy.input_shape is None:
        raise PrecsearchError("policy has no input_shape; pass an example input")
    device = next((p.device for p in model.parameters()), None) if model is not None else None
    return torch.zeros(batch, *policy.input_shape, device=device)


def _closest(item: str, ids: set[str], types: set[str]) -> list[str]:
    """The model's names nearest to what a missing rule names (tensor ids, or module types)."""
    kind, _, name = item.partition(" '")
    name = name.split("'")[0]
    if kind.startswith("module type"):
        return difflib.get_close_matches(name, sorted(types), n=3, cutoff=0.5)
    if kind.startswith("override"):
        return difflib.get_close_matches(name, sorted(ids), n=3, cutoff=0.5)
    return []
