"""Reports of a run directory: the memory-accuracy tradeoff as a PNG and a markdown table.

Everything comes from the files a search and ``precsearch baselines`` leave in the run directory (``trials.csv``,
``pareto.csv``, ``baselines.csv``, ``run.json``, ``calibration.csv``, ``budget.csv``, ``best.json``,
``sensitivity.csv``), so the Pareto front, the paper's sweep and the prior-work baselines are shown side by side with
numbers from the same proxies, the front's confirmed accuracies next to its proxy accuracies, the pick next to the
confirmed all-high and plain fp32 runs, the reference's learning curve that set the proxy length, the training steps
each phase spent, and the measured sensitivity of each unit against the bytes its demotion saves (``precsearch
sensitivity``). Memory is the measure the search minimized (a step's predicted peak by default, or the paper's bytes of
the assignable tensors) relative to the space's all-high assignment, beside the step's peak in MiB and its ratio to
torch.autocast(bf16)'s.

Figures are made with ``matplotlib.figure.Figure`` (rendered by the Agg canvas), never through pyplot, so a headless CLI
needs no display and a notebook keeps its own backend (pass ``ax`` to draw into it).
"""

from __future__ import annotations

import io
import logging
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pandas as pd
from matplotlib.figure import Figure

from precsearch.config.reading import REWRITE, load_json_object
from precsearch.errors import PrecsearchError
from precsearch.files import atomic_write_bytes, atomic_write_text
from precsearch.search.origins import origins
from precsearch.search.sensitivity_table import SENSITIVITY_CSV, unit_table

log = logging.getLogger(__name__)

__all__ = ["RunTables", "calibration_table", "load_run", "markdown_table", "plot_sensitivity", "plot_tradeoff",
           "save_figure", "summary_table", "sweep_points", "write_report"]

_R_PATTERN = re.compile(r"paper r=(\d+(?:\.\d+)?)")
MEASURE_LABELS = {"bytes": "bytes of the tensors training keeps", "peak": "peak of a training step"}


@dataclass
class RunTables:
    """The tables of one run directory (``baselines`` is empty when no baselines were run)."""

    run_dir: Path
    config: dict[str, Any]
    trials: pd.DataFrame
    pareto: pd.DataFrame
    baselines: pd.DataFrame
    best: dict[str, Any] | None
    calibration: pd.DataFrame
    budget: pd.DataFrame
    sensitivity: pd.DataFrame  # empty unless the run has sensitivity.csv


def _read_json(path: Path) -> dict[str, Any]:
    """A JSON object file of the run (run.json, best.json). precsearch writes them whole (atomically), so one that
    is empty, cut or not an object was damaged by a copy or an edit: refused in one line, not a traceback."""
    return load_json_object(path, "run file", REWRITE)


def _read_csv(path: Path) -> pd.DataFrame:
    """A table with its text columns as strings ('' where empty) and its numbers as numbers.

    Every line precsearch writes ends with a newline, the header included (even in a table without rows): a file
    without one is empty or cut inside its header and is refused. A last line without one was cut short (a copy or
    a write that was interrupted): it is left out with a WARNING, not read as a row of missing values (whose
    empty ``diverged`` would count as a divergence)."""
    text = path.read_text()
    if "\n" not in text:
        raise PrecsearchError(f"{path} is {'empty' if not text else 'cut inside its header line'}; {REWRITE}")
    if not text.endswith("\n"):
        log.warning("%s: its last row is cut short; reporting without it", path)
        text = text[: text.rfind("\n") + 1]
    try:
        frame = pd.read_csv(io.StringIO(text))
    except pd.errors.EmptyDataError:
        return pd.DataFrame()
    except pd.errors.ParserError as error:
        raise PrecsearchError(f"{path}: not a table precsearch wrote ({str(error).strip()}); {REWRITE}") from None
    _check_cells(frame, path)
    missing = [column for column in REQUIRED_COLUMNS.get(path.name, ()) if column not in frame]
    if missing and not frame.empty:
        raise PrecsearchError(f"{path} has no column {missing[0]}; the file was edited or damaged: write it again")
    for column in ("origin", "reason", "error", "name", "source", "reused"):
        if column in frame:
            frame[column] = frame[column].astype(object).where(frame[column].notna(), "").astype(str)
    return frame


