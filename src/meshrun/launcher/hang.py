"""A run that stalls says where: each worker's watchdog, its launcher's one summary.

Worker side (`HangWatchdog`): a daemon thread reads this worker's progress mark (launcher/progress.py)
twice a second. Once training has begun, a worker whose mark has not moved for `launch.hang_timeout`
seconds (three times that in its first step, which warms up, while a block compiles (train.compile),
and while it evaluates or checkpoints, which may take long without a mark) writes a report and its
Python stacks, all threads (`faulthandler`, which needs no GIL), under `RUN_DIR/hang/attempt-N/`, and exits with
`HUNG_EXIT_CODE`. The first worker to fire leaves a trigger file there: every other worker sees
it within a poll and reports too, waiting where it waits (the collective it is blocked in is on its
stack); all exit together a few seconds after the trigger, so no exit tears down a collective
before its peers have reported. A step that is slow but progressing
marks each microbatch and pipeline action, so it never fires.

Launcher side (`hang_summary`): after torchrun ends without a recorded outcome, the newest attempt's
reports become one summary: the rank furthest behind (step, phase, microbatch: the odd one out; its stage, dp index,
phase and stack file) and where the others wait. Under `launch.max_restarts` torchrun restarts the
group from the newest checkpoint like after any failure; a rank that stalls every time uses up the
restarts and is reported, not restarted forever.

torch's flight recorder (recent collectives per rank) is NCCL's: with gloo there is none, so the
stacks are the record of which collective each rank waits in.
"""

from __future__ import annotations

import faulthandler
import json
import os
import re
import shutil
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from meshrun.errors import RunError
from meshrun.files.atomic import write_atomic
from meshrun.files.json_reader import read_json
from meshrun.launcher import progress

HANG_DIR = "hang"
TRIGGER = "trigger"
HUNG_EXIT_CODE = 124  # as coreutils' timeout: the job was ended for making no progress
POLL_SECONDS = 0.5
SLOW_PHASES = ("compile", "eval", "checkpoint")  # long without a mark by nature: watched at SLOW_FACTOR x the timeout
SLOW_FACTOR = 3
GRACE_SECONDS = 3.0  # every rank exits this long after the trigger: time for all to report


class HangError(RunError):
    """The workers were ended for making no progress: the summary's last line."""

    exit_code = HUNG_EXIT_CODE


@dataclass(frozen=True)
class Place:
    """Where a worker sits in the layout, for its report."""

    rank: int
    pp_rank: int
    dp_rank: int
    stages: tuple[int, ...]


