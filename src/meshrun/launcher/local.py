"""Launching this node's workers: torchrun with the launcher-worker protocol's environment, the
rendezvous watched, and how the run ended read back from what the workers recorded (or did not)."""

from __future__ import annotations

import os
import uuid
from pathlib import Path

from torch import nn

from meshrun.checkpoint.paths import resume_candidates
from meshrun.config.schema import Config
from meshrun.config.topology import no_replica, peer_recovery
from meshrun.errors import RunError
from meshrun.files.console import say
from meshrun.files.json_reader import read_json
from meshrun.launcher.failures import RUN_DIR_ENV
from meshrun.launcher.hang import hang_summary
from meshrun.launcher.lifetime import PARENT_PID
from meshrun.launcher.logs import LOGS_ENV, log_dir
from meshrun.launcher.outcome import (
    RECORD,
    Outcome,
    clear_record,
    launcher_exit_code,
    read_error,
    read_record,
)
from meshrun.launcher.rendezvous import RendezvousWatch
from meshrun.launcher.returning import NODE_KEY_ENV, lost_node, node_key, run_returned
from meshrun.launcher.run_lock import HELD_ENV, RunDirLock
from meshrun.launcher.torchrun import (
    RDZV_TIMEOUT_EXIT,
    check_torchrun_ending,
    keeper_argv,
    run_tmpdir,
    run_torchrun,
    timeout_message,
    torchrun_argv,
    waiting_line,
    worker_env,
)


def launcher_job(cfg: Config) -> str:
    """This launch's job, as every node's launcher names it (meshrun.launcher.run_lock)."""
    launch = cfg.launch
    if launch.nnodes == 1 and launch.rdzv_endpoint is None:  # a private rendezvous: a job of its own
        return f"standalone {uuid.uuid4().hex[:12]}"
    return f"{launch.rdzv_id} at {launch.rdzv_endpoint}"


def already_complete(cfg: Config, model: nn.Module) -> bool:
    """The run in run_dir is at train.steps already (said in one line); a checkpoint it cannot resume
    from is refused here, before any worker exists. `model`: the one `preflight` built (meta)."""
    run_dir = Path(cfg.run_dir)
    if resume_candidates(cfg.run_dir, cfg.train.resume):  # cannot resume: stop before any worker exists
        from meshrun.checkpoint.dcp import read_manifest  # torch.distributed.checkpoint: only when needed
        from meshrun.checkpoint.resume import check_resumable
        from meshrun.models.lora import base_identity

        resume_from = check_resumable(cfg.run_dir, cfg.train.resume, model, base=base_identity(cfg.model))
        step = read_manifest(resume_from).get("step") if resume_from is not None else None
        if isinstance(step, int) and step >= cfg.train.steps:
            say(f"run already complete: {resume_from} is at step {step} (train.steps {cfg.train.steps}); nothing to do")
            return True
    done = completed_steps(run_dir) if cfg.train.resume == "auto" else None  # a named one: a rollback
    if done is not None and done >= cfg.train.steps:  # finished after its newest checkpoint (at_end off)
        say(
            f"run already complete: its summary.json records step {done} (train.steps {cfg.train.steps}); nothing to do"
        )
        return True
    return False


def launch(cfg: Config, worker_args: list[str], *, lock: RunDirLock) -> int:
    """torchrun with this node's workers, under the held `lock`; returns the exit code for how the
    run ended (see meshrun.launcher.outcome), or raises the workers' one-line reason."""
    run_dir = Path(cfg.run_dir)
    env = {**worker_env(cfg), PARENT_PID: str(os.getpid()), HELD_ENV: lock.job, LOGS_ENV: str(log_dir(run_dir))}
    env[RUN_DIR_ENV] = str(run_dir)  # the keepers' failure records (launch.recovery peer)
    if (key := node_key(cfg)) is not None:
        env[NODE_KEY_ENV] = key
        if (recorded := lost_node(cfg, key)) is not None:  # this node is back in a running job
            with run_tmpdir(env):
                code = run_returned(cfg, recorded, keeper_argv(cfg, worker_args, replacing=True), env=env, lock=lock)
            return returned_ending(run_dir, code)
    argv = torchrun_argv(cfg, worker_args)
    say(f"starting {cfg.world_size} workers: {' '.join(argv[1:])}")
    if cfg.launch.recovery == "peer" and not peer_recovery(cfg.parallel, cfg.launch):
        say(
            f"launch.recovery peer: {no_replica(cfg.parallel)}, so no replica holds a lost worker's state; a lost "
            "worker restarts every worker from the newest checkpoint (launch.max_restarts)"
        )
    watch = RendezvousWatch(cfg) if cfg.launch.nnodes > 1 else None
    if watch is not None:
        say(waiting_line(cfg))
        watch.start()
    clear_record(run_dir)  # an earlier launch's outcome must not be read as this one's
    try:
        with run_tmpdir(env):
            code, relayed = run_torchrun(argv, env=env, lock=lock)
    finally:
        if watch is not None:
            watch.stop()
    outcome = read_record(run_dir)
    stop = check_torchrun_ending(run_dir, outcome, code, relayed)
    hung = None  # a failure recorded after the hang's trigger is its consequence (a peer's collective broke)
    if outcome in (None, Outcome.FAILED):
        hung = hang_summary(run_dir, cfg.launch.hang_timeout, record=run_dir / RECORD)
    if hung is not None:
        lines, error = hung
        for line in lines:
            say(line)
        raise error
    if outcome is None and code == RDZV_TIMEOUT_EXIT:
        raise RunError(timeout_message(cfg, watch.state() if watch is not None else "one node"))
    if outcome is Outcome.FAILED and (error := read_error(run_dir)):
        raise error  # the workers' reason, as the last line (their lines may interleave above)
    return launcher_exit_code(outcome, code, stop_relayed=stop is not None)


def returned_ending(run_dir: Path, code: int) -> int:
    """A returned node's exit code: its workers' (each ends 0 when it completed or stopped, as under
    torchrun); a failure with the reason rank 0 recorded, if it did (it may still be writing it)."""
    if code and read_record(run_dir) is Outcome.FAILED and (error := read_error(run_dir)):
        raise error
    return code


def completed_steps(run_dir: Path) -> int | None:
    """The steps a completed run's summary.json records (None: not completed, or not readable):
    with checkpoint.at_end off, its newest checkpoint is older than the run's end."""
    try:
        steps = read_json(run_dir / "summary.json").get("steps")
    except (OSError, ValueError, AttributeError):
        return None
    return steps if isinstance(steps, int) else None
