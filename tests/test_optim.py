"""precsearch.runtime.optim: master weights, pure low-precision updates (nearest, stochastic, Kahan) and optimizer state
formats, against torch's own bfloat16 arithmetic, plain fp32 optimizers and hand-computed figures."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from precsearch.config.optimizer import UpdateConfig
from precsearch.errors import PrecsearchError
from precsearch.formats.kernels import quantize
from precsearch.runtime.optim import (
    LowPrecisionOptimizer,
    apply_update,
    from_config,
    update_bytes_per_param,
)
from precsearch.runtime.scaling import DynamicLossScaler

BF16_ULP_1 = 2.0**-7  # bf16 spacing in [1, 2)


def bf16(x: torch.Tensor) -> torch.Tensor:
    """Oracle: torch's own round-to-nearest-even cast."""
    return x.to(torch.bfloat16).float()


def fixed_grad_run(optimizer: torch.optim.Optimizer, param: nn.Parameter, grads: list[torch.Tensor]) -> None:
    for grad in grads:
        param.grad = grad.clone()
        optimizer.step()


# ------------------------------------------------------------------------------------------ the bf16 sums


def test_bf16_thousand_small_additions_nearest_stochastic_kahan(seeds) -> None:
    assert torch.equal(seeds.bf16_sum("nearest"), torch.ones(4096))  # every 1e-3 update cancelled

    kahan = seeds.bf16_sum("kahan")
    assert (kahan - 2.0).abs().max() <= BF16_ULP_1

    sr = seeds.bf16_sum("stochastic")
    step = bf16(torch.tensor(1e-3)).item()  # the update as bf16 holds it
    expected = 1.0 + 1000 * step
    # Each step rounds up with probability p = step / ulp: variance ulp^2 p (1 - p) per step.
    p = step / BF16_ULP_1
    sd = (1000 * BF16_ULP_1**2 * p * (1 - p)) ** 0.5
    assert abs(sr.mean().item() - expected) < 4 * sd / len(sr) ** 0.5  # unbiased
    assert 0.8 * sd < sr.std().item() < 1.2 * sd
    assert (sr - 2.0).abs().le(0.1).float().mean() > 0.7  # 2.0 +- 0.1 for most single runs (sd is 0.08)


# ----------------------------------------------------------------------------------- update primitives


def test_nearest_and_kahan_match_torch_bfloat16_arithmetic() -> None:
    generator = torch.Generator().manual_seed(0)
    w = bf16(torch.randn(512, generator=generator))
    c = torch.zeros(512)
    w_ref, c_ref = w.to(torch.bfloat16), torch.zeros(512, dtype=torch.bfloat16)
    w_near = w.clone()
    near_ref = w.to(torch.bfloat16)
    for _ in range(200):
        delta = torch.randn(512, generator=generator) * 1e-3
        apply_update(w_near, delta, "bf16", "nearest")
        near_ref = near_ref + delta.to(torch.bfloat16)
        apply_update(w, delta, "bf16", "kahan", compensation=c)
        u = delta.to(torch.bfloat16)  # torch's bf16 ops round each result to bf16
        y = u - c_ref
        s = w_ref + y
        c_ref = (s - w_ref) - y
        w_ref = s
    assert torch.equal(w_near, near_ref.float())
    assert torch.equal(w, w_ref.float()) and torch.equal(c, c_ref.float())


def test_master_weights_follow_the_fp32_trajectory_and_model_holds_the_rounded_copy() -> None:
    generator = torch.Generator().manual_seed(0)
    init = torch.randn(64, generator=generator)
    grads = [torch.randn(64, generator=generator) for _ in range(20)]
    plain = nn.Parameter(init.clone())
    fixed_grad_run(torch.optim.SGD([plain], lr=0.1, momentum=0.9), plain, grads)

    param = nn.Parameter(init.clone())
    optimizer = LowPrecisionOptimizer(torch.optim.SGD([param], lr=0.1, momentum=0.9), "bf16", master_weights=True)
    fixed_grad_run(optimizer, param, grads)
    assert torch.equal(optimizer.master(param), plain.detach())
    assert torch.equal(param.detach(), bf16(plain.detach()))


def test_state_format_rounds_momentum_and_adam_moments() -> None:
    param = nn.Parameter(torch.randn(32))
    optimizer = LowPrecisionOptimizer(torch.optim.AdamW([param], lr=1e-2), "bf16", master_weights=True,
                                      state_format={"exp_avg": "fp16", "exp_avg_sq": "bf16"})
    fixed_grad_run(optimizer, param, [torch.randn(32) for _ in range(3)])
    state = optimizer.state[param]
    assert torch.equal(state["exp_avg"], state["exp_avg"].half().float())
    assert torch.equal(state["exp_avg_sq"], bf16(state["exp_avg_sq"]))
    assert not torch.equal(state["exp_avg"], bf16(state["exp_avg"]))  # really fp16, not bf16

    param = nn.Parameter(torch.randn(32))
    sgd = LowPrecisionOptimizer(torch.optim.SGD([param], lr=0.1, momentum=0.9), "bf16", "stochastic",
                                master_weights=False, state_format="bf16", generator=torch.Generator().manual_seed(0))
    fixed_grad_run(sgd, param, [torch.randn(32) for _ in range(3)])
    buffer = sgd.state[param]["momentum_buffer"]
    assert torch.equal(buffer, bf16(buffer)) and torch.equal(param.detach(), bf16(param.detach()))


