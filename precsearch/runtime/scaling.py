"""Loss scaling for low-precision gradients: static, dynamic (GradScaler semantics) and adaptive per layer.

All scalers share torch.amp.GradScaler's surface (``scale``, ``unscale_``, ``step``, ``update``, ``get_scale``,
``state_dict`` / ``load_state_dict``, counters ``steps`` and ``skipped_steps``), so a loop can hold any of them.

A step overflowed when a (still scaled) gradient holds inf/NaN or, with ``overflow_format``, a magnitude >= that
format's max: a saturating format (no inf code, like ``e5m2s``) turns every overflow into +-max, which the scaler
would otherwise never see. ``overflow_check`` (a callable per gradient) replaces the format test, and the runtime
flags an overflow seen elsewhere (an activation gradient) with ``record_overflow()``.

The gradients' test runs on the device (one foreach inf-norm) and is read once per optimizer step together with
the ``watch``-ed checks' pending values (the runtime's overflow counts), in one transfer; an ``overflow_check``
returns Python bools, so it costs a synchronisation per gradient.

Defaults and ranges come from precsearch.config.loss_scaling (``OPTIONS``, ``check_option``), so a policy file
and a Python call are held to the same ranges in the same words.
"""

from __future__ import annotations

import functools
import logging
import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any, Protocol

import torch
from torch import nn

from precsearch.config.loss_scaling import EPOCH, OPTIONS, check_option, loss_scaling
from precsearch.errors import PrecsearchError
from precsearch.formats.format import FloatFormat, get_format
from precsearch.graph.op_rules import OP_RULES

__all__ = ["LossScaler", "NoLossScaler", "StaticLossScaler", "DynamicLossScaler", "AdaptiveLossScaler", "LayerScale",
           "SCALERS", "epoch_growth", "make_scaler"]

log = logging.getLogger(__name__)

OverflowCheck = Callable[[torch.Tensor], bool]
LayerSelector = Iterable[str] | Callable[[str, nn.Module], bool]


class StepCheck(Protocol):
    """Device-side statistics read together with the gradients' overflow test, once per step."""

    def pending(self) -> torch.Tensor | None:
        """A 1-D int64 tensor of values to read now, or None when there is nothing to read."""

    def settle(self, values: list[int]) -> tuple[bool, bool]:
        """Take the values read; return (the step overflowed, the step must be skipped whatever the scaler)."""


@dataclass(frozen=True)
class _Schedule:
    """GradScaler's update rule: x backoff on overflow, x growth after ``interval`` clean steps in a row."""

    growth_factor: float
    backoff_factor: float
    interval: int

    def __post_init__(self) -> None:
        for name in ("growth_factor", "backoff_factor"):
            object.__setattr__(self, name, check_option(name, getattr(self, name), name))
        interval = check_option("growth_interval", self.interval, "growth_interval")
        if interval == EPOCH:
            raise PrecsearchError("growth_interval 'epoch' needs the steps per epoch: resolve it with epoch_growth")
        object.__setattr__(self, "interval", interval)

    def next(self, value: float, overflowed: bool, tracker: int) -> tuple[float, int]:
        if overflowed:
            return value * self.backoff_factor, 0
        tracker += 1
        if tracker == self.interval:
            return value * self.growth_factor, 0
        return value, tracker


