"""The runtime wrapper: exactness at fp32, rounding of every tensor kind, promotion, loss scaling, packed memory.

Tensors stay below formats.COMPILE_MIN_NUMEL elements so the quantizer runs eagerly (no compile time here).
Reference values come from precsearch.formats.kernels.quantize on values captured with module hooks (an independent
path: the hooks see what the model's own modules receive), from the unwrapped model, and from the cost model.
"""

from __future__ import annotations

import contextlib
import copy
import inspect
import math
import types

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.multiprocessing.reductions import StorageWeakRef

from precsearch.config.policy import Accumulation, Policy
from precsearch.config.spaces import paper_space
from precsearch.config.spec import ASSIGNABLE_KINDS
from precsearch.cost.model import CostModel, measure_saved_bytes
from precsearch.cost.policies import policy_from_assignment
from precsearch.errors import PrecsearchError
from precsearch.formats.kernels import quantize
from precsearch.graph.tracing import trace
from precsearch.models import build
from precsearch.runtime.accumulate import ChunkedConv2d, ChunkedLinear, chunked_matmul, swap_chunked_layers
from precsearch.runtime.model import PrecisionModel, apply_policy
from precsearch.runtime.optim import LowPrecisionOptimizer
from precsearch.runtime.scaling import AdaptiveLossScaler, DynamicLossScaler
from precsearch.search.strategies import baseline

PAPER_LOW = {"weight": "e4m3b4s", "activation": "e4m3b4s", "activation_grad": "e5m2s", "weight_grad": "e6m9s"}
SHAPE = (3, 32, 32)


def _batch(n: int = 8, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, *SHAPE, generator=g), torch.randint(0, 10, (n,), generator=g)


def _policy(batch: int = 8, **fields) -> Policy:
    fields.setdefault("defaults", dict(PAPER_LOW))
    return Policy(input_shape=SHAPE, batch_size=batch, **fields)


def _model(name: str = "tiny_cnn", **options) -> nn.Module:
    torch.manual_seed(0)
    return build(name, **options)


def _representable(t: torch.Tensor, fmt: str) -> bool:
    return torch.equal(quantize(t, fmt), t)


