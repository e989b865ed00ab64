"""The paper's assignment technique, its ablations, uniform assignments, the seed set of the search and the
prior-work baselines."""

from __future__ import annotations

import json
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from torch import nn

from precsearch.config.policy import Policy
from precsearch.config.spaces import paper_space, parse_space
from precsearch.config.spec import ASSIGNABLE_KINDS, BASELINES
from precsearch.cost.model import CostModel
from precsearch.errors import PrecsearchError
from precsearch.graph.policy_check import check_policy
from precsearch.graph.tracing import trace
from precsearch.models import build
from precsearch.search.seeding import PAPER_SEEDING, Seeding, Seedings, seed_candidates, seed_queue
from precsearch.search.strategies import (
    ACCEPTANCE_WINDOW,
    R_GRID,
    Candidate,
    assign,
    assignment_key,
    baseline,
    baseline_policies,
    group_sizes,
    low_share,
    paper_assignment,
    sweep,
    uniform,
    units,
)
from precsearch.train.proxy import build_model

SPACE = paper_space()


class Ladder(nn.Module):
    """Convs of varied widths and resolutions, so group sizes differ a lot (seven groups with the input)."""

    def __init__(self) -> None:
        super().__init__()
        widths = [3, 8, 24, 4, 16, 6]
        self.convs = nn.ModuleList(nn.Conv2d(a, b, 3, padding=1) for a, b in zip(widths, widths[1:], strict=False))
        self.head = nn.Linear(6, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for index, conv in enumerate(self.convs):
            x = torch.relu(conv(x))
            if index == 1:
                x = nn.functional.max_pool2d(x, 2)
        return self.head(x.mean(dim=(2, 3)))


@pytest.fixture(scope="module")
def graph():
    return trace(Ladder(), torch.zeros(1, 3, 8, 8), batch_size=4)


def _sizes_from_frame(graph) -> dict[int, int]:
    """Group sizes computed independently from the graph's DataFrame."""
    frame = graph.to_dataframe()
    frame = frame[frame["kind"].isin(ASSIGNABLE_KINDS)]
    return {int(g): int(n) for g, n in frame.groupby("group")["numel"].sum().items()}


def _low_groups(candidate) -> set[int]:
    return {int(unit[1:]) for unit, level in candidate.decisions.items() if level == "low"}


def test_group_sizes_match_the_graph(graph):
    assert group_sizes(graph) == _sizes_from_frame(graph)
    assert len(group_sizes(graph)) == len(graph.groups) == 7


def test_endpoints_are_all_high_and_all_low(graph):
    assert paper_assignment(graph, 0.0, SPACE).assignment == uniform(graph, SPACE, "high").assignment
    assert paper_assignment(graph, 1.0, SPACE).assignment == uniform(graph, SPACE, "low").assignment
    low = uniform(graph, SPACE, "low").assignment
    assert all(low[tid] == SPACE.low[graph.tensors[tid].kind] for tid in graph.assignable_ids())
    assert set(low) == set(graph.assignable_ids())


@pytest.mark.parametrize("r", R_GRID)
def test_largest_groups_demoted_first_until_the_share_reaches_r(graph, r):
    sizes = _sizes_from_frame(graph)
    total = sum(sizes.values())
    order = sorted(sizes, key=lambda g: (-sizes[g], g))
    candidate = paper_assignment(graph, r, SPACE)
    demoted = _low_groups(candidate)
    # A prefix of the largest-first order ...
    assert demoted == set(order[:len(demoted)])
    share = sum(sizes[g] for g in demoted) / total
    assert share >= r - 1e-12 and candidate.low_share == pytest.approx(share)
    # ... and the shortest such prefix: without its last group the share is below r.
    if demoted:
        assert share - sizes[order[len(demoted) - 1]] / total < r


def test_low_share_agrees_with_the_cost_models_ratio(graph):
    cost = CostModel(graph)
    for candidate in sweep(graph, SPACE):
        decisions = np.zeros(len(graph.groups))
        decisions[sorted(_low_groups(candidate))] = 1
        assert candidate.low_share == pytest.approx(float(cost.ratio_batch(decisions)[0]))
    # and memory falls as r grows
    memory = [cost.bytes(c.assignment) for c in sweep(graph, SPACE)]
    assert all(a >= b for a, b in zip(memory, memory[1:], strict=False))


def test_smallest_first_ablation(graph):
    sizes = _sizes_from_frame(graph)
    order = sorted(sizes, key=lambda g: (sizes[g], g))
    candidate = paper_assignment(graph, 0.3, SPACE, order="smallest")
    assert candidate.strategy == "paper-smallest"
    assert _low_groups(candidate) == set(order[:len(_low_groups(candidate))])


def test_random_ablation_is_seeded(graph):
    runs = {seed: [paper_assignment(graph, 0.5, SPACE, order="random", seed=seed).key for _ in range(2)]
            for seed in range(6)}
    assert all(a == b for a, b in runs.values())
    assert len({keys[0] for keys in runs.values()}) > 1


def _stand_in(sizes: list[int]) -> SimpleNamespace:
    """A graph-like object: one activation per group with the given sizes (groups in execution order)."""
    tensors = {f"op{g}:activation": SimpleNamespace(id=f"op{g}:activation", kind="activation", numel=n, group=g)
               for g, n in enumerate(sizes)}
    return SimpleNamespace(tensors=tensors)


def test_ties_go_to_execution_order():
    graph = _stand_in([5, 10, 10, 5])
    assert _low_groups(paper_assignment(graph, 0.3, SPACE)) == {1}
    assert _low_groups(paper_assignment(graph, 0.6, SPACE)) == {1, 2}
    assert _low_groups(paper_assignment(graph, 0.7, SPACE)) == {0, 1, 2}
    assert _low_groups(paper_assignment(graph, 0.1, SPACE, order="smallest")) == {0}


def test_bad_arguments():
    graph = _stand_in([1, 2])
    with pytest.raises(PrecsearchError, match=r"\[0, 1\]"):
        paper_assignment(graph, 1.5, SPACE)
    with pytest.raises(PrecsearchError, match="largest, smallest, random"):
        paper_assignment(graph, 0.5, SPACE, order="middle")
    with pytest.raises(PrecsearchError, match="high, low"):
        assign(graph, SPACE, {"g0": "medium"})


def test_tensor_granularity_matches_group_decisions(graph):
    per_tensor = parse_space({**SPACE.to_dict(), "granularity": "tensor"})
    assert list(units(graph, per_tensor)) == graph.assignable_ids()
    for r in (0.2, 0.7):
        assert paper_assignment(graph, r, per_tensor).assignment == paper_assignment(graph, r, SPACE).assignment


def test_categorical_choice_assigns_its_formats(graph):
    space = parse_space({**SPACE.to_dict(), "granularity": "categorical",
                         "choices": {"half": "fp16", "e5": {"activation": "e5m2s"}}})
    decisions = dict.fromkeys(units(graph, space), "high") | {"g1": "half", "g2": "e5"}
    assignment = assign(graph, space, decisions)
    for tid in graph.assignable_ids():
        info = graph.tensors[tid]
        expected = {1: "fp16", 2: "e5m2s" if info.kind == "activation" else "e6m9s"}.get(info.group, "e6m9s")
        assert assignment[tid] == expected
    sizes = _sizes_from_frame(graph)  # every level but high counts toward the low share
    assert low_share(graph, space, decisions) == pytest.approx((sizes[1] + sizes[2]) / sum(sizes.values()))


def test_seed_candidates_are_distinct_and_cover_the_sweep(graph):
    seeds = seed_candidates(graph, SPACE)
    keys = [candidate.key for candidate, _ in seeds]
    assert len(keys) == len(set(keys))
    origins = [origin for _, names in seeds for origin in names]
    assert sorted(origins) == sorted(["all-high", "all-low", *(f"paper r={r:.1f}" for r in R_GRID)])
    by_origin = {origin: candidate for candidate, names in seeds for origin in names}
    assert by_origin["paper r=0.0"].key == by_origin["all-high"].key
    assert by_origin["paper r=1.0"].key == by_origin["all-low"].key


def test_a_seeding_in_the_config_is_enqueued_by_the_search_without_editing_it(graph):
    class Alternate(Seeding):
        name = "alternate"

        def candidates(self, graph, space):
            decisions = {unit: ("low" if i % 2 else "high") for i, unit in enumerate(units(graph, space))}
            return [(Candidate(self.name, decisions, assign(graph, space, decisions),
                               low_share(graph, space, decisions)), "alternate")]

    seeding = Seedings("paper-then-alternate", [*PAPER_SEEDING.parts, Alternate()])
    enqueued = seed_queue(SimpleNamespace(graph=graph, space=SPACE, assignments=2**20), 1, seeding)
    origins = [origins for _, origins in enqueued]
    assert origins[0] == ["all-high", "paper r=0.0"] and origins[-1] == ["alternate"]
    assert enqueued[-1][0] == {unit: ("low" if i % 2 else "high") for i, unit in enumerate(units(graph, SPACE))}


def test_assignment_key_ignores_order_and_sees_changes():
    a = {"x:activation": "e6m9s", "y:weight": "e4m3b4s"}
    assert assignment_key(a) == assignment_key(dict(reversed(list(a.items()))))
    assert assignment_key(a) != assignment_key({**a, "y:weight": "e6m9s"})


def test_baseline_policies_assign_the_hand_table_on_tiny_cnn():
    """Formats of every tensor of tiny_cnn (conv1 - conv2 - linear: the GEMMs), written out by hand."""
    torch.manual_seed(0)
    tiny = trace(build_model("tiny_cnn", 10), torch.zeros(1, 3, 8, 8), batch_size=4)
    policies = baseline_policies(tiny)
    assert list(policies) == list(BASELINES)
    for name, spec in [("fp32", "fp32"), ("fp16", "fp16"), ("bf16", "bf16"), ("fp8", "fp8_e5m2"), ("mpt", "fp16")]:
        assert set(policies[name].assignment(tiny).values()) == {spec}, name
    assert policies["mpt"].loss_scaling["mode"] == "dynamic" and policies["fp16"].loss_scaling["mode"] == "none"
    # hfp8: only the middle GEMM's operands are low: its weight, its input (pool1's output), its output gradient
    hfp8 = {"conv2:weight": "e4m3b4s", "pool1:activation": "e4m3b4s", "conv2:activation_grad": "e5m2s"}
    assert policies["hfp8"].assignment(tiny) == {t: hfp8.get(t, "e6m9s") for t in tiny.assignable_ids()}
    # wang_fp8: e5m2s but weight gradients and the first and last GEMM's operands (e6m9s)
    first_last = {"x:activation", "conv1:weight", "conv1:activation_grad", "pool2:activation", "linear:weight",
                  "linear:bias", "linear:activation_grad"}
    expected = {t: "e6m9s" if t in first_last or t.endswith("weight_grad") or t.endswith("bias_grad") else "e5m2s"
                for t in tiny.assignable_ids()}
    assert policies["wang_fp8"].assignment(tiny) == expected
    assert policies["wang_fp8"].optimizer["update"] == "stochastic"


def test_the_acceptance_window_keeps_exactly_the_targets_the_reference_accepts(graph):
    # the reference runs r only if the share it reached lies in [r, r + 0.1]; computed here from the group sizes
    sizes = _sizes_from_frame(graph)
    total = sum(sizes.values())
    order = sorted(sizes, key=lambda g: (-sizes[g], g))
    accepted = []
    for r in R_GRID:
        share = 0.0
        for group in order:
            if share >= r - 1e-12:
                break
            share += sizes[group] / total
        if r in (0.0, 1.0) or share <= r + 0.1 + 1e-12:
            accepted.append(r)
    assert len(accepted) < len(R_GRID)  # tiny_cnn's groups are coarse: some targets overshoot the window
    assert [c.r for c in sweep(graph, SPACE, window=ACCEPTANCE_WINDOW)] == accepted
    assert [c.r for c in sweep(graph, SPACE)] == list(R_GRID)  # no window: every target


# ------------------------------------------------------------------------------------------- baselines


@pytest.fixture(scope="module")
def tiny_graph():
    return trace(build("tiny_cnn"), torch.zeros(2, 3, 32, 32), batch_size=8)


def test_every_baseline_builds_and_predicts_from_the_cost_model(tiny_graph):
    cost = CostModel(tiny_graph)
    fp32_bytes = cost.bytes({})
    for name in BASELINES:
        policy = baseline(name, tiny_graph)
        assert check_policy(policy, tiny_graph).ok, name
        assignment = policy.assignment(tiny_graph)
        assert policy.predicted["bytes"] == int(cost.bytes(assignment))
        assert policy.predicted["ratio"] == pytest.approx(cost.bytes(assignment) / fp32_bytes)
        assert policy.provenance == {"strategy": f"baseline:{name}"}
        Policy.from_dict(json.loads(policy.to_json()))  # every baseline survives its own file format
        assert policy.accumulation is None  # costly: never on by default
    assert baseline("fp32", tiny_graph).predicted["ratio"] == 1.0
    assert baseline("fp16", tiny_graph).predicted["ratio"] == 0.5
    assert baseline("fp8", tiny_graph).predicted["ratio"] == 0.25
    with pytest.raises(PrecsearchError, match="unknown baseline 'fp4'; use one of fp32, fp16"):
        baseline("fp4", tiny_graph)


def test_uniform_and_mixed_precision_baselines(tiny_graph):
    ids = tiny_graph.assignable_ids()
    for name, spec in (("fp16", "fp16"), ("bf16", "bf16"), ("fp8", "fp8_e5m2")):
        policy = baseline(name, tiny_graph)
        assert set(policy.assignment(tiny_graph).values()) == {spec}
        assert policy.loss_scaling == {"mode": "none"} and policy.master_weights
    mpt = baseline("mpt", tiny_graph)
    assert mpt.assignment(tiny_graph) == dict.fromkeys(ids, "fp16")
    assert mpt.master_weights and mpt.loss_scaling == {"mode": "dynamic", "init_scale": 2.0**16}


def test_hfp8_keeps_only_the_inner_gemm_operands_low(tiny_graph):
    # tiny_cnn: conv1 (first GEMM), conv2, linear (last GEMM). conv2 computes pool1:activation x conv2:weight;
    # its backward multiplies conv2:activation_grad. Only those are low; everything else is e6m9s.
    assignment = baseline("hfp8", tiny_graph).assignment(tiny_graph)
    low = {tid: spec for tid, spec in assignment.items() if spec != "e6m9s"}
    assert low == {"pool1:activation": "e4m3b4s", "conv2:weight": "e4m3b4s", "conv2:activation_grad": "e5m2s"}
    policy = baseline("hfp8", tiny_graph)
    assert policy.overflow == {"weight": "saturate", "activation": "saturate", "weight_grad": "inf",
                               "activation_grad": "inf"}
    assert policy.promotion_threshold is None and policy.high_format == "e6m9s"


def test_wang_fp8_is_e5m2_data_with_16_bit_first_and_last_layers(tiny_graph):
    policy = baseline("wang_fp8", tiny_graph)
    assignment = policy.assignment(tiny_graph)
    high = {"x:activation", "conv1:weight", "conv1:activation_grad",  # first GEMM's operands
            "pool2:activation", "linear:weight", "linear:bias", "linear:activation_grad"}  # last GEMM's
    for tid, spec in assignment.items():
        kind = tiny_graph.tensors[tid].kind
        expected = "e6m9s" if tid in high or kind == "weight_grad" else "e5m2s"
        assert spec == expected, tid
    assert policy.optimizer == {"update": "stochastic"}


def test_torchao_fp8_makes_every_gemm_input_scaled_fp8_and_the_rest_bf16(tiny_graph):
    # tiny_cnn's GEMMs by hand: conv1 (x, conv1:weight), conv2 (pool1's output, conv2:weight), linear
    # (pool2's output, linear:weight). Forward operands e4m3fn@tensor; the output gradient each backward
    # multiplies e5m2@tensor; linear's bias (added, not multiplied) and all weight gradients stay bf16.
    gemm_inputs = {
        "x:activation": "e4m3fn@tensor", "conv1:weight": "e4m3fn@tensor", "conv1:activation_grad": "e5m2@tensor",
        "pool1:activation": "e4m3fn@tensor", "conv2:weight": "e4m3fn@tensor", "conv2:activation_grad": "e5m2@tensor",
        "pool2:activation": "e4m3fn@tensor", "linear:weight": "e4m3fn@tensor", "linear:activation_grad": "e5m2@tensor",
    }
    policy = baseline("torchao_fp8", tiny_graph)
    assert policy.assignment(tiny_graph) == {t: gemm_inputs.get(t, "bf16") for t in tiny_graph.assignable_ids()}
    assert policy.high_format == "bf16" and policy.loss_scaling == {"mode": "none"} and policy.master_weights
    assert policy.promotion_threshold is None
    assert json.loads(policy.to_json())["schema_version"] == 2  # a scaled policy's file
