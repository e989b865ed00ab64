"""The tensor graph's types: training tensors, ops, the paper's groups, and the graph with its JSON form.

A graph's tensors are of kinds `weight`, `activation`, `weight_grad`, `activation_grad` (the paper's P, Y, GP,
GY: every op's output counts, BN/ReLU/add/pool/cat included), plus `master_weight` and `optimizer_state` (SGD
momentum) per trainable parameter, which only the memory breakdown uses. The input batch is an activation
without a gradient. BN running statistics are buffers, not tensors of the assignment. `precsearch.graph.tracing`
makes graphs; `rules` is the op table they were traced with, which the cost model and the runtime read.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from precsearch.config.spec import ASSIGNABLE_KINDS, TensorId
from precsearch.errors import PrecsearchError
from precsearch.files import atomic_write_text
from precsearch.graph.op_rules import OP_RULES, OpRules

if TYPE_CHECKING:
    import networkx
    import pandas as pd

# The JSON file format's name (kept from the module that first wrote it, so saved graphs stay readable).
JSON_FORMAT = "precsearch.graph.tracing"
JSON_VERSION = 2  # 2: ops carry `module` and `call`

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
    model's autograd rules need (`inplace`, `running_stats` for BN, `p` for dropout). A module call's `module` is
    the module's qualified name and `call` which of its calls it is (0: the first; `name` is `module#call` after
    it); a function call's (and the input's) `module` is None."""

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
    module: str | None = None
    call: int = 0


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
    """Ops, tensors and groups of one model at one training batch size (see `precsearch.graph.tracing.trace`),
    and the op rules they were traced with (not part of the JSON form: `from_json` takes them)."""

    model_name: str
    batch_size: int
    input_shape: tuple[int, ...]
    tensors: dict[str, TensorInfo]
    ops: list[OpInfo]
    groups: list[Group]
    tracer: str = "fx"
    graph_module: torch.fx.GraphModule | None = None
    rules: OpRules = field(default=OP_RULES, repr=False, compare=False)
    opaque_modules: tuple[str, ...] = ()  # submodules FX could not trace, traced as single ops (FX traces only)

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
            "opaque_modules": list(self.opaque_modules), "fingerprint": self.fingerprint(),
            "ops": [asdict(op) for op in self.ops], "tensors": [asdict(info) for info in self.tensors.values()],
            "groups": [asdict(group) for group in self.groups]}, indent=1)

    @classmethod
    def from_json(cls, text: str, rules: OpRules = OP_RULES) -> TensorGraph:
        """The graph `to_json` wrote, read with the op rules it was traced with (default: the table's)."""
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
                   {t.id: t for t in tensors}, ops, groups, data["tracer"], rules=rules,
                   opaque_modules=tuple(data.get("opaque_modules", ())))

    def save(self, path: str | os.PathLike[str]) -> None:
        """Write `to_json()` atomically: a temporary file in the same folder, then os.replace."""
        target = Path(path)
        if not target.parent.is_dir():
            raise PrecsearchError(f"cannot write {target}: folder {target.parent} does not exist; create it first")
        atomic_write_text(target, self.to_json())


def grad_id(tensor_id: str) -> str:
    """The id of an activation's or weight's gradient (``spec.TensorId.grad``): ``op:activation<k>`` ->
    ``op:activation_grad<k>``, ``op:weight`` -> ``op:weight_grad``."""
    return str(TensorId.parse(tensor_id).grad())