def test_memory_formula() -> None:
    param = nn.Parameter(torch.zeros(10, 10))
    kahan = LowPrecisionOptimizer(torch.optim.SGD([param], lr=0.1, momentum=0.9), "bf16", "kahan",
                                  master_weights=False, state_format="bf16")
    assert kahan.memory_bytes() == {"weight": 200, "master_weight": 0, "compensation": 200, "optimizer_state": 200}
    param = nn.Parameter(torch.zeros(10, 10))
    mpt = LowPrecisionOptimizer(torch.optim.AdamW([param]), "fp16", master_weights=True)
    assert mpt.memory_bytes() == {"weight": 200, "master_weight": 400, "compensation": 0, "optimizer_state": 800}
    per = update_bytes_per_param("sgd", {"weight_format": "e5m2", "update": "stochastic", "master_weights": False},
                                 momentum=False)
    assert per == {"weight": 1.0, "master_weight": 0.0, "compensation": 0.0, "optimizer_state": 0.0}


def test_from_config_scheduler_and_loss_scaler_work_with_the_wrapper() -> None:
    model = nn.Linear(4, 3)
    inner = torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9)
    optimizer = from_config(inner, {"weight_format": "bf16", "update": "stochastic", "master_weights": False,
                                    "state_format": "bf16", "seed": 3})
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=4)
    scaler = DynamicLossScaler(init_scale=2.0**8)
    for _ in range(2):
        optimizer.zero_grad()
        scaler.scale(model(torch.ones(2, 4)).sum()).backward()
        scaler.step(optimizer)
        scaler.update()
        scheduler.step()
    assert inner.param_groups[0]["lr"] == pytest.approx(0.25)
    for p in model.parameters():
        assert torch.equal(p.detach(), bf16(p.detach()))
    assert scaler.skipped_steps == 0


def test_state_dict_round_trip_continues_identically() -> None:
    def make(param):
        return LowPrecisionOptimizer(torch.optim.SGD([param], lr=0.01), "bf16", "kahan", master_weights=False)

    generator = torch.Generator().manual_seed(0)
    grads = [torch.randn(16, generator=generator) for _ in range(10)]
    a = nn.Parameter(torch.ones(16))
    first = make(a)
    fixed_grad_run(first, a, grads[:5])
    b = nn.Parameter(a.detach().clone())
    second = make(b)
    second.load_state_dict(first.state_dict())
    fixed_grad_run(first, a, grads[5:])
    fixed_grad_run(second, b, grads[5:])
    assert torch.equal(a.detach(), b.detach())


def test_bad_settings_raise_clear_errors() -> None:
    param = nn.Parameter(torch.zeros(3))
    with pytest.raises(PrecsearchError, match="SGD, Adam, AdamW"):
        LowPrecisionOptimizer(torch.optim.RMSprop([param]))
    with pytest.raises(PrecsearchError, match="unknown weight update"):
        LowPrecisionOptimizer(torch.optim.SGD([param], lr=0.1), update="round-up")
    with pytest.raises(PrecsearchError, match="master"):
        LowPrecisionOptimizer(torch.optim.SGD([param], lr=0.1), update="kahan", master_weights=True)
    with pytest.raises(PrecsearchError, match="wider than the weight"):
        UpdateConfig("fp8_e5m2", "kahan", master_weights=False, compensation_format="bf16")
    with pytest.raises(PrecsearchError, match="momentum_buffer"):
        LowPrecisionOptimizer(torch.optim.SGD([param], lr=0.1, momentum=0.9), state_format="fp8_e4m3")
    with pytest.raises(PrecsearchError, match="exp_avg_sq"):
        LowPrecisionOptimizer(torch.optim.Adam([param]), state_format="fp16")
    with pytest.raises(PrecsearchError, match="unknown optimizer state"):
        LowPrecisionOptimizer(torch.optim.Adam([param]), state_format={"velocity": "bf16"})
    with pytest.raises(PrecsearchError, match="unknown optimizer setting"):
        from_config(torch.optim.SGD([param], lr=0.1), {"weight_fmt": "bf16"})
    with pytest.raises(PrecsearchError, match="unknown float format"):
        LowPrecisionOptimizer(torch.optim.SGD([param], lr=0.1), weight_format="bf17")
    with pytest.raises(PrecsearchError, match="closure"):
        LowPrecisionOptimizer(torch.optim.SGD([param], lr=0.1)).step(lambda: 0.0)


