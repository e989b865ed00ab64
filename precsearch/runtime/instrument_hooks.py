"""The fallback for models FX cannot trace: module forward hooks round what the hook tracer recorded.

Ops that are plain function calls are then not enforced and listed in ``unenforced``; modules that run but are
not in the traced graph (a branch the example input did not take) say so loudly, once each, in ``untraced``.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Callable
from typing import Any

from torch import nn

from precsearch.graph.tracing import untraced_modules
from precsearch.graph.types import TensorGraph
from precsearch.runtime.accumulate import CHUNKED_LAYERS
from precsearch.runtime.rounding import Rounder, Rounding, rounder_for
from precsearch.runtime.sites import SitePlan

__all__ = ["HookInstrument", "is_module_call"]

log = logging.getLogger(__name__)


def is_module_call(model: nn.Module, op: Any) -> bool:
    """Whether ``op`` is a call of one of the model's submodules (not a function call)."""
    if op.module is None:
        return False
    try:
        module = model.get_submodule(op.module)
    except AttributeError:  # not a module of ``model``
        return False
    return op.module_type in {cls.__name__ for cls in type(module).__mro__}  # a chunked Conv2d is a Conv2d


class HookInstrument:
    """Forward hooks on the modules the hook tracer recorded (each call of a module counted per forward, so a
    module called twice rounds each call as its own op), and on the modules it did not see."""

    def __init__(self, module: nn.Module, graph: TensorGraph, plan: SitePlan, rounding: Rounding) -> None:
        self.unenforced: list[str] = []
        self.untraced: list[str] = []
        self.handles: list[Any] = []
        self._input_rounder: Rounder | None = None
        self._module_rounders: dict[str, dict[int, Rounder]] = {}
        self._calls: Counter[str] = Counter()
        for name in untraced_modules(module, graph, CHUNKED_LAYERS):
            self.handles.append(module.get_submodule(name).register_forward_hook(self._untraced_hook(name)))
        for op in graph.ops:
            rounder = rounder_for(plan.of_op(op.name), rounding)
            if rounder is None:
                continue
            if op.role == "input":
                self._input_rounder = rounder
            elif is_module_call(module, op):
                self._module_rounders.setdefault(op.module, {})[op.call] = rounder
            else:
                self.unenforced.append(op.name)
        for base in self._module_rounders:
            self.handles.append(module.get_submodule(base).register_forward_hook(self._module_hook(base)))

    def begin(self, args: tuple[Any, ...]) -> tuple[Any, ...]:
        """A forward starts: count module calls afresh; the model's input, rounded."""
        self._calls.clear()
        if self._input_rounder is not None and args:
            args = (self._input_rounder(args[0]), *args[1:])
        return args

    def _untraced_hook(self, name: str) -> Callable[..., None]:
        def hook(module: nn.Module, args: Any, output: Any) -> None:
            if name in self.untraced:
                return
            self.untraced.append(name)
            log.warning("%s (%s) ran but is not in the traced graph (a branch the example input did not take): "
                        "no policy rule covers it, it runs unrounded in fp32 and its memory is not counted; "
                        "trace with a batch that takes this branch: apply_policy(model, policy, example_input=x)",
                        name, type(module).__name__)

        return hook

    def _module_hook(self, base: str) -> Callable[..., Any]:
        def hook(module: nn.Module, args: Any, output: Any) -> Any:
            call = self._calls[base]
            self._calls[base] += 1
            rounder = self._module_rounders[base].get(call)
            return None if rounder is None else rounder(output)

        return hook
