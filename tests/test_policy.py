"""Policy files: schema, precedence, atomic saves, loading without torch; compact assignments with their prediction
(precsearch.cost.policies) and checks against graphs and models (precsearch.graph.policy_check,
precsearch.analysis.checks)."""

from __future__ import annotations

import dataclasses
import json
import os
import re
import stat
from pathlib import Path

import pytest
import torch

from precsearch.analysis.checks import check_policy_on_model
from precsearch.config import policy as policy_module
from precsearch.config.policy import SCHEMA_VERSION, Accumulation, Policy
from precsearch.config.spec import ASSIGNABLE_KINDS
from precsearch.cost.model import CostModel
from precsearch.cost.policies import policy_from_assignment
from precsearch.errors import PrecsearchError
from precsearch.formats.format import NAMED_FORMATS, get_format
from precsearch.graph.policy_check import check_policy, verify_policy
from precsearch.graph.tracing import trace
from precsearch.models import build

PAPER_LOW = {"weight": "e4m3b4s", "activation": "e4m3b4s", "activation_grad": "e5m2s", "weight_grad": "e6m9s"}


@pytest.fixture(scope="module")
def graph():
    return trace(build("tiny_cnn"), torch.zeros(2, 3, 32, 32), batch_size=8)


@pytest.fixture
def policy(graph) -> Policy:
    return Policy(model="tiny_cnn", graph_fingerprint=graph.fingerprint(), input_shape=(3, 32, 32), batch_size=8,
                  defaults=dict(PAPER_LOW), overrides={"linear:activation": "fp32", "conv*:weight": "fp16"},
                  module_types={"BatchNorm2d": {"weight": "bf16"}}, high_format="fp32",
                  rounding={"weight_grad": "stochastic"}, overflow={"activation_grad": "inf"},
                  loss_scaling={"mode": "dynamic", "init_scale": 1024.0}, provenance={"strategy": "test"})


# ------------------------------------------------------------------------------------------ resolution


def test_precedence_exact_then_longest_glob_then_module_type_then_default(graph):
    policy = Policy(
        defaults={"weight": "e5m2s", "activation": "e4m3b4s"},
        overrides={"conv1:weight": "fp32", "conv*": "fp16", "conv*:weight": "bf16", "*:weight": "e3m4s"},
        module_types={"Conv2d": {"weight": "e6m9s"}, "BatchNorm2d": {"weight": "e2m5s"}},
    )
    fmt = {tid: policy.explain(graph.tensors[tid]) for tid in graph.tensors
           if graph.tensors[tid].kind in ASSIGNABLE_KINDS}
    assert fmt["conv1:weight"] == ("fp32", "override 'conv1:weight'")  # exact beats every glob
    assert fmt["conv2:weight"] == ("bf16", "override 'conv*:weight'")  # longest matching glob wins
    assert fmt["conv2:activation"] == ("fp16", "override 'conv*'")
    assert fmt["bn1:weight"] == ("e3m4s", "override '*:weight'")  # a glob beats the module type rule
    assert fmt["bn1:bias"] == ("e2m5s", "module type BatchNorm2d")  # a bias is of kind weight too
    assert fmt["linear:bias"] == ("e5m2s", "default for weight")
    assert fmt["relu1:activation"] == ("e4m3b4s", "default for activation")
    assert fmt["relu1:activation_grad"] == ("fp32", "no rule")


def test_module_type_rule_beats_default(graph):
    policy = Policy(defaults={"weight": "e5m2s"}, module_types={"BatchNorm2d": {"weight": "bf16"}})
    assert policy.format_for(graph.tensors["bn1:weight"]) == "bf16"
    assert policy.format_for(graph.tensors["conv1:weight"]) == "e5m2s"
    # master copies and momentum are not assigned: fp32, or the optimizer's state format
    assert policy.format_for(graph.tensors["conv1:weight_master"]) == "fp32"
    with_state = Policy(defaults={"weight": "e5m2s"}, optimizer={"state_format": "bf16"})
    assert with_state.format_for(graph.tensors["conv1:weight_momentum"]) == "bf16"


