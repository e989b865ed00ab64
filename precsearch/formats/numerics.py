"""Floating-point formats of any (E, M, bias, specials): rounding, bit packing and range statistics.

Every format here is simulated inside float32: ``quantize`` returns float32 tensors whose values all lie in
the format. That needs every value of the format to be a float32, so a format's normal range must sit inside
float32's normal range (min normal >= 2**-126, max <= float32 max); ``get_format`` rejects the others.

Special codes come in three families:

* ``ieee``: the top exponent code is reserved for inf (mantissa 0) and NaN (fp16, bf16, e5m2, ml_dtypes' e4m3).
* ``fn``: no inf; only the all-ones code is NaN (OCP's float8_e4m3fn).
* ``none``: every code is finite (QPyTorch and the Lee et al. reference code; also OCP's fp6/fp4, whose
  ``fn`` names mean "finite, no NaN").

Overflow semantics (``overflow=``) apply to finite values that round above the format's max:
``"inf"`` gives +-inf, ``"saturate"`` gives +-max, ``"nan"`` gives NaN. The default is ``"inf"`` for formats
with inf and ``"saturate"`` otherwise (torch's float8_e4m3fn cast saturates; ml_dtypes gives NaN: pass
``overflow="nan"`` for that). Infinite inputs stay infinite in formats that have inf; in the others they
follow the overflow mode. NaN stays NaN. Since the result is float32, ``"inf"`` and ``"nan"`` may be used
with any format (the Lee et al. reference lets gradients overflow to inf so the loss scaler reacts), but
``encode`` accepts only values the format can represent.

Rounding is round-half-to-even (``"nearest"``, IEEE, as every hardware cast), round-half-away-from-zero
(``"nearest_away"``: QPyTorch's and so the Lee et al. reference code's ties, to reproduce it bit for bit), or
stochastic (unbiased: the result is one of the two neighbours, rounding up
with probability proportional to the distance from the lower one), driven by a counter-based hash of the
element index and a seed drawn from a ``torch.Generator``, so results are reproducible and need no large
random tensor.

Kernels run under ``torch.compile`` (one fused pass each) for tensors of at least ``COMPILE_MIN_NUMEL`` elements
on CPU and for every tensor on an accelerator. A kernel whose compilation fails runs eagerly from then on, that
kernel alone, with one WARNING naming it and the reason; ``PRECSEARCH_COMPILE=0`` turns compiling off. The
kernels hold no integer constant outside int32 (Triton types scalar literals as int32). After the call that
compiles a kernel, later calls run Inductor's code directly, without TorchDynamo's per-call frame evaluation
(``_Compiled``): a training step makes hundreds of calls, most on small tensors.

``round_and_count`` is the runtime's one pass over a tensor: the rounded values, the count of values that
overflow the format, and optionally the format's codes of the result (for packed storage), all on the device,
so that a training step needs no host synchronisation per tensor.
"""

from __future__ import annotations

import functools
import logging
import math
import os
import re
import struct
import types
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import fx
from torch.utils._pytree import tree_flatten, tree_unflatten

from precsearch.config.spec import OVERFLOWS, ROUNDINGS
from precsearch.errors import PrecsearchError

__all__ = [
    "FloatFormat",
    "NAMED_FORMATS",
    "get_format",
    "quantize",
    "encode",
    "decode",
    "stats",
    "spec_name",
    "round_and_count",
    "round_and_count_fn",
    "overflow_threshold",
]

log = logging.getLogger(__name__)

SPECIALS = ("ieee", "fn", "none")
GRAMMAR = "e<E>m<M>[b<shift>][fn|s], 1 <= E <= 8, 0 <= M <= 23 (e.g. e5m2, e4m3b4s, e6m9s, e4m3fn)"
COMPILE_MIN_NUMEL = 1 << 14

