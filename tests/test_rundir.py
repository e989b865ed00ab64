"""Run directories owned by one process, resumes that never start over lost results, clean stops on signals."""

from __future__ import annotations

import contextlib
import json
import multiprocessing
import os
import random
import signal
import stat
import subprocess
import sys
import threading
import time
import traceback
from pathlib import Path

import optuna
import pandas as pd
import pytest
import yaml
from optuna.trial import TrialState

from precsearch import stopping
from precsearch.cli import main
from precsearch.config.spaces import PAPER_SPACE, paper_space
from precsearch.errors import PrecsearchError
from precsearch.search import rundir
from precsearch.search import study as search
from precsearch.search.context import torch_threads
from precsearch.search.rundir import RunLock, hold_worker_lock
from precsearch.search.settings import SearchConfig
from precsearch.search.storage import StudyLocation
from precsearch.search.study import run_search

PROXY = {"steps": 2, "batch_size": 16, "image_size": 8, "eval_batch_size": 64}
SPACE = paper_space(proxy=PROXY)
RESULTS = ("trials.csv", "pareto.csv", "best.json", "run.json")


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    with torch_threads(1):
        yield


def _search(out, trials, **kwargs):
    return run_search(SearchConfig("tiny_cnn", SPACE, trials=trials, out_dir=out, proxy_steps=PROXY["steps"],
                                   device="cpu", progress=False, **kwargs))


def _contender(barrier, out, storage, outcomes):
    """One of several processes released at once by ``barrier``; reports 'ok' or its one-line error. They
    meet again right after the run-directory check, the window in which two searches used to both find
    the directory free (a process refused before reaching it leaves the other waiting 2 s at most)."""
    checked = search.check_resume

    def check_then_meet(*args, **kwargs):
        checked(*args, **kwargs)
        with contextlib.suppress(threading.BrokenBarrierError):
            barrier.wait(timeout=2)

    search.check_resume = check_then_meet  # in this forked process only
    try:
        barrier.wait()
        _search(out, 1, storage=storage)
        outcomes.put("ok")
    except PrecsearchError as error:
        outcomes.put(f"refused: {error}")
    except BaseException:
        outcomes.put(f"crashed: {traceback.format_exc()}")


def _race(outs, storage=None):
    fork = multiprocessing.get_context("fork")
    barrier, outcomes = fork.Barrier(len(outs)), fork.Queue()
    workers = [fork.Process(target=_contender, args=(barrier, out, storage, outcomes)) for out in outs]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join(timeout=120)
    return sorted(outcomes.get(timeout=5) for _ in workers)


@pytest.mark.slow
def test_second_search_on_same_out_is_refused_and_deletes_nothing(tmp_path):
    # before the fix the loser removed the whole directory the winner wrote into (3 races of 4)
    for round_ in range(3):
        out = tmp_path / f"race{round_}"
        outcomes = _race([out, out])
        assert outcomes[0] == "ok", outcomes
        assert outcomes[1].startswith("refused: ") and ("is in use by the search of" in outcomes[1]
                                                         or "not empty; pass --resume" in outcomes[1]), outcomes
        for name in RESULTS:
            assert (out / name).is_file(), (round_, name, outcomes)
        trials = pd.read_csv(out / "trials.csv")
        assert trials["state"].tolist() == ["COMPLETE"]


@pytest.mark.slow
def test_two_searches_creating_one_sqlite_storage_give_one_line_not_a_traceback(tmp_path):
    for round_ in range(2):
        storage = f"sqlite:///{tmp_path}/study{round_}.db"
        outcomes = _race([tmp_path / f"a{round_}", tmp_path / f"b{round_}"], storage)
        assert outcomes[0] == "ok", outcomes
        assert outcomes[1].startswith("refused: storage ") and "already holds a precsearch study" in outcomes[1]


@pytest.fixture(scope="module")
def finished(tmp_path_factory):
    out = tmp_path_factory.mktemp("done") / "run"
    _search(out, 3)
    return out


def _snapshot(out):
    return {path.relative_to(out): path.read_bytes() for path in out.rglob("*") if path.is_file()}


