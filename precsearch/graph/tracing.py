"""The tensor graph of a CNN: every tensor training keeps, who produces and uses it, and the paper's groups.

`trace(model, example_input, batch_size=128)` traces the model with torch.fx (falling back to module hooks
when FX cannot trace it), runs it on the example input to learn every shape, and returns a `TensorGraph`:

- ops in execution order: the input, each leaf-module call, each function/method call that makes a new
  float tensor. Layout-only ops (`PASS_THROUGH`: view, reshape, flatten, contiguous, transpose, chunk,
  getitem, size, ...) create no tensor; their consumers are linked to the op that made the data. A copy
  made by `contiguous()`/`reshape()` of a transposed tensor (channel shuffle) is counted as that same
  tensor: autograd saves nothing for layout ops, so this matches the measured saved bytes.
- tensors of kinds `weight`, `activation`, `weight_grad`, `activation_grad` (the paper's P, Y, GP, GY:
  every op's output counts, BN/ReLU/add/pool/cat included), plus `master_weight` and `optimizer_state`
  (SGD momentum) per trainable parameter, which only the memory breakdown uses. The input batch is an
  activation without a gradient. BN running statistics are buffers, not tensors of the assignment.
- groups, as the paper defines them (see `Group`).
- per op (FX traces), what autograd saved while it ran (`attrs["saves"]`, recorded with saved_tensors_hooks
  in the shape run, which runs with gradients), and the GEMMs it ran where FX cannot see (`hidden_gemms`,
  recorded by a dispatch mode; `TensorGraph.unenforced`).

Shapes are those at the training batch size. When `batch_size` differs from the example's batch, the model
runs twice on tiny batches (the example, and the example plus one sample) and every dimension is
extrapolated linearly, which is exact for any shape that grows linearly with the batch (flatten included).
Tracing leaves the model as it found it: modes, buffers (BN running stats) and torch's global RNG state
(`training_mode`).
"""

from __future__ import annotations

import functools
import hashlib
import inspect
import json
import math
import operator
import os
import warnings
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

from precsearch.config.spec import ASSIGNABLE_KINDS, TensorId
from precsearch.errors import PrecsearchError
from precsearch.files import atomic_write_text

if TYPE_CHECKING:
    import networkx
    import pandas as pd


# Normalized function/method names (see `op_type_key`) whose output is a view or re-layout of their input.
PASS_THROUGH = frozenset({
    "view", "viewas", "reshape", "reshapeas", "flatten", "unflatten", "contiguous", "transpose", "permute",
    "t", "squeeze", "unsqueeze", "expand", "expandas", "chunk", "split", "tensorsplit", "unbind", "narrow",
    "select", "getitem", "getattr", "size", "dim", "numel", "get", "to", "float", "typeas", "detach",
})
PASS_THROUGH_MODULES = frozenset({"Flatten", "Unflatten", "Identity"})
GEMM_FUNCTIONS = frozenset({
    "conv1d", "conv2d", "conv3d", "convtranspose1d", "convtranspose2d", "convtranspose3d",
    "linear", "matmul", "mm", "bmm", "addmm",
})
# aten ops (overload packet names) that multiply matrices, as the dispatcher sees them after decomposition
_ATEN_GEMMS = frozenset({"mm", "addmm", "bmm", "baddbmm", "addbmm", "matmul", "linear", "convolution",
                         "_convolution", "mkldnn_convolution", "cudnn_convolution", "_mkldnn_matmul"})
# Ops (module type names, normalized function names) besides GEMMs whose output is a new tensor that their
# own backward does not read, when not run in place: the runtime may write its rounding over it.
_FRESH_OUTPUT_OPS = frozenset({
    "add", "sub", "mul", "cat", "BatchNorm1d", "BatchNorm2d", "BatchNorm3d", "SyncBatchNorm", "LayerNorm",
    "GroupNorm", "AdaptiveAvgPool2d", "AvgPool2d", "MaxPool2d",
})
# Ops (normalized names) besides GEMMs whose backward makes new input gradients (not a view or a pass-through
# of the gradient it receives), so that the gradient of an input they alone read is the rounding's to overwrite.
_FRESH_INPUT_GRADIENT_OPS = frozenset({
    "relu", "relu6", "hardtanh", "leakyrelu", "batchnorm", "batchnorm1d", "batchnorm2d", "batchnorm3d",
    "syncbatchnorm", "layernorm", "groupnorm", "maxpool1d", "maxpool2d", "maxpool3d", "avgpool1d", "avgpool2d",
    "avgpool3d",
})
_CONVS = (nn.Conv1d, nn.Conv2d, nn.Conv3d, nn.ConvTranspose1d, nn.ConvTranspose2d, nn.ConvTranspose3d)
GEMM_MODULES: tuple[type[nn.Module], ...] = (*_CONVS, nn.Linear)
_BATCH_NORMS = (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d, nn.SyncBatchNorm)
_DROPOUTS = (nn.Dropout, nn.Dropout1d, nn.Dropout2d, nn.Dropout3d, nn.AlphaDropout, nn.FeatureAlphaDropout)
_REFLECTED = {"radd", "rsub", "rmul", "rtruediv", "rdiv", "rmatmul", "rpow", "rfloordiv"}
_IN_PLACE_DUNDERS = {"iadd", "isub", "imul", "itruediv", "idiv", "imatmul", "ipow"}
_RENAMED = {"truediv": "div", "concat": "cat", "concatenate": "cat"}
JSON_FORMAT = "precsearch.graph.tracing"
JSON_VERSION = 1


def op_type_key(module_type: str) -> str:
    """Lower case without underscores, so module and function spellings meet: ReLU/relu, MaxPool2d/max_pool2d."""
    return module_type.replace("_", "").lower()


