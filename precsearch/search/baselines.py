"""Prior-work baselines and the paper's sweep trained under the same proxies as a search, reusing what the
search in the same run directory already trained; and torch's own mixed precision beside them.

The torch rows (``TORCH_BASELINES``) train the plain model under ``torch.autocast`` (precsearch.train.autocast),
with no policy file. They assign no formats, so the cost model has no figure for them (``memory``, ``bytes`` and
``peak_predicted`` are NaN); what they hold is measured: ``peak_bytes``, one proxy step's peak, and
``step_time``, the median seconds of a step, each beside the plain fp32 model's step measured in the same call
(``peak_x_fp32``, ``step_time_x_fp32``). The policy rows hold the cost model's figures instead. fp16 autocast is
CUDA's recipe: elsewhere ``autocast_fp16`` is skipped with one INFO line, so the default list runs anywhere.
"""

from __future__ import annotations

import logging
import math
from pathlib import Path
from typing import Any

import pandas as pd
import torch
from tqdm.auto import tqdm

from precsearch.config.compiling import CompileOptions
from precsearch.config.policy import Policy
from precsearch.config.reading import REWRITE, load_json_object
from precsearch.config.spaces import SearchSpace, load_space, parse_space
from precsearch.config.spec import DEFAULT_MEMORY_MEASURE, TORCH_BASELINES, ProxyConfig
from precsearch.cost.measured import measure_peak, median_step_times, sgd_step
from precsearch.errors import PrecsearchError
from precsearch.files import atomic_write_text
from precsearch.search.context import Budget, DataSpec, SearchContext, proxy_compile, torch_threads
from precsearch.search.rundir import RUN_FILE
from precsearch.search.settings import SearchConfig
from precsearch.search.strategies import BASELINES, baseline_policies, sweep
from precsearch.search.study import quiet, study_config
from precsearch.train.autocast import AUTOCAST_DTYPES, autocast_scaler
from precsearch.train.data import ImageDataset
from precsearch.train.proxy import run_proxy
from precsearch.train.reading import flagged
from precsearch.train.trainer import build_model, resolve_device

__all__ = ["run_baselines"]

log = logging.getLogger(__name__)


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


_MEMORIES = ("memory_bytes", "memory_peak", "peak_predicted")  # SearchContext.memories
_COPIED = ("memory", "bytes", *_MEMORIES, "val_accuracy", "val_loss", "batch_stats_accuracy", "diverged", "reason",
           "promotions", "wall_time")
_SEED_FIELDS = ("seeds", "val_accuracy_sd")  # copied when the reused trial has them (a multi-seed search)
_MEASURED = ("peak_bytes", "peak_x_fp32", "step_time", "step_time_x_fp32")  # the torch rows' (module doc)
TIMED_STEPS = 5  # each torch row's step time: the median of this many steps, taken in turn with plain fp32's


def _measured_steps(model_spec: str, train_set: ImageDataset, config: ProxyConfig, device: torch.device,
                    dtypes: tuple[torch.dtype | None, ...]) -> list[tuple[int, float]]:
    """(peak bytes, median seconds) of one proxy step of the plain model under ``torch.autocast`` of each of
    ``dtypes`` (None: plain fp32), each a fresh model measured after two steps (momentum buffers made)."""
    images = train_set.images[:config.batch_size].to(device)
    labels = train_set.labels[:config.batch_size].to(device)
    peaks, steps = [], []
    with torch.random.fork_rng(devices=[]):  # the model's init draws from the global generator
        torch.manual_seed(0)
        for dtype in dtypes:
            model = build_model(model_spec, train_set.num_classes).to(device)
            optimizer = torch.optim.SGD(model.parameters(), lr=config.lr, momentum=config.momentum,
                                        weight_decay=config.weight_decay)
            step = sgd_step(model, optimizer, images, labels, autocast=dtype, scaler=autocast_scaler(dtype, device),
                            warmup=2)
            peaks.append(measure_peak(step, device))
            steps.append(step)
    return list(zip(peaks, median_step_times(steps, device, TIMED_STEPS), strict=True))


def _autocast_row(model_spec: str, context: SearchContext, config: ProxyConfig, seed: int, device: str,
                  dtype: torch.dtype) -> dict[str, Any]:
    """A torch row: the proxy trained under ``torch.autocast(dtype)``, and its step measured beside plain fp32's."""
    result = run_proxy(model_spec, None, context.data, config.steps, seed=seed, device=device, config=config,
                       autocast=dtype)
    (plain_peak, plain_time), (peak, seconds) = _measured_steps(model_spec, context.data[0], config,
                                                                resolve_device(device), (None, dtype))
    return {"memory": math.nan, "bytes": math.nan, **dict.fromkeys(_MEMORIES, math.nan),
            "val_accuracy": result.val_accuracy, "val_loss": result.val_loss,
            "batch_stats_accuracy": result.batch_stats_accuracy, "diverged": result.diverged, "reason": result.reason,
            "promotions": 0, "wall_time": result.wall_time, "reused": "", "peak_bytes": peak,
            "peak_x_fp32": peak / plain_peak, "step_time": seconds, "step_time_x_fp32": seconds / plain_time}


def _torch_names(names: tuple[str, ...] | list[str], device: str) -> list[str]:
    """The torch rows to train: ``autocast_fp16`` only where fp16 autocast is CUDA's (module doc)."""
    chosen = [name for name in names if name in TORCH_BASELINES]
    if "autocast_fp16" in chosen and resolve_device(device).type != "cuda":
        log.info("autocast_fp16 skipped: torch.autocast(float16) with a GradScaler is CUDA's recipe, and this run "
                 "is on the CPU")
        chosen.remove("autocast_fp16")
    return chosen


