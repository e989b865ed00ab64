"""The Optuna samplers a search can use, by name: a space's ``sampler`` key, or ``precsearch search --sampler``.

Adding one is a factory here and its name in ``precsearch.config.spec.SAMPLERS``. Each factory takes, as ``seed=``, the
seed the search derives per worker (None in a shared study, whose hosts would otherwise propose the same points).
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable

import optuna

from precsearch.config.spec import SAMPLERS
from precsearch.errors import PrecsearchError

__all__ = ["FACTORIES", "make_sampler"]

FACTORIES: dict[str, Callable[..., optuna.samplers.BaseSampler]] = {
    # multivariate TPE, the default: it models joint group choices and needs few trials to start
    "tpe": functools.partial(optuna.samplers.TPESampler, n_startup_trials=5, multivariate=True),
    "nsga2": optuna.samplers.NSGAIISampler, "random": optuna.samplers.RandomSampler, "gp": optuna.samplers.GPSampler,
}


def make_sampler(name: str, seed: int | None) -> optuna.samplers.BaseSampler:
    """The sampler called ``name``, seeded with ``seed``."""
    if name not in FACTORIES:
        raise PrecsearchError(f"unknown sampler {name!r}; use one of {', '.join(SAMPLERS)}")
    with warnings.catch_warnings():  # some of Optuna's samplers (multivariate TPE, GP) are marked experimental
        warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
        return FACTORIES[name](seed=seed)
