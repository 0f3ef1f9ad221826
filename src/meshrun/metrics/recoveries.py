"""A run's recoveries for `meshrun report` (issue 46): each lost worker, from its keeper's record
(launcher/failures.py: the rank, the node, how it ended) joined to the recovery event rank 0 wrote
in metrics.jsonl (the step, from whom the state came, how long it took, the steps lost); a loss
with no event was not recovered (the run failed, or stopped, there).

A checkpoint restart (launch.recovery checkpoint: torchrun restarts every worker) leaves its own
event (metrics/run_dir.py: the checkpoint's step, the logged steps trained again, the seconds from
the last logged step to the checkpoint loaded); no keeper saw how its worker ended.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from meshrun.launcher.failures import Loss, read_losses

PEER_KEYS = ("recovered_ranks", "recovered_from", "recovery_s", "steps_lost")  # training/recovery.py's event
RESTART_KEYS = ("resumed_from_step", "steps_lost", "restart_s")  # metrics/run_dir.py's
MATCH_S = 5.0  # a keeper's record and the event's lost_at are the same clock's on one node; across nodes, close


@dataclass(frozen=True)
class Recovery:
    """One lost worker: `step` it was lost in (1-based), the `loss` as its keeper saw it (None: an
    event whose keeper left no record), and the `event` (None: not recovered)."""

    step: int | None
    ranks: str
    loss: Loss | None
    event: dict[str, Any] | None

    def line(self) -> str:
        """Which rank died and how, how it was recovered, the time it took, the steps lost."""
        where = f" on node {self.loss.host}" if self.loss is not None else ""
        how = f" {self.loss.how}" if self.loss is not None else " was lost"
        at = f"step {self.step}: " if self.step is not None else ""
        if self.event is None and self.loss is not None and self.loss.replaced:
            return f"{at}rank {self.ranks}{where}{how}; replaced, with no recovery event in metrics.jsonl (the run ended first)"
        if self.event is None:
            return f"{at}rank {self.ranks}{where}{how}; not recovered: no replacement left (launch.max_restarts)"
        e = self.event
        if "resumed_from_step" in e:
            return (
                f"{at}a worker was lost; every worker restarted from the checkpoint of step {e['resumed_from_step']} "
                f"in {e['restart_s']:.1f} s (from the last logged step to the checkpoint loaded); "
                f"steps lost: {e['steps_lost']} (logged, trained again)"
            )
        return (
            f"{at}rank {self.ranks}{where}{how}; recovered by a peer copy from rank {e['recovered_from']}'s memory "
            f"in {e['recovery_s']:.1f} s; steps lost: {e['steps_lost']}"
        )


def run_recoveries(rows: list[dict[str, Any]], run_dir: Path) -> list[Recovery]:
    """The run's losses and recoveries in time order: each event matched to the keeper's record of
    the same rank nearest its lost_at; records with no event last among their time."""
    losses = read_losses(run_dir)
    found, used = [], set()
    for row in rows:
        if all(key in row for key in RESTART_KEYS):  # in the step it was lost in, as logged
            found.append((row.get("time", 0.0), Recovery(row["step"] + row["steps_lost"] + 1, "", None, row)))
        if not all(key in row for key in PEER_KEYS):
            continue
        ranks = {int(r) for r in row["recovered_ranks"].split(",") if r.strip().isdigit()}
        near = [
            (abs(loss.at - row.get("lost_at", 0.0)), index)
            for index, loss in enumerate(losses)
            if loss.rank in ranks and index not in used
        ]
        index = min(near)[1] if near and min(near)[0] <= MATCH_S else None
        used.add(index)
        loss = losses[index] if index is not None else None
        found.append((row.get("lost_at", 0.0), Recovery(row["step"] + 1, row["recovered_ranks"], loss, row)))
    found += [(loss.at, Recovery(None, str(loss.rank), loss, None)) for i, loss in enumerate(losses) if i not in used]
    return [recovery for _, recovery in sorted(found, key=lambda pair: pair[0])]


def format_recoveries(named: list[tuple[str, list[Recovery]]]) -> str:
    """The report's lines for the runs that lost a worker ('' when none did)."""
    lines = [f"  {name} {recovery.line()}" for name, recoveries in named for recovery in recoveries]
    return "recoveries (a worker lost, and how the run went on):\n" + "\n".join(lines) if lines else ""
