"""The compiled training step: rounding written into the model's FX graph, compiled once per model structure and
code widths.

The eager runtime rounds through the format kernels and packs what autograd saves as codes, bookkeeping
TorchDynamo cannot trace. Here every site of the plan (precsearch.runtime.sites) becomes a rounding whose format,
rounding and overflow mode are read from a table of rows (precsearch.formats.as_data), one per tensor id, so the
graph does not depend on the formats themselves. What each piece keeps as the eager runtime keeps it:

* a weight is rounded before the forward, its gradient in the backward; a gradient the eager runtime holds as
  codes (precsearch.runtime.gradients) leaves the backward as codes (``gradient_carrier``,
  ``_HoldGradientsEarly``);
* an activation is rounded after its op, its gradient in the backward (after a ReLU, masked by the rounded
  output: ``_ReluMaskedByItsSite``; per consumer with ``gradient_rounding: per_use``; only counted where it
  arrives rounded alike, ``OpSites.gradient_from``);
* each rounding is one opaque op (precsearch.runtime.compiled_ops): fused into the model's ops, the rounding and
  its counts made Inductor hold float32 buffers around each op (ResNet-18 width 0.25: 0.61x plain fp32's peak
  against the eager step's 0.38x);
* with ``CompileOptions.saves_codes`` (the default) rounded values leave their site as codes, which the backward
  decodes again (``_RecomputeDecodes``) or reads a slice at a time (``_ConvOfCodes``, ``_batch_norm_of_codes``);
* a scaled format (precsearch.formats.scaled) rounds as ``quantize_scaled`` does, its codes saved with e8m0
  scales; the sites' scaled formats are part of the graph, and a delayed format's amax history enters and
  leaves as tensors (``Site.history``, ``_history_input``), the eager slot keeping it between steps;
* overflow and unencodable counts leave as tensors, never by writes (``counters``), read once a step by
  ``TensorState``; an unencodable value skips the step as eagerly, but the forward goes on with the format's
  largest magnitude, so batch-norm running statistics stay finite.

``RoundingGraph`` is built and compiled (``fullgraph=True``) once per traced structure, roundings per tensor kind
(constants: nearest rounding computes no hash) and code width per row, and shared by the runtime's models of that
structure (``Runtime.graphs``): trials change only the table and the parameters (``functional_call``). A
promotion is a row update, and a new graph where it widens a code. A search's proxies save float32
(``saves_codes=False``) so one graph serves every assignment.

Not compiled: steps that gather underflow statistics (every ``stats_every``-th runs eagerly), and what
``unsupported`` names. Stochastic rounding draws from the same hash with other seeds (per site and step, elements
in memory order). With ``backend="aot_eager"`` (its partitioner ignores the recomputation marks) the step trains
bit for bit as the eager one with nearest rounding; Inductor sums some reductions (batch norm) in another order,
so values differ in the last bits, by an ulp of the format where that flips an 8-bit rounding
(tests/test_compiled_step.py states both).
"""

from __future__ import annotations

import copy
import functools
import logging
import math
import operator
import types
from collections.abc import Callable
from typing import Any, NamedTuple

import torch
import torch._dynamo
import torch._inductor.config
import torch.fx.traceback
from torch import fx, nn
from torch._inductor.compile_fx import compile_fx
from torch._inductor.custom_graph_pass import CustomGraphPass
from torch.utils.checkpoint import CheckpointPolicy

from precsearch.config.compiling import CompileOptions
from precsearch.config.policy import Policy
from precsearch.config.spec import ACTIVATION_GRAD, WEIGHT, WEIGHT_GRAD
from precsearch.formats.as_data import code_bytes, decode_codes, format_row, nearest_in_floats, patterns_of
from precsearch.formats.kernels import storage_dtype
from precsearch.formats.runner import CompiledGraphs
from precsearch.formats.scaled import ScaledFormat, e8m0_decode, e8m0_encode, expand_scales, recorded
from precsearch.graph.raw_ops import output_leaves, with_leaves
from precsearch.graph.types import TensorGraph
from precsearch.runtime.compiled_ops import (
    batch_norm_backward_of_codes,
    conv_backward_of_codes,
    count_overflows,
    round_scaled_site,
    round_site,
)
from precsearch.runtime.ops import Codes
from precsearch.runtime.sites import SitePlan
from precsearch.runtime.sliced import ConvGeometry, Slicing
from precsearch.runtime.state import Slot, TensorState

__all__ = ["CompiledStep", "RoundingGraph", "compiled_step", "gradient_carrier", "unsupported"]

log = logging.getLogger(__name__)

DECODE = {"precsearch": "decode"}  # the annotation (node.meta["custom"]) of the ops that decode a site's codes
HELD = {"precsearch": "held"}  # the annotation of the ops that round a weight gradient to the codes it is held as


class _RecomputeDecodes(CustomGraphPass):
    """Inductor's joint-graph pass that marks every decode (``DECODE``) MUST_RECOMPUTE, as selective activation
    checkpointing does: the min-cut partitioner then saves the codes and decodes them again in the backward. Its
    own heuristics would not (a decoded value feeds a convolution's backward, its chain leaves the allowlist);
    turned off for the whole graph, they recompute long forward chains (batch norm, ReLU, rounding) in the
    backward and raise its peak above plain fp32's (measured on narrow_cnn)."""

    def __call__(self, graph: fx.Graph) -> None:
        for node in graph.nodes:
            if node.meta.get("custom", {}).get("precsearch") == DECODE["precsearch"]:
                node.meta["recompute"] = CheckpointPolicy.MUST_RECOMPUTE

    def uuid(self) -> str:  # part of Inductor's cache key
        return "precsearch-recompute-decodes-1"


class _HoldGradientsEarly(CustomGraphPass):
    """Inductor's post-grad pass that moves each held weight gradient's rounding (``HELD``) to right after the op
    that makes the gradient, as the eager hook does. The partitioner orders the backward as autograd's engine
    would, where a weight's rounding (the forward's first op) runs last: each weight gradient would stay float32
    to the end."""

    def __call__(self, graph: fx.Graph) -> None:
        held = [node for node in graph.nodes if node.meta.get("custom", {}).get("precsearch") == HELD["precsearch"]]
        for node in held:  # in graph order: a node's held inputs have moved before it
            position = {other: i for i, other in enumerate(graph.nodes)}
            # after the last of its inputs (the last of the graph's inputs where it reads only those)
            latest = max(node.all_input_nodes + graph.find_nodes(op="placeholder"), key=position.__getitem__)
            latest.append(node)

    def uuid(self) -> str:
        return "precsearch-hold-gradients-early-1"


