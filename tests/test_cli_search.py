"""The search commands end to end: search -> best.json -> train, baselines, report, bad input, kill -9 + resume."""

from __future__ import annotations

import contextlib
import csv
import io
import itertools
import json
import os
import signal
import subprocess
import sys
import time

import optuna
import pandas as pd
import pytest
import torch
import yaml
from optuna.trial import TrialState

from precsearch.cli import main
from precsearch.config.policy import Policy
from precsearch.config.spaces import PAPER_SPACE
from precsearch.config.spec import ASSIGNABLE_KINDS
from precsearch.cost.model import CostModel
from precsearch.graph.tracing import trace
from precsearch.models import build
from precsearch.search.storage import StudyLocation
from precsearch.train.data import load_dataset

TINY = ["--proxy-steps", "4", "--image-size", "8", "--batch-size", "16", "--device", "cpu", "--threads", "1"]


@pytest.fixture(scope="module")
def search_run(space_file, tmp_path_factory):
    """(run directory, what the command printed)."""
    out = tmp_path_factory.mktemp("cli") / "run"
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        code = main(["search", "tiny_cnn", "--space", str(space_file), "--trials", "5", "--out", str(out),
                     "--no-progress", *TINY])
    assert code == 0
    return out, printed.getvalue()


@pytest.fixture(scope="module")
def searched(search_run):
    return search_run[0]


def test_search_prints_its_front_and_writes_outputs(search_run):
    searched, printed = search_run
    for name in ("trials.csv", "pareto.csv", "best.json", "run.json"):
        assert (searched / name).is_file()
    assert any((searched / "policies").iterdir())
    lines = printed.splitlines()
    pareto = pd.read_csv(searched / "pareto.csv", keep_default_na=False)
    assert lines[0] == "proxy length: 4 steps (fixed)"
    assert lines[1].startswith("5 trials (5 complete") and f"Pareto front: {len(pareto)} point(s)" in lines[1]
    front = [line for line in lines if line.startswith("  trial ")]
    assert [int(line.split()[1].rstrip(":")) for line in front] == pareto["number"].tolist()
    for line, (_, row) in zip(front, pareto.iterrows(), strict=True):
        assert f"memory {row['memory']:.3f} of all-high" in line and f"accuracy {row['val_accuracy']:.4f}" in line
        assert line.split(": ", 1)[1].startswith(f"step peak {float(row['peak_predicted']) / 2**20:.2f} MiB predicted")
        if row["confirmed_accuracy"] != "":  # sequential confirmation stops at the first point confirmed
            assert f"confirmed {float(row['confirmed_accuracy']):.4f}" in line and "12 steps" in line
        else:
            assert "confirmed" not in line
    assert (pareto["confirmed_accuracy"] != "").any()
    assert any(line.startswith("confirmed yardsticks: ") and "plain fp32" in line for line in lines)
    assert "training steps:" in lines and any(line.strip().startswith("confirmation") for line in lines)
    trial = json.loads((searched / "best.json").read_text())["provenance"]["trial"]
    assert any(line.startswith(f"best.json: trial {trial} ") for line in lines)


