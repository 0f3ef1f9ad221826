"""Profiled steps: torch.profiler traces (`profile.steps` x `profile.ranks`) and CUDA memory
snapshots; and the pipeline timeline of measured steps (parallel/timeline.py's own stamps, no
profiler: it would slow the step it measures).

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
from torch.autograd.profiler import profile

from meshrun.config.schema import ProfileConfig
from meshrun.files.atomic import atomic_target
from meshrun.metrics.report import say
from meshrun.parallel import timeline


class StepProfiler:
    """Decides, per step, whether to run the profiler (this rank traces it: written to
    RUN_DIR/profile/) and whether to measure the pipeline timeline (every rank measures the same
    steps)."""

    def __init__(self, cfg: ProfileConfig, *, run_dir: Path, rank: int, device: torch.device) -> None:
        self.steps = set(cfg.steps) if cfg.ranks is None or rank in cfg.ranks else set()
        self.snapshot = cfg.memory_snapshot and device.type == "cuda"
        if cfg.memory_snapshot and not self.snapshot and rank == 0:
            say(f"profile.memory_snapshot: snapshots are of CUDA memory; none on {device.type}")
        self.folder, self.rank, self.device = run_dir / "profile", rank, device

    @contextlib.contextmanager
    def step(self, done: int, *, measure: bool) -> Iterator[None]:
        """Around optimizer step `done` (1-based); `measure`: keep its pipeline timeline."""
        with timeline.measuring(self.device) if measure else contextlib.nullcontext():
            if done not in self.steps:
                yield
                return
            self.folder.mkdir(parents=True, exist_ok=True)
            # Kineto prints two "USDT: profiler_start/stop" lines per profiled step unless its log
            # level is above all its levels (read when the profiler first starts; a user's wins).
            os.environ.setdefault("KINETO_LOG_LEVEL", "6")
            prof = profile(use_kineto=True, use_device="cuda" if self.device.type == "cuda" else None)
            with prof:
                if self.snapshot:
                    _record_memory_history(True)
                yield
                if self.snapshot:
                    _dump_memory_snapshot(self.folder / f"step{done}-rank{self.rank}-memory.pickle")
                    _record_memory_history(False)
            with atomic_target(self.folder / f"step{done}-rank{self.rank}.json") as tmp:
                prof.export_chrome_trace(str(tmp))


def _record_memory_history(enabled: bool) -> None:
    """Start / stop recording CUDA allocations. torch has no public API for snapshots yet: the
    documented `torch.cuda.memory._record_memory_history` is the one private call, kept here."""
    torch.cuda.memory._record_memory_history("all" if enabled else None, max_entries=100_000)


def _dump_memory_snapshot(path: Path) -> None:
    """A pickle for https://pytorch.org/memory_viz (documented, but private, like the above)."""
    with atomic_target(path) as tmp:
        torch.cuda.memory._dump_snapshot(str(tmp))
