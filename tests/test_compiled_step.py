"""The compiled training step (precsearch.runtime.compiled) against the eager runtime it replaces.

Oracle: the eager runtime (the format kernels, packed saves), tested against torch's casts and ml_dtypes
elsewhere. ``backend="aot_eager"`` runs the compiled step's graph through TorchDynamo and AOTAutograd without
Inductor, so the same float32 ops run in the same order as eager: training must then be bit for bit the eager
runtime's (parameters, buffers, losses, promotions, loss scale, overflow statistics). Inductor reorders float32
sums (batch norm), so with it the test is the one the module docstring states: the same decisions, values
within a tolerance.
"""

from __future__ import annotations

import argparse
import copy
import logging
import os
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from precsearch.cli._arguments import COMPILE_MIN_STEPS, choose_compile
from precsearch.config.compiling import CompileOptions
from precsearch.config.spec import PAPER_OVERFLOW
from precsearch.cost.measured import sgd_step, trace_step
from precsearch.cost.policies import policy_from_assignment
from precsearch.formats.kernels import quantize
from precsearch.formats.runner import Runtime, default_runtime
from precsearch.graph.tracing import trace
from precsearch.models import build
from precsearch.runtime.model import apply_policy

AOT_EAGER = CompileOptions(backend="aot_eager")
ALL_LOW = {"weight": "e4m3b4s", "activation": "e4m3b4s", "activation_grad": "e5m2s", "weight_grad": "e6m9s"}


class Untraceable(nn.Module):
    """Data-dependent control flow: torch.fx cannot trace it (module hooks instead)."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3, padding=1)
        self.bn = nn.BatchNorm2d(8)
        self.fc = nn.Linear(8, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.bn(self.conv(x))
        out = torch.relu(out) if out.mean() > -1 else out
        return self.fc(torch.flatten(F.adaptive_avg_pool2d(out, 1), 1))


class _Gated(nn.Module):
    """A block whose data-dependent branch torch.fx cannot trace (Dynamo breaks its graph there)."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(8, 8, 3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.conv(x)
        return torch.relu(out) if out.mean() > -1 else out


