"""A training worker's entry: join the process group, agree on the precision, train, and record
how the run ended; a failure becomes a few lines (its traceback in this rank's log), a hang a report."""

from __future__ import annotations

import contextlib
import os
import signal
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from meshrun.checkpoint.paths import last_complete_checkpoint
from meshrun.config.schema import Config
from meshrun.config.topology import peer_recovery
from meshrun.data.locations import data_dir
from meshrun.errors import ConfigError, RunError
from meshrun.files.atomic import DiskFull
from meshrun.files.console import say
from meshrun.hardware.precision import with_resolved_precision
from meshrun.launcher import progress
from meshrun.launcher.hang import HangWatchdog, Place
from meshrun.launcher.keeper import ROLE_ENV
from meshrun.launcher.logs import divert_worker_notes, log_failure
from meshrun.launcher.outcome import Outcome, failed_in, write_record
from meshrun.launcher.returning import record_node
from meshrun.launcher.run_lock import HELD_ENV
from meshrun.launcher.torchrun import in_launched_worker
from meshrun.models.families import init_line
from meshrun.parallel import regroup
from meshrun.parallel.mesh import Mesh, init_mesh, shutdown

if TYPE_CHECKING:
    from meshrun.training.recovery import PeerRecovery
    from meshrun.training.run import Run


def run_worker(cfg: Config) -> Outcome:
    """The worker's training entry: trains, and returns and records how the run ended."""
    from meshrun.training.run import Run  # heavy imports only in workers

    if in_launched_worker():  # Ctrl-C: torchrun passes SIGINT on; end at once, as every rank does,
        signal.signal(signal.SIGINT, signal.SIG_DFL)  # not with tracebacks of peers gone mid-collective
    run_dir = Path(cfg.run_dir)
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    if in_launched_worker():  # torch's notes (DTensor's) go to this rank's log, not the console
        divert_worker_notes(run_dir, int(os.environ["RANK"]))
    # launch.recovery peer: a spare waits here, its imports done, for its turn (no watchdog: it makes no progress)
    replacement = kept(cfg) and regroup.is_replacement()
    progress.mark_init("joining the process group")
    watchdog, rank, run, failing = start_watchdog(cfg), 0, None, False
    try:
        mesh, cfg, recovery = join_job(cfg, replacement=replacement)
        rank = mesh.rank
        progress.mark_init("building the model and initialising its weights")
        run = Run(cfg, mesh, data_dir(cfg), recovery=recovery)
        if rank == 0 and run.trainer.start_step == 0:  # a resumed run said where it resumed from
            say(init_line(cfg, run.trainer.flops_model))
        outcome = run.trainer.train()
    except ConfigError:
        raise  # refused before training (e.g. no checkpoint loads): the run directory stays as it was
    except DiskFull as full:  # anywhere (a checkpoint, metrics.jsonl, a picture): say what a rerun resumes
        failing, failed = True, RunError(f"{full}; {last_complete_checkpoint(run_dir)}")
        record_failure(run_dir, failed, attempt=attempt)
        raise failed from None
    except Exception as exc:
        failing = True
        if not in_launched_worker() or HELD_ENV not in os.environ:  # one process, or torchrun without
            record_failure(run_dir, exc, attempt=attempt)  # meshrun's launcher (none to say it): its own words
            raise
        raise SystemExit(worker_failed(run_dir, rank, exc, attempt=attempt)) from None
    finally:
        close_worker(run, failing=failing)
        if watchdog is not None:
            watchdog.stop()
    if rank == 0:
        write_record(run_dir, outcome, attempt=attempt)
    return outcome


