"""Rounding, bit packing and range statistics for any ``FloatFormat`` (precsearch.formats.format), on torch tensors.

``quantize`` rounds to a format and returns float32 (precsearch.formats.format says the special codes, overflow and
rounding modes); ``encode`` and ``decode`` turn values into bit patterns and back; ``round_and_count`` is the eager
runtime's one pass: the rounded values, the counts of values that overflow and of results the format has no code
for, and optionally the codes (for packed storage), all on the device: no host synchronisation per tensor.

The arithmetic is precsearch.formats.as_data's, the format a row of data; each kernel here is one pass over a
flat tensor for any format, run by precsearch.formats.runner's ``run_kernel`` (compiled by the default runtime's
runner). Codes are stored one per element in ``storage_dtype`` (uint8, int16 or int32 two's complement): the
public layout, and the eager runtime's.
"""

from __future__ import annotations

import functools
import logging
import math

import torch

from precsearch.errors import PrecsearchError
from precsearch.formats.as_data import decode_patterns, encode_patterns, format_row, nearest_in_floats, round_values
from precsearch.formats.format import FloatFormat, check_modes, get_format, overflow_threshold
from precsearch.formats.runner import labelled, run_kernel

__all__ = ["decode", "encode", "kernel_codes_dtype", "overflow_threshold", "quantize", "round_and_count",
           "round_and_count_fn", "stats", "storage_dtype"]

log = logging.getLogger(__name__)

_STORAGE_DTYPES = {1: torch.uint8, 2: torch.int16, 4: torch.int32}


def storage_dtype(fmt: FloatFormat) -> torch.dtype:
    """The integer dtype that holds ``fmt``'s codes (``FloatFormat.storage_bytes`` wide)."""
    return _STORAGE_DTYPES[fmt.storage_bytes]


def _check_tensor(x: torch.Tensor) -> torch.Tensor:
    if not isinstance(x, torch.Tensor) or not x.dtype.is_floating_point:
        got = x.dtype if isinstance(x, torch.Tensor) else type(x).__name__
        raise TypeError(f"expected a floating-point tensor, got {got}")
    if x.dtype == torch.float64:
        raise TypeError("float64 input would be rounded twice (to float32, then to the format): pass float32")
    return x if x.dtype == torch.float32 else x.float()


def kernel_codes_dtype(dtype: torch.dtype | None, device: torch.device) -> torch.dtype | None:
    """The dtype a kernel writes codes of ``dtype`` in: int32 for int16 on a CPU, narrowed by aten afterwards
    (Inductor's C++ conversions between int16 and int32 are not vectorized: six times a uint8 one; aten's are),
    so a 16-bit rounding with codes holds an int32 tensor of its size for a moment (the cost model's too)."""
    return torch.int32 if dtype == torch.int16 and device.type == "cpu" else dtype


@functools.lru_cache(maxsize=64)
def _round_kernel(rounding: str, in_floats: bool, codes: torch.dtype | None, in_place: bool):
    """One pass over a flat tensor for any format (its ``row``): the rounded values (written over ``x`` with
    ``in_place``, then None) and (``codes``) their bit patterns in that dtype; [overflowed, unencodable] is added
    to ``counts`` in the same pass (no kernel of its own)."""

    def round_and_count_kernel(x: torch.Tensor, row: torch.Tensor, seed: torch.Tensor, counts: torch.Tensor):
        rounded, overflowed = round_values(x, row, seed, rounding, in_floats)
        patterns, unencodable = None, torch.zeros_like(overflowed)
        if codes is not None:
            patterns, unencodable = encode_patterns(rounded, row)
            patterns = patterns.to(codes)
        counts.add_(torch.stack([overflowed.to(torch.int64), unencodable.to(torch.int64)]))
        if in_place:
            x.copy_(rounded)
            rounded = None
        return rounded, patterns

    what = ("round and count" + ("" if codes is None else f", {codes} codes".replace("torch.", ""))
            + (" in place" if in_place else ""))
    return labelled(f"{what} ({rounding}{', in floats' if in_floats else ''})", round_and_count_kernel)


@functools.lru_cache(maxsize=8)
def _decode_kernel(dtype: torch.dtype):
    """``decode_patterns`` for codes of one dtype (a compiled kernel is called without Dynamo's guards on its
    inputs, so each input dtype has a kernel of its own)."""

    def decode_kernel(codes: torch.Tensor, row: torch.Tensor) -> torch.Tensor:
        return decode_patterns(codes, row)

    return labelled(f"decode {dtype} codes".replace("torch.", ""), decode_kernel)


@functools.lru_cache(maxsize=256)
def _row(fmt: FloatFormat, rounding: str, overflow: str, device: torch.device) -> torch.Tensor:
    """``format_row`` made once per device (a training step rounds hundreds of tensors)."""
    return format_row(fmt, rounding, overflow, device)


