"""Every user file comes in through one reader whose limits are checked before the work they bound (issue: trust
boundaries): size, nesting, YAML aliases, integer digits; and a space or a policy that reads but means nothing
(an empty policy, a level no search should offer, an empty description) is refused or read as what it says."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import yaml

from precsearch.config.policy import Policy
from precsearch.config.reading import MAX_BYTES, MAX_DEPTH, MAX_INT_DIGITS, MAX_VALUES, parse_json, parse_yaml
from precsearch.config.spaces import PAPER_SPACE, load_space, parse_space
from precsearch.errors import PrecsearchError

SPACE = "high: e6m9s\nlow: e4m3b4s\n"
MIB = 2**20


def _refusal(load, path: Path) -> str:
    """The one-line message ``load(path)`` refuses the file with."""
    with pytest.raises(PrecsearchError) as caught:
        load(path)
    message = str(caught.value)
    assert "\n" not in message and str(path) in message
    return message


def _laughs(levels: int) -> str:
    """A space whose description is the billion laughs: each anchor nine aliases of the one before, 9**levels
    strings in all."""
    lines = ['  l0: &l0 ["lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol"]']
    lines += [f"  l{i}: &l{i} [{', '.join([f'*l{i - 1}'] * 9)}]" for i in range(1, levels)]
    return SPACE + "description:\n" + "\n".join(lines) + "\n"


def _nested_keys(count: int) -> str:
    """A space whose description is ``count`` mappings, each indented one space under the one before."""
    return SPACE + "description:\n" + "".join(" " * depth + f"k{depth}:\n" for depth in range(1, count + 1))


def _policy_text(**changes) -> str:
    return json.dumps({**Policy(input_shape=(3, 8, 8), batch_size=8).to_dict(), **changes})


# Hostile files: (name, text or the size of a sparse file, the phrase the refusal holds). Each must be refused before
# the work it would cost: the CLI tests below run them, and measure the time and memory.
HOSTILE = [
    ("laughs.yaml", _laughs(9), f"over {MAX_VALUES:,} values once its aliases are expanded"),
    ("lists.yaml", SPACE + "description: " + "[" * 20_000 + "]" * 20_000 + "\n",
     f"lists and mappings nested over {MAX_DEPTH} deep"),
    ("keys.yaml", _nested_keys(2_000), f"lists and mappings nested over {MAX_DEPTH} deep"),
    ("arrays.json", '{"schema_version": 1, "predicted": ' + "[" * 100_000 + "]" * 100_000 + "}",
     f"arrays and objects nested over {MAX_DEPTH} deep"),
    ("widest.json", "[" * (MAX_BYTES // 2) + "]" * (MAX_BYTES // 2), f"nested over {MAX_DEPTH} deep"),
    ("huge.json", 300 * MIB, "is 314,572,800 bytes, over the 4 MiB limit of a configuration file; check it is the "
                             "right file (a policy is a few KB)"),
    ("huge.yaml", 300 * MIB, "is 314,572,800 bytes, over the 4 MiB limit"),
    ("over.json", MAX_BYTES + 1, f"is {MAX_BYTES + 1:,} bytes, over the 4 MiB limit"),
]


def _write_hostile(folder: Path, name: str, content: str | int) -> Path:
    path = folder / name
    if isinstance(content, int):
        with path.open("wb") as file:
            file.truncate(content)  # sparse: the size is on record, the disk holds nothing
    else:
        path.write_text(content)
    return path


def test_the_refusals_say_the_line_where_the_limit_is_passed(tmp_path):
    # l0..l3 expand to 10 + 91 + 820 + 7,381 values: the first alias in l4 (line 8) passes 10,000
    assert f"laughs.yaml:8: over {MAX_VALUES:,}" in _refusal(load_space, _write_hostile(tmp_path, "laughs.yaml",
                                                                                      _laughs(9)))
    # the mapping of k1 (line 4) is the 2nd level, that of k64 (line 67) the 65th
    assert f"keys.yaml:67: lists and mappings nested over {MAX_DEPTH} deep" in _refusal(load_space, _write_hostile(
        tmp_path, "keys.yaml", _nested_keys(MAX_DEPTH + 5)))
    text = '{\n"schema_version": 1,\n"predicted": {"a":\n' + "[" * MAX_DEPTH + "\n" + "]" * MAX_DEPTH + "}}"
    assert "arrays.json:4: arrays" in _refusal(Policy.load, _write_hostile(tmp_path, "arrays.json", text))


def test_nesting_up_to_the_limit_reads_and_brackets_in_strings_do_not_nest(tmp_path):
    deepest: list = []
    for _ in range(MAX_DEPTH - 1):
        deepest = [deepest]
    brackets = "[" * MAX_DEPTH + "]" * MAX_DEPTH
    assert parse_yaml(brackets, "x") == parse_json(brackets, "x", "fix") == deepest
    with pytest.raises(PrecsearchError, match=f"^x:1: lists and mappings nested over {MAX_DEPTH} deep"):
        parse_yaml(f"[{brackets}]", "x")
    with pytest.raises(PrecsearchError, match=f"^x:1: arrays and objects nested over {MAX_DEPTH} deep"):
        parse_json(f"[{brackets}]", "x", "fix")
    nested = {"a": [[[[1]]]], "note": "[" * 500 + "{" * 500 + '\\"['}
    path = tmp_path / "p.json"
    path.write_text(_policy_text(provenance=nested))
    assert Policy.load(path).provenance == nested


def test_aliases_within_the_limits_read_and_expanding_past_them_is_refused(tmp_path):
    merged = tmp_path / "merged.yaml"
    merged.write_text("high: e6m9s\nlow: &forward {weight: e4m3b4s, activation: e4m3b4s}\ngranularity: categorical\n"
                      "choices:\n  fp12: {<<: *forward, activation: e5m6s}\n")
    assert load_space(merged).levels["fp12"] == {"weight": "e4m3b4s", "activation": "e5m6s", "weight_grad": "e6m9s",
                                                 "activation_grad": "e6m9s"}
    # each anchor a list 40 deep holding the one before: 80 deep once expanded, from 40 written
    deep = tmp_path / "deep.yaml"
    deep.write_text(SPACE + "description:\n  a: &a " + "[" * 40 + "1" + "]" * 40 + "\n  b: " + "[" * 40 + "*a"
                    + "]" * 40 + "\n")
    assert f"deep.yaml:5: alias *a nests lists and mappings over {MAX_DEPTH} deep" in _refusal(load_space, deep)
    itself = tmp_path / "itself.yaml"
    itself.write_text(SPACE + "description: &me [1, *me]\n")
    assert "itself.yaml:3: alias *me stands inside the &me it names" in _refusal(load_space, itself)


def test_more_values_than_a_configuration_holds_are_refused_without_aliases_too(tmp_path):
    path = tmp_path / "long.yaml"
    path.write_text(SPACE + "description: [" + ", ".join(["1"] * MAX_VALUES) + "]\n")
    assert f"over {MAX_VALUES:,} values" in _refusal(load_space, path)


def test_a_long_integer_is_refused_in_one_line_before_python_converts_it(tmp_path):
    policy = tmp_path / "digits.json"
    policy.write_text(_policy_text().replace('"batch_size": 8', '"batch_size": ' + "9" * 5_000))
    assert f"an integer of 5000 digits (999999999999...; over {MAX_INT_DIGITS})" in _refusal(Policy.load, policy)
    space = tmp_path / "digits.yaml"
    space.write_text(SPACE + "proxy: {steps: " + "9" * 5_000 + "}\n")
    assert f"digits.yaml:3: an integer of 5000 digits (over {MAX_INT_DIGITS})" in _refusal(load_space, space)
    fits = tmp_path / "fits.json"
    fits.write_text(_policy_text(provenance={"big": 10**99}))  # 100 digits: the limit exactly
    assert Policy.load(fits).provenance == {"big": 10**99}


def test_a_policy_file_holds_every_field_policy_save_writes(tmp_path):
    empty = tmp_path / "empty.json"
    empty.write_text('{"schema_version": 1}')
    message = _refusal(Policy.load, empty)
    assert "missing required fields model, graph_fingerprint, input_shape, batch_size, defaults" in message
    assert "write it with Policy.save" in message
    data = json.loads(_policy_text())
    del data["loss_scaling"]
    part = tmp_path / "part.json"
    part.write_text(json.dumps(data))
    assert _refusal(Policy.load, part).endswith(f"policy {part}: missing required fields loss_scaling (a policy file "
                                                "states every setting rather than leave it to a default); write it "
                                                "with Policy.save")
    saved = Policy(input_shape=(3, 8, 8), batch_size=8, defaults={"weight": "e5m2s"}).save(tmp_path / "saved.json")
    assert Policy.load(saved).defaults == {"weight": "e5m2s"}  # the optional fields left out by save still read


def test_every_way_a_policy_file_cannot_be_read_is_a_precsearch_error(tmp_path):
    assert _refusal(Policy.load, tmp_path / "none.json").endswith(
        "none.json does not exist; give a policy file that Policy.save wrote")
    (tmp_path / "folder.json").mkdir()
    assert "folder.json is a folder" in _refusal(Policy.load, tmp_path / "folder.json")
    latin = tmp_path / "latin.json"
    text = _policy_text(model="cafe")
    latin.write_bytes(text.replace("cafe", "caf\u00e9").encode("latin-1"))  # one byte 0xe9: not UTF-8
    assert f"latin.json: not a text file (byte {text.index('cafe') + 3} is not UTF-8; corrupted?)" in _refusal(
        Policy.load, latin)
    cut = tmp_path / "cut.json"
    cut.write_text('{"model": "tiny')
    message = _refusal(Policy.load, cut)
    assert "(Unterminated string starting at line 1 column 11)" in message and "at at" not in message


@pytest.mark.skipif(os.geteuid() == 0, reason="root reads any file")
def test_an_unreadable_policy_file_is_a_precsearch_error(tmp_path):
    path = tmp_path / "secret.json"
    path.write_text(_policy_text())
    path.chmod(0)
    assert "cannot read policy" in _refusal(Policy.load, path)


def test_a_byte_order_mark_is_read_past(tmp_path):
    policy = Policy(input_shape=(3, 8, 8), batch_size=8, defaults={"weight": "e5m2s"})
    path = tmp_path / "bom.json"
    path.write_bytes(b"\xef\xbb\xbf" + policy.to_json().encode())
    assert Policy.load(path) == policy
    space = tmp_path / "bom.yaml"
    space.write_bytes(b"\xef\xbb\xbf" + SPACE.encode())
    assert load_space(space) == parse_space(yaml.safe_load(SPACE))


BASE = {"high": "e6m9s", "low": "e4m3b4s", "granularity": "categorical"}


@pytest.mark.parametrize(("choices", "message"), [
    ({"wide": "fp32"}, "choices.wide.weight fp32 (32 bits) is wider than high e6m9s (16 bits); give a format at most "
                       "as wide as the high one"),
    ({"mixed": {"activation_grad": "fp32"}}, "choices.mixed.activation_grad fp32 (32 bits) is wider than high e6m9s "
                                             "(16 bits); give a format at most as wide as the high one"),
    ({"same": "e4m3b4s"}, "choices.same gives every kind the format level low gives; drop it or change a format"),
    ({"top": "e6m9s"}, "choices.top gives every kind the format level high gives; drop it or change a format"),
    ({"top": {"weight": "e6m9s"}}, "choices.top gives every kind the format level high gives; drop it or change a "
                                   "format"),
    ({"a": "fp16", "b": "e5m10"}, "choices.b gives every kind the format level a gives; drop it or change a format"),
])
def test_a_categorical_level_wider_than_high_or_equal_to_another_is_refused(choices, message):
    with pytest.raises(PrecsearchError) as caught:
        parse_space({**BASE, "choices": choices}, where="s.yaml")
    assert str(caught.value) == f"s.yaml: {message}"


def test_levels_as_wide_as_high_but_different_are_still_offered():
    space = parse_space({**BASE, "choices": {"half": "fp16", "mixed": {"weight": "e5m2"}}})
    assert list(space.levels) == ["high", "low", "half", "mixed"]


def test_an_empty_description_is_no_description_and_one_that_is_not_text_is_refused(tmp_path):
    path = tmp_path / "empty.yaml"
    path.write_text(SPACE + "description:\n")
    assert load_space(path).description == ""
    assert parse_space({**PAPER_SPACE, "description": "  two words \n"}).description == "two words"
    with pytest.raises(PrecsearchError, match=r"^s: description must be text, not list; quote it$"):
        parse_space({**PAPER_SPACE, "description": [1, 2]}, where="s")


# ------------------------------------------------------------------------------------------ through the CLI

SENSITIVITY = ["sensitivity", "tiny_cnn", "--out", "{tmp}/s", "--image-size", "8", "--device", "cpu", "--threads", "1",
               "--space"]
TRAIN = ["train", "tiny_cnn", "--image-size", "8", "--device", "cpu", "--threads", "1", "--metrics", "{tmp}/m.csv",
         "--policy"]


def _argv(name: str, path: Path, tmp_path: Path) -> list[str]:
    """The command that reads ``path``: a space through sensitivity, a policy through train."""
    command = SENSITIVITY if name.endswith(".yaml") else TRAIN
    return [part.format(tmp=tmp_path) for part in command] + [str(path)]


@pytest.mark.parametrize(("name", "content", "phrase"), [pytest.param(*row, id=row[0]) for row in [
    *HOSTILE,
    ("empty.json", '{"schema_version": 1}', "missing required fields model, graph_fingerprint"),
    ("digits.json", _policy_text().replace('"batch_size": 8', '"batch_size": ' + "9" * 5_000),
     "an integer of 5000 digits"),
    ("wide.yaml", SPACE + "granularity: categorical\nchoices: {wide: fp32}\n", "choices.wide.weight fp32 (32 bits)"),
    ("cut.json", '{"model": "tiny', "Unterminated string starting at line 1 column 11"),
]])
def test_the_cli_refuses_a_bad_file_in_one_line_with_exit_2_and_writes_nothing(tmp_path, name, content, phrase,
                                                                            capsys):
    from precsearch.cli import main

    argv = _argv(name, _write_hostile(tmp_path, name, content), tmp_path)
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"precsearch {argv[0]}: error: ") and phrase in lines[0]
    assert sorted(path.name for path in tmp_path.iterdir()) == [name]


CHILD = textwrap.dedent("""
    import contextlib, io, json, re, sys, time
    from precsearch.cli import main

    results = []
    for argv in json.loads(sys.argv[1]):
        err = io.StringIO()
        start = time.perf_counter()
        with contextlib.redirect_stderr(err):
            code = main(argv)
        seconds = time.perf_counter() - start
        with open("/proc/self/status") as status:
            peak_kb = int(re.search(r"VmHWM:\\s+(\\d+) kB", status.read()).group(1))
        results.append({"code": code, "seconds": seconds, "peak_kb": peak_kb, "err": err.getvalue()})
    print(json.dumps(results))
    """)


@pytest.mark.slow  # a child process that imports torch: 13 s on 2 cores
@pytest.mark.skipif(not Path("/proc/self/status").is_file(), reason="reads the peak memory from /proc")
def test_the_cli_refuses_each_hostile_file_in_under_2_s_and_200_mb(tmp_path):
    """Time and memory, measured in a child process. The CLI imports torch (about 400 MB resident) before it reads
    any file, so the child first runs each command on a tiny bad file (every import done, the warm baseline), then
    each hostile file: each refusal must take under 2 s of wall time, and the child's peak resident memory (VmHWM)
    must stay within 200 MB of the baseline over all of them (the peak is a maximum over the process's life)."""
    warm = [_argv("warm.yaml", _write_hostile(tmp_path, "warm.yaml", "[1]\n"), tmp_path),
            _argv("warm.json", _write_hostile(tmp_path, "warm.json", "{}"), tmp_path)]
    hostile = [_argv(name, _write_hostile(tmp_path, name, content), tmp_path) for name, content, _ in HOSTILE]
    done = subprocess.run([sys.executable, "-c", CHILD, json.dumps(warm + hostile)], capture_output=True, text=True,
                          timeout=300, check=True)
    results = json.loads(done.stdout)
    baseline_kb = results[len(warm) - 1]["peak_kb"]
    for (name, _, phrase), result in zip(HOSTILE, results[len(warm):], strict=True):
        assert result["code"] == 2 and phrase in result["err"], (name, result["err"])
        assert result["seconds"] < 2.0, (name, result["seconds"])
    assert results[-1]["peak_kb"] - baseline_kb < 200 * 1024, (baseline_kb, [r["peak_kb"] for r in results])
