"""What this worker is doing now: the step, the phase and its detail, and when it got there. The
training loop, the data-parallel seam and the pipeline stages mark each phase they enter; the hang
watchdog (launcher/hang.py) reads the mark. A mark is three attribute writes and a clock read: no
lock, no collective, no host sync. A leaf module: every layer may mark without depending on another.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, replace


@dataclass
class Progress:
    step: int = 0  # the optimizer step in progress (1-based); 0: not training yet
    phase: str = "start"  # data, forward, backward, optimizer, eval, checkpoint, ...
    detail: str = ""  # e.g. "stage 1 microbatch 3", or the collective it ends in
    at: float = 0.0  # time.monotonic() of the mark
    first_step: int = 0  # the step this worker began training at (it warms up there)
    waiting: bool = False  # between its own actions, waiting for another rank's output (a pipeline's input)


_now = Progress(at=time.monotonic())

# What a worker does before step 1, in order (phase "init"): a rank at an earlier stage is behind.
INIT_STAGES = (
    "joining the process group",
    "the first collective: every node's data prepared",
    "building the model and initialising its weights",
    "the model's first collectives: its weights placed and synchronised",
    "loading checkpoint",
)


def mark(phase: str, detail: str = "", *, step: int | None = None, waiting: bool = False) -> None:
    """This worker entered `phase` (of `step`, when a new step begins); `waiting`: it now waits for
    another rank's output, not in work of its own (the hang summary blames the ranks that work)."""
    if step is not None:
        _now.step = step
        _now.first_step = _now.first_step or step
    _now.phase, _now.detail, _now.waiting, _now.at = phase, detail, waiting, time.monotonic()


def current() -> Progress:
    """A copy of the latest mark."""
    return replace(_now)


def mark_init(stage: str, more: str = "") -> None:
    """This worker reached `stage` of INIT_STAGES (before step 1); `more`: e.g. the checkpoint's path."""
    if stage not in INIT_STAGES:
        raise ValueError(f"{stage!r} is not one of progress.INIT_STAGES")
    mark("init", f"{stage}{more}")