class PartlyTraceable(nn.Module):
    """A model FX traces but for one block (``gate``)."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3, padding=1)
        self.bn = nn.BatchNorm2d(8)
        self.gate = _Gated()
        self.fc = nn.Linear(8, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.gate(torch.relu(self.bn(self.conv(x))))
        return self.fc(torch.flatten(F.adaptive_avg_pool2d(out, 1), 1))


def _model(name: str) -> nn.Module:
    torch.manual_seed(0)
    if name == "untraceable":
        return Untraceable()
    return build(name, **({"width": 0.125} if name in ("resnet18", "mobilenet_v2") else {}))


def _policy(model: nn.Module, x: torch.Tensor, formats: dict[str, str], **fields):
    graph = trace(model, x[:2], batch_size=x.shape[0])
    fields = {"high_format": "e6m9s", "overflow": dict(PAPER_OVERFLOW), "promotion_threshold": 0.01,
              "loss_scaling": {"mode": "dynamic", "init_scale": 2.0**16}, "provenance": {"strategy": "test"},
              **fields}
    return policy_from_assignment(graph, {t: formats[graph.tensors[t].kind] for t in graph.assignable_ids()},
                                  **fields)


def _batches(steps: int, batch: int, size: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(batch, 3, size, size, generator=g), torch.randint(0, 10, (batch,), generator=g))
            for _ in range(steps)]


def _steps(wrapped, batches, **sgd) -> list[float]:
    """SGD steps (lr 0.1, ``sgd``'s settings) of a wrapped model, its losses."""
    optimizer = wrapped.wrap_optimizer(torch.optim.SGD(wrapped.parameters(), lr=0.1, **sgd))
    losses = []
    for x, y in batches:
        optimizer.zero_grad(set_to_none=True)
        loss = F.cross_entropy(wrapped(x), y)
        wrapped.scaler.scale(loss).backward()
        wrapped.scaler.step(optimizer)
        wrapped.scaler.update()
        losses.append(loss.item())
    return losses


def _train(model: nn.Module, policy, batches, device: str = "cpu", **options) -> tuple[nn.Module, list[float]]:
    batches = [(x.to(device), y.to(device)) for x, y in batches]
    wrapped = apply_policy(copy.deepcopy(model).to(device), policy, batches[0][0][:2], **options)
    losses = _steps(wrapped, batches, momentum=0.9, weight_decay=5e-4)
    with torch.no_grad():  # an evaluation forward between steps runs eagerly and counts nothing
        wrapped.eval()
        wrapped(batches[0][0])
        wrapped.train()
    return wrapped, losses


def _own_graphs() -> Runtime:
    """A runtime whose compiled graphs (and warnings) are these runs' alone, running the format kernels on the
    default runtime's runner (compiled already)."""
    return Runtime(default_runtime().kernels)


def _assert_same_module(eager, compiled_model) -> None:
    """Every parameter and buffer equal."""
    for (name, a), (_, b) in zip(eager.module.state_dict().items(), compiled_model.module.state_dict().items(),
                                 strict=True):
        assert torch.equal(a, b), name


def _assert_same_training(eager, compiled_model, eager_losses, compiled_losses) -> None:
    assert compiled_losses == eager_losses
    _assert_same_module(eager, compiled_model)
    assert compiled_model.promotions == eager.promotions
    assert compiled_model.scaler.get_scale() == eager.scaler.get_scale()
    assert compiled_model.scaler.skipped_steps == eager.scaler.skipped_steps
    assert compiled_model.tensor_stats() == eager.tensor_stats()


@pytest.mark.parametrize("case", ["master weights", "pure weights, statistics every 7th step",
                                  pytest.param("promotions", marks=pytest.mark.slow)])  # 44 s: with the slow ones
def test_the_compiled_step_trains_bit_for_bit_as_the_eager_runtime(case: str) -> None:
    """20 steps of tiny_cnn, compiled without Inductor (aot_eager) against eager: every parameter, buffer and
    loss, the promotions, the loss scale and the overflow statistics are equal. Steps that gather statistics
    run eagerly in the compiled model; a promotion changes a row of the table, not the graph."""
    model = _model("tiny_cnn")
    batches = _batches(20, 16, 16)
    promotes = case == "promotions"  # activations of at most 7.5: some promoted in the first steps
    formats = dict(ALL_LOW, activation="e2m3" if promotes else ALL_LOW["activation"])
    policy = _policy(model, batches[0][0], formats, master_weights=case != "pure weights, statistics every 7th step",
                     promotion_threshold=1e-4 if promotes else 0.01)
    stats_every = 7 if case.startswith("pure") else None
    eager, eager_losses = _train(model, policy, batches, stats_every=stats_every)
    done, done_losses = _train(model, policy, batches, stats_every=stats_every, compile=AOT_EAGER)
    assert done.compiled_step is not None and done.compiled_step.graph.compiles == 1
    if promotes:
        assert eager.promotions, "the case must promote"
    _assert_same_training(eager, done, eager_losses, done_losses)


class _Residual(nn.Module):
    """conv, batch norm and ReLU, then a block whose batch norm's output an add alone reads: that output's
    gradient is the add's output gradient itself (``OpSites.gradient_from``)."""

    def __init__(self) -> None:
        super().__init__()
        self.stem, self.stem_bn = nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8)
        self.conv, self.bn = nn.Conv2d(8, 8, 3, padding=1), nn.BatchNorm2d(8)
        self.fc = nn.Linear(8, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = torch.relu(self.stem_bn(self.stem(x)))
        out = torch.relu(self.bn(self.conv(out)) + out)
        return self.fc(torch.flatten(F.adaptive_avg_pool2d(out, 1), 1))


@pytest.mark.parametrize(("granularity", "name"), [("tensor", "tiny_cnn"), ("tensor", "residual"),
                                                   pytest.param("row", "tiny_cnn", marks=pytest.mark.slow)])
def test_scaled_formats_train_compiled_bit_for_bit_as_eagerly(granularity: str, name: str) -> None:
    """torchao's tensorwise recipe (and its rowwise variant): weights and activations e4m3fn, gradients e5m2, each
    tensor (row) with its own power-of-two scale, bf16 high, fp32 master weights. 12 steps of tiny_cnn compiled
    without Inductor (aot_eager; codes and scales saved, the convolutions' and batch norms' backwards reading
    them a slice at a time) train as the eager runtime: every parameter, buffer and loss, and the counts; and
    so does a residual block, whose add passes its scaled gradient on (counted, not rounded again)."""
    torch.manual_seed(0)
    model = _model("tiny_cnn") if name == "tiny_cnn" else _Residual()
    batches = _batches(12, 16, 16)
    formats = {kind: f"{element}@{granularity}" for kind, element in
               (("weight", "e4m3fn"), ("activation", "e4m3fn"), ("activation_grad", "e5m2"), ("weight_grad", "e5m2"))}
    policy = _policy(model, batches[0][0], formats, high_format="bf16", master_weights=True,
                     loss_scaling={"mode": "none"})
    eager, eager_losses = _train(model, policy, batches)
    done, done_losses = _train(model, policy, batches, compile=AOT_EAGER)
    assert done.compiled_step is not None
    assert any(site.scaled[0] and site.code for site in done.compiled_step.graph.sites)
    assert any(site.grad_arrives_rounded for site in done.compiled_step.graph.sites) == (name == "residual")
    _assert_same_training(eager, done, eager_losses, done_losses)


# OCP's MXFP8 (a scale per 32 values of a row) and Transformer Engine's delayed scaling (a scale per tensor from the
# largest amax of its last 4 roundings)
RECIPES = {"mx": "{}@block32", "delayed": "{}@tensor:delayed4"}
ELEMENTS = {"weight": "e4m3fn", "activation": "e4m3fn", "activation_grad": "e5m2", "weight_grad": "e5m2"}


def _recipe_policy(model: nn.Module, x: torch.Tensor, recipe: str):
    formats = {kind: RECIPES[recipe].format(element) for kind, element in ELEMENTS.items()}
    return _policy(model, x, formats, high_format="bf16", master_weights=True, loss_scaling={"mode": "none"})


def _histories(wrapped) -> dict[str, torch.Tensor]:
    return {tensor_id: slot.history.amaxes for tensor_id, slot in wrapped.state.slots.items()
            if slot.history is not None}


@pytest.mark.parametrize("recipe", ["mx", "delayed"])
def test_mx_block_scales_and_delayed_scaling_train_compiled_bit_for_bit_as_eagerly(recipe: str, caplog) -> None:
    """6 steps of tiny_cnn under MXFP8 (its classifier's rows, 10 values, end in a shorter block) or delayed
    scaling (weights, activations and both gradients, each with its amax history passed into the compiled graph
    and out of it as tensors), compiled without Inductor (aot_eager; codes saved with e8m0 scales), train as the
    eager runtime, with no WARNING: every parameter, buffer and loss, the counts, and every amax history. A
    checkpoint of the eager run, resumed compiled, goes on as the eager run goes on."""
    model = _model("tiny_cnn")
    batches = _batches(8, 16, 16)
    policy = _recipe_policy(model, batches[0][0], recipe)
    with caplog.at_level(logging.WARNING):
        eager, eager_losses = _train(model, policy, batches[:6])
        done, done_losses = _train(model, policy, batches[:6], compile=AOT_EAGER)
    assert not [record.getMessage() for record in caplog.records if record.levelno >= logging.WARNING]
    assert done.compiled_step is not None
    assert any(site.scaled[0] and site.code for site in done.compiled_step.graph.sites)
    _assert_same_training(eager, done, eager_losses, done_losses)
    histories = _histories(eager)
    assert len(histories) == (0 if recipe == "mx" else len(eager.state.slots))
    assert all(torch.equal(amaxes, _histories(done)[tensor_id]) for tensor_id, amaxes in histories.items())
    filled = {eager.state.slots[tensor_id].kind for tensor_id, amaxes in histories.items()
              if amaxes.count_nonzero() == 4}  # 6 steps filled them (the input's gradient's stays empty)
    assert filled == (set() if recipe == "mx" else set(ELEMENTS))

    resumed = apply_policy(copy.deepcopy(model), policy, batches[0][0][:2], compile=AOT_EAGER)
    resumed.load_state_dict(eager.state_dict())
    resumed_losses = _steps(resumed, batches[6:])  # plain SGD: a checkpoint holds no optimizer state
    assert resumed.compiled_step is not None and resumed_losses == _steps(eager, batches[6:])
    _assert_same_module(eager, resumed)
    assert all(torch.equal(amaxes, _histories(resumed)[tensor_id]) for tensor_id, amaxes in _histories(eager).items())


@pytest.mark.slow  # compiles two steps with Inductor
@pytest.mark.parametrize("recipe", ["mx", "delayed"])
def test_mx_and_delayed_compiled_steps_peak_within_5_percent_of_the_eager_ones(recipe: str) -> None:
    """tiny_cnn, batch 64, 32x32: the compiled step (Inductor; each rounded value saved as codes with its e8m0
    scales, as the eager runtime saves it; a delayed history a few floats) peaks at most 5% above the eager
    step, the third step of each (``sgd_step(warmup=2)``); measured below it (0.88x MX, 0.90x delayed, as 0.90x
    for a scale per tensor, which the compiled step served before). Bytes from the allocator's events
    (``trace_step``)."""
    model = _model("tiny_cnn")
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(64, 3, 32, 32, generator=g), torch.randint(0, 10, (64,), generator=g)
    policy = _recipe_policy(model, x, recipe)
    peaks = []
    for compile in (False, True):
        wrapped = apply_policy(copy.deepcopy(model), policy, x[:2], compile=compile)
        assert (wrapped.compiled_step is not None) == compile
        optimizer = torch.optim.SGD(wrapped.parameters(), lr=0.01, momentum=0.9, weight_decay=5e-4)
        peaks.append(trace_step(sgd_step(wrapped, optimizer, x, y, warmup=2)).peak)
    eager, compiled = peaks
    assert compiled <= 1.05 * eager, (compiled, eager)


def _residual_policy(model: nn.Module, x: torch.Tensor, add_gradient: str):
    """All-low, but the add's output gradient in ``add_gradient``."""
    from precsearch.graph.types import grad_id

    graph = trace(model, x[:2], batch_size=x.shape[0])
    add = next(op for op in graph.ops if op.name == "add")
    assignment = {t: ALL_LOW[graph.tensors[t].kind] for t in graph.assignable_ids()}
    assignment[grad_id(add.outputs[0])] = add_gradient
    return policy_from_assignment(graph, assignment, high_format="e6m9s", overflow=dict(PAPER_OVERFLOW),
                                  promotion_threshold=None, loss_scaling={"mode": "dynamic", "init_scale": 2.0**8})


@pytest.mark.parametrize("add_gradient", [ALL_LOW["activation_grad"], "e4m3b4s"])
def test_a_gradient_an_add_passes_on_rounded_alike_is_counted_not_rounded_again(add_gradient: str) -> None:
    """Where the add's output gradient is rounded in the batch norm's output gradient's format, the compiled
    backward counts that gradient's overflows (``count_overflows``) instead of rounding it again into a second
    float32 tensor, as the eager runtime rounds it over itself; in another format it rounds it. Counted in the
    dispatcher's view of one backward: one rounding pass fewer, one count more; and 6 steps train bit for bit
    as eager (aot_eager) either way."""
    from dispatch import DispatchCounter

    torch.manual_seed(0)
    model, batches = _Residual(), _batches(6, 8, 8)
    policy = _residual_policy(model, batches[0][0], add_gradient)
    eager, eager_losses = _train(model, policy, batches)
    done, done_losses = _train(model, policy, batches, compile=AOT_EAGER)
    _assert_same_training(eager, done, eager_losses, done_losses)
    x, y = batches[0]
    loss = F.cross_entropy(done(x), y)
    with DispatchCounter() as counter:
        loss.backward()
    alike = add_gradient == ALL_LOW["activation_grad"]
    gradient_sites = sum(site.grad is not None for site in done.compiled_step.graph.sites)
    assert counter.ops["precsearch.count_overflows"] == alike
    # and each convolution backward over codes rounds its weight again from the master
    weights_again = counter.ops["precsearch.conv_backward_of_codes"]
    assert weights_again == 2
    assert counter.ops["precsearch.round_site"] == gradient_sites - alike + weights_again


def test_a_graph_saving_float32_serves_assignments_that_part_an_add_gradient_from_its_value_gradient() -> None:
    """Saving float32 (a search's proxies, one graph for every assignment), the compiled step rounds a gradient an
    add passes on again whether it arrives rounded alike or not (the same values and counts as only counting
    it), so assignments that differ there share one graph, compiled once; each trains bit for bit as eagerly."""
    torch.manual_seed(0)
    model, batches = _Residual(), _batches(3, 8, 8)
    options = CompileOptions(backend="aot_eager", saves_codes=False)
    runtime = _own_graphs()
    graphs = []
    for add_gradient in (ALL_LOW["activation_grad"], "e4m3b4s"):
        policy = _residual_policy(model, batches[0][0], add_gradient)
        eager, eager_losses = _train(model, policy, batches)
        done, done_losses = _train(model, policy, batches, compile=options, runtime=runtime)
        _assert_same_training(eager, done, eager_losses, done_losses)
        graphs.append(done.compiled_step.graph)
    assert graphs[0] is graphs[1] and graphs[0].compiles == 1
    assert not any(site.grad_arrives_rounded for site in graphs[0].sites)


@pytest.mark.slow  # compiles three graphs
@pytest.mark.parametrize("saves_codes", [False, True])
def test_compiled_graphs_are_shared_by_assignments_of_equal_code_widths(saves_codes: bool) -> None:
    """Four policies of one model (all-low, fp16, fp32, hfp8-like), each trained bit for bit as eagerly: saving
    float32 (a search's proxies), one compiled graph serves them all; saving codes, a graph serves the
    assignments whose formats have the same code widths (all-low and hfp8-like: weights and activations 1 byte,
    weight gradients float32: e6m9s has no NaN code, so its gradients are not held as codes), so these four
    compile three graphs, each once."""
    model = _model("tiny_cnn")
    batches = _batches(2, 8, 16)
    kinds = ("weight", "activation", "activation_grad", "weight_grad")
    assignments = [ALL_LOW, dict.fromkeys(kinds, "fp16"), dict.fromkeys(kinds, "fp32"),
                   {"weight": "e4m3", "activation": "e4m3", "activation_grad": "e5m2", "weight_grad": "e6m9s"}]
    options = CompileOptions(backend="aot_eager", saves_codes=saves_codes)
    runtime = _own_graphs()  # one set of runs: their graphs shared
    graphs = []
    for formats in assignments:
        policy = _policy(model, batches[0][0], formats)
        eager, eager_losses = _train(model, policy, batches)
        done, done_losses = _train(model, policy, batches, compile=options, runtime=runtime)
        _assert_same_training(eager, done, eager_losses, done_losses)
        graphs.append(done.compiled_step.graph)
    if saves_codes:
        assert graphs[0] is graphs[3] and len({id(graph) for graph in graphs}) == 3
    else:
        assert len({id(graph) for graph in graphs}) == 1
    assert all(graph.compiles == 1 for graph in graphs)


def test_runs_given_one_runtime_share_its_graphs_and_options_are_plain_values() -> None:
    """``CompileOptions`` is a plain value (a pickled copy, a spawned worker's, is equal); the compiled graphs
    belong to the runtime the runs are handed: models wrapped in one runtime share a graph, under equal options
    made apart too, another runtime builds its own, and ``apply_policy`` without one uses the default runtime's."""
    import pickle

    model = _model("tiny_cnn")
    x = torch.randn(8, 3, 16, 16)
    policy = _policy(model, x, ALL_LOW)
    options = CompileOptions(backend="aot_eager")
    assert pickle.loads(pickle.dumps(options)) == options
    shared, other = _own_graphs(), _own_graphs()
    graphs = [apply_policy(copy.deepcopy(model), policy, x[:2], compile=CompileOptions(backend="aot_eager"),
                           runtime=runtime).compiled_step.graph for runtime in (shared, shared, other)]
    assert graphs[0] is graphs[1] and graphs[2] is not graphs[0]
    assert list(shared.graphs.graphs.values()) == [graphs[0]] and list(other.graphs.graphs.values()) == [graphs[2]]
    with shared.as_default():
        assert apply_policy(copy.deepcopy(model), policy, x[:2], compile=options).compiled_step.graph is graphs[0]


def test_a_policy_the_compiled_step_cannot_train_runs_eagerly_with_one_warning(caplog) -> None:
    model = _model("tiny_cnn")
    x = torch.randn(8, 3, 16, 16)
    policy = _policy(model, x, ALL_LOW, loss_scaling={"mode": "adaptive"})
    runtime = _own_graphs()  # the runs given this runtime: one WARNING for all
    with caplog.at_level(logging.WARNING, logger="precsearch.runtime.model"):
        wrapped = [apply_policy(copy.deepcopy(model), policy, x[:2], compile=True, runtime=runtime) for _ in range(2)]
    assert [one.compiled_step for one in wrapped] == [None, None]
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "adaptive loss scaling" in warnings[0] and "eagerly" in warnings[0]


@pytest.mark.slow
def test_a_block_fx_cannot_trace_runs_as_one_op_and_the_rest_compiles() -> None:
    """One WARNING names the block; the graph stays FX's, with the block one op (``opaque_modules``), and the
    compiled step (aot_eager) takes the model, its graph broken at the block's branch. Oracle: the same
    training written by hand with torch ops, each weight and each op's output rounded (kernels.quantize, a
    straight-through gradient), the values inside the block float32: every gradient is equal bit for bit."""
    torch.manual_seed(0)
    model = PartlyTraceable()
    x, y = torch.randn(8, 3, 8, 8), torch.randint(0, 10, (8,))
    with pytest.warns(UserWarning) as caught:
        policy = _policy(model, x, {"weight": "e4m3b4s", "activation": "e4m3b4s", "activation_grad": "fp32",
                                    "weight_grad": "fp32"})
    messages = [str(w.message) for w in caught if "torch.fx" in str(w.message)]
    assert len(messages) == 1 and messages[0].startswith("torch.fx could not trace gate (_Gated)")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        wrapped = apply_policy(copy.deepcopy(model), policy, x[:2], compile=AOT_EAGER)
    assert wrapped.graph.tracer == "fx" and wrapped.graph.opaque_modules == ("gate",)
    assert wrapped.compiled_step is not None
    F.cross_entropy(wrapped(x), y).backward()
    assert wrapped.compiled_step.graph.compiles >= 2  # Dynamo's graph breaks at the block's branch

    class StraightThrough(torch.autograd.Function):
        @staticmethod
        def forward(ctx, value):
            return quantize(value, "e4m3b4s")

        @staticmethod
        def backward(ctx, grad):
            return grad

    q = StraightThrough.apply
    w = {name: q(param) for name, param in model.named_parameters()}
    # the bias added after the convolution: its gradient a sum over (batch, height, width), as the runtime's
    # sliced backward sums it, not oneDNN's bias reduction (another float32 summation order)
    out = q(F.conv2d(q(x), w["conv.weight"], None, padding=1) + w["conv.bias"].view(1, -1, 1, 1))
    out = q(torch.relu(q(F.batch_norm(out, None, None, w["bn.weight"], w["bn.bias"], training=True))))
    inside = F.conv2d(out, w["gate.conv.weight"], w["gate.conv.bias"], padding=1)  # float32 inside the block
    out = q(F.adaptive_avg_pool2d(q(torch.relu(inside) if inside.mean() > -1 else inside), 1))
    F.cross_entropy(q(F.linear(out.flatten(1), w["fc.weight"], w["fc.bias"])), y).backward()
    trained = dict(wrapped.module.named_parameters())
    for name, param in model.named_parameters():
        assert torch.equal(trained[name].grad, param.grad), name


@pytest.mark.parametrize(("compile", "device", "steps", "expected"), [
    (None, "cuda", COMPILE_MIN_STEPS, True), (None, "cuda", COMPILE_MIN_STEPS - 1, False), (None, "auto", None, True),
    (None, "cpu", COMPILE_MIN_STEPS * 10, False), (None, "cpu", None, False), (False, "cuda", None, False),
    (True, "cpu", 1, True)])
def test_the_command_line_compiles_long_work_on_cuda_unless_told(monkeypatch, compile, device, steps,
                                                                  expected) -> None:
    """``--compile`` and ``--no-compile`` always win; otherwise a command compiles on CUDA from
    ``COMPILE_MIN_STEPS`` steps (None: long runs) and trains eagerly on a CPU, where the compiled step measured
    no faster: options it hands to its runs and workers, saving codes; no environment variable is set."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # "auto" and "cuda" resolve to CUDA here
    before = {key: value for key, value in os.environ.items() if key.startswith("PRECSEARCH")}
    options = choose_compile(argparse.Namespace(compile=compile, device=device), steps)
    assert options == (CompileOptions() if expected else None)
    assert {key: value for key, value in os.environ.items() if key.startswith("PRECSEARCH")} == before


@pytest.mark.slow
@pytest.mark.parametrize(("name", "gradient_rounding"), [("resnet18", "sum"), ("resnet18", "per_use"),
                                                         ("mobilenet_v2", "per_use"), ("untraceable", "sum")])
def test_zoo_models_train_bit_for_bit_compiled_as_eager(name: str, gradient_rounding: str, caplog) -> None:
    """The issue's models, 20 steps of the all-low policy with pure low-precision weights: ResNet-18 (its
    residual values have two consumers: their gradients summed then rounded, or rounded per consumer, the
    paper's ``per_use``) and MobileNetV2 (width 0.125) compiled (aot_eager) against eager; a model FX cannot
    trace falls back to the eager step with one WARNING naming it, so it trains as eager does."""
    model = _model(name)
    batches = _batches(20, 8, 16)
    policy = _policy(model, batches[0][0], ALL_LOW, master_weights=False, gradient_rounding=gradient_rounding)
    eager, eager_losses = _train(model, policy, batches)
    with caplog.at_level(logging.WARNING, logger="precsearch.runtime.model"):
        done, done_losses = _train(model, policy, batches, compile=AOT_EAGER)
    fallback = [r.getMessage() for r in caplog.records if "not compiled" in r.getMessage()]
    if name == "untraceable":
        assert done.compiled_step is None and len(fallback) == 1 and "Untraceable is not FX-traceable" in fallback[0]
    else:
        assert done.compiled_step is not None and not fallback
    _assert_same_training(eager, done, eager_losses, done_losses)


@pytest.mark.slow
def test_inductor_compiled_training_makes_the_eager_decisions_within_float32_reordering() -> None:
    """Inductor's code (the default backend) over 20 steps of tiny_cnn under all-low: the same promotions, loss
    scale and skipped steps as eager, and losses within 1% (measured: 0.45% at most). Not bit for bit: Inductor
    sums batch-norm statistics in another order, and a last-bit difference that flips an 8-bit rounding moves
    a value by a whole ulp of its format (weights of e4m3b4s differ by up to 20% of a tensor's largest value
    after 20 steps)."""
    model = _model("tiny_cnn")
    batches = _batches(20, 16, 16)
    policy = _policy(model, batches[0][0], ALL_LOW)
    eager, eager_losses = _train(model, policy, batches)
    done, done_losses = _train(model, policy, batches, compile=True)
    assert done.compiled_step is not None
    assert done_losses == pytest.approx(eager_losses, rel=1e-2)
    assert done.promotions == eager.promotions
    assert done.scaler.get_scale() == eager.scaler.get_scale()
    assert done.scaler.skipped_steps == eager.scaler.skipped_steps


@pytest.mark.slow
def test_a_search_of_40_trials_compiles_its_training_step_once(tmp_path) -> None:
    """A search of 40 trials (narrow_cnn on digits: 7 units, 128 assignments; 2-step proxies, one worker) with the
    compiled step on, as the CLI turns it on for a long search: every trained policy runs the one compiled
    graph, compiled once."""
    from precsearch.config.spaces import paper_space
    from precsearch.search.settings import SearchConfig
    from precsearch.search.study import run_search

    space = paper_space(proxy={"batch_size": 16, "image_size": 8, "eval_batch_size": 64})
    with _own_graphs().as_default() as runtime:
        result = run_search(SearchConfig("narrow_cnn", space, "digits", trials=40, out_dir=tmp_path / "run",
                                         device="cpu", progress=False, proxy_steps=2, threads=1,
                                         compile=CompileOptions()))
    trained = result.trials[result.trials["state"] == "COMPLETE"]
    assert len(trained) >= 40
    graphs = list(runtime.graphs.graphs.values())  # the search's runtime: the default while it ran
    assert len(graphs) == 1 and graphs[0].compiles == 1


CUDA = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA is not available here")]


@pytest.mark.parametrize("backend", [pytest.param("aot_eager", marks=CUDA), pytest.param("inductor", marks=CUDA)])
def test_the_compiled_step_on_cuda(backend: str) -> None:
    """On CUDA: without Inductor, bit for bit the eager runtime's 20 steps; with Inductor (Triton kernels), the
    eager decisions (promotions, loss scale, skipped steps) and losses within 1% (as on CPU)."""
    model = _model("tiny_cnn")
    batches = _batches(20, 16, 16)
    policy = _policy(model, batches[0][0], ALL_LOW)
    eager, eager_losses = _train(model, policy, batches, "cuda")
    done, done_losses = _train(model, policy, batches, "cuda", compile=CompileOptions(backend=backend))
    assert done.compiled_step is not None
    if backend == "aot_eager":
        _assert_same_training(eager, done, eager_losses, done_losses)
    else:
        assert done_losses == pytest.approx(eager_losses, rel=1e-2)
        assert done.promotions == eager.promotions
        assert done.scaler.get_scale() == eager.scaler.get_scale()


@pytest.mark.slow  # compiles a graph with stochastic rounding
def test_stochastic_rounding_in_the_compiled_step_draws_from_its_seed() -> None:
    """Stochastic rounding of activation gradients and weights inside the compiled graph (the hash computed in
    the graph; its values are ``round_with``'s, tested against the kernels in tests/test_format_data.py): the
    same seed trains the same bits, another seed other bits, and nearest rounding others again."""
    model = _model("tiny_cnn")
    batches = _batches(3, 16, 16)
    stochastic = _policy(model, batches[0][0], ALL_LOW, rounding={"activation_grad": "stochastic",
                                                                  "weight": "stochastic"})
    runs = [_train(model, policy, batches, seed=seed, compile=AOT_EAGER)[0]
            for policy, seed in ((stochastic, 1), (stochastic, 1), (stochastic, 2), (_policy(model, batches[0][0],
                                                                                             ALL_LOW), 1))]
    assert {slot.rounding for slot in runs[0].state.slots.values() if slot.kind == "weight"} == {"stochastic"}
    params = [[p.detach().clone() for p in run.module.parameters()] for run in runs]
    assert all(map(torch.equal, params[0], params[1]))
    assert not all(map(torch.equal, params[0], params[2]))
    assert not all(map(torch.equal, params[0], params[3]))


def _saved_tensors(wrapped, x: torch.Tensor) -> list[torch.Tensor]:
    """What one training forward of ``wrapped`` leaves autograd for the backward (each tensor once)."""
    saved: dict[int, torch.Tensor] = {}

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        saved[id(tensor)] = tensor
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        wrapped(x)
    return list(saved.values())


@pytest.mark.parametrize("backend", ["aot_eager", pytest.param("inductor", marks=pytest.mark.slow)])
def test_the_compiled_step_holds_no_copy_of_a_convolutions_weight_for_its_backward(backend: str) -> None:
    """A convolution's backward rounds its weight again from the fp32 master, as the eager runtime does, so what
    the compiled forward leaves autograd of each convolution's weight size (float32 values, or the 2-byte codes
    of fp16 weights: two byte planes) is the parameter itself, never a copy (the bit-for-bit tests above train
    through it). Counted by autograd's own saved-tensor hooks, against the parameters' storage."""
    model = _model("tiny_cnn")
    x = torch.randn(12, 3, 16, 16)
    policy = _policy(model, x, dict(ALL_LOW, weight="fp16"))
    done = apply_policy(copy.deepcopy(model), policy, x[:2], compile=CompileOptions(backend=backend))
    weights = {name: p for name, p in done.named_parameters() if p.dim() == 4}
    assert len(weights) == 2
    storages = {p.untyped_storage().data_ptr() for p in weights.values()}
    shapes = {tuple(p.shape) for p in weights.values()}
    of_weight_size = [t for t in _saved_tensors(done, x) if tuple(t.shape) in shapes or tuple(t.shape[1:]) in shapes]
    assert len(of_weight_size) == 2
    assert all(t.untyped_storage().data_ptr() in storages for t in of_weight_size)


@pytest.mark.slow
@pytest.mark.parametrize(("formats", "code"), [(ALL_LOW, 1), (dict(ALL_LOW, activation="fp16"), 2)])
def test_the_compiled_step_saves_each_rounded_activation_as_codes_of_its_width(formats, code) -> None:
    """Inductor's compiled step saves, for the backward, the codes of each rounded activation (1 byte for an
    8-bit format, 2 for fp16: two byte planes), not its float32 values: every saved tensor that grows with the
    batch is uint8 codes of that width (but the max pool's int8 offsets, Inductor's own), and together they hold
    the eager runtime's packed saves (its ``saved_bytes``, each storage's codes once) within 5%, never more: the
    step ``precsearch train --policy`` compiles from 2,000 steps (the test below) holds what the eager one holds.
    Counted by autograd's own saved-tensor hooks."""
    model = _model("tiny_cnn")
    x = torch.randn(12, 3, 16, 16)  # a batch no channel count equals
    policy = _policy(model, x, formats)
    eager = apply_policy(copy.deepcopy(model), policy, x[:2])
    eager(x)
    eager_bytes = eager.saved_bytes().activation
    done = apply_policy(copy.deepcopy(model), policy, x[:2], compile=True)
    batch = x.shape[0]
    per_sample = [t for t in _saved_tensors(done, x)  # 2 bytes: two byte planes, stacked on the batch or before it
                  if t.dim() > 1 and (t.shape[0] % batch == 0 or t.shape[:2] == (2, batch)) and t.dtype != torch.int8]
    assert per_sample and {t.dtype for t in per_sample} == {torch.uint8}
    assert all(t.shape[0] == code * batch or t.shape[:2] == (code, batch) for t in per_sample)
    compiled_bytes = sum(t.numel() * t.element_size() for t in per_sample)
    assert 0.95 * eager_bytes <= compiled_bytes <= eager_bytes, (compiled_bytes, eager_bytes)