def _policy_row(source: str, name: str, policy: Policy, key: str, known: dict[str, dict[str, Any]],
                context: SearchContext, seed: int, device: str, compile: CompileOptions | None,
                out_dir: Path) -> tuple[dict[str, Any], str]:
    """A policy's row, reused from ``known`` (a search's trial or an earlier row) or trained, and its policy file."""
    row: dict[str, Any]
    if key in known:
        row = {field: known[key].get(field, math.nan) for field in (*_COPIED, "reused")}
        row["memory"] = row[f"memory_{context.budget.memory}"]  # the search may have minimized the other measure
        row.update({field: known[key][field] for field in _SEED_FIELDS if field in known[key]})
    else:
        space = context.space
        result = run_proxy(context.model, policy, context.data, space.proxy.steps, seed=seed, device=device,
                           config=space.proxy, compile=proxy_compile(compile))
        measures, size = context.memories(policy.assignment(context.graph), result.promotions)
        row = dict(memory=measures[f"memory_{context.budget.memory}"], bytes=size, **measures,
                   val_accuracy=result.val_accuracy, val_loss=result.val_loss,
                   batch_stats_accuracy=result.batch_stats_accuracy, diverged=result.diverged, reason=result.reason,
                   promotions=len(result.promotions), wall_time=result.wall_time, reused="")
        if key:
            known[key] = {**row, "reused": f"{source} {name}"}
    path = out_dir / "baselines" / f"{source}_{name.replace('=', '')}.json"
    proxy = {"val_accuracy": float(row["val_accuracy"]), "memory": float(row["memory"]),
             "diverged": bool(row["diverged"])}
    policy.replace(provenance={**policy.provenance, "source": source, "name": name, "proxy": proxy}).save(path)
    return row, str(path.relative_to(out_dir))


def run_baselines(model_spec: str, space: SearchSpace | str | Path, data: DataSpec | str = "digits",
                  out_dir: str | Path = "runs/baselines", proxy_steps: int | None = None, seed: int = 0,
                  device: str = "auto", *, names: tuple[str, ...] | list[str] = (*BASELINES, *TORCH_BASELINES),
                  ablations: bool = False, batch_size: int | None = None, image_size: int | None = None,
                  threads: int | None = None, progress: bool = True, compile: CompileOptions | None = None,
                  memory: str | None = None) -> pd.DataFrame:
    """Train the prior-work baselines, torch's autocast and the paper's sweep (plus its ablations) under the
    same proxies: ``baselines.csv`` (rewritten after each proxy) and ``baselines/<source>_<name>.json``. In a
    search's run directory made with the same model, space, data and seed, the proxies are as long as the
    search's, and points it already trained are reused, as are sweep points that coincide. ``memory``: the
    measure of the ``memory`` column (None: the run directory's search's, else the step's peak)."""
    if isinstance(space, str | Path):
        space = load_space(space)
    run_file = Path(out_dir) / RUN_FILE
    recorded = load_json_object(run_file, "run file", REWRITE) if run_file.is_file() else {}
    if proxy_steps is None:
        proxy_steps = recorded.get("proxy_length")
    if memory is None:
        memory = recorded["budget"].get("memory", "bytes") if "budget" in recorded else DEFAULT_MEMORY_MEASURE
    space = space.with_proxy(steps=proxy_steps, batch_size=batch_size, image_size=image_size)
    data_spec = DataSpec(data) if isinstance(data, str) else data
    unknown = [name for name in names if name not in (*BASELINES, *TORCH_BASELINES)]
    if unknown:
        raise PrecsearchError(f"unknown baseline {unknown[0]!r}; use any of {', '.join(BASELINES + TORCH_BASELINES)}")
    if threads is not None and threads < 1:
        raise PrecsearchError(f"threads={threads} must be at least 1")
    resolve_device(device)
    context = SearchContext.create(model_spec, space, data_spec, Budget(memory=memory), seed, device)
    out_dir = Path(out_dir)
    known = {key: {**row, "reused": f"trial {int(row['number'])}"}
             for key, row in _reusable_trials(out_dir, context).items()}
    todo: list[tuple[str, str, Policy | None, float | None, str]] = [
        ("baseline", name, policy.replace(model=model_spec), None, "")
        for name, policy in baseline_policies(context.graph, [n for n in names if n in BASELINES]).items()]
    todo += [("torch", name, None, None, "") for name in _torch_names(names, device)]
    for order in ("largest", "smallest", "random") if ablations else ("largest",):
        for candidate in sweep(context.graph, space, order=order, seed=seed):
            policy = context.policy(candidate.assignment, {"strategy": candidate.strategy, "r": candidate.r})
            todo.append(("paper" if order == "largest" else order, f"r={candidate.r:.1f}", policy, candidate.r,
                         candidate.key))
    (out_dir / "baselines").mkdir(parents=True, exist_ok=True)
    rows: list[dict[str, Any]] = []
    with quiet(), torch_threads(threads):
        for source, name, policy, r, key in tqdm(todo, desc="baselines", unit="proxy", disable=not progress):
            if policy is None:
                fields, path = _autocast_row(model_spec, context, space.proxy, seed, device, AUTOCAST_DTYPES[name]), ""
            else:
                fields, path = _policy_row(source, name, policy, key, known, context, seed, device, compile, out_dir)
            row = {"source": source, "name": name, "r": math.nan if r is None else r, "key": key, **fields}
            row.update({field: row.get(field, math.nan) for field in _MEASURED})
            row["reading_flagged"] = flagged(row["val_accuracy"], row["batch_stats_accuracy"], context.budget.drop)
            rows.append({**row, "policy": path})
            atomic_write_text(out_dir / "baselines.csv", pd.DataFrame(rows).to_csv(index=False))
    return pd.DataFrame(rows)