# The columns the report reads as numbers and as flags; a cell of another kind (an edited or damaged file) is
# refused naming the file, the column and the line, never read as NaN or as True.
NUMBER_COLUMNS = ("number", "memory", "memory_bytes", "memory_peak", "peak_predicted", "peak_bytes", "bytes",
                  "val_accuracy", "val_accuracy_sd", "val_loss", "promotions", "seeds", "within_noise_of",
                  "confirmed_accuracy", "confirmed_sd", "confirmed_seeds", "confirmed_steps", "length", "seed", "step",
                  "runs", "steps", "share_of_total")
FLAG_COLUMNS = ("trained", "diverged", "feasible", "interrupted", "confirmed_diverged", "chosen")
_POINT = ("memory", "val_accuracy", "val_loss", "diverged")
REQUIRED_COLUMNS = {"trials.csv": ("number", "state", "origin", "trained", *_POINT), "pareto.csv": ("number", *_POINT),
                    "baselines.csv": ("source", "name", *_POINT)}


def _check_cells(frame: pd.DataFrame, path: Path) -> None:
    for column in frame.columns:
        cells = frame[column]
        if column in NUMBER_COLUMNS:
            bad = cells.notna() & pd.to_numeric(cells, errors="coerce").isna()
            wanted = "a number"
        elif column in FLAG_COLUMNS:
            bad = cells.notna() & ~cells.astype(str).isin(("True", "False"))
            wanted = "True or False"
        else:
            continue
        if bad.any():
            index = int(bad.to_numpy().nonzero()[0][0])
            raise PrecsearchError(f"{path}: column {column} holds {cells.iloc[index]!r} on line {index + 2}, not "
                                  f"{wanted}; the file was edited or damaged: fix that cell or write the file again")


def load_run(run_dir: str | Path) -> RunTables:
    """Read a run directory written by ``precsearch search`` (and optionally ``precsearch baselines``)."""
    run_dir = Path(run_dir)
    trials_file = run_dir / "trials.csv"
    baselines_file = run_dir / "baselines.csv"
    if not trials_file.is_file() and not baselines_file.is_file():
        raise PrecsearchError(f"{run_dir} holds no trials.csv or baselines.csv; give a run directory written by "
                              "precsearch search or precsearch baselines")
    config = _read_json(run_dir / "run.json") if (run_dir / "run.json").is_file() else {}
    trials = _read_csv(trials_file) if trials_file.is_file() else pd.DataFrame()
    pareto = _read_csv(run_dir / "pareto.csv") if (run_dir / "pareto.csv").is_file() else pd.DataFrame()
    baselines = _read_csv(baselines_file) if baselines_file.is_file() else pd.DataFrame()
    best = None
    if (run_dir / "best.json").is_file():
        best = _read_json(run_dir / "best.json").get("provenance")
        if not isinstance(best, dict):
            raise PrecsearchError(f"{run_dir / 'best.json'} has no provenance object; {REWRITE}")
    calibration, budget, sensitivity = (_read_csv(run_dir / name) if (run_dir / name).is_file() else pd.DataFrame()
                                        for name in ("calibration.csv", "budget.csv", SENSITIVITY_CSV))
    return RunTables(run_dir, config, trials, pareto, baselines, best, calibration, budget, sensitivity)


def sweep_points(trials: pd.DataFrame) -> pd.DataFrame:
    """The paper's sweep from a trials table: one row per target r (points that coincide share a trial)."""
    rows = []
    if trials.empty or "origin" not in trials:
        return pd.DataFrame(rows)
    for _, row in trials[trials["trained"].astype(bool)].iterrows():
        for match in filter(None, map(_R_PATTERN.fullmatch, origins(row["origin"]))):
            rows.append({**row.to_dict(), "r": float(match.group(1))})
    frame = pd.DataFrame(rows)
    return frame.sort_values("r").drop_duplicates("r") if not frame.empty else frame