def join_job(cfg: Config, *, replacement: bool) -> tuple[Mesh, Config, PeerRecovery | None]:
    """The process group and meshes, and the config with its precision agreed on; under peer
    recovery (launch.recovery), also this worker's part in it. A `replacement` joins the survivors'
    next generation and asks nothing of them before it takes their state (training/recovery.py)."""
    recovery = None
    if kept(cfg):
        from meshrun.training.recovery import join as join_recoverable
        from meshrun.training.recovery import resolved_alone  # heavy imports only in workers

        mesh, recovery = join_recoverable(cfg.layout, join_timeout=cfg.launch.rdzv_timeout, replacement=replacement)
        if replacement:
            return mesh, resolved_alone(cfg, mesh.device), recovery
        record_node(os.environ, cfg.launch.rdzv_endpoint)  # a node lost whole can come back (launcher/returning.py)
    else:
        mesh = init_mesh(cfg.layout, join_timeout=cfg.launch.rdzv_timeout)
    progress.mark_init("the first collective: every node's data prepared")
    torch.distributed.barrier()  # data prepared by every node's local rank 0
    return mesh, with_resolved_precision(cfg, mesh.device, speaks=mesh.rank == 0), recovery


def kept(cfg: Config) -> bool:
    """Under peer recovery: a worker its keeper started (launch.recovery peer through `meshrun train`)."""
    return peer_recovery(cfg.parallel, cfg.launch) and in_launched_worker() and ROLE_ENV in os.environ


def start_watchdog(cfg: Config) -> HangWatchdog | None:
    """This worker's hang watchdog (launch.hang_timeout 0: none), armed before it joins the process
    group: its place comes from the layout and its rank, not from the group."""
    if not cfg.launch.hang_timeout:
        return None
    rank = int(os.environ.get("RANK", "0"))
    place = Place.of(cfg.layout, rank)
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    one_process = not in_launched_worker()  # its own launcher: it says the summary itself
    watchdog = HangWatchdog(
        Path(cfg.run_dir),
        place,
        timeout=cfg.launch.hang_timeout,
        attempt=attempt,
        summarise=one_process,
        alone=kept(cfg),  # launch.recovery peer: the rank that stalled ends alone, and is replaced
    )
    watchdog.start()
    return watchdog


def close_worker(run: Run | None, *, failing: bool) -> None:
    """The run's and the process group's cleanup. After a failure, what they raise (a stop
    request's all-reduce still in flight when a peer was lost) would only bury the failure's line."""
    quietly = contextlib.suppress(Exception) if failing else contextlib.nullcontext()
    if run is not None:
        with quietly:
            run.close()
    with quietly:
        shutdown()


def worker_failed(run_dir: Path, rank: int, exc: Exception, *, attempt: int) -> int:
    """A launched worker's failure as a few lines, not one traceback per rank (a lost peer breaks
    every other rank's collective): the traceback goes to this rank's log, the first rank of the
    attempt to fail records its one-line cause, which the launcher repeats last, and says it now
    if torchrun will restart the workers. Returns the exit status (non-zero: torchrun restarts)."""
    cause = log_failure(run_dir, rank, exc, attempt=attempt)
    restarts = int(os.environ.get("TORCHELASTIC_MAX_RESTARTS", "0"))
    if attempt < restarts and not failed_in(run_dir, attempt):
        say(f"{cause}; torchrun restarts the workers (attempt {attempt + 2} of {restarts + 1})")
    record_failure(run_dir, exc, cause=cause, attempt=attempt)
    return 1


def record_failure(run_dir: Path, exc: BaseException, *, cause: str | None = None, attempt: int = 0) -> None:
    """Any rank that fails says so, with its one-line `cause`; a RunError's own line wins over
    a peer's earlier cause (the launcher says it last)."""
    error = " ".join(str(exc).split()) if isinstance(exc, RunError) else cause
    if not isinstance(exc, RunError) and failed_in(run_dir, attempt):
        return  # a peer failed first (this rank's collective broke with it): its record, and reason, stay
    with contextlib.suppress(OSError, RunError):  # the error itself matters more than its record (a full disk)
        write_record(run_dir, Outcome.FAILED, error=error, attempt=attempt)