def test_best_json_records_the_picks_predicted_peak_and_its_measured_one_beside_fp32_and_autocast(search_run):
    """The memory a user runs out of: best.json's ``predicted`` has the cost model's step peak, and ``peak`` the
    pick's step measured once at the proxy's batch beside plain fp32's and torch.autocast(bf16)'s, and with the
    finer slices ``precsearch train --finer-slices`` runs, each measured again here by the allocator's events of
    the same kind of step."""
    import copy

    from precsearch.cost.measured import sgd_step, trace_step

    searched, printed = search_run
    assert json.loads((searched / "run.json").read_text())["budget"]["memory"] == "peak"  # the default measure
    pareto = pd.read_csv(searched / "pareto.csv")
    assert (pareto["memory"] == pareto["memory_peak"]).all()
    best = Policy.load(searched / "best.json")
    peak = best.provenance["peak"]
    assert peak["batch"] == 16 and peak["device"] == "cpu"
    data = load_dataset("digits", image_size=8)[0]
    torch.manual_seed(0)
    plain = build("tiny_cnn", num_classes=10)
    graph = trace(plain, data.images[:2], batch_size=16)
    assert best.predicted["peak_bytes"] == peak["predicted"] == CostModel(graph).peak_bytes(best.assignment(graph))

    def measured(model, autocast=None):
        optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9, weight_decay=5e-4)
        optimizer = model.wrap_optimizer(optimizer) if hasattr(model, "wrap_optimizer") else optimizer
        step = sgd_step(model, optimizer, data.images[:16], data.labels[:16], autocast=autocast)
        step()
        step()
        return trace_step(step).peak

    from precsearch.runtime.model import apply_policy

    assert peak["plain_fp32"] == measured(copy.deepcopy(plain))
    assert peak["autocast_bf16"] == measured(copy.deepcopy(plain), torch.bfloat16)
    assert peak["measured"] == measured(apply_policy(copy.deepcopy(plain), best, data.images[:2], steps_per_epoch=1))
    assert abs(peak["measured"] - peak["predicted"]) <= 0.02 * peak["measured"]
    slices = CostModel(graph).finer_slices(best.assignment(graph))  # what train --finer-slices runs
    assert slices and peak["finer_predicted"] == CostModel(graph).peak_bytes(best.assignment(graph), slices)
    assert peak["finer_measured"] == measured(apply_policy(copy.deepcopy(plain), best, data.images[:2],
                                                            steps_per_epoch=1, slices=slices))
    assert peak["finer_measured"] < peak["measured"]
    assert any(line.startswith("  step peak ") and "x plain fp32" in line and "torch.autocast(bf16)" in line
               and "with train --finer-slices" in line for line in printed.splitlines())


def test_best_json_trains_under_precsearch_train(searched, tmp_path, capsys):
    metrics = tmp_path / "metrics.csv"
    code = main(["train", "tiny_cnn", "--policy", str(searched / "best.json"), "--steps", "6", "--eval-every", "3",
                 "--metrics", str(metrics), "--device", "cpu", "--threads", "1"])
    assert code == 0
    out = capsys.readouterr().out
    assert "trained: 6 steps" in out
    rows = list(csv.DictReader(metrics.open()))
    assert [row["step"] for row in rows] == ["3", "6"]
    accuracy, loss = float(rows[-1]["val_accuracy"]), float(rows[-1]["val_loss"])
    assert f"validation accuracy {accuracy:.4f}, loss {loss:.4f}" in out
    val_size = len(load_dataset("digits", image_size=8)[1])
    assert accuracy * val_size == pytest.approx(round(accuracy * val_size), abs=1e-6)  # a count of right answers
    # the policy is applied: the same run in plain fp32 ends at another loss
    fp32 = tmp_path / "fp32.json"
    Policy.load(searched / "best.json").replace(defaults=dict.fromkeys(ASSIGNABLE_KINDS, "fp32"), overrides={},
                                                 high_format="fp32").save(fp32)
    assert main(["train", "tiny_cnn", "--policy", str(fp32), "--steps", "6", "--eval-every", "3", "--metrics",
                 str(tmp_path / "fp32.csv"), "--device", "cpu", "--threads", "1"]) == 0
    assert float(list(csv.DictReader((tmp_path / "fp32.csv").open()))[-1]["val_loss"]) != loss


