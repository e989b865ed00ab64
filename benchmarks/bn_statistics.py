"""Batch norm's statistics under low-precision policies: why eval-mode readings went wrong, and the readings now.

Two parts, on the demo's task (narrow_cnn, 16x16 gratings, batch 32, momentum 0.9, weight decay 5e-4, cosine
over the run, ``--lr`` 0.1: what ``precsearch train narrow_cnn --recipe proxy --data gratings --policy P`` runs;
the demo's proxies train at 0.2):

* ``--trace``: one run of wang_fp8 (seed 101), step by step: the loss, the loss scale, whether the scaler
  skipped the step, how many rounded values overflowed their format, the stem conv's output (the stem batch
  norm's input, held in e5m2s) as its largest magnitude, the share of it at the format's largest value
  (114,688) and its batch mean, beside the stem batch norm's running mean and variance and the stem's weight
  norm. Written to ``bn_statistics_trace_lr<lr>.csv``; the steps where eval mode read wrong are where the running
  mean trails the batch mean by many standard deviations.
* the table: wang_fp8, the demo's pick (the input's group high, every other group low, the paper's HFP8 space)
  and hfp8, 1,200 steps each on seeds 101 and 102, trained by ``precsearch.train.trainer.train_policy`` (the
  path ``precsearch train`` runs). Every reading along the run (once an epoch) is taken three ways from the
  same weights: eval mode with the running averages as training left them (the reading before this change),
  eval mode with the statistics recomputed from 1,024 training images (``precsearch.train.reading``, the
  reading now), and each validation batch's own statistics. Written to
  ``bn_statistics_lr<lr>.csv``.

Usage: python benchmarks/bn_statistics.py [--trace] [--seeds 101,102] [--steps 1200] [--lr 0.1]
       [--out benchmarks/results]
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path

import pandas as pd
import torch
import torch.nn.functional as F

from precsearch.cli.demo import DATA, MODEL, PROXY
from precsearch.config.spaces import paper_space
from precsearch.config.spec import ProxyConfig
from precsearch.formats.format import get_format
from precsearch.runtime.model import apply_policy
from precsearch.search.context import Budget, DataSpec, SearchContext
from precsearch.search.strategies import assign, baseline
from precsearch.train import trainer
from precsearch.train.reading import evaluate, flagged
from precsearch.train.trainer import PAPER_LR

RESULTS = Path(__file__).resolve().parent / "results"


def demo_policies(context: SearchContext) -> dict:
    """wang_fp8, the demo's pick (the input's group high, the rest low) and hfp8, for the demo's model."""
    first = next(unit for unit, ids in context.units.items() if "x:activation" in ids)
    pick = context.policy(assign(context.graph, context.space, {unit: "high" if unit == first else "low"
                                                                for unit in context.units}),
                          {"strategy": "the demo's pick: the input's group high"})
    return {"wang_fp8": baseline("wang_fp8", context.graph).replace(model=MODEL), "pick": pick,
            "hfp8": baseline("hfp8", context.graph).replace(model=MODEL)}


