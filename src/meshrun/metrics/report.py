"""Rank 0's view of the run: progress lines, metric rows to trackers, the end-of-run summary."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from meshrun.metrics.console import say
from meshrun.metrics.trackers import NullTracker, Tracker


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
    """Collects rows; only the logging rank (rank 0) writes anything."""

    def __init__(self, run_dir: Path, *, steps: int, tracker: Tracker | None, timeline_title: str = "") -> None:
        self.run_dir, self.steps = run_dir, steps
        self.tracker: Tracker = tracker or NullTracker()
        self.active = tracker is not None
        self.rows: list[dict[str, Any]] = []
        self.timeline_title = timeline_title
        self.timeline: dict[int, Any] | None = None  # pipeline rank -> StepTimeline of the last measured step

    def log(self, step: int, row: dict[str, Any]) -> None:
        """`step` is the number of optimizer steps completed (1-based)."""
        if not self.active:
            return
        self.rows.append({"step": step, **row})
        self.tracker.log(row, step=step)
        if "val_loss" in row:
            say(f"step {step}/{self.steps} | val loss {row['val_loss']:.4f}")
        else:
            say(f"step {step}/{self.steps} | {_fmt(row)}")

    def note(self, message: str) -> None:
        if self.active:
            say(message)

    def finish(self, summary: dict[str, Any]) -> None:
        if not self.active:
            return
        self.tracker.summarize(summary)
        # matplotlib costs about 1.5 s of CPU to import: only the rank that plots, only here
        from meshrun.metrics.plots import plot_loss, plot_timeline

        plot_loss(self.rows, self.run_dir / "loss.png")
        if self.timeline:
            plot_timeline(self.timeline, self.run_dir / "pipeline_timeline.png", title=self.timeline_title)
        (self.run_dir / "summary.json").write_text(json.dumps(summary, indent=2))
        lines = [f"{key:>16}: {_value(value)}" for key, value in summary.items()]
        say("summary\n" + "\n".join(lines))

    def close(self) -> None:
        self.tracker.close()


def _value(value: Any) -> str:
    if isinstance(value, float):
        return "nan" if math.isnan(value) else f"{value:.4g}"
    return str(value)
