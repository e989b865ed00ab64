"""Floating-point formats of any (E, M, bias, specials) as small value objects, and the grammar that names them.

Plain Python, no torch: configuration code checks format names without loading the training stack.

Every format is simulated inside float32 (precsearch.formats.kernels' ``quantize`` returns float32 tensors whose
values all lie in the format), so a format's normal range must sit inside float32's (min normal >= 2**-126, max
<= float32 max); ``get_format`` rejects the others.

Special codes come in three families:

* ``ieee``: the top exponent code is reserved for inf (mantissa 0) and NaN (fp16, bf16, e5m2, ml_dtypes' e4m3).
* ``fn``: no inf; only the all-ones code is NaN (OCP's float8_e4m3fn).
* ``none``: every code is finite (QPyTorch and the Lee et al. reference code; also OCP's fp6/fp4, whose
  ``fn`` names mean "finite, no NaN").

Overflow semantics (``OVERFLOWS``) apply to finite values that round above the format's max: ``"inf"`` gives
+-inf, ``"saturate"`` +-max, ``"nan"`` NaN. The default is ``"inf"`` for formats with inf, else ``"saturate"``
(torch 2.13's float8_e4m3fn cast saturates; 2.11's and ml_dtypes give NaN: pass ``overflow="nan"``). Infinite
inputs stay infinite in formats that have inf, else follow the overflow mode; NaN stays NaN. Since the result is
float32, ``"inf"`` and ``"nan"`` suit any format (the Lee et al. reference lets gradients overflow to inf so the
loss scaler reacts), but ``encode`` accepts only values the format can represent.

Rounding modes (``ROUNDINGS``): round-half-to-even (``"nearest"``, IEEE, as every hardware cast),
round-half-away-from-zero (``"nearest_away"``: QPyTorch's and so the Lee et al. reference code's ties, to
reproduce it bit for bit), or unbiased ``"stochastic"`` rounding.
"""

from __future__ import annotations

import functools
import math
import re
import struct
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

from precsearch.errors import PrecsearchError, echo

T = TypeVar("T")

__all__ = ["FloatFormat", "GRAMMAR", "NAMED_FORMATS", "OVERFLOWS", "ROUNDINGS", "SPECIALS", "check_modes",
           "float32_bits", "get_format", "overflow_threshold", "parsed", "spec_name"]

SPECIALS: tuple[str, ...] = ("ieee", "fn", "none")
ROUNDINGS: tuple[str, ...] = ("nearest", "nearest_away", "stochastic")
OVERFLOWS: tuple[str, ...] = ("inf", "saturate", "nan")
GRAMMAR = "e<E>m<M>[b<shift>][fn|s], 1 <= E <= 8, 0 <= M <= 23 (e.g. e5m2, e4m3b4s, e6m9s, e4m3fn)"

_FP32_MAX = (2.0 - 2.0**-23) * 2.0**127
_FP32_MIN_NORMAL = 2.0**-126


