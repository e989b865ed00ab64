"""Sliced backwards: layers over a packed tensor whose backward decodes its codes a slice at a time.

A ``Conv2d`` or training ``BatchNorm2d`` reading a low activation, and an ``nn.ReLU`` making one, run through
autograd Functions whose backward decodes the codes a slice of samples at a time (``SlicedBackward.rows``), so the
step never holds a float32 copy of a whole saved tensor (a conv whose weight outsizes its input: a group of input
channels at a time, ``SlicedBackward.channels_per_group``). Which layers do is the site plan's
(``OpSites.reads_codes``, ``OpSites.relu_output``), from the op rules (``OpRule.sliced``), which also size the
slices; ``PACKED_INPUT`` names each layer type's Function.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Iterator, Sequence
from typing import Any, NamedTuple, Protocol

import torch
from torch import nn

from precsearch.errors import PrecsearchError
from precsearch.graph.op_rules import OpRules
from precsearch.runtime.gradient_codes import decoded, gradient_rows, new_gradient, slices_on
from precsearch.runtime.packing import Packer, Stored
from precsearch.runtime.rounding import RoundedWeightsCall, Rounding

__all__ = ["PACKED_INPUT", "ConvGeometry", "PackedInputCall", "PackedOutputRelu", "Slices", "Slicing",
           "batch_norm_backward_in_slices", "conv_backward_in_slices"]

log = logging.getLogger(__name__)


class Slices(Protocol):
    """A saved tensor's codes, decoded a slice at a time: packed by the eager runtime (precsearch.runtime.packing),
    or a compiled step's codes (precsearch.runtime.compiled)."""

    def slicer(self, dim: int = 0) -> Callable[[int, int], torch.Tensor]: ...

    def batch_slices(self, rows: int) -> Callable[[], Iterator[tuple[int, torch.Tensor]]]: ...


class Slicing:
    """What the sliced layers share: the op rules that say which layers slice their backward and how (the graph's,
    ``TensorGraph.rules``), and their WARNINGs, once per reason."""

    def __init__(self, rules: OpRules) -> None:
        self.rules = rules
        self._warned: set[str] = set()

    def rows(self, shape: Sequence[int], device: torch.device, module_type: str, weight_numel: int = 0,
             at_least: int = 1) -> int:
        """``SlicedBackward.rows`` of ``module_type``'s rule over a saved tensor of ``shape`` on CPU (``at_least``
        slices: the layer's ``OpSites.slices``); the whole batch elsewhere (slicing not measured off CPU) or where
        the rules slice no backward of that type."""
        sliced = self.rules.op_type(module_type).sliced
        if not slices_on(device) or sliced is None:
            return shape[0]
        return sliced.rows(shape, weight_numel, at_least)

    def channels(self, shape: Sequence[int], weight_shape: Sequence[int], device: torch.device,
                 at_least: int = 1) -> int:
        """``SlicedBackward.channels_per_group`` of Conv2d's rule on CPU; all channels elsewhere (not measured off
        CPU) or where the rules slice no Conv2d backward."""
        sliced = self.rules.op_type("Conv2d").sliced
        if not slices_on(device) or sliced is None:
            return shape[1]
        return sliced.channels_per_group(shape, weight_shape, at_least)

    def warn(self, name: str, why: str) -> None:
        """Once per reason: the layer ``name`` of a packed tensor runs its backward over the whole tensor."""
        if why not in self._warned:
            self._warned.add(why)
            log.warning("%s %s, so its backward decodes its whole packed tensor at once (one float32 copy of it, "
                        "and the kernel's workspace), not a slice at a time", name, why)


def _take_stored(ctx: Any) -> Stored:
    """The backward's one use of its saved tensor, taken out of ``ctx.stored`` (a list holding it) now: codes
    die with their last saver's backward, not with the autograd graph."""
    if not ctx.stored:
        raise PrecsearchError("a second backward through a layer of a packed tensor: its codes were freed by the "
                              "first (retain_graph=True is not supported under a policy)")
    return ctx.stored.pop()


def _channel_slicer(stored: Stored) -> Callable[[int, int], torch.Tensor]:
    """A saved tensor as a function of ``(start, length)`` giving that slice of its channels (dim 1), decoded when
    called where it is packed (precsearch.runtime.packing's ``slicer``)."""
    if stored.packed is not None:
        return stored.packed.slicer(1)
    whole = stored.unpack()
    return lambda start, length: whole.narrow(1, start, length)


