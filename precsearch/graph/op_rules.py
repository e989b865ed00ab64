"""The one table of what precsearch knows about each kind of op, read by graph, cost and runtime.

An op kind is a module class (``nn.Conv2d``) or a function or method name (``relu``, ``max_pool2d``, ``view``),
names compared as ``op_type_key`` spells them. Each kind has an ``OpRule``: whether it is a GEMM, a layout-only
pass-through or no tensor op at all, what autograd saves for it, whether the runtime may write over its output
or its input gradient, and the workspaces and slices of its backward. ``OP_RULES`` is the table; an
``OpRules`` built from it with ``with_modules``/``with_functions`` and passed to ``trace(..., rules=...)``
travels with the graph (``TensorGraph.rules``) to the cost model and the runtime.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

from torch import nn

from precsearch.errors import PrecsearchError

__all__ = ["ASSUMED_SAVES", "OP_RULES", "ChannelSlices", "OpRule", "OpRules", "SlicedBackward", "call_name",
           "op_type_key"]

# What an op no rule describes is assumed to save for backward: all it reads and makes.
ASSUMED_SAVES = ("inputs", "output")


@dataclass(frozen=True)
class ChannelSlices:
    """A conv that runs as one slice of samples (its weight outsizes its input) makes its backward a group of
    input channels at a time: each group's float32 weight slice ``weight[:, group]`` about ``slice_bytes``.
    Its workspace, measured with precsearch.cost.measured: ``output_gradient`` whole float32 copies of the output
    gradient (oneDNN's reordered one, each call makes one), ``input`` float32 input slices of one group (the
    decoded slice, oneDNN's reordered copy, the group's input gradient before its copy into the whole one),
    ``weight`` weight slices (the slice rounded again from the master, the group's weight gradient)."""

    slice_bytes: int
    output_gradient: int
    input: int
    weight: int


@dataclass(frozen=True)
class SlicedBackward:
    """The runtime's backward of this op where the tensor it saved (``reads``: its one ``input`` or its
    ``output``) is low: it decodes the codes a slice of samples at a time, each slice's float32 values about
    ``slice_bytes`` on CPU, holding ``workspace`` float32 slices and ``weight_blocks`` weight-sized float32
    blocks besides (a slice's weight gradient before it is summed, oneDNN's reordered weight). An op with
    weight blocks runs as one slice where its weight outsizes its input (oneDNN's weight-sized temporaries then
    outweigh the input's: ResNet-18's layer 4, 30 MiB against 37 or more in slices), in groups of input
    channels where ``channels`` says so."""

    reads: str
    slice_bytes: int
    workspace: int
    weight_blocks: int = 0
    channels: ChannelSlices | None = None
    min_slices: int = 1  # at least this many slices of a batch (``OpRules.with_min_slices``)

    def rows(self, shape: Sequence[int], weight_numel: int = 0, at_least: int = 1) -> int:
        """Samples per slice over a saved tensor of ``shape``: slices of ``slice_bytes``, and at least
        ``min_slices`` of them (``at_least`` for this one layer: a peak-directed choice, ``CostModel.finer_slices``)."""
        if self.weight_blocks and weight_numel >= math.prod(shape):
            return shape[0]
        slices = max(self.min_slices, at_least)
        return max(1, min(self.slice_bytes // (4 * math.prod(shape[1:])), -(-shape[0] // slices)))

    def channels_per_group(self, shape: Sequence[int], weight_shape: Sequence[int], at_least: int = 1) -> int:
        """Input channels per group of a backward over an input of ``shape`` with a weight of ``weight_shape``
        that runs as one slice of samples: weight slices of ``channels.slice_bytes``; all channels (one group)
        for an op sliced by samples, one without channel slices, or a grouped conv (each output channel reads
        some input channels only: its weight has fewer input channels than its input)."""
        if (self.channels is None or self.rows(shape, math.prod(weight_shape), at_least) < shape[0]
                or weight_shape[1] != shape[1]):
            return shape[1]
        per_channel = 4 * math.prod(weight_shape) // weight_shape[1]
        return max(1, min(shape[1], self.channels.slice_bytes // per_channel))


@dataclass(frozen=True)
class OpRule:
    """What one kind of op is and does. The defaults describe an op nothing is known about.

    - ``gemm``: multiplies matrices (a convolution, a linear layer): it opens a group, and its input is where
      its weight belongs.
    - ``pass_through``: its output is a view or re-layout of its input: no op, no tensor; its readers read the
      data it carries. ``no_tensor``: it returns no tensor (``size``): the runtime puts nothing after it.
    - ``saves``: what autograd keeps for its backward (measured on torch 2.13), used for graphs traced without
      recorded saves; None: not known (``ASSUMED_SAVES``). Items: ``inputs`` every input activation; ``pair``
      every input activation when it has two tensor operands (a product needs the other factor; scaling by a
      number saves nothing); ``output`` its own output; ``pool`` its input unless the output is 1x1 (adaptive
      average pooling to 1 is a mean); ``indices`` int64 argmax indices of the output's size; ``bnstats``
      per-channel fp32 vectors (save_mean, save_invstd, and running_mean/var when tracked); ``mask`` /
      ``channelmask`` dropout's float32 mask of the output's size / of (N, C). Saved parameters are weights.
    - ``records``: what the tracer notes about a call: ``running_stats`` (batch norm) or ``dropout`` (``p``).
    - ``fresh_output``: its output is a new tensor its backward does not read (when not run in place), so a
      rounding after it may write over it. ``fresh_input_gradient``: its backward makes new input gradients
      (not a view or a pass-through of the gradient it receives), so the gradient of an input it alone reads
      is the rounding's to overwrite. (GEMMs are both by their role.) ``passes_gradient``: its backward hands
      its output gradient to its inputs as it is (a sum), so an input's gradient is that gradient itself.
    - ``forward_workspace``: its forward holds its reordered input and weight beside its blocked output, then
      that beside the output (oneDNN's conv). ``backward_workspace``: float32 copies of its inputs its backward
      kernel holds; ``input_gradient_workspace`` more where its input needs a gradient, the last of them of the
      output's size where that is larger (torch 2.13's CPU kernels: oneDNN's conv a reordered input and a
      reordered output gradient, which a 1x1 conv widening its channels shows; batch norm one temporary).
    - ``sliced``: the runtime's backward reads its low saved tensor in slices (``SlicedBackward``)."""

    gemm: bool = False
    pass_through: bool = False
    no_tensor: bool = False
    saves: tuple[str, ...] | None = None
    records: str = ""
    fresh_output: bool = False
    fresh_input_gradient: bool = False
    passes_gradient: bool = False
    forward_workspace: bool = False
    backward_workspace: int = 0
    input_gradient_workspace: int = 0
    sliced: SlicedBackward | None = None


UNKNOWN = OpRule()


class OpRules:
    """The table: rules by module class (looked up along a module's class hierarchy, so subclasses share their
    base's rule) and by function or method name (``op_type_key``). A graph op is looked up by its
    ``module_type``: the module class of that name, else the function of that name."""

    def __init__(self, modules: Mapping[type[nn.Module], OpRule], functions: Mapping[str, OpRule],
                 aten_gemms: Iterable[str]) -> None:
        self.modules = dict(modules)
        self.functions = {op_type_key(name): rule for name, rule in functions.items()}
        self.aten_gemms = frozenset(aten_gemms)
        self._by_class_name = {cls.__name__: rule for cls, rule in self.modules.items()}

    def with_modules(self, modules: Mapping[type[nn.Module], OpRule]) -> OpRules:
        """This table with ``modules``' rules added or replacing those of the same classes."""
        return OpRules({**self.modules, **modules}, self.functions, self.aten_gemms)

    def with_functions(self, functions: Mapping[str, OpRule]) -> OpRules:
        """This table with ``functions``' rules added or replacing those of the same names."""
        return OpRules(self.modules, {**self.functions, **functions}, self.aten_gemms)

    def with_min_slices(self, count: int) -> OpRules:
        """This table with every sliced backward run in at least ``count`` slices of the batch: less memory (the
        backward of a small tensor holds a slice's float32 copy, not the whole tensor's) for more time (more,
        smaller kernel calls; benchmarks/results/bench_memory.md measures both), and float32 sums in another
        order."""
        if count < 1:
            raise PrecsearchError(f"min_slices must be at least 1, got {count}")
        return OpRules({cls: replace(rule, sliced=replace(rule.sliced, min_slices=count)) if rule.sliced else rule
                        for cls, rule in self.modules.items()}, self.functions, self.aten_gemms)

    def module(self, module: nn.Module) -> OpRule:
        """The rule of a module call: its class's, or its nearest base class's."""
        return next((self.modules[cls] for cls in type(module).__mro__ if cls in self.modules), UNKNOWN)

    def knows_module(self, module: nn.Module) -> bool:
        """Whether the table has a rule for this module's own class (the tracers keep such a module one op)."""
        return type(module) in self.modules

    def function(self, name: str) -> OpRule:
        """The rule of a function or method call, by name (as ``call_name`` gives it)."""
        return self.functions.get(op_type_key(name), UNKNOWN)

    def op_type(self, module_type: str) -> OpRule:
        """The rule of a graph op of ``module_type`` (``OpInfo.module_type``)."""
        return self._by_class_name.get(module_type) or self.function(module_type)

    def aten_gemm(self, name: str) -> bool:
        """Whether an aten op (by its overload packet's name) multiplies matrices, as the dispatcher sees it
        below FX: the rounding points of a GEMM."""
        return name in self.aten_gemms or "scaled_dot_product" in name

    def sliced_rows(self, op: Any, tensors: Mapping[str, Any], at_least: int = 1) -> int:
        """Samples per slice of graph op ``op``'s sliced backward (``SlicedBackward.rows`` over its
        ``sliced_saved_tensor``, its largest parameter the weight; ``tensors``: the graph's)."""
        weight = max((tensors[p].numel for p in op.params), default=0)
        return self.op_type(op.module_type).sliced.rows(tensors[self.sliced_saved_tensor(op)].shape, weight, at_least)

    def sliced_saved_tensor(self, op: Any) -> str | None:
        """The tensor whose codes the runtime's backward of graph op ``op`` reads in slices, where it is low (a
        traced ``nn.Conv2d``'s or ``nn.BatchNorm2d``'s one input, an ``nn.ReLU``'s output), else None."""
        sliced = self.op_type(op.module_type).sliced
        tensors = None if sliced is None else op.input_tensors if sliced.reads == "input" else op.outputs
        return tensors[0] if tensors is not None and len(tensors) == 1 else None


def op_type_key(module_type: str) -> str:
    """Lower case without underscores, so module and function spellings meet: ReLU/relu, MaxPool2d/max_pool2d."""
    return module_type.replace("_", "").lower()


_REFLECTED = {"radd", "rsub", "rmul", "rtruediv", "rdiv", "rmatmul", "rpow", "rfloordiv"}
_IN_PLACE_DUNDERS = {"iadd", "isub", "imul", "itruediv", "idiv", "imatmul", "ipow"}
_RENAMED = {"truediv": "div", "concat": "cat", "concatenate": "cat"}


def call_name(target: Any) -> tuple[str, bool]:
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


def _each(names: Iterable[Any], rule: OpRule) -> dict[Any, OpRule]:
    return dict.fromkeys(names, rule)


# ------------------------------------------------------------------------------------------------ the table

_INPUTS = ("inputs",)
# oneDNN's conv (torch 2.13, 2 cores): with 1 MiB slices, ResNet-18's conv backwards took 0.3-1.0x as long as
# one call over the batch, and held about a slice's worth of workspace besides their gradients where one call
# held two or three copies of the input. Batch norm (two passes of a few ops per slice) and ReLU: larger
# slices. Workspaces measured with precsearch.cost.measured: conv: the decoded slice, or the slice's input
# gradient before its copy into the whole one, and oneDNN's workspace; batch norm: the decoded slice and the
# slice minus the mean; ReLU: the decoded slice.
_CONV2D_SLICES = SlicedBackward("input", 2**20, 3, weight_blocks=2,
                                channels=ChannelSlices(2**20, output_gradient=1, input=3, weight=2))
_CONV = OpRule(gemm=True, saves=_INPUTS, forward_workspace=True, input_gradient_workspace=2)
_BATCH_NORM = OpRule(saves=("inputs", "bnstats"), records="running_stats", fresh_output=True,
                     fresh_input_gradient=True, backward_workspace=1)
_NORM = OpRule(saves=_INPUTS, fresh_output=True, fresh_input_gradient=True)
_SAVES_OUTPUT = OpRule(saves=("output",))
_SAVES_INPUT = OpRule(saves=_INPUTS)
_CLIPS = OpRule(saves=_INPUTS, fresh_input_gradient=True)  # relu6, hardtanh, leaky relu, average pooling
_MAX_POOL = OpRule(saves=("inputs", "indices"), fresh_input_gradient=True)
_LAYOUT = OpRule(pass_through=True)
_SIZE = OpRule(pass_through=True, no_tensor=True)

_MODULES: dict[type[nn.Module], OpRule] = {
    **_each((nn.Conv1d, nn.Conv3d, nn.ConvTranspose1d, nn.ConvTranspose2d, nn.ConvTranspose3d), _CONV),
    nn.Conv2d: replace(_CONV, sliced=_CONV2D_SLICES),
    nn.Linear: OpRule(gemm=True, saves=_INPUTS),
    **_each((nn.BatchNorm1d, nn.BatchNorm3d), _BATCH_NORM),
    nn.BatchNorm2d: replace(_BATCH_NORM, sliced=SlicedBackward("input", 2**22, 2)),
    nn.SyncBatchNorm: replace(_BATCH_NORM, backward_workspace=0),
    **_each((nn.LayerNorm, nn.GroupNorm), _NORM),
    nn.ReLU: OpRule(saves=("output",), fresh_input_gradient=True, sliced=SlicedBackward("output", 2**20, 1)),
    **_each((nn.ReLU6, nn.Hardtanh, nn.LeakyReLU, nn.AvgPool1d, nn.AvgPool3d), _CLIPS),
    nn.AvgPool2d: OpRule(saves=_INPUTS, fresh_output=True, fresh_input_gradient=True),
    **_each((nn.Sigmoid, nn.Tanh, nn.Softmax, nn.LogSoftmax), _SAVES_OUTPUT),
    **_each((nn.SiLU, nn.Hardswish, nn.Hardsigmoid, nn.GELU, nn.ELU, nn.Mish, nn.Softplus), _SAVES_INPUT),
    **_each((nn.AdaptiveAvgPool1d, nn.AdaptiveAvgPool3d), OpRule(saves=("pool",))),
    nn.AdaptiveAvgPool2d: OpRule(saves=("pool",), fresh_output=True),
    **_each((nn.MaxPool1d, nn.MaxPool3d), _MAX_POOL),
    nn.MaxPool2d: OpRule(saves=("inputs", "indices"), fresh_output=True, fresh_input_gradient=True),
    **_each((nn.AdaptiveMaxPool1d, nn.AdaptiveMaxPool2d, nn.AdaptiveMaxPool3d), OpRule(saves=("inputs", "indices"))),
    nn.Dropout: OpRule(saves=("mask",), records="dropout"),
    **_each((nn.Dropout1d, nn.Dropout2d, nn.Dropout3d), OpRule(saves=("channelmask",), records="dropout")),
    **_each((nn.AlphaDropout, nn.FeatureAlphaDropout), OpRule(records="dropout")),
    **_each((nn.Flatten, nn.Unflatten, nn.Identity), _LAYOUT),
}

_FUNCTIONS: dict[str, OpRule] = {
    **_each(("conv1d", "conv2d", "conv3d", "conv_transpose1d", "conv_transpose2d", "conv_transpose3d"), _CONV),
    "linear": OpRule(gemm=True, saves=_INPUTS),
    **_each(("matmul", "mm", "bmm"), OpRule(gemm=True, saves=("pair",))),
    "addmm": OpRule(gemm=True),
    "batch_norm": replace(_BATCH_NORM, fresh_output=False),
    **_each(("layer_norm", "group_norm"), OpRule(saves=_INPUTS, fresh_input_gradient=True)),
    "relu": OpRule(saves=("output",), fresh_input_gradient=True),
    **_each(("relu6", "hardtanh", "leaky_relu", "avg_pool1d", "avg_pool2d", "avg_pool3d"), _CLIPS),
    **_each(("sigmoid", "tanh", "softmax", "log_softmax", "exp"), _SAVES_OUTPUT),
    **_each(("silu", "hardswish", "hardsigmoid", "gelu", "elu", "mish", "softplus"), _SAVES_INPUT),
    **_each(("adaptive_avg_pool1d", "adaptive_avg_pool2d", "adaptive_avg_pool3d"), OpRule(saves=("pool",))),
    **_each(("max_pool1d", "max_pool2d", "max_pool3d"), _MAX_POOL),
    **_each(("adaptive_max_pool1d", "adaptive_max_pool2d", "adaptive_max_pool3d"),
            OpRule(saves=("inputs", "indices"))),
    "add": OpRule(saves=(), fresh_output=True, passes_gradient=True),
    **_each(("sub", "cat"), OpRule(saves=(), fresh_output=True)),
    "mul": OpRule(saves=("pair",), fresh_output=True),
    "div": OpRule(saves=("pair",)),
    **_each(("stack", "neg", "pad", "mean", "sum", "clone", "identity"), OpRule(saves=())),
    "dropout": OpRule(saves=("mask",), records="dropout"),
    **_each(("dropout1d", "dropout2d", "dropout3d"), OpRule(saves=("channelmask",), records="dropout")),
    **_each(("alpha_dropout", "feature_alpha_dropout", "feature_dropout", "native_dropout"),
            OpRule(records="dropout")),
    **_each(("view", "view_as", "reshape", "reshape_as", "flatten", "unflatten", "contiguous", "transpose",
             "permute", "t", "squeeze", "unsqueeze", "expand", "expand_as", "chunk", "split", "tensor_split",
             "unbind", "narrow", "select", "getitem", "getattr", "get", "to", "float", "type_as", "detach"),
            _LAYOUT),
    **_each(("size", "dim", "numel"), _SIZE),
    **_each(("stride", "storage_offset"), OpRule(no_tensor=True)),
}

# aten ops (overload packet names) that multiply matrices, as the dispatcher sees them after decomposition; the
# fused recurrent kernels (an nn.LSTM/GRU/RNN on oneDNN, cuDNN or MIOpen) run their input and recurrent GEMMs inside
_ATEN_GEMMS = ("mm", "addmm", "bmm", "baddbmm", "addbmm", "matmul", "linear", "convolution", "_convolution",
               "mkldnn_convolution", "cudnn_convolution", "_mkldnn_matmul", "mkldnn_rnn_layer", "mkldnn_rnn",
               "_cudnn_rnn", "miopen_rnn")

OP_RULES = OpRules(_MODULES, _FUNCTIONS, _ATEN_GEMMS)
