"""Rounding with the format as data: one traceable function serves every format, rounding and overflow mode.

precsearch.formats.kernels bakes each format's constants into a kernel of its own, so ``torch.compile`` of a
model that calls them specializes on every assignment (a search of 40 trials would compile 40 times). Here a
format, its rounding and its overflow mode are one small int32 tensor (``format_row``) and ``round_with``
computes, from it, bit for bit what ``kernels.round_and_count`` computes (values and overflow count), in plain
torch ops that Inductor fuses into the neighbouring kernels: a compiled graph taking the rows as inputs serves
every assignment. fp32 is a row too (``round_with`` then returns the values unchanged and counts nothing), so an
assignment may move a tensor between fp32 and a low format without a new graph.

``RoundWithGradient`` rounds a tensor and, in the backward, its gradient, each by its own row: the autograd
step of a compiled runtime. Overflow counts leave a compiled graph as tensors, not by writes to a counter: the
value's as an output, the gradient's as the gradient of a float64 leaf (``counter``), which autograd sums
across the step like any gradient.

Its cost against a kernel of one format: every call computes the stochastic rounding's hash, whatever its row
says (a selection, not a branch, picks the row's rounding).

``encode_codes`` and ``decode_codes`` turn rounded values into the format's bit patterns and back, the format
again a row (the encode with bit views, for a compiled pass over a flat tensor; the decode in float arithmetic,
which Inductor fuses into a graph's kernels), the code's width (``code_bytes``: one uint8 plane up to 8 bits,
two up to 16) a constant of the graph (16-bit patterns as two byte planes, not int16: Inductor's CPU code
converts int16 element by element): a compiled step that passes each rounded value through its codes gives
AOTAutograd's partitioner a tensor of the format's width to save for the backward, where it decodes it again.
"""

from __future__ import annotations

import functools
from typing import Any

import torch

from precsearch.formats.format import FloatFormat, get_format
from precsearch.formats.kernels import _check_modes, _float_bits, _hash_bits, overflow_threshold

__all__ = ["RoundWithGradient", "code_bytes", "decode_codes", "encode_codes", "format_row", "nearest_in_floats",
           "round_nearest", "round_with"]

_NEAREST, _AWAY, _STOCHASTIC = 0, 1, 2
_MODES = {"nearest": _NEAREST, "nearest_away": _AWAY, "stochastic": _STOCHASTIC}
# the row's fields, in order
(_DROP, _MASK, _MIN_NORMAL_BITS, _SHIFT_BASE, _SCALE_LOW, _SCALE_HIGH, _MAX_BITS, _ON_OVERFLOW, _KEEP_FROM,
 _MODE, _OVER_BITS, _TIE, _SUB_MAGIC, _SPLITTER, _BIG, _BITS, _MAN, _EMIN, _SPECIAL) = range(19)
_SPECIAL_CODES = {"none": 0, "fn": 1, "ieee": 2}
_SCALE_DOWN, _SCALE_UP = 2.0**-64, 2.0**64  # Veltkamp's split of the largest values, done 2**64 smaller
_INF_BITS = 0x7F800000


@functools.lru_cache(maxsize=256)
def _row_values(fmt: FloatFormat, rounding: str, overflow: str) -> tuple[int, ...]:
    if fmt.is_fp32:  # every value is kept (``_KEEP_FROM`` 0) and none counts as an overflow
        return (0, 0, 0, 1, _float_bits(1.0), _float_bits(1.0), _INF_BITS, _INF_BITS, 0, _NEAREST, _INF_BITS + 1,
                0, _float_bits(1.0), _float_bits(1.0), _INF_BITS, 32, 23, -126, _SPECIAL_CODES["ieee"])
    drop = 23 - fmt.man
    exponent = fmt.emin - fmt.man  # of the min subnormal: quanta times 2 ** exponent, in two exact products
    low = exponent // 2
    return (drop, (1 << drop) - 1, (fmt.emin + 127) << 23, drop + fmt.emin + 127, _float_bits(2.0**low),
            _float_bits(2.0 ** (exponent - low)), _float_bits(fmt.max),
            {"saturate": _float_bits(fmt.max), "inf": _INF_BITS, "nan": 0x7FC00000}[overflow],
            _INF_BITS if fmt.has_inf else _INF_BITS + 1, _MODES[rounding],
            _float_bits(overflow_threshold(fmt, rounding)), int(drop > 0), _float_bits(2.0 ** (exponent + 23)),
            _float_bits(2.0**drop + 1), _float_bits(2.0 ** (127 - drop)), fmt.bits, fmt.man, fmt.emin,
            _SPECIAL_CODES[fmt.special])


