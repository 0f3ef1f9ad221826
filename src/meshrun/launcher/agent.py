"""torchrun's agent as meshrun starts it: `torch.distributed.run`'s own main, ending on the stop
signal it passes to the workers (they checkpoint and say so in one line) with the signal's exit
status instead of a Python traceback in every preempted job's log, and on failed workers with one
line naming them, first failure first, a worker killed by a signal by its signal, instead of
torchrun's report (the launcher repeats the first failed worker's recorded cause last). Its own
log (the signals it sends, the workers it restarts) goes to RUN_DIR/logs/torchrun.log, not the
console (meshrun.launcher.logs). It ends with the launcher that started it (SIGTERM: the same
stop), and its workers with it (meshrun.launcher.lifetime)."""

from __future__ import annotations

import signal
import sys

from torch.distributed.elastic.multiprocessing.api import SignalException
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
from torch.distributed.elastic.rendezvous.api import RendezvousConnectionError, RendezvousTimeoutError
from torch.distributed.run import main

from meshrun.launcher import forked
from meshrun.launcher.forked import fork_meshrun_workers
from meshrun.launcher.lifetime import die_with_parent
from meshrun.launcher.logs import divert_agent_log
from meshrun.launcher.outcome import status_text
from meshrun.launcher.torchrun import RDZV_TIMEOUT_EXIT


def run_agent() -> None:
    die_with_parent(signal.SIGTERM)
    divert_agent_log()
    fork_meshrun_workers()
    try:
        main()
    except SignalException as stop:
        sys.exit(128 + int(stop.sigval))
    except ChildFailedError as failed:
        print(f"torchrun: workers failed: {failures_line(failed)}", file=sys.stderr)
        sys.exit(1)
    except RendezvousTimeoutError:  # `meshrun train` says which nodes were awaited, in one line
        sys.exit(RDZV_TIMEOUT_EXIT)
    except RendezvousConnectionError as unreachable:  # the host's store did not answer in time (or cannot bind)
        said = str(unreachable).splitlines()
        print(f"torchrun: {said[0] if said else 'the rendezvous store did not answer'}", file=sys.stderr)
        sys.exit(RDZV_TIMEOUT_EXIT)


def failures_line(failed: ChildFailedError) -> str:
    """Each failed rank's status, those torchrun itself ended (SIGTERM, once a peer had failed) last."""
    ended = -int(signal.SIGTERM)
    ranks = sorted(failed.failures.items(), key=lambda item: (item[1].exitcode == ended, item[0]))
    said = ", ".join(f"rank {rank} {status_text(failure.exitcode)}" for rank, failure in ranks)
    if any(failure.exitcode == ended for _, failure in ranks):
        said += " (torchrun sends SIGTERM to the other workers once one fails)"
    elif forked.FORKED:  # torch.multiprocessing reports one failed worker, not every one
        said += " (the failed worker torchrun found first; it stops the others)"
    return said


if __name__ == "__main__":
    run_agent()
