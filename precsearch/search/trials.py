"""Trial records: every attribute a trial of the study carries, named once (``TrialRecord``), how it is stored
on an Optuna trial and read back, and the trials table (trials.csv, pareto.csv) built from it. Adding an
attribute is one field of ``TrialRecord``; Optuna's own bookkeeping (fixed params, constraints, the retry
marker) is read and written here only.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import math
import warnings
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import optuna
import pandas as pd
from optuna.distributions import BaseDistribution
from optuna.storages import BaseStorage, RetryHeartbeatStaleTrialCallback
from optuna.trial import FrozenTrial, TrialState

from precsearch.config.policy import Policy
from precsearch.search.context import SearchContext
from precsearch.search.noise import failed_run
from precsearch.search.origins import origins_cell
from precsearch.search.strategies import assign
from precsearch.train.reading import flagged
from precsearch.train.trainer import ProxyResult

__all__ = ["RetryStaleTrial", "TrialRecord", "copies", "fail_stale", "params_of", "policy_of", "reopen", "retry_trial",
           "set_attrs", "set_constraints", "trials_frame"]

RETRY_OF = "failed_trial"  # Optuna's system attr of a retried trial (its RetryFailedTrialCallback's name)
OPTUNA_CONSTRAINTS = "constraints"  # Optuna's system attr of a constraint is "constraints:<name>"


def _same(value: Any) -> Any:
    return math.nan if value is None else value


def _blank(value: int | None) -> Any:
    """A trial number, or pandas' missing value (an empty cell; the number stays an int, not 3.0)."""
    return pd.NA if value is None else value


def _field(kind: str, default: Any = None, cell: Any = _same) -> Any:
    """A field of ``kind``: "result" (a trial of the same assignment copies it), "own" or "optuna" (Optuna's
    record of the trial: no user attr). ``cell``: its table cell (None: none)."""
    return field(default=default, metadata={"kind": kind, "cell": cell})


_result, _own, _optuna = (functools.partial(_field, kind) for kind in ("result", "own", "optuna"))


