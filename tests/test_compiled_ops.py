"""The compiled step's opaque site op (precsearch.runtime.compiled_ops.round_site) against torch's own casts: one
pass that rounds, encodes and counts, on tensors in any dense layout (Inductor lays activations out channels
last) and on non-dense ones."""

from __future__ import annotations

import pytest
import torch

from precsearch.formats.as_data import format_row
from precsearch.formats.runner import COMPILE_MIN_NUMEL
from precsearch.runtime.compiled_ops import round_site

CASTS = {"fp8_e4m3fn": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2, "bf16": torch.bfloat16}


def _activations(layout: str) -> torch.Tensor:
    """Values over every binade of the formats (and past their max), as an activation of ``layout``."""
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(8, 16, 12, 12, generator=generator) * torch.exp2(
        torch.randint(-20, 20, (8, 16, 12, 12), generator=generator).float())
    if layout == "channels_last":
        return x.contiguous(memory_format=torch.channels_last)
    if layout == "not dense":
        return x[:, ::2]
    return x


@pytest.mark.parametrize("layout", ["contiguous", "channels_last", "not dense"])
@pytest.mark.parametrize("name", ["fp8_e4m3fn", "fp8_e5m2", "bf16"])
def test_round_site_rounds_encodes_and_counts_as_torch_casts(name: str, layout: str) -> None:
    """Values: torch's cast (nearest, ties to even) where it does not overflow; overflowing values take the
    format's overflow mode (e4m3fn saturates, e5m2 and bf16 go to inf). Codes: the cast's bit patterns (16-bit
    codes as byte planes, low byte first), laid out as the input. Counts: the values that round past the
    format's max (e4m3fn by hand, the others where the cast gives inf), and none unencodable."""
    x = _activations(layout)
    dtype = CASTS[name]
    row, seed = format_row(name), torch.zeros((), dtype=torch.int64)
    cast = x.to(dtype)
    finfo = torch.finfo(dtype)
    # torch's e4m3fn cast saturates: by hand, past 464 (448 + half its ulp of 32; the tie rounds to even, 448);
    # the other casts go to inf
    overflowing = x.abs() > 464 if name == "fp8_e4m3fn" else cast.float().abs().isinf()
    expected = torch.where(overflowing, torch.copysign(torch.tensor(finfo.max if name == "fp8_e4m3fn" else
                                                                     float("inf")), x), cast.float())
    values, counts = round_site(x, row, seed, "nearest", None)
    assert values.shape == x.shape and torch.equal(values.view(torch.int32), expected.view(torch.int32))
    assert counts.tolist() == [int(overflowing.sum()), 0]
    nbytes = cast.element_size()
    codes, coded_counts = round_site(x, row, seed, "nearest", nbytes)
    patterns = expected.to(dtype).view(torch.uint8 if nbytes == 1 else torch.int16)
    if nbytes == 2:
        planes = patterns.to(torch.int32)
        patterns = torch.stack([(planes & 0xFF).to(torch.uint8), ((planes >> 8) & 0xFF).to(torch.uint8)])
    assert codes.dtype == torch.uint8 and torch.equal(codes, patterns)
    assert coded_counts.tolist() == counts.tolist()
    if layout != "not dense":  # the codes are laid out as the activation, so Inductor copies neither
        assert codes.stride()[-4:] == x.stride()


def test_round_site_is_one_compiled_pass_at_the_size_a_step_compiles() -> None:
    """At the size the runner compiles (``COMPILE_MIN_NUMEL``), the compiled kernel gives the eager one's bits."""
    from precsearch.formats.runner import KernelRunner, KernelSettings, Runtime, default_runtime

    x = torch.randn(COMPILE_MIN_NUMEL * 2) * 1e3
    row, seed = format_row("fp8_e5m2", "stochastic"), torch.tensor(7)
    compiled = round_site(x, row, seed, "stochastic", 1)
    ready = default_runtime().kernels.ready
    assert any(label.startswith("site rounded to 1-byte codes (stochastic)") for label in ready)
    with Runtime(KernelRunner(KernelSettings(enabled=False))).as_default():
        eager = round_site(x, row, seed, "stochastic", 1)
    assert torch.equal(compiled[0], eager[0]) and torch.equal(compiled[1], eager[1])
