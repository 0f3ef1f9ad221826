"""The run directory at the start of a (re)run, on the logging rank: its record made ready to continue.

config.json is the config this run resolved to; summary.json goes (it says the run completed, and
is written again when it does); metrics.jsonl is cut back to the resumed step (that stretch is
trained again, and logged again). Then the trackers that carry the record on are opened.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

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
    truncate_metrics(run_dir / "metrics.jsonl", after_step=start_step)
    return open_trackers(cfg.tracker, run_dir=run_dir, config=resolved, start_step=start_step)


def truncate_metrics(path: Path, *, after_step: int) -> None:
    """Drop rows past the resumed step. A row cut short by a crash mid-write (its run was killed
    there) is dropped too, not a reason to fail."""
    if not path.exists():
        return
    rows = [line for line in path.read_text().splitlines() if _metrics_step(line) <= after_step]
    write_atomic(path, "".join(f"{line}\n" for line in rows))


def _metrics_step(line: str) -> float:
    """A metrics.jsonl row's step; a partial or foreign row counts as past every step."""
    try:
        return json.loads(line)["step"]
    except (ValueError, KeyError, TypeError):
        return math.inf
