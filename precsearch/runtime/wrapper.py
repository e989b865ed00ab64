"""Train any CNN under a policy: rounding, packed saved activations, master weights, loss scaling, promotion.

``apply_policy(model, policy)`` traces the model (precsearch.graph.tracing), checks that the policy was made for it,
and returns a ``PrecisionModel`` that trains in the ordinary loop::

    model = apply_policy(model, Policy.load("policy.json"))
    optimizer = model.wrap_optimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9))
    for images, labels in loader:
        optimizer.zero_grad()
        loss = F.cross_entropy(model(images), labels)
        model.scaler.scale(loss).backward()
        model.scaler.step(optimizer)
        model.scaler.update()

The pieces, each in one place:

* ``TensorState``: per tensor id of the graph, its format now, and what was seen of it. Every rounding is one
  ``precsearch::round`` op (precsearch.runtime.ops: one fused kernel when compiled) that also adds the number of
  overflowing values to the tensor's row of a counts tensor on the device. The counts are read once per
  step, together with the loss scaler's own overflow test (``scaler.step``; or at the next training forward
  when the loop does not call it): a training step makes one host synchronisation, however many tensors it
  rounds. Only training forwards (``model.train()``, gradients on) count, so evaluation never promotes.
* ``instrument_fx``: a copy of the traced FX graph with a rounding module after every op that makes a
  rounded tensor (as torch.ao's prepare_fx inserts observers), and an alias module after every layout op
  that copies one. Untraceable models get module forward hooks; ops that are plain function calls are then
  not enforced and listed in ``unenforced``, as are ops that run GEMMs inside an FX leaf function or module
  (``TensorGraph.unenforced``: rounded at their boundary only), each with a WARNING.
* ``_Packer``: tensors autograd saves for backward are held as codes of their format (the round op makes the
  codes in the same pass) through ``saved_tensors_hooks``, once per storage; an op that saved its own output
  before the rounding module ran (ReLU saves its result) is switched to the rounded codes too, as
  low-precision hardware would store them. ``saved_bytes()`` reports what the last forward kept.
* sliced backwards: a ``Conv2d`` or training ``BatchNorm2d`` reading a low activation, and an ``nn.ReLU`` making
  one, are called through autograd Functions (``_ConvOfPackedInput``, ``_BatchNormOfPackedInput``,
  ``_ReluOfPackedOutput``) whose backward decodes the codes a slice of samples at a time
  (``SlicedBackward.rows``), so the step never holds a float32 copy of a whole saved tensor; a conv whose
  weight outsizes its input decodes its input, and rounds its weight again from the master, a group of input
  channels at a time instead (``SlicedBackward.channels_per_group``).

What each tensor kind gets:

* weights: the forward computes with ``round(param)`` through an autograd Function whose backward passes the
  gradient straight through, so the parameters stay fp32 masters for any optimizer (Micikevicius et al.);
  a layer's backward rounds its master again (``_RoundedFromMaster``: the same values, no copy of the weight
  held in between; a weight rounded stochastically keeps its codes instead);
  with ``master_weights=False`` the parameters themselves are rounded and ``wrap_optimizer`` returns a
  precsearch.runtime.optim ``LowPrecisionOptimizer`` that keeps them so. With master weights, an optimizer
  ``update="stochastic"`` rounds the working copy stochastically (Wang et al.'s stochastic weight update).
* activations: rounded by the module after their op; its backward rounds the activation's gradient, on the
  loss-scaled values. With ``policy.gradient_rounding == "per_use"`` (the paper's reference), an activation
  with several consumers gets a module before each (``_GradUse``) that rounds that consumer's gradient, and
  autograd sums the rounded gradients in float32.
* weight gradients: rounded in place as each arrives (a post-accumulate-grad hook), still loss-scaled; where the
  format's codes hold every rounded value (``FloatFormat.codes_hold_rounded``: fp16, bf16, fp8; not e6m9s,
  which has no NaN code) they are then held as its codes, ``.grad`` None, until the end of the backward, when
  a callback sets ``.grad`` to the decoded (identical) values. Not while ``torch.distributed`` is initialized
  (DDP reads ``.grad`` during the backward).
* divergence guard (Lee et al.): when a tensor of a kind in ``policy.promotion_kinds`` (weights and
  activations by default, as the reference) has an overflow fraction in a step that reaches
  ``policy.promotion_threshold``, it is promoted to ``policy.high_format`` for the rest of training, logged
  and listed in ``promotions``, and that step is skipped (its values overflowed). An overflow in a gradient
  is reported to the loss scaler as an overflow (a saturating format hides it from the scaler's inf test).
  A saved tensor that holds inf/NaN in a format without such codes cannot be packed faithfully: that step is
  skipped too, with a WARNING.
* statistics: overflow fractions always (per step); underflow / subnormal / NaN fractions when
  ``stats_every`` is set (every n-th step; they cost a few passes and a host read per tensor).
* accumulation: with ``policy.accumulation`` the layers it names are swapped, in the user's model, for
  precsearch.runtime.accumulate's chunked Linear/Conv2d (same Parameters), whose forward and backward GEMMs sum in
  the accumulation format; ``accumulation_layers`` lists them and ``unwrap`` puts the plain layers back. The
  model is traced before the swap, so the graph, its fingerprint and ``module_types`` rules (``"Conv2d"``)
  are those of the plain model; the swap is a change of arithmetic, not of what tensors are stored.

Everything is simulated in float32 (models must be float32) and is device-agnostic. On CUDA, report
``torch.cuda.max_memory_allocated()`` as the memory figure; on CPU use ``saved_bytes()``. With
``master_weights=False`` a promoted weight moves to the high format in the optimizers ``wrap_optimizer``
returned too (``LowPrecisionOptimizer.set_format``). Known limit: adaptive loss scaling scales a GEMM's
gradient after the rounding of that gradient (the scaler's points are the GEMM nodes), so it protects the
products the GEMM's backward forms, as in Zhao et al., not the rounding of its own output gradient.
"""

from __future__ import annotations

import contextlib
import copy
import logging
import math
import operator
import weakref
from collections import Counter
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch
from torch import fx, nn
from torch.multiprocessing.reductions import StorageWeakRef

from precsearch.config.policy import Policy
from precsearch.config.spec import GRAD_KINDS
from precsearch.errors import PrecsearchError
from precsearch.formats import kernels
from precsearch.formats.format import FloatFormat, get_format
from precsearch.graph.in_place import gradient_arrives_fresh, gradient_passes_from, makes_fresh_output
from precsearch.graph.op_rules import OP_RULES, OpRules
from precsearch.graph.policy_check import policy_example_input, verify_policy
from precsearch.graph.tracing import trace, untraced_modules
from precsearch.graph.types import TensorGraph, grad_id
from precsearch.runtime import ops
from precsearch.runtime.accumulate import CHUNKED_LAYERS, swap_chunked_layers
from precsearch.runtime.optim import LowPrecisionOptimizer, from_config
from precsearch.runtime.scaling import LossScaler, epoch_growth, make_scaler

__all__ = ["PrecisionModel", "Promotion", "SavedBytes", "TensorState", "apply_policy", "instrument_fx"]

log = logging.getLogger(__name__)


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
    weight: int = 0  # codes of weights rounded stochastically (the others are rounded again in the backward)
    parameter: int = 0  # parameters saved as they are (fp32 weights)
    other: int = 0  # byproducts: buffers (BN running stats), non-float32 tensors (max-pool indices)

    @property
    def total(self) -> int:
        return self.activation + self.weight + self.parameter + self.other


# ------------------------------------------------------------------------------------------ tensor state


class _Slot:
    """One assigned tensor id: its format now, how it rounds, its row of the counts, and what was seen."""

    def __init__(self, tensor_id: str, kind: str, row: int, fmt: FloatFormat, rounding: str,
                 overflow: str | None) -> None:
        self.id, self.kind, self.row, self.assigned = tensor_id, kind, row, fmt
        self.rounding, self.overflow_mode = rounding, overflow
        self.promoted = False
        self.fmt = fmt
        self.reset()

    def reset(self) -> None:
        self.calls = self.counted = self.overflowed = 0
        self.max_overflow = 0.0  # the largest fraction of one step
        self.pending = 0  # elements counted on the device this step, not read yet
        self.stat_sums: Counter[str] = Counter()
        self.stat_elements = 0

    @property
    def is_low(self) -> bool:
        return not self.fmt.is_fp32

    def args(self) -> tuple[str, str, str]:
        """The format arguments of the round ops."""
        return self.fmt.name, self.rounding, self.overflow_mode or self.fmt.default_overflow


