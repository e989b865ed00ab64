"""Low weight gradients held as their format's codes from their rounding to the end of the backward
(precsearch.runtime.gradients, and the compiled step's carriers: precsearch.runtime.compiled). Oracles: the same
runtime rounding the gradients in place as before (holding switched off through
``apply_policy(hold_gradients=...)``, as under DDP), the eager step for the compiled one, ``formats.quantize`` of
the raw gradient (a tensor hook on the parameter sees it before it is accumulated), and a real gloo process
group."""

from __future__ import annotations

import socket

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from precsearch.config.compiling import CompileOptions
from precsearch.config.policy import Policy
from precsearch.formats.kernels import quantize
from precsearch.models import build
from precsearch.runtime import compiled
from precsearch.runtime.gradients import no_process_group
from precsearch.runtime.model import apply_policy

PAPER_LOW = {"weight": "e4m3b4s", "activation": "e4m3b4s", "activation_grad": "e5m2s", "weight_grad": "e6m9s"}
SHAPE = (3, 32, 32)


def _wrapped(weight_grad: str = "fp16", overrides: dict[str, str] | None = None, hold_gradients=no_process_group,
             compile: CompileOptions | None = None):
    torch.manual_seed(0)
    policy = Policy(input_shape=SHAPE, batch_size=8, defaults={**PAPER_LOW, "weight_grad": weight_grad},
                    overrides=overrides or {})
    return apply_policy(build("tiny_cnn"), policy, hold_gradients=hold_gradients, compile=compile)


