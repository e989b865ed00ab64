"""The shared vocabulary is defined once (precsearch.config.spec and the schemas beside it: loss_scaling,
optimizer), and the configuration layer stays light."""

from __future__ import annotations

import ast
import dataclasses
import inspect
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from precsearch import models
from precsearch.config import loss_scaling, spec
from precsearch.config.optimizer import OPTIMIZER_KEYS, UpdateConfig
from precsearch.config.policy import Policy
from precsearch.config.spaces import parse_space
from precsearch.cost import model as cost
from precsearch.errors import PrecsearchError
from precsearch.graph.tracing import trace
from precsearch.runtime import scaling
from precsearch.search import strategies

PACKAGE = Path(spec.__file__).parent


def _module_level_names(path: Path) -> set[str]:
    """Names a module binds at its top level by assignment, class or function definition."""
    names: set[str] = set()
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.Assign):
            names |= {target.id for target in node.targets if isinstance(target, ast.Name)}
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            names.add(node.target.id)
        elif isinstance(node, ast.ClassDef | ast.FunctionDef):
            names.add(node.name)
    return names


def test_every_shared_name_is_defined_in_spec_alone():
    defined_elsewhere = {
        str(path.relative_to(PACKAGE)): sorted(_module_level_names(path) & set(spec.__all__))
        for path in PACKAGE.rglob("*.py") if path.name != "spec.py"
    }
    assert {path: names for path, names in defined_elsewhere.items() if names} == {}
    assert set(spec.__all__) <= _module_level_names(PACKAGE / "spec.py")


def test_the_validators_that_spaces_and_policies_once_each_had_are_gone_from_both():
    twins = {"_choice", "_loss_scaling", "_optimizer", "_unknown", "_number", "kinds_list"}
    for module in ("spaces.py", "policy.py"):
        assert _module_level_names(PACKAGE / module) & twins == set(), module


def test_a_policys_optimizer_settings_are_the_update_configs_less_the_policys_own_fields():
    assert OPTIMIZER_KEYS == ("update", "state_format", "compensation_format", "seed")
    assert {field.name for field in dataclasses.fields(UpdateConfig)} == {*OPTIMIZER_KEYS, "weight_format",
                                                                         "master_weights"}


def test_every_loss_scaling_mode_has_one_scaler_that_takes_exactly_its_options():
    assert loss_scaling.LOSS_SCALING_MODES == ("none", "static", "dynamic", "adaptive")
    assert set(scaling.SCALERS) == set(loss_scaling.LOSS_SCALING_MODES)
    for mode, options in loss_scaling.OPTIONS.items():
        parameters = inspect.signature(scaling.SCALERS[mode]).parameters
        assert set(parameters) - {"overflow_check"} == set(options), mode
        defaults = {name: p.default for name, p in parameters.items() if p.default is not inspect.Parameter.empty}
        assert {k: v for k, v in options.items() if v is not loss_scaling.REQUIRED} == {
            k: v for k, v in defaults.items() if k != "overflow_check"}, mode


@pytest.mark.parametrize("module", ["precsearch.analysis.report", "precsearch.config.spaces", "precsearch.config.spec"])
def test_configuration_modules_load_neither_the_runtime_nor_the_model_zoo(module):
    probe = (f"import sys, {module}; "
             "print(sorted(n for n in sys.modules if n.startswith(('precsearch.runtime.model', 'precsearch.models', "
             "'precsearch.train.proxy', 'precsearch.train.data'))))")
    loaded = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True).stdout
    assert loaded.strip() == "[]"


# ------------------------------------------------------------------ one set of validators and defaults

SPACE = {"high": "e6m9s", "low": "e4m3b4s"}


def test_a_space_and_a_policy_without_the_shared_keys_read_their_documented_defaults():
    space = parse_space(SPACE)
    policy = Policy.from_dict({"schema_version": 1})
    assert (space.loss_scaling, space.master_weights) == ({"mode": "dynamic", "init_scale": 65536.0}, False)
    assert (policy.loss_scaling, policy.master_weights) == ({"mode": "none"}, True)
    assert space.loss_scaling == dict(spec.SPACE_DEFAULTS.loss_scaling)
    assert policy.loss_scaling == dict(spec.POLICY_DEFAULTS.loss_scaling)
    # an entry without a mode takes its layer's default mode
    assert parse_space({**SPACE, "loss_scaling": {"init_scale": 8}}).loss_scaling["mode"] == "dynamic"
    assert Policy.from_dict({"schema_version": 1, "loss_scaling": {}}).loss_scaling == {"mode": "none"}


