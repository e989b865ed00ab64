"""Readings: batch norm's statistics put back on a skipped step, recomputed before a reading (precise BN), and the
batch-statistics check beside it (precsearch.train.reading, precsearch.runtime.norm_statistics)."""

from __future__ import annotations

import copy
import dataclasses
import math

import pytest
import torch
import torch.nn.functional as F

from precsearch.config.spec import PAPER_OVERFLOW
from precsearch.cost.policies import policy_for_graph
from precsearch.formats.format import get_format
from precsearch.graph.tracing import trace
from precsearch.models import build
from precsearch.runtime.model import apply_policy
from precsearch.runtime.norm_statistics import batch_norms
from precsearch.train.data import load_dataset, make_loader
from precsearch.train.reading import evaluate, flagged, read_model

CPU = torch.device("cpu")
ALL_LOW = {"weight": "e4m3b4s", "activation": "e4m3b4s", "activation_grad": "e5m2s", "weight_grad": "e6m9s"}
BATCH = 32


@pytest.fixture(scope="module")
def digits():
    return load_dataset("digits", image_size=8)


def _trained_all_low(digits, steps: int = 30):
    """tiny_cnn under the paper's all-low policy (activations saturate, gradients overflow to inf, dynamic
    scaling from 2^16), trained ``steps`` seeded SGD steps on digits."""
    train_set, _ = digits
    torch.manual_seed(0)
    model = build("tiny_cnn", num_classes=10)
    graph = trace(model, train_set.images[:2], batch_size=BATCH)
    policy = policy_for_graph(graph, defaults=ALL_LOW, high_format="e6m9s", overflow=dict(PAPER_OVERFLOW),
                              loss_scaling={"mode": "dynamic", "init_scale": 2.0**16})
    wrapped = apply_policy(model, policy, train_set.images[:2])
    optimizer = wrapped.wrap_optimizer(torch.optim.SGD(wrapped.parameters(), lr=0.1, momentum=0.9))
    order = torch.Generator().manual_seed(0)
    for _ in range(steps):
        chosen = torch.randperm(len(train_set), generator=order)[:BATCH]
        _step(wrapped, optimizer, train_set.images[chosen], train_set.labels[chosen])
    return wrapped, optimizer


def _step(wrapped, optimizer, images, labels) -> None:
    optimizer.zero_grad(set_to_none=True)
    wrapped.scaler.scale(F.cross_entropy(wrapped(images), labels)).backward()
    wrapped.scaler.step(optimizer)
    wrapped.scaler.update()


def _statistics(model) -> list[torch.Tensor]:
    return [buffer.clone() for norm in batch_norms(model) for buffer in (norm.running_mean, norm.running_var)]


def _precise_by_hand(wrapped, train_set, images: int, batch: int, seed: int) -> list[torch.Tensor]:
    """Precise BN's statistics computed independently: each batch norm's inputs in a train-mode forward over the
    same batches, their per-batch means and unbiased variances in float64, averaged with equal weights."""
    norms = batch_norms(wrapped.module)
    seen: dict[int, list[torch.Tensor]] = {id(norm): [] for norm in norms}
    hooks = [norm.register_forward_hook(lambda module, args, out: seen[id(module)].append(args[0].double()))
             for norm in norms]
    saved = _statistics(wrapped.module)
    wrapped.train()
    loader = make_loader(train_set, batch, shuffle=True, seed=seed)
    with torch.no_grad():
        for _, (inputs, _labels) in zip(range(math.ceil(images / batch)), loader, strict=False):
            wrapped(inputs)
    for hook in hooks:
        hook.remove()
    for buffer, value in zip(_statistics_refs(wrapped.module), saved, strict=True):
        buffer.copy_(value)
    statistics = []
    for norm in norms:
        inputs = seen[id(norm)]
        statistics.append(torch.stack([x.mean((0, 2, 3)) for x in inputs]).mean(0))
        statistics.append(torch.stack([x.var((0, 2, 3), unbiased=True) for x in inputs]).mean(0))
    return statistics


def _statistics_refs(model) -> list[torch.Tensor]:
    return [buffer for norm in batch_norms(model) for buffer in (norm.running_mean, norm.running_var)]


