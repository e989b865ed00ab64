"""Reproduce AdaComp's claim (Chen et al., AAAI 2018) at CPU scale: 2 gloo processes, a small CNN, digits.

    python benchmarks/reproduce_adacomp.py                         # ResNet-18 width 0.125, fp32 and all-low
    python benchmarks/reproduce_adacomp.py --model reproduce_adacomp:fc_cnn   # a CNN with a large FC layer

The paper: with bin lengths 50 (convolutions) and 500 (fully connected layers), about 40x compression of
convolution gradients and about 200x of fully connected ones, with no loss of accuracy. Here the same
training (the search's proxy recipe: SGD, momentum 0.9, weight decay 5e-4, cosine, lr 0.2, global batch 64
on 16x16 digits, equal steps and seed) runs with plain all-reduce and with AdaComp, in fp32 and under the
paper's all-low precision policy (Lee et al.'s r = 1: every group low). Ratios are gradient bytes over the
bytes AdaComp's payload needs (8 per layer + 4 per sent element), summed over both processes and all steps;
"wire" also counts the size exchange and the padding of variable-length payloads.
"""

from __future__ import annotations

import argparse
import logging

from torch import nn

from precsearch.config.spaces import paper_space
from precsearch.search.context import Budget, DataSpec, SearchContext
from precsearch.search.strategies import uniform
from precsearch.train.data_parallel import compression_by_type, train_data_parallel

PAPER = {"conv": "~40x", "fc": "~200x", "accuracy": "no loss"}


def fc_cnn(num_classes: int = 10) -> nn.Module:
    """Two conv stages and a 512-256-classes FC head (131k of its 140k weights fully connected), like the
    paper's small CIFAR-10 CNNs: the zoo's models end in one small Linear, which says little about FC layers."""
    def stage(cin: int, cout: int) -> list[nn.Module]:
        return [nn.Conv2d(cin, cout, 3, padding=1, bias=False), nn.BatchNorm2d(cout), nn.ReLU(), nn.MaxPool2d(2)]

    return nn.Sequential(*stage(3, 16), *stage(16, 32), nn.Flatten(), nn.Linear(32 * 4 * 4, 256), nn.ReLU(),
                         nn.Linear(256, num_classes))


def all_low_policy(model: str, data, seed: int):
    """The paper's all-low policy for ``model``, made the way the search makes its policies."""
    context = SearchContext.create(model, paper_space(), DataSpec(), Budget(), seed, "cpu", data=data)
    return context.policy(uniform(context.graph, context.space, "low").assignment, {"strategy": "all-low"})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="resnet18:width=0.125")
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--no-low", action="store_true", help="fp32 only, without the all-low policy")
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING, format="%(message)s")

    space = paper_space()
    config = space.proxy
    data = DataSpec().load(config.image_size)
    policies = {"fp32": None} if args.no_low else {"fp32": None, "all-low": all_low_policy(args.model, data,
                                                                                          args.seed)}
    print(f"{args.model}, digits {config.image_size}x{config.image_size}, {args.nproc} gloo processes, global "
          f"batch {config.batch_size}, {args.steps} steps, seed {args.seed}; bins conv 50, fc 500, other 50\n")
    print(f"{'precision':9} {'exchange':10} {'val acc':>8} {'vs plain':>9} {'conv':>7} {'fc':>7} {'other':>7} "
          f"{'all':>7} {'wire':>7} {'time':>7}")
    for name, policy in policies.items():
        plain = None
        for compress in ("none", "adacomp"):
            result = train_data_parallel(args.model, policy, data, args.steps, nproc=args.nproc, compress=compress,
                                         seed=args.seed, config=config)
            plain = plain if plain is not None else result.val_accuracy
            ratios = ["-"] * 5
            if result.compression is not None:
                by_type = compression_by_type(result.compression)
                wire = by_type.loc["all", "dense_bytes"] / result.wire_bytes
                ratios = [f"{by_type.loc[kind, 'ratio']:.1f}x" if kind in by_type.index else "-"
                          for kind in ("conv", "fc", "other", "all")] + [f"{wire:.1f}x"]
            delta = f"{100 * (result.val_accuracy - plain):+.2f} pt"
            print(f"{name:9} {compress:10} {100 * result.val_accuracy:7.2f}% {delta:>9} "
                  + " ".join(f"{ratio:>7}" for ratio in ratios) + f" {result.wall_time:6.1f}s")
    print(f"\npaper (Chen et al. 2018): conv {PAPER['conv']}, fc {PAPER['fc']}, {PAPER['accuracy']} in accuracy")


if __name__ == "__main__":
    main()
