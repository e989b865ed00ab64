"""The Optuna search: seeds, bookkeeping of diverged / failed / duplicate trials, resume, budgets, outputs."""

from __future__ import annotations

import json
import multiprocessing
import re
import time

import optuna
import pandas as pd
import pytest
import torch
from optuna.trial import TrialState

from precsearch.config.policy import Policy
from precsearch.config.spaces import paper_space
from precsearch.config.spec import ASSIGNABLE_KINDS
from precsearch.cost.model import CostModel
from precsearch.errors import PrecsearchError
from precsearch.formats.format import get_format
from precsearch.graph.tracing import trace
from precsearch.search.calibration import CalibrationSettings, reference_policy
from precsearch.search.context import Budget, DataSpec, SearchContext, torch_threads
from precsearch.search.ledger import recorded
from precsearch.search.objective import TrialStep
from precsearch.search.reference import Reference
from precsearch.search.seeding import AllHigh, Seedings
from precsearch.search.settings import SearchConfig
from precsearch.search.storage import StudyLocation
from precsearch.search.strategies import R_GRID
from precsearch.search.study import SearchInterrupted, run_search, study_ledger
from precsearch.search.trials import copies
from precsearch.search.workers import WorkerSteps, worker_gpus
from precsearch.train.proxy import ProxyTrainer, build_model

PROXY = {"steps": 4, "batch_size": 16, "image_size": 8, "eval_batch_size": 64}
SPACE = paper_space(proxy=PROXY)
# The search's logic is tested under the paper's measure, whose ratios a hand count can check and whose order
# tiny_cnn's assignments do not tie in (many share a step peak); the default measure has a test of its own.
PAPER_BYTES = Budget(memory="bytes")


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """Tiny proxies run fastest on one thread (and are not slowed by other busy cores)."""
    with torch_threads(1):
        yield


def _search(out, trials, trainer=None, **kwargs):
    """A search with proxies of the space's fixed length (calibration has tests of its own)."""
    kwargs.setdefault("space", SPACE)
    kwargs.setdefault("proxy_steps", kwargs["space"].proxy.steps)
    kwargs.setdefault("budget", PAPER_BYTES)
    config = SearchConfig("tiny_cnn", data="digits", trials=trials, out_dir=out, device="cpu", progress=False,
                          **kwargs)
    return run_search(config, trainer=trainer)


def _distinct(trials):
    """Completed trials that used up budget: every distinct assignment, not the copies of a trial's results."""
    copies = pd.to_numeric(trials["duplicate_of"], errors="coerce").notna()  # read with or without blanks as NaN
    return int(((trials["state"] == "COMPLETE") & ~copies).sum())


def _confirmed(trials):
    """Trained trials with a confirmation, one per assignment, by the confirmed accuracy."""
    rows = trials[trials["trained"] & trials["confirmed_accuracy"].notna()].drop_duplicates("key")
    return rows.sort_values("memory")


def _study(out) -> optuna.Study:
    """The run's study, opened as precsearch opens it (its records checksummed: plain Optuna's are refused)."""
    return optuna.load_study(study_name="precsearch", storage=StudyLocation.of(None, out).open())


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    out = tmp_path_factory.mktemp("search") / "run"
    return out, _search(out, 14)


def _graph():
    torch.manual_seed(0)
    return trace(build_model("tiny_cnn", 10), torch.zeros(1, 3, 8, 8), batch_size=16)


def test_outputs_exist_and_seeds_come_first(run):
    out, result = run
    for name in ("trials.csv", "pareto.csv", "best.json", "run.json", "study.journal", "calibration.csv",
                 "budget.csv"):
        assert (out / name).is_file()
    trials = pd.read_csv(out / "trials.csv", keep_default_na=False)
    assert _distinct(trials) == 14 and set(trials["state"]) == {"COMPLETE"}
    origins = "; ".join(trials["origin"])
    assert all(f"paper r={r:.1f}" in origins for r in R_GRID) and "all-high" in origins and "all-low" in origins
    seeded = trials[trials["origin"] != "sampler"]
    assert list(seeded["number"]) == list(range(len(seeded)))  # enqueued trials run before sampled ones