class TensorState:
    """What the runtime knows about each tensor id: format, promotion, statistics, and the device counters.

    ``round`` rounds a tensor and counts its overflow on the device; ``pending``/``settle`` are the loss
    scaler's once-a-step read of those counts (``LossScaler.watch``); ``flush`` reads them itself.
    """

    def __init__(self, slots: dict[str, _Slot], high: FloatFormat, threshold: float | None, seed: int,
                 promotion_kinds: tuple[str, ...] = ("weight", "activation", "weight_grad", "activation_grad")
                 ) -> None:
        self.slots = slots
        self.high = high
        self.threshold = threshold
        self.promotion_kinds = promotion_kinds
        self.promotions: list[Promotion] = []
        self.step = 0
        self.counting = False  # this forward is a training forward: count and gather statistics
        self.stats_due = False
        self.on_promote: list[Callable[[_Slot], None]] = []
        self._seed = seed
        self._counts: list[torch.Tensor] = []  # per slot row: [overflowed, unencodable] this step, on the device
        self._uncounted: torch.Tensor | None = None  # what a rounding that counts nothing adds to, never read
        self._seeds: torch.Tensor | None = None
        self._dirty = False
        self._warned_unencodable = self._warned_copied_gradient = False

    def _op_state(self, x: torch.Tensor, slot: _Slot | None, count: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """What a rounding of ``x`` in ``slot`` passes its op, on ``x``'s device: the counts it adds to (the
        slot's own tensor, ``count`` and ``x`` not empty, then accounted; else one never read; a kernel adds
        to a whole tensor, not to a view at an offset) and the stochastic-rounding seed."""
        device = x.device
        if self._uncounted is None or self._uncounted.device != device:
            self.flush()
            self._counts = [torch.zeros(2, dtype=torch.int64, device=device) for _ in self.slots]
            self._uncounted = torch.zeros(2, dtype=torch.int64, device=device)
            self._seeds = torch.full((), self._seed, dtype=torch.int64, device=device)
        if not (count and x.numel() > 0):
            return self._uncounted, self._seeds
        self._account(x, slot)
        return self._counts[slot.row], self._seeds

    def round(self, x: torch.Tensor, slot: _Slot, with_codes: bool = False,
              count: bool = True) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``x`` in the slot's format (a new tensor), its codes (``with_codes``, when the format fits 16 bits),
        and the overflow counted on the device (``count``)."""
        counts, seeds = self._op_state(x, slot, count)
        rounded, codes = ops.round(x, counts, *slot.args(), seeds, with_codes)
        return rounded, codes if codes.numel() else None

    def round_(self, x: torch.Tensor, slot: _Slot, with_codes: bool = False, count: bool = True
               ) -> torch.Tensor | None:
        """Round ``x`` in place, counting its overflow (``count``); its codes (``with_codes``, when the format
        fits 16 bits)."""
        counts, seeds = self._op_state(x, slot, count)
        codes = ops.round_(x, counts, *slot.args(), seeds, with_codes)
        return codes if codes.numel() else None

    def round_again(self, x: torch.Tensor, args: tuple[str, str, str], in_place: bool = False) -> torch.Tensor:
        """``x`` rounded again as an earlier rounding was (``args``: its ``_Slot.args()``), counting nothing:
        its overflow was counted the first time. No gradient flows through it."""
        counts, seeds = self._op_state(x, None, count=False)
        with torch.no_grad():
            if in_place:
                ops.round_(x, counts, *args, seeds, False)
                return x
            return ops.round(x, counts, *args, seeds, False)[0]

    def warn_gradient_copied(self, slot: _Slot) -> None:
        """Once: a gradient that may be rounded over itself arrived non-contiguous, so it was rounded into a new
        tensor."""
        if not self._warned_copied_gradient:
            self._warned_copied_gradient = True
            log.warning("the gradient %s arrived non-contiguous (a channels_last model?): such gradients are "
                        "rounded into a new tensor (one more float32 block each), not over themselves", slot.id)

    def _account(self, x: torch.Tensor, slot: _Slot) -> None:
        slot.calls += 1
        slot.pending += x.numel()
        self._dirty = True
        if self.stats_due:
            n = x.numel()
            slot.stat_sums.update({key: value * n for key, value in kernels.stats(x.detach(), slot.fmt).items()})
            slot.stat_elements += n

    # -- the once-a-step read ---------------------------------------------------------------------------

    def pending(self) -> torch.Tensor | None:
        return torch.cat(self._counts) if self._dirty else None

    def settle(self, values: list[int]) -> tuple[bool, bool]:
        """Take this step's counts: update statistics, promote, and say whether a gradient overflowed and
        whether the step must be skipped (a promotion, or a saved tensor the format could not hold)."""
        overflowed = skip = False
        unencodable = 0
        for slot in self.slots.values():
            if not slot.pending:
                continue
            over, bad = values[2 * slot.row], values[2 * slot.row + 1]
            fraction = over / slot.pending
            slot.counted += slot.pending
            slot.overflowed += over
            slot.max_overflow = max(slot.max_overflow, fraction)
            slot.pending = 0
            unencodable += bad
            if over and slot.kind in GRAD_KINDS:
                overflowed = True
            if self.threshold is not None and fraction >= self.threshold and self._promote(slot, fraction):
                skip = True
        if unencodable:
            skip = True
            if not self._warned_unencodable:
                self._warned_unencodable = True
                log.warning("step %d: %d saved value(s) were inf/NaN in a format without such codes, so their "
                            "packed copies are wrong: the step is skipped (training has likely diverged)",
                            self.step, unencodable)
        torch._foreach_zero_(self._counts)
        self._dirty = False
        return overflowed, skip

    def flush(self) -> None:
        """Read and settle pending counts now (when the loop did not call ``scaler.step``)."""
        if self._dirty:
            self.settle(torch.cat(self._counts).tolist())

    def _promote(self, slot: _Slot, fraction: float) -> bool:
        if slot.promoted or slot.fmt == self.high or not slot.is_low or slot.kind not in self.promotion_kinds:
            return False
        old = slot.fmt
        slot.fmt = self.high
        slot.promoted = True
        for callback in self.on_promote:
            callback(slot)
        self.promotions.append(Promotion(slot.id, self.step, fraction, old.name, self.high.name))
        log.info("promoted %s from %s to %s at step %d: %.2f%% of its values overflowed",
                 slot.id, old.name, self.high.name, self.step, 100 * fraction)
        return True

    # -- reports ----------------------------------------------------------------------------------------

    def table(self) -> dict[str, dict[str, Any]]:
        self.flush()
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
        return table

    def reset(self) -> None:
        self.flush()
        for slot in self.slots.values():
            slot.reset()

    # -- checkpoints --------------------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """What training must carry over: the step, the promotions and the stochastic-rounding counter."""
        self.flush()
        return {"step": self.step, "promotions": [list(p) for p in self.promotions],
                "rounding_seed": self._seed if self._seeds is None else int(self._seeds)}

    def load_state_dict(self, state: Mapping[str, Any]) -> list[_Slot]:
        """Restore ``state_dict()``; returns the slots promoted by it (the caller tells the optimizers)."""
        unknown = [p[0] for p in state["promotions"] if p[0] not in self.slots]
        if unknown:
            raise PrecsearchError(f"checkpoint promotes {unknown[0]!r}, which this policy does not assign; load it "
                                  "into a model wrapped with the policy it was trained under")
        self.step = int(state["step"])
        self.promotions = [Promotion(*p) for p in state["promotions"]]
        self._seed = int(state["rounding_seed"])
        if self._seeds is not None:
            self._seeds.fill_(self._seed)
        promoted = []
        for promotion in self.promotions:
            slot = self.slots[promotion.id]
            if not slot.promoted:
                slot.fmt, slot.promoted = get_format(promotion.to_format), True
                promoted.append(slot)
        return promoted


# ------------------------------------------------------------------------------------ saved-tensor packing


class _Packed:
    """One storage's values as codes of a format, shared by every saved view of it.

    It refers to the storage weakly, at the C++ level: a rounded tensor's Python object may die while views
    keep its storage alive, and a dead storage's address may be reused by an unrelated tensor.
    """

    __slots__ = ("fmt", "kind", "version", "storage", "shape", "codes", "saves", "unpacks", "decoded")

    def __init__(self, fmt: FloatFormat, kind: str, rounded: torch.Tensor, codes: torch.Tensor | None) -> None:
        self.fmt, self.kind, self.version, self.shape, self.codes = fmt, kind, rounded._version, rounded.shape, codes
        self.storage = StorageWeakRef(rounded.untyped_storage())
        self.saves = self.unpacks = 0  # saved views of the storage, and how many were unpacked
        self.decoded: torch.Tensor | None = None

    @property
    def nbytes(self) -> int:
        """What holding it costs."""
        return self.codes.nbytes

    def holds(self, t: torch.Tensor) -> bool:
        """Whether ``t`` views this storage, unmodified since it was rounded."""
        return self.version == t._version and not self.storage.expired()

    def _whole(self) -> torch.Tensor:
        """The storage, decoded into a new contiguous tensor."""
        return ops.decode(self.codes, self.fmt.name, self.codes.shape, self.codes.stride(), 0)

    def _view(self, geometry: tuple[torch.Size, tuple[int, ...], int]) -> torch.Tensor:
        """A view of the storage, decoded into a new tensor."""
        return ops.decode(self.codes, self.fmt.name, *geometry)

    def _part(self, dim: int, start: int, length: int) -> torch.Tensor:
        """A slice of the storage (a contiguous tensor) along ``dim``, decoded (its codes copied first)."""
        codes = self.codes.narrow(dim, start, length).contiguous()
        return ops.decode(codes, self.fmt.name, codes.shape, codes.stride(), 0)

    def view(self, geometry: tuple[torch.Size, tuple[int, ...], int]) -> torch.Tensor:
        """The saved view, decoded. A storage saved by several ops (ReLU and the next conv both save one
        activation) is decoded once and the float32 copy dropped after its last unpack."""
        self.unpacks += 1
        if self.saves == 1:
            return self._view(geometry)
        if self.decoded is None:
            self.decoded = self._whole()
        decoded = self.decoded
        if self.unpacks >= self.saves:
            self.decoded = None
        return decoded.as_strided(*geometry)

    def slicer(self, dim: int = 0) -> Callable[[int, int], torch.Tensor]:
        """One unpack of the whole storage (a contiguous tensor) as a function of ``(start, length)`` along
        ``dim`` that decodes that slice when called: a backward that needs no float32 copy of the whole
        tensor."""
        self.unpacks += 1
        whole = self.decoded  # another saver of the storage unpacked it first
        if self.unpacks >= self.saves:
            self.decoded = None

        def decode(start: int, length: int) -> torch.Tensor:
            return whole.narrow(dim, start, length) if whole is not None else self._part(dim, start, length)

        return decode

    def batch_slices(self, rows: int) -> Callable[[], Iterator[tuple[int, torch.Tensor]]]:
        """One unpack of the whole storage (a contiguous batch) as passes over it, ``rows`` samples at a time,
        each slice decoded when reached and yielded with its first sample (``slicer``)."""
        decode, batch = self.slicer(), self.shape[0]

        def one_pass() -> Iterator[tuple[int, torch.Tensor]]:
            for start in range(0, batch, rows):
                yield start, decode(start, min(rows, batch - start))

        return one_pass


class _RoundedFromMaster(_Packed):
    """A weight rounded from its fp32 master, saved as that master and the rounding: its backward rounds the
    master again, which gives the same values (nearest rounding is a function of the value, and the master is
    checked unchanged, as autograd checks what it saves), so the step holds no copy of any weight, neither
    codes nor float32, between a layer's forward and its backward (as torchao's float8 training can recompute
    its fp8 weights in the backward). A stochastic rounding draws anew each call: such weights keep codes."""

    __slots__ = ("master", "master_version", "state", "args")

    def __init__(self, slot: _Slot, rounded: torch.Tensor, master: torch.Tensor, state: TensorState) -> None:
        super().__init__(slot.fmt, "weight", rounded, None)
        self.master, self.master_version, self.state, self.args = master, master._version, state, slot.args()

    @property
    def nbytes(self) -> int:
        return 0  # the master is a parameter, held anyway

    def _master(self) -> torch.Tensor:
        if self.master._version != self.master_version:
            raise PrecsearchError("a parameter was changed in place between the forward and the backward that "
                                  "reads its rounded copy: call optimizer.step() only after backward()")
        return self.master

    def _whole(self) -> torch.Tensor:
        return self.state.round_again(self._master(), self.args)

    def _view(self, geometry: tuple[torch.Size, tuple[int, ...], int]) -> torch.Tensor:
        whole = self._whole()
        return whole if geometry == (whole.shape, whole.stride(), 0) else whole.as_strided(*geometry)

    def _part(self, dim: int, start: int, length: int) -> torch.Tensor:
        return self.state.round_again(self._master().narrow(dim, start, length).contiguous(), self.args,
                                      in_place=True)


class _Stored:
    """What the pack hook returns: the saved tensor itself, or its geometry inside a packed storage."""

    __slots__ = ("tensor", "packed", "geometry")

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor: torch.Tensor | None = tensor
        self.packed: _Packed | None = None
        self.geometry = (tensor.size(), tensor.stride(), tensor.storage_offset())

    def unpack(self) -> torch.Tensor:
        return self.tensor if self.packed is None else self.packed.view(self.geometry)

    def attach(self, packed: _Packed, sizes: SavedBytes) -> None:
        """Hold ``packed`` instead of the tensor; its first save adds its codes to ``sizes``."""
        self.tensor, self.packed = None, packed
        packed.saves += 1
        if packed.saves == 1:
            kind = "weight" if packed.kind == "weight" else "activation"
            setattr(sizes, kind, getattr(sizes, kind) + packed.nbytes)


class _Pending:
    """Float tensors saved as they are, by storage: kept so that a later rounding can switch them to codes."""

    __slots__ = ("version", "stored")

    def __init__(self, version: int) -> None:
        self.version = version
        self.stored: list[_Stored] = []


def _storage(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


def _whole_storage(t: torch.Tensor) -> bool:
    """Whether ``t`` is its storage, laid out contiguously from offset 0 (so its codes map 1:1)."""
    return (t.is_contiguous() and t.storage_offset() == 0
            and t.untyped_storage().nbytes() == t.numel() * t.element_size())


class _Packer:
    """The saved-tensor hooks of one forward pass and the bookkeeping that dedupes storages."""

    def __init__(self, module: nn.Module) -> None:
        self._module = module
        self.active = False
        self.last = SavedBytes()

    @contextlib.contextmanager
    def forward(self) -> Iterator[None]:
        self.active = True
        self._params = {_storage(p) for p in self._module.parameters()}
        self._buffers = {_storage(b) for b in self._module.buffers()}
        self._live: dict[int, _Packed] = {}
        self._pending: dict[int, _Pending] = {}
        self._all_pending: list[tuple[int, _Pending]] = []
        self._codes = SavedBytes()  # codes saved so far (packed storages are held by autograd alone)
        self._plain: dict[int, tuple[str, int]] = {}
        try:
            with torch.autograd.graph.saved_tensors_hooks(self.pack, _Stored.unpack):
                yield
        finally:
            self.active = False
            self.last = self._measure()
            self._live, self._pending, self._all_pending, self._plain = {}, {}, [], {}

    def register(self, raw: torch.Tensor, rounded: torch.Tensor, codes: torch.Tensor | None, fmt: FloatFormat,
                 kind: str) -> None:
        """``rounded`` holds values of ``fmt`` and ``codes`` their bit patterns: saves of it are packed, and
        earlier saves of ``raw`` switch to it."""
        if not self.active or codes is None:
            return
        packed = self._hold(rounded, _Packed(fmt, kind, rounded, codes))
        pending = self._pending.get(_storage(raw))
        if pending is not None and pending.version == raw._version and _whole_storage(raw):
            del self._pending[_storage(raw)]
            for stored in pending.stored:
                stored.attach(packed, self._codes)

    def register_weight(self, master: torch.Tensor, rounded: torch.Tensor, slot: _Slot, state: TensorState) -> None:
        """``rounded`` is ``master`` rounded by ``slot`` (not stochastically): saves of it hold the master, and
        the backward rounds it again (``_RoundedFromMaster``)."""
        if self.active:
            self._hold(rounded, _RoundedFromMaster(slot, rounded, master, state))

    def _hold(self, rounded: torch.Tensor, packed: _Packed) -> _Packed:
        """Saves of ``rounded`` become saves of ``packed`` until ``rounded`` dies (then nobody saved it)."""
        self._live[_storage(rounded)] = packed
        weakref.finalize(rounded, self._forget, _storage(rounded), id(packed))
        return packed

    def fresh(self, t: torch.Tensor) -> bool:
        """Whether the rounding may write over ``t`` in this (training) forward: an op's own new output, no
        view, that nothing saved and that is no parameter, buffer or tensor rounded before."""
        if not self.active or t.grad_fn is None or t._base is not None or not _whole_storage(t):
            return False
        ptr = _storage(t)
        return not (ptr in self._live or ptr in self._pending or ptr in self._params or ptr in self._buffers)

    def save_packed(self, t: torch.Tensor) -> _Stored | None:
        """A save of ``t`` held as the codes of its storage, when ``t`` is a whole packed storage in the batch's
        contiguous layout (so that its codes slice by sample); else None."""
        packed = self._live.get(_storage(t)) if self.active else None
        if packed is None or not packed.holds(t) or not _whole_storage(t) or t.shape != packed.shape:
            return None
        stored = _Stored(t)
        stored.attach(packed, self._codes)
        return stored

    def _forget(self, ptr: int, ident: int) -> None:
        if self.active and id(self._live.get(ptr)) == ident:
            del self._live[ptr]

    def alias(self, t: torch.Tensor, slot: _Slot, state: TensorState) -> None:
        """``t`` is a fresh copy of rounded values (a layout op's output): pack its saves in the slot's format
        too (its overflow was counted where it was rounded)."""
        if not self.active or not slot.is_low or t.dtype != torch.float32 or not _whole_storage(t):
            return
        known = self._live.get(_storage(t))
        if known is None or known.storage.expired():  # a view of a known storage is no copy
            _, codes = state.round(t, slot, with_codes=True, count=False)
            self.register(t, t, codes, slot.fmt, slot.kind)

    def pack(self, t: torch.Tensor) -> _Stored:
        stored = _Stored(t)
        ptr = _storage(t)
        if ptr in self._params or ptr in self._buffers or t.dtype != torch.float32:
            self._plain[ptr] = ("parameter" if ptr in self._params else "other", t.untyped_storage().nbytes())
            return stored
        packed = self._live.get(ptr)
        if packed is not None and packed.holds(t):
            stored.attach(packed, self._codes)
            return stored
        pending = self._pending.get(ptr)
        if pending is None or pending.version != t._version:
            pending = self._pending[ptr] = _Pending(t._version)
            self._all_pending.append((ptr, pending))
        pending.stored.append(stored)
        return stored

    def _measure(self) -> SavedBytes:
        sizes = self._codes
        for ptr, pending in self._all_pending:
            kept = [s.tensor for s in pending.stored if s.tensor is not None]
            if kept and ptr not in self._plain:
                self._plain[ptr] = ("activation", kept[0].untyped_storage().nbytes())
        for category, nbytes in self._plain.values():
            setattr(sizes, category, getattr(sizes, category) + nbytes)
        return sizes


# ----------------------------------------------------------------------------------- autograd functions


def _round_forward(ctx: Any, x: torch.Tensor, state: TensorState, slot: _Slot, with_codes: bool,
                   in_place: bool = False) -> Any:
    """The forward of the round Functions: rounded values (``x`` itself, ``in_place``), and their codes as a
    non-differentiable output."""
    ctx.set_materialize_grads(False)  # no zero gradients for the codes
    if in_place:
        rounded, codes = x, state.round_(x, slot, with_codes, count=state.counting)
        ctx.mark_dirty(x)
    else:
        rounded, codes = state.round(x, slot, with_codes, count=state.counting)
    if codes is None:
        return rounded, None
    ctx.mark_non_differentiable(codes)
    return rounded, codes


class _RoundActivation(torch.autograd.Function):
    """Forward: the activation rounded to its format (and its codes), over the op's own output with
    ``in_place``. Backward: its gradient rounded, over the gradient itself with ``grad_in_place`` (a new
    tensor only this rounding reads, ``graph.gradient_arrives_fresh``)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, state: TensorState, act: _Slot, grad: _Slot | None,
                with_codes: bool, in_place: bool, grad_in_place: bool) -> Any:
        ctx.state, ctx.grad, ctx.count = state, grad, state.counting  # an evaluation's backward counts nothing
        ctx.grad_in_place = grad_in_place
        return _round_forward(ctx, x, state, act, with_codes, in_place)

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor, _codes: Any) -> tuple[torch.Tensor | None, None, None, None, None,
                                                                  None, None]:
        if ctx.grad is not None and g is not None:
            if ctx.grad_in_place and g.is_contiguous():
                ctx.state.round_(g, ctx.grad, count=ctx.count)
            else:
                if ctx.grad_in_place:
                    ctx.state.warn_gradient_copied(ctx.grad)
                g = ctx.state.round(g, ctx.grad, count=ctx.count)[0]
        return g, None, None, None, None, None, None


