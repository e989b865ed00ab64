"""Running the format kernels under ``torch.compile``: one fused pass each, called straight through Inductor's code.

A ``KernelRunner`` runs a kernel compiled for tensors of at least ``min_numel`` elements on CPU, every tensor on
an accelerator; a kernel whose compilation fails runs eagerly from then on, alone, with one WARNING.
``runner.configured(enabled=False)`` (the CLI's ``--eager-kernels``) runs every kernel eagerly for a scope. A
``Runtime`` holds a runner and the compiled training steps (``CompiledGraphs``); ``default_runtime()`` is the
process's. The kernels hold no integer constant outside int32 (Triton types scalar literals as int32).

A kernel is a function of a flat float32 tensor and further tensors, with a ``label`` (``labelled``) that names
it in warnings; precsearch.formats.kernels builds them.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import types
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import fx
from torch.utils._pytree import tree_flatten, tree_unflatten

from precsearch.errors import first_line

__all__ = ["COMPILE_MIN_NUMEL", "INT32_LENGTHS", "Compiled", "CompiledGraphs", "KernelRunner", "KernelSettings",
           "Runtime", "default_runtime", "labelled", "run_kernel"]

log = logging.getLogger(__name__)

COMPILE_MIN_NUMEL = 1 << 14
INT32_LENGTHS = 2**31  # flat lengths a compiled kernel's direct call serves (the kernels may count in int32)
_PROBE_LENGTH = 4096  # values the first direct call is checked on (a copy of the start of the first input)


def labelled(label: str, kernel):
    """``kernel`` with the ``label`` that names it in warnings and in a runner's ``ready`` and ``failed``."""
    kernel.label = label
    return kernel


