"""Assignment strategies: the paper's technique, its ablations, uniform assignments and prior-work baselines.

An assignment maps every assignable tensor id (weights, activations and their gradients) to a format spec.
Strategies speak in *decisions*: one level name ("high", "low", or a categorical choice of the space) per
decision unit, a group (``g<index>``, the paper's granularity) or, for ``granularity: tensor``, a single tensor.

The paper's technique (Lee, Sharma, Aiken, TMLR 2023) for a memory-saving target ``r`` in [0, 1]: order the
groups by their share of tensor memory, largest first (ties in execution order), and demote whole groups to the
low formats until the low share reaches ``r``; the reference code accepts the result only if its low share lies
in ``[r, r + 0.1]`` (``ACCEPTANCE_WINDOW``; r = 0 and 1 always), which ``sweep(..., window=...)`` applies. Its
divergence guard is the policy's ``promotion_threshold`` and stays on.
"""

from __future__ import annotations

import hashlib
import json
import logging
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from precsearch.config.loss_scaling import PAPER_LOSS_SCALING
from precsearch.config.policy import Policy
from precsearch.config.spaces import SearchSpace
from precsearch.config.spec import ASSIGNABLE_KINDS, BASELINES, PAPER_HIGH, PAPER_LOW, PAPER_OVERFLOW, TensorId
from precsearch.cost import model as cost
from precsearch.cost.policies import policy_for_graph
from precsearch.errors import PrecsearchError
from precsearch.graph.types import OpInfo, TensorGraph

__all__ = [
    "ACCEPTANCE_WINDOW", "ORDERS", "R_GRID", "TORCHAO_LOW", "WANG_LOW", "Candidate", "assign", "assignment_key",
    "baseline", "baseline_policies", "candidate", "group_sizes", "low_share", "paper_assignment", "sweep", "uniform",
    "units",
]

log = logging.getLogger(__name__)

ORDERS: tuple[str, ...] = ("largest", "smallest", "random", "sensitivity")
R_GRID: tuple[float, ...] = tuple(round(0.1 * i, 1) for i in range(11))
ACCEPTANCE_WINDOW = 0.1  # the reference runs r only if the low share it reaches is at most r + 0.1
WANG_LOW = "e5m2s"  # Wang et al. 2018: (1,5,2) weights, activations and activation gradients
# torchao's float8 "tensorwise" recipe, each tensor scaled by its own amax (as search_spaces/fp8_scaled.yaml)
TORCHAO_LOW = {"weight": "e4m3fn@tensor", "activation": "e4m3fn@tensor", "activation_grad": "e5m2@tensor"}


@dataclass(frozen=True)
class Candidate:
    """One assignment with the decisions that made it, the strategy's name and its low-precision share."""

    strategy: str
    decisions: dict[str, str]
    assignment: dict[str, str]
    low_share: float
    r: float | None = None

    @property
    def key(self) -> str:
        return assignment_key(self.assignment)

    def within(self, window: float) -> bool:
        """Whether the reference would accept this candidate: its low share in [r, r + window] (r = 0 or 1,
        and candidates without a target, always)."""
        if self.r is None or self.r in (0.0, 1.0):
            return True
        return self.r - 1e-12 <= self.low_share <= self.r + window + 1e-12


def assignment_key(assignment: Mapping[str, Any]) -> str:
    """Stable hash of an assignment (id -> spec): equal assignments, equal keys, whatever the order."""
    items = sorted((tensor_id, str(spec)) for tensor_id, spec in assignment.items())
    return hashlib.sha1(json.dumps(items).encode()).hexdigest()[:16]


def _assignable(graph: Any) -> list[Any]:
    """The graph's assignable tensors in execution order."""
    return [info for info in graph.tensors.values() if info.kind in ASSIGNABLE_KINDS]


def units(graph: Any, space: SearchSpace) -> dict[str, list[str]]:
    """Decision unit name -> tensor ids it decides, in execution order (groups ``g<i>`` or single tensors)."""
    if space.granularity == "tensor":
        return {info.id: [info.id] for info in _assignable(graph)}
    grouped: dict[str, list[str]] = {}
    for info in sorted(_assignable(graph), key=lambda t: t.group):
        grouped.setdefault(f"g{info.group}", []).append(info.id)
    return grouped


def group_sizes(graph: Any) -> dict[int, int]:
    """Group index -> total elements of its assignable tensors (its share of memory when all are high)."""
    sizes: dict[int, int] = {}
    for info in _assignable(graph):
        sizes[info.group] = sizes.get(info.group, 0) + int(info.numel)
    return dict(sorted(sizes.items()))