def _copy(run, out):
    """A copy of a finished run directory, to damage or resume without touching the module's run."""
    for path, data in _snapshot(run).items():
        (out / path).parent.mkdir(parents=True, exist_ok=True)
        (out / path).write_bytes(data)
    return out


@pytest.mark.parametrize("damage", ["missing", "empty", "first line lost"])
def test_resume_refuses_when_the_study_is_lost_and_leaves_results_untouched(finished, tmp_path, damage):
    out = _copy(finished, tmp_path / "run")
    journal = out / "study.journal"
    if damage == "missing":
        journal.unlink()
    elif damage == "empty":
        journal.write_bytes(b"")
    else:
        journal.write_bytes(journal.read_bytes().split(b"\n", 1)[1])
    before = _snapshot(out)
    with pytest.raises(PrecsearchError, match=r"cannot (resume|open study storage)|is damaged: line 1 of"):
        _search(out, 5, resume=True)  # the first line lost breaks the journal's checksum chain at line 1
    assert _snapshot(out) == before


def test_a_search_recorded_by_an_earlier_precsearch_is_refused_in_one_line(finished, tmp_path):
    """A run directory, or a shared study, from before ``SEARCH_FORMAT`` (no format recorded) is not resumed
    under this version's calibration and rungs: one line says so and what to do; nothing is written."""
    out = _copy(finished, tmp_path / "run")
    recorded = json.loads((out / "run.json").read_text())
    assert recorded.pop("search_format") == rundir.SEARCH_FORMAT
    (out / "run.json").write_text(json.dumps(recorded))
    before = _snapshot(out)
    with pytest.raises(PrecsearchError, match=r"recorded by an earlier precsearch \(search format 1, this one "
                                              rf"reads {rundir.SEARCH_FORMAT}.*cannot be resumed; start a new "
                                              r"search in another --out"):
        _search(out, 5, resume=True)
    assert _snapshot(out) == before
    study = optuna.load_study(study_name="precsearch", storage=optuna.storages.JournalStorage(
        optuna.storages.journal.JournalFileBackend(str(out / "study.journal"))))
    earlier = {key: value for key, value in study.user_attrs["config"].items() if key != "search_format"}
    assert rundir.earlier_search(study.user_attrs["config"], "it", "") is None  # this version's own
    assert "recorded by an earlier precsearch" in str(rundir.earlier_search(earlier, "study x", "join another"))


def test_a_lock_left_by_a_dead_process_is_stale_and_taken_over(tmp_path):
    child = os.fork()
    if child == 0:  # take the lock and die without releasing it
        RunLock(tmp_path).acquire()
        os._exit(0)
    os.waitpid(child, 0)
    assert f":{child}" in (tmp_path / rundir.LOCK_NAME).read_text()
    with RunLock(tmp_path):
        assert (tmp_path / rundir.LOCK_NAME).read_text().strip() == rundir.owner_id()


def test_workers_of_a_killed_parent_keep_the_run_directory_locked(tmp_path):
    locked, done = os.pipe(), os.pipe()  # (read, write) each: one pipe per direction
    child = os.fork()
    if child == 0:  # a --jobs worker whose parent is gone: it holds the workers' lock until it ends
        hold_worker_lock(tmp_path)
        os.write(locked[1], b"x")
        os.read(done[0], 1)
        os._exit(0)
    os.read(locked[0], 1)
    try:
        with pytest.raises(PrecsearchError, match="worker processes of the search of .* still run"):
            RunLock(tmp_path).acquire()
    finally:
        os.write(done[1], b"x")
        os.waitpid(child, 0)
    with RunLock(tmp_path):
        pass


def test_resume_removes_temporaries_a_killed_write_left(finished, tmp_path):
    out = _copy(finished, tmp_path / "run")
    leftovers = [out / ".best.json.k2j3.tmp", out / ".trials.csv.x8a.tmp", out / "policies" / ".trial_0001.json.q.tmp"]
    for path in leftovers:
        path.write_text("{half")
    _search(out, 4, resume=True)
    assert not any(path.exists() for path in leftovers)