class LossScaler:
    """A fixed loss scale that skips the optimizer step when a gradient overflowed (base of all scalers)."""

    _kind = "static"

    def __init__(self, init_scale: float, *, overflow_format: str | FloatFormat | None = None,
                 overflow_check: OverflowCheck | None = None, skip_on_overflow: bool = True) -> None:
        if overflow_format is not None and overflow_check is not None:
            raise PrecsearchError("give either overflow_format or overflow_check to a loss scaler, not both")
        self._scale = check_option("init_scale", init_scale, "init_scale")
        self._overflow_max = None
        if overflow_format is not None:
            fmt = get_format(overflow_format)
            self._overflow_max = None if fmt.is_fp32 else fmt.max
        self._overflow_check = overflow_check
        self.skip_on_overflow = skip_on_overflow
        self.steps = 0
        self.skipped_steps = 0
        self._growth_tracker = 0
        self._found: dict[int, bool] = {}
        self._recorded_overflow = False
        self._skip_requested = False
        self._checks: list[StepCheck] = []
        self.on_skip: list[Callable[[], None]] = []  # called when a step is skipped (batch norm's statistics)

    # -- the GradScaler surface ------------------------------------------------------------------------

    def scale(self, loss: torch.Tensor) -> torch.Tensor:
        """The loss times the current scale (the loss itself at scale 1, so fp32 runs stay bitwise equal)."""
        return loss if self._scale == 1.0 else loss * self._scale

    def get_scale(self) -> float:
        return self._scale

    def record_overflow(self) -> None:
        """Flag an overflow seen outside the optimizer's gradients: this iteration's steps are skipped."""
        self._recorded_overflow = True

    def watch(self, check: StepCheck) -> None:
        """Read ``check``'s pending values with the gradients' test in each ``unscale_`` (one transfer)."""
        self._checks.append(check)

    def unscale_(self, optimizer: torch.optim.Optimizer) -> None:
        """Test the optimizer's scaled gradients for overflow, then divide them by their scale in place."""
        key = id(optimizer)
        if key in self._found:
            raise PrecsearchError("unscale_() was already called on this optimizer since the last update()")
        grads = [p for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
        self._found[key] = self._read(self._overflow_flag([p.grad for p in grads]))
        by_divisor: dict[float, list[torch.Tensor]] = {}
        for p in grads:
            divisor = self._divisor(p)
            if divisor != 1.0:
                by_divisor.setdefault(divisor, []).append(p.grad)
        for divisor, group in by_divisor.items():
            torch._foreach_div_(group, divisor)

    def step(self, optimizer: torch.optim.Optimizer, *args: Any, **kwargs: Any) -> Any:
        """``optimizer.step()`` unless this iteration overflowed (then the step is skipped and counted)."""
        if id(optimizer) not in self._found:
            self.unscale_(optimizer)
        overflowed = self._found[id(optimizer)] or self._recorded_overflow
        if self._skip_requested or (self.skip_on_overflow and overflowed):
            self.skipped_steps += 1
            log.debug("overflow at scale %g: optimizer step skipped", self._scale)
            for callback in self.on_skip:
                callback()
            return None
        return optimizer.step(*args, **kwargs)

    def _read(self, flag: torch.Tensor | None) -> bool:
        """The one host read of a step: the gradients' overflow flag and every watched check's values."""
        pending = [(check, values) for check in self._checks if (values := check.pending()) is not None]
        parts = [] if flag is None else [flag.reshape(1).to(torch.int64)]
        parts += [values.to(parts[0].device) if parts else values for _, values in pending]
        if not parts:
            return False
        read = torch.cat(parts).tolist()
        found, offset = (bool(read[0]), 1) if flag is not None else (False, 0)
        for check, values in pending:
            overflowed, skip = check.settle(read[offset:offset + values.numel()])
            offset += values.numel()
            found = found or overflowed
            self._skip_requested = self._skip_requested or skip
        return found

    def update(self) -> None:
        """End the iteration: adjust the scale (in subclasses that adapt it) and reset the overflow record."""
        if not self._found and not self._recorded_overflow:
            raise PrecsearchError("update() needs scaler.step(optimizer) (or unscale_) first in each iteration")
        overflowed = self._recorded_overflow or any(self._found.values())
        self._adjust(overflowed)
        self.steps += 1
        self._found.clear()
        self._recorded_overflow = False
        self._skip_requested = False

    def state_dict(self) -> dict[str, Any]:
        return {"kind": self._kind, "scale": self._scale, "growth_tracker": self._growth_tracker,
                "steps": self.steps, "skipped_steps": self.skipped_steps}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        missing = sorted(set(self.state_dict()) - set(state))
        if missing:
            raise PrecsearchError(f"loss scaler state lacks {', '.join(missing)}: pass a state_dict() of the same kind")
        if state["kind"] != self._kind:
            raise PrecsearchError(f"loss scaler state is for a {state['kind']} scaler, not {self._kind}")
        self._scale = check_option("init_scale", state["scale"], "loss scaler state's scale")
        self._growth_tracker = int(state["growth_tracker"])
        self.steps = int(state["steps"])
        self.skipped_steps = int(state["skipped_steps"])

    # -- hooks for subclasses -----------------------------------------------------------------------------

    def _divisor(self, param: torch.Tensor) -> float:
        return self._scale

    def _adjust(self, overflowed: bool) -> None:
        """Static scale: nothing to adjust."""

    def _overflow_flag(self, grads: list[torch.Tensor]) -> torch.Tensor | None:
        """A device bool: some gradient holds inf/NaN or (with ``overflow_format``) reaches that format's max."""
        if not grads:
            return None
        if self._overflow_check is not None:
            return torch.tensor(any(bool(self._overflow_check(g)) for g in grads))
        largest = torch.stack(torch._foreach_norm(grads, math.inf))  # NaN and inf propagate
        flag = ~torch.isfinite(largest).all()
        if self._overflow_max is not None:
            flag = flag | (largest >= self._overflow_max).any()
        return flag


class StaticLossScaler(LossScaler):
    """A fixed loss scale (Micikevicius et al. 2018 used e.g. 8 or 128 per model); steps skipped on overflow."""

    def __init__(self, init_scale: float, *, overflow_format: str | FloatFormat | None = None,
                 overflow_check: OverflowCheck | None = None) -> None:
        super().__init__(init_scale, overflow_format=overflow_format, overflow_check=overflow_check)


class NoLossScaler(LossScaler):
    """Scale 1 and never skip: training exactly as without a scaler (the all-fp32 policy's scaler)."""

    _kind = "none"

    def __init__(self) -> None:
        super().__init__(1.0, skip_on_overflow=False)

    def _overflow_flag(self, grads: list[torch.Tensor]) -> torch.Tensor | None:
        return None


class DynamicLossScaler(LossScaler):
    """torch.amp.GradScaler's dynamic scale: x ``backoff_factor`` and a skipped step on overflow, x
    ``growth_factor`` after ``growth_interval`` clean steps in a row; overflow also per ``overflow_format``."""

    _kind = "dynamic"

    def __init__(self, init_scale: float = OPTIONS["dynamic"]["init_scale"],
                 growth_factor: float = OPTIONS["dynamic"]["growth_factor"],
                 backoff_factor: float = OPTIONS["dynamic"]["backoff_factor"],
                 growth_interval: int = OPTIONS["dynamic"]["growth_interval"], *,
                 overflow_format: str | FloatFormat | None = None, overflow_check: OverflowCheck | None = None) -> None:
        super().__init__(init_scale, overflow_format=overflow_format, overflow_check=overflow_check)
        self._schedule = _Schedule(growth_factor, backoff_factor, growth_interval)

    def _adjust(self, overflowed: bool) -> None:
        self._scale, self._growth_tracker = self._schedule.next(self._scale, overflowed, self._growth_tracker)


@dataclass
class LayerScale:
    """What the adaptive scaler chose at one scaled point in the last backward pass."""

    name: str
    alpha: float  # this point's own factor (a power of two)
    scale: float  # cumulative scale of the gradient leaving the point: loss scale x every alpha on its path


@dataclass
class _Point:
    name: str
    weight: torch.Tensor | None  # a GEMM layer's weight: bound the products g * w
    fan: int
    guard_grad: bool  # the model output: bound the gradient g itself


def _gaussian_quantile(rate: float) -> float:
    """``t`` with ``P(|X| < t) = rate`` for a standard Gaussian X: ``sqrt(2) * erfinv(rate)``."""
    return math.sqrt(2.0) * torch.special.erfinv(torch.tensor(rate, dtype=torch.float64)).item()


@functools.lru_cache(maxsize=16)
def _product_quantile(rate: float) -> float:
    """``t`` with ``P(|XY| < t) = rate`` for independent standard Gaussians X, Y.

    The product has density ``K0(|z|) / pi``; its CDF is integrated on a log grid (where the log singularity
    of ``K0`` at 0 becomes a decaying integrand) and inverted by linear interpolation in ``log t``."""
    x = torch.linspace(-60.0, 5.0, 65001, dtype=torch.float64)
    s = x.exp()
    density = torch.special.modified_bessel_k0(s) * s * (2.0 / math.pi)
    cdf = torch.cat([torch.zeros(1, dtype=torch.float64), torch.cumulative_trapezoid(density, x)])
    i = int(torch.searchsorted(cdf, torch.tensor([rate], dtype=torch.float64)).item())
    frac = (rate - cdf[i - 1].item()) / (cdf[i].item() - cdf[i - 1].item())
    return math.exp(x[i - 1].item() + frac * (x[i].item() - x[i - 1].item()))


def _reduction_fan(module: nn.Module) -> int:
    """Terms summed per element of the layer's input gradient: out features (Linear), out x kernel (conv)."""
    weight = module.weight
    return int(weight.shape[0] * math.prod(weight.shape[2:]))


class AdaptiveLossScaler(LossScaler):
    """Adaptive layer-wise loss scaling (Zhao et al. 2019), computed during backward with autograd hooks.

    ``attach(model)`` marks scaled points: every GEMM layer (Linear, Conv) and the model output. When the backward
    reaches a point, the gradient ``g`` arriving there (carrying its path's cumulative scale ``s``) is multiplied
    by a factor ``alpha`` computed from statistics:

    * the products ``p = g * w`` of the layer's input-gradient GEMM: ``g`` and ``w`` are modelled as independent
      zero-mean Gaussians of standard deviations ``rms(g)`` and ``rms(w)``, so ``p / (rms(g) * rms(w))`` has the
      product-normal density ``K0(|z|) / pi``. (The authors' code treats ``p`` as Gaussian with ``sigma_p =
      rms(g) * rms(w)``, which misses the product's log-singular mass near zero and lets several times the
      target rate underflow, as tests/test_scaling.py measures.)
    * underflow bound: the smallest ``alpha`` with ``P(|alpha * p| < u) <= underflow_rate`` where ``u`` is
      the gradient format's min subnormal: ``alpha_u = u / (t * rms(g) * rms(w))`` with ``t`` the
      ``underflow_rate`` quantile of ``|z|``, never below 1. At the model output the gradient itself is
      guarded too, as a Gaussian: ``alpha_u >= u / (sqrt(2) * erfinv(underflow_rate) * rms(g))`` (our
      addition: at loss scale 1 nothing else keeps the first gradient from underflowing). Since values
      round to zero only below ``u / 2``, the power-of-two floor below still meets the rate;
    * overflow bound: ``alpha_o = max / (fan * max|g| * max|w|)`` with ``fan`` the number of products summed
      per input-gradient element (out features, or out channels x kernel area), so even a sum of
      same-signed maximal products stays finite (``max / max|g|`` for a guarded gradient);
    * ``alpha = 2 ** floor(log2(min(alpha_u, alpha_o, max_scale / s))))``: a power of two (exact to apply and
      to divide out), and the cumulative scale is capped by ``max_scale``.

    The gradient then carries ``s * alpha`` into the layer's backward (its weight gradient and the input gradient
    it passes on). Scales travel with gradients through every autograd node; where branches meet (a residual add,
    a tensor used twice), the later contribution is rescaled by a power of two to the first's scale, so sums never
    mix scales. ``unscale_`` divides each parameter's gradient by its own cumulative scale. An overflow still
    skips the step; ``max_scale`` then follows GradScaler's rule (backoff on overflow, growth after
    ``growth_interval`` clean steps, never above its initial value).

    Call ``optimizer.zero_grad()`` between iterations: a leftover gradient carries an unknown scale. Per-layer
    formats: ``attach(model, grad_formats={"layer1.conv": "e5m2"})``.
    """

    _kind = "adaptive"

    def __init__(self, grad_format: str | FloatFormat = OPTIONS["adaptive"]["grad_format"],
                 underflow_rate: float = OPTIONS["adaptive"]["underflow_rate"],
                 init_scale: float = OPTIONS["adaptive"]["init_scale"],
                 max_scale: float = OPTIONS["adaptive"]["max_scale"],
                 growth_factor: float = OPTIONS["adaptive"]["growth_factor"],
                 backoff_factor: float = OPTIONS["adaptive"]["backoff_factor"],
                 growth_interval: int = OPTIONS["adaptive"]["growth_interval"], *,
                 overflow_format: str | FloatFormat | None = None, overflow_check: OverflowCheck | None = None) -> None:
        super().__init__(init_scale, overflow_format=overflow_format, overflow_check=overflow_check)
        self.grad_format = get_format(grad_format)
        self.underflow_rate = check_option("underflow_rate", underflow_rate, "underflow_rate")
        self._t_grad = _gaussian_quantile(self.underflow_rate)
        self._t_product = _product_quantile(self.underflow_rate)
        self._max_scale_limit = check_option("max_scale", max_scale, "max_scale")
        self._max_scale = self._max_scale_limit
        self._schedule = _Schedule(growth_factor, backoff_factor, growth_interval)
        self._formats: dict[str, FloatFormat] = {}
        self._pending: dict[Any, _Point] = {}  # autograd node -> point, from forwards since the last scale()
        self._calls: dict[str, int] = {}  # calls per layer since the last scale(): later calls are "name#k"
        self._node_scale: dict[Any, float] = {}
        self._param_scale: dict[torch.Tensor, float] = {}
        self._last: dict[str, LayerScale] = {}

    # -- registration ---------------------------------------------------------------------------------

    def attach(self, model: nn.Module, layers: LayerSelector | None = None,
               grad_formats: dict[str, str | FloatFormat] | None = None,
               include_output: bool = True) -> list[torch.utils.hooks.RemovableHandle]:
        """Mark scaled points in ``model``: its GEMM layers (or those named / accepted by ``layers``) and, with
        ``include_output``, the model output. Returns the forward-hook handles (``.remove()`` detaches)."""
        modules = dict(model.named_modules())
        if layers is None:
            chosen = [name for name, module in modules.items() if OP_RULES.module(module).gemm]
        elif callable(layers):
            chosen = [name for name, module in modules.items() if layers(name, module)]
        else:
            chosen = list(layers)
            unknown = [name for name in chosen if name not in modules or not OP_RULES.module(modules[name]).gemm]
            if unknown:
                raise PrecsearchError(f"adaptive loss scaling: {', '.join(unknown)} not GEMM layers of the model; "
                                      "name Linear/Conv layers")
        for name, spec in (grad_formats or {}).items():
            self._formats[name] = get_format(spec)
        handles = [modules[name].register_forward_hook(self._forward_hook(name)) for name in chosen]
        if include_output and "" not in chosen:
            handles.append(model.register_forward_hook(self._forward_hook("")))
        return handles

    def _forward_hook(self, name: str) -> Callable[..., None]:
        def hook(module: nn.Module, inputs: Any, output: Any) -> None:
            if not (isinstance(output, torch.Tensor) and output.grad_fn is not None):
                return
            point = self._pending.get(output.grad_fn)
            if point is not None and not name:  # the model output is a GEMM layer's output: guard both
                point.guard_grad = True
            elif OP_RULES.module(module).gemm:
                calls = self._calls[name] = self._calls.get(name, -1) + 1
                label = (name or "<output>") + (f"#{calls}" if calls else "")
                self._pending[output.grad_fn] = _Point(label, module.weight, _reduction_fan(module), not name)
            else:
                self._pending[output.grad_fn] = _Point("<output>", None, 1, True)

        return hook

    # -- the backward pass ------------------------------------------------------------------------------

    def scale(self, loss: torch.Tensor) -> torch.Tensor:
        scaled = super().scale(loss)
        points, self._pending = self._pending, {}
        self._calls, self._node_scale = {}, {}
        if scaled.grad_fn is not None:
            self._node_scale[scaled.grad_fn] = self._scale
            self._install(scaled.grad_fn, points)
        return scaled

    def _install(self, root: Any, points: dict[Any, _Point]) -> None:
        seen, stack = {root}, [root]
        while stack:
            node = stack.pop()
            if node in points:
                node.register_prehook(self._prehook(node, points[node]))
            if node.next_functions:
                node.register_hook(self._posthook(node))
            for child, _ in node.next_functions:
                if child is not None and child not in seen:
                    seen.add(child)
                    stack.append(child)

    def _prehook(self, node: Any, point: _Point) -> Callable[..., Any]:
        def hook(grad_outputs: tuple[torch.Tensor | None, ...]) -> Any:
            incoming = self._node_scale.get(node, self._scale)
            alpha = self._alpha(grad_outputs[0], point, incoming)
            self._node_scale[node] = incoming * alpha
            self._last[point.name] = LayerScale(point.name, alpha, incoming * alpha)
            if alpha == 1.0:
                return None
            return tuple(None if g is None else g * alpha for g in grad_outputs)

        return hook

    def _posthook(self, node: Any) -> Callable[..., Any]:
        def hook(grad_inputs: tuple[torch.Tensor | None, ...], grad_outputs: Any) -> Any:
            mine = self._node_scale.get(node, self._scale)
            out = list(grad_inputs)
            changed = False
            for i, (child, _) in enumerate(node.next_functions):
                if child is None or out[i] is None:
                    continue
                variable = getattr(child, "variable", None)  # AccumulateGrad: the parameter itself
                table, key = (self._param_scale, variable) if variable is not None else (self._node_scale, child)
                target = table.setdefault(key, mine)
                if target != mine:
                    out[i] = out[i] * (target / mine)
                    changed = True
            return tuple(out) if changed else None

        return hook

    def _alpha(self, grad: torch.Tensor | None, point: _Point, incoming: float) -> float:
        if grad is None:
            return 1.0
        g = grad.detach().float()
        g_max = g.abs().max().item() if g.numel() else 0.0
        if not math.isfinite(g_max) or g_max == 0.0:
            return 1.0  # overflow is the step's business; an all-zero gradient needs no scale
        g_rms = g.square().mean().sqrt().item()
        lows, highs = [], []  # per guarded quantity: its rate-quantile magnitude, and the largest sum it feeds
        if point.guard_grad:
            lows.append(self._t_grad * g_rms)
            highs.append(g_max)
        if point.weight is not None:
            w = point.weight.detach().float()
            lows.append(self._t_product * g_rms * w.square().mean().sqrt().item())
            highs.append(point.fan * g_max * w.abs().max().item())
        if min(lows) == 0.0 or min(highs) == 0.0:
            return 1.0
        fmt = self._formats.get(point.name, self.grad_format)
        alpha_u = max(fmt.min_subnormal / min(lows), 1.0)
        alpha_o = fmt.max / max(highs)
        alpha = min(alpha_u, alpha_o, self._max_scale / incoming)
        return 2.0 ** math.floor(math.log2(alpha))

    # -- unscaling and state -------------------------------------------------------------------------------

    def _divisor(self, param: torch.Tensor) -> float:
        return self._param_scale.get(param, self._scale)

    def _adjust(self, overflowed: bool) -> None:
        cap, self._growth_tracker = self._schedule.next(self._max_scale, overflowed, self._growth_tracker)
        self._max_scale = min(cap, self._max_scale_limit)
        self._param_scale.clear()
        self._node_scale.clear()

    def layer_scales(self) -> dict[str, LayerScale]:
        """Per scaled point (the model output is ``<output>``): its factor and cumulative scale, last backward."""
        return dict(self._last)

    def get_max_scale(self) -> float:
        return self._max_scale

    def state_dict(self) -> dict[str, Any]:
        return {**super().state_dict(), "max_scale": self._max_scale}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        self._max_scale = check_option("max_scale", state["max_scale"], "loss scaler state's max_scale")


# The scaler of each mode of precsearch.config.loss_scaling (the modes are named there, and by each ``_kind``): a
# read-only table, fixed by the classes above.
SCALERS: MappingProxyType[str, type[LossScaler]] = MappingProxyType({
    scaler._kind: scaler for scaler in (NoLossScaler, StaticLossScaler, DynamicLossScaler, AdaptiveLossScaler)
})


def epoch_growth(options: dict[str, Any], steps_per_epoch: int | None) -> dict[str, Any]:
    """``options`` with ``growth_interval: "epoch"`` replaced by ``steps_per_epoch``: the Lee et al. reference
    doubles its scale once per epoch (torch's GradScaler with ``growth_interval`` = batches per epoch, so an
    overflow restarts the count)."""
    if options.get("growth_interval") != EPOCH:
        return dict(options)
    if steps_per_epoch is None:
        raise PrecsearchError("loss_scaling.growth_interval is 'epoch' but the steps per epoch are unknown; pass "
                              "steps_per_epoch to apply_policy (precsearch's trainers do) or give a number")
    return {**options, "growth_interval": steps_per_epoch}


def make_scaler(mode: str, **options: Any) -> LossScaler:
    """A scaler from a policy's loss-scaling entry: a mode of precsearch.config.loss_scaling plus the options that
    mode takes (checked there first, so a bad entry is refused in the file's words)."""
    settings = loss_scaling({"mode": mode, **options}, "loss_scaling", mode)
    return SCALERS[mode](**{key: value for key, value in settings.items() if key != "mode"})
