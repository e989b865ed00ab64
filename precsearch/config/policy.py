"""The policy file: which float format every training tensor uses, and how training enforces it.

A ``Policy`` is what a search (or a hand) produces and what ``precsearch.runtime.model.apply_policy`` loads into
ordinary training. It is a versioned JSON document, written with sorted keys and one entry per line so that two
policies diff cleanly: ``schema_version`` 1, or 2 when a tensor's format is scaled (``e4m3fn@tensor``,
precsearch.formats.scaled), so that a precsearch that predates scaled formats refuses such a file as newer
rather than misread it, while every other policy is written as before and still loads there.
A ``Policy`` is plain, frozen, validated data: it loads and saves without torch. The code that ties one to a
model lives with the model's boxes: the cost model's prediction (precsearch.cost.policies), the check against a
graph (precsearch.graph.policy_check) or a module (precsearch.analysis.checks), the prior-work baselines
(precsearch.search.strategies).

Resolving a tensor's format, in the spirit of torch.ao's QConfigMapping (most specific rule wins):

1. ``overrides[id]``: an exact tensor id of the graph (``"layer1.0.conv1:weight"``);
2. ``overrides[glob]``: a glob over ids (``"layer4.*:activation"``); the longest pattern wins, ties go to the
   alphabetically first;
3. ``module_types[type][kind]``: the producing module's class name or function name (``"Conv2d"``,
   ``"add"``) and the tensor kind;
4. ``defaults[kind]``;
5. nothing matched: fp32, and a check (precsearch.graph.policy_check) reports the tensor as not covered.

Master weights and optimizer state are not assigned here: master copies are fp32 when ``master_weights`` is
true, and the optimizer settings (``optimizer``) say how the update is rounded.

``compression`` (``none`` by default, or ``adacomp``) is how data-parallel training exchanges gradients
(precsearch.train.data_parallel), so a search may treat it as one more dimension beside the formats.

The paper's reference code differs from plain training in four settings, each explicit here (its values in
the paper's space, ``search_spaces/hfp8.yaml``):

* ``promotion_kinds``: which kinds the divergence guard may promote (default weights and activations, as the
  reference; a gradient that overflows is the loss scaler's to handle). Promotion is checked once per
  training step, never in eval mode or under ``no_grad`` (precsearch.runtime.model).
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
import fnmatch
import json
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from precsearch.config.checks import check_keys, choice, flag, not_wider
from precsearch.config.loss_scaling import loss_scaling
from precsearch.config.optimizer import optimizer
from precsearch.config.reading import load_json
from precsearch.config.spec import (
    ASSIGNABLE_KINDS,
    COMPRESSIONS,
    GRADIENT_ROUNDINGS,
    PAPER_PROMOTION_KINDS,
    POLICY_DEFAULTS,
    POLICY_ROUNDINGS,
    TIES,
    kinds_list,
    promotion_threshold,
)
from precsearch.errors import PrecsearchError, echo
from precsearch.files import atomic_write_text
from precsearch.formats.format import OVERFLOWS, FloatFormat, spec_name
from precsearch.formats.scaled import ScaledFormat, any_format, format_name, is_scaled

__all__ = ["ACCUMULATION_CHUNK", "ACCUMULATION_FORMAT", "ACCUMULATION_LAYER_TYPES", "Accumulation",
           "SCALED_SCHEMA_VERSION", "SCHEMA_VERSION", "Policy", "is_glob"]

SCHEMA_VERSION = 2  # the newest this precsearch reads; it writes 1 unless a tensor's format is scaled
SCALED_SCHEMA_VERSION = 2  # the first that holds scaled formats
ACCUMULATION_KEYS: tuple[str, ...] = ("format", "chunk", "layers")
# Wang et al. 2018: 16-bit (1,6,9) sums in chunks of 64.
ACCUMULATION_FORMAT = "e6m9s"
ACCUMULATION_CHUNK = 64
# The module types whose GEMM sums ``accumulation`` may make low (precsearch.runtime.accumulate has their twins).
ACCUMULATION_LAYER_TYPES: tuple[str, ...] = ("Linear", "Conv2d")
_GLOB_CHARS = frozenset("*?[")
_FIELDS = ("model", "graph_fingerprint", "input_shape", "batch_size", "defaults", "overrides", "module_types",
           "high_format", "rounding", "overflow", "loss_scaling", "promotion_threshold", "master_weights", "optimizer",
           "accumulation", "compression", "predicted", "provenance", "promotion_kinds", "gradient_rounding", "ties",
           "allow_unmatched_rules")
# Written only when they differ from these, so files without them read as before (in older precsearch too).
_OPTIONAL_DEFAULTS: dict[str, Any] = {"compression": "none", "promotion_kinds": list(PAPER_PROMOTION_KINDS),
                                      "gradient_rounding": "sum", "ties": "even", "allow_unmatched_rules": False}
_FILE_KEYS = (*_FIELDS, "schema_version", "formats")
# What every file Policy.save writes holds, so what a file read back must hold.
_SAVED_FIELDS = tuple(name for name in _FIELDS if name != "accumulation" and name not in _OPTIONAL_DEFAULTS)


def is_glob(key: str) -> bool:
    """Whether an ``overrides`` key is a glob over tensor ids rather than one id."""
    return not _GLOB_CHARS.isdisjoint(key)


class TensorRef(Protocol):
    """What resolving a format reads of a graph's tensor (precsearch.graph.tracing's ``TensorInfo`` is one)."""

    id: str
    kind: str
    module_type: str


class GraphRef(Protocol):
    """What ``Policy.assignment`` reads of a graph (precsearch.graph.tracing's ``TensorGraph`` is one)."""

    tensors: Mapping[str, Any]

    def assignable_ids(self) -> list[str]: ...


# ------------------------------------------------------------------------------------------- validation


def _mapping(value: Any, where: str) -> Mapping[str, Any]:
    if not isinstance(value, Mapping) or not all(isinstance(key, str) for key in value):
        raise PrecsearchError(f"{where} must be a mapping with string keys, not {type(value).__name__}")
    return value


def _kinds(value: Any, where: str) -> Mapping[str, Any]:
    value = _mapping(value, where)
    unknown = sorted(set(value) - set(ASSIGNABLE_KINDS))
    if unknown:
        raise PrecsearchError(f"{where}: unknown tensor kind {echo(unknown[0])}; use {', '.join(ASSIGNABLE_KINDS)}")
    return value


def _rule_formats(normal: Mapping[str, Any]) -> dict[str, str]:
    """Every low format a rule of the policy gives a tensor, by where it stands (``defaults.weight``, ...): fp32 is
    no low format (its tensors are not rounded, so never promoted)."""
    formats = {f"defaults.{kind}": spec for kind, spec in normal["defaults"].items()}
    formats |= {f"overrides[{echo(key)}]": spec for key, spec in normal["overrides"].items()}
    formats |= {f"module_types.{name}.{kind}": spec for name, rules in normal["module_types"].items()
                for kind, spec in rules.items()}
    return {where: spec for where, spec in formats.items()
            if not (isinstance(fmt := any_format(spec), FloatFormat) and fmt.is_fp32)}


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
        raise PrecsearchError(f"{where} must be a positive integer or null, not {echo(value)}")
    return value


@dataclass(frozen=True)
class Accumulation:
    """Simulated low-precision GEMM sums (Wang et al. 2018) in the Linear/Conv2d layers that ``layers`` names.

    ``format``: the accumulation format (Wang et al.: 16-bit ``e6m9s``); ``chunk``: the chunk length CL (>= 1;
    None sums sequentially, the swamping-prone baseline that chunking fixes); ``layers``: glob patterns over
    module qualified names (``"layer*.conv?"``), every Linear/Conv2d by default. ``apply_policy`` swaps the
    layers for precsearch.runtime.accumulate's chunked ones (``swap_chunked_layers``), forward and backward,
    before it instruments the model.

    Costly: a chunked layer makes CL + K/CL rounding passes in Python, 26x to 1000x the time of the plain
    layer on CPU, so no baseline turns it on. Wang et al.'s full recipe is
    ``baseline("wang_fp8", graph).replace(accumulation=Accumulation("e6m9s", 64))`` (precsearch.search.strategies).
    """

    format: str = ACCUMULATION_FORMAT
    chunk: int | None = ACCUMULATION_CHUNK
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


@dataclass(frozen=True)
class Policy:
    """A precision assignment plus everything training needs to enforce it; see the module docstring.

    Frozen and validated on construction (format specs normalized): ``replace`` makes a changed copy."""

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
        self._validate("policy")

    def _validate(self, where: str) -> None:
        """Check every field and normalize format specs; a ``PrecsearchError`` names the first problem."""
        normal: dict[str, Any] = {}
        if not isinstance(self.model, str):
            raise PrecsearchError(f"{where}: model must be a model spec string, not {echo(self.model)}")
        if self.graph_fingerprint is not None and not isinstance(self.graph_fingerprint, str):
            raise PrecsearchError(f"{where}: graph_fingerprint must be a string or null")
        if self.input_shape is not None:
            shape = self.input_shape
            if not isinstance(shape, list | tuple) or not all(isinstance(n, int) and not isinstance(n, bool) and n > 0
                                                              for n in shape):
                raise PrecsearchError(f"{where}: input_shape must be a list of positive integers, not {echo(shape)}")
            normal["input_shape"] = tuple(shape)
        normal["batch_size"] = _optional_int(self.batch_size, f"{where}: batch_size")
        normal["defaults"] = {k: format_name(v, f"{where}: defaults.{k}")
                              for k, v in _kinds(self.defaults, f"{where}: defaults").items()}
        normal["overrides"] = {k: format_name(v, f"{where}: overrides[{echo(k)}]")
                               for k, v in _mapping(self.overrides, f"{where}: overrides").items()}
        normal["module_types"] = {name: {k: format_name(v, f"{where}: module_types.{name}.{k}")
                                         for k, v in _kinds(rules, f"{where}: module_types.{name}").items()}
                                  for name, rules in _mapping(self.module_types, f"{where}: module_types").items()}
        normal["high_format"] = format_name(self.high_format, f"{where}: high_format", scaled=False)
        not_wider(normal["high_format"], _rule_formats(normal), where, "high_format")
        normal["rounding"] = {k: choice(v, POLICY_ROUNDINGS, f"{where}: rounding.{k}")
                              for k, v in _kinds(self.rounding, f"{where}: rounding").items()}
        normal["overflow"] = {k: choice(v, OVERFLOWS, f"{where}: overflow.{k}")
                              for k, v in _kinds(self.overflow, f"{where}: overflow").items()}
        normal["loss_scaling"] = loss_scaling(self.loss_scaling, f"{where}: loss_scaling",
                                              POLICY_DEFAULTS.loss_scaling_mode)
        normal["promotion_threshold"] = promotion_threshold(self.promotion_threshold, where)
        flag(self.master_weights, f"{where}: master_weights")
        flag(self.allow_unmatched_rules, f"{where}: allow_unmatched_rules")
        normal["optimizer"] = optimizer(self.optimizer, f"{where}: optimizer")
        normal["accumulation"] = _accumulation(self.accumulation, where)
        normal["compression"] = choice(self.compression, COMPRESSIONS, f"{where}: compression")
        normal["promotion_kinds"] = kinds_list(self.promotion_kinds, f"{where}: promotion_kinds")
        normal["gradient_rounding"] = choice(self.gradient_rounding, GRADIENT_ROUNDINGS,
                                             f"{where}: gradient_rounding")
        normal["ties"] = choice(self.ties, TIES, f"{where}: ties")
        normal["predicted"] = _json_data(self.predicted, f"{where}: predicted")
        normal["provenance"] = _json_data(self.provenance, f"{where}: provenance")
        for name, value in normal.items():
            object.__setattr__(self, name, value)

    # -- resolution ---------------------------------------------------------------------------------------

    def explain(self, tensor: TensorRef) -> tuple[str, str]:
        """(format spec, the rule that chose it) for a ``TensorInfo``, by the documented precedence."""
        if tensor.id in self.overrides:
            return self.overrides[tensor.id], f"override {tensor.id!r}"
        for pattern in sorted((key for key in self.overrides if is_glob(key)), key=lambda key: (-len(key), key)):
            if fnmatch.fnmatchcase(tensor.id, pattern):
                return self.overrides[pattern], f"override {pattern!r}"
        rule = self.module_types.get(tensor.module_type, {})
        if tensor.kind in rule:
            return rule[tensor.kind], f"module type {tensor.module_type}"
        if tensor.kind in self.defaults:
            return self.defaults[tensor.kind], f"default for {tensor.kind}"
        return "fp32", "no rule"

    def format_for(self, tensor: TensorRef) -> str:
        """The format spec of a ``TensorInfo`` (fp32 for master weights and anything no rule covers)."""
        if tensor.kind == "optimizer_state":
            return self.optimizer.get("state_format", "fp32")
        if tensor.kind not in ASSIGNABLE_KINDS:
            return "fp32"
        return self.explain(tensor)[0]

    def assignment(self, graph: GraphRef) -> dict[str, str]:
        """Tensor id -> format spec for every assignable tensor of ``graph`` (a ``TensorGraph``)."""
        return {tensor_id: self.format_for(graph.tensors[tensor_id]) for tensor_id in graph.assignable_ids()}

    def formats(self) -> dict[str, FloatFormat | ScaledFormat]:
        """Every format the policy names, by spec (the file lists them with their parameters)."""
        specs = {*self.defaults.values(), *self.overrides.values(), self.high_format}
        specs |= {spec for rules in self.module_types.values() for spec in rules.values()}
        if "state_format" in self.optimizer:
            specs.add(self.optimizer["state_format"])
        if self.accumulation is not None:
            specs.add(self.accumulation.format)
        return {spec: any_format(spec) for spec in sorted(specs)}

    # -- files --------------------------------------------------------------------------------------------

    def to_dict(self) -> dict[str, Any]:
        """The JSON document: every field, the schema version and the formats used with their parameters."""
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
        formats = self.formats()
        scaled = any(isinstance(fmt, ScaledFormat) for fmt in formats.values())
        data["schema_version"] = SCALED_SCHEMA_VERSION if scaled else 1
        data["formats"] = {spec: _format_entry(fmt) for spec, fmt in formats.items()}
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
            given = "is missing" if version is None else f"is {echo(version)} ({type(version).__name__})"
            raise PrecsearchError(f"{where}: schema_version {given}; give an integer, 1 or {SCHEMA_VERSION} (the "
                                  f"versions this precsearch reads; {SCALED_SCHEMA_VERSION} when a format is scaled)")
        if version > SCHEMA_VERSION:
            raise PrecsearchError(f"{where}: schema_version {version} was written by a newer precsearch "
                                  f"(this one reads {SCHEMA_VERSION}); upgrade precsearch")
        check_keys(data, _FILE_KEYS, where)
        try:
            policy = cls(**{name: data[name] for name in _FIELDS if name in data})
        except PrecsearchError as error:
            raise PrecsearchError(f"{where}: {str(error).removeprefix('policy: ')}") from None
        _check_listed_formats(data.get("formats", {}), where)
        scaled = next((spec for spec in policy.formats() if is_scaled(spec)), None)
        if scaled is not None and version < SCALED_SCHEMA_VERSION:
            raise PrecsearchError(f"{where}: scaled format {scaled} needs schema_version {SCALED_SCHEMA_VERSION} "
                                  f"(the file says {version}); write it with Policy.save")
        return policy

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> Policy:
        """Read and validate a policy file (precsearch.config.reading's limits). A missing, unreadable, corrupt,
        truncated, newer, incomplete or invalid file raises PrecsearchError."""
        where = f"policy {path}"
        data = load_json(path, "policy", "give a policy file that Policy.save wrote")
        policy = cls.from_dict(data, where=where)
        missing = [name for name in _SAVED_FIELDS if name not in data]
        if missing:
            raise PrecsearchError(f"{where}: missing required fields {', '.join(missing)} (a policy file states "
                                  "every setting rather than leave it to a default); write it with Policy.save")
        return policy

    def replace(self, **changes: Any) -> Policy:
        """A validated copy with ``changes`` applied."""
        return dataclasses.replace(self, **changes)


def _format_entry(fmt: FloatFormat | ScaledFormat) -> dict[str, Any]:
    """A format's parameters as the file lists them; a scaled one's are its element's plus how it scales."""
    if isinstance(fmt, ScaledFormat):
        return {**_format_entry(fmt.element), "element": fmt.element.name, "granularity": fmt.granularity,
                "block": fmt.block, "history": fmt.history}
    return {"bits": fmt.bits, "exp": fmt.exp, "man": fmt.man, "bias": fmt.bias, "special": fmt.special,
            "max": fmt.max, "min_subnormal": fmt.min_subnormal}


def _check_listed_formats(listed: Any, where: str) -> None:
    """The file's ``formats`` table is informative, but it must agree with how this precsearch reads the specs."""
    for spec, entry in _mapping(listed, f"{where}: formats").items():
        expected = _format_entry(any_format(format_name(spec, f"{where}: formats")))
        if not isinstance(entry, Mapping):
            raise PrecsearchError(f"{where}: formats.{spec} must be a mapping of its parameters")
        for key, value in entry.items():
            if key not in expected:
                raise PrecsearchError(f"{where}: formats.{spec}: unknown key {key!r}; allowed: {', '.join(expected)}")
            if value != expected[key]:
                raise PrecsearchError(f"{where}: formats.{spec}.{key} is {value!r} but this precsearch reads {spec} as "
                                      f"{key}={expected[key]!r}; the file was written by an incompatible precsearch")
