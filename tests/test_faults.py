"""A full disk or a cut journal loses nothing.

A search, a train and a report that meet a full disk (``RLIMIT_FSIZE`` in a subprocess, which makes writes past
the limit fail with EFBIG, or an ENOSPC injected at one fsync) say so in one line and exit 2; ``--resume`` then
finishes the study with every trial finished once. A journal cut anywhere resumes to the same study: the oracle
is the uncut run of the same seeds (a module fixture), and the interrupted count the summary must print is read
from the cut journal itself.
"""

from __future__ import annotations

import contextlib
import errno
import io
import json
import os
import re
import resource
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

import pandas as pd
import pytest
from optuna.storages.journal._storage import JournalOperation

from precsearch.cli import main
from precsearch.cli.search import summarize
from precsearch.files import TEMP_SUFFIX
from precsearch.formats.runner import KernelRunner, KernelSettings, Runtime

# 3 trials out of the 4 distinct seeds the paper's sweep queues: the budget ends with a seed still waiting, so a
# retry queued behind it would never run
# seed 4: a search whose all-high point is on the front (``finished`` needs it there), under readings that
# recompute batch norm's statistics
SEARCH = ["--eager-kernels", "search", "tiny_cnn", "--trials", "3", "--proxy-steps", "4", "--proxy-seeds", "1",
          "--confirm-factor", "1", "--image-size", "8", "--batch-size", "16", "--device", "cpu", "--threads", "1",
          "--no-progress", "--seed", "4"]
ONE_SEED_WARNING = "one seed per proxy"  # the only other line a search with --proxy-seeds 1 prints on stderr
SUMMARY = re.compile(r"(\d+) trials \((\d+) complete, \d+ diverged, \d+ stopped at a rung, (\d+) failed, "
                     r"(\d+) interrupted and retried\)")


@dataclass
class Finished:
    """The uncut run: its folder, journal, per-key proxy accuracy, Pareto keys, the all-high key, and the file
    each fsync of the run went to, in order."""

    out: Path
    journal: bytes
    accuracy: dict[str, float]
    pareto: list[str]
    all_high: str
    fsyncs: list[str]


@pytest.fixture(scope="module", autouse=True)
def eager_kernels():
    """Rounding kernels run eagerly here (``--eager-kernels`` in the subprocesses): these tests are about files,
    and compiling costs more than the tiny proxies."""
    with Runtime(KernelRunner(KernelSettings(enabled=False))).as_default():
        yield


@pytest.fixture(scope="module")
def finished(space_file, tmp_path_factory):
    out = tmp_path_factory.mktemp("finished") / "run"
    fsyncs: list[str] = []
    real_fsync = os.fsync

    def recording(fd):
        path = Path(os.readlink(f"/proc/self/fd/{fd}"))
        if path.name.startswith(".") and path.name.endswith(TEMP_SUFFIX):  # an atomic write's .<name>.<random>.tmp
            path = path.with_name(path.name[1:-len(TEMP_SUFFIX)].rsplit(".", 1)[0])
        fsyncs.append(path)
        return real_fsync(fd)

    with pytest.MonkeyPatch.context() as patch, contextlib.redirect_stdout(io.StringIO()):
        patch.setattr(os, "fsync", recording)
        assert main([*SEARCH, "--space", str(space_file), "--out", str(out)]) == 0
    trials = pd.read_csv(out / "trials.csv", keep_default_na=False)
    assert (trials["state"] == "COMPLETE").all() and len(trials) == 3
    pareto = sorted(pd.read_csv(out / "pareto.csv")["key"])
    all_high = trials[trials["decisions"].str.fullmatch("H+")]["key"].item()
    assert all_high in pareto  # the point the issue saw lost: it must be on this front for the tests to mean it
    accuracy = trials.set_index("key")["val_accuracy"].to_dict()
    return Finished(out, (out / "study.journal").read_bytes(), accuracy, pareto, all_high,
                    [str(path.relative_to(out)) for path in fsyncs])


def _records(journal: bytes) -> list[tuple[int, int, dict]]:
    """(start, end, record) of every whole line."""
    rows, start = [], 0
    for line in journal.splitlines(keepends=True):
        if line.endswith(b"\n"):
            rows.append((start, start + len(line), json.loads(line)))
        start += len(line)
    return rows