class _RoundWeight(torch.autograd.Function):
    """Forward: the weight the layer computes with, rounded (and its codes). Backward: straight through."""

    @staticmethod
    def forward(ctx: Any, param: torch.Tensor, state: TensorState, slot: _Slot, with_codes: bool) -> Any:
        return _round_forward(ctx, param, state, slot, with_codes)

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor, _codes: Any) -> tuple[torch.Tensor, None, None, None]:
        return g, None, None, None


class _Rounder(nn.Module):
    """The module inserted after an op: rounds each output position that has a slot (act, grad). With
    ``in_place`` (set by ``instrument_fx`` after ops that make fresh outputs read by nothing else) it may write
    the rounded values over the op's output (``_Packer.fresh`` says when). It rounds the output's gradient over
    itself, unless a backward hook of the reading module may keep it, with ``grad_in_place`` (the gradient
    arrives as a new tensor, ``graph.gradient_arrives_fresh``) and where the gradient is an add's output
    gradient that ``grad_source`` rounded exactly as this one rounds (``graph.gradient_passes_from``): the
    values do not change then, so the add's other input, which holds the same tensor, sees no difference."""

    def __init__(self, model: PrecisionModel, slots: dict[int, tuple[_Slot, _Slot | None]], op: str) -> None:
        super().__init__()
        self.op = op
        self.__dict__["_model"] = model  # not a submodule: the wrapper owns this one
        self.slots = slots
        self.in_place = self.grad_in_place = False
        self.grad_source: _Slot | None = None  # the add's output gradient this one's is (``gradient_passes_from``)
        self.__dict__["reader"] = None  # the module reading the output, when its gradient may be rounded over

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
        source, grad = self.grad_source, pair[1]
        rounded_alike = source is not None and grad is not None and source.is_low and source.args() == grad.args()
        grad_in_place = (self.grad_in_place or rounded_alike) and not _keeps_input_gradients(self.reader)
        return self._model._activation(t, *pair, in_place=self.in_place, grad_in_place=grad_in_place)

    def extra_repr(self) -> str:
        return self.op


