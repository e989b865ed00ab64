"""Proxy fidelity: do short proxies rank assignments the way full-length training does?

``validate_run`` takes a search's run directory, retrains its Pareto front, the all-high reference, the
paper's sweep points and the ``best.json`` trial for ``steps`` steps (default ``LONG_FACTOR`` times the proxy
length; give the real training length for a real check), and writes:

* ``fidelity.csv``: one row per assignment: its roles, the proxy's mean, sd and seed count, memory as
  planned and with the promotions the proxy made, the long run's accuracy, loss, divergence, promotions and
  memory with them (the promotion guard may promote more over a longer run, so the proxy under-counts).
* ``fidelity.json``: Spearman's and Kendall's rank correlations of proxy mean against long-run accuracy with
  bootstrap intervals (``noise.rank_correlations``), whether ``best.json`` still meets its budget after
  full training (memory including the long run's promotions; accuracy against the long all-high run), and
  plain fp32's accuracy over the same steps (the yardstick next to all-high), and how often the proxy foretold
  the long run: assignments whose divergence the proxy got right (``divergence_predicted``) and those where the
  long run promoted more tensors (``promotions_under_counted``).
* ``fidelity.png``: proxy accuracy (with seed error bars) against long-run accuracy per assignment.
"""

from __future__ import annotations

import json
import logging
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pandas as pd
from matplotlib.figure import Figure
from tqdm.auto import tqdm

from precsearch.analysis.report import save_figure
from precsearch.config.compiling import CompileOptions
from precsearch.config.policy import Policy
from precsearch.config.reading import REWRITE, load_json_object
from precsearch.config.spaces import parse_space
from precsearch.errors import PrecsearchError, echo
from precsearch.files import atomic_write_text
from precsearch.models import check_trusted
from precsearch.search.context import Budget, DataSpec, SearchContext, torch_threads
from precsearch.search.noise import rank_correlations
from precsearch.search.objective import TRIAL_POLICIES
from precsearch.search.origins import origins
from precsearch.train.reading import flagged
from precsearch.train.trainer import ProxyResult, resolve_device, train

__all__ = ["LONG_FACTOR", "FidelityResult", "long_run", "plot_fidelity", "validate_run"]

log = logging.getLogger(__name__)

LONG_FACTOR = 8  # default long run: this many times the proxy's steps
BOOTSTRAP_SEED = 0


@dataclass
class FidelityResult:
    table: pd.DataFrame
    summary: dict[str, Any]
    files: tuple[Path, Path, Path]


def long_run(context: SearchContext, policy: Policy | None, steps: int, seed: int) -> ProxyResult:
    """Training under ``policy`` (None: plain fp32) for ``steps`` steps with the proxy's recipe, not stopped by
    divergence."""
    return train(context.model, policy, context.data, steps, seed=seed, device=context.device,
                 config=context.space.proxy, stop_on_divergence=False, compile=context.compile)


def _context(run_dir: Path, device: str, compile: CompileOptions | None, trust_model: str | None
             ) -> tuple[SearchContext, int]:
    """The run's search context and proxy length, from its run.json."""
    run_file = run_dir / "run.json"
    if not run_file.is_file() or not (run_dir / "trials.csv").is_file():
        raise PrecsearchError(f"{run_dir} holds no run.json and trials.csv; give a run directory written by "
                              "precsearch search")
    config = load_json_object(run_file, "run file", REWRITE)
    model = check_trusted(config.get("model"), str(run_file), trust_model)
    context = SearchContext.create(model, parse_space(config["space"]), DataSpec(**config["data"]),
                                   Budget(**config["budget"]), config["seed"], device, compile=compile)
    return context, config.get("proxy_length", context.space.proxy.steps)