def test_a_skipped_saturating_step_leaves_the_statistics_and_the_reading_is_precise_bn(digits):
    train_set, val_set = digits
    wrapped, optimizer = _trained_all_low(digits)
    largest = get_format("e4m3b4s").max
    inputs: list[torch.Tensor] = []  # the stem batch norm's: the stem conv's output, rounded
    hook = wrapped.module.bn1.register_forward_hook(lambda module, args, out: inputs.append(args[0].detach()))
    before, skipped = _statistics(wrapped.module), wrapped.scaler.skipped_steps
    _step(wrapped, optimizer, train_set.images[:BATCH] * 1000, train_set.labels[:BATCH])  # the scripted batch
    hook.remove()
    assert float(inputs[-1].abs().max()) == largest  # the forward saturated at the format's largest value
    assert wrapped.scaler.skipped_steps == skipped + 1  # and its gradients overflowed: the step was skipped
    for kept, now in zip(before, _statistics(wrapped.module), strict=True):
        assert torch.equal(kept, now)  # the skipped step left batch norm's statistics as they were

    expected = _precise_by_hand(wrapped, train_set, 1024, batch=512, seed=7)
    reading = read_model(wrapped, digits, CPU, bn_images=1024, eval_batch_size=512, seed=7)
    for mine, theirs in zip(_statistics(wrapped.module), expected, strict=True):
        torch.testing.assert_close(mine.double(), theirs, rtol=1e-5, atol=1e-6)
    assert reading.accuracy == evaluate(wrapped, val_set, CPU)[0]  # the reading is eval mode on those statistics
    assert wrapped.training  # and the model trains on


def test_without_the_rollback_the_same_step_poisons_the_running_statistics(digits):
    """The case the rollback is for: the skipped forward's batch in the running averages reads at chance."""
    train_set, val_set = digits
    wrapped, optimizer = _trained_all_low(digits)
    wrapped.scaler.on_skip.clear()
    healthy = evaluate(wrapped, val_set, CPU)[0]
    _step(wrapped, optimizer, train_set.images[:BATCH] * 1000, train_set.labels[:BATCH])
    assert healthy > 0.5
    assert evaluate(wrapped, val_set, CPU)[0] <= 0.15  # one class, give or take
    reading = read_model(wrapped, digits, CPU, bn_images=1024, eval_batch_size=512, seed=7)
    assert abs(reading.accuracy - reading.batch_stats_accuracy) <= 0.01  # precise BN reads what the weights do


def test_a_reading_takes_no_training_step_and_batch_statistics_leave_the_buffers(digits):
    train_set, val_set = digits
    wrapped, _ = _trained_all_low(digits, steps=5)
    steps, calls = wrapped.step_count, {key: row["calls"] for key, row in wrapped.tensor_stats().items()}
    before = _statistics(wrapped.module)
    accuracy, _ = evaluate(wrapped, val_set, CPU, batch_size=64, batch_stats=True)
    for kept, now in zip(before, _statistics(wrapped.module), strict=True):
        assert torch.equal(kept, now)
    wrapped.eval()  # by hand: batch norms in train mode over each batch of 64, the rest in eval mode
    for norm in batch_norms(wrapped.module):
        norm.train()
    with torch.no_grad():
        logits = torch.cat([wrapped(val_set.images[start:start + 64]) for start in range(0, len(val_set), 64)])
    wrapped.train()
    for buffer, value in zip(_statistics_refs(wrapped.module), before, strict=True):
        buffer.copy_(value)
    assert accuracy == pytest.approx(float((logits.argmax(1) == val_set.labels).float().mean()))
    read_model(wrapped, digits, CPU, bn_images=256, eval_batch_size=512, seed=0)
    assert wrapped.step_count == steps
    assert {key: row["calls"] for key, row in wrapped.tensor_stats().items()} == calls  # nothing counted


