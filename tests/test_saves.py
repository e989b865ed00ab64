"""What autograd saves, predicted by the cost model and measured, on the four patterns where torchvision's zoo
went wrong (in plain torch): in-place activations whose backward needs their input, mixed formats across an
in-place op, ops that keep only a byproduct (stochastic depth's noise, LayerNorm's statistics), and a leaf
function that runs GEMMs where FX cannot see them. fp32 against `measure_saved_bytes` (saved_tensors_hooks);
under the runtime's policies against what the runtime's packer kept."""

from __future__ import annotations

import logging

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from precsearch.config.policy import Policy
from precsearch.config.spec import PAPER_OVERFLOW
from precsearch.cost.model import CostModel, measure_saved_bytes
from precsearch.cost.policies import policy_from_assignment
from precsearch.graph.policy_check import check_policy
from precsearch.graph.tracing import trace
from precsearch.runtime.model import apply_policy
from precsearch.search.strategies import baseline

BATCH = 4
ALL_LOW = {"weight": "e4m3b4s", "activation": "e4m3b4s", "activation_grad": "e5m2s", "weight_grad": "e6m9s"}


def noisy_depth(x: torch.Tensor, p: float) -> torch.Tensor:
    """torchvision's stochastic depth, row mode: one Bernoulli survival per sample; FX keeps it one op."""
    noise = torch.empty((x.shape[0],) + (1,) * (x.dim() - 1), dtype=x.dtype).bernoulli_(1 - p)
    return x * noise.div_(1 - p)


def attention(x: torch.Tensor, qkv_weight: torch.Tensor, proj_weight: torch.Tensor) -> torch.Tensor:
    """Self-attention over the spatial positions, like torchvision's `shifted_window_attention`: two linear
    layers and two batched products inside one function that FX does not trace into."""
    n, c, h, w = x.shape
    tokens = x.flatten(2).transpose(1, 2)
    q, k, v = F.linear(tokens, qkv_weight).chunk(3, dim=-1)
    weights = torch.softmax(q @ k.transpose(1, 2) / c**0.5, dim=-1)
    return F.linear(weights @ v, proj_weight).transpose(1, 2).reshape(n, c, h, w)


torch.fx.wrap("noisy_depth")
torch.fx.wrap("attention")


class InPlaceActivations(nn.Module):
    """ReLU6, Hardswish and SiLU in place after a BN: autograd keeps a clone of each one's input."""

    def __init__(self) -> None:
        super().__init__()
        layers = []
        for act in (nn.ReLU6(inplace=True), nn.Hardswish(inplace=True), nn.SiLU(inplace=True)):
            layers += [nn.Conv2d(8, 8, 3, padding=1), nn.BatchNorm2d(8), act]
        self.stem = nn.Conv2d(3, 8, 3, padding=1)
        self.body = nn.Sequential(*layers, nn.Conv2d(8, 8, 3))

    def forward(self, x):
        return self.body(self.stem(x)).mean((2, 3))


class ResidualBlock(nn.Module):
    """The residual pattern of ResNet: bn, an in-place add, an in-place ReLU; one storage, three tensors."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, 8, 3, padding=1)
        self.bn1 = nn.BatchNorm2d(8)
        self.conv2 = nn.Conv2d(8, 8, 3, padding=1)
        self.bn2 = nn.BatchNorm2d(8)
        self.relu = nn.ReLU(inplace=True)
        self.fc = nn.Linear(8, 5)

    def forward(self, x):
        identity = self.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(identity))
        out += identity
        return self.fc(self.relu(out).mean((2, 3)))


class Byproducts(nn.Module):
    """Ops that keep only a byproduct: stochastic depth its (N, 1, 1, 1) noise, LayerNorm its input plus
    per-position mean and rstd."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3, padding=1)
        self.norm = nn.LayerNorm(8)
        self.fc = nn.Linear(8, 5)

    def forward(self, x):
        y = self.conv(x)
        y = y + noisy_depth(y, 0.25)
        y = self.norm(y.permute(0, 2, 3, 1))
        return self.fc(y.mean((1, 2)))


