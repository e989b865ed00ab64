"""Checkpoints: the ordinary torch.save of model and optimizer state dicts carries precsearch's training state."""

from __future__ import annotations

import io

import pytest
import torch
import torch.nn.functional as F

from precsearch.config.policy import Policy
from precsearch.errors import PrecsearchError
from precsearch.models import build
from precsearch.runtime.model import apply_policy
from precsearch.runtime.optim import LowPrecisionOptimizer

SHAPE = (3, 8, 8)  # small tensors: the quantizer runs eagerly (no compile time)
# pure e5m2s weights (no fp32 masters: the optimizer keeps each weight's format), stochastic rounding of
# activations (a counter that must carry over), a dynamic loss scale started far too high (it backs off)
POLICY = Policy(input_shape=SHAPE, batch_size=8, high_format="e6m9s", master_weights=False,
                defaults={"weight": "e5m2s", "activation": "e4m3b4s", "activation_grad": "e5m2s",
                          "weight_grad": "e6m9s"},
                rounding={"activation": "stochastic"}, promotion_threshold=1e-3,
                loss_scaling={"mode": "dynamic", "init_scale": 2.0**30, "growth_interval": 2})


def _fresh():
    torch.manual_seed(0)
    model = build("tiny_cnn")
    wrapped = apply_policy(model, POLICY, seed=3)
    optimizer = wrapped.wrap_optimizer(torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9))
    return model, wrapped, optimizer


def _steps(wrapped, optimizer, first, count):
    losses = []
    for step in range(first, first + count):
        g = torch.Generator().manual_seed(step)
        x, y = torch.randn(8, *SHAPE, generator=g), torch.randint(0, 10, (8,), generator=g)
        optimizer.zero_grad()
        loss = F.cross_entropy(wrapped(x), y)
        wrapped.scaler.scale(loss).backward()
        wrapped.scaler.step(optimizer)
        wrapped.scaler.update()
        losses.append(loss.item())
    return losses


def _start():
    model, wrapped, optimizer = _fresh()
    with torch.no_grad():
        model.linear.weight[0, 0] = 2.0**18  # past e5m2s's max: the guard promotes linear:weight at step 1
    _steps(wrapped, optimizer, 0, 3)
    return model, wrapped, optimizer


def test_a_checkpoint_after_a_promotion_and_a_back_off_continues_bit_identically():
    model, wrapped, optimizer = _start()
    assert "linear:weight" in [p.id for p in wrapped.promotions]
    assert wrapped.scaler.skipped_steps >= 1 and wrapped.scaler.get_scale() < 2.0**30  # it backed off
    buffer = io.BytesIO()
    torch.save({"model": wrapped.state_dict(), "opt": optimizer.state_dict()}, buffer)
    promoted = list(wrapped.promotions)
    uninterrupted = _steps(wrapped, optimizer, 3, 5)

    _, resumed, resumed_optimizer = _fresh()  # fresh model, wrapper and optimizer, as a new process would
    buffer.seek(0)
    checkpoint = torch.load(buffer, weights_only=False)
    resumed.load_state_dict(checkpoint["model"])
    resumed_optimizer.load_state_dict(checkpoint["opt"])
    assert resumed.promotions == promoted and resumed.formats()["linear:weight"] == "e6m9s"
    continued = _steps(resumed, resumed_optimizer, 3, 5)
    assert continued == uninterrupted  # bit for bit
    for (name, a), b in zip(wrapped.state_dict().items(), resumed.state_dict().values(), strict=True):
        if isinstance(a, torch.Tensor):
            assert torch.equal(a, b), name
    assert resumed.scaler.state_dict() == wrapped.scaler.state_dict()
    assert resumed.step_count == wrapped.step_count == 8


def test_without_the_extra_state_the_promotion_and_scale_are_lost():
    # the defect the checkpoint fixes: the inner model's state_dict alone restarts the guard and the scale
    model, wrapped, _ = _start()
    _, resumed, _ = _fresh()
    resumed.module.load_state_dict(model.state_dict())
    assert resumed.promotions == [] and resumed.scaler.get_scale() == 2.0**30
    with pytest.raises(PrecsearchError, match="no precsearch training state"):
        resumed.set_extra_state({"step": 3})


def test_the_optimizer_state_keeps_a_promoted_weights_format():
    # with fp32 masters, loading used to round every weight from its master to the format it started in
    def optimizer_of(weight):
        return LowPrecisionOptimizer(torch.optim.SGD([weight], lr=0.1), weight_format="e4m3b4s")

    g = torch.Generator().manual_seed(0)
    weight = torch.nn.Parameter(torch.randn(64, generator=g))
    optimizer = optimizer_of(weight)
    optimizer.set_format(weight, "e6m9s")  # what the runtime does when the guard promotes the weight
    state, saved = optimizer.state_dict(), weight.detach().clone()
    fresh = torch.nn.Parameter(saved.clone())
    loaded = optimizer_of(fresh)
    loaded.load_state_dict(state)
    assert torch.equal(fresh.detach(), saved) and torch.equal(loaded.master(fresh), optimizer.master(weight))
    assert loaded.memory_bytes() == optimizer.memory_bytes()

