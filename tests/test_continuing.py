"""A continuing proxy run (precsearch.train.continuing): stopped and continued from its checkpoint, it gives the
uninterrupted run's result bit for bit, and its reading at a step is a fresh run of that length."""

from __future__ import annotations

import dataclasses
import io
import signal
import time
from pathlib import Path

import pytest
import torch
from torch.optim.optimizer import register_optimizer_step_pre_hook

from precsearch.config.spaces import load_space, paper_space
from precsearch.errors import PrecsearchError
from precsearch.search.context import Budget, DataSpec, SearchContext
from precsearch.search.strategies import uniform
from precsearch.stopping import SignalStop, stop_signals
from precsearch.train import trainer
from precsearch.train.continuing import Progress, State, decay_lr, decay_steps, run_tag, write_checkpoint
from precsearch.train.proxy import run_proxy

SPACES = Path(__file__).resolve().parents[1] / "search_spaces"
SPACE = paper_space(proxy={"batch_size": 16, "image_size": 8, "eval_batch_size": 64})


@pytest.fixture(scope="module")
def context():
    return SearchContext.create("tiny_cnn", SPACE, DataSpec("digits"), Budget(), 0, "cpu")


def _run(context, policy, steps, **options):
    with torch.random.fork_rng():
        torch.set_num_threads(1)
        return run_proxy("tiny_cnn", policy, context.data, steps, seed=3, device="cpu", config=SPACE.proxy, **options)


def _same(a, b):
    assert a.loss_curve == b.loss_curve and a.val_curve == b.val_curve
    assert (a.val_accuracy, a.val_loss, a.steps_run, a.promotions) == (b.val_accuracy, b.val_loss, b.steps_run,
                                                                         b.promotions)


def _continued_matches_uninterrupted(context, policy, tmp_path):
    whole = _run(context, policy, 12, evaluate_at=[4, 8])
    checkpoint = tmp_path / "run.pt"
    first = _run(context, policy, 4, evaluate_at=[4, 8], checkpoint=checkpoint)
    rest = _run(context, policy, 12, evaluate_at=[4, 8], checkpoint=checkpoint)
    _same(whole, rest)
    assert first.val_accuracy == whole.val_curve[0][1]  # the reading at 4 is the same in both
    assert rest.steps_spent == 8 + decay_steps(8) + decay_steps(12)  # the continued call trained only its part
    assert whole.steps_spent == 12 + decay_steps(4) + decay_steps(8) + decay_steps(12)
    # the run's own branches, the first call's among them: what the search's budget counts per run
    assert rest.branch_steps == whole.branch_steps == decay_steps(4) + decay_steps(8) + decay_steps(12)


def test_a_continued_plain_run_is_the_uninterrupted_run_bit_for_bit(context, tmp_path):
    _continued_matches_uninterrupted(context, None, tmp_path)


@pytest.mark.slow
@pytest.mark.parametrize("space", ["paper", "fp8_scaled", "mx"])
def test_a_continued_low_precision_run_is_the_uninterrupted_run_bit_for_bit(space, context, tmp_path):
    """All-low under the paper's numerics and under scaled 8-bit formats: the wrapper's state (loss scale,
    promotions, rounding counters, scales) goes back after every decay branch and comes back from the
    checkpoint, which is read as data (tensors and plain values only)."""
    if space != "paper":
        loaded = load_space(SPACES / f"{space}.yaml")
        context = SearchContext.create("tiny_cnn", dataclasses.replace(loaded, proxy=SPACE.proxy),
                                       DataSpec("digits"), Budget(), 0, "cpu")
    low = uniform(context.graph, context.space, "low").assignment
    _continued_matches_uninterrupted(context, context.policy(low, {}), tmp_path)


def test_a_checkpoint_of_another_run_is_not_continued(context, tmp_path):
    checkpoint = tmp_path / "run.pt"
    _run(context, None, 4, checkpoint=checkpoint)
    other = run_proxy("tiny_cnn", None, context.data, 4, seed=4, device="cpu", config=SPACE.proxy,
                      checkpoint=checkpoint)
    fresh = run_proxy("tiny_cnn", None, context.data, 4, seed=4, device="cpu", config=SPACE.proxy)
    _same(other, fresh)  # seed 4 does not continue seed 3's run


