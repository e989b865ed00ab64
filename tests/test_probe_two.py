"""Every input honoured or refused, second probe (issue 70).

One table of inputs the CLI refuses: each row is a direct call of ``precsearch.cli.main`` that must exit 2 with
exactly one line on stderr (no usage block, no traceback) holding a phrase, and leave its working folder, its
inputs and any run directory it reads as they were. Then tests of the inputs that are honoured: an LSTM traced
and rounded, 16-bit PNGs at their own pixel values, scaled formats rounded over given values, ``--jobs`` capped,
a search without a pick exiting 3. Reference values come from torch's own float8 casts and PIL's own pixels.
"""

from __future__ import annotations

import contextlib
import errno
import json
import math
import os
import re
import sys
import textwrap
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml
from cli_runs import run_cli
from PIL import Image
from torch import nn

from precsearch.config.policy import Policy
from precsearch.config.spaces import PAPER_SPACE, parse_space
from precsearch.errors import PrecsearchError
from precsearch.search.rundir import SEARCH_FORMAT
from precsearch.search.settings import SearchConfig

USER_MODULE = "precsearch_probe_two_models"
FAST = ["--image-size", "8", "--device", "cpu", "--threads", "1"]
TRAIN = ["train", "tiny_cnn", "--steps", "1", *FAST]
SEARCH = ["search", "tiny_cnn", "--out", "{tmp}/run", "--proxy-steps", "2", "--trials", "1", "--no-progress", *FAST]
HUGE_ID = "x" * 200_000
FIFOS = ("fifo.json", "fiforun/trials/trial_0000.json")


def _space(folder: Path, name: str, **changes) -> None:
    (folder / name).write_text(yaml.safe_dump({**PAPER_SPACE, **changes}))


def _policy(folder: Path, name: str, **changes) -> None:
    """A policy file for tiny_cnn at 8 px as Policy.save writes it, with ``changes`` written over its fields."""
    data = Policy(input_shape=(3, 8, 8), batch_size=16).to_dict()
    (folder / name).write_text(json.dumps({**data, **changes}))


def _run_dir(folder: Path, policy: str) -> None:
    """A run directory of a search of tiny_cnn on the digits, whose one trial records ``policy`` as its file."""
    folder.mkdir(parents=True)
    space = {**PAPER_SPACE, "proxy": {"steps": 2, "batch_size": 16, "image_size": 8}}
    (folder / "run.json").write_text(json.dumps({
        "model": "tiny_cnn", "space": space, "data": {"name": "digits", "root": None},
        "budget": {"max_memory": None, "max_accuracy_drop": None, "memory": "bytes", "confidence": 0.9},
        "seed": 0, "search_format": SEARCH_FORMAT}))
    (folder / "trials.csv").write_text("number,state,origin,trained,key,policy,val_accuracy,promotions,memory,"
                                       f"diverged\n0,COMPLETE,all-high,True,H,{policy},0.5,0,1.0,False\n")
    (folder / "pareto.csv").write_text("\n")


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """The inputs of the table's rows (read only)."""
    folder = tmp_path_factory.mktemp("probe")
    _space(folder, "report0.yaml", proxy={"report_every": 0})
    _space(folder, "image1.yaml", proxy={"image_size": 1})
    _space(folder, "momentum.yaml", proxy={"momentum": 1.5})
    _space(folder, "blowup.yaml", proxy={"blowup_factor": 0})
    _space(folder, "skipped.yaml", proxy={"max_skipped_fraction": 2})
    (folder / "nul.yaml").write_text("high: e6m9s\nlow: e4m3b4s\ndescription: a\x00b\n")
    _policy(folder, "narrow_high.json", high_format="e2m1", defaults={"weight": "e4m3b4s", "activation_grad": "e5m2s"})
    _policy(folder, "schema_text.json", schema_version="1")
    _policy(folder, "schema_true.json", schema_version=True)
    _policy(folder, "long_id.json", overrides={HUGE_ID: "e5m2s"})
    _policy(folder, "block.json", schema_version=2, formats={}, master_weights=True,
            defaults={"weight": "e4m3fn@block1000000000"})
    _policy(folder, "delayed.json", schema_version=2, formats={}, master_weights=True,
            defaults={"activation": "e4m3fn@tensor:delayed999999999999"})
    Policy(input_shape=(3, 8, 8), batch_size=16).save(folder / "outside" / "trial_0000.json")
    _run_dir(folder / "outrun", str(folder / "outside" / "trial_0000.json"))  # the file it names exists ...
    _run_dir(folder / "gonerun", str(folder / "gone" / "trial_0000.json"))  # ... and here it does not
    _run_dir(folder / "passwdrun", "/etc/passwd")
    _run_dir(folder / "fiforun", str(folder / FIFOS[1]))
    (folder / "fiforun" / "trials").mkdir()
    for fifo in FIFOS:
        os.mkfifo(folder / fifo)
    return folder