class Compiled:
    """A kernel compiled by TorchDynamo and Inductor for any length, then called straight through Inductor's
    compiled code. Dynamo's frame evaluation, guards and wrappers cost about 35 us a call on a CPU, more than
    the kernel itself on a few thousand values, and a training step makes hundreds of calls; AOTAutograd's
    runtime wrappers cost about 5 us more, so the direct call is Inductor's own (``current_callable``), or
    else AOTAutograd's entry. A direct call is taken on a device once it gave, bit for bit, Dynamo's own
    result on a copy of the start of the input that compiled it there (results and writes over the inputs);
    otherwise that device stays on Dynamo's path, with one WARNING.

    The kernel runs under a code object of its own, so each format has its own compile cache entry (no
    recompiles, no recompile limit to raise) however many formats a process uses."""

    def __init__(self, kernel) -> None:
        own_code = kernel.__code__.replace(co_name=f"{kernel.__name__}_{id(kernel):x}")
        fresh = types.FunctionType(own_code, kernel.__globals__, own_code.co_name, kernel.__defaults__,
                                   kernel.__closure__)
        self.label = kernel.label
        self._arg_names = own_code.co_varnames[:own_code.co_argcount]
        self._dynamo = torch.compile(fresh, backend=self._capture, dynamic=False)
        self._captured: list[tuple[fx.GraphModule, list[Callable]]] = []
        self._direct: dict[torch.device, tuple | None] = {}

    def _capture(self, graph_module: fx.GraphModule, example_inputs: list) -> object:
        """Compiles Dynamo's graph with Inductor, keeping the ways to call it directly, innermost first: the
        code Inductor generated (when it compiled one graph) and AOTAutograd's entry; each takes a list."""
        from torch._inductor.compile_fx import compile_fx, compile_fx_inner

        generated = []

        def keep_generated(*args, **kwargs):
            code = compile_fx_inner(*args, **kwargs)
            generated.append(code)
            return code

        with torch._functorch.config.patch(enable_autograd_cache=False):  # a cache hit would skip Inductor's compile
            compiled = compile_fx(graph_module, example_inputs, inner_compile=keep_generated)
        innermost = [generated[0].current_callable] if len(generated) == 1 else []
        self._captured.append((graph_module, [*innermost, lambda inputs: compiled(*inputs)]))
        return compiled

    def __call__(self, flat: torch.Tensor, *args: torch.Tensor):
        flat = flat.contiguous()  # the compiled code takes unit strides (an expanded gradient has stride 0)
        if flat.requires_grad:  # an op's output rounded in place: one graph serves it and its detached probe
            flat = flat.detach()
        direct = self._direct.get(flat.device, ())
        if direct and flat.numel() < INT32_LENGTHS:
            compiled, pick, unflatten = direct
            return unflatten(compiled(pick(flat, args)))
        verify = direct == () and flat.numel() < INT32_LENGTHS
        probe = [flat[:_PROBE_LENGTH].clone(), *(a.clone() for a in args)] if verify else []  # before any write
        before = len(self._captured)
        result = self._through_dynamo(flat, *args)
        if verify:
            self._direct[flat.device] = self._verified(self._captured[before:], probe)
        return result

    def _through_dynamo(self, flat: torch.Tensor, *args: torch.Tensor):
        torch._dynamo.mark_dynamic(flat, 0)  # one compiled kernel serves every tensor size
        return self._dynamo(flat, *args)

    def _verified(self, captured: list, probe: list[torch.Tensor]) -> tuple | None:
        """(a direct call of the code Dynamo compiled, its inputs from the kernel's, its outputs to the
        kernel's) for the innermost direct call that, on a copy of the start of the first call's inputs
        (``probe``), gives what Dynamo gives on another copy, results and writes over the inputs alike; else
        None (logged once)."""
        reason = "Dynamo compiled no single graph" if len(captured) != 1 else ""
        if not reason:
            graph_module, direct_calls = captured[0]
            pick = self._input_picker(graph_module)
            if pick is None:
                reason = "the graph takes inputs other than the kernel's arguments and the tensor length"
        if not reason:
            by_dynamo = [t.clone() for t in probe]
            compiled_before = len(self._captured)
            expected = self._through_dynamo(*by_dynamo)
            leaves, spec = tree_flatten(expected)
            tensors = [leaf for leaf in leaves if leaf is not None]  # a None the kernel returns is no output
            if len(self._captured) != compiled_before:
                reason = "the graph does not serve every length (Dynamo compiled again for a shorter input)"
            else:
                for index, compiled in enumerate(direct_calls):
                    direct = [t.clone() for t in probe]
                    again = list(compiled(pick(direct[0], tuple(direct[1:]))))
                    if (len(again) == len(tensors) and all(map(_same_bits, again, tensors))
                            and all(map(_same_bits, direct, by_dynamo))):
                        if index or len(direct_calls) == 1:  # AOTAutograd's entry, the last candidate
                            log.warning("the %s kernel is called through AOTAutograd's wrappers on %s, about 5 us "
                                        "more a call: Inductor's own code %s", self.label, probe[0].device,
                                        "gave another result" if index else "was not at hand")
                        return compiled, pick, _unflattener(expected, leaves, spec)
                reason = "the compiled code called directly gave another result"
        log.warning("the %s kernel runs through TorchDynamo on %s, about 35 us more a call: %s",
                    self.label, probe[0].device, reason)
        return None

    def _input_picker(self, graph_module: fx.GraphModule):
        """How to make the graph's inputs from the kernel's arguments, or None where it takes anything else."""
        sources = []
        for node in graph_module.graph.find_nodes(op="placeholder"):
            if isinstance(node.meta.get("example_value"), torch.SymInt):
                sources.append(None)  # the flat tensor's length, the only dynamic size
            elif node.name.startswith("l_") and node.name[2:-1] in self._arg_names:
                sources.append(self._arg_names.index(node.name[2:-1]))
            else:
                return None

        def pick(flat: torch.Tensor, args: tuple) -> list:
            values = (flat, *args)
            return [flat.numel() if index is None else values[index] for index in sources]

        return pick


def _unflattener(result: object, leaves: list, spec: object):
    """Rebuilds a kernel's result from the compiled code's outputs (its tensors, Nones left out). Holds the
    positions of the Nones, not the leaves (they would stay alive); a tensor or a flat tuple, the kernels'
    results, without pytree's walk."""
    if isinstance(result, torch.Tensor):  # a decoder's
        return lambda outputs: outputs[0]
    is_none = [leaf is None for leaf in leaves]
    if isinstance(result, tuple) and len(result) == len(leaves):
        positions = iter(range(len(leaves)))
        slots = [None if none else next(positions) for none in is_none]
        return lambda outputs: tuple(None if slot is None else outputs[slot] for slot in slots)

    def unflatten(outputs: list) -> object:
        filled = iter(outputs)
        return tree_unflatten([None if none else next(filled) for none in is_none], spec)

    return unflatten


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    if a.dtype == torch.float32:
        a, b = a.view(torch.int32), b.view(torch.int32)
    return torch.equal(a, b)


@dataclass(frozen=True)
class KernelSettings:
    """Whether a ``KernelRunner`` compiles its kernels (``enabled``) and from how many elements on a CPU
    (``min_numel``): a value, which a search hands its worker processes so that they run as the parent does."""

    enabled: bool = True
    min_numel: int = COMPILE_MIN_NUMEL


