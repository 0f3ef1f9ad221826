"""`meshrun report RUN [RUN ...]`: runs side by side, read from their run directories.

The table is each run's summary.json (written when the run completed; its throughput covers
every segment of a resumed run) beside its layout; the picture overlays the runs' loss curves
from metrics.jsonl against tokens seen, the axis on which two layouts (or a resumed and an
uninterrupted run) of the same job must agree.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from meshrun.config.topology import ParallelConfig
from meshrun.errors import ConfigError
from meshrun.metrics.record import read_metrics_rows, read_summary, slowest_rank, time_split_totals
from meshrun.metrics.recoveries import Recovery, format_recoveries, run_recoveries
from meshrun.parallel.layout import Layout, place_text

REPORT_NAME = "report.png"  # the picture's name in the first run's directory when --out is not given
COLUMNS = ("run", "layout", "precision", "tokens/s", "MFU", "peak GB per stage", "bubble", "final loss", "val loss")


@dataclass
class RunRecord:
    name: str
    config: dict[str, Any]
    summary: dict[str, Any] | None  # None: the run has not completed
    rows: list[dict[str, Any]]
    layout: Layout
    recoveries: list[Recovery]

    @property
    def tokens_per_step(self) -> int:
        return self.config["train"]["global_batch"] * self.config["model"]["seq_len"]


def read_run(path: Path) -> RunRecord:
    """A run directory's config, summary and metric rows; one-line errors for what is not one."""
    if not (path / "config.json").is_file():
        raise ConfigError(f"{path} is not a meshrun run directory (no config.json); pass the run_dir of a training job")
    try:
        config = json.loads((path / "config.json").read_text())
    except (OSError, ValueError, RecursionError) as exc:
        raise ConfigError(f"cannot read run {path}: {type(exc).__name__}: {exc}") from None
    if not _is_run_config(config):
        raise ConfigError(
            f"{path}/config.json is not a meshrun run's resolved config; pass the run_dir of a training job"
        )
    summary = read_summary(path / "summary.json")
    rows = read_metrics_rows(path / "metrics.jsonl")
    layout = _run_layout(path, config["parallel"])
    return RunRecord(path.name or str(path), config, summary, rows, layout, run_recoveries(rows, path))


def _run_layout(path: Path, parallel: dict[str, Any]) -> Layout:
    """The layout a run's config.json holds (keys of older versions that no longer exist are left out)."""
    known = {key: value for key, value in parallel.items() if key in ParallelConfig.model_fields}
    try:
        return Layout.of(ParallelConfig.model_validate(known))
    except ValidationError as exc:
        error = exc.errors()[0]
        where = ".".join(str(part) for part in ("parallel", *error["loc"]))
        raise ConfigError(
            f"{path}/config.json is not a meshrun run's resolved config ({where}: {error['msg']})"
        ) from None


def _is_run_config(config: Any) -> bool:
    """The resolved-config fields the table and the picture read, with the types meshrun wrote."""
    try:
        counts = (config["parallel"]["dp"], config["parallel"]["pp"], config["train"]["global_batch"])
        return isinstance(config["precision"], str) and all(
            type(n) is int for n in (*counts, config["model"]["seq_len"])
        )
    except (KeyError, TypeError):
        return False


def _number(value: Any, fmt: str) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    return format(value, fmt)


def table_row(run: RunRecord) -> list[str]:
    """One run's cells; '-' where the run did not measure a value (no MFU on CPU, no pipeline)."""
    s = run.summary or {}
    memory = s.get("peak_memory_gb_per_stage") or ([s["peak_memory_gb"]] if "peak_memory_gb" in s else [])
    return [
        run.name + ("" if run.summary else " (not finished)"),
        run.layout.text(),  # the config's, not summary.json's: older runs' summaries left tp out
        s.get("precision") or run.config["precision"],
        _number(s.get("tokens_per_s"), ".1f")
        + (f" (steps {s['measured_from_step']}+)" if "measured_from_step" in s else ""),
        _number(s["mfu"] * 100, ".2f") + "%" if "mfu" in s else "-",
        " / ".join(format(gb, ".3f") for gb in memory) or "-",
        _number(s["bubble"] * 100, ".2f") + "%" if "bubble" in s else "-",
        _number(s.get("final_loss"), ".5f"),
        _number(s.get("final_val_loss"), ".5f"),
    ]


def format_table(runs: list[RunRecord]) -> str:
    """A Markdown table: aligned in a terminal, pasteable into an issue."""
    return markdown([list(COLUMNS), *(table_row(run) for run in runs)])


