"""parallel.balance time | size (fairscale's balancers) profile the model on a microbatch of what
its first stage reads: token ids, a classifier's padded texts (its blocks hand on the (hidden,
mask) state), a forecaster's values (models/task_io.py). In one process, on the CPU."""

from __future__ import annotations

import pytest

from meshrun.config.schema import load_config
from meshrun.parallel.balance import measured_split

MODEL = ["model.num_layers=4", "model.dim=32", "model.num_heads=2", "model.seq_len=12", "precision=fp32"]

TASKS = {
    "causal_lm": [],
    "classification": ["task=classification", "model.name=encoder", "model.num_labels=3"],
    "regression": [
        "task=regression",
        "model.name=timeseries",
        "model.features=2",
        "model.horizon=3",
        "task_options.horizon=3",
    ],
}


@pytest.mark.parametrize("by", ["time", "size"])
@pytest.mark.parametrize("task", TASKS)
def test_every_task_is_balanced_over_its_stages(task: str, by: str) -> None:
    cfg = load_config(
        None,
        [
            *MODEL,
            *TASKS[task],
            "parallel.pp=2",
            f"parallel.balance={by}",
            "train.global_batch=4",
            "train.micro_batch=2",
        ],
    )
    split = measured_split(cfg, 2, by=by)
    assert sorted(block for stage in split for block in stage) == [0, 1, 2, 3] and all(split)
