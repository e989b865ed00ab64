"""CostModel's weight-update memory (masters, Kahan buffers, optimizer state) under a training configuration,
against hand sums over the model's own parameters and the buffers a real LowPrecisionOptimizer allocates."""

from __future__ import annotations

import pytest
import torch

from precsearch.cost.model import MIB, CostModel
from precsearch.errors import PrecsearchError
from precsearch.graph.tracing import trace
from precsearch.models import build
from precsearch.runtime.optim import LowPrecisionOptimizer

PURE_BF16_KAHAN = {"weight_format": "bf16", "master_weights": False, "update": "kahan", "state_format": "bf16"}
MPT = {"weight_format": "fp16", "master_weights": True, "update": "nearest"}  # state_format None: fp32


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return build("tiny_cnn")


def _cost(model: torch.nn.Module) -> CostModel:
    return CostModel(trace(model, torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(0))))


@pytest.fixture(scope="module")
def tiny() -> tuple[torch.nn.Module, CostModel]:
    model = _model()
    return model, _cost(model)


def _numel(model: torch.nn.Module) -> int:
    """Oracle: elements of the parameters an optimizer updates, straight from torch."""
    return sum(p.numel() for p in model.parameters() if p.requires_grad)


@pytest.mark.parametrize("optimizer, config, per_param", [
    # pure bf16 (Zamirai et al.): bf16 weight 2 + bf16 Kahan buffer 2 + bf16 momentum 2, no master
    ("sgd", PURE_BF16_KAHAN, {"weight": 2, "master_weight": 0, "compensation": 2, "optimizer_state": 2}),
    # mixed-precision training (Micikevicius et al.): fp16 weight 2 + fp32 master 4 + fp32 momentum 4
    ("sgd", MPT, {"weight": 2, "master_weight": 4, "compensation": 0, "optimizer_state": 4}),
    # AdamW, bf16 weights over fp32 masters, both moments in bf16: 2 states x 2 bytes
    ("adamw", {"weight_format": "bf16", "state_format": "bf16"},
     {"weight": 2, "master_weight": 4, "compensation": 0, "optimizer_state": 2 * 2}),
    # Adam with fp32 moments: 2 states x 4 bytes
    ("adam", {"weight_format": "bf16"}, {"weight": 2, "master_weight": 4, "compensation": 0, "optimizer_state": 8}),
    # momentum in an 8-bit format with 5 exponent bits, packed: 1 byte
    ("sgd", {"weight_format": "bf16", "state_format": "fp8_e5m2"},
     {"weight": 2, "master_weight": 4, "compensation": 0, "optimizer_state": 1}),
])
def test_update_bytes_equal_the_hand_sum_over_parameters(tiny, optimizer, config, per_param) -> None:
    model, cost = tiny
    n = _numel(model)
    assert n == 16 * 3 * 3 * 3 + 2 * 16 + 32 * 16 * 3 * 3 + 2 * 32 + 10 * 32 + 10  # tiny_cnn, by its layers
    assert cost.update_bytes(optimizer, config) == {kind: size * n for kind, size in per_param.items()}


def test_momentum_and_amsgrad_select_the_state_tensors(tiny) -> None:
    model, cost = tiny
    n = _numel(model)
    assert cost.update_bytes("sgd", MPT, momentum=False)["optimizer_state"] == 0
    assert cost.update_bytes("adamw", {"state_format": "bf16"}, amsgrad=True)["optimizer_state"] == 3 * 2 * n


def test_per_parameter_weight_formats_follow_the_assignment(tiny) -> None:
    """Convolution weights fp16 (fp32 master, 2 + 4 bytes), the rest unnamed so fp32 (no master, 4 bytes):
    the mixed case of mixed-precision training, with fp32 momentum everywhere."""
    model, cost = tiny
    graph = cost.graph
    conv = {name for name, _ in model.named_parameters() if name.startswith("conv")}
    assignment = {tid: "fp16" for tid, info in graph.tensors.items() if info.kind == "weight" and info.param in conv}
    assignment.update({tid: "e5m2s" for tid, info in graph.tensors.items() if info.kind == "activation"})  # ignored
    n_conv = sum(p.numel() for name, p in model.named_parameters() if name in conv)
    n_rest = _numel(model) - n_conv
    assert n_conv and n_rest
    expected = {"weight": 2 * n_conv + 4 * n_rest, "master_weight": 4 * n_conv, "compensation": 0,
                "optimizer_state": 4 * (n_conv + n_rest)}
    assert cost.update_bytes("sgd", MPT, weight_formats=assignment) == expected


