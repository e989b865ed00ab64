"""The policy file: which float format every training tensor uses, and how training enforces it.

A ``Policy`` is what a search (or a hand) produces and what ``precsearch.runtime.wrapper.apply_policy`` loads into
ordinary training. It is a versioned JSON document (``schema_version`` 1), written with sorted keys and one
entry per line so that two policies diff cleanly.

Resolving a tensor's format, in the spirit of torch.ao's QConfigMapping (most specific rule wins):

1. ``overrides[id]``: an exact tensor id of the graph (``"layer1.0.conv1:weight"``);
2. ``overrides[glob]``: a glob over ids (``"layer4.*:activation"``); the longest pattern wins, ties go to the
   alphabetically first;
3. ``module_types[type][kind]``: the producing module's class name or function name (``"Conv2d"``,
   ``"add"``) and the tensor kind;
4. ``defaults[kind]``;
5. nothing matched: fp32, and ``check`` reports the tensor as not covered.

Master weights and optimizer state are not assigned here: master copies are fp32 when ``master_weights`` is
true, and the optimizer settings (``optimizer``) say how the update is rounded.

``compression`` (``none`` by default, or ``adacomp``) is how data-parallel training exchanges gradients
(precsearch.train.data_parallel), so a search may treat it as one more dimension beside the formats.

The paper's reference code differs from plain training in four settings, each explicit here (its values in
the paper's space, ``search_spaces/hfp8.yaml``):

* ``promotion_kinds``: which kinds the divergence guard may promote (default weights and activations, as the
  reference; a gradient that overflows is the loss scaler's to handle). Promotion is checked once per
  training step, never in eval mode or under ``no_grad`` (precsearch.runtime.wrapper).
* ``gradient_rounding``: ``sum`` rounds an activation's gradient once, after autograd summed the gradients of
  its consumers; ``per_use`` (the reference) rounds each consumer's gradient, then sums them in float32 (the
  two branches of a residual block).
* ``ties``: ``even`` (IEEE round-half-to-even, every hardware cast: the default) or ``away`` (QPyTorch's
  ties away from zero, to reproduce the reference bit for bit) for every nearest rounding.
* ``loss_scaling.growth_interval``: clean steps between doublings, or ``"epoch"`` (the reference doubles
  once per epoch: the trainer passes the steps per epoch to ``apply_policy``).

``accumulation`` (optional, off by default) makes the GEMMs of the layers it names sum in a low format, forward
and backward, by Wang et al.'s chunk-based accumulation (precsearch.runtime.accumulate); see ``Accumulation``.
"""

from __future__ import annotations

import dataclasses
import difflib
import fnmatch
import json
import logging
import os
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from precsearch.config.spec import (
    ASSIGNABLE_KINDS,
    BASELINES,
    COMPRESSIONS,
    GRADIENT_ROUNDINGS,
    OVERFLOWS,
    PAPER_OVERFLOW,
    PAPER_PROMOTION_KINDS,
    POLICY_DEFAULTS,
    POLICY_ROUNDINGS,
    TIES,
    TensorId,
    check_keys,
    choice,
    flag,
    kinds_list,
    loss_scaling,
    optimizer,
    promotion_threshold,
)
from precsearch.cost.model import CostModel
from precsearch.errors import PrecsearchError
from precsearch.files import atomic_write_text
from precsearch.formats.numerics import FloatFormat, get_format, spec_name
from precsearch.graph.tracing import trace, untraced_modules
from precsearch.graph.types import OpInfo, TensorGraph, TensorInfo
from precsearch.runtime.accumulate import (
    CHUNKABLE_LAYERS,
    DEFAULT_ACC,
    DEFAULT_CHUNK,
    ChunkedConv2d,
    ChunkedLinear,
    swap_chunked_layers,
)

log = logging.getLogger(__name__)

__all__ = ["Accumulation", "SCHEMA_VERSION", "Policy", "PolicyReport", "baseline"]

