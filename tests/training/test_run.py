"""The run object does the I/O of a run (the resume, the run record, signal handlers, process
groups), so that a Trainer is built from what it made without touching a file or the process."""

from __future__ import annotations

import builtins
import os
import signal
from pathlib import Path

import pytest
import torch.distributed as dist
from conftest import in_process_trainer

from meshrun.training.trainer import Trainer, TrainingData


def test_constructing_a_trainer_does_no_io(data_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    with in_process_trainer(data_dir, tmp_path / "run") as built:

        def refuse(*args: object, **kwargs: object) -> None:
            raise AssertionError(f"I/O while constructing a Trainer: {args}")

        with monkeypatch.context() as io:
            for owner, name in ((builtins, "open"), (os, "open"), (signal, "signal"), (dist, "new_group")):
                io.setattr(owner, name, refuse)
            trainer = Trainer(
                built.cfg,
                built.mesh,
                built.state,
                data=TrainingData(train=built.train_data, val=built.val_data, card=built.data_card, task=built.task),
                flops_model=built.flops_model,
                start_step=built.start_step,
                newer_checkpoints=built.newer_checkpoints,
                report=built.report,
                requests=built.requests,
                background=built.background,
                profiler=built.profiler,
            )
        assert trainer.model is built.model and trainer.start_step == 0
