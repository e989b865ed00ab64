"""precsearch.formats.as_data's two roundings against each other (bit patterns and float32 arithmetic), Inductor's
code against eager torch, and its byte layout of codes against the storage dtypes of precsearch.formats.kernels.
Its values against independent oracles (ml_dtypes, torch's casts, a Python reference): tests/test_formats.py,
through kernels, whose arithmetic it is."""

from __future__ import annotations

import pytest
import torch

from precsearch.formats import kernels
from precsearch.formats.as_data import (
    code_bytes,
    decode_codes,
    encode_codes,
    format_row,
    nearest_in_floats,
    round_nearest,
    round_with,
)
from precsearch.formats.format import get_format

FORMATS = ("e5m2", "e4m3b4s", "e5m2s", "e6m9s", "fp16", "bf16", "fp8_e4m3fn", "e3m2s", "e2m1s", "e3m0", "e7m0s",
           "e5m22", "e5m23", "e8m0")


def probe(fmt: str) -> torch.Tensor:
    """Random float32 bit patterns over the whole range, the format's exact ties in its normal and subnormal
    ranges, values around its max, and +-0, +-inf, NaN and float32 subnormals."""
    spec = get_format(fmt)
    bits = torch.randint(-(2**31), 2**31 - 1, (3000,), generator=torch.Generator().manual_seed(0), dtype=torch.int64)
    random = bits.to(torch.int32).view(torch.float32)
    random = random[~random.isnan()]
    odd = torch.arange(1, 40, 2, dtype=torch.float64)
    normal_ties = (1 + odd * 2.0 ** -(spec.man + 1)) * 2.0 ** min(spec.emin + 1, spec.emax)
    subnormal_ties = odd * 2.0 ** (spec.emin - spec.man - 1)
    top = torch.tensor([spec.max, spec.max * (1 + 2.0 ** -(spec.man + 2)), spec.max * 1.5, spec.max * 4],
                       dtype=torch.float64)
    special = torch.tensor([0.0, float("inf"), float("nan"), 1e-45, 1e-40, 3e38])
    values = torch.cat([random, normal_ties.float(), subnormal_ties.float(), top.clamp(max=3.4e38).float(), special])
    return torch.cat([values, -values])


@pytest.mark.parametrize("fmt", [fmt for fmt in FORMATS if nearest_in_floats(fmt)])
def test_round_nearest_in_floats_gives_the_bit_patterns_rounding(fmt: str) -> None:
    x = probe(fmt)
    for overflow in ("inf", "saturate", "nan"):
        row = format_row(fmt, "nearest", overflow)
        expected, expected_overflowed = round_with(x, row, torch.tensor(0), "nearest")
        got, overflowed = round_nearest(x, row)
        assert torch.equal(got.view(torch.int32), expected.view(torch.int32)), overflow
        assert int(overflowed) == int(expected_overflowed), overflow


def test_an_fp32_row_keeps_every_value_and_counts_nothing() -> None:
    x = probe("e5m2")
    got, overflowed = round_with(x, format_row("fp32"), torch.tensor(0), "nearest")
    assert torch.equal(got.view(torch.int32), x.view(torch.int32))
    assert int(overflowed) == 0


@pytest.mark.slow
def test_round_with_compiled_by_inductor_gives_eager_torchs_bits() -> None:
    """Inductor's code for ``round_with`` against eager torch: one graph per rounding serves every row."""
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    compiled = torch.compile(round_with, fullgraph=True, dynamic=False)
    x = probe("e4m3b4s")
    for fmt, rounding, overflow in [("e4m3b4s", "stochastic", "saturate"), ("e5m2", "stochastic", "inf"),
                                    ("fp16", "nearest_away", "nan"), ("e3m0", "nearest_away", "inf")]:
        seed = torch.tensor(7, dtype=torch.int64)
        row = format_row(fmt, rounding, overflow)
        expected, expected_overflowed = round_with(x, row, seed, rounding)
        got, overflowed = compiled(x, row, seed, rounding)
        assert torch.equal(got.view(torch.int32), expected.view(torch.int32)), fmt
        assert int(overflowed) == int(expected_overflowed), fmt
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 2


@pytest.mark.parametrize("fmt", ["e4m3b4s", "e5m2s", "e6m9s", "bf16", "e2m1s"])
def test_round_nearest_gives_the_bit_patterns_rounding_for_every_float32_of_three_binades(fmt: str) -> None:
    """Every float32 (both signs) of the binade at 1, of the one below the format's min normal (its subnormal
    quanta) and of the top of its range (bf16: 2**126, where the split works 2**64 smaller), against
    ``round_with``: every tie and every carry of the float32 split."""
    spec = get_format(fmt)
    row = format_row(fmt, "nearest", "inf")
    for exponent in (0, spec.emin - 1, min(spec.emax, 126)):
        start = (exponent + 127) << 23
        x = torch.arange(start, start + (1 << 23), dtype=torch.int32).view(torch.float32)
        x = torch.cat([x, -x])
        expected, expected_overflowed = round_with(x, row, torch.tensor(0), "nearest")
        got, overflowed = round_nearest(x, row)
        assert torch.equal(got.view(torch.int32), expected.view(torch.int32)), exponent
        assert int(overflowed) == int(expected_overflowed), exponent


