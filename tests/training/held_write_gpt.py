"""A GPT whose checkpoint write of one step is held on cue: a background write caught in flight
without racing it. Used through `model.factory: held_write_gpt:build`; numerics as the plain GPT.

MESHRUN_TEST_HOLD=DIR:PATTERN: when DCP has written this rank's shards of a checkpoint whose folder
matches PATTERN (`step-00000004`, `step-*`), the write creates DIR/held-RANK and waits (before
DCP's closing collective) until DIR/release exists. Without the variable nothing is held.
"""

from __future__ import annotations

import fnmatch
import os
import time
from pathlib import Path

from torch.distributed.checkpoint import SavePlan, SavePlanner, filesystem
from torch.futures import Future

from meshrun.config.schema import ModelConfig
from meshrun.models.gpt import GPT

_write_data = filesystem._FileSystemWriter.write_data


def _held_write_data(self: filesystem._FileSystemWriter, plan: SavePlan, planner: SavePlanner) -> Future:
    written = _write_data(self, plan, planner)
    folder, _, name = os.environ.get("MESHRUN_TEST_HOLD", "").rpartition(":")
    if folder and fnmatch.fnmatch(Path(self.path).name, f"{name}.tmp"):
        written.wait()
        (Path(folder) / f"held-{os.environ.get('RANK', '0')}").touch()
        while not (Path(folder) / "release").exists():
            time.sleep(0.05)
    return written


filesystem._FileSystemWriter.write_data = _held_write_data  # type: ignore[method-assign] - the cue


def build(cfg: ModelConfig) -> GPT:
    return GPT(cfg)
