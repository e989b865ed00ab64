"""Low weights rounded to nearest are rounded again from their fp32 master in the backward (precsearch.runtime.packing's
``_RoundedFromMaster``), so no copy of them, codes or float32, is held between a layer's forward and its backward.
Oracles: torch's own fp16 cast of the masters and plain autograd over the cast weights, the dispatcher's count of the
ops the backward runs, and the parameters' own sizes."""

from __future__ import annotations

import copy
from collections import Counter

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from precsearch.config.policy import Policy
from precsearch.errors import PrecsearchError
from precsearch.formats.format import get_format
from precsearch.graph.tracing import trace
from precsearch.models import build
from precsearch.runtime.model import apply_policy
from precsearch.search.strategies import baseline

SHAPE = (3, 32, 32)
WEIGHTS_FP16 = {"weight": "fp16", "activation": "fp32", "activation_grad": "fp32", "weight_grad": "fp32"}


class _Ops(TorchDispatchMode):
    """Counts the ops dispatched while it is on."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: Counter[str] = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.calls[str(func.overloadpacket)] += 1
        return func(*args, **(kwargs or {}))


def _saved_parameters(model: torch.nn.Module, x: torch.Tensor) -> list[str]:
    """Names of the parameters plain autograd saves for the backward of ``model(x)`` (biases and batch-norm
    shifts are not: their gradients need no value of them)."""
    names = {p.untyped_storage().data_ptr(): name for name, p in model.named_parameters()}
    saved: dict[str, None] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        name = names.get(t.untyped_storage().data_ptr())
        if name is not None:
            saved[name] = None
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(x)
    return list(saved)


def _setup():
    torch.manual_seed(0)
    model = build("tiny_cnn")
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(8, *SHAPE, generator=g), torch.randint(0, 10, (8,), generator=g)
    return model, x, y


def test_backward_rounds_each_master_again_and_gets_plain_autograds_gradients_over_the_cast_weights():
    model, x, y = _setup()
    reference = copy.deepcopy(model)
    with torch.no_grad():
        for param in reference.parameters():
            param.copy_(param.half().float())  # torch's own cast: the weights the wrapped forward computes with
    wrapped = apply_policy(model, Policy(input_shape=SHAPE, batch_size=8, defaults=WEIGHTS_FP16))
    loss = F.cross_entropy(wrapped(x), y)
    assert wrapped.saved_bytes().weight == 0  # autograd holds no copy of any weight, only the parameters
    with _Ops() as ops:
        loss.backward()
    F.cross_entropy(reference(x), y).backward()
    saved = _saved_parameters(reference, x)
    assert len(saved) == 5  # two convs, two batch norms, the linear layer
    assert ops.calls["precsearch.round"] == len(saved) and ops.calls["precsearch.decode"] == 0
    for (name, param), expected in zip(model.named_parameters(), reference.parameters(), strict=True):
        assert torch.equal(param.grad, expected.grad), name  # straight through: the cast weights' gradients


def test_a_parameter_changed_between_forward_and_backward_is_refused():
    model, x, y = _setup()
    wrapped = apply_policy(model, Policy(input_shape=SHAPE, batch_size=8, defaults=WEIGHTS_FP16))
    loss = F.cross_entropy(wrapped(x), y)
    with torch.no_grad():
        model.linear.weight.add_(1.0)
    with pytest.raises(PrecsearchError, match="changed in place between the forward and the backward"):
        loss.backward()


def test_weights_rounded_stochastically_keep_their_codes_to_the_backward():
    """Wang et al.'s stochastic weight update draws another rounding each call: the backward must read the one
    the forward drew, so those weights are held as codes (one byte a value in e5m2s, two in the 16-bit first
    and last layers)."""
    model, x, _ = _setup()
    graph = trace(model, x[:2], batch_size=8)
    policy = baseline("wang_fp8", graph)
    formats = {graph.tensors[tid].param: get_format(fmt) for tid, fmt in policy.assignment(graph).items()
               if graph.tensors[tid].kind == "weight"}
    params = dict(model.named_parameters())
    by_hand = sum(params[name].numel() * (1 if formats[name].bits <= 8 else 2)
                  for name in _saved_parameters(model, x) if not formats[name].is_fp32)
    wrapped = apply_policy(model, policy)
    wrapped(x)
    assert by_hand > 0 and wrapped.saved_bytes().weight == by_hand
