"""The trainer: same numbers as before it left proxy.py, and no process-wide state left behind."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from precsearch.config.spaces import paper_space
from precsearch.config.spec import ProxyConfig
from precsearch.cost.policies import policy_from_assignment
from precsearch.graph.tracing import trace
from precsearch.models import build
from precsearch.search.context import torch_threads
from precsearch.search.strategies import paper_assignment
from precsearch.train.data import load_dataset
from precsearch.train.trainer import PAPER_RECIPE, train

# bn_images=0: read with the running averages, as the pinned numbers were (the reading recomputes them now,
# precsearch.train.reading; the training itself, the loss curve, is unchanged by that)
CONFIG = ProxyConfig(steps=6, batch_size=16, image_size=8, lr=0.1, eval_batch_size=64, bn_images=0)
# proxy.train of commit 087af98 (before the trainer moved here), seed 3, one thread, on the CPU: (loss curve,
# validation loss, validation accuracy), with the paper's recipe and a proxy's, by the kernels torch's CPU
# capability selects (float32 sums differ in their last bit between them). AVX2: 087af98 run on an AVX2-only
# machine; AVX512: pinned first, on a machine whose kernels were not AVX2's (its capability was not recorded).
BEFORE = {
    "AVX512": {
        "paper": (["0x1.2b3eb80000000p+1", "0x1.2f185c0000000p+1", "0x1.2072880000000p+1", "0x1.359c780000000p+1",
                   "0x1.1556120000000p+1", "0x1.22d2aa0000000p+1"], "0x1.2199ba0000000p+1", 0.125),
        "proxy": (["0x1.2517fa0000000p+1", "0x1.29dd940000000p+1", "0x1.13d46a0000000p+1", "0x1.2472140000000p+1",
                   "0x1.d034440000000p+0", "0x1.ddf58c0000000p+0"], "0x1.1634720000000p+1", 0.46875),
    },
    "AVX2": {
        "paper": (["0x1.2b3eb80000000p+1", "0x1.2f185e0000000p+1", "0x1.2072880000000p+1", "0x1.359c780000000p+1",
                   "0x1.1556120000000p+1", "0x1.22d2aa0000000p+1"], "0x1.2199ba0000000p+1", 0.125),
        "proxy": (["0x1.2517fa0000000p+1", "0x1.29dd940000000p+1", "0x1.13d46c0000000p+1", "0x1.2472140000000p+1",
                   "0x1.d034440000000p+0", "0x1.ddf58c0000000p+0"], "0x1.1634720000000p+1", 0.46875),
    },
}


@pytest.fixture(scope="module")
def run():
    data = load_dataset("synthetic", image_size=8, train_size=64, val_size=32)
    space = paper_space()
    graph = trace(build("tiny_cnn", num_classes=data[0].num_classes), data[0].images[:2])
    policy = policy_from_assignment(graph, paper_assignment(graph, 0.5, space).assignment,
                                    loss_scaling=dict(space.loss_scaling), overflow=dict(space.overflow))

    def run(recipe, **options):
        with torch_threads(1):
            return train("tiny_cnn", policy, data, 6, seed=3, device="cpu", config=CONFIG, recipe=recipe, **options)

    return run


@pytest.mark.parametrize("name, recipe", [("paper", PAPER_RECIPE), ("proxy", None)])
def test_a_seeded_run_gives_the_numbers_it_gave_before_the_trainer_moved(run, name, recipe):
    capability = torch.backends.cpu.get_cpu_capability()
    if capability not in BEFORE:
        pytest.skip(f"no numbers of commit 087af98 pinned for CPU capability {capability}")
    result = run(recipe)
    assert ([value.hex() for value in result.loss_curve], result.val_loss.hex(), result.val_accuracy) == (
        BEFORE[capability][name])


def test_a_run_leaves_the_global_rng_and_determinism_settings_as_it_found_them(run):
    torch.manual_seed(1234)
    rng = torch.get_rng_state()
    torch.use_deterministic_algorithms(False)
    environment = dict(os.environ)
    first = run(None)
    assert torch.equal(torch.get_rng_state(), rng)
    assert not torch.are_deterministic_algorithms_enabled()
    assert dict(os.environ) == environment
    torch.rand(3)  # the caller's draws do not change the next run's numbers
    assert run(None).loss_curve == first.loss_curve


def test_determinism_is_on_during_a_run_unless_the_caller_turns_it_off(run, monkeypatch):
    seen = []
    real = torch.nn.functional.cross_entropy

    def spy(*args, **kwargs):
        seen.append(torch.are_deterministic_algorithms_enabled())
        return real(*args, **kwargs)

    monkeypatch.setattr(torch.nn.functional, "cross_entropy", spy)
    run(None)
    assert seen and all(seen)
    seen.clear()
    run(None, deterministic=False)
    assert seen and not any(seen)


def test_importing_the_trainer_sets_no_environment_or_seed():
    probe = ("import os, torch; env = dict(os.environ); state = torch.get_rng_state(); seed = torch.initial_seed(); "
             "import precsearch.train.trainer, precsearch.train.proxy; "
             "print(dict(os.environ) == env, torch.equal(torch.get_rng_state(), state), torch.initial_seed() == seed)")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True).stdout
    assert out.split() == ["True", "True", "True"]
