"""A fake ``Trainer`` whose learning curves are scripted, for search tests that must not depend on real training.

Each policy is named by its decisions per unit of the space ("HHLL"; "plain" for no policy), as the trials
table's ``decisions`` column names it. ``curve(name, step, length, seed)`` gives the validation accuracy at
``step`` of a run read at ``length`` (a continuing run: its point at ``length`` is a run of that length's);
every call is logged in ``calls`` with the step it continued from (``start``: its checkpoint's, 0 without
one) and how far it got (``steps``). A curve that gives ``None`` at a run's end makes that run diverge (at
chance, ``DIVERGED_ACCURACY``, as a real diverged run reads).
"""

from __future__ import annotations

import io
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from precsearch.search.context import SearchContext
from precsearch.train.continuing import Progress, State, branch_steps, read_checkpoint, write_checkpoint
from precsearch.train.reading import Reading
from precsearch.train.trainer import ProxyResult

DIVERGED_ACCURACY = 0.1  # chance of the 10 classes
SCRIPTED = "scripted"  # the run tag of a scripted run's checkpoints


def curve_at(table: dict[int, tuple[float, ...]], step: int, before: float) -> tuple[float, ...]:
    """A curve given per seed at a few steps, held constant between them (``before`` on every seed before the
    first)."""
    known = [point for point in table if point <= step]
    return table[max(known)] if known else (before,) * len(next(iter(table.values())))


@dataclass
class ScriptedTrainer:
    curve: Callable[[str, int, int, int], float]
    context: SearchContext  # of the same model, space and data as the search's: its graph, units, high format
    batch_stats: Callable[[str, int, int, int], float] | None = None  # the batch-statistics accuracy of a final
    # reading (default: the curve's own, a reading batch norm's statistics do not decide)
    calls: list[dict] = field(default_factory=list)  # name, length, seed, start, steps (how far it got), readings

    def name(self, policy) -> str:
        if policy is None:
            return "plain"
        assignment = policy.assignment(self.context.graph)
        high = self.context.space.high
        return "".join("H" if all(assignment[tensor] == high for tensor in tensors) else "L"
                       for tensors in self.context.units.values())

    def __call__(self, policy, steps, seed, *, evaluate_at=(), on_eval=None, report=None,
                 checkpoint=None, decay_from=None) -> ProxyResult:
        name = self.name(policy)
        start = self._step_of(checkpoint)
        start = start if start <= (steps if decay_from is None else decay_from) else 0
        call = {"name": name, "length": steps, "seed": seed, "start": start, "steps": steps, "readings": [],
                "decay_from": decay_from}
        self.calls.append(call)
        val_curve = []
        for step in sorted(set(evaluate_at)):
            accuracy = self.curve(name, step, steps, seed)
            val_curve.append([step, accuracy])
            if on_eval is not None and start < step < steps:
                call["steps"] = step  # how far it got if the rung stops it here
                call["readings"].append(step)  # a real continuing run trains a decay branch at each
                self._save(checkpoint, step)
                on_eval(step, Reading(accuracy, 1.0 - accuracy, accuracy))
                call["steps"] = steps
        self._save(checkpoint, steps)
        final = self.curve(name, steps, steps, seed)
        diverged = final is None
        final = DIVERGED_ACCURACY if diverged else final
        if report is not None:  # a real run reports its running loss every few steps; here once, at its end
            report(steps, 1.0 - final)
        if decay_from is None:  # a run ending in its own decay is read as it is: no branch
            call["readings"].append(steps)
        batch_stats = final if self.batch_stats is None else self.batch_stats(name, steps, steps, seed)
        return ProxyResult(val_accuracy=final, val_loss=1.0 - final, diverged=diverged,
                           batch_stats_accuracy=batch_stats,
                           reason=f"scripted divergence at step {steps}" if diverged else "", steps_run=steps,
                           loss_curve=[], val_curve=val_curve, steps_spent=steps - start,
                           branch_steps=branch_steps(call["readings"]))

    @staticmethod
    def _save(checkpoint, step: int) -> None:
        """A checkpoint as a real run writes one (``write_checkpoint``; ``--resume`` reads every one as data first),
        its training state a scripted one: only the step."""
        if checkpoint is not None:
            buffer = io.BytesIO()
            torch.save({"step": step}, buffer)
            write_checkpoint(checkpoint, SCRIPTED, State(buffer.getvalue()), Progress(step=step))

    @staticmethod
    def _step_of(checkpoint) -> int:
        """The step a checkpoint of ``_save`` was written at (0: none)."""
        found = read_checkpoint(checkpoint, SCRIPTED, steps=2**62) if checkpoint is not None else None
        return 0 if found is None else found[1].step