def assign(graph: Any, space: SearchSpace, decisions: Mapping[str, str]) -> dict[str, str]:
    """The assignment (every assignable id -> spec) for one level per unit; undecided units stay high."""
    levels = space.levels
    kinds = {info.id: info.kind for info in _assignable(graph)}
    assignment = {tensor_id: space.high for tensor_id in kinds}
    for unit, tensor_ids in units(graph, space).items():
        level = decisions.get(unit, "high")
        if level not in levels:
            raise PrecsearchError(f"level {level!r} for {unit} is not in space {space.name}; "
                                  f"use one of {', '.join(levels)}")
        for tensor_id in tensor_ids:
            assignment[tensor_id] = levels[level][kinds[tensor_id]]
    return assignment


def low_share(graph: Any, space: SearchSpace, decisions: Mapping[str, str]) -> float:
    """Fraction of assignable elements whose unit is not at the high level (precsearch.cost.model.low_share)."""
    numel = {info.id: int(info.numel) for info in _assignable(graph)}
    decided = units(graph, space)
    sizes = [sum(numel[tensor_id] for tensor_id in tensor_ids) for tensor_ids in decided.values()]
    return float(cost.low_share(sizes, [decisions.get(unit, "high") != "high" for unit in decided]))


def _unit_decisions(graph: Any, space: SearchSpace, group_levels: Mapping[int, str]) -> dict[str, str]:
    """Per-group levels expressed in the space's units (a tensor unit takes its group's level)."""
    if space.granularity == "tensor":
        return {info.id: group_levels.get(info.group, "high") for info in _assignable(graph)}
    return {f"g{group}": level for group, level in group_levels.items()}


def candidate(graph: Any, space: SearchSpace, strategy: str, decisions: dict[str, str],
              r: float | None = None) -> Candidate:
    """The candidate ``decisions`` make, with its assignment and low share."""
    return Candidate(strategy=strategy, decisions=decisions, assignment=assign(graph, space, decisions),
                     low_share=low_share(graph, space, decisions), r=r)


def paper_assignment(graph: Any, r: float, space: SearchSpace, order: str = "largest",
                     seed: int = 0, scores: Mapping[int, float] | None = None) -> Candidate:
    """The paper's technique at memory-saving target ``r``: demote whole groups, in ``order``, until the low
    share reaches ``r``. "largest" is the paper; "smallest" and "random" (seeded) its ablations; "sensitivity"
    demotes the groups of least ``scores`` (``sensitivity_table.group_order``) first, ties in execution order."""
    if not 0.0 <= r <= 1.0:
        raise PrecsearchError(f"r={r} must lie in [0, 1]")
    if order not in ORDERS:
        raise PrecsearchError(f"unknown group order {order!r}; use one of {', '.join(ORDERS)}")
    sizes = group_sizes(graph)
    groups = list(sizes)  # execution order
    if (order == "sensitivity") != (scores is not None):
        raise PrecsearchError("give scores (group -> sensitivity per byte) with order sensitivity, and only then")
    if order == "sensitivity":
        unscored = sorted(set(groups) - set(scores))
        if unscored:
            raise PrecsearchError(f"no sensitivity score for group(s) {unscored}; measure this graph's groups")
        groups.sort(key=lambda g: scores[g])
    elif order == "largest":
        groups.sort(key=lambda g: -sizes[g])  # stable: ties keep execution order
    elif order == "smallest":
        groups.sort(key=lambda g: sizes[g])
    else:
        permutation = torch.randperm(len(groups), generator=torch.Generator().manual_seed(seed)).tolist()
        groups = [groups[i] for i in permutation]
    total = sum(sizes.values())
    levels: dict[int, str] = dict.fromkeys(sizes, "high")
    demoted = 0
    for group in groups:
        if total == 0 or demoted / total >= r - 1e-12:
            break
        levels[group] = "low"
        demoted += sizes[group]
    name = "paper" if order == "largest" else f"paper-{order}"
    return candidate(graph, space, name, _unit_decisions(graph, space, levels), r=r)


def sweep(graph: Any, space: SearchSpace, rs: Iterable[float] = R_GRID, order: str = "largest",
          seed: int = 0, window: float | None = None, scores: Mapping[int, float] | None = None) -> list[Candidate]:
    """The technique at each target in ``rs`` (default 0, 0.1, ..., 1); with a ``window`` (the paper's:
    ``ACCEPTANCE_WINDOW``), only the candidates whose low share lies in [r, r + window], the others logged."""
    candidates = [paper_assignment(graph, r, space, order=order, seed=seed, scores=scores) for r in rs]
    if window is None:
        return candidates
    for candidate in candidates:
        if not candidate.within(window):
            log.info("r=%.2f left out: its low share %.3f is past r + %.2f (the paper's acceptance window)",
                     candidate.r, candidate.low_share, window)
    return [candidate for candidate in candidates if candidate.within(window)]


def uniform(graph: Any, space: SearchSpace, level: str) -> Candidate:
    """Every unit at one level: ``uniform(graph, space, "high")`` is all-high, ``"low"`` all-low."""
    decisions = dict.fromkeys(units(graph, space), level)
    return candidate(graph, space, f"all-{level}", decisions, r=None)