def _mib(row: pd.Series, column: str) -> float:
    return float(row.get(column, math.nan)) / 2**20


def _entry(source: str, name: str, row: pd.Series, yardsticks: tuple[float, float]) -> dict[str, Any]:
    """One row of the summary: ``peak MiB`` is the step's peak, predicted by the cost model for a policy and
    measured for a torch.autocast row (which assigns no formats), beside plain fp32's and autocast bf16's measured
    peaks (``yardstick_peaks``); ``bytes MiB`` is the paper's bytes."""
    peak = _mib(row, "peak_bytes") if source == _SOURCES["torch"] else _mib(row, "peak_predicted")
    plain_fp32, autocast = yardsticks
    return {
        "source": source, "name": name, "memory": float(row["memory"]),
        "memory_bytes": float(row.get("memory_bytes", math.nan)),
        "memory_peak": float(row.get("memory_peak", math.nan)), "peak MiB": peak, "x plain fp32": peak / plain_fp32,
        "x autocast": peak / autocast, "bytes MiB": _mib(row, "bytes"),
        "val_accuracy": float(row["val_accuracy"]), "val_accuracy_sd": float(row.get("val_accuracy_sd", math.nan)),
        "val_loss": float(row["val_loss"]), "confirmed_accuracy": float(row.get("confirmed_accuracy", math.nan)),
        "confirmed_sd": float(row.get("confirmed_sd", math.nan)), "diverged": bool(row["diverged"]),
        "promotions": int(row["promotions"]) if not pd.isna(row.get("promotions", math.nan)) else 0,
    }


_SOURCES = {"baseline": "baseline", "torch": "torch.autocast"}  # baselines.csv's sources besides the sweep's


def summary_table(tables: RunTables) -> pd.DataFrame:
    """Pareto front, the paper's sweep and the baselines in one table (memory relative to all-high, the step's
    peak in MiB and beside torch.autocast bf16's)."""
    yardsticks = yardstick_peaks(tables)
    entries = [_entry("pareto", f"trial {int(row['number'])}", row, yardsticks)
               for _, row in tables.pareto.iterrows()]
    sweep = sweep_points(tables.trials)
    if sweep.empty and not tables.baselines.empty:
        sweep = tables.baselines[tables.baselines["source"] == "paper"]
    entries += [_entry("paper sweep", f"r={row['r']:.1f}", row, yardsticks) for _, row in sweep.iterrows()]
    if not tables.baselines.empty:
        for _, row in tables.baselines[tables.baselines["source"] != "paper"].iterrows():
            source = _SOURCES.get(row["source"], f"ablation ({row['source']})")
            entries.append(_entry(source, str(row["name"]), row, yardsticks))
    return pd.DataFrame(entries)


def yardstick_peaks(tables: RunTables) -> tuple[float, float]:
    """The measured step peaks of plain fp32 and torch.autocast(bf16), in MiB: autocast's baselines row (which
    measured plain fp32's beside it, ``peak_x_fp32``), else the pick's measurements in best.json (``StepPeaks``);
    NaN where neither ran."""
    baselines = tables.baselines
    if not baselines.empty and "peak_bytes" in baselines:
        row = baselines[(baselines["source"] == "torch") & (baselines["name"] == "autocast_bf16")]
        if not row.empty:
            autocast = _mib(row.iloc[0], "peak_bytes")
            return autocast / float(row.iloc[0]["peak_x_fp32"]), autocast
    peak = (tables.best or {}).get("peak")
    return (peak["plain_fp32"] / 2**20, peak["autocast_bf16"] / 2**20) if peak else (math.nan, math.nan)