@dataclass(frozen=True)
class FloatFormat:
    """Sign + ``exp`` exponent bits + ``man`` mantissa bits, exponent ``bias``, and a family of special codes."""

    exp: int
    man: int
    bias: int
    special: str = "ieee"
    name: str = ""

    def __post_init__(self) -> None:
        if not (1 <= self.exp <= 8 and 0 <= self.man <= 23):
            raise PrecsearchError(f"format e{self.exp}m{self.man}: E must be in 1..8 and M in 0..23 ({GRAMMAR})")
        if self.special not in SPECIALS:
            raise PrecsearchError(f"format special codes {self.special!r}: use one of {', '.join(SPECIALS)}")
        if self.special == "ieee" and self.exp == 1:
            raise PrecsearchError("format e1: an IEEE-like format needs E >= 2 (the top code is inf/NaN); use 's'")
        if self.special == "fn" and self.exp + self.man < 2:
            raise PrecsearchError(f"format e{self.exp}m{self.man}fn: too few bits for a NaN code and a finite value")
        if not self.name:
            object.__setattr__(self, "name", self._spec())
        if self.min_normal < _FP32_MIN_NORMAL or self.max > _FP32_MAX:
            raise PrecsearchError(f"format {self.name}: its range (min normal {self.min_normal:.3g}, max "
                                  f"{self.max:.3g}) leaves float32's normal range, so it cannot be simulated in "
                                  "float32; lower the bias shift or E")

    def _spec(self) -> str:
        shift = self.bias - (2 ** (self.exp - 1) - 1)
        suffix = {"ieee": "", "fn": "fn", "none": "s"}[self.special]
        return f"e{self.exp}m{self.man}" + (f"b{shift}" if shift else "") + suffix

    def __str__(self) -> str:
        return self.name

    @property
    def bits(self) -> int:
        return 1 + self.exp + self.man

    @property
    def has_inf(self) -> bool:
        return self.special == "ieee"

    @property
    def has_nan(self) -> bool:
        return self.special in ("ieee", "fn")

    @property
    def is_fp32(self) -> bool:
        return (self.exp, self.man, self.bias, self.special) == (8, 23, 127, "ieee")

    @property
    def emin(self) -> int:
        """Unbiased exponent of the smallest normal number."""
        return 1 - self.bias

    @property
    def emax(self) -> int:
        """Unbiased exponent of the largest finite number."""
        # IEEE reserves the top exponent code; so does fn when M = 0 (its one top code is the NaN).
        reserved = self.special == "ieee" or (self.special == "fn" and self.man == 0)
        return 2**self.exp - 1 - reserved - self.bias

    @property
    def max(self) -> float:
        # An fn format with M > 0 loses the all-ones mantissa at the top exponent to NaN.
        lost_ulps = 2 if self.special == "fn" and self.man > 0 else 1
        return (2.0 - lost_ulps * 2.0**-self.man) * 2.0**self.emax

    @property
    def min_normal(self) -> float:
        return 2.0**self.emin

    @property
    def min_subnormal(self) -> float:
        """Smallest positive value (equal to min_normal when M = 0: no subnormals then)."""
        return 2.0 ** (self.emin - self.man)

    @property
    def default_overflow(self) -> str:
        return "inf" if self.has_inf else "saturate"

    @property
    def packs(self) -> bool:
        """Whether the runtime holds values of this format as codes (at most 16 bits; wider ones stay float32)."""
        return self.bits <= 16

    @property
    def storage_bytes(self) -> int:
        """Bytes of one code as the runtime stores it: 1 up to 8 bits, 2 up to 16, else 4 (float32)."""
        if self.bits <= 8:
            return 1
        return 2 if self.bits <= 16 else 4


def float32_bits(value: float) -> int:
    """The bit pattern of ``value`` as a float32, read as an int32."""
    return struct.unpack("<i", struct.pack("<f", value))[0]


def _float32_of_bits(bits: int) -> float:
    return struct.unpack("<f", struct.pack("<i", bits))[0]


def check_modes(rounding: str, overflow: str) -> None:
    if rounding not in ROUNDINGS:
        raise PrecsearchError(f"unknown rounding {rounding!r}: use one of {', '.join(ROUNDINGS)}")
    if overflow not in OVERFLOWS:
        raise PrecsearchError(f"unknown overflow mode {overflow!r}: use one of {', '.join(OVERFLOWS)}")


