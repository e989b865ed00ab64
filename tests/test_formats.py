"""precsearch.formats (format, kernels, compiled) against independent oracles: torch's casts, ml_dtypes, hand
tables, and a pure-Python enumeration of each format's values from its definition."""

from __future__ import annotations

import ast
import bisect
import inspect
import itertools
import math

import ml_dtypes
import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from precsearch.errors import PrecsearchError
from precsearch.formats import as_data, kernels
from precsearch.formats.as_data import format_row
from precsearch.formats.format import NAMED_FORMATS, get_format, spec_name
from precsearch.formats.kernels import decode, encode, quantize, stats, storage_dtype
from precsearch.formats.runner import (
    COMPILE_MIN_NUMEL,
    Compiled,
    KernelRunner,
    KernelSettings,
    Runtime,
    default_runtime,
    labelled,
)

# ------------------------------------------------------------------------------------------ test values


def same(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Element-wise: equal values with equal signs (so -0 != +0), or both NaN."""
    return ((a == b) & (a.signbit() == b.signbit())) | (a.isnan() & b.isnan())


def _eagerly():
    """A runtime of its own whose kernels run eagerly, the default for a ``with`` block."""
    return Runtime(KernelRunner(KernelSettings(enabled=False))).as_default()


def mismatches(a: torch.Tensor, b: torch.Tensor) -> int:
    return int((~same(a, b)).sum())


def probe_values(format_values: np.ndarray, n_random: int = 200_000, seed: int = 0) -> torch.Tensor:
    """Every value of a format, the midpoints between neighbours (exact ties), one float32 ulp either side of
    each value and midpoint, values just past max, random values across every binade, +-0, +-inf and NaN."""
    vals = np.unique(np.abs(format_values[np.isfinite(format_values)]).astype(np.float64))
    mids = (vals[:-1] + vals[1:]) / 2
    top = vals[-1]
    step = vals[-1] - vals[-2]
    beyond = np.array([top + step / 2, top + step / 4, top + 3 * step / 4, top + step, 2 * top, 1e30])
    with np.errstate(over="ignore"):  # past-max probes of bf16 overflow float32 to inf: intended
        centre = np.concatenate([vals, mids, beyond]).astype(np.float32)
    up = np.nextafter(centre, np.float32(np.inf))
    down = np.nextafter(centre, np.float32(0))
    rng = np.random.default_rng(seed)
    lo, hi = math.log2(vals[1]) - 3, math.log2(top) + 2
    with np.errstate(over="ignore"):
        rand = (2.0 ** rng.uniform(lo, hi, n_random)).astype(np.float32)
    specials = np.array([0.0, np.inf, np.nan], dtype=np.float32)
    allv = np.concatenate([centre, up, down, rand, specials])
    return torch.from_numpy(np.concatenate([allv, -allv]))


ML_DTYPES = {
    # our name: (ml_dtypes type, overflow mode matching ml_dtypes, NaN handled by ml_dtypes as NaN)
    "fp8_e5m2": (ml_dtypes.float8_e5m2, None, True),
    "fp8_e4m3fn": (ml_dtypes.float8_e4m3fn, "nan", True),
    "fp8_e4m3": (ml_dtypes.float8_e4m3, None, True),
    "fp8_e3m4": (ml_dtypes.float8_e3m4, None, True),
    "fp6_e3m2fn": (ml_dtypes.float6_e3m2fn, None, False),
    "fp6_e2m3fn": (ml_dtypes.float6_e2m3fn, None, False),
    "fp4_e2m1fn": (ml_dtypes.float4_e2m1fn, None, False),
    "bf16": (ml_dtypes.bfloat16, None, True),
}

TORCH_DTYPES = {
    "fp16": torch.float16,
    "bf16": torch.bfloat16,
    "fp8_e5m2": torch.float8_e5m2,
}


def all_ml_values(dtype) -> np.ndarray:
    n_bits = np.dtype(dtype).itemsize * 8
    codes = np.arange(2**n_bits, dtype=np.uint16 if n_bits == 16 else np.uint8)
    return codes.view(dtype).astype(np.float32)


# ----------------------------------------------------------------------------------- format properties


@pytest.mark.parametrize("name", list(ML_DTYPES))
def test_named_format_ranges_match_ml_dtypes(name):
    fmt = get_format(name)
    info = ml_dtypes.finfo(ML_DTYPES[name][0])
    assert fmt.max == float(info.max)
    assert fmt.min_normal == float(info.smallest_normal)
    assert fmt.min_subnormal == float(info.smallest_subnormal)
    assert fmt.bits == info.bits
    has_inf = bool(np.isinf(all_ml_values(ML_DTYPES[name][0])).any())
    assert fmt.has_inf == has_inf


@pytest.mark.parametrize(
    ("spec", "bits", "max_", "min_normal", "min_subnormal", "has_inf", "has_nan"),
    [
        # Hand-computed: (1,5,2) with every code finite, bias 15: top code 31 -> 2^16 * 1.75.
        ("e5m2s", 8, 114688.0, 2.0**-14, 2.0**-16, False, False),
        # (1,4,3), bias 7 + 4 = 11: max 2^(15-11) * 1.875 = 30, min normal 2^-10, min subnormal 2^-13.
        ("e4m3b4s", 8, 30.0, 2.0**-10, 2.0**-13, False, False),
        # (1,6,9), bias 31: max 2^32 * (2 - 2^-9), min normal 2^-30, min subnormal 2^-39.
        ("e6m9s", 16, 2.0**32 * (2 - 2.0**-9), 2.0**-30, 2.0**-39, False, False),
        # IEEE-like e5m2: top code reserved, max 2^15 * 1.75.
        ("e5m2", 8, 57344.0, 2.0**-14, 2.0**-16, True, True),
        ("fp32", 32, float(torch.finfo(torch.float32).max), 2.0**-126, 2.0**-149, True, True),
        ("fp16", 16, 65504.0, 2.0**-14, 2.0**-24, True, True),
    ],
)
def test_format_ranges_hand_table(spec, bits, max_, min_normal, min_subnormal, has_inf, has_nan):
    fmt = get_format(spec)
    assert (fmt.bits, fmt.max, fmt.min_normal, fmt.min_subnormal) == (bits, max_, min_normal, min_subnormal)
    assert (fmt.has_inf, fmt.has_nan) == (has_inf, has_nan)


def test_get_format_accepts_name_spec_and_format():
    fmt = get_format("e4m3b4s")
    assert get_format(fmt) is fmt
    assert get_format("E4M3B4S") == fmt
    assert (fmt.exp, fmt.man, fmt.bias) == (4, 3, 11)
    assert str(fmt) == "e4m3b4s"
    assert get_format("e5m2") == get_format("fp8_e5m2").__class__(5, 2, 15, "ieee", "e5m2")
    assert get_format("e4m3fn").max == get_format("fp8_e4m3fn").max == 448.0
    assert (get_format("fp8_e4m3fn").storage_bytes, storage_dtype(get_format("fp8_e4m3fn"))) == (1, torch.uint8)
    assert (get_format("e6m9s").storage_bytes, storage_dtype(get_format("e6m9s"))) == (2, torch.int16)


# ---------------------------------------------------------------------------------- bit-exact vs oracles


@pytest.mark.parametrize("name", list(TORCH_DTYPES))
def test_quantize_bit_exact_against_torch_cast(name):
    dtype = TORCH_DTYPES[name]
    n_bits = torch.finfo(dtype).bits
    codes = torch.arange(2**n_bits, dtype=torch.int32).to(torch.int16 if n_bits == 16 else torch.uint8)
    values = codes.view(dtype).float().numpy()
    x = probe_values(values, n_random=400_000)
    assert x.numel() >= 1_000_000 or n_bits == 8
    assert mismatches(quantize(x, name), x.to(dtype).float()) == 0


def test_e4m3fn_saturates_like_torch_and_gives_nan_like_ml_dtypes():
    x = probe_values(all_ml_values(ml_dtypes.float8_e4m3fn))
    # torch's cast saturates past the max from torch 2.13 (2.11's gave NaN): clamped first, the same oracle on both
    torch_ref = x.clamp(-448.0, 448.0).to(torch.float8_e4m3fn).float()
    assert mismatches(quantize(x, "fp8_e4m3fn"), torch_ref) == 0
    assert mismatches(quantize(x, "fp8_e4m3fn", overflow="saturate"), torch_ref) == 0
    ml_ref = torch.from_numpy(x.numpy().astype(ml_dtypes.float8_e4m3fn).astype(np.float32))
    assert mismatches(quantize(x, "fp8_e4m3fn", overflow="nan"), ml_ref) == 0
    # The two semantics really differ past max: 470 -> 448 (torch) or NaN (ml_dtypes); 464 is a tie -> 448.
    probe = torch.tensor([470.0, 464.0, math.inf])
    assert quantize(probe, "fp8_e4m3fn").tolist() == [448.0, 448.0, 448.0]
    assert quantize(probe, "fp8_e4m3fn", overflow="nan")[1].item() == 448.0
    assert quantize(probe, "fp8_e4m3fn", overflow="nan")[[0, 2]].isnan().all()


@pytest.mark.parametrize("name", list(ML_DTYPES))
def test_quantize_bit_exact_against_ml_dtypes(name):
    dtype, overflow, nan_ok = ML_DTYPES[name]
    x = probe_values(all_ml_values(dtype))
    if not nan_ok:
        # ml_dtypes maps NaN to -0 in formats without a NaN code; float32 output keeps NaN here (documented).
        x = x[~x.isnan()]
    ref = torch.from_numpy(x.numpy().astype(dtype).astype(np.float32))
    assert mismatches(quantize(x, name, overflow=overflow), ref) == 0


def test_probe_volume_is_over_a_million_values():
    total = sum(probe_values(all_ml_values(d)).numel() for d, _, _ in ML_DTYPES.values())
    assert total >= 1_000_000


# ------------------------------------------------------------------------- no-special-codes hand tables

HAND_ROUNDING = [
    # (spec, input, expected) worked out by hand from the format definitions.
    ("e4m3b4s", 30.0, 30.0),
    ("e4m3b4s", 29.0, 28.0),  # tie 28 (mantissa 110) / 30 (111): even wins
    ("e4m3b4s", 29.5, 30.0),
    ("e4m3b4s", 31.0, 30.0),  # tie 30 / 32 rounds up past max: saturates (default)
    ("e4m3b4s", 1000.0, 30.0),
    ("e4m3b4s", 1.0625, 1.0),  # tie 1.0 / 1.125 -> 1.0
    ("e4m3b4s", 1.1875, 1.25),  # tie 1.125 / 1.25 -> 1.25
    ("e4m3b4s", 2.0**-14, 0.0),  # half the min subnormal: tie with 0 -> 0
    ("e4m3b4s", 2.0**-14 * 1.0001, 2.0**-13),
    ("e4m3b4s", 3 * 2.0**-14, 2.0**-12),  # 1.5 quanta -> 2 quanta
    ("e4m3b4s", -29.0, -28.0),
    ("e4m3b4s", 0.1, 0.1015625),  # 0.1 = 1.6 * 2^-4 -> 1.625 * 2^-4
    ("e5m2s", 65536.0, 65536.0),  # finite here (inf in IEEE e5m2)
    ("e5m2s", 114688.0, 114688.0),
    ("e5m2s", 122880.0, 114688.0),  # tie past max -> saturate
    ("e5m2s", 1.125, 1.0),  # tie 1.0 / 1.25 -> 1.0
    ("e5m2s", 1.375, 1.5),  # tie 1.25 / 1.5 -> 1.5
    ("e5m2s", 3 * 2.0**-17, 2.0**-15),
    ("e6m9s", 1 + 2.0**-10, 1.0),
    ("e6m9s", 1 + 3 * 2.0**-10, 1 + 2.0**-8),
    ("e6m9s", 2.0**-40, 0.0),
    ("e6m9s", 3 * 2.0**-40, 2.0**-38),
    ("e6m9s", 1e10, 2.0**32 * (2 - 2.0**-9)),
]


@pytest.mark.parametrize(("spec", "value", "expected"), HAND_ROUNDING)
def test_no_special_codes_hand_rounding(spec, value, expected):
    assert quantize(torch.tensor([value]), spec).item() == expected


def test_overflow_modes():
    x = torch.tensor([1000.0, -1000.0, math.inf, -math.inf, math.nan, 1.0])
    sat = quantize(x, "e4m3b4s")
    assert sat[:4].tolist() == [30.0, -30.0, 30.0, -30.0] and sat[4].isnan() and sat[5] == 1.0
    to_inf = quantize(x, "e4m3b4s", overflow="inf")
    assert to_inf[:4].tolist() == [math.inf, -math.inf, math.inf, -math.inf]
    to_nan = quantize(x, "e4m3b4s", overflow="nan")
    assert to_nan[:5].isnan().all() and to_nan[5] == 1.0
    # A format with inf keeps inf inputs as inf even when finite overflow saturates.
    fp16_sat = quantize(x, "fp16", overflow="saturate")
    assert fp16_sat[:4].tolist() == [1000.0, -1000.0, math.inf, -math.inf]
    assert quantize(torch.tensor([70000.0]), "fp16", overflow="saturate").item() == 65504.0
    assert quantize(torch.tensor([70000.0]), "fp16").item() == math.inf


def test_fp32_is_untouched_and_other_float_inputs_upcast_exactly():
    x = torch.randn(100)
    assert quantize(x, "fp32") is x
    h = torch.randn(100).half()
    assert torch.equal(quantize(h, "fp16"), h.float())


# ------------------------------------------------------------------------------------ stochastic rounding


@pytest.mark.parametrize(("spec", "value"), [("bf16", 1.0 + 2.0**-9), ("e4m3b4s", 0.3), ("e4m3b4s", 2.6 * 2.0**-13)])
def test_stochastic_rounding_is_unbiased_and_lands_on_neighbours(spec, value):
    n = 100_000
    x = torch.full((n,), value)
    gen = torch.Generator().manual_seed(1234)
    q = quantize(x, spec, rounding="stochastic", generator=gen)
    fmt = get_format(spec)
    table = [v for v, _ in reference_values(fmt)]
    below = max(v for v in table if v < value)  # the two neighbours, from the format's definition
    above = min(v for v in table if v > value)
    neighbours = sorted({float(v) for v in q.unique()})
    assert neighbours == [below, above]
    a, b = neighbours
    p = (value - a) / (b - a)
    sigma = (b - a) * math.sqrt(p * (1 - p) / n)
    assert abs(q.double().mean().item() - value) < 3 * sigma


def test_stochastic_rounding_reproducible_from_generator():
    x = torch.randn(10_000)
    q1 = quantize(x, "e5m2", rounding="stochastic", generator=torch.Generator().manual_seed(7))
    q2 = quantize(x, "e5m2", rounding="stochastic", generator=torch.Generator().manual_seed(7))
    q3 = quantize(x, "e5m2", rounding="stochastic", generator=torch.Generator().manual_seed(8))
    assert torch.equal(q1, q2)
    assert not torch.equal(q1, q3)
    # Representable values are left alone by stochastic rounding too (torch's own cast puts them on the grid).
    exact = x.to(torch.float8_e5m2).float()
    assert torch.equal(quantize(exact, "e5m2", rounding="stochastic"), exact)


@pytest.mark.parametrize("spec", ["e4m3b4s", "e5m2s", "fp8_e5m2", "fp16"])
def test_round_and_count_counts_what_could_round_past_max(spec):
    """Nearest: a value overflows when its rounding exceeds max (torch's IEEE cast to inf, or the Python
    reference, is the oracle). Stochastic: any magnitude above max may round up, so every one counts."""
    fmt = get_format(spec)
    ulp = 2.0 ** (fmt.emax - fmt.man)
    below_tie, tie, above_max = fmt.max + ulp / 2 * 0.99, fmt.max + ulp / 2, fmt.max * (1 + 2.0**-20)
    x = torch.tensor([fmt.max, below_tie, tie, above_max, -tie, -above_max, 1.0, math.nan, math.inf])
    table = reference_values(fmt)
    nearest_over = sum(math.isinf(reference_round(abs(v), table, fmt.man)) for v in x.tolist() if not math.isnan(v))
    stochastic_over = int((x.abs() > fmt.max).sum())  # NaN compares false
    assert kernels.round_and_count(x, fmt, "nearest")[2][0].item() == nearest_over
    assert kernels.round_and_count(x, fmt, "stochastic", seed=torch.tensor(1))[2][0].item() == stochastic_over
    assert stochastic_over == 6 and nearest_over in (1, 3)  # inf, and the ties only where max's code is odd


# Hand table: results of [1, NaN, inf, -inf, 2 max, -2 max] that a format has no code for. Saturating, only NaN
# can leave a format (one without NaN codes); overflowing to inf, the four overflows leave one without inf;
# overflowing to NaN, they leave one without NaN codes (inf inputs stay inf only where the format has inf).
UNENCODABLE = {
    ("fp8_e5m2", "saturate"): 0, ("fp8_e5m2", "inf"): 0, ("fp8_e5m2", "nan"): 0,
    ("fp8_e4m3fn", "saturate"): 0, ("fp8_e4m3fn", "inf"): 4, ("fp8_e4m3fn", "nan"): 0,
    ("e4m3b4s", "saturate"): 1, ("e4m3b4s", "inf"): 5, ("e4m3b4s", "nan"): 5,
}


@pytest.mark.parametrize(("spec", "overflow"), list(UNENCODABLE))
@pytest.mark.parametrize("rounding", ["nearest", "stochastic"])
@pytest.mark.parametrize("in_place", [False, True])
def test_round_and_count_counts_results_without_a_code(spec, overflow, rounding, in_place):
    fmt = get_format(spec)
    x = torch.tensor([1.0, math.nan, math.inf, -math.inf, 2 * fmt.max, -2 * fmt.max]).repeat(1000)
    fn = kernels.round_and_count_fn(spec, rounding, overflow, with_codes=True, in_place=in_place)
    counts = fn(x, torch.tensor(3))[2]
    assert counts.tolist() == [4000, 1000 * UNENCODABLE[spec, overflow]]


@pytest.mark.parametrize("in_place", [False, True])
def test_compiled_round_and_count_counts_nan_without_a_code(in_place):
    """The activations' kernel (saturating, codes), compiled: one NaN in each block of six."""
    x = torch.tensor([1.0, math.nan, math.inf, -math.inf, 1e6, -3.0]).repeat(COMPILE_MIN_NUMEL // 4)
    fn = kernels.round_and_count_fn("e4m3b4s", "nearest", "saturate", with_codes=True, in_place=in_place)
    counts = fn(x, None)[2]
    what = "round and count, uint8 codes" + (" in place" if in_place else "")
    assert f"{what} (nearest, in floats)" in default_runtime().kernels.ready, "the compiled path went untested"
    assert counts.tolist() == [3 * x.numel() // 6, x.numel() // 6]


@pytest.mark.slow
def test_compiled_path_matches_eager_bit_for_bit():
    n = COMPILE_MIN_NUMEL * 2
    x = torch.randn(n) * torch.exp2(torch.randint(-20, 20, (n,)).float())
    cases = [("e4m3b4s", "nearest"), ("fp8_e5m2", "stochastic"), ("bf16", "stochastic"), ("fp16", "nearest")]
    for spec, rounding in cases:
        compiled = quantize(x, spec, rounding, generator=torch.Generator().manual_seed(3))
        compiled_codes = encode(x, spec)
        compiled_back = decode(compiled_codes, spec)
        compiled_fused = kernels.round_and_count(x, spec, rounding, seed=torch.tensor(5), with_codes=True)
        assert not default_runtime().kernels.failed, "torch.compile failed here, so the compiled path went untested"
        with _eagerly():
            eager = quantize(x, spec, rounding, generator=torch.Generator().manual_seed(3))
            eager_codes = encode(x, spec)
            eager_fused = kernels.round_and_count(x, spec, rounding, seed=torch.tensor(5), with_codes=True)
        assert mismatches(compiled, eager) == 0
        assert torch.equal(compiled_codes, eager_codes)
        assert mismatches(compiled_back, decode(eager_codes, spec)) == 0
        assert mismatches(compiled_fused[0], eager_fused[0]) == 0
        assert torch.equal(compiled_fused[1], eager_fused[1]) and torch.equal(compiled_fused[2], eager_fused[2])


@pytest.fixture
def every_call_compiled():
    with default_runtime().kernels.configured(enabled=True, min_numel=0):
        yield


@pytest.mark.slow
@pytest.mark.usefixtures("every_call_compiled")
def test_a_compiled_kernel_is_called_without_dynamo_after_its_first_call(monkeypatch, caplog):
    """After the call that compiles it, a kernel runs Inductor's code directly: Dynamo's frame evaluation is not
    entered again (counted), at every size, and the results stay those of the eager kernel."""
    fn = kernels.round_and_count_fn("e5m2", "stochastic", "inf", True)
    kernel = kernels._round_kernel("stochastic", False, torch.uint8, False)  # fn's
    seed = torch.tensor(11)
    with caplog.at_level("WARNING", logger="precsearch.formats.runner"):
        fn(torch.randn(5000), seed)
    compiled = default_runtime().kernels.compiled(kernel)
    (_, (inductors_own, _aot_entry)), = compiled._captured
    assert compiled._direct[torch.device("cpu")][0] is inductors_own  # not AOTAutograd's wrappers (about 5 us)
    dynamo_calls = []
    through_dynamo = compiled._dynamo
    monkeypatch.setattr(compiled, "_dynamo", lambda *args: dynamo_calls.append(1) or through_dynamo(*args))
    for n in (3, 1000, 70_001):
        x = torch.randn(n) * 2.0**14
        x[0] = 1e6  # overflows e5m2 (max 57344)
        rounded, codes, counts = fn(x, seed)
        with _eagerly():
            eager = fn(x, seed)
        assert mismatches(rounded, eager[0]) == 0 and torch.equal(codes, eager[1])
        assert torch.equal(counts, eager[2]) and counts[0] > 0
    assert dynamo_calls == []
    expanded = torch.tensor(1e6).expand(80)  # stride 0, as autograd's gradient of a sum
    assert torch.equal(fn(expanded, seed)[2], torch.tensor([80, 0]))
    in_place = kernels.round_and_count_fn("e5m2", "stochastic", "inf", True, in_place=True)
    for n in (70_001, 5):  # the first call compiles and checks a probe of the input; it writes over x
        x = torch.randn(n) * 2.0**14
        written = x.clone().requires_grad_()  # as an op's output, rounded in place inside an autograd Function
        with torch.no_grad():
            _, codes, counts = in_place(written, seed)
        rounded, eager_codes, eager_counts = fn(x, seed)
        assert mismatches(written.detach(), rounded) == 0 and torch.equal(codes, eager_codes)
        assert torch.equal(counts, eager_counts)
    assert not [r for r in caplog.records if r.levelname == "WARNING"]  # both kernels called directly


def _doubling_kernel_with_direct_calls(replace):
    """A compiled test kernel (x * 2 and its sum) whose captured direct calls ``replace(own, entry)`` swaps
    (Inductor's own code and AOTAutograd's entry), called three times under caplog's WARNINGs: the kernel,
    its results, and the WARNINGs."""

    def kernel(x, seed):
        return x * 2, x.sum()

    labelled("test kernel", kernel)
    compiled = Compiled(kernel)
    real_capture = compiled._capture

    def capture(graph_module, example_inputs):
        real = real_capture(graph_module, example_inputs)
        compiled._captured[-1] = (graph_module, replace(*compiled._captured[-1][1]))
        return real

    compiled._dynamo = torch.compile(kernel, backend=capture, dynamic=False)
    x = torch.arange(8.0)
    return compiled, [compiled(x, torch.tensor(0)) for _ in range(3)]


def _wrong(call):
    return lambda inputs: [t + 1 for t in call(inputs)]


def test_a_kernel_whose_direct_call_disagrees_stays_on_dynamos_path_with_one_warning(caplog):
    """A compiled kernel whose Inductor code, called directly, does not reproduce Dynamo's result keeps going
    through Dynamo (simulated: the captured code returns wrong values), with one WARNING naming it."""
    with caplog.at_level("WARNING", logger="precsearch.formats.runner"):
        compiled, results = _doubling_kernel_with_direct_calls(lambda own, entry: [_wrong(own), _wrong(entry)])
    warnings = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert len(warnings) == 1 and "test kernel" in warnings[0] and "another result" in warnings[0]
    assert compiled._direct[torch.device("cpu")] is None
    assert all(torch.equal(doubled, torch.arange(8.0) * 2) and float(total) == 28.0 for doubled, total in results)


def test_a_kernel_whose_generated_code_disagrees_is_called_through_aotautograd_with_one_warning(caplog):
    """Inductor's own code that does not reproduce Dynamo's result (simulated) leaves AOTAutograd's entry as the
    direct call, with one WARNING naming the kernel: no silent step down."""
    with caplog.at_level("WARNING", logger="precsearch.formats.runner"):
        compiled, results = _doubling_kernel_with_direct_calls(lambda own, entry: [_wrong(own), entry])
    warnings = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert len(warnings) == 1 and "test kernel" in warnings[0] and "AOTAutograd" in warnings[0]
    assert compiled._direct[torch.device("cpu")][0] is compiled._captured[0][1][1]
    assert all(torch.equal(doubled, torch.arange(8.0) * 2) and float(total) == 28.0 for doubled, total in results)


def test_the_format_kernels_run_on_the_default_runtimes_runner():
    """A runtime is the default for its ``with`` block (nested blocks too), and the format kernels called there
    run on its runner; after the blocks the process's own runtime is the default again."""
    own = default_runtime()
    x = torch.randn(64)
    eager = Runtime(KernelRunner(KernelSettings(enabled=False)))
    compiled = Runtime(KernelRunner(KernelSettings(min_numel=0), compile=lambda kernel: kernel))  # kernels as is
    with compiled.as_default():
        assert default_runtime() is compiled
        quantize(x, "e4m3b4s")
        with eager.as_default():
            assert default_runtime() is eager
            quantize(x, "e5m2", "stochastic")
        assert default_runtime() is compiled
    assert default_runtime() is own
    assert compiled.kernels.ready == {"round and count (nearest, in floats)"} and not eager.kernels.ready


def test_a_runners_settings_cross_into_another_process_as_a_value():
    """What a search hands its workers (precsearch.search.workers): the parent runner's settings now, a value that
    pickles, from which a worker's runner runs as the parent's does."""
    import pickle

    parent = KernelRunner(KernelSettings(enabled=False, min_numel=7))
    with parent.configured(min_numel=9):
        settings = pickle.loads(pickle.dumps(parent.settings))
    assert settings == KernelSettings(enabled=False, min_numel=9)
    worker = KernelRunner(settings)
    assert (worker.enabled, worker.min_numel) == (False, 9) and worker.settings == settings


def test_a_kernel_that_fails_to_compile_runs_eagerly_alone_with_one_warning(caplog):
    compiled_labels = []

    def fake_compile(kernel):  # stands in for torch.compile: fails for the kernel of ties away from zero only
        if "nearest_away" in kernel.label:
            def broken(*args):
                raise RuntimeError("Scalar 2654435761 is out of range for type int32")
            return broken

        def compiled(*args):
            compiled_labels.append(kernel.label)
            return kernel(*args)
        return compiled

    runner = KernelRunner(compile=fake_compile)
    away, to_even = (kernels._round_kernel(rounding, in_floats, None, False)
                     for rounding, in_floats in (("nearest_away", False), ("nearest", True)))
    x = torch.randn(COMPILE_MIN_NUMEL) * 1000
    seed = torch.tensor(0)
    rows = {rounding: format_row("e5m2s", rounding, "saturate") for rounding in ("nearest_away", "nearest")}
    with caplog.at_level("WARNING", logger="precsearch.formats.runner"):
        for _ in range(3):
            broken, _ = runner.run(away, x, rows["nearest_away"], seed, torch.zeros(2, dtype=torch.int64))
            runner.run(to_even, x, rows["nearest"], seed, torch.zeros(2, dtype=torch.int64))
    warnings = [r for r in caplog.records if r.levelname == "WARNING"]
    assert len(warnings) == 1
    message = warnings[0].getMessage()
    assert away.label in message and "out of range for type int32" in message
    assert runner.failed == {"round and count (nearest_away)"}
    assert compiled_labels == ["round and count (nearest, in floats)"] * 3  # still compiled, each time
    fmt = get_format("e5m2s")  # the eager fallback rounds as the Python reference does (saturating)
    table = reference_values(fmt)
    expected = [math.copysign(min(reference_round(abs(v), table, fmt.man, "away"), fmt.max), v) for v in x.tolist()]
    assert mismatches(broken, torch.tensor(expected)) == 0


def test_stochastic_noise_is_murmur3s_finalizer_of_index_and_seed():
    # written with constants inside int32 for Triton, the hash must stay the textbook one (Python integers here)
    def murmur3_fmix32(index: int, seed: int) -> int:
        h = (index * 0x9E3779B1 + seed) & 0xFFFFFFFF
        h ^= h >> 16
        h = (h * 0x85EBCA6B) & 0xFFFFFFFF
        h ^= h >> 13
        h = (h * 0xC2B2AE35) & 0xFFFFFFFF
        return (h ^ (h >> 16)) >> 1

    index = torch.tensor([0, 1, 2, 12345, 2**31 - 1, 2**32 - 1, 987654321], dtype=torch.int64)
    for seed in (0, 5, 2**31 - 2):
        expected = [murmur3_fmix32(int(i), seed) for i in index]
        assert as_data._hash_bits(index, torch.tensor(seed)).tolist() == expected


def test_formats_kernels_hold_no_integer_constant_outside_int32():
    # Triton types an integer literal as int32 and refuses one out of range (2654435761 broke the CUDA build of
    # the stochastic kernel): every literal of the kernel builders must fit.
    source = inspect.getsource(as_data)
    tree = ast.parse(source)
    builders = {"_low32", "_mul32", "_hash_bits", "round_with", "round_nearest", "_finish", "encode_patterns",
                "decode_patterns"}
    literals = [node.value for fn in ast.walk(tree) if isinstance(fn, ast.FunctionDef) and fn.name in builders
                for node in ast.walk(fn) if isinstance(node, ast.Constant) and type(node.value) is int]
    assert len(literals) > 20  # the walk did find the kernels' constants
    assert all(-(2**31) <= value < 2**31 for value in literals), [v for v in literals if abs(v) >= 2**31]


# -------------------------------------------------------------------------------------------- encode


def small_formats() -> list[str]:
    names = [n for n, f in NAMED_FORMATS.items() if f.bits <= 16]
    return names + ["e5m2s", "e4m3b4s", "e6m9s", "e3m0", "e2m0s", "e1m2s", "e5m10b-3fn", "e7m8"]


@pytest.mark.parametrize("spec", small_formats())
def test_encode_decode_round_trip_over_every_code(spec):
    fmt = get_format(spec)
    codes = torch.arange(2**fmt.bits, dtype=torch.int32)
    if storage_dtype(fmt) == torch.int16:
        codes = torch.where(codes >= 2**15, codes - 2**16, codes)
    codes = codes.to(storage_dtype(fmt))
    values = decode(codes, fmt)
    table = reference_values(fmt)  # the format's values from its definition, code by code
    magnitude = torch.tensor([v for v, _ in table], dtype=torch.float64)
    positive = torch.tensor([c for _, c in table])
    assert torch.equal(values[positive].double(), magnitude)
    assert torch.equal(-values[positive + 2 ** (fmt.bits - 1)].double(), magnitude)  # the sign bit set
    assert mismatches(quantize(values, fmt), values) == 0
    back = encode(values, fmt)
    assert back.dtype == storage_dtype(fmt)
    nan = values.isnan()
    assert torch.equal(back[~nan], codes[~nan])
    assert decode(back[nan], fmt).isnan().all()
    assert int(values.isnan().sum()) == expected_nan_codes(fmt)


def expected_nan_codes(fmt) -> int:
    if fmt.special == "ieee":
        return 2 * (2**fmt.man - 1)
    return 2 if fmt.special == "fn" else 0


@pytest.mark.parametrize("name", [n for n in ML_DTYPES])
def test_decode_matches_ml_dtypes_bit_patterns(name):
    dtype = ML_DTYPES[name][0]
    fmt = get_format(name)
    raw = all_ml_values(dtype)
    n_codes = 2**fmt.bits
    codes = torch.arange(n_codes, dtype=torch.int32)
    if storage_dtype(fmt) == torch.int16:
        codes = torch.where(codes >= 2**15, codes - 2**16, codes)
    ours = decode(codes.to(storage_dtype(fmt)), fmt)
    assert mismatches(ours, torch.from_numpy(raw[:n_codes])) == 0


def test_storage_is_one_byte_per_element_for_8_bit_formats():
    x = torch.randn(1000)
    for spec in ["fp8_e5m2", "e4m3b4s", "fp4_e2m1fn", "fp6_e3m2fn"]:
        codes = encode(x, spec)
        assert codes.dtype == torch.uint8 and codes.element_size() * codes.numel() == 1000
    assert encode(x, "e6m9s").element_size() == 2


def test_encode_rejects_values_the_format_cannot_hold():
    with pytest.raises(PrecsearchError, match="no such code"):
        encode(torch.tensor([math.nan]), "e4m3b4s")
    with pytest.raises(PrecsearchError, match="no such code"):
        encode(torch.tensor([1.0, math.nan]), "fp4_e2m1fn")
    # Overflow follows the format's default (saturate without inf), so inf itself is encodable as max.
    assert decode(encode(torch.tensor([math.inf]), "fp8_e4m3fn"), "fp8_e4m3fn").item() == 448.0


# ------------------------------------------------------------------------------------------- statistics


def test_stats_counts_overflow_underflow_subnormal():
    fmt = get_format("e4m3b4s")
    x = torch.tensor(
        [100.0, -31.0, math.inf, 2.0**-14, -2.0**-15, 2.0**-12, 2.0**-11 * 0.99, 1.0, 0.0, math.nan]
    )
    # overflow: 100, -31 (tie past max), inf; underflow: 2^-14 (tie to 0), 2^-15; subnormal: 2^-12, ~2^-11.
    s = stats(x, fmt)
    assert s == {"overflow": 0.3, "underflow": 0.2, "subnormal": 0.2, "nan": 0.1}
    assert stats(torch.randn(10), "fp32")["overflow"] == 0.0


# -------------------------------------------------------------------------------------- property-based


def reference_values(fmt) -> list[tuple[float, int]]:
    """Non-negative finite values of a format with their codes, computed in Python from the definition."""
    out = []
    for exp_code in range(2**fmt.exp):
        for man_code in range(2**fmt.man):
            if fmt.special == "ieee" and exp_code == 2**fmt.exp - 1:
                continue
            if fmt.special == "fn" and exp_code == 2**fmt.exp - 1 and man_code == 2**fmt.man - 1:
                continue
            if exp_code == 0:
                value = man_code * 2.0 ** (1 - fmt.bias - fmt.man)
            else:
                value = (1 + man_code / 2**fmt.man) * 2.0 ** (exp_code - fmt.bias)
            out.append((value, (exp_code << fmt.man) | man_code))
    return sorted(out)


def reference_round(value: float, table: list[tuple[float, int]], man: int, ties: str = "even") -> float:
    """Round-to-nearest of a non-negative finite value against an explicit table (in fp64 arithmetic), ties to
    the even code or (``ties="away"``) to the larger magnitude; overflow -> inf.

    The value one code past max (max plus the ulp of max's binade) stands for overflow, with that code's parity.
    """
    values = [v for v, _ in table]
    top, top_code = table[-1]
    top_ulp = 2.0 ** (math.frexp(top)[1] - 1 - man)
    extended = values + [top + top_ulp]
    codes = [c for _, c in table] + [top_code + 1]
    i = bisect.bisect_right(extended, value) - 1
    if i >= len(extended) - 1:
        return math.inf
    lo, hi = extended[i], extended[i + 1]
    if value == lo:
        return lo
    if value - lo < hi - value:
        pick = i
    elif value - lo > hi - value or ties == "away":
        pick = i + 1
    else:
        pick = i if codes[i] % 2 == 0 else i + 1
    return math.inf if pick == len(extended) - 1 else extended[pick]


def _valid_specs() -> list[str]:
    """Every spec of the family e<E>m<M>[b<shift>][s|fn] (E 2..8, M 0..6, shift -3..6) that names a format."""
    specs = []
    for e, m, shift, suffix in itertools.product(range(2, 9), range(7), range(-3, 7), ("", "s", "fn")):
        spec = f"e{e}m{m}" + (f"b{shift}" if shift else "") + suffix
        try:
            get_format(spec)
        except PrecsearchError:
            continue
        specs.append(spec)
    return specs


VALID_SPECS = _valid_specs()
format_specs = st.sampled_from(VALID_SPECS)
narrow_specs = st.sampled_from([spec for spec in VALID_SPECS if get_format(spec).exp <= 5])


@settings(max_examples=60, deadline=None)
@given(spec=narrow_specs, data=st.data())
def test_nearest_rounding_matches_python_reference(spec, data):
    fmt = get_format(spec)
    table = reference_values(fmt)
    assert max(v for v, _ in table) == fmt.max
    assert min(v for v, _ in table if v > 0) == fmt.min_subnormal
    values = data.draw(
        st.lists(
            st.floats(0, fmt.max * 1.25, width=32, allow_subnormal=True) | st.sampled_from([v for v, _ in table]),
            min_size=1,
            max_size=40,
        )
    )
    x = torch.tensor(values, dtype=torch.float32)
    ours = quantize(x, fmt, overflow="inf")
    expected = torch.tensor([reference_round(float(v), table, fmt.man) for v in x.tolist()])
    assert mismatches(ours, expected) == 0
    assert mismatches(quantize(-x, fmt, overflow="inf"), -expected) == 0


@pytest.mark.parametrize("spec", [spec for spec in VALID_SPECS
                                  if get_format(spec).man == 0 and get_format(spec).exp <= 5])
def test_a_tie_between_powers_of_two_goes_to_the_even_code(spec):
    """With no mantissa bit a tie lies between two powers of two, and the even code is the one of even exponent
    field, which float32's own exponent parity gives only for an odd bias (e5m0b3 once rounded 3 to 2, not 4)."""
    fmt = get_format(spec)
    table = reference_values(fmt)
    ties = [(low + high) / 2 for (low, _), (high, _) in itertools.pairwise(table)]
    x = torch.tensor(ties, dtype=torch.float64).to(torch.float32)
    assert x.double().tolist() == ties  # every tie is exact in float32
    expected = torch.tensor([reference_round(value, table, fmt.man) for value in ties])
    assert mismatches(quantize(x, fmt, overflow="inf"), expected) == 0
    assert mismatches(quantize(-x, fmt, overflow="inf"), -expected) == 0


@pytest.mark.parametrize(("value", "even", "away"), [
    (1.0625, 1.0, 1.125),  # halfway between 1 and 1 + 2^-3
    (2.0**-14, 0.0, 2.0**-13),  # half the smallest subnormal (e4m3b4s: emin -10, 3 mantissa bits)
    (1.1875, 1.25, 1.25),  # a tie whose even neighbour is also the larger one
    (3 * 2.0**-14, 2.0**-12, 2.0**-12),
    (1.0625 + 2.0**-20, 1.125, 1.125),  # not a tie: both round to nearest
])
def test_ties_away_from_zero_hand_table(value, even, away):
    x = torch.tensor([value, -value])
    assert quantize(x, "e4m3b4s").tolist() == [even, -even]
    assert quantize(x, "e4m3b4s", rounding="nearest_away").tolist() == [away, -away]
    values, counts = kernels.round_and_count(x, "e4m3b4s", rounding="nearest_away")[::2]
    assert values.tolist() == [away, -away] and counts.tolist() == [0, 0]


@settings(max_examples=40, deadline=None)
@given(spec=narrow_specs, data=st.data())
def test_ties_away_rounding_matches_python_reference(spec, data):
    fmt = get_format(spec)
    table = reference_values(fmt)
    midpoints = [(a + b) / 2 for (a, _), (b, _) in zip(table, table[1:], strict=False)]
    values = data.draw(st.lists(st.floats(0, fmt.max * 1.25, width=32, allow_subnormal=True)
                                | st.sampled_from(midpoints), min_size=1, max_size=40))
    x = torch.tensor(values, dtype=torch.float32)
    expected = torch.tensor([reference_round(float(v), table, fmt.man, ties="away") for v in x.tolist()])
    assert mismatches(quantize(x, fmt, rounding="nearest_away", overflow="inf"), expected) == 0
    assert mismatches(quantize(-x, fmt, rounding="nearest_away", overflow="inf"), -expected) == 0
    threshold = kernels.overflow_threshold(fmt, "nearest_away")
    assert math.isinf(float(quantize(torch.tensor([threshold]), fmt, "nearest_away", overflow="inf")[0]))


@settings(max_examples=60, deadline=None)
@given(spec=format_specs, values=st.lists(st.floats(width=32, allow_nan=False, allow_infinity=False), max_size=50))
def test_quantize_idempotent_and_encodable(spec, values):
    fmt = get_format(spec)
    x = torch.tensor(values, dtype=torch.float32)
    q = quantize(x, fmt, overflow="saturate")
    assert mismatches(quantize(q, fmt), q) == 0
    assert (q.abs() <= fmt.max).all()
    assert mismatches(decode(encode(q, fmt), fmt), q) == 0
    sr = quantize(x, fmt, rounding="stochastic", overflow="saturate", generator=torch.Generator().manual_seed(0))
    assert mismatches(quantize(sr, fmt), sr) == 0
    down = quantize(x, fmt, overflow="saturate")  # stochastic result is within one neighbour of nearest
    assert ((sr - down).abs() <= (down.abs() * 2.0**-fmt.man + fmt.min_subnormal) * 2).all()


# ------------------------------------------------------------------------------------------- bad input


def test_bad_input_errors():
    with pytest.raises(ValueError, match=r"fp8_e5m2.*e<E>m<M>"):
        get_format("fp7")
    with pytest.raises(ValueError, match="E must be in 1..8"):
        get_format("e9m2")
    with pytest.raises(ValueError, match="M in 0..23"):
        get_format("e5m24")
    with pytest.raises(ValueError, match="float32's normal range"):
        get_format("e8m7b2")
    with pytest.raises(TypeError, match="floating-point"):
        quantize(torch.arange(4), "fp16")
    with pytest.raises(TypeError, match="float64"):
        quantize(torch.zeros(4, dtype=torch.float64), "fp16")
    with pytest.raises(ValueError, match="unknown rounding"):
        quantize(torch.zeros(4), "fp16", rounding="up")
    with pytest.raises(ValueError, match="unknown overflow"):
        quantize(torch.zeros(4), "fp16", overflow="wrap")
    with pytest.raises(PrecsearchError):
        get_format(3)


def test_spec_name_normalizes_and_prefixes_errors():
    assert spec_name(" E4M3B4S ", "policy p.json: defaults.weight") == "e4m3b4s"
    assert spec_name(get_format("fp16"), "x") == "fp16"
    with pytest.raises(PrecsearchError, match=r"^space s.yaml: high: unknown float format 'fp7'"):
        spec_name("fp7", "space s.yaml: high")
    with pytest.raises(PrecsearchError, match="must be a string"):
        spec_name(8, "x")


@pytest.mark.parametrize("spec", ["e5m23", "e7m23s", "e6m23fn"])
@pytest.mark.parametrize("rounding", ["nearest", "nearest_away", "stochastic"])
def test_a_format_with_floats_whole_mantissa_keeps_every_float32_in_its_normal_range(spec, rounding):
    """With M = 23 nothing is dropped: every float32 between the format's min normal and max is its own
    rounding (the oracle is the input itself), odd last bits included."""
    fmt = get_format(spec)
    lo, hi = math.log2(fmt.min_normal), math.log2(fmt.max)
    g = torch.Generator().manual_seed(3)
    x = torch.exp2(lo + (hi - lo) * torch.rand(4096, generator=g))
    x = (x.view(torch.int32) | 1).view(torch.float32)  # an odd last bit, which a wrong tie rule would move
    x = x[x <= fmt.max]
    x = torch.cat([x, -x, torch.tensor([1 + 2.0**-23, 1 + 3 * 2.0**-23])])
    assert mismatches(quantize(x, fmt, rounding=rounding, generator=torch.Generator().manual_seed(0)), x) == 0
