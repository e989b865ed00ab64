"""Rounding in the forward and backward: the autograd Functions, and the modules the instrumentation inserts.

* weights: the forward computes with ``round(param)`` through ``RoundWeight``, whose backward passes the gradient
  straight through, so the parameters stay fp32 masters for any optimizer (Micikevicius et al.); a layer's
  backward rounds its master again (precsearch.runtime.packing; a stochastically rounded weight keeps codes).
* activations: rounded by the module after their op (``Rounder``, through ``RoundActivation``), whose backward
  rounds the (loss-scaled) gradient and, where the site plan says so, hands it on as its codes
  (precsearch.runtime.gradient_codes). With ``gradient_rounding: per_use`` (the paper's reference) a ``GradUse``
  before each consumer rounds that consumer's gradient, and autograd sums the rounded gradients in float32.

Every inserted module is given the ``Rounding`` (state, packer, low weights) it rounds with; none refers to the
wrapper.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from precsearch.graph.raw_ops import output_leaves, with_leaves
from precsearch.runtime.gradient_codes import GradientCodes, decoded, slices_on
from precsearch.runtime.packing import Packer, version_of
from precsearch.runtime.sites import OpSites, SitePlan
from precsearch.runtime.state import Slot, TensorState

__all__ = ["Alias", "GradUse", "RoundActivation", "RoundWeight", "RoundedWeight", "RoundedWeightsCall", "Rounder",
           "Rounding", "low_weights", "rounder_for"]


class Rounding:
    """What the inserted modules round with, each given it explicitly: the tensor state, the packer that holds
    what they round, and the low weights (qualified name -> (parameter, slot))."""

    def __init__(self, state: TensorState, packer: Packer, weights: dict[str, tuple[nn.Parameter, Slot]]) -> None:
        self.state, self.packer, self.weights = state, packer, weights
        self.at_use: set[str] = set()  # weights rounded where the FX graph reads them: not before the forward

    def activation(self, t: torch.Tensor, act: Slot, grad: Slot | None, in_place: bool = False,
                   grad_in_place: bool = False, grad_codes: str | None = None) -> torch.Tensor:
        """``t`` rounded by ``act`` (its saves packed), its gradient by ``grad`` in the backward, handed on as its
        codes where ``grad_codes`` says why (``OpSites.gradient_codes``) and its format has codes."""
        grad = grad if grad is not None and grad.is_low and t.requires_grad else None
        if act.is_low:
            in_place, version = in_place and self.packer.fresh(t, act.holds_codes), version_of(t)
            grad_codes = grad_codes if self.packer.active else None
            rounded, codes = RoundActivation.apply(t, self.state, act, grad, self.packer.active, in_place,
                                                   grad_in_place, grad_codes)
            self.packer.register(t, rounded, codes, act.kind, version)
            return rounded
        if grad is not None:
            self.gradient_of(t, grad)
        return t

    def gradient_of(self, t: torch.Tensor, slot: Slot) -> None:
        """Round the gradient that reaches ``t`` in backward (counted if this forward is a training one)."""
        state, count = self.state, self.state.counting
        t.register_hook(lambda g: state.round(g, slot, count=count)[0])

    def weight(self, qualified: str) -> torch.Tensor:
        """The weight the forward computes with: the parameter rounded to its format now (one round op)."""
        param, slot = self.weights[qualified]
        if not slot.is_low:
            return param
        if not slot.rounds_alike_again:  # stochastic, or scaled: its saves hold codes
            rounded, codes = RoundWeight.apply(param, self.state, slot, self.packer.active)
            self.packer.register(param, rounded, codes, "weight", version_of(param))
        else:
            rounded, _ = RoundWeight.apply(param, self.state, slot, False)
            self.packer.register_weight(param, rounded, slot, self.state)
        return rounded

    def up_front(self) -> dict[str, torch.Tensor]:
        """The rounded weights of a forward that are not rounded at their use (their float32 copies die with the
        layer that uses them)."""
        return {name: self.weight(name) for name in self.weights if name not in self.at_use}


def low_weights(module: nn.Module, plan: SitePlan, state: TensorState) -> dict[str, tuple[nn.Parameter, Slot]]:
    """Qualified parameter name -> (parameter, slot) for the weights whose format is not fp32."""
    params = dict(module.named_parameters())
    return {site.param: (params[site.param], state.slots[site.value]) for site in plan.weights
            if site.param in params and state.slots[site.value].is_low}


def rounder_for(sites: OpSites | None, rounding: Rounding) -> Rounder | None:
    """The rounding module for an op's outputs (``sites``; None: it has none) whose value or gradient is low,
    or None."""
    found = {}
    for site in sites.outputs if sites is not None else ():
        act = rounding.state.slots[site.value]
        grad = rounding.state.slots[site.gradient] if site.gradient is not None else None
        low_grad = grad if grad is not None and grad.is_low else None
        if act.is_low or low_grad is not None:
            found[site.position] = (act, low_grad)
    if not found:
        return None
    rounder = Rounder(rounding, found, sites.op)
    rounder.grad_codes = sites.gradient_codes
    return rounder


def _round_forward(ctx: Any, x: torch.Tensor, state: TensorState, slot: Slot, with_codes: bool,
                   in_place: bool = False) -> Any:
    """The forward of the round Functions: rounded values (``x`` itself, ``in_place``), and their codes (an
    ``ops.Codes``, which autograd passes through: no gradient) or None."""
    ctx.set_materialize_grads(False)
    if in_place:
        rounded, codes = x, state.round_(x, slot, with_codes, count=state.counting)
        ctx.mark_dirty(x)
    else:
        rounded, codes = state.round(x, slot, with_codes, count=state.counting)
    return rounded, codes


class RoundActivation(torch.autograd.Function):
    """Forward: the activation rounded to its format (and its codes), over the op's own output with
    ``in_place``. Backward: its gradient rounded, over the gradient itself with ``grad_in_place`` (a new
    tensor only this rounding reads: the site plan's ``OpSites.fresh_gradient``), and handed on as its codes
    (a ``GradientCodes``) where ``grad_codes`` says why and its format has codes (``Slot.holds_codes``). A
    gradient that arrives as codes of this rounding's arguments (an add's, passed on) is handed on as it is."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, state: TensorState, act: Slot, grad: Slot | None,
                with_codes: bool, in_place: bool, grad_in_place: bool, grad_codes: str | None = None) -> Any:
        # an evaluation's backward counts nothing
        ctx.state, ctx.grad, ctx.count, ctx.grad_in_place = state, grad, state.counting, grad_in_place
        ctx.grad_codes = grad_codes
        return _round_forward(ctx, x, state, act, with_codes, in_place)

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor, _codes: Any) -> tuple[torch.Tensor | None, None, ...]:
        slot, state = ctx.grad, ctx.state
        if slot is None or g is None:
            return g, None, None, None, None, None, None, None
        if isinstance(g, GradientCodes):
            if g.args == slot.args() and slot.scaled is None:  # rounding it again changes no value: counted alone
                state.count_unchanged(g, slot, count=ctx.count)
                return g, None, None, None, None, None, None, None
            g = decoded(g)
        in_place = ctx.grad_in_place and g.is_contiguous()
        if ctx.grad_in_place and not in_place:
            state.warn_gradient_copied(slot)
        sliced = ctx.grad_codes == "slices" and slices_on(g.device)  # else its reader decodes it whole
        codes_now = slot.holds_codes and (ctx.grad_codes == "waits" or sliced)
        if in_place:
            codes = state.round_(g, slot, codes_now, count=ctx.count)
        else:
            g, codes = state.round(g, slot, codes_now, count=ctx.count)
        if codes_now:
            g = GradientCodes(codes, slot.args())
        return g, None, None, None, None, None, None, None


