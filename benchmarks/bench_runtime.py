"""Cost of training under a policy, and the memory it really saves.

1. One SGD training step (forward, backward, step) of ResNet-18 (CIFAR form, width 0.25, batch 64) under the
   paper's all-low policy (weights and activations e4m3b4s, activation gradients e5m2s, weight gradients
   e6m9s, high e6m9s, promotion guard on, dynamic loss scaling) as a ratio to the plain fp32 step timed in
   the same run: steps alternate between the two models, medians after warm-up. Goal: <= 1.5x. (The
   paper's style of simulation, QPyTorch rounding in module hooks, measured 5.9x on a 2-core CPU machine.)
2. Bytes autograd saves for backward after one forward under several policies, measured (packed storages,
   each once) against the fp32 model's measured bytes and against the cost model's prediction.

Usage: python benchmarks/bench_runtime.py [--steps 7] [--warmup 3] [--eager]
``--eager`` sets PRECSEARCH_COMPILE=0 (the quantizer's torch.compile path off) before precsearch is imported.
"""

from __future__ import annotations

import argparse
import copy
import os
import statistics
import sys
import time


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=7, help="timed steps per model (median reported)")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps per model first (compiles)")
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--width", type=float, default=0.25)
    parser.add_argument("--eager", action="store_true", help="disable the quantizer's torch.compile path")
    args = parser.parse_args()
    if args.eager:
        os.environ["PRECSEARCH_COMPILE"] = "0"

    import torch
    import torch.nn.functional as F

    from precsearch.cost import CostModel, measure_saved_bytes
    from precsearch.formats import COMPILE_MIN_NUMEL
    from precsearch.graph import trace
    from precsearch.models import build
    from precsearch.policy import PAPER_OVERFLOW, Policy, baseline
    from precsearch.runtime import apply_policy

    torch.manual_seed(0)
    plain = build("resnet18", width=args.width)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(args.batch, 3, 32, 32, generator=g)
    y = torch.randint(0, 10, (args.batch,), generator=g)
    graph = trace(plain, x[:2], batch_size=args.batch)
    all_low = {"weight": "e4m3b4s", "activation": "e4m3b4s", "activation_grad": "e5m2s", "weight_grad": "e6m9s"}
    paper_low = Policy.from_assignment(
        graph, {tid: all_low[graph.tensors[tid].kind] for tid in graph.assignable_ids()},
        high_format="e6m9s", overflow=dict(PAPER_OVERFLOW), loss_scaling={"mode": "dynamic", "init_scale": 2.0**16},
        promotion_threshold=0.01, provenance={"strategy": "all-low"},
    )

    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, "
          f"quantizer compile {'off' if args.eager else f'on (tensors >= {COMPILE_MIN_NUMEL:,} elements)'}")
    print(f"ResNet-18 width {args.width}, batch {args.batch}, SGD(lr=0.1, momentum=0.9, wd=5e-4)\n")

    wrapped = apply_policy(copy.deepcopy(plain), paper_low)
    steps = {}
    for name, model in (("fp32", plain), ("all-low", wrapped)):
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=5e-4)
        scaler = getattr(model, "scaler", None)

        def step(model=model, optimizer=optimizer, scaler=scaler) -> None:
            optimizer.zero_grad(set_to_none=True)
            loss = F.cross_entropy(model(x), y)
            if scaler is None:
                loss.backward()
                optimizer.step()
            else:
                scaler.scale(loss).backward()
                scaler.step(optimizer)
                scaler.update()

        steps[name] = step
    times: dict[str, list[float]] = {name: [] for name in steps}
    for index in range(args.warmup + args.steps):
        for name, step in steps.items():
            start = time.perf_counter()
            step()
            if index >= args.warmup:
                times[name].append(time.perf_counter() - start)
    base = statistics.median(times["fp32"])
    low = statistics.median(times["all-low"])
    print("1. training step time (median of", args.steps, "after", args.warmup, "warm-up steps, interleaved)")
    print(f"   fp32 plain model      {base * 1e3:8.1f} ms")
    print(f"   all-low paper policy  {low * 1e3:8.1f} ms   ratio {low / base:.2f}x (goal <= 1.5x; "
          f"QPyTorch in hooks: 5.9x)   promotions: {len(wrapped.promotions)}, "
          f"loss scale {wrapped.scaler.get_scale():g}\n")

    cost = CostModel(graph)
    fp32_measured = measure_saved_bytes(plain, x)
    policies = {
        "fp32": baseline("fp32", graph),
        "fp16": baseline("fp16", graph),
        "hfp8": baseline("hfp8", graph),
        "all-8-bit (all-low)": paper_low,
    }
    print("2. bytes autograd saves for backward after one forward (activations and byproducts, no weights)")
    print(f"   {'policy':22s} {'measured':>12s} {'vs fp32':>8s} {'predicted':>12s} {'meas/pred':>9s}"
          f" {'packed weights':>15s}")
    for name, policy in policies.items():
        model = apply_policy(copy.deepcopy(plain), policy)
        model(x)
        saved = model.saved_bytes()
        measured = saved.activation + saved.other
        predicted = cost.saved_activation_bytes(policy.assignment(graph))
        print(f"   {name:22s} {measured:12,d} {measured / fp32_measured:7.3f}x {predicted:12,d} "
              f"{measured / predicted:9.4f} {saved.weight:15,d}")
    print(f"   (fp32 model measured by precsearch.cost.measure_saved_bytes: {fp32_measured:,d} bytes)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