@functools.lru_cache(maxsize=256)
def overflow_threshold(fmt: FloatFormat, rounding: str = "nearest") -> float:
    """The smallest float32 magnitude that rounds past ``fmt.max``: what the runtime counts as an overflow.

    Under stochastic rounding, any value above max (it may round up). Under nearest rounding, the midpoint
    between max and the next step up when that tie rounds up (ties away from zero, or ties to even where max's
    last kept bit is odd: its even neighbour is the step up), else the float32 after the midpoint; with
    float32's whole mantissa (M = 23) nothing rounds, so the float32 after max."""
    check_modes(rounding, fmt.default_overflow)
    if fmt.is_fp32:
        return math.inf
    top = float32_bits(fmt.max)
    if rounding == "stochastic" or fmt.man == 23:
        return _float32_of_bits(top + 1)
    midpoint = top + (1 << (22 - fmt.man))  # max plus half its step, exact in float32 (M <= 22)
    tie_rounds_up = rounding == "nearest_away" or (top >> (23 - fmt.man)) & 1
    return _float32_of_bits(midpoint if tie_rounds_up else midpoint + 1)


def _standard(exp: int, man: int, special: str = "ieee", name: str = "", shift: int = 0) -> FloatFormat:
    return FloatFormat(exp, man, 2 ** (exp - 1) - 1 + shift, special, name)


NAMED_FORMATS: dict[str, FloatFormat] = {fmt.name: fmt for fmt in (
    _standard(8, 23, name="fp32"), _standard(5, 10, name="fp16"), _standard(8, 7, name="bf16"),
    _standard(5, 2, name="fp8_e5m2"), _standard(4, 3, "fn", name="fp8_e4m3fn"), _standard(4, 3, name="fp8_e4m3"),
    _standard(3, 4, name="fp8_e3m4"), _standard(3, 2, "none", name="fp6_e3m2fn"),
    _standard(2, 3, "none", name="fp6_e2m3fn"), _standard(2, 1, "none", name="fp4_e2m1fn"))}

_SPEC_RE = re.compile(r"e(\d+)m(\d+)(?:b([+-]?\d+))?(fn|s)?")


@functools.lru_cache(maxsize=256)
def _parse(spec: str) -> FloatFormat:
    key = spec.strip().lower()
    if key in NAMED_FORMATS:
        return NAMED_FORMATS[key]
    match = _SPEC_RE.fullmatch(key)
    if not match:
        raise PrecsearchError(f"unknown float format {echo(spec)}: use a name ({', '.join(NAMED_FORMATS)}) or a spec "
                              f"{GRAMMAR}")
    exp, man, shift, suffix = int(match[1]), int(match[2]), int(match[3] or 0), match[4]
    if not (1 <= exp <= 8 and 0 <= man <= 23):
        raise PrecsearchError(f"format {echo(spec)}: E must be in 1..8 and M in 0..23 ({GRAMMAR})")
    special = {None: "ieee", "fn": "fn", "s": "none"}[suffix]
    return _standard(exp, man, special, shift=shift)


def get_format(spec: str | FloatFormat) -> FloatFormat:
    """A ``FloatFormat`` from a name (``fp8_e5m2``), a spec string (``e4m3b4s``) or a ``FloatFormat``."""
    return parsed(spec, FloatFormat, _parse, "float format must be a name, a spec string or a FloatFormat")


def parsed(spec: object, kind: type[T], parse: Callable[[str], T], what: str) -> T:
    """``spec`` itself where it is a ``kind``, a string's ``parse``, else refused as ``what``: one rule for every
    format a user may give by name or by value."""
    if isinstance(spec, kind):
        return spec
    if not isinstance(spec, str):
        raise PrecsearchError(f"{what}, not {echo(spec)}")
    return parse(spec)


def spec_name(value: object, where: str) -> str:
    """``value`` as a lower-case spec string after checking that it names a format; errors start with ``where``
    (config files store formats as the strings their users wrote)."""
    if isinstance(value, FloatFormat):
        return value.name
    if not isinstance(value, str):
        raise PrecsearchError(f"{where}: a format must be a string such as e4m3b4s or fp16, not {echo(value)}")
    try:
        get_format(value)
    except PrecsearchError as error:
        raise PrecsearchError(f"{where}: {error}") from None
    return value.strip().lower()