def _left_running(journal: bytes) -> int:
    """Trials the journal shows started and not finished, replayed here from Optuna's record layout: a trial is
    created RUNNING (with a start time) or WAITING, and set RUNNING, WAITING or finished later."""
    states: dict[int, str] = {}
    for _, _, record in _records(journal):
        if record["op_code"] == JournalOperation.CREATE_TRIAL:
            states[len(states)] = "running" if record.get("datetime_start") else "waiting"
        elif record["op_code"] == JournalOperation.SET_TRIAL_STATE_VALUES:
            states[record["trial_id"]] = {0: "running", 4: "waiting"}.get(record["state"], "finished")
    return sum(state == "running" for state in states.values())


def _copy(finished: Finished, out: Path, journal: bytes) -> Path:
    shutil.copytree(finished.out, out)
    (out / "study.journal").write_bytes(journal)
    return out


def _resume(out: Path, space_file: Path) -> tuple[int, str, str]:
    printed, errors = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(printed), contextlib.redirect_stderr(errors):
        code = main([*SEARCH, "--space", str(space_file), "--out", str(out), "--resume"])
    return code, printed.getvalue(), errors.getvalue()


def _whole(out: Path, finished: Finished, printed: str, interrupted: int) -> list[str]:
    """What differs from the uncut study (empty when nothing does): every trial finished once with the same
    result, the same front with all-high on it, and a summary counting ``interrupted`` retried trials."""
    problems = []
    trials = pd.read_csv(out / "trials.csv", keep_default_na=False)
    if not (trials["state"] == "COMPLETE").all() or sorted(trials["key"]) != sorted(finished.accuracy):
        problems.append(f"trials {trials[['number', 'state', 'key']].values.tolist()}")
    elif trials.set_index("key")["val_accuracy"].to_dict() != finished.accuracy:
        problems.append("another proxy accuracy")
    pareto = sorted(pd.read_csv(out / "pareto.csv")["key"])
    if pareto != finished.pareto or finished.all_high not in pareto:
        problems.append(f"front {pareto}")
    counts = SUMMARY.search(printed)
    expected = (str(len(finished.accuracy)), str(len(finished.accuracy)), "0", str(interrupted))
    if counts is None or counts.groups() != expected:
        problems.append(f"summary {counts and counts.group(0)}, wanted {expected}")
    return problems


def _one_error_line(stderr: str) -> str:
    lines = [line for line in stderr.splitlines() if ONE_SEED_WARNING not in line]
    assert len(lines) == 1 and "Traceback" not in stderr, stderr
    return lines[0]


# ------------------------------------------------------------------------------------------------ a cut journal


def _cuts(journal: bytes) -> dict[str, int]:
    """Named offsets covering each kind of record a cut can lose."""
    rows = _records(journal)
    completes = [index for index, (_, _, record) in enumerate(rows)
                 if record["op_code"] == JournalOperation.SET_TRIAL_STATE_VALUES and record["state"] == 1]
    seeds = [index for index, (_, _, record) in enumerate(rows) if record["op_code"] == JournalOperation.CREATE_TRIAL]

    def middle(index):
        return (rows[index][0] + rows[index][1]) // 2

    return {
        "inside the study's config": middle(1),
        "after the first seed": rows[seeds[0]][1],
        "inside the first trial's completion": middle(completes[0]),
        "before the last trial's completion": rows[completes[-1]][0],  # the case: rerun, not lost
    }


@pytest.mark.parametrize("cut", ["inside the study's config",
                                 pytest.param("after the first seed", marks=pytest.mark.slow),
                                 "inside the first trial's completion", "before the last trial's completion"])
def test_a_cut_journal_resumes_to_the_whole_study(cut, finished, space_file, tmp_path):
    journal = finished.journal[:_cuts(finished.journal)[cut]]
    out = _copy(finished, tmp_path / "run", journal)
    code, printed, errors = _resume(out, space_file)
    assert code == 0, errors
    assert _whole(out, finished, printed, _left_running(journal)) == []


SWEEP_CHUNKS = 8  # the sweep is hundreds of resumes (a few seconds each): in chunks, each within the test timeout