@functools.lru_cache(maxsize=16)
def _zero_seed(device: torch.device) -> torch.Tensor:
    return torch.zeros((), dtype=torch.int64, device=device)


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
    same pass (no new float32 tensor; a non-contiguous ``x`` is copied back) and ``fn`` returns None for them.
    ``with_codes`` gives codes for a format that packs (``FloatFormat.packs``), None for the others."""
    spec = get_format(fmt)
    if spec.is_fp32:
        raise PrecsearchError("round_and_count: fp32 needs no rounding; keep the tensor as it is")
    check_modes(rounding, overflow)
    dtype = storage_dtype(spec) if with_codes and spec.packs else None
    in_floats = rounding == "nearest" and nearest_in_floats(spec)  # else round_values works on bit patterns
    prepared: dict[tuple[torch.device, bool], tuple] = {}  # (kernel, row) by device and in-place: a per-call hot path

    def fn(x: torch.Tensor, seed: torch.Tensor | None, counts: torch.Tensor | None = None):
        device = x.device
        seed = _zero_seed(device) if seed is None else seed
        counts = torch.zeros(2, dtype=torch.int64, device=device) if counts is None else counts
        written = in_place and x.is_contiguous()
        kernel_row = prepared.get((device, written))
        if kernel_row is None:
            kernel_row = prepared[device, written] = (
                _round_kernel(rounding, in_floats, kernel_codes_dtype(dtype, device), written),
                _row(spec, rounding, overflow, device))
        kernel, row = kernel_row
        rounded, codes = run_kernel(kernel, x.view(-1) if written else x.reshape(-1), row, seed, counts)
        if codes is not None:
            # shaped as x without being views of the flat outputs: a caller may modify them in place
            # (ReLU(inplace) on a view of an autograd Function's output is refused)
            codes = _shaped(codes.to(dtype), x.shape)
        if written:
            return None, codes, counts
        rounded = _shaped(rounded, x.shape)
        if in_place:
            _warn_copied_back(kernel.label)
            x.copy_(rounded)
            rounded = None
        return rounded, codes, counts

    return fn


def round_and_count(x: torch.Tensor, fmt: str | FloatFormat, rounding: str = "nearest", overflow: str | None = None,
                    *, seed: torch.Tensor | None = None, with_codes: bool = False
                    ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """``quantize(x, ...)``, the format's codes of the result (``with_codes``, else None), and an int64
    tensor ``[overflowed, unencodable]`` on ``x``'s device: how many values of ``x`` lie at or past
    ``overflow_threshold`` (NaN excluded), and how many results the format has no code for (inf or NaN in a
    format without them). One kernel when compiled, and no host synchronisation. ``seed`` (an int64 tensor
    on ``x``'s device) drives stochastic rounding; nearest ignores it."""
    x = _check_tensor(x)
    fmt = get_format(fmt)
    return round_and_count_fn(fmt.name, rounding, overflow or fmt.default_overflow, with_codes)(x, seed)


def quantize(x: torch.Tensor, fmt: str | FloatFormat, rounding: str = "nearest", overflow: str | None = None,
             generator: torch.Generator | None = None) -> torch.Tensor:
    """Round ``x`` to the nearest value of ``fmt`` (or stochastically, the seed drawn from ``generator``),
    returned as float32. fp32 returns ``x`` itself (float32 input) so that high-precision tensors are untouched."""
    fmt = get_format(fmt)
    x = _check_tensor(x)
    overflow = overflow or fmt.default_overflow
    check_modes(rounding, overflow)
    if fmt.is_fp32:
        return x
    seed = None
    if rounding == "stochastic":
        device = generator.device if generator is not None else "cpu"
        seed = torch.randint(0, 2**31 - 1, (), generator=generator, device=device, dtype=torch.int64).to(x.device)
    return round_and_count_fn(fmt.name, rounding, overflow, False)(x, seed)[0]


def encode(x: torch.Tensor, fmt: str | FloatFormat) -> torch.Tensor:
    """Bit patterns of ``x`` in ``fmt`` (``storage_dtype``: uint8 per element for <= 8 bits, int16 for <= 16, else
    int32), rounded to nearest first (the format's default overflow) in the same pass; values the format cannot
    hold (inf without an inf code, NaN without a NaN code) raise ``PrecsearchError``."""
    fmt = get_format(fmt)
    x = _check_tensor(x)
    device, dtype = x.device, storage_dtype(fmt)
    row = _row(fmt, "nearest", fmt.default_overflow, device)
    counts = torch.zeros(2, dtype=torch.int64, device=device)
    kernel = _round_kernel("nearest", nearest_in_floats(fmt), kernel_codes_dtype(dtype, device), False)
    _, codes = run_kernel(kernel, x.reshape(-1), row, _zero_seed(device), counts)
    if counts[1].item():
        raise PrecsearchError(f"cannot encode inf/NaN in {fmt.name}, which has no such code: clamp or quantize the "
                              "values first")
    return codes.to(dtype).view(x.shape)


def decode(codes: torch.Tensor, fmt: str | FloatFormat) -> torch.Tensor:
    """float32 values of ``encode``'s bit patterns."""
    fmt = get_format(fmt)
    if codes.dtype != storage_dtype(fmt):
        raise TypeError(f"{fmt.name} codes must be {storage_dtype(fmt)}, got {codes.dtype}")
    flat = codes.reshape(-1)
    flat = flat.to(torch.int32) if kernel_codes_dtype(codes.dtype, flat.device) != codes.dtype else flat
    row = _row(fmt, "nearest", fmt.default_overflow, flat.device)
    return run_kernel(_decode_kernel(flat.dtype), flat, row).view(codes.shape)


# ------------------------------------------------------------------------------------------- statistics


def stats(x: torch.Tensor, fmt: str | FloatFormat) -> dict[str, float]:
    """Fractions of ``x`` that overflow ``fmt`` (finite values that round above max, and infinite ones), underflow
    (nonzero values that round to zero), land on a nonzero subnormal, or are NaN, under nearest rounding."""
    fmt = get_format(fmt)
    x = _check_tensor(x)
    n = max(x.numel(), 1)
    if fmt.is_fp32:
        return {"overflow": 0.0, "underflow": 0.0, "subnormal": 0.0, "nan": float(x.isnan().sum()) / n}
    mag = quantize(x.abs(), fmt, overflow="inf")
    absx = x.abs()
    counts = {"overflow": (mag == math.inf).sum(), "underflow": ((mag == 0) & (absx > 0)).sum(),
              "subnormal": ((mag > 0) & (mag < fmt.min_normal)).sum(), "nan": x.isnan().sum()}
    return {key: float(value) / n for key, value in counts.items()}
