"""One worker kept alive: the process torchrun's agent (or srun, or a pod) starts for a rank runs the
training worker as its child and, when that child is killed, starts a replacement in its place,
while the other ranks' workers live on (issue 46, peer recovery).

Why here and not in torchrun's agent: the agent treats any worker's end as the whole group's
(`LocalElasticAgent` stops every local worker and restarts them all, and with one agent per rank a
rejoining agent makes every other agent restart its workers too); it has no way to replace one
worker. A keeper stays alive through its child's death, so the agent sees nothing, and the
survivors rebuild their process group with the replacement (meshrun.parallel.regroup), each worker
told its role in ROLE_ENV (which generation of the group to join, the store says: a keeper knows
only its own rank's deaths). Torch-free: it costs one small process per rank.
It passes on the signals the agent sends (a stop request, Ctrl-C) and ends with the agent; its
worker ends with it (meshrun.launcher.lifetime).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

from meshrun.checkpoint.paths import what_a_rerun_does
from meshrun.errors import RunError
from meshrun.files.console import say
from meshrun.launcher.failures import RUN_DIR_ENV, how_it_ended, lost, new_loss, read_losses, record, repeated_line
from meshrun.launcher.lifetime import die_with_parent
from meshrun.launcher.outcome import STOP_SIGNALS, Outcome, write_record
from meshrun.launcher.run_lock import HELD_ENV

ROLE_ENV = "MESHRUN_WORKER_ROLE"  # FIRST, REPLACEMENT or SPARE
FIRST, REPLACEMENT = "first", "replacement"  # the job's first worker for this rank; one started in a lost one's place
LOST_AT_ENV = "MESHRUN_LOST_AT"  # a replacement's: when (time.time()) the worker it replaces was lost
SPARE = "spare"  # started ahead: it waits, on its stdin, for its turn to be a replacement
RELAYED = (*STOP_SIGNALS, signal.SIGINT)  # what the agent sends a worker reaches the training worker


def keep(
    argv: Sequence[str], *, env: Mapping[str, str], replacements: int, spare: bool = False, replacing: bool = False
) -> int:
    """Run `argv` as this rank's worker; each time it is killed by a signal (a crash, the OOM killer,
    `kill -9`) or ended by its hang watchdog, start it again with the next generation, at most
    `replacements` times, each loss recorded in the run's failures (launcher/failures.py). `spare`: keep
    the next replacement started ahead, waiting (meshrun.parallel.regroup.generation), so that a
    replacement costs no process start. A worker that exits by itself (done, stopped, or failed in
    its own words) ends the keeper with its status; the last one's death too, as the shell would
    say it (128 + the signal), and a death after a stop this keeper passed on (the job is ending).
    `replacing`: the first worker is itself a replacement (its node was lost: launcher/returning.py)."""
    rank, run_dir = env.get("RANK", "?"), (Path(env[RUN_DIR_ENV]) if RUN_DIR_ENV in env else None)
    standby = start(argv, env=env, role=SPARE) if spare and replacements else None
    worker, number, relayed = start(argv, env=env, role=REPLACEMENT if replacing else FIRST), 0, []
    while lost(code := wait_relaying(worker, relayed)) and not relayed:
        how = note_loss(run_dir, env, code, number=number, replaced=number < replacements)
        if number == replacements:
            give_up(run_dir, env, code, how=how, replacements=replacements)
            break
        number += 1
        took = "its spare takes over" if standby is not None else "starting its replacement"
        say(f"rank {rank} {how}; {took} ({number} of {replacements}), which takes its state from a replica")
        lost_at = f"{time.time():.3f}"
        worker = (
            promote(standby, lost_at)
            if standby is not None
            else start(argv, env=env, role=REPLACEMENT, lost_at=lost_at)
        )
        standby = start(argv, env=env, role=SPARE) if spare and number < replacements else None
    if standby is not None:  # not needed: it holds nothing yet
        standby.kill()
        standby.wait()
    return code if code >= 0 else 128 - code


def note_loss(run_dir: Path | None, env: Mapping[str, str], code: int, *, number: int, replaced: bool) -> str:
    """How this rank's worker ended, in words, recorded in the run's failures (launcher/failures.py)."""
    rank = int(env.get("RANK", "0"))
    how = how_it_ended(code, run_dir, rank, number + 1)
    with contextlib.suppress(OSError):  # the record is for the report: the run goes on without it
        record(run_dir, new_loss(rank, how, job=env.get(HELD_ENV, ""), replaced=replaced))
    return how


def give_up(run_dir: Path | None, env: Mapping[str, str], code: int, *, how: str, replacements: int) -> None:
    """No replacement left: said here, and, as the run's last line (its outcome record, which the
    launcher repeats), the rank and the node it kept failing on."""
    say(f"rank {env.get('RANK', '?')} {how}; no replacement left ({replacements} used)")
    if run_dir is None:
        return
    mine = [
        loss
        for loss in read_losses(run_dir)
        if loss.rank == int(env.get("RANK", "0")) and loss.job == env.get(HELD_ENV, "")
    ]
    line = f"{repeated_line(mine, replacements=replacements)}; {what_a_rerun_does(run_dir)}"
    with contextlib.suppress(OSError, RunError):
        write_record(run_dir, Outcome.FAILED, error=line, exit_code=code if code >= 0 else 128 - code)


def start(argv: Sequence[str], *, env: Mapping[str, str], role: str, lost_at: str = "") -> subprocess.Popen:
    """A worker in `role`; a spare with a pipe on its stdin, where its turn comes (and when the
    worker it replaces was lost)."""
    stdin = subprocess.PIPE if role == SPARE else None
    return subprocess.Popen(list(argv), env={**env, ROLE_ENV: role, LOST_AT_ENV: lost_at}, stdin=stdin, text=True)


def promote(standby: subprocess.Popen, lost_at: str) -> subprocess.Popen:
    """The waiting spare becomes the replacement of a worker lost at `lost_at`."""
    assert standby.stdin is not None
    standby.stdin.write(f"{REPLACEMENT} {lost_at}\n")
    standby.stdin.close()
    return standby


def wait_relaying(worker: subprocess.Popen, relayed: list[int]) -> int:
    """Wait for `worker`'s end with the stop signals and Ctrl-C this process gets passed on to it (it
    checkpoints and stops, as when the agent signals it directly), each added to `relayed`. Returns
    its status (-N: signal N)."""

    def relay(signum: int, frame: object) -> None:
        relayed.append(signum)
        worker.send_signal(signum)

    previous = {sig: signal.signal(sig, relay) for sig in RELAYED}
    try:
        return worker.wait()
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def main(args: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m meshrun.launcher.keeper", description=__doc__)
    parser.add_argument("--replacements", type=int, required=True, help="replacements at most for this rank")
    parser.add_argument("--spare", action="store_true", help="keep the next replacement started ahead, waiting")
    parser.add_argument("--replacing", action="store_true", help="the first worker replaces one lost with its node")
    parser.add_argument("worker", nargs=argparse.REMAINDER, help="the worker's command line, after --")
    parsed = parser.parse_args(args)
    die_with_parent(signal.SIGTERM)  # the agent gone: the worker stops as on any stop request, then dies with this
    worker = parsed.worker[1:] if parsed.worker[:1] == ["--"] else parsed.worker
    return keep(
        worker, env=os.environ, replacements=parsed.replacements, spare=parsed.spare, replacing=parsed.replacing
    )


if __name__ == "__main__":
    sys.exit(main())
