"""The peak resident memory of a command's whole process tree (a search's parent and its ``--jobs`` workers
together), read from the kernel's own counters (/proc/PID/status VmRSS) every ``--interval`` seconds, and its
wall time. ``/usr/bin/time -v`` reports the largest single process, not the sum a machine must hold.

    python benchmarks/process_tree_peak.py -- precsearch search narrow_cnn --data gratings --jobs 2 --out /tmp/s
"""

from __future__ import annotations

import argparse
import subprocess
import time
from pathlib import Path


def _children() -> dict[int, list[int]]:
    tree: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:  # ended meanwhile
            continue
        tree.setdefault(int(fields[1]), []).append(int(entry.name))  # fields[1]: the parent's pid
    return tree


def _rss_kib(pid: int) -> int:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    except OSError:
        pass
    return 0


def tree_rss_kib(root: int) -> tuple[int, int]:
    """The summed VmRSS of ``root`` and every descendant, and how many processes that is."""
    tree, pending, total, count = _children(), [root], 0, 0
    while pending:
        pid = pending.pop()
        total += _rss_kib(pid)
        count += 1
        pending.extend(tree.get(pid, []))
    return total, count


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--interval", type=float, default=0.1)
    parser.add_argument("command", nargs=argparse.REMAINDER)
    args = parser.parse_args()
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    start = time.perf_counter()
    process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    peak, most = 0, 0
    while process.poll() is None:
        total, count = tree_rss_kib(process.pid)
        peak, most = max(peak, total), max(most, count)
        time.sleep(args.interval)
    wall = time.perf_counter() - start
    print(f"exit {process.returncode}; wall {wall:.1f} s; peak of the process tree's summed RSS {peak / 1024:.0f} MiB "
          f"(at most {most} processes at once); sampled every {args.interval:g} s")
    raise SystemExit(process.returncode)


if __name__ == "__main__":
    main()