class Untraceable(nn.Module):
    """Data-dependent control flow defeats torch.fx, so the runtime falls back to module hooks."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3, padding=1)
        self.bn = nn.BatchNorm2d(8)
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(8, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.bn(self.conv(x))
        out = torch.relu(out) if out.mean() > -1 else out  # a function op: not enforceable with hooks
        return self.fc(torch.flatten(self.pool(out), 1))


# --------------------------------------------------------------------------------------------- fp32


@pytest.mark.parametrize("name", ["tiny_cnn", "resnet18", "untraceable"])
def test_all_fp32_policy_is_bitwise_identical_to_the_plain_model(name):
    if name == "untraceable":
        torch.manual_seed(0)
        plain = Untraceable()
    else:
        plain = _model(name, width=0.125) if name == "resnet18" else _model(name)
    wrapped_model = copy.deepcopy(plain)
    expect_warning = name == "untraceable"
    with pytest.warns(UserWarning, match="torch.fx could not trace") if expect_warning else contextlib.nullcontext():
        wrapped = apply_policy(wrapped_model, _policy(defaults=dict.fromkeys(ASSIGNABLE_KINDS, "fp32")), strict=False)
    assert (wrapped.graph.graph_module is None) == (name == "untraceable")
    optimizers = [torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9, weight_decay=5e-4)
                  for m in (plain, wrapped)]
    for step in range(4):
        x, y = _batch(seed=step)
        losses = []
        for model, optimizer in zip((plain, wrapped), optimizers, strict=True):
            optimizer.zero_grad()
            loss = F.cross_entropy(model(x), y)
            scaler = getattr(model, "scaler", None)
            (scaler.scale(loss) if scaler is not None else loss).backward()
            losses.append(loss)
        assert torch.equal(losses[0], losses[1])
        for a, b in zip(plain.parameters(), wrapped_model.parameters(), strict=True):
            assert torch.equal(a.grad, b.grad)
        optimizers[0].step()
        wrapped.scaler.step(optimizers[1])
        wrapped.scaler.update()
    for a, b in zip(plain.state_dict().values(), wrapped_model.state_dict().values(), strict=True):
        assert torch.equal(a, b)


# ---------------------------------------------------------------------------------- every tensor kind


KIND_FORMATS = {"weight": "e4m3b4s", "activation": "fp8_e4m3", "activation_grad": "e5m2s", "weight_grad": "bf16"}
HIGH_IDS = ("relu1:activation", "relu1:activation_grad", "conv2:weight", "conv2:weight_grad")


@pytest.mark.filterwarnings("ignore:Full backward hook is firing")
def test_every_kind_is_rounded_to_its_format_and_high_tensors_stay_untouched():
    model = _model()
    policy = _policy(defaults=dict(KIND_FORMATS), overrides=dict.fromkeys(HIGH_IDS, "fp32"))
    wrapped = apply_policy(model, policy)
    seen: dict[str, object] = {}

    def forward_in(name):
        def hook(module, args):
            seen[f"{name}.in"] = args[0].detach().clone()
            if hasattr(module, "weight"):
                seen[f"{name}.weight"] = module.weight.detach().clone()  # what the module computes with
        return hook

    def forward_out(name):
        def hook(module, args, output):
            seen[f"{name}.out"] = output.detach().clone()  # the op's own output, before rounding
        return hook

    def backward(name):
        def hook(module, grad_input, grad_output):
            seen[f"{name}.grad_in"] = grad_input[0]
            seen[f"{name}.grad_out"] = grad_output[0]
        return hook

    for name in ("conv1", "bn1", "relu1", "pool1", "conv2"):
        module = model.get_submodule(name)
        module.register_forward_pre_hook(forward_in(name))
        module.register_forward_hook(forward_out(name))
        module.register_full_backward_hook(backward(name))
    raw_grads = {}
    for name in ("conv1", "conv2"):
        model.get_submodule(name).weight.register_hook(lambda g, name=name: raw_grads.update({name: g.clone()}))

    optimizer = torch.optim.SGD(wrapped.parameters(), lr=0.5)
    for _ in range(2):  # the second step checks again after the masters moved off the format grid
        seen.clear()
        raw_grads.clear()
        optimizer.zero_grad()
        x, y = _batch()
        F.cross_entropy(wrapped(x), y).backward()

        # weights: the conv computes with the master rounded to e4m3b4s; an fp32 weight is the master itself
        master = model.conv1.weight.detach()
        assert torch.equal(seen["conv1.weight"], quantize(master, "e4m3b4s"))
        assert torch.equal(seen["conv2.weight"], model.conv2.weight.detach())
        # activations: the input batch and conv1's output reach the next op rounded to fp8_e4m3
        assert torch.equal(seen["conv1.in"], quantize(x, "fp8_e4m3"))
        assert torch.equal(seen["bn1.in"], quantize(seen["conv1.out"], "fp8_e4m3"))
        assert not torch.equal(seen["bn1.in"], seen["conv1.out"])
        # relu1:activation is fp32: pool1 receives relu1's output bit for bit
        assert torch.equal(seen["pool1.in"], seen["relu1.out"])
        # activation gradients: conv1's backward receives bn1's input gradient rounded to e5m2s ...
        assert torch.equal(seen["conv1.grad_out"], quantize(seen["bn1.grad_in"], "e5m2s"))
        assert not torch.equal(seen["conv1.grad_out"], seen["bn1.grad_in"])
        # ... and relu1's fp32 gradient arrives untouched
        assert torch.equal(seen["relu1.grad_out"], seen["pool1.grad_in"])
        # weight gradients: the optimizer sees conv1's gradient rounded to bf16, conv2's (fp32) as computed
        assert torch.equal(model.conv1.weight.grad, quantize(raw_grads["conv1"], "bf16"))
        assert not torch.equal(model.conv1.weight.grad, raw_grads["conv1"])
        assert torch.equal(model.conv2.weight.grad, raw_grads["conv2"])
        for tensor_id, spec in wrapped.formats().items():
            info = wrapped.graph.tensors[tensor_id]
            expected = "fp32" if tensor_id in HIGH_IDS else KIND_FORMATS[info.kind]
            assert spec == expected
        optimizer.step()
    # with master weights the parameters stay fp32 and leave the format's grid
    assert not _representable(model.conv1.weight.detach(), "e4m3b4s")


def test_pure_low_precision_weights_stay_on_the_grid_through_the_optimizer():
    model = _model()
    wrapped = apply_policy(model, _policy(master_weights=False, optimizer={"update": "stochastic"}))
    optimizer = wrapped.wrap_optimizer(torch.optim.SGD(wrapped.parameters(), lr=0.1, momentum=0.9))
    assert isinstance(optimizer, LowPrecisionOptimizer) and optimizer.master(model.conv1.weight) is None
    before = model.conv1.weight.detach().clone()
    for step in range(3):
        optimizer.zero_grad()
        x, y = _batch(seed=step)
        F.cross_entropy(wrapped(x), y).backward()
        optimizer.step()
        for param in model.parameters():
            assert _representable(param.detach(), "e4m3b4s")
    assert not torch.equal(before, model.conv1.weight)


def test_stochastic_weight_rounding_with_master_weights_draws_fresh_roundings():
    model = _model()
    wrapped = apply_policy(model, baseline("wang_fp8", trace(model, torch.zeros(2, *SHAPE), batch_size=8)))
    assert wrapped.wrap_optimizer(optimizer := torch.optim.SGD(model.parameters(), lr=0.1)) is optimizer
    used = []
    model.conv2.register_forward_pre_hook(lambda module, args: used.append(module.weight.detach().clone()))
    x, _ = _batch()
    wrapped(x)
    wrapped(x)
    master = model.conv2.weight.detach()
    assert all(_representable(w, "e5m2s") for w in used)
    assert not torch.equal(used[0], used[1])  # two stochastic roundings of one master
    neighbours = (used[0] == quantize(master, "e5m2s", overflow="saturate"))
    assert 0.3 < neighbours.float().mean().item() < 1.0  # sometimes the other neighbour, often the nearest


# ------------------------------------------------------------------------------------------ promotion


def _train(wrapped: PrecisionModel, steps: int, lr: float, loss_factor: float = 1.0) -> list[float]:
    optimizer = torch.optim.SGD(wrapped.parameters(), lr=lr, momentum=0.9)
    losses = []
    x, y = _batch(n=8)
    for _ in range(steps):
        optimizer.zero_grad()
        loss = F.cross_entropy(wrapped(x), y)
        wrapped.scaler.scale(loss * loss_factor).backward()
        wrapped.scaler.step(optimizer)
        wrapped.scaler.update()
        losses.append(loss.item())
    return losses


def _one_step_on_input(policy: Policy, x: torch.Tensor) -> PrecisionModel:
    torch.manual_seed(0)
    wrapped = apply_policy(nn.Sequential(nn.Linear(x.shape[1], 2)), policy)
    optimizer = torch.optim.SGD(wrapped.parameters(), lr=0.1)
    loss = F.cross_entropy(wrapped(x), torch.zeros(len(x), dtype=torch.long))
    wrapped.scaler.scale(loss).backward()
    wrapped.scaler.step(optimizer)
    wrapped.scaler.update()
    return wrapped


@pytest.mark.parametrize(("threshold", "promoted"), [(0.1, True), (0.1 + 1e-6, False)])
def test_a_tensor_is_promoted_when_its_overflow_fraction_reaches_the_threshold(threshold, promoted):
    x = torch.zeros(1, 10)
    x[0, 3] = 100.0  # 1 value of 10 past e4m3b4s's max (30): a fraction of exactly 0.1
    policy = Policy(input_shape=(10,), batch_size=1, defaults={"activation": "e4m3b4s"}, promotion_threshold=threshold)
    wrapped = _one_step_on_input(policy, x)
    assert [(p.id, p.fraction) for p in wrapped.promotions] == ([("input_1:activation", 0.1)] if promoted else [])


def test_a_tensor_already_in_the_high_format_is_never_promoted():
    x = torch.full((1, 10), 1e30)  # past e6m9s's max: every value overflows the high format itself
    policy = Policy(input_shape=(10,), batch_size=1, defaults={"activation": "e6m9s"}, high_format="e6m9s",
                    promotion_threshold=0.01)
    wrapped = _one_step_on_input(policy, x)
    assert wrapped.promotions == []
    assert [wrapped.formats()[t] for t in ("input_1:activation", "0:activation")] == ["e6m9s", "e6m9s"]


@pytest.mark.parametrize("threshold", [0.01, None])
def test_forward_overflow_is_promoted_and_without_promotion_the_run_diverges(threshold):
    # conv2's weights x100 push its output past e4m3b4s's max (30) in far more than 1% of the values; with
    # forward overflow to inf (instead of the paper's saturation) BN then turns the batch into NaN.
    model = _model()
    with torch.no_grad():
        model.conv2.weight.mul_(100)
    policy = _policy(high_format="e6m9s", overflow={"activation": "inf"}, promotion_threshold=threshold)
    wrapped = apply_policy(model, policy)
    losses = _train(wrapped, steps=5, lr=0.05)
    if threshold is None:
        assert wrapped.promotions == [] and math.isnan(losses[0])
        return
    assert [p.id for p in wrapped.promotions] == ["conv2:activation"]
    promotion = wrapped.promotions[0]
    assert promotion.step == 1 and promotion.fraction > 0.01 and promotion.to_format == "e6m9s"
    assert wrapped.formats()["conv2:activation"] == "e6m9s"
    # promoted after step 1 (as the paper checks), whose overflowed values are not applied: that step is skipped
    assert math.isnan(losses[0]) and wrapped.scaler.skipped_steps == 1
    assert all(math.isfinite(loss) for loss in losses[1:]) and losses[-1] < losses[1]
    assert wrapped.tensor_stats()["conv2:activation"]["promoted"]


@pytest.mark.parametrize("threshold", [0.01, None])
def test_gradient_overflow_to_inf_is_promoted_and_without_promotion_the_run_diverges(threshold):
    # A loss scaled by 1e7 with the learning rate divided by 1e7 (a static scale that never skips a step):
    # the output gradient overflows e5m2s (max 114688) to inf unless its tensor is promoted. The weight gradients
    # stay in .grad (held as e6m9s codes, which have no inf, such a step is skipped instead:
    # test_held_gradients.py), so the inf reaches the weights.
    policy = _policy(high_format="e6m9s", overflow={"activation_grad": "inf", "weight_grad": "inf"},
                     promotion_threshold=threshold, promotion_kinds=ASSIGNABLE_KINDS)
    wrapped = apply_policy(_model(), policy, hold_gradients=lambda: False)
    losses = _train(wrapped, steps=5, lr=0.05 / 1e7, loss_factor=1e7)
    if threshold is None:
        assert wrapped.promotions == [] and math.isfinite(losses[0]) and math.isnan(losses[1])
        return
    assert "linear:activation_grad" in [p.id for p in wrapped.promotions]
    assert all(math.isfinite(loss) for loss in losses) and losses[-1] < losses[0]


@pytest.mark.parametrize("kinds", [None, ASSIGNABLE_KINDS])
def test_under_the_paper_space_an_overflowing_activation_gradient_is_not_promoted(kinds):
    # as above (the output gradient overflows e5m2s to inf), with the paper space's guard: weights and
    # activations only, unless promotion_kinds lists the gradients; the dynamic scaler skips the overflowed steps
    space = paper_space()
    assert space.promotion_kinds == ("weight", "activation")
    policy = _policy(high_format=space.high, overflow=dict(space.overflow), promotion_threshold=0.01,
                     promotion_kinds=kinds or space.promotion_kinds,
                     loss_scaling={"mode": "dynamic", "init_scale": 1.0})
    wrapped = apply_policy(_model(), policy)
    _train(wrapped, steps=2, lr=0.05, loss_factor=1e7)
    stats = wrapped.tensor_stats()["linear:activation_grad"]
    assert stats["max_overflow"] > 0.01  # it overflowed past the threshold
    promoted = [p.id for p in wrapped.promotions]
    if kinds is None:
        assert promoted == [] and not stats["promoted"] and wrapped.scaler.skipped_steps == 2
        assert wrapped.formats()["linear:activation_grad"] == "e5m2s"
    else:
        assert "linear:activation_grad" in promoted and wrapped.formats()["linear:activation_grad"] == "e6m9s"


def test_the_paper_loss_scale_doubles_once_per_epoch_and_halves_on_overflow():
    space = paper_space()
    assert space.loss_scaling["growth_interval"] == "epoch"
    policy = _policy(loss_scaling=dict(space.loss_scaling), promotion_threshold=None)
    with pytest.raises(PrecsearchError, match="steps_per_epoch"):
        apply_policy(_model(), policy)
    scaler = apply_policy(_model(), policy, steps_per_epoch=4).scaler
    weight = nn.Parameter(torch.ones(2))
    optimizer = torch.optim.SGD([weight], lr=0.0)
    overflow_at = {10}
    scales = []
    for step in range(1, 17):
        weight.grad = torch.full((2,), math.inf if step in overflow_at else 1.0)
        scaler.step(optimizer)
        scaler.update()
        scales.append(scaler.get_scale())
    # hand-written: x2 after each 4 clean steps (epoch boundaries 4 and 8), /2 at the overflow of step 10,
    # which restarts the count (torch's GradScaler with growth_interval = batches per epoch, as the reference)
    s = 65536.0
    assert scales == [s, s, s, 2 * s, 2 * s, 2 * s, 2 * s, 4 * s, 4 * s, 2 * s, 2 * s, 2 * s, 2 * s, 4 * s, 4 * s,
                      4 * s]


class TwoBranch(nn.Module):
    """An activation with two consumers, as the input of a residual block."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3, padding=1, bias=False)
        self.left = nn.Conv2d(4, 4, 1, bias=False)
        self.right = nn.Conv2d(4, 4, 3, padding=1, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.conv(x)
        return self.left(h) + self.right(h)


@pytest.mark.parametrize("mode", ["per_use", "sum"])
def test_per_use_gradient_rounding_rounds_each_branch_and_sum_rounds_once(mode):
    torch.manual_seed(0)
    model = TwoBranch()
    x = torch.randn(2, 3, 8, 8)
    # by hand, in fp32: each branch's gradient of h, then conv's weight gradient for a given gradient of h
    h = model.conv(x).detach()
    uses = [h.clone().requires_grad_() for _ in range(2)]
    (model.left(uses[0]) + model.right(uses[1])).sum().backward()
    left, right = (use.grad for use in uses)
    per_use = quantize(left, "e5m2s") + quantize(right, "e5m2s")
    summed = quantize(left + right, "e5m2s")
    assert not torch.equal(per_use, summed)  # the example tells them apart

    def conv_grad(grad_h: torch.Tensor) -> torch.Tensor:
        return torch.autograd.grad(model.conv(x), model.conv.weight, grad_h)[0]

    model.zero_grad()
    policy = Policy(input_shape=(3, 8, 8), batch_size=2, defaults=dict.fromkeys(ASSIGNABLE_KINDS, "fp32"),
                    overrides={"conv:activation_grad": "e5m2s"}, gradient_rounding=mode, promotion_threshold=None)
    wrapped = apply_policy(model, policy, example_input=x)
    wrapped(x).sum().backward()
    expected = conv_grad(per_use if mode == "per_use" else summed)
    assert torch.equal(model.conv.weight.grad, expected)
    assert not torch.equal(model.conv.weight.grad, conv_grad(summed if mode == "per_use" else per_use))


def test_ties_away_flows_from_the_policy_to_every_nearest_rounding():
    x = torch.full((8, *SHAPE), 1.0625)  # a tie of e4m3b4s: 1 by half-to-even, 1.125 away from zero
    seen = {}
    for ties in ("even", "away"):
        model = _model()
        model.conv1.register_forward_pre_hook(lambda module, args, ties=ties: seen.__setitem__(ties, args[0]))
        apply_policy(model, _policy(ties=ties))(x)
    assert torch.equal(seen["even"], torch.ones_like(x)) and torch.equal(seen["away"], torch.full_like(x, 1.125))


def test_saturating_gradient_overflow_makes_the_dynamic_scaler_skip():
    # e5m2s has no inf: a gradient past its max saturates, and only the runtime's report lets the scaler react.
    policy = _policy(loss_scaling={"mode": "dynamic", "init_scale": 2.0**40}, promotion_threshold=None)
    model = _model()
    wrapped = apply_policy(model, policy)
    assert isinstance(wrapped.scaler, DynamicLossScaler)
    before = [p.detach().clone() for p in model.parameters()]
    _train(wrapped, steps=1, lr=0.1)
    assert wrapped.scaler.skipped_steps == 1 and wrapped.scaler.get_scale() == 2.0**39
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))
    assert wrapped.tensor_stats()["linear:activation_grad"]["overflow"] > 0


