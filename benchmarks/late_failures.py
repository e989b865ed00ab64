"""How a run that learned can end at chance: the loss spikes of one full-length run, read from its running loss.

search_efficiency.py found tiny_cnn's pick (``HLLL``) at 100% on six seeds at 2,400 steps and at chance on seed
2002 at 8,000. This script trains such runs once to their end with no readings along the way (a reading trains
a decay branch, which moves the run's random streams, so the run with readings is another run) and lists the
spikes of each: the steps where the running loss (the trainer's ``report``, a mean over ``report_every`` steps)
rose above ``--spike-loss`` after the run had first fallen below a tenth of it, and whether the run came back
below that before its end.

    python benchmarks/late_failures.py --task tiny --decisions HLLL,HHHH --seeds 2002 --steps 8000

``--scaled weight`` gives the low formats of those kinds a power-of-two scale per tensor (``@tensor``), to ask
whether the failure is the fixed exponent range of the paper's low formats.

``--weights-every N`` prints the largest magnitude of each parameter every N steps.

``--cosine`` trains each run with its rate falling along one cosine over all its steps (a real training's
schedule, as ``precsearch train`` without ``--recipe proxy``) instead of the proxies' constant rate with a decay
only at the end: is the failure the assignment's, or the constant rate's?

``--shock STEP:FACTOR:LENGTH`` asks whether a cheap probe at the confirmation's length could see the failure
coming: the learning rate times FACTOR for LENGTH steps from STEP (a spike made on purpose), the divergence
monitor off (a natural spike does not stop a run either), then ``--steps`` more at the proxies' rate. A run that
ends back below a tenth of ``--spike-loss`` recovered.

    python benchmarks/late_failures.py --task tiny --decisions HLLL,HHHH --seeds 2000,2001,2002 --steps 600 \
        --shock 2400:10:20
"""

from __future__ import annotations

import argparse
import contextlib
from unittest import mock

import torch
from search_efficiency import TASKS, CosineTrainer  # the same tasks (this script's folder is on sys.path)

from precsearch.config.spaces import paper_space
from precsearch.config.spec import PAPER_LOW, ProxyConfig
from precsearch.models import build
from precsearch.search.context import Budget, DataSpec, SearchContext, torch_threads
from precsearch.search.strategies import assign


def spikes(losses: list[tuple[int, float]], spike_loss: float) -> list[tuple[int, int | None]]:
    """(first step above ``spike_loss``, first step back below a tenth of it or None) after the run learned."""
    found: list[tuple[int, int | None]] = []
    learned, start = False, None
    for step, loss in losses:
        if start is None and learned and loss > spike_loss:
            start = step
        elif loss < spike_loss / 10:
            if start is not None:
                found.append((start, step))
                start = None
            learned = True
    if start is not None:
        found.append((start, None))
    return found


class Shock:
    """The learning rate times ``factor`` for ``length`` steps from ``step`` (multiples of the trainer's
    ``report_every``, whose hook sets it)."""

    def __init__(self, text: str) -> None:
        step, factor, length = text.split(":")
        self.step, self.factor, self.length = int(step), float(factor), int(length)

    def scale_at(self, step: int) -> float:
        return self.factor if step == self.step else 1 / self.factor if step == self.step + self.length else 1


