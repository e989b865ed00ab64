"""Rounding, bit packing and range statistics for any ``FloatFormat`` (precsearch.formats.format), on torch tensors.

``quantize`` rounds to a format and returns float32 (see precsearch.formats.format for the formats, their
special codes, and the overflow and rounding modes). Stochastic rounding is unbiased: the result is one of
the two neighbours, rounding up with probability proportional to the distance from the lower one, driven by
a counter-based hash of the element index and a seed drawn from a ``torch.Generator``, so results are
reproducible and need no large random tensor.

Each kernel is one pass over the tensor, compiled by precsearch.formats.runner's ``RUNNER``.

``round_and_count`` is the runtime's one pass over a tensor: the rounded values, the count of values that
overflow the format, and optionally the format's codes of the result (for packed storage), all on the device,
so that a training step needs no host synchronisation per tensor.
"""

from __future__ import annotations

import functools
import logging
import math
import struct
from dataclasses import dataclass

import torch

from precsearch.errors import PrecsearchError
from precsearch.formats.format import OVERFLOWS, ROUNDINGS, FloatFormat, get_format
from precsearch.formats.runner import INT32_LENGTHS, RUNNER, labelled

__all__ = [
    "decode",
    "encode",
    "overflow_threshold",
    "quantize",
    "round_and_count",
    "round_and_count_fn",
    "stats",
    "storage_dtype",
]

log = logging.getLogger(__name__)

_STORAGE_DTYPES = {1: torch.uint8, 2: torch.int16, 4: torch.int32}


def storage_dtype(fmt: FloatFormat) -> torch.dtype:
    """The integer dtype that holds ``fmt``'s codes (``FloatFormat.storage_bytes`` wide)."""
    return _STORAGE_DTYPES[fmt.storage_bytes]


# ----------------------------------------------------------------------------------------------- rounding


def _check_tensor(x: torch.Tensor) -> torch.Tensor:
    if not isinstance(x, torch.Tensor) or not x.dtype.is_floating_point:
        got = x.dtype if isinstance(x, torch.Tensor) else type(x).__name__
        raise TypeError(f"expected a floating-point tensor, got {got}")
    if x.dtype == torch.float64:
        raise TypeError("float64 input would be rounded twice (to float32, then to the format): pass float32")
    return x if x.dtype == torch.float32 else x.float()


def _times_power_of_two(t: torch.Tensor, exponent: int) -> torch.Tensor:
    """``t * 2 ** exponent``, exact wherever the result is a float32: in two products where ``2 ** exponent``
    is no normal float32 (bf16's min subnormal, 2 ** -133: a subnormal operand is slow, and 2 ** 133 overflows)."""
    if -126 <= exponent <= 127:
        return t * 2.0**exponent
    half = exponent // 2
    return (t * 2.0**half) * 2.0 ** (exponent - half)


def _low32(v: torch.Tensor) -> torch.Tensor:
    """``v mod 2**32`` of an int64 tensor, written without the literal 0xFFFFFFFF (outside int32)."""
    return v - ((v >> 32) << 32)


def _mul32(h: torch.Tensor, half: int) -> torch.Tensor:
    """``h * (2 * half + 1) mod 2**32`` for 0 <= h < 2**32, in int64 arithmetic with constants inside int32."""
    return _low32((_low32(h * half) << 1) + h)


def _hash_bits(index: torch.Tensor, seed: torch.Tensor) -> torch.Tensor:
    """31 pseudo-random bits per element: murmur3's 32-bit finalizer on (index, seed), in int64 arithmetic.

    Its multipliers 0x9E3779B1, 0x85EBCA6B and 0xC2B2AE35 are applied as ``2 * half + 1`` (``_mul32``) so that
    no literal leaves int32."""
    h = _low32(_mul32(index, 0x4F1BBCD8) + seed)
    h = h ^ (h >> 16)
    h = _mul32(h, 0x42F5E535)
    h = h ^ (h >> 13)
    h = _mul32(h, 0x6159571A)
    return (h ^ (h >> 16)) >> 1


