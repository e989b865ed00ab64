"""Training under scaled formats (precsearch.formats.scaled) in the eager runtime: every rounded tensor of a few
steps against torch's float8 cast of the tensor over a power-of-two scale computed here, overflow counts (none
under current scaling; a stale delayed scale's, counted and promoted), the delayed history in checkpoints, the
saved bytes against the cost model, and the one scaled policy the compiled step leaves to the eager runtime."""

from __future__ import annotations

import logging
import math

import pytest
import torch
import torch.nn.functional as F

from precsearch.config.policy import Policy
from precsearch.cost.model import CostModel
from precsearch.errors import PrecsearchError
from precsearch.formats.format import get_format
from precsearch.formats.scaled import get_scaled_format
from precsearch.models import build
from precsearch.runtime.model import apply_policy
from precsearch.runtime.rounding import Rounder
from precsearch.runtime.state import Slot, TensorState

SHAPE, BATCH = (3, 8, 8), 8
# torch's float8 types and their largest finite values, written out
FLOAT8 = {"e4m3fn": (torch.float8_e4m3fn, 448.0), "e5m2": (torch.float8_e5m2, 57344.0)}
TENSORWISE = {"weight": "e4m3fn@tensor", "activation": "e4m3fn@tensor", "activation_grad": "e5m2@tensor",
              "weight_grad": "e5m2@tensor"}
ELEMENT = {"weight": "e4m3fn", "activation": "e4m3fn", "activation_grad": "e5m2", "weight_grad": "e5m2"}


def oracle(x: torch.Tensor, element: str, amax: float | None = None) -> torch.Tensor:
    """x over s = 2**ceil(log2(amax / max)) (amax: x's own, or a delayed one), cast by torch, times s. e4m3fn
    has no inf and saturates: clamped to its max before the cast, as torch 2.13's cast does of itself (2.11's
    gave NaN past the max)."""
    dtype, top = FLOAT8[element]
    amax = float(x.abs().max()) if amax is None else amax
    s = 2.0 ** math.ceil(math.log2(amax / top)) if amax > 0 else 1.0
    v = x / s
    return (v.clamp(-top, top) if element == "e4m3fn" else v).to(dtype).float() * s


def _batch(step: int, gain: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    return gain * torch.randn(BATCH, *SHAPE, generator=g), torch.randint(0, 10, (BATCH,), generator=g)


def _wrap(policy: Policy, round_in_place: bool = False):
    torch.manual_seed(0)
    model = build("tiny_cnn")
    wrapped = apply_policy(model, policy, round_in_place=round_in_place)  # False: rounded and unrounded both kept
    return model, wrapped, wrapped.wrap_optimizer(torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9))


def _step(wrapped, optimizer, x, y) -> None:
    optimizer.zero_grad()
    wrapped.scaler.scale(F.cross_entropy(wrapped(x), y)).backward()
    wrapped.scaler.step(optimizer)
    wrapped.scaler.update()


def _rounders(wrapped) -> list[Rounder]:
    return [module for module in wrapped._target.modules() if isinstance(module, Rounder)]