def test_no_assignment_is_trained_twice(run):
    _, result = run
    trials = result.trials
    fresh = trials[~copies(trials)]
    assert fresh["key"].is_unique
    assert trials["key"].nunique() == 14  # the budget counts distinct assignments, not the sampler's repeats
    high = trials[trials["reference_copy"]]
    assert high["decisions"].tolist() == ["HHHH"]  # all-high is the reference, trained once before the trials
    duplicates = trials[trials["duplicate_of"].notna()]
    for _, row in duplicates.iterrows():
        original = trials.set_index("number").loc[int(row["duplicate_of"])]
        assert original["key"] == row["key"]
        assert (original["val_accuracy"], original["memory"]) == (row["val_accuracy"], row["memory"])
        assert row["wall_time"] == original["wall_time"]  # copied, not re-measured


def test_memory_column_matches_a_hand_count(run):
    _, result = run
    graph = _graph()
    infos = [graph.tensors[tid] for tid in graph.assignable_ids()]
    high_bits = sum(info.numel * get_format(SPACE.high).bits for info in infos)
    low_bits = sum(info.numel * get_format(SPACE.low[info.kind]).bits for info in infos)
    all_low = result.trials[result.trials["decisions"] == "LLLL"].iloc[0]
    assert all_low["memory"] == pytest.approx(low_bits / high_bits)
    assert result.trials[result.trials["decisions"] == "HHHH"].iloc[0]["memory"] == pytest.approx(1.0)


def test_pareto_front_is_the_non_dominated_set(run):
    out, result = run
    trials = result.trials
    ok = trials[trials["feasible"] & trials["trained"]].drop_duplicates("key")
    front = pd.read_csv(out / "pareto.csv")
    points = list(zip(ok["memory"], ok["val_error"], strict=True))

    def dominated(m, e):
        return any((m2 <= m and e2 <= e) and (m2 < m or e2 < e) for m2, e2 in points)

    expected = {(m, e) for m, e in points if not dominated(m, e)}
    assert set(zip(front["memory"], front["val_error"], strict=True)) == expected
    files = sorted(p.name for p in (out / "policies").glob("*.json"))
    assert files == sorted(f"trial_{n:04d}.json" for n in front["number"])


def test_policy_files_reproduce_their_trials_assignment(run):
    out, result = run
    graph = _graph()
    for _, row in pd.read_csv(out / "pareto.csv").iterrows():
        policy = Policy.load(out / "policies" / f"trial_{int(row['number']):04d}.json")
        assignment = policy.assignment(graph)
        levels = dict(zip([f"g{i}" for i in range(4)], row["decisions"], strict=True))
        for tid, spec in assignment.items():
            info = graph.tensors[tid]
            expected = SPACE.low[info.kind] if levels[f"g{info.group}"] == "L" else SPACE.high
            assert spec == expected
        assert policy.provenance["trial"] == int(row["number"])
        assert policy.provenance["proxy"]["val_accuracy"] == pytest.approx(row["val_accuracy"])


def test_best_json_is_least_memory_confirmed_within_one_point_of_all_high(run):
    out, result = run
    confirmed = _confirmed(result.trials)
    assert (confirmed["confirmed_steps"] == 3 * 4).all() and (confirmed["confirmed_seeds"] == 1).all()
    reference = float(confirmed[confirmed["decisions"] == "HHHH"]["confirmed_accuracy"].iloc[0])
    ok = confirmed[confirmed["confirmed_accuracy"] >= reference - 0.01 - 1e-12]
    best = Policy.load(out / "best.json")
    chosen = result.trials.set_index("number").loc[best.provenance["trial"]]
    assert chosen["memory"] == pytest.approx(ok["memory"].min())
    # sequential confirmation: every front point cheaper than the pick was tried, none dearer
    front = result.pareto[result.pareto["key"] != chosen["key"]]
    tried = front["key"].isin(confirmed["key"])
    assert tried[front["memory"] < chosen["memory"]].all() and not tried[front["memory"] > chosen["memory"]].any()
    assert best.provenance["confirmation"]["confirmed_accuracy"] == pytest.approx(chosen["confirmed_accuracy"])


def test_run_json_records_the_config(run):
    out, _ = run
    config = json.loads((out / "run.json").read_text())
    assert config["model"] == "tiny_cnn" and config["space"]["proxy"]["steps"] == 4 and config["seed"] == 0
    assert config["proxy_length"] == 4 and config["calibration"]["fixed"] and config["confirmation"]["length"] == 12


