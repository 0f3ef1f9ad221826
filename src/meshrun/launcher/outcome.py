"""How a training run ended, as the worker says it, and the exit code `meshrun train` gives for it.

The worker's training entry returns an `Outcome` and records it in `RUN_DIR/outcome.json`
(completed and stopped by rank 0, failed by any rank that failed). One process hands it back
directly; under torchrun the launcher reads the record, since workers stopped on request exit 0
(torchrun would restart a group that exits non-zero) and torchrun passes on no worker's status.

Exit codes of `meshrun train`: 0 completed, 75 stopped on request with a checkpoint written
(EX_TEMPFAIL: rerun the same command to resume; Slurm jobs requeue), 1 failed, 2 bad input,
128 + the signal for a stop request that came before any checkpoint could be written, for Ctrl-C
(SIGINT: every rank ends at once, nothing written on the way out) and for torchrun's agent killed by
a signal, 124 for a job ended for making no progress (launcher/hang.py).
"""

from __future__ import annotations

import contextlib
import json
import signal
from collections.abc import Iterator
from enum import Enum
from pathlib import Path

from meshrun.checkpoint.paths import what_a_rerun_does
from meshrun.errors import RunError
from meshrun.files.atomic import write_atomic

RECORD = "outcome.json"
STOPPED_EXIT_CODE = 75  # EX_TEMPFAIL: stopped early with a checkpoint; rerun to resume
# What schedulers and torchrun send before killing, and Slurm's `--signal=USR1@T` warning: stop, checkpoint first.
STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)


class Outcome(Enum):
    COMPLETED = "completed"  # train.steps reached (or already reached when the run started)
    STOPPED = "stopped"  # SIGTERM / SIGUSR1: every rank checkpointed at one step and stopped
    FAILED = "failed"  # a worker raised

    @property
    def exit_code(self) -> int:
        return {Outcome.COMPLETED: 0, Outcome.STOPPED: STOPPED_EXIT_CODE, Outcome.FAILED: 1}[self]


def status_text(code: int) -> str:
    """A process's exit status in words: `exit N`, or `killed by SIGNAME` (Popen's -N)."""
    if code >= 0:
        return f"exit {code}"
    try:
        return f"killed by {signal.Signals(-code).name}"
    except ValueError:
        return f"killed by signal {-code}"


def write_record(
    run_dir: Path, outcome: Outcome, *, error: str | None = None, exit_code: int | None = None, attempt: int = 0
) -> None:
    """Write the outcome atomically (a reader never sees half a file). `error`: a failed worker's
    one-line reason (a RunError's text), which the launcher repeats as its last line; `exit_code`:
    the launcher's exit code for it, where not 1 (a hang whose report could not be written: 124);
    `attempt`: torchrun's restart count, so a restarted group's failure is not taken for its
    predecessor's."""
    run_dir.mkdir(parents=True, exist_ok=True)
    record = (
        {"outcome": outcome.value, "attempt": attempt}
        | ({"error": error} if error else {})
        | ({"exit_code": exit_code} if exit_code else {})
    )
    write_atomic(run_dir / RECORD, json.dumps(record) + "\n")


def read_record(run_dir: Path) -> Outcome | None:
    """The outcome the workers recorded; None when none did (they died before they could)."""
    try:
        return Outcome(json.loads((run_dir / RECORD).read_text())["outcome"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def failed_in(run_dir: Path, attempt: int) -> bool:
    """A rank of this attempt has recorded a failure already."""
    try:
        record = json.loads((run_dir / RECORD).read_text())
        return record["outcome"] == Outcome.FAILED.value and record.get("attempt", 0) == attempt
    except (OSError, ValueError, KeyError, TypeError):
        return False


def read_error(run_dir: Path) -> RunError | None:
    """The one-line reason a failed worker recorded, with its exit code; None when it recorded none (a crash)."""
    try:
        record = json.loads((run_dir / RECORD).read_text())
        error, code = record.get("error"), record.get("exit_code", 1)
    except (OSError, ValueError, AttributeError):
        return None
    if not isinstance(error, str) or not error:
        return None
    failure = RunError(error)
    failure.exit_code = code if type(code) is int and 0 < code < 256 else 1
    return failure


def clear_record(run_dir: Path) -> None:
    """Forget an earlier run's outcome before workers start, so only theirs is read."""
    (run_dir / RECORD).unlink(missing_ok=True)


def launcher_exit_code(outcome: Outcome | None, torchrun_code: int, *, stop_relayed: bool) -> int:
    """`meshrun train`'s exit code after torchrun: the workers' recorded outcome decides. A stop
    this launcher relayed makes torchrun itself exit non-zero: a completion the workers recorded
    first is still one. Only a recorded stop says 75 (a checkpoint written); anything else is
    torchrun's failure (1 if it said 0; 128 + N if it was killed by signal N)."""
    if outcome is Outcome.COMPLETED and (torchrun_code == 0 or stop_relayed):
        return 0
    if outcome is Outcome.STOPPED:
        return STOPPED_EXIT_CODE
    return 128 - torchrun_code if torchrun_code < 0 else torchrun_code or 1


class StoppedBeforeTraining(BaseException):
    """A stop signal reached the launcher before any worker could act on it (none had yet, or
    none recorded a stop): nothing was checkpointed, so the exit is 128 + the signal, not 75.
    A BaseException, as KeyboardInterrupt: no `except Exception` on the way may swallow it."""

    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum

    @property
    def exit_code(self) -> int:
        return 128 + self.signum

    def __str__(self) -> str:
        return (
            f"stopped by {signal.Signals(self.signum).name} before training began: no checkpoint written; "
            "rerun the same command to start"
        )


class Interrupted(BaseException):
    """Ctrl-C, or SIGINT to the launcher alone: it passed the signal on and every rank ended at
    once (their SIGINT is the default: no handler, nothing saved on the way out). The exit is
    130, and the line names the checkpoint a rerun resumes from. A BaseException, as
    KeyboardInterrupt, which it replaces."""

    exit_code = 128 + signal.SIGINT

    def __init__(self, run_dir: Path) -> None:
        super().__init__(run_dir)
        self.rerun = what_a_rerun_does(run_dir)

    def __str__(self) -> str:
        return (
            f"interrupted (Ctrl-C / SIGINT): every rank stopped at once, without writing a checkpoint; {self.rerun} "
            "(SIGTERM or SIGUSR1 instead writes one, then stops with exit 75)"
        )


@contextlib.contextmanager
def stops_end_the_launcher() -> Iterator[None]:
    """Until the workers (or the trainer in this process) take stop signals over, a stop
    request ends the launcher at once with StoppedBeforeTraining: there is nothing to save."""

    def stop(signum: int, frame: object) -> None:
        raise StoppedBeforeTraining(signum)

    previous = {sig: signal.signal(sig, stop) for sig in STOP_SIGNALS}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
