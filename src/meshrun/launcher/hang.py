"""A run that stalls says where: each worker's watchdog, its launcher's one summary.

Worker side (`HangWatchdog`): a daemon thread reads this worker's progress mark (launcher/progress.py)
twice a second, from the moment the worker starts (before it joins the process group; one process
without torchrun too) until it finishes. A worker whose mark has not moved for `launch.hang_timeout`
seconds (`SLOW_FACTOR` = three times that while it initialises, which is each of: joining the
process group, the first collective, building the model and its weights, loading a checkpoint; in
its first step, which warms up; while a block compiles (train.compile); and while it evaluates or
checkpoints, which may take long without a mark) writes a report and its Python stacks, all threads
(`faulthandler`, which needs no GIL), under `RUN_DIR/hang/attempt-N/`, and exits with
`HUNG_EXIT_CODE`. The first worker to fire leaves a trigger file there: every other worker sees
it within a poll and reports too, waiting where it waits (the collective it is blocked in is on its
stack); all exit together a few seconds after the trigger, so no exit tears down a collective
before its peers have reported. A step that is slow but progressing marks each microbatch and
pipeline action, so it never fires. A watchdog that cannot write its report (the folder is a file,
the disk is full) still ends the job with `HUNG_EXIT_CODE` and one line saying where it tried to
write and why it could not; a one-process job, whose worker is its launcher, prints the summary
itself. Under launch.recovery peer (`alone`) only the rank that stalled exits, once every rank has
reported (the `_odd_one` of the reports); the others wait on in their collective, which its exit
breaks, and recover with its replacement (training/recovery.py); its keeper moves the reports aside
(launcher/failures.py).

Launcher side (`hang_summary`): after torchrun ends without a recorded outcome, the newest attempt's
reports become one summary: the rank that stalled (see `_odd_one`: its stage, dp index, phase and
stack file) and where the others wait. Under `launch.max_restarts` torchrun restarts the
group from the newest checkpoint like after any failure; a rank that stalls every time uses up the
restarts and is reported, not restarted forever.

torch's flight recorder (recent collectives per rank) is NCCL's: with gloo there is none, so the
stacks are the record of which collective each rank waits in.
"""

from __future__ import annotations

import contextlib
import faulthandler
import json
import os
import re
import shutil
import sys
import threading
import time
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from meshrun.errors import ConfigError, RunError
from meshrun.files.atomic import write_atomic
from meshrun.files.console import say
from meshrun.files.json_reader import read_json
from meshrun.launcher import progress
from meshrun.launcher.outcome import Outcome, write_record
from meshrun.parallel.layout import PLACE_AXES, Layout, place_text

HANG_DIR = "hang"
TRIGGER = "trigger"
HUNG_EXIT_CODE = 124  # as coreutils' timeout: the job was ended for making no progress
POLL_SECONDS = 0.5
# long without a mark by nature: watched at SLOW_FACTOR x the timeout (init: before step 1)
SLOW_PHASES = ("init", "compile", "eval", "checkpoint", "recovering")
SLOW_FACTOR = 3
GRACE_SECONDS = 3.0  # every rank exits this long after the trigger: time for all to report


class HangError(RunError):
    """The workers were ended for making no progress: the summary's last line."""

    exit_code = HUNG_EXIT_CODE


@dataclass(frozen=True)
class Place:
    """Where a worker sits in the layout, for its report: its coordinate on each axis a layout is
    named by (Layout.place), the pipeline stages it holds."""

    rank: int
    axes: Mapping[str, int]
    stages: tuple[int, ...]

    @classmethod
    def of(cls, layout: Layout, rank: int) -> Place:
        """`rank`'s place, from the layout alone (the watchdog is armed before the process group exists)."""
        axes = layout.place(rank)
        return cls(rank, axes, tuple(layout.stages_of(axes["pp"])))

    def report(self) -> dict[str, Any]:
        """The report's fields: `rank`, `{axis}_rank` for each axis, `stages`."""
        return {"rank": self.rank, **{f"{axis}_rank": c for axis, c in self.axes.items()}, "stages": list(self.stages)}