def test_a_tensorwise_step_rounds_every_tensor_as_torchs_float8_cast_over_its_scale_and_nothing_overflows():
    policy = Policy(input_shape=SHAPE, batch_size=BATCH, high_format="bf16", defaults=dict(TENSORWISE),
                    loss_scaling={"mode": "none"}, master_weights=True)
    model, wrapped, optimizer = _wrap(policy)
    checked: list[tuple[str, torch.Tensor, torch.Tensor]] = []  # (kind, unrounded, rounded)
    grads: dict[int, dict[str, torch.Tensor]] = {}

    def rounder_hook(module, inputs, output):
        for act, grad in module.slots.values():
            raw = inputs[0]
            if act.is_low:
                checked.append(("activation", raw.detach().clone(), output.detach().clone()))
            if grad is not None and raw.requires_grad:
                box = grads.setdefault(len(grads), {})
                output.register_hook(lambda g, box=box: box.__setitem__("raw", g.clone()))
                raw.register_hook(lambda g, box=box: box.__setitem__("rounded", g.clone()))

    def weight_hook(module, args):
        for name, _ in module.named_parameters(recurse=False):
            checked.append(("weight", masters[module][name], getattr(module, name).detach().clone()))

    handles = [rounder.register_forward_hook(rounder_hook) for rounder in _rounders(wrapped)]
    layers = [layer for layer in model.modules() if list(layer.parameters(recurse=False))]
    handles += [layer.register_forward_pre_hook(weight_hook) for layer in layers]
    raw_weight_grads = {}
    handles += [p.register_hook(lambda g, p=p: raw_weight_grads.__setitem__(p, g.clone()))
                for p in model.parameters()]
    for step in range(3):
        checked.clear(), grads.clear(), raw_weight_grads.clear()
        masters = {layer: {n: p.detach().clone() for n, p in layer.named_parameters(recurse=False)}
                   for layer in layers}
        _step(wrapped, optimizer, *_batch(step))
        kinds = [kind for kind, _, _ in checked]
        assert kinds.count("weight") == len(list(model.parameters())) and kinds.count("activation") >= 7
        for kind, raw, rounded in checked:
            assert torch.equal(rounded, oracle(raw, ELEMENT[kind])), kind
        assert len(grads) >= 6
        for box in grads.values():
            assert torch.equal(box["rounded"], oracle(box["raw"], "e5m2"))
        for param, raw in raw_weight_grads.items():
            assert torch.equal(param.grad, oracle(raw, "e5m2"))
        stats = wrapped.tensor_stats()
        assert len(stats) == len(wrapped.formats()) and all(row["max_overflow"] == 0 for row in stats.values())
    for handle in handles:
        handle.remove()
    assert wrapped.promotions == [] and set(wrapped.formats().values()) == set(TENSORWISE.values())


def test_rounding_over_the_ops_own_outputs_and_gradients_trains_bit_for_bit_as_rounding_into_new_tensors():
    policy = Policy(input_shape=SHAPE, batch_size=BATCH, high_format="bf16", defaults=dict(TENSORWISE),
                    loss_scaling={"mode": "none"}, master_weights=True)
    runs = []
    for in_place in (True, False):
        model, wrapped, optimizer = _wrap(policy, round_in_place=in_place)
        for step in range(3):
            _step(wrapped, optimizer, *_batch(step))
        runs.append([p.detach().clone() for p in model.parameters()])
    assert all(torch.equal(a, b) for a, b in zip(*runs, strict=True))


def test_saved_bytes_are_the_cost_models_codes_plus_a_scale_byte():
    low = {"weight": "e4m3fn@row", "activation": "e4m3fn@block32", "activation_grad": "e5m2@tensor",
           "weight_grad": "e5m2@tensor"}
    policy = Policy(input_shape=SHAPE, batch_size=BATCH, high_format="bf16", defaults=low,
                    loss_scaling={"mode": "none"}, master_weights=True)
    _, wrapped, optimizer = _wrap(policy)
    _step(wrapped, optimizer, *_batch(0))
    predicted = CostModel(wrapped.graph).saved_activation_bytes(policy.assignment(wrapped.graph))
    saved = wrapped.saved_bytes()  # codes and scales of activations, and what the ops made themselves
    assert saved.activation + saved.other == predicted


DELAYED = Policy(input_shape=SHAPE, batch_size=BATCH, high_format="bf16", master_weights=True,
                 defaults={"activation": "e4m3fn@tensor:delayed4"}, loss_scaling={"mode": "none"},
                 promotion_threshold=0.01)


