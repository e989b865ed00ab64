"""Weight gradients: rounded in place as each arrives, then held as codes until the end of the backward.

Each low weight gradient is rounded in place by a post-accumulate-grad hook, still loss-scaled. Where the
format fits 16 bits (``Slot.holds_codes``) it is then held as its codes, ``.grad`` None, until the end of the
backward, when a callback sets ``.grad`` to the decoded (identical) values: the earlier layers' backward runs
beside 16 (or 8) bits a value, not 32. An inf or NaN a format has no code for (e6m9s has neither) comes back as
the format's largest magnitude, counted: that step is skipped as overflowed (``TensorState.settle``), so no
optimizer reads it. Not while ``may_hold`` says no (by default ``no_process_group``: DDP reads ``.grad`` during
the backward).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from precsearch.runtime import ops
from precsearch.runtime.sites import SitePlan
from precsearch.runtime.state import Slot, TensorState

__all__ = ["hold_as_codes", "hook_weight_gradients", "no_process_group"]


def no_process_group() -> bool:
    """Whether no torch.distributed process group is up: DDP's reducer reads ``.grad`` in its own hooks during
    the backward, so weight gradients are held as codes only without one."""
    return not (torch.distributed.is_available() and torch.distributed.is_initialized())


def hook_weight_gradients(module: nn.Module, plan: SitePlan, state: TensorState,
                          may_hold: Callable[[], bool]) -> list[Any]:
    """Round each low weight gradient of ``module`` as soon as it is accumulated; the hooks' handles."""
    params = dict(module.named_parameters())
    handles = []
    for site in plan.weights:
        slot = state.slots[site.gradient] if site.gradient is not None else None
        if slot is not None and slot.is_low and site.param in params:
            hook = _rounding_hook(state, slot, may_hold)
            handles.append(params[site.param].register_post_accumulate_grad_hook(hook))
    return handles


def _rounding_hook(state: TensorState, slot: Slot, may_hold: Callable[[], bool]) -> Callable[[torch.Tensor], None]:
    """Round ``param.grad`` in place and, where its format fits 16 bits, hold only its codes until the end of the
    backward (``hold_as_codes``)."""

    def hook(param: torch.Tensor) -> None:
        if not slot.is_low or state.graph_rounds:  # a compiled step's backward rounded it already
            return
        hold = slot.holds_codes and may_hold()
        codes = state.round_(param.grad, slot, with_codes=hold, count=state.counting)
        if codes is not None:
            hold_as_codes(param, codes)

    return hook


def hold_as_codes(param: torch.Tensor, codes: ops.Codes) -> None:
    """Drop ``param.grad`` (already rounded) for its codes, and set it back, decoded, at the end of the backward:
    the same values, since rounded values are exactly the format's. Inside the backward ``.grad`` is None; a
    backward that raises leaves it None. A later backward accumulates into the restored ``.grad`` as usual."""
    param.grad = None

    def restore() -> None:
        param.grad = codes.whole()

    torch.autograd.Variable._execution_engine.queue_callback(restore)
