"""A hand-written mutation check: plausible mistakes planted one at a time, and whether the suite notices.

Each mutant replaces one snippet of the package (which must occur exactly once, so the list fails loudly when
the code moves on) in a scratch copy of the repository, then runs the test files that cover that code. A mutant
is *killed* when those tests fail. Survivors are printed with their reason: each is either a missing test or a
change judged harmless (the list says which).

    python benchmarks/mutation_check.py               # every mutant, about 10 minutes on 2 cores
    python benchmarks/mutation_check.py --only F1 S2  # a few
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


@dataclass(frozen=True)
class Mutant:
    name: str
    path: str
    old: str
    new: str
    tests: tuple[str, ...]
    what: str
    harmless: str = ""  # why a survivor would not be a missing test (empty: it would be)


FORMATS = ("tests/test_formats.py",)
STRATEGIES = ("tests/test_strategies.py",)
SCALING = ("tests/test_scaling.py", "tests/test_runtime.py")  # the paper's schedule is tested through a policy
POLICY = ("tests/test_policy.py", "tests/test_strategies.py")
SPEC = ("tests/test_spec.py",)

MUTANTS = (
    Mutant("F1", "precsearch/formats/kernels.py",
           "normal = (mag + ((mask >> 1) + ((mag >> drop) & 1))) & ~mask",
           "normal = (mag + ((mask >> 1) + 1)) & ~mask", FORMATS, "normal-range ties round away from zero"),
    Mutant("F2", "precsearch/formats/kernels.py",
           "normal = (mag + ((mask >> 1) + ((mag >> drop) & 1))) & ~mask",
           "normal = mag & ~mask", FORMATS, "normal-range rounding truncates"),
    Mutant("F3", "precsearch/formats/kernels.py",
           "rounded = torch.where(rounded > key.max_bits, on_overflow, rounded)",
           "rounded = torch.where(rounded >= key.max_bits, on_overflow, rounded)", FORMATS,
           "the largest finite value counts as overflow"),
    Mutant("F4", "precsearch/formats/kernels.py",
           "rounded = torch.where(mag < min_normal_bits, subnormal, normal)",
           "rounded = torch.where(mag < min_normal_bits, 0, normal)", FORMATS, "subnormals flush to zero"),
    Mutant("F5", "precsearch/formats/kernels.py",
           "keep_from = 0x7F800000 if key.keep_inf else 0x7F800001",
           "keep_from = 0x7F800001", FORMATS, "inf is not kept in formats that have inf"),
    Mutant("F6", "precsearch/formats/kernels.py",
           "quanta = (significand + (noise & ((1 << shift) - 1))) >> shift",
           "quanta = significand >> shift", FORMATS, "stochastic rounding truncates below min normal"),
    Mutant("F7", "precsearch/formats/kernels.py",
           "return torch.where(((c >> (fmt.bits - 1)) & 1).bool(), -value, value)",
           "return value", FORMATS, "decoding drops the sign"),
    Mutant("F8", "precsearch/formats/kernels.py",
           "        return float(torch.nextafter(top, torch.tensor(math.inf)))",
           "        return float(top)", FORMATS, "stochastic overflow threshold at max itself"),
    Mutant("F9", "precsearch/formats/kernels.py", "normal = (mag + ((mask + 1) >> 1)) & ~mask",
           "normal = (mag + (mask >> 1)) & ~mask", FORMATS, "ties='away' rounds ties toward zero"),
    Mutant("S1", "precsearch/search/strategies.py",
           "groups.sort(key=lambda g: -sizes[g])  # stable: ties keep execution order",
           "groups.sort(key=lambda g: sizes[g])", STRATEGIES, "the paper demotes the smallest groups first"),
    Mutant("S2", "precsearch/search/strategies.py",
           "if total == 0 or demoted / total >= r - 1e-12:",
           "if total == 0 or demoted / total > r:", STRATEGIES, "one group too many demoted at an exact target"),
    Mutant("S3", "precsearch/search/strategies.py",
           '[decisions.get(unit, "high") != "high" for unit in decided]',
           '[decisions.get(unit, "high") == "low" for unit in decided]', STRATEGIES,
           "low share ignores categorical levels other than low"),
    Mutant("S4", "precsearch/search/seeding.py",
           "[AllHigh(), PaperSweep(), AllLow()]", "[AllHigh(), PaperSweep()]", STRATEGIES,
           "the search is not seeded with all-low"),
    Mutant("P1", "precsearch/search/strategies.py",
           '    dynamic = dict(PAPER_LOSS_SCALING)',
           '    return policy_for_graph(graph)\n'
           '    dynamic = dict(PAPER_LOSS_SCALING)', POLICY,
           "every baseline is an empty fp32 policy"),
    Mutant("P2", "precsearch/search/strategies.py", "low_ids = operands - first_last", "low_ids = operands", POLICY,
           "hfp8 keeps the first and last GEMM low"),
    Mutant("P3", "precsearch/search/strategies.py",
           'overrides = {tensor_id: PAPER_LOW[graph.tensors[tensor_id].kind]',
           'overrides = {tensor_id: PAPER_LOW["weight"]', POLICY,
           "hfp8 gradients in the forward format"),
    Mutant("P4", "precsearch/search/strategies.py", '    ids.add(str(TensorId(op.name, "activation_grad")))\n', "",
           POLICY,
           "a GEMM's output gradient is not one of its operands"),
    Mutant("P5", "precsearch/config/policy.py",
           "        if tensor.id in self.overrides:\n            return self.overrides[tensor.id], "
           "f\"override {tensor.id!r}\"\n", "", POLICY, "exact overrides lose to globs"),
    Mutant("V1", "precsearch/config/spec.py", "PAPER_LOSS_SCALING, master_weights=False)",
           "PAPER_LOSS_SCALING, master_weights=True)", SPEC, "a space's default turns master weights on"),
    Mutant("V2", "precsearch/config/loss_scaling.py",
           '    mode = choice(raw.get("mode", default_mode)',
           '    mode = choice(raw.get("mode", "none")', SPEC,
           "a loss-scaling entry without a mode reads as none in a space too"),
    Mutant("V3", "precsearch/config/loss_scaling.py",
           '        settings[key] = checked if canonical or key.endswith("_format") else value',
           '        settings[key] = checked if key.endswith("_format") else value', SPEC,
           "a space's loss-scaling numbers are not canonical"),
    Mutant("V4", "precsearch/config/spec.py", "        return f\"{self.op}:{self.kind}{self.index or ''}\"",
           "        return f\"{self.op}:{self.kind}{self.index}\"", SPEC, "output 0's id gets an index"),
    Mutant("V5", "precsearch/config/spec.py",
           '        kinds = {"activation": "activation_grad", "weight": "weight_grad"}',
           '        kinds = {"activation": "activation_grad", "weight": "activation_grad"}', SPEC,
           "a weight's gradient id is an activation gradient's"),
    Mutant("L1", "precsearch/cost/model.py", "    return low @ numel / total if total else np.zeros(low.shape[:-1])",
           "    return low @ numel / len(numel) if total else np.zeros(low.shape[:-1])", SPEC,
           "the low share divides by the tensor count"),
    Mutant("N1", "precsearch/train/trainer.py", "    with torch.random.fork_rng(devices=gpus):",
           "    with contextlib.nullcontext():", ("tests/test_train.py",),
           "a run leaves the global RNG seeded"),
    Mutant("C1", "precsearch/cost/model.py",
           "return fmt.storage_bytes", "return 4", ("tests/test_cost.py",),
           "stored activations priced at fp32 whatever their format"),
    Mutant("C2", "precsearch/cost/model.py",
           "per_element = np.full(len(self.ids), 32.0)", "per_element = np.full(len(self.ids), 16.0)",
           ("tests/test_cost.py",), "unassigned tensors priced at 16 bits"),
    Mutant("R1", "precsearch/runtime/scaling.py", "            return value * self.backoff_factor, 0",
           "            return value * self.backoff_factor, tracker", SCALING,
           "an overflow does not restart the count of clean steps"),
    Mutant("R2", "precsearch/runtime/scaling.py", "        if tracker == self.interval:",
           "        if tracker > self.interval:", SCALING, "the scale grows one step late"),
    Mutant("O1", "precsearch/runtime/optim.py",
           'weight.copy_(quantize(weight + u, fmt, rounding="stochastic", generator=generator))',
           "weight.copy_(quantize(weight + u, fmt))", ("tests/test_optim.py",),
           "stochastic weight updates round to nearest"),
    Mutant("O2", "precsearch/runtime/optim.py", "compensation.copy_(quantize(quantize(s - weight, cfmt) - y, cfmt))",
           "compensation.zero_()", ("tests/test_optim.py",), "Kahan summation loses its compensation"),
    Mutant("A1", "precsearch/runtime/accumulate.py", "        total = quantize(total + acc[..., c, :], fmt)",
           "        total = total + acc[..., c, :]", ("tests/test_accumulate.py",),
           "chunk sums are added in fp32"),
    Mutant("A2", "precsearch/runtime/accumulate.py", "        acc = quantize(acc + a[..., i, :] * b[..., i, :], fmt)",
           "        acc = acc + a[..., i, :] * b[..., i, :]", ("tests/test_accumulate.py",),
           "products inside a chunk are added in fp32"),
    Mutant("T1", "precsearch/runtime/state.py", "fraction >= self.threshold and self._promote(slot, fraction)",
           "fraction > self.threshold and self._promote(slot, fraction)", ("tests/test_runtime.py",),
           "a tensor overflowing exactly at the threshold is not promoted"),
    Mutant("T2", "precsearch/runtime/state.py",
           "slot.promoted or slot.fmt == self.high or not slot.is_low or slot.kind",
           "slot.promoted or slot.kind", ("tests/test_runtime.py",), "tensors already high are promoted again"),
    Mutant("Q1", "precsearch/search/objective.py",
           "decisions = {unit: trial.suggest_categorical(unit, context.levels) for unit in context.units}",
           'decisions = {unit: trial.suggest_categorical(unit, ["high", "low"]) for unit in context.units}',
           ("tests/test_search.py",), "the sampler never proposes a categorical space's other levels"),
    Mutant("Q2", "precsearch/cli/search.py", '    return "\\n".join(lines)\n', '    return ""\n',
           ("tests/test_cli_search.py",), "the search command prints nothing"),
)


def _scratch_copy(target: Path) -> None:
    ignore = shutil.ignore_patterns(".git", ".venv", "runs", "__pycache__", "*.egg-info", ".pytest_cache")
    for name in ("precsearch", "tests", "benchmarks", "search_spaces", "pyproject.toml"):
        source = ROOT / name
        if source.is_dir():
            shutil.copytree(source, target / name, ignore=ignore)
        else:
            shutil.copy2(source, target / name)


def _apply(mutant: Mutant, tree: Path) -> None:
    path = tree / mutant.path
    text = path.read_text()
    count = text.count(mutant.old)
    if count != 1:
        raise SystemExit(f"mutant {mutant.name}: its snippet occurs {count} times in {mutant.path}; update the list")
    path.write_text(text.replace(mutant.old, mutant.new))


def run(mutant: Mutant) -> tuple[bool, float]:
    """(killed, seconds): the mutant's tests run on a scratch copy with the mutation applied."""
    with tempfile.TemporaryDirectory(prefix="mutant-") as scratch:
        tree = Path(scratch)
        _scratch_copy(tree)
        _apply(mutant, tree)
        env = {**os.environ, "PYTHONPATH": str(tree)}
        start = time.perf_counter()
        proc = subprocess.run([sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider", *mutant.tests],
                              cwd=tree, env=env, capture_output=True, text=True)
        return proc.returncode != 0, time.perf_counter() - start


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", nargs="*", help="mutant names to run (default: all)")
    args = parser.parse_args(argv)
    chosen = [m for m in MUTANTS if not args.only or m.name in args.only]
    killed = 0
    for mutant in chosen:
        dead, seconds = run(mutant)
        killed += dead
        verdict = "killed " if dead else "SURVIVED"
        note = f" (judged harmless: {mutant.harmless})" if not dead and mutant.harmless else ""
        print(f"{mutant.name:3s} {verdict} {seconds:6.1f} s  {mutant.path}: {mutant.what}{note}", flush=True)
    print(f"mutation score: {killed}/{len(chosen)} killed ({100 * killed / max(len(chosen), 1):.0f}%)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
