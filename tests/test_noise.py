"""Seed noise as a quantity: pooled noise, confident picks, ties on the front, rank correlations, multi-seed
proxies in the search."""

from __future__ import annotations

import json
import math

import numpy as np
import pandas as pd
import pytest

from precsearch.config.policy import Policy
from precsearch.config.spaces import paper_space
from precsearch.search.context import Budget, DataSpec, SearchContext, torch_threads
from precsearch.search.noise import Noise, explained_by, failed_run, pooled_noise, rank_correlations, seeds_for
from precsearch.search.selection import choose_best, mark_ties
from precsearch.search.settings import SearchConfig
from precsearch.search.study import run_search
from precsearch.train.proxy import run_proxy

T_90_20 = 1.325  # Student t, one-sided 90%, 20 degrees of freedom (printed tables)
PROXY = {"steps": 4, "batch_size": 16, "image_size": 8, "eval_batch_size": 64}


def _frame(rows):
    """A trials table with the columns choose_best reads."""
    base = {"state": "COMPLETE", "trained": True, "diverged": False, "origin": "sampler"}
    return pd.DataFrame([{**base, "number": number, "key": f"k{number}", **row}
                         for number, row in enumerate(rows)])


def test_student_quantile_matches_the_printed_table():
    assert Noise(0.01, 20, 0.9).quantile == pytest.approx(T_90_20, abs=1e-3)
    assert Noise(0.01, 0, 0.9).quantile == 0.0  # unmeasured: the plain comparison


def test_best_json_is_not_chosen_by_a_difference_smaller_than_the_noise():
    """Candidate 1 passes "within 1 point of all-high" by 0.2 points of its mean, far less than the bound's
    margin (1.325 x 0.0075 x sqrt(1/2 + 1/3) = 0.91 points); candidate 2 passes with room to spare."""
    reference, drop = 0.95, 0.01
    frame = _frame([{"memory": 0.40, "val_accuracy": 0.942, "seeds": 2, "val_accuracy_sd": 0.007},
                    {"memory": 0.60, "val_accuracy": 0.955, "seeds": 2, "val_accuracy_sd": 0.007}])
    noise = Noise(0.0075, 20, 0.9)
    margin = T_90_20 * 0.0075 * math.sqrt(1 / 2 + 1 / 3)
    assert 0.942 - margin < reference - drop <= 0.942  # the plain rule would take candidate 1 ...
    plain = choose_best(frame, Budget(max_accuracy_drop=drop), reference, reference_seeds=3)
    assert int(plain["number"]) == 0
    best = choose_best(frame, Budget(max_accuracy_drop=drop), reference, noise, reference_seeds=3)
    assert int(best["number"]) == 1  # ... the confident rule does not
    # its stated confidence, P(true difference > -1 point): t = 0.015 / (0.0075 sqrt(5/6)) = 2.19 lies
    # between the table's 97.5% (2.086) and 99% (2.528) points for 20 df
    assert (0.955 - reference + drop) / (0.0075 * math.sqrt(5 / 6)) == pytest.approx(2.19, abs=0.005)
    assert 0.975 < best["pick_confidence"] < 0.99


def test_memory_budget_takes_the_cheaper_of_two_indistinguishable_points():
    frame = _frame([{"memory": 0.5, "val_accuracy": 0.950, "seeds": 2, "val_accuracy_sd": 0.01},
                    {"memory": 0.7, "val_accuracy": 0.955, "seeds": 2, "val_accuracy_sd": 0.01},
                    {"memory": 0.9, "val_accuracy": 0.990, "seeds": 2, "val_accuracy_sd": 0.01}])
    budget = Budget(max_memory=0.8)
    assert int(choose_best(frame, budget, None)["number"]) == 1  # plain: the higher mean wins
    best = choose_best(frame, budget, None, Noise(0.0075, 20, 0.9))  # 0.5 point gap < 0.99 point margin
    assert int(best["number"]) == 0 and 0 < best["pick_confidence"] < 0.5


def test_too_much_noise_picks_all_high_itself():
    frame = _frame([{"memory": 1.0, "val_accuracy": 0.9, "seeds": 3, "val_accuracy_sd": 0.1},
                    {"memory": 0.5, "val_accuracy": 0.9, "seeds": 3, "val_accuracy_sd": 0.1}])
    best = choose_best(frame, Budget(), 0.9, Noise(0.1, 6, 0.9), reference_seeds=3, reference_key="k0")
    assert int(best["number"]) == 0 and math.isnan(best["pick_confidence"])


def test_front_marks_points_within_noise_of_a_cheaper_point():
    front = _frame([{"memory": 0.3, "val_accuracy": 0.90, "seeds": 3},
                    {"memory": 0.5, "val_accuracy": 0.905, "seeds": 3},
                    {"memory": 0.8, "val_accuracy": 0.98, "seeds": 3}])
    marked = mark_ties(front, Noise(0.0075, 20, 0.9)).set_index("number")["within_noise_of"]
    assert marked.to_dict() == {0: -1, 1: 0, 2: -1}


def test_a_spread_is_explained_by_a_known_sd_up_to_the_chi_square_bound():
    """Three values (2 df): their sample variance is s^2 * chi2 / 2 under a known sd s, and the chi-square
    distribution with 2 df has cdf 1 - exp(-x / 2), so its 90% quantile is -2 ln 0.1 = 4.60517 (by hand)."""
    sd = 0.01
    bound = sd ** 2 * (-2 * math.log(0.1)) / 2  # the largest sample variance a 10% tail still allows
    for variance, explained in ((0.999 * bound, True), (1.001 * bound, False)):
        half_gap = math.sqrt(variance)  # (-d, 0, d) has sample variance d^2
        assert explained_by([0.9 - half_gap, 0.9, 0.9 + half_gap], sd, 0.9) is explained
    assert explained_by([0.911, 0.912, 0.381], 0.0088) is False  # seeds 53 points apart: not sampling noise
    assert explained_by([0.5], 0.0)  # one value has no spread to explain


