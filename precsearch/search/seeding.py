"""The search's starting points: each ``Seeding`` is one source of them, as Optuna's samplers are one class
each, and ``SearchConfig.seeding`` holds the one a search queues first (``PAPER_SEEDING`` by default: all-high,
the paper's sweep and all-low). ``seed_study`` queues them in a study, once, whichever worker takes the step.
"""

from __future__ import annotations

import itertools
from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import Any

import optuna

from precsearch.config.spaces import SearchSpace
from precsearch.search.context import SearchContext
from precsearch.search.ledger import Ledger, pause_point
from precsearch.search.strategies import Candidate, sweep, uniform
from precsearch.search.trials import TrialRecord, params_of

__all__ = ["PAPER_SEEDING", "AllHigh", "AllLow", "PaperSweep", "Seeding", "Seedings", "seed_candidates", "seed_queue",
           "seed_study"]


class Seeding(ABC):
    """One source of the search's starting points: a subclass with a ``name`` and ``candidates``, which the search
    enqueues without knowing it by name."""

    name: str

    def prepared(self, context: SearchContext, study: optuna.Study) -> Seeding:
        """This seeding ready to give candidates for ``context``'s model: one built from measurements takes them
        here, once per study, and keeps them in it (precsearch.search.sensitivity)."""
        return self

    @abstractmethod
    def candidates(self, graph: Any, space: SearchSpace) -> list[tuple[Candidate, str]]:
        """(candidate, origin) pairs; the origin labels the point in the report (``"paper r=0.3"``)."""


class AllHigh(Seeding):
    """Every unit high: the reference every other point is measured against."""

    name = "all-high"

    def candidates(self, graph: Any, space: SearchSpace) -> list[tuple[Candidate, str]]:
        return [(uniform(graph, space, "high"), self.name)]


class PaperSweep(Seeding):
    """The paper's technique at r = 0, 0.1, ..., 1."""

    name = "paper"

    def candidates(self, graph: Any, space: SearchSpace) -> list[tuple[Candidate, str]]:
        return [(candidate, f"paper r={candidate.r:.1f}") for candidate in sweep(graph, space)]


class AllLow(Seeding):
    """Every unit low: the memory end of the front."""

    name = "all-low"

    def candidates(self, graph: Any, space: SearchSpace) -> list[tuple[Candidate, str]]:
        return [(uniform(graph, space, "low"), self.name)]


class Seedings(Seeding):
    """Seedings one after another under one name: the name a study's config records for them."""

    def __init__(self, name: str, parts: Sequence[Seeding]) -> None:
        self.name = name
        self.parts = tuple(parts)

    def prepared(self, context: SearchContext, study: optuna.Study) -> Seeding:
        return Seedings(self.name, [part.prepared(context, study) for part in self.parts])

    def candidates(self, graph: Any, space: SearchSpace) -> list[tuple[Candidate, str]]:
        return [pair for part in self.parts for pair in part.candidates(graph, space)]


PAPER_SEEDING = Seedings("paper", [AllHigh(), PaperSweep(), AllLow()])  # the search's default


def seed_candidates(graph: Any, space: SearchSpace, seeding: Seeding = PAPER_SEEDING
                    ) -> list[tuple[Candidate, list[str]]]:
    """``seeding``'s candidates, each assignment once with the origins of every seed that produced it
    (["all-high", "paper r=0.0"]), so the report can mark the sweep even where points coincide."""
    seen: dict[str, tuple[Candidate, list[str]]] = {}
    for candidate, origin in seeding.candidates(graph, space):
        seen.setdefault(candidate.key, (candidate, []))[1].append(origin)
    return list(seen.values())


def seed_study(study: optuna.Study, context: SearchContext, seeding: Seeding, trials: int, ledger: Ledger) -> None:
    """Queue ``seeding``'s candidates (``seed_queue``) as the study's ``seeds`` step, each under the lease
    (``Ledger.holding``): a worker that takes the step over queues only what is not queued yet."""

    def work(name: str) -> dict[str, Any]:
        prepared = seeding.prepared(context, study)
        queued = {context.key(params_of(trial)) for trial in study.get_trials(deepcopy=False)
                  if len(params_of(trial)) == len(context.units)}
        for decisions, origins in seed_queue(context, trials, prepared):
            if context.key(decisions) in queued:
                continue
            with ledger.holding(name):
                study.enqueue_trial(decisions, user_attrs=TrialRecord(origin=tuple(origins)).to_attrs())
                queued.add(context.key(decisions))
                pause_point(ledger.pause_at, f"queued:{len(queued)}")  # the test hook
        return {"queued": len(queued)}

    ledger.run(["seeds"], work)


def seed_queue(context: SearchContext, trials: int, seeding: Seeding) -> list[tuple[dict[str, str], list[str]]]:
    """What a new study queues, in order, as (decisions, origins): ``seeding``'s candidates, then every other
    assignment of a space that holds no more than ``trials`` (a sampler would propose them again and again)."""
    seeded = seed_candidates(context.graph, context.space, seeding)
    queue = [(dict(candidate.decisions), list(origins)) for candidate, origins in seeded]
    if context.assignments > trials:
        return queue
    known = {candidate.key for candidate, _ in seeded}
    for levels in itertools.product(context.levels, repeat=len(context.units)):
        decisions = dict(zip(context.units, levels, strict=True))
        if context.key(decisions) not in known:
            queue.append((decisions, ["enumerated"]))
    return queue
