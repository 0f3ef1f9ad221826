"""A job's processes end with the process that started them: torchrun's agent with the
launcher, the workers with the agent. Without it, a launcher killed outright (SIGKILL, a closed
terminal) left torchrun and its workers training into a run_dir whose lock it had released.

Each parent exports its pid as PARENT_PID; the child asks the kernel (prctl PR_SET_PDEATHSIG)
for a signal when that parent ends. The agent asks for SIGTERM: it stops its workers as on any
stop request (they checkpoint and stop), holding the run_dir lock until they have. A worker asks
for SIGKILL: its agent is gone, nobody would restart or report it.
"""

from __future__ import annotations

import contextlib
import ctypes
import multiprocessing
import os
import signal
import sys
import time
from pathlib import Path
from typing import NoReturn

PARENT_PID = "MESHRUN_PARENT_PID"
PR_SET_PDEATHSIG = 1  # linux/prctl.h
PR_SET_NAME = 15
WORKER_NAME = "meshrun-r"  # + the rank: a worker's command name (ps -o comm, top, /proc/PID/comm)


def die_with_parent(sig: signal.Signals) -> None:
    """Receive `sig` when the process named by PARENT_PID ends (Linux; elsewhere nothing), and
    export this process as the parent of the ones it starts. No PARENT_PID (a torchrun started
    by hand): nothing to follow."""
    parent = os.environ.get(PARENT_PID)
    if parent is None or not sys.platform.startswith("linux"):
        return
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_PDEATHSIG, int(sig), 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG) failed")
    if os.getppid() != int(parent):  # it ended before the request above: no signal will come
        os.kill(os.getpid(), sig)
    os.environ[PARENT_PID] = str(os.getpid())


def name_worker(rank: int) -> None:
    """Name this process `meshrun-rRANK` for ps and top (Linux; 15 characters at most): a forked
    worker's command line is its fork server's (meshrun.launcher.forked)."""
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None).prctl(PR_SET_NAME, f"{WORKER_NAME}{rank}".encode()[:15], 0, 0, 0)


def ends_itself() -> bool:
    """Whether this worker ends itself: started as a process of its own, not forked by a
    multiprocessing start (launcher/forked.py), whose wrapper sends torchrun's agent the worker's
    return value and then ends it with os._exit (ending it first, the agent would wait for a value
    never sent)."""
    return multiprocessing.parent_process() is None


def end_worker(code: int) -> NoReturn:
    """End a worker as multiprocessing ends a forked one: flush the console, then exit without
    interpreter finalization. There, process groups a DeviceMesh still references are freed and
    gloo can abort the process (SIGABRT, "terminate called without an active exception") after a
    run that finished: its agent then reports a failure (pytorch #179291). Every file is closed and
    the process group destroyed before this is called."""
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(OSError, ValueError):  # a closed or broken console: nothing to say there
            stream.flush()
    os._exit(code)


def wait_for_session(session: int, timeout: float = 30.0) -> None:
    """Wait, at most `timeout` seconds, until no live process is left in `session` (the agent's:
    it was started in a session of its own). A killed agent's workers end a moment after it (their
    fork server's and their own parent-death signals), still printing; the launcher's line about
    the agent comes after theirs. Linux (/proc); elsewhere nothing to wait for."""
    deadline = time.monotonic() + timeout
    while sys.platform.startswith("linux") and time.monotonic() < deadline and session_alive(session):
        time.sleep(0.05)


def session_alive(session: int) -> bool:
    """Whether a process other than a zombie is in `session` (/proc/PID/stat: state, session)."""
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):  # ended while read
            continue
        if int(fields[3]) == session and fields[0] not in ("Z", "X"):
            return True
    return False