def _keeps_input_gradients(module: nn.Module | None) -> bool:
    """Whether a backward hook (the module's own or a global one) sees, and may keep, the gradients of the
    module's inputs: a rounding must not write over them then."""
    return module is not None and bool(module._backward_hooks or nn.modules.module._global_backward_hooks)


class _Alias(nn.Module):
    """The module inserted after a layout op: a copy it made of rounded values is packed like its source."""

    def __init__(self, model: PrecisionModel, slot: _Slot) -> None:
        super().__init__()
        self.__dict__["_model"] = model
        self.slot = slot

    def forward(self, value: Any) -> Any:
        if isinstance(value, torch.Tensor):
            self._model._packer.alias(value, self.slot, self._model.state)
        return value


class _GradUse(nn.Module):
    """Inserted before one consumer of an activation (``gradient_rounding: per_use``): the gradient this
    consumer sends back is rounded on its own, and autograd sums the consumers' rounded gradients in float32."""

    def __init__(self, model: PrecisionModel, slot: _Slot) -> None:
        super().__init__()
        self.__dict__["_model"] = model
        self.slot = slot

    def forward(self, value: Any) -> Any:
        if not isinstance(value, torch.Tensor) or not value.requires_grad or not self.slot.is_low:
            return value
        use = value.view_as(value)  # a node of its own in the autograd graph, sharing the storage
        self._model._round_grad_of(use, self.slot)
        return use


class _RoundedWeightsCall(nn.Module):
    """Calls a layer with its low weights rounded, so that their float32 copies die with the call."""

    def __init__(self, model: PrecisionModel, layer: nn.Module, params: dict[str, str]) -> None:
        super().__init__()
        self.__dict__["_model"] = model
        self.__dict__["layer"] = layer  # the user's module, called as it is: not a child of this one
        self.params = params  # the layer's parameter name -> its qualified name

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        rounded = {name: self._model._round_weight(qualified) for name, qualified in self.params.items()}
        return torch.func.functional_call(self.layer, rounded, args, kwargs)


def _take_stored(ctx: Any) -> _Stored:
    """The backward's one use of its saved tensor, taken out of ``ctx.stored`` (a list holding it) now: codes
    die with their last saver's backward, not with the autograd graph."""
    if not ctx.stored:
        raise PrecsearchError("a second backward through a layer of a packed tensor: its codes were freed by the "
                              "first (retain_graph=True is not supported under a policy)")
    return ctx.stored.pop()


def _slice_rows(ctx: Any, grad_out: torch.Tensor, module_type: str, weight_numel: int = 0) -> int:
    """``SlicedBackward.rows`` of ``module_type`` in the op rules ``ctx.rules`` on CPU; the whole batch elsewhere
    (slicing not measured off CPU) or where the rules slice no backward of that type."""
    sliced = ctx.rules.op_type(module_type).sliced
    if grad_out.device.type != "cpu" or sliced is None:
        return ctx.input_shape[0]
    return sliced.rows(ctx.input_shape, weight_numel)


def _slice_channels(ctx: Any, grad_out: torch.Tensor) -> int:
    """``SlicedBackward.channels_per_group`` of a Conv2d in the op rules ``ctx.rules`` on CPU; all channels
    elsewhere (not measured off CPU) or where the rules slice no Conv2d backward."""
    sliced = ctx.rules.op_type("Conv2d").sliced
    if grad_out.device.type != "cpu" or sliced is None:
        return ctx.input_shape[1]
    return sliced.channels_per_group(ctx.input_shape, ctx.weight_shape)


def _channel_slicer(stored: _Stored) -> Callable[[int, int], torch.Tensor]:
    """A saved tensor as a function of ``(start, length)`` giving that slice of its channels (dim 1), decoded when
    called where it is packed (``_Packed.slicer``)."""
    if stored.packed is not None:
        return stored.packed.slicer(1)
    whole = stored.unpack()
    return lambda start, length: whole.narrow(1, start, length)