def test_pooled_noise_by_hand():
    groups = [[0.90, 0.92, 0.91], [0.80, 0.83]]
    frame = _frame([{"val_accuracy": np.mean(g), "val_accuracy_sd": np.std(g, ddof=1), "seeds": len(g)}
                    for g in groups] + [{"val_accuracy": 0.5, "val_accuracy_sd": math.nan, "seeds": 1}])
    residuals = [0.90 - 0.91, 0.92 - 0.91, 0.0, 0.80 - 0.815, 0.83 - 0.815]
    expected = math.sqrt(sum(r * r for r in residuals) / (5 - 2))
    noise = pooled_noise(frame, extra=[[0.5, 0.5]])
    assert noise.df == 4 and noise.sd == pytest.approx(math.sqrt(sum(r * r for r in residuals) / 4))
    assert pooled_noise(frame).sd == pytest.approx(expected) and pooled_noise(frame).df == 3
    assert not pooled_noise(frame.iloc[2:]).measured


def test_a_policy_with_a_failed_run_adds_nothing_to_the_pooled_noise():
    """tiny_cnn on gratings (chance 14.95%): a candidate at 100% and 21.3% on its two seeds failed a run (21.3%
    is nearer chance than 100%); its spread (sd 55.7 points) is left out, and the pooled sd is that of the others,
    by hand. Seeds 3 points apart at 96-99% are noise, not failures."""
    chance = 0.1495
    assert failed_run(0.213, 1.0, chance) and failed_run(0.301, 1.0, chance)
    assert not failed_run(0.965, 0.995, chance) and not failed_run(0.58, 1.0, chance)  # 0.58 > (0.1495 + 1) / 2
    assert not failed_run(0.0957, 0.119, chance)  # no seed learned: nothing failed beside it
    groups = [[1.0, 0.213], [0.96, 0.99], [1.0, 0.999]]
    frame = _frame([{"val_accuracy": np.mean(g), "val_accuracy_sd": np.std(g, ddof=1), "seeds": len(g),
                     "failed_runs": sum(failed_run(a, max(g), chance) for a in g)} for g in groups])
    expected = math.sqrt(((0.96 - 0.975) ** 2 * 2 + (0.0005 ** 2) * 2) / 2)
    noise = pooled_noise(frame)
    assert noise.df == 2 and noise.sd == pytest.approx(expected)
    assert pooled_noise(frame.drop(columns="failed_runs")).df == 3  # a table without the column pools every row


def test_seeds_for_keeps_the_margin_under_half_the_drop():
    noise = Noise(0.0075, 20, 0.9)  # margin(k, 3) = 1.325 * 0.0075 * sqrt(1/k + 1/3)
    assert seeds_for(noise, 0.04, 3) == 1  # 0.0115 <= 0.02
    assert seeds_for(noise, 0.02, 3) == 2  # k=1: 0.0115 > 0.01; k=2: 0.0091
    assert seeds_for(noise, 0.01, 3, max_seeds=4) == 4  # never enough: capped (with a warning)
    assert seeds_for(noise, 0.04, 3, min_seeds=2) == 2  # the search's automatic choice starts at 2


def test_rank_correlations_by_hand():
    result = rank_correlations([1, 2, 3, 4], [1, 3, 2, 4], resamples=200, seed=1)
    assert result["spearman"] == pytest.approx(1 - 6 * 2 / (4 * 15))  # sum of squared rank differences 2
    assert result["kendall"] == pytest.approx((5 - 1) / 6)  # 5 concordant, 1 discordant pair
    assert result["spearman_low"] <= result["spearman"] <= result["spearman_high"]
    assert rank_correlations([1, 2, 3, 4], [1, 3, 2, 4], resamples=200, seed=1) == result  # seeded
    assert math.isnan(rank_correlations([1, 2], [2, 1])["kendall"])


def test_multi_seed_search_records_means_over_the_same_seeds(tmp_path):
    space = paper_space(proxy=PROXY)
    with torch_threads(1):
        result = run_search(SearchConfig("tiny_cnn", space, "digits", trials=3, out_dir=tmp_path / "run",
                                         proxy_steps=4, device="cpu", progress=False, proxy_seeds=2,
                                         budget=Budget(max_accuracy_drop=0.5, memory="bytes")))  # trials 0, 1 trained
        trials = result.trials.set_index("number")
        assert set(trials["seeds"]) <= {1, 2}  # racing: a candidate gains its second seed only while undecided
        context = SearchContext.create("tiny_cnn", space, DataSpec(), Budget(), 0, "cpu")
        row = trials.loc[1]  # the first trial after all-high, trained here with seeds 0 (and 1)
        policy = Policy.load(row["policy"])
        alone = [run_proxy("tiny_cnn", policy, context.data, 4, seed=seed, device="cpu", config=space.proxy)
                 for seed in range(int(row["seeds"]))]
    accuracies = [r.val_accuracy for r in alone]
    assert row["val_accuracy"] == pytest.approx(np.mean(accuracies))
    if len(accuracies) > 1:
        assert row["val_accuracy_sd"] == pytest.approx(np.std(accuracies, ddof=1))
    high = trials.loc[0]
    assert high["reference_copy"] and high["seeds"] == 2  # the reference ran the same two seeds
    noise = json.loads((tmp_path / "run" / "best.json").read_text())["provenance"]["noise"]
    assert noise["confidence"] == 0.9 and noise["seeds"] in (1, 2) and result.noise.df >= 1  # the pick's seeds