class _ConvOfPackedInput(torch.autograd.Function):
    """A Conv2d whose input autograd would hold as codes. Its backward makes each slice of samples' input gradient,
    and the weight gradient as a sum over slices, from that slice decoded: no float32 copy of the whole input, nor
    oneDNN's reordered copies of it. With one slice (a weight larger than the input): groups of input channels
    instead (``SlicedBackward.channels_per_group``), from that group's slices of the input and of the weight
    (rounded again from the master, or decoded; a group's input gradient needs only its weight slice, its weight
    gradient only its input slice): no float32 copy of the whole weight either. The weight comes as its save
    (``weight_stored``, from ``Packer.save_packed``) where it is low."""

    slices_weight = True  # the caller passes the weight's save

    @staticmethod
    def runs(layer: nn.Module) -> bool:
        return True

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, stored: list[Stored],
                layer: nn.Conv2d, slicing: Slicing, at_least: int, weight_stored: Stored | None) -> torch.Tensor:
        ctx.stored, ctx.layer, ctx.input_shape, ctx.has_bias = stored, layer, x.shape, bias is not None
        ctx.slicing, ctx.at_least, ctx.weight_shape, ctx.weight_stored = slicing, at_least, weight.shape, weight_stored
        if weight_stored is None:  # not packed: autograd keeps it (and checks that nothing changed it)
            ctx.save_for_backward(weight)
        return layer._conv_forward(x, weight, bias)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        packed, layer = _take_stored(ctx).packed, ctx.layer
        saved_weight = ctx.weight_stored or Stored(ctx.saved_tensors[0])
        ctx.weight_stored = None  # its codes die with this backward
        need_input, need_weight, need_bias = ctx.needs_input_grad[:3]
        shape, device = ctx.input_shape, grad_out.device
        geometry = ConvGeometry(layer.stride, layer.padding, layer.dilation, layer.groups)
        grad_input, grad_weight = conv_backward_in_slices(
            grad_out, packed, saved_weight, geometry, shape, ctx.weight_shape,
            ctx.slicing.rows(shape, device, "Conv2d", math.prod(ctx.weight_shape), ctx.at_least),
            ctx.slicing.channels(shape, ctx.weight_shape, device, ctx.at_least), need_input, need_weight)
        grad_bias = grad_out.sum((0, 2, 3)) if need_bias and ctx.has_bias else None
        return grad_input, grad_weight, grad_bias, None, None, None, None, None


class ConvGeometry(NamedTuple):
    """What a convolution's backward needs of the layer besides its tensors."""

    stride: Sequence[int]
    padding: Sequence[int]
    dilation: Sequence[int]
    groups: int


def conv_backward_in_slices(grad_out: torch.Tensor, packed: Slices, saved_weight: Stored, geometry: ConvGeometry,
                            input_shape: Sequence[int], weight_shape: Sequence[int], rows: int, channels: int,
                            need_input: bool, need_weight: bool) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """A convolution's input and weight gradients from its input's codes (``packed``), ``rows`` samples or
    ``channels`` input channels at a time (``_ConvOfPackedInput``); the compiled step's backward too."""

    def conv_backward(g: torch.Tensor, x: torch.Tensor, weight: torch.Tensor,
                      mask: list[bool]) -> tuple[torch.Tensor, ...]:
        return torch.ops.aten.convolution_backward(g, x, weight, None, geometry.stride, geometry.padding,
                                                   geometry.dilation, False, [0, 0], geometry.groups, mask)

    batch = input_shape[0]
    grad_input = grad_weight = None
    if rows >= batch and channels < input_shape[1]:
        grad_out = decoded(grad_out)  # read by every group
        grad_input = grad_out.new_empty(input_shape) if need_input else None
        grad_weight = grad_out.new_empty(weight_shape) if need_weight else None
        input_slice, weight_slice = packed.slicer(1), _channel_slicer(saved_weight)

        def backward_group(start: int, length: int) -> None:
            """One group of input channels; its float32 slices die on return, before the next group's."""
            parts = conv_backward(grad_out, input_slice(start, length), weight_slice(start, length),
                                  [need_input, need_weight, False])
            for whole, part in zip((grad_input, grad_weight), parts[:2], strict=True):
                if whole is not None:
                    whole.narrow(1, start, length).copy_(part)

        for start in range(0, input_shape[1], channels):
            backward_group(start, min(channels, input_shape[1] - start))
    elif rows >= batch:
        (_, x), = packed.batch_slices(rows)()
        grad_input, grad_weight, _ = conv_backward(decoded(grad_out), x, saved_weight.unpack(),
                                                   [need_input, need_weight, False])
    else:
        weight = saved_weight.unpack()
        grad_input = new_gradient(grad_out, input_shape) if need_input else None
        for start, x in packed.batch_slices(rows)() if need_input or need_weight else ():
            g = gradient_rows(grad_out, start, rows)
            part, grad = conv_backward(g, x, weight, [need_input, need_weight, False])[:2]
            if need_input:
                grad_input[start:start + rows].copy_(part)
            if need_weight:
                grad_weight = grad if grad_weight is None else grad_weight.add_(grad)
            del x, g, part, grad  # the next slice and its gradients are made beside none of these
    return grad_input, grad_weight


