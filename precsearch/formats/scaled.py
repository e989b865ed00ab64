"""Scaled formats: an element format whose values are stored with a power-of-two scale per tensor, row or block.

How current GPUs train in 8 bits: torchao's float8 "tensorwise" and "rowwise" recipes, Transformer Engine's
delayed scaling, OCP's MX formats (Microscaling v1.0: one e8m0 exponent per 32 elements). A value ``v`` of a group
with scale ``s`` is stored as ``q = round(v / s)`` in the element format and means ``q * s``.

Grammar (``SCALED_GRAMMAR``): ``<element>@<granularity>[:<recipe>]``.

* ``e4m3fn@tensor``: one scale per tensor, from this tensor's amax (current scaling).
* ``e4m3fn@tensor:delayed16``: from the largest amax of the last 16 calls (Transformer Engine's delayed scaling:
  no pass over the tensor before the cast); this call's amax is recorded after use, in an ``AmaxHistory`` the
  caller keeps (and checkpoints).
* ``e4m3fn@row``: one scale per row of the 2-D view ``x.reshape(x.shape[0], -1)`` (per output channel of a
  weight); a tensor of fewer than 2 dimensions is one row.
* ``e2m1fn@block32``: MX, one scale per block of 32 consecutive elements along each row of that view (a row whose
  length is no multiple of 32 ends in a shorter block).

The element is any ``get_format`` name, except that the OCP MX names ``e2m3fn``, ``e3m2fn`` and ``e2m1fn`` mean
OCP's fp6/fp4 (every code finite, fp4's max 6), not the grammar's fn family (a NaN code). The grammar part is
plain Python (torch is imported only where a tensor is rounded), so configuration code checks names without torch.

Scale rule. Every scale is a power of two ``2**k``, ``-127 <= k <= 127`` (an e8m0 byte): MX mandates it, torchao
offers it (``round_scales_to_power_of_2``), and then ``x / s`` and ``q * s`` are exact (for elements of up to 8
bits; wider ones may round among float32's subnormals), so scaled rounding is exactly the element's rounding of
the shifted value, stored as its codes plus one byte per scale. (A rounded value past float32's max, for an amax
within a step of it, is inf.)

* tensor and row: ``k = ceil(log2(amax / max))``, the smallest scale with ``amax / s <= max``, so current
  scaling never overflows; a stale delayed scale can.
* block (OCP MX v1.0's conversion): ``k = floor(log2(amax)) - emax`` (emax: exponent of the element's largest normal),
  which keeps the block's largest binade whole but may put ``amax / s`` past max (up to 2**(emax+1)).
* ``k`` is clamped to [-127, 127]; an amax of 0 (all zeros) gives ``k = 0`` (scale 1) and zeros.

Values that round past the element's max after scaling saturate to +-max (for every element, e5m2 too: OCP
MX clamps, torchao clamps before its cast, Transformer Engine casts with satfinite) and are counted.

Non-finite inputs stay non-finite, so that a loss scaler still sees them. tensor and row: the amax is taken
over finite values; NaN stays NaN; inf stays inf where the element has inf (e5m2) and becomes NaN where it has
none (even fp6/fp4, which have no NaN code either; torch 2.13's float8_e4m3fn cast would give +-448). block: as OCP
MX and its reference code, a block holding inf or NaN gets the NaN scale (e8m0 0xFF) and all its values are
NaN. Inputs that are inf are not counted as overflows (unlike ``round_and_count``): they are not saturated.
"""

from __future__ import annotations

import functools
import math
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from precsearch.errors import PrecsearchError, clip, echo
from precsearch.formats.format import FloatFormat, get_format, parsed, spec_name

if TYPE_CHECKING:
    import torch

