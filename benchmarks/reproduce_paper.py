"""Reproduce the memory-accuracy tradeoff of Lee, Sharma, Aiken (TMLR 2023) at a scale this machine affords.

    python benchmarks/reproduce_paper.py --threads 1 --eager-kernels   # CPU scale (about 10 minutes)
    python benchmarks/reproduce_paper.py --cifar10 DIR    # full scale: CIFAR-10, ResNet-18, batch 128, 200 epochs,
                                                          # r step 0.1 (needs a GPU; untested at this scale)

CPU scale: the bundled digits at 12x12, ResNet-18 width 0.125, batch 64, 2 epochs (44 steps), r step 0.2.
``--eager-kernels`` there: at these sizes compiling the formats kernels costs more than it saves (the
stochastic kernels of wang_fp8 took 330 s to compile against 6 s of eager training).

Every method trains with the same recipe, the paper's (precsearch.train.trainer.PAPER_RECIPE: SGD lr 0.1, momentum
0.9, weight decay 5e-4, cosine per epoch, random crop + flip, Kaiming fan-out init) and the paper's numerics
(the HFP8 space: promotion of weights and activations after each step, loss scale from 2^16 doubling once per
epoch, per-use gradient rounding). Methods: the paper's technique at r = 0, 0.1, ..., 1 (the targets its
acceptance window [r, r + 0.1] keeps), and the baselines pi_op (HFP8, Sun et al.), fp8 (e5m2), fp16, mpt
(Micikevicius et al.) and wang_fp8 (Wang et al.), with fp32 as the reference.

Memory per method: the paper's measure (bytes of the assignable tensors, precsearch.cost.model) as a ratio to
pi_op's, the paper's x axis, and the measured peak of one training step (precsearch.cost.measured: CPU allocator
events, or CUDA's counters) as a ratio to plain fp32's. Writes benchmarks/results/reproduce_paper.csv and
reproduce_paper.png (one curve per method), and prints the table and which of the paper's claims hold here.
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from pathlib import Path

import pandas as pd
import torch
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from precsearch.config.policy import Policy
from precsearch.config.spaces import paper_space
from precsearch.config.spec import ProxyConfig
from precsearch.cost.measured import measure_peak, sgd_step
from precsearch.formats.runner import default_runtime
from precsearch.runtime.model import apply_policy
from precsearch.search.context import Budget, DataSpec, SearchContext
from precsearch.search.strategies import ACCEPTANCE_WINDOW, baseline_policies, sweep
from precsearch.train.trainer import PAPER_LR, PAPER_RECIPE, build_model, kaiming_fan_out_, train

RESULTS = Path(__file__).parent / "results"
BASELINES = ("fp32", "hfp8", "fp8", "fp16", "mpt", "wang_fp8")
LABELS = {"hfp8": "pi_op (HFP8)", "fp8": "fp8 (e5m2)", "fp16": "fp16", "mpt": "mpt (Micikevicius)",
          "wang_fp8": "Wang fp8", "fp32": "fp32"}
ACCURACY_TOLERANCE = 0.01  # "preserving accuracy": within 1 point of pi_op's validation accuracy


def _scale(args: argparse.Namespace) -> dict:
    """The experiment's size: the paper's with --cifar10, else what a 2-core CPU trains in minutes."""
    if args.cifar10:
        return {"model": "resnet18", "data": DataSpec("cifar10", args.cifar10), "image_size": 32, "batch": 128,
                "epochs": args.epochs or 200.0}
    return {"model": f"resnet18:width={args.width}", "data": DataSpec("digits"), "image_size": 12, "batch": 64,
            "epochs": args.epochs or 2.0}


def _policies(context: SearchContext, r_step: float) -> dict[str, Policy]:
    """Baselines and the paper's sweep (the targets its acceptance window keeps), by name."""
    policies = dict(baseline_policies(context.graph, BASELINES))
    targets = [round(r_step * i, 2) for i in range(round(1 / r_step) + 1)]
    for candidate in sweep(context.graph, context.space, targets, window=ACCEPTANCE_WINDOW):
        policies[f"paper r={candidate.r:.1f}"] = context.policy(candidate.assignment,
                                                                {"strategy": "paper", "r": candidate.r})
    return policies