_FP32_MAX = torch.finfo(torch.float32).max
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
            raise PrecsearchError(
                f"format {self.name}: its range (min normal {self.min_normal:.3g}, max {self.max:.3g}) leaves "
                "float32's normal range, so it cannot be simulated in float32; lower the bias shift or E"
            )

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

    def codes_hold_rounded(self, overflow: str) -> bool:
        """Whether this format's codes hold every value a rounding to it under ``overflow`` can give: it packs,
        has a NaN code, and an inf code unless overflow saturates (then only a NaN input leaves the grid)."""
        return self.packs and self.has_nan and (self.has_inf or overflow == "saturate")

    @property
    def storage_dtype(self) -> torch.dtype:
        if self.bits <= 8:
            return torch.uint8
        return torch.int16 if self.bits <= 16 else torch.int32


def _standard(exp: int, man: int, special: str = "ieee", name: str = "", shift: int = 0) -> FloatFormat:
    return FloatFormat(exp, man, 2 ** (exp - 1) - 1 + shift, special, name)


NAMED_FORMATS: dict[str, FloatFormat] = {
    fmt.name: fmt
    for fmt in (
        _standard(8, 23, name="fp32"),
        _standard(5, 10, name="fp16"),
        _standard(8, 7, name="bf16"),
        _standard(5, 2, name="fp8_e5m2"),
        _standard(4, 3, "fn", name="fp8_e4m3fn"),
        _standard(4, 3, name="fp8_e4m3"),
        _standard(3, 4, name="fp8_e3m4"),
        _standard(3, 2, "none", name="fp6_e3m2fn"),
        _standard(2, 3, "none", name="fp6_e2m3fn"),
        _standard(2, 1, "none", name="fp4_e2m1fn"),
    )
}

_SPEC_RE = re.compile(r"e(\d+)m(\d+)(?:b([+-]?\d+))?(fn|s)?")


@functools.lru_cache(maxsize=256)
def _parse(spec: str) -> FloatFormat:
    key = spec.strip().lower()
    if key in NAMED_FORMATS:
        return NAMED_FORMATS[key]
    match = _SPEC_RE.fullmatch(key)
    if not match:
        raise PrecsearchError(
            f"unknown float format {spec!r}: use a name ({', '.join(NAMED_FORMATS)}) or a spec {GRAMMAR}"
        )
    exp, man, shift, suffix = int(match[1]), int(match[2]), int(match[3] or 0), match[4]
    if not (1 <= exp <= 8 and 0 <= man <= 23):
        raise PrecsearchError(f"format {spec!r}: E must be in 1..8 and M in 0..23 ({GRAMMAR})")
    special = {None: "ieee", "fn": "fn", "s": "none"}[suffix]
    return _standard(exp, man, special, shift=shift)


def get_format(spec: str | FloatFormat) -> FloatFormat:
    """A ``FloatFormat`` from a name (``fp8_e5m2``), a spec string (``e4m3b4s``) or a ``FloatFormat``."""
    if isinstance(spec, FloatFormat):
        return spec
    if not isinstance(spec, str):
        raise PrecsearchError(f"float format must be a name, a spec string or a FloatFormat, not {spec!r}")
    return _parse(spec)


def spec_name(value: object, where: str) -> str:
    """``value`` as a lower-case spec string after checking that it names a format; errors start with ``where``.

    For config files (policies, search spaces) that store formats as the strings their users wrote.
    """
    if isinstance(value, FloatFormat):
        return value.name
    if not isinstance(value, str):
        raise PrecsearchError(f"{where}: a format must be a string such as e4m3b4s or fp16, not {value!r}")
    try:
        get_format(value)
    except PrecsearchError as error:
        raise PrecsearchError(f"{where}: {error}") from None
    return value.strip().lower()


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
            normal = (mag + ((mask >> 1) + ((mag >> drop) & 1))) & ~mask
            subnormal = ((mag.view(torch.float32) + magic) - magic).view(torch.int32)
        rounded = torch.where(mag < min_normal_bits, subnormal, normal)
        rounded = torch.where(rounded > key.max_bits, on_overflow, rounded)
        rounded = torch.where(mag >= keep_from, mag, rounded)
        return rounded | sign

    return kernel


_COMPILE = os.environ.get("PRECSEARCH_COMPILE", "1") != "0"
_INT32_LENGTHS = 2**31  # flat lengths a compiled kernel's direct call serves (the kernels may count in int32)
_PROBE_LENGTH = 4096  # values the first direct call is checked on (a copy of the start of the first input)
_failed: set[str] = set()  # labels of kernels whose compilation failed: they alone run eagerly
_ready: set[str] = set()  # labels of kernels compiled: they run compiled at any size


