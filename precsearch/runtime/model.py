"""Train any CNN under a policy: ``apply_policy(model, policy)`` returns a ``PrecisionModel``.

It traces the model (precsearch.graph.tracing), checks that the policy was made for it, and returns a
``PrecisionModel`` that trains in the ordinary loop::

    model = apply_policy(model, Policy.load("policy.json"))
    optimizer = model.wrap_optimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9))
    for images, labels in loader:
        optimizer.zero_grad()
        loss = F.cross_entropy(model(images), labels)
        model.scaler.scale(loss).backward()
        model.scaler.step(optimizer)
        model.scaler.update()

Each step in its own module of precsearch.runtime, each given what it needs explicitly:

* ``state``: per tensor id, its format now, its overflow counts, promotion (the divergence guard).
* ``norm_statistics``: batch norm's running statistics put back when the loss scaler skips a step.
* ``packing``: tensors autograd saves for backward held as the codes of their format, once per storage.
* ``rounding``: the autograd Functions and modules that round weights, activations and their gradients.
* ``instrument_fx`` (torch.ao's prepare_fx, rounding modules for observers), or ``instrument_hooks`` for
  untraceable models (function-call ops then not enforced and listed in ``unenforced``).
* ``sliced``: Conv2d, BatchNorm2d and ReLU backwards decoding packed tensors a slice at a time.
* ``gradients``: weight gradients rounded as they arrive and held as codes until the end of the backward.
* ``weights``: pure low-precision weights (``master_weights=False``) and the optimizers keeping them.
* op knowledge is the op rules' the graph was traced with (``TensorGraph.rules``): the runtime keeps no table.
* statistics: overflow fractions always; underflow / subnormal / NaN fractions every ``stats_every``-th step
  (they cost a few passes and a host read per tensor).
* accumulation: ``policy.accumulation``'s layers are swapped, in the user's model, for
  precsearch.runtime.accumulate's chunked Linear/Conv2d (same Parameters; ``unwrap`` puts them back). The model is
  traced before the swap, so the graph, its fingerprint and rules are the plain model's: the swap changes
  arithmetic, not what tensors are stored.

Everything is simulated in float32 (models must be float32), on any device. On CUDA, report
``torch.cuda.max_memory_allocated()`` as the memory figure; on CPU ``saved_bytes()``. Known limit: adaptive loss scaling
scales a GEMM's gradient after that gradient's rounding (its points are the GEMM nodes), so it protects the
products the GEMM's backward forms, as in Zhao et al., not the rounding of its own output gradient.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import nn

from precsearch.config.compiling import CompileOptions
from precsearch.config.policy import Policy
from precsearch.errors import PrecsearchError
from precsearch.formats.runner import CompiledGraphs, Runtime, default_runtime
from precsearch.graph.op_rules import OP_RULES, OpRules
from precsearch.graph.policy_check import policy_example_input, verify_policy
from precsearch.graph.tracing import trace
from precsearch.graph.types import TensorGraph, grad_id
from precsearch.runtime.accumulate import CHUNKED_LAYERS, swap_chunked_layers
from precsearch.runtime.compiled import compiled_step
from precsearch.runtime.gradients import hook_weight_gradients, no_process_group
from precsearch.runtime.instrument_fx import instrument_fx
from precsearch.runtime.instrument_hooks import HookInstrument, is_module_call
from precsearch.runtime.norm_statistics import keep_running_statistics
from precsearch.runtime.packing import Packer, SavedBytes
from precsearch.runtime.rounding import Rounding, low_weights
from precsearch.runtime.scaling import LossScaler, epoch_growth, make_scaler
from precsearch.runtime.sites import plan_sites
from precsearch.runtime.state import Promotion, TensorState, make_state
from precsearch.runtime.weights import Optimizers, round_pure_weights

__all__ = ["PrecisionModel", "apply_policy"]

log = logging.getLogger(__name__)

# a function of the traced graph and the policy giving the slices apply_policy runs (op name -> count)
ChooseSlices = Callable[[TensorGraph, Policy], Mapping[str, int]]


class PrecisionModel(nn.Module):
    """A model training under a policy; build it with ``apply_policy``. The user's model is ``.module``;
    ``compiled_step`` is the compiled step its forwards with gradients run (precsearch.runtime.compiled), or None."""

    def __init__(self, model: nn.Module, policy: Policy, graph: TensorGraph, seed: int = 0,
                 stats_every: int | None = None, steps_per_epoch: int | None = None,
                 hold_gradients: Callable[[], bool] = no_process_group, round_in_place: bool = True,
                 gradient_codes: bool = True, slices: Mapping[str, int] | None = None,
                 compile: CompileOptions | None = None, graphs: CompiledGraphs | None = None) -> None:
        super().__init__()
        self.module, self.policy, self.graph = model, policy, graph
        self.stats_every, self.steps_per_epoch = stats_every, steps_per_epoch
        self._generator = torch.Generator().manual_seed(seed)
        self._plain_layers = _swap_accumulation(model, policy)
        self.accumulation_layers = list(self._plain_layers)
        self.state = make_state(graph, policy, seed)
        self._packer = Packer(model)
        self.scaler, self._handles = _scaler_of(self, policy, graph, self.state, steps_per_epoch)
        self.scaler.watch(self.state)  # the state's counts ride the scaler's one host read a step
        keep_running_statistics(model, self.scaler, self.state)
        self.sites = plan_sites(graph, policy.gradient_rounding == "per_use", chunked=self.accumulation_layers,
                                gradient_codes=gradient_codes, slices=slices)
        weights = low_weights(model, self.sites, self.state)
        self._optimizers = Optimizers(policy, weights, self._generator)
        if not policy.master_weights:
            self.state.on_promote.append(self._optimizers.promote)
        self.clipped_at_start = [] if policy.master_weights else round_pure_weights(weights, self.state)
        self.compiled_step = compile and compiled_step(policy, graph, self.sites, self.state, compile, graphs,
                                                       hold_gradients)
        self._handles += hook_weight_gradients(model, self.sites, self.state, hold_gradients)
        self._rounding = Rounding(self.state, self._packer, weights)
        self._hooks: HookInstrument | None = None
        self.untraced: list[str] = []  # modules that ran in a forward but are not in the graph (hook tracer only)
        self.unenforced: list[str] = []
        if graph.graph_module is not None:
            replaced = {name: model.get_submodule(name) for name in self.accumulation_layers}
            target = instrument_fx(graph, self.sites, model, self._rounding, replaced, in_place=round_in_place)
        else:
            target = model
            self._hooks = HookInstrument(model, graph, self.sites, self._rounding)
            self._handles += self._hooks.handles
            self.untraced, self.unenforced = self._hooks.untraced, list(self._hooks.unenforced)
            _warn_hooked(policy, self.unenforced)
        self.__dict__["_target"] = target  # the FX module shares the user's submodules: keep it unregistered
        self.unenforced += _hidden_gemms(graph)
        self._warned_compile = False

    @property
    def promotions(self) -> list[Promotion]:
        """The tensors promoted so far (read after the step's counts were settled)."""
        self.state.flush()
        return self.state.promotions

    @property
    def step_count(self) -> int:
        """Training forwards run so far."""
        return self.state.step

    # -- checkpoints: the training state rides in the ordinary state_dict() as "_extra_state" -------------

    def get_extra_state(self) -> dict[str, Any]:
        """Promotions, step count, rounding counter, loss scaler and the stochastic-update generator, so that
        ``torch.save(model.state_dict())`` and ``load_state_dict`` continue training exactly."""
        return {"tensors": self.state.state_dict(), "scaler": self.scaler.state_dict(),
                "generator": self._generator.get_state()}

    def set_extra_state(self, state: Any) -> None:
        if not isinstance(state, Mapping) or not {"tensors", "scaler", "generator"} <= set(state):
            raise PrecsearchError("checkpoint has no precsearch training state: save model.state_dict() of the "
                                  "PrecisionModel (what apply_policy returned), not of the inner model")
        for slot in self.state.load_state_dict(state["tensors"]):
            for callback in self.state.on_promote:
                callback(slot)
        self.scaler.load_state_dict(state["scaler"])
        self._generator.set_state(state["generator"])

    # -- training -----------------------------------------------------------------------------------------

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if torch.compiler.is_compiling():  # under torch.compile: the call below breaks the graph, runs eagerly
            return self._forward_under_compile(*args, **kwargs)
        return self._forward(*args, **kwargs)

    @torch.compiler.disable
    def _forward_under_compile(self, *args: Any, **kwargs: Any) -> Any:
        """The saved-tensor bookkeeping identifies storages by address, which TorchDynamo cannot trace: a
        compiled wrapper of this model runs it eagerly (its rounding kernels are compiled one by one anyway)."""
        if not self._warned_compile:
            self._warned_compile = True
            log.warning("torch.compile of a policy-wrapped model runs it eagerly (its saved-tensor bookkeeping "
                        "cannot be traced): wrap with apply_policy(model, policy, compile=True) instead, which "
                        "compiles the training step itself")
        return self._forward(*args, **kwargs)

    def _forward(self, *args: Any, **kwargs: Any) -> Any:
        self.state.start_forward(self.training and torch.is_grad_enabled(), self.stats_every)
        self.state.graph_rounds = (self.compiled_step is not None and torch.is_grad_enabled()
                                   and not self.state.stats_due and len(args) == 1 and not kwargs)
        if self.state.graph_rounds:
            return self.compiled_step(self.module, args[0], self.training)
        packing = self._packer.forward() if torch.is_grad_enabled() else contextlib.nullcontext()
        with packing:
            if self._hooks is not None:
                args = self._hooks.begin(args)
            weights = self._rounding.up_front()
            if not weights:
                return self._target(*args, **kwargs)
            return torch.func.functional_call(self._target, weights, args, kwargs)

    def wrap_optimizer(self, optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
        """The optimizer to step: ``optimizer`` itself with fp32 masters and no optimizer settings, else a
        precsearch.runtime.optim ``LowPrecisionOptimizer`` keeping pure low-precision weights (and rounded state)."""
        return self._optimizers.wrap(optimizer)

    # -- reports ------------------------------------------------------------------------------------------

    def saved_bytes(self) -> SavedBytes:
        """What the last forward (with gradients) left for backward, each storage counted once."""
        return self._packer.last

    def formats(self) -> dict[str, str]:
        """Tensor id -> the format in force now (after promotions)."""
        self.state.flush()
        return {tensor_id: slot.name for tensor_id, slot in self.state.slots.items()}

    def reset_stats(self) -> None:
        self.state.reset()

    def tensor_stats(self, as_frame: bool = False) -> Any:
        """Per tensor id of low precision: kind, format, promoted, calls, and the mean fractions (over the
        values seen since the last reset) of ``overflow`` (also ``max_overflow``, the largest of one step)
        and, with ``stats_every``, ``underflow``, ``subnormal`` and ``nan``. A dict, or a pandas DataFrame."""
        table = self.state.table()
        if not as_frame:
            return table
        import pandas as pd

        return pd.DataFrame.from_dict(table, orient="index")

    def unwrap(self) -> nn.Module:
        """Remove every hook this wrapper installed and return the user's model (parameters as they are)."""
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        for name, layer in self._plain_layers.items():
            layer.train(self.module.get_submodule(name).training)
            self.module.set_submodule(name, layer)
        self._plain_layers.clear()
        return self.module


def _swap_accumulation(model: nn.Module, policy: Policy) -> dict[str, nn.Module]:
    """Swap the policy's accumulation layers for chunked ones; the plain ones by name, for ``unwrap``."""
    if policy.accumulation is None:
        return {}
    before = dict(model.named_modules())
    accumulation = policy.accumulation
    names = swap_chunked_layers(model, accumulation.layers, accumulation.format, accumulation.chunk)
    log.info("chunked %s accumulation (CL=%s) in %d layer(s)", policy.accumulation.format,
             policy.accumulation.chunk, len(names))
    return {name: before[name] for name in names}


def _scaler_of(wrapper: PrecisionModel, policy: Policy, graph: TensorGraph, state: TensorState,
               steps_per_epoch: int | None) -> tuple[LossScaler, list[Any]]:
    """The loss scaler ``policy.loss_scaling`` names, and the handles of its hooks. An adaptive scaler's points
    are the GEMM layers: a GEMM's scale protects the products that form its input's gradient, so each uses
    that gradient's format."""
    options = {key: value for key, value in policy.loss_scaling.items() if key != "mode"}
    options = epoch_growth(options, steps_per_epoch)
    mode = policy.loss_scaling["mode"]
    if mode != "adaptive":
        return make_scaler(mode, **options), []
    options.setdefault("grad_format", policy.defaults.get("activation_grad", "fp32"))
    scaler = make_scaler(mode, **options)
    grad_formats = {}
    for op in graph.ops:
        if op.role != "gemm" or op.call > 0 or not is_module_call(wrapper.module, op):
            continue
        slots = [state.slots.get(grad_id(t)) for t in op.input_tensors]
        fmts = [s.fmt for s in slots if s is not None]
        if fmts:
            grad_formats[f"module.{op.name}"] = max(fmts, key=lambda f: f.min_subnormal)
    return scaler, scaler.attach(wrapper, layers=list(grad_formats), grad_formats=grad_formats)


def _warn_hooked(policy: Policy, unenforced: list[str]) -> None:
    """What the hook fallback cannot do, said once at wrapping."""
    if policy.gradient_rounding == "per_use":
        log.warning("model is not FX-traceable: gradient_rounding per_use needs the FX graph; each "
                    "activation's summed gradient is rounded once (sum)")
    if unenforced:
        log.warning("model is not FX-traceable: activations of %d function op(s) are not rounded (%s)",
                    len(unenforced), ", ".join(unenforced))


def _hidden_gemms(graph: TensorGraph) -> list[str]:
    """Ops running GEMMs inside an FX leaf are rounded only at their boundary: say so, once, and list them."""
    hidden = graph.unenforced()
    if hidden:
        log.warning("%d op(s) run GEMMs inside FX leaf functions or modules, where the policy cannot round: "
                    "their inputs, weights and outputs are rounded, the values inside them are not (%s: %s)",
                    len(hidden), ", ".join(hidden), "; ".join(sorted(set(hidden.values()))))
    return list(hidden)


def _warn_compiled_slices(compiled: bool, slices: Mapping[str, int] | None) -> None:
    """Once per model: the compiled step keeps the op rules' slices, so ``slices`` reaches its eager steps only."""
    if compiled and slices:
        log.warning("the compiled step runs its sliced backwards in the op rules' slices: slices= applies to "
                    "eager steps only; pass compile=False for the finer slices")


def apply_policy(model: nn.Module, policy: Policy, example_input: torch.Tensor | None = None, *,
                 strict: bool = True, seed: int = 0, stats_every: int | None = None,
                 steps_per_epoch: int | None = None, rules: OpRules = OP_RULES,
                 hold_gradients: Callable[[], bool] = no_process_group, round_in_place: bool = True,
                 gradient_codes: bool = True, slices: Mapping[str, int] | ChooseSlices | None = None,
                 compile: bool | CompileOptions = False, runtime: Runtime | None = None) -> PrecisionModel:
    """Wrap ``model`` so that it trains under ``policy`` (see the module docstring).

    ``example_input`` (default: zeros of the policy's input shape) traces the model at the policy's batch size; a
    policy made for another graph raises unless ``strict=False``. ``seed`` seeds stochastic rounding;
    ``stats_every`` turns on underflow statistics every n-th step; ``steps_per_epoch`` resolves a loss scale
    ``growth_interval`` of ``"epoch"``. ``policy.accumulation``'s layers are swapped in ``model`` itself. ``rules``:
    the op rules to trace and train with. Three memory-saving steps can be switched off, for a user chasing a
    difference: ``hold_gradients`` (called in each backward) says whether low weight gradients may be held as
    codes until the end of the backward (by default: while no process group is up, as DDP reads ``.grad`` during
    the backward), ``round_in_place=False`` rounds every activation and activation gradient into a new tensor, and
    ``gradient_codes=False`` hands every rounded activation gradient on as float32, not as its codes
    (``OpSites.gradient_codes``). None changes a value. ``slices`` (op name -> count, or a function of the traced
    graph and the policy giving them, e.g. ``precsearch.cost.model.finer_slices``) runs those layers' sliced
    backwards in at least that many slices on CPU: less memory at the step's peak for more time, float32 sums in
    another order.

    ``compile=True`` (or a ``CompileOptions``) trains with the compiled step (precsearch.runtime.compiled),
    compiled once per model structure and code widths in ``runtime`` (default: ``default_runtime()``), where the
    policy allows it (else one WARNING per runtime says why, and the step runs eagerly); forwards without
    gradients run eagerly. The format kernels run on the default runtime's runner (``train`` makes its runtime the
    default while it runs).
    """
    if not isinstance(policy, Policy):
        raise PrecsearchError(f"apply_policy needs a precsearch Policy, got {type(policy).__name__}")
    not_fp32 = sorted({str(p.dtype) for p in model.parameters() if p.dtype != torch.float32})
    if not_fp32:
        raise PrecsearchError(f"model has {', '.join(not_fp32)} parameters; formats are simulated in float32: "
                              "call model.float() first")
    if example_input is None:
        example_input = policy_example_input(policy, model)
    graph = trace(model, example_input, batch_size=policy.batch_size or example_input.shape[0],
                  leaf_modules=CHUNKED_LAYERS, rules=rules)
    verify_policy(policy, graph, strict=strict)
    if callable(slices):
        slices = slices(graph, policy)
    wrapped = PrecisionModel(model, policy, graph, seed=seed, stats_every=stats_every, steps_per_epoch=steps_per_epoch,
                             hold_gradients=hold_gradients, round_in_place=round_in_place,
                             gradient_codes=gradient_codes, slices=slices,
                             compile=CompileOptions() if compile is True else compile or None,
                             graphs=(runtime or default_runtime()).graphs)
    _warn_compiled_slices(bool(wrapped.compiled_step), slices)
    return wrapped