def test_fp32_parameters_are_left_to_the_inner_optimizer() -> None:
    low, high, plain = (nn.Parameter(torch.ones(4)) for _ in range(3))
    optimizer = LowPrecisionOptimizer(torch.optim.SGD([low, high], lr=1e-3), {low: "bf16"}, "nearest",
                                      master_weights=False)
    low.grad, high.grad = -torch.ones(4), -torch.ones(4)
    optimizer.step()
    fixed_grad_run(torch.optim.SGD([plain], lr=1e-3), plain, [-torch.ones(4)])
    assert torch.equal(low.detach(), torch.ones(4))  # bf16 cancels the update
    assert torch.equal(high.detach(), plain.detach())  # fp32: exactly the inner optimizer's result
    assert quantize(high.detach(), "bf16").ne(high.detach()).all()


def test_set_format_rerounds_weight_and_kahan_buffer_or_leaves_them_when_wider() -> None:
    generator = torch.Generator().manual_seed(0)
    param = nn.Parameter(torch.randn(256, generator=generator))
    optimizer = LowPrecisionOptimizer(torch.optim.SGD([param], lr=1.0), "fp16", "kahan", master_weights=False)
    fixed_grad_run(optimizer, param, [torch.randn(256, generator=generator) * 1e-4 for _ in range(3)])
    weight, buffer = param.detach().clone(), optimizer.state_dict()["compensation"][0]
    assert not torch.equal(weight, bf16(weight)) and not torch.equal(buffer, bf16(buffer))  # fp16 values
    optimizer.set_format(param, "bf16")  # narrower: both re-rounded (torch's own cast as the oracle)
    assert torch.equal(param.detach(), bf16(weight))
    assert torch.equal(optimizer.state_dict()["compensation"][0], bf16(buffer))
    fixed_grad_run(optimizer, param, [torch.randn(256, generator=generator) * 1e-2])
    assert torch.equal(param.detach(), bf16(param.detach())) and optimizer.memory_bytes()["weight"] == 512

    e5m2 = nn.Parameter(torch.randn(256, generator=generator))
    optimizer = LowPrecisionOptimizer(torch.optim.SGD([e5m2], lr=0.1), "fp8_e5m2", master_weights=False)
    before = e5m2.detach().clone()
    optimizer.set_format(e5m2, "fp16")  # wider: every fp8_e5m2 value is an fp16 value, nothing changes
    assert torch.equal(e5m2.detach(), before)
    fixed_grad_run(optimizer, e5m2, [torch.randn(256, generator=generator)])
    after = e5m2.detach()
    assert torch.equal(after, after.half().float())
    assert not torch.equal(after, after.to(torch.float8_e5m2).float())  # updated in fp16, not in fp8


def test_set_format_with_master_weights_to_fp32_and_bad_calls() -> None:
    generator = torch.Generator().manual_seed(1)
    init, grads = torch.randn(64, generator=generator), [torch.randn(64, generator=generator) for _ in range(4)]
    plain = nn.Parameter(init.clone())
    fixed_grad_run(torch.optim.SGD([plain], lr=0.1), plain, grads)
    param = nn.Parameter(init.clone())
    optimizer = LowPrecisionOptimizer(torch.optim.SGD([param], lr=0.1), "bf16", master_weights=True)
    fixed_grad_run(optimizer, param, grads[:2])
    optimizer.set_format(param, "fp16")  # the model's copy is rounded again from the fp32 master
    assert torch.equal(param.detach(), optimizer.master(param).half().float())
    optimizer.set_format(param, "fp32")  # handed back to the inner optimizer: the fp32 trajectory exactly
    fixed_grad_run(optimizer, param, grads[2:])
    assert optimizer.master(param) is None and torch.equal(param.detach(), plain.detach())

    stranger = nn.Parameter(torch.zeros(3))
    with pytest.raises(PrecsearchError, match="not one this optimizer updates"):
        optimizer.set_format(stranger, "bf16")
    kahan = LowPrecisionOptimizer(torch.optim.SGD([stranger], lr=0.1), "fp16", "kahan", master_weights=False,
                                  compensation_format="bf16")
    with pytest.raises(PrecsearchError, match="wider than the weight format"):
        kahan.set_format(stranger, "fp8_e5m2")


# --------------------------------------------------------------------------------------- digits (slow)


@pytest.mark.slow
def test_pure_bf16_digits_nearest_loses_stochastic_and_kahan_match_fp32(seeds) -> None:
    runs = {mode: seeds.bf16_digits(mode, seed=0, steps=1000, lr=0.003) for mode in seeds.MODES}
    fp32 = runs["fp32"].accuracy
    assert runs["nearest"].unchanged > 0.5  # most updates fall under half an ulp: nearest drops them
    assert runs["nearest"].accuracy < fp32 - 2.0
    assert abs(runs["stochastic"].accuracy - fp32) <= 0.5
    assert abs(runs["kahan"].accuracy - fp32) <= 0.5