class _ConvOfPackedInput(torch.autograd.Function):
    """A Conv2d whose input autograd would hold as codes. Its backward, in slices of samples, makes the weight
    gradient as a sum over slices of the decoded input, then the input gradient slice by slice from the
    output gradient alone (as ``torch.nn.grad.conv2d_input``), so no float32 copy of the whole input, nor
    oneDNN's reordered copies of it, is made. One slice (``SlicedBackward.rows``: a weight larger than
    the input): groups of input channels instead (``SlicedBackward.channels_per_group``), one call each, from that
    group's slices of the input, decoded from its codes, and of the weight, rounded again from the master or
    decoded where it keeps codes (a group's input gradient needs only its weight slice, its weight gradient
    only its input slice), written into the whole gradients: no float32 copy of the whole weight, nor
    oneDNN's reordered copy of it. The weight comes as its save (``weight_stored``, from
    ``_Packer.save_packed``) where it is low."""

    slices_weight = True  # the caller passes the weight's save

    @staticmethod
    def runs(layer: nn.Module) -> bool:
        return True

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                stored: list[_Stored], rules: OpRules, layer: nn.Conv2d, weight_stored: _Stored | None) -> torch.Tensor:
        ctx.stored, ctx.layer, ctx.input_shape, ctx.has_bias = stored, layer, x.shape, bias is not None
        ctx.rules = rules
        ctx.weight_shape, ctx.weight_stored = weight.shape, weight_stored
        if weight_stored is None:  # not packed: autograd keeps it (and checks that nothing changed it)
            ctx.save_for_backward(weight)
        return layer._conv_forward(x, weight, bias)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        packed, layer = _take_stored(ctx).packed, ctx.layer
        saved_weight = ctx.weight_stored or _Stored(ctx.saved_tensors[0])
        ctx.weight_stored = None  # its codes die with this backward
        need_input, need_weight, need_bias = ctx.needs_input_grad[:3]
        batch, rows = ctx.input_shape[0], _slice_rows(ctx, grad_out, "Conv2d", math.prod(ctx.weight_shape))
        channels = _slice_channels(ctx, grad_out)

        def conv_backward(g: torch.Tensor, x: torch.Tensor, weight: torch.Tensor,
                          mask: list[bool]) -> tuple[torch.Tensor, ...]:
            return torch.ops.aten.convolution_backward(g, x, weight, None, layer.stride, layer.padding,
                                                       layer.dilation, False, [0, 0], layer.groups, mask)

        grad_input = grad_weight = None
        if rows >= batch and channels < ctx.input_shape[1]:
            grad_input = grad_out.new_empty(ctx.input_shape) if need_input else None
            grad_weight = grad_out.new_empty(ctx.weight_shape) if need_weight else None
            input_slice, weight_slice = packed.slicer(1), _channel_slicer(saved_weight)

            def backward_group(start: int, length: int) -> None:
                """One group of input channels; its float32 slices die on return, before the next group's."""
                parts = conv_backward(grad_out, input_slice(start, length), weight_slice(start, length),
                                      [need_input, need_weight, False])
                for whole, part in zip((grad_input, grad_weight), parts[:2], strict=True):
                    if whole is not None:
                        whole.narrow(1, start, length).copy_(part)

            for start in range(0, ctx.input_shape[1], channels):
                backward_group(start, min(channels, ctx.input_shape[1] - start))
        elif rows >= batch:
            (_, x), = packed.batch_slices(rows)()
            grad_input, grad_weight, _ = conv_backward(grad_out, x, saved_weight.unpack(),
                                                       [need_input, need_weight, False])
        else:
            weight = saved_weight.unpack()
            passes = packed.batch_slices(rows)
            for start, x in passes() if need_weight else ():
                grad = conv_backward(grad_out[start:start + rows], x, weight, [False, True, False])[1]
                grad_weight = grad if grad_weight is None else grad_weight.add_(grad)
                del x, grad  # the next slice and its gradient are made beside neither, and the last outlives no loop
            if need_input:
                grad_input = grad_out.new_empty(ctx.input_shape)
                for start in range(0, batch, rows):
                    g = grad_out[start:start + rows]
                    shape = (g.shape[0], *ctx.input_shape[1:])
                    grad_input[start:start + rows].copy_(conv_backward(g, g.new_empty(1).expand(shape), weight,
                                                                       [True, False, False])[0])
        grad_bias = grad_out.sum((0, 2, 3)) if need_bias and ctx.has_bias else None
        return grad_input, grad_weight, grad_bias, None, None, None, None


class _BatchNormOfPackedInput(torch.autograd.Function):
    """A BatchNorm2d in training whose input autograd would hold as codes. One slice: torch's own backward over
    the decoded input. Several: two passes over the slices, the per-channel sums of the gradient and of the
    gradient times the centred input (each slice's float32 sum added in float64; torch's CPU kernel sums in
    float64), then the input gradient slice by slice, so no float32 copy of the whole input is made."""

    slices_weight = False

    @staticmethod
    def runs(layer: nn.Module) -> bool:
        return layer.training

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None,
                stored: list[_Stored], rules: OpRules, layer: nn.BatchNorm2d) -> torch.Tensor:
        layer.num_batches_tracked.add_(1)  # nn.BatchNorm2d's own training forward, for a set momentum
        out, mean, invstd = torch.native_batch_norm(x, weight, bias, layer.running_mean, layer.running_var, True,
                                                    layer.momentum, layer.eps)
        ctx.stored, ctx.input_shape, ctx.eps, ctx.rules = stored, x.shape, layer.eps, rules
        # the running statistics too, unused: what torch's batch norm saves, so that saved bytes stay its own
        ctx.save_for_backward(weight, mean, invstd, layer.running_mean, layer.running_var)
        return out

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        packed, (weight, mean, invstd, _, _) = _take_stored(ctx).packed, ctx.saved_tensors
        need = list(ctx.needs_input_grad[:3])
        batch, rows = ctx.input_shape[0], _slice_rows(ctx, grad_out, "BatchNorm2d")
        passes = packed.batch_slices(rows)
        if rows >= batch:
            (_, x), = passes()
            grads = torch.ops.aten.native_batch_norm_backward(grad_out, x, weight, None, None, mean, invstd, True,
                                                              ctx.eps, need)
            return *grads, None, None, None
        channel, dims = (1, -1, 1, 1), (0, 2, 3)
        sum_dy = dot = 0  # per channel: sums of grad_out and of grad_out * (x - mean), slice sums added in float64
        for start, x in passes():
            g = grad_out[start:start + rows]
            sum_dy = sum_dy + g.sum(dims).double()
            dot = dot + (x - mean.view(channel)).mul_(g).sum(dims).double()
            del x  # the next slice is decoded beside none other, and the last not kept into the second pass
        grad_input = None
        if need[0]:
            count = grad_out.numel() // grad_out.shape[1]
            k = (dot * invstd.double().square() / count).float().view(channel)
            mean_dy = (sum_dy / count).float().view(channel)
            scale = (invstd if weight is None else invstd * weight).view(channel)
            grad_input = torch.empty_like(grad_out)
            for start, x in passes():
                out = grad_input[start:start + rows]
                torch.sub(grad_out[start:start + rows], (x - mean.view(channel)).mul_(k), out=out)
                out.sub_(mean_dy).mul_(scale)
        grad_weight = (dot * invstd.double()).float() if need[1] else None
        grad_bias = sum_dy.float() if need[2] else None
        return grad_input, grad_weight, grad_bias, None, None, None


class _ReluOfPackedOutput(torch.autograd.Function):
    """An ``nn.ReLU`` whose output is a low activation. It saves its output through the packer (held as the
    codes of its rounding, like any output an op saves), and its backward decodes those codes a slice at a
    time into torch's own ReLU backward, so no float32 copy of the whole output is made."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, stored: list[_Stored], rules: OpRules, inplace: bool) -> torch.Tensor:
        out = torch.relu_(x) if inplace else torch.relu(x)
        if inplace:
            ctx.mark_dirty(x)
        ctx.stored, ctx.input_shape = stored, out.shape  # the caller saves the output, as autograd returns it
        ctx.rules = rules
        return out

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[torch.Tensor | None, None, None, None]:
        stored = _take_stored(ctx)
        if stored.packed is None:  # not rounded after all (a promoted slot): the output itself
            return torch.ops.aten.threshold_backward(grad_out, stored.tensor, 0), None, None, None
        rows = _slice_rows(ctx, grad_out, "ReLU")
        grad_input = torch.empty_like(grad_out)
        for start, out in stored.packed.batch_slices(rows)():
            torch.ops.aten.threshold_backward.grad_input(grad_out[start:start + rows], out, 0,
                                                         grad_input=grad_input[start:start + rows])
        return grad_input, None, None, None


class _PackedOutputRelu(nn.Module):
    """Calls an ``nn.ReLU`` whose output is a low activation through ``_ReluOfPackedOutput`` in a training
    forward, else as the module itself (and with hooks other than forward hooks, one WARNING)."""

    def __init__(self, model: PrecisionModel, layer: nn.ReLU) -> None:
        super().__init__()
        self.__dict__["_model"] = model
        self.__dict__["layer"] = layer

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        packer = self._model._packer
        if _runs_as_itself(self.layer):
            self._model.warn_unsliced(self.layer, _HOOKED)
            return self.layer(x)
        if not packer.active:
            return self.layer(x)
        stored: list[_Stored] = []
        out = _ReluOfPackedOutput.apply(x, stored, self._model.graph.rules, self.layer.inplace)
        stored.append(packer.pack(out))  # after the call: an in-place ReLU's output has its final version now
        return _after_forward_hooks(self.layer, x, out)


def packed_output_function(layer: nn.Module) -> type[torch.autograd.Function] | None:
    """The Function that computes ``layer``'s backward from its packed output a slice at a time (a plain
    ``nn.ReLU``), or None."""
    return _ReluOfPackedOutput if type(layer) is nn.ReLU else None


def packed_input_function(layer: nn.Module) -> type[torch.autograd.Function] | None:
    """The Function that computes ``layer``'s backward from its packed input a slice at a time, or None: a
    plain ``nn.Conv2d`` with zero padding given as numbers (``padding="same"`` may pad unevenly, which
    ``aten.convolution_backward`` cannot), or a plain ``nn.BatchNorm2d`` with running statistics and a set
    momentum."""
    if type(layer) is nn.Conv2d and layer.padding_mode == "zeros" and not isinstance(layer.padding, str):
        return _ConvOfPackedInput
    if type(layer) is nn.BatchNorm2d and layer.track_running_stats and layer.momentum is not None:
        return _BatchNormOfPackedInput
    return None


class _PackedInputCall(_RoundedWeightsCall):
    """Calls a layer whose input is a low activation (``packed_input_function``): through that Function when
    the packer holds the input as codes (a training forward), else as the layer itself; low weights rounded
    as ``_RoundedWeightsCall`` rounds them. Its forward hooks run after the Function; a layer with other hooks is
    called as itself (one WARNING)."""

    def __init__(self, model: PrecisionModel, layer: nn.Module, params: dict[str, str],
                 function: type[torch.autograd.Function]) -> None:
        super().__init__(model, layer, params)
        self.__dict__["function"] = function

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        if _runs_as_itself(self.layer):
            self._model.warn_unsliced(self.layer, _HOOKED)
            return super().forward(x)
        weights = {name: self._model._round_weight(qualified) for name, qualified in self.params.items()}
        stored = None
        packer = self._model._packer
        if x.dim() == 4 and self.function.runs(self.layer) and packer.active:
            stored = packer.save_packed(x)
            if stored is None:
                self._model.warn_unsliced(self.layer, "reads a tensor that is not a whole packed batch (a view of "
                                          "one, or channels_last)")
        if stored is None:
            return torch.func.functional_call(self.layer, weights, (x,))
        weight = weights.get("weight", self.layer.weight)
        weight_stored = (packer.save_packed(weight),) if self.function.slices_weight else ()
        out = self.function.apply(x, weight, weights.get("bias", self.layer.bias), [stored], self._model.graph.rules,
                                  self.layer, *weight_stored)
        return _after_forward_hooks(self.layer, x, out)


# why a layer with hooks runs as itself
_HOOKED = "has module hooks other than forward hooks (remove them to train in less memory)"


def _runs_as_itself(module: nn.Module) -> bool:
    """Whether ``module`` has hooks that only a call of the module runs: any but forward hooks without kwargs
    (``_after_forward_hooks`` runs those after a Function as the call would), or global hooks."""
    glob = nn.modules.module
    return any((module._forward_pre_hooks, module._backward_hooks, module._backward_pre_hooks,
                module._forward_hooks_with_kwargs, glob._global_forward_pre_hooks, glob._global_forward_hooks,
                glob._global_backward_hooks, glob._global_backward_pre_hooks))


def _after_forward_hooks(module: nn.Module, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """The module's forward hooks on ``out``, in order, each free to replace it (``nn.Module.__call__``'s
    rule): adaptive loss scaling marks its GEMM layers' outputs so."""
    for hook in module._forward_hooks.values():
        result = hook(module, (x,), out)
        if result is not None:
            out = result
    return out


