"""Cost of training under a policy: step time against plain fp32, measured side by side in one run.

1. One SGD training step (forward, backward, step; SGD lr 0.1, momentum 0.9, wd 5e-4) of ResNet-18 (CIFAR form)
   under each policy, eager and compiled, as ratios to the plain fp32 model's eager step and to its
   ``torch.compile``-d step timed in the same run: steps alternate between the models (interleaved), medians
   after warm-up. Compiled rows: plain ``torch.compile(model, fullgraph=True)``; a policy through
   ``apply_policy(compile=True)`` (precsearch.runtime.compiled, saving codes for the backward: one compiled graph
   serves the policies of the model with the same code widths; each other plan compiles its own). Per row: its
   first step (the compile, where it compiles), the ops it runs a step (eager: aten ops dispatched, counted by
   a ``TorchDispatchMode``; compiled: the kernels in the code Inductor wrote for the forward and backward, each
   run once a step, besides the convolutions' library calls; each site's rounding is one opaque pass of its
   own, precsearch.runtime.compiled_ops). The machine's CPU model and vector flags head the output. Goal:
   compiled all-low and hfp8 <= 1.5x compiled plain fp32. Rows: plain fp32; plain under
   ``torch.autocast(bfloat16)`` (CUDA); the fp32 policy through ``apply_policy``; the fp16, bf16 and hfp8
   baselines; the paper's all-low policy (weights and activations e4m3b4s, activation gradients e5m2s,
   weight gradients e6m9s, high e6m9s, promotion guard on, dynamic loss scaling); ``all-high`` (every tensor the
   paper's high format, e6m9s: what a search's reference trains; not in the default rows); and, when QPyTorch is
   importable, the paper's own style (QPyTorch ``float_quantize`` e5m2 in module hooks). On CUDA each row
   also gives ``torch.cuda.max_memory_allocated()`` during a step above what was allocated before it.
   ``--proxy-graph``: the compiled policy rows save float32, as a search's proxies do (one graph for every
   assignment), instead of codes. ``--threads N``: torch's intra-op threads (a search worker of ``--jobs 2`` on
   2 cores has one).
2. Rounding 2^28 values (CUDA; 2^24 on CPU): nearest and stochastic e5m2 (``precsearch.formats.kernels.quantize``)
   against torch's native float8_e5m2 cast round trip. Goal: stochastic <= 1.5x the native cast.
3. Bytes autograd saves for backward after one forward under several policies, measured (packed storages,
   each once) against the fp32 model's measured bytes and against the cost model's prediction.

Usage: python benchmarks/bench_runtime.py [--device cpu|cuda] [--model resnet18] [--width W] [--image-size 32]
       [--batch N] [--steps 7] [--warmup 3] [--threads N]
       [--policies fp32,fp16,bf16,hfp8,all-low,all-high] [--no-compiled] [--proxy-graph] [--sections 1,2,3]
Defaults: CPU ResNet-18 width 0.25 batch 64; CUDA width 1.0 batch 128.
"""

from __future__ import annotations

import argparse
import copy
import os
import statistics
import sys
import time
from collections.abc import Callable