class HangWatchdog:
    """Ends this worker when its progress mark stalls (see the module docstring). `summarise`: this
    worker is its own launcher (one process): it prints the summary before it exits."""

    def __init__(
        self, run_dir: Path, place: Place, *, timeout: float, attempt: int, summarise: bool = False, alone: bool = False
    ) -> None:
        self.run_dir, self.folder = run_dir, run_dir / HANG_DIR / f"attempt-{attempt}"
        self.place, self.timeout, self.summarise, self.alone = place, timeout, summarise, alone
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="meshrun-hang-watchdog", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        """The worker is done: a later run in this process (tests, parity) is not this one's."""
        self._stop.set()

    def limit(self, now: progress.Progress) -> float:
        """Seconds without a mark that make a hang, in the phase `now` is in."""
        return self.timeout * (SLOW_FACTOR if _is_slow(now.phase, now.step, now.first_step) else 1)

    def _watch(self) -> None:
        answered, since = 0.0, 0.0  # `alone`: the last trigger this worker reported to and survived (mtime, monotonic)
        while not self._stop.wait(POLL_SECONDS):
            now = progress.current()
            if now.phase == "finishing":
                continue  # the summary and pictures: no longer watched
            stalled = time.monotonic() - max(now.at, since)
            peer_fired = _trigger_time(self.folder) > answered
            if stalled > self.limit(now) or peer_fired:
                try:
                    self._report(now, stalled, first=not peer_fired)
                except Exception as exc:  # noqa: BLE001 - whatever stops the report, the job still ends
                    self._say_unwritable(now, stalled, exc)
                    os._exit(HUNG_EXIT_CODE)
                if not self.alone or self._stalled_here():
                    os._exit(HUNG_EXIT_CODE)  # the main thread is stuck: end the process from here
                answered, since = _trigger_time(self.folder), time.monotonic()

    def _stalled_here(self) -> bool:
        """`alone` (launch.recovery peer): whether this rank is the one that stalled (`_odd_one` of
        the reports), which then ends alone, its peers' reads done, to be replaced; the others wait
        in their collective until it breaks, and recover."""
        found = read_reports(self.run_dir)
        if found is None or _odd_one(found[1])["rank"] != self.place.rank:
            return False
        time.sleep(2 * POLL_SECONDS)  # the others read the reports at the same moment: before they move
        return True

    def _report(self, now: progress.Progress, stalled: float, *, first: bool) -> None:
        self.folder.mkdir(parents=True, exist_ok=True)
        stacks = self.folder / f"rank{self.place.rank}.stacks.txt"
        with stacks.open("w") as out:
            out.write(
                f"rank {self.place.rank}: {_at_step(now.step)}, {_phase(asdict(now))}, {stalled:.1f} s without progress\n"
            )
            out.flush()
            faulthandler.dump_traceback(file=out, all_threads=True)
        last = time.time() - stalled  # wall clock: comparable across nodes, unlike monotonic time
        report = {**self.place.report(), **asdict(now), "stalled_s": round(stalled, 1), "last_progress": last}
        report.pop("at")
        write_atomic(self.folder / f"rank{self.place.rank}.json", json.dumps(report) + "\n")
        if first:
            write_atomic(self.folder / TRIGGER, f"{self.place.rank}\n")
        if self.summarise:
            self._say_summary()
            return
        # Every rank ends together, GRACE_SECONDS after the trigger: one that ended sooner would break
        # its peers' collectives before their watchdogs reported where they wait.
        time.sleep(max(0.0, (self.folder / TRIGGER).stat().st_mtime + GRACE_SECONDS - time.time()))

    def _say_summary(self) -> None:
        """One process is its own launcher: the summary `hang_summary` gives the launcher, said here."""
        found = hang_summary(self.run_dir, round(self.timeout), record=self.run_dir / "no record")
        if found is not None:
            lines, error = found
            for line in lines:
                say(line)
            print(f"meshrun: error: {error}", file=sys.stderr, flush=True)

    def _say_unwritable(self, now: progress.Progress, stalled: float, exc: Exception) -> None:
        """No report: this line says why, and (under torchrun) the outcome record carries it to the launcher."""
        line = (
            f"rank {self.place.rank} made no progress for {stalled:.0f} s at {_at_step(now.step)} in "
            f"{_phase(asdict(now))}; the job was ended (exit {HUNG_EXIT_CODE}) without a hang report: it could "
            f"not be written to {self.folder}: {type(exc).__name__}: {exc}"
        )
        print(f"meshrun: error: {line}", file=sys.stderr, flush=True)
        if not self.summarise:
            with contextlib.suppress(Exception):  # the run folder is unwritable too: the line above is all
                write_record(self.run_dir, Outcome.FAILED, error=line, exit_code=HUNG_EXIT_CODE)


def _trigger_time(folder: Path) -> float:
    """When the newest hang of `folder` was triggered (its trigger file's mtime); 0: none."""
    try:
        return (folder / TRIGGER).stat().st_mtime
    except OSError:
        return 0.0


