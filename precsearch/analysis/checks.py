"""Does precsearch hold up on a user's model? The saved bytes the cost model predicts against those measured,
and the ops the runtime cannot enforce.

Saved bytes decide the memory an assignment buys, so both sides are measured, not assumed: in fp32 against
autograd's own (`measure_saved_bytes`, saved_tensors_hooks), under a policy against what the runtime's packer
kept in one training forward. `precsearch trace MODEL --check` prints `ModelCheck.summary()`;
benchmarks/zoo_check.py runs it over torchvision's zoo. `check_policy_on_model` holds a policy against a model
as `apply_policy` traces it.
"""

from __future__ import annotations

import copy
from collections.abc import Iterable
from dataclasses import dataclass, field

import torch
from torch import nn

from precsearch.config.policy import Policy
from precsearch.cost.model import MIB, CostModel, measure_saved_bytes
from precsearch.graph.policy_check import PolicyReport, check_policy, policy_example_input
from precsearch.graph.tracing import trace, untraced_modules
from precsearch.runtime.accumulate import CHUNKED_LAYERS
from precsearch.runtime.model import apply_policy
from precsearch.search.strategies import baseline

TOLERANCE = 0.02  # the agreement the cost model is held to (tests and the zoo check)


@dataclass(frozen=True)
class ModelCheck:
    """Saved bytes of one model at one batch: fp32 predicted and measured, and per policy (runtime kept,
    predicted); the ops the runtime rounds only at their boundary (`TensorGraph.unenforced`)."""

    model: str
    batch_size: int
    fp32_predicted: int
    fp32_measured: int
    runtime: dict[str, tuple[int, int]] = field(default_factory=dict)
    unenforced: dict[str, str] = field(default_factory=dict)

    @property
    def fp32_error(self) -> float:
        """Relative error of the fp32 prediction (predicted / measured - 1)."""
        return self.fp32_predicted / self.fp32_measured - 1

    def ratio(self, policy: str) -> float:
        """Runtime saved / predicted under `policy`."""
        kept, predicted = self.runtime[policy]
        return kept / predicted

    @property
    def ok(self) -> bool:
        """Every figure within `TOLERANCE`."""
        return abs(self.fp32_error) <= TOLERANCE and all(abs(self.ratio(p) - 1) <= TOLERANCE for p in self.runtime)

    def summary(self) -> str:
        lines = [f"Check of {self.model} at batch {self.batch_size}: bytes saved for backward, predicted vs "
                 f"measured (within {TOLERANCE:.0%}: {'yes' if self.ok else 'NO'})",
                 f"  fp32: predicted {self.fp32_predicted / MIB:.3f} MiB, measured {self.fp32_measured / MIB:.3f} "
                 f"MiB (autograd), error {self.fp32_error:+.1%}"]
        lines += [f"  {policy}: runtime kept {kept / MIB:.3f} MiB, predicted {predicted / MIB:.3f} MiB, ratio "
                  f"{self.ratio(policy):.3f}" for policy, (kept, predicted) in self.runtime.items()]
        if self.unenforced:
            lines.append(f"  WARNING: {len(self.unenforced)} op(s) not enforced inside (rounded at their boundary "
                         "only): " + "; ".join(f"{name} ({why})" for name, why in self.unenforced.items()))
        else:
            lines.append("  unenforced ops: none")
        return "\n".join(lines)


def check_model(model: nn.Module, batch: torch.Tensor, policies: Iterable[str] = ("hfp8", "fp16"),
                leaf_modules: Iterable[type | str] = (), name: str | None = None, seed: int = 0) -> ModelCheck:
    """Trace `model` on two samples of `batch` at its full batch size, as `apply_policy` does, and measure
    one training forward on `batch`: plain (fp32) and under each baseline policy
    (`precsearch.search.strategies.baseline` names). The model is left as it was (the runtime runs on copies)."""
    leaf_modules = list(leaf_modules)
    graph = trace(model, batch[:2], batch_size=batch.shape[0], leaf_modules=leaf_modules, model_name=name)
    cost = CostModel(graph)
    torch.manual_seed(seed)
    measured = measure_saved_bytes(model, batch)
    runtime = {}
    for policy_name in policies:
        policy = baseline(policy_name, graph)
        wrapped = apply_policy(copy.deepcopy(model), policy, batch[:2])
        torch.manual_seed(seed)
        wrapped.train()(batch)
        kept = wrapped.saved_bytes()
        runtime[policy_name] = (kept.activation + kept.other, cost.saved_activation_bytes(policy.assignment(graph)))
    return ModelCheck(graph.model_name, batch.shape[0], cost.saved_activation_bytes(), measured, runtime,
                      graph.unenforced())


def check_policy_on_model(policy: Policy, model: nn.Module, example_input: torch.Tensor | None = None) -> PolicyReport:
    """`check_policy` on `model` traced as `apply_policy` traces it (on `example_input`, or a batch of two zeros of
    the policy's input shape: give a real batch, since a branch zeros do not take is not traced); the report
    also names the model's modules that are not in the graph (`untraced`)."""
    if example_input is None:
        example_input = policy_example_input(policy, model)
    graph = trace(model, example_input, batch_size=policy.batch_size, leaf_modules=CHUNKED_LAYERS)
    return check_policy(policy, graph, untraced_modules(model, graph, CHUNKED_LAYERS))