def test_a_retried_trial_continues_the_run_it_retries(context, tmp_path):
    """--resume retries an interrupted trial under a new trial number, which its policy's provenance records:
    the retry continues the interrupted run's checkpoint (steps 5-12 only), and gives the uninterrupted run."""
    high = uniform(context.graph, context.space, "high").assignment
    interrupted, retry = context.policy(high, {"trial": 1}), context.policy(high, {"trial": 11})
    checkpoint = tmp_path / "run.pt"
    _run(context, interrupted, 4, evaluate_at=[4, 8], checkpoint=checkpoint)
    rest = _run(context, retry, 12, evaluate_at=[4, 8], checkpoint=checkpoint)
    assert rest.steps_spent == 8 + decay_steps(8) + decay_steps(12)
    _same(rest, _run(context, retry, 12, evaluate_at=[4, 8]))
    other = uniform(context.graph, context.space, "low").assignment
    assert run_tag(context.policy(other, {"trial": 1}), 3) != run_tag(interrupted, 3)  # another assignment's run


class _Stop(Exception):
    pass


def test_a_run_interrupted_and_continued_counts_the_steps_of_the_uninterrupted_run(context, tmp_path):
    """A search's budget sums its runs' ``steps_spent``: a call that an interruption ended after its reading at
    8 left its steps in the checkpoint, and the call that continues it counts them (Ctrl-C and --resume do
    not make a confirmation or calibration run look cheaper than it was)."""
    checkpoint = tmp_path / "run.pt"
    _run(context, None, 4, evaluate_at=[4, 8], checkpoint=checkpoint)

    def stop(step, loss):
        if step == 10:
            raise _Stop

    with pytest.raises(_Stop):
        _run(context, None, 12, evaluate_at=[4, 8], checkpoint=checkpoint, report=stop)
    rest = _run(context, None, 12, evaluate_at=[4, 8], checkpoint=checkpoint)
    assert rest.steps_spent == 8 + decay_steps(8) + decay_steps(12)  # steps 5-12, the branches at 8 and 12
    _same(rest, _run(context, None, 12, evaluate_at=[4, 8]))


def _rates(run):
    """The learning rate of every optimizer step ``run()`` takes (torch's global step hook)."""
    rates = []
    hook = register_optimizer_step_pre_hook(
        lambda optimizer, args, kwargs: rates.append(optimizer.param_groups[0]["lr"]))
    try:
        run()
    finally:
        hook.remove()
    return rates


def test_a_run_ending_in_its_own_decay_goes_on_from_a_reading_along_torchs_cosine(context, tmp_path):
    """Confirmation's runs: the rate held to step 4 (where a proxy of length 4 was read and checkpointed), then
    falling along one cosine over steps 5-12, read at 12 as the run stands (no branch)."""
    results = []
    rates = _rates(lambda: results.append(_run(context, None, 12, decay_from=4)))
    whole = results[0]
    sgd = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=SPACE.proxy.lr)
    cosine = torch.optim.lr_scheduler.CosineAnnealingLR(sgd, T_max=8)  # the oracle: torch's own schedule
    expected = [SPACE.proxy.lr] * 4
    for _ in range(8):
        expected.append(sgd.param_groups[0]["lr"])
        cosine.step()
    assert rates == pytest.approx(expected, rel=1e-12, abs=1e-15)
    assert whole.steps_spent == 12 and whole.branch_steps == 0 and whole.steps_run == 12
    checkpoint = tmp_path / "run.pt"
    _run(context, None, 4, checkpoint=checkpoint)  # a proxy read at 4: its checkpoint holds the state at 4
    rest = _run(context, None, 12, checkpoint=checkpoint, decay_from=4)
    _same(whole, rest)
    assert rest.steps_spent == 8  # steps 5-12: the decay, continued from the reading


def test_a_run_stopped_inside_its_decay_goes_on_bit_for_bit(context, tmp_path, monkeypatch):
    monkeypatch.setattr(trainer, "CHECKPOINT_EVERY", 2)
    checkpoint = tmp_path / "run.pt"
    _run(context, None, 4, checkpoint=checkpoint)

    def stop(step, loss):
        if step == 10:  # a report step (every 10), before that step's checkpoint: the last one is at 8
            raise _Stop

    with pytest.raises(_Stop):
        _run(context, None, 12, checkpoint=checkpoint, decay_from=4, report=stop)
    rest = _run(context, None, 12, checkpoint=checkpoint, decay_from=4)
    _same(rest, _run(context, None, 12, decay_from=4))
    assert rest.steps_spent == 8  # steps 5-8 of the stopped call (its checkpoint carried them), then 9-12


