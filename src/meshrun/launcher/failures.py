"""Which worker was lost, where and how, as its keeper saw it (launch.recovery peer, issue 46): one
file per rank, `RUN_DIR/failures/rank{R}.json`, a list of losses each keeper writes (atomically,
the whole list) the moment its worker dies. `meshrun report` reads them beside metrics.jsonl's
recovery events (which say from whom and how long, not how the rank died or on which node), and
the keeper that runs out of replacements names the node from them: a rank that keeps failing on
one node is a node to drain.

A worker its hang watchdog ended (launcher/hang.py: under peer recovery only the rank that stalled
exits, with HUNG_EXIT_CODE) is a loss like a killed one; its report folder is kept under a name of
its own (`hang/replaced-R-N`), so that a later failure of the run is not read as this hang.
"""

from __future__ import annotations

import json
import socket
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from meshrun.files.atomic import write_atomic
from meshrun.launcher.outcome import status_text

FAILURES = "failures"
RUN_DIR_ENV = "MESHRUN_RUN_DIR"  # for keepers: where their records go (set by `meshrun train`'s launcher)
HANG_DIR, HUNG_EXIT_CODE = "hang", 124  # launcher/hang.py's (not imported: the keeper stays light)
MAX_TEXT = 1000  # a record's words (a hang's stacks path included), as read back


@dataclass(frozen=True)
class Loss:
    """One lost worker: `rank` on `host`, `how` it ended (words), `at` (time.time(), the keeper's),
    which launch (`job`, the run_dir lock's) and whether a replacement took its place."""

    rank: int
    host: str
    how: str
    at: float
    job: str
    replaced: bool


def lost(code: int) -> bool:
    """A worker's status that a replacement answers: killed by a signal, or ended by its hang watchdog."""
    return code < 0 or code == HUNG_EXIT_CODE


def how_it_ended(code: int, run_dir: Path | None, rank: int, number: int) -> str:
    """`code` in words; a hang's with the watchdog's report, whose folder is moved aside to
    `hang/replaced-RANK-NUMBER` (read from there by the user, never again as this run's hang)."""
    if code != HUNG_EXIT_CODE:
        return f"was {status_text(code)}"
    where, stacks = "", ""
    if run_dir is not None:
        for folder in sorted((run_dir / HANG_DIR).glob("attempt-*")):
            kept = folder.with_name(f"replaced-{rank}-{number}")
            try:
                report = json.loads((folder / f"rank{rank}.json").read_text())
                folder.rename(kept)
                where = f" at step {report['step']} ({report['phase']}) for {report['stalled_s']:.0f} s"
            except (OSError, ValueError, KeyError, TypeError):
                continue
            stacks = f"; stacks: {kept / f'rank{rank}.stacks.txt'}"
    return f"made no progress{where} (its hang watchdog ended it, launch.hang_timeout{stacks})"


def record(run_dir: Path | None, loss: Loss) -> None:
    """Add `loss` to its rank's file; nothing without a run_dir (a keeper started by hand)."""
    if run_dir is None:
        return
    path = run_dir / FAILURES / f"rank{loss.rank}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    earlier = [asdict(item) for item in read_rank(path)]
    write_atomic(path, json.dumps([*earlier, asdict(loss)], indent=1) + "\n")


def read_rank(path: Path) -> list[Loss]:
    """One rank's losses; those meshrun could not have written left out (a report is no reason to fail)."""
    try:
        items = json.loads(path.read_text())
        return [loss for loss in map(_loss, items) if loss is not None] if isinstance(items, list) else []
    except (OSError, ValueError, RecursionError):
        return []


def _loss(item: object) -> Loss | None:
    """A Loss from a parsed item, if every field has the type meshrun writes (text short and printable)."""
    try:
        loss = Loss(**item) if isinstance(item, dict) else None
    except TypeError:
        return None
    if loss is None or type(loss.rank) is not int or type(loss.replaced) is not bool:
        return None
    if not isinstance(loss.at, (int, float)) or isinstance(loss.at, bool):
        return None
    texts = (loss.host, loss.how, loss.job)
    return loss if all(isinstance(t, str) and len(t) <= MAX_TEXT and t.isprintable() for t in texts) else None


def read_losses(run_dir: Path) -> list[Loss]:
    """Every rank's losses in the run's folder, in time order."""
    found = [loss for path in (run_dir / FAILURES).glob("rank*.json") for loss in read_rank(path)]
    return sorted(found, key=lambda loss: loss.at)


def new_loss(rank: int, how: str, *, job: str, replaced: bool) -> Loss:
    return Loss(rank, socket.gethostname(), how, time.time(), job, replaced)


def repeated_line(losses: list[Loss], *, replacements: int) -> str:
    """The run's last line when one rank used up its replacements: the rank, its node and each
    way it ended, so that the user can drain the node."""
    last = losses[-1]
    hosts = sorted({loss.host for loss in losses})
    where = f"node {hosts[0]}" if len(hosts) == 1 else f"nodes {', '.join(hosts)}"
    ways = "; ".join(dict.fromkeys(loss.how for loss in losses))
    return (
        f"rank {last.rank} on {where} failed {len(losses)} times ({ways}); launch.max_restarts ({replacements}) "
        f"replacements used up: if {where} keeps failing, drain it (take it out of the job) before rerunning"
    )