SCHEMA_VERSION = 1
ACCUMULATION_KEYS: tuple[str, ...] = ("format", "chunk", "layers")
# Traced as single GEMM ops, so a model whose layers were already swapped traces like the plain one.
CHUNKED_LAYERS: tuple[type[nn.Module], ...] = (ChunkedLinear, ChunkedConv2d)
_GLOB_CHARS = frozenset("*?[")
_FIELDS = (
    "model", "graph_fingerprint", "input_shape", "batch_size", "defaults", "overrides", "module_types",
    "high_format", "rounding", "overflow", "loss_scaling", "promotion_threshold", "master_weights", "optimizer",
    "accumulation", "compression", "predicted", "provenance", "promotion_kinds", "gradient_rounding", "ties",
    "allow_unmatched_rules",
)
# Written only when they differ from these, so files without them read as before (in older precsearch too).
_OPTIONAL_DEFAULTS: dict[str, Any] = {
    "compression": "none", "promotion_kinds": list(PAPER_PROMOTION_KINDS), "gradient_rounding": "sum",
    "ties": "even", "allow_unmatched_rules": False,
}
_FILE_KEYS = (*_FIELDS, "schema_version", "formats")


def _is_glob(key: str) -> bool:
    return not _GLOB_CHARS.isdisjoint(key)


# ------------------------------------------------------------------------------------------- validation


def _mapping(value: Any, where: str) -> Mapping[str, Any]:
    if not isinstance(value, Mapping) or not all(isinstance(key, str) for key in value):
        raise PrecsearchError(f"{where} must be a mapping with string keys, not {type(value).__name__}")
    return value


def _kinds(value: Any, where: str) -> Mapping[str, Any]:
    value = _mapping(value, where)
    unknown = sorted(set(value) - set(ASSIGNABLE_KINDS))
    if unknown:
        raise PrecsearchError(f"{where}: unknown tensor kind {unknown[0]!r}; use {', '.join(ASSIGNABLE_KINDS)}")
    return value


def _json_data(value: Any, where: str) -> dict[str, Any]:
    """A mapping that JSON can write as is (checked now so that save never fails half-way)."""
    value = dict(_mapping(value, where))
    try:
        json.dumps(value, allow_nan=False)
    except (TypeError, ValueError) as error:
        raise PrecsearchError(f"{where} must hold only JSON data (str, number, bool, list, dict): {error}") from None
    return value


def _optional_int(value: Any, where: str) -> int | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise PrecsearchError(f"{where} must be a positive integer or null, not {value!r}")
    return value


@dataclass(frozen=True)
class Accumulation:
    """Simulated low-precision GEMM sums (Wang et al. 2018) in the Linear/Conv2d layers that ``layers`` names.

    ``format``: the accumulation format (Wang et al.: 16-bit ``e6m9s``); ``chunk``: the chunk length CL (>= 1;
    None sums sequentially, the swamping-prone baseline that chunking fixes); ``layers``: glob patterns over
    module qualified names (``"layer*.conv?"``), every Linear/Conv2d by default. ``apply_policy`` swaps the
    layers for precsearch.runtime.accumulate's chunked ones, forward and backward, before it instruments the model.

    Costly: a chunked layer makes CL + K/CL rounding passes in Python, 26x to 1000x the time of the plain
    layer on CPU, so no baseline turns it on. Wang et al.'s full recipe is
    ``baseline("wang_fp8", graph).replace(accumulation=Accumulation("e6m9s", 64))``.
    """

    format: str = DEFAULT_ACC
    chunk: int | None = DEFAULT_CHUNK
    layers: tuple[str, ...] = ("*",)

    def __post_init__(self) -> None:
        object.__setattr__(self, "format", spec_name(self.format, "accumulation.format"))
        chunk = self.chunk
        if chunk is not None and (isinstance(chunk, bool) or not isinstance(chunk, int) or chunk < 1):
            raise PrecsearchError(f"accumulation.chunk must be an integer >= 1, or null for sequential sums, "
                                  f"not {chunk!r}")
        layers = self.layers
        if (not isinstance(layers, list | tuple) or not layers
                or not all(isinstance(pattern, str) and pattern for pattern in layers)):
            raise PrecsearchError(f"accumulation.layers must be a non-empty list of glob patterns over module "
                                  f"names such as [\"*\"], not {layers!r}")
        object.__setattr__(self, "layers", tuple(layers))

    def apply(self, model: nn.Module) -> list[str]:
        """Swap the chosen layers of ``model`` in place for chunked ones (same Parameters); their names."""
        return swap_chunked_layers(model, self.layers, self.format, self.chunk)

    def to_dict(self) -> dict[str, Any]:
        return {"format": self.format, "chunk": self.chunk, "layers": list(self.layers)}