def check_report_folder(run_dir: Path) -> None:
    """Refuse, before any worker, a `RUN_DIR/hang` that is not a folder: no report could be written there."""
    path = run_dir / HANG_DIR
    if path.is_symlink() or (path.exists() and not path.is_dir()):
        raise ConfigError(
            f"{path} is not a folder: meshrun writes its hang reports there; move it away or set another run_dir"
        )


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


def _came_first(folder: Path, record: Path | None) -> bool:
    """Whether the hang of `folder` was triggered before the failure `record` was written (or no
    failure was): then the failure is the hang's consequence, a peer's broken collective. A worker that
    failed first (an exception that left its peers waiting) is the cause, and its error is the story."""
    try:
        return record is None or not record.exists() or record.stat().st_mtime >= (folder / TRIGGER).stat().st_mtime
    except OSError:
        return True  # no trigger file: the reports were the first thing written


def hang_summary(run_dir: Path, timeout: int, *, record: Path | None) -> tuple[list[str], HangError] | None:
    """The summary lines and the last line's error of the newest hang; None when there was none, or
    when the workers' failure `record` came before it (see `_came_first`; None: no record to weigh)."""
    found = read_reports(run_dir)
    if found is None or not _came_first(found[0], record):
        return None
    folder, reports = found
    odd = _odd_one(reports)
    stacks = folder / f"rank{odd['rank']}.stacks.txt"
    axes = {axis: odd[f"{axis}_rank"] for axis in PLACE_AXES if f"{axis}_rank" in odd}  # tp: not in older reports
    where = f"{place_text(axes)}, stages {list(odd['stages'])}"
    first = (
        f"hang at {_at_step(odd['step'])}: rank {odd['rank']} ({where}) made no progress for "
        f"{odd['stalled_s']:.0f} s in {_phase(odd)}; its stacks: {stacks}"
    )
    lines = [first]
    waiting: dict[str, list[int]] = {}
    for report in reports:
        if report is not odd:
            waiting.setdefault(_phase(report), []).append(report["rank"])
    lines += [f"  waiting: ranks {sorted(ranks)} in {phase}" for phase, ranks in sorted(waiting.items())]
    error = HangError(
        f"rank {odd['rank']} stopped making progress at {_at_step(odd['step'])} ({_phase(odd)}); the job was "
        f"ended after launch.hang_timeout ({timeout} s{_bound_note(odd)}): stacks and reports in {folder}"
    )
    return lines, error


PHASE_ORDER = ("init", "data", "compile", "forward", "backward", "optimizer", "log", "eval", "checkpoint", "finishing")


def _odd_one(reports: list[dict]) -> dict:
    """The rank that stalled: of the ranks stopped inside their own work, the one furthest behind.
    A rank waiting for another's output (a pipeline rank between its actions, waiting for the next
    input or gradient) is a consequence wherever it stands: its mark is the action it finished, which
    may look earlier than the blocked rank's (stage 0 after its forwards, while the last stage hangs in
    a backward). Only when every rank waits is the furthest behind of all named."""
    working = [report for report in reports if not report.get("waiting")]
    return min(working or reports, key=_how_far)  # the others ran on until they waited for it


def _how_far(report: dict) -> tuple[int, int, int, float]:
    """How far a rank got in the job: step, phase, place in the phase. Ties: the older mark."""
    phase = PHASE_ORDER.index(report["phase"]) if report["phase"] in PHASE_ORDER else len(PHASE_ORDER)
    return report["step"], phase, _place_in_phase(report), report["last_progress"]


def _place_in_phase(report: dict) -> int:
    """The initialisation stage (progress.INIT_STAGES) or the microbatch a rank is at; 0 if neither."""
    detail = report.get("detail", "")
    if report["phase"] == "init":
        return next((i for i, stage in enumerate(progress.INIT_STAGES) if detail.startswith(stage)), 0)
    found = re.search(r"microbatch (\d+)", detail)
    return int(found[1]) if found else 0


def _at_step(step: int) -> str:
    return f"step {step}" if step else "initialisation (before step 1)"


def _is_slow(phase: str, step: int, first_step: int) -> bool:
    """Whether a worker in `phase` of `step` is watched at SLOW_FACTOR x the timeout."""
    return phase in SLOW_PHASES or step == first_step


def _bound_note(report: dict) -> str:
    """How the timeout was stretched where `report`'s rank stalled, for the last line."""
    if not _is_slow(report["phase"], report["step"], report.get("first_step", -1)):
        return ""
    return f"; x{SLOW_FACTOR} in {report['phase'] if report['phase'] in SLOW_PHASES else 'the first step'}"


def _phase(report: dict) -> str:
    return f"{report['phase']} ({report['detail']})" if report.get("detail") else report["phase"]
