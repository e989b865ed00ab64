"""Nothing silently wrong: weights clipped at start, rules naming nothing, meaningless picks, untraced code,
file-system errors. Each test is named after the behaviour a defect of issue 16 lacked."""

from __future__ import annotations

import errno
import os
import resource
import subprocess
import sys

import pandas as pd
import pytest
import torch
from torch import nn

from precsearch.analysis.checks import check_policy_on_model
from precsearch.cli import main
from precsearch.config.policy import Policy
from precsearch.errors import PrecsearchError
from precsearch.formats.kernels import quantize
from precsearch.models import build
from precsearch.runtime.model import apply_policy
from precsearch.search.context import Budget
from precsearch.search.selection import choose_best

SHAPE = (3, 8, 8)


def test_pure_low_precision_starting_weights_are_promoted_or_reported_not_silently_clipped(caplog):
    # e4m3b12s holds at most 0.117: most of tiny_cnn's starting weights lie past it
    low = {"weight": "e4m3b12s"}
    torch.manual_seed(0)
    model = build("tiny_cnn")
    original = {name: p.detach().clone() for name, p in model.named_parameters()}
    wrapped = apply_policy(model, Policy(input_shape=SHAPE, batch_size=8, defaults=low, high_format="e6m9s",
                                         master_weights=False, promotion_threshold=0.01))
    promoted = {p.id for p in wrapped.promotions}
    assert "conv1:weight" in promoted and all(p.step == 0 for p in wrapped.promotions)
    for name, param in model.named_parameters():  # a promoted weight was rounded to the high format, unclipped
        if f"{name.rsplit('.', 1)[0]}:{name.rsplit('.', 1)[1]}" in promoted:
            assert torch.equal(param.detach(), quantize(original[name], "e6m9s"))
    caplog.clear()
    torch.manual_seed(0)
    unguarded = apply_policy(build("tiny_cnn"), Policy(input_shape=SHAPE, batch_size=8, defaults=low,
                                                        high_format="e6m9s", master_weights=False,
                                                        promotion_threshold=None))
    assert unguarded.promotions == [] and any(item.startswith("conv1:weight ") for item in unguarded.clipped_at_start)
    assert "clipped values past their format's range" in caplog.text


def test_a_policy_rule_naming_no_tensor_is_an_error_with_the_closest_ids():
    policy = Policy(input_shape=SHAPE, batch_size=8, defaults={"weight": "e5m2s"},
                    overrides={"conv9:activation": "fp16"})
    closest = r"override 'conv9:activation' \(closest: conv2:activation, conv1:activation"
    with pytest.raises(PrecsearchError, match=closest) as error:
        apply_policy(build("tiny_cnn"), policy)
    assert "allow_unmatched_rules" in str(error.value) and "\n" not in str(error.value)
    kinds = Policy(input_shape=SHAPE, batch_size=8, module_types={"Conv2d": {"weight_grad": "fp16"},
                                                                   "Conv2D": {"weight": "fp16"}})
    report = check_policy_on_model(kinds, build("tiny_cnn"))
    assert report.missing == ["module type 'Conv2D'"] and report.hints["module type 'Conv2D'"][0] == "Conv2d"
    allowed = policy.replace(allow_unmatched_rules=True)
    assert apply_policy(build("tiny_cnn"), allowed).formats()["conv1:weight"] == "e5m2s"
    assert Policy.from_dict(allowed.to_dict()).allow_unmatched_rules


def _frame(rows):
    base = {"state": "COMPLETE", "trained": True, "diverged": False, "memory": 1.0, "val_accuracy": 0.5}
    return pd.DataFrame([{**base, "number": number, "key": f"k{number}", **row} for number, row in enumerate(rows)])


