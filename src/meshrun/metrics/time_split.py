"""Where a rank's time goes, per log window: data, compute, waiting on others, optimizer, validation,
checkpoint and the bookkeeping between them, which together make the window's wall time.

The trainer marks its phases (`phase`); inside forward+backward the model marks its own computation
(`section("compute")`: a microbatch's forward and backward, or a pipeline stage's action), and the
rest of that phase counts as waiting: pipeline receives and sends, and the data-parallel gradient
all-reduce after this rank's last gradient was ready (`gradients_ready`, from DDP's comm hook).
Inside a compute section FSDP's all-gathers and reduce-scatters are carved out as waiting again
(`collective_starts` / `collective_ends`, from hooks around FSDP's own: parallel/fsdp.py). Tensor
parallelism's collectives still count as compute: DTensor runs them inside its ops (a functional
collective is waited for at the first use of its result), where no public hook reaches.

Off the hot path: a mark is a clock read and a list append. On CPU the clock is the host's; on
CUDA a timing event on the current stream (the device's own time, no host sync), read when the
window closes at a log step, after the trainer has synchronised anyway.

A leaf, like launcher/progress.py: every layer may mark without depending on another. One split per
process, started by the trainer; before `start` every mark is a no-op.
"""

from __future__ import annotations

import contextlib
import math
import statistics
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Protocol

import torch

PARTS = ("data", "compute", "wait", "optimizer", "eval", "checkpoint", "other")
PHASES = {  # a trainer phase -> what its time counts as, outside sections
    "data": "data",
    "forward_backward": "wait",  # the model's compute sections carve out the compute
    "optimizer": "optimizer",
    "eval": "eval",
    "checkpoint": "checkpoint",
    "other": "other",  # the progress bar, the log line; the stop-request poll and log gather wait in sections
}

STEP_PHASES = ("forward_backward", "optimizer", "other")  # sections count there; inside eval, all is eval time
Stamp = float | torch.cuda.Event


class TimeSplit:
    """Contiguous stretches of one rank's time, each counted as one of PARTS."""

    def __init__(self, device: torch.device, *, at: float) -> None:
        self.cuda = device.type == "cuda"
        self.kind, self.phase_name = "other", "other"
        self.since: Stamp = self._stamp(at)
        self.stretches: list[tuple[str, Stamp, Stamp]] = []
        self.ready: Stamp | None = None  # this rank's last gradient bucket, inside the open section
        self.in_section = False
        self.in_collective = False  # a collective inside the open section: waiting until it ends

    def _stamp(self, at: float | None = None) -> Stamp:
        return at if at is not None and not self.cuda else stamp(cuda=self.cuda)

    def _switch(self, kind: str, until: Stamp) -> None:
        self.stretches.append((self.kind, self.since, until))
        self.kind, self.since = kind, until

    def phase(self, name: str) -> None:
        self.phase_name = name
        self._switch(PHASES[name], self._stamp())

    @contextlib.contextmanager
    def section(self, kind: str) -> Iterator[None]:
        if self.phase_name not in STEP_PHASES:
            yield
            return
        outer = self.kind
        self._switch(kind, self._stamp())
        self.in_section, self.ready, self.in_collective = True, None, False
        try:
            yield
        finally:
            self.in_section = self.in_collective = False
            # what follows this rank's last gradient is the all-reduce: the outer phase's (waiting)
            self._switch(outer, self.ready if self.ready is not None else self._stamp())

    def gradients_ready(self) -> None:
        if self.in_section:
            self.ready = self._stamp()

    def collective_starts(self) -> None:
        if self.in_section and self.kind == "compute":
            self._switch("wait", self._stamp())
            self.in_collective = True

    def collective_ends(self) -> None:
        if self.in_collective:
            self._switch("compute", self._stamp())
            self.in_collective = False

    def close(self, *, at: float) -> dict[str, float]:
        """Seconds per part since the last close (or start), up to `at` (perf_counter, taken after a
        device sync); the next window starts there."""
        self._switch(self.kind, self._stamp(at))
        seconds: dict[str, float] = dict.fromkeys(PARTS, 0.0)
        for kind, start, end in self.stretches:
            seconds[kind] += elapsed(start, end)
        self.stretches = []
        return seconds


def stamp(*, cuda: bool) -> Stamp:
    """Now: the host's clock, or on CUDA a timing event on the current stream (no host sync)."""
    if not cuda:
        return time.perf_counter()
    event = torch.cuda.Event(enable_timing=True)
    event.record()
    return event


def elapsed(start: Stamp, end: Stamp) -> float:
    """Seconds between two stamps (CUDA events: once both have run, e.g. after a sync)."""
    if isinstance(start, float) and isinstance(end, float):
        return end - start
    assert isinstance(start, torch.cuda.Event) and isinstance(end, torch.cuda.Event)
    return start.elapsed_time(end) / 1e3


