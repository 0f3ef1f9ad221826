"""Pipeline timelines: when each stage ran which microbatch's F and B, on measured steps.

`pipeline.MarkedStage` runs every action it computes inside `action(stage, kind, microbatch)`,
and the pipeline the whole step inside `step()`. On a step being measured (`measuring`: the
trainer's logged steps under pp) each records a start and an end stamp: a clock read on the CPU,
a CUDA timing event on the current stream on a GPU (the device's own time, read after the
trainer's sync at the log step: no host sync per action). Unmeasured steps record nothing. Both
are also `record_function` marks (`meshrun.pp:0F3` = stage 0, forward, microbatch 3;
`meshrun.pp:step`), so a profiled step's Chrome trace names them.

Why not torch's profiler for the timeline: it records every op, which made a logged pipeline step
of a small model take about twice an unlogged one (and so the logged step times wrong). Why our
own marks and not the schedules': in torch 2.13, Schedule1F1B marks nothing, and the marks of
ScheduleGPipe and of the runtime schedules (`PP:0F3`) include the wait for the neighbour's
activations, which is exactly the bubble to be measured. Busy time is the sum of the marked
computations; the rest of the step's wall time is the bubble.

Each rank times its step from its own start; `on_one_clock` puts the ranks' timelines on one
clock for the picture (each step's start is also read on the epoch clock, shared by the
processes of a machine), and where machines' clocks disagree, no stage is drawn starting a
microbatch's forward before the previous stage finished computing it.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch.autograd.profiler import record_function

from meshrun.metrics.time_split import Stamp, elapsed, stamp
from meshrun.parallel.layout import Layout

MARK_PREFIX = "meshrun.pp:"
STEP_MARK = f"{MARK_PREFIX}step"


@dataclass
class Action:
    stage: int
    kind: str  # F, B, I or W
    microbatch: int
    start: float  # seconds from the step's start
    end: float


@dataclass
class StepTimeline:
    """One rank's measured step."""

    actions: list[Action] = field(default_factory=list)
    wall: float = 0.0
    epoch_ns: int = 0  # when the step began on the epoch clock (ns)
    offset: float = 0.0  # seconds after the earliest rank's step began (set by `on_one_clock`)

    @property
    def bubble(self) -> float:
        busy = sum(a.end - a.start for a in self.actions)
        return max(0.0, 1.0 - busy / self.wall) if self.wall else 0.0


class _Recorder:
    """The stamps of the step being measured (one per process, like time_split's)."""

    def __init__(self) -> None:
        self.cuda: bool | None = None  # None: not measuring
        self.step: tuple[Stamp, Stamp, int] | None = None  # start, end, start on the epoch clock (ns)
        self.actions: list[tuple[tuple[int, str, int], Stamp, Stamp]] = []
        self.timeline = StepTimeline()  # the last measured step, once read

    def stamp(self) -> Stamp:
        return stamp(cuda=bool(self.cuda))


_RECORDER = _Recorder()


@contextlib.contextmanager
def measuring(device: torch.device) -> Iterator[None]:
    """Record the timeline of the step run inside (every rank of the pipeline measures the same steps)."""
    _RECORDER.cuda, _RECORDER.step, _RECORDER.actions = device.type == "cuda", None, []
    try:
        yield
    finally:
        _RECORDER.cuda = None


@contextlib.contextmanager
def step() -> Iterator[None]:
    """Around a pipeline step: its span, when measured."""
    with record_function(STEP_MARK):
        if _RECORDER.cuda is None:
            yield
            return
        start, epoch_ns = _RECORDER.stamp(), time.time_ns()
        yield
        _RECORDER.step = (start, _RECORDER.stamp(), epoch_ns)


@contextlib.contextmanager
def action(stage: int, kind: str, microbatch: int) -> Iterator[None]:
    """Around one stage action (kind: F, B, I = input half of a split backward, W = weight half)."""
    with record_function(f"{MARK_PREFIX}{stage}{kind}{microbatch}"):
        if _RECORDER.cuda is None:
            yield
            return
        start = _RECORDER.stamp()
        yield
        _RECORDER.actions.append(((stage, kind, microbatch), start, _RECORDER.stamp()))


def last_measured() -> StepTimeline:
    """The timeline of the last measured step, read once after it (on CUDA, after a sync)."""
    if _RECORDER.step is not None:
        origin, end, epoch_ns = _RECORDER.step
        actions = [
            Action(*key, elapsed(origin, start), elapsed(origin, stop)) for key, start, stop in _RECORDER.actions
        ]
        wall = elapsed(origin, end)
        _RECORDER.timeline = StepTimeline(sorted(actions, key=lambda a: a.start), wall, epoch_ns)
        _RECORDER.step, _RECORDER.actions = None, []
    return _RECORDER.timeline


def gather_timelines(layout: Layout) -> tuple[float, dict[int, StepTimeline]]:
    """Every rank's last measured step (a collective: every rank calls it): the mean bubble
    fraction and each pipeline stage's timeline on one clock. A rank that measured none (a
    replacement that joined after the step, launch.recovery peer) is left out: a replica of its
    stage measured it."""
    gathered: list = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, last_measured())
    timelines = {rank: t for rank, t in enumerate(gathered) if t.wall} or dict(enumerate(gathered))
    bubble = sum(t.bubble for t in timelines.values()) / len(timelines)
    by_stage = {s: next(timelines[r] for r in layout.ranks_of_pp_rank(s) if r in timelines) for s in range(layout.pp)}
    return bubble, on_one_clock(by_stage)


def on_one_clock(by_rank: dict[int, StepTimeline]) -> dict[int, StepTimeline]:
    """Pipeline rank -> its timeline shifted onto the earliest rank's clock (`offset`, and every
    action's times, grow by the difference of their starts). Then each rank is moved later where
    it would start a microbatch's forward before the previous stage (on the rank before) ended it:
    clocks of different machines can disagree by more than a stage's compute."""
    earliest = min(t.epoch_ns for t in by_rank.values())
    aligned: dict[int, StepTimeline] = {}
    for rank in sorted(by_rank):
        timeline = by_rank[rank]
        offset = (timeline.epoch_ns - earliest) / 1e9
        if rank - 1 in aligned:
            ended = {(a.stage, a.microbatch): a.end for a in aligned[rank - 1].actions if a.kind == "F"}
            late = [
                ended[(a.stage - 1, a.microbatch)] - (a.start + offset)
                for a in timeline.actions
                if a.kind == "F" and (a.stage - 1, a.microbatch) in ended
            ]
            offset += max([0.0, *late])
        actions = [Action(a.stage, a.kind, a.microbatch, a.start + offset, a.end + offset) for a in timeline.actions]
        aligned[rank] = StepTimeline(actions, timeline.wall, timeline.epoch_ns, offset)
    return aligned
