"""Sensitivity before search: which tensors the space's low format hurts, measured on a few all-high steps.

Inference tools score layers before they search (NVIDIA ModelOpt's auto_quantize: the gradient-weighted
quantization error sum((dL/dY)^2 (Q(Y) - Y)^2)); ``measure`` does the same for every tensor kind a policy
assigns, per unit of the space, from a few seeded plain-fp32 SGD steps on the task's data:

- forward tensors (activations, the input included, and weights): ``score`` = sum(g^2 (Q_low(v) - Q_high(v))^2),
  g the tensor's loss gradient, divided by the share of its energy that is not its per-channel mean: early in
  training the gradient alone misses rounding that erases a faint signal on a bright level (the ``gratings``
  input), which against the spread batch norm keeps is as large as the signal itself.
- gradients, on the update they make: a weight gradient's rounding error moves the weight by lr x error, scored
  like a weight (lr^2 sum(g^2 error^2)); an activation gradient's relative error is carried into the updates of
  every weight it flows back to (relative error x lr^2 sum(g^4) over those weights). Gradients are rounded at
  the loss scale a dynamic scaler settles on, as the runtime rounds them.

Every error is the low format's against the high one, so scores add up over a unit's tensors. ``error`` is the
squared error relative to the tensor's spread (forward) or energy (gradients), ``overflow`` and ``underflow``
the shares of values outside the low format's range. The rounding is nearest, per tensor, once per step; the
promotion guard and stochastic rounding are not modelled.

``least_sensitive`` solves the knapsack exactly (scipy's MILP): demote the units of least summed score whose
bytes saved reach a target; ``sensitivity_sweep`` does it along the paper's ladder of targets, and
``SensitivitySeeding`` hands those points to the search as seeds (``SENSITIVITY_SEEDING``: ahead of the paper's).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import numpy as np
import optuna
import pandas as pd
import torch
import torch.nn.functional as F
from scipy.optimize import Bounds, LinearConstraint, milp
from torch import fx, nn

from precsearch.config.spaces import SearchSpace
from precsearch.config.spec import ASSIGNABLE_KINDS, TensorId
from precsearch.cost.model import CostModel
from precsearch.errors import PrecsearchError
from precsearch.formats.format import FloatFormat, get_format
from precsearch.formats.kernels import quantize, stats
from precsearch.formats.scaled import expand_scales, get_scaled_format, is_scaled, quantize_scaled
from precsearch.graph.tracing import trace
from precsearch.graph.types import TensorGraph
from precsearch.search.context import SearchContext
from precsearch.search.seeding import PAPER_SEEDING, Seeding, Seedings
from precsearch.search.sensitivity_table import COLUMNS, keep_table, recorded_table, unit_table
from precsearch.search.strategies import R_GRID, Candidate, candidate, units
from precsearch.train.data import ImageDataset, make_loader
from precsearch.train.trainer import build_model, seeded

__all__ = ["DEFAULT_BATCHES", "SENSITIVITY_SEEDING", "SensitivitySeeding", "least_sensitive", "measure",
           "measure_model", "sensitivity_sweep"]

DEFAULT_BATCHES = 4


class _Tap(torch.autograd.Function):
    """Identity that hands the gradient arriving at its output to ``sink`` (the tensor's dL/dY, before any
    in-place op that later writes over the output changes what autograd holds)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, sink: list[torch.Tensor]) -> torch.Tensor:
        ctx.sink = sink
        return x.clone()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        ctx.sink.append(grad.detach().clone())
        return grad, None


class _Probe(fx.Interpreter):
    """Runs the traced FX graph and taps the outputs ``wanted`` names: node name -> {output position: tensor id}."""

    def __init__(self, module: fx.GraphModule, wanted: Mapping[str, Mapping[int, str]]) -> None:
        super().__init__(module)
        self.wanted = wanted
        self.values: dict[str, torch.Tensor] = {}
        self.grads: dict[str, list[torch.Tensor]] = {}

    def run_node(self, node: fx.Node) -> Any:
        result = super().run_node(node)
        positions = self.wanted.get(node.name)
        if not positions:
            return result
        if isinstance(result, torch.Tensor):
            return self._tap(result, positions.get(0))
        return type(result)(self._tap(item, positions.get(index)) for index, item in enumerate(result))

    def _tap(self, value: Any, tensor_id: str | None) -> Any:
        if tensor_id is None or not isinstance(value, torch.Tensor) or not value.is_floating_point():
            return value
        self.values[tensor_id] = value.detach().clone()
        if not value.requires_grad:
            return value
        sink = self.grads.setdefault(tensor_id, [])
        return _Tap.apply(value, sink)


