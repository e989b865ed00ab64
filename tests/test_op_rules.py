"""The op rules are one table that graph, cost model and runtime all read: a made-up module type declared in one
injected ``OpRules`` changes the graph's ops and groups, the predicted saved bytes and what the runtime rounds.

Oracles: the groups and saved bytes are worked out by hand from the model below; the saved bytes of the plain
table are autograd's own (``measure_saved_bytes``); a rounded tensor is one that rounding to its format leaves
unchanged."""

from __future__ import annotations

import copy
import dataclasses
import warnings

import pytest
import torch
from torch import nn

from precsearch.config.compiling import CompileOptions
from precsearch.cost.model import CostModel, measure_saved_bytes
from precsearch.cost.policies import policy_from_assignment
from precsearch.formats.kernels import quantize
from precsearch.formats.runner import Runtime, default_runtime
from precsearch.graph.op_rules import OP_RULES, OpRule, OpRules
from precsearch.graph.tracing import trace
from precsearch.runtime import model as runtime_model
from precsearch.runtime.model import apply_policy
from precsearch.runtime.sites import AliasSite, SitePlan

LOW = "e4m3b4s"
BATCH = 2
SHIFT_NUMEL = BATCH * 4 * 4 * 4  # Shift's output: (2, 4, 4, 4)