@pytest.mark.parametrize("key, value", [
    ("loss_scaling", {"mode": "magic"}),
    ("loss_scaling", {"mode": "dynamic", "init_scal": 2}),
    ("loss_scaling", {"mode": "dynamic", "growth_interval": "week"}),
    ("loss_scaling", {"mode": "dynamic", "init_scale": "big"}),
    ("loss_scaling", {"mode": "adaptive", "grad_format": "e9m9"}),
    ("loss_scaling", {"mode": "static", "scale": 1024}),
    ("loss_scaling", {"mode": "static"}),
    ("loss_scaling", {"mode": "none", "init_scale": 8}),
    ("loss_scaling", {"mode": "dynamic", "backoff_factor": 1.5}),
    ("loss_scaling", {"mode": "dynamic", "growth_factor": 1}),
    ("loss_scaling", {"mode": "dynamic", "growth_interval": 0}),
    ("loss_scaling", {"mode": "adaptive", "underflow_rate": 0.9}),
    ("loss_scaling", ["dynamic"]),
    ("optimizer", {"update": "round"}),
    ("optimizer", {"lr": 0.1}),
    ("optimizer", {"seed": -1}),
    ("optimizer", {"state_format": "fp12"}),
    ("optimizer", "sgd"),
    ("promotion_threshold", 2),
    ("master_weights", "yes"),
    ("ties", "up"),
    ("gradient_rounding", "each"),
    ("promotion_kinds", ["weights"]),
])
def test_spaces_and_policies_refuse_a_bad_shared_setting_with_the_same_one_line_message(key, value):
    with pytest.raises(PrecsearchError) as from_space:
        parse_space({**SPACE, key: value}, where="file.x")
    with pytest.raises(PrecsearchError) as from_policy:
        Policy.from_dict({"schema_version": 1, key: value}, where="file.x")
    assert str(from_space.value) == str(from_policy.value)
    assert str(from_space.value).startswith(f"file.x: {key}") and "\n" not in str(from_space.value)


def test_every_scaled_mode_starts_from_init_scale_and_other_names_are_refused_in_the_users_words():
    for mode in ("static", "dynamic", "adaptive"):
        entry = {"mode": mode, "init_scale": 1024}
        assert Policy(loss_scaling=entry).loss_scaling == entry
        assert scaling.make_scaler(**entry).get_scale() == 1024.0
    with pytest.raises(PrecsearchError) as error:
        Policy(loss_scaling={"mode": "static", "scale": 1024})
    assert str(error.value) == ("policy: loss_scaling: unknown key 'scale' (did you mean init_scale?); allowed keys: "
                                "mode, init_scale, overflow_format")
    with pytest.raises(PrecsearchError) as error:
        scaling.make_scaler("none", init_scale=8.0)
    assert str(error.value) == "loss_scaling: mode none takes no option 'init_scale'; it takes no options"
    with pytest.raises(PrecsearchError, match=r"^loss_scaling: mode static needs init_scale"):
        scaling.make_scaler("static")
    with pytest.raises(PrecsearchError, match=r"^backoff_factor=1.5 must be a number in \(0.0, 1.0\)$"):
        scaling.DynamicLossScaler(backoff_factor=1.5)  # a Python call is held to the file's range, in its words


def test_a_policy_keeps_its_numbers_as_written_and_a_space_hashes_them_canonically():
    data = {"schema_version": 1, "loss_scaling": {"mode": "static", "init_scale": 128}}
    assert '"init_scale": 128,\n' in Policy.from_dict(data).to_json()  # not 128.0
    as_int = parse_space({**SPACE, "loss_scaling": {"mode": "dynamic", "init_scale": 1024, "growth_interval": 10.0}})
    as_float = parse_space({**SPACE, "loss_scaling": {"mode": "dynamic", "init_scale": 1024.0, "growth_interval": 10}})
    assert as_int.fingerprint() == as_float.fingerprint()
    assert as_int.loss_scaling == {"mode": "dynamic", "init_scale": 1024.0, "growth_interval": 10}
    assert type(as_int.loss_scaling["growth_interval"]) is int


# ------------------------------------------------------------------------------------ one low share