class _RoundedWeight(nn.Module):
    """Inserted after a read of a parameter (a weight passed to a function): the rounded weight."""

    def __init__(self, model: PrecisionModel, qualified: str) -> None:
        super().__init__()
        self.__dict__["_model"] = model
        self.qualified = qualified

    def forward(self, param: torch.Tensor) -> torch.Tensor:
        return self._model._round_weight(self.qualified)


# -------------------------------------------------------------------------------------- instrumentation


def instrument_fx(graph: TensorGraph, module: nn.Module,
                  rounder: Callable[[Any], nn.Module | None], alias: Callable[[_Slot], nn.Module],
                  weights: Callable[[str, list[str] | None, bool, bool], nn.Module | None],
                  replaced: dict[str, nn.Module] | None = None,
                  per_use: Callable[[_Slot], nn.Module] | None = None) -> fx.GraphModule:
    """A copy of ``graph``'s FX graph (calling ``module``'s submodules, with ``replaced`` swapped in) with the
    module ``rounder(op)`` after every op it returns one for, ``alias(slot)`` after every layout op
    (contiguous, reshape, ...) that may copy a rounded activation of that slot, and every call of a submodule
    or read of a parameter replaced by ``weights(qualified name, parameter names or None for a read, reads a
    low activation, makes a low activation)`` where it returns a module (one that computes with rounded
    weights, or a sliced backward's layer call): torch.ao's prepare_fx, with rounding modules for observers.
    With ``per_use``, an output whose gradient is rounded and that has several consumers gets the module
    ``per_use(gradient slot)`` before each consumer, which rounds that consumer's gradient instead."""
    source = graph.graph_module
    fx_graph = copy.deepcopy(source.graph)
    gm = fx.GraphModule(source, fx_graph, type(module).__name__)
    traced = dict(gm.named_modules())
    for name, layer in (replaced or {}).items():
        if name in traced:
            gm.set_submodule(name, layer)
    nodes = {node.name: node for node in fx_graph.nodes}
    last_placeholder = [node for node in fx_graph.nodes if node.op == "placeholder"][-1]
    carried: dict[fx.Node, dict[int, _Slot]] = {}  # node -> the rounded activation slot of each output
    rounded: list[tuple[fx.Node, nn.Module]] = []  # each rounding node and its module

    def insert(after: fx.Node, node: fx.Node, name: str, inserted: nn.Module) -> fx.Node:
        gm.add_submodule(name, inserted)
        with fx_graph.inserting_after(after):
            new = fx_graph.call_module(name, (node,))
        node.replace_all_uses_with(new, delete_user_cb=lambda user: user is not new)
        return new

    fresh_gradients, passes = gradient_arrives_fresh(graph), gradient_passes_from(graph)
    rounders: dict[str, nn.Module] = {}
    for index, op in enumerate(graph.ops):
        inserted = rounder(op)
        if inserted is not None:
            # every use of the op's output now reads the rounding's: it may overwrite an output nothing saved
            inserted.in_place = makes_fresh_output(op, graph.rules)
            inserted.grad_in_place = op.name in fresh_gradients and set(inserted.slots) == {0}
            node = nodes[op.node]
            after = last_placeholder if node.op == "placeholder" else node
            new = insert(after, node, f"precsearch_round_{index}", inserted)
            reader = next(iter(new.users)) if inserted.grad_in_place or op.name in passes else None  # the one
            if reader is not None and reader.op == "call_module":
                inserted.__dict__["reader"] = gm.get_submodule(reader.target)  # the user's, not a child
            carried[new] = {position: act for position, (act, _) in inserted.slots.items() if act.is_low}
            rounded.append((new, inserted))
            rounders[op.name] = inserted
    op_nodes = {op.node for op in graph.ops}
    for node in list(fx_graph.nodes):
        if (node.name in op_nodes or node in carried or not node.op.startswith("call_")
                or graph.rules.returns_no_tensor(node.target) or node.target is getattr):
            continue
        source_slots = next((carried[arg] for arg in node.all_input_nodes if arg in carried), None)
        if not source_slots:
            continue
        if node.target is operator.getitem and isinstance(node.args[1], int):
            picked = source_slots.get(node.args[1])
            source_slots = {0: picked} if picked is not None else {}
        if 0 in source_slots:
            carried[insert(node, node, f"precsearch_alias_{len(carried)}", alias(source_slots[0]))] = source_slots
        elif source_slots:
            carried[node] = source_slots
    if per_use is not None:
        for node, inserted in rounded:
            _round_per_use(fx_graph, gm, node, inserted, per_use)
    for name, add in passes.items():  # after per_use, which may take the add's gradient rounding off
        if name in rounders and add in rounders and set(rounders[name].slots) == {0}:
            rounders[name].grad_source = rounders[add].slots.get(0, (None, None))[1]
    for node in list(fx_graph.nodes):
        if node.op == "call_module" and node.target in traced:  # the user's modules, not those inserted
            names = [name for name, _ in gm.get_submodule(node.target).named_parameters()]
            low_input = bool(node.args) and node.args[0] in carried and not node.kwargs and len(node.args) == 1
            rounding = next(iter(node.users)) if len(node.users) == 1 else None
            low_output = 0 in carried.get(rounding, {})
            inserted = weights(node.target, names, low_input, low_output)
            if inserted is not None:
                name = f"precsearch_weights_{node.target.replace('.', '_')}"
                if not hasattr(gm, name):
                    gm.add_submodule(name, inserted)
                node.target = name
        elif node.op == "get_attr":
            inserted = weights(node.target, None, False, False)
            if inserted is not None:
                insert(node, node, f"precsearch_weight_{node.target.replace('.', '_')}", inserted)
    fx_graph.lint()
    gm.recompile()
    return gm


def _round_per_use(fx_graph: fx.Graph, gm: fx.GraphModule, node: fx.Node, inserted: Any,
                   per_use: Callable[[_Slot], nn.Module]) -> None:
    """Give each consumer of ``node`` (a single-tensor rounding node) its own gradient rounding module, and
    take the rounding of the summed gradient off ``inserted``."""
    act, grad = inserted.slots.get(0, (None, None))
    users = list(node.users)
    if grad is None or len(users) < 2 or set(inserted.slots) != {0}:
        return
    inserted.slots[0] = (act, None)
    for user in users:
        name = f"precsearch_use_{node.name}_{user.name}"
        gm.add_submodule(name, per_use(grad))
        with fx_graph.inserting_before(user):
            use = fx_graph.call_module(name, (node,))
        user.replace_input_with(node, use)


# ------------------------------------------------------------------------------------------ the wrapper