def test_train_without_a_policy_is_plain_fp32(tmp_path, capsys):
    """The yardstick: no policy, no wrapper; the same numbers as a plain SGD loop written out here."""
    import torch
    import torch.nn.functional as F

    from precsearch.train.data import make_loader
    from precsearch.train.trainer import build_model

    metrics = tmp_path / "plain.csv"
    assert main(["train", "tiny_cnn", "--steps", "4", "--eval-every", "4", "--recipe", "proxy", "--metrics",
                 str(metrics), "--image-size", "8", "--batch-size", "16", "--lr", "0.1", "--seed", "3",
                 "--device", "cpu", "--threads", "1"]) == 0
    assert "trained in plain fp32 (no policy): 4 steps" in capsys.readouterr().out
    train_set, val_set = load_dataset("digits", image_size=8)
    torch.manual_seed(3)
    model = build_model("tiny_cnn", train_set.num_classes)
    sgd = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=5e-4)
    schedule = torch.optim.lr_scheduler.CosineAnnealingLR(sgd, T_max=4)
    batches = make_loader(train_set, 16, shuffle=True, seed=3, drop_last=True)
    for _, (images, labels) in zip(range(4), batches, strict=False):
        sgd.zero_grad()
        F.cross_entropy(model(images), labels).backward()
        sgd.step()
        schedule.step()
    # the reading: batch norm's statistics recomputed from the first 1,024 training images of the run's seeded
    # order, in batches of the evaluation batch size, 512 (torch's own update_bn), then eval mode
    torch.optim.swa_utils.update_bn(itertools.islice(make_loader(train_set, 512, shuffle=True, seed=3), 2), model)
    model.eval()
    with torch.no_grad():
        logits = model(val_set.images)
    accuracy = float((logits.argmax(dim=1) == val_set.labels).float().mean())
    row = list(csv.DictReader(metrics.open()))[-1]
    assert float(row["val_accuracy"]) == pytest.approx(accuracy)
    assert float(row["val_loss"]) == pytest.approx(float(F.cross_entropy(logits, val_set.labels)), rel=1e-5)


def test_baselines_reuse_the_sweep_and_report_draws_everything(searched, space_file, capsys):
    code = main(["baselines", "tiny_cnn", "--space", str(space_file), "--out", str(searched), "--names", "fp32,fp8",
                 "--no-progress", *TINY])
    assert code == 0
    table = pd.read_csv(searched / "baselines.csv", keep_default_na=False)
    assert table["name"].tolist()[:2] == ["fp32", "fp8"]
    sweep = table[table["source"] == "paper"]
    assert len(sweep) == 11
    trials = pd.read_csv(searched / "trials.csv", keep_default_na=False)
    # every sweep point the search trained is reused from it, the others trained once here
    searched_keys = set(trials[trials["trained"].astype(str) == "True"]["key"])
    for _, row in sweep.iterrows():
        assert row["reused"].startswith("trial ") == (row["key"] in searched_keys)
    # the memory column is the search's measure (the step's peak), trained here or reused, beside the other one
    policies = table[table["source"] != "torch"]
    assert (policies["memory"].astype(float) == policies["memory_peak"].astype(float)).all()
    assert (policies["memory_bytes"].astype(float) != policies["memory_peak"].astype(float)).any()
    fp32 = table[table["name"] == "fp32"].iloc[0]
    graph = trace(build("tiny_cnn", num_classes=10), torch.zeros(2, 3, 8, 8), batch_size=16)
    fp32_policy = Policy.load(searched / fp32["policy"])
    assert float(fp32["peak_predicted"]) == CostModel(graph).peak_bytes(fp32_policy.assignment(graph))
    assert main(["report", str(searched)]) == 0
    assert "report.png" in capsys.readouterr().out
    text = (searched / "report.md").read_text()
    assert "| baseline | fp8 |" in text and "| paper sweep | r=0.5 |" in text and "| pareto |" in text
    assert "- proxy length: 4 steps (fixed)" in text and "plain fp32" in text and "## Training steps" in text
    assert "| peak MiB | x plain fp32 | x autocast | bytes MiB |" in text and "- the pick's step peak " in text


def _bad_space(tmp_path, **changes):
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump({**PAPER_SPACE, **changes}))
    return str(path)


@pytest.mark.parametrize("case, needle", [
    ("model", "unknown model 'resnet99'"),
    ("dataset", "unknown dataset 'mnist'"),
    ("space file", "does not exist"),
    ("space key", "unknown key 'samplr'"),
    ("space format", "E must be in 1..8"),
    ("storage url", "cannot open study storage postgresql://nohost/db"),
    ("storage dir", "cannot open study storage sqlite:///"),
    ("empty data dir", "is empty"),
])
def test_bad_input_is_one_line_exit_2_and_nothing_written(case, needle, space_file, tmp_path, capsys):
    out = tmp_path / "out"
    model, options = "tiny_cnn", ["--space", str(space_file)]
    if case == "model":
        model = "resnet99"
    elif case == "dataset":
        options += ["--data", "mnist"]
    elif case == "space file":
        options = ["--space", str(tmp_path / "missing.yaml")]
    elif case == "space key":
        options = ["--space", _bad_space(tmp_path, samplr="tpe")]
    elif case == "space format":
        options = ["--space", _bad_space(tmp_path, low="e9m3")]
    elif case == "storage url":
        options += ["--storage", "postgresql://nohost/db"]
    elif case == "storage dir":
        options += ["--storage", f"sqlite:///{tmp_path}/no/such/dir/study.db"]
    else:
        (tmp_path / "empty").mkdir()
        options += ["--data", "cifar10", "--data-root", str(tmp_path / "empty")]
    code = main(["search", model, *options, "--trials", "2", "--out", str(out), "--no-progress", *TINY])
    err = capsys.readouterr().err.strip()
    assert code == 2
    assert len(err.splitlines()) == 1 and needle in err and "Traceback" not in err
    assert not out.exists()


