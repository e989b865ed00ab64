"""The real peak memory of a training step, measured: on CUDA the caching allocator's counters, on CPU the
allocator's own events recorded by torch.profiler (a tracker of every live allocation, in CI).

Why not torch's ``MemTracker``: it registers post-accumulate-grad hooks on each module's parameters, which under a
``PrecisionModel`` are, during the forward, the rounded non-leaf weights ``functional_call`` swaps in, so it fails.
Nor a ``TorchDispatchMode`` tracker: under any dispatch mode ``torch.compile`` falls back to eager, so it would
measure the eager quantizer's temporaries, not the fused kernels the runtime runs. The profiler's allocation events
see every allocation of the CPU allocator, compiled code and kernel workspaces included (the CPU counterpart of
``torch.cuda.max_memory_allocated``), and its event tree names the op that made each one (``trace_step``).

``measure_peak(step)`` is the peak of the bytes allocated during ``step`` minus those it freed: memory above
what was live before it. Blocks allocated before and freed during the step are invisible to the profiler,
so call it with the step's previous garbage gone (e.g. gradients set to None first).
"""

from __future__ import annotations

import contextlib
import logging
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch.profiler import ProfilerActivity, profile

log = logging.getLogger(__name__)

__all__ = ["Allocation", "StepMemory", "measure_peak", "median_step_times", "sgd_step", "trace_step"]

_BACKWARD = "autograd::engine::evaluate_function: "
_OPTIMIZER = "Optimizer.step#"


@dataclass(frozen=True)
class Allocation:
    """One block allocated during the step: its size, when (event index) it was made and freed (None: still
    live when the step ended), the outermost op inside its phase that made it, and the phase: ``forward``,
    ``backward:<autograd node>`` or ``optimizer``."""

    nbytes: int
    start: int
    end: int | None
    op: str
    phase: str

    def live_at(self, index: int) -> bool:
        return self.start <= index and (self.end is None or self.end > index)


@dataclass(frozen=True)
class StepMemory:
    """Every allocation of one step in event order, and the peak of the live total (bytes above the start)."""

    allocations: tuple[Allocation, ...]
    peak: int
    peak_index: int

    def live_at_peak(self) -> list[Allocation]:
        """The blocks that make up the peak, largest first."""
        live = [a for a in self.allocations if a.live_at(self.peak_index)]
        return sorted(live, key=lambda a: -a.nbytes)

    def summary(self, top: int = 12) -> str:
        """The peak, where it happened, and its largest blocks grouped by (phase, op)."""
        at = next((a for a in self.allocations if a.start == self.peak_index), None)
        groups: dict[tuple[str, str], list[int]] = {}
        for block in self.live_at_peak():
            groups.setdefault((block.phase, block.op), []).append(block.nbytes)
        rows = sorted(groups.items(), key=lambda item: -sum(item[1]))[:top]
        lines = [f"peak {self.peak:,d} bytes, reached in {at.phase if at else '?'} by {at.op if at else '?'}"]
        lines += [f"  {sum(sizes):>14,d}  {len(sizes):4d} block(s)  {phase:42.42s} {op}" for (phase, op), sizes in rows]
        return "\n".join(lines)


def _phase(event: object) -> tuple[str, str]:
    """(op, phase) of an allocation event from its ancestors in the profiler's event tree: the op is the
    outermost one inside the phase (``aten::convolution``, not the ``aten::empty`` it called)."""
    chain = []
    parent = getattr(event, "parent", None)
    while parent is not None:
        chain.append(parent.name)
        parent = parent.parent
    phase, op = "forward", chain[-1] if chain else "(no op)"
    for index, name in enumerate(chain):
        if name.startswith(_BACKWARD) or name.startswith(_OPTIMIZER):
            phase = "optimizer" if name.startswith(_OPTIMIZER) else "backward:" + name[len(_BACKWARD):]
            op = chain[index - 1] if index else name
            break
    return op, phase


