"""One job per run directory: a second `meshrun train` on a run_dir in use would resume from a
checkpoint the first is still extending and truncate the metrics it is writing.

The launcher takes an exclusive `flock` on RUN_DIR/.meshrun.lock and hands the locked file to
torchrun's agent (the same open file: the lock is held while either lives), whose workers end
with it (meshrun.launcher.lifetime). So a launcher killed outright (SIGKILL, a closed terminal)
leaves the lock held until its agent has stopped the workers. The kernel drops the lock when
the last holder ends, however it ends: no stale lock after a crash. On many nodes every node's
launcher shares the run_dir, so there the job's rendezvous keeps it one.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import socket
from collections.abc import Iterator
from pathlib import Path
from typing import IO

from meshrun.errors import ConfigError

LOCK = ".meshrun.lock"


class RunDirLock:
    """The held lock: its file descriptor (for the agent to inherit) and the owner's name."""

    def __init__(self, file: IO[str]) -> None:
        self.file = file

    def fileno(self) -> int:
        return self.file.fileno()

    def claim(self) -> None:
        """Name this job in the lock file (what a refused second job prints); only once the job is
        known to train, so that a rerun with nothing to do changes no byte of the run directory."""
        self.file.seek(0)
        self.file.truncate()
        self.file.write(f"pid {os.getpid()} on {socket.gethostname()}\n")
        self.file.flush()


@contextlib.contextmanager
def hold_run_dir(run_dir: Path) -> Iterator[RunDirLock]:
    """Own `run_dir` for the block, or refuse in one line naming the job that owns it."""
    run_dir.mkdir(parents=True, exist_ok=True)
    with open(run_dir / LOCK, "a+") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            lock.seek(0)
            owner = lock.read().strip() or "another process"
            raise ConfigError(
                f"run_dir {run_dir} is in use by another meshrun job ({owner}); wait for it to end, or set a new run_dir"
            ) from None
        yield RunDirLock(lock)
