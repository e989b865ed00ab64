"""Proxy training: deterministic, stops at divergence and says why, evaluates honestly, writes metrics."""

from __future__ import annotations

import csv
import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from precsearch.config.policy import Policy
from precsearch.config.spaces import paper_space
from precsearch.errors import PrecsearchError
from precsearch.runtime.scaling import DynamicLossScaler, NoLossScaler
from precsearch.search.context import Budget, DataSpec, SearchContext, torch_threads
from precsearch.search.strategies import paper_assignment, uniform
from precsearch.train import trainer as train_module
from precsearch.train.data import load_dataset
from precsearch.train.proxy import (
    PAPER_RECIPE,
    ProxyConfig,
    build_model,
    evaluate,
    resolve_device,
    run_proxy,
    train_policy,
)

# Small batches keep every rounded tensor below the size at which precsearch.formats.runner compiles its kernel.
CONFIG = ProxyConfig(steps=6, batch_size=16, image_size=8, lr=0.1, eval_batch_size=64)
SPACE = paper_space(proxy={"steps": 6, "batch_size": 16, "image_size": 8, "lr": 0.1, "eval_batch_size": 64})


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """Tiny proxies run fastest on one thread (and are not slowed by other busy cores)."""
    with torch_threads(1):
        yield


@pytest.fixture(scope="module")
def context():
    return SearchContext.create("tiny_cnn", SPACE, DataSpec("digits"), Budget(), seed=0, device="cpu")


def _policy(context, strategy: str) -> Policy:
    graph, space = context.graph, context.space
    candidate = paper_assignment(graph, 0.5, space) if strategy == "paper" else uniform(graph, space, strategy)
    return context.policy(candidate.assignment, {"strategy": strategy})


def test_same_assignment_and_seed_give_the_same_numbers(context):
    policy = _policy(context, "paper")
    first = run_proxy("tiny_cnn", policy, context.data, 6, seed=3, device="cpu", config=CONFIG)
    second = run_proxy("tiny_cnn", policy, context.data, 6, seed=3, device="cpu", config=CONFIG)
    assert first.loss_curve == second.loss_curve and len(first.loss_curve) == 6
    assert (first.val_accuracy, first.val_loss, first.promotions) == (second.val_accuracy, second.val_loss,
                                                                      second.promotions)
    other = run_proxy("tiny_cnn", policy, context.data, 6, seed=4, device="cpu", config=CONFIG)
    assert other.loss_curve != first.loss_curve
    assert not first.diverged and first.reason == "" and first.steps_run == 6 and first.device == "cpu"


def test_low_precision_changes_the_numbers(context):
    high = run_proxy("tiny_cnn", _policy(context, "high"), context.data, 3, seed=0, device="cpu", config=CONFIG)
    low = run_proxy("tiny_cnn", _policy(context, "low"), context.data, 3, seed=0, device="cpu", config=CONFIG)
    assert high.loss_curve[0] != low.loss_curve[0]


def test_a_diverging_proxy_stops_early_and_says_why(context):
    wild = ProxyConfig(steps=40, batch_size=16, image_size=8, lr=1e4, momentum=0.9, eval_batch_size=64)
    result = run_proxy("tiny_cnn", _policy(context, "low"), context.data, 40, seed=0, device="cpu", config=wild)
    assert result.diverged
    assert result.steps_run < 40
    assert any(word in result.reason for word in ("non-finite", "blew up", "collapsed", "skipped"))
    assert result.val_error == pytest.approx(1 - result.val_accuracy)


def test_divergence_rules_one_by_one():
    config = ProxyConfig(blowup_factor=10.0, min_loss_scale=1.0, max_skipped_fraction=0.25)
    monitor = train_module.Divergence(config)
    assert monitor.check(1, 2.0, NoLossScaler()) == ""
    assert "non-finite" in monitor.check(2, math.nan, NoLossScaler())
    assert "blew up" in monitor.check(3, 20.5, NoLossScaler())
    assert monitor.check(3, 19.5, NoLossScaler()) == ""
    scaler = DynamicLossScaler()
    state = scaler.state_dict()
    scaler.load_state_dict({**state, "scale": 0.5})
    assert "collapsed" in monitor.check(4, 2.0, scaler)
    scaler.load_state_dict({**state, "skipped_steps": 50})
    assert monitor.check(200, 2.0, scaler) == ""  # 50 = 0.25 x 200 is allowed by step 200
    scaler.load_state_dict({**state, "skipped_steps": 51})
    assert "51 skipped steps by step 200" in monitor.check(200, 2.0, scaler)
    scaler.load_state_dict({**state, "skipped_steps": 20})
    assert monitor.check(5, 2.0, scaler) == ""  # early in a run at least 20 are allowed
    scaler.load_state_dict({**state, "skipped_steps": 21})
    assert "21 skipped steps by step 5" in monitor.check(5, 2.0, scaler)
    # the allowance counts the steps so far, not the run's length: a continued run judges as an unbroken one
    assert train_module.Divergence(config, first_loss=2.0).check(6, 20.5, NoLossScaler()).startswith("loss blew")


