"""precsearch.formats.scaled against independent oracles: the scale rules written out here in float64, torch's
float8 casts (tensorwise, rowwise, delayed) and ml_dtypes' casts (OCP MX blocks); and the grammar's names and
errors."""

from __future__ import annotations

import math
import subprocess
import sys

import ml_dtypes
import numpy as np
import pytest
import torch

from precsearch.errors import PrecsearchError
from precsearch.formats.format import get_format
from precsearch.formats.scaled import (
    AmaxHistory,
    ScaledFormat,
    get_scaled_format,
    is_scaled,
    quantize_scaled,
    scale_bytes,
)

# OCP MX v1.0's element formats: the exponent of the largest normal (its table 1), ml_dtypes' type, whether it
# has inf
ELEMENTS = {
    "e4m3fn": (8, ml_dtypes.float8_e4m3fn, False),
    "e5m2": (15, ml_dtypes.float8_e5m2, True),
    "e2m3fn": (2, ml_dtypes.float6_e2m3fn, False),
    "e3m2fn": (4, ml_dtypes.float6_e3m2fn, False),
    "e2m1fn": (2, ml_dtypes.float4_e2m1fn, False),
}
TORCH_FLOAT8 = {"e4m3fn": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal values with equal signs (so -0 != +0), or both NaN, everywhere."""
    return bool((((a == b) & (a.signbit() == b.signbit())) | (a.isnan() & b.isnan())).all())


def grid(dtype) -> np.ndarray:
    """The non-negative finite values of an ml_dtypes type, ascending, from all its codes."""
    values = np.arange(2 ** ml_dtypes.finfo(dtype).bits, dtype=np.uint8).view(dtype).astype(np.float64)
    return np.unique(values[np.isfinite(values) & ~np.signbit(values)])


def smallest_exponent(amax: float, top: float) -> int:
    """The smallest k with amax <= top * 2**k (tensor and row scaling)."""
    k = math.ceil(math.log2(amax / top))
    while amax > top * 2.0**k:
        k += 1
    while amax <= top * 2.0 ** (k - 1):
        k -= 1
    return k


def mx_exponent(amax: float, emax: int) -> int:
    """OCP MX v1.0's shared exponent: floor(log2(amax)) - emax."""
    e = math.floor(math.log2(amax))
    while 2.0**e > amax:
        e -= 1
    while 2.0 ** (e + 1) <= amax:
        e += 1
    return e - emax


def rounds_past(v: np.ndarray, man: int, top: float) -> np.ndarray:
    """Whether |v| rounded to nearest-even with ``man`` mantissa bits and an unbounded exponent exceeds top."""
    m, e = np.frexp(np.abs(v))  # |v| = m * 2**e, 0.5 <= m < 1
    return np.ldexp(np.round(np.ldexp(m, man + 1)), e - man - 1) > top


def ml_cast(dtype):
    return lambda v: v.astype(np.float32).astype(dtype).astype(np.float64)


def torch_cast(dtype):
    return lambda v: torch.from_numpy(v).float().to(dtype).double().numpy()


def oracle(x: torch.Tensor, element: str, granularity: str, block: int = 0, cast=None,
           scale_amax: float | None = None) -> tuple[torch.Tensor, np.ndarray, int]:
    """What quantize_scaled should return (values, scales, overflow count), group by group in float64 numpy
    from the module docstring's rules; ``scale_amax`` replaces each group's amax (a delayed scale)."""
    emax, dtype, has_inf = ELEMENTS[element]
    top, man = float(ml_dtypes.finfo(dtype).max), ml_dtypes.finfo(dtype).nmant
    cast = cast or ml_cast(dtype)
    rows = x.shape[0] if x.dim() >= 2 and granularity != "tensor" else 1
    flat = x.double().numpy().reshape(rows, -1)
    length = block or flat.shape[1]
    out, scales, overflowed = np.empty_like(flat), [], 0
    for r in range(rows):
        for start in range(0, flat.shape[1], length):
            group = flat[r, start:start + length]
            finite = np.isfinite(group)
            if block and not finite.all():  # the e8m0 NaN scale: the whole block is NaN
                out[r, start:start + length] = np.nan
                scales.append(np.nan)
                continue
            amax = np.abs(group[finite]).max(initial=0.0) if scale_amax is None else scale_amax
            k = 0 if amax == 0 else mx_exponent(amax, emax) if block else smallest_exponent(amax, top)
            s = 2.0 ** min(max(k, -127), 127)
            v = group / s
            overflowed += int((finite & rounds_past(v, man, top)).sum())
            q = cast(np.clip(v, -top, top)) * s  # clamping before the cast saturates
            q[np.isinf(group)] = group[np.isinf(group)] if has_inf else np.nan
            q[np.isnan(group)] = np.nan
            out[r, start:start + length] = q
            scales.append(s)
    shape = {"tensor": (), "row": (rows,), "block": (rows, -1)}[granularity]
    return torch.from_numpy(out).float().reshape(x.shape), np.array(scales).reshape(shape), overflowed


def sample(shape: tuple[int, ...], element: str, seed: int, nonfinite: bool = False) -> torch.Tensor:
    """float32 values for the rounding after scaling: each row 2**j larger or smaller than the others, and in
    it element values, midpoints between them (ties), values past max (MX saturates them), tiny ones (element
    subnormals, underflow) and zeros of both signs; with ``nonfinite``, an inf, a -inf and a NaN."""
    rng = np.random.default_rng(seed)
    emax, dtype, _ = ELEMENTS[element]
    values = grid(dtype)
    pool = np.concatenate([values, (values[1:] + values[:-1]) / 2, values[-1] * (1 + rng.random(8) / 7),
                           2.0 ** rng.uniform(-20, emax, 32)])
    rows = shape[0] if len(shape) >= 2 else 1
    x = rng.choice(pool, size=math.prod(shape)) * rng.choice([-1.0, 1.0], size=math.prod(shape))
    x = x.reshape(rows, -1) * 2.0 ** rng.integers(-30, 30, size=(rows, 1))
    if nonfinite:
        x.reshape(-1)[rng.choice(x.size, 3, replace=False)] = [np.inf, -np.inf, np.nan]
    return torch.tensor(x.reshape(shape), dtype=torch.float32)


def check(x: torch.Tensor, spec: str, element: str, granularity: str, block: int = 0, cast=None) -> None:
    rounded, scales, overflowed = quantize_scaled(x, spec)
    expected, expected_scales, expected_overflowed = oracle(x, element, granularity, block, cast)
    assert rounded.dtype == torch.float32 and same(rounded, expected)
    np.testing.assert_array_equal(scales.numpy(), expected_scales)
    assert overflowed.dtype == torch.int64 and int(overflowed) == expected_overflowed


SHAPES = [(6, 70), (8, 3, 5, 5), (100,)]


# ------------------------------------------------------------------------------- tensorwise and rowwise


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("granularity", ["tensor", "row"])
@pytest.mark.parametrize("element", ["e4m3fn", "e5m2"])
@pytest.mark.parametrize("seed", [0, 1])
def test_current_scaling_is_torchs_float8_cast_of_x_over_a_power_of_two(element, granularity, shape, seed):
    x = sample(shape, element, seed, nonfinite=seed == 1)
    check(x, f"{element}@{granularity}", element, granularity, cast=torch_cast(TORCH_FLOAT8[element]))


@pytest.mark.parametrize("element", ["e2m3fn", "e3m2fn", "e2m1fn"])
def test_current_scaling_of_fp6_and_fp4_is_ml_dtypes_cast(element):
    check(sample((6, 70), element, 2, nonfinite=True), f"{element}@row", element, "row")


def test_current_scaling_never_overflows_and_the_amax_lands_within_max():
    x = sample((6, 70), "e4m3fn", 3)
    rounded, scales, overflowed = quantize_scaled(x, "e4m3fn@row")
    amax = x.abs().amax(1)
    assert int(overflowed) == 0
    assert bool(((amax / scales <= 448) & (amax / scales > 224)).all())


def test_scale_exponents_are_clamped_to_e8m0s_range():
    tiny = torch.tensor([[1e-40, -3e-42, 0.0], [2.0**-149, 0.0, 0.0], [1e30, 3.0, -2e29]])
    scales = quantize_scaled(tiny, "e4m3fn@row")[1]
    assert scales[0].item() == scales[1].item() == 2.0**-127  # a float32 subnormal, exactly
    check(tiny, "e4m3fn@row", "e4m3fn", "row", cast=torch_cast(torch.float8_e4m3fn))
    check(tiny, "e2m1fn@block2", "e2m1fn", "block", 2)
    huge = torch.tensor([3e38, -1e38, 1.0])  # e3m2b5s's max is 0.875: 3e38 would want a scale of 2**129
    rounded, scales, overflowed = quantize_scaled(huge, "e3m2b5s@tensor")
    assert scales.item() == 2.0**127 and rounded[:2].tolist() == [0.875 * 2.0**127, -0.625 * 2.0**127]
    assert int(overflowed) == 1


def test_ties_round_to_even_or_away_from_zero_as_asked():
    x = torch.tensor([448.0, 1.0625, -1.0625, 1.1875])  # midpoints of e4m3fn's steps of 0.125 at 1
    assert quantize_scaled(x, "e4m3fn@tensor")[0].tolist() == [448.0, 1.0, -1.0, 1.25]
    assert quantize_scaled(x, "e4m3fn@tensor", "nearest_away")[0].tolist() == [448.0, 1.125, -1.125, 1.25]


def test_stochastic_rounding_gives_a_neighbour_after_scaling_and_follows_the_generator():
    x = sample((4, 64), "e4m3fn", 4)
    values = grid(ml_dtypes.float8_e4m3fn)
    rounded, scales, _ = quantize_scaled(x, "e4m3fn@row", "stochastic", generator=torch.Generator().manual_seed(7))
    v = (x.abs() / scales[:, None]).double().numpy()
    lower = values[np.searchsorted(values, v, side="right") - 1]
    upper = values[np.minimum(np.searchsorted(values, v, side="left"), len(values) - 1)]
    q = (rounded.abs() / scales[:, None]).double().numpy()
    assert bool(((q == lower) | (q == upper)).all()) and (q != lower).any() and (q != upper).any()
    again = quantize_scaled(x, "e4m3fn@row", "stochastic", generator=torch.Generator().manual_seed(7))[0]
    assert same(again, rounded)


# ---------------------------------------------------------------------------------------- delayed scaling


@pytest.mark.parametrize("element", ["e4m3fn", "e5m2"])
def test_delayed_scaling_uses_the_largest_amax_of_the_last_calls_and_saturates_what_outgrew_it(element):
    history = AmaxHistory(3)
    base = sample((4, 50), element, 0)
    amaxes: list[float] = []
    overflows = []
    for step, growth in enumerate([1, 4, 16, 1, 1, 1, 1, 0.25]):
        x = base * growth
        if step == 4:
            x[0, :3] = torch.tensor([math.inf, -math.inf, math.nan])
        rounded, scales, overflowed = quantize_scaled(x, f"{element}@tensor:delayed3", history=history)
        expected, expected_scales, expected_overflowed = oracle(
            x, element, "tensor", cast=torch_cast(TORCH_FLOAT8[element]), scale_amax=max(amaxes[-3:], default=0.0))
        assert same(rounded, expected) and scales.item() == expected_scales.item()
        assert int(overflowed) == expected_overflowed
        overflows.append(expected_overflowed)
        amaxes.append(float(x[x.isfinite()].abs().max()))
    # each growth outgrows the stale scale; the history keeps the peak for 3 calls; a shrinking tensor fits
    assert overflows[1] > 0 and overflows[2] > 0 and overflows[3:] == [0] * 5


def test_an_amax_history_restores_from_its_state_dict():
    spec = "e4m3fn@tensor:delayed4"
    history = AmaxHistory(4)
    for step in range(3):
        quantize_scaled(sample((4, 50), "e4m3fn", step) * 2.0**step, spec, history=history)
    restored = AmaxHistory(4)
    restored.load_state_dict(history.state_dict())
    x = sample((4, 50), "e4m3fn", 9) * 16
    assert same(quantize_scaled(x, spec, history=history)[0], quantize_scaled(x, spec, history=restored)[0])
    assert torch.equal(history.amaxes, restored.amaxes)
    with pytest.raises(PrecsearchError, match="length 8 cannot load one of length 4"):
        AmaxHistory(8).load_state_dict(history.state_dict())


@pytest.mark.parametrize(("spec", "history"), [("e4m3fn@tensor:delayed4", None), ("e4m3fn@tensor", AmaxHistory(4)),
                                               ("e4m3fn@tensor:delayed4", AmaxHistory(8))])
def test_a_history_goes_with_delayed_scaling_only_and_of_its_length(spec, history):
    with pytest.raises(PrecsearchError, match="history"):
        quantize_scaled(torch.ones(4), spec, history=history)


# ------------------------------------------------------------------------------------------------ MX blocks


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("element", list(ELEMENTS))
@pytest.mark.parametrize("seed", [0, 1])
def test_mx_blocks_follow_ocp_shared_exponent_and_ml_dtypes_casts(element, shape, seed):
    x = sample(shape, element, seed, nonfinite=seed == 1)
    check(x, f"{element}@block32", element, "block", 32)


def test_other_block_sizes_and_a_row_shorter_than_a_block():
    check(sample((5, 7), "e4m3fn", 5), "e4m3fn@block16", "e4m3fn", "block", 16)
    check(sample((3, 40), "e2m1fn", 6), "e2m1fn@block4", "e2m1fn", "block", 4)


def test_an_mx_block_past_max_after_its_floor_scale_saturates_and_counts():
    x = torch.cat([torch.tensor([500.0, -470.0, 464.0, 100.0]), torch.ones(28)])  # amax 500: scale 2**(8-8)
    rounded, scales, overflowed = quantize_scaled(x, "e4m3fn@block32")
    assert scales.tolist() == [[1.0]] and rounded[:4].tolist() == [448.0, -448.0, 448.0, 96.0]
    assert int(overflowed) == 2  # 464 is a tie that rounds to 448 (even)


# ------------------------------------------------------------------------------------ zeros, inf and NaN


@pytest.mark.parametrize("spec", ["e4m3fn@tensor", "e5m2@row", "e2m1fn@block32"])
def test_all_zero_groups_get_scale_one_and_keep_their_signs(spec):
    zeros = torch.tensor([0.0, -0.0] * 20)
    rounded, scales, overflowed = quantize_scaled(zeros, spec)
    assert same(rounded, zeros) and scales.reshape(-1).tolist() == [1.0] * scales.numel() and int(overflowed) == 0
    rounded, scales, _ = quantize_scaled(torch.stack([zeros, torch.full((40,), 3.0)]), spec)
    assert same(rounded[0], zeros)
    if not spec.endswith("@tensor"):
        assert scales[0].reshape(-1).tolist() == [1.0] * scales[0].numel()


def test_inf_stays_inf_in_e5m2_and_becomes_nan_without_inf_and_neither_counts_as_overflow():
    x = torch.tensor([1.0, -3.0, math.inf, -math.inf, math.nan, 100.0])
    for spec, inf in [("e5m2@tensor", [math.inf, -math.inf]), ("e4m3fn@tensor", [math.nan] * 2),
                      ("e2m1fn@row", [math.nan] * 2)]:
        rounded, scales, overflowed = quantize_scaled(x, spec)
        top = float(ml_dtypes.finfo(ELEMENTS[spec.split("@")[0]][1]).max)
        assert scales.reshape(()).item() == 2.0 ** smallest_exponent(100.0, top)
        assert same(rounded[2:5], torch.tensor([*inf, math.nan])) and int(overflowed) == 0
    rounded, scales, _ = quantize_scaled(torch.tensor([math.inf, math.nan]), "e4m3fn@tensor")
    assert scales.item() == 1.0 and rounded.isnan().all()


def test_an_mx_block_with_inf_or_nan_is_nan_with_a_nan_scale():
    x = torch.ones(3, 64)
    x[0, 5], x[1, 40] = math.inf, math.nan
    rounded, scales, overflowed = quantize_scaled(x, "e4m3fn@block32")
    assert scales.isnan().tolist() == [[True, False], [False, True], [False, False]]
    assert rounded[0, :32].isnan().all() and rounded[1, 32:].isnan().all() and (rounded[0, 32:] == 1).all()
    assert int(overflowed) == 0


# --------------------------------------------------------------------------------------- shapes and bytes


@pytest.mark.parametrize(("spec", "shape", "scales_shape", "nbytes"), [
    ("e4m3fn@tensor", (64, 3, 3, 3), (), 1),
    ("e4m3fn@tensor:delayed16", (64, 3, 3, 3), (), 1 + 16 * 4),
    ("e5m2@row", (64, 3, 3, 3), (64,), 64),
    ("e5m2@row", (10,), (1,), 1),
    ("e2m1fn@block32", (64, 3, 3, 3), (64, 1), 64),
    ("e2m1fn@block32", (16, 100), (16, 4), 64),
    ("e2m1fn@block32", (100,), (1, 4), 4),
    ("e4m3fn@block32", (), (1, 1), 1),
    ("e4m3fn@row", (0, 5), (0,), 0),
])
def test_scales_have_the_stated_shape_and_a_byte_each(spec, shape, scales_shape, nbytes):
    assert get_scaled_format(spec).scales_shape(shape) == scales_shape
    assert scale_bytes(spec, shape) == nbytes
    history = AmaxHistory(16) if "delayed" in spec else None
    rounded, scales, _ = quantize_scaled(torch.ones(shape), spec, history=history)
    assert scales.shape == scales_shape and rounded.shape == shape


def test_half_precision_inputs_round_as_their_float32_values():
    x = sample((4, 64), "e4m3fn", 8).bfloat16()
    for spec in ["e4m3fn@tensor", "e4m3fn@row", "e2m1fn@block32"]:
        assert same(quantize_scaled(x, spec)[0], quantize_scaled(x.float(), spec)[0])


# ---------------------------------------------------------------------------------------------------- grammar


@pytest.mark.parametrize(("spec", "name", "granularity", "history", "block", "top"), [
    ("e4m3fn@tensor", "e4m3fn@tensor", "tensor", 0, 0, 448.0),
    ("e4m3fn@tensor:delayed16", "e4m3fn@tensor:delayed16", "tensor", 16, 0, 448.0),
    (" E5M2@Row ", "e5m2@row", "row", 0, 0, 57344.0),
    ("e4m3fn@block32", "e4m3fn@block32", "block", 0, 32, 448.0),
    ("e2m3fn@block32", "fp6_e2m3fn@block32", "block", 0, 32, float(ml_dtypes.finfo(ml_dtypes.float6_e2m3fn).max)),
    ("e3m2fn@block32", "fp6_e3m2fn@block32", "block", 0, 32, float(ml_dtypes.finfo(ml_dtypes.float6_e3m2fn).max)),
    ("e2m1fn@block32", "fp4_e2m1fn@block32", "block", 0, 32, float(ml_dtypes.finfo(ml_dtypes.float4_e2m1fn).max)),
    ("fp8_e5m2@block16", "fp8_e5m2@block16", "block", 0, 16, 57344.0),
    ("e4m3b4s@row", "e4m3b4s@row", "row", 0, 0, get_format("e4m3b4s").max),
])
def test_good_specs_parse_and_their_names_read_back(spec, name, granularity, history, block, top):
    fmt = get_scaled_format(spec)
    assert (fmt.name, fmt.granularity, fmt.history, fmt.block, fmt.element.max) == (name, granularity, history,
                                                                                     block, top)
    assert get_scaled_format(fmt.name) == fmt and get_scaled_format(fmt) is fmt and str(fmt) == name
    assert is_scaled(spec) and is_scaled(fmt)


@pytest.mark.parametrize("spec", ["e4m3fn", "e4m3fn@", "@tensor", "e4m3fn@col", "e4m3fn@block", "e4m3fn@block0",
                                  "e4m3fn@row:delayed16", "e4m3fn@block32:delayed4", "e4m3fn@tensor:delayed0",
                                  "e4m3fn@tensor:delayed", "e4m3fn@tensor:current", "e9m3@tensor",
                                  "e4m3fn@tensor@row", "e4m3fn@row32"])
def test_bad_specs_raise_one_line_naming_the_spec_and_the_fix(spec):
    with pytest.raises(PrecsearchError) as error:
        get_scaled_format(spec)
    message = str(error.value)
    assert "\n" not in message and spec in message
    assert "use" in message or "must" in message


@pytest.mark.parametrize(("args", "match"), [(("col",), "granularity 'col'"), (("block",), "block size"),
                                             (("row", 0, 32), "block size"), (("row", 4), "delayed"),
                                             (("tensor", -1), "delayed")])
def test_a_scaled_format_checks_its_fields(args, match):
    with pytest.raises(PrecsearchError, match=match):
        ScaledFormat(get_format("e4m3fn"), *args)


def test_is_scaled_tells_scaled_names_from_plain_ones():
    assert not any(is_scaled(spec) for spec in ["e4m3fn", get_format("e4m3fn"), None, 3])
    with pytest.raises(PrecsearchError, match="spec string or a ScaledFormat"):
        get_scaled_format(3)


def test_the_grammar_loads_no_torch():
    probe = ("import sys; from precsearch.formats.scaled import get_scaled_format, scale_bytes; "
             "scale_bytes(get_scaled_format('e2m1fn@block32'), (64, 3, 3, 3)); print('torch' in sys.modules)")
    assert subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True).stdout == "False\n"


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA is not available here")
@pytest.mark.parametrize("spec", ["e4m3fn@tensor", "e5m2@row", "e2m1fn@block32", "e4m3fn@block32"])
def test_cuda_rounds_as_the_cpu(spec):
    x = sample((8, 3, 5, 5), "e4m3fn", 10, nonfinite=True)
    cpu, cuda = quantize_scaled(x, spec), quantize_scaled(x.cuda(), spec)
    assert same(cuda[0].cpu(), cpu[0]) and torch.equal(cuda[1].cpu().nan_to_num(), cpu[1].nan_to_num())
    assert int(cuda[2]) == int(cpu[2])
