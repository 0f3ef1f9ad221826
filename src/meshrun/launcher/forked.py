"""meshrun's workers forked from one process that has imported torch and meshrun once, instead of
each worker starting Python and importing them itself: those imports take ~2.5 s of CPU a worker
(measured on the 2-core test machine: a 4-rank launch spent ~10 s of CPU before its first step,
~5 s of wall time, against 0.5 s of training for a tiny job).

torchrun's agent starts a function entrypoint with a multiprocessing start method
(`LaunchConfig.start_method`); with "forkserver" every worker is forked from a server process
that preloaded the modules named here. The worker's environment, exit status, signals and
console are as a `python -u -m meshrun ...` worker's: torchrun sets each rank's environment in the
child and watches it as it watches a subprocess. Any other command (the peer-recovery keeper, a
command a user gave torchrun by hand), and every worker where the temporary folder's path is too
long for the server's socket, starts as torchrun starts it.
"""

from __future__ import annotations

import multiprocessing
import runpy
import sys
import tempfile
from collections.abc import Callable
from typing import Any

import torch.distributed.run as torchrun_module
from torch.distributed.launcher.api import LaunchConfig, elastic_launch

MESHRUN_WORKER = ("-u", "-m", "meshrun")  # how torchrun's `-m meshrun ARGS` reaches elastic_launch
# The server listens on a Unix socket in the temporary folder: TMPDIR/pymp-XXXXXXXX/listener-XXXXXXXX
# must fit a socket's 107 characters; a longer TMPDIR (a scheduler's per-job folder) starts workers
# as processes, as torchrun does
LONGEST_TMPDIR = 107 - len("/pymp-12345678/listener-12345678")
FORKED = False  # this agent started its workers forked (its failure report names one of them)
TRACKER_WARNING = "resource_tracker"  # its warnings start so ("-W" splits at colons)
# the server's lifetime (first), then what every worker imports
PRELOAD = ["meshrun.launcher.fork_server", "meshrun.cli", "meshrun.training.worker"]


def forks_under(tmpdir: str) -> bool:
    """Whether workers are forked where the temporary folder is `tmpdir` (the server's socket fits)."""
    return len(tmpdir) <= LONGEST_TMPDIR


def worker(*argv: str) -> None:
    """One forked worker: `python -u -m meshrun ARGV` as a call (its parent, the fork server,
    ends with the agent: meshrun.launcher.fork_server)."""
    for stream in (sys.stdout, sys.stderr):
        stream.reconfigure(write_through=True)  # type: ignore[attr-defined]  # python -u
    sys.argv = ["meshrun", *argv]
    runpy.run_module("meshrun", run_name="__main__", alter_sys=True)


def forking_launch(config: LaunchConfig, entrypoint: Callable | str | None) -> Callable[..., Any]:
    """torchrun's `elastic_launch(config, entrypoint)`, starting `python -u -m meshrun ...`
    workers forked from the preloaded server."""

    def launch(*args: str) -> Any:
        meshrun = entrypoint == sys.executable and tuple(args[: len(MESHRUN_WORKER)]) == MESHRUN_WORKER
        if not meshrun or not forks_under(tempfile.gettempdir()):
            return elastic_launch(config, entrypoint)(*args)
        global FORKED
        FORKED = True
        config.start_method = "forkserver"
        multiprocessing.set_forkserver_preload(PRELOAD)
        # multiprocessing's resource tracker (a process the agent starts, passing its -W options on)
        # removes the queues' semaphores of an agent killed outright, and would say so on the console
        sys.warnoptions.append(f"ignore:{TRACKER_WARNING}:UserWarning")
        return elastic_launch(config, worker)(*args[len(MESHRUN_WORKER) :])

    return launch


def fork_meshrun_workers() -> None:
    """Make torchrun's `main` start meshrun's workers forked. The one place meshrun reaches into
    torchrun's module: its `run` launches through the module's `elastic_launch` name
    (tests/launcher/test_forked.py fails loudly if a torch upgrade changes that)."""
    torchrun_module.elastic_launch = forking_launch  # type: ignore[assignment]
