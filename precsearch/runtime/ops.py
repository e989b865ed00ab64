"""The runtime's tensor operations as ``torch.library`` ops: one dispatch each, traceable by ``torch.compile``.

Each op is one call into precsearch.formats.kernels' fused kernels, so a step dispatches one op per rounded or
unpacked tensor, and overflow counts stay on the device: the kernel's pass adds them to ``counts``, an int64
``[overflowed, unencodable]`` per tensor id, read once per step. Defined with ``torch.library.Library`` (its
dispatch measured about 18 us a call on a 2-core CPU, ``custom_op``'s about 95 us), with fake implementations so
``torch.compile`` traces through them. Their autograd formulas are the runtime's autograd Functions
(precsearch.runtime.rounding and .sliced).

* ``precsearch::round(x, counts, fmt, rounding, overflow, seed, with_codes) -> (rounded, codes)``: ``x`` rounded
  to ``fmt``; ``codes`` its bit patterns (empty without ``with_codes``). ``seed`` (int64, advanced in place)
  drives stochastic rounding.
* ``precsearch::round_(...) -> codes``: the same, written over ``x`` in the same pass (weight gradients, and
  activations whose float32 values nothing else reads).
* ``precsearch::decode(codes, fmt, size, stride, offset) -> Tensor``: the float32 values of packed codes,
  viewed with the geometry of the tensor that was saved.

``Codes`` is what the runtime holds of a rounded tensor: its codes and, for a scaled format, its scales.
"""

from __future__ import annotations

import torch

from precsearch.formats import kernels
from precsearch.formats.format import get_format
from precsearch.formats.scaled import ScaledFormat, e8m0_decode, expand_scales

__all__ = ["Codes", "round", "round_", "decode"]

_SEED_STEP = 0x3C6EF35F  # odd: consecutive stochastic roundings see fresh noise from one device counter

_lib = torch.library.Library("precsearch", "DEF")
_lib.define("round(Tensor x, Tensor(a!) counts, str fmt, str rounding, str overflow, Tensor(b!)? seed, "
            "bool with_codes) -> (Tensor, Tensor)")
_lib.define("round_(Tensor(a!) x, Tensor(b!) counts, str fmt, str rounding, str overflow, Tensor(c!)? seed, "
            "bool with_codes) -> Tensor")
_lib.define("decode(Tensor codes, str fmt, SymInt[] size, SymInt[] stride, SymInt offset) -> Tensor")


def _round_and_count(x: torch.Tensor, counts: torch.Tensor, fmt: str, rounding: str, overflow: str,
                     seed: torch.Tensor | None, with_codes: bool, in_place: bool = False):
    if rounding == "stochastic" and seed is not None:
        seed.add_(_SEED_STEP)
    return kernels.round_and_count_fn(fmt, rounding, overflow, with_codes, in_place)(x, seed, counts)[:2]


def _no_codes(x: torch.Tensor, codes: torch.Tensor | None) -> torch.Tensor:
    return x.new_empty(0, dtype=torch.uint8) if codes is None else codes


def _round(x, counts, fmt, rounding, overflow, seed, with_codes):
    rounded, codes = _round_and_count(x, counts, fmt, rounding, overflow, seed, with_codes)
    return rounded, _no_codes(x, codes)


def _round_(x, counts, fmt, rounding, overflow, seed, with_codes):
    _, codes = _round_and_count(x, counts, fmt, rounding, overflow, seed, with_codes, in_place=True)
    return _no_codes(x, codes)


def _decode(codes, fmt, size, stride, offset):
    return kernels.decode(codes, fmt).as_strided(size, stride, offset)


_lib.impl("round", _round, "CompositeExplicitAutograd")
_lib.impl("round_", _round_, "CompositeExplicitAutograd")
_lib.impl("decode", _decode, "CompositeExplicitAutograd")


def _codes_fake(x: torch.Tensor, fmt: str, with_codes: bool) -> torch.Tensor:
    spec = get_format(fmt)
    packed = with_codes and spec.packs
    return x.new_empty(x.shape if packed else (0,), dtype=kernels.storage_dtype(spec) if packed else torch.uint8)


@torch.library.register_fake("precsearch::round", lib=_lib)
def _round_fake(x, counts, fmt, rounding, overflow, seed, with_codes):
    return torch.empty_like(x), _codes_fake(x, fmt, with_codes)


@torch.library.register_fake("precsearch::round_", lib=_lib)
def _round__fake(x, counts, fmt, rounding, overflow, seed, with_codes):
    return _codes_fake(x, fmt, with_codes)


@torch.library.register_fake("precsearch::decode", lib=_lib)
def _decode_fake(codes, fmt, size, stride, offset):
    return codes.new_empty(codes.shape, dtype=torch.float32).as_strided(size, stride, offset)


round = torch.ops.precsearch.round  # noqa: A001 (the op's own name)
round_ = torch.ops.precsearch.round_
decode = torch.ops.precsearch.decode


class Codes:
    """A rounded tensor as the runtime holds it: the codes of its format (``fmt``, a scaled format's element) and,
    for a scaled format (``scaled``), its scales as e8m0 bytes (precsearch.formats.scaled), which decoding
    multiplies back in."""

    __slots__ = ("codes", "fmt", "scaled", "scales")

    def __init__(self, codes: torch.Tensor, fmt: str, scaled: ScaledFormat | None = None,
                 scales: torch.Tensor | None = None) -> None:
        self.codes, self.fmt, self.scaled, self.scales = codes, fmt, scaled, scales

    @property
    def nbytes(self) -> int:
        return self.codes.nbytes + (0 if self.scales is None else self.scales.nbytes)

    def view(self, size: torch.Size, stride: tuple[int, ...], offset: int) -> torch.Tensor:
        """The values, decoded into a new tensor, viewed with the geometry of the tensor that was saved."""
        if self.scaled is None:
            return decode(self.codes, self.fmt, size, stride, offset)
        return self._scaled(self.codes, self.scales).as_strided(size, stride, offset)

    def whole(self) -> torch.Tensor:
        """All the values, decoded into a new contiguous tensor."""
        return self.view(self.codes.shape, self.codes.stride(), 0)

    def part(self, dim: int, start: int, length: int) -> torch.Tensor:
        """A slice along ``dim``, decoded (its codes copied first). A scaled tensor's scales follow a slice of
        rows (``dim`` 0) or of a tensor with one scale; other slices of a row- or block-scaled tensor decode
        the whole tensor first."""
        scaled = self.scaled
        if scaled is not None and dim != 0 and scaled.granularity != "tensor":
            return self.whole().narrow(dim, start, length).contiguous()
        codes = self.codes.narrow(dim, start, length).contiguous()
        if scaled is None:
            return decode(codes, self.fmt, codes.shape, codes.stride(), 0)
        scales = self.scales if scaled.granularity == "tensor" else self.scales.narrow(0, start, length)
        return self._scaled(codes, scales)

    def _scaled(self, codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
        values = decode(codes, self.fmt, codes.shape, codes.stride(), 0)
        return values * expand_scales(e8m0_decode(scales), self.scaled, codes.shape)