def test_from_assignment_reproduces_the_assignment_compactly(graph):
    ids = graph.assignable_ids()
    assignment = {tid: PAPER_LOW[graph.tensors[tid].kind] for tid in ids}
    assignment["conv2:weight"] = "e6m9s"
    assignment["pool1:activation_grad"] = "fp16"
    policy = policy_from_assignment(graph, assignment, provenance={"strategy": "unit"})
    assert policy.assignment(graph) == assignment
    assert policy.overrides == {"conv2:weight": "e6m9s", "pool1:activation_grad": "fp16"}
    assert policy.defaults == PAPER_LOW
    assert policy.graph_fingerprint == graph.fingerprint() and policy.batch_size == 8
    cost = CostModel(graph)
    assert policy.predicted["bytes"] == int(cost.bytes(assignment))
    assert policy.predicted["saved_activation_bytes"] == cost.saved_activation_bytes(assignment)


def test_from_assignment_rejects_ids_of_another_graph(graph):
    with pytest.raises(PrecsearchError, match="graph lacks.*'layer1.0.conv1:weight'"):
        policy_from_assignment(graph, {"layer1.0.conv1:weight": "fp16"})


# ---------------------------------------------------------------------------------------------- check


def test_check_reports_missing_rules_and_uncovered_tensors_by_name(graph):
    policy = Policy(defaults={"weight": "e5m2s", "activation": "e5m2s", "weight_grad": "e6m9s"},
                    overrides={"conv9:weight": "fp16", "layer*:activation": "fp16", "relu1:activation_grad": "fp16"},
                    module_types={"GELU": {"activation": "bf16"}})
    report = check_policy(policy, graph)
    assert report.missing == ["override 'conv9:weight'", "override 'layer*:activation'", "module type 'GELU'"]
    expected = [tid for tid in graph.assignable_ids()
                if graph.tensors[tid].kind == "activation_grad" and tid != "relu1:activation_grad"]
    assert report.uncovered == expected
    assert not report.ok and "conv9:weight" in report.summary() and "conv1:activation_grad" in report.summary()


def test_check_traces_a_model_from_the_policy_input_shape(policy):
    report = check_policy_on_model(policy, build("tiny_cnn"))
    assert report.fingerprint_matches and report.uncovered == []
    assert report.missing == []


def test_policy_for_another_model_is_refused_unless_not_strict(policy):
    other = trace(build("tiny_cnn", width=0.5), torch.zeros(2, 3, 32, 32), batch_size=8)
    with pytest.raises(PrecsearchError, match=r"policy was made for tiny_cnn \(graph [0-9a-f]+\).*strict=False"):
        verify_policy(policy, other)
    report = verify_policy(policy, other, strict=False)
    assert not report.fingerprint_matches


# ---------------------------------------------------------------------------------------------- files


def test_save_load_round_trip_is_sorted_versioned_and_lists_formats(policy, tmp_path):
    path = policy.save(tmp_path / "p.json")
    text = path.read_text()
    data = json.loads(text)
    assert list(data) == sorted(data) and data["schema_version"] == 1  # no scaled format: readable by older ones
    assert text == json.dumps(data, indent=2, sort_keys=True) + "\n"
    assert '    "conv*:weight": "fp16",\n' in text  # one override per line: diffs stay readable
    fmt = get_format("e4m3b4s")
    assert data["formats"]["e4m3b4s"] == {"bits": 8, "exp": 4, "man": 3, "bias": fmt.bias, "special": "none",
                                          "max": 30.0, "min_subnormal": 2.0**-13}
    assert set(data["formats"]) == {"e4m3b4s", "e5m2s", "e6m9s", "fp16", "fp32", "bf16"}
    loaded = Policy.load(path)
    assert loaded == policy
    assert loaded.input_shape == (3, 32, 32)
    assert loaded.loss_scaling == {"mode": "dynamic", "init_scale": 1024.0}


SCALED = {"weight": "e4m3fn@tensor", "activation": "E4M3FN@tensor:delayed16", "activation_grad": "e5m2@row",
          "weight_grad": "e2m1fn@block32"}


