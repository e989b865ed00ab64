"""Every value a user gives the CLI is honoured or refused (issue 32, the input half).

One table of bad inputs across the commands: each row is a direct call of ``precsearch.cli.main``, which must
exit 2 with one line (no traceback) holding a phrase, and leave the paths listed as absent absent (a command
that fails before its work writes nothing). Then rows proving the values are honoured, not just refused."""

from __future__ import annotations

import csv
import json
import textwrap

import pytest
import torch
import yaml

from precsearch.cli import main
from precsearch.config.policy import Policy
from precsearch.config.spaces import PAPER_SPACE
from precsearch.train.data import load_dataset

CUDA = torch.cuda.is_available()
NO_CUDA = pytest.mark.skipif(CUDA, reason="needs a machine without CUDA")
USER_MODULE = "precsearch_test_user_models"
FAST = ["--image-size", "8", "--device", "cpu", "--threads", "1"]  # a row that reaches the data or a model
TRAIN = ["train", "tiny_cnn", *FAST]
SEARCH = ["search", "tiny_cnn", "--out", "{tmp}/run", "--proxy-steps", "2", "--no-progress", *FAST]


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """Bad (and one good) input files, and a module of user model factories that raise."""
    folder = tmp_path_factory.mktemp("inputs")
    space = yaml.safe_dump({key: value for key, value in PAPER_SPACE.items() if key != "proxy"})
    (folder / "dup_top.yaml").write_text(space + "proxy:\n  steps: 3\nproxy:\n  steps: 4\n")
    (folder / "dup_nested.yaml").write_text(space + "proxy:\n  steps: 3\n  steps: 4\n")
    (folder / "unclosed.yaml").write_text("name: broken\nhigh: e6m9s\nlow: {weight: e4m3b4s, activation: e4m3b4s\n"
                                          "granularity: group\n")
    (folder / "wide.yaml").write_text(yaml.safe_dump({**PAPER_SPACE, "high": "fp16", "low": "fp32"}))
    (folder / "same.yaml").write_text(yaml.safe_dump({**PAPER_SPACE, "high": "fp16", "low": "fp16"}))
    policy = Policy(input_shape=(3, 8, 8), batch_size=8, defaults={"weight": "e5m2s"},
                    overrides={"conv2:weight": "e5m2s"})
    text = json.dumps(policy.to_dict(), indent=2)
    assert text.count('"conv2:weight": "e5m2s"') == 1
    (folder / "dup_policy.json").write_text(text.replace('"conv2:weight": "e5m2s"',
                                                         '"conv2:weight": "e5m2s",\n    "conv2:weight": "fp16"'))
    Policy(input_shape=(1, 8, 8), batch_size=8).save(folder / "gray_policy.json")
    Policy(input_shape=(3, 16, 16), batch_size=8).save(folder / "policy16.json")
    header = "number,state,origin,trained,memory,val_accuracy,val_loss,diverged\n"
    for name, row in (("badrun", "1,COMPLETE,,True,0.5,0.5x,1.0,False"),
                      ("flagrun", "1,COMPLETE,,maybe,0.5,0.5,1.0,False"), ("colrun", None)):
        (folder / name).mkdir()
        table = header + "0,COMPLETE,all-high,True,1.0,0.5,1.0,False\n" + (f"{row}\n" if row else "")
        (folder / name / "trials.csv").write_text(table.replace(",val_loss", ",loss") if row is None else table)
    (folder / f"{USER_MODULE}.py").write_text(textwrap.dedent("""
        from torch import nn

        def broken():
            raise RuntimeError("factory broke")

        class Forward(nn.Module):
            def __init__(self):
                super().__init__()
                self.conv = nn.Conv2d(3, 4, 3)

            def forward(self, x):
                x = self.conv(x)
                raise ValueError("forward broke")

        def bad_forward():
            return Forward()

        def four_classes():
            return nn.Sequential(nn.Conv2d(3, 4, 3), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(4, 4))
        """))
    return folder


@pytest.fixture
def user_models(files, monkeypatch):
    monkeypatch.syspath_prepend(str(files))


def _run(argv: list[str], capsys) -> tuple[int, str]:
    """main's exit status (argparse's refusals exit through SystemExit) and what it printed to stderr."""
    try:
        code = main(argv)
    except SystemExit as stop:
        code = stop.code
    return code, capsys.readouterr().err


