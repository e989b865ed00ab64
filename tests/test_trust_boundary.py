"""Trust boundaries (issue: files are data, user code is fenced, sizes are priced before work).

A run directory, a study journal or a policy someone hands over must not run code on the receiver's machine:
a model factory named in a file is refused unless the user names it on the command line. A user factory
that fails, exits or raises a BaseException is one line, exit 2; its own time is not training time. Model
sizes and spec values a machine cannot take are refused in one line, in well under 2 s, before any work."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import textwrap
import time

import optuna
import pytest
import torch
import yaml
from cli_runs import run_cli

from precsearch import models
from precsearch.config.policy import Policy
from precsearch.config.spaces import PAPER_SPACE
from precsearch.errors import PrecsearchError
from precsearch.models.common import TooNarrow, scale_channels
from precsearch.search.rundir import SEARCH_FORMAT
from precsearch.search.storage import STUDY_NAME, StudyLocation

FAST = ["--image-size", "8", "--device", "cpu", "--threads", "1"]
EVIL_MODULE = "precsearch_test_evil_import"  # writes the sentinel when imported
USER_MODULE = "precsearch_test_trust_factories"
TRUSTED = f"{USER_MODULE}:tiny"


def _one_error_line(command: str, err: str) -> str:
    """The one ``error:`` line a refused command printed (no traceback); returns it."""
    assert "Traceback" not in err
    lines = err.strip().splitlines()
    assert sum("error:" in line for line in lines) == 1, err
    assert lines[-1].startswith(f"precsearch {command}: error: "), err
    return lines[-1]


@pytest.fixture
def sentinel(tmp_path, monkeypatch):
    """The file the evil specs (``_evil_specs``) would create; the module that creates it on import is on the
    path, not imported yet."""
    path = tmp_path / "sentinel"
    code_folder = tmp_path / "code"
    code_folder.mkdir()
    (code_folder / f"{EVIL_MODULE}.py").write_text(f"open({str(path)!r}, 'w').close()\ndef make():\n    pass\n")
    monkeypatch.syspath_prepend(str(code_folder))
    monkeypatch.delitem(sys.modules, EVIL_MODULE, raising=False)
    return path


def _evil_specs(sentinel) -> list[str]:
    """Two specs that run code: a shell command through os.system, and a module that acts when imported."""
    return [f"os:system:command=touch {sentinel}", f"{EVIL_MODULE}:make"]


def _run_config(model: str) -> dict:
    """The run.json fields validate reads, of a tiny search on the digits by this precsearch, naming ``model``."""
    space = {**PAPER_SPACE, "proxy": {**PAPER_SPACE.get("proxy", {}), "steps": 2, "batch_size": 16,
                                      "image_size": 8}}
    return {"model": model, "space": space, "data": {"name": "digits", "root": None},
            "budget": {"max_memory": None, "max_accuracy_drop": None, "memory": "bytes", "confidence": 0.9},
            "seed": 0, "search_format": SEARCH_FORMAT}


def _foreign_run(folder, model: str) -> None:
    """A run directory "from another machine": run.json, trials.csv and a study journal whose config names
    ``model``, and a best.json made for it."""
    folder.mkdir()
    config = _run_config(model)
    (folder / "run.json").write_text(json.dumps(config))
    (folder / "trials.csv").write_text("number,state,origin,trained,memory,val_accuracy,val_loss,diverged\n")
    backend = StudyLocation.of(None, folder).open()
    study = optuna.create_study(study_name=STUDY_NAME, storage=backend, directions=["minimize", "minimize"])
    study.set_user_attr("config", config)
    Policy(model=model, input_shape=(3, 8, 8), batch_size=16).save(folder / "best.json")


def _four_commands(run) -> dict[str, list[str]]:
    """The four commands that read a model from a run directory, each as it would be typed."""
    return {
        "validate": ["validate", str(run), "--steps", "1", "--threads", "1", "--no-progress", "--no-compile"],
        "report": ["report", str(run), "--storage", str(run / "study.journal")],
        "train": ["train", "tiny_cnn", "--policy", str(run / "best.json"), "--steps", "1", *FAST],
        "search": ["search", "tiny_cnn", "--resume", "--out", str(run), "--proxy-steps", "2", "--trials", "1",
                   "--no-progress", "--batch-size", "16", *FAST],
    }


# ------------------------------------------------------------------------------------ 1. files are data


@pytest.mark.parametrize("command", ["validate", "report", "train", "search"])
@pytest.mark.parametrize("which", [0, 1], ids=["os-system", "module-import"])
def test_a_run_directory_naming_code_cannot_run_it(command, which, tmp_path, sentinel, capsys):
    evil = _evil_specs(sentinel)[which]
    run = tmp_path / "run"
    _foreign_run(run, evil)
    before = sorted(path.name for path in run.iterdir())
    code, _, err = run_cli(_four_commands(run)[command], capsys)
    assert code == 2, err
    line = _one_error_line(command, err)
    assert ("holds a search with different model" if command == "search" else evil) in line  # search: as named
    assert not sentinel.exists()
    assert EVIL_MODULE not in sys.modules
    assert sorted(path.name for path in run.iterdir()) == before  # nothing written into it


def test_report_without_storage_reads_the_model_as_text_only(tmp_path, sentinel, capsys):
    run = tmp_path / "run"
    _foreign_run(run, _evil_specs(sentinel)[0])
    (run / "trials.csv").write_text("number,state,origin,trained,memory,val_accuracy,val_loss,diverged\n"
                                    "0,COMPLETE,all-high,True,1.0,0.5,1.0,False\n")
    code, _, err = run_cli(["report", str(run)], capsys)
    assert code == 0, err
    assert not sentinel.exists()
    assert "os:system" in (run / "report.md").read_text()  # shown as what the file says, never run


def test_trust_model_runs_exactly_the_factory_named(tmp_path, sentinel, capsys):
    evil = _evil_specs(sentinel)[0]
    run = tmp_path / "run"
    _foreign_run(run, evil)
    code, _, err = run_cli(["validate", str(run), "--trust-model", "os:system:command=touch elsewhere", "--steps",
                         "1", "--threads", "1", "--no-progress"], capsys)
    assert code == 2 and "is not the model" in _one_error_line("validate", err)
    assert not sentinel.exists()
    code, _, err = run_cli(["validate", str(run), "--trust-model", evil, "--steps", "1", "--threads", "1",
                         "--no-progress"], capsys)
    assert sentinel.exists()  # the user opted in: the factory ran (and returned no model)
    assert code == 2 and "returned int, expected a torch.nn.Module" in _one_error_line("validate", err)


def test_trust_model_needs_the_storage_it_applies_to(tmp_path, capsys):
    code, _, err = run_cli(["report", str(tmp_path), "--trust-model", TRUSTED], capsys)
    assert code == 2 and "--trust-model needs --storage" in _one_error_line("report", err)


def test_a_spec_in_a_file_that_is_no_string_is_refused_naming_the_file(tmp_path, capsys):
    run = tmp_path / "run"
    _foreign_run(run, "tiny_cnn")
    (run / "run.json").write_text(json.dumps({**_run_config("tiny_cnn"), "model": ["os", "system"]}))
    code, _, err = run_cli(_four_commands(run)["validate"], capsys)
    assert code == 2 and "run.json: model must be a model spec string" in _one_error_line("validate", err)


@pytest.fixture
def user_factories(tmp_path, monkeypatch):
    """A module of user factories: a tiny model, and factories that fail in the ways a factory can."""
    folder = tmp_path / "factories"
    folder.mkdir()
    (folder / f"{USER_MODULE}.py").write_text(textwrap.dedent("""
        import os
        import signal
        import sys
        import time

        from precsearch.models.tiny import tiny_cnn

        def tiny():
            return tiny_cnn()

        def slow(seconds):
            time.sleep(seconds)
            return tiny_cnn()

        def base():
            raise BaseException("x")

        def interrupt():
            raise KeyboardInterrupt

        def leave():
            sys.exit(0)

        def signalled():
            signal.raise_signal(signal.SIGINT)  # to this thread: a process-wide kill may land on another one
            time.sleep(5)
        """))
    (folder / "precsearch_test_import_fails.py").write_text("LIMIT = 1 / 0\n\ndef net():\n    pass\n")
    (folder / "precsearch_test_syntax.py").write_text("def net(:\n    pass\n")
    monkeypatch.syspath_prepend(str(folder))
    for name in (USER_MODULE, "precsearch_test_import_fails", "precsearch_test_syntax"):
        monkeypatch.delitem(sys.modules, name, raising=False)
    return folder


@pytest.mark.slow  # a two-trial search with a user factory, then validate, report, train, resume: 25 s
def test_a_factory_named_on_the_command_line_runs_in_all_four_commands(tmp_path, user_factories, capsys):
    run = tmp_path / "run"
    code, _, err = run_cli(["search", TRUSTED, "--out", str(run), "--proxy-steps", "2", "--trials", "2",
                         "--no-progress", "--batch-size", "16", "--proxy-seeds", "1", *FAST], capsys)
    assert code == 0, err
    assert json.loads((run / "run.json").read_text())["model"] == TRUSTED
    commands = _four_commands(run)
    code, _, err = run_cli(commands["validate"], capsys)
    assert code == 2 and "--trust-model" in _one_error_line("validate", err)
    code, out, err = run_cli([*commands["validate"], "--trust-model", TRUSTED], capsys)
    assert code == 0, err
    assert (run / "fidelity.csv").is_file()
    code, out, err = run_cli([*commands["report"], "--trust-model", TRUSTED], capsys)
    assert code == 0, err
    assert "rebuilt from the storage" in out
    code, out, err = run_cli(["train", TRUSTED, *commands["train"][2:]], capsys)
    assert code == 0, err
    assert out.startswith("trained: 1 steps")
    code, _, err = run_cli(["search", TRUSTED, *commands["search"][2:], "--proxy-seeds", "1"], capsys)
    assert code == 0, err


# ---------------------------------------------------------------------- 2. a policy's model is checked


def test_a_policy_made_for_another_model_is_refused_before_the_data_is_loaded(tmp_path, capsys):
    policy = tmp_path / "policy.json"
    Policy(model="tiny_cnn", input_shape=(3, 8, 8), batch_size=16).save(policy)
    metrics = tmp_path / "m.csv"
    code, _, err = run_cli(["train", "narrow_cnn", "--policy", str(policy), "--steps", "1", "--metrics", str(metrics),
                         *FAST], capsys)
    assert code == 2
    assert "was made for model 'tiny_cnn', not 'narrow_cnn'" in _one_error_line("train", err)
    assert not metrics.exists()


def test_the_policy_model_is_honoured_spelled_any_way(tmp_path, capsys):
    policy = tmp_path / "policy.json"
    Policy(model="tiny_cnn:width=1", input_shape=(3, 8, 8), batch_size=16).save(policy)
    code, out, err = run_cli(["train", " tiny_cnn : width = 1.0 ", "--policy", str(policy), "--steps", "1", *FAST],
                          capsys)
    assert code == 0, err
    assert out.startswith("trained: 1 steps")


# ---------------------------------------------------------------------------------- 3. factory errors


@pytest.mark.parametrize(("factory", "phrase"), [
    ("precsearch_test_import_fails:net", "importing module 'precsearch_test_import_fails' for model factory "
                                         "'precsearch_test_import_fails:net' raised ZeroDivisionError: division by "
                                         "zero at"),
    ("precsearch_test_syntax:net", "'precsearch_test_syntax:net' raised SyntaxError: invalid syntax "
                                   "(precsearch_test_syntax.py, line 1) at "),
    (f"{USER_MODULE}:base", f"model factory '{USER_MODULE}:base' raised BaseException: x at"),
    (f"{USER_MODULE}:interrupt", f"model factory '{USER_MODULE}:interrupt' raised KeyboardInterrupt at"),
    (f"{USER_MODULE}:leave", f"model factory '{USER_MODULE}:leave' raised SystemExit: 0 at"),
])
def test_a_factory_that_fails_exits_or_interrupts_itself_is_one_line(factory, phrase, tmp_path, user_factories,
                                                                      capsys):
    metrics = tmp_path / "m.csv"
    code, out, err = run_cli(["train", factory, "--steps", "1", "--metrics", str(metrics), *FAST], capsys)
    assert code == 2, err
    line = _one_error_line("train", err)
    assert phrase in line
    assert "stopped by" not in err and out == ""
    assert not metrics.exists()


def test_a_real_sigint_while_a_factory_runs_still_stops_the_command(user_factories):
    """In a process of its own, as a user's command, with SIGINT's default disposition: a test session started in
    the background by a shell (``make test &``) ignores SIGINT, and a Python started so installs no handler."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(user_factories), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, "-m", "precsearch", "train", f"{USER_MODULE}:signalled", "--steps", "1",
                           *FAST], env=env, capture_output=True, text=True, timeout=120,
                          preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    assert done.returncode == 130, done.stderr
    assert done.stderr.strip() == "precsearch train: stopped by SIGINT"