# a held weight gradient's bytes cross autograd as a 1-byte float dtype (autograd carries only float gradients)
CARRIER_DTYPE = torch.float8_e5m2

SEED_STRIDE = 0x3C6EF35F  # odd: each site and direction of a step draws with its own seed, steps apart


def _site_seed(seed: torch.Tensor, site: Site, gradient: bool) -> torch.Tensor:
    """The seed a site's value (or, ``gradient``, its gradient) draws from in this step."""
    return seed + (2 * site.index + gradient) * SEED_STRIDE


def unsupported(policy: Policy, graph: TensorGraph, state: TensorState) -> str | None:
    """Why a compiled step cannot train ``policy`` on ``graph`` (None: it can)."""
    if graph.graph_module is None:
        return f"{graph.model_name} is not FX-traceable (traced with module hooks)"
    no_mantissa = sorted({slot.fmt.name for slot in state.slots.values()
                          if slot.rounding == "nearest" and not nearest_in_floats(slot.fmt)})
    reasons = {
        "policy.accumulation (chunked accumulation layers)": policy.accumulation is not None,
        "adaptive loss scaling (per-layer hooks)": policy.loss_scaling["mode"] == "adaptive",
        f"nearest rounding to {', '.join(no_mantissa)} (no mantissa bit)": bool(no_mantissa),
        # each consumer's gradient would record its amax in an order autograd's engine picks
        "delayed scaling of activation gradients rounded per use (gradient_rounding: per_use)":
            policy.gradient_rounding == "per_use" and any(
                slot.history is not None and slot.kind == ACTIVATION_GRAD for slot in state.slots.values()),
    }
    found = [reason for reason, applies in reasons.items() if applies]
    return f"the policy needs {', '.join(found)}" if found else None


class Site(NamedTuple):
    """One rounding of the graph: its rows (``grad`` None: the gradient is not rounded), the roundings of
    both (constants of the graph), whether it follows a ReLU, and its values at the traced batch size."""

    index: int
    act: int | None  # None: the value is not rounded (a consumer's gradient alone, ``gradient_rounding: per_use``)
    grad: int | None
    rounding: tuple[str, str]
    relu_output: bool
    numel: int
    per_sample: bool  # an activation (its values grow with the batch), not a weight
    code: int | None  # bytes of the codes its rounded values pass through (None: float32, no codes)
    scaled: tuple[str | None, str | None]  # the value's and the gradient's scaled formats (None: unscaled)
    grad_arrives_rounded: bool = False  # its gradient arrives rounded alike (``OpSites.gradient_from``): counted
    grad_code: int | None = None  # a weight's: bytes of the codes its gradient leaves the backward as (None: float32)
    history: tuple[int | None, int | None] = (None, None)  # the value's and gradient's amax histories (delayed)


def _record(history: torch.Tensor | None, amax: torch.Tensor) -> torch.Tensor | None:
    """A delayed format's ``history`` with this rounding's ``amax`` recorded (None: not delayed)."""
    return None if history is None else recorded(history, amax)


class _Round(torch.autograd.Function):
    """Forward: ``x`` rounded by the site's row of ``rows`` (through its codes where the site has a code dtype),
    and [overflowed, unencodable] (float64, not differentiable). Backward: the gradient rounded by the gradient
    row, its overflow count the gradient of ``counter`` (a float64 leaf, exact to 2**53). A delayed format's
    amax history (``history``, ``gradient_history``) leaves with its amax recorded: the forward's as an output
    after the counts, the backward's as the gradient of ``gradient_history``. After a ReLU (``relu_output``) the
    rounded gradient is masked by the rounded output, as the eager ReLU backward reads its packed output: a
    positive value that rounds to 0 passes no gradient."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, rows: torch.Tensor, seed: torch.Tensor, counter: torch.Tensor | None,
                site: Site, formats: dict[str, ScaledFormat], carrier: torch.Tensor | None = None,
                history: torch.Tensor | None = None, gradient_history: torch.Tensor | None = None) -> Any:
        ctx.site, ctx.formats = site, formats
        row, scaled = rows[site.act], site.scaled[0]
        kept = ()  # the history with this amax recorded
        if scaled is None:  # one opaque pass: the rounded values, or their codes
            values, counted = round_site(x, row, _site_seed(seed, site, False), site.rounding[0], site.code)
            scales = None
        else:
            values, scales, counted, amax = round_scaled_site(x, row, scaled, site.code, history)
            kept = () if history is None else (recorded(history, amax),)
        rounded, codes = values, ()
        if site.code is not None:  # the partitioner saves these codes (and scales) for the backward, which decodes
            scales = None if scales is None else e8m0_encode(scales)  # as the eager runtime holds them
            with torch.fx.traceback.annotate(DECODE):
                rounded = decode_codes(values, row, site.code)
                if scales is not None:
                    rounded = rounded * expand_scales(e8m0_decode(scales), formats[scaled], x.shape)
            codes = (values,) if scales is None else (values, scales)
        elif scales is not None:
            rounded = values * expand_scales(scales, formats[scaled], x.shape)
        ctx.save_for_backward(rows, seed, gradient_history, *([rounded] if site.relu_output else []))
        # [overflowed, unencodable], float64 of 2 elements (Dynamo specializes no value of a 0-d tensor)
        counts = counted.to(torch.float64)
        ctx.mark_non_differentiable(counts, *kept, *codes)
        return rounded, counts, *kept, *codes

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor, *_not_differentiable: Any) -> Any:
        rows, seed, history, *output = ctx.saved_tensors
        site, overflowed, kept = ctx.site, None, None
        if site.grad_code is not None:  # a weight's gradient, left as its bytes: the gradient of its carrier
            with torch.fx.traceback.annotate(HELD):
                held, counted, kept = _held_bytes(g, rows[site.grad], _site_seed(seed, site, True), site,
                                                  ctx.formats.get(site.scaled[1]), history)
                counts = counted.to(torch.float64).reshape(2)  # an inf or NaN its codes miss: unencodable
            return None, None, None, counts, None, None, held.view(CARRIER_DTYPE), None, kept
        if site.grad is not None:
            grad_seed = _site_seed(seed, site, True)
            if site.grad_arrives_rounded:  # rounding again changes no value (and would hold a second copy)
                overflowed = count_overflows(g, rows[site.grad], grad_seed, site.rounding[1], site.scaled[1])
            else:
                g, overflowed, kept = _rounded(g, rows[site.grad], grad_seed, site.rounding[1],
                                               ctx.formats.get(site.scaled[1]), history)
            overflowed = _backward_counts(overflowed)
        if output:
            g = torch.ops.aten.threshold_backward(g, output[0], 0)
        return g, None, None, overflowed, None, None, None, None, kept


def _backward_counts(overflowed: torch.Tensor) -> torch.Tensor:
    """A gradient site's counts as its counter's gradient: [overflowed, unencodable] (float64; a gradient left
    float32 has no value its format cannot hold)."""
    return torch.cat([overflowed.to(torch.float64).reshape(1), overflowed.new_zeros(1, dtype=torch.float64)])


class _ReluMaskedByItsSite(torch.autograd.Function):
    """A ReLU whose rounding site masks its gradient (``Site.relu_output``): that mask lies inside the ReLU's own
    (a value that rounds positive was positive), so passing the gradient on as it is gives bit for bit what
    masking again gives, and autograd saves no mask of the activation's size for it."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(x)

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> torch.Tensor:
        return g