def _accumulation(value: Any, where: str) -> Accumulation | None:
    if value is None or isinstance(value, Accumulation):
        return value
    value = _mapping(value, f"{where}: accumulation")
    check_keys(value, ACCUMULATION_KEYS, f"{where}: accumulation")
    try:
        return Accumulation(**value)
    except PrecsearchError as error:
        raise PrecsearchError(f"{where}: {error}") from None


# ---------------------------------------------------------------------------------------------- policy


@dataclass
class PolicyReport:
    """What ``Policy.check`` found: rules naming nothing in the model, tensors no rule covers, graph identity."""

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


@dataclass
class Policy:
    """A precision assignment plus everything training needs to enforce it; see the module docstring."""

    model: str = ""
    graph_fingerprint: str | None = None
    input_shape: tuple[int, ...] | None = None
    batch_size: int | None = None
    defaults: dict[str, str] = field(default_factory=dict)
    overrides: dict[str, str] = field(default_factory=dict)
    module_types: dict[str, dict[str, str]] = field(default_factory=dict)
    high_format: str = "fp32"
    rounding: dict[str, str] = field(default_factory=dict)
    overflow: dict[str, str] = field(default_factory=dict)
    loss_scaling: dict[str, Any] = field(default_factory=lambda: dict(POLICY_DEFAULTS.loss_scaling))
    promotion_threshold: float | None = 0.01
    master_weights: bool = POLICY_DEFAULTS.master_weights
    optimizer: dict[str, Any] = field(default_factory=dict)
    accumulation: Accumulation | None = None
    compression: str = "none"
    promotion_kinds: tuple[str, ...] = PAPER_PROMOTION_KINDS
    gradient_rounding: str = "sum"
    ties: str = "even"
    predicted: dict[str, Any] = field(default_factory=dict)
    provenance: dict[str, Any] = field(default_factory=dict)
    allow_unmatched_rules: bool = False  # a rule naming nothing in the model is then only a warning

    def __post_init__(self) -> None:
        self.validate()

    def validate(self, where: str = "policy") -> None:
        """Check every field and normalize format specs; a ``PrecsearchError`` names the first problem."""
        if not isinstance(self.model, str):
            raise PrecsearchError(f"{where}: model must be a model spec string, not {self.model!r}")
        if self.graph_fingerprint is not None and not isinstance(self.graph_fingerprint, str):
            raise PrecsearchError(f"{where}: graph_fingerprint must be a string or null")
        if self.input_shape is not None:
            shape = self.input_shape
            if not isinstance(shape, list | tuple) or not all(
                isinstance(n, int) and not isinstance(n, bool) and n > 0 for n in shape
            ):
                raise PrecsearchError(f"{where}: input_shape must be a list of positive integers, not {shape!r}")
            self.input_shape = tuple(shape)
        self.batch_size = _optional_int(self.batch_size, f"{where}: batch_size")
        self.defaults = {k: spec_name(v, f"{where}: defaults.{k}")
                         for k, v in _kinds(self.defaults, f"{where}: defaults").items()}
        self.overrides = {k: spec_name(v, f"{where}: overrides[{k!r}]")
                          for k, v in _mapping(self.overrides, f"{where}: overrides").items()}
        self.module_types = {
            name: {k: spec_name(v, f"{where}: module_types.{name}.{k}")
                   for k, v in _kinds(rules, f"{where}: module_types.{name}").items()}
            for name, rules in _mapping(self.module_types, f"{where}: module_types").items()
        }
        self.high_format = spec_name(self.high_format, f"{where}: high_format")
        self.rounding = {k: choice(v, POLICY_ROUNDINGS, f"{where}: rounding.{k}")
                         for k, v in _kinds(self.rounding, f"{where}: rounding").items()}
        self.overflow = {k: choice(v, OVERFLOWS, f"{where}: overflow.{k}")
                         for k, v in _kinds(self.overflow, f"{where}: overflow").items()}
        self.loss_scaling = loss_scaling(self.loss_scaling, f"{where}: loss_scaling", POLICY_DEFAULTS)
        self.promotion_threshold = promotion_threshold(self.promotion_threshold, where)
        flag(self.master_weights, f"{where}: master_weights")
        flag(self.allow_unmatched_rules, f"{where}: allow_unmatched_rules")
        self.optimizer = optimizer(self.optimizer, f"{where}: optimizer")
        self.accumulation = _accumulation(self.accumulation, where)
        self.compression = choice(self.compression, COMPRESSIONS, f"{where}: compression")
        self.promotion_kinds = kinds_list(self.promotion_kinds, f"{where}: promotion_kinds")
        self.gradient_rounding = choice(self.gradient_rounding, GRADIENT_ROUNDINGS, f"{where}: gradient_rounding")
        self.ties = choice(self.ties, TIES, f"{where}: ties")
        self.predicted = _json_data(self.predicted, f"{where}: predicted")
        self.provenance = _json_data(self.provenance, f"{where}: provenance")

    # -- resolution ---------------------------------------------------------------------------------------

    def explain(self, tensor: TensorInfo) -> tuple[str, str]:
        """(format spec, the rule that chose it) for a ``TensorInfo``, by the documented precedence."""
        if tensor.id in self.overrides:
            return self.overrides[tensor.id], f"override {tensor.id!r}"
        for pattern in self._globs():
            if fnmatch.fnmatchcase(tensor.id, pattern):
                return self.overrides[pattern], f"override {pattern!r}"
        rule = self.module_types.get(tensor.module_type, {})
        if tensor.kind in rule:
            return rule[tensor.kind], f"module type {tensor.module_type}"
        if tensor.kind in self.defaults:
            return self.defaults[tensor.kind], f"default for {tensor.kind}"
        return "fp32", "no rule"

    def format_for(self, tensor: TensorInfo) -> str:
        """The format spec of a ``TensorInfo`` (fp32 for master weights and anything no rule covers)."""
        if tensor.kind == "optimizer_state":
            return self.optimizer.get("state_format", "fp32")
        if tensor.kind not in ASSIGNABLE_KINDS:
            return "fp32"
        return self.explain(tensor)[0]

    def assignment(self, graph: TensorGraph) -> dict[str, str]:
        """Tensor id -> format spec for every assignable tensor of ``graph`` (a ``TensorGraph``)."""
        return {tensor_id: self.format_for(graph.tensors[tensor_id]) for tensor_id in graph.assignable_ids()}

    def formats(self) -> dict[str, FloatFormat]:
        """Every format the policy names, by spec (the file lists them with their parameters)."""
        specs = {*self.defaults.values(), *self.overrides.values(), self.high_format}
        specs |= {spec for rules in self.module_types.values() for spec in rules.values()}
        if "state_format" in self.optimizer:
            specs.add(self.optimizer["state_format"])
        if self.accumulation is not None:
            specs.add(self.accumulation.format)
        return {spec: get_format(spec) for spec in sorted(specs)}

    def _globs(self) -> list[str]:
        return sorted((key for key in self.overrides if _is_glob(key)), key=lambda key: (-len(key), key))

    @classmethod
    def from_assignment(cls, graph: TensorGraph, assignment: Mapping[str, Any], **fields: Any) -> Policy:
        """A compact policy for ``graph`` giving exactly ``assignment`` (ids not named are fp32).

        Each kind's most common format becomes its default and the rest become exact-id overrides. The
        model identity comes from the graph; ``fields`` set any other field (and may override those). The
        cost model's prediction is filled in.
        """
        unknown = sorted(set(assignment) - set(graph.assignable_ids()))
        if unknown:
            raise PrecsearchError(f"assignment names {len(unknown)} id(s) the graph lacks, e.g. {unknown[0]!r}; "
                                  "build it from this model's graph")
        specs = {tensor_id: spec_name(assignment.get(tensor_id, "fp32"), f"assignment[{tensor_id!r}]")
                 for tensor_id in graph.assignable_ids()}
        defaults: dict[str, str] = {}
        for kind in ASSIGNABLE_KINDS:
            counts = Counter(spec for tensor_id, spec in specs.items() if graph.tensors[tensor_id].kind == kind)
            if counts:
                defaults[kind] = counts.most_common(1)[0][0]
        overrides = {tensor_id: spec for tensor_id, spec in specs.items()
                     if spec != defaults[graph.tensors[tensor_id].kind]}
        values: dict[str, Any] = {**_identity(graph), "defaults": defaults, "overrides": overrides, **fields}
        return cls(**values).fill_predicted(graph)

    def fill_predicted(self, graph: TensorGraph) -> Policy:
        """Set ``predicted`` from the cost model for ``graph``: bytes, the fp32 bytes, their ratio, saved bytes."""
        cost = CostModel(graph)
        assignment = self.assignment(graph)
        total, fp32 = cost.bytes(assignment), cost.bytes({})
        self.predicted = {
            "bytes": int(total),
            "fp32_bytes": int(fp32),
            "ratio": float(total) / float(fp32) if fp32 else 1.0,
            "low_share": float(cost.low_share(assignment)),
            "saved_activation_bytes": int(cost.saved_activation_bytes(assignment)),
        }
        return self

    # -- checking against a model -------------------------------------------------------------------------

    def check(self, model_or_graph: nn.Module | TensorGraph, example_input: torch.Tensor | None = None
              ) -> PolicyReport:
        """Report the rules that name nothing in the model and the tensors no rule covers, by name.

        Takes a ``TensorGraph`` or an ``nn.Module`` (traced with ``example_input``, or a batch of two zeros of
        the policy's ``input_shape``: give a real batch, since a branch zeros do not take is not traced). For
        a module, the report also names its modules that are not in the graph (``untraced``).
        """
        graph = self._graph(model_or_graph, example_input)
        untraced = ([] if isinstance(model_or_graph, TensorGraph)
                    else untraced_modules(model_or_graph, graph, CHUNKED_LAYERS))
        ids = set(graph.tensors)
        missing = [f"override {key!r}" for key in sorted(self.overrides)
                   if (key not in ids if not _is_glob(key) else not fnmatch.filter(ids, key))]
        types = {info.module_type for info in graph.tensors.values()}
        missing += [f"module type {name!r}" for name in sorted(self.module_types) if name not in types]
        if self.accumulation is not None:
            chunkable = {layer.__name__ for layer in CHUNKABLE_LAYERS}
            layers = {op.name.partition("#")[0] for op in graph.ops if op.module_type in chunkable}
            missing += [f"accumulation layers {pattern!r}" for pattern in self.accumulation.layers
                        if not fnmatch.filter(layers, pattern)]
        missing += [f"module type {name!r} {kind}" for name, rules in sorted(self.module_types.items())
                    if name in types for kind in sorted(rules)
                    if not any(t.module_type == name and t.kind == kind for t in graph.tensors.values())]
        uncovered = [tensor_id for tensor_id in graph.assignable_ids()
                     if self.explain(graph.tensors[tensor_id])[1] == "no rule"]
        unenforced = [f"{name} ({why})" for name, why in graph.unenforced().items()]
        hints = {item: _closest(item, ids, types) for item in missing}
        return PolicyReport(self.model, self.graph_fingerprint, graph.fingerprint(), missing, uncovered, unenforced,
                            {item: close for item, close in hints.items() if close}, untraced)

    def verify(self, graph: TensorGraph, strict: bool = True) -> PolicyReport:
        """``check`` that raises when the policy was made for another graph (unless ``strict`` is False)."""
        report = self.check(graph)
        if strict and not report.fingerprint_matches:
            lacking = [item for item in report.missing if item.startswith("override")]
            detail = f"; {len(lacking)} override(s) name nothing here, e.g. {lacking[0]}" if lacking else ""
            raise PrecsearchError(
                f"policy was made for {self.model or 'another model'} (graph {self.graph_fingerprint}), "
                f"but this model's graph is {report.graph_fingerprint}{detail}; make a policy for this model "
                "(or pass strict=False to apply_policy, in Python, to apply it anyway)"
            )
        if report.missing:
            named = "; ".join(report.named(item) for item in report.missing[:3])
            if self.allow_unmatched_rules or not strict:
                log.warning("policy rule(s) name nothing in this model, ignored: %s", named)
            else:
                raise PrecsearchError(f"{len(report.missing)} policy rule(s) name nothing in this model: {named}; "
                                      "fix the names (precsearch trace MODEL lists them), or set "
                                      '"allow_unmatched_rules": true in the policy')
        return report

    def _graph(self, model_or_graph: nn.Module | TensorGraph, example_input: torch.Tensor | None) -> TensorGraph:
        if isinstance(model_or_graph, TensorGraph):
            return model_or_graph
        if example_input is None:
            example_input = self.example_input(model_or_graph)
        return trace(model_or_graph, example_input, batch_size=self.batch_size, leaf_modules=CHUNKED_LAYERS)

    def example_input(self, model: nn.Module | None = None, batch: int = 2) -> torch.Tensor:
        """Zeros of ``(batch, *input_shape)`` on the model's device, for tracing."""
        if self.input_shape is None:
            raise PrecsearchError("policy has no input_shape; pass an example input")
        device = next((p.device for p in model.parameters()), None) if model is not None else None
        return torch.zeros(batch, *self.input_shape, device=device)

    # -- files --------------------------------------------------------------------------------------------

    def to_dict(self) -> dict[str, Any]:
        """The JSON document: every field, the schema version and the formats used with their parameters."""
        self.validate()
        data = {name: getattr(self, name) for name in _FIELDS}
        data["input_shape"] = list(self.input_shape) if self.input_shape is not None else None
        if self.accumulation is None:
            del data["accumulation"]  # optional: files without it read as before, in older precsearch too
        else:
            data["accumulation"] = self.accumulation.to_dict()
        data["promotion_kinds"] = list(self.promotion_kinds)
        for name, default in _OPTIONAL_DEFAULTS.items():
            if data[name] == default:
                del data[name]  # optional like accumulation: files without it read as before
        data["schema_version"] = SCHEMA_VERSION
        data["formats"] = {spec: _format_entry(fmt) for spec, fmt in self.formats().items()}
        return data

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2, sort_keys=True, allow_nan=False) + "\n"

    def save(self, path: str | os.PathLike[str]) -> Path:
        """Write atomically (``files.atomic_write_text``); on failure nothing is left."""
        path = Path(path)
        text = self.to_json()  # fails (validation, serialization) before anything touches the disk
        try:
            atomic_write_text(path, text)
        except OSError as error:
            raise PrecsearchError(f"cannot write policy {path}: {error.strerror or error}; "
                                  "choose a writable path") from None
        return path

    @classmethod
    def from_dict(cls, data: Any, where: str = "policy") -> Policy:
        """Validate a parsed document (schema version, keys, types, formats); errors name ``where``."""
        if not isinstance(data, Mapping):
            raise PrecsearchError(f"{where}: expected a JSON object, found {type(data).__name__}")
        version = data.get("schema_version")
        if isinstance(version, bool) or not isinstance(version, int) or version < 1:
            raise PrecsearchError(f"{where}: missing or invalid schema_version {version!r}; "
                                  f"a policy file needs schema_version {SCHEMA_VERSION}")
        if version > SCHEMA_VERSION:
            raise PrecsearchError(f"{where}: schema_version {version} was written by a newer precsearch "
                                  f"(this one reads {SCHEMA_VERSION}); upgrade precsearch")
        check_keys(data, _FILE_KEYS, where)
        try:
            policy = cls(**{name: data[name] for name in _FIELDS if name in data})
        except PrecsearchError as error:
            raise PrecsearchError(f"{where}: {str(error).removeprefix('policy: ')}") from None
        _check_listed_formats(data.get("formats", {}), where)
        return policy

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> Policy:
        """Read and validate a policy file; corrupt, truncated, newer or invalid files raise PrecsearchError."""
        path = Path(path)
        try:
            text = path.read_text(encoding="utf-8")
        except UnicodeDecodeError:
            raise PrecsearchError(f"policy {path}: not a text file (corrupted?); write it again with "
                                  "Policy.save") from None
        try:
            data = json.loads(text)
        except json.JSONDecodeError as error:
            state = "empty" if not text.strip() else "truncated or corrupted"
            raise PrecsearchError(f"policy {path}: {state} JSON ({error.msg} at line {error.lineno} column "
                                  f"{error.colno}); write it again with Policy.save") from None
        return cls.from_dict(data, where=f"policy {path}")

    def replace(self, **changes: Any) -> Policy:
        """A validated copy with ``changes`` applied."""
        return dataclasses.replace(self, **changes)


