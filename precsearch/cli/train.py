"""`precsearch train MODEL [--policy FILE] ...`: full training under a policy (without one: plain fp32, the
yardstick a pick is held against), metrics to a CSV.

With ``--nproc N`` it trains data-parallel in N processes (precsearch.train.data_parallel), with or without a
policy, and ``--compress adacomp`` (or a policy's ``compression``) compresses their gradient exchange.
"""

from __future__ import annotations

import argparse
from typing import Any

from precsearch.cli._arguments import add_compile_argument, add_data_arguments, choose_compile, count, path, real
from precsearch.config.spec import COMPRESSIONS, ProxyConfig
from precsearch.errors import PrecsearchError
from precsearch.train.trainer import PAPER_LR

DEFAULT_BATCH = 64  # without --batch-size and a policy that names one
DEFAULT_EPOCHS = 10

HELP = "train a model under a policy file, or in plain fp32 without one"
DESCRIPTION = ("Train MODEL under a policy (e.g. a search's best.json) with the paper's recipe (SGD lr 0.1, "
               "momentum 0.9, weight decay 5e-4, cosine per epoch, random crop + flip, Kaiming fan-out "
               "init); validation accuracy and loss go to --metrics after every evaluation.")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model", metavar="MODEL", help="the model the policy was made for (e.g. tiny_cnn)")
    add_compile_argument(parser)
    parser.add_argument("--policy", type=path, default=None, metavar="FILE",
                        help="policy JSON file (default: none, plain fp32 training)")
    parser.add_argument("--nproc", type=count, default=None, metavar="N",
                        help="train in N data-parallel processes (gloo on CPU, nccl on CUDA); --batch-size is "
                             "the global batch")
    parser.add_argument("--compress", choices=COMPRESSIONS, default=None,
                        help="gradient exchange with --nproc: none (all-reduce) or adacomp (default: the "
                             "policy's compression, else none)")
    length = parser.add_mutually_exclusive_group()
    length.add_argument("--steps", type=count, default=None, metavar="N", help="SGD steps")
    length.add_argument("--epochs", type=real(0, open_low=True), default=None, metavar="E",
                        help=f"epochs (default {DEFAULT_EPOCHS})")
    recipe = ProxyConfig()
    parser.add_argument("--recipe", choices=("paper", "proxy"), default="paper",
                        help="paper: the reference recipe (augmentation, Kaiming fan-out init, cosine per epoch); "
                             "proxy: a search proxy's (none of these, cosine per step)")
    parser.add_argument("--lr", type=real(0, open_low=True), default=PAPER_LR,
                        help=f"peak learning rate (default {PAPER_LR})")
    parser.add_argument("--momentum", type=real(0, 1, open_high=True), default=recipe.momentum,
                        help=f"SGD momentum in [0, 1) (default {recipe.momentum})")
    parser.add_argument("--weight-decay", type=real(0), default=recipe.weight_decay,
                        help=f"L2 weight decay >= 0 (default {recipe.weight_decay})")
    parser.add_argument("--eval-every", type=count, default=None, metavar="N",
                        help="evaluate every N steps (default: every epoch)")
    parser.add_argument("--metrics", type=path, default=None, metavar="CSV", help="write metrics to this CSV file")
    parser.add_argument("--finer-slices", action="store_true",
                        help="run the policy's sliced backwards that set the step's predicted peak in more slices "
                             "(CostModel.finer_slices): a lower peak for a slower step (README, 'Peak memory'); "
                             "an eager step on a CPU, in one process")
    add_data_arguments(parser)


