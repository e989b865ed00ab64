"""precsearch.runtime.accumulate: chunked low-precision accumulation against scalar loops in numpy/ml_dtypes types,
chunked layers against torch's Linear/Conv2d, the swamping claim against fp64, and FP8 digits training."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from precsearch.errors import PrecsearchError
from precsearch.runtime.accumulate import ChunkedConv2d, ChunkedLinear, chunked_matmul, chunked_sum, swap_chunked_layers

NEAR_FP32 = "e8m22"  # one mantissa bit short of fp32: exercises every loop, results within fp32 tolerance


def loop_matmul(a: np.ndarray, b: np.ndarray, dtype, chunk: int | None) -> np.ndarray:
    """Oracle: element by element, each add done in float32 and rounded to ``dtype`` by numpy/ml_dtypes."""
    m, k = a.shape
    n = b.shape[1]
    cl = k if chunk is None else chunk
    out = np.zeros((m, n), dtype=np.float32)
    for i in range(m):
        for j in range(n):
            total = None
            for start in range(0, k, cl):
                acc = None
                for t in range(start, min(start + cl, k)):
                    product = np.float32(a[i, t]) * np.float32(b[t, j])
                    acc = dtype(product) if acc is None else dtype(np.float32(acc) + product)
                total = acc if total is None else dtype(np.float32(total) + np.float32(acc))
            out[i, j] = np.float32(total)
    return out


@pytest.mark.parametrize("fmt, dtype", [("fp16", np.float16), ("bf16", ml_dtypes.bfloat16)])
@pytest.mark.parametrize("chunk", [None, 1, 5, 64])
def test_chunked_matmul_matches_a_scalar_loop(fmt, dtype, chunk) -> None:
    generator = torch.Generator().manual_seed(0)
    a = torch.rand(3, 37, generator=generator) * 4
    b = torch.rand(37, 2, generator=generator) * 4
    ours = chunked_matmul(a, b, fmt, chunk).numpy()
    np.testing.assert_array_equal(ours, loop_matmul(a.numpy(), b.numpy(), dtype, chunk))


def test_summing_16384_values_in_e6m9s_sequential_swamps_chunked_does_not(seeds) -> None:
    errors = seeds.accumulation_errors(16384)
    assert errors["sequential"] > 0.5  # the running sum stalls near 2**10: each U(0,1) addend < half an ulp
    assert errors["chunk 64"] < 1e-2


def test_chunked_sum_and_batched_operands() -> None:
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(70, 3, generator=generator)
    assert torch.allclose(chunked_sum(x, NEAR_FP32, 8), x.sum(0), atol=1e-5)
    a, b = torch.randn(2, 5, 9, generator=generator), torch.randn(2, 9, 4, generator=generator)
    assert torch.allclose(chunked_matmul(a, b, NEAR_FP32, 4), a @ b, atol=1e-5)


def test_chunked_linear_forward_backward_match_linear() -> None:
    torch.manual_seed(0)
    linear = nn.Linear(20, 7)
    chunked = ChunkedLinear.from_linear(linear, NEAR_FP32, chunk=3)
    assert chunked.weight is linear.weight and chunked.bias is linear.bias
    x = torch.randn(5, 4, 20, requires_grad=True)
    out_ref, out = linear(x), chunked(x)
    grad = torch.randn_like(out_ref)
    refs = torch.autograd.grad(out_ref, (x, linear.weight, linear.bias), grad)
    ours = torch.autograd.grad(out, (x, linear.weight, linear.bias), grad)
    assert torch.allclose(out, out_ref, atol=1e-5)
    for r, o in zip(refs, ours, strict=True):
        assert torch.allclose(o, r, atol=1e-5)


def test_chunked_linear_backward_gemms_accumulate_in_the_format() -> None:
    torch.manual_seed(0)
    layer = ChunkedLinear(40, 6, bias=False, acc_format="e5m2", chunk=8)
    x = torch.rand(9, 40, requires_grad=True)
    grad = torch.rand(9, 6)
    gx, gw = torch.autograd.grad(layer(x), (x, layer.weight), grad)
    assert torch.equal(gx, chunked_matmul(grad, layer.weight.detach(), "e5m2", 8))
    assert torch.equal(gw, chunked_matmul(grad.t(), x.detach(), "e5m2", 8))
    assert not torch.allclose(gw, grad.t() @ x.detach(), rtol=1e-3)  # and that is visibly not fp32


@pytest.mark.parametrize("options", [
    dict(stride=1, padding=1, dilation=1, groups=1, bias=True),
    dict(stride=2, padding=(1, 2), dilation=1, groups=2, bias=False),
    dict(stride=1, padding=2, dilation=2, groups=4, bias=True),
])
def test_chunked_conv2d_forward_backward_match_conv2d(options) -> None:
    torch.manual_seed(0)
    conv = nn.Conv2d(8, 12, 3, **options)
    chunked = ChunkedConv2d.from_conv(conv, NEAR_FP32, chunk=5)
    x = torch.randn(2, 8, 9, 7, requires_grad=True)
    out_ref, out = conv(x), chunked(x)
    grad = torch.randn_like(out_ref)
    params = [conv.weight] + ([conv.bias] if conv.bias is not None else [])
    refs = torch.autograd.grad(out_ref, [x, *params], grad)
    ours = torch.autograd.grad(out, [x, *params], grad)
    assert out.shape == out_ref.shape and torch.allclose(out, out_ref, atol=1e-5)
    for r, o in zip(refs, ours, strict=True):
        assert torch.allclose(o, r, atol=1e-4)


def test_swap_chunked_layers_by_name_glob_and_filter() -> None:
    def model() -> nn.Sequential:
        torch.manual_seed(0)
        return nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.ReLU(), nn.Flatten(),
                             nn.Sequential(nn.Linear(4 * 16, 8), nn.Linear(8, 2)))

    plain, swapped = model(), model()
    optimizer = torch.optim.SGD(swapped.parameters(), lr=0.1)  # built before the swap: must keep working
    params_before = list(swapped.parameters())
    assert swap_chunked_layers(swapped, ["0", "3.*"], NEAR_FP32, chunk=16) == ["0", "3.0", "3.1"]
    assert isinstance(swapped[0], ChunkedConv2d) and isinstance(swapped[3][1], ChunkedLinear)
    assert [p is q for p, q in zip(params_before, swapped.parameters(), strict=True)] == [True] * 6
    x = torch.randn(2, 3, 4, 4)
    assert torch.allclose(swapped(x), plain(x), atol=1e-5)
    swapped(x).sum().backward()
    before = swapped[3][1].weight.detach().clone()
    optimizer.step()
    assert not torch.equal(before, swapped[3][1].weight.detach())

    only_linear = model()
    names = swap_chunked_layers(only_linear, lambda name, m: isinstance(m, nn.Linear))
    assert names == ["3.0", "3.1"] and type(only_linear[0]) is nn.Conv2d


def test_bad_input_raises_clear_errors() -> None:
    with pytest.raises(PrecsearchError, match="chunk length"):
        chunked_matmul(torch.ones(2, 3), torch.ones(3, 2), "e6m9s", 0)
    with pytest.raises(PrecsearchError, match="chunk length"):
        ChunkedLinear(3, 2, chunk=-4)
    with pytest.raises(PrecsearchError, match="chunk length"):
        swap_chunked_layers(nn.Sequential(nn.Linear(2, 2)), chunk=0)
    with pytest.raises(PrecsearchError, match="matches"):
        swap_chunked_layers(nn.Sequential(nn.Linear(2, 2)), ["head"])
    with pytest.raises(PrecsearchError, match="padding"):
        ChunkedConv2d.from_conv(nn.Conv2d(2, 2, 3, padding="same"))
    with pytest.raises(PrecsearchError, match="inner dimensions"):
        chunked_matmul(torch.ones(2, 3), torch.ones(4, 2), "e6m9s")
    with pytest.raises(PrecsearchError, match="unknown float format"):
        chunked_matmul(torch.ones(2, 3), torch.ones(3, 2), "e6m9x")


@pytest.mark.slow
def test_fp8_digits_training_is_within_one_point_of_fp32(seeds) -> None:
    fp32 = seeds.fp8_digits(False, seed=0, steps=300, lr=0.01).accuracy
    fp8 = seeds.fp8_digits(True, seed=0, steps=300, lr=0.01).accuracy
    assert fp32 > 90.0  # a trained model, so the comparison means something
    assert abs(fp8 - fp32) <= 1.0


def test_conv_gradient_fold_is_rounded_to_the_format() -> None:
    conv = ChunkedConv2d(2, 3, 3, padding=1, acc_format="bf16", chunk=4)
    x = torch.randn(1, 2, 5, 5, requires_grad=True)
    (grad_x,) = torch.autograd.grad(conv(x).sum(), x)
    assert torch.equal(grad_x, grad_x.to(torch.bfloat16).float())
    assert F.conv2d(x, conv.weight, padding=1).shape == conv(x).shape
