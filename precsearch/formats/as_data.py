"""Rounding to any format with the format as data: one traceable function serves every format, rounding and
overflow mode, for every path that rounds (precsearch.formats.kernels' public functions, the eager runtime's
ops, the compiled step's sites).

A format, its rounding and its overflow mode are one small int32 tensor (``format_row``), so a compiled kernel or
graph taking rows as inputs serves every assignment (a search of 40 trials compiles once, not 40 times); fp32 is
a row too (values kept, nothing counted). ``round_values`` rounds in float32 arithmetic for round to nearest
(``round_nearest``, vector code under Inductor), on float32 bit patterns otherwise (``round_with``). Stochastic
rounding is unbiased (up with probability proportional to the distance from the lower neighbour), driven by a
counter-based hash of the element index and a seed tensor: reproducible, and no large random tensor.

``encode_patterns`` / ``decode_patterns`` turn rounded values into bit patterns (int32) and back; ``encode_codes``
/ ``decode_codes`` store them in bytes (``code_bytes``: one uint8 plane up to 8 bits; two, stacked first, up to
16, as Inductor's CPU code converts int16 element by element), the layout a compiled step saves for the backward.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch

from precsearch.formats.format import FloatFormat, check_modes, get_format, overflow_threshold
from precsearch.formats.format import float32_bits as _float_bits

__all__ = ["code_bytes", "decode_codes", "decode_patterns", "encode_codes", "encode_patterns", "format_row",
           "nearest_in_floats", "patterns_of", "round_nearest", "round_values", "round_with"]

# the row's fields, in order
(_DROP, _MASK, _MIN_NORMAL_BITS, _SHIFT_BASE, _SCALE_LOW, _SCALE_HIGH, _MAX_BITS, _ON_OVERFLOW, _KEEP_FROM,
 _OVER_BITS, _TIE, _SUB_MAGIC, _SPLITTER, _BIG, _BITS, _MAN, _EMIN, _SPECIAL, _QUANTA_LOW, _QUANTA_HIGH) = range(20)
_SPECIAL_CODES = {"none": 0, "fn": 1, "ieee": 2}
_SCALE_DOWN, _SCALE_UP = 2.0**-64, 2.0**64  # Veltkamp's split of the largest values, done 2**64 smaller
_INF_BITS = 0x7F800000


@functools.lru_cache(maxsize=256)
def _row_values(fmt: FloatFormat, rounding: str, overflow: str) -> tuple[int, ...]:
    if fmt.is_fp32:  # every value is kept (``_KEEP_FROM`` 0) and none counts as an overflow
        return (0, 0, 0, 1, _float_bits(1.0), _float_bits(1.0), _INF_BITS, _INF_BITS, 0, _INF_BITS + 1,
                0, _float_bits(1.0), _float_bits(1.0), _INF_BITS, 32, 23, -126, _SPECIAL_CODES["ieee"],
                _float_bits(1.0), _float_bits(1.0))
    drop = 23 - fmt.man
    exponent = fmt.emin - fmt.man  # of the min subnormal: quanta times 2 ** exponent, in two exact products
    low = exponent // 2
    return (drop, (1 << drop) - 1, (fmt.emin + 127) << 23, drop + fmt.emin + 127, _float_bits(2.0**low),
            _float_bits(2.0 ** (exponent - low)), _float_bits(fmt.max),
            {"saturate": _float_bits(fmt.max), "inf": _INF_BITS, "nan": 0x7FC00000}[overflow],
            _INF_BITS if fmt.has_inf else _INF_BITS + 1,
            _float_bits(overflow_threshold(fmt, rounding)), _tie(fmt), _float_bits(2.0 ** (exponent + 23)),
            _float_bits(2.0**drop + 1), _float_bits(2.0 ** (127 - drop)), fmt.bits, fmt.man, fmt.emin,
            _SPECIAL_CODES[fmt.special], _float_bits(2.0**-low), _float_bits(2.0 ** (low - exponent)))


def _tie(fmt: FloatFormat) -> int:
    """How a normal tie finds its even neighbour (``round_with``): bit 0 set, from the last kept bit of float32's
    pattern; bit 1 set, that bit inverted. With no mantissa bit the kept bit is float32's exponent field's last,
    whose parity is the format's code's only when both biases are odd (float32's is 127)."""
    flipped = fmt.man == 0 and fmt.bias % 2 == 0
    return int(23 - fmt.man > 0) | (2 if flipped else 0)


def format_row(fmt: str | FloatFormat, rounding: str = "nearest", overflow: str | None = None,
               device: torch.device | str = "cpu") -> torch.Tensor:
    """The int32 tensor that tells the roundings how to round: ``fmt`` and ``overflow`` (the format's default
    when None) as data, with the overflow threshold of ``rounding`` (which the caller passes again, as a
    constant)."""
    fmt = get_format(fmt)
    overflow = overflow or fmt.default_overflow
    check_modes(rounding, overflow)
    return torch.tensor(_row_values(fmt, rounding, overflow), dtype=torch.int32, device=device)


def nearest_in_floats(fmt: str | FloatFormat) -> bool:
    """Whether ``round_nearest`` serves ``fmt``: a format with a mantissa bit (or fp32)."""
    fmt = get_format(fmt)
    return fmt.is_fp32 or fmt.man > 0


def _low32(v: torch.Tensor) -> torch.Tensor:
    """``v mod 2**32`` of an int64 tensor, written without the literal 0xFFFFFFFF (outside int32)."""
    return v - ((v >> 32) << 32)


def _mul32(h: torch.Tensor, half: int) -> torch.Tensor:
    """``h * (2 * half + 1) mod 2**32`` for 0 <= h < 2**32, in int64 arithmetic with constants inside int32."""
    return _low32((_low32(h * half) << 1) + h)


def _hash_bits(index: torch.Tensor, seed: torch.Tensor) -> torch.Tensor:
    """31 pseudo-random bits per element: murmur3's 32-bit finalizer on (index, seed), in int64 arithmetic
    (Triton types an integer literal as int32: its multipliers 0x9E3779B1, 0x85EBCA6B and 0xC2B2AE35 are applied
    as ``2 * half + 1``, ``_mul32``)."""
    h = _low32(_mul32(index, 0x4F1BBCD8) + seed)
    h = h ^ (h >> 16)
    h = _mul32(h, 0x42F5E535)
    h = h ^ (h >> 13)
    h = _mul32(h, 0x6159571A)
    return (h ^ (h >> 16)) >> 1


def round_with(x: torch.Tensor, row: torch.Tensor, seed: torch.Tensor,
               rounding: str) -> tuple[torch.Tensor, torch.Tensor]:
    """``x`` (float32) rounded as ``row`` says, on its bit patterns, and how many of its values overflow (at or
    past ``overflow_threshold``; NaN excluded; int64). ``seed`` (an int64 tensor) drives stochastic rounding:
    the hash reads it, the caller advances it. ``rounding`` (the row's) is a constant of the graph: only its own
    arithmetic is computed."""
    bits = x.view(torch.int32)
    sign = bits & ~0x7FFFFFFF
    mag = bits & 0x7FFFFFFF
    drop, mask = row[_DROP], row[_MASK]
    noise = None
    if rounding == "stochastic":
        index = torch.arange(x.numel(), device=x.device, dtype=torch.int64).view(x.shape)
        noise = _hash_bits(index, seed).to(torch.int32)

    def pick(stochastic: Callable, away: Callable, to_even: Callable) -> torch.Tensor:
        return {"stochastic": stochastic, "nearest_away": away, "nearest": to_even}[rounding]()

    # normal range: add an increment (the noise, half a step, or half a step less one plus the kept part's last
    # bit), drop the low bits (a carry into the exponent is the correct rounding up)
    increment = pick(lambda: noise & mask, lambda: (mask + 1) >> 1,  # ties to even; with M = 23 nothing to drop
                     lambda: (mask >> 1) + (((mag >> drop) ^ (row[_TIE] >> 1)) & row[_TIE] & 1))
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


def round_values(x: torch.Tensor, row: torch.Tensor, seed: torch.Tensor, rounding: str,
                 in_floats: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """``x`` rounded by ``row`` with ``rounding`` (the row's, a constant of the graph), and its overflow count:
    in float32 arithmetic (``round_nearest``) where ``in_floats`` (the row's format ``nearest_in_floats``)."""
    if rounding == "nearest" and in_floats:
        return round_nearest(x, row)
    return round_with(x, row, seed, rounding)


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


def encode_patterns(v: torch.Tensor, row: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The bit patterns (int32) of ``v``, values already rounded to the row's format, and how many the format has
    no code for. Read off float32's own pattern: a normal value's code is it shifted right by the mantissa bits
    the format lacks, less the difference of the exponent biases; a subnormal's is its count of min-subnormal
    quanta (exact products with powers of two). inf and NaN take the format's codes; where it has none (inf in an
    ``fn`` format, both in a ``none`` one) they are coded as its largest magnitude with their sign, and counted:
    the runtime skips that step (``TensorState.settle``) and ``kernels.encode`` refuses them. Bit views, which
    Inductor vectorizes in a pass over a flat tensor; four times the speed of the same codes from ``log2``."""
    bits = v.view(torch.int32)
    mag = bits & 0x7FFFFFFF
    one = torch.ones_like(row[_BITS])
    man, top = row[_MAN], row[_BITS] - 1  # top: the sign's bit
    per_quantum = row[_QUANTA_LOW:_QUANTA_HIGH + 1].view(torch.float32)  # 1 / min subnormal, in two factors
    quanta = ((mag.view(torch.float32) * per_quantum[0]) * per_quantum[1]).to(torch.int32)
    code = torch.where(mag >= row[_MIN_NORMAL_BITS], (mag >> row[_DROP]) - ((row[_EMIN] + 126) << man), quanta)
    ones = (one << top) - 1  # every magnitude bit: the largest code
    ieee, fn = row[_SPECIAL] == _SPECIAL_CODES["ieee"], row[_SPECIAL] == _SPECIAL_CODES["fn"]
    top_exponent = ones - ((one << man) - 1)
    inf_code = torch.where(ieee, top_exponent, ones - fn.to(torch.int32))
    nan_code = torch.where(ieee, top_exponent | (one << torch.clamp(man - 1, min=0)), ones)
    infinite, nan = mag == _INF_BITS, mag > _INF_BITS
    code = torch.where(nan, nan_code, torch.where(infinite, inf_code, code))
    unencodable = ((infinite & ~ieee) | (nan & ~(ieee | fn))).sum(dtype=torch.int32)
    return code + (((bits >> 31) & 1) << top), unencodable


def decode_patterns(pattern: torch.Tensor, row: torch.Tensor) -> torch.Tensor:
    """float32 values of ``encode_patterns``' bit patterns (any integer dtype; bits above the format's are
    ignored, so int16 holds 16-bit ones), assembled as float32 bit patterns: a normal code shifted into float32's
    mantissa plus the difference of the exponent biases, a subnormal one as a multiple of the min subnormal (two
    exact products), the sign moved to bit 31. For a pass over a flat tensor (``kernels.decode``, the compiled
    step's sliced backwards), three times the speed of ``decode_codes`` there."""
    pattern = pattern.to(torch.int32)
    one = torch.ones_like(row[_BITS])
    top, man = row[_BITS] - 1, row[_MAN]
    ones = (one << top) - 1  # every magnitude bit: the largest code
    mag = pattern & ones
    scales = row[_SCALE_LOW:_SCALE_HIGH + 1].view(torch.float32)
    subnormal = ((mag.to(torch.float32) * scales[0]) * scales[1]).view(torch.int32)
    bits = torch.where(mag >= (one << man), (mag << row[_DROP]) + ((row[_EMIN] + 126) << 23), subnormal)
    top_exponent = ones - ((one << man) - 1)
    ieee_special = (row[_SPECIAL] == _SPECIAL_CODES["ieee"]) & (mag >= top_exponent)
    bits = torch.where(ieee_special, _INF_BITS | ((mag != top_exponent).to(torch.int32) << 22), bits)  # or NaN
    bits = torch.where((row[_SPECIAL] == _SPECIAL_CODES["fn"]) & (mag == ones), 0x7FC00000, bits)
    return (bits | (((pattern >> top) & 1) << 31)).view(torch.float32)


def encode_codes(v: torch.Tensor, row: torch.Tensor, nbytes: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``encode_patterns`` stored as uint8: ``nbytes`` 1, shaped as ``v``; 2, the low and the high byte planes,
    stacked first."""
    pattern, unencodable = encode_patterns(v, row)
    if nbytes == 1:
        return pattern.to(torch.uint8), unencodable
    return torch.stack([(pattern & 0xFF).to(torch.uint8), (pattern >> 8).to(torch.uint8)]), unencodable


def patterns_of(codes: torch.Tensor, nbytes: int) -> torch.Tensor:
    """The bit patterns (int32) of ``encode_codes``' bytes."""
    return codes.to(torch.int32) if nbytes == 1 else codes[0].to(torch.int32) | (codes[1].to(torch.int32) << 8)


def decode_codes(codes: torch.Tensor, row: torch.Tensor, nbytes: int) -> torch.Tensor:
    """float32 values of ``encode_codes``' bytes, in float arithmetic (``(significand * 2**low) * 2**high``, two
    exact products): what a compiled graph decodes, which Inductor fuses into the kernels around it."""
    bits, man = row[_BITS], row[_MAN]
    one = torch.ones_like(bits)
    pattern = patterns_of(codes, nbytes)
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