class LeafAttention(nn.Module):
    """A conv stem and attention computed inside a leaf function from the layer's weights."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3, stride=2, padding=1)
        self.qkv = nn.Linear(8, 24, bias=False)
        self.proj = nn.Linear(8, 8, bias=False)
        self.fc = nn.Linear(8, 5)

    def forward(self, x):
        y = self.conv(x)
        y = y + attention(y, self.qkv.weight, self.proj.weight)
        return self.fc(y.mean((2, 3)))


MODELS = {"in_place": InPlaceActivations, "residual": ResidualBlock, "byproducts": Byproducts,
          "leaf_gemm": LeafAttention}


def _example(batch: int, seed: int = 0, size: int = 16) -> torch.Tensor:
    return torch.randn((batch, 3, size, size), generator=torch.Generator().manual_seed(seed))


def _policy(name: str, graph) -> Policy:
    if name != "all-low":
        return baseline(name, graph)
    return policy_from_assignment(
        graph, {tid: ALL_LOW[graph.tensors[tid].kind] for tid in graph.assignable_ids()}, high_format="e6m9s",
        overflow=dict(PAPER_OVERFLOW), loss_scaling={"mode": "dynamic", "init_scale": 2.0**16})


def _runtime_saved(model: nn.Module, policy: Policy, x: torch.Tensor) -> int:
    """Bytes the runtime's packer kept for backward after one training forward (non-parameter storages)."""
    wrapped = apply_policy(model, policy, x[:2])
    torch.manual_seed(3)
    wrapped(x)
    saved = wrapped.saved_bytes()
    wrapped.unwrap()
    return saved.activation + saved.other


def test_in_place_relu6_keeps_a_clone_of_its_input_counted_by_hand():
    """The issue's reproduction: batch 4 of 16x16. Saved: conv1's input, BN's input and four (8,) vectors
    (save_mean, save_invstd, running mean and var), the clone of ReLU6's input, conv2's input (ReLU6's
    output, in BN's storage)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 8, 3), nn.BatchNorm2d(8), nn.ReLU6(inplace=True), nn.Conv2d(8, 8, 3))
    x = _example(BATCH)
    by_hand = 4 * (BATCH * 3 * 16 * 16 + 3 * BATCH * 8 * 14 * 14 + 4 * 8)
    assert measure_saved_bytes(model, x) == by_hand == 87_680
    assert CostModel(trace(model, x[:2], batch_size=BATCH)).saved_activation_bytes() == by_hand


@pytest.mark.parametrize("name", list(MODELS))
def test_predicted_saved_bytes_equal_measured_in_fp32(name):
    torch.manual_seed(0)
    model = MODELS[name]()
    graph = trace(model, _example(2), batch_size=BATCH)
    torch.manual_seed(3)
    measured = measure_saved_bytes(model, _example(BATCH, seed=1))
    assert CostModel(graph).saved_activation_bytes() == measured


@pytest.mark.slow
@pytest.mark.parametrize("policy_name", ["hfp8", "fp16", "all-low"])
@pytest.mark.parametrize("name", list(MODELS))
def test_predicted_saved_bytes_equal_the_runtimes_under_a_policy(name, policy_name):
    torch.manual_seed(0)
    model = MODELS[name]()
    x = _example(BATCH, seed=1)
    graph = trace(model, x[:2], batch_size=BATCH)
    policy = _policy(policy_name, graph)
    predicted = CostModel(graph).saved_activation_bytes(policy.assignment(graph))
    assert _runtime_saved(model, policy, x) == predicted


def test_an_in_place_relu_is_stored_in_its_own_format_not_its_inputs():
    """bn2 high (2 bytes), the add and the ReLU that modify its storage in place low (1 byte): the runtime
    keeps the ReLU's output as 1-byte codes, and so must the prediction."""
    torch.manual_seed(0)
    model = ResidualBlock()
    x = _example(BATCH, seed=1)
    graph = trace(model, x[:2], batch_size=BATCH)
    assignment = dict.fromkeys(graph.assignable_ids(), "e4m3b4s")
    assignment.update({tid: "e6m9s" for tid in graph.assignable_ids() if tid.startswith("bn")})
    policy = policy_from_assignment(graph, assignment, overflow=dict(PAPER_OVERFLOW))
    cost = CostModel(graph)
    relu_output = graph.tensors["relu#1:activation"].numel
    assert cost.saved_activation_bytes(policy.assignment(graph)) == _runtime_saved(model, policy, x)
    high_relu = {**assignment, "relu#1:activation": "e6m9s"}
    assert cost.saved_activation_bytes(high_relu) - cost.saved_activation_bytes(assignment) == relu_output


