"""Where a run's checkpoints are and which are complete: paths only, no torch, so that the
launcher can see whether there is anything to resume without importing
torch.distributed.checkpoint (about a second of every launch on 2 CPU cores)."""

from __future__ import annotations

import json
import re
from pathlib import Path

CHECKPOINTS = "checkpoints"
MANIFEST = "manifest.json"  # file sizes and crc32s, written last: its presence marks a complete save
CONFIG = "config.json"  # the resolved config, so a checkpoint folder is self-describing
LATEST = "latest"  # names the checkpoint saved last


def checkpoint_root(run_dir: str | Path) -> Path:
    return Path(run_dir) / CHECKPOINTS


def complete_checkpoints(run_dir: str | Path) -> list[Path]:
    """Finished checkpoints, oldest first (a `.tmp` folder is an interrupted save)."""
    root = checkpoint_root(run_dir)
    if not root.is_dir():
        return []
    found = [
        p for p in root.glob("step-*") if re.fullmatch(r"step-\d+", p.name) and p.is_dir() and (p / MANIFEST).is_file()
    ]
    return sorted(found, key=step_of)


def newest_first(run_dir: str | Path) -> list[Path]:
    """Complete checkpoints, the one to continue from first: the one saved last, then older steps
    newest first, then any higher steps. After a rollback the saved-last one is on the branch the
    run went on with; the higher steps it left behind (kept, never deleted) come last."""
    found = complete_checkpoints(run_dir)[::-1]
    try:
        last = checkpoint_root(run_dir) / (checkpoint_root(run_dir) / LATEST).read_text().strip()
    except (OSError, ValueError):  # unreadable, or not text: the step order alone
        return found
    if last not in found:  # deleted by hand, or an older meshrun's run
        return found
    at = step_of(last)
    return sorted(found, key=lambda p: (step_of(p) > at, -step_of(p)))


def resumed_step(run_dir: str | Path) -> int | None:
    """The step a rerun resumes from (the newest complete checkpoint's); None: none is complete yet."""
    saved = newest_first(run_dir)
    return step_of(saved[0]) if saved else None


def last_complete_checkpoint(run_dir: str | Path) -> str:
    """What a rerun resumes from, in words for a line that says how a run ended."""
    step = resumed_step(run_dir)
    return f"the last complete checkpoint is step {step}" if step is not None else "no checkpoint is complete yet"


def what_a_rerun_does(run_dir: str | Path) -> str:
    """Where rerunning the same command starts, in words for a line that says how a run ended."""
    step = resumed_step(run_dir)
    if step is None:
        return "no checkpoint is complete yet: rerunning the same command starts afresh"
    return f"rerunning the same command resumes from step {step}, the last complete checkpoint"


def step_of(checkpoint: Path) -> int:
    return int(checkpoint.name.split("-")[1])


def resume_candidates(run_dir: str | Path, resume: str) -> list[Path]:
    """Checkpoints to try, best first (`newest_first`). `auto`: the run's complete ones. A path:
    the checkpoints this run saved since it started from that path, then the path itself, so that
    a torchrun restart, a Slurm requeue or a rerun of the same command continues the run, not
    starts it over."""
    if resume == "none":
        return []
    own = newest_first(run_dir)
    if resume == "auto":
        return own
    start, resolved = Path(resume), Path(resume).resolve()
    return [p for p in own if started_from(p) == resolved and p.resolve() != resolved] + [start]


def started_from(checkpoint: Path) -> Path | None:
    """The explicit `train.resume` of the run that saved `checkpoint` (its config.json), resolved."""
    try:
        resume = json.loads((checkpoint / CONFIG).read_text())["train"]["resume"]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return None if resume in ("auto", "none") else Path(resume).resolve()
