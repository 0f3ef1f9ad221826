"""What `meshrun train` does once its checks passed: hold the run directory, prepare data on first
use, then hand over to a worker (under torchrun, or one process) or to this node's launcher."""

from __future__ import annotations

import contextlib
import os
import signal
from collections.abc import Iterator
from pathlib import Path

from torch import nn

from meshrun.config.schema import Config
from meshrun.data.first_use import prepare_on_first_use
from meshrun.launcher.hang import check_report_folder, clear_reports
from meshrun.launcher.lifetime import die_with_parent, name_worker
from meshrun.launcher.local import already_complete, launch, launcher_job
from meshrun.launcher.outcome import Interrupted
from meshrun.launcher.run_lock import HELD_ENV, hold_run_dir, worker_job
from meshrun.launcher.torchrun import in_launched_worker
from meshrun.preflight import check_data_fits, check_run_dir
from meshrun.training.worker import run_worker


def train(cfg: Config, worker_args: list[str], model: nn.Module) -> int:
    """Be a worker (under torchrun) or launch them; `model` is the one `preflight` built (meta).
    Returns the exit code for the run's outcome (see meshrun.launcher.outcome). Nothing in the run
    directory changes before the run is known to train (a complete run: nothing to do)."""
    if in_launched_worker():
        die_with_parent(signal.SIGKILL)  # the agent that started this worker is gone: so is the job
        name_worker(int(os.environ.get("RANK", "0")))
        with worker_hold(cfg):
            if int(os.environ.get("LOCAL_RANK", "0")) == 0:
                ensure_data(cfg)
            run_worker(cfg)
        return 0  # stopped on request too: torchrun restarts a group that exits non-zero
    run_dir = Path(cfg.run_dir)
    try:
        with hold_run_dir(run_dir, job=launcher_job(cfg), role="meshrun train") as lock:
            # again, now held: a job that ended meanwhile may have left a config.json this one would run over
            check_run_dir(cfg)
            ensure_data(cfg)
            if already_complete(cfg, model):
                return 0
            check_report_folder(run_dir)
            clear_reports(run_dir)  # an earlier launch's hang reports must not be read as this one's
            if cfg.world_size == 1 and cfg.launch.nnodes == 1 and cfg.launch.max_restarts == 0:
                return run_worker(cfg).exit_code  # one process needs no torchrun (nor its restarts)
            return launch(cfg, worker_args, lock=lock)
    except KeyboardInterrupt:  # Ctrl-C in one process, or passed on to torchrun's workers
        raise Interrupted(run_dir) from None


def ensure_data(cfg: Config) -> None:
    """This job's data, prepared on first use and then checked (data that was already there was
    checked by `preflight`)."""
    if (prepared := prepare_on_first_use(cfg)) is not None:
        check_data_fits(cfg, prepared)


@contextlib.contextmanager
def worker_hold(cfg: Config) -> Iterator[None]:
    """A worker holds the run_dir for its job, unless its launcher does (torchrun started by hand)."""
    if HELD_ENV in os.environ:
        yield
        return
    with hold_run_dir(Path(cfg.run_dir), job=worker_job(), role=f"worker rank {os.environ['RANK']}"):
        check_run_dir(cfg)
        yield