class PrecisionModel(nn.Module):
    """A model training under a policy; build it with ``apply_policy``. The user's model is ``.module``."""

    def __init__(self, model: nn.Module, policy: Policy, graph: TensorGraph, seed: int = 0,
                 stats_every: int | None = None, steps_per_epoch: int | None = None) -> None:
        super().__init__()
        self.module = model
        self.policy = policy
        self.graph = graph
        self.unenforced: list[str] = []
        self.untraced: list[str] = []  # modules that ran in a forward but are not in the graph (hook tracer only)
        self.clipped_at_start: list[str] = []  # "id fraction%" of pure low weights clipped by their first rounding
        self.stats_every = stats_every
        self._generator = torch.Generator().manual_seed(seed)
        self._handles: list[Any] = []
        self._optimizers: list[LowPrecisionOptimizer] = []  # wrapped ones, told about weight promotions
        self._plain_layers: dict[str, nn.Module] = {}
        self.accumulation_layers = self._swap_accumulation()
        self.steps_per_epoch = steps_per_epoch
        self.state = TensorState(self._make_slots(), get_format(policy.high_format), policy.promotion_threshold,
                                 seed, promotion_kinds=policy.promotion_kinds)
        self._packer = _Packer(model)
        self.scaler: LossScaler = self._make_scaler()
        self.scaler.watch(self.state)
        self._weights = self._weight_slots()
        if not policy.master_weights:
            self.state.on_promote.append(self._promote_in_optimizers)
        self._round_pure_weights()
        self._hook_weight_grads()
        self._input_rounder: _Rounder | None = None
        self._module_rounders: dict[str, dict[int, _Rounder]] = {}
        self._calls: Counter[str] = Counter()
        self._rounded_at_use: set[str] = set()
        self._warned_unsliced: set[str] = set()
        self._warned_compile = False
        if graph.graph_module is not None:
            per_use = (lambda slot: _GradUse(self, slot)) if policy.gradient_rounding == "per_use" else None
            target = instrument_fx(graph, model, self._rounder_for, lambda slot: _Alias(self, slot),
                                   self._weights_call_for,
                                   {name: model.get_submodule(name) for name in self.accumulation_layers}, per_use)
        else:
            target = self._instrument_hooks()
            if policy.gradient_rounding == "per_use":
                log.warning("model is not FX-traceable: gradient_rounding per_use needs the FX graph; each "
                            "activation's summed gradient is rounded once (sum)")
        self.__dict__["_target"] = target  # the FX module shares the user's submodules: keep it unregistered
        if self.unenforced:
            log.warning("model is not FX-traceable: activations of %d function op(s) are not rounded (%s)",
                        len(self.unenforced), ", ".join(self.unenforced))
        self._list_hidden_gemms()

    def _list_hidden_gemms(self) -> None:
        """Ops running GEMMs inside an FX leaf are rounded only at their boundary: say so, once, and list them."""
        hidden = self.graph.unenforced()
        if hidden:
            self.unenforced += list(hidden)
            log.warning("%d op(s) run GEMMs inside FX leaf functions or modules, where the policy cannot round: "
                        "their inputs, weights and outputs are rounded, the values inside them are not (%s: %s)",
                        len(hidden), ", ".join(hidden), "; ".join(sorted(set(hidden.values()))))

    @property
    def promotions(self) -> list[Promotion]:
        """The tensors promoted so far (read after the step's counts were settled)."""
        self.state.flush()
        return self.state.promotions

    @property
    def step_count(self) -> int:
        """Training forwards run so far."""
        return self.state.step

    # -- checkpoints: the training state rides in the ordinary state_dict() as "_extra_state" -------------

    def get_extra_state(self) -> dict[str, Any]:
        """Promotions, step count, rounding counter, loss scaler and the stochastic-update generator, so that
        ``torch.save(model.state_dict())`` and ``load_state_dict`` continue training exactly."""
        return {"tensors": self.state.state_dict(), "scaler": self.scaler.state_dict(),
                "generator": self._generator.get_state()}

    def set_extra_state(self, state: Any) -> None:
        if not isinstance(state, Mapping) or not {"tensors", "scaler", "generator"} <= set(state):
            raise PrecsearchError("checkpoint has no precsearch training state: save model.state_dict() of the "
                                  "PrecisionModel (what apply_policy returned), not of the inner model")
        for slot in self.state.load_state_dict(state["tensors"]):
            for callback in self.state.on_promote:
                callback(slot)
        self.scaler.load_state_dict(state["scaler"])
        self._generator.set_state(state["generator"])

    # -- set-up -------------------------------------------------------------------------------------------

    def _swap_accumulation(self) -> list[str]:
        """Swap the policy's accumulation layers for chunked ones; keep the plain ones for ``unwrap``."""
        if self.policy.accumulation is None:
            return []
        before = dict(self.module.named_modules())
        accumulation = self.policy.accumulation
        names = swap_chunked_layers(self.module, accumulation.layers, accumulation.format, accumulation.chunk)
        self._plain_layers = {name: before[name] for name in names}
        log.info("chunked %s accumulation (CL=%s) in %d layer(s)", self.policy.accumulation.format,
                 self.policy.accumulation.chunk, len(names))
        return names

    def _make_slots(self) -> dict[str, _Slot]:
        slots = {}
        stochastic_update = self.policy.optimizer.get("update") == "stochastic"
        for row, tensor_id in enumerate(self.graph.assignable_ids()):
            info = self.graph.tensors[tensor_id]
            fmt = get_format(self.policy.format_for(info))
            rounding = self.policy.rounding.get(info.kind, "nearest")
            if rounding == "nearest" and self.policy.ties == "away":
                rounding = "nearest_away"
            if info.kind == "weight" and self.policy.master_weights and stochastic_update:
                rounding = "stochastic"  # the master's rounding to the working copy is the weight update
            slots[tensor_id] = _Slot(tensor_id, info.kind, row, fmt, rounding, self.policy.overflow.get(info.kind))
        return slots

    def _make_scaler(self) -> LossScaler:
        options = {key: value for key, value in self.policy.loss_scaling.items() if key != "mode"}
        options = epoch_growth(options, self.steps_per_epoch)
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
            slots = [self.state.slots.get(grad_id(t)) for t in op.input_tensors]
            fmts = [s.fmt for s in slots if s is not None]
            if fmts:
                grad_formats[f"module.{op.name}"] = max(fmts, key=lambda f: f.min_subnormal)
        self._handles += scaler.attach(self, layers=list(grad_formats), grad_formats=grad_formats)
        return scaler

    def _weight_slots(self) -> dict[str, tuple[nn.Parameter, _Slot]]:
        """Qualified parameter name -> (parameter, slot) for the weights whose format is not fp32."""
        params = dict(self.module.named_parameters())
        found = {}
        for slot in self.state.slots.values():
            info = self.graph.tensors[slot.id]
            if slot.kind == "weight" and slot.is_low and info.param in params:
                found[info.param] = (params[info.param], slot)
        return found

    def _round_pure_weights(self) -> None:
        """Without master weights the parameters are the low-precision weights: round them once now. This
        first rounding counts its overflow like any other, so the guard promotes a weight the format cannot
        hold before its values are clipped; values clipped anyway (below the threshold) are reported."""
        if self.policy.master_weights:
            return
        with torch.no_grad():
            rounded = {name: self.state.round(param.detach(), slot)[0] for name, (param, slot) in self._weights.items()}
            self.state.flush()  # settles the counts: promotes at step 0
            clipped = []
            for name, (param, slot) in self._weights.items():
                param.copy_(rounded[name] if not slot.promoted else
                            kernels.quantize(param.detach(), slot.fmt, overflow=slot.overflow_mode))
                if slot.overflowed and not slot.promoted:
                    clipped.append(f"{slot.id} {100 * slot.overflowed / slot.counted:.2g}%")
                slot.reset()
        self.clipped_at_start = clipped
        if clipped:
            log.warning("master_weights=False: rounding the starting weights clipped values past their format's "
                        "range in %d tensor(s) (%s)%s", len(clipped), ", ".join(clipped),
                        "" if self.state.threshold is None else
                        ", each below the promotion threshold; lower it or give these weights a wider format")

    def _hook_weight_grads(self) -> None:
        """Each low weight gradient is rounded as soon as it is accumulated (``_grad_hook``)."""
        params = dict(self.module.named_parameters())
        for slot in self.state.slots.values():
            info = self.graph.tensors[slot.id]
            if slot.kind == "weight_grad" and slot.is_low and info.param in params:
                hook = self._grad_hook(slot)
                self._handles.append(params[info.param].register_post_accumulate_grad_hook(hook))

    def _grad_hook(self, slot: _Slot) -> Callable[[torch.Tensor], None]:
        """Round ``param.grad`` in place and, where its format's codes hold every rounded value (inf and NaN
        too), hold only those until the end of the backward (``_hold_gradient``): the earlier layers' backward
        then runs beside 16 (or 8) bits a value, not 32."""

        def hook(param: torch.Tensor) -> None:
            if not slot.is_low:
                return
            hold = slot.fmt.codes_hold_rounded(slot.args()[2]) and not _distributed()
            codes = self.state.round_(param.grad, slot, with_codes=hold, count=self.state.counting)
            if codes is not None:
                _hold_gradient(param, codes, slot.fmt.name)

        return hook

    def _rounder_for(self, op: Any) -> _Rounder | None:
        """The rounding module for ``op``'s outputs that need rounding, or None."""
        found = {}
        for tensor_id in op.outputs:
            position = int(tensor_id.rsplit(":activation", 1)[1] or 0)
            act = self.state.slots.get(tensor_id)
            grad = self.state.slots.get(grad_id(tensor_id))
            if act is not None and (act.is_low or (grad is not None and grad.is_low)):
                found[position] = (act, grad if grad is not None and grad.is_low else None)
        return _Rounder(self, found, op.name) if found else None

    def _instrument_hooks(self) -> nn.Module:
        """Fallback for untraceable models: forward hooks on the modules the hook tracer recorded, and on the
        modules it did not see (``untraced_modules``), which say so loudly when they run."""
        for name in untraced_modules(self.module, self.graph, CHUNKED_LAYERS):
            self._handles.append(self.module.get_submodule(name).register_forward_hook(self._untraced_hook(name)))
        for op in self.graph.ops:
            rounder = self._rounder_for(op)
            if rounder is None:
                continue
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

    def _untraced_hook(self, name: str) -> Callable[..., None]:
        def hook(module: nn.Module, args: Any, output: Any) -> None:
            if name in self.untraced:
                return
            self.untraced.append(name)
            log.warning("%s (%s) ran but is not in the traced graph (a branch the example input did not take): "
                        "no policy rule covers it, it runs unrounded in fp32 and its memory is not counted; "
                        "trace with a batch that takes this branch: apply_policy(model, policy, example_input=x)",
                        name, type(module).__name__)

        return hook

    def _module_hook(self, base: str) -> Callable[..., Any]:
        def hook(module: nn.Module, args: Any, output: Any) -> Any:
            call = self._calls[base]
            self._calls[base] += 1
            rounder = self._module_rounders[base].get(call)
            return None if rounder is None else rounder(output)

        return hook

    # -- rounding -----------------------------------------------------------------------------------------

    def _promote_in_optimizers(self, slot: _Slot) -> None:
        """Pure low-precision weights: the optimizers must now keep the promoted weight in its new format."""
        if slot.kind != "weight":
            return
        params = [param for param, weight_slot in self._weights.values() if weight_slot is slot]
        for optimizer in self._optimizers:
            held = {id(p) for group in optimizer.param_groups for p in group["params"]}
            for param in params:
                if id(param) in held:
                    optimizer.set_format(param, slot.fmt)

    def _activation(self, t: torch.Tensor, act: _Slot, grad: _Slot | None, in_place: bool = False,
                    grad_in_place: bool = False) -> torch.Tensor:
        grad = grad if grad is not None and grad.is_low and t.requires_grad else None
        if act.is_low:
            in_place = in_place and self._packer.fresh(t)
            rounded, codes = _RoundActivation.apply(t, self.state, act, grad, self._packer.active, in_place,
                                                    grad_in_place)
            self._packer.register(t, rounded, codes, act.fmt, act.kind)
            return rounded
        if grad is not None:
            self._round_grad_of(t, grad)
        return t

    def warn_unsliced(self, layer: nn.Module, why: str) -> None:
        """Once per reason: a layer of a packed tensor runs its backward over the whole tensor, not in slices."""
        if why not in self._warned_unsliced:
            self._warned_unsliced.add(why)
            name = next((n for n, m in self.module.named_modules() if m is layer), type(layer).__name__)
            log.warning("%s %s, so its backward decodes its whole packed tensor at once (one float32 copy of it, "
                        "and the kernel's workspace), not a slice at a time", name, why)

    def _round_grad_of(self, t: torch.Tensor, slot: _Slot) -> None:
        """Round the gradient that reaches ``t`` in backward (counted if this forward is a training one)."""
        count = self.state.counting
        t.register_hook(lambda g: self.state.round(g, slot, count=count)[0])

    def _weights_call_for(self, target: str, names: list[str] | None, low_input: bool,
                          low_output: bool) -> nn.Module | None:
        """For the FX pass: a layer call (``names``: its parameters) or a parameter read (``names`` None) that
        uses low weights, rewritten to use them rounded; a Conv2d or BatchNorm2d call of a low activation
        (``low_input``) rewritten to ``_PackedInputCall``, and a ReLU making one (``low_output``) to
        ``_PackedOutputRelu``; None when none applies."""
        if names is None:
            self._rounded_at_use.add(target)
            return _RoundedWeight(self, target) if target in self._weights else None
        layer = self.module.get_submodule(target)
        if low_output and packed_output_function(layer) is not None:
            return _PackedOutputRelu(self, layer)
        params = {name: f"{target}.{name}" for name in names if f"{target}.{name}" in self._weights}
        self._rounded_at_use.update(params.values())
        function = packed_input_function(layer) if low_input else None
        if function is not None:
            return _PackedInputCall(self, layer, params, function)
        return _RoundedWeightsCall(self, layer, params) if params else None

    def _round_weight(self, qualified: str) -> torch.Tensor:
        """The weight the forward computes with: the parameter rounded to its format now (one round op)."""
        param, slot = self._weights[qualified]
        if not slot.is_low:
            return param
        if slot.rounding == "stochastic":  # a second rounding would draw other values: its saves hold codes
            rounded, codes = _RoundWeight.apply(param, self.state, slot, self._packer.active)
            self._packer.register(param, rounded, codes, slot.fmt, "weight")
        else:
            rounded, _ = _RoundWeight.apply(param, self.state, slot, False)
            self._packer.register_weight(param, rounded, slot, self.state)
        return rounded

    # -- training -----------------------------------------------------------------------------------------

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if torch.compiler.is_compiling():  # under torch.compile: the call below breaks the graph, runs eagerly
            return self._forward_under_compile(*args, **kwargs)
        return self._forward(*args, **kwargs)

    @torch.compiler.disable
    def _forward_under_compile(self, *args: Any, **kwargs: Any) -> Any:
        """The saved-tensor bookkeeping identifies storages by address, which TorchDynamo cannot trace: a
        compiled wrapper of this model runs it eagerly (its rounding kernels are compiled one by one anyway)."""
        if not self._warned_compile:
            self._warned_compile = True
            log.warning("torch.compile of a policy-wrapped model runs it eagerly (its saved-tensor bookkeeping "
                        "cannot be traced; the rounding kernels are compiled one by one already): call the "
                        "wrapped model without torch.compile")
        return self._forward(*args, **kwargs)

    def _forward(self, *args: Any, **kwargs: Any) -> Any:
        training = self.training and torch.is_grad_enabled()
        self.state.flush()  # counts left unread (no scaler.step in the loop): one read, once per step
        if training:
            self.state.step += 1
        self.state.counting = training
        self.state.stats_due = training and bool(self.stats_every) and self.state.step % self.stats_every == 0
        self._calls.clear()
        packing = self._packer.forward() if torch.is_grad_enabled() else contextlib.nullcontext()
        with packing:
            if self._input_rounder is not None and args:
                args = (self._input_rounder(args[0]), *args[1:])
            # weights the FX pass rounds at their use are not here: their float32 copies die with the layer
            weights = {name: self._round_weight(name) for name in self._weights if name not in self._rounded_at_use}
            if not weights:
                return self._target(*args, **kwargs)
            return torch.func.functional_call(self._target, weights, args, kwargs)

    def wrap_optimizer(self, optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
        """The optimizer to step: ``optimizer`` itself with fp32 masters and no optimizer settings, else a
        precsearch.runtime.optim ``LowPrecisionOptimizer`` keeping pure low-precision weights (and rounded state)."""
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
        self.state.flush()
        return {tensor_id: slot.fmt.name for tensor_id, slot in self.state.slots.items()}

    def track_stats(self, every: int | None = 1) -> None:
        """Gather underflow / subnormal / NaN fractions every ``every`` steps (None: only overflow counts)."""
        self.stats_every = every

    def reset_stats(self) -> None:
        self.state.reset()

    def tensor_stats(self, as_frame: bool = False) -> Any:
        """Per tensor id of low precision: kind, format, promoted, calls, and the mean fractions (over the
        values seen since the last reset) of ``overflow`` (also ``max_overflow``, the largest of one step)
        and, with ``stats_every``, ``underflow``, ``subnormal`` and ``nan``. A dict, or a pandas DataFrame."""
        table = self.state.table()
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


def _distributed() -> bool:
    """Whether a process group is up: DDP's reducer reads ``.grad`` in its own hooks during the backward, so
    weight gradients are not held as codes then."""
    return torch.distributed.is_available() and torch.distributed.is_initialized()


def _hold_gradient(param: torch.Tensor, codes: torch.Tensor, fmt: str) -> None:
    """Drop ``param.grad`` (already rounded) for its codes, and set it back, decoded, at the end of the backward:
    the same values, since rounded values are exactly the format's. Inside the backward ``.grad`` is None; a
    backward that raises leaves it None. A later backward accumulates into the restored ``.grad`` as usual."""
    param.grad = None

    def restore() -> None:
        param.grad = ops.decode(codes, fmt, codes.shape, codes.stride(), 0)

    torch.autograd.Variable._execution_engine.queue_callback(restore)


def _is_module(model: nn.Module, op: Any) -> bool:
    """Whether ``op`` is a call of one of the model's submodules (not a function call)."""
    base = op.name.partition("#")[0]
    try:
        module = model.get_submodule(base)
    except AttributeError:
        return False
    return op.module_type in {cls.__name__ for cls in type(module).__mro__}  # a chunked Conv2d is a Conv2d


def apply_policy(model: nn.Module, policy: Policy, example_input: torch.Tensor | None = None, *,
                 strict: bool = True, seed: int = 0, stats_every: int | None = None,
                 steps_per_epoch: int | None = None, rules: OpRules = OP_RULES) -> PrecisionModel:
    """Wrap ``model`` so that it trains under ``policy`` (see the module docstring).

    ``example_input`` (default: zeros of the policy's input shape) is used to trace the model at the
    policy's batch size; a policy made for another graph raises unless ``strict=False``. ``seed`` seeds
    stochastic rounding; ``stats_every`` turns on underflow statistics every n-th step; ``steps_per_epoch``
    resolves a loss scale ``growth_interval`` of ``"epoch"`` (the paper's schedule). The layers of
    ``policy.accumulation`` are swapped in ``model`` itself (``accumulation_layers`` names them). ``rules``:
    the op rules to trace and train with (``precsearch.graph.op_rules``).
    """
    if not isinstance(policy, Policy):
        raise PrecsearchError(f"apply_policy needs a precsearch Policy, got {type(policy).__name__}")
    not_fp32 = sorted({str(p.dtype) for p in model.parameters() if p.dtype != torch.float32})
    if not_fp32:
        raise PrecsearchError(f"model has {', '.join(not_fp32)} parameters; formats are simulated in float32: "
                              "call model.float() first")
    if example_input is None:
        example_input = policy_example_input(policy, model)
    graph = trace(model, example_input, batch_size=policy.batch_size or example_input.shape[0],
                  leaf_modules=CHUNKED_LAYERS, rules=rules)
    verify_policy(policy, graph, strict=strict)
    return PrecisionModel(model, policy, graph, seed=seed, stats_every=stats_every, steps_per_epoch=steps_per_epoch)