@pytest.mark.slow
@pytest.mark.parametrize("chunk", range(SWEEP_CHUNKS))
def test_a_journal_cut_at_every_record_boundary_and_mid_record_resumes_to_the_whole_study(chunk, finished, space_file,
                                                                                         tmp_path):
    """Every boundary and the middle of every record (records chunk, chunk + SWEEP_CHUNKS, ...). A cut inside the
    first record leaves no study: --resume refuses it in one line (the folder's results stay; a new search goes to
    another --out)."""
    failures = []
    for index, (start, end, _) in enumerate(_records(finished.journal)):
        if index % SWEEP_CHUNKS != chunk:
            continue
        for offset in (start, (start + end) // 2):
            journal = finished.journal[:offset]
            out = _copy(finished, tmp_path / f"cut{offset}", journal)
            code, printed, errors = _resume(out, space_file)
            if index == 0:
                if code != 2 or "is missing from" not in _one_error_line(errors):
                    failures.append(f"{offset}: {code} {errors}")
            elif code != 0:
                failures.append(f"{offset}: exit {code}: {errors}")
            else:
                failures += [f"{offset}: {problem}" for problem in _whole(out, finished, printed,
                                                                         _left_running(journal))]
            shutil.rmtree(out)
    assert failures == []


def test_a_garbled_journal_line_is_named_by_file_and_line(finished, space_file, tmp_path):
    rows = _records(finished.journal)
    start, end, _ = rows[40]
    garbled = finished.journal[:start + 1] + b"#" + finished.journal[start + 2:]  # {#op_code":...
    out = _copy(finished, tmp_path / "run", garbled)
    code, _, errors = _resume(out, space_file)
    line = _one_error_line(errors)
    assert code == 2
    assert f"journal {out / 'study.journal'}" in line and "line 41 of" in line and "head -n 40" in line, line
    assert "--storage" not in line and "column" not in line, line
    assert (out / "study.journal").read_bytes() == garbled  # refused, not "repaired"


# ----------------------------------------------------------------------------------------------- a full disk


def _limited(limit: int):
    def set_limit():
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))

    return set_limit


def _run_limited(args: list[str], limit: int) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "precsearch", *args], capture_output=True, text=True,
                          preexec_fn=_limited(limit), timeout=300)


def _limit_inside(finished: Finished, record: str) -> int:
    """A file-size limit that falls in the middle of a record of the uncut run's journal (the run under the limit
    writes the same records; only worker ids and times may shift them by a few bytes)."""
    rows = _records(finished.journal)
    if record == "the reference":
        index = next(i for i, (_, _, r) in enumerate(rows) if "step:calibration" in json.dumps(r))
    elif record == "a trial":
        index = next(i for i, (_, _, r) in enumerate(rows) if r.get("trial_id") == 1 and r["op_code"] == 8)
    else:
        index = next(i for i, (_, _, r) in enumerate(rows) if "step:confirm" in json.dumps(r))
    start, end, _ = rows[index]
    return (start + end) // 2


def _fill_and_resume(finished, space_file, tmp_path, record):
    out = tmp_path / "run"
    stopped = _run_limited([*SEARCH, "--space", str(space_file), "--out", str(out)], _limit_inside(finished, record))
    line = _one_error_line(stopped.stderr)
    assert stopped.returncode == 2
    assert "file too large" in line.lower() and str(out / "study.journal") in line and "--resume" in line, line
    journal = (out / "study.journal").read_bytes()
    assert journal.endswith(b"\n") and _records(journal)  # cut back to whole records
    code, printed, errors = _resume(out, space_file)
    assert code == 0, errors
    assert _whole(out, finished, printed, _left_running(journal)) == []


def test_a_disk_filling_during_the_trials_stops_in_one_line_and_resume_finishes(finished, space_file, tmp_path):
    _fill_and_resume(finished, space_file, tmp_path, "a trial")


@pytest.mark.slow
@pytest.mark.parametrize("record", ["the reference", "the confirmation"])
def test_a_disk_filling_elsewhere_stops_in_one_line_and_resume_finishes(record, finished, space_file, tmp_path):
    _fill_and_resume(finished, space_file, tmp_path, record)


def _no_space_at(finished: Finished, target: str, occurrence: int = 0) -> int:
    """The index among the run's fsyncs of the ``occurrence``-th one of ``target`` (negative: from the end)."""
    return [i for i, path in enumerate(finished.fsyncs) if path == target][occurrence]


