"""The peer-recovery tests' job and their check of a recovered run (tests/launcher/test_recovery.py,
and the Slurm one in test_slurm.py): a dp2 job whose model kills a rank on cue, run plain or under
launch.recovery peer, and a killed run compared with the uninterrupted one."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
import torch
from conftest import final_weights, losses, meshrun_env, read_metrics, run_meshrun, tiny

HERE = str(Path(__file__).parents[1] / "training")  # interrupting_gpt: SIGKILL at a forward, on cue
STEPS = 6
# 2 microbatches a step on each rank: forward 5 is step 3's first, mid-step (its peer waits in DDP's all-reduce)
JOB = {
    "model.factory": "interrupting_gpt:build",
    "parallel.dp": 2,
    "train.steps": STEPS,
    "checkpoint.interval": 0,  # the only checkpoint is the run's last: none could have been read
    "launch.max_restarts": 1,
}


def train(
    data_dir: Path, run: Path, job: dict[str, object], env: dict[str, str] | None = None
) -> tuple[Path, subprocess.CompletedProcess]:
    """`meshrun train` of `job` into `run` (the cue's model found through PYTHONPATH; `env` added)."""
    args = ["train", *tiny(data_dir, run, **job)]
    return run, run_meshrun(
        args, tmp_path=run.parent, env=meshrun_env(run.parent, PYTHONPATH=HERE, **(env or {})), timeout=300
    )


def assert_recovered(runs: dict, monkeypatch: pytest.MonkeyPatch, *, events: list[tuple] | None = None) -> list[tuple]:
    """The killed run's weights are the uninterrupted run's, each step trained once, no checkpoint
    read (checkpoint.interval 0: none was written before the end), the recoveries recorded: `events`
    (returned: step, ranks, source, steps lost)."""
    (plain, _), (run, done) = runs["uninterrupted"], runs["killed"]
    assert done.returncode == 0, done.stderr[-3000:]
    monkeypatch.syspath_prepend(HERE)  # the checkpoints' model.factory
    reference, recovered = final_weights(plain), final_weights(run)
    assert all(torch.equal(recovered[name], reference[name]) for name in reference)
    rows = read_metrics(run)
    assert [row["step"] for row in rows if "loss" in row] == list(range(1, STEPS + 1))  # each step once
    assert losses(run) == losses(plain)  # a row per step (log_interval 1): the replacement's window is whole
    recorded = [
        (e["step"], e["recovered_ranks"], e["recovered_from"], e["steps_lost"]) for e in rows if "recovered_ranks" in e
    ]
    assert events is None or recorded == events, recorded
    assert "resumed from" not in done.stderr and "Traceback" not in done.stderr
    return recorded