class KernelRunner:
    """Runs kernels on flat tensors: compiled (``compile(kernel)``, a ``Compiled`` by default, made once per
    kernel), or eagerly when compiling is off, the tensor is small, or the kernel's compilation failed. On CPU a
    kernel is first compiled for a tensor of ``min_numel`` elements (a compilation costs seconds, which a few small
    tensors do not repay); once compiled, it serves every size (a fifth of the eager cost on a thousand values)
    but 0 and 1 (which would need a compilation of their own). ``ready`` and ``failed`` hold kernel labels."""

    def __init__(self, settings: KernelSettings = KernelSettings(),
                 compile: Callable[[Callable], Callable] = Compiled) -> None:
        self.enabled, self.min_numel = settings.enabled, settings.min_numel
        self.ready: set[str] = set()
        self.failed: set[str] = set()
        self.compiled = functools.lru_cache(maxsize=192)(compile)

    @property
    def settings(self) -> KernelSettings:
        """``enabled`` and ``min_numel`` now, as a value."""
        return KernelSettings(self.enabled, self.min_numel)

    @contextlib.contextmanager
    def configured(self, enabled: bool | None = None, min_numel: int | None = None) -> Iterator[KernelRunner]:
        """This runner with ``enabled`` and ``min_numel`` (where given) for the ``with`` block, the previous
        settings restored after it however the block ends: the one way a command or a test changes them."""
        before = self.enabled, self.min_numel
        self.enabled = before[0] if enabled is None else enabled
        self.min_numel = before[1] if min_numel is None else min_numel
        try:
            yield self
        finally:
            self.enabled, self.min_numel = before

    def run(self, kernel, flat: torch.Tensor, *args):
        unready = flat.device.type == "cpu" and flat.numel() < self.min_numel and kernel.label not in self.ready
        if not self.enabled or unready or flat.numel() < 2 or kernel.label in self.failed:
            return kernel(flat, *args)
        try:
            result = self.compiled(kernel)(flat, *args)
            self.ready.add(kernel.label)
            return result
        except Exception as error:  # any compiler failure: this kernel runs eagerly, visibly, from now on
            self.failed.add(kernel.label)
            log.warning("torch.compile failed for the %s kernel (%s): it runs eagerly from now on, several times "
                        "slower (a dozen passes over the tensor instead of one); other kernels stay compiled",
                        kernel.label, first_line(error)[:300])
            return kernel(flat, *args)


class CompiledGraphs:
    """The training steps a runtime has compiled (precsearch.runtime.compiled builds them, by model structure,
    sites and code widths, so that a search's trials share one) and the reasons already logged for training
    eagerly instead (one WARNING each)."""

    def __init__(self) -> None:
        self.graphs: dict[tuple[Any, ...], Any] = {}
        self.warned: set[tuple[str, str]] = set()  # (model, reason)


class Runtime:
    """What the runs of a process share: the format kernels' runner (``kernels``) and the compiled training steps
    (``graphs``). ``apply_policy``, ``train`` and a search's workers are handed one; ``default_runtime()`` is the
    process's unless a ``with runtime.as_default():`` block makes another the default.

    The format kernels run on the default runtime's runner wherever they are called: inside torch ops (whose
    arguments cannot be a runner) and in autograd's backward threads (which a thread-local default would not
    reach); so the default is one per process, as torch.compile's caches are, and ``train`` makes its runtime the
    default while it runs."""

    def __init__(self, kernels: KernelRunner | None = None) -> None:
        self.kernels = KernelRunner() if kernels is None else kernels
        self.graphs = CompiledGraphs()

    @contextlib.contextmanager
    def as_default(self) -> Iterator[Runtime]:
        """This runtime as the process's default (``default_runtime``) for the ``with`` block; the previous
        default is back after it however the block ends."""
        _DEFAULTS.append(self)
        try:
            yield self
        finally:
            _DEFAULTS.pop()


_DEFAULTS: list[Runtime] = []  # the process's own runtime (made at first use), then those of open as_default blocks


def default_runtime() -> Runtime:
    """The runtime the format kernels run on and that ``apply_policy`` and ``train`` use when given none: the
    innermost ``as_default`` block's, else the process's own (made at first use)."""
    if not _DEFAULTS:
        _DEFAULTS.append(Runtime())
    return _DEFAULTS[-1]


def run_kernel(kernel, flat: torch.Tensor, *args):
    """``kernel`` on ``flat`` and ``args``, run by the default runtime's runner: how the format kernels are called."""
    return default_runtime().kernels.run(kernel, flat, *args)