# (id, argv, phrase the one error line holds, paths under the row's tmp folder that must not exist afterwards[,
# a mark])
ROWS = [
    # train: numbers, each with a range, never replaced by a default
    ("train-batch-0", [*TRAIN, "--batch-size", "0"], "--batch-size: '0': give an integer >= 1", ()),
    ("train-batch-neg", [*TRAIN, "--batch-size", "-5"], "--batch-size: '-5'", ()),
    ("train-image-0", [*TRAIN, "--image-size", "0"], "--image-size: '0'", ()),
    ("train-image-neg", [*TRAIN, "--image-size", "-8"], "--image-size: '-8'", ()),
    ("train-image-text", [*TRAIN, "--image-size", "big"], "--image-size: 'big'", ()),
    ("train-steps-0", [*TRAIN, "--steps", "0"], "--steps: '0'", ()),
    ("train-steps-float", [*TRAIN, "--steps", "2.5"], "--steps: '2.5'", ()),
    ("train-epochs-0", [*TRAIN, "--epochs", "0"], "--epochs: '0': give a number > 0", ()),
    ("train-epochs-nan", [*TRAIN, "--epochs", "nan"], "--epochs: 'nan' is not a finite number", ()),
    ("train-epochs-inf", [*TRAIN, "--epochs", "inf"], "--epochs: 'inf' is not a finite number", ()),
    ("train-lr-nan", [*TRAIN, "--lr", "nan"], "--lr: 'nan' is not a finite number", ()),
    ("train-lr-inf", [*TRAIN, "--lr", "inf"], "--lr: 'inf' is not a finite number", ()),
    ("train-lr-0", [*TRAIN, "--lr", "0"], "--lr: '0': give a number > 0", ()),
    ("train-lr-neg", [*TRAIN, "--lr", "-0.1"], "--lr: '-0.1'", ()),
    ("train-momentum-nan", [*TRAIN, "--momentum", "nan"], "--momentum: 'nan' is not a finite number", ()),
    ("train-momentum-neg", [*TRAIN, "--momentum", "-0.5"], "--momentum: '-0.5': give a number in [0, 1)", ()),
    ("train-momentum-1", [*TRAIN, "--momentum", "1"], "--momentum: '1'", ()),
    ("train-decay-nan", [*TRAIN, "--weight-decay", "nan"], "--weight-decay: 'nan' is not a finite number", ()),
    ("train-decay-neg", [*TRAIN, "--weight-decay", "-0.001"], "--weight-decay: '-0.001': give a number >= 0", ()),
    ("train-eval-neg", [*TRAIN, "--eval-every", "-3", "--metrics", "{tmp}/m.csv"], "--eval-every: '-3'",
     ("m.csv",)),
    ("train-eval-0", [*TRAIN, "--eval-every", "0"], "--eval-every: '0'", ()),
    ("train-threads-0", ["train", "tiny_cnn", "--threads", "0"], "--threads: '0'", ()),
    ("train-nproc-0", [*TRAIN, "--nproc", "0"], "--nproc: '0'", ()),
    ("train-seed-neg", [*TRAIN, "--seed", "-1"], "--seed: '-1': give an integer in [0, 4294967295]", ()),
    ("train-seed-big", [*TRAIN, "--seed", str(2**40)], "--seed:", ()),
    ("train-device", [*TRAIN, "--device", "gpu"], "--device: 'gpu': give auto", ()),
    # train: files and the model against the data
    ("train-policy-missing", [*TRAIN, "--policy", "{tmp}/none.json"], "none.json", ()),
    ("train-policy-dup", [*TRAIN, "--policy", "{files}/dup_policy.json", "--metrics", "{tmp}/m.csv"],
     "key 'conv2:weight' given twice in one object (lines", ("m.csv",)),
    ("train-policy-gray", [*TRAIN, "--policy", "{files}/gray_policy.json", "--metrics", "{tmp}/m.csv"],
     "made for 1-channel inputs (1, 8, 8), the data has 3 channels", ("m.csv",)),
    ("train-policy-size", [*TRAIN, "--policy", "{files}/policy16.json"], "pass --image-size 16", ()),
    ("train-classes", ["train", "tiny_cnn:num_classes=4", *FAST, "--metrics", "{tmp}/m.csv"],
     "asks for num_classes=4, but the data has 10 classes", ("m.csv",)),
    ("train-factory", ["train", f"{USER_MODULE}:broken", *FAST, "--metrics", "{tmp}/m.csv"],
     "raised RuntimeError: factory broke at", ("m.csv",)),
    ("train-factory-classes", ["train", f"{USER_MODULE}:four_classes", *FAST, "--metrics", "{tmp}/m.csv"],
     "outputs (2, 4) for a batch of the data of shape (2, 3, 8, 8), but the data has 10 classes", ("m.csv",)),
    ("train-compress", [*TRAIN, "--compress", "adacomp"], "needs --nproc", ()),
    ("train-finer-plain", [*TRAIN, "--finer-slices", "--metrics", "{tmp}/m.csv"],
     "--finer-slices needs --policy FILE", ("m.csv",)),
    ("train-finer-compile", [*TRAIN, "--finer-slices", "--policy", "{files}/policy16.json", "--compile"],
     "--finer-slices needs no --compile", ()),
    ("train-finer-nproc", [*TRAIN, "--finer-slices", "--policy", "{files}/policy16.json", "--nproc", "2"],
     "--finer-slices needs no --nproc", ()),
    # search
    ("search-batch-0", [*SEARCH, "--batch-size", "0"], "--batch-size: '0'", ("run",)),
    ("search-batch-neg", [*SEARCH, "--batch-size", "-5"], "--batch-size: '-5': give an integer >= 1", ("run",)),
    ("search-image-0", [*SEARCH, "--image-size", "0"], "--image-size: '0'", ("run",)),
    ("search-trials-0", [*SEARCH, "--trials", "0"], "--trials: '0'", ("run",)),
    ("search-jobs-0", [*SEARCH, "--jobs", "0"], "--jobs: '0'", ("run",)),
    ("search-proxy-steps-0", [*SEARCH, "--proxy-steps", "0"], "--proxy-steps: '0': give a number of steps",
     ("run",)),
    ("search-max-proxy-steps-neg", [*SEARCH, "--max-proxy-steps", "-1"], "--max-proxy-steps: '-1'", ("run",)),
    ("search-confirm-nan", [*SEARCH, "--confirm-factor", "nan"], "--confirm-factor: 'nan' is not a finite",
     ("run",)),
    ("search-confirm-half", [*SEARCH, "--confirm-factor", "0.5"], "--confirm-factor: '0.5': give a number in [1, 100]",
     ("run",)),
    ("search-heartbeat-0", [*SEARCH, "--heartbeat", "0"], "--heartbeat: '0'", ("run",)),
    ("search-max-memory-nan", [*SEARCH, "--max-memory", "nan"], "--max-memory: 'nan' is not a finite", ("run",)),
    ("search-max-memory-0", [*SEARCH, "--max-memory", "0"], "--max-memory: '0': give a number in (0, 1]",
     ("run",)),
    ("search-drop-neg", [*SEARCH, "--max-accuracy-drop", "-0.1"], "--max-accuracy-drop: '-0.1'", ("run",)),
    ("search-drop-inf", [*SEARCH, "--max-accuracy-drop", "inf"], "--max-accuracy-drop: 'inf' is not a finite",
     ("run",)),
    ("search-confidence-big", [*SEARCH, "--confidence", "1.5"], "--confidence: '1.5': give a number in [0.5, 1)",
     ("run",)),
    ("search-confidence-nan", [*SEARCH, "--confidence", "nan"], "--confidence: 'nan'", ("run",)),
    ("search-proxy-seeds-0", [*SEARCH, "--proxy-seeds", "0"], "--proxy-seeds: '0': give a number of seeds",
     ("run",)),
    ("search-seed-neg", [*SEARCH, "--seed", "-2"], "--seed: '-2'", ("run",)),
    ("search-device-name", [*SEARCH, "--device", "tpu"], "--device: 'tpu'", ("run",)),
    ("search-space-dup", [*SEARCH, "--space", "{files}/dup_top.yaml"],
     "dup_top.yaml:", ("run",)),
    ("search-space-dup-nested", [*SEARCH, "--space", "{files}/dup_nested.yaml"], "key 'steps' given twice (first "
     "at line", ("run",)),
    ("search-space-unclosed", [*SEARCH, "--space", "{files}/unclosed.yaml"], "unclosed.yaml:4: expected ',' or '}'",
     ("run",)),
    ("search-space-wide", [*SEARCH, "--space", "{files}/wide.yaml"],
     "low.weight fp32 (32 bits) is wider than high fp16 (16 bits)", ("run",)),
    ("search-space-same", [*SEARCH, "--space", "{files}/same.yaml"], "every low format is as wide as high",
     ("run",)),
    ("search-space-missing", [*SEARCH, "--space", "{tmp}/none.yaml"], "none.yaml does not exist", ("run",)),
    ("search-classes", ["search", "tiny_cnn:classes=4", *SEARCH[2:]], "num_classes=4, but the data has 10",
     ("run",)),
    ("search-factory", ["search", f"{USER_MODULE}:broken", *SEARCH[2:]], "model factory "
     f"'{USER_MODULE}:broken' raised RuntimeError: factory broke at", ("run",)),
    ("search-forward", ["search", f"{USER_MODULE}:bad_forward", *SEARCH[2:]],
     "raised ValueError: forward broke at", ("run",)),
    ("search-factory-classes", ["search", f"{USER_MODULE}:four_classes", *SEARCH[2:]],
     "but the data has 10 classes; make it return (N, 10) logits", ("run",)),
    ("search-resume-foreign", [*SEARCH[:3], "{tmp}/foreign", *SEARCH[4:], "--resume"], "nothing to resume",
     ("foreign/.precsearch.lock", "foreign/.precsearch.workers.lock", "foreign/run.json")),
    ("search-foreign", [*SEARCH[:3], "{tmp}/foreign", *SEARCH[4:]], "is not empty",
     ("foreign/.precsearch.lock", "foreign/.precsearch.workers.lock", "foreign/study.journal")),
    ("search-cuda", [*SEARCH[:-4], "--threads", "1", "--device", "cuda"], "CUDA is not available", ("run",),
     NO_CUDA),
    # baselines
    ("baselines-proxy-steps-0", ["baselines", "tiny_cnn", "--out", "{tmp}/b", "--proxy-steps", "0"],
     "--proxy-steps: '0'", ("b",)),
    ("baselines-batch-neg", ["baselines", "tiny_cnn", "--out", "{tmp}/b", "--batch-size", "-5"],
     "--batch-size: '-5'", ("b",)),
    ("baselines-names", ["baselines", "tiny_cnn", "--out", "{tmp}/b", "--names", "fp32,fp7", *FAST],
     "unknown baseline 'fp7'", ("b",)),
    ("baselines-space-unclosed", ["baselines", "tiny_cnn", "--out", "{tmp}/b", "--space", "{files}/unclosed.yaml",
                                  *FAST], "unclosed.yaml:4:", ("b",)),
    ("baselines-cuda", ["baselines", "tiny_cnn", "--out", "{tmp}/b", "--device", "cuda"], "CUDA is not available",
     ("b",), NO_CUDA),
    # validate
    ("validate-steps-0", ["validate", "{tmp}/run", "--steps", "0"], "--steps: '0'", ()),
    ("validate-threads-neg", ["validate", "{tmp}/run", "--threads", "-1"], "--threads: '-1'", ()),
    ("validate-seed-neg", ["validate", "{tmp}/run", "--seed", "-1"], "--seed: '-1'", ()),
    ("validate-device", ["validate", "{tmp}/run", "--device", "cpu0"], "--device: 'cpu0'", ()),
    ("validate-no-run", ["validate", "{tmp}/foreign"], "holds no run.json and trials.csv",
     ("foreign/fidelity.csv",)),
    # trace
    ("trace-shape-2", ["trace", "tiny_cnn", "--input-shape", "3,32"], "--input-shape: '3,32': give C,H,W", ()),
    ("trace-shape-4", ["trace", "tiny_cnn", "--input-shape", "1,3,32,32"], "give C,H,W", ()),
    ("trace-shape-text", ["trace", "tiny_cnn", "--input-shape", "3,a,32"], "give C,H,W", ()),
    ("trace-shape-0", ["trace", "tiny_cnn", "--input-shape", "3,0,8"], "give C,H,W", ()),
    ("trace-batch-0", ["trace", "tiny_cnn", "--batch-size", "0"], "--batch-size: '0'", ()),
    ("trace-channels", ["trace", "tiny_cnn", "--input-shape", "1,8,8", "--json", "{tmp}/g.json"],
     "expects (N, 3, H, W)", ("g.json",)),
    ("trace-factory", ["trace", f"{USER_MODULE}:broken", "--json", "{tmp}/g.json"],
     "raised RuntimeError: factory broke at", ("g.json",)),
    ("trace-forward", ["trace", f"{USER_MODULE}:bad_forward", "--input-shape", "3,8,8", "--json", "{tmp}/g.json"],
     f"{USER_MODULE}.py:14 in forward", ("g.json",)),
    ("trace-model", ["trace", "tiny_cn"], "did you mean tiny_cnn?", ()),
    # demo
    ("demo-trials-0", ["demo", "--out", "{tmp}/demo", "--trials", "0"], "--trials: '0'", ("demo",)),
    ("demo-jobs-neg", ["demo", "--out", "{tmp}/demo", "--jobs", "-2"], "--jobs: '-2'", ("demo",)),
    ("demo-device", ["demo", "--out", "{tmp}/demo", "--device", "gpu"], "--device: 'gpu'", ("demo",)),
    ("demo-cuda", ["demo", "--out", "{tmp}/demo", "--device", "cuda"], "CUDA is not available", ("demo",),
     NO_CUDA),
    # sensitivity
    ("sensitivity-batches-0", ["sensitivity", "tiny_cnn", "--out", "{tmp}/s", "--batches", "0"], "--batches: '0'",
     ("s",)),
    ("sensitivity-image-neg", ["sensitivity", "tiny_cnn", "--out", "{tmp}/s", "--image-size", "-1"],
     "--image-size: '-1'", ("s",)),
    ("sensitivity-space-dup", ["sensitivity", "tiny_cnn", "--out", "{tmp}/s", "--space", "{files}/dup_top.yaml",
                               *FAST], "key 'proxy' given twice", ("s",)),
    ("sensitivity-cuda", ["sensitivity", "tiny_cnn", "--out", "{tmp}/s", "--device", "cuda"], "CUDA is not available",
     ("s",), NO_CUDA),
    # report
    ("report-number", ["report", "{files}/badrun"], "badrun/trials.csv: column val_accuracy holds '0.5x' on line 3",
     ()),
    ("report-flag", ["report", "{files}/flagrun"], "column trained holds 'maybe' on line 3, not True or False", ()),
    ("report-column", ["report", "{files}/colrun"], "colrun/trials.csv has no column val_loss", ()),
    ("report-storage-missing", ["report", "{tmp}/out", "--storage", "{tmp}/missing.journal"],
     "no journal file", ("missing.journal", "out")),
    ("report-study-name", ["report", "{tmp}/out", "--study-name", "x"], "--study-name needs --storage", ("out",)),
    ("report-empty", ["report", "{tmp}/foreign"], "holds no trials.csv or baselines.csv", ("foreign/report.md",)),
    # formats
    ("formats-spec", ["formats", "e4m3q"], "e4m3q", ()),
]