def test_bn_images_zero_reads_the_running_averages_as_they_are(digits):
    _, val_set = digits
    wrapped, _ = _trained_all_low(digits, steps=5)
    before = _statistics(wrapped.module)
    reading = read_model(wrapped, digits, CPU, bn_images=0, eval_batch_size=512, seed=0)
    for kept, now in zip(before, _statistics(wrapped.module), strict=True):
        assert torch.equal(kept, now)
    assert reading.accuracy == evaluate(wrapped, val_set, CPU)[0]


@pytest.mark.parametrize(("accuracy", "batch", "drop", "expected"), [
    (0.10, 0.96, 0.01, True), (0.955, 0.96, 0.01, False), (0.97, 0.95, 0.01, True), (0.50, None, 0.01, False),
    (0.50, math.nan, 0.01, False), (0.90, 0.95, 0.05, False), (0.90, 0.951, 0.05, True)])
def test_a_reading_is_flagged_when_it_and_batch_statistics_differ_by_more_than_the_drop(accuracy, batch, drop,
                                                                                        expected):
    assert flagged(accuracy, batch, drop) is expected


@pytest.mark.slow
def test_the_wang_fp8_case_in_miniature_reads_what_batch_statistics_read():
    """wang_fp8 on the demo's task, one 200-step proxy (seed 1): its stem's output, held in e5m2, rises faster
    than the running averages follow. Read on those averages the proxy is far below what the same weights read
    with batch statistics; read on recomputed statistics it is within a point of them."""
    from precsearch.cli.demo import DATA, MODEL, PROXY
    from precsearch.config.spaces import paper_space
    from precsearch.search.context import Budget, DataSpec, SearchContext, torch_threads
    from precsearch.search.strategies import baseline
    from precsearch.train.proxy import run_proxy

    space = paper_space().with_proxy(**PROXY)
    context = SearchContext.create(MODEL, space, DataSpec(DATA), Budget(), 0, "cpu")
    policy = baseline("wang_fp8", context.graph)
    with torch_threads(1):
        before = run_proxy(MODEL, policy, context.data, 200, seed=1, device="cpu",
                           config=dataclasses.replace(space.proxy, bn_images=0))
        now = run_proxy(MODEL, policy, context.data, 200, seed=1, device="cpu", config=space.proxy)
    assert now.loss_curve == before.loss_curve  # the same training: only the reading differs
    assert now.batch_stats_accuracy == before.batch_stats_accuracy >= 0.9
    assert before.val_accuracy < before.batch_stats_accuracy - 0.3  # the running averages misread it
    assert abs(now.val_accuracy - now.batch_stats_accuracy) <= 0.01


def test_a_forward_outside_training_draws_no_stochastic_rounding_of_its_own(digits):
    """Under a stochastic weight update (Wang et al.) each training forward draws the working copy of the weights
    from the masters. An eval-mode forward computes with the copy the next training forward will draw: the same
    values every time (a reading's statistics and its evaluation see one model), and training's draws unmoved."""
    train_set, _ = digits
    torch.manual_seed(0)
    plain = build("tiny_cnn", num_classes=10)
    graph = trace(plain, train_set.images[:2], batch_size=BATCH)
    policy = policy_for_graph(graph, defaults=dict.fromkeys(ALL_LOW, "e5m2s"), high_format="e6m9s",
                              optimizer={"update": "stochastic"}, loss_scaling={"mode": "none"})
    images, labels = train_set.images[:BATCH], train_set.labels[:BATCH]

    def losses(evaluate_between: bool) -> list[float]:
        model = apply_policy(copy.deepcopy(plain), policy, images[:2], seed=3)
        optimizer = model.wrap_optimizer(torch.optim.SGD(model.parameters(), lr=0.05))
        seen = []
        for _ in range(4):
            if evaluate_between:
                model.eval()
                with torch.no_grad():
                    first, second = model(images), model(images)
                assert torch.equal(first, second)
                model.train()
                with torch.no_grad():  # train mode without gradients is outside training too
                    assert torch.equal(model(images), model(images))
            optimizer.zero_grad(set_to_none=True)
            loss = F.cross_entropy(model(images), labels)
            loss.backward()
            optimizer.step()
            seen.append(float(loss))
        return seen

    assert losses(evaluate_between=True) == losses(evaluate_between=False)