def _measured_peak(context: SearchContext, model_spec: str, policy: Policy | None, device: torch.device) -> int:
    """Peak bytes of one training step (forward, backward, SGD) above what is live before it."""
    train_set = context.data[0]
    torch.manual_seed(0)
    model = build_model(model_spec, num_classes=train_set.num_classes)
    kaiming_fan_out_(model)
    if policy is not None:
        model = apply_policy(model, policy, steps_per_epoch=1)
    model = model.to(device)
    batch = context.space.proxy.batch_size
    x, y = train_set.images[:batch].to(device), train_set.labels[:batch].to(device)
    step = sgd_step(model, torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9, weight_decay=5e-4), x, y)
    step()  # momentum buffers, compiled kernels
    return measure_peak(step, device)


def run(args: argparse.Namespace) -> pd.DataFrame:
    scale = _scale(args)
    device = torch.device(args.device)
    space = paper_space(proxy={"batch_size": scale["batch"], "image_size": scale["image_size"], "lr": PAPER_LR,
                               "eval_batch_size": 512})
    context = SearchContext.create(scale["model"], space, scale["data"], Budget(), args.seed, str(device))
    per_epoch = len(context.data[0]) // scale["batch"]
    steps = max(1, round(scale["epochs"] * per_epoch))
    config = _run_config(space.proxy, steps)
    print(f"{scale['model']} on {scale['data'].name} {scale['image_size']}x{scale['image_size']}, batch "
          f"{scale['batch']}, {steps} steps ({scale['epochs']:g} epochs of {per_epoch}), seed {args.seed}, "
          f"{device}, {torch.get_num_threads()} thread(s)")
    policies = _policies(context, args.r_step or (0.1 if args.cifar10 else 0.2))
    pi_op_bytes = context.cost.bytes(policies["hfp8"].assignment(context.graph))
    fp32_bytes = context.cost.bytes({})
    plain_peak = _measured_peak(context, scale["model"], None, device)
    rows = []
    for name, policy in policies.items():
        start = time.perf_counter()
        result = train(scale["model"], policy, context.data, steps, seed=args.seed, device=str(device),
                       config=config, recipe=PAPER_RECIPE)
        size = context.cost.bytes(policy.assignment(context.graph))
        rows.append({
            "method": "paper" if name.startswith("paper") else name, "name": name,
            "r": float(name.split("=")[1]) if name.startswith("paper") else math.nan,
            "bytes_vs_pi_op": size / pi_op_bytes, "bytes_vs_fp32": size / fp32_bytes,
            "peak_vs_fp32": _measured_peak(context, scale["model"], policy, device) / plain_peak,
            "val_accuracy": result.val_accuracy, "diverged": result.diverged, "reason": result.reason,
            "promotions": len(result.promotions), "final_loss_scale": result.final_loss_scale,
            "seconds": time.perf_counter() - start,
        })
        print(f"  {name}: accuracy {result.val_accuracy:.4f}{' (diverged)' if result.diverged else ''}, "
              f"bytes {size / pi_op_bytes:.2f}x pi_op, {rows[-1]['seconds']:.0f} s", flush=True)
    return pd.DataFrame(rows)


def _run_config(proxy: ProxyConfig, steps: int) -> ProxyConfig:
    """The space's proxy settings for a run of ``steps`` (statistics off: they cost passes and reads)."""
    return ProxyConfig(**{**{key: getattr(proxy, key) for key in ProxyConfig.KEYS}, "steps": steps,
                          "stats_every": 10**9, "max_skipped_fraction": 1.0})