class _BatchNormOfPackedInput(torch.autograd.Function):
    """A BatchNorm2d in training whose input autograd would hold as codes. One slice: torch's own backward over
    the decoded input. Several: two passes over the slices, the per-channel sums of the gradient and of the
    gradient times the centred input (each slice's float32 sum added in float64; torch's CPU kernel sums in
    float64), then the input gradient slice by slice, so no float32 copy of the whole input is made."""

    slices_weight = False

    @staticmethod
    def runs(layer: nn.Module) -> bool:
        return layer.training

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None,
                stored: list[Stored], layer: nn.BatchNorm2d, slicing: Slicing, at_least: int) -> torch.Tensor:
        layer.num_batches_tracked.add_(1)  # nn.BatchNorm2d's own training forward, for a set momentum
        out, mean, invstd = torch.native_batch_norm(x, weight, bias, layer.running_mean, layer.running_var, True,
                                                    layer.momentum, layer.eps)
        ctx.stored, ctx.input_shape, ctx.eps, ctx.slicing, ctx.at_least = stored, x.shape, layer.eps, slicing, at_least
        # the running statistics too, unused: what torch's batch norm saves, so that saved bytes stay its own
        ctx.save_for_backward(weight, mean, invstd, layer.running_mean, layer.running_var)
        return out

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        packed, (weight, mean, invstd, _, _) = _take_stored(ctx).packed, ctx.saved_tensors
        rows = ctx.slicing.rows(ctx.input_shape, grad_out.device, "BatchNorm2d", at_least=ctx.at_least)
        grads = batch_norm_backward_in_slices(grad_out, packed, weight, mean, invstd, ctx.eps, rows,
                                              ctx.needs_input_grad[:3])
        return *grads, None, None, None, None


def batch_norm_backward_in_slices(grad_out: torch.Tensor, packed: Slices, weight: torch.Tensor | None,
                                  mean: torch.Tensor, invstd: torch.Tensor, eps: float, rows: int,
                                  need: Sequence[bool]) -> tuple[torch.Tensor | None, ...]:
    """A training batch norm's input, weight and bias gradients from its input's codes (``packed``), ``rows``
    samples at a time (``_BatchNormOfPackedInput``); the compiled step's backward too."""
    batch = grad_out.shape[0]
    passes = packed.batch_slices(rows)
    if rows >= batch:
        (_, x), = passes()
        return tuple(torch.ops.aten.native_batch_norm_backward(decoded(grad_out), x, weight, None, None, mean, invstd,
                                                               True, eps, list(need)))
    channel, dims = (1, -1, 1, 1), (0, 2, 3)
    sum_dy = dot = 0  # per channel: sums of grad_out and of grad_out * (x - mean), slice sums added in float64
    for start, x in passes():
        g = gradient_rows(grad_out, start, rows)
        sum_dy = sum_dy + g.sum(dims).double()
        dot = dot + (x - mean.view(channel)).mul_(g).sum(dims).double()
        del x, g  # the next slice is decoded beside none other, and the last not kept into the second pass
    grad_input = None
    if need[0]:
        count = grad_out.numel() // grad_out.shape[1]
        k = (dot * invstd.double().square() / count).float().view(channel)
        mean_dy = (sum_dy / count).float().view(channel)
        scale = (invstd if weight is None else invstd * weight).view(channel)
        grad_input = new_gradient(grad_out)
        for start, x in passes():
            out = grad_input[start:start + rows]
            torch.sub(gradient_rows(grad_out, start, rows), (x - mean.view(channel)).mul_(k), out=out)
            out.sub_(mean_dy).mul_(scale)
    grad_weight = (dot * invstd.double()).float() if need[1] else None
    grad_bias = sum_dy.float() if need[2] else None
    return grad_input, grad_weight, grad_bias