def _by_point(frame: pd.DataFrame, column: str) -> dict[tuple[float, float], list[Any]]:
    """Values of ``column`` grouped by (memory, accuracy), so coinciding points get one label."""
    points: dict[tuple[float, float], list[Any]] = {}
    for _, row in frame.iterrows():
        points.setdefault((float(row["memory"]), float(row["val_accuracy"])), []).append(row[column])
    return points


def plot_tradeoff(tables: RunTables, ax: Any = None) -> Figure:
    """Memory (x, ratio to all-high) against proxy validation accuracy (y): every trial, the Pareto front,
    the paper's sweep and the baselines; diverged proxies are drawn at their accuracy with an x."""
    fig = Figure(figsize=(7.5, 5)) if ax is None else ax.figure
    ax = fig.subplots() if ax is None else ax
    trials = tables.trials
    if not trials.empty:
        trained = trials[trials["trained"].astype(bool)]
        ok, bad = trained[~trained["diverged"].astype(bool)], trained[trained["diverged"].astype(bool)]
        ax.scatter(ok["memory"], ok["val_accuracy"], s=18, color="0.7", label="trials", zorder=1)
        if not bad.empty:
            ax.scatter(bad["memory"], bad["val_accuracy"], s=30, marker="x", color="0.4", label="diverged",
                       zorder=1)
    if not tables.pareto.empty:
        front = tables.pareto.sort_values("memory")
        ax.step(front["memory"], front["val_accuracy"], where="post", color="tab:red", zorder=3)
        ax.scatter(front["memory"], front["val_accuracy"], s=40, color="tab:red", label="Pareto front", zorder=3)
        _draw_noise(ax, front)
    sweep = sweep_points(trials)
    if sweep.empty and not tables.baselines.empty:
        sweep = tables.baselines[tables.baselines["source"] == "paper"]
    if not sweep.empty:
        ax.plot(sweep["memory"], sweep["val_accuracy"], "o--", color="tab:blue", ms=5, label="paper sweep (r)",
                zorder=2)
        for index, ((memory, accuracy), rs) in enumerate(_by_point(sweep, "r").items()):
            label = f"r={rs[0]:.1f}" if len(rs) == 1 else f"r={rs[0]:.1f}-{rs[-1]:.1f}"
            ax.annotate(label, (memory, accuracy), fontsize=7, color="tab:blue", xytext=(3, -9 - 8 * (index % 2)),
                        textcoords="offset points")
    if not tables.baselines.empty:
        others = tables.baselines[tables.baselines["source"] == "baseline"]
        ax.scatter(others["memory"], others["val_accuracy"], marker="s", s=40, color="tab:green",
                   label="baselines", zorder=4)
        labelled = others.assign(label=[f"{row['name']}{' (diverged)' if bool(row['diverged']) else ''}"
                                        for _, row in others.iterrows()])
        points = sorted(_by_point(labelled, "label").items())
        for index, ((memory, accuracy), names) in enumerate(points):
            ax.annotate(", ".join(names), (memory, accuracy), fontsize=7, color="tab:green",
                        xytext=(4, 4 + 8 * (index % 3)), textcoords="offset points")
    measure = tables.config.get("budget", {}).get("memory", "bytes")
    ax.set_xlabel(f"memory optimized: {MEASURE_LABELS[measure]} (ratio to all-high, cost model)")
    ax.set_ylabel("proxy validation accuracy")
    title = tables.config.get("model", "")
    space = tables.config.get("space", {}).get("name", "")
    ax.set_title(f"{title} / {space}: memory vs accuracy" if title else "memory vs accuracy")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="lower right")
    fig.tight_layout()
    return fig