def _labelled(label: str, kernel):
    kernel.label = label
    return kernel


class _Compiled:
    """A kernel compiled by TorchDynamo and Inductor for any length, then called straight through Inductor's
    compiled code. Dynamo's frame evaluation, guards and wrappers cost about 35 us a call on a CPU, more than
    the kernel itself on a few thousand values, and a training step makes hundreds of calls; AOTAutograd's
    runtime wrappers cost about 5 us more, so the direct call is Inductor's own (``current_callable``), or
    else AOTAutograd's entry. A direct call is taken on a device once it gave, bit for bit, Dynamo's own
    result on a copy of the start of the input that compiled it there (results and writes over the inputs);
    otherwise that device stays on Dynamo's path, with one WARNING.

    The kernel runs under a code object of its own, so each format has its own compile cache entry (no
    recompiles, no recompile limit to raise) however many formats a process uses."""

    def __init__(self, kernel) -> None:
        own_code = kernel.__code__.replace(co_name=f"{kernel.__name__}_{id(kernel):x}")
        fresh = types.FunctionType(own_code, kernel.__globals__, own_code.co_name, kernel.__defaults__,
                                   kernel.__closure__)
        self.label = kernel.label
        self._arg_names = own_code.co_varnames[:own_code.co_argcount]
        self._dynamo = torch.compile(fresh, backend=self._capture, dynamic=False)
        self._captured: list[tuple[fx.GraphModule, list[Callable]]] = []
        self._direct: dict[torch.device, tuple | None] = {}

    def _capture(self, graph_module: fx.GraphModule, example_inputs: list) -> object:
        """Compiles Dynamo's graph with Inductor, keeping the ways to call it directly, innermost first: the
        code Inductor generated (when it compiled one graph) and AOTAutograd's entry; each takes a list."""
        from torch._inductor.compile_fx import compile_fx, compile_fx_inner

        generated = []

        def keep_generated(*args, **kwargs):
            code = compile_fx_inner(*args, **kwargs)
            generated.append(code)
            return code

        with torch._functorch.config.patch(enable_autograd_cache=False):  # a cache hit would skip Inductor's compile
            compiled = compile_fx(graph_module, example_inputs, inner_compile=keep_generated)
        innermost = [generated[0].current_callable] if len(generated) == 1 else []
        self._captured.append((graph_module, [*innermost, lambda inputs: compiled(*inputs)]))
        return compiled

    def __call__(self, flat: torch.Tensor, *args: torch.Tensor):
        flat = flat.contiguous()  # the compiled code takes unit strides (an expanded gradient has stride 0)
        if flat.requires_grad:  # an op's output rounded in place: one graph serves it and its detached probe
            flat = flat.detach()
        direct = self._direct.get(flat.device, ())
        if direct and flat.numel() < _INT32_LENGTHS:
            compiled, pick, unflatten = direct
            return unflatten(compiled(pick(flat, args)))
        verify = direct == () and flat.numel() < _INT32_LENGTHS
        probe = [flat[:_PROBE_LENGTH].clone(), *(a.clone() for a in args)] if verify else []  # before any write
        before = len(self._captured)
        result = self._through_dynamo(flat, *args)
        if verify:
            self._direct[flat.device] = self._verified(self._captured[before:], probe)
        return result

    def _through_dynamo(self, flat: torch.Tensor, *args: torch.Tensor):
        torch._dynamo.mark_dynamic(flat, 0)  # one compiled kernel serves every tensor size
        return self._dynamo(flat, *args)

    def _verified(self, captured: list, probe: list[torch.Tensor]) -> tuple | None:
        """(a direct call of the code Dynamo compiled, its inputs from the kernel's, its outputs to the
        kernel's) for the innermost direct call that, on a copy of the start of the first call's inputs
        (``probe``), gives what Dynamo gives on another copy, results and writes over the inputs alike; else
        None (logged once)."""
        reason = "Dynamo compiled no single graph" if len(captured) != 1 else ""
        if not reason:
            graph_module, direct_calls = captured[0]
            pick = self._input_picker(graph_module)
            if pick is None:
                reason = "the graph takes inputs other than the kernel's arguments and the tensor length"
        if not reason:
            by_dynamo = [t.clone() for t in probe]
            compiled_before = len(self._captured)
            expected = self._through_dynamo(*by_dynamo)
            leaves, spec = tree_flatten(expected)
            tensors = [leaf for leaf in leaves if leaf is not None]  # a None the kernel returns is no output
            if len(self._captured) != compiled_before:
                reason = "the graph does not serve every length (Dynamo compiled again for a shorter input)"
            else:
                for index, compiled in enumerate(direct_calls):
                    direct = [t.clone() for t in probe]
                    again = list(compiled(pick(direct[0], tuple(direct[1:]))))
                    if (len(again) == len(tensors) and all(map(_same_bits, again, tensors))
                            and all(map(_same_bits, direct, by_dynamo))):
                        if index or len(direct_calls) == 1:  # AOTAutograd's entry, the last candidate
                            log.warning("the %s kernel is called through AOTAutograd's wrappers on %s, about 5 us "
                                        "more a call: Inductor's own code %s", self.label, probe[0].device,
                                        "gave another result" if index else "was not at hand")
                        return compiled, pick, _unflattener(expected, leaves, spec)
                reason = "the compiled code called directly gave another result"
        log.warning("the %s kernel runs through TorchDynamo on %s, about 35 us more a call: %s",
                    self.label, probe[0].device, reason)
        return None

    def _input_picker(self, graph_module: fx.GraphModule):
        """How to make the graph's inputs from the kernel's arguments, or None where it takes anything else."""
        sources = []
        for node in graph_module.graph.find_nodes(op="placeholder"):
            if isinstance(node.meta.get("example_value"), torch.SymInt):
                sources.append(None)  # the flat tensor's length, the only dynamic size
            elif node.name.startswith("l_") and node.name[2:-1] in self._arg_names:
                sources.append(self._arg_names.index(node.name[2:-1]))
            else:
                return None

        def pick(flat: torch.Tensor, args: tuple) -> list:
            values = (flat, *args)
            return [flat.numel() if index is None else values[index] for index in sources]

        return pick


