"""Saved-tensor packing: tensors autograd saves for backward are held as the codes of their format.

``Packer.forward()`` is the ``saved_tensors_hooks`` context of one forward. A rounding registers its result and
codes (``register``; the round op makes the codes in the same pass; a scaled format's come with its e8m0 scales,
``ops.Codes``); saves of that storage are then held as its codes, once per storage, however many ops save it. An
op that saved its own output before the rounding ran (ReLU saves its result) is switched to the rounded codes too,
as low-precision hardware would store them. A weight rounded to nearest is saved as its fp32 master and rounded
again in the backward (``register_weight``). ``last`` reports what the last forward kept (``SavedBytes``).
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
from torch import nn
from torch.multiprocessing.reductions import StorageWeakRef

from precsearch.errors import PrecsearchError
from precsearch.runtime import ops
from precsearch.runtime.state import Slot, TensorState

__all__ = ["Packer", "SavedBytes", "Stored", "batch_passes"]


@dataclass
class SavedBytes:
    """Bytes autograd held for backward after one forward, by what they are (each storage counted once)."""

    activation: int = 0  # activations as stored: packed codes, or float32 where unrounded
    weight: int = 0  # codes of weights rounded stochastically or scaled (the others are rounded again in the backward)
    parameter: int = 0  # parameters saved as they are (fp32 weights)
    other: int = 0  # byproducts: buffers (BN running stats), non-float32 tensors (max-pool indices)

    @property
    def total(self) -> int:
        return self.activation + self.weight + self.parameter + self.other


class _Packed:
    """One storage's values as codes of a format, shared by every saved view of it.

    It refers to the storage weakly, at the C++ level: a rounded tensor's Python object may die while views
    keep its storage alive, and a dead storage's address may be reused by an unrelated tensor.
    """

    __slots__ = ("kind", "version", "storage", "shape", "codes", "saves", "unpacks", "decoded")

    def __init__(self, kind: str, rounded: torch.Tensor, codes: ops.Codes | None) -> None:
        self.kind, self.version, self.shape, self.codes = kind, rounded._version, rounded.shape, codes
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
        return self.codes.whole()

    def _view(self, geometry: tuple[torch.Size, tuple[int, ...], int]) -> torch.Tensor:
        """A view of the storage, decoded into a new tensor."""
        return self.codes.view(*geometry)

    def _part(self, dim: int, start: int, length: int) -> torch.Tensor:
        """A slice of the storage (a contiguous tensor) along ``dim``, decoded (its codes copied first)."""
        return self.codes.part(dim, start, length)

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
        return batch_passes(self.slicer(), self.shape[0], rows)


def batch_passes(decode: Callable[[int, int], torch.Tensor], batch: int,
                 rows: int) -> Callable[[], Iterator[tuple[int, torch.Tensor]]]:
    """Passes over a batch of ``batch`` samples, ``rows`` at a time, each slice decoded (``decode(start, length)``)
    when reached and yielded with its first sample: what a sliced backward reads (precsearch.runtime.sliced)."""

    def one_pass() -> Iterator[tuple[int, torch.Tensor]]:
        for start in range(0, batch, rows):
            yield start, decode(start, min(rows, batch - start))

    return one_pass


class _RoundedFromMaster(_Packed):
    """A weight rounded from its fp32 master, saved as that master and the rounding: its backward rounds the
    master again, which gives the same values (nearest rounding is a function of the value, and the master is
    checked unchanged, as autograd checks what it saves), so the step holds no copy of any weight, neither
    codes nor float32, between a layer's forward and its backward (as torchao's float8 training can recompute
    its fp8 weights in the backward). A stochastic rounding draws anew each call, and a scaled one of a slice
    takes another amax: such weights keep codes (``Slot.rounds_alike_again``)."""

    __slots__ = ("master", "master_version", "state", "args")

    def __init__(self, slot: Slot, rounded: torch.Tensor, master: torch.Tensor, state: TensorState) -> None:
        super().__init__("weight", rounded, None)
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
        return self.state.round_again(self._master().narrow(dim, start, length).contiguous(), self.args, in_place=True)


class Stored:
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
        self.stored: list[Stored] = []


def _storage(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


def version_of(t: torch.Tensor) -> int | None:
    """``t``'s version counter (None for an inference tensor, which has none, and which nothing saves)."""
    return None if t.is_inference() else t._version


