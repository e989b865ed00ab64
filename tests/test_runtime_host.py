"""Host work of a training step under a policy: what makes a GPU step fast or slow, counted on any machine.

On a GPU, a step's cost under a policy is host work per rounded tensor: each host read of a device value
(``.item()``, ``.tolist()``, a copy to the CPU) stalls the stream, and each dispatched op is a kernel launch
plus Python. These tests count both in one steady-state step with a ``TorchDispatchMode`` (the dispatcher's
own view, independent of precsearch) and patched host-read methods, on CPU, so they hold without a GPU.

A precsearch op (``precsearch::round``, ``round_``, ``decode``) is one dispatch: one fused kernel when its
formats kernel is compiled. The counts are the same with compiled or eager kernels.
"""

from __future__ import annotations

import copy
from collections import Counter

import pytest
import torch
from dispatch import DispatchCounter

from precsearch.config.policy import Policy
from precsearch.config.spec import PAPER_OVERFLOW
from precsearch.cost.measured import sgd_step
from precsearch.cost.policies import policy_from_assignment
from precsearch.formats.runner import KernelRunner, KernelSettings, Runtime
from precsearch.graph.in_place import gradient_arrives_fresh, gradient_passes_from
from precsearch.graph.tracing import trace
from precsearch.graph.types import grad_id
from precsearch.models import build
from precsearch.runtime.model import apply_policy
from precsearch.search.strategies import baseline

PAPER_LOW = {"weight": "e4m3b4s", "activation": "e4m3b4s", "activation_grad": "e5m2s", "weight_grad": "e6m9s"}
BATCH = 4
SIZE = 16  # small enough that every formats kernel runs eagerly here: no compile time in these tests


def _paper_policy(graph) -> Policy:
    return policy_from_assignment(
        graph, {tid: PAPER_LOW[graph.tensors[tid].kind] for tid in graph.assignable_ids()},
        high_format="e6m9s", overflow=dict(PAPER_OVERFLOW), loss_scaling={"mode": "dynamic", "init_scale": 2.0**16},
        promotion_threshold=0.01,
    )


CUDA = pytest.param("cuda", marks=[pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(),
                                                                        reason="CUDA is not available here")])


def _setup(name: str = "resnet18", width: float = 0.125, device: str = "cpu"):
    torch.manual_seed(0)
    plain = build(name, width=width).to(device)
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(BATCH, 3, SIZE, SIZE, generator=g), torch.randint(0, 10, (BATCH,), generator=g)
    x, y = x.to(device), y.to(device)
    return plain, trace(plain, x[:2], batch_size=BATCH), x, y


def _stepper(model, x, y):
    return sgd_step(model, torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, weight_decay=5e-4), x, y)


def _count_one_step(step, monkeypatch) -> Counter[str]:
    for _ in range(3):  # steady state: promotions, caches, lazily made device state
        step()
    counter = DispatchCounter()
    reads = Counter()
    for method in ("tolist", "numpy", "item"):
        original = getattr(torch.Tensor, method)

        def counted(self, *args, _original=original, _method=method, **kwargs):
            reads[_method] += 1
            return _original(self, *args, **kwargs)

        monkeypatch.setattr(torch.Tensor, method, counted)
    with counter:
        step()
    monkeypatch.undo()
    counter.ops["host read"] = (counter.ops["aten._local_scalar_dense"] + counter.ops["host copy"]
                                + reads["tolist"] + reads["numpy"])
    return counter.ops


@pytest.mark.parametrize("device", ["cpu", CUDA])
def test_a_training_step_under_the_paper_policy_reads_the_host_once(device, monkeypatch):
    plain, graph, x, y = _setup(device=device)
    wrapped = apply_policy(copy.deepcopy(plain), _paper_policy(graph), example_input=x[:2])
    ops = _count_one_step(_stepper(wrapped, x, y), monkeypatch)
    # 197 tensors rounded, one read: the loss scaler's overflow test and every overflow count together
    assert ops["precsearch.round"] + ops["precsearch.round_"] > 150
    assert ops["host read"] == 1
    assert _count_one_step(_stepper(plain, x, y), monkeypatch)["host read"] == 0  # the counter's baseline


def _overflowing_conv1():
    """ResNet-18 under the paper policy with conv1's weights x1000: they overflow e4m3b4s (max 30)."""
    plain, graph, x, y = _setup()
    model = copy.deepcopy(plain)
    with torch.no_grad():
        model.conv1.weight.mul_(1000)
    return apply_policy(model, _paper_policy(graph)), x, y


def test_the_guard_still_sees_every_overflow_through_the_once_a_step_read(monkeypatch):
    # counts read once per step must still promote
    wrapped, x, y = _overflowing_conv1()
    ops = _count_one_step(_stepper(wrapped, x, y), monkeypatch)
    assert ops["host read"] == 1
    assert "conv1:weight" in [p.id for p in wrapped.promotions]