# ------------------------------------------------------------------------------------------- baselines


def _gemm_operands(graph: TensorGraph, op: OpInfo) -> set[str]:
    """The tensors a GEMM op multiplies: Y = X W forward, dX = dY W and dW = X dY backward, so its weights, its
    input activations and its output's gradient."""
    ids = {info.id for info in graph.tensors.values() if info.kind == "weight" and info.op == op.name}
    ids |= {str(TensorId(name, "activation")) for name in op.inputs}
    ids.add(str(TensorId(op.name, "activation_grad")))
    return ids & set(graph.tensors)


def _every_gemm_operand(graph: TensorGraph) -> set[str]:
    return set().union(*(_gemm_operands(graph, op) for op in graph.ops if op.role == "gemm"))


def _first_last_gemm_operands(graph: TensorGraph) -> set[str]:
    gemms = [op for op in graph.ops if op.role == "gemm"]
    if not gemms:
        return set()
    return _gemm_operands(graph, gemms[0]) | _gemm_operands(graph, gemms[-1])


def baseline(name: str, graph: TensorGraph) -> Policy:
    """A prior-work policy for any traced model, with the cost model's prediction. No baseline enables the
    promotion guard: they reproduce prior work, which had none.

    * ``fp32``, ``fp16``, ``bf16``, ``fp8``: the format alone (``fp8`` is ``fp8_e5m2``, the one 8-bit format with
      range enough for data and gradients), fp32 master weights, no loss scaling, IEEE overflow to inf.
    * ``mpt`` (Micikevicius et al. 2018): fp16 tensors, fp32 master weights, dynamic loss scaling from 2^16.
    * ``hfp8`` (Sun et al. 2019, the paper's pi_op): every GEMM's operands low (weights and input activations
      ``e4m3b4s``, its output's gradient ``e5m2s``) but the first and last GEMM's; every other tensor ``e6m9s``;
      forward saturates, gradients overflow to inf; dynamic scaling.
    * ``wang_fp8`` (Wang et al. 2018): ``WANG_LOW``, but weight gradients and the first and last GEMM's operands
      ``e6m9s``; stochastic rounding in the weight update; dynamic scaling.
    * ``torchao_fp8`` (torchao's float8 training, tensorwise recipe): every GEMM's operands but biases scaled fp8
      (``TORCHAO_LOW``), every other tensor ``bf16``; fp32 master weights, no loss scaling (a current scale
      never overflows).
    """
    if name not in BASELINES:
        raise PrecsearchError(f"unknown baseline {name!r}; use one of {', '.join(BASELINES)}")
    dynamic = dict(PAPER_LOSS_SCALING)
    common: dict[str, Any] = {"promotion_threshold": None, "provenance": {"strategy": f"baseline:{name}"}}
    if name in ("fp32", "fp16", "bf16", "fp8", "mpt"):
        spec = {"fp8": "fp8_e5m2", "mpt": "fp16"}.get(name, name)
        return policy_for_graph(graph, defaults=dict.fromkeys(ASSIGNABLE_KINDS, spec), high_format="fp32",
                                loss_scaling=dynamic if name == "mpt" else {"mode": "none"}, **common)
    if name == "torchao_fp8":
        low_ids = {tensor_id for tensor_id in _every_gemm_operand(graph)
                   if TensorId.parse(tensor_id).param != "bias"}
        overrides = {tensor_id: TORCHAO_LOW[graph.tensors[tensor_id].kind] for tensor_id in sorted(low_ids)}
        return policy_for_graph(graph, defaults=dict.fromkeys(ASSIGNABLE_KINDS, "bf16"), overrides=overrides,
                                high_format="bf16", loss_scaling={"mode": "none"}, **common)
    first_last = _first_last_gemm_operands(graph)
    if name == "hfp8":
        # weights, input activations and output gradients: never weight grads
        low_ids = _every_gemm_operand(graph) - first_last
        overrides = {tensor_id: PAPER_LOW[graph.tensors[tensor_id].kind] for tensor_id in sorted(low_ids)}
        defaults = dict.fromkeys(ASSIGNABLE_KINDS, PAPER_HIGH)
        optimizer: dict[str, Any] = {}
    else:
        defaults = {**dict.fromkeys(ASSIGNABLE_KINDS, WANG_LOW), "weight_grad": PAPER_HIGH}
        overrides = {tensor_id: PAPER_HIGH for tensor_id in sorted(first_last)}
        optimizer = {"update": "stochastic"}
    return policy_for_graph(graph, defaults=defaults, overrides=overrides, high_format=PAPER_HIGH,
                            overflow=dict(PAPER_OVERFLOW), loss_scaling=dynamic, optimizer=optimizer, **common)


def baseline_policies(graph: TensorGraph, names: Sequence[str] = BASELINES) -> dict[str, Policy]:
    """Prior-work policies (``baseline``) for ``graph``, by name."""
    return {name: baseline(name, graph) for name in names}