def _roles(run_dir: Path, trials: pd.DataFrame) -> dict[str, list[str]]:
    """Assignment key -> roles (front, all-high, paper r=..., best) of the assignments to retrain."""
    roles: dict[str, list[str]] = {}
    trained = trials[trials["trained"].astype(bool) & (trials["state"] == "COMPLETE")]
    by_number = trained.set_index("number")
    pareto = pd.read_csv(run_dir / "pareto.csv") if (run_dir / "pareto.csv").stat().st_size > 1 else None
    if pareto is not None and not pareto.empty:
        for number in pareto["number"]:
            roles.setdefault(by_number.loc[number, "key"], []).append("front")
    for _, row in trained.iterrows():
        for origin in origins(row["origin"]):
            if origin == "all-high" or origin.startswith("paper r="):
                roles.setdefault(row["key"], []).append(origin)
    best = run_dir / "best.json"
    if best.is_file():
        number = load_json_object(best, "run file", REWRITE).get("provenance", {}).get("trial")
        if number in by_number.index:
            roles.setdefault(by_number.loc[number, "key"], []).append("best")
    return roles


def _policy_file(run_dir: Path, row: pd.Series) -> Path:
    """The policy the proxy trained under, in trials/ of the run directory. The path the trial recorded (absolute,
    on the worker's host) names the file only: a run directory may come from someone else, so nothing it names
    outside itself is opened, and whether such a file exists changes no message."""
    folder = run_dir / TRIAL_POLICIES
    name = Path(str(row["policy"])).name
    local = folder / name
    if not name or not local.resolve().is_relative_to(folder.resolve()) or not local.is_file():
        raise PrecsearchError(f"{run_dir / 'trials.csv'}: trial {int(row['number'])} trained under policy "
                              f"{echo(name)}, which is not a file in {folder}; validate reads the policies of a run "
                              "from its own trials/ folder only: copy the worker's trials/ files there")
    return local


def validate_run(run_dir: str | Path, steps: int | None = None, seed: int | None = None, device: str = "cpu",
                 threads: int | None = None, progress: bool = True, compile: CompileOptions | None = None,
                 trust_model: str | None = None) -> FidelityResult:
    """Retrain the run's front, all-high, sweep and best assignments for ``steps`` steps (see the module
    docstring); ``seed`` defaults to the search's seed; ``compile``: how the runs compile (None: eagerly).
    A run.json naming a model factory is refused unless ``trust_model`` is that spec (``check_trusted``)."""
    run_dir = Path(run_dir)
    resolve_device(device)  # refused before the run is read and retrained
    context, length = _context(run_dir, device, compile, trust_model)
    steps = LONG_FACTOR * length if steps is None else steps
    if steps < 1:
        raise PrecsearchError(f"steps={steps} must be at least 1")
    seed = context.seed if seed is None else seed
    trials = pd.read_csv(run_dir / "trials.csv", keep_default_na=False, na_values=[""])
    roles = _roles(run_dir, trials)
    first = trials[trials["trained"].astype(bool) & (trials["state"] == "COMPLETE")].drop_duplicates("key")
    first = first[first["key"].isin(roles)].set_index("key")
    policies = {key: Policy.load(_policy_file(run_dir, first.loc[key])) for key in roles}  # all, before any run
    rows = []
    with torch_threads(threads):
        for key in tqdm(list(roles), desc="validate", unit="run", disable=not progress):
            row = first.loc[key]
            policy = policies[key]
            result = long_run(context, policy, steps, seed)
            memories, _ = context.memories(policy.assignment(context.graph), result.promotions)
            rows.append({
                "trial": int(row["number"]), "roles": "; ".join(roles[key]), "key": key,
                "proxy_accuracy": float(row["val_accuracy"]), "proxy_sd": float(row.get("val_accuracy_sd", math.nan)),
                "proxy_seeds": int(row.get("seeds", 1)) if row.get("seeds", 1) == row.get("seeds", 1) else 1,
                "proxy_promotions": int(row["promotions"]), "proxy_memory": float(row["memory"]),
                "proxy_diverged": str(row["diverged"]) == "True",
                "long_steps": steps, "long_accuracy": result.val_accuracy, "long_loss": result.val_loss,
                "long_batch_stats_accuracy": result.batch_stats_accuracy,
                "long_reading_flagged": flagged(result.val_accuracy, result.batch_stats_accuracy, context.budget.drop),
                "long_diverged": result.diverged, "long_reason": result.reason,
                "long_promotions": len(result.promotions), "long_memory": memories[f"memory_{context.budget.memory}"],
            })
        plain = long_run(context, None, steps, seed)
    table = pd.DataFrame(rows)
    summary = _summary(table, context.budget)
    summary["plain_fp32_accuracy"] = plain.val_accuracy
    out = (run_dir / "fidelity.csv", run_dir / "fidelity.json", run_dir / "fidelity.png")
    atomic_write_text(out[0], table.to_csv(index=False))
    atomic_write_text(out[1], json.dumps(summary, indent=2))
    save_figure(plot_fidelity(table, summary), out[2])
    return FidelityResult(table, summary, out)


