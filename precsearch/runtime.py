"""Train any CNN under a policy: rounding, packed saved activations, master weights, loss scaling, promotion.

``apply_policy(model, policy)`` traces the model (precsearch.graph), checks that the policy was made for it,
and returns a ``PrecisionModel`` that trains in the ordinary loop::

    model = apply_policy(model, Policy.load("policy.json"))
    optimizer = model.wrap_optimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9))
    for images, labels in loader:
        optimizer.zero_grad()
        loss = F.cross_entropy(model(images), labels)
        model.scaler.scale(loss).backward()
        model.scaler.step(optimizer)
        model.scaler.update()

What it enforces, per tensor id of the graph:

* weights: the forward uses ``quantize(param)`` through an autograd Function whose backward passes the
  gradient straight through, so the parameters stay fp32 masters for any optimizer (Micikevicius et al.);
  with ``master_weights=False`` the parameters themselves are rounded and ``wrap_optimizer`` returns a
  precsearch.optim ``LowPrecisionOptimizer`` that keeps them so. With master weights, an optimizer
  ``update="stochastic"`` rounds the working copy stochastically (Wang et al.'s stochastic weight update).
* activations: the FX graph gets a rounding module after every op that makes an activation (as torch.ao's
  prepare_fx inserts observers); its backward rounds the activation's gradient, on the loss-scaled values.
  Untraceable models use module forward hooks; ops that are plain function calls are then not enforced and
  listed in ``unenforced``.
* weight gradients: rounded in place after accumulation, still loss-scaled: post-accumulate-grad hooks
  queue them and one autograd final callback rounds them all, a kernel per format, when backward ends.
  Weights too are rounded a kernel per format, from one flat buffer that is packed once.
* memory: tensors autograd saves for backward are held as codes of their format (``formats.encode``) through
  ``saved_tensors_hooks``, once per storage; an op that saved its own output before the rounding module
  ran (ReLU saves its result) is switched to the rounded codes too, as low-precision hardware would store
  them. ``saved_bytes()`` reports what the last forward kept. On CUDA, report
  ``torch.cuda.max_memory_allocated()`` as the memory figure; on CPU use ``saved_bytes()``.
* divergence guard: each rounding counts the values that overflow the format; when a tensor's fraction in
  one call reaches ``policy.promotion_threshold`` it is promoted to ``policy.high_format`` at once (that very
  tensor is rounded in the high format) and for the rest of training, logged and listed in ``promotions``.
  This is a little earlier than the paper's end-of-step check, so the overflowing step itself is not lost.
  An overflow in a saturating gradient format is reported to the loss scaler (``record_overflow``), which
  then skips the step as it would for inf.
* statistics: overflow fractions always when counted; underflow / subnormal / NaN fractions when
  ``stats_every`` is set (every n-th step, since they cost a few passes over each tensor).
* accumulation: with ``policy.accumulation`` the layers it names are swapped, in the user's model, for
  precsearch.accumulate's chunked Linear/Conv2d (same Parameters), whose forward and backward GEMMs sum in
  the accumulation format; ``accumulation_layers`` lists them and ``unwrap`` puts the plain layers back. The
  model is traced before the swap, so the graph, its fingerprint and ``module_types`` rules (``"Conv2d"``)
  are those of the plain model; the swap is a change of arithmetic, not of what tensors are stored.

Everything is simulated in float32 (models must be float32) and is device-agnostic; the overflow test reads
one scalar per rounded tensor, a host sync on CUDA. With ``master_weights=False`` a promoted weight moves to
the high format in the optimizers ``wrap_optimizer`` returned too (``LowPrecisionOptimizer.set_format``).
Known limit: adaptive loss scaling scales a GEMM's gradient after the rounding of that gradient (the
scaler's points are the GEMM nodes), so it protects the products the GEMM's backward forms, as in Zhao et
al., not the rounding of its own output gradient.
"""

from __future__ import annotations

import contextlib
import copy
import logging
import operator
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch
from torch import fx, nn
from torch.multiprocessing.reductions import StorageWeakRef

from precsearch import formats as F
from precsearch.errors import PrecsearchError
from precsearch.graph import TensorGraph, trace
from precsearch.optim import LowPrecisionOptimizer, from_config
from precsearch.policy import CHUNKED_LAYERS, Policy
from precsearch.scaling import LossScaler, make_scaler

__all__ = ["PrecisionModel", "Promotion", "SavedBytes", "apply_policy"]

log = logging.getLogger(__name__)

GRAD_KINDS = ("weight_grad", "activation_grad")
# Layout ops whose output is no tensor: no alias module after them.
_NOT_TENSORS = frozenset({"size", "dim", "numel", "stride", "storage_offset"})


class Promotion(NamedTuple):
    """A tensor moved to the high format: which, at which step, why (its overflow fraction), from and to."""

    id: str
    step: int
    fraction: float
    from_format: str
    to_format: str


