"""Searching through a real PostgreSQL server: several worker processes on one study, a worker killed with
SIGKILL mid-trial, workers racing to create a study, and joins that must be refused.

The module starts a throwaway server of its own (``benchmarks/local_postgres.py``: initdb + pg_ctl in a
temporary folder, 127.0.0.1 on a free port, run as the ``postgres`` user under root) and stops it after.
Without any way to start one the tests are skipped, except in CI (CI=true), where ``.ci/run`` installs the
server and a failure to start is an error.
"""

from __future__ import annotations

import importlib.util
import multiprocessing
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import optuna
import pandas as pd
import pytest
from optuna.trial import TrialState

from precsearch.cli import main
from precsearch.config.spaces import paper_space
from precsearch.search import study as search
from precsearch.search.context import Budget, DataSpec
from precsearch.search.storage import StudyLocation
from precsearch.search.strategies import seed_candidates

TINY = ["--image-size", "8", "--batch-size", "16", "--device", "cpu", "--threads", "1", "--no-progress"]


def _load_helper():
    path = Path(__file__).resolve().parents[1] / "benchmarks" / "local_postgres.py"
    spec = importlib.util.spec_from_file_location("local_postgres", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


helper = _load_helper()


@pytest.fixture(scope="module")
def postgres():
    """The URL of a fresh local server, for the whole module."""
    try:
        server = helper.local_postgres()
        url = server.__enter__()
    except helper.PostgresUnavailable as error:
        if os.environ.get("CI"):
            raise
        pytest.skip(f"no PostgreSQL server can be started here: {error}")
    yield url
    server.__exit__(None, None, None)


def _worker(url: str, study: str, out: Path, trials: int, steps: int) -> subprocess.Popen:
    """`precsearch search` as a separate process joining ``study``; eager rounding (no torch.compile warm-up);
    one seed per proxy, so that every assignment, all-high included, is trained by a trial (with seeds the
    all-high trial copies the reference the study's creator trained)."""
    command = [sys.executable, "-m", "precsearch", "search", "tiny_cnn", "--storage", url, "--study-name", study,
               "--out", str(out), "--trials", str(trials), "--proxy-steps", str(steps), "--heartbeat", "1",
               "--proxy-seeds", "1", *TINY]
    return subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "PRECSEARCH_COMPILE": "0"})


def _finish(workers: list[subprocess.Popen]) -> list[int]:
    codes = []
    for worker in workers:
        _, err = worker.communicate(timeout=300)
        assert worker.returncode in (0, -signal.SIGKILL), err
        codes.append(worker.returncode)
    return codes


def _trials(url: str, study: str) -> list[optuna.trial.FrozenTrial]:
    return optuna.load_study(study_name=study, storage=url).get_trials()


def _seed_origins() -> list[str]:
    context = search.SearchContext.create("tiny_cnn", paper_space(proxy={"image_size": 8, "batch_size": 16}),
                                          DataSpec(), Budget(), 0, "cpu")
    return [origin for _, origins in seed_candidates(context.graph, context.space) for origin in origins]


def _trained_once(trials: list[optuna.trial.FrozenTrial]) -> pd.Series:
    """Completed trials that ran a proxy themselves, counted per assignment key."""
    trained = [t.user_attrs["key"] for t in trials if t.state == TrialState.COMPLETE
               and t.user_attrs.get("trained") and "duplicate_of" not in t.user_attrs]
    return pd.Series(trained, dtype=object).value_counts()


def test_three_workers_finish_the_study_once_each_assignment(postgres, tmp_path):
    workers = [_worker(postgres, "three", tmp_path / f"w{i}", 10, 8) for i in range(3)]
    assert _finish(workers) == [0, 0, 0]
    trials = _trials(postgres, "three")
    states = [t.state for t in trials]
    distinct = {t.user_attrs["key"] for t in trials if t.state == TrialState.COMPLETE}
    assert 10 <= len(distinct) <= 12  # each worker checks the total after its own trial
    assert set(states) == {TrialState.COMPLETE}  # nothing lost, failed or left behind
    assert (_trained_once(trials) == 1).all()
    origins = [origin for t in trials for origin in t.user_attrs.get("origin", [])]
    assert sorted(origins) == sorted(_seed_origins())  # the paper's sweep, each seed exactly once
    for trial in [t for t in trials if t.user_attrs.get("trained")]:  # every proxy's policy is in the --out of
        # the worker that trained it (a candidate a known point already beats trains no proxy)
        policy = Path(trial.user_attrs["policy"])
        assert policy.is_file() and policy.parent.parent.name in {"w0", "w1", "w2"}
    for index in range(3):
        assert (tmp_path / f"w{index}" / "trials.csv").is_file()


def _pid(trial: optuna.trial.FrozenTrial) -> int:
    return int(trial.user_attrs["worker"].rsplit(":", 1)[1])