def test_element_counts_match_a_real_optimizers_buffers(tiny) -> None:
    """The graph prices exactly the buffers LowPrecisionOptimizer allocates for the model: Kahan buffers and
    momenta counted after one step (torch creates momentum lazily), times the format's bytes by hand."""
    model = _model()
    wrapped = LowPrecisionOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), "bf16",
                                    update="kahan", master_weights=False, state_format="bf16")
    model(torch.randn(4, 3, 32, 32)).sum().backward()
    wrapped.step()
    compensation = sum(buffer.numel() for buffer in wrapped.state_dict()["compensation"].values())
    momenta = sum(state["momentum_buffer"].numel() for state in wrapped.state.values())
    priced = tiny[1].update_bytes("sgd", PURE_BF16_KAHAN)
    assert priced["compensation"] == 2 * compensation and priced["optimizer_state"] == 2 * momenta
    assert priced == pytest.approx(wrapped.memory_bytes())


def test_frozen_parameters_hold_no_master_or_state() -> None:
    model = _model()
    model.conv1.weight.requires_grad_(False)
    n = _numel(model)
    assert n == sum(p.numel() for p in model.parameters()) - 16 * 3 * 3 * 3
    assert _cost(model).update_bytes("sgd", MPT) == {"weight": 2 * n, "master_weight": 4 * n, "compensation": 0,
                                                      "optimizer_state": 4 * n}


def test_breakdown_under_an_optimizer_has_update_rows(tiny) -> None:
    model, cost = tiny
    graph = cost.graph
    weights = {tid: "bf16" for tid, info in graph.tensors.items() if info.kind == "weight"}
    table = cost.breakdown(weights, optimizer="sgd", config=PURE_BF16_KAHAN)
    assert list(table.columns[-4:]) == ["master_weight", "compensation", "optimizer_state", "total"]
    per_group = {}
    for tid in weights:
        per_group[graph.tensors[tid].group] = per_group.get(graph.tensors[tid].group, 0) + graph.tensors[tid].numel
    for group, numel in per_group.items():
        assert table.loc[group, "weight"] * MIB == pytest.approx(2 * numel)
        assert table.loc[group, "compensation"] * MIB == pytest.approx(2 * numel)
        assert table.loc[group, "optimizer_state"] * MIB == pytest.approx(2 * numel)
        assert table.loc[group, "master_weight"] == 0
    n = _numel(model)
    assert table.loc["total", "compensation"] * MIB == pytest.approx(2 * n)
    assert table.loc["total", "total"] * MIB == pytest.approx(cost.bytes(weights) + 2 * n + 2 * n)

    default = cost.breakdown(weights)  # no optimizer: fp32 master copies and fp32 momentum, no Kahan column
    assert "compensation" not in default.columns
    assert default.loc["total", "master_weight"] * MIB == pytest.approx(4 * n)
    assert default.loc["total", "optimizer_state"] * MIB == pytest.approx(4 * n)
    # with an optimizer, unnamed weights are fp32 and need no master copy
    mpt_all_fp32 = cost.breakdown(None, optimizer="sgd", config=MPT)
    assert mpt_all_fp32.loc["total", "master_weight"] == 0
    assert mpt_all_fp32.loc["total", "optimizer_state"] * MIB == pytest.approx(4 * n)


@pytest.mark.parametrize("call, message", [
    (lambda cost: cost.update_bytes("rmsprop", MPT), "optimizer rmsprop is not supported"),
    (lambda cost: cost.breakdown(None, optimizer="lamb"), "optimizer lamb is not supported"),
    (lambda cost: cost.update_bytes("sgd", {"updates": "kahan"}), "unknown optimizer setting"),
    (lambda cost: cost.update_bytes("sgd", {**PURE_BF16_KAHAN, "compensation_format": "fp32"}), "wider than"),
    (lambda cost: cost.update_bytes("sgd", {"update": "kahan"}), "master_weights=False"),
    (lambda cost: cost.update_bytes("sgd", MPT, weight_formats={"nope": "bf16"}), "unknown tensor 'nope'"),
    # a per-parameter format the config cannot serve: a Kahan buffer in bf16 for an 8-bit weight
    (lambda cost: cost.update_bytes("sgd", {**PURE_BF16_KAHAN, "compensation_format": "bf16"},
                                    weight_formats={"conv1:weight": "e5m2s"}), "wider than the weight format e5m2s"),
])
def test_bad_settings_raise_one_line_errors(tiny, call, message) -> None:
    with pytest.raises(PrecsearchError, match=message) as error:
        call(tiny[1])
    assert "\n" not in str(error.value)