class RoundWeight(torch.autograd.Function):
    """Forward: the weight the layer computes with, rounded (and its codes). Backward: straight through."""

    @staticmethod
    def forward(ctx: Any, param: torch.Tensor, state: TensorState, slot: Slot, with_codes: bool) -> Any:
        return _round_forward(ctx, param, state, slot, with_codes)

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor, _codes: Any) -> tuple[torch.Tensor, None, None, None]:
        return g, None, None, None


class Rounder(nn.Module):
    """The module inserted after an op: rounds each output position that has a slot (act, grad). With
    ``in_place`` (``OpSites.fresh_output``) it may write the rounded values over the op's output (``Packer.fresh``
    says when). It rounds the gradient over itself with ``grad_in_place`` (it arrives as a new tensor,
    ``OpSites.fresh_gradient``) and where it is an add's output gradient that ``grad_source`` rounded exactly so
    (``OpSites.gradient_from``: the values do not change, so the add's other input, holding the same tensor, sees
    no difference); never where a backward hook of the reading module may keep it."""

    def __init__(self, rounding: Rounding, slots: dict[int, tuple[Slot, Slot | None]], op: str) -> None:
        super().__init__()
        self.op, self.rounding, self.slots = op, rounding, slots
        self.in_place = self.grad_in_place = False
        self.grad_codes: str | None = None  # why its gradients travel as codes (``OpSites.gradient_codes``)
        self.grad_source: Slot | None = None  # the add's output gradient this one's is (``OpSites.gradient_from``)
        self.__dict__["reader"] = None  # the module reading the output, when its gradient may be rounded over

    def forward(self, value: Any) -> Any:
        if isinstance(value, torch.Tensor):
            return self._one(0, value)
        if isinstance(value, tuple | list):  # positions as the tracer numbered them, nested tuples flattened
            return with_leaves(value, [self._one(i, v) if isinstance(v, torch.Tensor) else v
                                       for i, v in enumerate(output_leaves(value))])
        return value

    def _one(self, position: int, t: torch.Tensor) -> torch.Tensor:
        pair = self.slots.get(position)
        if pair is None or t.dtype != torch.float32:
            return t
        grad = pair[1]
        rounded_alike = grad is not None and grad.rounds_again_as(self.grad_source)
        grad_in_place = (self.grad_in_place or rounded_alike) and not keeps_input_gradients(self.reader)
        return self.rounding.activation(t, *pair, in_place=self.in_place, grad_in_place=grad_in_place,
                                        grad_codes=self.grad_codes)

    def extra_repr(self) -> str:
        return self.op


