"""What every step of a search shares: the data, the budget it picks by, and one process's context."""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import math
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from precsearch.config.compiling import CompileOptions
from precsearch.config.policy import Policy
from precsearch.config.spaces import SearchSpace
from precsearch.config.spec import DEFAULT_MEMORY_MEASURE, MEMORY_MEASURES
from precsearch.cost.model import CostModel
from precsearch.cost.policies import policy_from_assignment
from precsearch.errors import PrecsearchError
from precsearch.graph.tracing import trace
from precsearch.graph.types import TensorGraph
from precsearch.models import check_fits
from precsearch.search.noise import DEFAULT_CONFIDENCE
from precsearch.search.strategies import Candidate, assign, assignment_key, uniform, units
from precsearch.train.data import ImageDataset, load_dataset
from precsearch.train.proxy import ProxyTrainer, Trainer
from precsearch.train.trainer import ProxyResult, build_model

__all__ = ["DEFAULT_ACCURACY_DROP", "Budget", "DataSpec", "SearchContext", "combine_seeds", "proxy_compile",
           "seed_record", "torch_threads"]

DEFAULT_ACCURACY_DROP = 0.01


@dataclass(frozen=True)
class DataSpec:
    """Which dataset the proxies train on: a name of ``precsearch.train.data`` and, for local data, its folder."""

    name: str = "digits"
    root: str | None = None

    def load(self, image_size: int, seed: int = 0) -> tuple[ImageDataset, ImageDataset]:
        return load_dataset(self.name, root=self.root, image_size=image_size, seed=seed)


@dataclass(frozen=True)
class Budget:
    """At most one of ``max_memory`` (ratio of all-high memory) or ``max_accuracy_drop`` (fraction), and the
    memory measure the search minimizes: ``peak`` (of a training step, the default) or ``bytes`` (the paper's)."""

    max_memory: float | None = None
    max_accuracy_drop: float | None = None
    memory: str = DEFAULT_MEMORY_MEASURE
    confidence: float = DEFAULT_CONFIDENCE  # one-sided confidence of accuracy decisions (see precsearch.search.noise)

    def __post_init__(self) -> None:
        if not 0.5 <= self.confidence < 1.0:
            raise PrecsearchError(f"confidence {self.confidence} must lie in [0.5, 1), e.g. 0.9")
        if self.memory not in MEMORY_MEASURES:
            raise PrecsearchError(f"memory measure {self.memory!r}: use one of {', '.join(MEMORY_MEASURES)}")
        if self.max_memory is not None and self.max_accuracy_drop is not None:
            raise PrecsearchError("give either --max-memory or --max-accuracy-drop, not both")
        if self.max_memory is not None and not 0.0 < self.max_memory <= 1.0:
            raise PrecsearchError(f"max memory {self.max_memory} must be a ratio of all-high memory in (0, 1]")
        if self.max_accuracy_drop is not None and not 0.0 <= self.max_accuracy_drop <= 1.0:
            raise PrecsearchError(f"max accuracy drop {self.max_accuracy_drop} must be a fraction in [0, 1] "
                                  "(0.01 = 1 point)")

    @property
    def single_objective(self) -> bool:
        return self.max_memory is not None or self.max_accuracy_drop is not None

    @property
    def drop(self) -> float:
        """The accuracy drop the pick allows (the default 1 point when the budget gives none)."""
        return DEFAULT_ACCURACY_DROP if self.max_accuracy_drop is None else self.max_accuracy_drop

    def describe(self) -> str:
        if self.max_memory is not None:
            return (f"best accuracy with memory <= {self.max_memory:g} of all-high (least memory among accuracies "
                    f"within seed noise of the best at {100 * self.confidence:g}% confidence)")
        return (f"least memory with accuracy within {100 * self.drop:g} point(s) of all-high at "
                f"{100 * self.confidence:g}% confidence")