def _gradient_scale(grads: Iterable[torch.Tensor], space: SearchSpace) -> float:
    """The loss scale gradients are rounded at: the initial scale, halved (for ``dynamic``) until no rounded
    gradient overflows its low format, as a dynamic scaler would settle."""
    scaling = dict(space.loss_scaling)
    mode = scaling.get("mode", "none")
    if mode == "none":
        return 1.0
    scale = float(scaling.get("init_scale", 1.0))
    if mode != "dynamic":
        return scale
    largest = max((float(g.abs().max()) for g in grads if g.numel()), default=0.0)
    limit = min(_element(space.low[kind]).max for kind in ("activation_grad", "weight_grad"))
    while scale > 1.0 and largest * scale > limit:
        scale /= 2.0
    return scale


def _rounding_error(value: torch.Tensor, low: str, high: str, overflow: str, scale: float = 1.0) -> torch.Tensor:
    """What holding ``value`` (at ``scale``) in ``low`` instead of ``high`` changes, in ``value``'s units."""
    scaled = value * scale
    return (_rounded(scaled, low, overflow) - _rounded(scaled, high, overflow)) / scale


def _element(fmt: str) -> FloatFormat:
    """The format one value is held in (a scaled format's element)."""
    return get_scaled_format(fmt).element if is_scaled(fmt) else get_format(fmt)


def _in_element(value: torch.Tensor, fmt: str) -> tuple[torch.Tensor, FloatFormat]:
    """``value`` in the units its format's element holds (divided by its own scales, as ``_rounded`` scales it),
    and that element: what its overflow and underflow shares are of."""
    if not is_scaled(fmt):
        return value, get_format(fmt)
    current = dataclasses.replace(get_scaled_format(fmt), history=0)
    scales = quantize_scaled(value, current)[1]
    return value / expand_scales(scales, current, value.shape), current.element


def _rounded(value: torch.Tensor, fmt: str, overflow: str) -> torch.Tensor:
    """``value`` held in ``fmt``; a scaled format with the scale of ``value`` itself (one value has no history of
    amaxes for a delayed recipe)."""
    if not is_scaled(fmt):
        return quantize(value, fmt, overflow=overflow)
    return quantize_scaled(value, dataclasses.replace(get_scaled_format(fmt), history=0))[0]


def _relative(error: torch.Tensor, value: torch.Tensor) -> float:
    norm = float(value.square().sum())
    return float(error.square().sum()) / norm if norm > 0 else 0.0


def _spread_share(value: torch.Tensor) -> float:
    """The share of ``value``'s energy that is not its per-channel mean: what batch norm keeps of it."""
    energy = float(value.square().sum())
    if energy == 0:
        return 1.0
    dims = [dim for dim in range(value.dim()) if dim != 1] if value.dim() >= 2 else None
    centred = value - (value.mean(dim=dims, keepdim=True) if dims is not None else value.mean())
    return max(float(centred.square().sum()) / energy, 1e-12)


def _upstream_weights(graph: TensorGraph) -> dict[str, list[str]]:
    """Activation id -> the weight ids whose gradients its gradient flows into (its op's and its ancestors')."""
    import networkx

    ops = {op.name: op for op in graph.ops}
    op_graph = networkx.DiGraph()
    op_graph.add_nodes_from(ops)
    op_graph.add_edges_from((source, op.name) for op in graph.ops for source in op.inputs if source in ops)
    weights = {op.name: [tid for tid in op.params if tid in graph.tensors] for op in graph.ops}
    upstream = {}
    for op in graph.ops:
        before = [*networkx.ancestors(op_graph, op.name), op.name]
        for tensor_id in op.outputs:
            upstream[tensor_id] = [weight for name in before for weight in weights[name]]
    return upstream


