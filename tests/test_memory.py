"""Peak memory of a training step: the CPU tracker against hand-computed peaks, and the cost model's predicted
peak against the tracker for every zoo model, plain and under the runtime's policies."""

from __future__ import annotations

import copy

import pytest
import torch

from precsearch.config.policy import Policy
from precsearch.config.spec import PAPER_OVERFLOW
from precsearch.cost.measured import measure_peak, sgd_step, trace_step
from precsearch.cost.model import MIB, CostModel
from precsearch.cost.policies import policy_from_assignment
from precsearch.graph.tracing import trace
from precsearch.models import NAMES, build
from precsearch.runtime.model import apply_policy
from precsearch.search.strategies import baseline

KIB = 1024


def test_tracker_peak_of_allocations_by_hand():
    """a (4 KiB) and b (8 KiB) live together, then a dies and c (2 KiB) comes: the peak is a + b."""
    kept = []

    def program() -> None:
        a = torch.empty(KIB, dtype=torch.float32)
        b = torch.empty(2 * KIB, dtype=torch.float32)
        del a
        kept.append(torch.empty(512, dtype=torch.float32))
        kept.append(b)

    memory = trace_step(program)
    assert memory.peak == 12 * KIB
    assert sorted(a.nbytes for a in memory.allocations) == [2 * KIB, 4 * KIB, 8 * KIB]
    assert sorted(a.nbytes for a in memory.allocations if a.end is None) == [2 * KIB, 8 * KIB]


def test_tracker_counts_temporaries_and_ignores_older_blocks():
    """x exists before the step and is freed in it: not counted. (x + x) * x holds x + x (4 KiB) and the
    product (4 KiB) at once; the product outlives the step. (Tensor operands only: a Python number
    becomes a small tensor of its own.)"""
    holder = {"x": torch.ones(KIB)}
    out = []

    def program() -> None:
        x = holder.pop("x")
        out.append((x + x) * x)
        del x

    assert measure_peak(program, "cpu") == 8 * KIB
    assert out[0].sum().item() == 2 * KIB


def test_tracker_step_of_a_linear_layer_by_hand():
    """loss = (x @ w.T).pow(2).sum(): forward keeps y (B x K) for pow's backward, makes y^2 (B x K) and the
    loss (4 bytes); backward makes the loss's gradient (4 bytes), 2y*g (B x K) while y^2 is still held, the
    gradient of w.T (D x K) and its contiguous copy that AccumulateGrad stores as w.grad (K x D)."""
    batch, d_in, d_out = 64, 32, 128
    g = torch.Generator().manual_seed(0)
    x = torch.randn(batch, d_in, generator=g)
    w = torch.randn(d_out, d_in, generator=g, requires_grad=True)

    def step() -> None:
        (x @ w.T).pow(2).sum().backward()

    assert measure_peak(step) == 4 * (3 * batch * d_out + 2 * d_out * d_in) + 8


# ------------------------------------------------------------------------------------ predicted vs measured

# Small widths: activations still dominate parameters, as in real training (at 16x16 images and batch 8 they
# do not, and the prediction of ResNet-18's peak is 17% high). tiny_cnn at width 1
# (16 channels): narrower layers are padded to oneDNN's 16-channel blocks, a CPU artifact.
WIDTHS = {"resnet18": 0.25, "mobilenet_v2": 0.25, "shufflenet_v2": 0.25, "squeezenet": 0.25, "tiny_cnn": 1.0,
          "narrow_cnn": 1.0}
BATCHES = (16, 32)
IMAGE = 32
POLICIES = ("plain", "fp32", "fp16", "bf16", "hfp8", "all-low")
ALL_LOW = {"weight": "e4m3b4s", "activation": "e4m3b4s", "activation_grad": "e5m2s", "weight_grad": "e6m9s"}
# Cases where the measured peak exceeds the prediction by more than 10% because the runtime holds a
# transient the model does not: (model, batch, policy) -> the transient.
RUNTIME_EXTRA: dict[tuple[str, int, str], str] = {}