@dataclass(frozen=True)
class TrialRecord:
    """What a trial of the study records: its user attrs (``to_attrs``) and what Optuna keeps of it
    (``from_trial``). A field's order is its column's order in the trials table."""

    number: int = _optuna(-1)
    state: str = _optuna(TrialState.WAITING.name)
    origin: tuple[str, ...] = _own((), cell=origins_cell)
    memory: float | None = _result()
    memory_bytes: float | None = _result()
    memory_peak: float | None = _result()
    peak_predicted: float | None = _result()  # the cost model's step peak in bytes
    memory_planned: float | None = _result()
    bytes: float | None = _result()
    low_share: float | None = _result()
    val_accuracy: float | None = _result()
    val_loss: float | None = _result()
    batch_stats_accuracy: float | None = _result()
    val_accuracy_sd: float | None = _result()
    seeds: int | None = _result()
    trained: bool = _result(False)
    diverged: bool = _result(False)
    stopped_at: int | None = _result()
    seed_steps: tuple[int, ...] = _result((), cell=lambda steps: ";".join(str(step) for step in steps))
    branch_steps: int = _result(0)
    reason: str = _result("")
    promotions: tuple[str, ...] = _result((), cell=len)
    skipped_steps: int | None = _result()
    steps_run: int | None = _result()
    wall_time: float | None = _result()
    duplicate_of: int | None = _own(cell=_blank)  # the trial of the same assignment whose results it copied
    reference_copy: bool = _own(False)  # all-high: the calibrated reference's results, not trained again
    retry_of: int | None = _optuna(cell=_blank)  # the interrupted trial it runs again
    worker: str = _own("")
    policy: str = _result("")
    error: str = _own("")
    interrupted: bool = _own(False)
    key: str = _result("")
    final_loss_scale: float | None = _result()
    overflow_max: float | None = _result()
    underflow_max: float | None = _result()
    underflow_mean: float | None = _result()
    device: str = _result("")
    val_accuracies: tuple[float, ...] = _result((), cell=None)
    loss_curve: tuple[float, ...] = _result((), cell=None)
    trains: int | None = _own(cell=None)  # its own number while it holds the claim to train its key
    params: Mapping[str, Any] = field(default_factory=dict, metadata={"kind": "optuna", "cell": None})
    constraints: Mapping[str, float] = field(default_factory=dict, metadata={"kind": "optuna", "cell": None})
    values: tuple[float, ...] | None = _optuna(cell=None)

    def to_attrs(self) -> dict[str, Any]:
        """The user attrs to set on the trial: every field of its own or a result that is not its default."""
        attrs = {}
        for item in _fields(self, ("own", "result")):
            value = getattr(self, item.name)
            if value != item.default:
                attrs[item.name] = list(value) if isinstance(value, tuple) else value
        return attrs

    @classmethod
    def from_trial(cls, trial: FrozenTrial) -> TrialRecord:
        """The record of a trial as the storage holds it."""
        names = {item.name for item in _fields(cls, ("own", "result"))}
        attrs = {name: tuple(value) if isinstance(value, list) else value
                 for name, value in trial.user_attrs.items() if name in names}
        if "seeds" not in attrs and "val_accuracy" in attrs:
            attrs["seeds"] = 1
        return cls(number=trial.number, state=trial.state.name, retry_of=trial.system_attrs.get(RETRY_OF),
                   params=params_of(trial), constraints=trial.constraints,
                   values=None if trial.values is None else tuple(trial.values), **attrs)

    @classmethod
    def from_result(cls, result: ProxyResult, **values: Any) -> TrialRecord:
        """A trained trial's record: what its proxy measured (``result``'s fields of the same name, the loss curve
        rounded), then ``values``."""
        measured = {name: value for name, value in result.to_dict().items() if name in cls.__dataclass_fields__}
        measured["loss_curve"] = tuple(round(value, 5) for value in result.loss_curve)
        return dataclasses.replace(cls(**measured), **values)

    def copied(self) -> TrialRecord:
        """What a trial of the same assignment records instead of training it."""
        return type(self)(duplicate_of=self.number,
                          **{item.name: getattr(self, item.name) for item in _fields(self, ("result",))})

    @property
    def feasible(self) -> bool:
        """A completed trial whose constraints all hold (a trial without constraints was never judged)."""
        return (self.state == TrialState.COMPLETE.name and bool(self.constraints)
                and all(value <= 0 for value in self.constraints.values()))

    def cells(self) -> dict[str, Any]:
        """Its row of the trials table, in field order (``trials_frame`` adds what needs the search's context)."""
        return {item.name: item.metadata.get("cell", _same)(getattr(self, item.name))
                for item in dataclasses.fields(self) if item.metadata.get("cell", _same) is not None}


def _fields(record: TrialRecord | type[TrialRecord], kinds: tuple[str, ...]) -> list[dataclasses.Field]:
    return [item for item in dataclasses.fields(record) if item.metadata.get("kind") in kinds]


def set_attrs(trial: optuna.Trial, record: TrialRecord) -> None:
    """Record ``record``'s attrs (those not at their default) on the running ``trial``."""
    for name, value in record.to_attrs().items():
        trial.set_user_attr(name, value)


def set_constraints(trial: optuna.Trial, constraints: Mapping[str, float]) -> None:
    """Optuna keeps the first value of a trial's constraint; a trial reopened by --resume may have set them before
    its end was lost, so those are written over."""
    recorded = trial.storage.get_trial_system_attrs(trial._trial_id)
    for name, value in constraints.items():
        key = f"{OPTUNA_CONSTRAINTS}:{name}"
        if key in recorded:
            trial.storage.set_trial_system_attr(trial._trial_id, key, float(value))
        else:
            trial.set_constraint(name, value)