@pytest.mark.parametrize("measure", [None, "bytes"])
def test_baselines_outside_a_search_price_memory_by_the_peak_unless_told(measure, tmp_path, capsys):
    """Outside a search's run directory the table's memory is the default measure, the step's peak; --memory
    bytes gives the paper's. Both ratios are columns either way."""
    out = tmp_path / "b"
    chosen = [] if measure is None else ["--memory", measure]
    assert main(["baselines", "tiny_cnn", "--names", "fp8", "--out", str(out), "--no-progress", *chosen, *TINY]) == 0
    row = pd.read_csv(out / "baselines.csv").set_index("name").loc["fp8"]
    assert row["memory"] == row[f"memory_{measure or 'peak'}"]
    assert row["memory_peak"] != row["memory_bytes"]
    assert f"memory {row['memory']:.3f} of all-high" in capsys.readouterr().out


def test_other_commands_reject_bad_input(tmp_path, capsys):
    assert main(["report", str(tmp_path)]) == 2
    assert "no trials.csv" in capsys.readouterr().err
    assert main(["baselines", "tiny_cnn", "--names", "fp7", "--out", str(tmp_path / "b"), *TINY]) == 2
    assert "unknown baseline 'fp7'" in capsys.readouterr().err
    assert main(["train", "tiny_cnn", "--policy", str(tmp_path / "none.json"), "--steps", "1"]) == 2
    assert not (tmp_path / "b").exists()


def _completed(journal) -> dict[int, tuple[float, ...]]:
    storage = StudyLocation.of(str(journal), journal.parent).open()
    try:
        study = optuna.load_study(study_name="precsearch", storage=storage)
    except KeyError:  # not created yet
        return {}
    return {t.number: tuple(t.values) for t in study.get_trials(states=(TrialState.COMPLETE,))}


@pytest.mark.slow
def test_kill_9_then_resume_keeps_every_completed_trial(space_file, tmp_path):
    out = tmp_path / "run"
    args = ["search", "tiny_cnn", "--space", str(space_file), "--trials", "8", "--out", str(out), "--no-progress",
            "--proxy-steps", "40", "--image-size", "8", "--batch-size", "16", "--device", "cpu", "--threads", "1"]
    process = subprocess.Popen([sys.executable, "-m", "precsearch", *args], stdout=subprocess.DEVNULL,
                               stderr=subprocess.DEVNULL)
    deadline = time.time() + 300
    try:
        while time.time() < deadline and process.poll() is None:
            if (out / "study.journal").is_file() and _completed(out / "study.journal"):
                break
            time.sleep(0.2)
        assert process.poll() is None, "the search finished before it could be killed; give it more work"
        os.kill(process.pid, signal.SIGKILL)
    finally:
        process.wait()
    before = _completed(out / "study.journal")
    assert 1 <= len(before) < 8
    assert main([*args, "--resume"]) == 0
    after = _completed(out / "study.journal")
    assert all(after.get(number) == values for number, values in before.items())
    trials = pd.read_csv(out / "trials.csv", keep_default_na=False)
    completed = trials[trials["state"] == "COMPLETE"]
    assert completed["key"].nunique() == 8  # the budget counts distinct assignments; a copied duplicate is not one
    killed = trials[trials["state"] == "FAIL"]
    assert killed["interrupted"].all() and set(killed["key"]) <= set(completed["key"])  # cut short, run again