def test_the_reference_is_confirmed_by_continuing_its_calibration_runs_as_a_fresh_run_would_read(run):
    """Confirmation trains only the reference's steps past the proxy length (its checkpoints from calibration,
    same policy and seeds), and what it reads is what a run of the confirmation's length from scratch reads."""
    out, _ = run
    attrs = _study(out).user_attrs
    summary = attrs["confirmation"]
    assert summary["reference_seeds"] == attrs["calibration"]["seeds"] and summary["seeds"][0] == 1000
    context = SearchContext.create("tiny_cnn", SPACE, DataSpec("digits"), Budget(), 0, "cpu")
    for seed in summary["reference_seeds"]:
        continued = recorded(attrs, f"confirm:{summary['reference']}:{seed}")
        assert continued["steps_spent"] == 12 - 4  # its decay after 4, read at its end: a fresh run spends 12
        fresh = context.trainer(reference_policy(context), 12, seed, decay_from=4)
        assert (continued["val_accuracy"], continued["val_loss"]) == (fresh.val_accuracy, fresh.val_loss)


def test_diverged_trials_are_complete_and_infeasible(tmp_path):
    wild = paper_space(proxy={**PROXY, "steps": 30, "lr": 1e4})
    result = _search(tmp_path / "run", 3, space=wild)
    assert set(result.trials["state"]) == {"COMPLETE"}
    assert result.trials["diverged"].all() and not result.trials["feasible"].any()
    started = [t for t in _study(tmp_path / "run").trials if t.state != TrialState.WAITING]
    assert len(started) == 3
    for trial in started:
        assert trial.state == TrialState.COMPLETE and trial.constraints["diverged"] > 0
        assert trial.user_attrs["reason"]
    assert result.pareto.empty and result.best is None and not (tmp_path / "run" / "best.json").exists()


REFERENCE_CALLS = len(CalibrationSettings(fixed=SPACE.proxy.steps).points())  # its run, read at each point


class Failing:
    """The real proxies, but the ``on_call``-th call raises ``error`` (the first ``REFERENCE_CALLS`` continue the
    reference's run)."""

    def __init__(self, error, on_call):
        self.real = ProxyTrainer("tiny_cnn", DataSpec("digits").load(SPACE.proxy.image_size), "cpu", SPACE.proxy)
        self.error, self.on_call, self.calls = error, on_call, 0

    def __call__(self, *args, **kwargs):
        self.calls += 1
        if self.calls == self.on_call:
            raise self.error
        return self.real(*args, **kwargs)


def test_a_raising_trial_is_failed_and_the_study_goes_on(tmp_path):
    result = _search(tmp_path / "run", 6, trainer=Failing(RuntimeError("boom"), on_call=REFERENCE_CALLS + 1))
    states = result.trials["state"].tolist()
    assert states.count("FAIL") == 1 and _distinct(result.trials) == 5
    failed = result.trials[result.trials["state"] == "FAIL"].iloc[0]
    assert failed["error"] == "RuntimeError: boom" and failed["number"] == 1


def test_interrupt_keeps_completed_trials_and_resume_finishes(tmp_path):
    out = tmp_path / "run"
    with pytest.raises(SearchInterrupted) as stop:
        _search(out, 6, trainer=Failing(KeyboardInterrupt(), on_call=REFERENCE_CALLS + 2))
    saved = pd.read_csv(out / "trials.csv", keep_default_na=False)
    assert saved["state"].tolist() == ["COMPLETE", "COMPLETE", "FAIL"]
    assert stop.value.result.interrupted
    interrupted_key = _study(out).trials[2].user_attrs["key"]
    result = _search(out, 6, resume=True)
    trials = result.trials
    assert trials.iloc[:2]["key"].tolist() == saved.iloc[:2]["key"].tolist()
    before = saved.iloc[:2]["val_accuracy"].astype(float).tolist()
    assert trials.iloc[:2]["val_accuracy"].tolist() == pytest.approx(before)
    assert _distinct(trials) == 6  # the interrupted trial does not use budget
    retried = trials[(trials["key"] == interrupted_key) & (trials["state"] == "COMPLETE")]
    assert len(retried) == 1 and pd.isna(retried.iloc[0]["duplicate_of"])


