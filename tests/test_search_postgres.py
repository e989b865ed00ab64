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
import random
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import optuna
import pandas as pd
import pytest
from optuna.trial import TrialState

from precsearch.cli import main
from precsearch.cli.search import PAUSE_AT
from precsearch.config.spaces import paper_space
from precsearch.errors import PrecsearchError
from precsearch.search import storage as storage_module
from precsearch.search import study as search
from precsearch.search.context import Budget, DataSpec
from precsearch.search.ledger import CLAIM
from precsearch.search.reference import Reference
from precsearch.search.seeding import PAPER_SEEDING, seed_candidates, seed_queue, seed_study
from precsearch.search.storage import StudyLocation
from precsearch.search.trials import TrialRecord

TINY = ["--image-size", "8", "--batch-size", "16", "--device", "cpu", "--threads", "1", "--no-progress"]


def _load_helper():
    path = Path(__file__).resolve().parents[1] / "benchmarks" / "local_postgres.py"
    spec = importlib.util.spec_from_file_location("local_postgres", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


helper = _load_helper()


@pytest.fixture(scope="module")
def server():
    """A fresh local server for the whole module (``helper.LocalPostgres``: url, stop, start)."""
    try:
        started = helper.local_server()
        running = started.__enter__()
    except helper.PostgresUnavailable as error:
        if os.environ.get("CI"):
            raise
        pytest.skip(f"no PostgreSQL server can be started here: {error}")
    yield running
    started.__exit__(None, None, None)


@pytest.fixture
def postgres(server):
    """The URL of the module's server."""
    return server.url


def _worker(url: str, study: str, out: Path, trials: int, steps: int, heartbeat: int = 1,
            pause_at: str | None = None) -> subprocess.Popen:
    """`precsearch -v search` as a separate process joining ``study``, logging to ``_log(out)``; eager rounding
    (no torch.compile warm-up); one seed per proxy, so that every assignment, all-high included, is trained by
    a trial (with seeds the all-high trial copies the reference the study's creator trained). ``pause_at``:
    the setup point where the worker stops itself, handed to it in the variable the CLI reads into
    ``SearchConfig.pause_at`` (precsearch.search.ledger.pause_point)."""
    command = [sys.executable, "-m", "precsearch", "-v", "--eager-kernels", "search", "tiny_cnn", "--storage", url,
               "--study-name", study, "--out", str(out), "--trials", str(trials), "--proxy-steps", str(steps),
               "--heartbeat", str(heartbeat), "--proxy-seeds", "1", *TINY]
    env = dict(os.environ)
    if pause_at is not None:
        env[PAUSE_AT] = pause_at
    with _log(out).open("w") as log:  # a file, not a pipe that fills up while the test polls the database
        return subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=log, env=env)


def _log(out: Path) -> Path:
    """Where the worker writing to ``out`` logs."""
    return out.with_name(out.name + ".log")


def _finish(workers: list[subprocess.Popen]) -> list[int]:
    codes = []
    for worker in workers:
        worker.wait(timeout=300)
        log = _log(Path(worker.args[worker.args.index("--out") + 1]))
        assert worker.returncode in (0, -signal.SIGKILL), log.read_text()[-3000:]
        codes.append(worker.returncode)
    return codes


def _trials(url: str, study: str) -> list[optuna.trial.FrozenTrial]:
    return optuna.load_study(study_name=study, storage=url).get_trials()


def _seed_origins() -> list[str]:
    context = search.SearchContext.create("tiny_cnn", paper_space(proxy={"image_size": 8, "batch_size": 16}),
                                          DataSpec(), Budget(), 0, "cpu")
    return [origin for _, origins in seed_candidates(context.graph, context.space) for origin in origins]


def _decided_here(trial: optuna.trial.FrozenTrial) -> bool:
    """A trial that decided its assignment itself (trained its proxy, or found a known point that beats it), not
    one that copied another trial's results or the reference's."""
    record = TrialRecord.from_trial(trial)
    return record.duplicate_of is None and not record.reference_copy


def _trained_here(trial: optuna.trial.FrozenTrial) -> bool:
    """A trial that ran its proxy itself."""
    return TrialRecord.from_trial(trial).trained and _decided_here(trial)