@pytest.mark.slow
def test_a_value_without_a_code_skips_the_compiled_step_as_the_eager_one() -> None:
    """A NaN in the batch reaches activations whose format (e4m3b4s) has no NaN code: the eager step finds it
    when it packs them, the compiled step when it encodes them, and both skip that step (and only that one), so
    the parameters train bit for bit alike. The skipped step leaves batch norm's running statistics as they were
    in both (precsearch.runtime.norm_statistics): the eager forward had folded a NaN into them, the compiled one
    the code's value (the format's largest magnitude)."""
    model = _model("tiny_cnn")
    batches = _batches(4, 8, 16)
    batches[2][0][0, 0, 0, 0] = float("nan")
    policy = _policy(model, batches[0][0], ALL_LOW)
    eager, eager_losses = _train(model, policy, batches)
    done, done_losses = _train(model, policy, batches, compile=AOT_EAGER)
    assert done.compiled_step is not None
    assert eager.scaler.skipped_steps == done.scaler.skipped_steps == 1
    for (name, a), (_, b) in zip(eager.module.named_parameters(), done.module.named_parameters(), strict=True):
        assert torch.equal(a, b), name
    for name, a in eager.module.named_buffers():
        assert torch.equal(a, dict(done.module.named_buffers())[name]), name
    assert eager.module.bn1.running_mean.isfinite().all()