@pytest.mark.parametrize(("argv", "phrase", "absent"),
                         [pytest.param(*row[1:4], id=row[0], marks=row[4:]) for row in ROWS])
def test_a_bad_input_is_one_line_and_exit_2_and_leaves_the_disk_as_it_was(argv, phrase, absent, files, tmp_path,
                                                                         capsys, user_models):
    (tmp_path / "foreign").mkdir()
    (tmp_path / "foreign" / "notes.txt").write_text("not a run\n")
    filled = [part.format(tmp=tmp_path, files=files) for part in argv]
    code, err = _run(filled, capsys)
    assert code == 2, err
    assert "Traceback" not in err
    lines = err.strip().splitlines()
    assert lines[-1].startswith(f"precsearch {argv[0]}: error: ") and sum("error:" in line for line in lines) == 1
    assert phrase in lines[-1]
    assert "<unicode string>" not in err and "growth_interval" not in err
    assert [path for path in absent if (tmp_path / path).exists()] == []
    assert sorted(path.name for path in (tmp_path / "foreign").iterdir()) == ["notes.txt"]


def test_the_table_covers_every_command_with_at_least_60_rows():
    commands = {row[1][0] for row in ROWS}
    assert {"train", "search", "baselines", "validate", "trace", "demo", "sensitivity", "report"} <= commands
    assert len(ROWS) >= 60