def test_outputs_get_the_users_umask(tmp_path):
    previous = os.umask(0o022)
    try:
        out = tmp_path / "run"
        _search(out, 1)
    finally:
        os.umask(previous)
    for name in ("trials.csv", "pareto.csv", "run.json"):
        assert stat.S_IMODE((out / name).stat().st_mode) == 0o644, name  # the temporary alone is 0600
    for path in (out / "policies").iterdir():
        assert stat.S_IMODE(path.stat().st_mode) == 0o644


def _consistent(out, before):
    """The run directory after a stop: parseable tables, no trial left RUNNING, no temporary files, every
    trained trial finished before still there with its result, and best.json one of the finished trials."""
    assert not list(out.rglob(".*.tmp"))
    if not (out / "run.json").is_file():
        assert not out.exists() or not (out / "trials.csv").exists()
        return {}
    study = optuna.load_study(study_name="precsearch", storage=StudyLocation.of(None, out).open())
    assert not [t.number for t in study.trials if t.state == TrialState.RUNNING]
    if not (out / "trials.csv").is_file():
        return {}
    trials = pd.read_csv(out / "trials.csv", keep_default_na=False)
    assert set(trials["state"]) <= {"COMPLETE", "FAIL", "PRUNED"}
    assert (trials[trials["state"] == "FAIL"]["interrupted"].astype(str) == "True").all()
    # a trial priced but not trained (beaten by one with less memory within the drop) has no accuracy
    finished = {int(row["number"]): float(row["val_accuracy"]) for _, row in trials.iterrows()
                if row["state"] == "COMPLETE" and str(row["trained"]) == "True"}
    assert all(finished.get(number) == accuracy for number, accuracy in before.items())  # nothing lost
    fresh = trials[(trials["trained"].astype(str) == "True") & (trials["duplicate_of"].astype(str) == "")
                   & (trials["reference_copy"].astype(str) == "False")]
    assert fresh["key"].is_unique  # no assignment trained twice across the stops
    if (out / "best.json").is_file():
        assert json.loads((out / "best.json").read_text())["provenance"]["trial"] in finished
    return finished


@pytest.mark.slow
def test_twenty_sigints_at_random_moments_each_stop_the_search_with_130_and_consistent_files(tmp_path, capsys,
                                                                                            caplog):
    space = tmp_path / "space.yaml"
    # one unit per tensor: far more assignments than 20 stops of at most 2 s can train, so none ends the search
    space.write_text(yaml.safe_dump({**PAPER_SPACE, "proxy": PROXY, "granularity": "tensor"}))
    out = tmp_path / "run"
    command = ["search", "tiny_cnn", "--space", str(space), "--trials", "500", "--out", str(out), "--no-progress",
               "--device", "cpu", "--threads", "1", "--proxy-steps", str(PROXY["steps"])]  # trials from the start
    rng = random.Random(16)
    inside = threading.Event()

    def interrupt(signum, frame):  # Python's own SIGINT handler, but only while the CLI runs
        if inside.is_set():
            raise KeyboardInterrupt

    def send_after(delay: float) -> None:
        """SIGINT ``delay`` s after the CLI's own handler is in force: a signal landing before ``main`` entered
        it, or after ``main`` returned for another reason, raised KeyboardInterrupt out of the test and
        ended pytest itself (CI, under load); now a ``main`` that returns unstopped fails the assertion."""
        while not stopping.signals_in_force() and inside.is_set():
            time.sleep(0.001)
        time.sleep(delay)
        if inside.is_set():
            os.kill(os.getpid(), signal.SIGINT)

    previous = signal.signal(signal.SIGINT, interrupt)
    finished: dict[int, float] = {}
    try:
        for _ in range(20):
            sender = threading.Thread(target=send_after, args=(rng.uniform(0.0, 2.0),))
            inside.set()
            sender.start()
            try:
                code = main(command + (["--resume"] if (out / "run.json").is_file() else []))
            finally:
                inside.clear()
                sender.join()
            err = capsys.readouterr().err
            assert code == 130, err
            assert "stopped by SIGINT" in err.strip().splitlines()[-1]
            assert "Traceback" not in err and "Exception ignored" not in err, err
            assert not [record.getMessage() for record in caplog.records if record.exc_info]  # Optuna's traceback
            caplog.clear()
            finished = _consistent(out, finished)
    finally:
        signal.signal(signal.SIGINT, previous)
    assert len(finished) > 0


