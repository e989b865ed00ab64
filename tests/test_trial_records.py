"""Trial records have one owner: an attribute added to ``TrialRecord`` alone is recorded on the trials, copied to
a trial of the same assignment, and shown in trials.csv, pareto.csv and the notebook's trials table."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import optuna
import pandas as pd
import pytest
from optuna.distributions import CategoricalDistribution
from optuna.trial import TrialState

from precsearch.analysis.report import load_run
from precsearch.config.spaces import paper_space
from precsearch.search import objective, trials
from precsearch.search.context import torch_threads
from precsearch.search.settings import SearchConfig
from precsearch.search.study import run_search
from precsearch.search.trials import RetryStaleTrial, TrialRecord, set_attrs

NOTEBOOK = Path(__file__).resolve().parents[1] / "notebooks" / "tradeoff_curves.ipynb"
SPACE = paper_space(proxy={"steps": 4, "batch_size": 16, "image_size": 8, "eval_batch_size": 64})


@dataclasses.dataclass(frozen=True)
class ProbedRecord(TrialRecord):
    """The record with one more result: the proxy's steps times ten, set where the objective records a result."""

    probe: int | None = dataclasses.field(default=None, metadata={"kind": "result"})

    @classmethod
    def from_result(cls, result, **values):
        return super().from_result(result, probe=10 * result.steps_run, **values)


def _notebook_trials(run_dir: Path) -> pd.DataFrame:
    """The notebook's trials table: its own cell, run on the run directory's tables."""
    cells = json.loads(NOTEBOOK.read_text())["cells"]
    source = next("".join(cell["source"]) for cell in cells
                  if cell["cell_type"] == "code" and "tables.trials" in "".join(cell["source"]))
    namespace = {"tables": load_run(run_dir)}
    exec(source, namespace)  # noqa: S102 - the repository's own notebook
    return namespace["trials"]


def test_an_attribute_added_to_the_record_alone_reaches_every_table(tmp_path, monkeypatch):
    for module in (trials, objective):  # the one edit: the record every module uses
        monkeypatch.setattr(module, "TrialRecord", ProbedRecord)
    out = tmp_path / "run"
    with torch_threads(1):
        run_search(SearchConfig("tiny_cnn", SPACE, "digits", trials=6, out_dir=out, device="cpu", progress=False,
                                proxy_steps=4))
    table = pd.read_csv(out / "trials.csv")
    trained = table[table["trained"] & ~table["reference_copy"]]
    assert len(trained) > 0
    assert (trained["probe"] == 10 * trained["steps_run"]).all()  # recorded on the trial, read back
    untrained = table[~table["trained"]]
    assert untrained["probe"].isna().all()  # never set: its default
    copied = table[table["duplicate_of"].notna()]
    for _, row in copied.iterrows():  # a copy of a trial of the same assignment takes it too
        assert row["probe"] == table.set_index("number").loc[int(row["duplicate_of"]), "probe"]
    pareto = pd.read_csv(out / "pareto.csv")
    assert len(pareto) > 0
    assert pareto.set_index("number")["probe"].equals(table.set_index("number").loc[pareto["number"], "probe"])
    shown = _notebook_trials(out)
    assert shown.set_index("number")["probe"].sort_index().equals(table.set_index("number")["probe"].sort_index())


@pytest.mark.filterwarnings("ignore::optuna.exceptions.ExperimentalWarning")  # Optuna's retry callback is
def test_a_dead_workers_trial_is_retried_with_its_origin_and_none_of_its_results():
    study = optuna.create_study()
    trial = study.ask({"g0": CategoricalDistribution(["high", "low"])})
    set_attrs(trial, TrialRecord(origin=("paper r=0.1",), key="k", trains=trial.number, worker="host:1",
                                 trained=True, val_accuracy=0.5))  # died after recording its result
    RetryStaleTrial(3)(study, study.trials[trial.number])
    retry = TrialRecord.from_trial(study.get_trials(states=(TrialState.WAITING,))[0])
    assert retry == TrialRecord(number=retry.number, origin=("paper r=0.1",), retry_of=trial.number,
                                params=dict(trial.params))
