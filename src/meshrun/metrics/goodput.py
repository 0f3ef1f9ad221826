"""Goodput under failures (issue 46): the share of wall time spent on training that is kept, over a
run whose workers fail every `every_s` seconds, for peer recovery and for a checkpoint restart,
from terms measured in two real runs' records (metrics.jsonl: each row's wall `time` and step time,
the checkpoints' save times, the recovery events).

Per failure, a run loses the recovery itself (from the loss to training again: peer copy or a
restart of every worker and a checkpoint load, with the first step's warm-up) and the work it
does again: under peer recovery what was in flight (half a step, or half a save, on average,
weighted by their shares of the time: a save interrupted counts as done again, which today's peer
recovery does not do, see docs/guides/peer-recovery.md), under a checkpoint restart everything since
the last checkpoint was saved (half a checkpoint period on average: the period is `interval` steps
and one save). Both runs save a checkpoint every `interval` steps, so the saves cost both the same
share. With one failure every `every_s` seconds, P the period:

    goodput = max(0, 1 - (recovery_s + lost_s) / every_s) * interval * step_s / P
    lost_s  = (interval * step_s**2 + save_s**2) / (2 P)   (peer)   or   P / 2   (checkpoint restart)

tests/launcher/test_recovery_report.py checks it against a step-by-step simulation of such a run.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Measured:
    """The measured terms: a step, a checkpoint save, every `interval` steps, and one recovery of
    each kind (seconds from the loss to training again, the work trained again not included)."""

    step_s: float
    save_s: float
    interval: int
    peer_s: float
    restart_s: float

    def period_s(self) -> float:
        """Training between two checkpoints, and the save."""
        return self.interval * self.step_s + self.save_s

    def goodput(self, every_s: float, *, peer: bool) -> float:
        """The share of wall time kept as training, one failure every `every_s` seconds."""
        period = self.period_s()
        in_flight = (self.interval * self.step_s**2 + self.save_s**2) / (2 * period)
        recovery, lost = (self.peer_s, in_flight) if peer else (self.restart_s, period / 2)
        return max(0.0, 1 - (recovery + lost) / every_s) * self.interval * self.step_s / period


def step_s(rows: list[dict[str, Any]]) -> float:
    """A step's time: the median of the logged steps (the recovered ones among them do not move it)."""
    return statistics.median(row["step_time_s"] for row in rows if "loss" in row)


def save_s(rows: list[dict[str, Any]]) -> float:
    """A checkpoint save's time: the median of the saves the run logged."""
    return statistics.median(row["checkpoint_s"] for row in rows if "checkpoint_s" in row and "loss" not in row)


def peer_recovery_s(rows: list[dict[str, Any]]) -> float:
    """The first peer recovery's cost: the wall time between the logged step before it and the one
    trained again after it, less one step (log_interval 1: every step has its row and time)."""
    event = next(row for row in rows if "recovered_ranks" in row)
    return _gap(rows, event["step"], event["step"] + 1) - step_s(rows)


def checkpoint_restart_s(rows: list[dict[str, Any]]) -> float:
    """The first checkpoint restart's cost: from the last logged step to the checkpoint loaded (the
    event's restart_s), then to the first step trained after it, less one step."""
    event = next(row for row in rows if "resumed_from_step" in row)
    first = next(
        row for row in rows if "loss" in row and row["step"] == event["step"] + 1 and row["time"] > event["time"]
    )
    return event["restart_s"] + first["time"] - event["time"] - step_s(rows)


def _gap(rows: list[dict[str, Any]], before: int, after: int) -> float:
    times = {row["step"]: row["time"] for row in rows if "loss" in row}
    return times[after] - times[before]


def measured(peer_rows: list[dict[str, Any]], restart_rows: list[dict[str, Any]], *, interval: int) -> Measured:
    """The terms from a peer-recovered run's rows and a checkpoint-restarted run's (the same job;
    the step and save times are the restarted run's, whose checkpoints are every `interval` steps)."""
    return Measured(
        step_s=step_s(restart_rows),
        save_s=save_s(restart_rows),
        interval=interval,
        peer_s=peer_recovery_s(peer_rows),
        restart_s=checkpoint_restart_s(restart_rows),
    )