def _unflattener(result: object, leaves: list, spec: object):
    """Rebuilds a kernel's result from the compiled code's outputs (its tensors, Nones left out). Holds the
    positions of the Nones, not the leaves (they would stay alive); a tensor or a flat tuple, the kernels'
    results, without pytree's walk."""
    if isinstance(result, torch.Tensor):  # a decoder's
        return lambda outputs: outputs[0]
    is_none = [leaf is None for leaf in leaves]
    if isinstance(result, tuple) and len(result) == len(leaves):
        slots = []
        filled = 0
        for none in is_none:
            slots.append(None if none else filled)
            filled += not none
        return lambda outputs: tuple(None if slot is None else outputs[slot] for slot in slots)

    def unflatten(outputs: list) -> object:
        filled = iter(outputs)
        return tree_unflatten([None if none else next(filled) for none in is_none], spec)

    return unflatten


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    if a.dtype == torch.float32:
        a, b = a.view(torch.int32), b.view(torch.int32)
    return torch.equal(a, b)


@functools.lru_cache(maxsize=192)
def _compiled(kernel) -> _Compiled:
    return _Compiled(kernel)


def _run(kernel, flat: torch.Tensor, *args):
    """Run a kernel on a flat tensor: compiled, or eagerly once its compilation has failed. On CPU a kernel
    is first compiled for a tensor of ``COMPILE_MIN_NUMEL`` elements (a compilation costs seconds, which a
    few small tensors do not repay); once compiled, it serves every size (a compiled call on a thousand
    values costs a fifth of the eager one), sizes 0 and 1 excepted (they would need a compilation of their own).
    """
    unready = flat.device.type == "cpu" and flat.numel() < COMPILE_MIN_NUMEL and kernel.label not in _ready
    if not _COMPILE or unready or flat.numel() < 2 or kernel.label in _failed:
        return kernel(flat, *args)
    try:
        result = _compiled(kernel)(flat, *args)
        _ready.add(kernel.label)
        return result
    except Exception as error:  # any compiler failure: this kernel runs eagerly, visibly, from now on
        _failed.add(kernel.label)
        reason = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        log.warning("torch.compile failed for the %s kernel (%s): it runs eagerly from now on, several times "
                    "slower (a dozen passes over the tensor instead of one); other kernels stay compiled",
                    kernel.label, reason[:300])
        return kernel(flat, *args)


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

    return _labelled(_label(fmt, "quantize", rounding, overflow), quantize_kernel)


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
    return _run(_rounding_kernel(fmt, rounding, overflow), x.reshape(-1), seed).view(x.shape)