def _relu_masked_by_its_site(x: torch.Tensor) -> torch.Tensor:
    return _ReluMaskedByItsSite.apply(x)


def _rounded(x: torch.Tensor, row: torch.Tensor, seed: torch.Tensor, rounding: str, scaled: ScaledFormat | None,
             history: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """``x`` rounded by ``row`` (a scaled format's element, ``scaled``; a delayed one's scale from ``history``)
    and its overflow count, in one opaque op, and ``history`` with its amax recorded (``_record``)."""
    if scaled is None:
        values, counted = round_site(x, row, seed, rounding, None)
        return values, counted[0], None
    values, scales, counted, amax = round_scaled_site(x, row, scaled.name, None, history)
    return values * expand_scales(scales, scaled, x.shape), counted[0], _record(history, amax)


class _RoundGradient(torch.autograd.Function):
    """Forward: ``x`` as it is. Backward: the gradient rounded by the site's gradient row, its overflow count the
    gradient of ``counter`` (one consumer's gradient, with ``gradient_rounding: per_use``)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, rows: torch.Tensor, seed: torch.Tensor, counter: torch.Tensor,
                site: Site, formats: dict[str, ScaledFormat]) -> torch.Tensor:
        ctx.site, ctx.formats = site, formats
        ctx.save_for_backward(rows, seed)
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> Any:
        rows, seed = ctx.saved_tensors
        site = ctx.site
        g, overflowed, _ = _rounded(g, rows[site.grad], _site_seed(seed, site, True), site.rounding[1],
                                    ctx.formats.get(site.scaled[1]))  # never delayed (``unsupported``)
        return g, None, None, _backward_counts(overflowed), None, None


def _round_gradient(value: torch.Tensor, rows: torch.Tensor, seed: torch.Tensor, counters: list[torch.Tensor],
                    site: Site, counter: int, formats: _HeldByGraph) -> torch.Tensor:
    return _RoundGradient.apply(value, rows, seed, counters[counter], site, formats.value)


def _histories_of(site: Site, histories: list[torch.Tensor]) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """The amax histories a site's value and gradient are scaled by (None: not delayed)."""
    return tuple(None if index is None else histories[index] for index in site.history)  # type: ignore[return-value]


def _round_site(value: torch.Tensor, rows: torch.Tensor, seed: torch.Tensor, counters: list[torch.Tensor],
                site: Site, counter: int | None, formats: dict[str, ScaledFormat], histories: list[torch.Tensor],
                carrier: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, list[torch.Tensor],
                                                              list[torch.Tensor]]:
    """``_Round`` of one site: the rounded value, its counts, its value's history with this amax recorded (none
    where not delayed), and its codes (and scales)."""
    rounded, counted, *rest = _Round.apply(value, rows, seed, None if counter is None else counters[counter], site,
                                           formats, carrier, *_histories_of(site, histories))
    kept = rest[:1] if site.history[0] is not None else []
    return rounded, counted, kept, rest[len(kept):]


def _round(value: Any, rows: torch.Tensor, seed: torch.Tensor, counters: list[torch.Tensor],
           sites: tuple[tuple[int, Site, int | None], ...], formats: _HeldByGraph,
           histories: list[torch.Tensor]) -> tuple[Any, list[torch.Tensor], list[torch.Tensor], list[torch.Tensor]]:
    """``value`` (a tensor, or a tuple of them) with each (position, site, counter index) of ``sites`` rounded,
    the forward's counts, the codes (and scales) of the sites that have them, and the amax histories recorded."""
    counts, codes, kept = [], [], []
    items = output_leaves(value)  # positions as the tracer numbered them, nested tuples flattened
    for position, site, counter in sites:
        items[position], counted, site_kept, code = _round_site(items[position], rows, seed, counters, site, counter,
                                                                formats.value, histories)
        counts.append(counted)
        kept += site_kept
        codes += code
    return with_leaves(value, items), counts, codes, kept


class _ConvOfCodes(torch.autograd.Function):
    """A convolution of a site's rounded values that saves their codes for a backward decoding them a slice at a
    time (``conv_backward_of_codes``), and its weight's fp32 master (held anyway), which the backward rounds again
    by the weight's site (same row, seed and element order: the same values), as ``packing._RoundedFromMaster``
    does: no copy of the weight is held from the layer's forward to its backward."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, codes: torch.Tensor,
                scales: torch.Tensor | None, rows: torch.Tensor, site: Site, geometry: ConvGeometry, slice_rows: int,
                channels: int, master: torch.Tensor, seed: torch.Tensor, weight_site: Site,
                weight_scaled: ScaledFormat | None, weight_history: torch.Tensor | None) -> torch.Tensor:
        ctx.site, ctx.geometry, ctx.slice_rows, ctx.channels = site, geometry, slice_rows, channels
        ctx.weight_site, ctx.weight_scaled, ctx.has_bias = weight_site, weight_scaled, bias is not None
        ctx.save_for_backward(codes, rows, master, seed, scales, weight_history)
        return torch.ops.aten.convolution(x, weight, bias, geometry.stride, geometry.padding, geometry.dilation,
                                          False, [0, 0], geometry.groups)

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> Any:
        codes, rows, master, seed, scales, weight_history = ctx.saved_tensors
        need_input, need_weight, need_bias = ctx.needs_input_grad[:3]
        geometry, weight_site = ctx.geometry, ctx.weight_site
        # the forward's history, before its amax was recorded: the forward's scale
        weight = _rounded(master, rows[weight_site.act], _site_seed(seed, weight_site, False),
                          weight_site.rounding[0], ctx.weight_scaled, weight_history)[0]
        grad_input, grad_weight = conv_backward_of_codes(
            grad_out, codes, scales, ctx.site.scaled[0], rows[ctx.site.act], weight, list(geometry.stride),
            list(geometry.padding), list(geometry.dilation), geometry.groups, ctx.site.code, ctx.slice_rows,
            ctx.channels, need_input, need_weight)
        grad_bias = grad_out.sum((0, 2, 3)) if need_bias and ctx.has_bias else None
        return grad_input if need_input else None, grad_weight if need_weight else None, grad_bias, *[None] * 12


class _BatchNormGradOfCodes(torch.autograd.Function):
    """The gradients of a training batch norm computed outside autograd (``_batch_norm_of_codes``: its running
    statistics update there, in the traced graph), from its input's codes: forward, the output as it is;
    backward, ``batch_norm_backward_of_codes``."""

    @staticmethod
    def forward(ctx: Any, out: torch.Tensor, x: torch.Tensor, weight: torch.Tensor | None,
                bias: torch.Tensor | None, codes: torch.Tensor, scales: torch.Tensor | None, scaled: str | None,
                row: torch.Tensor, mean: torch.Tensor, invstd: torch.Tensor, eps: float, nbytes: int,
                rows: int) -> torch.Tensor:
        ctx.eps, ctx.nbytes, ctx.rows, ctx.scaled = eps, nbytes, rows, scaled
        ctx.save_for_backward(codes, row, mean, invstd, weight, scales)
        return out.view_as(out)

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> Any:
        codes, row, mean, invstd, weight, scales = ctx.saved_tensors
        need = list(ctx.needs_input_grad[1:4])
        grads = batch_norm_backward_of_codes(
            grad_out, codes, scales, ctx.scaled, row, weight, mean, invstd, ctx.eps, ctx.nbytes, ctx.rows, need)
        return None, *(grad if wanted else None for grad, wanted in zip(grads, need, strict=True)), *[None] * 9


def _conv_of_codes(layer: nn.Conv2d, x: torch.Tensor, codes: tuple[torch.Tensor, ...], rows: torch.Tensor, site: Site,
                   of_graph: _HeldByGraph, master: torch.Tensor, seed: torch.Tensor, weight_name: str,
                   held: _HeldByGraph, histories: list[torch.Tensor]) -> torch.Tensor:
    """``layer`` on a site's rounded values ``x``, its backward reading their ``codes`` (and scales) and rounding
    its weight again from ``master``, by the site of the parameter ``weight_name`` (``held``: the graph's weight
    sites and scaled formats; ``histories``: the delayed formats' amax histories as the step started)."""
    slicing = of_graph.value
    weight = layer.weight
    weight_sites, formats = held.value
    weight_site = weight_sites[weight_name][0]
    geometry = ConvGeometry(layer.stride, layer.padding, layer.dilation, layer.groups)
    return _ConvOfCodes.apply(x, weight, layer.bias, codes[0], _scales_of(codes), rows, site, geometry,
                              slicing.rows(x.shape, x.device, "Conv2d", weight.numel()),
                              slicing.channels(x.shape, weight.shape, x.device), master, seed, weight_site,
                              formats.get(weight_site.scaled[0]), _histories_of(weight_site, histories)[0])


def _batch_norm_of_codes(layer: nn.BatchNorm2d, x: torch.Tensor, codes: tuple[torch.Tensor, ...], rows: torch.Tensor,
                         site: Site, of_graph: _HeldByGraph) -> torch.Tensor:
    """``layer`` on a site's rounded values ``x``: in training, its forward as the eager runtime's
    (``nn.BatchNorm2d``'s with a set momentum), its backward reading their ``codes``."""
    slicing = of_graph.value
    if not layer.training:
        return layer(x)
    layer.num_batches_tracked.add_(1)
    weight, bias = layer.weight, layer.bias
    out, mean, invstd = torch.native_batch_norm(
        x.detach(), None if weight is None else weight.detach(), None if bias is None else bias.detach(),
        layer.running_mean, layer.running_var, True, layer.momentum, layer.eps)
    return _BatchNormGradOfCodes.apply(out, x, weight, bias, codes[0], _scales_of(codes), site.scaled[0],
                                       rows[site.act], mean, invstd, layer.eps, site.code,
                                       slicing.rows(x.shape, x.device, "BatchNorm2d"))


def _scales_of(codes: tuple[torch.Tensor, ...]) -> torch.Tensor | None:
    """A scaled site's codes come with their scales (``_Round``)."""
    return codes[1] if len(codes) > 1 else None


def _name(fmt: ScaledFormat | None) -> str | None:
    return None if fmt is None else fmt.name


class _HeldByGraph(nn.Module):
    """A value the graph's calls read (``get_attr``), held as a submodule: the graph's code cannot spell it as a
    constant (the ``Slicing``, the sites' scaled formats by name)."""

    def __init__(self, value: Any) -> None:
        super().__init__()
        self.value = value


_OF_CODES = {nn.Conv2d: _conv_of_codes, nn.BatchNorm2d: _batch_norm_of_codes}


def _read_codes_in_backward(gm: fx.GraphModule, plan: SitePlan, coded: dict[fx.Node, tuple[fx.Node, Site]],
                            rows: fx.Node, seed: fx.Node, masters: fx.Node, histories: fx.Node, slicing: Slicing,
                            weights: _HeldByGraph) -> None:
    """Each layer of ``gm`` whose backward the plan says reads its input's codes (``OpSites.reads_codes``), where
    that input has codes (``coded``), called through ``_OF_CODES``, so that its backward decodes the codes a slice
    at a time, as the eager runtime's does; a convolution's also rounds its weight again from its master
    (``masters``, by the weight's site: ``weights``)."""
    gm.add_submodule("precsearch_slicing", _HeldByGraph(slicing))
    gm.add_submodule("precsearch_weights", weights)
    for node in list(gm.graph.nodes):
        sites = plan.of_node(node.name) if node.op == "call_module" else None
        if sites is None or not sites.reads_codes or node.args[0] not in coded:
            continue
        layer = gm.get_submodule(node.target)
        pair, site = coded[node.args[0]]
        with gm.graph.inserting_before(node):
            codes = gm.graph.call_function(operator.getitem, (pair, 2))
            module, slicing_node = gm.graph.get_attr(node.target), gm.graph.get_attr("precsearch_slicing")
            args = (module, node.args[0], codes, rows, site, slicing_node)
            if isinstance(layer, nn.Conv2d):
                name = f"{node.target}.weight"
                master = gm.graph.call_function(operator.getitem, (masters, name))
                args += (master, seed, name, gm.graph.get_attr("precsearch_weights"), histories)
            replacement = gm.graph.call_function(_OF_CODES[type(layer)], args)
        node.replace_all_uses_with(replacement)
        gm.graph.erase_node(node)


class _StepInputs(NamedTuple):
    """The nodes a rounded graph reads its step's state from, after the model's own inputs."""

    rows: fx.Node  # the formats table, one row per assignable tensor
    seed: fx.Node
    counters: fx.Node  # one float64 leaf per site whose gradient is rounded
    masters: fx.Node  # the fp32 parameters, by name
    histories: fx.Node  # the delayed rows' amax histories
    formats: fx.Node  # the scaled formats, by name: the graph's code cannot spell a ScaledFormat


def _add_step_inputs(gm: fx.GraphModule, formats: dict[str, ScaledFormat]) -> _StepInputs:
    """``gm``'s placeholders for the step's state, after the model's own, and a read of the scaled ``formats``."""
    fx_graph = gm.graph
    gm.add_submodule("precsearch_scaled", _HeldByGraph(formats))
    node = [node for node in fx_graph.nodes if node.op == "placeholder"][-1]
    placeholders = []
    for name in ("rows", "seed", "counters", "masters", "histories"):
        with fx_graph.inserting_after(node):
            node = fx_graph.placeholder(f"precsearch_{name}")
        placeholders.append(node)
    with fx_graph.inserting_after(node):
        formats_node = fx_graph.get_attr("precsearch_scaled")
    return _StepInputs(*placeholders, formats_node)


class _SiteNumbering:
    """The graph's sites in the order they are made, and the counters of those whose gradient is rounded: a
    site's index and counter are its place in these lists (the seeds follow site order)."""

    def __init__(self, graph: TensorGraph, rows: dict[str, int], roundings: dict[str, str],
                 codes: tuple[int | None, ...], scaled: tuple[ScaledFormat | None, ...],
                 delayed: dict[int, int]) -> None:
        self.graph, self.rows, self.roundings, self.codes, self.scaled = graph, rows, roundings, codes, scaled
        self.delayed = delayed  # a delayed row -> its amax history
        self.sites: list[Site] = []
        self.counters = 0

    def add(self, value: str, gradient: str | None, relu_output: bool, act: bool = True,
            grad_arrives_rounded: bool = False) -> tuple[Site, int | None]:
        """The site rounding ``value`` (unless not ``act``) and ``gradient`` (unless None), and its counter."""
        info, rows, codes, scaled, delayed = self.graph.tensors[value], self.rows, self.codes, self.scaled, self.delayed
        site = Site(len(self.sites), rows[value] if act else None, rows.get(gradient),
                    (self.roundings[info.kind],
                     self.roundings[self.graph.tensors[gradient].kind] if gradient else "nearest"),
                    relu_output, info.numel, info.kind != WEIGHT, codes[rows[value]] if act else None,
                    (_name(scaled[rows[value]]) if act else None,
                     _name(scaled[rows[gradient]]) if gradient else None), grad_arrives_rounded,
                    codes[rows[gradient]] if gradient else None,
                    (delayed.get(rows[value]) if act else None, delayed.get(rows[gradient]) if gradient else None))
        self.sites.append(site)
        counter = None
        if site.grad is not None:
            counter, self.counters = self.counters, self.counters + 1
        return site, counter


def _round_at_sites(fx_graph: fx.Graph, plan: SitePlan, numbering: _SiteNumbering, inputs: _StepInputs,
                    arrive_rounded: frozenset[str]
                    ) -> tuple[list[fx.Node], list[fx.Node], dict[fx.Node, tuple[fx.Node, Site]]]:
    """Every op of ``plan`` followed by its rounding (``_round``), and, where its gradient is rounded per use, each
    consumer preceded by a rounding of its gradient (``_round_gradient``); returns the nodes of the forward's
    counts and of the recorded amaxes kept, and the values with codes (-> their rounding and site)."""
    nodes = {node.name: node for node in fx_graph.nodes}
    state = (inputs.rows, inputs.seed, inputs.counters)
    forward_counts, kept = [], []
    coded: dict[fx.Node, tuple[fx.Node, Site]] = {}
    for op_sites in plan.ops:
        node = nodes[op_sites.node]
        users = list(node.users)
        if op_sites.relu_output:  # the site masks the gradient by the rounded output, inside the ReLU's mask
            node.op, node.target, node.kwargs = "call_function", _relu_masked_by_its_site, {}
        sites = tuple((out.position, *numbering.add(out.value, None if op_sites.per_use else out.gradient,
                                                    op_sites.relu_output,
                                                    grad_arrives_rounded=op_sites.op in arrive_rounded))
                      for out in op_sites.outputs)
        with fx_graph.inserting_after(inputs.formats if node.op == "placeholder" else node):
            pair = fx_graph.call_function(_round, (node, *state, sites, inputs.formats, inputs.histories))
        with fx_graph.inserting_after(pair):
            rounded = fx_graph.call_function(operator.getitem, (pair, 0))
        with fx_graph.inserting_after(rounded):
            forward_counts.append(fx_graph.call_function(operator.getitem, (pair, 1)))
            kept.append(fx_graph.call_function(operator.getitem, (pair, 3)))
        node.replace_all_uses_with(rounded, delete_user_cb=lambda user, pair=pair: user is not pair)
        whole = sites[0][1] if len(sites) == 1 and sites[0][0] == 0 and sites[0][1].code is not None else None
        if whole is not None:
            coded[rounded] = pair, whole
        for user in users if op_sites.per_use else ():  # each consumer's gradient rounded before it
            site, counter = numbering.add(op_sites.outputs[0].value, op_sites.outputs[0].gradient, False, act=False)
            with fx_graph.inserting_before(user):
                use = fx_graph.call_function(_round_gradient, (rounded, *state, site, counter, inputs.formats))
            user.replace_input_with(rounded, use)
            if whole is not None:
                coded[use] = pair, whole
    return forward_counts, kept, coded


class RoundingGraph:
    """The model's FX graph with a rounding site at every assignable tensor, and its compiled step: ``run`` gives
    the output and the forward's counts per site; ``rows`` has one row per assignable tensor id (the state's rows,
    ``graph.assignable_ids()`` order); ``counts`` turns those and the ``counters()``' gradients into (overflowed,
    elements, roundings, unencodable) per row."""

    def __init__(self, graph: TensorGraph, plan: SitePlan, roundings: dict[str, str], codes: tuple[int | None, ...],
                 scaled: tuple[ScaledFormat | None, ...], backend: str = "inductor",
                 arrive_rounded: frozenset[str] = frozenset()) -> None:
        rows = {tensor_id: row for row, tensor_id in enumerate(graph.assignable_ids())}
        self.n_rows, self.backend, self.batch_size = len(rows), backend, graph.batch_size
        source = graph.graph_module
        # over a copy of the traced modules: every model of this structure passes its own tensors (functional_call)
        gm = fx.GraphModule(copy.deepcopy(source), copy.deepcopy(source.graph), f"{graph.model_name}Rounded")
        formats = {fmt.name: fmt for fmt in scaled if fmt is not None}
        inputs = _add_step_inputs(gm, formats)
        self._delayed = [row for row, fmt in enumerate(scaled) if fmt is not None and fmt.history]
        delayed = {row: index for index, row in enumerate(self._delayed)}
        numbering = _SiteNumbering(graph, rows, roundings, codes, scaled, delayed)
        forward_counts, kept, coded = _round_at_sites(gm.graph, plan, numbering, inputs, arrive_rounded)
        weight_sites: dict[str, tuple[Site, int | None]] = {}  # made last, as before: the seeds follow site order
        _read_codes_in_backward(gm, plan, coded, inputs.rows, inputs.seed, inputs.masters, inputs.histories,
                                Slicing(graph.rules), _HeldByGraph((weight_sites, formats)))
        output = next(node for node in gm.graph.nodes if node.op == "output")
        output.args = ((output.args[0], tuple(forward_counts), tuple(kept)),)
        gm.graph.lint()
        gm.recompile()
        weight_sites.update({site.param: numbering.add(site.value, site.gradient, False) for site in plan.weights})
        self.graph_module, self.weight_sites = gm, weight_sites
        self.sites, self._counters = numbering.sites, numbering.counters
        self._set_up_step(graph)

    def _set_up_step(self, graph: TensorGraph) -> None:
        """What a step reads off the sites, and the step's own compiled function."""
        # the rows whose recorded histories the step returns, in order (a value's; a gradient's leave as gradients)
        self._kept = [self._delayed[site.history[0]] for site in self.sites if site.history[0] is not None]
        self._gradient_histories = {site.history[1] for site in self.sites} - {None}
        self.passes = sum((site.act is not None) + (site.grad is not None) for site in self.sites)  # roundings a step
        self._forward_rows = [site.act for site in self.sites if site.act is not None]
        self._backward_rows = [site.grad for site in self.sites if site.grad is not None]
        self._elements: dict[tuple[int, torch.device], torch.Tensor] = {}
        self.compiles = 0  # graphs Dynamo handed to the backend: 1 per structure, input shape and mode
        # a code object of its own: Dynamo keeps its compiled graphs per code object (at most 8, then it fails
        # under fullgraph), and a process may build a graph per structure and code widths
        own_step = types.FunctionType(_step.__code__.replace(co_name=f"_step_{id(self):x}"), _step.__globals__)
        # a submodule FX could not trace (data-dependent control flow) breaks Dynamo's graph too: the rest compiles
        self._compiled = torch.compile(own_step, fullgraph=not graph.opaque_modules, dynamic=False,
                                       backend=self._counted)

    def _counted(self, graph_module: fx.GraphModule, example_inputs: list[torch.Tensor]) -> Callable[..., Any]:
        self.compiles += 1
        backend = torch._dynamo.lookup_backend(self.backend)
        if all(site.code is None and site.grad_code is None for site in self.sites):
            return backend(graph_module, example_inputs)
        with torch._inductor.config.patch(joint_custom_pre_pass=_RecomputeDecodes()):  # read as it partitions
            if self.backend == "inductor":
                # buffer reuse off: Inductor holds a dead buffer until a later one of its size takes it (6 float32
                # activation gradients alive in ResNet-18's backward, 1.11x the eager peak); the backward is lowered
                # outside this block, so the patch travels with the compile. Layout optimization off: it saved each
                # weight's master (``_ConvOfCodes``) as a channels-last float32 copy
                return compile_fx(graph_module, example_inputs,
                                  config_patches={"allow_buffer_reuse": False, "layout_optimization": False,
                                                  "post_grad_custom_post_pass": _HoldGradientsEarly()})
            return backend(graph_module, example_inputs)

    def counters(self, device: torch.device) -> list[torch.Tensor]:
        """Fresh float64 leaves, one per site whose gradient is rounded: their gradients count its values that
        overflowed and (a weight gradient held as codes) that its codes miss."""
        return [torch.zeros(2, dtype=torch.float64, device=device, requires_grad=True) for _ in range(self._counters)]

    def run(self, model: nn.Module, x: torch.Tensor, rows: torch.Tensor, seed: torch.Tensor,
            counters: list[torch.Tensor], slots: dict[int, Slot], training: bool) -> tuple[Any, torch.Tensor]:
        """``model`` (of the traced structure) on ``x``, rounded as ``rows`` say: its output and the forward's
        overflow counts, one per site. ``slots``: the state's, by row (the formats of held weight gradients, the
        delayed formats' amax histories, which a ``training`` step's roundings record into)."""
        self.graph_module.train(model.training)
        params = dict(model.named_parameters())
        buffers = dict(model.named_buffers())
        carriers = {name: gradient_carrier(params[name], site.grad_code, slots[site.grad])
                    for name, (site, _counter) in self.weight_sites.items() if site.grad_code is not None}
        histories = [_history_input(slots[row], index in self._gradient_histories, training, x.device)
                     for index, row in enumerate(self._delayed)]
        output, counts, kept = self._compiled(self.graph_module, self.weight_sites, params, buffers, x, rows, seed,
                                              counters, carriers, histories)
        for row, amaxes in zip(self._kept, kept, strict=True) if training else ():
            slots[row].history.amaxes = amaxes
        return output, counts

    def counts(self, forward: torch.Tensor, counters: list[torch.Tensor], batch: int) -> torch.Tensor:
        """(overflowed, elements, roundings, unencodable) per row, int64, from a step's forward counts (two per
        site) and its counters' gradients (none before the backward ran) at batch size ``batch``."""
        device = forward.device
        forward_rows, backward_rows = self._row_indices(device)
        counted = torch.zeros(self.n_rows, 2, dtype=torch.float64, device=device)  # overflowed, unencodable
        counted.index_add_(0, forward_rows, forward.view(-1, 2))
        grads = [counter.grad for counter in counters]
        backward = bool(grads) and all(grad is not None for grad in grads)
        if backward:
            counted.index_add_(0, backward_rows, torch.stack(grads))
        counted = counted.to(torch.int64)
        return torch.cat([counted[:, :1], self._elements_at(batch, device, backward), counted[:, 1:]], dim=1)

    @functools.cache  # noqa: B019 (one per process and structure: the cache lives as long as the graph anyway)
    def _row_indices(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """The rows of the forward counts and of the counters, as index tensors on ``device``, made once."""
        return (torch.tensor(self._forward_rows, device=device), torch.tensor(self._backward_rows, device=device))

    def _elements_at(self, batch: int, device: torch.device, backward: bool) -> torch.Tensor:
        """(elements, roundings) per row of a step at batch size ``batch`` (its backward's too, ``backward``), from
        the traced shapes: no device read."""
        key = (batch, device, backward)
        if key not in self._elements:
            elements = [[0, 0] for _ in range(self.n_rows)]
            for site in self.sites:
                numel = site.numel * batch // self.batch_size if site.per_sample else site.numel
                for row in (site.act, site.grad if backward else None):
                    if row is not None:
                        elements[row][0] += numel
                        elements[row][1] += 1
            self._elements[key] = torch.tensor(elements, dtype=torch.int64, device=device)
        return self._elements[key]


def _held_bytes(g: torch.Tensor, row: torch.Tensor, seed: torch.Tensor, site: Site, scaled: ScaledFormat | None,
                history: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """A weight gradient rounded by ``row`` as the bytes its carrier receives (``gradient_carrier``), its
    counts, and a delayed format's ``history`` with its amax recorded: its codes as the eager runtime holds them
    (uint8, or int16 for 2 bytes), in the weight's element order, then a scaled format's scales as e8m0 bytes."""
    kept = None
    if scaled is None:
        codes, counted = round_site(g, row, seed, site.rounding[1], site.grad_code)
        scales = None
    else:
        codes, scales, counted, amax = round_scaled_site(g, row, scaled.name, site.grad_code, history)
        kept = _record(history, amax)
    if site.grad_code == 2:  # int16, not byte planes
        codes = patterns_of(codes, 2).to(torch.int16)
    held = codes.reshape(-1).view(torch.uint8)
    if scales is not None:
        held = torch.cat([held, e8m0_encode(scales).reshape(-1)])
    return held, counted, kept


def _history_input(slot: Slot, gradient: bool, training: bool, device: torch.device) -> torch.Tensor:
    """A delayed row's amax history as the compiled step reads it: a value's as it is (the step returns it with
    the amax recorded); a ``gradient``'s as a leaf whose gradient in the backward is that, which its hook keeps
    in the slot, in a ``training`` step (an evaluation's backward records nothing, as eagerly)."""
    amaxes = slot.history.amaxes.to(device)
    if not gradient:
        return amaxes
    leaf = amaxes.detach().requires_grad_()

    def keep(leaf: torch.Tensor) -> None:
        slot.history.amaxes, leaf.grad = leaf.grad, None

    if training:
        leaf.register_post_accumulate_grad_hook(keep)
    return leaf


def gradient_carrier(param: torch.Tensor, nbytes: int, slot: Slot) -> torch.Tensor:
    """A leaf of no storage (stride 0) whose gradient in the compiled backward is the bytes of ``param``'s rounded
    gradient (``_held_bytes``), which its hook decodes into ``param.grad`` (the same values): the backward holds
    each weight gradient as codes, as the eager runtime does, not float32. A later backward accumulates into
    ``param.grad`` as autograd would."""
    scaled, fmt = slot.scaled, slot.fmt
    n_codes = param.numel() * nbytes
    n_scales = 0 if scaled is None else math.prod(scaled.scales_shape(param.shape))
    carrier = torch.empty((), dtype=CARRIER_DTYPE, device=param.device).expand(n_codes + n_scales)
    carrier.requires_grad_()

    def decode_into_param(carrier: torch.Tensor) -> None:
        held = carrier.grad.view(torch.uint8)
        carrier.grad = None
        codes = held[:n_codes].view(storage_dtype(fmt)).view(param.shape)
        scales = None if scaled is None else held[n_codes:].view(scaled.scales_shape(param.shape))
        value = Codes(codes, fmt.name, scaled, scales).whole()
        param.grad = value if param.grad is None else param.grad.add_(value)

    carrier.register_post_accumulate_grad_hook(decode_into_param)
    return carrier


def _step(gm: fx.GraphModule, weight_sites: dict[str, tuple[Site, int | None]], params: dict[str, torch.Tensor],
          buffers: dict[str, torch.Tensor], x: torch.Tensor, rows: torch.Tensor, seed: torch.Tensor,
          counters: list[torch.Tensor], carriers: dict[str, torch.Tensor],
          histories: list[torch.Tensor]) -> tuple[Any, torch.Tensor, list[torch.Tensor]]:
    """The compiled function: weights rounded (a held gradient's to its carrier), then the rounded graph on them
    (``functional_call``); the output, the forward's counts and the amax histories recorded (``_kept``)."""
    tensors: dict[str, torch.Tensor] = {**buffers, **params}
    weight_counts, weight_kept = [], []
    for name, (site, counter) in weight_sites.items():  # in the order of the sites' rows
        tensors[name], counted, kept, _codes = _round_site(params[name], rows, seed, counters, site, counter,
                                                           gm.precsearch_scaled.value, histories, carriers.get(name))
        weight_counts.append(counted)
        weight_kept += kept
    output, counts, kept = torch.func.functional_call(gm, tensors, (x, rows, seed, counters, params, histories))
    counted = torch.cat([count for group in (*counts, weight_counts) for count in group])
    return output, counted, [*(amaxes for group in kept for amaxes in group), *weight_kept]


class CompiledStep:
    """One wrapped model's use of the shared ``RoundingGraph``s: its graph (found again when promotions or
    ``may_hold`` may change a code width), its table of rows, a seed per step, and the counts handed to its state
    (a training forward's only, as the eager path counts)."""

    def __init__(self, find_graph: Callable[[bool], RoundingGraph], state: TensorState,
                 may_hold: Callable[[], bool]) -> None:
        self.find_graph, self.state, self.may_hold = find_graph, state, may_hold
        self._slots = {slot.row: slot for slot in state.slots.values()}  # promotions change them in place
        self._found_for: tuple[int, bool] | None = None  # (promotions, holds) the graph was found for
        self._rows: torch.Tensor | None = None  # the table of rows for them
        self.graph = self._current_graph()

    def _current_graph(self) -> RoundingGraph:
        now = (len(self.state.promotions), self.may_hold())
        if now != self._found_for:
            graph = self.find_graph(now[1])
            if self._found_for is not None and graph is not self.graph and not graph.compiles:
                log.info("the step's code widths changed (a promotion, or weight gradients held or not): "
                         "it compiles a graph for them")
            self.graph, self._found_for, self._rows = graph, now, None
        return self.graph

    def __call__(self, module: nn.Module, x: torch.Tensor, training: bool) -> Any:
        state = self.state
        graph = self._current_graph()
        if self._rows is None or self._rows.device != x.device:
            self._rows = rows_table(state, x.device)
        seed = state.seed_tensor(x.device)
        counters = graph.counters(x.device)
        output, forward = graph.run(module, x, self._rows, seed.reshape(1).clone(), counters, self._slots, training)
        seed.add_(SEED_STRIDE * 2 * len(graph.sites))
        if training:
            batch = x.shape[0]
            state.count_compiled(lambda: graph.counts(forward.detach(), counters, batch))
        return output


def compiled_step(policy: Policy, graph: TensorGraph, plan: SitePlan, state: TensorState,
                  options: CompileOptions, built: CompiledGraphs, may_hold: Callable[[], bool]) -> CompiledStep | None:
    """The compiled step of ``graph`` under ``policy``, or None (with one WARNING per model and reason in
    ``built``, a runtime's graphs, saying why) where it cannot train it; ``may_hold``: whether weight gradients may
    be held as codes during the backward (precsearch.runtime.gradients)."""
    reason = unsupported(policy, graph, state)
    if reason is not None:
        if (graph.model_name, reason) not in built.warned:  # once: a search wraps many policies
            built.warned.add((graph.model_name, reason))
            log.warning("training %s eagerly, not compiled: %s (pass compile=False, or --no-compile, to say so)",
                        graph.model_name, reason)
        return None
    return CompiledStep(lambda holds: rounding_graph(graph, plan, state, options, built, holds), state, may_hold)


def _code_width(slot: Slot, options: CompileOptions, holds: bool) -> int | None:
    """The bytes of the codes a row's values pass through in the compiled graph (None: float32): a weight's or
    an activation's, saved for the backward; a weight gradient's, held to the end of the backward (``holds``,
    ``Slot.holds_codes``: as the eager runtime holds it); an activation gradient is never held."""
    if not options.saves_codes or slot.kind == ACTIVATION_GRAD:
        return None
    if slot.kind == WEIGHT_GRAD and not (holds and slot.holds_codes):
        return None
    return code_bytes(slot.fmt)


def rounding_graph(graph: TensorGraph, plan: SitePlan, state: TensorState, options: CompileOptions,
                   built: CompiledGraphs, holds: bool) -> RoundingGraph:
    """The ``RoundingGraph`` for ``graph``'s structure and sites, ``state``'s roundings per kind, each row's code
    width now and the outputs whose gradients arrive rounded alike now: built once in ``built`` for the runs that
    share it (its step compiled on first use)."""
    roundings: dict[str, str] = {}
    for slot in state.slots.values():
        roundings.setdefault(slot.kind, slot.rounding)
    slots = sorted(state.slots.values(), key=lambda slot: slot.row)
    codes = tuple(_code_width(slot, options, holds) for slot in slots)
    scaled = tuple(slot.scaled for slot in slots)
    # rounding such a gradient again or only counting it gives the same values and counts, so a graph that saves
    # float32 (a search's proxies, one graph for every assignment) rounds it; a promotion may part the formats
    arrive_rounded = frozenset(
        sites.op for sites in plan.ops if options.saves_codes and sites.gradient_from is not None
        and state.slots[sites.outputs[0].gradient].rounds_again_as(
            state.slots[plan.of_op(sites.gradient_from).outputs[0].gradient]))
    # the plan's decisions and the op rules (their slices; a table is its own key, held alive by the graph built
    # from it) shape the graph as much as the tensors do
    key = (graph.fingerprint(), graph.model_name, graph.rules, plan.ops, plan.weights,
           tuple(sorted(roundings.items())), codes, scaled, options.backend, arrive_rounded)
    if key not in built.graphs:
        built.graphs[key] = RoundingGraph(graph, plan, roundings, codes, scaled, options.backend, arrive_rounded)
    return built.graphs[key]


def rows_table(state: TensorState, device: torch.device) -> torch.Tensor:
    """The rows of ``state``'s slots now (int32, one per row; a scaled format's element), for
    ``RoundingGraph.run``."""
    ordered = sorted(state.slots.values(), key=lambda slot: slot.row)
    return torch.stack([format_row(slot.fmt, slot.rounding, slot.args()[2]) for slot in ordered]).to(device)