def _policy(name: str, graph) -> Policy | None:
    if name == "plain":
        return None
    if name != "all-low":
        return baseline(name, graph)
    return policy_from_assignment(
        graph, {tid: ALL_LOW[graph.tensors[tid].kind] for tid in graph.assignable_ids()}, high_format="e6m9s",
        overflow=dict(PAPER_OVERFLOW), loss_scaling={"mode": "dynamic", "init_scale": 2.0**16},
        promotion_threshold=0.01)


def _measured_peak(model: torch.nn.Module, policy: Policy | None, x: torch.Tensor, y: torch.Tensor,
                   compile: bool = False) -> int:
    """Peak of one SGD step (momentum, weight decay) after a first step made the momentum buffers and
    compiled the format kernels (``compile``: and the step); gradients are None before it, as after zero_grad."""
    if policy is not None:
        model = apply_policy(model, policy, compile=compile)
    step = sgd_step(model, torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9, weight_decay=5e-4), x, y)
    step()
    return measure_peak(step)


def _cases():
    for name in NAMES:
        for batch in BATCHES:
            for policy in POLICIES:
                reason = RUNTIME_EXTRA.get((name, batch, policy))
                marks = [pytest.mark.xfail(strict=True, reason=reason)] if reason else []
                if policy != "plain":  # compiling the format kernels and the rounding take minutes in all
                    marks.append(pytest.mark.slow)
                yield pytest.param(name, batch, policy, marks=marks, id=f"{name}-b{batch}-{policy}")


@pytest.fixture(scope="module")
def zoo():
    """name -> (model, its graph at each batch)."""
    built = {}
    for name in NAMES:
        torch.manual_seed(0)
        model = build(name, width=WIDTHS[name])
        example = torch.randn(2, 3, IMAGE, IMAGE, generator=torch.Generator().manual_seed(0))
        built[name] = (model, {batch: trace(model, example, batch_size=batch) for batch in BATCHES})
    return built


@pytest.mark.parametrize(("name", "batch", "policy_name"), list(_cases()))
def test_predicted_peak_within_10_percent_of_measured(zoo, name, batch, policy_name):
    model, graphs = zoo[name]
    graph = graphs[batch]
    policy = _policy(policy_name, graph)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(batch, 3, IMAGE, IMAGE, generator=g)
    y = torch.randint(0, 10, (batch,), generator=g)
    measured = _measured_peak(copy.deepcopy(model), policy, x, y)
    predicted = CostModel(graph).peak_bytes(None if policy is None else policy.assignment(graph))
    assert abs(predicted - measured) <= 0.10 * measured, (
        f"{name} width {WIDTHS[name]} batch {batch} {policy_name}: predicted peak {predicted / MIB:.3f} MiB, "
        f"measured {measured / MIB:.3f} MiB (CPU allocator events)")