_split: TimeSplit | None = None


def start(device: torch.device, *, at: float) -> None:
    """This process's split starts at `at` (time.perf_counter(), after a device sync)."""
    global _split
    _split = TimeSplit(device, at=at)


def phase(name: str) -> None:
    """This rank entered trainer phase `name` (a key of PHASES)."""
    if _split is not None:
        _split.phase(name)


def section(kind: str) -> contextlib.AbstractContextManager[None]:
    """Time inside counts as `kind` (one of PARTS) within a training step's phases (STEP_PHASES);
    within validation and checkpoints all time is theirs."""
    return _split.section(kind) if _split is not None else contextlib.nullcontext()


def gradients_ready() -> None:
    """A gradient bucket of this rank is complete (DDP's comm hook): its own backward got this far."""
    if _split is not None:
        _split.gradients_ready()


def collective_starts() -> None:
    """A collective inside a compute section begins: waiting, until `collective_ends` (a repeated start
    is one wait; outside a compute section both do nothing)."""
    if _split is not None:
        _split.collective_starts()


def collective_ends() -> None:
    """The collective `collective_starts` marked is over: compute again (no-op when none is open)."""
    if _split is not None:
        _split.collective_ends()


def close(*, at: float) -> dict[str, float]:
    """Seconds per part of the window ending `at` ({} before `start`)."""
    return _split.close(at=at) if _split is not None else {}


def split_row(per_rank: list[list[float]], *, wall_s: float) -> dict[str, float]:
    """A log row's time split: the window's wall seconds, each rank's seconds per part (they sum to
    it), and each rank's device utilisation (percent) where its backend reports one (NaN: none).
    `per_rank`: every rank's [seconds of each of PARTS..., utilisation], as gathered."""
    row = {"time/wall_s": wall_s}
    for rank, figures in enumerate(per_rank):
        row.update({f"time/rank{rank}/{part}_s": seconds for part, seconds in zip(PARTS, figures)})
        if not math.isnan(figures[len(PARTS)]):
            row[f"device_util/rank{rank}"] = figures[len(PARTS)]
    return row


@dataclass(frozen=True)
class Slowest:
    rank: int
    ratio: float  # its compute seconds / the median rank's


def slowest(compute_s: list[float]) -> Slowest:
    """The rank with the most compute time (its own work, waits excluded) against the median."""
    rank = max(range(len(compute_s)), key=compute_s.__getitem__)
    median = statistics.median(compute_s)
    return Slowest(rank, compute_s[rank] / median if median > 0 else 1.0)


class RankPlaces(Protocol):
    """What the straggler row asks of the layout (parallel.layout.Layout): a leaf imports no layer."""

    def place(self, rank: int) -> dict[str, int]: ...

    def rank_text(self, rank: int) -> str: ...


class Stragglers:
    """A rank slower than `ratio` x the median in `windows` log windows in a row is named once."""

    def __init__(self, *, ratio: float, windows: int) -> None:
        self.ratio, self.windows = ratio, windows
        self.streak: tuple[int, int] = (-1, 0)  # (rank, consecutive slow windows)
        self.named: set[int] = set()
        self.excused = False

    def excuse(self) -> None:
        """The current window holds a peer recovery (training/recovery.py): some ranks trained its
        step twice, a replacement once, after a wait of its own; judge no rank on it."""
        self.excused = True

    def persistent(self, slow: Slowest) -> bool:
        """True once per rank: at the window that makes its streak of slow windows long enough."""
        if slow.ratio < self.ratio:
            self.streak = (-1, 0)
            return False
        rank, count = self.streak
        self.streak = (slow.rank, count + 1 if rank == slow.rank else 1)
        if self.streak[1] >= self.windows and slow.rank not in self.named:
            self.named.add(slow.rank)
            return True
        return False

    def row(self, per_rank: list[list[float]], *, layout: RankPlaces) -> tuple[dict[str, float], str | None]:
        """The slowest rank of a window (`per_rank` as in split_row) with its place in `layout`, and
        the warning line naming it when it has been slow long enough."""
        slow = slowest([figures[PARTS.index("compute")] for figures in per_rank])
        place = layout.place(slow.rank)
        row: dict[str, float] = {"straggler/rank": slow.rank, **{f"straggler/{a}": c for a, c in place.items()}}
        row["straggler/ratio"] = slow.ratio
        if self.excused:
            self.excused, self.streak = False, (-1, 0)
            return row, None
        if not self.persistent(slow):
            return row, None
        return row, (
            f"warning: {layout.rank_text(slow.rank)} is a straggler: its compute took "
            f"{slow.ratio:.2f}x the median rank's in {self.windows} log windows in a row (metrics.straggler_ratio "
            f"{self.ratio:g}); the others wait for it (a slower device or host, or more work: an uneven pipeline split)"
        )
