"""Measured pipeline timelines: when each stage ran which microbatch's forward and backward.

The timer wraps the public action methods of this rank's PipelineStage objects. Only steps
marked for measurement are timed (on CUDA each timed action is bracketed by a synchronise,
which is why it is not on for every step). Busy time is the sum of action durations; the
rest of the step's wall time is the bubble (waiting for neighbours, including transfers).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

# PipelineStage method -> action letter (I = input-grad half of a split backward, W = weight half)
_ACTIONS = {"forward_one_chunk": "F", "backward_one_chunk": "B", "backward_weight_one_chunk": "W"}


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


class ActionTimer:
    def __init__(self, stages: list, device: torch.device) -> None:
        self.device, self.enabled = device, False
        self.current = StepTimeline()
        self.origin = 0.0
        for stage in stages:
            for name, kind in _ACTIONS.items():
                if hasattr(stage, name):
                    setattr(stage, name, self._timed(getattr(stage, name), stage.stage_index, kind))

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def _timed(self, action: Callable, stage: int, kind: str) -> Callable:
        def run(microbatch: int, *args, **kwargs):
            if not self.enabled:
                return action(microbatch, *args, **kwargs)
            self._sync()
            start = time.perf_counter() - self.origin
            out = action(microbatch, *args, **kwargs)
            self._sync()
            split = kind == "B" and kwargs.get("full_backward", True) is False
            self.current.actions.append(Action(stage, "I" if split else kind, microbatch, start, time.perf_counter() - self.origin))
            return out

        return run

    def begin(self, enabled: bool) -> None:
        self.enabled = enabled
        if enabled:
            self._sync()
            self.current, self.origin = StepTimeline(), time.perf_counter()

    def end(self) -> None:
        if self.enabled:
            self._sync()
            self.current.wall = time.perf_counter() - self.origin
            self.enabled = False
