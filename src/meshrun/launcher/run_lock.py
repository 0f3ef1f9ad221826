"""One job per run directory: a second job on a run_dir in use would resume from a checkpoint the
first is still extending, truncate the metrics it is writing and delete its save in progress.

The lock is an exclusive `flock` on the run directory itself (its own descriptor: deleting a file
inside cannot take it away, as deleting a lock file did), taken before any worker starts by
`meshrun train` (handed to torchrun's agent, which holds it as long as its workers live:
meshrun.launcher.lifetime), or by the workers themselves where torchrun was started by hand. The
kernel drops it when its last holder ends, however it ends: no stale lock after a crash.

Within one job several processes share the run_dir: each node's launcher, or each worker. A job is
named by its rendezvous (`launch.rdzv_id` at `launch.rdzv_endpoint`; a worker's TORCHELASTIC_RUN_ID
at MASTER_ADDR:MASTER_PORT): no two living jobs share one. The process that takes the lock writes
the owner record RUN_DIR/.meshrun.lock (the job, its host, the pids that hold the lock); a process
of the same job finds the lock held by its own job and goes on, any other is refused in one line
naming the holders still alive. The owner removes the record when it ends.

Filesystems that lock only files open for writing (NFS, where `flock` is a POSIX lock) cannot lock
a folder: there the lock is on RUN_DIR/.meshrun.flock instead, and deleting that file under a
running job defeats it. Across nodes the lock holds where the shared filesystem passes `flock` on to its server (NFSv4 and
NFSv3 with lockd, Lustre mounted with `flock`, GPFS, CephFS); where locks stay on each node
(Lustre's `localflock`, NFS with `local_lock=flock`) only jobs on one node exclude each other.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import socket
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from meshrun.errors import ConfigError
from meshrun.files.atomic import write_atomic
from meshrun.files.json_reader import read_json

LOCK = ".meshrun.lock"  # the owner record (the lock itself is on the folder)
FALLBACK_LOCK = ".meshrun.flock"  # locked instead where the filesystem cannot lock a folder
HELD_ENV = "MESHRUN_RUN_DIR_JOB"  # for workers: the job whose launcher holds the run_dir lock
RECORD_WAIT_S = 5.0  # a held lock whose record is not written yet (it follows the lock by ms)


@dataclass
class Owner:
    """The owner record: which job holds the lock, on which host, and its holders (pid, role);
    `pids` names the process id space they live in (containers on one host share its name, not it)."""

    job: str
    host: str
    pids: str
    holders: list[tuple[int, str]] = field(default_factory=list)

    def living(self) -> list[tuple[int, str]]:
        """The holders still alive; in another pid space, all (their pids cannot be asked from here)."""
        if not self.pids or self.pids != pid_space():
            return self.holders
        return [(pid, role) for pid, role in self.holders if _alive(pid)]

    def text(self) -> str:
        holders = ", ".join(f"pid {pid} ({role})" for pid, role in self.living()) or "no living holder named"
        return f"{holders} on {self.host}, job {self.job}"


def pid_space() -> str:
    """This boot of this machine and this process's pid namespace ("" where /proc cannot say)."""
    try:
        boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
        return f"{boot} {os.readlink('/proc/self/ns/pid')}"
    except OSError:
        return ""


class RunDirLock:
    """The run_dir as this process has it: the held lock (`fd`), or None where another process of
    the same job holds it."""

    def __init__(self, run_dir: Path, job: str, fd: int | None) -> None:
        self.run_dir, self.job, self.fd = run_dir, job, fd
        self.owner = Owner(job, socket.gethostname(), pid_space()) if fd is not None else None

    def add_holder(self, pid: int, role: str) -> None:
        """Name a process that holds the lock too (the agent that inherits it) in the owner record."""
        if self.owner is not None:
            self.owner.holders.append((pid, role))
            write_atomic(self.run_dir / LOCK, json.dumps(self.owner.__dict__) + "\n")

    def release(self) -> None:
        if self.fd is None:
            return
        if read_owner(self.run_dir) == self.owner:  # the record is still ours (not a later job's)
            with contextlib.suppress(OSError):
                (self.run_dir / LOCK).unlink()
        os.close(self.fd)  # the lock ends with the last descriptor (an agent's copy may outlive this)
        self.fd = None


@contextlib.contextmanager
def hold_run_dir(run_dir: Path, *, job: str, role: str) -> Iterator[RunDirLock]:
    """Own `run_dir` for the block as `job` (this process named `role` in the record), share it
    with the process of `job` that owns it, or refuse in one line naming the job that does."""
    run_dir.mkdir(parents=True, exist_ok=True)
    lock = _acquire(run_dir, job)
    try:
        lock.add_holder(os.getpid(), role)
        yield lock
    finally:
        lock.release()


def read_owner(run_dir: Path) -> Owner | None:
    """The owner record, or None where it is missing or not one (being written, deleted, foreign)."""
    try:
        data = read_json(run_dir / LOCK, limit=2**16)
        holders = [(int(pid), str(role)) for pid, role in data["holders"]]
        return Owner(str(data["job"]), str(data["host"]), str(data["pids"]), holders)
    except (OSError, ValueError, TypeError, KeyError):
        return None


def _acquire(run_dir: Path, job: str) -> RunDirLock:
    deadline = time.monotonic() + RECORD_WAIT_S
    while True:
        fd = _try_lock(run_dir)
        if fd is not None:
            return RunDirLock(run_dir, job, fd)
        owner = read_owner(run_dir)
        named = owner is not None and bool(owner.living())  # a record of holders all gone: not written yet
        if named and owner is not None and owner.job == job:
            return RunDirLock(run_dir, job, None)  # another node's launcher (or worker) of this job owns it
        if named or time.monotonic() > deadline:
            holder = owner.text() if owner is not None else f"its owner record {LOCK} is missing"
            raise ConfigError(
                f"run_dir {run_dir} is in use by another meshrun job ({holder}); wait for it to end, or set a new run_dir"
            )
        time.sleep(0.1)


def _try_lock(run_dir: Path) -> int | None:
    """A descriptor holding the lock, or None while another process holds it."""
    fd = os.open(run_dir, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return fd
    except BlockingIOError:
        os.close(fd)
        return None
    except OSError as exc:
        os.close(fd)
        if exc.errno not in (errno.EBADF, errno.ENOLCK, errno.EOPNOTSUPP, errno.EINVAL):
            raise
    # NFS locks only files open for writing (flock there is a POSIX lock): a lock file, which deleting defeats
    fd = os.open(run_dir / FALLBACK_LOCK, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        return None
    return fd


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True


def worker_job() -> str:
    """The job a worker started by torchrun (or by hand) belongs to: its rendezvous."""
    run_id = os.environ.get("TORCHELASTIC_RUN_ID", "none")
    return f"{run_id} at {os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']}"