def test_sigterm_stops_the_search_with_143(tmp_path, capsys):
    """SIGTERM is sent once the search has written run.json, inside its signal handling; a guard handler takes
    one that lands outside (a fixed 1.5 s delay raced a slow start under load, and SIGTERM's default action
    then killed pytest itself)."""
    out = tmp_path / "run"
    outside: list[int] = []
    previous = signal.signal(signal.SIGTERM, lambda signum, frame: outside.append(signum))

    def stop_once_running() -> None:
        deadline = time.monotonic() + 300
        while not (out / "run.json").is_file() and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(0.5)
        os.kill(os.getpid(), signal.SIGTERM)

    sender = threading.Thread(target=stop_once_running)
    sender.start()
    try:
        code = main(["search", "tiny_cnn", "--trials", "500", "--out", str(out), "--no-progress", "--device",
                     "cpu", "--threads", "1", "--proxy-steps", "2", "--image-size", "8", "--batch-size", "16"])
    finally:
        sender.join()
        signal.signal(signal.SIGTERM, previous)
    assert not outside and code == 143
    assert capsys.readouterr().err.strip().splitlines()[-1].startswith("precsearch search: stopped by SIGTERM")
    _consistent(out, {})


def test_resume_while_the_search_runs_is_refused_and_fails_no_live_trial(finished, tmp_path):
    out = _copy(finished, tmp_path / "run")
    before = _snapshot(out)
    # RunLock: the running search (the lock is per open file, so this process counts as another one)
    with RunLock(out), pytest.raises(PrecsearchError, match=r"is in use by the search of .*:\d+; wait for it"):
        _search(out, 5, resume=True)
    assert _snapshot(out) == before


def _children(pid):
    found = []
    for stat_file in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError):
            fields = stat_file.read_text().rsplit(")", 1)[1].split()
            if int(fields[1]) == pid:
                found.append(int(stat_file.parent.name))
    return found


def _finished_trials(out):
    """How many trials the search writing to ``out`` has finished so far, read from its study's journal (what
    ``precsearch report SNAPSHOT --storage OUT/study.journal`` tabulates while the search runs)."""
    if not (out / "study.journal").is_file():  # opening a journal that is not there would create it
        return 0
    try:
        study = optuna.load_study(study_name="precsearch", storage=StudyLocation.of(None, out).open())
    except KeyError:  # the study is not created yet
        return 0
    return sum(t.state == TrialState.COMPLETE for t in study.get_trials(deepcopy=False))


@pytest.mark.slow
def test_workers_of_a_killed_jobs_parent_stop_and_resume_then_works(tmp_path):
    out = tmp_path / "run"
    command = [sys.executable, "-m", "precsearch", "search", "tiny_cnn", "--trials", "200", "--jobs", "2",
               "--out", str(out), "--no-progress", "--device", "cpu", "--threads", "1", "--proxy-steps", "2",
               "--image-size", "8", "--batch-size", "16"]
    parent = subprocess.Popen(command, env={**os.environ, "PYTHONPATH": os.getcwd()}, stderr=subprocess.PIPE)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and not (_finished_trials(out) and len(_children(parent.pid)) >= 2):
        time.sleep(0.2)
    assert not (out / "trials.csv").exists()  # the run directory's tables are written once, when the search ends
    workers = _children(parent.pid)
    assert len(workers) >= 2
    parent.kill()  # kill -9: the workers are orphaned mid-trial
    parent.wait()
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and any(os.path.exists(f"/proc/{pid}") for pid in workers):
        time.sleep(0.2)
    assert not [pid for pid in workers if os.path.exists(f"/proc/{pid}")], "orphaned workers went on training"
    options = command[3:]
    options[options.index("--trials") + 1], options[options.index("--jobs") + 1] = "2", "1"
    assert main(options + ["--resume"]) == 0  # refused while they lived; now the lock is free
    trials = pd.read_csv(out / "trials.csv")
    assert set(trials["state"]) <= {"COMPLETE", "FAIL", "PRUNED"} and not list(out.rglob(".*.tmp"))