def _closest(item: str, ids: set[str], types: set[str]) -> list[str]:
    """The model's names nearest to what a missing rule names (tensor ids, or module types)."""
    kind, _, name = item.partition(" '")
    name = name.split("'")[0]
    if kind.startswith("module type"):
        return difflib.get_close_matches(name, sorted(types), n=3, cutoff=0.5)
    if kind.startswith("override"):
        return difflib.get_close_matches(name, sorted(ids), n=3, cutoff=0.5)
    return []


def _format_entry(fmt: FloatFormat) -> dict[str, Any]:
    return {"bits": fmt.bits, "exp": fmt.exp, "man": fmt.man, "bias": fmt.bias, "special": fmt.special,
            "max": fmt.max, "min_subnormal": fmt.min_subnormal}


def _check_listed_formats(listed: Any, where: str) -> None:
    """The file's ``formats`` table is informative, but it must agree with how this precsearch reads the specs."""
    for spec, entry in _mapping(listed, f"{where}: formats").items():
        fmt = get_format(spec_name(spec, f"{where}: formats"))
        expected = _format_entry(fmt)
        if not isinstance(entry, Mapping):
            raise PrecsearchError(f"{where}: formats.{spec} must be a mapping of its parameters")
        for key, value in entry.items():
            if key not in expected:
                raise PrecsearchError(f"{where}: formats.{spec}: unknown key {key!r}; allowed: {', '.join(expected)}")
            if value != expected[key]:
                raise PrecsearchError(f"{where}: formats.{spec}.{key} is {value!r} but this precsearch reads "
                                      f"{spec} as {key}={expected[key]!r}; the file was written by an "
                                      "incompatible precsearch")