class Shift(nn.Module):
    """A made-up elementwise layer the table does not know."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + 1


class Net(nn.Module):
    """conv -> Shift -> ReLU -> flatten -> linear, with data-dependent control flow: torch.fx cannot trace it, so
    the module hooks do and the cost model takes what each op saves from the rules, not from a recorded run."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3, padding=1)
        self.shift = Shift()
        self.relu = nn.ReLU()
        self.fc = nn.Linear(4 * 4 * 4, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.abs().sum() < 0:  # never taken
            return x
        return self.fc(torch.flatten(self.relu(self.shift(self.conv(x))), 1))


class TraceableNet(Net):
    """Net without its branch: torch.fx traces it, so the FX lowering and the compiled step round it."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(torch.flatten(self.relu(self.shift(self.conv(x))), 1))


PASS_THROUGH = OP_RULES.with_modules({Shift: OpRule(pass_through=True)})
SAVES_OUTPUT = OP_RULES.with_modules({Shift: OpRule(saves=("output",))})
# the conv's and the ReLU's backward not sliced over their saved tensor: neither reads codes
NOT_SLICED = OP_RULES.with_modules({kind: dataclasses.replace(OP_RULES.modules[kind], sliced=None)
                                    for kind in (nn.ReLU, nn.Conv2d)})


def _trace(rules: OpRules) -> tuple[Net, torch.Tensor, object]:
    torch.manual_seed(0)
    model, x = Net(), torch.randn(BATCH, 3, 4, 4)
    with pytest.warns(UserWarning, match="torch.fx could not trace"):
        graph = trace(model, x, rules=rules)
    return model, x, graph


@pytest.mark.parametrize(("rules", "group_ops"), [
    (OP_RULES, ["conv", "add", "relu"]),  # not in the table: traced through, its sum is a function op
    (PASS_THROUGH, ["conv", "relu"]),  # a layout op: no op, no tensor
    (SAVES_OUTPUT, ["conv", "shift", "relu"]),  # one op of its own
])
def test_a_rule_declared_once_decides_the_graphs_ops_and_groups(rules, group_ops):
    _, _, graph = _trace(rules)
    assert [list(group.ops) for group in graph.groups] == [["x"], group_ops, ["fc"]]
    assert graph.rules is rules
    ops = {op.name: op for op in graph.ops}
    assert ops["relu"].input_tensors == (f"{group_ops[-2]}:activation",)  # reads Shift's output, or conv's
    if "shift" in ops:
        assert ops["shift"].module_type == "Shift" and ops["shift"].role == "other"
        assert {"shift:activation", "shift:activation_grad"} <= set(graph.groups[1].tensor_ids)


def test_the_cost_model_prices_what_the_rule_says_the_op_saves():
    """conv saves its input (2*3*4*4 floats), ReLU its output (2*4*4*4), the linear layer the same storage
    through the flatten; an add saves nothing, and so does a pass-through. Declared as saving its output,
    Shift adds its output's float32 bytes, and its output is one more activation in the paper's counting."""
    model, x, plain = _trace(OP_RULES)
    measured = measure_saved_bytes(model, x)
    assert measured == 4 * (BATCH * 3 * 4 * 4 + SHIFT_NUMEL)
    assert CostModel(plain).saved_activation_bytes() == measured
    passed, saving = CostModel(_trace(PASS_THROUGH)[2]), CostModel(_trace(SAVES_OUTPUT)[2])
    assert passed.saved_activation_bytes() == measured
    assert saving.saved_activation_bytes() == measured + 4 * SHIFT_NUMEL
    assert saving.activation_bytes() == passed.activation_bytes() + 4 * SHIFT_NUMEL


@pytest.mark.parametrize("rules", [PASS_THROUGH, SAVES_OUTPUT])
def test_the_runtime_rounds_an_op_of_the_table_and_not_a_pass_through(rules):
    """Every activation low: Shift's output is rounded where the table makes it an op, and where it is a
    pass-through the ReLU reads the rounded conv output plus one, which the format cannot hold everywhere."""
    model, x, graph = _trace(rules)
    policy = policy_from_assignment(graph, {tid: LOW for tid in graph.assignable_ids()
                                            if graph.tensors[tid].kind == "activation"})
    with pytest.warns(UserWarning, match="torch.fx could not trace"):
        wrapped = apply_policy(copy.deepcopy(model), policy, x, rules=rules)
    seen = []
    wrapped.module.relu.register_forward_pre_hook(lambda module, args: seen.append(args[0].detach().clone()))
    wrapped(x)
    relu_input = seen[0]
    rounded = torch.equal(quantize(relu_input, LOW), relu_input)
    assert ("shift:activation" in wrapped.state.slots) is (rules is SAVES_OUTPUT)
    assert rounded is (rules is SAVES_OUTPUT)


@pytest.mark.parametrize("rules", [PASS_THROUGH, SAVES_OUTPUT])
@pytest.mark.parametrize("lowering", ["module hooks", "fx", "compiled"])
def test_an_injected_rule_reaches_every_lowering(lowering, rules):
    """The rule decides the sites (precsearch.runtime.sites), and every lowering rounds at them with no edit of
    its own: the model's output under every activation low equals the same forward written by hand with
    ``quantize`` at each site, Shift's output rounded where the rule makes it an op and not where it is a
    pass-through (the ReLU then reads the rounded conv output plus one). The module-hook lowering runs Net
    (FX cannot trace it), the others TraceableNet, the compiled step through aot_eager."""
    torch.manual_seed(0)
    model, x = (Net() if lowering == "module hooks" else TraceableNet()), torch.randn(BATCH, 3, 4, 4)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the hook lowering says FX could not trace Net
        graph = trace(model, x, rules=rules)
        policy = policy_from_assignment(graph, {tid: LOW for tid in graph.assignable_ids()
                                                if graph.tensors[tid].kind == "activation"})
        wrapped = apply_policy(copy.deepcopy(model), policy, x, rules=rules,
                               compile=CompileOptions("aot_eager") if lowering == "compiled" else False)
    assert graph.tracer == ("hooks" if lowering == "module hooks" else "fx")
    assert (wrapped.compiled_step is not None) is (lowering == "compiled")
    output = wrapped(x)

    def q(value: torch.Tensor) -> torch.Tensor:
        return quantize(value, LOW)

    with torch.no_grad():
        conv = q(model.conv(q(x)))
        shifted = q(conv + 1) if rules is SAVES_OUTPUT else conv + 1
        expected = q(model.fc(torch.flatten(q(torch.relu(shifted)), 1)))
    assert torch.equal(output.detach(), expected)


@pytest.mark.parametrize("rules", [OP_RULES, NOT_SLICED])
def test_an_injected_plan_decision_reaches_every_lowering(rules):
    """Which layers run their backward over codes is the site plan's (``OpSites.reads_codes``: the conv reading
    the rounded input; ``OpSites.relu_output``: the ReLU reading its rounded output), from the op rules: with
    their sliced backward taken off in an injected table, the plan says neither, and with no edit of its own
    the FX lowering calls both layers as themselves and the compiled step (aot_eager) leaves its convolution to
    autograd and its ReLU unmasked; with the table's rules, both lowerings take the plan's packed calls. Either
    way the two agree bit for bit on the output and every gradient. (The module-hook lowering runs no backward
    over codes: it rounds at the sites alone, ``test_an_injected_rule_reaches_every_lowering``.)"""
    torch.manual_seed(0)
    model, x = TraceableNet(), torch.randn(BATCH, 3, 4, 4)
    graph = trace(model, x, rules=rules)
    policy = policy_from_assignment(graph, {tid: LOW for tid in graph.assignable_ids()
                                            if graph.tensors[tid].kind == "activation"})
    sliced = rules is OP_RULES
    results = []
    for options in (False, CompileOptions("aot_eager")):
        wrapped = apply_policy(copy.deepcopy(model), policy, x, rules=rules, compile=options)
        sites = {op_sites.op: op_sites for op_sites in wrapped.sites.ops}
        assert (sites["conv"].reads_codes, sites["relu"].relu_output) == (sliced, sliced)
        if options:
            code = wrapped.compiled_step.graph.graph_module.code
            assert ("_conv_of_codes" in code, "_relu_masked_by_its_site" in code) == (sliced, sliced)
        else:
            calls = {type(module).__name__ for module in vars(wrapped)["_target"].modules()}
            assert ("PackedInputCall" in calls, "PackedOutputRelu" in calls) == (sliced, sliced)
        output = wrapped(x)
        output.square().sum().backward()
        results.append([output.detach(), *(param.grad for param in wrapped.module.parameters())])
    eager, compiled = results
    assert all(torch.equal(a, b) for a, b in zip(eager, compiled, strict=True))


class TransposedNet(Net):
    """Net reading the ReLU's output transposed: its flatten copies the rounded values, which fc saves."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(self.relu(self.shift(self.conv(x))).transpose(2, 3).flatten(1))