def test_a_trial_left_running_by_a_killed_process_is_requeued(tmp_path):
    out = tmp_path / "run"
    first = _search(out, 2).trials
    study = _study(out)
    orphan = study.ask()  # pops the next enqueued assignment into RUNNING, as a kill -9 would leave it
    orphan_params = dict(orphan.params) or study.trials[orphan.number].system_attrs["fixed_params"]
    result = _search(out, 4, resume=True)
    trials = result.trials
    orphan_row = trials.set_index("number").loc[orphan.number]
    assert orphan_row["state"] == "COMPLETE" and orphan_row["interrupted"]  # run again in place, once
    assert trials.iloc[:2]["val_accuracy"].tolist() == first["val_accuracy"].tolist()
    assert _distinct(trials) == 4 and len(trials) == 4
    study = _study(out)
    assert study.trials[orphan.number].params == orphan_params


def test_a_requeued_trial_keeps_nothing_its_dead_run_recorded(tmp_path):
    out = tmp_path / "run"
    _search(out, 2)
    study = _study(out)
    orphan = study.ask()
    for name, value in {"error": "RuntimeError: stale", "diverged": True, "reason": "stale", "wall_time": -1.0}.items():
        orphan.set_user_attr(name, value)  # what a run killed after recording part of its end leaves
    row = _search(out, 3, resume=True).trials.set_index("number").loc[orphan.number]
    assert row["state"] == "COMPLETE" and row["interrupted"]
    assert row["error"] == "" and row["reason"] == "" and not row["diverged"] and row["wall_time"] > 0


def test_max_memory_budget(tmp_path):
    result = _search(tmp_path / "run", 8, budget=Budget(max_memory=0.6, memory="bytes"))
    trials = result.trials
    over = trials[trials["memory_planned"] > 0.6]
    assert len(over) > 0 and not over["trained"].any() and not over["feasible"].any()
    assert set(over["reason"]) == {"over the memory budget"}
    confirmed = _confirmed(trials)
    under = confirmed[confirmed["memory"] <= 0.6]
    assert result.best["memory"] <= 0.6 and len(under) > 0
    assert result.best["val_accuracy"] == under["confirmed_accuracy"].max()  # one seed: the best confirmed mean


def test_max_accuracy_drop_budget(tmp_path):
    result = _search(tmp_path / "run", 6, budget=Budget(max_accuracy_drop=0.05, memory="bytes"))
    reference = Reference.from_study(_study(tmp_path / "run")).result.val_accuracy
    trials = result.trials
    high = trials[trials["decisions"] == "HHHH"].iloc[0]
    assert high["reference_copy"] and high["val_accuracy"] == reference  # not trained twice
    confirmed = _confirmed(trials)
    confirmed_high = float(confirmed[confirmed["decisions"] == "HHHH"]["confirmed_accuracy"].iloc[0])
    ok = confirmed[confirmed["confirmed_accuracy"] >= confirmed_high - 0.05]
    assert result.best["memory"] == ok["memory"].min()


def test_the_search_minimizes_the_predicted_peak_by_default_and_reports_both_measures(tmp_path, run):
    result = _search(tmp_path / "run", 4, budget=Budget())
    graph = _graph()
    cost = CostModel(graph)
    trained = result.trials[result.trials["trained"]]
    for _, row in trained.iterrows():  # each measure from the cost model, for the trial's own policy file
        assignment = Policy.load(row["policy"]).assignment(graph)
        high = {tid: SPACE.high for tid in graph.assignable_ids()}
        assert row["memory_peak"] == pytest.approx(cost.peak_bytes(assignment) / cost.peak_bytes(high))
        assert row["memory_bytes"] == pytest.approx(cost.bytes(assignment) / cost.bytes(high))
    assert (trained["memory"] == trained["memory_peak"]).all()
    assert (trained["memory_peak"] != trained["memory_bytes"]).any()  # the two measures differ
    bytes_run = run[1].trials[run[1].trials["trained"]]
    assert (bytes_run["memory"] == bytes_run["memory_bytes"]).all()  # the paper's measure, when asked for
    assert {"memory_bytes", "memory_peak"} <= set(result.pareto.columns)
    with pytest.raises(PrecsearchError, match="memory measure 'rss'"):
        Budget(memory="rss")


def test_budget_validation():
    with pytest.raises(PrecsearchError, match="not both"):
        Budget(max_memory=0.5, max_accuracy_drop=0.01)
    with pytest.raises(PrecsearchError, match=r"\(0, 1\]"):
        Budget(max_memory=1.5)
    with pytest.raises(PrecsearchError, match="0.01 = 1 point"):
        Budget(max_accuracy_drop=2)