@contextlib.contextmanager
def _fifos_answered(folder: Path):
    """While the block runs, a thread that opens each FIFO of ``folder`` for writing once a reader has it open,
    and closes it: a command that blocks reading one reads an empty file instead of hanging the test session."""
    done = threading.Event()

    def answer() -> None:
        waiting = [folder / fifo for fifo in FIFOS]
        while waiting and not done.is_set():
            for path in list(waiting):
                try:
                    os.close(os.open(path, os.O_WRONLY | os.O_NONBLOCK))
                    waiting.remove(path)
                except OSError as error:
                    if error.errno != errno.ENXIO:  # ENXIO: no reader yet
                        raise
            time.sleep(0.05)

    thread = threading.Thread(target=answer, daemon=True)
    thread.start()
    try:
        yield
    finally:
        done.set()
        thread.join()


def _listing(folder: Path) -> list[tuple[str, int]]:
    return sorted((str(path.relative_to(folder)), path.lstat().st_mtime_ns) for path in folder.rglob("*"))


# (id, argv, phrase the one error line holds). {tmp}: the row's own empty working folder; {files}: the inputs.
ROWS = [
    # 3. a policy's high format is at least as wide as its low ones: the space's rule
    ("policy-high-narrower", [*TRAIN, "--policy", "{files}/narrow_high.json"],
     "defaults.weight e4m3b4s (8 bits) is wider than high_format e2m1 (4 bits); give a format at most as wide"),
    # 5. bounds that keep a search finite
    ("search-confirm-factor", [*SEARCH, "--confirm-factor", "1e300"],
     "argument --confirm-factor: '1e300': give a number in [1, 100]"),
    ("search-proxy-seeds", [*SEARCH, "--proxy-seeds", "100000"],
     "argument --proxy-seeds: '100000': give a number of seeds in [1, 32], or auto"),
    # 6. only regular files are read: a FIFO would block
    ("train-policy-fifo", [*TRAIN, "--policy", "{files}/fifo.json"], "fifo.json is not a regular file"),
    ("train-policy-device", [*TRAIN, "--policy", "/dev/zero"], "/dev/zero is not a regular file"),
    ("validate-policy-fifo", ["validate", "{files}/fiforun", "--steps", "1", "--no-progress"],
     "trial 0 trained under policy 'trial_0000.json', which is not a file in"),
    # 7. scaled formats' sizes, refused by the spec parser
    ("formats-block-digits", ["formats", "e4m3fn@block99999999999999999999", "--round", "1"],
     "a block of 99999999999999999999 is over the limit of 4096; give @block<N> with 1 <= N <= 4096"),
    ("formats-block", ["formats", "e4m3fn@block1000000000", "--round", "1"], "a block of 1000000000 is over the"),
    ("formats-delayed", ["formats", "e4m3fn@tensor:delayed999999999999"],
     "a delayed history of 999999999999 is over the limit of 1024; give :delayed<N> with 1 <= N <= 1024"),
    ("formats-delayed-400mb", ["formats", "e4m3fn@tensor:delayed100000000"], "a delayed history of 100000000 is"),
    ("train-policy-block", [*TRAIN, "--policy", "{files}/block.json"], "a block of 1000000000 is over the limit"),
    ("train-policy-delayed", [*TRAIN, "--policy", "{files}/delayed.json"],
     "a delayed history of 999999999999 is over the limit"),
    # 8, 13. each proxy key has its real range
    ("search-report-every-0", [*SEARCH, "--space", "{files}/report0.yaml"],
     "proxy.report_every=0 must be an integer >= 1"),
    ("search-momentum", [*SEARCH, "--space", "{files}/momentum.yaml"], "proxy.momentum=1.5 must be a number in [0, 1)"),
    ("search-blowup", [*SEARCH, "--space", "{files}/blowup.yaml"], "proxy.blowup_factor=0 must be a number > 1"),
    ("search-skipped", [*SEARCH, "--space", "{files}/skipped.yaml"],
     "proxy.max_skipped_fraction=2 must be a number in [0, 1]"),
    # 9. image sizes priced like widths
    ("train-image-1", ["train", "tiny_cnn", "--image-size", "1", "--device", "cpu", "--metrics", "{tmp}/m.csv"],
     "tiny_cnn cannot take images of 1x1 (RuntimeError: "),
    ("search-proxy-image-1", ["search", "tiny_cnn", "--out", "{tmp}/run", "--space", "{files}/image1.yaml",
                              "--device", "cpu"], "give an image size >= 2"),
    # 10. a NUL byte in a space
    ("search-space-nul", [*SEARCH, "--space", "{files}/nul.yaml"],
     "nul.yaml:3: character U+0000 (at offset 39) is not allowed in YAML"),
    # 12. a run directory opens nothing outside itself, and says the same whether it exists or not
    ("validate-outside", ["validate", "{files}/outrun", "--steps", "1", "--no-progress"],
     "which is not a file in"),
    ("validate-outside-gone", ["validate", "{files}/gonerun", "--steps", "1", "--no-progress"],
     "which is not a file in"),
    ("validate-passwd", ["validate", "{files}/passwdrun", "--steps", "1", "--no-progress"],
     "trial 0 trained under policy 'passwd', which is not a file in"),
    # 14. the versions a policy may say
    ("policy-schema-text", [*TRAIN, "--policy", "{files}/schema_text.json"],
     "schema_version is '1' (str); give an integer, 1 or 2"),
    ("policy-schema-true", [*TRAIN, "--policy", "{files}/schema_true.json"],
     "schema_version is True (bool); give an integer, 1 or 2"),
    # 15. a user's value is echoed cut short
    ("policy-long-override", [*TRAIN, "--policy", "{files}/long_id.json"],
     f"override '{'x' * 79}... (200,002 characters)"),  # repr's first 80 characters
    # 16. an empty path is no path
    ("search-out-empty", ["search", "tiny_cnn", "--out", ""], "argument --out: '': give a path"),
    ("baselines-out-empty", ["baselines", "tiny_cnn", "--out", ""], "argument --out: '': give a path"),
    ("sensitivity-out-empty", ["sensitivity", "tiny_cnn", "--out", ""], "argument --out: '': give a path"),
    ("train-metrics-empty", [*TRAIN, "--metrics", ""], "argument --metrics: '': give a path"),
    # 17. argparse's refusals are one line too
    ("search-trials-0", [*SEARCH, "--trials", "0"], "argument --trials: '0': give an integer >= 1"),
    ("train-lr-nan", [*TRAIN, "--lr", "nan"], "argument --lr: 'nan' is not a finite number"),
    ("search-confidence", [*SEARCH, "--confidence", "1.5"], "argument --confidence: '1.5': give a number in [0.5, 1)"),
    # 18. a delayed scale has no history to come from in one rounding
    ("formats-round-delayed", ["formats", "e4m3fn@tensor:delayed16", "--round", "1", "2"],
     "a delayed scale comes from the amaxes of earlier roundings"),
]


