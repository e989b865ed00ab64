"""precsearch.formats.as_data (rounding with the format as data) against the per-format kernels of
precsearch.formats.kernels, themselves tested against ml_dtypes and torch's casts (test_formats.py)."""

from __future__ import annotations

import itertools

import pytest
import torch

from precsearch.formats import kernels
from precsearch.formats.as_data import (
    RoundWithGradient,
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


@pytest.mark.parametrize("fmt", FORMATS)
def test_round_with_gives_the_format_kernels_values_and_counts(fmt: str) -> None:
    x = probe(fmt)
    for rounding, overflow in itertools.product(("nearest", "nearest_away", "stochastic"), ("inf", "saturate", "nan")):
        seed = torch.tensor(12345, dtype=torch.int64)
        expected, _, counts = kernels.round_and_count(x, fmt, rounding, overflow, seed=seed)
        for constant in (None, rounding):  # the rounding read from the row, or a constant of the graph
            got, overflowed = round_with(x, format_row(fmt, rounding, overflow), seed, constant)
            assert torch.equal(got.view(torch.int32), expected.view(torch.int32)), (rounding, overflow, constant)
            assert int(overflowed) == int(counts[0]), (rounding, overflow, constant)
        if rounding == "nearest" and nearest_in_floats(fmt):
            got, overflowed = round_nearest(x, format_row(fmt, rounding, overflow))
            assert torch.equal(got.view(torch.int32), expected.view(torch.int32)), ("round_nearest", overflow)
            assert int(overflowed) == int(counts[0]), ("round_nearest", overflow)


def test_an_fp32_row_keeps_every_value_and_counts_nothing() -> None:
    x = probe("e5m2")
    got, overflowed = round_with(x, format_row("fp32"), torch.tensor(0))
    assert torch.equal(got.view(torch.int32), x.view(torch.int32))
    assert int(overflowed) == 0


def test_one_compiled_graph_serves_every_assignment() -> None:
    """Forward and backward through ``RoundWithGradient`` compiled once (fullgraph), then run under four
    assignments (formats, roundings, overflow modes, fp32 among them): each gives the per-format kernels'
    rounded value, gradient and gradient overflow count, and Dynamo made one graph in all."""
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    weight = torch.randn(20, 30, generator=torch.Generator().manual_seed(1))

    def loss_of(x, row, seed, grad_row, grad_seed, counter):
        rounded, overflowed = RoundWithGradient.apply(x @ weight, row, seed, grad_row, grad_seed, counter)
        return rounded, overflowed, (rounded * 1e5).relu().sum()

    compiled = torch.compile(loss_of, backend="eager", fullgraph=True)
    assignments = [("e4m3b4s", "nearest", "saturate", "e5m2s", "stochastic", "saturate"),
                   ("fp16", "nearest_away", "inf", "e5m2", "nearest", "inf"),
                   ("fp32", "nearest", "inf", "e6m9s", "stochastic", "nan"),
                   ("e5m2", "stochastic", "nan", "fp32", "nearest", "inf")]
    seen_overflow = []
    for fmt, rounding, overflow, grad_fmt, grad_rounding, grad_overflow in assignments:
        x = torch.randn(64, 20, generator=torch.Generator().manual_seed(2), requires_grad=True)
        counter = torch.zeros((), dtype=torch.float64, requires_grad=True)
        seed, grad_seed = torch.tensor(3), torch.tensor(5)
        rounded, overflowed, loss = compiled(x, format_row(fmt, rounding, overflow), seed,
                                             format_row(grad_fmt, grad_rounding, grad_overflow), grad_seed, counter)
        loss.backward()
        product = (x @ weight).detach()
        expected, counts = product, torch.zeros(2, dtype=torch.int64)
        if fmt != "fp32":
            expected, _, counts = kernels.round_and_count(product, fmt, rounding, overflow, seed=seed)
        upstream = (expected > 0).float() * 1e5
        grad, grad_counts = upstream, torch.zeros(2, dtype=torch.int64)
        if grad_fmt != "fp32":
            grad, _, grad_counts = kernels.round_and_count(upstream, grad_fmt, grad_rounding, grad_overflow,
                                                           seed=grad_seed)
        assert torch.equal(rounded.view(torch.int32), expected.view(torch.int32)), fmt
        assert int(overflowed) == int(counts[0])
        torch.testing.assert_close(x.grad, grad @ weight.T, rtol=0, atol=0, equal_nan=True)  # inf grads: NaN
        assert counter.grad.item() == int(grad_counts[0]), grad_fmt
        seen_overflow.append(int(grad_counts[0]))
    assert max(seen_overflow) > 0  # some gradient did overflow: the counts were put to the test
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 1


@pytest.mark.slow
def test_round_with_compiled_by_inductor_gives_the_kernels_bits() -> None:
    """Inductor's code for ``round_with`` (one graph for three rows) against the per-format kernels."""
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    compiled = torch.compile(round_with, fullgraph=True, dynamic=False)
    x = probe("e4m3b4s")
    for fmt, rounding, overflow in [("e4m3b4s", "stochastic", "saturate"), ("e5m2", "nearest", "inf"),
                                    ("fp16", "nearest_away", "nan")]:
        seed = torch.tensor(7, dtype=torch.int64)
        expected, _, counts = kernels.round_and_count(x, fmt, rounding, overflow, seed=seed)
        got, overflowed = compiled(x, format_row(fmt, rounding, overflow), seed)
        assert torch.equal(got.view(torch.int32), expected.view(torch.int32)), fmt
        assert int(overflowed) == int(counts[0]), fmt
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 1


@pytest.mark.parametrize("fmt", ["e4m3b4s", "e5m2s", "e6m9s", "bf16", "e2m1s"])
def test_round_nearest_gives_the_kernels_bits_for_every_float32_of_three_binades(fmt: str) -> None:
    """Every float32 (both signs) of the binade at 1, of the one below the format's min normal (its subnormal
    quanta) and of the top of its range (bf16: 2**126, where the split works 2**64 smaller), against the
    per-format kernel: every tie and every carry of the float32 split."""
    spec = get_format(fmt)
    row = format_row(fmt, "nearest", "inf")
    for exponent in (0, spec.emin - 1, min(spec.emax, 126)):
        start = (exponent + 127) << 23
        x = torch.arange(start, start + (1 << 23), dtype=torch.int32).view(torch.float32)
        x = torch.cat([x, -x])
        expected, _, counts = kernels.round_and_count(x, fmt, "nearest", "inf")
        got, overflowed = round_nearest(x, row)
        assert torch.equal(got.view(torch.int32), expected.view(torch.int32)), exponent
        assert int(overflowed) == int(counts[0]), exponent


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
def test_codes_as_data_are_the_kernels_codes_for_every_value(fmt: str) -> None:
    """``decode_codes`` of every bit pattern of the format gives the float32 of ``kernels.decode`` (bit for bit;
    NaN as NaN), and ``encode_codes`` of those values gives the patterns back (a NaN: the format's NaN code
    decodes to NaN), counting none as unencodable."""
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
