"""torchrun's agent as meshrun starts it: `torch.distributed.run`'s own main, ending on the stop
signal it passes to the workers (they checkpoint and say so in one line) with the signal's exit
status instead of a Python traceback in every preempted job's log, and on failed workers with one
line naming them instead of torchrun's report (each worker has said why; the launcher repeats a
worker's recorded reason last). It ends with the launcher
that started it (SIGTERM: the same stop), and its workers with it (meshrun.launcher.lifetime)."""

from __future__ import annotations

import signal
import sys

from torch.distributed.elastic.multiprocessing.api import SignalException
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
from torch.distributed.elastic.rendezvous.api import RendezvousConnectionError, RendezvousTimeoutError
from torch.distributed.run import main

from meshrun.launcher.lifetime import die_with_parent
from meshrun.launcher.torchrun import RDZV_TIMEOUT_EXIT


def run_agent() -> None:
    die_with_parent(signal.SIGTERM)
    try:
        main()
    except SignalException as stop:
        sys.exit(128 + int(stop.sigval))
    except ChildFailedError as failed:
        codes = ", ".join(f"rank {rank}: exit {f.exitcode}" for rank, f in sorted(failed.failures.items()))
        print(f"torchrun: workers failed ({codes}); their own lines above say why", file=sys.stderr)
        sys.exit(1)
    except RendezvousTimeoutError:  # `meshrun train` says which nodes were awaited, in one line
        sys.exit(RDZV_TIMEOUT_EXIT)
    except RendezvousConnectionError as unreachable:  # the host's store did not answer in time (or cannot bind)
        said = str(unreachable).splitlines()
        print(f"torchrun: {said[0] if said else 'the rendezvous store did not answer'}", file=sys.stderr)
        sys.exit(RDZV_TIMEOUT_EXIT)


if __name__ == "__main__":
    run_agent()