def time_split_row(run: RunRecord, parts: list[str]) -> list[str]:
    """Where one run's time went (each part's share of every rank's logged windows) and its slowest
    rank; '-' for a run from before the time split."""
    shares = time_split_totals(run.rows)
    slow = slowest_rank(run.rows)
    slowest = "-"
    if slow is not None:
        slowest = (
            f"rank {slow['rank']} ({place_text(slow)}): {slow['ratio']:.2f}x the median, "
            f"in {slow['windows']}/{slow['of']} windows"
        )
    return [run.name, *(_number(shares[p] * 100, ".1f") + "%" if p in shares else "-" for p in parts), slowest]


def format_time_split(runs: list[RunRecord]) -> str:
    """Where the time goes, per run: the shares of wall time of every rank (docs/concepts/metrics.md); the parts
    in the order the runs logged them."""
    parts = list(dict.fromkeys(part for run in runs for part in time_split_totals(run.rows)))
    return "where the time goes (share of every rank's wall time):\n" + markdown(
        [["run", *parts, "slowest rank (compute)"], *(time_split_row(run, parts) for run in runs)]
    )


def markdown(cells: list[list[str]]) -> str:
    """Rows of cells (the first: the header) as an aligned Markdown table."""
    widths = [max(len(row[i]) for row in cells) for i in range(len(cells[0]))]
    lines = ["| " + " | ".join(cell.ljust(w) for cell, w in zip(row, widths)) + " |" for row in cells]
    lines.insert(1, "|" + "|".join("-" * (w + 2) for w in widths) + "|")
    return "\n".join(lines)


def plot_losses(runs: list[RunRecord], path: Path, *, replace: bool = False) -> None:
    """Train (lines) and validation (markers) loss of every run against tokens seen; `path` is
    written over only with `replace` (report --force)."""
    from meshrun.metrics.plots import plt, save_figure  # matplotlib, headless

    fig, ax = plt.subplots(figsize=(8, 4.5), layout="constrained")
    drawn = False
    for index, run in enumerate(runs):
        colour = f"C{index % 10}"
        for key, style in (("loss", "-"), ("val_loss", "o--")):
            points = [(row["step"] * run.tokens_per_step, row[key]) for row in run.rows if key in row]
            if points:
                ax.plot(*zip(*points), style, color=colour, label=f"{run.name} {key.replace('_', ' ')}")
                drawn = True
        mark_recoveries(ax, run, colour)
    ax.set_xlabel("tokens")
    ax.set_ylabel("cross-entropy (nats/token)")
    ax.grid(alpha=0.3)
    if drawn:  # a legend of nothing is a matplotlib warning, not a picture
        ax.legend(fontsize=8)
    else:
        ax.set_title("no loss logged yet in these runs' metrics.jsonl")
    save_figure(fig, path, replace=replace)


def mark_recoveries(ax: Any, run: RunRecord, colour: str) -> None:
    """A marker on `run`'s loss curve at each step a lost worker was recovered in (its loss: the
    step trained again), labelled once."""
    loss = {row["step"]: row["loss"] for row in run.rows if "loss" in row}
    steps = [r.step for r in run.recoveries if r.event is not None and r.step is not None and r.step in loss]
    if steps:
        x = [step * run.tokens_per_step for step in steps]
        ax.plot(x, [loss[s] for s in steps], "X", color=colour, markersize=10, label=f"{run.name} recovered")


def report(paths: list[str], *, out: str | None = None, force: bool = False) -> str:
    """The table for these run directories; writes the loss picture to `out`, by default
    REPORT_NAME in the first run's directory (a new file, or with `force` one that exists; never
    another of a run's own files)."""
    runs = [read_run(Path(p)) for p in paths]
    target = Path(out) if out is not None else Path(paths[0]) / REPORT_NAME
    name = f"--out {out}" if out is not None else str(target)
    if target.is_dir():
        raise ConfigError(f"{name} is a folder; name a .png file")
    if target.suffix.lower() not in (".png", ".pdf", ".svg"):
        raise ConfigError(f"{name}: name a .png (or .pdf, .svg) file for the loss curves")
    if target.exists() and target.name != REPORT_NAME and (target.parent / "config.json").is_file():
        raise ConfigError(f"{name} is a file of the run in {target.parent}; choose another --out")
    if target.exists() and not force:
        raise ConfigError(f"{name} already exists; choose another --out, or pass --force to replace it")
    try:
        plot_losses(runs, target, replace=force)
    except FileExistsError:
        raise ConfigError(f"{name} appeared while the picture was drawn; choose another --out") from None
    except OSError as exc:
        raise ConfigError(f"{name} cannot be written ({exc.strerror}); choose another --out") from None
    recoveries = format_recoveries([(run.name, run.recoveries) for run in runs])
    more = f"\n\n{recoveries}" if recoveries else ""
    return f"{format_table(runs)}\n\n{format_time_split(runs)}{more}\n\nloss curves: {target}"