def test_verbose_shows_the_traceback_of_user_code(files, capsys, user_models):
    code, err = _run(["-v", "trace", f"{USER_MODULE}:broken"], capsys)
    assert code == 2
    assert "Traceback" in err and f'{USER_MODULE}.py", line 5, in broken' in err
    assert err.strip().splitlines()[-1].startswith("precsearch trace: error: model factory")


def test_train_honours_the_batch_size_steps_eval_interval_and_class_count_given(tmp_path, capsys):
    metrics = tmp_path / "m.csv"
    code = main(["train", "tiny_cnn:classes=10", "--batch-size", "3", "--steps", "2", "--eval-every", "1",
                 "--recipe", "proxy", "--metrics", str(metrics), *FAST])
    assert code == 0
    rows = list(csv.DictReader(metrics.read_text().splitlines()))
    assert [int(row["step"]) for row in rows] == [1, 2]  # evaluated every step, as asked
    per_epoch = len(load_dataset("digits", image_size=8)[0]) // 3  # batches of 3 in an epoch
    assert [float(row["epoch"]) for row in rows] == [round(step / per_epoch, 3) for step in (1, 2)]
    assert "2 steps" in capsys.readouterr().out


def test_train_honours_finer_slices_with_the_slices_the_cost_model_names(tmp_path, capsys, monkeypatch):
    """``--finer-slices`` trains the policy's model with ``slices=finer_slices``: the layers ``CostModel.finer_slices``
    names run in that many slices (the site plan the wrapped model trains with)."""
    from precsearch.config.spec import PAPER_LOW
    from precsearch.cost.model import CostModel
    from precsearch.cost.policies import policy_from_assignment
    from precsearch.graph.tracing import trace
    from precsearch.models import build
    from precsearch.train import trainer

    images = load_dataset("digits", image_size=8)[0].images[:2]
    graph = trace(build("tiny_cnn"), images, batch_size=64)
    policy = policy_from_assignment(graph, {tid: PAPER_LOW[graph.tensors[tid].kind] for tid in graph.assignable_ids()})
    policy.save(tmp_path / "policy.json")
    expected = CostModel(graph).finer_slices(policy.assignment(graph))
    trained, original = [], trainer.apply_policy

    def recording(*args, **kwargs):
        trained.append(original(*args, **kwargs))
        return trained[-1]

    monkeypatch.setattr(trainer, "apply_policy", recording)
    assert main([*TRAIN, "--policy", str(tmp_path / "policy.json"), "--steps", "2", "--recipe", "proxy",
                 "--finer-slices"]) == 0
    assert expected and {sites.op: sites.slices for sites in trained[0].sites.ops if sites.slices > 1} == expected
    assert "2 steps" in capsys.readouterr().out


def test_trace_honours_the_batch_size_and_input_shape_given(capsys):
    assert main(["trace", "tiny_cnn", "--batch-size", "3", "--input-shape", "3,8,8"]) == 0
    assert "batch 3, input (3, 8, 8)" in capsys.readouterr().out


@pytest.mark.slow  # a real (one-trial) search: 12 s on 2 cores
@NO_CUDA
def test_after_a_refused_device_the_corrected_search_starts_without_resume(tmp_path, capsys):
    argv = ["search", "tiny_cnn", "--out", str(tmp_path / "run"), "--proxy-steps", "1", "--trials", "1",
            "--no-progress", "--image-size", "8", "--batch-size", "8", "--threads", "1", "--proxy-seeds", "1"]
    assert _run([*argv, "--device", "cuda"], capsys)[0] == 2
    assert not (tmp_path / "run").exists()
    code, err = _run([*argv, "--device", "cpu"], capsys)
    assert code == 0, err
    assert (tmp_path / "run" / "trials.csv").is_file()