class HangWatchdog:
    def __init__(self, run_dir: Path, place: Place, *, timeout: float, attempt: int) -> None:
        self.folder = run_dir / HANG_DIR / f"attempt-{attempt}"
        self.place, self.timeout = place, timeout
        self._thread = threading.Thread(target=self._watch, name="meshrun-hang-watchdog", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def limit(self, now: progress.Progress) -> float:
        """Seconds without a mark that make a hang, in the phase `now` is in."""
        slow = now.phase in SLOW_PHASES or now.step == now.first_step
        return self.timeout * (SLOW_FACTOR if slow else 1)

    def _watch(self) -> None:
        while True:
            time.sleep(POLL_SECONDS)
            now = progress.current()
            if now.step == 0 or now.phase == "finishing":
                continue  # armed while training: loading a model or a checkpoint, and the summary, mark nothing
            stalled = time.monotonic() - now.at
            peer_fired = (self.folder / TRIGGER).exists()
            if stalled > self.limit(now) or peer_fired:
                self._report(now, stalled, first=not peer_fired)
                os._exit(HUNG_EXIT_CODE)  # the main thread is stuck: end the process from here

    def _report(self, now: progress.Progress, stalled: float, *, first: bool) -> None:
        self.folder.mkdir(parents=True, exist_ok=True)
        stacks = self.folder / f"rank{self.place.rank}.stacks.txt"
        with stacks.open("w") as out:
            out.write(
                f"rank {self.place.rank}: step {now.step}, {now.phase} {now.detail}, {stalled:.1f} s without progress\n"
            )
            out.flush()
            faulthandler.dump_traceback(file=out, all_threads=True)
        last = time.time() - stalled  # wall clock: comparable across nodes, unlike monotonic time
        report = {**asdict(self.place), **asdict(now), "stalled_s": round(stalled, 1), "last_progress": last}
        report.pop("at")
        write_atomic(self.folder / f"rank{self.place.rank}.json", json.dumps(report) + "\n")
        if first:
            write_atomic(self.folder / TRIGGER, f"{self.place.rank}\n")
        # Every rank ends together, GRACE_SECONDS after the trigger: one that ended sooner would break
        # its peers' collectives before their watchdogs reported where they wait.
        time.sleep(max(0.0, (self.folder / TRIGGER).stat().st_mtime + GRACE_SECONDS - time.time()))


def clear_reports(run_dir: Path) -> None:
    """Forget an earlier launch's hang reports before workers start, so only this one's are read."""
    shutil.rmtree(run_dir / HANG_DIR, ignore_errors=True)


def read_reports(run_dir: Path) -> tuple[Path, list[dict]] | None:
    """The newest attempt's folder and its rank reports; None when no worker reported a hang."""
    attempts = sorted((run_dir / HANG_DIR).glob("attempt-*"), key=lambda p: int(p.name.split("-")[1]))
    if not attempts:
        return None
    reports = []
    for path in sorted(attempts[-1].glob("rank*.json")):
        try:
            reports.append(read_json(path))
        except (OSError, ValueError):
            continue  # a worker ended while writing: the others still say enough
    return (attempts[-1], reports) if reports else None


def _came_first(folder: Path, record: Path) -> bool:
    """Whether the hang of `folder` was triggered before the failure `record` was written (or no
    failure was): then the failure is the hang's consequence, a peer's broken collective. A worker that
    failed first (an exception that left its peers waiting) is the cause, and its error is the story."""
    try:
        return not record.exists() or record.stat().st_mtime >= (folder / TRIGGER).stat().st_mtime
    except OSError:
        return True  # no trigger file: the reports were the first thing written


def hang_summary(run_dir: Path, timeout: int, *, record: Path) -> tuple[list[str], HangError] | None:
    """The summary lines and the last line's error of the newest hang; None when there was none, or
    when the workers' failure `record` came before it (see `_came_first`)."""
    found = read_reports(run_dir)
    if found is None or not _came_first(found[0], record):
        return None
    folder, reports = found
    odd = min(reports, key=_how_far)  # the furthest behind: the others ran on until they waited for it
    stacks = folder / f"rank{odd['rank']}.stacks.txt"
    where = f"pipeline rank {odd['pp_rank']}, stages {list(odd['stages'])}, dp {odd['dp_rank']}"
    first = (
        f"hang at step {odd['step']}: rank {odd['rank']} ({where}) made no progress for "
        f"{odd['stalled_s']:.0f} s in {_phase(odd)}; its stacks: {stacks}"
    )
    lines = [first]
    waiting: dict[str, list[int]] = {}
    for report in reports:
        if report is not odd:
            waiting.setdefault(_phase(report), []).append(report["rank"])
    lines += [f"  waiting: ranks {sorted(ranks)} in {phase}" for phase, ranks in sorted(waiting.items())]
    error = HangError(
        f"rank {odd['rank']} stopped making progress at step {odd['step']} ({_phase(odd)}); the job was ended after "
        f"launch.hang_timeout ({timeout} s): stacks and reports in {folder}"
    )
    return lines, error


PHASE_ORDER = ("data", "compile", "forward", "backward", "optimizer", "log", "eval", "checkpoint", "finishing")


def _how_far(report: dict) -> tuple[int, int, int, float]:
    """How far a rank got in the job: step, phase, microbatch; a pipeline rank still waiting for its
    first input counts as past every microbatch (it waits on another). Ties: the older mark."""
    phase = PHASE_ORDER.index(report["phase"]) if report["phase"] in PHASE_ORDER else len(PHASE_ORDER)
    found = re.search(r"microbatch (\d+)", report.get("detail", ""))
    microbatch = int(found[1]) if found else (1 << 30 if "pipeline step started" in report.get("detail", "") else 0)
    return report["step"], phase, microbatch, report["last_progress"]


def _phase(report: dict) -> str:
    return f"{report['phase']} ({report['detail']})" if report.get("detail") else report["phase"]