def _identity(graph: TensorGraph) -> dict[str, Any]:
    """The policy fields that tie it to one model's graph."""
    return {
        "model": graph.model_name,
        "graph_fingerprint": graph.fingerprint(),
        "input_shape": tuple(graph.input_shape) if graph.input_shape is not None else None,
        "batch_size": graph.batch_size,
    }


# ------------------------------------------------------------------------------------------- baselines


def _gemm_operands(graph: TensorGraph, op: OpInfo) -> set[str]:
    """The tensors a GEMM op multiplies: its weights, its input activations and its output's gradient.

    Forward computes Y = X W; backward computes dX = dY W and dW = X dY, so X, W and dY are its operands.
    """
    ids = {info.id for info in graph.tensors.values() if info.kind == "weight" and info.op == op.name}
    ids |= {str(TensorId(name, "activation")) for name in op.inputs}
    ids.add(str(TensorId(op.name, "activation_grad")))
    return ids & set(graph.tensors)


def _first_last_gemm_operands(graph: TensorGraph) -> set[str]:
    gemms = [op for op in graph.ops if op.role == "gemm"]
    if not gemms:
        return set()
    return _gemm_operands(graph, gemms[0]) | _gemm_operands(graph, gemms[-1])


def baseline(name: str, graph: TensorGraph) -> Policy:
    """A prior-work policy for any traced model (a ``TensorGraph``), with the cost model's prediction.

    * ``fp32``: everything fp32, no loss scaling.
    * ``fp16`` / ``bf16`` / ``fp8``: the format alone: every weight, activation and gradient in it (``fp8`` is
      ``fp8_e5m2``, IEEE-like with inf: the one 8-bit format with range enough for data and gradients), fp32
      master weights, no loss scaling, IEEE overflow to inf.
    * ``mpt`` (Micikevicius et al. 2018): fp16 tensors, fp32 master weights, dynamic loss scaling from 2^16.
    * ``hfp8`` (Sun et al. 2019, the paper's pi_op): every GEMM's operands low: weights and input activations
      ``e4m3b4s``, the gradient of its output ``e5m2s``; weight gradients ``e6m9s``; the first and last GEMM
      and every other tensor high (``e6m9s``); forward saturates, gradients overflow to inf; dynamic scaling.
    * ``wang_fp8`` (Wang et al. 2018): weights, activations and activation gradients ``e5m2s``, weight
      gradients ``e6m9s``, the first and last GEMM's operands 16-bit ``e6m9s``, stochastic rounding in the
      weight update; dynamic scaling.

    No baseline enables the promotion guard: they reproduce prior work, which had none.
    """
    if name not in BASELINES:
        raise PrecsearchError(f"unknown baseline {name!r}; use one of {', '.join(BASELINES)}")
    dynamic = {"mode": "dynamic", "init_scale": 2.0**16}
    common: dict[str, Any] = {"promotion_threshold": None, "provenance": {"strategy": f"baseline:{name}"}}
    if name in ("fp32", "fp16", "bf16", "fp8", "mpt"):
        spec = {"fp8": "fp8_e5m2", "mpt": "fp16"}.get(name, name)
        policy = Policy(**_identity(graph), defaults=dict.fromkeys(ASSIGNABLE_KINDS, spec), high_format="fp32",
                        loss_scaling=dynamic if name == "mpt" else {"mode": "none"}, **common)
        return policy.fill_predicted(graph)
    high = "e6m9s"
    first_last = _first_last_gemm_operands(graph)
    if name == "hfp8":
        low = {"weight": "e4m3b4s", "activation": "e4m3b4s", "activation_grad": "e5m2s"}
        operands: set[str] = set()
        for op in graph.ops:
            if op.role == "gemm":
                operands |= _gemm_operands(graph, op)
        low_ids = operands - first_last
        overrides = {tensor_id: low[graph.tensors[tensor_id].kind] for tensor_id in sorted(low_ids)}
        defaults = dict.fromkeys(ASSIGNABLE_KINDS, high)
        optimizer: dict[str, Any] = {}
    else:
        defaults = {"weight": "e5m2s", "activation": "e5m2s", "activation_grad": "e5m2s", "weight_grad": high}
        overrides = {tensor_id: high for tensor_id in sorted(first_last)}
        optimizer = {"update": "stochastic"}
    policy = Policy(**_identity(graph), defaults=defaults, overrides=overrides, high_format=high,
                    overflow=dict(PAPER_OVERFLOW), loss_scaling=dynamic, optimizer=optimizer, **common)
    return policy.fill_predicted(graph)