@dataclass(frozen=True)
class _KernelKey:
    man: int
    emin: int
    max_bits: int
    rounding: str
    overflow: str
    keep_inf: bool


@functools.lru_cache(maxsize=64)
def _make_kernel(key: _KernelKey):
    """A rounding function with the format's constants baked in (so torch.compile specializes on them).

    It works on float32 bit patterns. Results in the normal range drop ``23 - man`` bits of the input's own
    pattern (a carry into the exponent is the correct rounding up). Below the format's min normal, nearest
    rounding is ``(|x| + C) - C`` in float32, with C chosen so that float32's ulp at C is the format's min
    subnormal (exact IEEE addition does the round-half-to-even); stochastic rounding there adds noise to the
    significand counted in min-subnormal quanta, and ties away from zero add half a quantum (half an ulp in
    the normal range) and truncate.
    """
    drop = 23 - key.man
    mask = (1 << drop) - 1
    min_normal_bits = (key.emin + 127) << 23
    magic = 2.0 ** (key.emin - key.man + 23)
    on_overflow = {"saturate": key.max_bits, "inf": 0x7F800000, "nan": 0x7FC00000}[key.overflow]
    # Inputs that stay as they are: NaN always, and inf too when the format has inf.
    keep_from = 0x7F800000 if key.keep_inf else 0x7F800001

    def kernel(x: torch.Tensor, seed: torch.Tensor) -> torch.Tensor:
        """The float32 bit patterns (int32) of ``x`` rounded."""
        bits = x.view(torch.int32)
        sign = bits & ~0x7FFFFFFF
        mag = bits & 0x7FFFFFFF
        if key.rounding != "nearest":
            exp_field = mag >> 23
            significand = (mag & 0x7FFFFF) | ((exp_field > 0).to(torch.int32) << 23)
            shift = torch.clamp(drop + key.emin + 127 - torch.clamp(exp_field, min=1), min=1, max=25)
            if key.rounding == "stochastic":
                index = torch.arange(x.numel(), device=x.device, dtype=torch.int64).view(x.shape)
                noise = _hash_bits(index, seed).to(torch.int32)
                normal = (mag + (noise & mask)) & ~mask
                quanta = (significand + (noise & ((1 << shift) - 1))) >> shift
            else:  # ties away from zero: add half a step, truncate
                normal = (mag + ((mask + 1) >> 1)) & ~mask
                quanta = (significand + (1 << (shift - 1))) >> shift
            subnormal = _times_power_of_two(quanta.to(torch.float32), key.emin - key.man).view(torch.int32)
        else:
            # half a step less one, plus the kept part's last bit: ties go to even (nothing to drop when M = 23)
            normal = (mag + ((mask >> 1) + ((mag >> drop) & 1))) & ~mask if drop else mag
            subnormal = ((mag.view(torch.float32) + magic) - magic).view(torch.int32)
        rounded = torch.where(mag < min_normal_bits, subnormal, normal)
        rounded = torch.where(rounded > key.max_bits, on_overflow, rounded)
        rounded = torch.where(mag >= keep_from, mag, rounded)
        return rounded | sign

    return kernel



@functools.lru_cache(maxsize=16)
def _zero_seed(device: torch.device) -> torch.Tensor:
    return torch.zeros((), dtype=torch.int64, device=device)


def _round_key(fmt: FloatFormat, rounding: str, overflow: str) -> _KernelKey:
    return _KernelKey(fmt.man, fmt.emin, _float_bits(fmt.max), rounding, overflow, fmt.has_inf)


def _label(fmt: FloatFormat, what: str, rounding: str = "nearest", overflow: str | None = None) -> str:
    return f"{fmt.name} {what} ({rounding}, overflow {overflow or fmt.default_overflow})"