def trace_run(policy, data, steps: int, seed: int, config: ProxyConfig) -> pd.DataFrame:
    """The step-by-step trace of one run (the proxy recipe: cosine over ``steps``), as the module says."""
    train_set, _ = data
    device = torch.device("cpu")
    largest = get_format("e5m2s").max
    with trainer.seeded(seed, device):
        model = trainer.build_model(MODEL, train_set.num_classes, train_set.images[:2])
        wrapped = apply_policy(model, policy, train_set.images[:2], seed=seed,
                               steps_per_epoch=len(train_set) // config.batch_size)
        wrapped.train()
        sgd = torch.optim.SGD(wrapped.parameters(), lr=config.lr, momentum=config.momentum,
                              weight_decay=config.weight_decay)
        optimizer = wrapped.wrap_optimizer(sgd)
        schedule = torch.optim.lr_scheduler.CosineAnnealingLR(sgd, T_max=steps)
        seen: dict[str, torch.Tensor] = {}
        model.stem.register_forward_hook(lambda module, args, out: seen.__setitem__("stem", out.detach()))
        batches = trainer._batches(train_set, config.batch_size, seed)
        rows, skipped, overflowed = [], 0, 0
        for step in range(1, steps + 1):
            images, labels = next(batches)
            optimizer.zero_grad(set_to_none=True)
            loss = F.cross_entropy(wrapped(images), labels)
            scale = float(wrapped.scaler.get_scale())
            wrapped.scaler.scale(loss).backward()
            wrapped.scaler.step(optimizer)
            wrapped.scaler.update()
            schedule.step()
            wrapped.state.flush()
            total = sum(slot.overflowed for slot in wrapped.state.slots.values())
            stem, norm = seen["stem"], model.stem_bn
            rows.append({"step": step, "loss": float(loss.detach()), "loss_scale": scale,
                         "skipped": wrapped.scaler.skipped_steps - skipped, "overflowed_values": total - overflowed,
                         "stem_out_absmax": float(stem.abs().max()),
                         "stem_out_at_largest": float((stem.abs() >= largest).float().mean()),
                         "stem_batch_mean_absmax": float(stem.mean((0, 2, 3)).abs().max()),
                         "stem_batch_sd_max": float(stem.var((0, 2, 3)).sqrt().max()),
                         "stem_bn_running_mean_absmax": float(norm.running_mean.abs().max()),
                         "stem_bn_running_var_max": float(norm.running_var.max()),
                         "stem_bn_lag_sd": float(((stem.mean((0, 2, 3)) - norm.running_mean).abs()
                                                  / (norm.running_var + norm.eps).sqrt()).max()),
                         "stem_weight_norm": float(model.stem.weight.norm())})
            skipped, overflowed = wrapped.scaler.skipped_steps, total
    return pd.DataFrame(rows)


def table_runs(policies: dict, data, steps: int, seeds: list[int], config: ProxyConfig, drop: float) -> pd.DataFrame:
    """Every reading of each policy and seed, three ways (see the module docstring)."""
    rows: list[dict] = []
    read_model = trainer.read_model

    def three_ways(model, data, device, **options):
        """The trainer's reading, and before it the running averages' (kept for the next reading: a run read
        before this change never recomputed them)."""
        running = evaluate(model, data[1], device, options["eval_batch_size"])[0]
        kept = {name: buffer.clone() for name, buffer in model.named_buffers()}
        reading = read_model(model, data, device, **options)
        for name, buffer in model.named_buffers():
            buffer.copy_(kept[name])
        rows[-1]["readings"].append((running, reading))
        return reading

    trainer.read_model = three_ways  # the trainer's own readings, each also taken before the statistics change
    try:
        for name, policy in policies.items():
            for seed in seeds:
                rows.append({"policy": name, "seed": seed, "readings": []})
                losses: list[float] = []
                result = trainer.train(MODEL, policy, data, steps, seed=seed, config=config,
                                       stop_on_divergence=False,
                                       report=lambda step, loss, kept=losses: kept.append(loss),
                                       eval_every=len(data[0]) // config.batch_size)
                readings = rows[-1].pop("readings")
                running, reading = readings[-1]
                rows[-1].update(readings=len(readings),
                                off_running=sum(abs(ran - read.batch_stats_accuracy) > drop for ran, read in readings),
                                off_recomputed=sum(flagged(read.accuracy, read.batch_stats_accuracy, drop)
                                                   for _, read in readings),
                                train_loss=sum(losses[-64:]) / len(losses[-64:]), eval_running=running,
                                eval_recomputed=reading.accuracy, batch_stats=reading.batch_stats_accuracy,
                                flagged=flagged(reading.accuracy, reading.batch_stats_accuracy, drop),
                                skipped_steps=result.skipped_steps)
                print(pd.DataFrame(rows[-1:]).to_string(index=False, header=len(rows) == 1), flush=True)
    finally:
        trainer.read_model = read_model
    return pd.DataFrame(rows)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trace", action="store_true", help="the step-by-step trace of wang_fp8 on one seed")
    parser.add_argument("--seeds", default="101,102")
    parser.add_argument("--steps", type=int, default=1200)
    parser.add_argument("--lr", type=float, default=PAPER_LR)
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    torch.set_num_threads(1)
    space = paper_space().with_proxy(**PROXY)
    context = SearchContext.create(MODEL, space, DataSpec(DATA), Budget(), 0, "cpu")
    config = dataclasses.replace(space.proxy, report_every=1, lr=args.lr)
    policies = demo_policies(context)
    seeds = [int(seed) for seed in args.seeds.split(",")]
    if args.trace:
        frame = trace_run(policies["wang_fp8"], context.data, args.steps, seeds[0], config)
        frame.to_csv(args.out / f"bn_statistics_trace_lr{args.lr:g}.csv", index=False, float_format="%.6g")
        print(frame.iloc[::25].to_string(index=False))
        return 0
    frame = table_runs(policies, context.data, args.steps, seeds, config, context.budget.drop)
    frame.to_csv(args.out / f"bn_statistics_lr{args.lr:g}.csv", index=False, float_format="%.6g")
    return 0


if __name__ == "__main__":
    sys.exit(main())