__all__ = ["GRANULARITIES", "MAX_BLOCK", "MAX_HISTORY", "SCALED_GRAMMAR", "AmaxHistory", "ScaledFormat", "any_format",
           "e8m0_decode", "e8m0_encode", "expand_scales", "format_name", "get_scaled_format", "is_scaled",
           "power_of_two_scales", "quantize_scaled", "recorded", "scale_bytes", "scaled_values"]

GRANULARITIES: tuple[str, ...] = ("tensor", "row", "block")

# OCP MX's element names: its fp6/fp4 have no NaN code (the grammar's "fn" suffix would reserve one)
_OCP_ELEMENTS = {"e2m3fn": "fp6_e2m3fn", "e3m2fn": "fp6_e3m2fn", "e2m1fn": "fp4_e2m1fn"}
_SCALE_EXPONENTS = 127  # e8m0 holds 2**-127 .. 2**127 (0xFF is its NaN)
_AMAX_BYTES = 4  # a delayed history's amaxes are float32
# Bounds of a spec's numbers, checked as it is parsed, before anything is allocated for it: a row pads its last block
# to the block size (MX uses 32), and a delayed history keeps that many amaxes per tensor (Transformer Engine: 1024).
MAX_BLOCK = 4096
MAX_HISTORY = 1024
SCALED_GRAMMAR = (f"<element>@tensor[:delayed<N>], <element>@row or <element>@block<N>, 1 <= N <= {MAX_BLOCK} for a "
                  f"block and {MAX_HISTORY} for a history (e.g. e4m3fn@tensor, e4m3fn@tensor:delayed16, e5m2@row, "
                  "e2m1fn@block32)")