@dataclass
class SavedBytes:
    """Bytes autograd held for backward after one forward, by what they are (each storage counted once)."""

    activation: int = 0  # activations as stored: packed codes, or float32 where unrounded
    weight: int = 0  # rounded weight copies (packed codes)
    parameter: int = 0  # parameters saved as they are (fp32 weights)
    other: int = 0  # byproducts: buffers (BN running stats), non-float32 tensors (max-pool indices)

    @property
    def total(self) -> int:
        return self.activation + self.weight + self.parameter + self.other


def _overflow_threshold(fmt: F.FloatFormat, rounding: str) -> float:
    """The smallest float32 magnitude that rounds past ``fmt.max`` (any value above max under stochastic)."""
    if fmt.is_fp32:
        return float("inf")
    top = torch.tensor(fmt.max, dtype=torch.float32)
    if rounding == "stochastic":
        return float(torch.nextafter(top, torch.tensor(float("inf"))))
    mid = torch.tensor(fmt.max + 2.0 ** (fmt.emax - fmt.man) / 2, dtype=torch.float32)
    if torch.isinf(F.quantize(mid.reshape(1), fmt, overflow="inf")).item():
        return float(mid)
    return float(torch.nextafter(mid, torch.tensor(float("inf"))))


def _count_at_least(x: torch.Tensor, threshold: float) -> int:
    """How many |x| >= threshold; one min/max pass when none does (the usual case)."""
    low, high = torch.aminmax(x.detach())
    if torch.maximum(-low, high).item() < threshold:
        return 0
    return int(torch.count_nonzero(x.detach().abs() >= threshold))


class _Slot:
    """One assigned tensor id: its current format, rounding, overflow mode, and statistics since reset."""

    def __init__(self, tensor_id: str, kind: str, fmt: F.FloatFormat, rounding: str, overflow: str | None,
                 count: bool) -> None:
        self.id, self.kind, self.assigned = tensor_id, kind, fmt
        self.rounding, self.overflow_mode, self.count = rounding, overflow, count
        self.promoted = False
        self.set_format(fmt)
        self.reset()

    def set_format(self, fmt: F.FloatFormat) -> None:
        self.fmt = fmt
        self.over_at = _overflow_threshold(fmt, self.rounding)

    def reset(self) -> None:
        self.calls = self.counted = self.overflowed = 0
        self.max_overflow = 0.0
        self.stat_sums: Counter[str] = Counter()
        self.stat_elements = 0

    @property
    def is_low(self) -> bool:
        return not self.fmt.is_fp32


_Member = tuple[str, torch.Tensor, _Slot]  # (key, tensor, slot): a weight or weight gradient rounded in a group


# ------------------------------------------------------------------------------------ saved-tensor packing


class _Packed:
    """One storage's values as codes of a format, shared by every saved view of it.

    It refers to the storage weakly, at the C++ level: a rounded tensor's Python object may die while views
    keep its storage alive, and a dead storage's address may be reused by an unrelated tensor.
    """

    __slots__ = ("fmt", "kind", "version", "storage", "shape", "codes", "saves", "unpacks", "decoded")

    codes: torch.Tensor | None  # the codes, or the float32 values themselves when the format cannot hold them

    def __init__(self, fmt: F.FloatFormat, kind: str, rounded: torch.Tensor) -> None:
        self.fmt, self.kind, self.version, self.shape = fmt, kind, rounded._version, rounded.shape
        self.storage = StorageWeakRef(rounded.untyped_storage())
        self.codes = None
        self.saves = self.unpacks = 0  # saved views of the whole storage, and how many were unpacked
        self.decoded: torch.Tensor | None = None

    def holds(self, t: torch.Tensor) -> bool:
        """Whether ``t`` views this storage, unmodified since it was rounded."""
        return self.version == t._version and not self.storage.expired()

    def encode(self, view: torch.Tensor) -> None:
        """Encode the whole storage that ``view`` looks into; keep it as float32 if the format cannot hold it
        (inf or NaN in a format without such codes, after an overflow to inf or a divergence)."""
        base = view.detach().as_strided(self.shape, _contiguous_strides(self.shape), 0)
        try:
            self.codes = F.encode(base, self.fmt)
        except PrecsearchError:
            self.codes = base

    def values(self, start: int = 0, count: int | None = None) -> torch.Tensor:
        """``count`` decoded values from ``start`` as a flat float32 tensor; by default the whole storage,
        decoded once and kept until every op that saved it has unpacked it (ReLU and the next conv both
        save one activation)."""
        codes = self.codes.reshape(-1)
        if count is not None:
            codes = codes[start:start + count]
            return codes if codes.dtype == torch.float32 else F.decode(codes, self.fmt)
        if codes.dtype == torch.float32:
            return codes
        decoded = self.decoded if self.decoded is not None else F.decode(codes, self.fmt)
        self.unpacks += 1
        self.decoded = decoded if self.unpacks < self.saves else None
        return decoded