def _summary(table: pd.DataFrame, budget: Budget) -> dict[str, Any]:
    """Rank correlations (non-diverged long runs) and the verdict on best.json after full training."""
    ok = table[~table["long_diverged"]]
    summary: dict[str, Any] = {"assignments": len(table), "long_steps": int(table["long_steps"].iloc[0]),
                               "bootstrap_seed": BOOTSTRAP_SEED}
    summary.update(rank_correlations(ok["proxy_accuracy"], ok["long_accuracy"], seed=BOOTSTRAP_SEED))
    summary["divergence_predicted"] = int((table["proxy_diverged"] == table["long_diverged"]).sum())
    summary["promotions_under_counted"] = int((table["long_promotions"] > table["proxy_promotions"]).sum())
    summary["best"] = _best_verdict(table, budget)
    return {name: None if isinstance(value, float) and math.isnan(value) else value
            for name, value in summary.items()}


def _best_verdict(table: pd.DataFrame, budget: Budget) -> dict[str, Any] | None:
    best = table[table["roles"].str.contains("best")]
    high = table[table["roles"].str.contains("all-high")]
    if best.empty:
        return None
    row = best.iloc[0]
    verdict: dict[str, Any] = {"trial": int(row["trial"]), "long_accuracy": float(row["long_accuracy"]),
                               "long_memory": float(row["long_memory"]), "proxy_memory": float(row["proxy_memory"]),
                               "diverged": bool(row["long_diverged"])}
    meets = not row["long_diverged"]
    if budget.max_memory is not None:
        meets = meets and row["long_memory"] <= budget.max_memory + 1e-12
    elif not high.empty:
        reference = float(high.iloc[0]["long_accuracy"])
        verdict["long_all_high_accuracy"] = reference
        meets = meets and row["long_accuracy"] >= reference - budget.drop - 1e-12
    verdict["meets_budget"] = bool(meets)
    return verdict


def plot_fidelity(table: pd.DataFrame, summary: dict[str, Any], ax: Any = None) -> Figure:
    """Proxy mean accuracy (x, +- seed sd) against long-run accuracy (y), one point per assignment."""
    figure = Figure(figsize=(6, 4.5)) if ax is None else ax.figure
    ax = figure.subplots() if ax is None else ax
    ok = table[~table["long_diverged"]]
    ax.errorbar(ok["proxy_accuracy"], ok["long_accuracy"], xerr=ok["proxy_sd"].fillna(0), fmt="o", ms=5,
                capsize=3, color="tab:blue", label="assignments")
    bad = table[table["long_diverged"]]
    if not bad.empty:
        ax.scatter(bad["proxy_accuracy"], bad["long_accuracy"], marker="x", color="tab:red", label="long run diverged")
    for _, row in table.iterrows():
        ax.annotate(f"t{int(row['trial'])}", (row["proxy_accuracy"], row["long_accuracy"]), fontsize=7,
                    xytext=(3, 3), textcoords="offset points")

    def interval(name: str) -> str:
        value = summary.get(name)
        if value is None:
            return f"{name} n/a"
        return f"{name} {value:.2f} [{summary[f'{name}_low']:.2f}, {summary[f'{name}_high']:.2f}]"

    ax.set_title(f"{interval('spearman')}, {interval('kendall')}", fontsize=9)
    ax.set_xlabel("proxy validation accuracy (mean +- sd over seeds)")
    ax.set_ylabel(f"validation accuracy after {summary['long_steps']} steps")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="lower right")
    figure.tight_layout()
    return figure