class Probe:
    """What a run's report hook (every ``report_every`` steps) does besides recording the loss: a ``shock``, and
    every ``weights_every`` steps a line with the largest magnitude of each parameter (``names``, in the
    model's order). Both reach the SGD optimizer the run builds, which ``patched`` records; with a shock the
    divergence monitor is off, as a natural spike does not stop a run either."""

    def __init__(self, shock: Shock | None, weights_every: int, names: list[str]) -> None:
        self.shock, self.weights_every, self.names = shock, weights_every, names
        self.optimizers: list[torch.optim.SGD] = []

    def patched(self) -> contextlib.AbstractContextManager:
        recorded, plain_sgd = self.optimizers, torch.optim.SGD

        class RecordedSGD(plain_sgd):
            def __init__(self, *args, **kwargs) -> None:
                super().__init__(*args, **kwargs)
                recorded.append(self)

        stack = contextlib.ExitStack()
        stack.enter_context(mock.patch.object(torch.optim, "SGD", RecordedSGD))
        if self.shock is not None:
            stack.enter_context(mock.patch("precsearch.train.trainer.Divergence.check", return_value=""))
        return stack

    def at(self, step: int, loss: float) -> None:
        if not self.optimizers:
            return
        groups = self.optimizers[-1].param_groups
        scale = self.shock.scale_at(step) if self.shock is not None else 1
        for group in groups if scale != 1 else ():
            group["lr"] *= scale
        if self.weights_every and step % self.weights_every == 0:
            params = [param for group in groups for param in group["params"]]
            largest = ", ".join(f"{name} {param.detach().abs().max():.3g}"
                                for name, param in zip(self.names, params, strict=True))
            print(f"    step {step}: loss {loss:.3f}; largest |value|: {largest}", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--task", choices=sorted(TASKS), default="tiny")
    parser.add_argument("--decisions", default="HLLL,HHHH", help="assignments, one letter per unit (H or L)")
    parser.add_argument("--seeds", default="2002")
    parser.add_argument("--steps", type=int, default=8000)
    parser.add_argument("--spike-loss", type=float, default=1.0, help="running loss that counts as a spike")
    parser.add_argument("--scaled", default="", help="kinds whose low format gets a scale per tensor, comma-separated")
    parser.add_argument("--shock", default=None, help="STEP:FACTOR:LENGTH: the rate times FACTOR for LENGTH steps "
                        "from STEP, then --steps more")
    parser.add_argument("--weights-every", type=int, default=0,
                        help="print the largest magnitude of each parameter every N steps (0: never)")
    parser.add_argument("--cosine", action="store_true",
                        help="the rate along one cosine over each whole run, not the proxies' constant rate")
    args = parser.parse_args()
    if args.cosine and args.shock:
        parser.error("--shock is a probe of the proxies' constant rate; leave out --cosine")
    try:
        shock = Shock(args.shock) if args.shock else None
    except ValueError:
        parser.error(f"--shock {args.shock!r}: give STEP:FACTOR:LENGTH, for example 2400:10:20")
    report_every = TASKS[args.task][1].get("report_every", ProxyConfig().report_every)
    if shock is not None and (shock.step % report_every or shock.length % report_every):
        parser.error(f"--shock: STEP and LENGTH must be multiples of the trainer's report_every ({report_every})")
    steps = args.steps + (shock.step + shock.length if shock else 0)
    model, proxy = TASKS[args.task]
    scaled = [kind for kind in args.scaled.split(",") if kind]
    if unknown := sorted(set(scaled) - set(PAPER_LOW)):
        parser.error(f"--scaled: unknown kinds {', '.join(unknown)}; choose from {', '.join(PAPER_LOW)}")
    space = paper_space(proxy=proxy, low={kind: f"{spec}@tensor" if kind in scaled else spec
                                          for kind, spec in PAPER_LOW.items()})
    context = SearchContext.create(model, space, DataSpec("gratings"), Budget(max_accuracy_drop=0.01), 0, "cpu")
    probe = Probe(shock, args.weights_every, [name for name, _ in build(model).named_parameters()])
    trainer = CosineTrainer(context.trainer) if args.cosine else context.trainer
    shocked = f", shock {args.shock}" if shock else ""
    schedule = "one cosine over the run" if args.cosine else "the proxies' constant rate"
    print(f"{args.task}: {model} on gratings, {steps} steps{shocked}, {schedule}, one thread, low formats "
          f"{space.low}; spike: running loss above {args.spike_loss:g} after it was below {args.spike_loss / 10:g}")
    for decisions in args.decisions.split(","):
        levels = {unit: "high" if level == "H" else "low" for unit, level in zip(context.units, decisions, strict=True)}
        assignment = assign(context.graph, space, levels)
        policy = context.policy(assignment, {"strategy": decisions})
        for seed in (int(text) for text in args.seeds.split(",")):
            losses: list[tuple[int, float]] = []

            def report(step: int, loss: float, losses: list = losses) -> None:
                losses.append((step, loss))
                probe.at(step, loss)

            with torch_threads(1), probe.patched():
                result = trainer(policy, steps, seed, report=report)
            shown = ", ".join(f"{start}-{end}" if end is not None else f"{start}-never" for start, end
                              in spikes(losses, args.spike_loss)) or "none"
            print(f"  {decisions} (memory {context.memory(assignment, result.promotions)[0]:.3f}) seed {seed}: "
                  f"accuracy {result.val_accuracy:.4f}; spikes (step up - step back) {shown}; skipped steps "
                  f"{result.skipped_steps}, final loss scale {result.final_loss_scale:g}, promoted "
                  f"{', '.join(result.promotions) or 'nothing'}", flush=True)


if __name__ == "__main__":
    main()