def test_scaled_formats_round_trip_under_schema_version_2_and_an_older_precsearch_refuses_them(policy, tmp_path,
                                                                                               monkeypatch):
    scaled = policy.replace(defaults=SCALED, overrides={"conv1:weight": "e5m2@tensor"})
    assert scaled.defaults["activation"] == "e4m3fn@tensor:delayed16"  # normalized like plain names
    path = scaled.save(tmp_path / "scaled.json")
    data = json.loads(path.read_text())
    assert data["schema_version"] == 2
    assert data["formats"]["e2m1fn@block32"] == {  # OCP's fp4 by hand: max 6, min subnormal 0.5, no NaN code
        "bits": 4, "exp": 2, "man": 1, "bias": 1, "special": "none", "max": 6.0, "min_subnormal": 0.5,
        "element": "fp4_e2m1fn", "granularity": "block", "block": 32, "history": 0}
    assert data["formats"]["e4m3fn@tensor:delayed16"]["history"] == 16
    assert Policy.load(path) == scaled
    # the same file under version 1 is not one an older precsearch could have written: refused, naming the fix
    with pytest.raises(PrecsearchError, match="scaled format .* needs schema_version 2 .*says 1"):
        Policy.load(_edited(scaled, tmp_path, schema_version=1))
    monkeypatch.setattr(policy_module, "SCHEMA_VERSION", 1)  # what a precsearch before scaled formats reads
    with pytest.raises(PrecsearchError, match="schema_version 2 was written by a newer precsearch"):
        Policy.load(path)
    assert Policy.load(policy.save(tmp_path / "plain.json")) == policy  # an unscaled one still loads there


@pytest.mark.parametrize(("changes", "needle"), [
    ({"defaults": {"weight": "e4m3fn@tensr"}}, r"defaults.weight: unknown scaled format 'e4m3fn@tensr': use "
                                               r"<element>@tensor\[:delayed<N>\], <element>@row"),
    ({"overrides": {"conv1:weight": "e4m3fn@block0"}}, r"overrides\['conv1:weight'\]: unknown scaled format"),
    ({"module_types": {"Conv2d": {"weight": "e9m3@row"}}}, r"module_types.Conv2d.weight: scaled format 'e9m3@row': "
                                                           r"format 'e9m3': E must be in 1..8"),
    ({"defaults": {"weight": "e4m3q"}}, r"unknown float format 'e4m3q'.*; or a scaled format <element>@tensor"),
    ({"high_format": "e4m3fn@tensor"}, r"high_format: e4m3fn@tensor is a scaled format.*such as bf16"),
])
def test_bad_scaled_names_are_one_line_naming_the_name_and_the_grammar(policy, changes, needle):
    with pytest.raises(PrecsearchError) as caught:
        policy.replace(**changes)
    assert "\n" not in str(caught.value)
    assert re.search(needle, str(caught.value))


def _write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "bad.json"
    path.write_text(text)
    return path


def _edited(policy: Policy, tmp_path: Path, **changes) -> Path:
    data = policy.to_dict()
    data.update(changes)
    return _write(tmp_path, json.dumps(data))