def keeps_input_gradients(module: nn.Module | None) -> bool:
    """Whether a backward hook (the module's own or a global one) sees, and may keep, the gradients of the
    module's inputs: a rounding must not write over them then."""
    return module is not None and bool(module._backward_hooks or nn.modules.module._global_backward_hooks)


class Alias(nn.Module):
    """The module inserted after a layout op: a copy it made of rounded values is packed like its source."""

    def __init__(self, rounding: Rounding, slot: Slot) -> None:
        super().__init__()
        self.rounding, self.slot = rounding, slot

    def forward(self, value: Any) -> Any:
        if isinstance(value, torch.Tensor):
            self.rounding.packer.alias(value, self.slot, self.rounding.state)
        return value


class GradUse(nn.Module):
    """Inserted before one consumer of an activation (``gradient_rounding: per_use``): the gradient this
    consumer sends back is rounded on its own, and autograd sums the consumers' rounded gradients in float32."""

    def __init__(self, rounding: Rounding, slot: Slot) -> None:
        super().__init__()
        self.rounding, self.slot = rounding, slot

    def forward(self, value: Any) -> Any:
        if not isinstance(value, torch.Tensor) or not value.requires_grad or not self.slot.is_low:
            return value
        use = value.view_as(value)  # a node of its own in the autograd graph, sharing the storage
        self.rounding.gradient_of(use, self.slot)
        return use


class RoundedWeightsCall(nn.Module):
    """Calls a layer with its low weights rounded, so that their float32 copies die with the call."""

    def __init__(self, rounding: Rounding, layer: nn.Module, params: dict[str, str]) -> None:
        super().__init__()
        self.rounding = rounding
        self.__dict__["layer"] = layer  # the user's module, called as it is: not a child of this one
        self.params = params  # the layer's parameter name -> its qualified name

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        rounded = {name: self.rounding.weight(qualified) for name, qualified in self.params.items()}
        return torch.func.functional_call(self.layer, rounded, args, kwargs)


class RoundedWeight(nn.Module):
    """Inserted after a read of a parameter (a weight passed to a function): the rounded weight."""

    def __init__(self, rounding: Rounding, qualified: str) -> None:
        super().__init__()
        self.rounding, self.qualified = rounding, qualified

    def forward(self, param: torch.Tensor) -> torch.Tensor:
        return self.rounding.weight(self.qualified)