def _search_without_space_at(finished, space_file, tmp_path, target, occurrence):
    """ENOSPC at one fsync of a fresh run (the writes after it succeed, as when the failed write's space is
    freed), then --resume."""
    out, failing = tmp_path / "run", _no_space_at(finished, target, occurrence)
    calls = []
    real_fsync = os.fsync

    def fsync(fd):
        calls.append(fd)
        if len(calls) - 1 == failing:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real_fsync(fd)

    errors = io.StringIO()
    with pytest.MonkeyPatch.context() as patch, contextlib.redirect_stdout(io.StringIO()), \
            contextlib.redirect_stderr(errors):
        patch.setattr(os, "fsync", fsync)
        code = main([*SEARCH, "--space", str(space_file), "--out", str(out)])
    line = _one_error_line(errors.getvalue())
    assert code == 2 and "no space left" in line.lower() and str(out / target) in line, line
    assert not list(out.rglob("*.tmp"))
    journal = (out / "study.journal").read_bytes()
    code, printed, errors = _resume(out, space_file)
    assert code == 0, errors
    assert _whole(out, finished, printed, _left_running(journal)) == []


@pytest.mark.parametrize(("target", "occurrence"), [("trials/trial_0001.json", 0), ("best.json", -1)])
def test_no_space_for_a_trial_s_policy_or_the_last_export_stops_in_one_line_and_resume_finishes(
        target, occurrence, finished, space_file, tmp_path):
    _search_without_space_at(finished, space_file, tmp_path, target, occurrence)


@pytest.mark.slow
@pytest.mark.parametrize(("target", "occurrence"), [("trials.csv", 0), ("study.journal", 40), ("run.json", -1)])
def test_no_space_for_an_export_or_a_journal_record_stops_in_one_line_and_resume_finishes(
        target, occurrence, finished, space_file, tmp_path):
    _search_without_space_at(finished, space_file, tmp_path, target, occurrence)


# both commands in one process under the limit (one interpreter start, which costs more than either command)
UNDER_A_LIMIT = """
import contextlib, io, json, sys
from precsearch.cli import main
outcomes = []
for args in json.loads(sys.argv[1]):
    errors = io.StringIO()
    with contextlib.redirect_stderr(errors):
        outcomes.append([main(args), errors.getvalue()])
print(json.dumps(outcomes))
"""


def test_a_train_and_a_report_past_the_file_size_limit_say_so_in_one_line(finished, tmp_path):
    metrics, run = tmp_path / "metrics.csv", shutil.copytree(finished.out, tmp_path / "run")
    commands = [["--eager-kernels", "train", "tiny_cnn", "--steps", "2", "--eval-every", "1", "--metrics", str(metrics),
                 "--image-size", "8", "--batch-size", "16", "--device", "cpu", "--threads", "1"],
                ["report", str(run)]]
    done = subprocess.run([sys.executable, "-c", UNDER_A_LIMIT, json.dumps(commands)], capture_output=True, text=True,
                          preexec_fn=_limited(64), timeout=300)
    assert done.returncode == 0, done.stderr
    (train_code, train_error), (report_code, report_error) = json.loads(done.stdout.splitlines()[-1])
    for code, error, path in ((train_code, train_error, metrics), (report_code, report_error, run / "report.png")):
        line = error.strip()
        assert code == 2 and len(line.splitlines()) == 1 and "Traceback" not in line, error
        assert "file too large" in line.lower() and str(path) in line, line
        assert not path.exists() and not list(path.parent.glob(".*.tmp"))


def test_the_summary_lists_best_json_only_when_it_was_written(tmp_path):
    result = SimpleNamespace(trials=pd.DataFrame({"state": ["COMPLETE"], "diverged": [False]}), calibration=None,
                             pareto=pd.DataFrame(), noise=None, confirmation=None, best=None, budget=None,
                             note="no confirmed point", out_dir=tmp_path, wall_time=1.0)
    text = summarize(result)
    assert "best.json not written: no confirmed point" in text
    outputs = next(line for line in text.splitlines() if line.startswith("outputs:"))
    assert "best.json" not in outputs and "pareto.csv" in outputs