def run(args: argparse.Namespace) -> int:
    import torch

    from precsearch.config.policy import Policy
    from precsearch.cost.model import finer_slices
    from precsearch.models import check_fits, is_spec, same_model
    from precsearch.train.data import load_dataset
    from precsearch.train.trainer import PAPER_RECIPE, resolve_device, train_policy

    device = resolve_device(args.device)  # before the data is loaded
    _check_finer_slices(args, device)
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    if args.compress is not None and args.nproc is None:
        raise PrecsearchError(f"--compress {args.compress} needs --nproc N (the data-parallel processes)")
    policy = Policy.load(args.policy) if args.policy is not None else None
    if policy is not None and policy.input_shape is None:
        raise PrecsearchError(f"policy {args.policy} has no input_shape; make it with precsearch search")
    # a class name (a policy made in Python) is left to apply_policy, which checks the traced structure
    if policy is not None and is_spec(policy.model) and not same_model(policy.model, args.model):
        raise PrecsearchError(f"policy {args.policy} was made for model {policy.model!r}, not {args.model!r}; give "
                              f"the model it was made for, or make a policy for {args.model} with precsearch search")
    image_size = _given_or(args.image_size, policy.input_shape[-1] if policy is not None else ProxyConfig().image_size)
    batch_size = _given_or(args.batch_size, policy.batch_size if policy is not None else None, DEFAULT_BATCH)
    check_fits(args.model, batch_size, image_size)  # before the data is loaded at that size
    data = load_dataset(args.data, root=args.data_root, image_size=image_size)
    per_epoch = max(1, len(data[0]) // batch_size)
    steps = _given_or(args.steps, max(1, round(_given_or(args.epochs, DEFAULT_EPOCHS) * per_epoch)))
    config = ProxyConfig(steps=steps, batch_size=batch_size, image_size=image_size, lr=args.lr,
                         momentum=args.momentum, weight_decay=args.weight_decay)
    if args.nproc is not None:
        return _run_data_parallel(args, policy, data, steps, config)
    result = train_policy(args.model, policy, data, steps, seed=args.seed, device=args.device, config=config,
                          compile=choose_compile(args, steps), eval_every=args.eval_every, metrics=args.metrics,
                          recipe=PAPER_RECIPE if args.recipe == "paper" else None,
                          slices=finer_slices if args.finer_slices else None)
    status = f"diverged ({result.reason})" if result.diverged else "trained"
    status += "" if policy is not None else " in plain fp32 (no policy)"
    print(f"{status}: {result.steps_run} steps in {result.wall_time:.1f} s; validation accuracy "
          f"{result.val_accuracy:.4f}, loss {result.val_loss:.4f}; {len(result.promotions)} promotion(s)")
    if args.metrics:
        print(f"metrics: {args.metrics}")
    return 0


def _check_finer_slices(args: argparse.Namespace, device: Any) -> None:
    """``--finer-slices`` slices a policy's eager backward on a CPU, in one process: anything else is refused."""
    if not args.finer_slices:
        return
    refused = {"--policy FILE (plain fp32 has no sliced backwards)": args.policy is None,
               "no --compile (the compiled step keeps the op rules' slices)": args.compile,
               "no --nproc (one process)": args.nproc is not None,
               "--device cpu (the backwards slice on a CPU only)": device.type != "cpu"}
    for needs, refuse in refused.items():
        if refuse:
            raise PrecsearchError(f"--finer-slices needs {needs}")


def _given_or(given: Any, *defaults: Any) -> Any:
    """The value the user gave (the argparse types refused any unusable one), else the first default set; a 0
    the user typed is never replaced."""
    return next(value for value in (given, *defaults) if value is not None)


def _run_data_parallel(args: argparse.Namespace, policy: Any, data: Any, steps: int, config: ProxyConfig) -> int:
    from precsearch.train.data_parallel import compression_by_type, train_data_parallel

    result = train_data_parallel(args.model, policy, data, steps, nproc=args.nproc, compress=args.compress,
                                 seed=args.seed, device=args.device, config=config, eval_every=args.eval_every,
                                 metrics=args.metrics, threads=args.threads)
    print(f"trained in {result.nproc} processes ({result.compress}): {result.steps_run} steps in "
          f"{result.wall_time:.1f} s; validation accuracy {result.val_accuracy:.4f}, loss {result.val_loss:.4f}")
    if result.compression is not None:
        by_type = compression_by_type(result.compression)
        figures = [f"{kind} {ratio:.1f}x" for kind, ratio in by_type["ratio"].items()]
        print(f"compression (dense / sent bytes): {', '.join(figures)}")
    if args.metrics:
        print(f"metrics: {args.metrics}")
    return 0
