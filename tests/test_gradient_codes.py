"""Activation gradients in flight as the codes of their rounding (precsearch.runtime.gradient_codes, issue 67)."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from precsearch.cost.policies import policy_from_assignment
from precsearch.errors import PrecsearchError
from precsearch.graph.op_rules import OP_RULES
from precsearch.graph.tracing import trace
from precsearch.models import build
from precsearch.runtime.gradient_codes import GradientCodes, decoded, gradient_rows
from precsearch.runtime.model import apply_policy
from precsearch.runtime.ops import Codes

PAPER_LOW = {"weight": "e4m3b4s", "activation": "e4m3b4s", "activation_grad": "e5m2s", "weight_grad": "e6m9s"}
FP8 = {"weight": "e4m3", "activation": "e4m3", "activation_grad": "e5m2", "weight_grad": "e5m2"}
CODE_BYTES = {"e5m2s": 1, "e5m2": 1, "e4m3b4s": 1, "e6m9s": 2}  # by hand: 8-bit formats a byte, 16-bit two
FOUR_SLICES = OP_RULES.with_min_slices(4)  # every sliced backward in 4 slices: the codes are read a slice at a time


class Residual(nn.Module):
    """conv-bn-relu, then a block whose conv branch and shortcut meet in an add (its gradient waits as codes)."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1, self.bn1, self.relu1 = nn.Conv2d(3, 8, 3, padding=1, bias=False), nn.BatchNorm2d(8), nn.ReLU()
        self.conv2, self.bn2, self.relu2 = nn.Conv2d(8, 8, 3, padding=1, bias=False), nn.BatchNorm2d(8), nn.ReLU()
        self.fc = nn.Linear(8, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.relu1(self.bn1(self.conv1(x)))
        x = self.relu2(self.bn2(self.conv2(x)) + x)
        return self.fc(F.adaptive_avg_pool2d(x, 1).flatten(1))


def _batch(size: int, batch: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return torch.randn(batch, 3, size, size, generator=g), torch.randint(0, 10, (batch,), generator=g)


def _all_low(model: nn.Module, x: torch.Tensor, low: dict[str, str], rules=OP_RULES):
    graph = trace(model, x[:2], batch_size=x.shape[0], rules=rules)
    return policy_from_assignment(graph, {tid: low[graph.tensors[tid].kind] for tid in graph.assignable_ids()})


def test_a_gradient_held_as_codes_reads_as_torchs_own_rounding_whole_and_by_rows():
    """The oracle is torch's e5m2 cast (round-half-to-even, subnormals): a ``GradientCodes`` of those codes gives
    the cast's values to any op, decoded whole or seven rows at a time (the last slice shorter)."""
    values = torch.randn(20, 3, 4, 4, generator=torch.Generator().manual_seed(0)) * 2.0 ** -14
    cast = values.to(torch.float8_e5m2)
    codes = GradientCodes(Codes(cast.view(torch.uint8), "e5m2"), ("e5m2", "nearest", "saturate"))
    expected = cast.float()
    assert torch.equal(decoded(codes), expected)
    assert torch.equal(codes * 1.0, expected) and type(codes * 1.0) is torch.Tensor  # any op: plain values
    assert torch.equal(torch.cat([gradient_rows(codes, start, 7) for start in range(0, 20, 7)]), expected)
    assert (expected != 0).any() and (expected.abs() < 2.0 ** -14).any()  # subnormals among them


def test_a_write_into_a_gradient_held_as_codes_is_refused():
    """A write would reach a decoded copy, not the codes: refused in one line naming the fix, never lost."""
    codes = GradientCodes(Codes(torch.ones(4).to(torch.float8_e5m2).view(torch.uint8), "e5m2"),
                          ("e5m2", "nearest", "saturate"))
    with pytest.raises(PrecsearchError, match="add_.Tensor would write into a gradient held as its codes"):
        codes.add_(1.0)
    with pytest.raises(PrecsearchError, match="gradient_codes=False"):
        torch.mul(torch.ones(4), 2.0, out=codes)
    assert torch.equal(decoded(codes), torch.ones(4))


class AddsLeaves(nn.Module):
    """An add of a parameter, and one of the model's input: their gradients reach a leaf's ``.grad``."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 3, 3, padding=1, bias=False)
        self.offset = nn.Parameter(torch.zeros(1, 3, 8, 8))
        self.fc = nn.Linear(3 * 64, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.conv(x) + self.offset
        return self.fc((torch.relu(y) + x).flatten(1))


def test_an_add_that_reads_a_leaf_hands_its_gradient_on_float32_and_gradients_accumulate():
    """The plan sends no add's gradient as codes where it would reach a leaf's ``.grad`` (a parameter or an input
    that requires a gradient): two backwards without ``zero_grad`` accumulate ``.grad`` bit for bit as with every
    gradient float32."""
    torch.manual_seed(0)
    model, (x, y) = AddsLeaves(), _batch(8, 4)
    policy = _all_low(model, x, FP8)
    grads = []
    for on in (True, False):
        wrapped = apply_policy(copy.deepcopy(model), policy, gradient_codes=on)
        assert not [sites.op for sites in wrapped.sites.ops if sites.gradient_codes == "waits"]
        leaf = x.clone().requires_grad_()
        for _ in range(2):
            F.cross_entropy(wrapped(leaf), y).backward()
        assert type(wrapped.module.offset.grad) is torch.Tensor and type(leaf.grad) is torch.Tensor
        grads.append([wrapped.module.offset.grad, leaf.grad, wrapped.module.conv.weight.grad])
    assert all(torch.equal(one, other) for one, other in zip(*grads, strict=True))


def _in_flight(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> list[torch.Tensor]:
    """The gradients every rounding in the backward handed on (a node hook on each ``RoundActivationBackward``)."""
    handed: list[torch.Tensor] = []
    loss = F.cross_entropy(model(x), y)
    seen, stack = set(), [loss.grad_fn]
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        if type(node).__name__ == "RoundActivationBackward":
            node.register_hook(lambda grads, _: handed.append(grads[0]))
        stack.extend(next_node for next_node, _ in node.next_functions)
    loss.backward()
    return handed


@pytest.mark.parametrize("low", [PAPER_LOW, FP8], ids=["paper", "fp8"])
def test_every_gradient_the_plan_sends_as_codes_is_held_at_its_code_width(low):
    """Counted, not timed: each rounding whose op the site plan marks (``OpSites.gradient_codes``: the add, the
    sliced layers) hands autograd a ``GradientCodes`` holding one code a value at its format's width (a hand
    table), and the others hand on float32; with ``gradient_codes=False`` every one is float32."""
    torch.manual_seed(0)
    model, (x, y) = Residual(), _batch(8, 16)
    policy = _all_low(model, x, low, FOUR_SLICES)
    wrapped = apply_policy(copy.deepcopy(model), policy, rules=FOUR_SLICES)
    marked = [sites for sites in wrapped.sites.ops if sites.gradient_codes]
    assert {sites.op.split(":")[0]: sites.gradient_codes for sites in marked} == {
        "add": "waits", **dict.fromkeys(("conv1", "bn1", "relu1", "conv2", "bn2", "relu2"), "slices")}
    handed = _in_flight(wrapped, x, y)
    as_codes = [g for g in handed if isinstance(g, GradientCodes)]
    assert len(as_codes) == len(marked)
    for g in as_codes:
        assert g.codes.codes.nbytes == g.numel() * CODE_BYTES[low["activation_grad"]] and g.codes.scales is None
    assert len(handed) > len(as_codes) and all(g.dtype == torch.float32 for g in handed)
    plain = apply_policy(copy.deepcopy(model), policy, rules=FOUR_SLICES, gradient_codes=False)
    assert not any(isinstance(g, GradientCodes) for g in _in_flight(plain, x, y))


def _train(model: nn.Module, policy, x, y, gradient_codes: bool, rules=OP_RULES, steps: int = 2):
    """Outputs, parameter gradients, parameters and every slot's counts after ``steps`` SGD steps."""
    wrapped = apply_policy(copy.deepcopy(model), policy, rules=rules, gradient_codes=gradient_codes,
                           steps_per_epoch=100)
    optimizer = torch.optim.SGD(wrapped.parameters(), lr=0.05, momentum=0.9)
    outputs = []
    for _ in range(steps):
        optimizer.zero_grad()
        out = wrapped(x)
        wrapped.scaler.scale(F.cross_entropy(out, y)).backward()
        wrapped.scaler.step(optimizer)
        wrapped.scaler.update()
        outputs.append(out.detach())
    wrapped.state.flush()
    grads = {name: p.grad for name, p in wrapped.module.named_parameters()}
    counts = {tid: (slot.calls, slot.counted, slot.overflowed) for tid, slot in wrapped.state.slots.items()}
    return outputs, grads, dict(wrapped.module.state_dict()), counts, wrapped


@pytest.mark.parametrize("spec, size, batch", [("resnet18:width=0.25", 16, 16), ("mobilenet_v2:width=0.5", 16, 8)])
def test_gradients_as_codes_train_bit_for_bit_as_float32_gradients(spec, size, batch):
    """Two steps of the zoo model, its sliced backwards in 4 slices: outputs, gradients, weights, batch-norm
    statistics and every tensor's counts are bit for bit those of the step that hands gradients on float32."""
    torch.manual_seed(0)
    model, (x, y) = build(spec), _batch(size, batch)
    policy = _all_low(model, x, PAPER_LOW, FOUR_SLICES)
    codes = _train(model, policy, x, y, True, FOUR_SLICES)
    floats = _train(model, policy, x, y, False, FOUR_SLICES)
    assert any(sites.gradient_codes for sites in codes[4].sites.ops)
    for one, other in zip(codes[0], floats[0], strict=True):
        assert torch.equal(one, other)
    for part in (1, 2):
        assert codes[part].keys() == floats[part].keys()
        for name in codes[part]:
            assert torch.equal(codes[part][name], floats[part][name]), name
    assert codes[3] == floats[3] and any(calls for calls, _, _ in codes[3].values())


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA is not available here")
def test_on_cuda_an_adds_gradient_travels_as_codes_and_a_sliced_layers_as_float32():
    """The sliced backwards decode whole off CPU, so there only the add's gradient (which waits) is handed on as
    codes; the step trains bit for bit as with every gradient float32."""
    torch.manual_seed(0)
    model, (x, y) = Residual().cuda(), tuple(t.cuda() for t in _batch(8, 16))
    policy = _all_low(model, x, FP8, FOUR_SLICES)
    wrapped = apply_policy(copy.deepcopy(model), policy, rules=FOUR_SLICES)
    as_codes = [g for g in _in_flight(wrapped, x, y) if isinstance(g, GradientCodes)]
    # the add's, which bn2's rounding (the same format) hands on as it is
    assert len(as_codes) == 2 and as_codes[0] is as_codes[1] and as_codes[0].codes.codes.nbytes == as_codes[0].numel()
    codes, floats = (_train(model, policy, x, y, on, FOUR_SLICES) for on in (True, False))
    for part in (1, 2):
        for name in codes[part]:
            assert torch.equal(codes[part][name], floats[part][name]), name