def test_an_injected_alias_decision_reaches_the_eager_lowering(monkeypatch):
    """Which layout ops hold a rounded value as it is is the site plan's (``SitePlan.aliases``): the transpose
    and the flatten after the ReLU. With them taken off in an injected plan, the FX lowering, with no edit of
    its own, puts no ``Alias`` after them and saves fc's input, the flatten's copy, as float32 (four bytes a
    value, not one); with them, as the ReLU's codes. The output and every gradient agree bit for bit."""
    torch.manual_seed(0)
    model, x = TransposedNet(), torch.randn(BATCH, 3, 4, 4)
    graph = trace(model, x)
    policy = policy_from_assignment(graph, {tid: LOW for tid in graph.assignable_ids()
                                            if graph.tensors[tid].kind == "activation"})
    planned, results = runtime_model.plan_sites, []
    for keep in (True, False):
        def injected(*args, keep=keep, **kwargs):
            plan = planned(*args, **kwargs)
            return SitePlan(plan.ops, plan.weights, plan.aliases if keep else ())

        monkeypatch.setattr(runtime_model, "plan_sites", injected)
        wrapped = apply_policy(copy.deepcopy(model), policy, x)
        aliases = [AliasSite("transpose", "relu", ((0, 0),)), AliasSite("flatten", "relu", ((0, 0),))]
        assert list(wrapped.sites.aliases) == (aliases if keep else [])
        calls = [type(module).__name__ for module in vars(wrapped)["_target"].modules()]
        assert calls.count("Alias") == (2 if keep else 0)
        output = wrapped(x)
        results.append([wrapped.saved_bytes().activation, output.detach()])
        output.square().sum().backward()
        results[-1] += [param.grad for param in wrapped.module.parameters()]
    (kept_bytes, *kept), (float_bytes, *floats) = results
    assert float_bytes - kept_bytes == 3 * SHIFT_NUMEL
    assert all(torch.equal(a, b) for a, b in zip(kept, floats, strict=True))


def test_one_runtime_compiles_a_step_of_its_own_for_each_rule_table():
    """The compiled graphs one runtime keeps are keyed by the op rules and the site plan too, not by the tensors
    alone: after a step compiled under the table's rules, the same model under a table without sliced backwards
    gets its own step, whose convolution reads no codes (the case the parametrized test above meets only when
    its cases run in this order)."""
    torch.manual_seed(0)
    model, x = TraceableNet(), torch.randn(BATCH, 3, 4, 4)
    runtime = Runtime(default_runtime().kernels)
    steps = []
    for rules in (OP_RULES, NOT_SLICED):
        graph = trace(model, x, rules=rules)
        policy = policy_from_assignment(graph, {tid: LOW for tid in graph.assignable_ids()
                                                if graph.tensors[tid].kind == "activation"})
        wrapped = apply_policy(copy.deepcopy(model), policy, x, rules=rules, compile=CompileOptions("aot_eager"),
                               runtime=runtime)
        wrapped(x).sum().backward()
        steps.append(wrapped.compiled_step.graph)
    assert steps[0] is not steps[1]
    assert ["_conv_of_codes" in step.graph_module.code for step in steps] == [True, False]