def reopen(storage: BaseStorage, trial_id: int, trial: FrozenTrial) -> None:
    """Put a dead run's RUNNING trial back to WAITING with its origin alone (and marked interrupted): every attr
    the dead run recorded goes back to its default, so a rerun that leaves one at its default cannot keep it."""
    defaults = {item.name: list(item.default) if isinstance(item.default, tuple) else item.default
                for item in _fields(TrialRecord, ("own", "result")) if item.name in trial.user_attrs}
    kept = TrialRecord(origin=TrialRecord.from_trial(trial).origin, interrupted=True)
    for name, value in (defaults | kept.to_attrs()).items():
        storage.set_trial_user_attr(trial_id, name, value)
    storage.set_trial_state_values(trial_id, TrialState.WAITING)


def retry_trial(params: Mapping[str, Any], distributions: dict[str, BaseDistribution], origin: tuple[str, ...],
                number: int) -> FrozenTrial:
    """A WAITING trial running interrupted trial ``number``'s assignment again, marked as Optuna marks a retry."""
    return optuna.trial.create_trial(state=TrialState.WAITING, params=dict(params), distributions=distributions,
                                     user_attrs=TrialRecord(origin=origin).to_attrs(), system_attrs={RETRY_OF: number})


class RetryStaleTrial(RetryHeartbeatStaleTrialCallback):
    """Optuna's retry of a dead worker's trial, carrying the trial's origin only. Optuna's would copy every user
    attr: the dead trial's claim and its partial results, which the retry could not set back to their defaults
    (``to_attrs`` writes only the fields that differ from them)."""

    def __call__(self, study: optuna.Study, trial: FrozenTrial) -> None:
        kept = copy.copy(trial)
        kept.user_attrs = TrialRecord(origin=TrialRecord.from_trial(trial).origin).to_attrs()
        super().__call__(study, kept)


def fail_stale(study: optuna.Study) -> None:
    """Fail (and queue again, ``RetryStaleTrial``) the trials whose worker stopped heartbeating."""
    with warnings.catch_warnings():  # Optuna marks it experimental
        warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
        optuna.storages.fail_stale_trials(study)


def params_of(trial: FrozenTrial) -> dict[str, Any]:
    """The trial's decisions: a queued trial's fixed params until it runs."""
    return dict(trial.system_attrs.get("fixed_params") or trial.params)


def copies(frame: pd.DataFrame) -> pd.Series:
    """Rows of a trials table whose results were copied (from a trial of the same assignment, or the reference)."""
    return frame["duplicate_of"].notna() | frame["reference_copy"].astype(bool)


def _row(record: TrialRecord, context: SearchContext, chance: float) -> dict[str, Any]:
    params, values = record.params, record.val_accuracies
    accuracy = math.nan if record.val_accuracy is None else record.val_accuracy
    key = record.key or (context.key(params) if len(params) == len(context.units) else "")
    return {**record.cells(), "val_error": 1.0 - accuracy,
            "reading_flagged": flagged(accuracy, record.batch_stats_accuracy, context.budget.drop),
            "failed_runs": sum(failed_run(value, max(values), chance) for value in values), "feasible": record.feasible,
            "key": key, "decisions": "".join(_level_code(params.get(unit, "high"), context) for unit in context.units)}


def _level_code(level: str, context: SearchContext) -> str:
    """One character per unit for the decisions column: H, L, or the choice's index among the levels."""
    if level == "high":
        return "H"
    if level == "low":
        return "L"
    return str(context.levels.index(level)) if level in context.levels else "?"


def trials_frame(study: optuna.Study, context: SearchContext) -> pd.DataFrame:
    """One row per started trial (queued ones are not trials yet) with origin, memory, proxy metrics, state."""
    chance = context.chance  # read once: it counts the validation labels
    rows = [_row(TrialRecord.from_trial(t), context, chance) for t in study.get_trials(deepcopy=False)
            if t.state != TrialState.WAITING]
    if not rows:  # stopped before the first trial (say, in calibration): still a table with its header
        return pd.DataFrame(columns=list(_row(TrialRecord(), context, chance)))
    return pd.DataFrame(rows)


def policy_of(trial: FrozenTrial, context: SearchContext, provenance: dict[str, Any]) -> Policy:
    assignment = assign(context.graph, context.space, context.decisions(params_of(trial)))
    return context.policy(assignment, provenance)