def test_storage_url_and_errors(tmp_path):
    out = tmp_path / "run"
    with pytest.raises(PrecsearchError, match="cannot open study storage"):
        _search(out, 2, storage=f"sqlite:///{tmp_path}/missing/dir/study.db")
    assert not out.exists()
    result = _search(out, 2, storage=f"sqlite:///{tmp_path}/study.db")
    assert (tmp_path / "study.db").is_file() and not (out / "study.journal").exists()
    assert _distinct(result.trials) == 2


def test_out_dir_rules(tmp_path):
    out = tmp_path / "run"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    with pytest.raises(PrecsearchError, match="not empty; pass --resume"):
        _search(out, 2)
    with pytest.raises(PrecsearchError, match="nothing to resume"):
        _search(tmp_path / "fresh", 2, resume=True)
    assert not (tmp_path / "fresh").exists()
    _search(tmp_path / "done", 2)
    with pytest.raises(PrecsearchError, match="different seed"):
        _search(tmp_path / "done", 3, resume=True, seed=1)


def test_categorical_and_tensor_spaces_search(tmp_path):
    space = paper_space(proxy=PROXY, granularity="categorical", choices={"half": "fp16"})
    trials = _search(tmp_path / "cat", 4, space=space).trials
    assert set(trials["state"]) == {"COMPLETE"} and _distinct(trials) == 4
    # the sampler is offered every level of the space for every unit (seeded trials included)
    for trial in _study(tmp_path / "cat").trials:
        assert {name: dist.choices for name, dist in trial.distributions.items()} == dict.fromkeys(
            trial.params, tuple(space.levels))
    assert tuple(space.levels) == ("high", "low", "half")
    per_tensor = paper_space(proxy=PROXY, granularity="tensor")
    trials = _search(tmp_path / "tensor", 3, space=per_tensor).trials
    graph = _graph()
    assert len(trials.iloc[0]["decisions"]) == len(graph.assignable_ids())
    assert {graph.tensors[t].kind for t in graph.assignable_ids()} == set(ASSIGNABLE_KINDS)


@pytest.mark.slow
def test_parallel_workers_share_the_study(tmp_path, capsys):
    config = SearchConfig("tiny_cnn", data="digits", trials=10, out_dir=tmp_path / "run", device="cpu", jobs=2,
                          space=SPACE, proxy_steps=100)  # long enough to report (every 10 steps) and be drawn
    # (the bar draws at most once a second: 20-step trials under a loaded CI ran between two draws)
    result = run_search(config)
    trials = result.trials
    assert _distinct(trials) == 10  # the trials other workers are running count against the budget
    fresh = trials[trials["trained"] & ~copies(trials)]
    assert fresh["key"].is_unique
    # the parent's bar shows where the workers' proxies stand, read from the memory they share with it
    shown = set(re.findall(r"worker (\d): trial (\d+), seed (\d+): step (\d+)/(\d+)", capsys.readouterr().err))
    assert shown and all(int(step) <= int(steps) == 100 for *_, step, steps in shown)
    assert {int(trial) for _, trial, *_ in shown} <= set(fresh["number"])


@pytest.mark.slow
def test_workers_resuming_the_last_trial_start_no_trial_past_the_budget(tmp_path):
    """Resumed with one trial left, its interrupted trial queued again: one worker retries it, and the other is
    not started, since each worker takes a trial before any budget check (it would sample a third)."""
    out, seeding = tmp_path / "run", Seedings("all-high", [AllHigh()])
    with pytest.raises(SearchInterrupted):  # trial 0 (all-high) is the reference's copy; trial 1 is interrupted
        _search(out, 2, trainer=Failing(KeyboardInterrupt(), on_call=REFERENCE_CALLS + 1), seeding=seeding)
    assert [t.state for t in _study(out).trials] == [TrialState.COMPLETE, TrialState.FAIL]
    trials = _search(out, 2, resume=True, jobs=2, seeding=seeding).trials
    assert _distinct(trials) == 2
    assert [t.system_attrs.get("failed_trial") for t in _study(out).trials] == [None, None, 1]  # no trial 3


def test_a_torn_journal_record_is_dropped_on_resume(tmp_path):
    out = tmp_path / "run"
    first = _search(out, 2).trials
    with (out / "study.journal").open("ab") as journal:
        journal.write(b'{"op_code": 5, "worker_id": "x", "trial_id": 9')  # a write cut short by kill -9
    trials = _search(out, 3, resume=True).trials
    assert trials.iloc[:2]["key"].tolist() == first["key"].tolist()
    assert _distinct(trials) == 3
    assert (out / "study.journal").read_bytes().endswith(b"\n")