@dataclass
class SearchContext:
    """Everything one process needs to run trials; ``trainer`` runs the real proxies unless one is injected."""

    model: str
    space: SearchSpace
    data_spec: DataSpec
    budget: Budget
    seed: int
    device: str
    data: tuple[ImageDataset, ImageDataset]
    graph: TensorGraph
    cost: CostModel
    trainer: Trainer
    high_bytes: float = 0.0
    high_peak: float = 0.0
    units: dict[str, list[str]] = field(default_factory=dict)
    all_high: Candidate | None = None  # every unit high: the reference's assignment (its key is the reference's)
    proxy_seeds: int | None = 1  # seeds per proxy; None: chosen from the noise the reference measures
    settings: dict[str, Any] = field(default_factory=dict)  # SearchConfig.settings(): part of the study's config
    compile: CompileOptions | None = None  # how fixed-policy runs compile (None: eagerly); proxies save float32
    checkpoints: Path | None = None  # where this process's runs keep their checkpoints (None: nowhere)

    @classmethod
    def create(cls, model: str, space: SearchSpace, data_spec: DataSpec, budget: Budget, seed: int,
               device: str, data: tuple[ImageDataset, ImageDataset] | None = None,
               proxy_seeds: int | None = 1, trainer: Trainer | None = None,
               compile: CompileOptions | None = None) -> SearchContext:
        """Load the data (unless given), build and trace the model at the proxy's batch and image size, once
        ``check_fits`` found that they fit this machine. ``compile``: how runs compile their step (None: eagerly)."""
        check_fits(model, space.proxy.batch_size, space.proxy.image_size)
        if data is None:
            data = data_spec.load(space.proxy.image_size, seed=0)
        torch.manual_seed(seed)
        network = build_model(model, data[0].num_classes, data[0].images[:2])
        example = data[0].images[:2]  # real images: a data-dependent branch zeros would skip is traced
        graph = trace(network, example, batch_size=space.proxy.batch_size)
        if proxy_seeds is not None and proxy_seeds < 1:
            raise PrecsearchError(f"proxy_seeds={proxy_seeds} must be at least 1 (or auto)")
        context = cls(model=model, space=space, data_spec=data_spec, budget=budget, seed=seed, device=device,
                      data=data, graph=graph, cost=CostModel(graph), proxy_seeds=proxy_seeds,
                      trainer=trainer or ProxyTrainer(model, data, device, space.proxy, proxy_compile(compile)),
                      compile=compile)
        context.units = units(graph, space)
        context.all_high = uniform(graph, space, "high")
        high = context.all_high.assignment
        context.high_bytes = float(context.cost.bytes(high))
        context.high_peak = float(context.cost.peak_bytes(high))
        return context

    @property
    def levels(self) -> list[str]:
        return list(self.space.levels)

    @property
    def assignments(self) -> int:
        """How many distinct assignments the space holds."""
        return len(self.levels) ** len(self.units)

    @property
    def chance(self) -> float:
        """The validation accuracy a network that learned nothing reaches by luck: the majority class's share plus
        3 binomial standard deviations."""
        labels = self.data[1].labels
        share = float(torch.bincount(labels).max()) / len(labels)
        return share + 3.0 * self.sampling_sd(share)

    @property
    def validation_size(self) -> int:
        return len(self.data[1].labels)

    def sampling_sd(self, accuracy: float) -> float:
        """The binomial sd of an accuracy measured on the validation set, which no training shrinks."""
        return math.sqrt(accuracy * (1.0 - accuracy) / self.validation_size)

    def decisions(self, params: Mapping[str, Any]) -> dict[str, str]:
        return {unit: str(params.get(unit, "high")) for unit in self.units}

    def key(self, params: Mapping[str, Any]) -> str:
        return assignment_key(assign(self.graph, self.space, self.decisions(params)))

    def memory(self, assignment: Mapping[str, str], promoted: Sequence[str] = ()) -> tuple[float, float]:
        """(ratio to all-high in the budget's measure, bytes) of an assignment; promoted tensors count as high."""
        ratios, size = self.memories(assignment, promoted)
        return ratios[f"memory_{self.budget.memory}"], size

    def memories(self, assignment: Mapping[str, str], promoted: Sequence[str] = ()) -> tuple[dict[str, float], float]:
        """Both measures as ratios to all-high and the predicted step peak in bytes, and the bytes."""
        effective = dict(assignment)
        for tensor_id in promoted:
            if tensor_id in effective:
                effective[tensor_id] = self.space.high
        size = float(self.cost.bytes(effective))
        peak = float(self.cost.peak_bytes(effective))
        return {"memory_bytes": size / self.high_bytes, "memory_peak": peak / self.high_peak,
                "peak_predicted": peak}, size

    def policy(self, assignment: Mapping[str, str], provenance: Mapping[str, Any]) -> Policy:
        """The policy file for an assignment under this space's numerics (rounding, scaling, guard)."""
        space = self.space
        return policy_from_assignment(
            self.graph, dict(assignment), model=self.model, high_format=space.high, rounding=dict(space.rounding),
            overflow=dict(space.overflow), loss_scaling=dict(space.loss_scaling),
            promotion_threshold=space.promotion_threshold, promotion_kinds=space.promotion_kinds,
            gradient_rounding=space.gradient_rounding, ties=space.ties, master_weights=space.master_weights,
            optimizer=dict(space.optimizer), provenance=dict(provenance))

    def constraints(self, result: ProxyResult | None, memory: float, reference: float | None,
                    margin: float = 0.0) -> dict[str, float]:
        """Constraint values (feasible when all <= 0): divergence (or untrained), then the budget's bound;
        the accuracy bound holds when the mean is within the drop by more than the noise ``margin``."""
        constraints = {"diverged": 1.0 if result is None or result.diverged else 0.0}
        if self.budget.max_memory is not None:
            constraints["memory_budget"] = memory - self.budget.max_memory
        if self.budget.max_accuracy_drop is not None:
            accuracy = result.val_accuracy if result is not None else 0.0
            constraints["accuracy_drop"] = (reference or 0.0) - self.budget.max_accuracy_drop - accuracy + margin
        return constraints

    def checkpoint(self, key: str, seed: int) -> Path | None:
        """Where the run of assignment ``key`` on ``seed`` keeps its state, so that a run stopped anywhere, or
        continued to a later point, goes on from there."""
        if self.checkpoints is None:
            return None
        return self.checkpoints / f"{hashlib.sha256(key.encode()).hexdigest()[:20]}-{seed}.pt"

    def drop_checkpoint(self, key: str, seed: int) -> None:
        """A finished run's checkpoint is removed: nothing continues it."""
        path = self.checkpoint(key, seed)
        if path is not None:
            path.unlink(missing_ok=True)

    def proxy_seed_list(self, count: int) -> list[int]:
        """The seeds of a ``count``-seed proxy, the same for every trial and the reference, so that differences
        are not differences of seeds."""
        return [self.seed + index for index in range(count)]

    def train_seeds(self, policy: Policy | None, steps: int, seeds: Sequence[int]) -> list[ProxyResult]:
        """One run per seed, stopping at the first divergence."""
        results = []
        for seed in seeds:
            results.append(self.trainer(policy, steps, seed))
            if results[-1].diverged:
                break
        return results

    def score(self, result: ProxyResult | None) -> float:
        """The accuracy-side objective value, finite so that Optuna stores it; the worst for None (untrained)."""
        if self.space.accuracy_objective == "val_loss":
            return 1e6 if result is None or not math.isfinite(result.val_loss) else min(result.val_loss, 1e6)
        return 1.0 if result is None else result.val_error

    def values(self, memory: float, result: ProxyResult | None) -> list[float]:
        if self.budget.max_memory is not None:
            return [self.score(result)]
        if self.budget.max_accuracy_drop is not None:
            return [memory]
        return [memory, self.score(result)]