@pytest.mark.parametrize("activations", ["all-low", "e8m10"])
def test_the_forward_rounds_out_of_place_exactly_where_the_cost_model_holds_a_float32_copy(activations):
    """A training forward rounds into a new float32 tensor (``precsearch::round``, counted by the dispatcher)
    once per low weight use, for the input batch, and for each activation the cost model gives an ``unrounded``
    block; every other output is rounded over itself (``precsearch::round_``). GEMM, normalization, sum and
    pooling outputs always are; a ReLU's output, which its backward reads through its save, is where that save
    becomes the rounding's codes (all-low's 8-bit formats) and is not where the format has none (e8m10, 19 bits:
    the save keeps the raw output, a hand table of ``FloatFormat.packs``)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Counter(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.calls: dict[str, int] = {}

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            name = str(func.overloadpacket)
            self.calls[name] = self.calls.get(name, 0) + 1
            return func(*args, **(kwargs or {}))

    torch.manual_seed(0)
    model = build("resnet18", width=0.125)
    x = torch.randn(4, 3, 16, 16, generator=torch.Generator().manual_seed(1))
    graph = trace(model, x[:2], batch_size=4)
    policy = _policy("all-low", graph) if activations == "all-low" else policy_from_assignment(
        graph, {tid: "e8m10" if graph.tensors[tid].kind == "activation" else ALL_LOW[graph.tensors[tid].kind]
                for tid in graph.assignable_ids()}, high_format="fp32")
    wrapped = apply_policy(model, policy)
    with Counter() as counter:
        wrapped(x)
    blocks = CostModel(graph).peak_timeline(policy.assignment(graph))
    unrounded = sum(b.what.startswith("unrounded ") for b in blocks)
    weight_uses = sum(b.what.startswith("rounded ") and not b.what.startswith(("rounded gradient", "rounded weight"))
                      for b in blocks)
    fresh = sum(op.role == "gemm" or op.module_type in ("BatchNorm2d", "add", "AdaptiveAvgPool2d") for op in graph.ops)
    relus = sum(op.module_type == "ReLU" for op in graph.ops)
    assert unrounded == (0 if activations == "all-low" else relus)
    assert counter.calls["precsearch.round"] == weight_uses + 1 + unrounded  # + 1: the input batch
    assert counter.calls["precsearch.round_"] == fresh + relus - unrounded


@pytest.mark.slow  # compiles a step
@pytest.mark.parametrize("policy_name", ["all-low", "fp16"])
def test_the_compiled_step_holds_the_eager_steps_peak_as_the_cost_model_predicts(policy_name):
    """tiny_cnn, batch 64, 32x32: the compiled step (Inductor, codes saved, each site one opaque pass) peaks
    within 5% of the eager step (measured: 1.0001x all-low; before the sites were opaque, 1.44x: Inductor held
    float32 copies of the values around each op for the overflow counts), and the cost model's prediction for
    the step (one for both: the compiled backward holds low weight gradients as codes too) is within 1% of
    it."""
    torch.manual_seed(0)
    model = build("tiny_cnn")
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(64, 3, 32, 32, generator=g), torch.randint(0, 10, (64,), generator=g)
    graph = trace(model, x[:2], batch_size=64)
    policy = _policy(policy_name, graph)
    eager = _measured_peak(copy.deepcopy(model), policy, x, y)
    compiled = _measured_peak(copy.deepcopy(model), policy, x, y, compile=True)
    assert abs(compiled - eager) <= 0.05 * eager, (compiled / MIB, eager / MIB)
    predicted = CostModel(graph).peak_bytes(policy.assignment(graph))
    assert abs(predicted - compiled) <= 0.01 * compiled, (predicted / MIB, compiled / MIB)


@pytest.mark.slow
def test_resnet18_width_1_batch_128_peaks_meet_their_goals():
    """The goals at ResNet-18 width 1.0, batch 128, 32x32 (``benchmarks/bench_memory.py`` prints the table):
    the measured peak of the all-low step at most 0.35x the plain fp32 step's (its 8-bit saved tensors alone are
    0.24x), the fp16 baseline's at most 0.55x. Bytes, not times: the same on any machine with these kernels."""
    torch.manual_seed(0)
    model = build("resnet18", width=1.0)
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(128, 3, 32, 32, generator=g), torch.randint(0, 10, (128,), generator=g)
    graph = trace(model, x[:2], batch_size=128)
    plain = _measured_peak(copy.deepcopy(model), None, x, y)
    ratios = {name: _measured_peak(copy.deepcopy(model), _policy(name, graph), x, y) / plain
              for name in ("all-low", "fp16")}
    assert ratios["all-low"] <= 0.35 and ratios["fp16"] <= 0.55, ratios


def test_trace_step_holds_back_the_profilers_banners_and_passes_the_rest_on(capfd):
    """torch's profiler prints "USDT:" lines on stderr at each start and stop (two a measured step, six in a
    search's summary): they are held back; what the step itself writes there still reaches stderr."""
    import os

    from precsearch.cost.measured import trace_step

    def step():
        os.write(2, b"the step's own line\n")
        return torch.ones(1024) + 1

    assert trace_step(step).peak >= 4096
    assert capfd.readouterr().err == "the step's own line\n"


# ------------------------------------------------------------------------------------ peak ordering
# The search's settings (benchmarks/bench_memory.py's SUITE): 16x16 images, batch 64 (the demo's narrow_cnn 32).
ORDER_WIDTHS = {"resnet18": 0.25, "mobilenet_v2": 0.5, "shufflenet_v2": 0.5, "squeezenet": 0.5, "tiny_cnn": 1.0,
                "narrow_cnn": 1.0}
