"""RUN_DIR/logs/: what the job's processes say that is not for the console.

The console carries meshrun's own lines: progress, and a handled failure as a few lines. What
torch says that tells a user nothing they can act on (torchrun's agent announcing the signals it
sends, DTensor's note that a redistribution takes two collectives), and a failed worker's full
traceback, go to a file here instead, named in the line that needs it:
`torchrun.log` (the agent's own log) and `rank-R.log` (worker R: its notes and tracebacks).
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import time
import traceback
from pathlib import Path

LOGS = "logs"
LOGS_ENV = "MESHRUN_LOGS"  # the folder, for torchrun's agent (it has no config)
# torch logger -> the words that mark one of its records as a note for the log file, not the console
WORKER_NOTES = {"torch.distributed.tensor._redistribute": "This is suboptimal"}  # once per rank in every tp run
MAX_CAUSE = 300  # characters of a failure's message on the console (the log has all of it)


def log_dir(run_dir: Path) -> Path:
    return run_dir / LOGS


def rank_log(run_dir: Path, rank: int) -> Path:
    return log_dir(run_dir) / f"rank-{rank}.log"


class _ToFile(logging.Filter):
    """Records containing `words` go to `handler` and not on to the console."""

    def __init__(self, handler: logging.Handler, words: str) -> None:
        super().__init__()
        self.handler, self.words = handler, words

    def filter(self, record: logging.LogRecord) -> bool:
        if self.words not in record.getMessage():
            return True
        self.handler.handle(record)
        return False


def divert(logger_name: str, path: Path, *, containing: str | None = None) -> None:
    """Send to the file `path` (appended, opened at the first record) instead of the console:
    the records `logger_name` itself logs that contain `containing` (a logger's filter sees no
    record of its children), or with no `containing`, every record of it and its children."""
    with contextlib.suppress(OSError):  # a full disk: the file's first record says so, training goes on
        path.parent.mkdir(parents=True, exist_ok=True)
    handler = logging.FileHandler(path, delay=True)
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    logger = logging.getLogger(logger_name)
    if containing is not None:
        logger.addFilter(_ToFile(handler, containing))
        return
    logger.addHandler(handler)
    logger.propagate = False  # torch's console handler sits on a parent
    logger.setLevel(logging.INFO)  # the file may say more than the console did: restarts, rendezvous


def divert_worker_notes(run_dir: Path, rank: int) -> None:
    """In a worker: torch's notes in WORKER_NOTES go to this rank's log."""
    for name, words in WORKER_NOTES.items():
        divert(name, rank_log(run_dir, rank), containing=words)


def divert_agent_log() -> None:
    """In torchrun's agent: its whole log goes to LOGS_ENV's torchrun.log (meshrun's launcher and
    agent say in their own lines what it reports: a signal sent, a worker failed)."""
    folder = os.environ.get(LOGS_ENV)
    if folder is not None:
        divert("torch.distributed.elastic", Path(folder) / "torchrun.log")
        divert("torch.multiprocessing", Path(folder) / "torchrun.log")  # "Terminating process" for forked workers


def log_failure(run_dir: Path, rank: int, exc: BaseException, *, attempt: int) -> str:
    """Append `exc`'s traceback to this rank's log; return its one-line cause naming that log:
    the innermost exception of its `raise ... from` chain, type and first line of its message.
    A log that cannot be written (a full disk): the traceback goes to the console after all."""
    path = rank_log(run_dir, rank)
    text = "".join(traceback.format_exception(exc))
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path, "a") as log:
            log.write(f"--- {time.strftime('%Y-%m-%d %H:%M:%S')} rank {rank}, attempt {attempt} failed:\n{text}")
        where = f"traceback: {path}"
    except OSError as unwritable:
        print(text, file=sys.stderr, flush=True)
        where = f"traceback above: {path} cannot be written ({unwritable.strerror or unwritable})"
    root = exc
    while root.__cause__ is not None:
        root = root.__cause__
    said = str(root).strip().splitlines()
    message = said[0] if said else ""
    if len(message) > MAX_CAUSE:
        message = message[:MAX_CAUSE] + "..."
    return f"rank {rank} failed: {type(root).__name__}: {message} ({where})"