def plot_sensitivity(table: pd.DataFrame, ax: Any = None) -> Figure:
    """Each unit of a sensitivity table (``SENSITIVITY_CSV``) as its summed score against its bytes saved."""
    units = unit_table(table)
    fig = Figure(figsize=(6.5, 4.5)) if ax is None else ax.figure
    ax = fig.add_subplot() if ax is None else ax
    ax.scatter(units["bytes_saved"], units["score"].clip(lower=1e-30), color="tab:purple")
    for row in units.itertuples():
        ax.annotate(str(row.unit), (row.bytes_saved, max(row.score, 1e-30)), fontsize=7,
                    xytext=(3, 3), textcoords="offset points")
    ax.set_yscale("log")
    ax.set_xlabel("bytes saved by demoting the unit")
    ax.set_ylabel("sensitivity (summed score)")
    ax.set_title("sensitivity against bytes")
    return fig


def _draw_noise(ax: Any, front: pd.DataFrame) -> None:
    """Seed error bars (+- sd) on the front, and a white centre on points whose accuracy is within seed noise
    of a cheaper front point (``within_noise_of``): their extra memory buys nothing measurable."""
    if "val_accuracy_sd" in front and front["val_accuracy_sd"].notna().any():
        ax.errorbar(front["memory"], front["val_accuracy"], yerr=front["val_accuracy_sd"].fillna(0), fmt="none",
                    ecolor="tab:red", capsize=3, zorder=3)
    if "within_noise_of" in front:
        tied = front[front["within_noise_of"] >= 0]
        if not tied.empty:
            ax.scatter(tied["memory"], tied["val_accuracy"], s=40, facecolors="white", edgecolors="tab:red", zorder=4,
                       label="front point within seed noise of a cheaper one")


def markdown_table(frame: pd.DataFrame) -> str:
    """A GitHub markdown table (pandas' to_markdown needs tabulate, which we do not depend on)."""
    if frame.empty:
        return "(no rows)\n"
    def cell(value: Any) -> str:
        if isinstance(value, float):
            return "nan" if math.isnan(value) else f"{value:.4f}"
        return str(value)

    lines = ["| " + " | ".join(frame.columns) + " |", "|" + "---|" * len(frame.columns)]
    lines += ["| " + " | ".join(cell(value) for value in row) + " |" for row in frame.itertuples(index=False)]
    return "\n".join(lines) + "\n"


def _confirmation_lines(record: dict[str, Any] | None) -> list[str]:
    """The pick's proxy and confirmed accuracy next to the confirmed all-high and plain fp32 runs."""
    if not record:
        return []
    def text(value: Any) -> str:
        return "n/a" if value is None else f"{value:.4f}"

    def seeds(name: str) -> str:
        return "" if record.get(name) is None else f" ({record[name]} seed{'s' if record[name] > 1 else ''})"

    lines = [f"- confirmed over {record['steps']} steps on fresh seeds: the pick "
             f"{text(record['confirmed_accuracy'])}{seeds('seeds')} (proxy {text(record['proxy_accuracy'])}), "
             f"all-high {text(record['all_high_accuracy'])}{seeds('all_high_seeds')}, plain fp32 "
             f"{text(record['plain_fp32_accuracy'])}{seeds('plain_fp32_seeds')}"]
    if record.get("note"):
        lines.append(f"- {record['note']}")
    return lines


def calibration_table(calibration: pd.DataFrame) -> pd.DataFrame:
    """calibration.csv summarized: one row per (length, step) with the seeds' mean, min and max accuracy."""
    grouped = calibration.groupby(["length", "step"])["val_accuracy"]
    table = grouped.agg(["mean", "min", "max", "count"]).reset_index()
    chosen = calibration.groupby("length")["chosen"].first()
    table["chosen"] = table["length"].map(chosen).astype(bool)
    return table.rename(columns={"mean": "accuracy_mean", "min": "accuracy_min", "max": "accuracy_max",
                                 "count": "seeds"})


def save_figure(figure: Figure, path: Path) -> None:
    """``figure`` as a PNG, written atomically (``files.atomic_write_bytes``): on a full disk nothing is left."""
    buffer = io.BytesIO()
    figure.savefig(buffer, dpi=130, format="png")
    atomic_write_bytes(path, buffer.getvalue())