@pytest.mark.parametrize(("argv", "phrase"), [pytest.param(*row[1:], id=row[0]) for row in ROWS])
def test_a_refused_input_is_one_line_exit_2_and_changes_nothing(argv, phrase, files, tmp_path, capsys,
                                                                monkeypatch):
    monkeypatch.chdir(tmp_path)  # an empty --out would be this folder
    before = _listing(files)
    filled = [part.format(tmp=tmp_path, files=files) for part in argv]
    with _fifos_answered(files):
        code, out, err = run_cli(filled, capsys)
    assert code == 2, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"precsearch {argv[0]}: error: "), err
    assert phrase in lines[0]
    assert len(lines[0]) < 700
    assert out == ""
    assert list(tmp_path.iterdir()) == []
    assert _listing(files) == before


def _validate_line(files: Path, run: str, capsys, monkeypatch, tmp_path) -> str:
    monkeypatch.chdir(tmp_path)
    code, _, err = run_cli(["validate", str(files / run), "--steps", "1", "--no-progress"], capsys)
    assert code == 2
    return err.strip().replace(str(files / run), "RUN")


def test_whether_a_file_outside_the_run_exists_changes_no_message(files, capsys, monkeypatch, tmp_path):
    assert (files / "outside" / "trial_0000.json").is_file() and not (files / "gone").exists()
    assert _validate_line(files, "outrun", capsys, monkeypatch, tmp_path) == _validate_line(
        files, "gonerun", capsys, monkeypatch, tmp_path)


