"""The same numerics on CUDA: every test here is marked ``cuda`` and skipped where CUDA is absent.

References are the CPU results (tests/test_formats.py checks those against ml_dtypes, torch's casts and
hand tables) and torch's own CUDA casts where the semantics agree. torch's CUDA cast to float8_e4m3fn does
not saturate as its CPU cast does (5.5M of 16.7M values differed on an H200): ours is compared with the CPU
cast, the stated semantics (``overflow="saturate"``).
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

from precsearch.cost.policies import policy_from_assignment
from precsearch.formats.format import get_format
from precsearch.formats.kernels import decode, encode, quantize, round_and_count
from precsearch.formats.runner import default_runtime
from precsearch.graph.tracing import trace
from precsearch.models import build
from precsearch.runtime.model import apply_policy
from precsearch.search.strategies import baseline

pytestmark = [pytest.mark.cuda,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA is not available here")]

FORMATS = ["fp16", "bf16", "fp8_e5m2", "fp8_e4m3fn", "fp8_e4m3", "e5m2s", "e4m3b4s", "e6m9s", "e3m0", "e2m1s"]


def _values(n: int = 1 << 20) -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, generator=g) * torch.exp2(torch.randint(-40, 40, (n,), generator=g).float())
    x[:6] = torch.tensor([0.0, -0.0, float("inf"), -float("inf"), float("nan"), 2.0**-149])
    return x


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.cpu().view(torch.int32)


@pytest.mark.parametrize("spec", FORMATS)
@pytest.mark.parametrize("rounding", ["nearest", "stochastic"])
def test_every_format_rounds_on_cuda_bit_for_bit_as_on_cpu(spec, rounding):
    x = _values()
    for overflow in ("inf", "saturate", "nan"):
        seed = 12345
        cpu, _, cpu_counts = round_and_count(x, spec, rounding, overflow, seed=torch.tensor(seed), with_codes=False)
        cuda, _, cuda_counts = round_and_count(x.cuda(), spec, rounding, overflow, seed=torch.tensor(seed).cuda())
        assert torch.equal(_bits(cuda), _bits(cpu)), (spec, rounding, overflow)
        assert torch.equal(cuda_counts.cpu(), cpu_counts)
    failed = default_runtime().kernels.failed
    assert not failed, f"compile failed on CUDA for {failed}"


@pytest.mark.parametrize("spec", [s for s in FORMATS if get_format(s).bits <= 16])
def test_codes_round_trip_on_cuda_as_on_cpu(spec):
    x = quantize(_values(), spec, overflow="saturate")
    x = x[torch.isfinite(x)]
    codes = encode(x.cuda(), spec)
    assert torch.equal(codes.cpu(), encode(x, spec))
    assert torch.equal(_bits(decode(codes, spec)), _bits(x))


@pytest.mark.parametrize(("spec", "dtype"), [("fp16", torch.float16), ("bf16", torch.bfloat16),
                                             ("fp8_e5m2", torch.float8_e5m2)])
def test_quantize_on_cuda_equals_torchs_own_cuda_cast(spec, dtype):
    x = _values().cuda()
    assert torch.equal(_bits(quantize(x, spec)), _bits(x.to(dtype).float()))


def test_e4m3fn_saturates_on_cuda_as_torchs_cpu_cast():
    x = _values()
    x = x[torch.isfinite(x)]
    expected = x.to(torch.float8_e4m3fn).float()  # the CPU cast saturates
    assert torch.equal(_bits(quantize(x.cuda(), "fp8_e4m3fn", overflow="saturate")), _bits(expected))


def test_stochastic_rounding_compiles_on_cuda():
    x = torch.randn(1 << 24, device="cuda")
    q = quantize(x, "e5m2", "stochastic", generator=torch.Generator(device="cuda").manual_seed(0))
    assert not any(label.startswith("e5m2 ") for label in default_runtime().kernels.failed)
    assert torch.equal(quantize(q, "e5m2"), q)  # on the grid


def _steps(model, x, y, steps=3):
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=5e-4)
    scaler = getattr(model, "scaler", None)
    losses = []
    for _ in range(steps):
        optimizer.zero_grad()
        loss = F.cross_entropy(model(x), y)
        (scaler.scale(loss) if scaler is not None else loss).backward()
        (scaler.step(optimizer) if scaler is not None else optimizer.step())
        if scaler is not None:
            scaler.update()
        losses.append(loss.detach())
    return losses


def test_fp32_policy_trains_bit_identically_to_the_plain_model_on_cuda(monkeypatch):
    monkeypatch.setattr(torch.backends.cudnn, "deterministic", True)
    monkeypatch.setattr(torch.backends.cudnn, "benchmark", False)
    torch.manual_seed(0)
    plain = build("resnet18", width=0.25).cuda()
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(16, 3, 32, 32, generator=g).cuda(), torch.randint(0, 10, (16,), generator=g).cuda()
    model = copy.deepcopy(plain)
    wrapped = apply_policy(model, baseline("fp32", trace(plain, x[:2], batch_size=16)))
    assert all(torch.equal(a, b) for a, b in zip(_steps(plain, x, y), _steps(wrapped, x, y), strict=True))
    assert all(torch.equal(a, b) for a, b in zip(plain.state_dict().values(), model.state_dict().values(),
                                                 strict=True))


def test_a_paper_policy_step_on_cuda_matches_the_cpu_step(monkeypatch):
    monkeypatch.setattr(torch.backends.cudnn, "deterministic", True)
    torch.manual_seed(0)
    plain = build("tiny_cnn")
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(8, 3, 32, 32, generator=g), torch.randint(0, 10, (8,), generator=g)
    graph = trace(plain, x[:2], batch_size=8)
    low = {"weight": "e4m3b4s", "activation": "e4m3b4s", "activation_grad": "e5m2s", "weight_grad": "e6m9s"}
    policy = policy_from_assignment(graph, {t: low[graph.tensors[t].kind] for t in graph.assignable_ids()},
                                    high_format="e6m9s", promotion_threshold=0.01)
    cpu = apply_policy(copy.deepcopy(plain), policy)
    cuda = apply_policy(copy.deepcopy(plain).cuda(), policy, example_input=x[:2].cuda())
    cpu_loss = _steps(cpu, x, y, steps=1)[0]
    cuda_loss = _steps(cuda, x.cuda(), y.cuda(), steps=1)[0]
    # convolutions sum in another order on the GPU: the rounded values agree to the format, not bitwise
    assert abs(cpu_loss.item() - cuda_loss.item()) < 0.05 * abs(cpu_loss.item())
    assert cuda.formats() == cpu.formats()