def _trained_once(trials: list[optuna.trial.FrozenTrial]) -> pd.Series:
    """Completed trials that ran a proxy themselves, counted per assignment key."""
    trained = [t.user_attrs["key"] for t in trials if t.state == TrialState.COMPLETE and _trained_here(t)]
    return pd.Series(trained, dtype=object).value_counts()


@pytest.mark.slow  # three worker processes, about a minute: with the slow tests, which CI runs too
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
            reference = getattr(Reference.from_study(study), "key", None)  # all-high copies it: no proxy to kill
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
    decided = [t for t in trials.values() if t.state == TrialState.COMPLETE and t.user_attrs["key"] == key
               and _decided_here(t)]  # by the retry, or by a trial the sampler proposed meanwhile (the retry copies it)
    # retried by a survivor, once; it trains the proxy unless a cheaper point within the drop is known by then
    assert len(decided) == 1 and _pid(decided[0]) != _pid(victim)
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
    study = search.join_study(context, storage, location)
    seed_study(study, context, PAPER_SEEDING, 10, search.study_ledger(study, location, storage))


@pytest.mark.slow  # processes started at once, half a minute: with the slow tests, which CI runs too
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
    ("not a precsearch study", "is not a precsearch study; delete it"),
])
def test_bad_joins_are_one_line_exit_2(case, needle, postgres, tmp_path, capsys):
    url, model, steps, name = postgres, "tiny_cnn", "4", "taken"
    if case == "not a precsearch study":  # made by another program: it has trials, and no precsearch config
        name = "foreign"
        if name not in [summary.study_name for summary in optuna.get_all_study_summaries(postgres)]:
            optuna.create_study(study_name=name, storage=postgres, directions=["minimize", "minimize"]).optimize(
                lambda trial: (trial.suggest_float("x", 0, 1), 0.0), n_trials=1)
    elif case == "malformed url":
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
    code = main(["search", model, "--storage", url, "--study-name", name, "--trials", "2", "--proxy-steps", steps,
                 "--out", str(out), *TINY])
    err = capsys.readouterr().err.strip()
    assert code == 2
    assert len(err.splitlines()) == 1 and needle in err and "Traceback" not in err, err
    assert not out.exists()


# ------------------------------------------------------------------------- a dead creator, a database restart

HEARTBEAT = 2  # seconds; a setup step whose worker is silent for 3 x this is taken over
TAKEOVER_SLACK = 4.0  # seconds a survivor may need beyond the lease to look again and claim (a loaded machine)
KILL_POINTS = {  # where the creator is killed: named setup points (precsearch.search.ledger.pause_point)
    "created": "inside the creation lock, the study made but no config recorded",
    "config": "inside the creation lock, the config recorded",
    "queued-early": "holding the seeds step, a seeded-random few of the seeds queued",
    "queued-late": "holding the seeds step, a seeded-random most of the seeds queued",
    "calibrating": "holding the reference's calibration run, before it trains",
}


def _pause_point(kind: str) -> str:
    if kind in ("created", "config"):
        return kind
    if kind == "calibrating":
        return "claimed:calibration:8:0"  # --proxy-steps 8, one reference seed: the search seed 0
    context = search.SearchContext.create("tiny_cnn", paper_space(proxy={"image_size": 8, "batch_size": 16}),
                                          DataSpec(), Budget(), 0, "cpu")
    seeds = len(seed_queue(context, 10, PAPER_SEEDING))
    draw = random.Random(f"issue 31 {kind}")
    return f"queued:{draw.randint(1, seeds // 2) if kind == 'queued-early' else draw.randint(seeds // 2 + 1, seeds)}"


def _stopped(process: subprocess.Popen) -> bool:
    """Whether ``process`` stopped itself (SIGSTOP at its pause point)."""
    stat = Path(f"/proc/{process.pid}/stat").read_text()
    return stat.rsplit(")", 1)[1].split()[0] == "T"