def claims(table: pd.DataFrame) -> list[tuple[str, str, str]]:
    """Each of the paper's claims: whether it holds here, and the figures that say so."""
    pi_op = table[table["name"] == "hfp8"].iloc[0]
    paper = table[table["method"] == "paper"]
    kept = paper[(paper["bytes_vs_pi_op"] <= 0.5) & ~paper["diverged"]
                 & (paper["val_accuracy"] >= pi_op["val_accuracy"] - ACCURACY_TOLERANCE)]
    best = kept.sort_values("bytes_vs_pi_op").iloc[0] if len(kept) else None
    memory = (">2x memory reduction over a baseline assignment (pi_op) while preserving accuracy",
              "holds" if best is not None else "does not hold",
              f"{best['name']}: {1 / best['bytes_vs_pi_op']:.1f}x less than pi_op, accuracy "
              f"{best['val_accuracy']:.4f} vs {pi_op['val_accuracy']:.4f}" if best is not None else
              f"no sweep point at <= 0.5x pi_op within {ACCURACY_TOLERANCE:.0%} of its accuracy")
    diverged = table[(table["method"] != "paper") & table["diverged"]]["name"].tolist()
    paper_diverged = paper[paper["diverged"]]["name"].tolist()
    if paper_diverged:
        verdict = "does not hold"
    elif diverged:
        verdict = "holds"
    else:
        verdict = "not tested (no baseline diverged at this scale)"
    divergence = ("avoids divergence where other baselines diverge", verdict,
                  f"baselines diverged: {', '.join(diverged) or 'none'}; sweep points diverged: "
                  f"{', '.join(paper_diverged) or 'none'}")
    return [memory, divergence]


def plot(table: pd.DataFrame, path: Path, title: str) -> None:
    """The paper's figure: memory ratio (vs pi_op) on x, validation accuracy on y, one curve per method."""
    figure = Figure(figsize=(7, 4.5))
    FigureCanvasAgg(figure)
    axes = figure.add_subplot()
    paper = table[table["method"] == "paper"].sort_values("bytes_vs_pi_op")
    axes.plot(paper["bytes_vs_pi_op"], 100 * paper["val_accuracy"], "o-", color="black", label="paper (r = 0..1)")
    for _, row in paper.iterrows():
        axes.annotate(f"{row['r']:.1f}", (row["bytes_vs_pi_op"], 100 * row["val_accuracy"]), fontsize=7,
                      textcoords="offset points", xytext=(3, 3))
    for _, row in table[table["method"] != "paper"].iterrows():
        marker = "x" if row["diverged"] else "s"
        axes.plot(row["bytes_vs_pi_op"], 100 * row["val_accuracy"], marker, markersize=8,
                  label=LABELS[row["name"]] + (" (diverged)" if row["diverged"] else ""))
    axes.set_xlabel("memory ratio (bytes of training tensors / pi_op's)")
    axes.set_ylabel("validation accuracy (%)")
    axes.set_title(title, fontsize=9)
    axes.grid(alpha=0.3)
    axes.legend(fontsize=7, loc="lower right")
    figure.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=110)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cifar10", default=None, metavar="DIR", help="local CIFAR-10 (python pickles): full scale")
    parser.add_argument("--epochs", type=float, default=None, help="epochs (default 2 here, 200 with --cifar10)")
    parser.add_argument("--width", type=float, default=0.125, help="ResNet-18 width at CPU scale")
    parser.add_argument("--r-step", type=float, default=None, help="sweep step (default 0.2 here, 0.1 full)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (1 while others share the CPU)")
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument("--eager-kernels", action="store_true", help="the format kernels uncompiled (small tensors)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    start = time.perf_counter()
    with default_runtime().kernels.configured(enabled=not args.eager_kernels):
        table = run(args)
    wall = time.perf_counter() - start
    args.out.mkdir(parents=True, exist_ok=True)
    table.to_csv(args.out / "reproduce_paper.csv", index=False)
    title = f"{'CIFAR-10' if args.cifar10 else 'digits 12x12'}, seed {args.seed}, {wall / 60:.0f} min"
    plot(table, args.out / "reproduce_paper.png", title)
    print("\n| method | memory (bytes) / pi_op | memory (bytes) / fp32 | measured peak / fp32 | val accuracy | "
          "diverged | promotions |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for _, row in table.iterrows():
        print(f"| {row['name']} | {row['bytes_vs_pi_op']:.2f} | {row['bytes_vs_fp32']:.2f} | "
              f"{row['peak_vs_fp32']:.2f} | {row['val_accuracy']:.4f} | {'yes' if row['diverged'] else 'no'} | "
              f"{row['promotions']} |")
    print("\n| the paper's claim | here | figures |")
    print("| --- | --- | --- |")
    for claim, verdict, figures in claims(table):
        print(f"| {claim} | {verdict} | {figures} |")
    print(f"\nwall time {wall:.0f} s; wrote {args.out / 'reproduce_paper.csv'} and {args.out / 'reproduce_paper.png'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