def _sync(device: str) -> None:
    import torch

    if device == "cuda":
        torch.cuda.synchronize()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--steps", type=int, default=7, help="timed steps per model (median reported)")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps per model first (compiles)")
    parser.add_argument("--batch", type=int, default=None)
    parser.add_argument("--width", type=float, default=None, help="ResNet-18's width (other models: none)")
    parser.add_argument("--model", default="resnet18", help="zoo model (default resnet18)")
    parser.add_argument("--image-size", type=int, default=32)
    parser.add_argument("--policies", default="fp32,fp16,bf16,hfp8,all-low",
                        help="comma-separated rows beside plain fp32 (default: all)")
    parser.add_argument("--no-compiled", action="store_true", help="eager rows only")
    parser.add_argument("--proxy-graph", action="store_true",
                        help="compiled policy rows save float32, as a search's proxies (default: codes)")
    parser.add_argument("--threads", type=int, default=None, help="torch's intra-op threads (default: torch's)")
    parser.add_argument("--sections", default="1,2,3", help="which sections to run (default: 1,2,3)")
    args = parser.parse_args()
    sections = {part.strip() for part in args.sections.split(",")}
    device = args.device
    width = args.width if args.width is not None else (1.0 if device == "cuda" else 0.25)
    batch = args.batch if args.batch is not None else (128 if device == "cuda" else 64)

    import torch

    if args.threads is not None:
        torch.set_num_threads(args.threads)

    from precsearch.config.compiling import CompileOptions
    from precsearch.config.spec import PAPER_OVERFLOW
    from precsearch.cost.measured import sgd_step
    from precsearch.cost.model import CostModel, measure_saved_bytes
    from precsearch.cost.policies import policy_from_assignment
    from precsearch.graph.tracing import trace
    from precsearch.models import build
    from precsearch.runtime.model import apply_policy
    from precsearch.search.strategies import baseline

    if device == "cuda" and not torch.cuda.is_available():
        print("--device cuda: CUDA is not available here", file=sys.stderr)
        return 2
    torch.manual_seed(0)
    plain = build(args.model, **({"width": width} if args.model == "resnet18" else {})).to(device)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(batch, 3, args.image_size, args.image_size, generator=g).to(device)
    y = torch.randint(0, 10, (batch,), generator=g).to(device)
    graph = trace(plain, x[:2], batch_size=batch)
    all_low = {"weight": "e4m3b4s", "activation": "e4m3b4s", "activation_grad": "e5m2s", "weight_grad": "e6m9s"}
    policies = {
        name: baseline(name, graph) for name in ("fp32", "fp16", "bf16", "hfp8")
    }
    for name, formats in (("all-low", all_low), ("all-high", dict.fromkeys(all_low, "e6m9s"))):
        policies[name] = policy_from_assignment(
            graph, {tid: formats[graph.tensors[tid].kind] for tid in graph.assignable_ids()},
            high_format="e6m9s", overflow=dict(PAPER_OVERFLOW),
            loss_scaling={"mode": "dynamic", "init_scale": 2.0**16}, promotion_threshold=0.01,
            provenance={"strategy": name},
        )
    chosen = [name.strip() for name in args.policies.split(",") if name.strip()]

    name_of = torch.cuda.get_device_name() if device == "cuda" else f"CPU, {torch.get_num_threads()} threads"
    print(f"torch {torch.__version__}, {name_of}")
    print(_cpu_line())
    model = f"ResNet-18 width {width}" if args.model == "resnet18" else args.model
    print(f"{model}, {args.image_size}x{args.image_size}, batch {batch}, SGD(lr=0.1, momentum=0.9, wd=5e-4)\n")
    if "1" in sections:
        compile_options = CompileOptions(saves_codes=False) if args.proxy_graph else True
        _bench_steps(args, device, plain, x, y, policies, chosen, apply_policy, sgd_step, compile_options)
    if "2" in sections:
        _bench_quantize(device)
    if "3" in sections:
        _bench_saved(plain, x, graph, policies, chosen, apply_policy, CostModel, measure_saved_bytes)
    return 0


def _cpu_line() -> str:
    """The CPU's model name, the vector ISA torch's kernels use, and its vector flags (from /proc/cpuinfo)."""
    import platform

    import torch

    model, flags = platform.processor() or platform.machine(), set()
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            lines = cpuinfo.read().splitlines()
    except OSError:
        lines = []
    for line in lines:
        key, _, value = line.partition(":")
        if key.strip() == "model name":
            model = value.strip()
        elif key.strip() == "flags":
            flags = set(value.split())
    vector = sorted(f for f in flags if f.startswith(("avx", "amx", "fma", "f16c", "sse4")))
    return (f"CPU: {model}, {os.cpu_count()} cores; torch kernels use {torch.backends.cpu.get_cpu_capability()}; "
            f"flags: {' '.join(vector) or 'unknown'}")


def _kernels_written(step: Callable[[], object]) -> int:
    """Kernels in the code Inductor writes while ``step`` runs (0 when it compiles nothing): its own
    ``save_output_code`` hook, as ``torch._inductor.utils.run_and_get_code`` uses, without the latter's reset of
    everything compiled before."""
    from unittest import mock

    from torch._inductor.graph import GraphLowering

    codes: list[str] = []
    with mock.patch.object(GraphLowering, "save_output_code", codes.append):
        step()
    return sum(code.count("async_compile.cpp_pybinding(") + code.count("async_compile.triton(") for code in codes)