# --------------------------------------------------------------------------------- underflow, scaling


def _activation_grad_underflow(mode: str) -> tuple[float, PrecisionModel]:
    """Element-weighted fraction of activation-gradient values that fp16 flushes to zero, over 2 steps of a
    model whose loss is scaled down 100x (small gradients)."""
    policy = _policy(defaults=dict.fromkeys(ASSIGNABLE_KINDS, "fp16"), loss_scaling={"mode": mode},
                     promotion_threshold=None)
    wrapped = apply_policy(_model(), policy, stats_every=1)
    _train(wrapped, steps=2, lr=0.01, loss_factor=1e-2)
    rows = {tid: row for tid, row in wrapped.tensor_stats().items() if row["kind"] == "activation_grad"}
    sizes = {tid: wrapped.graph.tensors[tid].numel for tid in rows}
    fraction = sum(rows[tid]["underflow"] * sizes[tid] for tid in rows) / sum(sizes.values())
    return fraction, wrapped


def test_fp16_without_loss_scaling_loses_gradients_and_scaling_recovers_them():
    unscaled, _ = _activation_grad_underflow("none")
    dynamic, wrapped = _activation_grad_underflow("dynamic")
    adaptive, adaptive_model = _activation_grad_underflow("adaptive")
    assert unscaled > 0.05  # a measurable share of the gradients flushes to zero
    assert dynamic < 1e-3 and wrapped.scaler.get_scale() == 2.0**16
    assert isinstance(adaptive_model.scaler, AdaptiveLossScaler) and adaptive_model.scaler.layer_scales()
    assert adaptive < 1e-3