def proxy_compile(options: CompileOptions | None) -> CompileOptions | None:
    """How a search's proxies compile: as ``options`` say, but saving float32, so that every assignment of the
    search trains with one compiled graph (a proxy's memory is priced by the cost model, not measured)."""
    return None if options is None else dataclasses.replace(options, saves_codes=False)


def combine_seeds(results: list[ProxyResult]) -> ProxyResult:
    """One result for proxies of the same policy under several seeds: memory counts every tensor any seed
    promoted, it diverged if any seed did, and the curves are the first seed's."""
    first = results[0]
    if len(results) == 1:
        return first
    diverged = [result for result in results if result.diverged]

    def mean(name: str) -> float | None:  # None where a seed has none (a run read before batch-statistics readings)
        values = [getattr(result, name) for result in results]
        return None if None in values else sum(values) / len(values)

    def total(name: str, combine: Callable[[Iterable[Any]], Any] = sum) -> Any:
        return combine(getattr(result, name) for result in results)

    return dataclasses.replace(
        first, val_accuracy=mean("val_accuracy"), val_loss=mean("val_loss"),
        batch_stats_accuracy=mean("batch_stats_accuracy"), diverged=bool(diverged),
        reason=diverged[0].reason if diverged else "", steps_run=total("steps_run", min),
        skipped_steps=total("skipped_steps", max), promotions=sorted({t for r in results for t in r.promotions}),
        overflow_max=total("overflow_max", max), underflow_max=total("underflow_max", max),
        underflow_mean=mean("underflow_mean"), wall_time=total("wall_time"), steps_spent=total("steps_spent"),
        branch_steps=total("branch_steps"))


def seed_record(accuracies: Sequence[float]) -> dict[str, Any]:
    """Per-seed accuracies, their count and sample sd (NaN for one): a multi-seed run's user attrs."""
    count = len(accuracies)
    mean = sum(accuracies) / count
    sd = math.sqrt(sum((a - mean) ** 2 for a in accuracies) / (count - 1)) if count > 1 else math.nan
    return {"val_accuracies": list(accuracies), "seeds": count, "val_accuracy_sd": sd}


@contextlib.contextmanager
def torch_threads(count: int | None) -> Iterator[None]:
    """torch's intra-op threads for the duration (None: leave as is). Small proxies run best on one."""
    before = torch.get_num_threads()
    if count is not None:
        torch.set_num_threads(count)
    try:
        yield
    finally:
        torch.set_num_threads(before)