def _contiguous_strides(shape: torch.Size) -> tuple[int, ...]:
    strides, step = [], 1
    for size in reversed(shape):
        strides.append(step)
        step *= max(size, 1)
    return tuple(reversed(strides))


class _Stored:
    """What the pack hook returns: the saved tensor itself, or its geometry inside a packed storage."""

    __slots__ = ("tensor", "packed", "geometry")

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor: torch.Tensor | None = tensor
        self.packed: _Packed | None = None
        self.geometry = (tensor.size(), tensor.stride(), tensor.storage_offset())

    def unpack(self) -> torch.Tensor:
        if self.packed is None:
            return self.tensor
        size, stride, offset = self.geometry
        # the whole storage, or a slice of it (one weight of a group): decode just that range
        piece = self.packed.values() if self.whole() else self.packed.values(offset, self._extent())
        return piece.as_strided(size, stride, piece.storage_offset())

    def _extent(self) -> int:
        size, stride, _ = self.geometry
        return 1 + sum((n - 1) * step for n, step in zip(size, stride, strict=True)) if all(size) else 0

    def whole(self) -> bool:
        """Whether this saved view spans its packed storage from the start."""
        return self.geometry[2] == 0 and self._extent() == self.packed.shape.numel()

    def attach(self, packed: _Packed) -> None:
        """Hold ``packed`` instead of the tensor."""
        self.tensor, self.packed = None, packed
        if self.whole():
            packed.saves += 1


class _Pending:
    """Float tensors saved as they are, by storage: kept so that a later rounding can switch them to codes."""

    __slots__ = ("version", "stored")

    def __init__(self, version: int) -> None:
        self.version = version
        self.stored: list[_Stored] = []