def test_truncated_and_corrupted_files_are_named(policy, tmp_path):
    text = policy.to_json()
    for broken, what in ((text[: len(text) // 2], "truncated or corrupted"), ("", "empty"),
                         ("{\"schema_version\": 1,,}", "truncated or corrupted")):
        path = _write(tmp_path, broken)
        with pytest.raises(PrecsearchError, match=f"policy {path}: {what} JSON .*line") as info:
            Policy.load(path)
        assert "\n" not in str(info.value)
    binary = tmp_path / "binary.json"
    binary.write_bytes(b"\xff\xfe\x00garbage")
    with pytest.raises(PrecsearchError, match="not a text file"):
        Policy.load(binary)
    with pytest.raises(PrecsearchError, match="expected a JSON object, found list"):
        Policy.load(_write(tmp_path, "[1, 2]"))


def test_unknown_format_lists_the_named_formats_and_the_grammar(policy, tmp_path):
    path = _edited(policy, tmp_path, defaults={"weight": "float7"})
    with pytest.raises(PrecsearchError) as info:
        Policy.load(path)
    message = str(info.value)
    assert message.startswith(f"policy {path}: defaults.weight: ")
    assert all(name in message for name in NAMED_FORMATS) and "e<E>m<M>" in message
    with pytest.raises(PrecsearchError, match=r"overrides\['conv1:weight'\]: format 'e9m2': E must be in 1..8"):
        Policy.load(_edited(policy, tmp_path, overrides={"conv1:weight": "e9m2"}))


def test_newer_schema_unknown_keys_and_wrong_types_are_refused(policy, tmp_path):
    cases = [
        ({"schema_version": SCHEMA_VERSION + 1}, "written by a newer precsearch.*upgrade precsearch"),
        ({"schema_version": "1"}, r"schema_version is '1' \(str\); give an integer, 1 or 2"),
        ({"colour": "blue"}, "unknown key 'colour'; allowed keys: model"),
        ({"batch_size": "8"}, "batch_size must be a positive integer"),
        ({"batch_size": True}, "batch_size must be a positive integer"),
        ({"master_weights": "yes"}, "master_weights must be true or false"),
        ({"defaults": ["fp16"]}, "defaults must be a mapping"),
        ({"defaults": {"weights": "fp16"}}, "unknown tensor kind 'weights'"),
        ({"rounding": {"weight": "up"}}, r"rounding.weight: 'up' is not allowed"),
        ({"overflow": {"activation": "wrap"}}, r"overflow.activation: 'wrap' is not allowed"),
        ({"promotion_threshold": 2}, r"promotion_threshold must be in \(0, 1\]"),
        ({"loss_scaling": {"mode": "magic"}}, r"loss_scaling.mode: 'magic' is not allowed"),
        ({"loss_scaling": {"mode": "dynamic", "init_scal": 2}},
         r"loss_scaling: unknown key 'init_scal' \(did you mean init_scale\?\)"),
        ({"optimizer": {"update": "round"}}, r"optimizer.update: 'round' is not allowed"),
        ({"input_shape": [3, -1]}, "input_shape must be a list of positive integers"),
        ({"formats": {"e4m3b4s": {"bits": 8, "max": 448.0}}}, r"formats.e4m3b4s.max is 448.0 but .* max=30.0"),
    ]
    for changes, pattern in cases:
        path = _edited(policy, tmp_path, **changes)
        with pytest.raises(PrecsearchError, match=pattern) as info:
            Policy.load(path)
        assert str(info.value).startswith(f"policy {path}: ") and "\n" not in str(info.value)


def test_failed_save_leaves_no_file_behind(policy, tmp_path, monkeypatch):
    target = tmp_path / "p.json"
    with pytest.raises(PrecsearchError, match="provenance must hold only JSON data"):
        policy.replace(provenance={"trial": object()})  # not JSON: refused before anything can be saved
    with pytest.raises(dataclasses.FrozenInstanceError):
        policy.provenance = {}  # a frozen policy changes by replace only
    assert list(tmp_path.iterdir()) == []

    policy.save(target)
    before = target.read_bytes()
    policy = policy.replace(provenance={"trial": 7})

    def broken_replace(src, dst):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "replace", broken_replace)
    with pytest.raises(PrecsearchError, match=f"cannot write policy {target}: No space left on device"):
        policy.save(target)
    assert target.read_bytes() == before  # the old file is intact
    assert sorted(p.name for p in tmp_path.iterdir()) == ["p.json"]  # and no temp file is left

    def read_only(*args, **kwargs):  # what creating a file raises in a read-only directory (root is exempt)
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(os, "open", read_only)
    with pytest.raises(PrecsearchError, match="cannot write policy .*: Permission denied; choose a writable path"):
        policy.save(tmp_path / "other.json")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["p.json"]


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into read-only directories")
def test_save_into_read_only_directory(policy, tmp_path):
    folder = tmp_path / "ro"
    folder.mkdir()
    folder.chmod(stat.S_IREAD | stat.S_IEXEC)
    try:
        with pytest.raises(PrecsearchError, match="cannot write policy .*choose a writable path"):
            policy.save(folder / "p.json")
        assert list(folder.iterdir()) == []
    finally:
        folder.chmod(stat.S_IRWXU)


def test_constructing_a_bad_policy_in_code_fails_early():
    with pytest.raises(PrecsearchError, match="policy: high_format: unknown float format 'fp99'"):
        Policy(high_format="fp99")
    with pytest.raises(PrecsearchError, match="optimizer: unknown key 'lr'"):
        Policy(optimizer={"lr": 0.1})


# ---------------------------------------------------------------------------------------- accumulation


def test_accumulation_round_trips_and_a_file_without_it_is_unchanged(policy, tmp_path):
    plain = json.loads(policy.to_json())
    assert "accumulation" not in plain and policy.accumulation is None  # old files read and write as before
    assert Policy.load(_write(tmp_path, json.dumps(plain))).accumulation is None
    chunked = policy.replace(accumulation={"format": "fp16", "chunk": None, "layers": ["conv*"]})
    assert chunked.accumulation == Accumulation("fp16", None, ("conv*",))
    data = json.loads(chunked.save(tmp_path / "p.json").read_text())
    assert data["schema_version"] == 1
    assert data["accumulation"] == {"format": "fp16", "chunk": None, "layers": ["conv*"]}
    assert data["formats"]["fp16"]["man"] == 10  # the accumulation format is listed with the others
    loaded = Policy.load(tmp_path / "p.json")
    assert loaded == chunked and loaded.accumulation.layers == ("conv*",)
    # defaults: Wang et al.'s 16-bit (1,6,9) sums, chunks of 64, every layer
    assert Policy(accumulation={}).accumulation == Accumulation("e6m9s", 64, ("*",))


def test_bad_accumulation_values_are_refused_naming_file_and_field(policy, tmp_path):
    cases = [
        ({"chunk": 0}, "accumulation.chunk must be an integer >= 1, or null"),
        ({"chunk": 2.5}, "accumulation.chunk must be an integer >= 1"),
        ({"chunk": True}, "accumulation.chunk must be an integer >= 1"),
        ({"format": "e9m2"}, "accumulation.format: format 'e9m2': E must be in 1..8"),
        ({"format": 16}, "accumulation.format: a format must be a string"),
        ({"layers": "conv*"}, "accumulation.layers must be a non-empty list of glob patterns"),
        ({"layers": []}, "accumulation.layers must be a non-empty list"),
        ({"chunks": 64}, r"accumulation: unknown key 'chunks' \(did you mean chunk\?\); allowed keys: format, chunk, "
                         "layers"),
    ]
    for value, pattern in cases:
        path = _edited(policy, tmp_path, accumulation=value)
        with pytest.raises(PrecsearchError, match=pattern) as info:
            Policy.load(path)
        assert str(info.value).startswith(f"policy {path}: accumulation") and "\n" not in str(info.value)
    with pytest.raises(PrecsearchError, match="accumulation must be a mapping"):
        Policy.load(_edited(policy, tmp_path, accumulation="e6m9s"))
    with pytest.raises(PrecsearchError, match="^accumulation.chunk must be"):
        Accumulation(chunk=-1)


def test_check_names_accumulation_patterns_that_match_no_layer(graph):
    report = check_policy(Policy(accumulation={"layers": ["conv?", "layer4.*"]}), graph)
    assert report.missing == ["accumulation layers 'layer4.*'"]


def test_the_paper_settings_round_trip_and_files_without_them_read_the_defaults(policy, tmp_path):
    plain = json.loads(policy.to_json())
    assert not {"promotion_kinds", "gradient_rounding", "ties"} & set(plain)  # defaults are not written
    assert (policy.promotion_kinds, policy.gradient_rounding, policy.ties) == (("weight", "activation"), "sum",
                                                                               "even")
    paper = policy.replace(promotion_kinds=["activation_grad", "weight"], gradient_rounding="per_use", ties="away",
                           loss_scaling={"mode": "dynamic", "growth_interval": "epoch"})
    data = json.loads(paper.save(tmp_path / "p.json").read_text())
    assert data["promotion_kinds"] == ["weight", "activation_grad"]  # each kind once, in the order of ASSIGNABLE_KINDS
    assert (data["gradient_rounding"], data["ties"], data["loss_scaling"]["growth_interval"]) == ("per_use", "away",
                                                                                                "epoch")
    assert Policy.load(tmp_path / "p.json") == paper
    cases = [
        ({"ties": "up"}, "ties: 'up' is not allowed; use one of even, away"),
        ({"gradient_rounding": "each"}, "gradient_rounding: 'each' is not allowed; use one of sum, per_use"),
        ({"promotion_kinds": "weight"}, "promotion_kinds must be a list of tensor kinds"),
        ({"promotion_kinds": ["weights"]}, "promotion_kinds: unknown tensor kind 'weights'"),
        ({"rounding": {"weight": "nearest_away"}}, "rounding.weight: 'nearest_away' is not allowed"),
        ({"loss_scaling": {"mode": "dynamic", "growth_interval": "week"}}, "growth_interval='week' must be a whole"),
    ]
    for value, pattern in cases:
        with pytest.raises(PrecsearchError, match=pattern) as info:
            Policy.load(_edited(policy, tmp_path, **value))
        assert "\n" not in str(info.value)