def test_evaluate_matches_a_direct_forward():
    _, val = load_dataset("digits", image_size=8)
    torch.manual_seed(0)
    model = build_model("tiny_cnn", num_classes=10).eval()
    with torch.no_grad():
        logits = model(val.images)
    accuracy, loss = evaluate(model, val, torch.device("cpu"), batch_size=64)
    assert accuracy == pytest.approx(float((logits.argmax(1) == val.labels).float().mean()))
    assert loss == pytest.approx(float(F.cross_entropy(logits, val.labels)), rel=1e-5)


def test_train_policy_writes_metrics(context, tmp_path):
    metrics = tmp_path / "metrics.csv"
    config = ProxyConfig(steps=8, batch_size=16, image_size=8, lr=0.1, eval_batch_size=64)
    result = train_policy("tiny_cnn", _policy(context, "paper"), context.data, 8, config=config, device="cpu",
                          eval_every=4, metrics=metrics)
    rows = list(csv.DictReader(metrics.open()))
    assert [int(row["step"]) for row in rows] == [4, 8]
    assert float(rows[-1]["val_accuracy"]) == pytest.approx(result.val_accuracy)
    assert float(rows[-1]["val_loss"]) == pytest.approx(result.val_loss, rel=1e-6)
    assert float(rows[-1]["batch_stats_accuracy"]) == pytest.approx(result.batch_stats_accuracy)
    assert set(rows[0]) == {"step", "epoch", "train_loss", "val_accuracy", "val_loss", "batch_stats_accuracy",
                            "wall_time"}


def test_train_policy_rejects_other_image_sizes(context):
    data16 = load_dataset("digits", image_size=16)
    with pytest.raises(PrecsearchError, match="--image-size 8"):
        train_policy("tiny_cnn", _policy(context, "high"), data16, 2, device="cpu")


def test_policy_for_another_model_is_refused(context):
    with pytest.raises(PrecsearchError, match="made for"):
        run_proxy("tiny_cnn:width=2", _policy(context, "high"), context.data, 2, device="cpu", config=CONFIG)


def test_devices():
    assert resolve_device("cpu") == torch.device("cpu")
    assert resolve_device("auto").type == ("cuda" if torch.cuda.is_available() else "cpu")
    with pytest.raises(PrecsearchError, match="auto, cpu or cuda"):
        resolve_device("tpu")
    if not torch.cuda.is_available():
        with pytest.raises(PrecsearchError, match="CUDA is not available"):
            resolve_device("cuda")


def test_the_paper_recipe_steps_the_cosine_per_epoch_and_inits_convolutions_kaiming_fan_out(context, monkeypatch):
    # 64 training images at batch 16: 4 steps per epoch, 12 steps = 3 epochs
    data = load_dataset("synthetic", image_size=8, train_size=64, val_size=32)
    config = ProxyConfig(steps=12, batch_size=16, image_size=8, lr=0.1, eval_batch_size=64)
    lrs, initial = [], []
    step = torch.optim.SGD.step

    def record(self, *args, **kwargs):
        lrs.append(self.param_groups[0]["lr"])
        return step(self, *args, **kwargs)

    monkeypatch.setattr(torch.optim.SGD, "step", record)
    convs: list[nn.Conv2d] = []

    def record_init(module, args):  # torch's global hook: the weights each run's first forward sees
        if isinstance(module, nn.Conv2d) and len(convs) < 2:
            convs.append(module)
            if len(convs) == 2:  # tiny_cnn's conv2, before any step
                initial.append(module.weight.detach().clone())

    policy = _policy(context, "high")
    for recipe in (PAPER_RECIPE, None):
        convs.clear()
        handle = torch.nn.modules.module.register_module_forward_pre_hook(record_init)
        try:
            train_policy("tiny_cnn", policy, data, 12, config=config, device="cpu", recipe=recipe)
        finally:
            handle.remove()
    epoch_lrs = [0.1 * (1 + math.cos(math.pi * epoch / 3)) / 2 for epoch in range(3) for _ in range(4)]
    step_lrs = [0.1 * (1 + math.cos(math.pi * k / 12)) / 2 for k in range(12)]
    assert lrs[:12] == pytest.approx(epoch_lrs) and lrs[12:] == pytest.approx(step_lrs)
    # Kaiming normal, fan-out: std sqrt(2 / (out channels x kernel area)); PyTorch's default is uniform, smaller
    expected = math.sqrt(2 / (initial[0].shape[0] * initial[0].shape[2] * initial[0].shape[3]))
    assert initial[0].std().item() == pytest.approx(expected, rel=0.1)
    assert initial[1].std().item() < 0.7 * expected  # PyTorch's default: std 1 / sqrt(3 fan-in) = 0.58x here
