"""What a search is asked to do, as one frozen value: ``run_search(SearchConfig(...))``."""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

from precsearch.config.compiling import CompileOptions
from precsearch.config.spaces import SearchSpace, load_space, parse_space
from precsearch.errors import PrecsearchError
from precsearch.search.calibration import CalibrationSettings
from precsearch.search.confirmation import DEFAULT_CONFIRM_FACTOR, MAX_CONFIRM_FACTOR
from precsearch.search.context import Budget, DataSpec
from precsearch.search.noise import MAX_PROXY_SEEDS
from precsearch.search.seeding import PAPER_SEEDING, Seeding

__all__ = ["AUTO", "DEFAULT_HEARTBEAT", "SearchConfig", "usable_jobs"]

log = logging.getLogger(__name__)

AUTO = "auto"
DEFAULT_HEARTBEAT = 20  # seconds between heartbeats; a trial silent for 3x this is failed and retried


@dataclass(frozen=True)
class SearchConfig:
    """A search of ``model`` in ``space`` (a space, or a YAML file) on ``data``; outputs go to ``out_dir``.

    ``proxy_steps``: ``"auto"`` calibrates the proxy length (precsearch.search.calibration, doubling from
    ``calibration_start`` up to ``max_proxy_steps``); an integer fixes it. ``confirm_factor``: the confirmation
    runs' length as a multiple of the proxy length. ``proxy_seeds``: seeds per proxy and for the reference (None:
    chosen from the noise, ``noise.seeds_for``). ``study_name`` joins the shared study of that name in
    ``storage`` (``trials`` is then the study's total); ``sampler`` replaces the space's Optuna sampler.
    ``seeding``: the search's first trials (precsearch.search.seeding).
    """

    model: str
    space: SearchSpace | str | Path
    data: DataSpec | str = "digits"
    trials: int = 40
    out_dir: str | Path = "runs/search"
    proxy_steps: int | str = AUTO
    max_proxy_steps: int = CalibrationSettings.max_steps
    calibration_start: int = CalibrationSettings.start
    confirm_factor: float = DEFAULT_CONFIRM_FACTOR
    storage: str | None = None
    jobs: int = 1
    resume: bool = False
    budget: Budget = field(default_factory=Budget)
    seed: int = 0
    device: str = "auto"
    batch_size: int | None = None
    image_size: int | None = None
    threads: int | None = None
    progress: bool = True
    study_name: str | None = None
    heartbeat: int = DEFAULT_HEARTBEAT
    proxy_seeds: int | None = 1
    sampler: str | None = None
    seeding: Seeding = PAPER_SEEDING
    compile: CompileOptions | None = None  # how its runs compile their step (None: eagerly)
    pause_at: str | None = None  # test hook: where this search stops itself (ledger.pause_point)

    SETTINGS: ClassVar[tuple[str, ...]] = ("proxy_steps", "max_proxy_steps", "calibration_start", "confirm_factor",
                                           "seeding")

    def __post_init__(self) -> None:
        if self.trials < 1 or self.jobs < 1 or (self.threads is not None and self.threads < 1):
            raise PrecsearchError(f"trials={self.trials}, jobs={self.jobs} and threads={self.threads} must be at "
                                  "least 1")
        if self.proxy_steps != AUTO and not (isinstance(self.proxy_steps, int) and self.proxy_steps >= 1):
            raise PrecsearchError(f"proxy steps {self.proxy_steps!r}: give auto or a number of steps >= 1")
        if not 1 <= self.confirm_factor <= MAX_CONFIRM_FACTOR:
            raise PrecsearchError(f"confirmation factor {self.confirm_factor:g} must be in [1, {MAX_CONFIRM_FACTOR}]")
        if self.proxy_seeds is not None and not 1 <= self.proxy_seeds <= MAX_PROXY_SEEDS:
            raise PrecsearchError(f"proxy_seeds={self.proxy_seeds} must be in [1, {MAX_PROXY_SEEDS}] (or None: chosen "
                                  "from the noise)")
        self.calibration  # noqa: B018 (checks the schedule)
        jobs = usable_jobs(self.jobs, self.trials)
        if jobs < self.jobs:  # a worker beyond these would only start, load the model and wait: memory for nothing
            log.info("--jobs %d: %d worker process(es), as many as %d trial(s) on %d CPU(s) can use", self.jobs, jobs,
                     self.trials, os.cpu_count() or 1)
            object.__setattr__(self, "jobs", jobs)

    @property
    def calibration(self) -> CalibrationSettings:
        fixed = None if self.proxy_steps == AUTO else int(self.proxy_steps)
        return CalibrationSettings(start=self.calibration_start, max_steps=self.max_proxy_steps, fixed=fixed)

    @property
    def data_spec(self) -> DataSpec:
        return DataSpec(self.data) if isinstance(self.data, str) else self.data

    def resolved_space(self) -> SearchSpace:
        """The space with the batch and image size given here, and the sampler if one is given."""
        space = load_space(self.space) if isinstance(self.space, str | Path) else self.space
        space = space.with_proxy(batch_size=self.batch_size, image_size=self.image_size,
                                 steps=self.proxy_steps if self.proxy_steps != AUTO else None)
        if self.sampler is not None:  # checked like a space file's key
            space = parse_space({**space.to_dict(), "sampler": self.sampler}, "--sampler")
        return space

    def settings(self) -> dict[str, Any]:
        """The settings that, with the model, space, data, seed and budget, decide what a study means (as the
        study's config records them: a seeding by its name)."""
        return {name: _recorded(getattr(self, name)) for name in self.SETTINGS}


def usable_jobs(jobs: int, trials: int) -> int:
    """Worker processes a search of ``trials`` trials can use: no more than its trials, nor than the CPUs (each
    worker is a process of its own, on a GPU too)."""
    return max(1, min(jobs, trials, os.cpu_count() or 1))


def _recorded(value: Any) -> Any:
    """A setting as JSON keeps it."""
    if isinstance(value, Seeding):
        return value.name
    return list(value) if isinstance(value, tuple) else value
