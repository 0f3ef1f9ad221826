"""Pipeline timelines read from profiler records: when each stage ran which microbatch's F and B.

`pipeline.MarkedStage` names every action it computes with a `torch.profiler.record_function` mark
(`meshrun.pp:0F3` = stage 0, forward, microbatch 3), and the pipeline names the whole step
(`meshrun.pp:step`). The marks cost nothing unless a profiler is running; a profiled step's
marks are both in its Chrome trace and, read back by `step_timeline`, the timeline picture.

Why our own marks and not the schedules': in torch 2.13, Schedule1F1B marks nothing, and the
marks of ScheduleGPipe and of the runtime schedules (`PP:0F3`) include the wait for the
neighbour's activations, which is exactly the bubble to be measured. Busy time is the sum of
the marked computations; the rest of the step's wall time is the bubble.

Each rank times its step from its own start; `on_one_clock` puts the ranks' timelines on one
clock for the picture (the profiler's clock is the epoch, shared by the processes of a machine),
and where machines' clocks disagree, no stage is drawn starting a microbatch's forward before the
previous stage finished computing it.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

MARK_PREFIX = "meshrun.pp:"
STEP_MARK = f"{MARK_PREFIX}step"
_ACTION_MARK = re.compile(rf"^{re.escape(MARK_PREFIX)}(\d+)([FBIW])(\d+)$")


def action_mark(stage: int, kind: str, microbatch: int) -> str:
    """The profiler name of one action (kind: F, B, I = input half of a split backward, W = weight half)."""
    return f"{MARK_PREFIX}{stage}{kind}{microbatch}"


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
    epoch_ns: int = 0  # when the step began on the profiler's clock (ns since the epoch)
    offset: float = 0.0  # seconds after the earliest rank's step began (set by `on_one_clock`)

    @property
    def bubble(self) -> float:
        busy = sum(a.end - a.start for a in self.actions)
        return max(0.0, 1.0 - busy / self.wall) if self.wall else 0.0


def step_timeline(events: list[tuple[str, float, float, bool]], *, origin_ns: int = 0) -> StepTimeline:
    """The timeline in profiler events given as (name, start_us, end_us, on_device), timed from
    `origin_ns` on the profiler's clock.

    Spans are the device's where the profiler recorded one (on CUDA a mark's kernels run after
    their launch: the host's span would time the launches), else the host's (CPU).
    """
    by_device = sorted(events, key=lambda e: e[3])  # device spans come last and win
    steps = [(start, end) for name, start, end, _ in by_device if name == STEP_MARK]
    if not steps:
        return StepTimeline()
    origin, end_of_step = steps[-1]
    spans: dict[tuple[int, str, int], tuple[float, float]] = {}
    for name, start, end, _ in by_device:
        if (match := _ACTION_MARK.match(name)) and origin <= start <= end_of_step:
            spans[(int(match[1]), match[2], int(match[3]))] = (start, end)
    actions = [
        Action(stage, kind, microbatch, (start - origin) / 1e6, (end - origin) / 1e6)
        for (stage, kind, microbatch), (start, end) in spans.items()
    ]
    epoch_ns = origin_ns + round(origin * 1e3)
    return StepTimeline(sorted(actions, key=lambda a: a.start), (end_of_step - origin) / 1e6, epoch_ns)


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
