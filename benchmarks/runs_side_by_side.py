"""Whether a search's calibration and confirmation runs train faster side by side, one per ``--jobs`` worker
process at one thread each, than one after another in one process at as many threads as there are workers
(where the search's parent trained them before its workers took them over).

Each run is one of calibration's: the all-high reference continued from step 0 to ``--steps``, on its own seed,
built as a search builds it (``SearchContext.create``, the search space's proxy). Both ways train the same runs
in the same call, alternating ``--repeats`` times; the wall time of each is printed, with the ratio of their
medians.

    python benchmarks/runs_side_by_side.py mobilenet_v2:width=0.5 --image-size 16 --steps 100
"""

from __future__ import annotations

import argparse
import multiprocessing
import statistics
import tempfile
import time
from pathlib import Path

import torch

from precsearch.config.spaces import paper_space
from precsearch.search.context import Budget, DataSpec, SearchContext

SPAWN = multiprocessing.get_context("spawn")


def _context(model: str, image_size: int) -> SearchContext:
    space = paper_space().with_proxy(image_size=image_size)
    return SearchContext.create(model, space, DataSpec("gratings"), Budget(), 0, "cpu")


def _train(model: str, image_size: int, steps: int, seeds: list[int], threads: int, folder: str) -> float:
    """Wall seconds to train all-high's runs on ``seeds`` one after another at ``threads`` threads (the
    context built and a 1-step run trained before the clock starts, as each worker does once)."""
    torch.set_num_threads(threads)
    context = _context(model, image_size)
    context.checkpoints = Path(folder)
    policy = context.policy(context.all_high.assignment, {"strategy": "all-high"})
    context.trainer(policy, 1, -1)  # warm: the rounding kernels are built or loaded once per process
    start = time.perf_counter()
    for seed in seeds:
        context.trainer(policy, steps, seed)
    return time.perf_counter() - start


def _worker(model: str, image_size: int, steps: int, seed: int, folder: str, ready, go, done) -> None:
    torch.set_num_threads(1)
    context = _context(model, image_size)
    context.checkpoints = Path(folder)
    policy = context.policy(context.all_high.assignment, {"strategy": "all-high"})
    context.trainer(policy, 1, -1)
    ready.release()
    go.wait()
    context.trainer(policy, steps, seed)
    done.put(time.perf_counter())


def side_by_side(model: str, image_size: int, steps: int, seeds: list[int], folder: str) -> float:
    """Wall seconds from the moment every worker process is ready (its context built, a 1-step run trained)
    until the last run ends: one process per seed at one thread."""
    ready, go, done = SPAWN.Semaphore(0), SPAWN.Event(), SPAWN.Queue()
    workers = [SPAWN.Process(target=_worker, args=(model, image_size, steps, seed, folder, ready, go, done))
               for seed in seeds]
    for worker in workers:
        worker.start()
    for _ in workers:
        ready.acquire()
    start = time.perf_counter()
    go.set()
    ends = [done.get() for _ in workers]
    for worker in workers:
        worker.join()
    return max(ends) - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("model", nargs="?", default="mobilenet_v2:width=0.5")
    parser.add_argument("--image-size", type=int, default=16)
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--jobs", type=int, default=2, help="runs, one per worker process; the parent's threads")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    seeds = list(range(args.jobs))
    one, many = [], []
    with tempfile.TemporaryDirectory() as folder:
        for _ in range(args.repeats):
            one.append(_train(args.model, args.image_size, args.steps, seeds, args.jobs, folder))
            many.append(side_by_side(args.model, args.image_size, args.steps, seeds, folder))
            print(f"  one process at {args.jobs} threads {one[-1]:.1f} s; {args.jobs} processes at 1 thread "
                  f"{many[-1]:.1f} s", flush=True)
    print(f"{args.model} ({args.image_size}x{args.image_size} gratings), {args.jobs} all-high runs of {args.steps} "
          f"steps, median of {args.repeats}: one process {statistics.median(one):.1f} s, side by side "
          f"{statistics.median(many):.1f} s ({statistics.median(many) / statistics.median(one):.2f}x)")


if __name__ == "__main__":
    main()