# ---------------------------------------------------------------------------------------- real memory


def test_eight_bit_policy_really_holds_a_quarter_of_the_fp32_saved_bytes():
    batch = 8
    model = _model("resnet18", width=0.125)
    x, _ = _batch(n=batch)
    fp32_measured = measure_saved_bytes(model, x)
    graph = trace(model, x[:2], batch_size=batch)
    cost = CostModel(graph)
    policy = policy_from_assignment(graph, {tid: PAPER_LOW[graph.tensors[tid].kind] for tid in graph.assignable_ids()})
    wrapped = apply_policy(model, policy)

    storages = []  # every float storage the model's modules receive or make, held only weakly

    def remember(tensor: torch.Tensor) -> None:
        storages.append((StorageWeakRef(tensor.untyped_storage()), tensor.untyped_storage().data_ptr()))

    for module in model.modules():
        module.register_forward_pre_hook(lambda m, args: remember(args[0]))
        module.register_forward_hook(lambda m, args, out: remember(out))
    out = wrapped(x)
    saved = wrapped.saved_bytes()
    measured = saved.activation + saved.other  # what measure_saved_bytes counts: non-parameter storages
    predicted = cost.saved_activation_bytes(policy.assignment(graph))
    assert abs(measured / predicted - 1) < 0.02
    assert abs(measured / fp32_measured - 0.25) < 0.01
    assert predicted == policy.predicted["saved_activation_bytes"]
    # no float32 activation outlives the forward: autograd holds their codes only
    alive = {ptr for ref, ptr in storages if not ref.expired()}
    assert len(storages) > 100 and alive <= {x.untyped_storage().data_ptr(), out.untyped_storage().data_ptr()}
    out.sum().backward()  # and backward works from the packed codes
    assert all(p.grad is not None for p in model.parameters())