def _function_name(target: Any) -> tuple[str, bool]:
    """(name, in_place) of a called function or method: operator.add, torch.add, '__radd__' -> ('add', ...)."""
    raw = target if isinstance(target, str) else getattr(target, "__name__", type(target).__name__)
    in_place = False
    if raw.startswith("__") and raw.endswith("__") and len(raw) > 4:
        raw = raw[2:-2]
        if raw in _REFLECTED:
            raw = raw[1:]
        elif raw in _IN_PLACE_DUNDERS:
            raw, in_place = raw[1:], True
    elif raw.endswith("_") and not raw.startswith("_"):
        raw, in_place = raw[:-1], True
    return _RENAMED.get(raw, raw), in_place


# ------------------------------------------------------------------------------------------ data classes


@dataclass(frozen=True)
class TensorInfo:
    """One training tensor. Gradient, master and momentum tensors repeat the fields of the tensor they belong
    to (`op`, `producer`, `consumers` describe the forward tensor)."""

    id: str
    kind: str
    op: str
    node: str
    module_type: str
    param: str | None
    shape: tuple[int, ...]
    numel: int
    group: int
    producer: str | None
    consumers: tuple[str, ...]


@dataclass(frozen=True)
class OpInfo:
    """One operation. `inputs` are the producing ops; `input_tensors` the activations it reads (in order),
    `params` the weight tensors it uses, `outputs` the activations it makes. `attrs` holds what the cost
    model's autograd rules need (`inplace`, `running_stats` for BN, `p` for dropout)."""

    name: str
    node: str
    role: str
    module_type: str
    group: int
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]
    input_tensors: tuple[str, ...] = ()
    params: tuple[str, ...] = ()
    attrs: dict[str, Any] = field(default_factory=dict, hash=False, compare=True)


@dataclass(frozen=True)
class Group:
    """The paper's unit of precision decisions. In execution order each input or GEMM (conv/linear) op opens
    a group and other ops join the current one; a group owns its ops' activations and activation grads, and
    the weights (with grads, master copies, momentum) of ops whose inputs all come from inside it, so a
    GEMM's weight sits with the GEMM's input. A weight whose op reads several groups stays in the op's own
    group; a parameter used by several ops belongs where its first use puts it."""

    index: int
    ops: tuple[str, ...]
    tensor_ids: tuple[str, ...]


@dataclass
class TensorGraph:
    """Ops, tensors and groups of one model at one training batch size (see the module docstring)."""

    model_name: str
    batch_size: int
    input_shape: tuple[int, ...]
    tensors: dict[str, TensorInfo]
    ops: list[OpInfo]
    groups: list[Group]
    tracer: str = "fx"
    graph_module: torch.fx.GraphModule | None = None

    @functools.cached_property
    def nx(self) -> networkx.DiGraph:
        """Op nodes and tensor nodes; edges op -> activation -> consumer op, weight -> op, tensor -> its grad,
        master copy and momentum. Built on first use."""
        import networkx

        graph = networkx.DiGraph(model_name=self.model_name, batch_size=self.batch_size)
        for op in self.ops:
            graph.add_node(op.name, type="op", role=op.role, module_type=op.module_type, group=op.group)
        for info in self.tensors.values():
            graph.add_node(info.id, type="tensor", kind=info.kind, shape=info.shape, numel=info.numel,
                           group=info.group)
        for op in self.ops:
            for tensor_id in op.outputs:
                graph.add_edge(op.name, tensor_id)
            for tensor_id in (*op.input_tensors, *op.params):
                graph.add_edge(tensor_id, op.name)
        for info in self.tensors.values():
            forward = str(TensorId.parse(info.id).forward())
            if forward != info.id:  # a gradient, master copy or optimizer state: an edge from its tensor
                graph.add_edge(forward, info.id)
        return graph

    def assignable_ids(self) -> list[str]:
        """Ids of the tensors an assignment may hold low (weights, activations and their gradients)."""
        return [tid for tid, info in self.tensors.items() if info.kind in ASSIGNABLE_KINDS]

    def unenforced(self) -> dict[str, str]:
        """Op name -> why a policy cannot round inside it: an op that is no GEMM itself yet ran GEMMs where FX
        cannot see (a leaf function such as torchvision's `shifted_window_attention`, or a leaf module). The
        runtime rounds its inputs, weights and outputs; the values inside it stay float32."""
        return {op.name: f"runs {', '.join(op.attrs['hidden_gemms'])} inside an FX leaf"
                for op in self.ops if op.attrs.get("hidden_gemms")}

    def fingerprint(self) -> str:
        """Stable 16-hex-digit hash of the tensor ids and shapes, to tell whether a policy fits this graph."""
        payload = json.dumps([[tid, list(info.shape)] for tid, info in self.tensors.items()])
        return hashlib.sha256(payload.encode()).hexdigest()[:16]

    def to_dataframe(self) -> pd.DataFrame:
        """One row per tensor, in graph order."""
        import pandas as pd

        return pd.DataFrame([asdict(info) for info in self.tensors.values()])

    def to_json(self) -> str:
        """The whole graph (not the GraphModule) as JSON; `from_json` reads it back."""
        return json.dumps({
            "format": JSON_FORMAT, "version": JSON_VERSION, "model_name": self.model_name,
            "batch_size": self.batch_size, "input_shape": list(self.input_shape), "tracer": self.tracer,
            "fingerprint": self.fingerprint(), "ops": [asdict(op) for op in self.ops],
            "tensors": [asdict(info) for info in self.tensors.values()],
            "groups": [asdict(group) for group in self.groups],
        }, indent=1)

    @classmethod
    def from_json(cls, text: str) -> TensorGraph:
        try:
            data = json.loads(text)
        except json.JSONDecodeError as error:
            raise PrecsearchError(f"graph JSON is not valid JSON ({error}); "
                                  "write it with TensorGraph.to_json") from error
        if not isinstance(data, dict) or data.get("format") != JSON_FORMAT or data.get("version") != JSON_VERSION:
            raise PrecsearchError(f"not a {JSON_FORMAT} v{JSON_VERSION} file; write it with TensorGraph.to_json")
        tensors = [TensorInfo(**{**t, "shape": tuple(t["shape"]), "consumers": tuple(t["consumers"])})
                   for t in data["tensors"]]
        ops = [OpInfo(**{**o, **{k: tuple(o[k]) for k in ("inputs", "outputs", "input_tensors", "params")}})
               for o in data["ops"]]
        groups = [Group(g["index"], tuple(g["ops"]), tuple(g["tensor_ids"])) for g in data["groups"]]
        return cls(data["model_name"], data["batch_size"], tuple(data["input_shape"]),
                   {t.id: t for t in tensors}, ops, groups, data["tracer"])

    def save(self, path: str | os.PathLike[str]) -> None:
        """Write `to_json()` atomically: a temporary file in the same folder, then os.replace."""
        target = Path(path)
        if not target.parent.is_dir():
            raise PrecsearchError(f"cannot write {target}: folder {target.parent} does not exist; create it first")
        atomic_write_text(target, self.to_json())


