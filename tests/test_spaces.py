"""Search-space files: the shipped spaces load, say what the papers say, and bad files fail with one line."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from precsearch.config.spaces import load_space, paper_space, parse_space
from precsearch.config.spec import ASSIGNABLE_KINDS, PAPER_HIGH, PAPER_LOW
from precsearch.errors import PrecsearchError
from precsearch.formats.format import get_format
from precsearch.formats.scaled import any_format, get_scaled_format

SPACES = Path(__file__).resolve().parents[1] / "search_spaces"
BASE = {"high": "e6m9s", "low": "e4m3b4s"}


def _error(raw: dict) -> str:
    with pytest.raises(PrecsearchError) as caught:
        parse_space(raw)
    message = str(caught.value)
    assert "\n" not in message
    return message


@pytest.mark.parametrize("path", sorted(SPACES.glob("*.yaml")), ids=lambda p: p.name)
def test_shipped_spaces_load_and_every_level_names_real_formats(path):
    space = load_space(path)
    assert space.name == path.stem
    assert list(space.levels)[:2] == ["high", "low"]
    for level in space.levels.values():
        assert set(level) == set(ASSIGNABLE_KINDS)
        for spec in level.values():
            any_format(spec)
    assert parse_space(space.to_dict()) == space


def test_shipped_set_covers_the_issue():
    assert {p.stem for p in SPACES.glob("*.yaml")} >= {"hfp8", "fp16_mixed", "bf16", "fp8_e4m3_e5m2", "multi_format"}
    assert load_space(SPACES / "multi_format.yaml").granularity == "categorical"


def test_hfp8_is_the_papers_formats():
    # the paper's formats, written out by hand: the YAML file and the package's constants must both say them
    by_hand = {"weight": "e4m3b4s", "activation": "e4m3b4s", "activation_grad": "e5m2s", "weight_grad": "e6m9s"}
    space = load_space(SPACES / "hfp8.yaml")
    assert space.high == PAPER_HIGH == "e6m9s"
    assert space.low == PAPER_LOW == by_hand
    assert (get_format(space.high).exp, get_format(space.high).man) == (6, 9)
    assert get_format(space.low["weight"]).max == 30.0  # (1,4,3), bias +4, no special codes
    assert space.overflow["activation"] == "saturate" and space.overflow["activation_grad"] == "inf"
    assert space.promotion_threshold == 0.01
    # The built-in paper space (used by the demo) is the same search as the file.
    assert paper_space().fingerprint() == space.fingerprint()


def test_fp8_space_is_e4m3_forward_e5m2_backward():
    space = load_space(SPACES / "fp8_e4m3_e5m2.yaml")
    assert space.low["weight"] == space.low["activation"] == "fp8_e4m3fn"
    assert space.low["activation_grad"] == space.low["weight_grad"] == "fp8_e5m2"


def test_scaled_spaces_are_torchaos_tensorwise_recipe_and_ocp_mxfp8():
    fp8 = load_space(SPACES / "fp8_scaled.yaml")
    assert fp8.high == "bf16" and fp8.master_weights
    assert fp8.low == {"weight": "e4m3fn@tensor", "activation": "e4m3fn@tensor", "activation_grad": "e5m2@tensor",
                       "weight_grad": "e5m2@tensor"}
    mx = {kind: get_scaled_format(spec) for kind, spec in load_space(SPACES / "mx.yaml").low.items()}
    assert {fmt.block for fmt in mx.values()} == {32}
    assert {kind: fmt.element.name for kind, fmt in mx.items()} == {
        "weight": "e4m3fn", "activation": "e4m3fn", "activation_grad": "e5m2", "weight_grad": "e5m2"}


@pytest.mark.parametrize(("raw", "needle"), [
    ({"high": "bf16", "low": "e4m3fn@tensr", "master_weights": True},
     r"low: unknown scaled format 'e4m3fn@tensr': use <element>@tensor\[:delayed<N>\]"),
    ({"high": "bf16", "low": "e4m3q", "master_weights": True},
     r"low: unknown float format 'e4m3q'.*; or a scaled format <element>@tensor"),
    ({"high": "e4m3fn@tensor", "low": "e4m3fn@tensor"}, r"high: e4m3fn@tensor is a scaled format.*such as bf16"),
    ({"high": "bf16", "low": "e4m3fn@tensor"}, r"low weight format e4m3fn@tensor is scaled.*master_weights: true"),
    ({"high": "e4m3fn", "low": "e5m2@row", "master_weights": True}, r"every low format is as wide as high"),
    ({"high": "bf16", "low": "e4m3fn@tensor", "master_weights": True, "rounding": "stochastic"},
     r"weight may be e4m3fn@tensor, a scaled format, which rounds to nearest only; set rounding.weight: nearest"),
])
def test_scaled_low_formats_are_checked_in_one_line(raw, needle):
    assert re.search(needle, _error(raw))


def test_low_as_one_spec_and_partial_mapping():
    assert parse_space(BASE).low == dict.fromkeys(ASSIGNABLE_KINDS, "e4m3b4s")
    partial = parse_space({"high": "fp32", "low": {"activation": "fp16"}})
    assert partial.low == {"weight": "fp32", "activation": "fp16", "weight_grad": "fp32", "activation_grad": "fp32"}


def test_categorical_levels_and_choice_defaults():
    choices = {"wide": "fp16", "mixed": {"weight": "e5m2"}}
    space = parse_space({**BASE, "granularity": "categorical", "choices": choices})
    assert list(space.levels) == ["high", "low", "wide", "mixed"]
    assert space.levels["wide"] == dict.fromkeys(ASSIGNABLE_KINDS, "fp16")
    assert space.levels["mixed"]["weight"] == "e5m2" and space.levels["mixed"]["activation"] == "e6m9s"
    assert list(parse_space(BASE).levels) == ["high", "low"]


def test_with_proxy_overrides_only_given_values():
    space = parse_space({**BASE, "proxy": {"steps": 30, "lr": 0.3}})
    changed = space.with_proxy(steps=5, batch_size=None)
    assert (changed.proxy.steps, changed.proxy.lr, changed.proxy.batch_size) == (5, 0.3, space.proxy.batch_size)
    assert changed.fingerprint() != space.fingerprint()
    assert space.with_proxy(steps=None) is space


def test_unknown_keys_list_the_allowed_ones():
    message = _error({**BASE, "granularty": "group"})
    assert "'granularty'" in message and "did you mean granularity" in message and "objectives" in message
    assert "activation_grad" in _error({"high": "e6m9s", "low": {"weights": "e4m3"}})
    assert "batch_size" in _error({**BASE, "proxy": {"step": 10}})
    assert "init_scale" in _error({**BASE, "loss_scaling": {"mode": "dynamic", "scale_init": 2}})
    assert "state_format" in _error({**BASE, "optimizer": {"updates": "nearest"}})


def test_impossible_formats_name_the_grammar_or_the_names():
    assert "E must be in 1..8" in _error({"high": "e6m9s", "low": "e9m3"})
    message = _error({"high": "fp12", "low": "e4m3"})
    assert "fp8_e4m3fn" in message and "e<E>m<M>" in message
    assert "range" in _error({"high": "e6m9s", "low": "e8m3b200"})  # leaves float32's range


@pytest.mark.parametrize("raw, needle", [
    ({"low": "e4m3"}, "high"),
    ({**BASE, "granularity": "layer"}, "group, tensor, categorical"),
    ({**BASE, "choices": {"a": "fp16"}}, "only to granularity categorical"),
    ({**BASE, "granularity": "categorical"}, "needs choices"),
    ({**BASE, "granularity": "categorical", "choices": {"low": "fp16"}}, "identifier other than"),
    ({**BASE, "rounding": "upward"}, "nearest, stochastic"),
    ({**BASE, "overflow": {"weight": "wrap"}}, "inf, saturate, nan"),
    ({**BASE, "loss_scaling": "auto"}, "none, static, dynamic, adaptive"),
    ({**BASE, "loss_scaling": {"mode": "static"}}, "scale"),
    ({**BASE, "promotion_threshold": 0}, "(0, 1]"),
    ({**BASE, "master_weights": "yes"}, "true or false"),
    ({**BASE, "optimizer": {"update": "kahan"}, "master_weights": True}, "kahan"),
    ({**BASE, "objectives": ["accuracy"]}, "[memory, val_error]"),
    ({**BASE, "proxy": {"steps": 0}}, "proxy.steps"),
    ({**BASE, "proxy": {"lr": "fast"}}, "proxy.lr"),
    ([1, 2], "mapping"),
])
def test_bad_values_raise_one_line(raw, needle):
    assert needle in _error(raw)


def test_load_space_errors(tmp_path):
    with pytest.raises(PrecsearchError, match="does not exist"):
        load_space(tmp_path / "nope.yaml")
    broken = tmp_path / "broken.yaml"
    broken.write_text("high: [e6m9s\nlow: e4m3\n")
    with pytest.raises(PrecsearchError, match=r"broken.yaml:2: expected ',' or '\]'") as caught:
        load_space(broken)
    assert "\n" not in str(caught.value) and "<unicode string>" not in str(caught.value)
    odd = tmp_path / "odd.yaml"
    odd.write_text("high: e6m9s\nlow: e4m3b4s\nsamplr: tpe\n")
    with pytest.raises(PrecsearchError, match=r"odd.yaml: unknown key 'samplr' \(did you mean sampler\?\)"):
        load_space(odd)
