"""Where metric rows go: metrics.jsonl always, wandb (one run per job) when enabled.

Only the logging rank (rank 0) opens trackers; other ranks get `NullTracker`.
"""

from __future__ import annotations

import json
import netrc
import os
from pathlib import Path
from typing import Any, Protocol

from meshrun.config import TrackerConfig


class Tracker(Protocol):
    def log(self, row: dict[str, Any], step: int) -> None: ...

    def summarize(self, summary: dict[str, Any]) -> None: ...

    def close(self) -> None: ...


class NullTracker:
    def log(self, row: dict[str, Any], step: int) -> None:
        pass

    def summarize(self, summary: dict[str, Any]) -> None:
        pass

    def close(self) -> None:
        pass


class JsonlTracker:
    """Appends one JSON object per row to metrics.jsonl, flushed so a crash keeps what was logged."""

    def __init__(self, path: Path) -> None:
        self.file = path.open("a", encoding="utf-8")

    def log(self, row: dict[str, Any], step: int) -> None:
        self.file.write(json.dumps({"step": step, **row}) + "\n")
        self.file.flush()

    def summarize(self, summary: dict[str, Any]) -> None:
        pass  # the run directory's summary.json holds it

    def close(self) -> None:
        self.file.close()


def has_wandb_key() -> bool:
    """An API key in the environment or in ~/.netrc (where `wandb login` stores it)."""
    if os.environ.get("WANDB_API_KEY"):
        return True
    try:
        hosts = netrc.netrc().hosts
    except (OSError, netrc.NetrcParseError):
        return False
    host = os.environ.get("WANDB_BASE_URL", "https://api.wandb.ai").split("://")[-1]
    return host in hosts


def wandb_mode(cfg: TrackerConfig) -> tuple[str, str | None]:
    """The effective mode (WANDB_MODE wins over the config) and a note for the user, if any."""
    mode = os.environ.get("WANDB_MODE") or cfg.mode
    if mode in ("disabled", "offline", "dryrun"):
        return ("offline" if mode == "dryrun" else mode), None
    if not has_wandb_key():
        return "offline", "wandb: no API key found (WANDB_API_KEY or `wandb login`); logging offline, sync later with `wandb sync`"
    return "online", None


class WandbTracker:
    """One wandb run for the whole job, holding the resolved config."""

    def __init__(self, cfg: TrackerConfig, *, mode: str, run_dir: Path, config: dict[str, Any]) -> None:
        import wandb  # lazy: importing wandb costs about a second

        self.run = wandb.init(
            project=os.environ.get("WANDB_PROJECT") or cfg.project,
            entity=os.environ.get("WANDB_ENTITY") or cfg.entity,
            name=os.environ.get("WANDB_NAME") or cfg.name or run_dir.name,
            mode=mode,
            dir=str(run_dir),
            config=config,
            settings=wandb.Settings(console="off", x_disable_stats=True, quiet=True),
        )

    def log(self, row: dict[str, Any], step: int) -> None:
        self.run.log(row, step=step)

    def summarize(self, summary: dict[str, Any]) -> None:
        self.run.summary.update(summary)

    def close(self) -> None:
        self.run.finish()


class MultiTracker:
    def __init__(self, trackers: list[Tracker]) -> None:
        self.trackers = trackers

    def log(self, row: dict[str, Any], step: int) -> None:
        for tracker in self.trackers:
            tracker.log(row, step)

    def summarize(self, summary: dict[str, Any]) -> None:
        for tracker in self.trackers:
            tracker.summarize(summary)

    def close(self) -> None:
        for tracker in self.trackers:
            tracker.close()


def open_trackers(cfg: TrackerConfig, *, run_dir: Path, config: dict[str, Any], say=print) -> MultiTracker:
    trackers: list[Tracker] = [JsonlTracker(run_dir / "metrics.jsonl")]
    mode, note = wandb_mode(cfg)
    if note:
        say(note)
    if mode != "disabled":
        trackers.append(WandbTracker(cfg, mode=mode, run_dir=run_dir, config=config))
    return MultiTracker(trackers)