def measure(graph: TensorGraph, model: nn.Module, space: SearchSpace, batches: Iterable[tuple[torch.Tensor,
            torch.Tensor]]) -> pd.DataFrame:
    """The sensitivity table (``COLUMNS``, one row per unit and tensor kind, scores averaged over the steps) of
    ``model`` traced as ``graph`` (whose modules it shares), from one plain SGD step per batch of ``batches``."""
    if graph.graph_module is None:
        raise PrecsearchError(f"sensitivity runs the FX graph, and {graph.model_name} was traced with module "
                              "hooks; make the model FX-traceable")
    proxy = space.proxy
    lr = proxy.lr
    parameters = dict(model.named_parameters())
    wanted: dict[str, dict[int, str]] = {}
    for op in graph.ops:
        for tensor_id in op.outputs:
            wanted.setdefault(op.node, {})[TensorId.parse(tensor_id).index] = tensor_id
    upstream = _upstream_weights(graph)
    sgd = torch.optim.SGD(model.parameters(), lr=lr, momentum=proxy.momentum, weight_decay=proxy.weight_decay)
    model.train()
    rows: dict[str, list[dict[str, float]]] = {}
    steps = 0
    for images, labels in batches:
        probe = _Probe(graph.graph_module, wanted)
        sgd.zero_grad(set_to_none=True)
        F.cross_entropy(probe.run(images.clone().requires_grad_(True)), labels).backward()
        values: dict[str, torch.Tensor] = dict(probe.values)
        grads: dict[str, torch.Tensor] = {tid: sum(sink) for tid, sink in probe.grads.items() if sink}
        for info in graph.tensors.values():
            if info.kind == "weight" and info.param in parameters:
                values[info.id] = parameters[info.param].detach()
                if parameters[info.param].grad is not None:
                    grads[info.id] = parameters[info.param].grad.detach()
        scale = _gradient_scale(grads.values(), space)
        weight_updates = {tid: lr**2 * float(g.pow(4).sum()) for tid, g in grads.items()
                          if graph.tensors[tid].kind == "weight"}
        for info in graph.tensors.values():
            if info.kind not in ASSIGNABLE_KINDS:
                continue
            forward = str(TensorId.parse(info.id).forward())
            gradient = info.kind.endswith("_grad")
            value = grads.get(forward) if gradient else values.get(info.id)
            if value is None:
                continue
            low, overflow = space.low[info.kind], space.overflow[info.kind]
            error = _rounding_error(value, low, space.high, overflow, scale if gradient else 1.0)
            share = 1.0 if gradient else _spread_share(value)
            relative = _relative(error, value) / share
            if info.kind == "weight_grad":
                score = lr**2 * float((value.square() * error.square()).sum())
            elif info.kind == "activation_grad":
                score = relative * sum(weight_updates.get(tid, 0.0) for tid in upstream.get(forward, ()))
            else:
                weight = grads.get(info.id)
                score = float((weight.square() * error.square()).sum()) / share if weight is not None else math.nan
            shares = stats(*_in_element(value * scale if gradient else value, low))
            rows.setdefault(info.id, []).append({"score": score, "error": relative,
                                                 "overflow": shares["overflow"], "underflow": shares["underflow"]})
        sgd.step()
        steps += 1
    if steps == 0:
        raise PrecsearchError("sensitivity needs at least one batch; give batches >= 1")
    return _table(graph, space, {tid: pd.DataFrame(measured).mean() for tid, measured in rows.items()})


def _table(graph: TensorGraph, space: SearchSpace, per_tensor: Mapping[str, pd.Series]) -> pd.DataFrame:
    """Per-tensor means summed (scores) or numel-weighted (error, overflow, underflow) per unit and kind."""
    cost = CostModel(graph, high=space.high, low=space.low)
    high = {tid: space.high for tid in graph.assignable_ids()}
    all_high = cost.bytes(high)
    records = []
    for unit, tensor_ids in units(graph, space).items():
        by_kind: dict[str, list[str]] = {}
        for tensor_id in tensor_ids:
            by_kind.setdefault(graph.tensors[tensor_id].kind, []).append(tensor_id)
        for kind, ids in by_kind.items():
            numel = np.array([graph.tensors[tid].numel for tid in ids], dtype=np.float64)
            measured = [per_tensor.get(tid) for tid in ids]
            weights = np.array([n if m is not None else 0.0 for n, m in zip(numel, measured, strict=True)])

            def weighted(column: str, measured: list[pd.Series | None] = measured,
                         weights: np.ndarray = weights) -> float:
                total = weights.sum()
                values = [m[column] if m is not None else 0.0 for m in measured]
                return float(np.dot(weights, values) / total) if total > 0 else math.nan

            demoted = {**high, **{tid: space.low[kind] for tid in ids}}
            scores = [m["score"] for m in measured if m is not None]
            records.append({"unit": unit, "group": graph.tensors[ids[0]].group, "kind": kind, "tensors": len(ids),
                            "numel": int(numel.sum()), "bytes_saved": all_high - cost.bytes(demoted),
                            "score": float(sum(scores)) if scores else math.nan, "error": weighted("error"),
                            "overflow": weighted("overflow"), "underflow": weighted("underflow")})
    return pd.DataFrame(records, columns=list(COLUMNS))


