"""The memory cost model: bytes of assignments against hand sums, the vectorized path against the per-dict
one, and the predicted autograd saved bytes against measurement (saved_tensors_hooks) and hand counts."""

from __future__ import annotations

import logging
import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from precsearch.config.spec import ASSIGNABLE_KINDS, PAPER_LOW
from precsearch.cost.model import MIB, CostModel, measure_saved_bytes
from precsearch.errors import PrecsearchError
from precsearch.graph.tracing import trace
from precsearch.models import NAMES, build

# bits of each format, written out by hand (1 sign + E + M) as an oracle independent of precsearch.formats.format
BITS = {"e4m3b4s": 8, "e5m2s": 8, "e6m9s": 16, "fp16": 16, "bf16": 16, "fp8_e4m3fn": 8, "fp6_e3m2fn": 6,
        "fp4_e2m1fn": 4, "e3m4": 8, "fp32": 32}


def _example(batch: int, seed: int = 0) -> torch.Tensor:
    return torch.randn((batch, 3, 32, 32), generator=torch.Generator().manual_seed(seed))


@pytest.fixture(scope="module")
def resnet() -> CostModel:
    torch.manual_seed(0)
    return CostModel(trace(build("resnet18", width=0.25), _example(2), batch_size=16))


@pytest.mark.parametrize("name", NAMES)
def test_predicted_saved_bytes_match_measurement(name):
    """fp32, width 0.25, batch 8: the graph's prediction of what autograd saves vs what it saves."""
    torch.manual_seed(0)
    model = build(name, width=0.25)
    predicted = CostModel(trace(model, _example(2), batch_size=8)).saved_activation_bytes()
    measured = measure_saved_bytes(model, _example(8, seed=1))
    assert abs(predicted - measured) <= 0.02 * measured, (
        f"{name} width 0.25 batch 8 fp32: predicted {predicted / MIB:.3f} MiB saved for backward, "
        f"measured {measured / MIB:.3f} MiB (non-parameter storages, saved_tensors_hooks)")


def test_tiny_cnn_saved_bytes_by_hand():
    """Count tiny_cnn's saved storages by hand (see its docstring), in fp32 and with 8-bit activations."""
    n = 4
    graph = trace(build("tiny_cnn"), _example(2), batch_size=n)
    cost = CostModel(graph)
    x = n * 3 * 32 * 32                # conv1 saves the input
    conv1 = n * 16 * 32 * 32           # bn1 saves conv1's output
    relu1 = n * 16 * 32 * 32           # relu1 saves its output; max-pool saves the same storage again
    pool1_indices = n * 16 * 16 * 16   # and int64 indices
    pool1 = n * 16 * 16 * 16           # conv2 saves pool1's output
    conv2 = n * 32 * 8 * 8             # bn2 saves conv2's output
    relu2 = n * 32 * 8 * 8             # relu2 saves its output; adaptive avg-pool to 1x1 saves nothing
    flat = n * 32                      # linear saves the flattened pooled output
    stats = 4 * (16 + 32)              # per BN channel: save_mean, save_invstd, running_mean, running_var
    activations = x + conv1 + relu1 + pool1 + conv2 + relu2 + flat
    assert cost.saved_activation_bytes() == 4 * activations + 8 * pool1_indices + 4 * stats
    assert cost.saved_activation_bytes() == measure_saved_bytes(build("tiny_cnn"), _example(n))
    low = {tid: "e4m3b4s" for tid, info in graph.tensors.items() if info.kind == "activation"}
    assert cost.saved_activation_bytes(low) == activations + 8 * pool1_indices + 4 * stats
    half = {tid: "fp16" for tid in low}
    assert cost.saved_activation_bytes(half) == 2 * activations + 8 * pool1_indices + 4 * stats


