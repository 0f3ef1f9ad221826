"""One job per run directory: a second `meshrun train` on a run_dir in use would resume from a
checkpoint the first is still extending and truncate the metrics it is writing.

The launcher holds an exclusive `flock` on RUN_DIR/.meshrun.lock while its job runs (one node; on
many nodes every node's launcher shares the run_dir, so there the job's rendezvous keeps it one).
The kernel drops the lock when the process ends, however it ends: no stale lock after a crash.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import socket
from collections.abc import Iterator
from pathlib import Path

from meshrun.errors import ConfigError

LOCK = ".meshrun.lock"


@contextlib.contextmanager
def hold_run_dir(run_dir: Path) -> Iterator[None]:
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
        lock.seek(0)
        lock.truncate()
        lock.write(f"pid {os.getpid()} on {socket.gethostname()}\n")
        lock.flush()
        yield