ORDER_BATCH = {"narrow_cnn": 32}
# Where the ordering does not hold yet, measured on a 2-core Xeon (AVX-512), torch 2.13: model -> why.
ORDER_FAILS = {"tiny_cnn": "the first layer's 1 MiB output: its batch norm's backward decodes it whole beside its "
                           "codes and torch's own workspace (all-high 1.145x plain fp32, all-low 1.072x)"}


@pytest.mark.slow  # the format kernels are compiled for each model's first step
@pytest.mark.parametrize("name", [pytest.param(name, marks=[pytest.mark.xfail(strict=True, reason=ORDER_FAILS[name])]
                                               if name in ORDER_FAILS else []) for name in NAMES])
def test_all_low_peaks_at_most_all_high_and_all_high_at_most_plain_fp32(name):
    """Measured step peaks (the CPU allocator's events) at the search's settings: the paper's all-low policy
    holds no more than all-high (every tensor e6m9s), which holds no more than the plain fp32 model."""
    torch.manual_seed(0)
    model = build(name, width=ORDER_WIDTHS[name])
    batch = ORDER_BATCH.get(name, 64)
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(batch, 3, 16, 16, generator=g), torch.randint(0, 10, (batch,), generator=g)
    graph = trace(model, x[:2], batch_size=batch)
    high = policy_from_assignment(graph, dict.fromkeys(graph.assignable_ids(), "e6m9s"), high_format="e6m9s",
                                  overflow=dict(PAPER_OVERFLOW),
                                  loss_scaling={"mode": "dynamic", "init_scale": 2.0**16})
    peaks = {label: _measured_peak(copy.deepcopy(model), policy, x, y)
             for label, policy in (("plain", None), ("all-high", high), ("all-low", _policy("all-low", graph)))}
    assert peaks["all-low"] <= peaks["all-high"] <= peaks["plain"], {k: v / MIB for k, v in peaks.items()}


@pytest.mark.parametrize("policy_name", ["fp16", "hfp8", "all-low"])
def test_finer_slices_peak_as_predicted_with_16_bit_codes_widened_to_int32(policy_name):
    """narrow_cnn, the demo's setting, its sliced backwards at the predicted peak in finer slices
    (``CostModel.finer_slices``): measured within 1% of the prediction. A 16-bit format's codes are written and
    read as int32 on a CPU (``kernels.kernel_codes_dtype``), a moment's transient beside a decoded slice or a
    gradient's rounding that sets this step's peak (fp16, hfp8's 16-bit gradients; without it priced, the
    prediction was 0.86x); all-low's 8-bit codes have none."""
    torch.manual_seed(0)
    model = build("narrow_cnn")
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(32, 3, 16, 16, generator=g), torch.randint(0, 10, (32,), generator=g)
    graph = trace(model, x[:2], batch_size=32)
    policy, cost = _policy(policy_name, graph), CostModel(graph)
    slices = cost.finer_slices(policy.assignment(graph))
    wrapped = apply_policy(model, policy, slices=slices, steps_per_epoch=100)
    step = sgd_step(wrapped, torch.optim.SGD(wrapped.parameters(), lr=0.01, momentum=0.9), x, y, warmup=2)
    measured = trace_step(step).peak
    assert abs(cost.peak_bytes(policy.assignment(graph), slices) - measured) <= 0.01 * measured



@pytest.mark.slow  # ShuffleNetV2's step under a policy: its format kernels compile
def test_shufflenet_s_last_conv_widening_its_channels_holds_its_reordered_output_gradient_as_predicted():
    """ShuffleNetV2 w0.5, 16 px, batch 64, the paper's all-low formats: the step peaks in the backward of conv5, a
    1x1 conv widening its channels, where oneDNN holds a reordered copy of its output gradient, 2.2x its
    input's size, and a conv that keeps or narrows its channels holds a second input-sized block
    (``OpRule.input_gradient_workspace``). Predicted within 0.5% of the allocator's record (the input-sized
    rule alone: 2.1% short)."""
    torch.manual_seed(0)
    model = build("shufflenet_v2", width=0.5)
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(64, 3, 16, 16, generator=g), torch.randint(0, 10, (64,), generator=g)
    graph = trace(model, x[:2], batch_size=64)
    policy = _policy("all-low", graph)
    measured = _measured_peak(model, policy, x, y)
    assert abs(CostModel(graph).peak_bytes(policy.assignment(graph)) - measured) <= 0.005 * measured