def _whole_storage(t: torch.Tensor) -> bool:
    """Whether ``t`` is its storage, laid out contiguously from offset 0 (so its codes map 1:1)."""
    return (t.is_contiguous() and t.storage_offset() == 0
            and t.untyped_storage().nbytes() == t.numel() * t.element_size())


class Packer:
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
            with torch.autograd.graph.saved_tensors_hooks(self.pack, Stored.unpack):
                yield
        finally:
            self.active = False
            self.last = self._measure()
            self._live, self._pending, self._all_pending, self._plain = {}, {}, [], {}

    def register(self, raw: torch.Tensor, rounded: torch.Tensor, codes: ops.Codes | None, kind: str,
                 raw_version: int | None) -> None:
        """``codes`` hold the values of ``rounded``: saves of it are packed, and earlier saves of ``raw`` as it was
        before the rounding (``raw_version``; a rounding over it moves it on) switch to it."""
        if not self.active or codes is None:
            return
        packed = self._hold(rounded, _Packed(kind, rounded, codes))
        pending = self._pending.get(_storage(raw))
        if pending is not None and pending.version == raw_version and _whole_storage(raw):
            del self._pending[_storage(raw)]
            for stored in pending.stored:
                stored.attach(packed, self._codes)

    def register_weight(self, master: torch.Tensor, rounded: torch.Tensor, slot: Slot, state: TensorState) -> None:
        """``rounded`` is ``master`` rounded by ``slot`` (``rounds_alike_again``): saves of it hold the master, and
        the backward rounds it again (``_RoundedFromMaster``)."""
        if self.active:
            self._hold(rounded, _RoundedFromMaster(slot, rounded, master, state))

    def _hold(self, rounded: torch.Tensor, packed: _Packed) -> _Packed:
        """Saves of ``rounded`` become saves of ``packed`` until ``rounded`` dies (then nobody saved it)."""
        self._live[_storage(rounded)] = packed
        weakref.finalize(rounded, self._forget, _storage(rounded), id(packed))
        return packed

    def fresh(self, t: torch.Tensor, makes_codes: bool) -> bool:
        """Whether the rounding may write over ``t`` in this (training) forward: an op's own new output, no
        view, that is no parameter, buffer or tensor rounded before, and that nothing saved, or (``makes_codes``:
        the rounding registers its codes) whose saves so far are of ``t`` as it is, which then switch to those
        codes (``register``): the raw values have no reader left."""
        if not self.active or t.grad_fn is None or t._base is not None or not _whole_storage(t):
            return False
        ptr = _storage(t)
        pending = self._pending.get(ptr)
        return (not (ptr in self._live or ptr in self._params or ptr in self._buffers)
                and (pending is None or (makes_codes and pending.version == t._version)))

    def save_packed(self, t: torch.Tensor) -> Stored | None:
        """A save of ``t`` held as the codes of its storage, when ``t`` is a whole packed storage in the batch's
        contiguous layout (so that its codes slice by sample); else None."""
        packed = self._live.get(_storage(t)) if self.active else None
        if packed is None or not packed.holds(t) or not _whole_storage(t) or t.shape != packed.shape:
            return None
        stored = Stored(t)
        stored.attach(packed, self._codes)
        return stored

    def _forget(self, ptr: int, ident: int) -> None:
        if self.active and id(self._live.get(ptr)) == ident:
            del self._live[ptr]

    def alias(self, t: torch.Tensor, slot: Slot, state: TensorState) -> None:
        """``t`` is a fresh copy of rounded values (a layout op's output): pack its saves in the slot's format
        too (its overflow was counted where it was rounded). Not for a format without codes (nothing to pack), nor
        for a scaled one: its scales, taken again over the copy's rows or blocks, need not give back the same
        values; the copy is saved as float32."""
        if (not self.active or not slot.holds_codes or slot.scaled is not None or t.dtype != torch.float32
                or not _whole_storage(t)):
            return
        known = self._live.get(_storage(t))
        if known is None or known.storage.expired():  # a view of a known storage is no copy
            with torch.no_grad():  # no graph: its saves would be held to the forward's end
                _, codes = state.round(t, slot, with_codes=True, count=False)
            self.register(t, t, codes, slot.kind, version_of(t))

    def pack(self, t: torch.Tensor) -> Stored:
        stored = Stored(t)
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