# ------------------------------------------------------------------------------ 1. a recurrent module


class _ConvLSTM(nn.Module):
    """conv, relu, flatten, LSTM, Linear: the fc reads the LSTM's last cell state, inside its nested output."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3, padding=1)
        self.relu = nn.ReLU()
        self.lstm = nn.LSTM(4 * 8, 16, batch_first=True)
        self.fc = nn.Linear(16, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.relu(self.conv(x)).flatten(2).reshape(x.shape[0], 8, -1)
        out, (h, c) = self.lstm(x)
        return self.fc(c[-1])


def test_an_lstm_is_one_op_with_its_tensors_and_its_nested_output_is_rounded(caplog):
    from precsearch.graph.tracing import trace
    from precsearch.runtime.model import apply_policy

    torch.manual_seed(0)
    model, x = _ConvLSTM(), torch.randn(4, 3, 8, 8)
    graph = trace(model, x[:2], batch_size=4)
    assert [op.name for op in graph.ops] == ["x", "conv", "relu", "lstm", "fc"]
    lstm = next(op for op in graph.ops if op.name == "lstm")
    assert lstm.outputs == ("lstm:activation", "lstm:activation1", "lstm:activation2")  # out, h, c
    assert graph.tensors["lstm:activation2"].shape == (1, 4, 16) and "lstm:weight_hh_l0" in graph.tensors
    assert next(op for op in graph.ops if op.name == "fc").input_tensors == ("lstm:activation2",)
    assert "lstm" in graph.unenforced()
    kinds = ("weight", "activation", "weight_grad", "activation_grad")
    policy = Policy(input_shape=(3, 8, 8), batch_size=4, defaults=dict.fromkeys(kinds, "e5m2"),
                    promotion_threshold=None)
    seen: dict[str, torch.Tensor] = {}
    model.fc.register_forward_pre_hook(lambda module, args: seen.__setitem__("c", args[0].detach().clone()))
    with caplog.at_level("WARNING"):
        wrapped = apply_policy(model, policy, x)
    assert "lstm" in wrapped.unenforced and "(lstm: runs aten." in caplog.text  # one WARNING names it
    seen.clear()  # apply_policy's own trace ran the model
    wrapped(x)
    c = seen["c"]
    assert torch.equal(c, c.to(torch.float8_e5m2).float())  # the cell state reaching fc, rounded as torch casts
    assert not torch.equal(c, model.lstm(model.relu(model.conv(x)).flatten(2).reshape(4, 8, -1))[1][1][-1])


def test_trace_lists_the_lstm_and_warns_that_it_is_rounded_at_its_boundary(tmp_path, monkeypatch, capsys):
    (tmp_path / f"{USER_MODULE}.py").write_text(textwrap.dedent("""
        from tests.test_probe_two import _ConvLSTM

        def conv_lstm():
            return _ConvLSTM()
        """))
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[1]))
    monkeypatch.delitem(sys.modules, USER_MODULE, raising=False)
    code, out, err = run_cli(["trace", f"{USER_MODULE}:conv_lstm", "--input-shape", "3,8,8", "--batch-size", "4"],
                          capsys)
    assert code == 0, err
    assert "5 ops" in out and "lstm:activation2" in out and "lstm:weight_ih_l0" in out
    assert re.search(r"WARNING: 1 op\(s\) rounded at their boundary only.*lstm \(runs aten\.", out)


# ----------------------------------------------------------------------------------- 2. 16-bit PNGs


def test_a_16_bit_png_keeps_its_dynamic_range(tmp_path):
    from precsearch.train.data import load_dataset

    gradient = (np.arange(8 * 8, dtype=np.uint32).reshape(8, 8) * 1000 + 500).astype(np.uint16)  # 500 .. 63500
    for split in ("train", "val"):
        for index, name in enumerate(("a", "b")):
            (tmp_path / split / name).mkdir(parents=True)
            Image.fromarray(gradient if index == 0 else gradient[::-1].copy()).save(tmp_path / split / name / "g.png")
    with Image.open(tmp_path / "train" / "a" / "g.png") as image:
        assert image.mode == "I;16"
        pixels = np.asarray(image).astype(np.float64) / 65535  # PIL's own values of the file
    train, _ = load_dataset("imagefolder", root=tmp_path, image_size=8)
    raw = train.images * train.std.view(1, -1, 1, 1) + train.mean.view(1, -1, 1, 1)
    for channel in range(3):
        np.testing.assert_allclose(raw[0, channel].numpy(), pixels, rtol=0, atol=1e-6)
    assert len(np.unique(raw[0, 0].numpy().round(5))) == 64  # every level kept: none saturated


def test_32_bit_integer_pixels_are_refused_in_one_line(tmp_path):
    from precsearch.train.data import load_dataset

    for split in ("train", "val"):
        (tmp_path / split / "a").mkdir(parents=True)
        Image.fromarray(np.full((8, 8), 70000, dtype=np.int32)).save(tmp_path / split / "a" / "i.tif")
    with pytest.raises(PrecsearchError, match=r"i\.tif has 32-bit integer pixels \(mode I\), whose range"):
        load_dataset("imagefolder", root=tmp_path, image_size=8)


# ------------------------------------------------------------------ 3, 15. the shared rules, in Python


def test_a_policy_and_a_space_refuse_a_wider_low_format_by_one_rule():
    with pytest.raises(PrecsearchError) as policy:
        Policy(high_format="e4m3b4s", defaults={"weight": "fp16"})
    with pytest.raises(PrecsearchError) as space:
        parse_space({**PAPER_SPACE, "high": "fp16", "low": "fp32"}, where="space")
    assert str(policy.value) == ("policy: defaults.weight fp16 (16 bits) is wider than high_format e4m3b4s (8 "
                                 "bits); give a format at most as wide as the high one")
    assert str(space.value) == ("space: low.weight fp32 (32 bits) is wider than high fp16 (16 bits); give a format at "
                                "most as wide as the high one")
    assert Policy(high_format="e6m9s", defaults={"weight": "e4m3fn@tensor"}).high_format == "e6m9s"  # its element
    # fp32 is no low format in a policy: its tensors are not rounded, so never promoted
    assert Policy(high_format="e6m9s", defaults={"weight": "fp32", "activation": "e8m23"}).high_format == "e6m9s"


# ------------------------------------------------------------------------- 9. the smallest image size


@pytest.mark.parametrize(("batch", "smallest"), [(2, 2), (1, 6)])
def test_the_smallest_image_size_named_is_the_smallest_tiny_cnn_trains_on(batch, smallest):
    """A training forward of tiny_cnn pools 1x1 images to nothing; at batch 1 its last BatchNorm needs the 6x6
    images that leave it two values a channel."""
    from precsearch.models import build, check_fits

    with pytest.raises(PrecsearchError, match=f"give an image size >= {smallest}$"):
        check_fits("tiny_cnn", batch, 1)
    check_fits("tiny_cnn", batch, smallest)
    model = build("tiny_cnn").train()
    model(torch.zeros(batch, 3, smallest, smallest))  # a real training forward takes it ...
    with pytest.raises((RuntimeError, ValueError)):
        model(torch.zeros(batch, 3, smallest - 1, smallest - 1))  # ... and not one pixel less


# ------------------------------------------------------------------------------------ 4. --jobs capped


def test_jobs_are_capped_at_what_the_trials_and_cpus_can_use(caplog):
    from precsearch.search.settings import usable_jobs

    with caplog.at_level("INFO", logger="precsearch.search.settings"):
        config = SearchConfig("tiny_cnn", parse_space(PAPER_SPACE), trials=1, jobs=1000)
    assert config.jobs == 1
    assert caplog.messages == [f"--jobs 1000: 1 worker process(es), as many as 1 trial(s) on {os.cpu_count()} "
                               "CPU(s) can use"]
    assert usable_jobs(1000, 1000) == os.cpu_count() and usable_jobs(2, 1000) == min(2, os.cpu_count())
    with pytest.raises(PrecsearchError, match=r"confirmation factor 1e\+300 must be in \[1, 100\]"):
        SearchConfig("tiny_cnn", parse_space(PAPER_SPACE), confirm_factor=1e300)
    with pytest.raises(PrecsearchError, match=r"proxy_seeds=100000 must be in \[1, 32\]"):
        SearchConfig("tiny_cnn", parse_space(PAPER_SPACE), proxy_seeds=100_000)


@pytest.mark.slow  # a one-trial search: 15 s on 2 cores
def test_a_search_with_jobs_1000_and_one_trial_runs_in_this_process(tmp_path, capsys, monkeypatch, caplog):
    import multiprocessing

    started: list[object] = []
    monkeypatch.setattr(multiprocessing.context.SpawnProcess, "start", lambda self: started.append(self))
    with caplog.at_level("INFO", logger="precsearch.search.settings"):
        code, _, err = run_cli([*[part.format(tmp=tmp_path) for part in SEARCH], "--jobs", "1000", "--proxy-seeds",
                             "1", "--batch-size", "16"], capsys)
    assert code in (0, 3), err
    assert "--jobs 1000: 1 worker process(es), as many as 1 trial(s)" in caplog.text
    assert started == [] and (tmp_path / "run" / "trials.csv").is_file()


# ------------------------------------------------------------------------- 18. scaled formats, rounded


VALUES = [1000.0, 2000.0, 3000.0, 0.001, -7.5]


def _rounded(spec: str, capsys) -> list[float]:
    """The rounded column of ``precsearch formats SPEC --round VALUES`` (x, rounded, scale on each line)."""
    code, out, err = run_cli(["formats", spec, "--round", *map(str, VALUES)], capsys)
    assert code == 0, err
    rows = [line.split() for line in out.strip().splitlines()[1:]]
    assert [float(row[0]) for row in rows] == pytest.approx(VALUES)
    return [float(row[1]) for row in rows]


def _torch_e4m3fn(values: list[float], scale: list[float]) -> list[float]:
    """torch's own float8_e4m3fn cast of ``values / scale``, saturated at 448 first (torch 2.13's CPU cast
    saturates, torch 2.11's gives NaN past it), times ``scale``."""
    x, s = torch.tensor(values), torch.tensor(scale)
    return ((x / s).clamp(-448, 448).to(torch.float8_e4m3fn).float() * s).tolist()


