"""Optuna samplers by name: one registry over the shared vocabulary, chosen by a space or --sampler."""

from __future__ import annotations

import json

import optuna
import pytest

from precsearch.config.spaces import paper_space, parse_space
from precsearch.config.spec import SAMPLERS
from precsearch.errors import PrecsearchError
from precsearch.search.context import Budget, DataSpec, SearchContext, torch_threads
from precsearch.search.samplers import FACTORIES, make_sampler
from precsearch.search.settings import SearchConfig
from precsearch.search.study import run_search
from precsearch.search.workers import sampler

PROXY = {"steps": 4, "batch_size": 16, "image_size": 8, "eval_batch_size": 64}
OPTUNA_CLASS = {"tpe": optuna.samplers.TPESampler, "nsga2": optuna.samplers.NSGAIISampler,
                "random": optuna.samplers.RandomSampler, "gp": optuna.samplers.GPSampler}


def test_every_sampler_name_has_one_factory_making_optunas_sampler():
    assert tuple(FACTORIES) == SAMPLERS
    for name in SAMPLERS:
        assert type(make_sampler(name, 3)) is OPTUNA_CLASS[name]
    with pytest.raises(PrecsearchError, match="unknown sampler 'cmaes'; use one of tpe, nsga2, random, gp"):
        make_sampler("cmaes", 0)


def test_a_space_names_its_sampler_which_does_not_change_what_a_trial_trains():
    data = paper_space().to_dict()
    nsga = parse_space({**data, "sampler": "nsga2"})
    assert paper_space().sampler == "tpe" and nsga.sampler == "nsga2"
    assert nsga.fingerprint() == paper_space().fingerprint()
    with pytest.raises(PrecsearchError, match="sampler"):
        parse_space({**data, "sampler": "grid"})


def test_the_search_uses_the_sampler_it_is_given(tmp_path):
    with torch_threads(1):
        result = run_search(SearchConfig("tiny_cnn", paper_space(proxy=PROXY), data="digits", trials=6,
                                         out_dir=tmp_path / "run", proxy_steps=PROXY["steps"], device="cpu",
                                         progress=False, sampler="random"))
    assert result.trials["key"].nunique() == 6
    assert json.loads((tmp_path / "run" / "run.json").read_text())["space"]["sampler"] == "random"
    context = SearchContext.create("tiny_cnn", parse_space({**paper_space(proxy=PROXY).to_dict(), "sampler": "random"}),
                                   DataSpec("digits"), Budget(), 0, "cpu")
    assert type(sampler(context, 0)) is optuna.samplers.RandomSampler