def _wait_for(condition, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def _pid_of(worker: str) -> int:
    return int(worker.rsplit(":", 1)[1])


def _check_finished_once(trials: list[optuna.trial.FrozenTrial]) -> None:
    """None running or queued; no assignment trained by two completed trials; every trial failed by its
    heartbeat retried to completion; every seed queued once."""
    assert not [t.number for t in trials if t.state in (TrialState.RUNNING, TrialState.WAITING)]
    assert (_trained_once(trials) == 1).all()
    retried = {t.system_attrs["failed_trial"] for t in trials if t.state == TrialState.COMPLETE
               and "failed_trial" in t.system_attrs}
    assert {t.number for t in trials if t.state == TrialState.FAIL} <= retried
    origins = [origin for t in trials if "failed_trial" not in t.system_attrs  # a retry copies its origin
               for origin in t.user_attrs.get("origin", [])]
    assert sorted(origins) == sorted(_seed_origins())


@pytest.mark.slow
@pytest.mark.parametrize("kind", KILL_POINTS)
def test_the_creator_killed_during_setup_leaves_a_study_the_survivors_finish(kind, postgres, tmp_path):
    name = f"creator-{kind}"
    survivors = [_worker(postgres, name, tmp_path / f"s{i}", 10, 8, HEARTBEAT, pause_at="join") for i in range(2)]
    _wait_for(lambda: all(_stopped(w) for w in survivors), 180, "the survivors to start")  # before the creator,
    victim = _worker(postgres, name, tmp_path / "victim", 10, 8, HEARTBEAT, pause_at=_pause_point(kind))  # so
    _wait_for(lambda: _stopped(victim), 180, f"the creator to reach {kind}")  # that it is the one to create
    for survivor in survivors:
        os.kill(survivor.pid, signal.SIGCONT)
    os.kill(victim.pid, signal.SIGKILL)
    killed = time.monotonic()
    storage = optuna.storages.RDBStorage(postgres)
    study_id = storage.get_study_id_from_name(name)
    pids = {survivor.pid for survivor in survivors}

    def taken_over() -> bool:  # a survivor holds a setup step (the one the creator held, or the next)
        return any(key.startswith(CLAIM) and _pid_of(claim["worker"]) in pids
                   for key, claim in storage.get_study_user_attrs(study_id).items())

    _wait_for(taken_over, 120, "a survivor to take setup over")
    waited = time.monotonic() - killed
    print(f"{kind}: setup taken over {waited:.1f} s after the creator died")  # shown with pytest -s
    assert waited <= 3 * HEARTBEAT + TAKEOVER_SLACK, f"setup was taken over {waited:.1f} s after the creator died"
    assert _finish(survivors) == [0, 0]
    assert victim.wait(timeout=10) == -signal.SIGKILL
    trials = _trials(postgres, name)
    assert {t.state for t in trials} == {TrialState.COMPLETE}  # the creator died before any trial
    assert all(_pid_of(t.user_attrs["worker"]) in pids for t in trials)
    _check_finished_once(trials)
    if kind == "calibrating":  # the survivors waited out the lease, saying for what, held by whom
        logs = "".join(_log(tmp_path / f"s{i}").read_text() for i in range(2))
        assert f"waiting for step calibration:8:0, which worker {socket.gethostname()}:{victim.pid} runs" in logs
        assert "went silent" in logs


def _training(storage: optuna.storages.RDBStorage, name: str) -> list[int]:
    """The trials of study ``name`` training a proxy now."""
    try:
        study_id = storage.get_study_id_from_name(name)
    except KeyError:  # not created yet
        return []
    reference = getattr(Reference.from_study(optuna.load_study(study_name=name, storage=storage)), "key", None)
    return [t.number for t in storage.get_all_trials(study_id, states=(TrialState.RUNNING,))
            if t.user_attrs.get("trains") == t.number and t.user_attrs.get("key") != reference]


@pytest.mark.slow
def test_a_database_restart_under_two_training_workers_loses_nothing(server, tmp_path):
    watch = optuna.storages.RDBStorage(server.url)  # (creates Optuna's tables before the workers race to)
    workers = [_worker(server.url, "restart", tmp_path / f"w{i}", 10, 200, HEARTBEAT) for i in range(2)]
    _wait_for(lambda: _training(watch, "restart"), 180, "a worker to train")
    server.stop("immediate")  # a crash: no shutdown checkpoint, every connection cut
    time.sleep(HEARTBEAT)
    server.start()
    assert _finish(workers) == [0, 0]
    trials = _trials(server.url, "restart")
    _check_finished_once(trials)
    assert search.trials_done(optuna.load_study(study_name="restart", storage=server.url)) >= 10
    for index in range(2):  # both lived through the restart
        assert "is reachable again; going on" in _log(tmp_path / f"w{index}").read_text()


def test_a_database_away_too_long_stops_the_worker_in_one_line_and_starting_it_again_finishes(
        server, tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(storage_module, "STORAGE_OUTAGE", 2.0)
    args = ["search", "tiny_cnn", "--storage", server.url, "--study-name", "away", "--out", str(tmp_path / "out"),
            "--trials", "3", "--proxy-steps", "60", "--confirm-factor", "1", "--heartbeat", "1", "--proxy-seeds", "1",
            *TINY]
    training: list[int] = []  # the trial training when the database went away
    watch = optuna.storages.RDBStorage(server.url)  # (creates Optuna's tables before the search races to)

    def stop_while_training() -> None:
        deadline = time.monotonic() + 120
        while not training and time.monotonic() < deadline:
            training.extend(_training(watch, "away"))
            time.sleep(0.02)
        if training:
            server.stop("immediate")

    stopper = threading.Thread(target=stop_while_training, daemon=True)
    stopper.start()
    try:
        code = main(args)
    finally:
        stopper.join()
        if training:
            server.start()
    assert training, "no proxy was seen training"
    err = capsys.readouterr().err
    errors = [line for line in err.splitlines() if line.startswith("precsearch search: error:")]
    assert code == 2 and "Traceback" not in err and len(errors) == 1, err
    assert "was unreachable for 2 s" in errors[0] and "start this worker again" in errors[0]
    assert main(args) == 0
    trials = _trials(server.url, "away")
    _check_finished_once(trials)
    key = trials[training[0]].user_attrs["key"]  # finished before the database went, or failed and retried
    assert [t.state for t in trials if t.user_attrs.get("key") == key and _decided_here(t)
            and t.state == TrialState.COMPLETE] == [TrialState.COMPLETE]


HOLD_AND_STOP = """
import os, signal, sys
from pathlib import Path
from precsearch.search.storage import StudyLocation
location = StudyLocation.of(sys.argv[1], Path("."), "held", 1)
held = location.lock(location.open())  # kept: a collected generator would release it
held.__enter__()
print("held", flush=True)
os.kill(os.getpid(), signal.SIGSTOP)
"""


def test_a_worker_stopped_holding_the_study_lock_is_named_and_the_wait_for_it_ends_in_one_line(postgres, caplog,
                                                                                                monkeypatch):
    """A stopped process keeps its connection, and the advisory lock with it: the others say who holds it (the
    worker's host:pid, from its session's application name) after a heartbeat, and stop waiting in one line
    once it held the lock STORAGE_OUTAGE seconds; once the holder is gone the lock is free."""
    monkeypatch.setattr(storage_module, "STORAGE_OUTAGE", 3.0)
    holder = subprocess.Popen([sys.executable, "-c", HOLD_AND_STOP, postgres], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline() == "held\n"
        location = StudyLocation.of(postgres, Path("."), "held", 1)
        storage = location.open()
        started = time.monotonic()
        with (caplog.at_level("WARNING", logger=storage_module.__name__), pytest.raises(PrecsearchError) as error,
              location.lock(storage)):
            pass
        waited = time.monotonic() - started
    finally:
        holder.kill()
        holder.wait()
    who = f"precsearch {socket.gethostname()}:{holder.pid} (PostgreSQL backend "
    warnings = [record.getMessage() for record in caplog.records if "waiting for the lock" in record.getMessage()]
    assert len(warnings) == 1 and who in warnings[0] and "giving up once it is held for 3 s" in warnings[0], warnings
    message = str(error.value)
    assert "\n" not in message and who in message and "stopped or hung" in message, message
    assert "SELECT pg_terminate_backend(" in message, message
    assert int(re.search(r"has been held for (\d+) s", message).group(1)) >= 3, message
    assert waited < 3 + 10 * storage_module.LOCK_POLL, waited  # a look between tries, not a wait for ever
    with location.lock(storage):  # the server released the killed holder's lock
        pass
