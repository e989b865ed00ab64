"""Prior-work baselines and the paper's sweep trained under the same proxies as a search, reusing what the
search in the same run directory already trained."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pandas as pd
from tqdm.auto import tqdm

from precsearch.config.compiling import CompileOptions
from precsearch.config.policy import Policy
from precsearch.config.reading import REWRITE, load_json_object
from precsearch.config.spaces import SearchSpace, load_space, parse_space
from precsearch.errors import PrecsearchError
from precsearch.files import atomic_write_text
from precsearch.search.context import Budget, DataSpec, SearchContext, proxy_compile, torch_threads
from precsearch.search.rundir import RUN_FILE
from precsearch.search.settings import SearchConfig
from precsearch.search.strategies import (
    BASELINES,
    baseline_policies,
    sweep,
)
from precsearch.search.study import quiet, study_config
from precsearch.train.proxy import run_proxy
from precsearch.train.reading import flagged
from precsearch.train.trainer import resolve_device

__all__ = ["run_baselines"]


def _reusable_trials(out_dir: Path, context: SearchContext) -> dict[str, dict[str, Any]]:
    """Trained rows of a search in ``out_dir`` made with the same proxies, by assignment key."""
    run_file, trials_file = out_dir / RUN_FILE, out_dir / "trials.csv"
    if not run_file.is_file() or not trials_file.is_file():
        return {}
    previous = load_json_object(run_file, "run file", REWRITE)
    length = previous.get("proxy_length")
    config = study_config(context)
    ignored = ("budget", "proxy_seeds", "space", *SearchConfig.SETTINGS)
    if length != context.space.proxy.steps or any(previous.get(key) != config[key] for key in config
                                                  if key not in ignored):
        return {}
    if parse_space(previous["space"]).with_proxy(steps=length).to_dict() != config["space"]:
        return {}
    frame = pd.read_csv(trials_file)
    stopped = frame["stopped_at"].notna() if "stopped_at" in frame else False
    frame = frame[frame["trained"].astype(bool) & (frame["state"] == "COMPLETE") & ~stopped].sort_values("number")
    reusable: dict[str, dict[str, Any]] = {}
    for _, row in frame.iterrows():
        reusable.setdefault(row["key"], row.to_dict())  # the trial that trained it, not a later duplicate
    return reusable


_COPIED = ("memory", "bytes", "val_accuracy", "val_loss", "batch_stats_accuracy", "diverged", "reason", "promotions",
           "wall_time")
_SEED_FIELDS = ("seeds", "val_accuracy_sd")  # copied when the reused trial has them (a multi-seed search)


def run_baselines(
    model_spec: str,
    space: SearchSpace | str | Path,
    data: DataSpec | str = "digits",
    out_dir: str | Path = "runs/baselines",
    proxy_steps: int | None = None,
    seed: int = 0,
    device: str = "auto",
    *,
    names: tuple[str, ...] | list[str] = BASELINES,
    ablations: bool = False,
    batch_size: int | None = None,
    image_size: int | None = None,
    threads: int | None = None,
    progress: bool = True,
    compile: CompileOptions | None = None,
) -> pd.DataFrame:
    """Train the prior-work baselines and the paper's sweep (plus its ablations) under the same proxies.

    Writes ``baselines.csv`` (rewritten after each proxy) and ``baselines/<source>_<name>.json`` policies.
    In a search's run directory made with the same model, space, data and seed, the proxies are as long as
    the search's (unless ``proxy_steps`` says otherwise), and sweep points the search already trained are
    reused, not trained again; so are sweep points that coincide with each other. ``compile``: how the
    proxies compile their step (None: eagerly; ``proxy_compile``).
    """
    if isinstance(space, str | Path):
        space = load_space(space)
    run_file = Path(out_dir) / RUN_FILE
    if proxy_steps is None and run_file.is_file():
        proxy_steps = load_json_object(run_file, "run file", REWRITE).get("proxy_length")
    space = space.with_proxy(steps=proxy_steps, batch_size=batch_size, image_size=image_size)
    data_spec = DataSpec(data) if isinstance(data, str) else data
    unknown = [name for name in names if name not in BASELINES]
    if unknown:
        raise PrecsearchError(f"unknown baseline {unknown[0]!r}; use any of {', '.join(BASELINES)}")
    if threads is not None and threads < 1:
        raise PrecsearchError(f"threads={threads} must be at least 1")
    resolve_device(device)
    context = SearchContext.create(model_spec, space, data_spec, Budget(), seed, device)
    out_dir = Path(out_dir)
    known = {key: {**row, "reused": f"trial {int(row['number'])}"}
             for key, row in _reusable_trials(out_dir, context).items()}
    todo: list[tuple[str, str, Policy, float | None, str]] = [
        ("baseline", name, policy.replace(model=model_spec), None, "")
        for name, policy in baseline_policies(context.graph, names).items()]
    for order in ("largest", "smallest", "random") if ablations else ("largest",):
        for candidate in sweep(context.graph, space, order=order, seed=seed):
            policy = context.policy(candidate.assignment, {"strategy": candidate.strategy, "r": candidate.r})
            todo.append(("paper" if order == "largest" else order, f"r={candidate.r:.1f}", policy, candidate.r,
                         candidate.key))
    (out_dir / "baselines").mkdir(parents=True, exist_ok=True)
    rows: list[dict[str, Any]] = []
    with quiet(), torch_threads(threads):
        for source, name, policy, r, key in tqdm(todo, desc="baselines", unit="proxy", disable=not progress):
            row: dict[str, Any] = {"source": source, "name": name, "r": math.nan if r is None else r, "key": key}
            if key in known:
                row.update({field: known[key].get(field, math.nan) for field in (*_COPIED, "reused")})
                row.update({field: known[key][field] for field in _SEED_FIELDS if field in known[key]})
            else:
                result = run_proxy(model_spec, policy, context.data, space.proxy.steps, seed=seed, device=device,
                                   config=space.proxy, compile=proxy_compile(compile))
                memory, size = context.memory(policy.assignment(context.graph), result.promotions)
                row.update(memory=memory, bytes=size, val_accuracy=result.val_accuracy, val_loss=result.val_loss,
                           batch_stats_accuracy=result.batch_stats_accuracy, diverged=result.diverged,
                           reason=result.reason, promotions=len(result.promotions),
                           wall_time=result.wall_time, reused="")
                if key:
                    known[key] = {**row, "reused": f"{source} {name}"}
            path = out_dir / "baselines" / f"{source}_{name.replace('=', '')}.json"
            proxy = {"val_accuracy": float(row["val_accuracy"]), "memory": float(row["memory"]),
                     "diverged": bool(row["diverged"])}
            policy.replace(provenance={**policy.provenance, "source": source, "name": name, "proxy": proxy}).save(path)
            row["reading_flagged"] = flagged(row["val_accuracy"], row["batch_stats_accuracy"], context.budget.drop)
            rows.append({**row, "policy": str(path.relative_to(out_dir))})
            atomic_write_text(out_dir / "baselines.csv", pd.DataFrame(rows).to_csv(index=False))
    return pd.DataFrame(rows)