class Assorted(nn.Module):
    """Ops with other save rules: ReLU6/SiLU/avg-pool save inputs, sigmoid its output, a tensor product both
    factors, dropout a float mask, max-pool indices, adaptive avg-pool to 2x2 its input."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3, padding=1)
        self.bn = nn.BatchNorm2d(8, affine=False)
        self.act = nn.ReLU6()
        self.drop = nn.Dropout(0.3)
        self.drop2d = nn.Dropout2d(0.3)
        self.pool = nn.MaxPool2d(2)
        self.avg = nn.AvgPool2d(2)
        self.fc = nn.Linear(8 * 2 * 2, 5)

    def forward(self, x):
        y = self.act(self.bn(self.conv(x)))
        y = F.silu(self.drop(y)) * torch.sigmoid(y)
        y = self.avg(self.pool(self.drop2d(y)))
        y = F.adaptive_avg_pool2d(y, 2)
        return self.fc(y.flatten(1))


def test_other_op_rules_match_measurement():
    torch.manual_seed(0)
    model = Assorted()
    predicted = CostModel(trace(model, _example(2), batch_size=6)).saved_activation_bytes()
    measured = measure_saved_bytes(model, _example(6))
    assert predicted == measured, f"predicted {predicted} B, measured {measured} B"


class Erf(nn.Module):
    """An op no rule knows (erf saves its input); `branch` makes the forward untraceable by FX."""

    def __init__(self, branch: bool = False):
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3)
        self.branch = branch

    def forward(self, x):
        y = self.conv(x)
        if self.branch and y.sum() > 1e9:  # data-dependent control flow: FX cannot trace this
            y = y * 2
        return torch.erf(y).mean((2, 3))


def test_unknown_op_is_priced_by_what_autograd_saved_while_tracing(caplog):
    model = Erf()
    with caplog.at_level(logging.WARNING, logger="precsearch.cost.model"):
        predicted = CostModel(trace(model, _example(2), batch_size=4)).saved_activation_bytes()
    assert predicted == measure_saved_bytes(model, _example(4)) and "no autograd save rule" not in caplog.text


def test_unknown_op_of_a_hook_traced_model_is_counted_conservatively_with_a_warning(caplog):
    model = Erf(branch=True)
    with caplog.at_level(logging.WARNING, logger="precsearch.cost.model"), pytest.warns(UserWarning, match="torch.fx"):
        predicted = CostModel(trace(model, _example(2), batch_size=4)).saved_activation_bytes()
    assert "no autograd save rule for op type(s) erf" in caplog.text
    assert predicted >= measure_saved_bytes(model, _example(4))


def test_measuring_leaves_the_model_untouched():
    model = build("tiny_cnn").eval()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    assert measure_saved_bytes(model, _example(4)) > 0
    assert not model.training and all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    with pytest.raises(PrecsearchError, match="expects \\(N, 3, H, W\\)"):
        measure_saved_bytes(model, torch.randn(2, 1, 32, 32))


def test_mixed_assignment_bytes_equal_the_hand_sum(resnet):
    graph = resnet.graph
    rng = np.random.default_rng(0)
    specs = sorted(BITS)
    assignment = {tid: specs[rng.integers(len(specs))] for tid in graph.assignable_ids() if rng.random() < 0.7}
    expected_bits = sum(math.prod(info.shape) * BITS[assignment.get(tid, "fp32")]
                        for tid, info in graph.tensors.items() if info.kind in ASSIGNABLE_KINDS)
    assert resnet.bits(assignment) == expected_bits
    assert resnet.bytes(assignment) == expected_bits / 8
    assert resnet.bytes() == 4 * sum(math.prod(i.shape) for i in graph.tensors.values() if i.kind in ASSIGNABLE_KINDS)
    every_kind = resnet.bytes(assignment, kinds=("weight", "activation", "weight_grad", "activation_grad",
                                                  "master_weight", "optimizer_state"))
    params = sum(math.prod(i.shape) for i in graph.tensors.values() if i.kind == "weight")
    assert every_kind == expected_bits / 8 + 2 * 4 * params  # master copies and momentum stay fp32
    acts = [tid for tid, info in graph.tensors.items() if info.kind == "activation"]
    assert resnet.activation_bytes() == 4 * sum(graph.tensors[t].numel for t in acts)


def test_breakdown_rows_and_columns_add_up(resnet):
    graph = resnet.graph
    assignment = {tid: "e5m2s" for tid, info in graph.tensors.items() if info.kind == "activation_grad"}
    table = resnet.breakdown(assignment)
    for kind in ASSIGNABLE_KINDS:
        assert table.loc["total", kind] * MIB == pytest.approx(resnet.bytes(assignment, kinds=(kind,)))
    for group in graph.groups:
        bits = sum(graph.tensors[t].numel * (8 if t in assignment else 32) for t in group.tensor_ids)
        assert table.loc[group.index, "total"] * MIB == pytest.approx(bits / 8)
    assert table.loc["total", "total"] == pytest.approx(table["total"].iloc[:-1].sum())


def test_bytes_batch_matches_one_dict_at_a_time(resnet):
    rng = np.random.default_rng(1)
    decisions = rng.random((64, resnet.n_groups)) < 0.5
    batch = resnet.bytes_batch(decisions)
    one_by_one = [resnet.bytes(resnet.group_assignment(row)) for row in decisions]
    assert batch.tolist() == one_by_one
    graph = resnet.graph
    assignable = [info for info in graph.tensors.values() if info.kind in ASSIGNABLE_KINDS]
    all_high = resnet.bytes_batch(np.zeros(resnet.n_groups, dtype=bool))[0]
    assert all_high == sum(info.numel * 16 for info in assignable) / 8  # e6m9s everywhere
    all_low = resnet.bytes_batch(np.ones(resnet.n_groups, dtype=bool))[0]
    assert all_low == sum(info.numel * BITS[PAPER_LOW[info.kind]] for info in assignable) / 8
    with pytest.raises(PrecsearchError, match=f"shape \\(n, {resnet.n_groups}\\)"):
        resnet.bytes_batch(np.zeros((2, resnet.n_groups + 1)))


def test_low_shares(resnet):
    graph = resnet.graph
    numel = {tid: info.numel for tid, info in graph.tensors.items() if info.kind in ASSIGNABLE_KINDS}
    total = sum(numel.values())
    activations = {tid: "e4m3b4s" for tid in numel if graph.tensors[tid].kind == "activation"}
    assert resnet.low_share(activations) == pytest.approx(sum(numel[t] for t in activations) / total)
    # weight grads kept at e6m9s (the high format's width) are not held in fewer bits
    assert resnet.low_share(resnet.group_assignment([True] * resnet.n_groups)) == pytest.approx(
        sum(n for t, n in numel.items() if graph.tensors[t].kind != "weight_grad") / total)
    decisions = np.zeros((2, resnet.n_groups), dtype=bool)
    decisions[1, [0, 3]] = True
    in_groups = sum(n for t, n in numel.items() if graph.tensors[t].group in (0, 3))
    assert resnet.ratio_batch(decisions).tolist() == pytest.approx([0.0, in_groups / total])


def test_bad_assignments(resnet):
    with pytest.raises(PrecsearchError, match="unknown tensor 'nope:activation'"):
        resnet.bytes({"nope:activation": "e5m2s"})
    with pytest.raises(PrecsearchError, match="is a master_weight, always fp32"):
        resnet.bytes({"conv1:weight_master": "e5m2s"})
    with pytest.raises(PrecsearchError, match="unknown float format"):
        resnet.bytes({"conv1:weight": "e9m9x"})
    with pytest.raises(PrecsearchError, match="low formats must name exactly the kinds"):
        CostModel(resnet.graph, low={"weight": "e4m3b4s"})


SCALED_LOW = {"weight": "e4m3fn@block32", "activation": "e4m3fn@tensor:delayed16", "activation_grad": "e5m2@row",
              "weight_grad": "e5m2@tensor"}


def _two_linears() -> tuple[nn.Module, torch.Tensor]:
    return nn.Sequential(nn.Linear(40, 8, bias=False), nn.ReLU(), nn.Linear(8, 3, bias=False)), torch.randn(2, 40)


def test_scaled_formats_are_priced_as_codes_plus_a_byte_per_scale_by_hand():
    """Batch 4 through Linear(40, 8), ReLU, Linear(8, 3): one byte per 8-bit code, one per e8m0 scale (per tensor,
    per row of x.reshape(rows, -1), per 32 values of a row), and a delayed16 history's 16 float32 amaxes."""
    model, x = _two_linears()
    graph = trace(model, x, batch_size=4)
    history = 16 * 4
    by_hand = {
        "input_1:activation": 4 * 40 + 1 + history,
        "0:weight": 8 * 40 + 8 * 2,            # 8 rows of 40 values: two blocks of 32 (the second one short)
        "0:weight_grad": 8 * 40 + 1,
        "0:activation": 4 * 8 + 1 + history,
        "0:activation_grad": 4 * 8 + 4,        # one scale per sample (row)
        "1:activation": 4 * 8 + 1 + history,
        "1:activation_grad": 4 * 8 + 4,
        "2:weight": 3 * 8 + 3 * 1,
        "2:weight_grad": 3 * 8 + 1,
        "2:activation": 4 * 3 + 1 + history,
        "2:activation_grad": 4 * 3 + 4,
    }
    assert set(by_hand) == set(graph.assignable_ids())
    cost = CostModel(graph, high="bf16", low=SCALED_LOW)
    all_low = {tid: SCALED_LOW[graph.tensors[tid].kind] for tid in by_hand}
    assert cost.bytes(all_low) == sum(by_hand.values()) == 1293
    assert cost.bytes_batch(np.ones((1, cost.n_groups)))[0] == 1293  # the group table prices them alike
    assert cost.bytes_batch(np.zeros((1, cost.n_groups)))[0] == 2 * (160 + 320 * 2 + 32 * 4 + 24 * 2 + 12 * 2)
    # autograd keeps the input (for the first GEMM) and the ReLU's output (ReLU and the second GEMM): their codes
    # and their one scale each; the amax histories are state, not saved
    assert cost.saved_activation_bytes(all_low) == (160 + 1) + (32 + 1)
    assert cost.low_share(all_low) == 1.0