@pytest.mark.parametrize("spec", ["e4m3fn@tensor", "e4m3fn@row"])
def test_formats_rounds_values_as_one_tensor_with_the_scale_of_their_amax(spec, capsys):
    scale = 2.0 ** math.ceil(math.log2(max(map(abs, VALUES)) / 448))  # the least power of two with amax / s <= max
    assert scale == 8
    assert _rounded(spec, capsys) == _torch_e4m3fn(VALUES, [scale] * len(VALUES))


def test_formats_rounds_each_block_with_the_scale_of_its_amax(capsys):
    blocks = [VALUES[0:2], VALUES[2:4], VALUES[4:]]
    scales = [2.0 ** (math.floor(math.log2(max(map(abs, block)))) - 8) for block in blocks for _ in block]  # OCP MX
    assert scales == [4, 4, 8, 8, 2**-6]
    assert _rounded("e4m3fn@block2", capsys) == _torch_e4m3fn(VALUES, scales)


# ------------------------------------------------------------------------- 11. bad checkpoints on resume


@pytest.mark.slow  # a one-trial search, then its resume: 20 s on 2 cores
def test_a_resume_names_every_checkpoint_naming_code_and_runs_nothing(tmp_path, capsys):
    argv = [part.format(tmp=tmp_path) for part in SEARCH] + ["--proxy-seeds", "1", "--batch-size", "16"]
    code, _, err = run_cli(argv, capsys)
    assert code in (0, 3), err
    folder = tmp_path / "run" / "checkpoints"
    folder.mkdir(exist_ok=True)
    for name in ("a.pt", "b.pt"):
        torch.save({"tag": "x", "state": b"x", "progress": {}, "code": os.system}, folder / name)
    def files_of_the_run() -> list[tuple[str, int]]:  # its lock files aside, which every command takes
        return [item for item in _listing(tmp_path / "run") if not item[0].startswith(".precsearch")]

    before = files_of_the_run()
    code, out, err = run_cli([*argv, "--resume", "--trials", "2"], capsys)
    assert code == 2
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in err and "Trial" not in err, err  # no Optuna "Trial 4 failed"
    assert f"2 checkpoint(s) in {folder} are not ones precsearch wrote: a.pt, b.pt (the first: " in lines[0]
    assert "posix.system" in lines[0] and "delete them" in lines[0]
    assert files_of_the_run() == before  # the journal and trials.csv too: no trial ran


# ------------------------------------------------------------------------- 20. a search without a pick


@pytest.mark.slow  # a three-trial search: 12 s on 2 cores
def test_a_search_without_a_pick_exits_3_and_says_why(tmp_path, capsys):
    """No assignment holds 1% of all-high's memory: the search ends without a pick."""
    code, out, err = run_cli(["search", "tiny_cnn", "--trials", "3", "--proxy-steps", "4", "--image-size", "8",
                              "--batch-size", "16", "--max-memory", "0.01", "--out", str(tmp_path / "run"),
                              "--no-progress", "--device", "cpu", "--threads", "1"], capsys)
    assert code == 3, err
    assert err.strip().splitlines()[-1].startswith("precsearch search: no pick, best.json not written: ")
    assert not (tmp_path / "run" / "best.json").exists() and (tmp_path / "run" / "trials.csv").is_file()


def test_search_help_documents_exit_status_3(capsys):
    code, out, _ = run_cli(["search", "--help"], capsys)
    assert code == 0
    assert "3 when the search ends without one" in " ".join(out.split())