def test_a_stale_delayed_scale_saturates_counts_and_promotes_and_its_history_rides_in_checkpoints():
    _, wrapped, optimizer = _wrap(DELAYED)
    slot = wrapped.state.slots["x:activation"]
    x0, y0 = _batch(0)
    _step(wrapped, optimizer, x0, y0)  # the history starts at zeros (scale 1): randn fits e4m3fn as it is
    assert slot.overflowed == 0 and float(slot.history.amaxes[0]) == float(x0.abs().max())
    wrapped.eval()
    with torch.no_grad():
        wrapped(_batch(1, gain=1e4)[0])  # an evaluation reads the scale, records nothing
    wrapped.train()
    assert float(slot.history.amaxes.max()) == float(x0.abs().max())
    checkpoint = wrapped.state_dict()

    seen = []
    handle = next(r for r in _rounders(wrapped) if "x:activation" in [a.id for a, _ in r.slots.values()]
                  ).register_forward_hook(lambda m, inputs, output: seen.append((inputs[0].clone(), output.clone())))
    x1, y1 = _batch(1, gain=1e3)  # a thousand times larger than the history's amax
    _step(wrapped, optimizer, x1, y1)
    handle.remove()
    stale = float(x0.abs().max())
    top, threshold = 448.0, 464.0  # e4m3fn's max, and the midpoint to the next binade's first step (480)
    s = 2.0 ** math.ceil(math.log2(stale / top))
    expected = int(((x1 / s).abs() >= threshold).sum())
    assert expected > 0.01 * x1.numel()
    assert slot.overflowed == expected
    assert torch.equal(seen[0][1], oracle(x1, "e4m3fn", amax=stale))  # saturated at +-448 s
    assert "x:activation" in [p.id for p in wrapped.promotions]  # (and conv1's output, 1000x larger too)
    assert wrapped.formats()["x:activation"] == "bf16"

    _, resumed, _ = _wrap(DELAYED)
    resumed.load_state_dict(checkpoint)
    assert torch.equal(resumed.state.slots["x:activation"].history.amaxes,
                       checkpoint["_extra_state"]["tensors"]["amax_histories"]["x:activation"]["amaxes"])
    other = Policy(input_shape=SHAPE, batch_size=BATCH, high_format="bf16", master_weights=True,
                   defaults={"activation": "e4m3fn@tensor"}, loss_scaling={"mode": "none"})
    with pytest.raises(PrecsearchError, match="amax history for 'x:activation'.*under the policy"):
        _wrap(other)[1].load_state_dict(checkpoint)


@pytest.mark.parametrize(("changes", "needle"), [
    ({"rounding": {"activation": "stochastic"}}, "rounds to nearest only; set rounding.activation: nearest"),
    ({"defaults": {"weight": "e4m3fn@tensor"}, "master_weights": False}, "needs fp32 master weights"),
])
def test_what_the_runtime_does_not_do_with_scaled_formats_is_refused_at_wrapping(changes, needle):
    with pytest.raises(PrecsearchError, match=needle):
        apply_policy(build("tiny_cnn"), DELAYED.replace(**changes))


@pytest.mark.parametrize(("policy", "compiles"), [
    (DELAYED, True), (DELAYED.replace(defaults={"activation": "e4m3fn@block32"}), True),
    (DELAYED.replace(defaults={"activation_grad": "e5m2@tensor:delayed4"}, gradient_rounding="per_use"), False)])
def test_the_compiled_step_serves_block_and_delayed_scales_but_delayed_gradients_rounded_per_use(caplog, policy,
                                                                                                  compiles):
    """Each consumer's gradient would record its amax in the order autograd's engine picks: that policy trains
    eagerly, with the WARNING naming why (tests/test_compiled_step.py trains the others compiled)."""
    with caplog.at_level(logging.WARNING):
        wrapped = apply_policy(build("tiny_cnn"), policy, compile=True)
    assert (wrapped.compiled_step is not None) == compiles
    assert ("delayed scaling of activation gradients rounded per use" in caplog.text) != compiles


@pytest.mark.parametrize(("spec", "scales"), [("e4m3fn@tensor", 1), ("e5m2@row", 6), ("e4m3fn@block32", 6 * 2),
                                             ("e4m3fn@tensor:delayed2", 1)])
def test_codes_decode_to_the_rounded_values_whole_by_view_and_in_slices_of_either_dimension(spec, scales):
    """A (6, 5, 3, 3) tensor: rows of 45 values, two blocks of 32 each; one byte a code and a scale."""
    slot = Slot("t:activation", "activation", 0, get_scaled_format(spec), "nearest", None)
    state = TensorState({slot.id: slot}, get_format("bf16"), None, 0, ("activation",))
    x = torch.randn(6, 5, 3, 3, generator=torch.Generator().manual_seed(0)) * torch.arange(1, 7).reshape(6, 1, 1, 1)
    state.round(x, slot)  # a delayed history gets an amax
    rounded, codes = state.round(x, slot, with_codes=True)
    assert codes.nbytes == x.numel() + scales
    assert torch.equal(codes.whole(), rounded)
    assert torch.equal(codes.view(torch.Size((5, 6, 9)), (9, 45, 1), 0), rounded.reshape(6, 5, 9).transpose(0, 1))
    for dim, start, length in ((0, 2, 3), (1, 1, 2)):
        assert torch.equal(codes.part(dim, start, length), rounded.narrow(dim, start, length))