def test_the_factory_time_is_not_training_time(tmp_path, user_factories, capsys):
    seconds = 3.0
    metrics = tmp_path / "m.csv"
    start = time.perf_counter()
    code, out, err = run_cli(["train", f"{USER_MODULE}:slow:seconds={seconds}", "--steps", "1", "--recipe", "proxy",
                           "--metrics", str(metrics), *FAST], capsys)
    assert code == 0, err
    assert time.perf_counter() - start >= seconds  # the factory slept in this call ...
    training = float(re.search(r"1 steps in ([0-9.]+) s", out).group(1))
    assert training < seconds  # ... and the time reported leaves its sleep out (one step of tiny_cnn at 8 px)
    logged = float(metrics.read_text().splitlines()[-1].split(",")[-1])
    assert logged <= training + 0.1


# --------------------------------------------------------------- 4. sizes and spec values, before work


TRAIN = ["--steps", "1", "--metrics", "{tmp}/m.csv", "--device", "cpu", "--threads", "1"]
SMALL = ["--image-size", "8"]


@pytest.mark.parametrize(("argv", "phrase"), [
    (["train", "resnet18:width=1e9", *SMALL, *TRAIN], "too large for any memory"),
    (["train", "tiny_cnn:width=1e9", *SMALL, *TRAIN], "too large for any memory"),
    (["train", "tiny_cnn:classes=1e15", *SMALL, *TRAIN], "more than this machine's"),
    (["train", "tiny_cnn", "--image-size", "100000", *TRAIN], "images of 3x100000x100000 needs at least"),
    (["train", "tiny_cnn:width=1_0", *SMALL, *TRAIN], "write the number in plain digits, without underscores (10)"),
    (["train", "tiny_cnn:width=1e-9", *SMALL, *TRAIN],
     "leaves a layer of tiny_cnn with no channels; give width >= 0.03125"),
    (["train", "resnet18:width=1e-9", *SMALL, *TRAIN], "give width >= 0.0078125"),
    (["train", "shufflenet_v2:width=0.01", *SMALL, *TRAIN], "leaves a layer of shufflenet_v2 with no channels"),
    (["train", "tiny_cn", *SMALL, *TRAIN], "unknown model 'tiny_cn' (did you mean tiny_cnn?)"),
    (["search", "tiny_cnn", "--space", "{tmp}/huge.yaml", "--out", "{tmp}/out", "--proxy-steps", "2",
      "--no-progress", "--device", "cpu"], "images of 3x100000x100000 needs at least"),
    (["sensitivity", "tiny_cnn", "--image-size", "100000", "--out", "{tmp}/out", "--device", "cpu"],
     "images of 3x100000x100000 needs at least"),
])
def test_sizes_and_spec_values_are_refused_in_one_line_before_any_work(argv, phrase, tmp_path, capsys):
    (tmp_path / "huge.yaml").write_text(yaml.safe_dump({**PAPER_SPACE, "proxy": {"image_size": 100000}}))
    start = time.perf_counter()
    code, _, err = run_cli([part.format(tmp=tmp_path) for part in argv], capsys)
    seconds = time.perf_counter() - start
    assert code == 2, err
    assert phrase in _one_error_line(argv[0], err)
    assert seconds < 2.0
    assert not (tmp_path / "m.csv").exists() and not (tmp_path / "out").exists()


