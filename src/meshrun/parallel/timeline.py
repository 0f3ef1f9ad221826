"""Pipeline timelines read from profiler records: when each stage ran which microbatch's F and B.

`pipeline.MarkedStage` names every action it computes with a `torch.profiler.record_function` mark
(`meshrun.pp:0F3` = stage 0, forward, microbatch 3), and the pipeline names the whole step
(`meshrun.pp:step`). The marks cost nothing unless a profiler is running; a profiled step's
marks are both in its Chrome trace and, read back by `step_timeline`, the timeline picture.

Why our own marks and not the schedules': in torch 2.13, Schedule1F1B marks nothing, and the
marks of ScheduleGPipe and of the runtime schedules (`PP:0F3`) include the wait for the
neighbour's activations, which is exactly the bubble to be measured. Busy time is the sum of
the marked computations; the rest of the step's wall time is the bubble.
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

    @property
    def bubble(self) -> float:
        busy = sum(a.end - a.start for a in self.actions)
        return max(0.0, 1.0 - busy / self.wall) if self.wall else 0.0


def step_timeline(events: list[tuple[str, float, float, bool]]) -> StepTimeline:
    """The timeline in profiler events given as (name, start_us, end_us, on_device).

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
    return StepTimeline(sorted(actions, key=lambda a: a.start), (end_of_step - origin) / 1e6)