def measure_model(model_spec: str, space: SearchSpace, data: tuple[ImageDataset, ImageDataset],
                  batches: int = DEFAULT_BATCHES, seed: int = 0, device: str = "cpu") -> pd.DataFrame:
    """``measure`` for a zoo model (or factory) on ``batches`` seeded training batches of the space's size."""
    if batches < 1:
        raise PrecsearchError(f"batches={batches} must be at least 1")
    train_set = data[0]
    batch_size = space.proxy.batch_size
    if len(train_set) < batch_size:
        raise PrecsearchError(f"the training set has {len(train_set)} images, fewer than the batch size "
                              f"{batch_size}; lower the batch size or give more data")
    torch_device = torch.device(device)
    with seeded(seed, torch_device):
        model = build_model(model_spec, train_set.num_classes, train_set.images[:2]).to(torch_device)
        graph = trace(model, train_set.images[:2].to(torch_device), batch_size=batch_size, model_name=model_spec)
        loader = make_loader(train_set, batch_size, shuffle=True, seed=seed, drop_last=True)
        chosen = [(images.to(torch_device), labels.to(torch_device))
                  for _, (images, labels) in zip(range(batches), loader, strict=False)]
        return measure(graph, model, space, chosen)


def least_sensitive(scores: Mapping[str, float], saved: Mapping[str, float], need: float) -> set[str]:
    """The units to demote: least summed score among the sets whose bytes saved reach ``need`` (every unit when
    none does), solved exactly: a 0/1 integer program, scipy's HiGHS at zero gap."""
    names = list(scores)
    if need <= 0 or not names:
        return set()
    savings = np.array([max(float(saved[name]), 0.0) for name in names])
    if need >= savings.sum():
        return set(names)
    costs = np.array([float(scores[name]) for name in names])
    result = milp(costs, constraints=LinearConstraint(savings[None, :], lb=need, ub=np.inf),
                  integrality=np.ones(len(names)), bounds=Bounds(0, 1),
                  options={"mip_rel_gap": 0.0})
    if result.x is None:
        raise PrecsearchError(f"the sensitivity knapsack found no solution ({result.message})")
    return {name for name, chosen in zip(names, result.x, strict=True) if chosen > 0.5}


def sensitivity_sweep(graph: TensorGraph, space: SearchSpace, table: pd.DataFrame,
                      rs: Iterable[float] = R_GRID) -> list[Candidate]:
    """For each target r, the least sensitive units that save r of the bytes all-low saves."""
    summed = unit_table(table)
    scores = dict(zip(summed["unit"], summed["score"], strict=True))
    saved = dict(zip(summed["unit"], summed["bytes_saved"], strict=True))
    total = sum(max(value, 0.0) for value in saved.values())
    candidates = []
    for r in rs:
        demoted = least_sensitive(scores, saved, r * total)
        decisions = {unit: "low" if unit in demoted else "high" for unit in units(graph, space)}
        candidates.append(candidate(graph, space, "sensitivity", decisions, r))
    return candidates


class SensitivitySeeding(Seeding):
    """The knapsack's points as seeds of a search, from a measured ``table``, or one ``prepared`` measures once
    per study and keeps in it."""

    name = "sensitivity"

    def __init__(self, table: pd.DataFrame | None = None, rs: Sequence[float] = R_GRID) -> None:
        self.table = table
        self.rs = tuple(rs)

    def prepared(self, context: SearchContext, study: optuna.Study) -> Seeding:
        """The table kept in the study, measured here on the CPU first if no worker did: every worker seeds from
        the same numbers."""
        if self.table is not None:
            return self
        if recorded_table(study.user_attrs) is None:
            keep_table(study, measure_model(context.model, context.space, context.data, seed=context.seed,
                                            device="cpu"))
        return SensitivitySeeding(recorded_table(study.user_attrs), self.rs)

    def candidates(self, graph: Any, space: SearchSpace) -> list[tuple[Candidate, str]]:
        if self.table is None:
            raise PrecsearchError("the sensitivity seeding has no table: measure one (measure_model) or prepare it")
        return [(candidate, f"sensitivity r={candidate.r:.1f}")
                for candidate in sensitivity_sweep(graph, space, self.table, self.rs)]


SENSITIVITY_SEEDING = Seedings("sensitivity", [SensitivitySeeding(), *PAPER_SEEDING.parts])  # knapsack first