@pytest.mark.parametrize("policy_name", ["all-low", "hfp8", "fp16"])
def test_a_step_dispatches_at_most_twice_the_ops_of_the_plain_model(policy_name, monkeypatch):
    plain, graph, x, y = _setup()
    policy = _paper_policy(graph) if policy_name == "all-low" else baseline(policy_name, graph)
    wrapped = apply_policy(copy.deepcopy(plain), policy)
    low = sum(count for name, count in _count_one_step(_stepper(wrapped, x, y), monkeypatch).items()
              if name not in ("host read", "host copy"))
    fp32 = sum(count for name, count in _count_one_step(_stepper(plain, x, y), monkeypatch).items()
               if name not in ("host read", "host copy"))
    assert fp32 > 300  # the counter sees the plain model's step
    assert low <= 2 * fp32, f"{policy_name}: {low} ops against {fp32} for the plain fp32 step"


def test_evaluation_forwards_never_count_or_promote():
    plain, graph, x, y = _setup()
    wrapped = apply_policy(copy.deepcopy(plain), _paper_policy(graph))
    wrapped.eval()
    with torch.no_grad():
        wrapped(x * 100)  # overflows e4m3b4s (max 30) in most activations
    assert wrapped.promotions == [] and wrapped.tensor_stats() == {} and wrapped.step_count == 0
    wrapped.train()
    _stepper(wrapped, x * 100, y)()  # the same input in a training step does promote
    assert wrapped.promotions and wrapped.step_count == 1


def _training_state(wrapped) -> tuple:
    return (wrapped.formats(), [p.id for p in wrapped.promotions], wrapped.scaler.get_scale(),
            wrapped.scaler.steps, wrapped.step_count, wrapped.tensor_stats())


@pytest.mark.parametrize("context", ["eval, no_grad", "train, no_grad", "train, inference_mode",
                                     "eval with gradients and backward"])
def test_no_forward_outside_a_training_step_changes_the_training_state(context):
    # inputs x100 overflow e4m3b4s (max 30) in most activations, and conv1's weights overflow it
    wrapped, x, y = _overflowing_conv1()
    _stepper(wrapped, x, y)()  # one training step, so that there is a state to keep (it promotes conv1)
    before = _training_state(wrapped)
    assert before[1] and before[4] == 1
    wrapped.train(context.startswith("train"))
    if context.endswith("no_grad"):
        with torch.no_grad():
            wrapped(x * 100)
    elif context.endswith("inference_mode"):
        with torch.inference_mode():
            wrapped(x * 100)
    else:
        torch.nn.functional.cross_entropy(wrapped(x * 100), y).mul(2.0**24).backward()  # gradients overflow too
    assert _training_state(wrapped) == before


@pytest.mark.slow
@pytest.mark.parametrize("name", ["resnet18", "mobilenet_v2"])
def test_compiled_kernels_train_bit_identically_to_eager_ones(name):
    plain, graph, x, y = _setup(name)
    policy = _paper_policy(graph)

    def three_steps() -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        model = copy.deepcopy(plain)
        step = _stepper(apply_policy(model, policy), x, y)
        losses = [step() for _ in range(3)]
        return losses, [p.detach().clone() for p in model.parameters()]

    with Runtime(KernelRunner(KernelSettings(enabled=False))).as_default():
        eager_losses, eager_weights = three_steps()
    with Runtime(KernelRunner(KernelSettings(min_numel=0))).as_default() as compiled:  # every kernel call compiled
        compiled_losses, compiled_weights = three_steps()
    failed = compiled.kernels.failed
    assert compiled.kernels.ready and not failed, f"torch.compile failed for {failed}: the compiled path went untested"
    assert all(torch.equal(a, b) for a, b in zip(eager_losses, compiled_losses, strict=True))
    assert all(torch.equal(a, b) for a, b in zip(eager_weights, compiled_weights, strict=True))
    assert not all(torch.equal(a, b) for a, b in zip(eager_weights, [p.detach() for p in plain.parameters()],
                                                     strict=True))  # the steps did train