def test_low_share_is_the_share_of_elements_held_low_per_row():
    assert cost.low_share([1, 3], [0, 1]) == pytest.approx(0.75)
    assert cost.low_share([1, 3], [[0, 1], [1, 0], [1, 1]]).tolist() == pytest.approx([0.75, 0.25, 1.0])
    assert float(cost.low_share([], [])) == 0.0


def test_every_low_share_of_the_package_is_the_share_of_elements_held_low():
    graph = trace(models.build("tiny_cnn", num_classes=10), torch.zeros(2, 3, 16, 16))
    space = parse_space(SPACE)
    model = cost.CostModel(graph)
    candidate = strategies.paper_assignment(graph, 0.5, space)
    assignable = [info for info in graph.tensors.values() if info.kind in spec.ASSIGNABLE_KINDS]
    held_low = sum(info.numel for info in assignable if candidate.assignment[info.id] != space.high)
    expected = held_low / sum(info.numel for info in assignable)  # counted by hand from the graph
    assert 0 < expected < 1
    assert strategies.low_share(graph, space, candidate.decisions) == pytest.approx(expected)
    assert model.low_share(candidate.assignment) == pytest.approx(expected)
    rows = [[candidate.decisions[f"g{group}"] == "low" for group in range(model.n_groups)], [True] * model.n_groups]
    assert model.ratio_batch(rows).tolist() == pytest.approx([expected, 1.0])


# ---------------------------------------------------------------------------------------- typed tensor ids

@pytest.mark.parametrize("model", ["resnet18", "mobilenet_v2"])
def test_every_tensor_id_of_a_traced_model_reads_back_as_its_kind_and_grad_names_the_graphs_gradient(model):
    graph = trace(models.build(model, num_classes=10), torch.zeros(2, 3, 32, 32))
    kinds = set()
    for tensor_id, info in graph.tensors.items():
        tid = spec.TensorId.parse(tensor_id)
        assert (str(tid), tid.kind, tid.op) == (tensor_id, info.kind, info.op)
        kinds.add(tid.kind)
        if info.kind in ("activation", "weight"):
            gradient = str(tid.grad())
            expected = "activation_grad" if info.kind == "activation" else "weight_grad"
            assert gradient not in graph.tensors or graph.tensors[gradient].kind == expected
            assert graph.nx.has_edge(tensor_id, gradient) == (gradient in graph.tensors)
    assert kinds == set(spec.KINDS)
    # every gradient in the graph is the grad() of the tensor it belongs to
    grads = {str(spec.TensorId.parse(tid).grad()) for tid, info in graph.tensors.items()
             if info.kind in ("activation", "weight")}
    assert {tid for tid, info in graph.tensors.items() if info.kind in spec.GRAD_KINDS} <= grads


@pytest.mark.parametrize("text, fields", [
    ("conv1:activation", ("conv1", "activation", 0, "")),
    ("var_mean:activation1", ("var_mean", "activation", 1, "")),
    ("var_mean:activation_grad1", ("var_mean", "activation_grad", 1, "")),
    ("layer1.0.conv1:weight", ("layer1.0.conv1", "weight", 0, "weight")),
    ("fc:bias_grad", ("fc", "weight_grad", 0, "bias")),
    ("fc:weight_master", ("fc", "master_weight", 0, "weight")),
    ("fc:weight_momentum", ("fc", "optimizer_state", 0, "weight")),
    ("add:layer1.0.conv1.weight", ("add", "weight", 0, "layer1.0.conv1.weight")),
])
def test_a_tensor_id_has_one_string_form(text, fields):
    tid = spec.TensorId.parse(text)
    assert (tid.op, tid.kind, tid.index, tid.param) == fields
    assert str(tid) == text and spec.TensorId(*fields) == tid


def test_grad_keeps_the_output_index_and_forward_undoes_it():
    mean = spec.TensorId.parse("var_mean:activation1")
    assert str(mean.grad()) == "var_mean:activation_grad1" and mean.grad().forward() == mean
    assert str(spec.TensorId.parse("fc:weight_momentum").forward()) == "fc:weight"
    for bad in ("conv1", ":weight", "conv1:"):
        with pytest.raises(ValueError, match="is not op:name"):
            spec.TensorId.parse(bad)
    with pytest.raises(ValueError, match="has no gradient"):
        spec.TensorId.parse("fc:weight_master").grad()