def test_no_pick_when_the_reference_diverged_or_everything_is_at_chance_level():
    frame = _frame([{"diverged": True, "val_accuracy": 0.097},  # all-high diverged
                    {"memory": 0.3, "val_accuracy": 0.100}])  # all-low: learned nothing
    assert choose_best(frame, Budget(), reference=None, chance=0.147) is None
    assert choose_best(frame, Budget(), reference=0.12, chance=0.147) is None  # a reference at chance level
    assert choose_best(frame, Budget(max_memory=0.5), reference=None, chance=0.147) is None
    good = _frame([{"val_accuracy": 0.80}, {"memory": 0.3, "val_accuracy": 0.795}, {"memory": 0.2,
                                                                                    "val_accuracy": 0.10}])
    assert int(choose_best(good, Budget(), reference=0.80, chance=0.147)["number"]) == 1
    assert int(choose_best(good, Budget(max_memory=0.5), reference=None, chance=0.147)["number"]) == 1


def test_a_file_too_large_for_the_file_system_is_one_line_and_exit_2(tmp_path):
    """A real write failure, not a patched one: the process may write files of at most 1 KiB (RLIMIT_FSIZE),
    so writing the graph's JSON fails with EFBIG; the command says so in one line and leaves no file."""
    limit = 1024

    def small_files() -> None:
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))

    target = tmp_path / "graph.json"
    done = subprocess.run([sys.executable, "-m", "precsearch", "trace", "tiny_cnn", "--json", str(target)],
                          capture_output=True, text=True, preexec_fn=small_files, timeout=300)
    assert done.returncode == 2
    assert done.stderr.count("\n") == 1 and os.strerror(errno.EFBIG) in done.stderr and "graph.json" in done.stderr
    assert list(tmp_path.iterdir()) == []  # no half-written file, no temp file left behind


def test_writing_into_a_folder_where_a_file_goes_is_one_line_and_exit_2(tmp_path, capsys):
    (tmp_path / "graph.json").mkdir()
    assert main(["trace", "tiny_cnn", "--json", str(tmp_path / "graph.json")]) == 2
    assert capsys.readouterr().err.count("\n") == 1


class Branchy(nn.Module):
    """A data-dependent branch: zeros skip ``extra``, every real batch runs it (torch.fx cannot trace this)."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3, padding=1)
        self.extra = nn.Conv2d(8, 8, 3, padding=1)
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(8, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.conv(x)
        if x.abs().sum() > 0:
            out = self.extra(out)
        return self.fc(torch.flatten(self.pool(out), 1))


def test_a_branch_the_example_input_skipped_is_reported_at_trace_check_and_run_time(caplog):
    low = Policy(input_shape=SHAPE, batch_size=8, defaults={"weight": "e5m2s", "activation": "e5m2s"})
    torch.manual_seed(0)
    model = Branchy()
    report = check_policy_on_model(low, model)  # traced on zeros of the policy's input shape
    assert report.untraced == ["extra"] and not report.ok and "extra" in report.summary()
    with pytest.warns(UserWarning, match=r"1 module\(s\) of Branchy did not run on the example input.*extra"):
        wrapped = apply_policy(model, low)
    assert "extra:weight" not in wrapped.formats()
    batch = torch.randn(8, *SHAPE, generator=torch.Generator().manual_seed(1))
    wrapped(batch)
    wrapped(batch)
    assert wrapped.untraced == ["extra"]
    assert caplog.text.count("extra (Conv2d) ran but is not in the traced graph") == 1  # once, loudly
    caplog.clear()
    with pytest.warns(UserWarning, match="torch.fx could not trace"):  # traced on a real batch: covered
        covered = apply_policy(Branchy(), low, example_input=batch[:2])
    covered(batch)
    assert covered.formats()["extra:weight"] == "e5m2s" and covered.untraced == [] and "ran but" not in caplog.text


def test_small_cli_mistakes_are_named_in_one_line(tmp_path, capsys):
    with pytest.raises(SystemExit, match="2"):  # argparse's refusal (tests/test_cli_inputs.py has the others)
        main(["train", "tiny_cnn", "--nproc", "1", "--lr", "nan", "--steps", "2", "--device", "cpu"])
    assert "argument --lr: 'nan' is not a finite number; give a number > 0" in capsys.readouterr().err
    assert main(["search", "tiny_cnn", "--space", str(tmp_path), "--out", str(tmp_path / "run")]) == 2
    assert "is a folder; give a UTF-8 YAML file" in capsys.readouterr().err

