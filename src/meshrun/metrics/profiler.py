"""Profiled steps: torch.profiler traces (`profile.steps` x `profile.ranks`), CUDA memory
snapshots, and the pipeline timeline of measured steps, all from one profiler per step.

`torch.autograd.profiler.profile` (the engine beneath `torch.profiler.profile`) is used
directly: `torch.profiler.profile` first imports torch._inductor, which took 6-16 s per
process on a loaded 2-core machine, for nothing we use.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path

import torch
import torch.distributed as dist
from torch.autograd.profiler import profile
from torch.profiler import DeviceType

from meshrun.config.schema import ProfileConfig
from meshrun.files.atomic import atomic_target
from meshrun.metrics.report import say
from meshrun.parallel.layout import Layout
from meshrun.parallel.timeline import MARK_PREFIX, StepTimeline, on_one_clock, step_timeline


class StepProfiler:
    """Decides, per step, whether to run the profiler, and keeps what it recorded.

    A step is profiled when this rank traces it (written to RUN_DIR/profile/) or when the
    pipeline timeline is measured (every rank measures the same steps).
    """

    def __init__(self, cfg: ProfileConfig, *, run_dir: Path, rank: int, device: torch.device) -> None:
        self.steps = set(cfg.steps) if cfg.ranks is None or rank in cfg.ranks else set()
        self.snapshot = cfg.memory_snapshot and device.type == "cuda"
        if cfg.memory_snapshot and not self.snapshot and rank == 0:
            say(f"profile.memory_snapshot: snapshots are of CUDA memory; none on {device.type}")
        self.folder, self.rank, self.device = run_dir / "profile", rank, device
        self.timeline = StepTimeline()  # of the last measured step
        self._recorded: profile | None = None  # the last measured step's profiler, read on demand

    @contextlib.contextmanager
    def step(self, done: int, *, measure: bool) -> Iterator[None]:
        """Around optimizer step `done` (1-based); `measure`: keep its pipeline timeline."""
        trace = done in self.steps
        if not (trace or measure):
            yield
            return
        self.folder.mkdir(parents=True, exist_ok=True)
        # Kineto prints two "USDT: profiler_start/stop" lines per profiled step unless its log
        # level is above all its levels (read when the profiler first starts; a user's wins).
        os.environ.setdefault("KINETO_LOG_LEVEL", "6")
        snapshot = trace and self.snapshot
        prof = profile(use_kineto=True, use_device="cuda" if self.device.type == "cuda" else None)
        with prof:
            if snapshot:
                _record_memory_history(True)
            yield
            if snapshot:
                _dump_memory_snapshot(self.folder / f"step{done}-rank{self.rank}-memory.pickle")
                _record_memory_history(False)
        if trace:
            with atomic_target(self.folder / f"step{done}-rank{self.rank}.json") as tmp:
                prof.export_chrome_trace(str(tmp))
        if measure:
            self._recorded = prof

    def measured(self) -> StepTimeline:
        """The timeline of the last measured step, read from its profiler records (once, after
        the trainer has timed its window)."""
        if self._recorded is not None:
            spans, origin_ns = mark_spans(self._recorded), _first_mark_ns(self._recorded)
            self.timeline, self._recorded = step_timeline(spans, origin_ns=origin_ns), None
        return self.timeline


def gather_timelines(profiler: StepProfiler, layout: Layout) -> tuple[float, dict[int, StepTimeline]]:
    """Every rank's last measured step (a collective: every rank calls it): the mean bubble
    fraction and each pipeline stage's timeline on one clock."""
    timelines: list = [None] * dist.get_world_size()
    dist.all_gather_object(timelines, profiler.measured())
    bubble = sum(t.bubble for t in timelines) / len(timelines)
    return bubble, on_one_clock({s: timelines[layout.rank_at(pp=s)] for s in range(layout.pp)})


def mark_spans(prof: profile) -> list[tuple[str, float, float, bool]]:
    """(name, start_us, end_us, on_device) of the meshrun marks a finished profiler recorded,
    timed from the first mark.

    Read from the raw records (`kineto_results`, set by the public `profile` on exit) rather than
    `function_events`, which first builds an event tree of every op: ~1 s per pipeline step on 2
    CPU cores, for the few dozen marks used here. A torch upgrade that renames these record
    accessors fails tests/metrics/test_observability.py::test_mark_spans_read_the_profilers_own_events.
    """
    marks = _marks(prof)
    origin = min((event.start_ns() for event in marks), default=0)  # integer ns: floats of epoch us lose 0.25 us
    return [
        (
            event.name(),
            (event.start_ns() - origin) / 1e3,
            (event.start_ns() - origin + event.duration_ns()) / 1e3,
            event.device_type() != DeviceType.CPU,
        )
        for event in marks
    ]


def _marks(prof: profile) -> list:
    """The raw profiler records of the meshrun marks (none when the profiler recorded nothing)."""
    if prof.kineto_results is None:
        return []
    return [event for event in prof.kineto_results.events() if event.name().startswith(MARK_PREFIX)]


def _first_mark_ns(prof: profile) -> int:
    """When the first mark began, in ns on the profiler's clock (the epoch: one clock per machine)."""
    return min((event.start_ns() for event in _marks(prof)), default=0)


def _record_memory_history(enabled: bool) -> None:
    """Start / stop recording CUDA allocations. torch has no public API for snapshots yet: the
    documented `torch.cuda.memory._record_memory_history` is the one private call, kept here."""
    torch.cuda.memory._record_memory_history("all" if enabled else None, max_entries=100_000)


def _dump_memory_snapshot(path: Path) -> None:
    """A pickle for https://pytorch.org/memory_viz (documented, but private, like the above)."""
    with atomic_target(path) as tmp:
        torch.cuda.memory._dump_snapshot(str(tmp))
