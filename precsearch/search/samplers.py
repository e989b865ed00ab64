"""The Optuna samplers a search can use, by name: a space's ``sampler`` key, or ``precsearch search --sampler``.

Adding one is a factory here and its name in ``precsearch.config.spec.SAMPLERS``. Each factory takes the seed the
search derives per worker (None in a shared study, whose hosts would otherwise propose the same points).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable

import optuna

from precsearch.config.spec import SAMPLERS
from precsearch.errors import PrecsearchError

__all__ = ["FACTORIES", "make_sampler"]


def _tpe(seed: int | None) -> optuna.samplers.BaseSampler:
    """Multivariate TPE: models joint group choices (the default; it needs few trials to start)."""
    return optuna.samplers.TPESampler(seed=seed, n_startup_trials=5, multivariate=True)


def _nsga2(seed: int | None) -> optuna.samplers.BaseSampler:
    return optuna.samplers.NSGAIISampler(seed=seed)


def _random(seed: int | None) -> optuna.samplers.BaseSampler:
    return optuna.samplers.RandomSampler(seed=seed)


def _gp(seed: int | None) -> optuna.samplers.BaseSampler:
    return optuna.samplers.GPSampler(seed=seed)


FACTORIES: dict[str, Callable[[int | None], optuna.samplers.BaseSampler]] = {
    "tpe": _tpe, "nsga2": _nsga2, "random": _random, "gp": _gp,
}


def make_sampler(name: str, seed: int | None) -> optuna.samplers.BaseSampler:
    """The sampler called ``name``, seeded with ``seed``."""
    if name not in FACTORIES:
        raise PrecsearchError(f"unknown sampler {name!r}; use one of {', '.join(SAMPLERS)}")
    with warnings.catch_warnings():  # some of Optuna's samplers (multivariate TPE, GP) are marked experimental
        warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
        return FACTORIES[name](seed)