# ------------------------------------------------------------------------------------------ bit packing


def _wide_codes(fmt: FloatFormat, device: torch.device) -> bool:
    """Whether the kernels leave ``fmt``'s codes as int32, for aten to narrow: 16-bit codes on a CPU, where
    Inductor's C++ conversions between int16 and int32 are not vectorized (six times a uint8 one; aten's are)."""
    return fmt.storage_dtype == torch.int16 and device.type == "cpu"


def _narrow(codes: torch.Tensor | None, fmt: FloatFormat) -> torch.Tensor | None:
    return codes if codes is None or codes.dtype == fmt.storage_dtype else codes.to(fmt.storage_dtype)


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
    sign_extend = fmt.storage_dtype == torch.int16 and fmt.bits == 16

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
        return codes if wide else codes.to(fmt.storage_dtype), unencodable

    return codes_of


@functools.lru_cache(maxsize=64)
def _make_encoder(fmt: FloatFormat):
    """Round to nearest and assemble the format's bit pattern in one pass; also count unencodable values."""
    round_nearest = _make_kernel(_round_key(fmt, "nearest", fmt.default_overflow))
    codes_of = _code_builder(fmt)

    def encoder(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        codes, unencodable = codes_of(round_nearest(x, torch.zeros((), dtype=torch.int64, device=x.device)))
        return codes, (codes[:0] if unencodable is None else unencodable).sum()

    return _labelled(_label(fmt, "encode"), encoder)


def _count(mask: torch.Tensor) -> torch.Tensor:
    """How many of ``mask`` are true, as int64: summed in int32 where that cannot overflow (twice the vector
    width of an int64 sum on a CPU; a compiled kernel guards on the length, ``_Compiled``)."""
    if mask.numel() < _INT32_LENGTHS:
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
    return _labelled(_label(fmt, what, rounding, overflow), round_and_count_kernel)


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
            _, codes = _run(kernel_in_place, x.view(-1), seed, counts)
            codes = _narrow(codes, spec)
            return None, None if codes is None else _shaped(codes, x.shape), counts
        rounded, codes = _run(kernel, x.reshape(-1), seed, counts)
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

    return _labelled(_label(fmt, "decode"), decoder)


def encode(x: torch.Tensor, fmt: str | FloatFormat) -> torch.Tensor:
    """Bit patterns of ``x`` in ``fmt``: uint8 per element for <= 8 bits, int16 for <= 16, else int32.

    ``x`` is rounded to nearest first (with the format's default overflow), in the same pass; values the
    format cannot hold (inf without an inf code, NaN without a NaN code) raise ``PrecsearchError``.
    """
    fmt = get_format(fmt)
    x = _check_tensor(x)
    codes, unencodable = _run(_make_encoder(fmt), x.reshape(-1))
    codes = _narrow(codes, fmt)
    if unencodable.item():
        raise PrecsearchError(
            f"cannot encode inf/NaN in {fmt.name}, which has no such code: clamp or quantize the values first"
        )
    return codes.view(x.shape)


def decode(codes: torch.Tensor, fmt: str | FloatFormat) -> torch.Tensor:
    """float32 values of ``encode``'s bit patterns."""
    fmt = get_format(fmt)
    if codes.dtype != fmt.storage_dtype:
        raise TypeError(f"{fmt.name} codes must be {fmt.storage_dtype}, got {codes.dtype}")
    flat = codes.reshape(-1)
    return _run(_make_decoder(fmt), flat.to(torch.int32) if _wide_codes(fmt, flat.device) else flat).view(codes.shape)


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