class InPlace(nn.Module):
    """In-place ReLU module, in-place residual add and functional in-place ReLU."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1, self.bn1, self.relu1 = nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(inplace=True)
        self.conv2, self.bn2 = nn.Conv2d(8, 8, 3, padding=1), nn.BatchNorm2d(8)
        self.pool, self.fc = nn.AdaptiveAvgPool2d(1), nn.Linear(8, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.relu1(self.bn1(self.conv1(x)))
        y = self.bn2(self.conv2(out))
        y += out
        return self.fc(torch.flatten(self.pool(F.relu(y, inplace=True)), 1))


def test_in_place_ops_see_rounded_values_and_their_saves_are_packed_once():
    torch.manual_seed(0)
    model = InPlace()
    x, y = _batch()
    graph = trace(model, x[:2], batch_size=8)
    policy = policy_from_assignment(graph, {tid: PAPER_LOW[graph.tensors[tid].kind] for tid in graph.assignable_ids()})
    reference = copy.deepcopy(model)
    wrapped = apply_policy(model, policy)
    seen = {}
    model.conv2.register_forward_pre_hook(lambda m, args: seen.update({"conv2": args[0].detach().clone()}))
    model.pool.register_forward_pre_hook(lambda m, args: seen.update({"pool": args[0].detach().clone()}))
    F.cross_entropy(wrapped(x), y).backward()
    assert _representable(seen["conv2"], "e4m3b4s") and _representable(seen["pool"], "e4m3b4s")
    saved = wrapped.saved_bytes()
    assert saved.activation + saved.other == CostModel(graph).saved_activation_bytes(policy.assignment(graph))
    assert abs((saved.activation + saved.other) / measure_saved_bytes(reference, x) - 0.25) < 0.01
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in model.parameters())


@pytest.mark.parametrize("name", ["mobilenet_v2", "shufflenet_v2", "squeezenet"])
def test_packed_saved_bytes_match_the_cost_model_across_the_zoo(name):
    # depthwise convs, channel split + shuffle (layout copies of rounded values), max-pool indices
    model = _model(name, width=0.125)
    x, _ = _batch(n=4)
    graph = trace(model, x[:2], batch_size=4)
    for spec in ("fp16", "e4m3b4s"):
        policy = policy_from_assignment(graph, dict.fromkeys(graph.assignable_ids(), spec))
        wrapped = apply_policy(model, policy)
        wrapped(x)
        saved = wrapped.saved_bytes()
        predicted = CostModel(graph).saved_activation_bytes(policy.assignment(graph))
        assert abs((saved.activation + saved.other) / predicted - 1) < 0.02, spec
        wrapped.unwrap()


def test_a_promoted_pure_low_precision_weight_is_updated_in_the_high_format():
    model = _model()
    policy = _policy(defaults={"weight": "e5m2s"}, high_format="e6m9s", master_weights=False,
                     promotion_threshold=1e-3)
    wrapped = apply_policy(model, policy)
    optimizer = wrapped.wrap_optimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    with torch.no_grad():
        model.linear.weight[0, 0] = 2.0**18  # past e5m2s's max (114688) in 1/320 of the weight: promoted at once
    for step in range(2):
        optimizer.zero_grad()
        x, y = _batch(seed=step)
        F.cross_entropy(wrapped(x), y).backward()
        optimizer.step()
    assert [p.id for p in wrapped.promotions] == ["linear:weight"]
    weight = model.linear.weight.detach()
    assert _representable(weight, "e6m9s") and not _representable(weight, "e5m2s")  # the optimizer followed
    assert _representable(model.conv2.weight.detach(), "e5m2s") and _representable(model.linear.bias, "e5m2s")


# ------------------------------------------------------------------------------------------ accumulation


def test_accumulation_swaps_exactly_the_matched_layers_and_unwrap_restores_them():
    model = _model()
    plain = trace(model, torch.zeros(2, *SHAPE), batch_size=8)
    params = dict(model.named_parameters())
    convs = {name: m for name, m in model.named_modules() if type(m) is nn.Conv2d}
    wrapped = apply_policy(model, _policy(accumulation={"format": "e6m9s", "chunk": 16, "layers": ["conv*"]}))
    assert wrapped.accumulation_layers == sorted(convs) == ["conv1", "conv2"]
    assert {name for name, m in model.named_modules() if isinstance(m, ChunkedConv2d)} == set(convs)
    assert type(model.linear) is nn.Linear and model.conv2.chunk == 16
    assert all(p is params[name] for name, p in model.named_parameters())  # optimizers built before stay valid
    assert wrapped.graph.fingerprint() == plain.fingerprint()
    assert wrapped.unwrap() is model and all(model.get_submodule(name) is m for name, m in convs.items())


def test_a_swapped_linear_computes_chunked_matmul_of_what_it_receives():
    model = _model()
    wrapped = apply_policy(model, _policy(accumulation={"format": "e6m9s", "chunk": 4, "layers": ["lin*"]}))
    assert isinstance(model.linear, ChunkedLinear) and wrapped.accumulation_layers == ["linear"]
    seen = {}

    def hook(module, args, output):  # inside the wrapper's forward: the weights are the rounded copies
        seen.update(x=args[0].detach(), w=module.weight.detach(), b=module.bias.detach(), out=output.detach())

    model.linear.register_forward_hook(hook)
    wrapped(_batch()[0])
    expected = quantize(chunked_matmul(seen["x"], seen["w"].t(), "e6m9s", 4) + seen["b"], "e6m9s")
    assert torch.equal(seen["out"], expected)
    assert _representable(seen["w"], "e4m3b4s")  # the policy's weight format still applies
    assert not torch.equal(seen["out"], F.linear(seen["x"], seen["w"], seen["b"]))  # 16-bit sums, not fp32


def test_wang_fp8_with_chunked_accumulation_trains_with_finite_gradients():
    graph = trace(_model(), torch.zeros(2, *SHAPE), batch_size=8)
    plain = baseline("wang_fp8", graph)
    grads = {}
    for name, policy in (("chunked", plain.replace(accumulation=Accumulation("e6m9s", 64))), ("plain", plain)):
        model = _model()
        wrapped = apply_policy(model, policy)
        optimizer = wrapped.wrap_optimizer(torch.optim.SGD(model.parameters(), lr=0.1))
        before = model.conv2.weight.detach().clone()
        x, y = _batch()
        wrapped.scaler.scale(F.cross_entropy(wrapped(x), y)).backward()
        grads[name] = {n: p.grad.clone() for n, p in model.named_parameters()}
        wrapped.scaler.step(optimizer)
        wrapped.scaler.update()
        assert all(torch.isfinite(g).all() for g in grads[name].values()), name
        assert not torch.equal(before, model.conv2.weight), name  # the step was taken
    assert wrapped.accumulation_layers == [] and not torch.equal(grads["chunked"]["conv2.weight"],
                                                                  grads["plain"]["conv2.weight"])


def test_a_model_with_chunked_layers_still_traces_them_as_gemms():
    model = _model()
    plain = trace(model, torch.zeros(2, *SHAPE), batch_size=8)
    swap_chunked_layers(model, None, "e6m9s", 64)
    wrapped = apply_policy(model, _policy())
    assert wrapped.graph.tracer == "fx" and wrapped.graph.fingerprint() == plain.fingerprint()
    assert [op.name for op in wrapped.graph.ops if op.role == "gemm"] == ["conv1", "conv2", "linear"]


# ------------------------------------------------------------------------------------ hooks, checks


def test_untraceable_models_are_rounded_through_module_hooks():
    torch.manual_seed(0)
    model = Untraceable()
    policy = Policy(input_shape=SHAPE, batch_size=8, defaults=dict(PAPER_LOW))
    with pytest.warns(UserWarning, match="torch.fx could not trace"):
        wrapped = apply_policy(model, policy, strict=False)
    assert "relu" in wrapped.unenforced
    seen = {}
    model.bn.register_forward_pre_hook(lambda m, args: seen.update({"bn.in": args[0].detach()}))
    model.conv.register_forward_pre_hook(lambda m, args: seen.update({"conv.in": args[0].detach()}))
    x, y = _batch()
    F.cross_entropy(wrapped(x), y).backward()
    assert torch.equal(seen["conv.in"], quantize(x, "e4m3b4s"))
    assert _representable(seen["bn.in"], "e4m3b4s") and seen["bn.in"].abs().sum() > 0
    assert wrapped.saved_bytes().activation > 0
    assert wrapped.unwrap() is model and model.conv._forward_hooks == {}


def test_untraceable_models_keep_their_chunked_layers_rounded_through_hooks():
    torch.manual_seed(0)
    model = Untraceable()
    policy = Policy(input_shape=SHAPE, batch_size=8, defaults=dict(PAPER_LOW), accumulation={"layers": ["fc"]})
    with pytest.warns(UserWarning, match="torch.fx could not trace"):
        wrapped = apply_policy(model, policy, strict=False)
    assert wrapped.accumulation_layers == ["fc"] and wrapped.unenforced == ["relu"]
    seen = {}
    model.fc.register_forward_hook(lambda m, args, out: seen.update(out=out.detach()))  # after the rounder
    wrapped(_batch()[0])
    assert _representable(seen["out"], "e4m3b4s") and seen["out"].abs().sum() > 0


def test_a_policy_for_another_model_is_refused():
    policy = policy_from_assignment(trace(_model(), torch.zeros(2, *SHAPE), batch_size=8), {})
    with pytest.raises(PrecsearchError, match="policy was made for TinyCNN .*pass strict=False"):
        apply_policy(_model("tiny_cnn", width=0.5), policy)
    wrapped = apply_policy(_model("tiny_cnn", width=0.5), policy, strict=False)
    assert set(wrapped.formats().values()) == {"fp32"}
    with pytest.raises(PrecsearchError, match="float64 parameters; .*call model.float"):
        apply_policy(_model().double(), policy)


def test_tensor_stats_and_saved_bytes_report_per_tensor():
    wrapped = apply_policy(_model(), _policy(), stats_every=1)
    _train(wrapped, steps=1, lr=0.1)
    table = wrapped.tensor_stats(as_frame=True)
    assert {"kind", "format", "overflow", "underflow", "subnormal", "nan"} <= set(table.columns)
    assert set(table.index) == set(wrapped.graph.assignable_ids())
    fractions = table[["overflow", "underflow", "subnormal", "nan"]].to_numpy()
    assert ((fractions >= 0) & (fractions <= 1)).all() and fractions[:, 1].max() > 0
    wrapped.reset_stats()
    assert wrapped.tensor_stats() == {}
    assert wrapped.step_count == 1 and wrapped.saved_bytes().total > 0


# ----------------------------------------------------------------------------------------- layout


def _holds(value: object, target: object, depth: int, seen: set[int]) -> bool:
    """Whether ``value`` is ``target`` or reaches it, ``depth`` steps down through attributes, containers,
    closures and bound methods (modules are not entered: each is walked on its own)."""
    if value is target:
        return True
    if depth == 0 or id(value) in seen or isinstance(value, torch.Tensor | nn.Module | str | int | float | type):
        return False
    seen.add(id(value))
    if isinstance(value, dict):
        children = list(value.values())
    elif isinstance(value, list | tuple | set | frozenset):
        children = list(value)
    elif isinstance(value, types.MethodType):
        children = [value.__self__, value.__func__]
    elif isinstance(value, types.FunctionType):
        children = [cell.cell_contents for cell in value.__closure__ or () if cell.cell_contents is not None]
    else:
        children = list(getattr(value, "__dict__", {}).values())
    return any(_holds(child, target, depth - 1, seen) for child in children)


def _modules_referring_to(wrapped: PrecisionModel) -> list[str]:
    """The modules a wrapped model runs (its submodules and the instrumented FX module) whose attributes, hooks
    included, reach the wrapper."""
    modules = {id(m): m for m in wrapped.modules()}
    for value in vars(wrapped).values():
        if isinstance(value, nn.Module):
            modules.update({id(m): m for m in value.modules()})
    del modules[id(wrapped)]
    return [type(m).__name__ for m in modules.values()
            if any(_holds(value, wrapped, 6, set()) for value in vars(m).values())]


@pytest.mark.parametrize("name", ["resnet18", "untraceable"])
def test_no_module_of_a_wrapped_model_refers_to_the_wrapper(name):
    """Every inserted module gets the state it needs at construction: none reaches back to the PrecisionModel
    (the walk finds a reference planted on purpose)."""
    if name == "untraceable":
        torch.manual_seed(0)
        with pytest.warns(UserWarning, match="torch.fx could not trace"):
            wrapped = apply_policy(Untraceable(), _policy(), strict=False)
    else:
        wrapped = apply_policy(_model(name, width=0.125), _policy(gradient_rounding="per_use",
                                                                  loss_scaling={"mode": "adaptive"}))
    x, y = _batch()
    wrapped.scaler.scale(F.cross_entropy(wrapped(x), y)).backward()
    assert wrapped.graph.graph_module is None or any("precsearch_round" in n for n, _ in vars(wrapped)["_target"]
                                                     .named_modules())
    assert _modules_referring_to(wrapped) == []
    last = list(wrapped.module.modules())[-1]
    last.__dict__["planted"] = [wrapped]
    assert _modules_referring_to(wrapped) == [type(last).__name__]


def test_the_precision_model_is_a_thin_class():
    assert len(inspect.getsource(PrecisionModel).splitlines()) < 150