def test_a_runs_workers_share_out_its_steps_and_a_later_run_takes_a_dead_ones_claim_at_once(tmp_path):
    """The ledger of a run with --jobs: a worker leaves a step its sibling claimed (a lease), and with
    ``wait=False`` goes on without it; the parent, which takes steps only while no worker runs, and a resumed run
    (another run id) take a claim left by a killed worker at once, without waiting out the lease."""
    location = StudyLocation.of(None, tmp_path)
    storage = location.open()
    study = optuna.create_study(study_name="precsearch", storage=storage)
    first, second = (study_ledger(study, location, storage, "r1", index) for index in (1, 2))
    ran = []

    def work(name):
        ran.append(name)
        return {"done": name}

    with first.lock():  # worker 1 holds step "a" (as its claim looks while it trains)
        study.set_user_attr("claim:a", {"worker": first.worker, "since": time.time(), "time": time.time()})
    assert second.run(["a", "b"], work, wait=False) == {"b": {"done": "b"}}  # "a" is left to worker 1
    assert ran == ["b"]
    parent = study_ledger(study, location, storage, "r1", 0)
    resumed = study_ledger(study, location, storage, "r2", 1)
    for ledger, name in ((parent, "a"), (resumed, "c")):
        with ledger.lock():
            study.set_user_attr(f"claim:{name}", {"worker": first.worker, "since": time.time(), "time": time.time()})
        assert ledger.run([name], work)[name] == {"done": name}  # at once: the lease is 60 s
    assert ran == ["b", "a", "c"]


@pytest.mark.slow
def test_jobs_workers_train_calibration_and_confirmation_runs_side_by_side(tmp_path):
    """With --jobs 2 the worker processes, not the parent, train calibration's and confirmation's runs, and share
    them out (all-high's two seeds in calibration; all-high's and plain fp32's runs in confirmation): the claims
    the study keeps name the worker that trained each run. The runs are long enough (300 and 900 steps) that a
    worker is still training its first when the other, started with it, comes for one."""
    out = tmp_path / "run"
    space = paper_space(proxy={**PROXY, "steps": 300})
    result = _search(out, 2, jobs=2, proxy_seeds=2, space=space)
    claims = {name.removeprefix("claim:"): claim["worker"] for name, claim in _study(out).user_attrs.items()
              if name.startswith("claim:")}
    runs = {name: worker for name, worker in claims.items() if name.startswith(("calibration:", "confirm:"))}
    assert {name.split(":")[1] for name in runs} >= {"300", result.confirmation.reference, "plain-fp32"}
    run_ids = {worker.split("/")[0] for worker in runs.values()}
    assert len(run_ids) == 1 and run_ids.pop().startswith("run ")
    assert {worker.split("/")[1] for worker in runs.values()} == {"1", "2"}  # both workers trained; no parent (0)
    assert result.best is not None


def test_the_bar_drops_a_worker_that_exited():
    """A worker clears its slot when it exits (``run_worker``), so the bar no longer shows its last trial's step
    beside the workers still training."""
    steps = WorkerSteps(multiprocessing.get_context("spawn"), 2)
    steps.record(1, TrialStep(25, 1, 50, 3200))
    steps.record(2, TrialStep(28, 0, 10, 3200))
    assert steps.shown() == "worker 1: trial 25, seed 1: step 50/3200; worker 2: trial 28, seed 0: step 10/3200"
    steps.clear(1)
    assert steps.shown() == "worker 2: trial 28, seed 0: step 10/3200"
    steps.record_run(1, "confirming", 4100)  # calibration's and confirmation's runs: the phase and the step
    assert steps.shown() == "worker 1: confirming: step 4100; worker 2: trial 28, seed 0: step 10/3200"


def test_workers_get_one_visible_gpu_each(monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3,5")
    assert worker_gpus(2, cuda=True) == ["3", "5"]
    assert worker_gpus(3, cuda=True) == ["3", "5", "3"]  # more workers than GPUs: in turn
    assert worker_gpus(2, cuda=False) == [None, None]
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    with pytest.raises(PrecsearchError, match="hides every GPU"):
        worker_gpus(2, cuda=True)
