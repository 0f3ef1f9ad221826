"""How a training run ended, as the worker says it, and the exit code `meshrun train` gives for it.

The worker's training entry returns an `Outcome` and records it in `RUN_DIR/outcome.json`
(completed and stopped by rank 0, failed by any rank that failed). One process hands it back
directly; under torchrun the launcher reads the record, since workers stopped on request exit 0
(torchrun would restart a group that exits non-zero) and torchrun passes on no worker's status.

Exit codes of `meshrun train`: 0 completed, 75 stopped on request with a checkpoint written
(EX_TEMPFAIL: rerun the same command to resume; Slurm jobs requeue), 1 failed, 2 bad input.
"""

from __future__ import annotations

import json
from enum import Enum
from pathlib import Path

from meshrun.atomic import write_atomic

RECORD = "outcome.json"
STOPPED_EXIT_CODE = 75  # EX_TEMPFAIL: stopped early with a checkpoint; rerun to resume


class Outcome(Enum):
    COMPLETED = "completed"  # train.steps reached (or already reached when the run started)
    STOPPED = "stopped"  # SIGTERM / SIGUSR1: every rank checkpointed at one step and stopped
    FAILED = "failed"  # a worker raised

    @property
    def exit_code(self) -> int:
        return {Outcome.COMPLETED: 0, Outcome.STOPPED: STOPPED_EXIT_CODE, Outcome.FAILED: 1}[self]


def write_record(run_dir: Path, outcome: Outcome) -> None:
    """Write the outcome atomically (a reader never sees half a file)."""
    run_dir.mkdir(parents=True, exist_ok=True)
    write_atomic(run_dir / RECORD, json.dumps({"outcome": outcome.value}) + "\n")


def read_record(run_dir: Path) -> Outcome | None:
    """The outcome the workers recorded; None when none did (they died before they could)."""
    try:
        return Outcome(json.loads((run_dir / RECORD).read_text())["outcome"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def clear_record(run_dir: Path) -> None:
    """Forget an earlier run's outcome before workers start, so only theirs is read."""
    (run_dir / RECORD).unlink(missing_ok=True)


def launcher_exit_code(outcome: Outcome | None, torchrun_code: int, *, stop_relayed: bool) -> int:
    """`meshrun train`'s exit code after torchrun: the workers' recorded outcome decides. A stop
    this launcher relayed makes torchrun itself exit non-zero: that is a stop, unless the workers
    had completed or failed first. No record and no stop: torchrun's failure (1 if it said 0)."""
    if outcome is Outcome.COMPLETED and (torchrun_code == 0 or stop_relayed):
        return 0
    if outcome is Outcome.FAILED:
        return torchrun_code or 1
    if outcome is Outcome.STOPPED or stop_relayed:
        return STOPPED_EXIT_CODE
    return torchrun_code or 1