@dataclass(frozen=True)
class ScaledFormat:
    """An ``element`` format with a power-of-two scale per tensor, row or ``block`` elements; ``history`` > 0:
    a tensor's scale comes from the amaxes of its last ``history`` roundings (delayed scaling)."""

    element: FloatFormat
    granularity: str
    history: int = 0
    block: int = 0

    def __post_init__(self) -> None:
        if self.granularity not in GRANULARITIES:
            raise PrecsearchError(f"scale granularity {self.granularity!r}: use one of {', '.join(GRANULARITIES)}")
        if (self.block > 0) != (self.granularity == "block") or self.block < 0:
            raise PrecsearchError(f"scaled format {self.name}: a block size >= 1 goes with block scaling only "
                                  f"({SCALED_GRAMMAR})")
        if self.history < 0 or (self.history and self.granularity != "tensor"):
            raise PrecsearchError(f"scaled format {self.name}: delayed scaling keeps one amax history per tensor; "
                                  f"use @tensor:delayed<N> with N >= 1")
        _check_bound(self.name, str(self.block) if self.block else None, MAX_BLOCK, "a block of", "@block<N>")
        _check_bound(self.name, str(self.history) if self.history else None, MAX_HISTORY, "a delayed history of",
                     ":delayed<N>")

    @property
    def name(self) -> str:
        block = str(self.block) if self.block else ""
        return f"{self.element.name}@{self.granularity}{block}" + (f":delayed{self.history}" if self.history else "")

    def __str__(self) -> str:
        return self.name

    def rows_columns(self, shape: Sequence[int]) -> tuple[int, int]:
        """(rows, columns) of the 2-D view a tensor of ``shape`` is scaled in: ``x.reshape(shape[0], -1)``, or one
        row for tensor scaling and tensors of fewer than 2 dimensions."""
        if self.granularity == "tensor" or len(shape) < 2:
            return 1, math.prod(shape)
        return shape[0], math.prod(shape[1:])

    def scales_shape(self, shape: Sequence[int]) -> tuple[int, ...]:
        """Shape of the scales of a tensor of ``shape``: () per tensor, (rows,) per row, (rows, blocks) per block."""
        if self.granularity == "tensor":
            return ()
        rows, cols = self.rows_columns(shape)
        return (rows,) if self.granularity == "row" else (rows, -(-cols // self.block))


_SCALED_RE = re.compile(r"([^@]+)@(tensor|row|block([1-9]\d*))(?::delayed([1-9]\d*))?")


@functools.lru_cache(maxsize=256)
def _parse(spec: str) -> ScaledFormat:
    match = _SCALED_RE.fullmatch(spec.strip().lower())
    if not match:
        raise PrecsearchError(f"unknown scaled format {echo(spec)}: use {SCALED_GRAMMAR}")
    element, granularity, block, history = match[1], match[2], match[3], match[4]
    _check_bound(spec, block, MAX_BLOCK, "a block of", "@block<N>")
    _check_bound(spec, history, MAX_HISTORY, "a delayed history of", ":delayed<N>")
    try:
        fmt = get_format(_OCP_ELEMENTS.get(element, element))
    except PrecsearchError as error:
        raise PrecsearchError(f"scaled format {echo(spec)}: {error}") from None
    return ScaledFormat(fmt, "block" if block else granularity, int(history or 0), int(block or 0))


def _check_bound(spec: str, digits: str | None, bound: int, what: str, grammar: str) -> None:
    """Refuse a spec number over ``bound`` by its digits, before Python or torch is asked to hold it."""
    if digits is not None and (len(digits) > len(str(bound)) or int(digits) > bound):
        raise PrecsearchError(f"scaled format {echo(spec.strip())}: {what} {clip(digits, 20)} is over the limit of "
                              f"{bound}; give {grammar} with 1 <= N <= {bound}")


def get_scaled_format(spec: str | ScaledFormat) -> ScaledFormat:
    """A ``ScaledFormat`` from a spec string (``e4m3fn@tensor:delayed16``) or a ``ScaledFormat``."""
    return parsed(spec, ScaledFormat, _parse, "scaled format must be a spec string or a ScaledFormat")


def is_scaled(spec: object) -> bool:
    """Whether ``spec`` names a scaled format (a ``ScaledFormat``, or a string with ``@``), not a plain one."""
    return isinstance(spec, ScaledFormat) or (isinstance(spec, str) and "@" in spec)


def any_format(spec: str | FloatFormat | ScaledFormat) -> FloatFormat | ScaledFormat:
    """The ``ScaledFormat`` or ``FloatFormat`` a spec names (config code reads both kinds of names)."""
    return get_scaled_format(spec) if is_scaled(spec) else get_format(spec)


def format_name(value: object, where: str, scaled: bool = True) -> str:
    """``spec_name`` for places that also take scaled formats (``scaled=False``: a place that does not, with an
    error that says so); errors start with ``where`` and name both grammars."""
    if not is_scaled(value):
        try:
            return spec_name(value, where)
        except PrecsearchError as error:
            raise PrecsearchError(f"{error}; or a scaled format {SCALED_GRAMMAR}" if scaled else str(error)) from None
    if not scaled:
        raise PrecsearchError(f"{where}: {value} is a scaled format, which this setting does not take; give an "
                              "unscaled one such as bf16 or e6m9s")
    if isinstance(value, ScaledFormat):
        return value.name
    spec = str(value)  # a string with "@" (is_scaled)
    try:
        get_scaled_format(spec)
    except PrecsearchError as error:
        raise PrecsearchError(f"{where}: {error}") from None
    return spec.strip().lower()


def scale_bytes(spec: str | ScaledFormat, shape: Sequence[int]) -> int:
    """Bytes of the scales of a tensor of ``shape``: one e8m0 byte per scale, plus a delayed history's amaxes."""
    fmt = get_scaled_format(spec)
    return math.prod(fmt.scales_shape(shape)) + _AMAX_BYTES * fmt.history


# ------------------------------------------------------------------------------------------------ rounding


class AmaxHistory:
    """The amaxes of a tensor's last ``length`` roundings, newest first, for delayed scaling (zeros until
    filled: amax 0 gives scale 1, Transformer Engine's initial scale). It moves to the device of the amaxes
    it records."""

    def __init__(self, length: int, device: torch.device | str | None = None):
        import torch

        if length < 1:
            raise PrecsearchError(f"amax history length {length}: use at least 1")
        self.amaxes = torch.zeros(length, dtype=torch.float32, device=device)

    def update(self, amax: torch.Tensor) -> None:
        """Record ``amax`` (a 0-d tensor) as the newest, dropping the oldest."""
        self.amaxes = recorded(self.amaxes.to(amax.device), amax)

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {"amaxes": self.amaxes.clone()}

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        amaxes = state["amaxes"]
        if amaxes.shape != self.amaxes.shape:
            raise PrecsearchError(f"amax history of length {self.amaxes.numel()} cannot load one of length "
                                  f"{amaxes.numel()}: use the delayed<N> it was saved with")
        self.amaxes = amaxes.to(self.amaxes, copy=True)


def recorded(amaxes: torch.Tensor, amax: torch.Tensor) -> torch.Tensor:
    """A history's ``amaxes`` with ``amax`` recorded as the newest and the oldest dropped, as a new tensor: what
    ``AmaxHistory.update`` keeps, and what the compiled step passes out of its graph (no state written there)."""
    import torch

    return torch.cat([amax.reshape(1), amaxes[:-1]])


def power_of_two_scales(amax: torch.Tensor, fmt: ScaledFormat) -> torch.Tensor:
    """The power-of-two scales (float32, exact) of groups with largest magnitude ``amax`` (module docstring).

    ``frexp`` gives ``floor(log2(amax))`` exactly; the tensor rule adds 1 unless ``amax`` fits ``max`` at that
    exponent, a comparison of significands. A non-finite ``amax`` (a block with inf/NaN) gives a NaN scale."""
    import torch

    element = fmt.element
    significand, exponent = torch.frexp(amax)  # amax = significand * 2**exponent, 0.5 <= significand < 1
    k = exponent - 1 - element.emax
    if fmt.granularity != "block":
        k = k + (2 * significand > element.max / 2.0**element.emax).to(k.dtype)
    k = torch.where(amax > 0, k, 0).clamp(-_SCALE_EXPONENTS, _SCALE_EXPONENTS)
    # float32 bits of 2**k: the exponent field, or for 2**-127 (a subnormal) the top mantissa bit
    powers = torch.where(k > -127, (k + 127) << 23, 1 << 22).view(torch.float32)
    return torch.where(amax.isfinite(), powers, math.nan)


def e8m0_encode(scales: torch.Tensor) -> torch.Tensor:
    """``quantize_scaled``'s scales as the e8m0 bytes that store them: ``k + 127`` for ``2**k``, 0xFF for NaN."""
    import torch

    exponent = torch.frexp(scales)[1] - 1  # exact for every power of two, 2**-127 (a subnormal) too
    return torch.where(scales.isnan(), 255, exponent + _SCALE_EXPONENTS).to(torch.uint8)


def e8m0_decode(codes: torch.Tensor) -> torch.Tensor:
    """The float32 scales of e8m0 bytes (``e8m0_encode``'s inverse)."""
    import torch

    powers = torch.ldexp(torch.ones_like(codes, dtype=torch.float32), codes.to(torch.int32) - _SCALE_EXPONENTS)
    return torch.where(codes == 255, math.nan, powers)


def expand_scales(scales: torch.Tensor, spec: str | ScaledFormat, shape: Sequence[int]) -> torch.Tensor:
    """``scales`` (shaped by ``ScaledFormat.scales_shape(shape)``) as a tensor that broadcasts over a tensor of
    ``shape``, each value's own scale: what turns stored codes back into values."""
    fmt = get_scaled_format(spec)
    if fmt.granularity == "tensor":
        return scales
    rows, cols = fmt.rows_columns(shape)
    if fmt.granularity == "row":
        return scales.reshape(rows, *[1] * (len(shape) - 1)) if len(shape) >= 2 else scales.reshape(())
    return scales.repeat_interleave(fmt.block, dim=1)[:, :cols].reshape(shape)


def scaled_values(x: torch.Tensor, fmt: ScaledFormat, history: torch.Tensor | None = None,
                  in_place: bool = False) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``x`` divided by its scales, shaped as ``x`` (exact; inf turned NaN where the element has no inf): a new
    float32 tensor, or with ``in_place`` ``x`` itself where contiguous and unpadded; the scales and the groups'
    amaxes (both ``scales_shape``). A group's amax is over its finite values (a block's over all, so inf or NaN
    gives the NaN scale); a delayed ``history``'s largest amax gives the scale, and the caller records this amax
    (``recorded``): the history is never written here. One float32 temporary (the magnitudes), freed before the
    result is made, so the eager peak is the rounding's own; pure torch ops, so the compiled step traces it."""
    import torch
    import torch.nn.functional as F

    rows, cols = fmt.rows_columns(x.shape)
    length = fmt.block or cols
    padded = cols % length != 0  # a row's last block, padded with zeros
    groups = x.reshape(rows, cols)
    if padded:
        groups = F.pad(groups, (0, length - cols % length))
    groups = groups.reshape(rows, -1, length)
    magnitude = groups.abs()
    if not fmt.block:
        magnitude = magnitude.nan_to_num_(nan=0.0, posinf=0.0)
    amax = magnitude.amax(-1, keepdim=True)
    del magnitude
    scales = power_of_two_scales(amax if history is None else history.max().to(amax.device), fmt)
    infinite = None if fmt.element.has_inf else groups.isinf()  # (read before x may be divided in place)
    scaled = groups.div_(scales) if in_place and x.is_contiguous() and not padded else groups / scales
    if infinite is not None:
        scaled.masked_fill_(infinite, math.nan)
    scaled = torch.ops.aten._unsafe_view.default(scaled.reshape(rows, -1)[:, :cols].contiguous(), x.shape)
    shape = fmt.scales_shape(x.shape)
    return scaled, scales.reshape(shape), amax.reshape(shape)


def quantize_scaled(x: torch.Tensor, spec: str | ScaledFormat, rounding: str = "nearest",
                    history: AmaxHistory | None = None, generator: torch.Generator | None = None
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``x`` rounded to ``spec`` (float32, shaped as ``x``), its scales (float32 powers of two, shaped by
    ``ScaledFormat.scales_shape``) and how many finite values rounded past the element's max after scaling and
    were saturated (an int64 0-d tensor on ``x``'s device: no host synchronisation). ``history`` is required by a
    delayed spec (an ``AmaxHistory`` of its length, which this call updates) and refused by the others."""
    import torch

    from precsearch.formats.kernels import _check_tensor, overflow_threshold, quantize

    fmt = get_scaled_format(spec)
    if fmt.history and (history is None or history.amaxes.numel() != fmt.history):
        raise PrecsearchError(f"scaled format {fmt.name}: delayed scaling needs history=AmaxHistory({fmt.history}), "
                              "one kept per tensor across calls")
    if not fmt.history and history is not None:
        raise PrecsearchError(f"scaled format {fmt.name}: current scaling takes no history; drop it or use "
                              f"{fmt.name}:delayed<N>")
    x = _check_tensor(x)
    threshold = overflow_threshold(fmt.element, rounding)  # checks the rounding before the history changes
    if x.numel() == 0:  # no amax to take
        return x, x.new_ones(fmt.scales_shape(x.shape)), x.new_zeros((), dtype=torch.int64)
    scaled, scales, amax = scaled_values(x, fmt, None if history is None else history.amaxes)
    if history is not None:
        history.update(amax)
    overflowed = ((scaled.abs() >= threshold) & x.isfinite()).sum()
    rounded = quantize(scaled, fmt.element, rounding, "saturate", generator) * expand_scales(scales, fmt, x.shape)
    return rounded, scales, overflowed
