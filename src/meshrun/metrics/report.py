"""Rank 0's view of the run: progress (a live bar on a terminal, else lines), metric rows to
trackers, the end-of-run summary and pictures."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from meshrun.errors import ConfigError
from meshrun.files.atomic import write_atomic
from meshrun.files.console import say
from meshrun.metrics.record import read_metrics_rows, run_totals
from meshrun.metrics.trackers import NullTracker, Tracker

if TYPE_CHECKING:
    from meshrun.config.schema import Config


class ProgressBar:
    """A live tqdm bar on stderr (step, loss, tokens/s, ETA) for a terminal; other messages are
    written above it so the bar stays the last line."""

    def __init__(self, *, steps: int, start_step: int) -> None:
        from tqdm import tqdm  # lazy: only rank 0 on a terminal draws one

        self.bar = tqdm(
            total=steps,
            initial=start_step,
            file=sys.stderr,
            dynamic_ncols=True,
            bar_format="[meshrun] step {n_fmt}/{total_fmt} |{bar:20}| ETA {remaining}{postfix}",
        )
        self.write = tqdm.write

    def say(self, message: str) -> None:
        self.write(f"[meshrun] {message}", file=sys.stderr)

    def advance(self, step: int, row: dict[str, Any] | None = None) -> None:
        """To `step` done; `row`: the last logged numbers (they change at log steps only)."""
        if row is not None:
            self.bar.set_postfix_str(f"loss {row['loss']:.4f}, {row['tokens_per_s'] / 1e3:.1f}k tok/s")
        self.bar.update(step - self.bar.n)

    def close(self) -> None:
        self.bar.close()


def _fmt(row: dict[str, Any]) -> str:
    parts = [f"loss {row['loss']:.4f}", f"lr {row['lr']:.2e}", f"gnorm {row['grad_norm']:.3f}"]
    parts.append(f"{row['tokens_per_s'] / 1e3:.1f}k tok/s")
    parts.append(f"{row['tflops']:.3f} TFLOP/s" + (f" (MFU {row['mfu']:.1%})" if "mfu" in row else ""))
    parts.append(f"{row['step_time_s'] * 1e3:.0f} ms/step")
    parts.append(f"mem {row['memory_gb']:.2f} GB")
    if "bubble" in row:
        parts.append(f"bubble {row['bubble']:.1%}")
    if "loss_scale" in row:
        parts.append(f"scale {row['loss_scale']:.0f} skipped {row['skipped_steps']}")
    return " | ".join(parts)


class RunReport:
    """Collects rows; only the logging rank (rank 0) writes anything.

    A resumed run starts from the rows its earlier segments left in metrics.jsonl (up to the
    resumed step), so loss.png and the summary cover the whole run, not the last segment.
    """

    def __init__(
        self,
        run_dir: Path,
        *,
        steps: int,
        tracker: Tracker | None,
        timeline_title: str = "",
        start_step: int = 0,
        plots: bool = True,
    ) -> None:
        self.run_dir, self.steps, self.plots = run_dir, steps, plots
        self.tracker: Tracker = tracker or NullTracker()
        self.active = tracker is not None
        self.rows = self._earlier_rows(start_step) if self.active else []
        # No window before the resumed step on record (another run_dir's checkpoint): say from where.
        self.measured_from = 0 if any("train_s" in row for row in self.rows) else start_step
        self.timeline_title = timeline_title
        self.timeline: dict[str, Any] | None = None  # the last measured step: its number, bubble, stages
        live = self.active and sys.stderr.isatty()  # a terminal, not a log file or Slurm output
        self.bar = ProgressBar(steps=steps, start_step=start_step) if live else None

    def _say(self, message: str) -> None:
        if self.bar is not None:
            self.bar.say(message)
        else:
            say(message)

    def _earlier_rows(self, start_step: int) -> list[dict[str, Any]]:
        """What the run logged before `start_step` (metrics.jsonl, already cut back to it)."""
        if not start_step:
            return []
        try:
            return read_metrics_rows(self.run_dir / "metrics.jsonl")
        except ConfigError as exc:
            say(f"warning: {exc}; loss.png and the summary cover the steps after {start_step} only")
            return []

    def keep_timeline(self, step: int, by_stage: dict[int, Any], *, bubble: float) -> None:
        """Pipeline rank -> StepTimeline of measured step `step`, and its logged (all-rank) bubble."""
        self.timeline = {"step": step, "bubble": bubble, "stages": by_stage}

    def log(self, step: int, row: dict[str, Any]) -> None:
        """`step` is the number of optimizer steps completed (1-based)."""
        if not self.active:
            return
        self.rows.append({"step": step, **row})
        self.tracker.log(row, step=step)
        if "val_loss" in row:
            self._say(f"step {step}/{self.steps} | val loss {row['val_loss']:.4f} | eval {row['eval_s']:.2f} s")
        elif "loss" not in row:
            return  # a checkpoint's time: its own note says so
        elif self.bar is not None:
            self.bar.advance(step, row)
        else:
            say(f"step {step}/{self.steps} | {_fmt(row)}")

    def tick(self, step: int) -> None:
        """Every step: the bar moves (and its ETA updates) between log steps too, with no host sync."""
        if self.bar is not None:
            self.bar.advance(step)

    def note(self, message: str) -> None:
        if self.active:
            self._say(message)

    def run_totals(self) -> dict[str, Any]:
        """Throughput, time and peak memory of the whole run, from every row (see record.run_totals)."""
        totals: dict[str, Any] = dict(run_totals(self.rows))
        if self.measured_from:
            totals["measured_from_step"] = self.measured_from
        return totals

    def finish(self, summary: dict[str, Any]) -> None:
        if not self.active:
            return
        if self.bar is not None:
            self.bar.close()
            self.bar = None
        self.tracker.summarize(summary)
        if self.plots:
            from meshrun.metrics.plots import plot_loss  # matplotlib: only rank 0 draws, and only at the end

            plot_loss(self.rows, self.run_dir / "loss.png", run=self.run_dir.name)
        if self.timeline:
            self._save_timeline(**self.timeline)
        write_atomic(self.run_dir / "summary.json", json.dumps(summary, indent=2))
        lines = [f"{key:>16}: {_value(value)}" for key, value in summary.items()]
        say("summary\n" + "\n".join(lines))

    def _save_timeline(self, *, step: int, bubble: float, stages: dict[int, Any]) -> None:
        """pipeline_timeline.png (with `plots`) and the numbers it is drawn from (pipeline_timeline.json)."""
        if self.plots:
            from meshrun.metrics.plots import plot_timeline

            title = f"{self.run_dir.name}: {self.timeline_title} step {step},"
            plot_timeline(stages, self.run_dir / "pipeline_timeline.png", title=title, bubble=bubble)
        record = {
            "step": step,
            "bubble": bubble,
            "stages": {
                rank: {"wall": t.wall, "offset": t.offset, "actions": [vars(a) for a in t.actions]}
                for rank, t in stages.items()
            },
        }
        write_atomic(self.run_dir / "pipeline_timeline.json", json.dumps(record, indent=1))

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
        self.tracker.close()


def _value(value: Any) -> str:
    if isinstance(value, float):
        return "nan" if math.isnan(value) else f"{value:.4g}"
    return str(value)


def run_facts(cfg: Config, row: dict[str, Any]) -> dict[str, Any]:
    """What `meshrun report` compares runs by, beside the throughput: layout, precision, peak
    memory per pipeline stage and the last measured bubble (from the last logged row)."""
    stages = sorted(
        (k for k in row if k.startswith("memory_gb/stage")), key=lambda k: int(k.removeprefix("memory_gb/stage"))
    )
    facts = {
        "layout": cfg.layout.text(),
        "microbatches": cfg.accumulation_steps,
        "precision": cfg.precision,
        "peak_memory_gb_per_stage": [row[k] for k in stages],
    }
    if "bubble" in row:
        facts["bubble"] = row["bubble"]
    facts.update({k: row[k] for k in ("trainable_params", "params", "trainable_state_bytes") if k in row})  # LoRA
    return facts