# ---------------------------------------------------------------------------------- tracing, both ways


@dataclass(frozen=True, eq=False)
class _ParamRef:
    """A parameter reaching an op: qualified name, name as the op sees it, the object (identity dedupes it)."""

    qualname: str
    local: str
    param: nn.Parameter


@dataclass
class _RawOp:
    """An op as a tracer sees it, with output shapes at the example batch (None: not a float tensor)."""

    name: str
    node: str
    role: str
    module_type: str
    inputs: list[str]
    params: list[_ParamRef]
    shapes: list[tuple[int, ...] | None]
    attrs: dict[str, Any]

    def activation_ids(self) -> list[str | None]:
        return [None if shape is None else str(TensorId(self.name, "activation", index))
                for index, shape in enumerate(self.shapes)]


def _describe(value: Any) -> list[tuple[int, ...] | None] | None:
    """Output shapes of a value: [shape] for a float tensor, one entry per element for a tuple/list of tensors
    (None for non-float ones), None when it holds no tensor at all."""
    if isinstance(value, torch.Tensor):
        return [tuple(value.shape) if value.is_floating_point() else None]
    if isinstance(value, (tuple, list)) and value and all(isinstance(v, torch.Tensor) for v in value):
        return [tuple(v.shape) if v.is_floating_point() else None for v in value]
    return None


def _tensors_in(value: Any) -> Iterator[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, (tuple, list)):
        for item in value:
            yield from _tensors_in(item)
    elif isinstance(value, dict):
        for item in value.values():
            yield from _tensors_in(item)


def _first_line(error: BaseException) -> str:
    text = str(error).strip().splitlines()
    return f"{type(error).__name__}: {text[0] if text else ''}".rstrip(": ")


def makes_fresh_output(op: OpInfo) -> bool:
    """Whether ``op`` makes new output tensors that its backward does not read (a GEMM, a normalization, a
    pooling, an out-of-place sum or product), so a rounding after it may overwrite them."""
    return not op.attrs.get("inplace") and (op.role == "gemm" or op.module_type in _FRESH_OUTPUT_OPS)


# A Conv2d or BatchNorm2d module that reads a low activation, and a ReLU module that makes one, computes its
# backward a slice of samples at a time from the codes (precsearch.runtime.wrapper's ``_ConvOfPackedInput``,
# ``_BatchNormOfPackedInput``, ``_ReluOfPackedOutput``), each slice's decoded float32 values about this many
# bytes on CPU. Conv (torch 2.13's oneDNN, 2 cores): with 1 MiB slices, ResNet-18's conv backwards took
# 0.3-1.0x as long as one call over the batch, and held about a slice's worth of workspace besides their
# gradients where one call held two or three copies of the input. Batch norm (two passes of a few ops per
# slice) and ReLU: larger slices.
SLICE_BYTES = {"Conv2d": 2**20, "BatchNorm2d": 2**22, "ReLU": 2**20}