@functools.lru_cache(maxsize=256)
def _rounding_kernel(fmt: FloatFormat, rounding: str, overflow: str):
    kernel = _make_kernel(_round_key(fmt, rounding, overflow))

    def quantize_kernel(x: torch.Tensor, seed: torch.Tensor) -> torch.Tensor:
        return kernel(x, seed).view(torch.float32)

    return labelled(_label(fmt, "quantize", rounding, overflow), quantize_kernel)


def _check_modes(rounding: str, overflow: str) -> None:
    if rounding not in ROUNDINGS:
        raise PrecsearchError(f"unknown rounding {rounding!r}: use one of {', '.join(ROUNDINGS)}")
    if overflow not in OVERFLOWS:
        raise PrecsearchError(f"unknown overflow mode {overflow!r}: use one of {', '.join(OVERFLOWS)}")


def _float_bits(value: float) -> int:
    return struct.unpack("<i", struct.pack("<f", value))[0]


def quantize(
    x: torch.Tensor,
    fmt: str | FloatFormat,
    rounding: str = "nearest",
    overflow: str | None = None,
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """Round ``x`` to the nearest value of ``fmt`` (or stochastically), returned as float32.

    fp32 returns ``x`` itself (float32 input) so that high-precision tensors are untouched.
    """
    fmt = get_format(fmt)
    x = _check_tensor(x)
    overflow = overflow or fmt.default_overflow
    _check_modes(rounding, overflow)
    if fmt.is_fp32:
        return x
    if rounding == "stochastic":
        device = generator.device if generator is not None else "cpu"
        seed = torch.randint(0, 2**31 - 1, (), generator=generator, device=device, dtype=torch.int64).to(x.device)
    else:
        seed = _zero_seed(x.device)
    return RUNNER.run(_rounding_kernel(fmt, rounding, overflow), x.reshape(-1), seed).view(x.shape)


# ------------------------------------------------------------------------------------------ bit packing


def _wide_codes(fmt: FloatFormat, device: torch.device) -> bool:
    """Whether the kernels leave ``fmt``'s codes as int32, for aten to narrow: 16-bit codes on a CPU, where
    Inductor's C++ conversions between int16 and int32 are not vectorized (six times a uint8 one; aten's are)."""
    return storage_dtype(fmt) == torch.int16 and device.type == "cpu"


def _narrow(codes: torch.Tensor | None, fmt: FloatFormat) -> torch.Tensor | None:
    return codes if codes is None or codes.dtype == storage_dtype(fmt) else codes.to(storage_dtype(fmt))


def _code_builder(fmt: FloatFormat):
    """The format's bit patterns of values already in the format (given as float32 bit patterns), and a mask of
    those it has no code for (None when it has a code for every value).

    A normal value's code is its float32 pattern shifted right by the mantissa bits it lacks, less the
    difference of the exponent biases; a subnormal's is its count of min-subnormal quanta (an exact product
    with a power of two). The sign is moved in with one arithmetic shift, sign-extended for 16-bit codes
    (stored as int16)."""
    normal_from = (fmt.emin + 127) << 23
    drop = 23 - fmt.man
    bias_offset = (127 - fmt.bias) << fmt.man
    quanta_exp = fmt.man - fmt.emin  # 1 / min subnormal = 2 ** quanta_exp
    top_code = (2**fmt.exp - 1) << fmt.man
    sign_mask = (1 << (fmt.bits - 1)) - 1
    dtype = storage_dtype(fmt)
    sign_extend = dtype == torch.int16 and fmt.bits == 16

    def codes_of(bits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        wide = _wide_codes(fmt, bits.device)
        mag = bits & 0x7FFFFFFF
        value = mag.view(torch.float32)
        quanta = _times_power_of_two(value, quanta_exp)
        mag_code = torch.where(mag >= normal_from, (mag >> drop) - bias_offset, quanta.to(torch.int32))
        unencodable = None
        if fmt.has_inf:
            nan = (mag != 0x7F800000).to(torch.int32) << max(fmt.man - 1, 0)  # inf, or the format's quiet NaN
            mag_code = torch.where(mag >= 0x7F800000, top_code | nan, mag_code)
        elif fmt.has_nan:
            mag_code = torch.where(mag > 0x7F800000, top_code | (2**fmt.man - 1), mag_code)
            unencodable = mag == 0x7F800000
        else:
            unencodable = mag >= 0x7F800000
        sign = bits >> (32 - fmt.bits)
        sign = sign & ~sign_mask if sign_extend else sign & (sign_mask + 1)
        codes = sign | mag_code
        return codes if wide else codes.to(dtype), unencodable

    return codes_of


@functools.lru_cache(maxsize=64)
def _make_encoder(fmt: FloatFormat):
    """Round to nearest and assemble the format's bit pattern in one pass; also count unencodable values."""
    round_nearest = _make_kernel(_round_key(fmt, "nearest", fmt.default_overflow))
    codes_of = _code_builder(fmt)

    def encoder(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        codes, unencodable = codes_of(round_nearest(x, torch.zeros((), dtype=torch.int64, device=x.device)))
        return codes, (codes[:0] if unencodable is None else unencodable).sum()

    return labelled(_label(fmt, "encode"), encoder)


def _count(mask: torch.Tensor) -> torch.Tensor:
    """How many of ``mask`` are true, as int64: summed in int32 where that cannot overflow (twice the vector
    width of an int64 sum on a CPU; a compiled kernel guards on the length, ``_Compiled``)."""
    if mask.numel() < INT32_LENGTHS:
        return mask.to(torch.int32).sum(dtype=torch.int32).to(torch.int64)
    return mask.sum()


@functools.lru_cache(maxsize=256)
def _make_round_and_count(fmt: FloatFormat, rounding: str, overflow: str, over_bits: int, with_codes: bool,
                          in_place: bool = False):
    """One pass: rounded values (written over ``x`` with ``in_place``, then None) and (``with_codes``) their
    codes; [overflow count, unencodable count] is added to ``counts`` in the same pass (no kernel of its own)."""
    round_values = _make_kernel(_round_key(fmt, rounding, overflow))
    codes_of = _code_builder(fmt)
    saturating = overflow == "saturate"  # then only a NaN input can leave the format: one without NaN codes

    def round_and_count_kernel(x: torch.Tensor, seed: torch.Tensor, counts: torch.Tensor):
        mag = x.view(torch.int32) & 0x7FFFFFFF
        over = _count((mag >= over_bits) & (mag <= 0x7F800000))  # NaN is no overflow
        rounded_bits = round_values(x, seed)
        rounded = rounded_bits.view(torch.float32)
        codes, bad = None, torch.zeros_like(over)
        if with_codes:
            codes, unencodable = codes_of(rounded_bits)
            if saturating:  # the same mask, read off the input: the counting loop need not round
                unencodable = None if fmt.has_nan else mag > 0x7F800000
            bad = bad if unencodable is None else _count(unencodable)
        if in_place:
            x.copy_(rounded)
            rounded = None
        counts.add_(torch.stack([over, bad]))
        return rounded, codes

    what = "round, count" + (" and encode" if with_codes else "") + (" in place" if in_place else "")
    return labelled(_label(fmt, what, rounding, overflow), round_and_count_kernel)


@functools.lru_cache(maxsize=256)
def overflow_threshold(fmt: FloatFormat, rounding: str = "nearest") -> float:
    """The smallest float32 magnitude that rounds past ``fmt.max`` (under stochastic rounding: any value above
    max, since it may round up): what the runtime counts as an overflow."""
    if fmt.is_fp32:
        return math.inf
    top = torch.tensor(fmt.max, dtype=torch.float32)
    if rounding == "stochastic":
        return float(torch.nextafter(top, torch.tensor(math.inf)))
    mid = torch.tensor(fmt.max + 2.0 ** (fmt.emax - fmt.man) / 2, dtype=torch.float32)
    if math.isinf(float(quantize(mid.reshape(1), fmt, rounding, overflow="inf")[0])):
        return float(mid)
    return float(torch.nextafter(mid, torch.tensor(math.inf)))


def round_and_count(x: torch.Tensor, fmt: str | FloatFormat, rounding: str = "nearest", overflow: str | None = None,
                    *, seed: torch.Tensor | None = None, with_codes: bool = False
                    ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """``quantize(x, ...)``, the format's codes of the result (``with_codes``, else None), and an int64
    tensor ``[overflowed, unencodable]`` on ``x``'s device: how many values of ``x`` lie at or past
    ``overflow_threshold`` (NaN excluded), and how many results the format has no code for (inf or NaN in a
    format without them). One kernel when compiled, and no host synchronisation. ``seed`` (an int64 tensor
    on ``x``'s device) drives stochastic rounding; nearest ignores it.
    """
    x = _check_tensor(x)
    fmt = get_format(fmt)
    return round_and_count_fn(fmt.name, rounding, overflow or fmt.default_overflow, with_codes)(x, seed)


_shaped = torch.ops.aten._unsafe_view.default


@functools.cache
def _warn_copied_back(label: str) -> None:
    log.warning("%s: a non-contiguous tensor is rounded into a new one and copied back (one more pass and a "
                "float32 copy), not in place", label)


@functools.lru_cache(maxsize=256)
def round_and_count_fn(fmt: str, rounding: str, overflow: str, with_codes: bool, in_place: bool = False):
    """``round_and_count`` for one setting, with every look-up done once: what the runtime calls per tensor
    (``fn(x, seed, counts)`` on a float32 ``x``; ``counts``, an int64 tensor of 2, is added to in the kernel's
    pass and returned, a new one when None). With ``in_place`` the rounded values are written over ``x`` in the
    same pass (no new float32 tensor; a non-contiguous ``x`` is copied back) and ``fn`` returns None for them."""
    spec = get_format(fmt)
    if spec.is_fp32:
        raise PrecsearchError("round_and_count: fp32 needs no rounding; keep the tensor as it is")
    _check_modes(rounding, overflow)
    over_bits = _float_bits(overflow_threshold(spec, rounding))
    packed = with_codes and spec.packs
    kernel = _make_round_and_count(spec, rounding, overflow, over_bits, packed)
    kernel_in_place = _make_round_and_count(spec, rounding, overflow, over_bits, packed, True) if in_place else None

    def fn(x: torch.Tensor, seed: torch.Tensor | None, counts: torch.Tensor | None = None):
        seed = _zero_seed(x.device) if seed is None else seed
        counts = torch.zeros(2, dtype=torch.int64, device=x.device) if counts is None else counts
        if in_place and x.is_contiguous():
            _, codes = RUNNER.run(kernel_in_place, x.view(-1), seed, counts)
            codes = _narrow(codes, spec)
            return None, None if codes is None else _shaped(codes, x.shape), counts
        rounded, codes = RUNNER.run(kernel, x.reshape(-1), seed, counts)
        codes = _narrow(codes, spec)
        # shaped as x without being views of the flat outputs: a caller may modify them in place (ReLU(inplace)
        # on a view of an autograd Function's output is refused)
        rounded = _shaped(rounded, x.shape)
        if in_place:
            _warn_copied_back(kernel.label)
            x.copy_(rounded)
            rounded = None
        return rounded, None if codes is None else _shaped(codes, x.shape), counts

    return fn


@functools.lru_cache(maxsize=64)
def _make_decoder(fmt: FloatFormat):
    """float32 values of bit patterns, the inverse of ``_code_builder``: a normal code shifted into float32's
    mantissa plus the difference of the exponent biases, a subnormal one as a multiple of the min subnormal,
    the sign bit moved to bit 31."""
    first_normal = 1 << fmt.man
    top_code = (2**fmt.exp - 1) << fmt.man
    bias_offset = (127 - fmt.bias) << 23
    drop = 23 - fmt.man

    def decoder(codes: torch.Tensor) -> torch.Tensor:
        c = codes.to(torch.int32)
        mag_code = c & ((1 << (fmt.bits - 1)) - 1)
        subnormal = _times_power_of_two(mag_code.to(torch.float32), fmt.emin - fmt.man).view(torch.int32)
        bits = torch.where(mag_code >= first_normal, (mag_code << drop) + bias_offset, subnormal)
        if fmt.has_inf:
            nan = (mag_code != top_code).to(torch.int32) << 22  # inf, or float32's quiet NaN
            bits = torch.where(mag_code >= top_code, 0x7F800000 | nan, bits)
        elif fmt.has_nan:
            bits = torch.where(mag_code == top_code | (2**fmt.man - 1), 0x7FC00000, bits)
        sign = ((c >> (fmt.bits - 1)) & 1) << 31
        return (bits | sign).view(torch.float32)

    return labelled(_label(fmt, "decode"), decoder)


def encode(x: torch.Tensor, fmt: str | FloatFormat) -> torch.Tensor:
    """Bit patterns of ``x`` in ``fmt``: uint8 per element for <= 8 bits, int16 for <= 16, else int32.

    ``x`` is rounded to nearest first (with the format's default overflow), in the same pass; values the
    format cannot hold (inf without an inf code, NaN without a NaN code) raise ``PrecsearchError``.
    """
    fmt = get_format(fmt)
    x = _check_tensor(x)
    codes, unencodable = RUNNER.run(_make_encoder(fmt), x.reshape(-1))
    codes = _narrow(codes, fmt)
    if unencodable.item():
        raise PrecsearchError(
            f"cannot encode inf/NaN in {fmt.name}, which has no such code: clamp or quantize the values first"
        )
    return codes.view(x.shape)


def decode(codes: torch.Tensor, fmt: str | FloatFormat) -> torch.Tensor:
    """float32 values of ``encode``'s bit patterns."""
    fmt = get_format(fmt)
    if codes.dtype != storage_dtype(fmt):
        raise TypeError(f"{fmt.name} codes must be {storage_dtype(fmt)}, got {codes.dtype}")
    flat = codes.reshape(-1)
    flat = flat.to(torch.int32) if _wide_codes(fmt, flat.device) else flat
    return RUNNER.run(_make_decoder(fmt), flat).view(codes.shape)


# ------------------------------------------------------------------------------------------- statistics


def stats(x: torch.Tensor, fmt: str | FloatFormat) -> dict[str, float]:
    """Fractions of ``x`` that overflow ``fmt``, underflow to zero, or land on a subnormal, under nearest rounding.

    ``overflow`` counts finite values that round above max plus infinite values; ``underflow`` counts nonzero
    values that round to zero; ``subnormal`` counts values that round to a nonzero subnormal; ``nan`` counts NaN.
    """
    fmt = get_format(fmt)
    x = _check_tensor(x)
    n = max(x.numel(), 1)
    if fmt.is_fp32:
        return {"overflow": 0.0, "underflow": 0.0, "subnormal": 0.0, "nan": float(x.isnan().sum()) / n}
    mag = quantize(x.abs(), fmt, overflow="inf")
    absx = x.abs()
    counts = {
        "overflow": (mag == math.inf).sum(),
        "underflow": ((mag == 0) & (absx > 0)).sum(),
        "subnormal": ((mag > 0) & (mag < fmt.min_normal)).sum(),
        "nan": x.isnan().sum(),
    }
    return {key: float(value) / n for key, value in counts.items()}