def _storage(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


def _whole_storage(t: torch.Tensor) -> bool:
    """Whether ``t`` is its storage, laid out contiguously from offset 0 (so a rounded copy maps 1:1)."""
    return (t.is_contiguous() and t.storage_offset() == 0
            and t.untyped_storage().nbytes() == t.numel() * t.element_size())


class _Packer:
    """The saved-tensor hooks of one forward pass and the bookkeeping that dedupes storages."""

    def __init__(self, module: nn.Module) -> None:
        self._module = module
        self._active = False
        self.last = SavedBytes()

    @contextlib.contextmanager
    def forward(self) -> Iterator[None]:
        self._active = True
        self._params = {_storage(p) for p in self._module.parameters()}
        self._buffers = {_storage(b) for b in self._module.buffers()}
        self._live: dict[int, _Packed] = {}
        self._pending: dict[int, _Pending] = {}
        self._all_pending: list[tuple[int, _Pending]] = []
        self._all_packed: list[_Packed] = []
        self._plain: dict[int, tuple[str, int]] = {}
        try:
            with torch.autograd.graph.saved_tensors_hooks(self.pack, _Stored.unpack):
                yield
        finally:
            self._active = False
            self.last = self._measure()
            self._live, self._pending, self._all_pending, self._all_packed, self._plain = {}, {}, [], [], {}

    def register(self, raw: torch.Tensor, rounded: torch.Tensor, fmt: F.FloatFormat, kind: str) -> None:
        """``rounded`` holds values of ``fmt``: saves of it are packed; earlier saves of ``raw`` switch to it."""
        if not self._active or fmt.is_fp32:
            return
        packed = _Packed(fmt, kind, rounded)
        self._live[_storage(rounded)] = packed
        self._all_packed.append(packed)
        pending = self._pending.get(_storage(raw))
        if pending is not None and pending.version == raw._version and _whole_storage(raw):
            del self._pending[_storage(raw)]
            packed.encode(rounded)
            for stored in pending.stored:
                stored.attach(packed)

    def alias(self, t: torch.Tensor, fmt: F.FloatFormat, kind: str) -> None:
        """``t`` is a fresh copy of rounded values (a layout op's output): pack its saves in ``fmt`` too."""
        if not self._active or fmt.is_fp32 or t.dtype != torch.float32 or not _whole_storage(t):
            return
        known = self._live.get(_storage(t))
        if known is None or known.storage.expired():  # a view of a known storage is no copy
            self.register(t, t, fmt, kind)

    def pack(self, t: torch.Tensor) -> _Stored:
        stored = _Stored(t)
        ptr = _storage(t)
        if ptr in self._params or ptr in self._buffers or t.dtype != torch.float32:
            self._plain[ptr] = ("parameter" if ptr in self._params else "other", t.untyped_storage().nbytes())
            return stored
        packed = self._live.get(ptr)
        if packed is not None and packed.holds(t):
            if packed.codes is None:
                packed.encode(t)
            stored.attach(packed)
            return stored
        pending = self._pending.get(ptr)
        if pending is None or pending.version != t._version:
            pending = self._pending[ptr] = _Pending(t._version)
            self._all_pending.append((ptr, pending))
        pending.stored.append(stored)
        return stored

    def _measure(self) -> SavedBytes:
        sizes = SavedBytes()
        for packed in self._all_packed:
            if packed.codes is not None:
                kind = "weight" if packed.kind == "weight" else "activation"
                setattr(sizes, kind, getattr(sizes, kind) + packed.codes.nbytes)
        for ptr, pending in self._all_pending:
            kept = [s.tensor for s in pending.stored if s.tensor is not None]
            if kept and ptr not in self._plain:
                self._plain[ptr] = ("activation", kept[0].untyped_storage().nbytes())
        for category, nbytes in self._plain.values():
            setattr(sizes, category, getattr(sizes, category) + nbytes)
        return sizes


# ----------------------------------------------------------------------------------- autograd functions


class _RoundActivation(torch.autograd.Function):
    """Forward: the activation rounded to its format. Backward: its gradient rounded (if it has a slot)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, model: PrecisionModel, act: _Slot, grad: _Slot | None) -> torch.Tensor:
        ctx.model, ctx.grad = model, grad
        # not a view (quantize may return one): autograd forbids in-place ops (ReLU(inplace)) on a view output
        return model._quantize(x, act).detach()

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
        if ctx.grad is not None:
            g = ctx.model._round(g, ctx.grad)
        return g, None, None, None


class _RoundWeights(torch.autograd.Function):
    """Weights sharing a format, rounded together from one flat buffer (one kernel, one packed storage) for
    the forward; each gradient passes straight to its fp32 parameter."""

    @staticmethod
    def forward(ctx: Any, flat: torch.Tensor, model: PrecisionModel, slot: _Slot, *params: torch.Tensor) -> Any:
        rounded = model._quantize(flat, slot)
        model._packer.register(flat, rounded, slot.fmt, "weight")
        parts = rounded.split([p.numel() for p in params])
        return tuple(part.view(p.shape) for part, p in zip(parts, params, strict=True))

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        return (None, None, None, *grads)


class _Rounder(nn.Module):
    """The module inserted after an op: rounds each output position that has a slot (act, grad)."""

    def __init__(self, model: PrecisionModel, slots: dict[int, tuple[_Slot, _Slot | None]], op: str) -> None:
        super().__init__()
        self.op = op
        self.__dict__["_model"] = model  # not a submodule: the wrapper owns this one
        self.slots = slots

    def forward(self, value: Any) -> Any:
        if isinstance(value, torch.Tensor):
            return self._one(0, value)
        if isinstance(value, tuple | list):
            return type(value)(self._one(i, v) if isinstance(v, torch.Tensor) else v for i, v in enumerate(value))
        return value

    def _one(self, position: int, t: torch.Tensor) -> torch.Tensor:
        pair = self.slots.get(position)
        if pair is None or t.dtype != torch.float32:
            return t
        return self._model._activation(t, *pair)

    def extra_repr(self) -> str:
        return self.op


class _Alias(nn.Module):
    """The module inserted after a layout op: a copy it made of rounded values is packed like its source."""

    def __init__(self, model: PrecisionModel, slots: dict[int, _Slot]) -> None:
        super().__init__()
        self.__dict__["_model"] = model
        self.slots = slots

    def forward(self, value: Any) -> Any:
        slot = self.slots.get(0)
        if isinstance(value, torch.Tensor) and slot is not None:
            self._model._packer.alias(value, slot.fmt, slot.kind)
        return value


# ------------------------------------------------------------------------------------------ the wrapper


class PrecisionModel(nn.Module):
    """A model training under a policy; build it with ``apply_policy``. The user's model is ``.module``."""

    def __init__(self, model: nn.Module, policy: Policy, graph: TensorGraph, seed: int = 0,
                 stats_every: int | None = None) -> None:
        super().__init__()
        self.module = model
        self.policy = policy
        self.graph = graph
        self.high = F.get_format(policy.high_format)
        self.threshold = policy.promotion_threshold
        self.promotions: list[Promotion] = []
        self.step_count = 0
        self.unenforced: list[str] = []
        self.stats_every = stats_every
        self._generator = torch.Generator().manual_seed(seed)
        self._handles: list[Any] = []
        self._optimizers: list[LowPrecisionOptimizer] = []  # wrapped ones, told about weight promotions
        self._plain_layers: dict[str, nn.Module] = {}
        self.accumulation_layers = self._swap_accumulation()
        self._grad_queue: list[_Member] = []
        self.slots = self._make_slots()
        self._packer = _Packer(model)
        self.scaler: LossScaler = self._make_scaler()
        self._weights = self._weight_slots()
        self._round_pure_weights()
        self._hook_weight_grads()
        self._input_rounder: _Rounder | None = None
        self._module_rounders: dict[str, dict[int, _Rounder]] = {}
        self._calls: Counter[str] = Counter()
        target = self._instrument_fx() if graph.graph_module is not None else self._instrument_hooks()
        self.__dict__["_target"] = target  # the FX module shares the user's submodules: keep it unregistered
        if self.unenforced:
            log.warning("model is not FX-traceable: activations of %d function op(s) are not rounded (%s)",
                        len(self.unenforced), ", ".join(self.unenforced))

    # -- set-up -------------------------------------------------------------------------------------------

    def _swap_accumulation(self) -> list[str]:
        """Swap the policy's accumulation layers for chunked ones; keep the plain ones for ``unwrap``."""
        if self.policy.accumulation is None:
            return []
        before = dict(self.module.named_modules())
        names = self.policy.accumulation.apply(self.module)
        self._plain_layers = {name: before[name] for name in names}
        log.info("chunked %s accumulation (CL=%s) in %d layer(s)", self.policy.accumulation.format,
                 self.policy.accumulation.chunk, len(names))
        return names

    def _make_slots(self) -> dict[str, _Slot]:
        slots = {}
        stochastic_update = self.policy.optimizer.get("update") == "stochastic"
        for tensor_id in self.graph.assignable_ids():
            info = self.graph.tensors[tensor_id]
            fmt = F.get_format(self.policy.format_for(info))
            rounding = self.policy.rounding.get(info.kind, "nearest")
            if info.kind == "weight" and self.policy.master_weights and stochastic_update:
                rounding = "stochastic"  # the master's rounding to the working copy is the weight update
            overflow = self.policy.overflow.get(info.kind)
            saturating = (overflow or fmt.default_overflow) == "saturate"
            count = self.threshold is not None or (info.kind in GRAD_KINDS and saturating)
            slots[tensor_id] = _Slot(tensor_id, info.kind, fmt, rounding, overflow, count)
        return slots

    def _make_scaler(self) -> LossScaler:
        options = {key: value for key, value in self.policy.loss_scaling.items() if key != "mode"}
        mode = self.policy.loss_scaling["mode"]
        if mode != "adaptive":
            return make_scaler(mode, **options)
        options.setdefault("grad_format", self.policy.defaults.get("activation_grad", "fp32"))
        scaler = make_scaler(mode, **options)
        # A GEMM's scale protects the products that form its input's gradient: use that gradient's format.
        grad_formats = {}
        for op in self.graph.ops:
            if op.role != "gemm" or "#" in op.name or not _is_module(self.module, op):
                continue
            slots = [self.slots.get(t.replace(":activation", ":activation_grad")) for t in op.input_tensors]
            fmts = [s.fmt for s in slots if s is not None]
            if fmts:
                grad_formats[f"module.{op.name}"] = max(fmts, key=lambda f: f.min_subnormal)
        self._handles += scaler.attach(self, layers=list(grad_formats), grad_formats=grad_formats)
        return scaler

    def _weight_slots(self) -> dict[str, tuple[nn.Parameter, _Slot]]:
        """Qualified parameter name -> (parameter, slot) for the weights whose format is not fp32."""
        params = dict(self.module.named_parameters())
        found = {}
        for slot in self.slots.values():
            info = self.graph.tensors[slot.id]
            if slot.kind == "weight" and slot.is_low and info.param in params:
                found[info.param] = (params[info.param], slot)
        return found

    def _round_pure_weights(self) -> None:
        """Without master weights the parameters are the low-precision weights: round them once now."""
        if self.policy.master_weights:
            return
        with torch.no_grad():
            for param, slot in self._weights.values():
                param.copy_(F.quantize(param.detach(), slot.fmt, overflow=slot.overflow_mode))

    def _hook_weight_grads(self) -> None:
        params = dict(self.module.named_parameters())
        for slot in self.slots.values():
            info = self.graph.tensors[slot.id]
            if slot.kind == "weight_grad" and slot.is_low and info.param in params:
                self._handles.append(params[info.param].register_post_accumulate_grad_hook(self._grad_hook(slot)))

    def _rounder_slots(self, op: Any) -> dict[int, tuple[_Slot, _Slot | None]]:
        """Output position -> (activation slot, gradient slot) for the outputs that need rounding."""
        found = {}
        for tensor_id in op.outputs:
            position = int(tensor_id.rsplit(":activation", 1)[1] or 0)
            act = self.slots.get(tensor_id)
            grad = self.slots.get(tensor_id.replace(":activation", ":activation_grad"))
            if act is not None and (act.is_low or (grad is not None and grad.is_low)):
                found[position] = (act, grad if grad is not None and grad.is_low else None)
        return found

    def _instrument_fx(self) -> fx.GraphModule:
        """A copy of the traced FX graph with a rounding module after every op that makes a rounded tensor,
        and an alias module after every layout op (contiguous, reshape, ...) that copies one."""
        source = self.graph.graph_module
        graph = copy.deepcopy(source.graph)
        gm = fx.GraphModule(source, graph, type(self.module).__name__)
        traced = dict(gm.named_modules())
        for name in self.accumulation_layers:  # the graph was traced before the swap
            if name in traced:
                gm.set_submodule(name, self.module.get_submodule(name))
        nodes = {node.name: node for node in graph.nodes}
        last_placeholder = [node for node in graph.nodes if node.op == "placeholder"][-1]
        carried: dict[fx.Node, dict[int, _Slot]] = {}  # node -> the rounded activation slot of each output

        def insert(after: fx.Node, node: fx.Node, name: str, module: nn.Module) -> fx.Node:
            gm.add_submodule(name, module)
            with graph.inserting_after(after):
                new = graph.call_module(name, (node,))
            node.replace_all_uses_with(new, delete_user_cb=lambda user: user is not new)
            return new

        for index, op in enumerate(self.graph.ops):
            slots = self._rounder_slots(op)
            if slots:
                node = nodes[op.node]
                after = last_placeholder if node.op == "placeholder" else node
                new = insert(after, node, f"precsearch_round_{index}", _Rounder(self, slots, op.name))
                carried[new] = {position: act for position, (act, _) in slots.items() if act.is_low}
        op_nodes = {op.node for op in self.graph.ops}
        for node in list(graph.nodes):
            if (node.name in op_nodes or node in carried or not node.op.startswith("call_")
                    or node.target in _NOT_TENSORS or node.target is getattr):
                continue
            source_slots = next((carried[arg] for arg in node.all_input_nodes if arg in carried), None)
            if not source_slots:
                continue
            if node.target is operator.getitem and isinstance(node.args[1], int):
                picked = source_slots.get(node.args[1])
                source_slots = {0: picked} if picked is not None else {}
            if source_slots:
                alias = insert(node, node, f"precsearch_alias_{len(carried)}", _Alias(self, source_slots))
                carried[alias] = source_slots
        graph.lint()
        gm.recompile()
        return gm

    def _instrument_hooks(self) -> nn.Module:
        """Fallback for untraceable models: forward hooks on the modules the hook tracer recorded."""
        for op in self.graph.ops:
            slots = self._rounder_slots(op)
            if not slots:
                continue
            rounder = _Rounder(self, slots, op.name)
            if op.role == "input":
                self._input_rounder = rounder
            elif _is_module(self.module, op):
                base, _, call = op.name.partition("#")
                self._module_rounders.setdefault(base, {})[int(call or 0)] = rounder
            else:
                self.unenforced.append(op.name)
        for base in self._module_rounders:
            self._handles.append(self.module.get_submodule(base).register_forward_hook(self._module_hook(base)))
        return self.module

    def _module_hook(self, base: str) -> Callable[..., Any]:
        def hook(module: nn.Module, args: Any, output: Any) -> Any:
            call = self._calls[base]
            self._calls[base] += 1
            rounder = self._module_rounders[base].get(call)
            return None if rounder is None else rounder(output)

        return hook

    # -- rounding -----------------------------------------------------------------------------------------

    def _quantize(self, x: torch.Tensor, slot: _Slot) -> torch.Tensor:
        return F.quantize(x.detach(), slot.fmt, slot.rounding, slot.overflow_mode, self._generator)

    def _observe(self, x: torch.Tensor, slot: _Slot) -> None:
        """Count overflow (promoting the slot when it reaches the threshold) and gather statistics."""
        if not slot.is_low or x.numel() == 0:
            return
        slot.calls += 1
        n = x.numel()
        if slot.count:
            over = _count_at_least(x, slot.over_at)
            if over and self.threshold is not None and over / n >= self.threshold and self._promote(slot, over / n):
                if not slot.is_low:
                    return
                over = _count_at_least(x, slot.over_at)
            slot.counted += n
            slot.overflowed += over
            slot.max_overflow = max(slot.max_overflow, over / n)
            if over and slot.kind in GRAD_KINDS:
                self.scaler.record_overflow()
        if self.stats_every and self.step_count % self.stats_every == 0:
            slot.stat_sums.update({key: value * n for key, value in F.stats(x.detach(), slot.fmt).items()})
            slot.stat_elements += n

    def _round(self, x: torch.Tensor, slot: _Slot) -> torch.Tensor:
        """``x`` rounded to the slot's format (after the overflow check); ``x`` itself when that is fp32."""
        self._observe(x, slot)
        return self._quantize(x, slot) if slot.is_low else x

    def _promote(self, slot: _Slot, fraction: float) -> bool:
        if slot.promoted or slot.fmt == self.high:
            return False
        old = slot.fmt
        slot.set_format(self.high)
        slot.promoted = True
        if slot.kind == "weight" and not self.policy.master_weights:
            self._promote_in_optimizers(slot)
        self.promotions.append(Promotion(slot.id, self.step_count, fraction, old.name, self.high.name))
        log.info("promoted %s from %s to %s at step %d: %.2f%% of its values overflowed",
                    slot.id, old.name, self.high.name, self.step_count, 100 * fraction)
        return True

    def _promote_in_optimizers(self, slot: _Slot) -> None:
        """Pure low-precision weights: the optimizers must now keep the promoted weight in its new format."""
        params = [param for param, weight_slot in self._weights.values() if weight_slot is slot]
        for optimizer in self._optimizers:
            held = {id(p) for group in optimizer.param_groups for p in group["params"]}
            for param in params:
                if id(param) in held:
                    optimizer.set_format(param, slot.fmt)

    def _activation(self, t: torch.Tensor, act: _Slot, grad: _Slot | None) -> torch.Tensor:
        self._observe(t, act)
        grad = grad if grad is not None and grad.is_low and t.requires_grad else None
        if act.is_low:
            rounded = _RoundActivation.apply(t, self, act, grad)
            self._packer.register(t, rounded, act.fmt, act.kind)
            return rounded
        if grad is not None:
            t.register_hook(lambda g, slot=grad: self._round(g, slot))
        return t

    def _by_format(self, members: list[_Member], finish: Callable[[torch.Tensor | None, _Slot, list[_Member]], None],
                   ) -> None:
        """Round many small tensors (weights, weight gradients) a few kernels at a time: group them by format,
        check each group's flat copy (``_observe``), and hand it to ``finish(flat, slot, group)`` (``flat`` is
        None for a group now in fp32). A tensor promoted by the check is regrouped under its new format."""
        groups: dict[tuple[Any, ...], list[_Member]] = {}
        for member in members:
            slot = member[2]
            groups.setdefault((slot.fmt, slot.rounding, slot.overflow_mode), []).append(member)
        for group in groups.values():
            slot = group[0][2]
            if not slot.is_low:
                finish(None, slot, group)
                continue
            flat = torch.cat([tensor.detach().reshape(-1) for _, tensor, _ in group])
            if self._observe_group(flat, group):
                self._by_format(group, finish)
            else:
                finish(flat, slot, group)

    def _observe_group(self, flat: torch.Tensor, group: list[_Member]) -> bool:
        """``_observe`` for a group from its flat copy: one min/max pass when nothing overflows. True when a
        member was promoted."""
        slot = group[0][2]
        if (self.stats_every and self.step_count % self.stats_every == 0) or (
                slot.count and _count_at_least(flat, slot.over_at)):
            formats = [member_slot.fmt for _, _, member_slot in group]
            parts = flat.split([tensor.numel() for _, tensor, _ in group])
            for part, (_, _, member_slot) in zip(parts, group, strict=True):
                self._observe(part, member_slot)
            return any(member_slot.fmt != fmt for (_, _, member_slot), fmt in zip(group, formats, strict=True))
        for _, tensor, member_slot in group:
            member_slot.calls += 1
            if member_slot.count:
                member_slot.counted += tensor.numel()
        return False

    def _rounded_weights(self) -> dict[str, torch.Tensor]:
        """Parameter name -> the weight the forward computes with."""
        used: dict[str, torch.Tensor] = {}

        def finish(flat: torch.Tensor | None, slot: _Slot, group: list[_Member]) -> None:
            params = [param for _, param, _ in group]
            rounded = params if flat is None else _RoundWeights.apply(flat, self, slot, *params)
            used.update((name, weight) for (name, _, _), weight in zip(group, rounded, strict=True))

        self._by_format([(name, param, slot) for name, (param, slot) in self._weights.items()], finish)
        return used

    def _grad_hook(self, slot: _Slot) -> Callable[[torch.Tensor], None]:
        """Post-accumulate hook: queue the gradient; the whole queue is rounded when backward ends."""
        def hook(param: torch.Tensor) -> None:
            if not self._grad_queue:
                torch.autograd.Variable._execution_engine.queue_callback(self._round_grads)
            self._grad_queue.append((slot.id, param.grad, slot))

        return hook

    def _round_grads(self) -> None:
        queue, self._grad_queue = self._grad_queue, []

        def finish(flat: torch.Tensor | None, slot: _Slot, group: list[_Member]) -> None:
            if flat is None:
                return
            parts = self._quantize(flat, slot).split([grad.numel() for _, grad, _ in group])
            for (_, grad, _), part in zip(group, parts, strict=True):
                grad.copy_(part.view_as(grad))

        with torch.no_grad():
            self._by_format(queue, finish)

    # -- training -----------------------------------------------------------------------------------------

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if self.training and torch.is_grad_enabled():
            self.step_count += 1
        self._calls.clear()
        self._grad_queue = []  # left over only if the last backward failed
        packing = self._packer.forward() if torch.is_grad_enabled() else contextlib.nullcontext()
        with packing:
            if self._input_rounder is not None and args:
                args = (self._input_rounder(args[0]), *args[1:])
            if not self._weights:
                return self._target(*args, **kwargs)
            return torch.func.functional_call(self._target, self._rounded_weights(), args, kwargs)

    def wrap_optimizer(self, optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
        """The optimizer to step: ``optimizer`` itself with fp32 masters and no optimizer settings, else a
        precsearch.optim ``LowPrecisionOptimizer`` keeping pure low-precision weights (and rounded state)."""
        settings = dict(self.policy.optimizer)
        if self.policy.master_weights:
            if "state_format" not in settings:
                return optimizer
            settings.pop("update", None)  # with masters, the weight update is the forward's rounding
            formats: dict[torch.Tensor, Any] = {}
        else:
            formats = {param: slot.fmt for param, slot in self._weights.values()}
        settings["master_weights"] = self.policy.master_weights
        wrapped = from_config(optimizer, settings, weight_format=formats, generator=self._generator)
        self._optimizers.append(wrapped)
        return wrapped

    # -- reports ------------------------------------------------------------------------------------------

    def saved_bytes(self) -> SavedBytes:
        """What the last forward (with gradients) left for backward, each storage counted once."""
        return self._packer.last

    def formats(self) -> dict[str, str]:
        """Tensor id -> the format in force now (after promotions)."""
        return {tensor_id: slot.fmt.name for tensor_id, slot in self.slots.items()}

    def track_stats(self, every: int | None = 1) -> None:
        """Gather underflow / subnormal / NaN fractions every ``every`` steps (None: only overflow counts)."""
        self.stats_every = every

    def reset_stats(self) -> None:
        for slot in self.slots.values():
            slot.reset()

    def tensor_stats(self, as_frame: bool = False) -> Any:
        """Per tensor id of low precision: kind, format, promoted, calls, and the mean fractions (over the
        values seen since the last reset) of ``overflow`` (also ``max_overflow`` per call) and, with
        ``stats_every``, ``underflow``, ``subnormal`` and ``nan``. A dict, or a pandas DataFrame."""
        table: dict[str, dict[str, Any]] = {}
        for tensor_id, slot in self.slots.items():
            if slot.assigned.is_fp32 or not slot.calls:
                continue
            row: dict[str, Any] = {"kind": slot.kind, "format": slot.fmt.name, "assigned": slot.assigned.name,
                                   "promoted": slot.promoted, "calls": slot.calls}
            if slot.counted:
                row["overflow"] = slot.overflowed / slot.counted
                row["max_overflow"] = slot.max_overflow
            if slot.stat_elements:
                row.update({key: value / slot.stat_elements for key, value in slot.stat_sums.items()})
                row.setdefault("overflow", row.get("overflow", 0.0))
            table[tensor_id] = row
        if not as_frame:
            return table
        import pandas as pd

        return pd.DataFrame.from_dict(table, orient="index")

    def unwrap(self) -> nn.Module:
        """Remove every hook this wrapper installed and return the user's model (parameters as they are)."""
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        for name, layer in self._plain_layers.items():
            layer.train(self.module.get_submodule(name).training)
            self.module.set_submodule(name, layer)
        self._plain_layers.clear()
        return self.module


def _is_module(model: nn.Module, op: Any) -> bool:
    """Whether ``op`` is a call of one of the model's submodules (not a function call)."""
    base = op.name.partition("#")[0]
    try:
        module = model.get_submodule(base)
    except AttributeError:
        return False
    return op.module_type in {cls.__name__ for cls in type(module).__mro__}  # a chunked Conv2d is a Conv2d


def apply_policy(model: nn.Module, policy: Policy, example_input: torch.Tensor | None = None, *,
                 strict: bool = True, seed: int = 0, stats_every: int | None = None) -> PrecisionModel:
    """Wrap ``model`` so that it trains under ``policy`` (see the module docstring).

    ``example_input`` (default: zeros of the policy's input shape) is used to trace the model at the
    policy's batch size; a policy made for another graph raises unless ``strict=False``. ``seed`` seeds
    stochastic rounding; ``stats_every`` turns on underflow statistics every n-th step. The layers of
    ``policy.accumulation`` are swapped in ``model`` itself (``accumulation_layers`` names them).
    """
    if not isinstance(policy, Policy):
        raise PrecsearchError(f"apply_policy needs a precsearch Policy, got {type(policy).__name__}")
    not_fp32 = sorted({str(p.dtype) for p in model.parameters() if p.dtype != torch.float32})
    if not_fp32:
        raise PrecsearchError(f"model has {', '.join(not_fp32)} parameters; formats are simulated in float32: "
                              "call model.float() first")
    if example_input is None:
        example_input = policy.example_input(model)
    graph = trace(model, example_input, batch_size=policy.batch_size or example_input.shape[0],
                  leaf_modules=CHUNKED_LAYERS)
    policy.verify(graph, strict=strict)
    return PrecisionModel(model, policy, graph, seed=seed, stats_every=stats_every)