def backward_slice_rows(module_type: str, shape: Sequence[int], weight_numel: int) -> int:
    """Samples per slice of a sliced backward over a saved tensor of ``shape``: slices of ``SLICE_BYTES``; a
    conv whose weight is larger than its input runs as one slice (oneDNN's weight-sized temporaries then
    outweigh the input's: ResNet-18's layer 4, 30 MiB against 37 or more in slices)."""
    if module_type == "Conv2d" and weight_numel >= math.prod(shape):
        return shape[0]
    return max(1, SLICE_BYTES[module_type] // (4 * math.prod(shape[1:])))


# A conv that runs as one slice of samples (its weight outsizes its input) makes its backward a group of input
# channels at a time instead: each group's float32 weight slice, ``weight[:, group]``, about this many bytes.
CHANNEL_SLICE_BYTES = 2**20


def backward_slice_channels(shape: Sequence[int], weight_shape: Sequence[int]) -> int:
    """Input channels per group of the backward of a conv over an input of ``shape`` with a weight of
    ``weight_shape`` that runs as one slice of samples (``backward_slice_rows``): weight slices of
    ``CHANNEL_SLICE_BYTES``; all channels (one group) for a conv sliced by samples or a grouped conv (each output
    channel reads some input channels only: its weight has fewer input channels than its input)."""
    if backward_slice_rows("Conv2d", shape, math.prod(weight_shape)) < shape[0] or weight_shape[1] != shape[1]:
        return shape[1]
    per_channel = 4 * math.prod(weight_shape) // weight_shape[1]
    return max(1, min(shape[1], CHANNEL_SLICE_BYTES // per_channel))


def sliced_saved_tensor(op: OpInfo) -> str | None:
    """The tensor whose codes the runtime's backward of ``op`` reads in slices, where it is low: a traced
    ``nn.Conv2d``'s or ``nn.BatchNorm2d``'s (in training) one input, an ``nn.ReLU``'s output; else None."""
    if op.module_type in ("Conv2d", "BatchNorm2d") and len(op.input_tensors) == 1:
        return op.input_tensors[0]
    if op.module_type == "ReLU" and len(op.outputs) == 1:
        return op.outputs[0]
    return None


def _sole_readers(graph: TensorGraph) -> Iterator[tuple[OpInfo, OpInfo, int]]:
    """Each op whose output one op alone reads in the traced graph: (op, reader, times the reader reads it)."""
    ops = {op.node: op for op in graph.ops}
    for node in graph.graph_module.graph.nodes:
        users = list(node.users)
        if node.name in ops and len(users) == 1 and users[0].name in ops:
            yield ops[node.name], ops[users[0].name], _count_reads(users[0], node)


def _count_reads(user: torch.fx.Node, node: torch.fx.Node) -> int:
    reads: list[bool] = []
    torch.fx.node.map_arg((user.args, user.kwargs), lambda arg: reads.append(arg is node))
    return sum(reads)


def gradient_arrives_fresh(graph: TensorGraph) -> frozenset[str]:
    """The ops whose (single) output's gradient reaches its rounding as a new tensor nothing else holds: the
    output has one reader in the traced graph, which reads it once and whose backward makes new input
    gradients (a GEMM, a normalization, an activation function, a pooling), so that rounding may write over
    it. Empty for an untraced model."""
    if graph.graph_module is None:
        return frozenset()
    return frozenset(op.name for op, reader, reads in _sole_readers(graph) if reads == 1 and (
        reader.role == "gemm" or op_type_key(reader.module_type) in _FRESH_INPUT_GRADIENT_OPS))


def gradient_passes_from(graph: TensorGraph) -> dict[str, str]:
    """The ops whose (single) output is read once, by an add and nothing else, each with that add: the output's
    gradient is the add's output gradient itself (or, for a broadcast input, a new sum of it). Where the runtime
    rounded that gradient to the output gradient's own format, rounding it again changes no value, so it may be
    rounded over itself although the add's other input holds it too. Empty for an untraced model."""
    if graph.graph_module is None:
        return {}
    return {op.name: reader.name for op, reader, reads in _sole_readers(graph)
            if reads == 1 and op_type_key(reader.module_type) == "add"}


def is_gemm_module(module: nn.Module) -> bool:
    """The one definition of a GEMM layer: convolutions and Linear, subclasses included."""
    return isinstance(module, GEMM_MODULES)


def _module_attrs(module: nn.Module) -> dict[str, Any]:
    attrs: dict[str, Any] = {}
    if getattr(module, "inplace", False):
        attrs["inplace"] = True
    if isinstance(module, _BATCH_NORMS):
        attrs["running_stats"] = bool(module.track_running_stats)
    if isinstance(module, _DROPOUTS):
        attrs["p"] = float(module.p)
    return attrs


def _function_attrs(name: str, in_place: bool, args: Sequence[Any], kwargs: dict[str, Any]) -> dict[str, Any]:
    attrs: dict[str, Any] = {}
    if in_place or kwargs.get("inplace") is True:
        attrs["inplace"] = True
    if name == "batchnorm":
        running = kwargs.get("running_mean", args[1] if len(args) > 1 else None)
        attrs["running_stats"] = running is not None
    if name.startswith("dropout") or name.endswith("dropout"):
        attrs["p"] = float(kwargs.get("p", args[1] if len(args) > 1 else 0.5))
        attrs["training"] = bool(kwargs.get("training", args[2] if len(args) > 2 else True))
    return attrs


def _module_params(module: nn.Module, qualname: str) -> list[_ParamRef]:
    prefix = f"{qualname}." if qualname else ""
    return [_ParamRef(prefix + local, local, param) for local, param in module.named_parameters()]


class _LeafSpec:
    """Which modules are traced as one op: torch.nn's own modules (FX's default) plus the user's choice,
    given as module classes, class names or qualified module names."""

    def __init__(self, model: nn.Module, leaf_modules: Iterable[type | str]) -> None:
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
        if is_gemm_module(module):  # subclasses too (e.g. precsearch.runtime.accumulate's chunked layers)
            return True
        return self.default.is_leaf_module(module, qualname)


class _Tracer(torch.fx.Tracer):
    def __init__(self, leaf: _LeafSpec) -> None:
        super().__init__()
        self.leaf = leaf

    def is_leaf_module(self, m: nn.Module, module_qualified_name: str) -> bool:
        return self.leaf(m, module_qualified_name)


class _OpNamer:
    """Unique op names: a module call is named by its qualified name (`#k` added on its k-th later call); a
    function call by an FX-style name (`add`, `add_1`, ...) that is never a module's qualified name or an
    earlier op's name."""

    def __init__(self, model: nn.Module) -> None:
        self.modules = {qualname for qualname, _ in model.named_modules()}
        self.used: set[str] = set()
        self.calls: Counter[str] = Counter()

    def module(self, qualname: str) -> str:
        count = self.calls[qualname]
        self.calls[qualname] += 1
        name = qualname if count == 0 else f"{qualname}#{count}"
        self.used.add(name)
        return name

    def function(self, candidate: str) -> str:
        name, suffix = candidate, 0
        while name in self.used or name in self.modules:
            suffix += 1
            name = f"{candidate}_{suffix}"
        self.used.add(name)
        return name


def _is_aten_gemm(name: str) -> bool:
    """Whether an aten op (by its overload packet's name) multiplies matrices: the rounding points of a GEMM."""
    return name in _ATEN_GEMMS or "scaled_dot_product" in name


class _GemmRecorder(TorchDispatchMode):
    """Records the GEMMs torch dispatches while it is active, below FX: those run inside a leaf function."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if _is_aten_gemm(name):
            self.seen.append(f"aten.{name}")
        return func(*args, **(kwargs or {}))


@dataclass(frozen=True)
class _Saved:
    """One storage autograd saved while a node ran: a value of node `node` (output `position`, None when it is
    a storage no node made), and its whole storage's bytes and element size (the fallback price)."""

    node: str | None
    position: int
    nbytes: int
    itemsize: int


class _ShapeRecorder(torch.fx.Interpreter):
    """Runs a GraphModule with gradients and keeps, by node name: `_describe` of its value, the storages
    autograd saved while it ran (`_Saved`, what the cost model prices: derived, not guessed) and the GEMMs it
    dispatched. Every value stays alive, so a storage address names one storage for the whole run."""

    def __init__(self, module: torch.fx.GraphModule) -> None:
        super().__init__(module)
        self.extra_traceback = False
        self.records: dict[str, list[tuple[int, ...] | None] | None] = {}
        self.saves: dict[str, list[_Saved]] = {}
        self.gemms: dict[str, list[str]] = {}
        self._params = {p.untyped_storage().data_ptr() for p in module.parameters()}
        self._writer: dict[int, tuple[str, int]] = {}  # storage address -> (node, output) that last wrote it
        self._alive: list[Any] = []

    def run(self, *args: Any, **kwargs: Any) -> Any:
        with torch.enable_grad():
            return super().run(*args, **kwargs)

    def run_node(self, n: torch.fx.Node) -> Any:
        saved: list[torch.Tensor] = []
        recorder = _GemmRecorder()
        with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t), recorder:
            result = super().run_node(n)
        self.records[n.name] = _describe(result)
        values = [result] if isinstance(result, torch.Tensor) else list(result) if _describe(result) else []
        own = {t.untyped_storage().data_ptr(): (n.name, i) for i, t in enumerate(values)}
        entries: dict[int, _Saved] = {}
        for tensor in saved:
            ptr = tensor.untyped_storage().data_ptr()
            if ptr in entries or ptr in self._params:
                continue
            node, position = own.get(ptr) or self._writer.get(ptr) or (None, 0)
            entries[ptr] = _Saved(node, position, tensor.untyped_storage().nbytes(), tensor.element_size())
        self._writer.update(own)
        self.saves[n.name] = list(entries.values())
        self.gemms[n.name] = recorder.seen
        self._alive.append((result, saved))
        return result


def _fx_ops(gm: torch.fx.GraphModule, run: _ShapeRecorder) -> list[_RawOp]:
    """Raw ops of a traced graph, with pass-throughs resolved to the activations they carry, that reach the
    graph's output. Each op's attrs hold what autograd saved while it ran (`saves`, see `_saved_items`) and,
    for an op that is no GEMM itself, the GEMMs it ran inside (`hidden_gemms`): FX cannot see into it."""
    records = run.records
    sources: dict[str, Any] = {}  # node name -> activation id, _ParamRef, tuple of those, or None
    ops: list[_RawOp] = []
    namer = _OpNamer(gm)
    outputs: list[str] = []
    for node in gm.graph.nodes:
        out = records.get(node.name)
        if node.op == "output":
            outputs = _split_sources(sources.get(n.name) for n in node.all_input_nodes)[0]
        if node.op == "placeholder":
            if not ops and out is not None:
                ops.append(_RawOp(namer.function(node.name), node.name, "input", "input", [], [], out, {}))
                sources[node.name] = ops[-1].activation_ids()[0]
            continue
        if node.op == "get_attr":
            value = operator.attrgetter(node.target)(gm)
            is_param = isinstance(value, nn.Parameter)
            sources[node.name] = _ParamRef(node.target, node.target, value) if is_param else None
            continue
        if node.op not in ("call_module", "call_function", "call_method") or out is None:
            continue
        arg_sources = [sources.get(n.name) for n in node.all_input_nodes]
        if node.op == "call_module":
            module = gm.get_submodule(node.target)
            module_type, pass_through = type(module).__name__, type(module).__name__ in PASS_THROUGH_MODULES
        else:
            module_type, in_place = _function_name(node.target)
            pass_through = op_type_key(module_type) in PASS_THROUGH
        if pass_through:
            sources[node.name] = _select(node, sources, arg_sources)
            continue
        if all(shape is None for shape in out):
            continue
        activations, params = _split_sources(arg_sources)
        if node.op == "call_module":
            name = namer.module(node.target)
            role = "gemm" if is_gemm_module(module) else "other"
            params = _module_params(module, node.target)
            attrs = _module_attrs(module)
        else:
            name = namer.function(node.name)
            role = "gemm" if op_type_key(module_type) in GEMM_FUNCTIONS else "other"
            attrs = _function_attrs(op_type_key(module_type), in_place, node.args, node.kwargs)
        ops.append(_RawOp(name, node.name, role, module_type, activations, params, out, attrs))
        ids = ops[-1].activation_ids()
        sources[node.name] = ids[0] if len(ids) == 1 else tuple(ids)
        attrs["saves"] = _saved_items(run.saves[node.name], sources)
        if role != "gemm" and run.gemms[node.name]:
            attrs["hidden_gemms"] = sorted(set(run.gemms[node.name]))
    return _live(ops, outputs)


def _saved_items(saves: list[_Saved], sources: dict[str, Any]) -> list[list[Any]]:
    """What an op saved, for the cost model: ["activation", id] for a storage holding an activation of the
    graph (views and layout copies included), else ["new", numel, itemsize] for a storage autograd or the op
    made (a clone of an in-place op's input, BN statistics, a dropout mask, indices, values computed inside
    a leaf function), at its own dtype."""
    items: list[list[Any]] = []
    for saved in saves:
        source = sources.get(saved.node) if saved.node is not None else None
        if isinstance(source, tuple):
            source = source[saved.position] if saved.position < len(source) else None
        if isinstance(source, str):
            items.append(["activation", source])
        else:
            items.append(["new", saved.nbytes // saved.itemsize, saved.itemsize])
    return items


def _live(ops: list[_RawOp], outputs: Iterable[str]) -> list[_RawOp]:
    """The input op and the ops whose outputs reach the model's output: an op computed only for control flow
    (`x.sum() > 0`) or left unused gets no gradient and is not a training tensor."""
    live = set(outputs)
    kept = []
    for op in reversed(ops):
        if op.role == "input" or any(tensor_id in live for tensor_id in op.activation_ids()):
            kept.append(op)
            live.update(op.inputs)
    return kept[::-1]


def _select(node: torch.fx.Node, sources: dict[str, Any], arg_sources: list[Any]) -> Any:
    """What a pass-through carries: the element of a multi-output op for getitem, else its first input's data."""
    if node.target is operator.getitem and isinstance(node.args[1], int):
        carried = sources.get(node.args[0].name) if isinstance(node.args[0], torch.fx.Node) else None
        if isinstance(carried, tuple):
            return carried[node.args[1]]
    return next((source for source in arg_sources if source is not None), None)


def _split_sources(arg_sources: Iterable[Any]) -> tuple[list[str], list[_ParamRef]]:
    """Activation ids (deduplicated, in order) and parameters among an op's argument sources."""
    activations: list[str] = []
    params: list[_ParamRef] = []
    for source in arg_sources:
        for item in source if isinstance(source, tuple) else (source,):
            if isinstance(item, str) and item not in activations:
                activations.append(item)
            elif isinstance(item, _ParamRef):
                params.append(item)
    return activations, params


class _HookRecorder(TorchFunctionMode):
    """The fallback tracer: forward hooks on leaf modules record module calls, and a TorchFunctionMode records
    the torch functions and tensor methods called outside leaf modules. Data flow follows tensor identity
    (every tensor seen is kept alive, so ids are never reused while tracing)."""

    def __init__(self, model: nn.Module, leaf: _LeafSpec, input_name: str) -> None:
        super().__init__()
        self.model, self.leaf, self.input_name = model, leaf, input_name
        self.ops: list[_RawOp] = []
        self.sources: dict[int, Any] = {}
        self.params = {id(p): name for name, p in model.named_parameters()}
        self.alive: list[Any] = []
        self.depth = 0
        self.namer = _OpNamer(model)

    def run(self, x: torch.Tensor) -> Any:
        name = self.namer.function(self.input_name)
        self.ops.append(_RawOp(name, name, "input", "input", [], [], _describe(x), {}))
        self._bind(x, self.ops[-1])
        handles = []
        for qualname, module in self.model.named_modules():
            if module is not self.model and self.leaf(module, qualname) and not self._inside_leaf(qualname):
                handles.append(module.register_forward_pre_hook(self._enter))
                handles.append(module.register_forward_hook(self._make_exit(qualname)))
        try:
            with self:
                output = self.model(x)
        finally:
            for handle in handles:
                handle.remove()
        self.ops = _live(self.ops, _split_sources(map(self._source, _tensors_in(output)))[0])
        return output

    def _inside_leaf(self, qualname: str) -> bool:
        parts = qualname.split(".")
        return any(self.leaf(self.model.get_submodule(".".join(parts[:i])), ".".join(parts[:i]))
                   for i in range(1, len(parts)))

    def _bind(self, value: Any, op: _RawOp) -> None:
        ids = op.activation_ids()
        tensors = [value] if isinstance(value, torch.Tensor) else list(value)
        for tensor, tensor_id in zip(tensors, ids, strict=False):
            self.sources[id(tensor)] = tensor_id
        self.alive.append(value)

    def _source(self, tensor: torch.Tensor) -> Any:
        """A parameter's _ParamRef, else the activation id (or tuple) the tensor carries, else None."""
        if id(tensor) in self.params:
            return _ParamRef(self.params[id(tensor)], self.params[id(tensor)], tensor)
        return self.sources.get(id(tensor))

    def _inputs(self, args: Iterable[Any]) -> tuple[list[str], list[_ParamRef]]:
        return _split_sources(self._source(tensor) for tensor in _tensors_in(list(args)))

    def _enter(self, module: nn.Module, args: Any) -> None:
        self.depth += 1

    def _make_exit(self, qualname: str):
        def exit_hook(module: nn.Module, args: Any, output: Any) -> None:
            self.depth -= 1
            shapes = _describe(output)
            if shapes is None:
                return
            if type(module).__name__ in PASS_THROUGH_MODULES:
                self._pass_through(args, output)
                return
            if all(shape is None for shape in shapes):
                return
            activations, _ = self._inputs(args)
            name = self.namer.module(qualname)
            role = "gemm" if is_gemm_module(module) else "other"
            op = _RawOp(name, name, role, type(module).__name__, activations, _module_params(module, qualname),
                        shapes, _module_attrs(module))
            self.ops.append(op)
            self._bind(output, op)

        return exit_hook

    def _pass_through(self, args: Iterable[Any], output: Any) -> None:
        carried = next((s for s in map(self._source, _tensors_in(list(args))) if s is not None), None)
        for tensor in _tensors_in(output):
            self.sources[id(tensor)] = carried
        self.alive.append(output)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        output = func(*args, **kwargs)
        if self.depth > 0:
            return output
        shapes = _describe(output)
        if shapes is None:
            return output
        module_type, in_place = _function_name(func)
        key = op_type_key(module_type)
        if key in PASS_THROUGH:
            self._pass_through([*args, *kwargs.values()], output)
            return output
        if all(shape is None for shape in shapes):
            return output
        activations, params = self._inputs([*args, *kwargs.values()])
        name = self.namer.function(module_type)
        role = "gemm" if key in GEMM_FUNCTIONS else "other"
        op = _RawOp(name, name, role, module_type, activations, params, shapes,
                    _function_attrs(key, in_place, args, kwargs))
        self.ops.append(op)
        self._bind(output, op)
        return output


# ------------------------------------------------------------------------------------------------ trace


@contextmanager
def training_mode(model: nn.Module) -> Iterator[None]:
    """Put `model` in training mode; afterwards restore its modules' modes, its buffers (BN running stats)
    and torch's global RNG state, so tracing or measuring leaves no trace."""
    modes = [(module, module.training) for module in model.modules()]
    buffers = [(buffer, buffer.detach().clone()) for buffer in model.buffers()]
    rng = torch.random.get_rng_state()
    model.train()
    try:
        yield
    finally:
        with torch.no_grad():
            for buffer, saved in buffers:
                buffer.copy_(saved)
        for module, mode in modes:
            module.training = mode
        torch.random.set_rng_state(rng)


@contextmanager
def _shape_runs() -> Iterator[None]:
    """No gradients and one intra-op thread: the tiny shape-run batches gain nothing from more threads, and on a
    busy 2-core machine OpenMP's spinning made a batch-2 ResNet-18 forward 20x slower with 2 threads than 1."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with torch.no_grad():
            yield
    finally:
        torch.set_num_threads(threads)


def _expected_input(model: nn.Module, given: tuple[int, ...]) -> str:
    """'; its first layer ... expects ...' when the first conv/linear layer cannot take the given shape, else ''."""
    for qualname, module in model.named_modules():
        if isinstance(module, _CONVS):
            spatial = len(module.kernel_size)
            expected = "(N, " + ", ".join([str(module.in_channels), *"DHW"[3 - spatial:]]) + ")"
            if len(given) != spatial + 2 or given[1] != module.in_channels:
                return f"; its first layer {qualname} ({type(module).__name__}) expects {expected}"
            return ""
        if isinstance(module, nn.Linear):
            if not given or given[-1] != module.in_features:
                return f"; its first layer {qualname} (Linear) expects (N, ..., {module.in_features})"
            return ""
    return ""


def forward_error(name: str, model: nn.Module, x: torch.Tensor, error: BaseException,
                  fx_error: BaseException | None = None) -> PrecsearchError:
    """One line for a forward that raised: the input shape, the error, the first layer's expected input."""
    given = tuple(x.shape)
    message = (f"{name} failed on the example input of shape {given} ({_first_line(error)})"
               f"{_expected_input(model, given)}")
    if fx_error is not None:
        message += f"; torch.fx could not trace it either ({_first_line(fx_error)})"
    return PrecsearchError(message.replace("\n", " "))


def _no_tensor(name: str, output: Any) -> PrecsearchError:
    return PrecsearchError(f"{name} returns {type(output).__name__}, not a float tensor; trace needs a model "
                           "whose forward returns a tensor (or a tuple of tensors)")


def _returns_float(output: Any) -> bool:
    return any(t.is_floating_point() for t in _tensors_in(output))


def _grow(x: torch.Tensor) -> torch.Tensor:
    """The example plus one more sample (its first), for the second point of the shape extrapolation."""
    return torch.cat([x, x[:1]])


def _extrapolate(shape0: tuple[int, ...] | None, shape1: tuple[int, ...] | None, b0: int, target: int,
                 op: str) -> tuple[int, ...] | None:
    """Shape at batch `target` from shapes at b0 and b0 + 1, assuming each dimension is linear in the batch."""
    if shape0 is None and shape1 is None:
        return None
    if shape0 is not None and shape1 is not None and len(shape0) == len(shape1):
        result = tuple(d0 + (target - b0) * (d1 - d0) for d0, d1 in zip(shape0, shape1, strict=True))
        if all(d >= 0 for d in result):
            return result
    raise PrecsearchError(f"op {op} changes shape irregularly with the batch size, so shapes at the training "
                          "batch cannot be inferred; pass an example input at the training batch size")


def trace(model: nn.Module, example_input: torch.Tensor, batch_size: int | None = None,
          leaf_modules: Iterable[type | str] = (), model_name: str | None = None) -> TensorGraph:
    """Trace `model` on `example_input` (a small batch such as (2, 3, 32, 32); 2 or more when BatchNorm sees
    (N, C) tensors) into a TensorGraph whose shapes are at `batch_size` (default: the example's batch).

    `leaf_modules` (classes, class names or qualified module names) are kept as single ops, besides torch.nn's
    own modules. Falls back to module hooks, with one warning, when torch.fx cannot trace the model
    (data-dependent control flow); `graph_module` is None then. `model_name` defaults to the class name.
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
    leaf = _LeafSpec(model, list(leaf_modules))
    gm: torch.fx.GraphModule | None = None
    fx_error: BaseException | None = None
    with training_mode(model), _shape_runs():
        try:
            tracer = _Tracer(leaf)
            graph = tracer.trace(model)
            gm = torch.fx.GraphModule(tracer.root, graph, name)
        except Exception as error:  # any FX failure means: use the hook tracer
            fx_error = error
        if gm is not None:
            ops, shapes1 = _trace_fx(gm, name, model, example_input, b0 != target)
        else:
            warnings.warn(f"torch.fx could not trace {name} ({_first_line(fx_error)}); "
                          "tracing it with module hooks instead", stacklevel=2)
            ops, shapes1 = _trace_hooks(model, leaf, name, example_input, fx_error, b0 != target)
    for op in ops:
        extrapolated = shapes1.get(op.name, op.shapes)
        op.shapes = [_extrapolate(s0, s1, b0, target, op.name) if b0 != target else s0
                     for s0, s1 in zip(op.shapes, extrapolated, strict=True)]
        if b0 != target and "saves" in op.attrs:
            op.attrs["saves"] = [_extrapolate_save(item, b0, target, op.name) for item in op.attrs["saves"]]
    graph = _assemble(ops, name, target, tuple(example_input.shape[1:]), "fx" if gm is not None else "hooks", gm)
    missed = untraced_modules(model, graph, leaf_modules) if gm is None else []
    if missed:  # the hook tracer sees only the branch the example input took
        warnings.warn(f"{len(missed)} module(s) of {name} did not run on the example input, so no policy covers "
                      f"them and their memory is not counted: {', '.join(missed[:8])}; trace with a real batch "
                      "that takes every branch (PrecisionModel warns if they run)", stacklevel=2)
    return graph


def untraced_modules(model: nn.Module, graph: TensorGraph, leaf_modules: Iterable[type | str] = ()) -> list[str]:
    """Leaf modules of ``model`` that are not ops of ``graph``: they did not run when it was traced (a branch
    the example input did not take, or a module the forward never calls). Code that runs but is not in the
    graph is covered by no policy rule and counted by no memory prediction. Layout-only modules make no op."""
    leaf = _LeafSpec(model, list(leaf_modules))
    traced = {op.name.partition("#")[0] for op in graph.ops}
    leaves: list[str] = []
    missed = []
    for qualname, module in model.named_modules():
        if not qualname or not leaf(module, qualname) or any(qualname.startswith(f"{p}.") for p in leaves):
            continue
        leaves.append(qualname)
        if qualname not in traced and type(module).__name__ not in PASS_THROUGH_MODULES:
            missed.append(qualname)
    return missed


def _record(make_recorder: Callable[[], Any], name: str, model: nn.Module, x: torch.Tensor, grow: bool,
            fx_error: BaseException | None) -> list[Any]:
    """Run a fresh recorder on the example, and on one more sample if `grow`; the recorders, in that order."""
    recorders = []
    for sample in (x, _grow(x)) if grow else (x,):
        recorder = make_recorder()
        try:
            output = recorder.run(sample)
        except Exception as error:  # whatever the model raises becomes one clear line
            raise forward_error(name, model, sample, error, fx_error) from error
        if not _returns_float(output):
            raise _no_tensor(name, output)
        recorders.append(recorder)
    return recorders


def _trace_fx(gm: torch.fx.GraphModule, name: str, model: nn.Module, x: torch.Tensor,
              grow: bool) -> tuple[list[_RawOp], dict[str, list[Any]]]:
    """Raw ops of the traced graph with shapes at the example batch, and shapes at one more sample if `grow`
    (the numel of each storage an op saved then holds both points, for `trace` to extrapolate)."""
    runs = _record(lambda: _ShapeRecorder(gm), name, model, x, grow, None)
    ops = _fx_ops(gm, runs[0])
    if not grow:
        return ops, {}
    grown = {op.name: op for op in _fx_ops(gm, runs[1])}
    for op in ops:
        if "saves" in op.attrs:
            op.attrs["saves"] = _grow_saves(op, grown.get(op.name), x.shape[0])
    return ops, {op.name: runs[1].records.get(op.node) or [None] * len(op.shapes) for op in ops}


def _grow_saves(op: _RawOp, grown: _RawOp | None, b0: int) -> list[list[Any]]:
    """`op`'s saves with each new storage's numel as [numel at b0, numel at b0 + 1], extrapolated by `trace`."""
    saves = op.attrs["saves"]
    other = grown.attrs["saves"] if grown is not None else None
    if other is None or [item[:1] for item in other] != [item[:1] for item in saves]:
        raise PrecsearchError(f"op {op.name} saves different tensors for backward at batch {b0} and {b0 + 1}, so "
                              "its saved bytes at the training batch cannot be inferred; pass an example input "
                              "at the training batch size")
    return [[item[0], [item[1], more[1]], item[2]] if item[0] == "new" else item
            for item, more in zip(saves, other, strict=True)]


def _extrapolate_save(item: list[Any], b0: int, target: int, op: str) -> list[Any]:
    """A `_grow_saves` item at the training batch: a new storage's numel extrapolated like a shape."""
    if item[0] != "new":
        return item
    kind, (numel0, numel1), itemsize = item
    return [kind, _extrapolate((numel0,), (numel1,), b0, target, op)[0], itemsize]


def _trace_hooks(model: nn.Module, leaf: _LeafSpec, name: str, x: torch.Tensor, fx_error: BaseException | None,
                 grow: bool) -> tuple[list[_RawOp], dict[str, list[Any]]]:
    """Raw ops from module hooks (see `_HookRecorder`), and shapes at one more sample if `grow`."""
    parameters = list(inspect.signature(model.forward).parameters)
    input_name = parameters[0] if parameters else "input"
    runs = [recorder.ops for recorder in
            _record(lambda: _HookRecorder(model, leaf, input_name), name, model, x, grow, fx_error)]
    if not grow:
        return runs[0], {}
    if [op.name for op in runs[0]] != [op.name for op in runs[1]]:
        raise PrecsearchError(f"{name} runs different ops at batch {x.shape[0]} and {x.shape[0] + 1}, so shapes "
                              "at the training batch cannot be inferred; pass an example input at the training "
                              "batch size")
    return runs[0], {op.name: op.shapes for op in runs[1]}


def _assemble(raw_ops: list[_RawOp], model_name: str, batch_size: int, input_shape: tuple[int, ...],
              tracer: str, gm: torch.fx.GraphModule | None) -> TensorGraph:
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
                                                    ref.qualname, shape, _numel(shape), weight_group, None, users)
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
                                              _numel(shape), own, op.name, tuple(consumers.get(tensor_id, ())))
        ops.append(OpInfo(op.name, op.node, op.role, op.module_type, own,
                          tuple(dict.fromkeys(producer[t] for t in op.inputs)), tuple(outputs), tuple(op.inputs),
                          tuple(param_ids), dict(op.attrs)))
    groups = [Group(index, tuple(o.name for o in ops if o.group == index),
                    tuple(tid for tid, info in tensors.items() if info.group == index))
              for index in range(group + 1)]
    return TensorGraph(model_name, batch_size, input_shape, tensors, ops, groups, tracer, gm)


def grad_id(tensor_id: str) -> str:
    """The id of an activation's or weight's gradient (``spec.TensorId.grad``): ``op:activation<k>`` ->
    ``op:activation_grad<k>``, ``op:weight`` -> ``op:weight_grad``."""
    return str(TensorId.parse(tensor_id).grad())


def _numel(shape: Sequence[int]) -> int:
    count = 1
    for dim in shape:
        count *= dim
    return count