@contextlib.contextmanager
def _without_profiler_banners() -> Iterator[None]:
    """The profiler's library prints "USDT:" (and "STAGE:") lines on the process's stderr as each profile starts
    and stops: they are held back, and whatever else was written there meanwhile is passed on."""
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile() as held:
        os.dup2(held.fileno(), 2)
        try:
            yield
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
            held.seek(0)
            kept = [line for line in held.read().decode(errors="replace").splitlines(keepends=True)
                    if not line.startswith(("USDT:", "STAGE:"))]
            sys.stderr.write("".join(kept))


def trace_step(step: Callable[[], object]) -> StepMemory:
    """Run ``step`` once under torch.profiler and return every CPU allocation it made (see module doc)."""
    with _without_profiler_banners(), profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        step()
    events = []
    stack = list(prof.profiler.kineto_results.experimental_event_tree())
    while stack:
        event = stack.pop()
        stack.extend(event.children)
        if event.typed[0] == torch._C._profiler._EventType.Allocation and event.typed[1].device.type == "cpu":
            events.append(event)
    events.sort(key=lambda e: e.start_time_ns)
    open_blocks: dict[int, tuple[int, int, str, str]] = {}  # ptr -> (size, start, op, phase)
    done: list[Allocation] = []
    live = peak = peak_index = 0
    for index, event in enumerate(events):
        size, ptr = event.typed[1].alloc_size, event.typed[1].ptr
        if size > 0:
            open_blocks[ptr] = (size, index, *_phase(event))
        elif ptr in open_blocks:
            block = open_blocks.pop(ptr)
            done.append(Allocation(block[0], block[1], index, block[2], block[3]))
        else:
            continue  # a block from before the step: not counted either way
        live += size
        if live > peak:
            peak, peak_index = live, index
    done += [Allocation(size, start, None, op, phase) for size, start, op, phase in open_blocks.values()]
    return StepMemory(tuple(sorted(done, key=lambda a: a.start)), peak, peak_index)


def measure_peak(step: Callable[[], object], device: str | torch.device = "cpu") -> int:
    """Peak bytes above those live before ``step``: CUDA's ``max_memory_allocated - memory_allocated``, else
    the CPU allocator's events (``trace_step``)."""
    device = torch.device(device)
    if device.type != "cuda":
        return trace_step(step).peak
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    before = torch.cuda.memory_allocated(device)
    step()
    torch.cuda.synchronize(device)
    return torch.cuda.max_memory_allocated(device) - before


def sgd_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, x: torch.Tensor, y: torch.Tensor,
             autocast: torch.dtype | None = None, scaler: Any = None, warmup: int = 0) -> Callable[[], torch.Tensor]:
    """One cross-entropy training step to measure, returning its (detached) loss: through ``scaler`` (default:
    the model's own when it has one, a ``PrecisionModel``; a ``torch.amp.GradScaler`` for fp16 autocast), the
    forward under ``torch.autocast(autocast)`` when given, gradients set to None at its end so that the next step
    starts from the baseline. ``warmup`` steps are taken before it is returned (2: the momentum buffers made and
    compiled kernels built, so that the step measured is a steady one)."""
    scaler = scaler if scaler is not None else getattr(model, "scaler", None)

    def step() -> torch.Tensor:
        with torch.autocast(x.device.type, dtype=autocast or torch.float32, enabled=autocast is not None):
            loss = torch.nn.functional.cross_entropy(model(x), y)
        if scaler is None:
            loss.backward()
            optimizer.step()
        else:
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()
        optimizer.zero_grad(set_to_none=True)
        return loss.detach()

    for _ in range(warmup):
        step()
    return step


def median_step_times(steps: Sequence[Callable[[], object]], device: str | torch.device = "cpu",
                      repeats: int = 5) -> list[float]:
    """Median seconds of each of ``steps`` over ``repeats`` calls, taken in turn (one call of each, then the next
    round), so that a machine's load falls on all of them alike; the device synchronised around each call."""
    device = torch.device(device)
    sync = torch.cuda.synchronize if device.type == "cuda" else lambda _: None
    times: list[list[float]] = [[] for _ in steps]
    for _ in range(repeats):
        for index, step in enumerate(steps):
            sync(device)
            start = time.perf_counter()
            step()
            sync(device)
            times[index].append(time.perf_counter() - start)
    return [statistics.median(seconds) for seconds in times]
