"""The run directory at the start of a (re)run, on the logging rank: its record made ready to continue.

config.json is the config this run resolved to; summary.json goes (it says the run completed, and
is written again when it does); metrics.jsonl is cut back to the resumed step (that stretch is
trained again, and logged again). A restart within the launch (torchrun's, after a lost worker
under launch.recovery checkpoint) adds a recovery event there: the checkpoint's step, the logged
steps it loses, and the seconds from the last logged step to the checkpoint loaded (`meshrun
report` shows it; bench/recovery.py prices it). Then the trackers that carry the record on are opened.
"""

from __future__ import annotations

import json
import math
import os
import time
from pathlib import Path
from typing import Any

from meshrun.config.schema import Config
from meshrun.files.atomic import write_atomic
from meshrun.metrics.trackers import MultiTracker, open_trackers


def start_run_record(cfg: Config, *, start_step: int) -> MultiTracker:
    """Make `cfg.run_dir`'s record continue from `start_step` (0: a fresh run); its trackers."""
    run_dir = Path(cfg.run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    resolved = cfg.model_dump(mode="json")
    write_atomic(run_dir / "config.json", json.dumps(resolved, indent=2))
    (run_dir / "summary.json").unlink(missing_ok=True)
    restarted = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) > 0
    truncate_metrics(run_dir / "metrics.jsonl", after_step=start_step, restarted=restarted)
    return open_trackers(cfg.tracker, run_dir=run_dir, config=resolved, start_step=start_step)


def truncate_metrics(path: Path, *, after_step: int, restarted: bool = False) -> None:
    """Drop rows past the resumed step. A row cut short by a crash mid-write (its run was killed
    there) is dropped too, not a reason to fail. `restarted`: the rows end with a restart event."""
    if not path.exists():
        return
    lines = path.read_text().splitlines()
    rows = [line for line in lines if _metrics_step(line) <= after_step]
    event = restart_event(lines, after_step) if restarted else None
    rows += [json.dumps(event)] if event is not None else []
    write_atomic(path, "".join(f"{line}\n" for line in rows))


def restart_event(lines: list[str], after_step: int) -> dict[str, Any] | None:
    """The restart from the checkpoint of `after_step`: the steps logged past it (trained again) and
    the seconds since the last logged step (the lost worker noticed, every worker started again,
    the checkpoint loaded); None when no step was logged (nothing to measure from)."""
    logged = [row for row in map(_row, lines) if isinstance(row.get("time"), (int, float)) and "loss" in row]
    if not logged:
        return None
    last = max(logged, key=lambda row: row["time"])
    lost = max(0, max(row["step"] for row in logged) - after_step)
    now = time.time()  # the checkpoint loaded; the event's `time`, as every row's, when it was logged
    return {
        "step": after_step,
        "time": now,
        "resumed_from_step": after_step,
        "steps_lost": lost,
        "restart_s": max(0.0, now - last["time"]),
    }


def _row(line: str) -> dict[str, Any]:
    try:
        row = json.loads(line)
    except ValueError:
        return {}
    return row if isinstance(row, dict) and isinstance(row.get("step"), int) else {}


def _metrics_step(line: str) -> float:
    """A metrics.jsonl row's step; a partial or foreign row counts as past every step."""
    try:
        return json.loads(line)["step"]
    except (ValueError, KeyError, TypeError):
        return math.inf