def format_row(fmt: str | FloatFormat, rounding: str = "nearest", overflow: str | None = None,
               device: torch.device | str = "cpu") -> torch.Tensor:
    """The int32 tensor that tells ``round_with`` how to round: ``fmt``, ``rounding`` and ``overflow`` (the
    format's default when None) as data."""
    fmt = get_format(fmt)
    overflow = overflow or fmt.default_overflow
    _check_modes(rounding, overflow)
    return torch.tensor(_row_values(fmt, rounding, overflow), dtype=torch.int32, device=device)


def nearest_in_floats(fmt: str | FloatFormat) -> bool:
    """Whether ``round_nearest`` serves ``fmt``: a format with a mantissa bit (or fp32)."""
    fmt = get_format(fmt)
    return fmt.is_fp32 or fmt.man > 0


def round_with(x: torch.Tensor, row: torch.Tensor, seed: torch.Tensor,
               rounding: str | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``x`` (float32) rounded as ``row`` says, and how many of its values overflow (int64, NaN excluded): the
    values and count of ``kernels.round_and_count`` with the same format, rounding, overflow and ``seed`` (an
    int64 tensor; the hash of stochastic rounding reads it, the caller advances it). ``rounding`` given (it
    must be the row's) makes the rounding a constant of the graph: only its own arithmetic is computed, no
    hash for nearest rounding."""
    bits = x.view(torch.int32)
    sign = bits & ~0x7FFFFFFF
    mag = bits & 0x7FFFFFFF
    drop, mask, mode = row[_DROP], row[_MASK], row[_MODE]
    noise = None
    if rounding in (None, "stochastic"):
        index = torch.arange(x.numel(), device=x.device, dtype=torch.int64).view(x.shape)
        noise = _hash_bits(index, seed).to(torch.int32)

    def pick(stochastic: Any, away: Any, to_even: Any) -> Any:
        """The increment of the row's rounding: a selection on the row, or the constant ``rounding``'s own."""
        if rounding is not None:
            return {"stochastic": stochastic, "nearest_away": away, "nearest": to_even}[rounding]()
        return torch.where(mode == _STOCHASTIC, stochastic(), torch.where(mode == _AWAY, away(), to_even()))

    # normal range: add an increment, drop the low bits (a carry into the exponent is the correct rounding up)
    increment = pick(lambda: noise & mask, lambda: (mask + 1) >> 1,  # ties to even; with M = 23 nothing to drop
                     lambda: (mask >> 1) + ((mag >> drop) & row[_TIE]))
    normal = (mag + increment) & ~mask
    # below the min normal: a count of min-subnormal quanta, rounded the same three ways
    exp_field = mag >> 23
    significand = (mag & 0x7FFFFF) | ((exp_field > 0).to(torch.int32) << 23)
    shift = torch.clamp(row[_SHIFT_BASE] - torch.clamp(exp_field, min=1), min=1, max=25)
    half = torch.ones_like(shift) << (shift - 1)
    sub_increment = pick(lambda: noise & ((half << 1) - 1), lambda: half,
                         lambda: half - 1 + ((significand >> shift) & 1))
    quanta = (significand + sub_increment) >> shift
    scales = row[_SCALE_LOW:_SCALE_HIGH + 1].view(torch.float32)
    subnormal = ((quanta.to(torch.float32) * scales[0]) * scales[1]).view(torch.int32)
    return _finish(row, mag, sign, subnormal, normal)


def round_nearest(x: torch.Tensor, row: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``round_with(x, row, seed, "nearest")`` for a format with at least one mantissa bit
    (``nearest_in_floats``), in float32 arithmetic alone, which Inductor compiles to vector code (a bit view of
    a whole tensor it does not, on CPU; about 2.5x faster). Float32 additions round to nearest, ties to even, so

    * normal range: Veltkamp's split ``c = a * (2**drop + 1); c - (c - a)`` is ``a`` rounded to the format's
      significand (values from ``2**(127 - drop)``, where ``c`` would overflow, split 2**64 smaller);
    * below the min normal: ``(a + magic) - magic``, ``magic`` = 2**23 quanta, adds at the quantum;
    * then overflow as the row says, inf and NaN kept as the format keeps them, and the sign back.

    With no mantissa bit, a tie's even neighbour is the one of even exponent field, which no split gives.
    """
    f = row.view(torch.float32)
    a = x.abs()
    c = a * f[_SPLITTER]
    normal = c - (c - a)
    big = a * _SCALE_DOWN
    c_big = big * f[_SPLITTER]
    normal = torch.where(a >= f[_BIG], (c_big - (c_big - big)) * _SCALE_UP, normal)
    magic = f[_SUB_MAGIC]
    rounded = torch.where(a < f[_MIN_NORMAL_BITS], (a + magic) - magic, normal)
    rounded = torch.where(rounded <= f[_MAX_BITS], rounded, f[_ON_OVERFLOW])  # NaN from an inf split: overflow
    rounded = torch.where((a >= f[_KEEP_FROM]) | (a != a), a, rounded)  # a != a: NaN (vector code, not isnan)
    return torch.copysign(rounded, x), (a >= f[_OVER_BITS]).sum(dtype=torch.int32)


def _finish(row: torch.Tensor, mag: torch.Tensor, sign: torch.Tensor, subnormal: torch.Tensor,
            normal: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The rounded magnitude of either range, overflow applied, inf and NaN kept, the sign back; and the count
    of overflowing values."""
    rounded = torch.where(mag < row[_MIN_NORMAL_BITS], subnormal, normal)
    rounded = torch.where(rounded > row[_MAX_BITS], row[_ON_OVERFLOW], rounded)
    rounded = torch.where(mag >= row[_KEEP_FROM], mag, rounded)
    overflowed = ((mag >= row[_OVER_BITS]) & (mag <= _INF_BITS)).sum()
    return (rounded | sign).view(torch.float32), overflowed


class RoundWithGradient(torch.autograd.Function):
    """Forward: ``x`` rounded by ``row`` (``round_with``), and its overflow count (not differentiable).
    Backward: the gradient rounded by ``grad_row``; its overflow count is the gradient of ``counter`` (a float64
    leaf, exact to 2**53), so that a compiled graph counts without writing to a tensor."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, row: torch.Tensor, seed: torch.Tensor, grad_row: torch.Tensor,
                grad_seed: torch.Tensor, counter: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        ctx.save_for_backward(grad_row, grad_seed)
        ctx.counter_dtype = counter.dtype
        rounded, overflowed = round_with(x, row, seed)
        ctx.mark_non_differentiable(overflowed)
        return rounded, overflowed

    @staticmethod
    def backward(ctx, grad: torch.Tensor, _overflowed: torch.Tensor | None):
        grad_row, grad_seed = ctx.saved_tensors
        rounded, overflowed = round_with(grad.contiguous(), grad_row, grad_seed)
        return rounded, None, None, None, None, overflowed.to(ctx.counter_dtype)


def code_bytes(fmt: str | FloatFormat) -> int | None:
    """The bytes a compiled graph saves per value of ``fmt`` (1 up to 8 bits, 2 up to 16), or None for a wider
    format, whose values stay float32."""
    fmt = get_format(fmt)
    return fmt.storage_bytes if fmt.storage_bytes <= 2 else None


def _exp2_int(k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """2**k of an integer-valued float32 tensor as two normal float32 factors (2**k alone may be subnormal or
    overflow for k in [-149, 149]); exp2 of an integer is exact."""
    low = torch.floor(k * 0.5)
    return torch.exp2(low), torch.exp2(k - low)


def encode_codes(v: torch.Tensor, row: torch.Tensor, nbytes: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The bit patterns of ``v``, values already rounded to the row's format, as uint8 (``nbytes`` 1: shaped as
    ``v``; 2: the low and the high byte, stacked first), and how many the format has no code for. Read off
    float32's own pattern: a normal value's code is it shifted right by the mantissa bits the format lacks, less
    the difference of the exponent biases; a subnormal's is its count of min-subnormal quanta (exact quotients
    by powers of two). inf and NaN take the format's codes; where it has none (inf in an ``fn`` format, both in
    a ``none`` one) they are saved as its largest magnitude with their sign, and counted: the runtime skips that
    step, as the eager runtime does (``TensorState.settle``). Bit views: for a compiled pass over a flat tensor
    (precsearch.runtime.compiled_ops.round_site), which Inductor vectorizes; four times the speed of the same
    codes from ``log2``."""
    bits = v.view(torch.int32)
    mag = bits & 0x7FFFFFFF
    one = torch.ones_like(row[_BITS])
    man, top = row[_MAN], row[_BITS] - 1  # top: the sign's bit
    scales = row[_SCALE_LOW:_SCALE_HIGH + 1].view(torch.float32)
    quanta = ((mag.view(torch.float32) / scales[0]) / scales[1]).to(torch.int32)
    code = torch.where(mag >= row[_MIN_NORMAL_BITS], (mag >> row[_DROP]) - ((row[_EMIN] + 126) << man), quanta)
    ones = (one << top) - 1  # every magnitude bit: the largest code
    ieee, fn = row[_SPECIAL] == _SPECIAL_CODES["ieee"], row[_SPECIAL] == _SPECIAL_CODES["fn"]
    top_exponent = ones - ((one << man) - 1)
    inf_code = torch.where(ieee, top_exponent, ones - fn.to(torch.int32))
    nan_code = torch.where(ieee, top_exponent | (one << torch.clamp(man - 1, min=0)), ones)
    infinite, nan = mag == _INF_BITS, mag > _INF_BITS
    code = torch.where(nan, nan_code, torch.where(infinite, inf_code, code))
    pattern = code + (((bits >> 31) & 1) << top)
    unencodable = ((infinite & ~ieee) | (nan & ~(ieee | fn))).sum(dtype=torch.int32)
    if nbytes == 1:
        return pattern.to(torch.uint8), unencodable
    return torch.stack([(pattern & 0xFF).to(torch.uint8), (pattern >> 8).to(torch.uint8)]), unencodable


def decode_codes(codes: torch.Tensor, row: torch.Tensor, nbytes: int) -> torch.Tensor:
    """float32 values of ``encode_codes``' bit patterns in the row's format: ``(significand * 2**low) * 2**high``,
    two exact products (a subnormal format's smallest quantum may be no normal float32)."""
    bits, man = row[_BITS], row[_MAN]
    one = torch.ones_like(bits)
    pattern = codes.to(torch.int32) if nbytes == 1 else codes[0].to(torch.int32) | (codes[1].to(torch.int32) << 8)
    top = bits - 1
    mag = pattern & ((one << top) - 1)
    exponent_field = mag >> man
    quanta = (mag & ((one << man) - 1)) + torch.where(exponent_field > 0, one << man, 0)
    k = (torch.clamp(exponent_field, min=1) + row[_EMIN] - 1 - man).to(torch.float32)
    low, high = _exp2_int(k)
    value = (quanta.to(torch.float32) * low) * high
    special = row[_SPECIAL]
    ones = (one << top) - 1
    top_exponent = ones - ((one << man) - 1)
    is_ieee_special = (special == _SPECIAL_CODES["ieee"]) & (mag >= top_exponent)
    value = torch.where(is_ieee_special, torch.where(mag == top_exponent, float("inf"), float("nan")), value)
    value = torch.where((special == _SPECIAL_CODES["fn"]) & (mag == ones), float("nan"), value)
    return torch.where((pattern >> top) > 0, -value, value)