def test_a_checkpoint_another_schedule_left_is_not_continued(context, tmp_path, monkeypatch):
    """A run at the constant rate past where this run's decay starts, or one inside another decay, is another
    run: a run that continued it would be neither."""
    monkeypatch.setattr(trainer, "CHECKPOINT_EVERY", 2)
    past = tmp_path / "past.pt"
    _run(context, None, 8, checkpoint=past)  # the constant rate to 8
    _same(_run(context, None, 12, checkpoint=past, decay_from=4), _run(context, None, 12, decay_from=4))
    decaying = tmp_path / "decaying.pt"
    _run(context, None, 10, checkpoint=decaying, decay_from=6)  # checkpointed at 8, inside the decay after 6
    _same(_run(context, None, 10, checkpoint=decaying, decay_from=4), _run(context, None, 10, decay_from=4))
    _same(_run(context, None, 10, checkpoint=decaying), _run(context, None, 10))


def test_a_run_stopped_and_continued_counts_each_second_once(context, tmp_path, monkeypatch):
    """``wall_time`` is the seconds the run trained over all its calls: a checkpoint (here every 2 steps) stores
    the time so far, and neither the next checkpoint nor the continuing call adds that time again."""
    monkeypatch.setattr(trainer, "CHECKPOINT_EVERY", 2)
    checkpoint = tmp_path / "run.pt"

    def stop(step, loss):
        if step == 10:  # after the checkpoints at 2, 4, 6 and 8
            raise _Stop

    clock = time.perf_counter()
    with pytest.raises(_Stop):
        _run(context, None, 12, evaluate_at=[4], checkpoint=checkpoint, report=stop)
    first = time.perf_counter() - clock
    clock = time.perf_counter()
    rest = _run(context, None, 12, evaluate_at=[4], checkpoint=checkpoint)
    second = time.perf_counter() - clock
    assert 0 < rest.wall_time <= first + second
    clock = time.perf_counter()
    whole = _run(context, None, 12, evaluate_at=[4], checkpoint=tmp_path / "whole.pt")
    assert 0 < whole.wall_time <= time.perf_counter() - clock


class _OpensAFile:
    """A pickle payload: an unrestricted unpickler calls ``open(path, "w")``, which creates the file."""

    def __init__(self, path) -> None:
        self.path = str(path)

    def __reduce__(self):
        return open, (self.path, "w")


def _saved(value) -> bytes:
    buffer = io.BytesIO()
    torch.save(value, buffer)
    return buffer.getvalue()


def test_a_checkpoint_that_names_code_is_refused_and_never_run(context, tmp_path):
    """A run directory may come from someone else: --resume reads its checkpoints as tensors and plain values
    only, at either layer (the file, and the training state inside it)."""
    sentinel = tmp_path / "ran"
    outer = tmp_path / "outer.pt"
    outer.write_bytes(_saved({"tag": "x", "state": b"", "progress": _OpensAFile(sentinel)}))
    inner = tmp_path / "inner.pt"
    write_checkpoint(inner, run_tag(None, 3), State(_saved({"model": _OpensAFile(sentinel)})), Progress(step=2))
    fields = tmp_path / "fields.pt"
    fields.write_bytes(_saved({"tag": run_tag(None, 3), "state": b"", "progress": {"step": 2, "code": "x"}}))
    for path in (outer, inner, fields):
        with pytest.raises(PrecsearchError, match="not one precsearch wrote.*delete it to train that run"):
            _run(context, None, 4, checkpoint=path)
    assert not sentinel.exists()
    torch.load(outer, weights_only=False)  # the payload is real: an unrestricted load runs it
    assert sentinel.exists()


def test_a_decay_branch_falls_along_a_cosine_to_zero():
    assert decay_steps(8) == 1 and decay_steps(100) == 10 and decay_steps(101) == 11
    rates = [decay_lr(0.2, index, 10) for index in range(10)]
    assert rates[0] == 0.2 and rates == sorted(rates, reverse=True) and 0 < rates[-1] < 0.01
    assert decay_lr(0.2, 5, 10) == pytest.approx(0.1)


def test_a_stop_recorded_inside_a_decay_branch_ends_the_run_at_its_next_step(context):
    """A search's trials run inside Optuna's ``study.optimize``, where the handler only records a signal; the
    trainer raises it before its next step. A branch is a tenth of its step (320 steps at 3,200, minutes on a
    CPU), so a run that checked only where it reports its loss trained through the whole branch."""
    steps = []

    def record_a_signal_at_the_branchs_second_step(optimizer, args, kwargs):
        steps.append(len(steps) + 1)
        if len(steps) == 42:  # steps 1-40 at the constant rate, then the branch at 40 (4 steps)
            signals.received = signal.SIGINT  # what the handler does inside Optuna's frames

    hook = register_optimizer_step_pre_hook(record_a_signal_at_the_branchs_second_step)
    try:
        with stop_signals() as signals, pytest.raises(SignalStop):
            _run(context, None, 50, evaluate_at=[40])
    finally:
        hook.remove()
    assert decay_steps(40) == 4 and len(steps) == 42  # stopped before the branch's third step