@pytest.mark.parametrize("name", ["resnet18", "mobilenet_v2"])
def test_torch_compile_of_a_wrapped_model_runs_it_eagerly_with_one_warning(name, caplog):
    plain, graph, x, y = _setup(name)
    policy = _paper_policy(graph)

    def three_steps(compiled: bool) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        model = copy.deepcopy(plain)
        wrapped = apply_policy(model, policy)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, weight_decay=5e-4)
        step = sgd_step(torch.compile(wrapped) if compiled else wrapped, optimizer, x, y)
        losses = [step() for _ in range(3)]
        return losses, [p.detach().clone() for p in model.parameters()]

    eager_losses, eager_weights = three_steps(compiled=False)
    with caplog.at_level("WARNING", logger="precsearch.runtime"):
        compiled_losses, compiled_weights = three_steps(compiled=True)
    assert [r.getMessage().split(" (")[0] for r in caplog.records if r.name.startswith("precsearch.runtime")] == [
        "torch.compile of a policy-wrapped model runs it eagerly"]
    assert all(torch.equal(a, b) for a, b in zip(eager_losses, compiled_losses, strict=True))
    assert all(torch.equal(a, b) for a, b in zip(eager_weights, compiled_weights, strict=True))


@pytest.mark.parametrize("name", ["resnet18", "mobilenet_v2"])
def test_rounding_over_the_ops_own_output_trains_as_rounding_into_a_new_tensor(name):
    """Activations of GEMMs, normalizations and sums are rounded over the op's output (no second float32
    tensor), and activation gradients that arrive as new tensors (``graph.gradient_arrives_fresh``) or as an
    add's gradient rounded alike (``graph.gradient_passes_from``) over themselves; three steps give
    bit-identical losses and weights to rounding into new tensors, and the in-place rounds really ran
    (counted). Gradients are handed on float32 (``gradient_codes=False``): an add's, handed on as its codes, is
    passed on by the roundings after it, not rounded over itself (tests/test_gradient_codes.py)."""
    plain, graph, x, y = _setup(name)
    policy = _paper_policy(graph)

    def three_steps(in_place: bool) -> tuple[list[torch.Tensor], list[torch.Tensor], Counter[str]]:
        model = copy.deepcopy(plain)
        step = _stepper(apply_policy(model, policy, round_in_place=in_place, gradient_codes=False), x, y)
        losses = [step() for _ in range(2)]
        with DispatchCounter() as counter:
            losses.append(step())
        return losses, [p.detach().clone() for p in model.parameters()], counter.ops

    fresh_losses, fresh_weights, fresh_ops = three_steps(True)
    new_losses, new_weights, new_ops = three_steps(False)
    assert all(torch.equal(a, b) for a, b in zip(fresh_losses, new_losses, strict=True))
    assert all(torch.equal(a, b) for a, b in zip(fresh_weights, new_weights, strict=True))
    gemms_and_norms = sum(op.role == "gemm" or "Norm" in op.module_type for op in graph.ops)
    fresh_gradients = gradient_arrives_fresh(graph)
    read_once = sum(op.name in fresh_gradients for op in graph.ops if op.role != "input")
    added = len(gradient_passes_from(graph))  # every gradient is e5m2s in this policy: all rounded alike
    # weight gradients are rounded in place either way; activations of GEMMs and norms, the gradients of
    # outputs read once by a GEMM, a norm or a ReLU, and those of outputs an add alone reads only in place
    assert fresh_ops["precsearch.round_"] - new_ops["precsearch.round_"] >= gemms_and_norms + read_once + added
    assert fresh_ops["precsearch.round_"] + fresh_ops["precsearch.round"] == (
        new_ops["precsearch.round_"] + new_ops["precsearch.round"])


def test_a_gradient_that_arrives_non_contiguous_is_rounded_into_a_new_tensor_with_one_warning(caplog):
    """Where the rounding may write over a gradient but it arrives non-contiguous (channels_last), it is
    rounded into a new tensor: the gradient it received is left as it was, the result is torch's own rounding
    of it, and one WARNING says so however often it happens."""
    from precsearch.formats.kernels import quantize
    from precsearch.runtime.rounding import RoundActivation

    plain, graph, _, _ = _setup()
    wrapped = apply_policy(plain, _paper_policy(graph))
    slots = wrapped.state.slots
    act = next(slot for slot in slots.values() if slot.kind == "activation" and slot.is_low
               and grad_id(slot.id) in slots and slots[grad_id(slot.id)].is_low)
    grad = slots[grad_id(act.id)]
    with caplog.at_level("WARNING", logger="precsearch.runtime"):
        for _ in range(2):
            x = torch.randn(4, 8, 6, 6, requires_grad=True)
            g = (torch.randn(4, 8, 6, 6) * 2.0**-20).to(memory_format=torch.channels_last)
            received = g.clone()
            rounded, _ = RoundActivation.apply(x * 1.0, wrapped.state, act, grad, False, False, True)
            rounded.backward(g)
            assert torch.equal(g, received)
            assert torch.equal(x.grad, quantize(received, *grad.args()[:1], rounding=grad.args()[1],
                                                overflow=grad.args()[2]))
            assert not torch.equal(x.grad, received)  # the rounding did something
    warnings = [r for r in caplog.records if "arrived non-contiguous" in r.getMessage()]
    assert len(warnings) == 1