def test_the_memory_floor_is_weights_one_batch_and_the_largest_activation(monkeypatch):
    batch, size = 4, 16
    model = models.build("tiny_cnn")
    weights = sum(t.numel() * t.element_size() for t in (*model.parameters(), *model.buffers()))
    outputs = []
    hooks = [module.register_forward_hook(lambda m, i, o: outputs.append(o.numel() * o.element_size()))
             for module in model.modules()]
    with torch.no_grad():
        model(torch.zeros(batch, 3, size, size))
    for hook in hooks:
        hook.remove()
    floor = weights + batch * 3 * size * size * 4 + max(outputs)
    monkeypatch.setattr(models, "machine_memory", lambda: floor)
    models.check_fits("tiny_cnn", batch, size)  # exactly enough
    monkeypatch.setattr(models, "machine_memory", lambda: floor - 1)
    with pytest.raises(PrecsearchError, match="one batch .* weights .* its largest activation"):
        models.check_fits("tiny_cnn", batch, size)


def test_a_user_factory_is_not_built_to_price_it_only_its_batch(user_factories, monkeypatch):
    monkeypatch.setattr(models, "machine_memory", lambda: 2**20)
    models.check_fits(f"{USER_MODULE}:base", 1, 8)  # would raise BaseException if it were called
    with pytest.raises(PrecsearchError, match=r"needs at least .* \(one batch"):
        models.check_fits(f"{USER_MODULE}:base", 64, 64)
    assert USER_MODULE not in sys.modules


def test_numbers_of_a_spec_are_plain_digits_and_strings_keep_their_underscores():
    with pytest.raises(PrecsearchError, match="without underscores"):
        models.parse_model_spec("resnet18:width=0_5")
    with pytest.raises(PrecsearchError, match="plain digits"):
        models.parse_model_spec("resnet18:classes=\u0661\u0660")  # Arabic-Indic 10, which int() reads
    assert models.parse_model_spec("pkg.mod:make:mode=fast_path") == ("pkg.mod:make", {"mode": "fast_path"})


def test_a_width_that_leaves_a_layer_no_channels_is_refused_not_widened():
    assert scale_channels(24, 1 / 48) == 1  # the smallest width that gives 24 channels one
    with pytest.raises(TooNarrow, match="give width >= "):
        scale_channels(24, 0.01)
    for name in models.NAMES:
        with pytest.raises(PrecsearchError, match="give width >= ") as refused:
            models.build(name, width=1e-6)
        smallest = float(str(refused.value).rsplit(">= ", 1)[1])
        models.build(name, width=smallest)  # the bound it names builds