def _batch(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(8, *SHAPE, generator=g), torch.randint(0, 10, (8,), generator=g)


def _not_holding() -> bool:
    return False  # as under DDP: rounded in place, kept in .grad


def _train(wrapped, steps: int, backwards: int = 1) -> list[dict[str, torch.Tensor]]:
    """Each step's gradients (as the optimizer sees them), and the weights after the last step."""
    optimizer = torch.optim.SGD(wrapped.parameters(), lr=0.1, momentum=0.9)
    seen = []
    for step in range(steps):
        optimizer.zero_grad(set_to_none=True)
        for part in range(backwards):
            x, y = _batch(10 * step + part)
            F.cross_entropy(wrapped(x), y).backward()
        seen.append({name: p.grad.clone() for name, p in wrapped.module.named_parameters()})
        optimizer.step()
    seen.append({name: p.detach().clone() for name, p in wrapped.module.named_parameters()})
    return seen


@pytest.mark.parametrize("weight_grad", ["fp16", "fp8_e5m2"])  # 16-bit (int16) and 8-bit (uint8) codes
def test_held_gradients_train_bit_identically_to_in_place_rounding(weight_grad):
    held = _train(_wrapped(weight_grad), steps=3)
    in_place = _train(_wrapped(weight_grad, hold_gradients=_not_holding), steps=3)
    for step, (a, b) in enumerate(zip(held, in_place, strict=True)):
        for name in b:
            assert torch.equal(a[name], b[name]), (step, name)


def test_two_backwards_before_a_step_accumulate_exactly_as_without_holding():
    held = _train(_wrapped(), steps=2, backwards=2)
    in_place = _train(_wrapped(hold_gradients=_not_holding), steps=2, backwards=2)
    for step, (a, b) in enumerate(zip(held, in_place, strict=True)):
        for name in b:
            assert torch.equal(a[name], b[name]), (step, name)


def _grads_inside_backward(wrapped) -> tuple[dict[str, torch.Tensor | None], dict[str, torch.Tensor]]:
    """``.grad`` of each parameter as a post-accumulate hook registered after the runtime's sees it, and the raw
    gradient (before accumulation and rounding) each receives."""
    inside: dict[str, torch.Tensor | None] = {}
    raw: dict[str, torch.Tensor] = {}
    for name, param in wrapped.module.named_parameters():
        param.register_hook(lambda g, name=name: raw.update({name: g.clone()}))
        param.register_post_accumulate_grad_hook(
            lambda p, name=name: inside.update({name: None if p.grad is None else p.grad.clone()}))
    x, y = _batch(0)
    F.cross_entropy(wrapped(x), y).backward()
    return inside, raw


def test_a_held_gradient_is_none_inside_the_backward_and_set_when_backward_returns():
    """conv1's gradient (fp16) is held: None to a later hook, then the rounded raw gradient; conv2's is fp32
    (an override): the raw gradient all along."""
    wrapped = _wrapped(overrides={"conv2:weight_grad": "fp32"})
    inside, raw = _grads_inside_backward(wrapped)
    params = dict(wrapped.module.named_parameters())
    assert inside["conv1.weight"] is None and inside["linear.weight"] is None
    assert torch.equal(params["conv1.weight"].grad, quantize(raw["conv1.weight"], "fp16"))
    assert not torch.equal(params["conv1.weight"].grad, raw["conv1.weight"])
    assert torch.equal(inside["conv2.weight"], raw["conv2.weight"])
    assert torch.equal(params["conv2.weight"].grad, raw["conv2.weight"])


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_nothing_is_held_while_a_process_group_is_up():
    """A gloo process group of world size 1: every low gradient is rounded in place and stays in ``.grad``
    during the backward, where DDP's reducer reads it."""
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{_free_port()}", rank=0, world_size=1)
    try:
        inside, raw = _grads_inside_backward(_wrapped())
    finally:
        dist.destroy_process_group()
    for name, grad in inside.items():
        assert grad is not None and torch.equal(grad, quantize(raw[name], "fp16")), name


@pytest.mark.parametrize(("weight_grad", "overflow"), [("e6m9s", "saturate"), ("e6m9s", "inf"), ("e4m3fn", "inf")])
def test_a_format_without_inf_or_nan_codes_is_held_too(weight_grad, overflow):
    """e6m9s has no inf or NaN code, an fn format no inf code: their gradients are held as codes as well (None to
    a later hook), and come back as the raw gradient rounded (``formats.quantize``)."""
    torch.manual_seed(0)
    policy = Policy(input_shape=SHAPE, batch_size=8, defaults={**PAPER_LOW, "weight_grad": weight_grad},
                    overflow={"weight_grad": overflow})
    wrapped = apply_policy(build("tiny_cnn"), policy)
    inside, raw = _grads_inside_backward(wrapped)
    for name, param in wrapped.module.named_parameters():
        assert inside[name] is None, name
        assert torch.equal(param.grad, quantize(raw[name], weight_grad, overflow=overflow)), name


@pytest.mark.parametrize("compile", [None, CompileOptions(backend="aot_eager")], ids=["eager", "compiled"])
@pytest.mark.parametrize("poison", [float("inf"), float("nan")], ids=["inf", "nan"])
def test_an_inf_or_nan_weight_gradient_its_codes_miss_skips_the_step(compile, poison):
    """Only the weight gradients are low (e6m9s, no inf or NaN code), so no rounding counts a non-finite value
    but theirs: one input value is ``poison``, which makes the loss and every gradient NaN. Held as codes the
    weight gradients come back finite (the format's largest magnitude), yet the step is skipped and the loss
    scale backs off, as for a NaN in ``.grad`` (oracle: the weights unchanged, ``skipped_steps``, the scale
    halved)."""
    torch.manual_seed(0)
    fp32 = {kind: "fp32" for kind in PAPER_LOW}
    policy = Policy(input_shape=SHAPE, batch_size=8, defaults={**fp32, "weight_grad": "e6m9s"},
                    loss_scaling={"mode": "dynamic", "init_scale": 1024.0})
    wrapped = apply_policy(build("tiny_cnn"), policy, compile=compile)
    optimizer = torch.optim.SGD(wrapped.parameters(), lr=0.1)
    before = {name: p.detach().clone() for name, p in wrapped.module.named_parameters()}
    x, y = _batch(0)
    x[0, 0, 0, 0] = poison
    wrapped.scaler.scale(F.cross_entropy(wrapped(x), y)).backward()
    assert torch.isfinite(wrapped.module.linear.weight.grad).all()  # held as codes: no inf or NaN code
    wrapped.scaler.step(optimizer)
    wrapped.scaler.update()
    assert wrapped.scaler.skipped_steps == 1
    assert wrapped.scaler.get_scale() == 512.0
    for name, p in wrapped.module.named_parameters():
        assert torch.equal(p.detach(), before[name]), name


def _carried(monkeypatch) -> list[tuple[tuple[int, ...], int]]:
    """(the weight's shape, bytes) of each gradient the compiled backward hands a weight's carrier, as it
    arrives."""
    carried = []
    make = compiled.gradient_carrier

    def recording(param, *args):
        carrier = make(param, *args)
        carrier.register_hook(lambda g: carried.append((tuple(param.shape), g.numel() * g.element_size())))
        return carrier

    monkeypatch.setattr(compiled, "gradient_carrier", recording)
    return carried


@pytest.mark.parametrize(("weight_grad", "code", "scales"), [("fp16", 2, 0), ("fp8_e5m2", 1, 0), ("e6m9s", 2, 0),
                                                             ("e5m2@tensor", 1, 1)])
def test_the_compiled_backward_hands_out_each_weight_gradient_as_codes_of_its_width(monkeypatch, weight_grad, code,
                                                                                     scales):
    """Under compile, every low weight gradient leaves the backward as its format's codes (``code`` bytes a
    value, not float32's 4; a scaled format's scales as one byte each), as the eager runtime holds it, and
    ``.grad`` is then bit for bit the eager step's (aot_eager runs the same float32 ops)."""
    carried = _carried(monkeypatch)
    options = CompileOptions(backend="aot_eager")
    done = _train(_wrapped(weight_grad, compile=options), steps=1)
    eager = _train(_wrapped(weight_grad), steps=1)
    params = dict(_wrapped(weight_grad).module.named_parameters())
    assert sorted(carried) == sorted((tuple(p.shape), code * p.numel() + scales) for p in params.values())
    for name in params:
        assert torch.equal(done[0][name], eager[0][name]), name
        assert torch.equal(done[1][name], eager[1][name]), name


@pytest.mark.slow  # compiles two graphs
def test_compiled_held_gradients_accumulate_as_the_compiled_step_that_keeps_float32():
    """Two backwards before each step: holding codes changes nothing against the compiled step not allowed to
    hold them (as under DDP), which hands out float32 gradients (none through a carrier): each backward's
    gradient is rounded, then added to ``.grad``."""
    options = CompileOptions(backend="aot_eager")
    held = _train(_wrapped(compile=options), steps=2, backwards=2)
    with pytest.MonkeyPatch.context() as monkeypatch:
        carried = _carried(monkeypatch)
        in_float32 = _train(_wrapped(hold_gradients=_not_holding, compile=options), steps=2, backwards=2)
    assert carried == []
    for step, (a, b) in enumerate(zip(held, in_float32, strict=True)):
        for name in b:
            assert torch.equal(a[name], b[name]), (step, name)


@pytest.mark.parametrize(("weight_grad", "code"), [("fp16", 2), ("fp8_e5m2", 1), ("e6m9s", 2), ("e4m3b4s", 1)])
def test_the_eager_backward_holds_each_weight_gradient_as_codes_of_its_width(monkeypatch, weight_grad, code):
    """Each low weight gradient is held in the backward as ``code`` bytes a value (counted where the runtime
    hands them to ``hold_as_codes``), not float32's 4, e6m9s (no inf or NaN code) and e4m3b4s too."""
    from precsearch.runtime import gradients

    held = []
    hold = gradients.hold_as_codes

    def recording(param, codes):
        held.append((tuple(param.shape), codes.nbytes))
        hold(param, codes)

    monkeypatch.setattr(gradients, "hold_as_codes", recording)
    wrapped = _wrapped(weight_grad)
    _train(wrapped, steps=1)
    assert sorted(held) == sorted((tuple(p.shape), code * p.numel()) for p in wrapped.module.parameters())