class _Reached(BaseException):
    """Raised where the test has seen what it looks for: the command stops there."""


@pytest.mark.parametrize(("steps", "flags", "expected"), [
    (3000, ["--compile"], CompileOptions()), (3000, [], None), (3000, ["--compile", "--no-compile"], None)])
def test_train_with_a_policy_hands_its_compile_choice_to_the_wrapper(tmp_path, monkeypatch, steps, flags,
                                                                     expected) -> None:
    """``precsearch train MODEL --policy P --steps 3000 --compile`` wraps the model compiled and saving codes (so
    its saves are the eager step's: the test above), through its configuration; on a CPU by default, and with
    ``--no-compile`` last, it trains eagerly; never through the environment."""
    from precsearch.cli import main
    from precsearch.train import trainer

    model = _model("tiny_cnn")
    x = torch.randn(64, 3, 8, 8)
    _policy(model, x, ALL_LOW).save(tmp_path / "policy.json")
    seen = []

    def wrap(model, policy, example, **options):
        seen.append(options.get("compile"))
        raise _Reached

    monkeypatch.setattr(trainer, "apply_policy", wrap)
    before = {key: value for key, value in os.environ.items() if key.startswith("PRECSEARCH")}
    with pytest.raises(_Reached):
        main(["train", "tiny_cnn", "--policy", str(tmp_path / "policy.json"), "--steps", str(steps),
              "--image-size", "8", "--device", "cpu", "--threads", "1", "--data", "digits", *flags])
    assert seen == [expected or False]
    assert {key: value for key, value in os.environ.items() if key.startswith("PRECSEARCH")} == before