def write_report(run_dir: str | Path) -> tuple[Path, Path]:
    """Write ``report.png`` and ``report.md`` into ``run_dir``; returns their paths."""
    from precsearch.search.peaks import StepPeaks  # torch's: the report's tables need none

    tables = load_run(run_dir)
    run_dir = Path(run_dir)
    png = run_dir / "report.png"
    save_figure(plot_tradeoff(tables), png)
    table = summary_table(tables)
    config = tables.config
    lines = [f"# precsearch report: {run_dir.name}", ""]
    if config:
        proxy = config.get("space", {}).get("proxy", {})
        lines.append(f"- model: `{config.get('model')}`, data: `{config.get('data', {}).get('name')}`, space: "
                     f"`{config.get('space', {}).get('name')}`, seed {config.get('seed')}")
        if proxy:  # the space's steps are replaced by the run's proxy length where it has one (below)
            shown = {key: value for key, value in proxy.items() if key != "steps" or "proxy_length" not in config}
            lines.append("- proxies: " + ", ".join(f"{key} {value}" for key, value in shown.items()))
    if not tables.trials.empty:
        states = tables.trials["state"].value_counts().to_dict()
        diverged = int(tables.trials["diverged"].astype(bool).sum())
        lines.append(f"- trials: {len(tables.trials)} ({', '.join(f'{n} {s}' for s, n in states.items())}), "
                     f"{diverged} diverged")
    elif (run_dir / "trials.csv").is_file():
        log.warning("%s holds no trials: the search stopped before its first trial (precsearch search --resume "
                    "continues it); the report shows no trials", run_dir / "trials.csv")
        lines.append("- trials: none (the search stopped before its first trial)")
    if "proxy_length" in config:
        how = "fixed" if config.get("calibration", {}).get("fixed") else "calibrated on the all-high reference"
        lines.append(f"- proxy length: {config['proxy_length']} steps ({how})")
    if tables.best:
        lines.append(f"- best.json: trial {tables.best.get('trial')} ({tables.best.get('role')})")
        lines += _confirmation_lines(tables.best.get("confirmation"))
        if tables.best.get("noise"):
            lines.append(f"- noise: {tables.best['noise']['statement']}")
        if tables.best.get("peak"):
            lines.append(f"- the pick's {StepPeaks(**tables.best['peak']).describe()}")
    measure = config.get("budget", {}).get("memory", "bytes")
    lines += ["", f"Memory is the measure the search minimized, {MEASURE_LABELS[measure]}, relative to the all-high "
              "assignment (promoted tensors counted high): `memory_peak` the cost model's step peak, "
              "`memory_bytes` the paper's bytes of weights, activations and their gradients. `peak MiB` is a "
              "step's peak, predicted by the cost model for a policy and measured for a torch.autocast row (which "
              "assigns no formats and has no memory ratio), and `x plain fp32` and `x autocast` its ratios to the "
              "measured peaks of plain fp32 and torch.autocast(bf16); `bytes MiB` the paper's bytes. Accuracy is the "
              "proxy's validation accuracy.",
              "", "![tradeoff](report.png)", "", markdown_table(table)]
    if not tables.calibration.empty:
        lines += ["## Calibration: the all-high reference's learning curve", "",
                  "Mean (min-max over seeds) validation accuracy at each evaluated step of each length; the chosen "
                  "length is the proxy length.", "", markdown_table(calibration_table(tables.calibration))]
    if not tables.budget.empty:
        lines += ["## Training steps", "", markdown_table(tables.budget)]
    if not tables.sensitivity.empty:
        save_figure(plot_sensitivity(tables.sensitivity), run_dir / "sensitivity.png")
        lines += ["## Sensitivity", "", "Each unit's summed score (the loss change its low format would cause, "
                  "precsearch.search.sensitivity) against the bytes demoting it saves, least sensitive per byte "
                  "first.", "", "![sensitivity](sensitivity.png)", "", markdown_table(unit_table(tables.sensitivity))]
    md = run_dir / "report.md"
    atomic_write_text(md, "\n".join(lines))
    return png, md