def _dispatched_ops(step: Callable[[], object]) -> int:
    """aten ops one eager step dispatches."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Count(TorchDispatchMode):
        ops = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            Count.ops += 1
            return func(*args, **(kwargs or {}))

    with Count():
        step()
    return Count.ops


def _bench_steps(args, device, plain, x, y, policies, chosen, apply_policy, sgd_step,  # noqa: N803
                 compile_options) -> None:
    import torch

    def stepper(model, autocast: bool = False) -> Callable[[], object]:
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=5e-4)
        return sgd_step(model, optimizer, x, y, autocast=torch.bfloat16 if autocast else None)

    steps: dict[str, Callable[[], object]] = {"plain fp32": stepper(plain)}
    compiled_rows: set[str] = set()
    if not args.no_compiled:
        steps["plain fp32, compiled"] = stepper(torch.compile(copy.deepcopy(plain), fullgraph=True))
        compiled_rows.add("plain fp32, compiled")
    if device == "cuda":
        steps["plain, autocast bf16"] = stepper(copy.deepcopy(plain), autocast=True)
    wrapped_models = {}
    passes = 0
    for name in chosen:
        wrapped = apply_policy(copy.deepcopy(plain), policies[name])
        wrapped_models[name] = wrapped
        steps[f"{name} policy"] = stepper(wrapped)
        if not args.no_compiled:
            wrapped = apply_policy(copy.deepcopy(plain), policies[name], compile=compile_options)
            wrapped_models[f"{name}, compiled"] = wrapped
            steps[f"{name} policy, compiled"] = stepper(wrapped)
            compiled_rows.add(f"{name} policy, compiled")
            passes = wrapped.compiled_step.graph.passes if wrapped.compiled_step else passes
    qpytorch = _qpytorch_hooks(copy.deepcopy(plain))
    if qpytorch is not None:
        steps["QPyTorch e5m2 in hooks"] = stepper(qpytorch)

    times: dict[str, list[float]] = {name: [] for name in steps}
    first: dict[str, float] = {}
    kernels: dict[str, int] = {}
    peaks: dict[str, int] = {}
    for index in range(args.warmup + args.steps):
        for name, step in steps.items():
            if device == "cuda" and index == args.warmup:
                _sync(device)
                torch.cuda.reset_peak_memory_stats()
                before = torch.cuda.memory_allocated()
            _sync(device)
            start = time.perf_counter()
            if index == 0 and name in compiled_rows:  # the step that compiles: count the kernels Inductor wrote
                kernels[name] = _kernels_written(step)
            else:
                step()
            _sync(device)
            if index == 0:
                first[name] = time.perf_counter() - start
            if index >= args.warmup:
                times[name].append(time.perf_counter() - start)
            if device == "cuda" and index == args.warmup:
                peaks[name] = torch.cuda.max_memory_allocated() - before
    for name, step in steps.items():
        if name not in compiled_rows:
            kernels[name] = _dispatched_ops(step)
    shared = [name for name in compiled_rows if name != "plain fp32, compiled" and not kernels[name]]
    known = [kernels[other] for other in compiled_rows if other != "plain fp32, compiled" and kernels[other]]
    for name in shared:  # a policy served by the graph an earlier row compiled (none: Inductor's cache served it)
        kernels[name] = known[0] if known else 0
    base = statistics.median(times["plain fp32"])
    base_compiled = statistics.median(times["plain fp32, compiled"]) if compiled_rows else None
    print(f"1. training step, median of {args.steps} after {args.warmup} warm-up steps, interleaved")
    header = f"   {'step':30s} {'ms':>8s} {'x eager':>8s} {'x comp.':>8s} {'1st step s':>10s} {'ops/kernels':>12s}"
    header += f" {'pays after':>10s}"
    print(header + (f" {'peak MB':>9s} {'x fp32':>7s}" if peaks else ""))
    for name, samples in times.items():
        median = statistics.median(samples)
        versus = f"{median / base_compiled:8.2f}" if base_compiled else f"{'-':>8s}"
        count = f"{kernels[name]:,d}" + (" k" if name in compiled_rows else " op")
        pays = "-"
        eager_name = name.removesuffix(", compiled")
        if name in compiled_rows and eager_name in times:  # steps until the compile (its first step) is repaid
            saved = statistics.median(times[eager_name]) - median
            pays = f"{first[name] / saved:,.0f}" if saved > 0 else "never"
        line = (f"   {name:30s} {median * 1e3:8.1f} {median / base:8.2f} {versus} {first[name]:10.1f} {count:>12s}"
                f" {pays:>10s}")
        if peaks:
            line += f" {peaks[name] / 1e6:9.0f} {peaks[name] / peaks['plain fp32']:7.2f}"
        print(line)
    if compiled_rows:
        print(f"   (k: kernels in the code Inductor wrote for the step's forward and backward, convolutions' library "
              f"calls aside; op: aten ops dispatched; a compiled policy's step makes {passes} rounding passes; "
              f"a compiled row reuses the graph of an earlier one whose formats have the same code widths, else "
              f"compiles its own; pays after: steps "
              f"whose saving over the eager row repays the first step)")
    for name, wrapped in wrapped_models.items():
        if wrapped.promotions:
            print(f"   ({name}: {len(wrapped.promotions)} promotion(s), loss scale {wrapped.scaler.get_scale():g})")
    print()


def _qpytorch_hooks(model):
    """The paper's style: QPyTorch's e5m2 rounding of every module output and its gradient, in hooks."""
    try:
        from qtorch import FloatingPoint
        from qtorch.quant import Quantizer
    except ImportError:
        return None
    e5m2 = FloatingPoint(exp=5, man=2)
    for module in model.modules():
        if not list(module.children()):
            quantizer = Quantizer(forward_number=e5m2, backward_number=e5m2)
            module.register_forward_hook(lambda m, args, out, q=quantizer: q(out))
    return model


def _bench_quantize(device: str) -> None:
    import torch

    from precsearch.formats.kernels import quantize

    n = 2**28 if device == "cuda" else 2**24
    x = torch.randn(n, device=device)
    generator = torch.Generator(device=device).manual_seed(0)
    runs = {
        "torch native fp8_e5m2 cast": lambda: x.to(torch.float8_e5m2).float(),
        "quantize e5m2 nearest": lambda: quantize(x, "e5m2"),
        "quantize e5m2 stochastic": lambda: quantize(x, "e5m2", "stochastic", generator=generator),
    }
    times = {}
    for name, run in runs.items():
        run()
        samples = []
        for _ in range(7):
            _sync(device)
            start = time.perf_counter()
            run()
            _sync(device)
            samples.append(time.perf_counter() - start)
        times[name] = statistics.median(samples)
    base = times["torch native fp8_e5m2 cast"]
    print(f"2. rounding 2^{n.bit_length() - 1} float32 values on {device}, median of 7")
    for name, seconds in times.items():
        print(f"   {name:28s} {seconds * 1e3:9.2f} ms {seconds / base:7.2f}x the native cast")
    print()


def _bench_saved(plain, x, graph, policies, chosen, apply_policy, CostModel, measure_saved_bytes) -> None:  # noqa: N803
    cost = CostModel(graph)
    fp32_measured = measure_saved_bytes(plain, x)
    print("3. bytes autograd saves for backward after one forward (activations and byproducts, no weights)")
    print(f"   {'policy':22s} {'measured':>12s} {'vs fp32':>8s} {'predicted':>12s} {'meas/pred':>9s}"
          f" {'packed weights':>15s}")
    for name in chosen:
        policy = policies[name]
        model = apply_policy(copy.deepcopy(plain), policy)
        model(x)
        saved = model.saved_bytes()
        measured = saved.activation + saved.other
        predicted = cost.saved_activation_bytes(policy.assignment(graph))
        print(f"   {name:22s} {measured:12,d} {measured / fp32_measured:7.3f}x {predicted:12,d} "
              f"{measured / predicted:9.4f} {saved.weight:15,d}")
    print(f"   (fp32 model measured by precsearch.cost.model.measure_saved_bytes: {fp32_measured:,d} bytes)")


if __name__ == "__main__":
    sys.exit(main())