@pytest.mark.slow
def test_a_killed_worker_loses_only_its_trial_which_a_survivor_retries(postgres, tmp_path):
    workers = [_worker(postgres, "kill", tmp_path / f"w{i}", 12, 40) for i in range(3)]
    pids = {worker.pid: worker for worker in workers}
    deadline = time.time() + 120
    victim = None
    while victim is None and time.time() < deadline:
        time.sleep(0.3)
        try:
            study = optuna.load_study(study_name="kill", storage=postgres)
            reference = study.user_attrs.get("reference_key")  # all-high copies the reference: no proxy to kill
            running = [t for t in study.get_trials() if t.state == TrialState.RUNNING
                       and t.user_attrs.get("trains") == t.number and _pid(t) in pids
                       and t.user_attrs.get("key") != reference]
        except KeyError:  # the study is not created yet
            continue
        if running:
            victim = running[0]
            os.kill(_pid(victim), signal.SIGKILL)
    assert victim is not None, "no worker was seen training"
    codes = _finish(workers)
    assert sorted(codes) == [-signal.SIGKILL, 0, 0]
    trials = {t.number: t for t in _trials(postgres, "kill")}
    killed = trials[victim.number]
    assert killed.state == TrialState.FAIL and "error" not in killed.user_attrs  # failed by its heartbeat
    key = killed.user_attrs["key"]
    retries = [t for t in trials.values() if t.system_attrs.get("failed_trial") == victim.number]
    assert [t.state for t in retries] == [TrialState.COMPLETE]
    trained = [t for t in trials.values() if t.state == TrialState.COMPLETE and t.user_attrs["key"] == key
               and "duplicate_of" not in t.user_attrs]
    assert len(trained) == 1 and _pid(trained[0]) != _pid(victim)  # retried by a survivor, once
    assert (_trained_once(list(trials.values())) == 1).all()
    assert sum(t.state == TrialState.COMPLETE for t in trials.values()) >= 12

    out = tmp_path / "rebuilt"
    assert main(["report", str(out), "--storage", postgres, "--study-name", "kill"]) == 0
    table = pd.read_csv(out / "trials.csv", keep_default_na=False)
    assert table.set_index("number").loc[victim.number, "state"] == "FAIL"
    complete = table[table["state"] == "COMPLETE"]
    assert len(complete) == len(trials) - 1
    trained = complete[complete["trained"].astype(str) == "True"]  # not those a known point already beat
    assert trained["val_accuracy"].astype(float).between(0, 1).all()
    assert complete["memory"].astype(float).gt(0).all()
    assert all(Path(path).is_file() for path in trained["policy"])
    for name in ("pareto.csv", "best.json", "report.png", "report.md"):
        assert (out / name).is_file()


def _race(url: str, name: str, barrier) -> None:
    context = search.SearchContext.create("tiny_cnn", paper_space(), DataSpec(), Budget(), 0, "cpu")
    location = StudyLocation.of(url, Path("."), name, 1)
    storage = location.open()
    barrier.wait()
    search._join_study(context, storage, location, trials=10)


def test_workers_starting_at_once_create_and_seed_the_study_once(postgres):
    spawn = multiprocessing.get_context("spawn")
    barrier = spawn.Barrier(2)
    racers = [spawn.Process(target=_race, args=(postgres, "race", barrier)) for _ in range(2)]
    for racer in racers:
        racer.start()
    for racer in racers:
        racer.join(timeout=120)
    assert [racer.exitcode for racer in racers] == [0, 0]
    names = [summary.study_name for summary in optuna.get_all_study_summaries(postgres)]
    assert names.count("race") == 1
    trials = _trials(postgres, "race")
    assert all(t.state == TrialState.WAITING for t in trials)
    origins = [origin for t in trials for origin in t.user_attrs["origin"]]
    assert sorted(origins) == sorted(_seed_origins())


@pytest.mark.parametrize("case, needle", [
    ("malformed url", "cannot open study storage postgresql+psycopg:/nohost"),
    ("unsupported database", "not mysql"),
    ("server down", "Connection refused"),
    ("another model", "different model, graph_fingerprint"),
    ("another space", "different space"),
])
def test_bad_joins_are_one_line_exit_2(case, needle, postgres, tmp_path, capsys):
    url, model, steps = postgres, "tiny_cnn", "4"
    if case == "malformed url":
        url = "postgresql+psycopg:/nohost"
    elif case == "unsupported database":
        url = "mysql://user@127.0.0.1/db"
    elif case == "server down":
        url = f"postgresql+psycopg://postgres@127.0.0.1:{helper.free_port()}/postgres"
    else:
        names = [summary.study_name for summary in optuna.get_all_study_summaries(postgres)]
        if "taken" not in names:
            assert main(["search", "tiny_cnn", "--storage", postgres, "--study-name", "taken", "--trials", "1",
                         "--proxy-steps", "4", "--out", str(tmp_path / "first"), *TINY]) == 0
            capsys.readouterr()
        model, steps = ("tiny_cnn:width=0.5", "4") if case == "another model" else ("tiny_cnn", "5")
    out = tmp_path / "out"
    code = main(["search", model, "--storage", url, "--study-name", "taken", "--trials", "2", "--proxy-steps", steps,
                 "--out", str(out), *TINY])
    err = capsys.readouterr().err.strip()
    assert code == 2
    assert len(err.splitlines()) == 1 and needle in err and "Traceback" not in err, err
    assert not out.exists()