def test_byproducts_are_priced_at_their_own_size():
    """noisy_depth keeps an (N, 1, 1, 1) float32 noise tensor; LayerNorm keeps its input and (N, H, W, 1)
    float32 mean and rstd; neither keeps a full-size output."""
    graph = trace(Byproducts(), _example(2), batch_size=BATCH)
    depth = next(op for op in graph.ops if op.module_type == "noisy_depth")
    norm = next(op for op in graph.ops if op.module_type == "LayerNorm")
    assert depth.attrs["saves"] == [["new", BATCH, 4]]
    assert norm.attrs["saves"] == [["activation", norm.input_tensors[0]], ["new", BATCH * 16 * 16, 4],
                                   ["new", BATCH * 16 * 16, 4]]


def test_gemms_inside_a_leaf_function_are_listed_as_unenforced_with_a_warning(caplog):
    torch.manual_seed(0)
    model = LeafAttention()
    x = _example(BATCH)
    graph = trace(model, x[:2], batch_size=BATCH)
    assert list(graph.unenforced()) == ["attention"]
    assert "aten.bmm" in graph.unenforced()["attention"] and "aten.mm" in graph.unenforced()["attention"]
    assert graph.ops[1].role == "gemm" and "hidden_gemms" not in graph.ops[1].attrs  # the conv is no leaf
    policy = baseline("hfp8", graph)
    with caplog.at_level(logging.WARNING, logger="precsearch.runtime"):
        wrapped = apply_policy(model, policy, x[:2])
    assert wrapped.unenforced == ["attention"]
    assert [r.message for r in caplog.records].count(next(m for m in caplog.messages if "attention" in m)) == 1
    assert "inside FX leaf" in caplog.text
    report = check_policy(policy, graph)
    assert report.unenforced == [f"attention ({graph.unenforced()['attention']})"]
    assert "WARNING: 1 op(s) not enforced inside" in report.summary()


class SecondInput(nn.Module):
    """``a * other``, mul saving both factors: ``other`` is conv_b's output as it is (``plain``), the same through
    ``type_as(a)`` (a's dtype, not its values), or ``(a > 0).float()`` (a mask, not a's values)."""

    def __init__(self, other: str) -> None:
        super().__init__()
        self.other = other
        self.conv_a = nn.Conv2d(3, 4, 3, padding=1)
        self.conv_b = nn.Conv2d(3, 4, 3, padding=1)
        self.fc = nn.Linear(4 * 16 * 16, 5)

    def forward(self, x):
        a = self.conv_a(x)
        other = {"plain": lambda: self.conv_b(x), "type_as": lambda: self.conv_b(x).type_as(a),
                 "mask": lambda: (a > 0).float()}[self.other]()
        return self.fc(torch.flatten(a * other, 1))


def test_a_layout_op_carries_the_rounded_values_of_its_first_input_alone():
    """Every activation e4m3b4s but conv_b's output: ``type_as(a)`` and ``(a > 0).float()`` read the low ``a``
    yet hold none of its values, so they are no alias of it (precsearch.runtime.sites ``AliasSite``): the
    runtime keeps the factor as float32, as the cost model prices it, and the gradients are those of the model
    without ``type_as`` (taken for an alias of ``a``, the factor was packed as a's codes: conv_a's gradient read
    conv_b's output rounded to a's format)."""
    x = _example(BATCH, seed=1)
    results = {}
    for other in ("plain", "type_as", "mask"):
        torch.manual_seed(0)
        model = SecondInput(other)
        graph = trace(model, x)
        policy = policy_from_assignment(graph, {tid: "e4m3b4s" for tid in graph.assignable_ids()
                                                if graph.tensors[tid].kind == "activation"
                                                and not tid.startswith("conv_b")})
        wrapped = apply_policy(model, policy, x)
        output = wrapped(x)
        saved = wrapped.saved_bytes()
        assert saved.activation + saved.other == CostModel(graph).saved_activation_bytes(policy.assignment(graph))
        assert "conv_a" not in {site.op for site in wrapped.sites.aliases}  # only flatten (mul), type_as (conv_b)
        output.square().sum().backward()
        results[other] = [output.detach(), *(param.grad for param in model.parameters())]
    assert all(torch.equal(a, b) for a, b in zip(results["plain"], results["type_as"], strict=True))