class _ReluOfPackedOutput(torch.autograd.Function):
    """An ``nn.ReLU`` whose output is a low activation. It saves its output through the packer (held as the
    codes of its rounding, like any output an op saves), and its backward decodes those codes a slice at a
    time into torch's own ReLU backward, so no float32 copy of the whole output is made."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, stored: list[Stored], inplace: bool, slicing: Slicing,
                at_least: int) -> torch.Tensor:
        out = torch.relu_(x) if inplace else torch.relu(x)
        if inplace:
            ctx.mark_dirty(x)
        ctx.stored, ctx.input_shape, ctx.slicing, ctx.at_least = stored, out.shape, slicing, at_least  # the caller
        # saves the output
        return out

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[torch.Tensor | None, None, None, None, None]:
        stored = _take_stored(ctx)
        if stored.packed is None:  # not rounded after all (a promoted slot): the output itself
            return torch.ops.aten.threshold_backward(grad_out, stored.tensor, 0), None, None, None, None
        rows = ctx.slicing.rows(ctx.input_shape, grad_out.device, "ReLU", at_least=ctx.at_least)
        grad_input = new_gradient(grad_out)
        for start, out in stored.packed.batch_slices(rows)():
            torch.ops.aten.threshold_backward.grad_input(gradient_rows(grad_out, start, rows), out, 0,
                                                         grad_input=grad_input[start:start + rows])
        return grad_input, None, None, None, None


# the Function that computes the backward of a layer the site plan says reads its input's codes
# (``OpSites.reads_codes``, ``sites.reads_packed_input``) from them, a slice at a time, by the layer's type
PACKED_INPUT: dict[type[nn.Module], type[torch.autograd.Function]] = {
    nn.Conv2d: _ConvOfPackedInput, nn.BatchNorm2d: _BatchNormOfPackedInput}


class PackedOutputRelu(nn.Module):
    """Calls an ``nn.ReLU`` whose output is a low activation through ``_ReluOfPackedOutput`` in a training
    forward, else as the module itself (and with hooks other than forward hooks, one WARNING)."""

    def __init__(self, packer: Packer, slicing: Slicing, layer: nn.ReLU, name: str, at_least: int = 1) -> None:
        super().__init__()
        self.packer, self.slicing, self.name, self.at_least = packer, slicing, name, at_least
        self.__dict__["layer"] = layer  # the user's module, called as it is: not a child of this one

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        packer = self.packer
        if _runs_as_itself(self.layer):
            self.slicing.warn(self.name, _HOOKED)
            return self.layer(x)
        if not packer.active:
            return self.layer(x)
        stored: list[Stored] = []
        out = _ReluOfPackedOutput.apply(x, stored, self.layer.inplace, self.slicing, self.at_least)
        stored.append(packer.pack(out))  # after the call: an in-place ReLU's output has its final version now
        return _after_forward_hooks(self.layer, x, out)


class PackedInputCall(RoundedWeightsCall):
    """Calls a layer whose input is a low activation (``PACKED_INPUT``): through that Function when
    the packer holds the input as codes (a training forward), else as the layer itself; low weights rounded
    as ``RoundedWeightsCall`` rounds them. Its forward hooks run after the Function; a layer with other hooks is
    called as itself (one WARNING)."""

    def __init__(self, rounding: Rounding, slicing: Slicing, layer: nn.Module, name: str, params: dict[str, str],
                 function: type[torch.autograd.Function], at_least: int = 1) -> None:
        super().__init__(rounding, layer, params)
        self.slicing, self.name, self.function, self.at_least = slicing, name, function, at_least

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        if _runs_as_itself(self.layer):
            self.slicing.warn(self.name, _HOOKED)
            return super().forward(x)
        weights = {name: self.rounding.weight(qualified) for name, qualified in self.params.items()}
        stored = None
        packer = self.rounding.packer
        if x.dim() == 4 and self.function.runs(self.layer) and packer.active:
            stored = packer.save_packed(x)
            if stored is None:
                self.slicing.warn(self.name, "reads a tensor that is not a whole packed batch (a view of one, or "
                                  "channels_last)")
        if stored is None:
            return torch.func.functional_call(self.layer, weights, (x,))
        weight = weights.get("weight", self.layer.weight)
        weight_stored = (packer.save_packed(weight),) if self.function.slices_weight else ()
        out = self.function.apply(x, weight, weights.get("bias", self.layer.bias), [stored], self.layer,
                                  self.slicing, self.at_least, *weight_stored)
        return _after_forward_hooks(self.layer, x, out)


# why a layer with hooks runs as itself
_HOOKED = "has module hooks other than forward hooks (remove them to train in less memory)"


def _runs_as_itself(module: nn.Module) -> bool:
    """Whether ``module`` has hooks that only a call of the module runs: any but forward hooks without kwargs
    (``_after_forward_hooks`` runs those after a Function as the call would), or global hooks."""
    glob = nn.modules.module
    return any((module._forward_pre_hooks, module._backward_hooks, module._backward_pre_hooks,
                module._forward_hooks_with_kwargs, glob._global_forward_pre_hooks, glob._global_forward_hooks,
                glob._global_backward_hooks, glob._global_backward_pre_hooks))


def _after_forward_hooks(module: nn.Module, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """The module's forward hooks on ``out``, in order, each free to replace it (``nn.Module.__call__``'s
    rule): adaptive loss scaling marks its GEMM layers' outputs so."""
    for hook in module._forward_hooks.values():
        result = hook(module, (x,), out)
        if result is not None:
            out = result
    return out