CODED = [fmt for fmt in FORMATS if get_format(fmt).bits <= 16] + ["e1m6s", "e3m12s", "e4m3b4"]


def _every_code(fmt: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Every bit pattern of ``fmt``: in the kernels' storage dtype (uint8 up to 8 bits; int16 up to 16, as two's
    complement), and as ``encode_codes`` writes them (uint8; 16-bit patterns as a low and a high byte plane)."""
    spec = get_format(fmt)
    patterns = torch.arange(2**spec.bits, dtype=torch.int64)
    if code_bytes(spec) == 1:
        return patterns.to(torch.uint8), patterns.to(torch.uint8)
    stored = torch.where(patterns >= 2**15, patterns - 2**16, patterns).to(torch.int16)
    return stored, torch.stack([patterns & 0xFF, patterns >> 8]).to(torch.uint8)


@pytest.mark.parametrize("fmt", CODED)
def test_byte_codes_hold_the_storage_dtypes_codes_for_every_value(fmt: str) -> None:
    """The compiled step's byte layout (uint8; 16 bits as two byte planes) and float decoding against
    ``kernels``' storage dtypes (int16 two's complement) and bit-pattern decoding: ``decode_codes`` of every bit
    pattern gives the float32 of ``kernels.decode`` (bit for bit; NaN as NaN; those values are tested against
    the format's own table in test_formats.py), and
    ``encode_codes`` of them gives the byte patterns back (a NaN: a NaN code), counting none as unencodable."""
    stored, codes = _every_code(fmt)
    row, nbytes = format_row(fmt), code_bytes(fmt)
    values = kernels.decode(stored, fmt)
    decoded = decode_codes(codes, row, nbytes)
    nan = values.isnan()
    assert torch.equal(decoded.isnan(), nan)
    assert torch.equal(decoded[~nan].view(torch.int32), values[~nan].view(torch.int32))
    encoded, unencodable = encode_codes(values, row, nbytes)
    assert encoded.dtype == torch.uint8 and encoded.shape == codes.shape and int(unencodable) == 0
    assert torch.equal(encoded[..., ~nan], codes[..., ~nan])
    assert bool(decode_codes(encoded[..., nan], row, nbytes).isnan().all())


@pytest.mark.parametrize(("fmt", "unencodable"), [("e4m3b4s", 4), ("fp8_e4m3fn", 2), ("e5m2", 0)])
def test_values_without_a_code_are_counted_and_saved_as_the_largest_magnitude(fmt: str, unencodable: int) -> None:
    """inf and NaN in a format without them (``s``: neither; ``fn``: no inf) are counted, and decode to the
    format's largest magnitude with their sign (fn's NaN keeps its code); an IEEE-like format codes them all."""
    spec = get_format(fmt)
    x = torch.tensor([float("inf"), -float("inf"), float("nan"), -float("nan"), 1.0, -0.0])
    row = format_row(fmt)
    codes, counted = encode_codes(x, row, code_bytes(fmt))
    back = decode_codes(codes, row, code_bytes(fmt))
    assert int(counted) == unencodable
    assert torch.equal(back[4:].view(torch.int32), x[4:].view(torch.int32))
    if spec.has_inf:
        assert back[0] == float("inf") and back[1] == -float("inf") and bool(back[2:4].isnan().all())
    else:
        assert back[0] == spec.max and back[1] == -spec.max
        assert bool(back[2:4].isnan().all()) if spec.has_nan else bool((back[2:4].abs() == spec.max).all())


@pytest.mark.slow
def test_codes_as_data_compiled_by_inductor_are_the_eager_ones() -> None:
    """Inductor's vector code (log2, exp2, float products) gives the same patterns and values as eager torch,
    for every pattern of the paper's formats."""
    encode = torch.compile(encode_codes, backend="inductor", fullgraph=True, dynamic=False)
    decode = torch.compile(decode_codes, backend="inductor", fullgraph=True, dynamic=False)
    for fmt in ("e4m3b4s", "e5m2s", "e6m9s"):
        (stored, codes), row, nbytes = _every_code(fmt), format_row(fmt), code_bytes(fmt)
        values = kernels.decode(stored, fmt)
        assert torch.equal(decode(codes, row, nbytes).view(torch.int32), values.view(torch.int32))
        assert torch.equal(encode(values, row, nbytes)[0], codes)
