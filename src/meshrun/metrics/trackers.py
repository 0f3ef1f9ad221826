"""Where metric rows go: `tracker.backends` of metrics.jsonl, wandb (one run per job), TensorBoard.

Only the logging rank (rank 0) opens trackers; other ranks get `NullTracker`.
"""

from __future__ import annotations

import contextlib
import json
import os
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

from meshrun.config.schema import TrackerConfig
from meshrun.files import console
from meshrun.files.atomic import DiskFull, disk_error, write_atomic


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
    """Appends one JSON object per row to metrics.jsonl, flushed so a crash keeps what was logged;
    `time` is when the row was written (Unix seconds, as wandb's _timestamp and TensorBoard's wall_time)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.file = path.open("a", encoding="utf-8")

    def log(self, row: dict[str, Any], step: int) -> None:
        try:
            self.file.write(json.dumps({"step": step, "time": round(time.time(), 3), **row}) + "\n")
            self.file.flush()
        except OSError as err:  # a full disk: one line (a torn last row is what readers skip)
            raise disk_error(err, self.path) from err

    def summarize(self, summary: dict[str, Any]) -> None:
        pass  # the run directory's summary.json holds it

    def close(self) -> None:
        with contextlib.suppress(OSError):  # a row a full disk refused is still buffered: already reported
            self.file.close()


def wandb_credentials() -> tuple[bool, str | None]:
    """Whether wandb itself finds credentials for its server, and why not if it cannot say.

    Asks `wandb.login(prompt=False, verify=False)`: wandb's own resolution (WANDB_API_KEY,
    WANDB_IDENTITY_TOKEN_FILE, settings files, netrc for WANDB_BASE_URL), with no network and
    no prompt. `silent` first, else login prints a greeting that asks the server for the user.
    """
    import wandb
    import wandb.errors  # named: the package does not declare its submodule to type checkers

    wandb.setup(settings=wandb.Settings(silent=True))
    try:
        return wandb.login(prompt=False, verify=False), None
    except wandb.errors.Error as exc:  # e.g. a malformed key, or both a key and a token file set
        return False, f"wandb credentials unusable ({' '.join(str(exc).split())})"


def wandb_mode(cfg: TrackerConfig) -> tuple[str, str | None]:
    """The effective mode (WANDB_MODE wins over the config) and a note for the user, if any."""
    mode = os.environ.get("WANDB_MODE") or cfg.mode
    if mode in ("disabled", "offline", "dryrun"):
        return ("offline" if mode == "dryrun" else mode), None
    found, problem = wandb_credentials()
    if not found:
        why = problem or "wandb: no API key found (WANDB_API_KEY, WANDB_IDENTITY_TOKEN_FILE or `wandb login`)"
        return "offline", f"{why}; logging offline, sync later with `wandb sync`"
    return "online", None


def init_timeout(cfg: TrackerConfig) -> float:
    """tracker.init_timeout, unless WANDB_INIT_TIMEOUT holds a positive number of seconds."""
    try:
        seconds = float(os.environ.get("WANDB_INIT_TIMEOUT", ""))
    except ValueError:
        return cfg.init_timeout
    return seconds if seconds > 0 else cfg.init_timeout


class WandbTracker:
    """One wandb run for the whole job, holding the resolved config.

    Arguments given to `wandb.init` win over WANDB_* variables in wandb itself, so each one we
    pass defers to its variable; the rest (WANDB_RUN_GROUP, WANDB_TAGS, WANDB_NOTES, ...) wandb
    reads on its own.
    """

    def __init__(
        self,
        cfg: TrackerConfig,
        *,
        mode: str,
        run_dir: Path,
        config: dict[str, Any],
        warn: Callable[[str], None] = print,
    ) -> None:
        import wandb  # lazy: importing wandb costs about a second
        import wandb.errors

        # A resumed job continues the same wandb run: its id lives in the run directory.
        id_file = run_dir / "wandb_run_id"
        run_id = os.environ.get("WANDB_RUN_ID") or (
            id_file.read_text().strip() if id_file.exists() else uuid.uuid4().hex[:8]
        )
        write_atomic(id_file, run_id + "\n")
        kwargs = {
            "id": run_id,
            "resume": "allow",
            "project": os.environ.get("WANDB_PROJECT") or cfg.project,
            "entity": os.environ.get("WANDB_ENTITY") or cfg.entity,
            "name": os.environ.get("WANDB_NAME") or cfg.name or run_dir.name,
            "dir": os.environ.get("WANDB_DIR") or str(run_dir),
            "config": config,
        }
        # `quiet` still prints the offline banner (3 lines); `silent` prints nothing.
        settings = {"console": "off", "x_disable_stats": True, "silent": True}
        if mode != "online":
            self.run = wandb.init(mode=mode, settings=wandb.Settings(**settings), **kwargs)  # pyright: ignore[reportArgumentType] (wandb_mode returns one of wandb's modes)
            return
        timeout = init_timeout(cfg)
        try:
            self.run = wandb.init(mode="online", settings=wandb.Settings(**settings, init_timeout=timeout), **kwargs)
        except wandb.errors.Error as exc:  # no network, server down, credentials refused
            wandb.teardown()  # the failed attempt still holds the run id in wandb's service
            self.run = wandb.init(mode="offline", settings=wandb.Settings(**settings), **kwargs)
            reason = " ".join(str(exc).splitlines()[0].split()) if str(exc) else type(exc).__name__
            warn(
                f"warning: wandb online failed within {timeout:g} s ({reason}); logging offline in "
                f"{self.run.settings.sync_dir}, sync later with `wandb sync {self.run.settings.sync_dir}`"
            )

    def log(self, row: dict[str, Any], step: int) -> None:
        # Not committed here: validation rows arrive later for the same step and join its row.
        self.run.log(row, step=step)

    def summarize(self, summary: dict[str, Any]) -> None:
        # Commit the last step first: its row would otherwise land at finish() and overwrite
        # the job-wide tokens_per_s / tflops in the summary with the last window's values.
        self.run.log({}, commit=True)
        self.run.summary.update(summary)

    def close(self) -> None:
        self.run.finish()


class MultiTracker:
    """Fans rows out to every tracker. A tracker that fails (e.g. wandb's service process killed
    by a scheduler's SIGTERM) is dropped with one warning: metrics must never stop training. A full
    disk does stop it: the run's record (and its next checkpoint) could not be written, and a run
    training on without them would lose what it learns."""

    def __init__(self, trackers: list[Tracker], *, run_dir: Path, warn: Callable[[str], None] = print) -> None:
        self.trackers, self.run_dir, self.warn = trackers, run_dir, warn

    def _each(self, call: Callable[[Tracker], None]) -> None:
        for tracker in list(self.trackers):
            try:
                call(tracker)
            except DiskFull:
                raise
            except OSError as exc:
                where = Path(exc.filename) if isinstance(exc.filename, str) else self.run_dir
                if (full := disk_error(exc, where)) is not exc:  # TensorBoard or wandb met a full disk
                    raise full from exc
                self._drop(tracker, exc)
            except Exception as exc:  # noqa: BLE001 - any tracker failure, by design
                self._drop(tracker, exc)

    def _drop(self, tracker: Tracker, exc: Exception) -> None:
        self.trackers.remove(tracker)
        self.warn(
            f"warning: {type(tracker).__name__} failed ({type(exc).__name__}: {exc}); it is off for the rest of the run"
        )

    def log(self, row: dict[str, Any], step: int) -> None:
        self._each(lambda tracker: tracker.log(row, step))

    def summarize(self, summary: dict[str, Any]) -> None:
        self._each(lambda tracker: tracker.summarize(summary))

    def close(self) -> None:
        self._each(lambda tracker: tracker.close())


class TensorBoardTracker:
    """Event files under RUN_DIR/tensorboard: every numeric value of a row as a scalar at its step,
    the resolved config as text. A resumed job writes into the same folder; `purge_step` tells
    TensorBoard to drop what the interrupted run logged after the checkpoint (it is logged again)."""

    def __init__(self, log_dir: Path, *, config: dict[str, Any], start_step: int) -> None:
        from torch.utils.tensorboard import (
            SummaryWriter,  # lazy: only when this backend is chosen
        )

        self.writer = SummaryWriter(str(log_dir), purge_step=start_step + 1 if start_step else None)
        self.writer.add_text("config", f"```json\n{json.dumps(config, indent=2)}\n```", global_step=start_step)

    def log(self, row: dict[str, Any], step: int) -> None:
        for key, value in row.items():
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                self.writer.add_scalar(key, value, global_step=step)
        self.writer.flush()

    def summarize(self, summary: dict[str, Any]) -> None:
        pass  # the run directory's summary.json holds it

    def close(self) -> None:
        self.writer.close()


def open_trackers(
    cfg: TrackerConfig,
    *,
    run_dir: Path,
    config: dict[str, Any],
    start_step: int = 0,
    say: Callable[[str], None] | None = None,
) -> MultiTracker:
    say = say or console.say
    trackers: list[Tracker] = []
    if "jsonl" in cfg.backends:
        trackers.append(JsonlTracker(run_dir / "metrics.jsonl"))
    if "tensorboard" in cfg.backends:
        trackers.append(TensorBoardTracker(run_dir / "tensorboard", config=config, start_step=start_step))
    if "wandb" in cfg.backends:
        mode, note = wandb_mode(cfg)
        if note:
            say(note)
        if mode != "disabled":
            trackers.append(WandbTracker(cfg, mode=mode, run_dir=run_dir, config=config, warn=say))
    return MultiTracker(trackers, run_dir=run_dir, warn=say)
