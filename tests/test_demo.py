"""The demo holds prior-work baselines near the pick's memory to all-high as the pick was held, with scripted
learning curves (precsearch.cli.demo.held_baselines)."""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import pandas as pd
import pytest
from scripted import ScriptedTrainer

from precsearch.cli.demo import DATA, MODEL, PROXY, held_baselines
from precsearch.config.spaces import paper_space
from precsearch.search.calibration import run_record
from precsearch.search.confirmation import Confirmation
from precsearch.search.context import Budget, DataSpec, SearchContext
from precsearch.search.strategies import baseline_policies
from precsearch.train.trainer import ProxyResult

LENGTH, SEEDS = 1200, (1000, 1001, 1002)


def _record(accuracy: float, seed: int) -> dict:
    result = ProxyResult(val_accuracy=accuracy, val_loss=1 - accuracy, diverged=False, reason="", steps_run=LENGTH,
                         loss_curve=[], val_curve=[], steps_spent=LENGTH)
    return run_record(result, seed)


@pytest.mark.parametrize(("wang_accuracy", "trained_seeds", "named"), [
    (0.1, 1, "hfp8, 0.865"),  # at chance on its first seed: out, and the next baseline in is hfp8
    (1.0, 1, "wang_fp8, 0.523"),  # as all-high (whose 3 seeds give the noise its degrees of freedom): in
])
def test_a_baseline_near_the_pick_is_confirmed_seed_by_seed_and_named_when_in(tmp_path, wang_accuracy,
                                                                              trained_seeds, named):
    """wang_fp8 (0.523 of all-high's bytes) is within 10% of a 0.522 pick: it trains on the confirmation's
    seeds at its length until the drop rule decides. fp8 (0.500) diverged at the proxy length: out, untrained.
    hfp8 (0.865) holds more than 1/0.9 of the pick's memory: not trained, and the claim is held against it."""
    context = SearchContext.create(MODEL, paper_space(proxy=PROXY), DataSpec(DATA), Budget(max_accuracy_drop=0.01),
                                   0, "cpu")
    trainer = ScriptedTrainer(lambda name, step, length, seed: wang_accuracy, context)
    context = dataclasses.replace(context, trainer=trainer)
    policies = baseline_policies(context.graph, ("fp8", "wang_fp8", "hfp8"))
    rows = []
    for name, memory, diverged in (("fp8", 0.500, True), ("wang_fp8", 0.523, False), ("hfp8", 0.865, False)):
        policies[name].save(tmp_path / f"{name}.json")
        rows.append({"source": "baseline", "name": name, "memory": memory, "diverged": diverged,
                     "policy": f"{name}.json"})
    high_runs = [_record(1.0, seed) for seed in (0, 1, 2)]
    result = SimpleNamespace(out_dir=tmp_path, confirmation=Confirmation(LENGTH, {context.all_high.key: high_runs},
                                                                           SEEDS, context.all_high.key, (0, 1, 2)))
    shown = held_baselines(pd.DataFrame(rows), {"memory": 0.522}, result, context)
    assert [(call["length"], call["seed"]) for call in trainer.calls] == [(LENGTH, seed)
                                                                           for seed in SEEDS[:trained_seeds]]
    assert "fp8         memory 0.500  diverged at the proxy length: out" in shown
    memory = float(named.split(", ")[1])
    how = "confirmed within the drop" if wang_accuracy == 1 else f"not held: {memory / 0.522:.2f}x the pick's memory"
    assert shown.splitlines()[-1] == (f"the least-memory baseline not ruled out: {named} ({how}); the pick holds "
                                      f"{1 - 0.522 / memory:.0%} less memory")
