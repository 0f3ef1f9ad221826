"""Every task under the layouts its own file does not launch, one launch per task: the task's
one-process run (meshrun's Trainer in this process, fp32) saves a checkpoint at step 5 and trains
10 clipped steps; one launch resumes that step-5 checkpoint at another layout and schedule and must
end at the one-process run's weights (1e-5). Microbatches of one sample: the one-process run
accumulates 8 per step. Resharded resume, layout and schedule in one run:

- classification: dp2 x pp2 DDP, interleaved-1f1b (2 stages per rank), selective recompute,
  4 microbatches per rank;
- regression: dp4 HSDP (shards of 2, 2 replicas), every:2 recompute, 2 microbatches per rank;
- masked_lm: dp2 x pp2 FSDP2, zbv (2 stages per rank in a V, weight gradients in their own
  backward), full recompute, 4 microbatches per rank.

And bf16 and fp16 (GradScaler) autocast for one task, in this process: finite, the loss falls, the
first step's loss near fp32's.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path

import pytest
from conftest import final_weights, in_process_trainer, losses, max_weight_diff, read_metrics, run_meshrun, tiny
from test_classification import CLASSIFY, labelled_dir  # noqa: F401 (a fixture used here)
from test_masked_lm import MLM, masked_dir  # noqa: F401 (a fixture used here)
from test_regression import REGRESS, series_dir  # noqa: F401 (a fixture used here)

ONE_MICROBATCH = {"train.micro_batch": 1}
TASKS = {  # the fixture of the task's data, its settings, the layout it resumes at
    "classification": (
        "labelled_dir",
        CLASSIFY,
        {
            "parallel.dp": 2,
            "parallel.pp": 2,
            "parallel.dp_mode": "ddp",
            "parallel.schedule": "interleaved-1f1b",
            "parallel.virtual_stages": 2,
            "recompute": "selective",
        },
    ),
    "regression": (
        "series_dir",
        REGRESS,
        {"parallel.dp": 4, "parallel.dp_mode": "hsdp", "parallel.dp_shard": 2, "recompute": "every:2"},
    ),
    "masked_lm": (
        "masked_dir",
        {**MLM, "train.eval_interval": 0},  # zbv cannot evaluate in torch 2.13 (parallel/stages.py)
        {
            "parallel.dp": 2,
            "parallel.pp": 2,
            "parallel.dp_mode": "fsdp",
            "parallel.schedule": "zbv",
            "recompute": "full",
        },
    ),
}
STEPS = {"train.steps": 10, "checkpoint.interval": 5}
# Relative error of step 1's loss under autocast: each matmul's operands are rounded to the half
# type (unit roundoff u: 2^-8 bf16, 2^-11 fp16) and multiplied-summed in fp32, through 4 blocks and
# a mean over 48 values. A few u bounds it (measured when written: 3e-4 bf16, 3e-5 fp16).
TOLERANCE = {"bf16": 4 * 2.0**-8, "fp16": 4 * 2.0**-11}


@pytest.fixture(scope="module")
def one_process(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Callable[..., Path]:
    """`one_process(task, **overrides)`: the task's one-process run (fp32 unless overridden), meshrun's
    real Trainer on a one-process mesh in this process; run once per module per settings."""
    runs: dict[str, Path] = {}

    def get(task: str, **overrides: object) -> Path:
        key = repr((task, sorted(overrides.items())))
        if key not in runs:
            fixture, settings, _ = TASKS[task]
            run = tmp_path_factory.mktemp(f"{task}-one") / "run"
            with in_process_trainer(
                request.getfixturevalue(fixture), run, **{**settings, **ONE_MICROBATCH, **STEPS, **overrides}
            ) as trainer:
                trainer.train()
            runs[key] = run
        return runs[key]

    return get


@pytest.fixture(scope="module", params=sorted(TASKS))
def task_runs(
    request: pytest.FixtureRequest, one_process: Callable[..., Path], tmp_path_factory: pytest.TempPathFactory
) -> tuple[Path, Path]:
    """(the one-process run, the run resumed from its step-5 checkpoint at the task's other layout)."""
    fixture, settings, layout = TASKS[request.param]
    reference, resumed = one_process(request.param), tmp_path_factory.mktemp(request.param) / "resumed"
    resume = {"train.resume": reference / "checkpoints" / "step-00000005"}
    args = tiny(
        request.getfixturevalue(fixture), resumed, **{**settings, **ONE_MICROBATCH, **STEPS, **layout, **resume}
    )
    run_meshrun(["train", *args], tmp_path=resumed.parent)
    return reference, resumed


def test_resumed_at_another_layout_ends_at_the_one_process_weights(task_runs: tuple[Path, Path]) -> None:
    """Steps 6 to 10 at the layout: the same losses as the one-process run's, and the same weights after."""
    reference, resumed = task_runs
    assert [row["step"] for row in read_metrics(resumed) if "loss" in row] == [6, 7, 8, 9, 10]
    assert losses(resumed) == pytest.approx(losses(reference)[5:], rel=1e-5)
    assert max_weight_diff(final_weights(resumed), final_weights(reference)) < 1e-5
    assert max_weight_diff(final_weights(reference / "checkpoints" / "step-00000005"), final_weights(reference)) > 1e-3


@pytest.mark.parametrize("precision", sorted(TOLERANCE))
def test_half_precision_trains_near_fp32(precision: str, one_process: Callable[..., Path]) -> None:
    """Autocast on the regression task (fp16 through the GradScaler: its scale logged, no step
    skipped): every loss finite, the last steps' below the first, step 1's loss within TOLERANCE
    of fp32's and not equal to it (the half type was used)."""
    half, fp32 = one_process("regression", precision=precision), one_process("regression")
    assert all(math.isfinite(loss) for loss in losses(half))
    assert max(losses(half)[-3:]) < losses(half)[0]
    assert 0 < abs(losses(half)[0] / losses(fp32)[0] - 1) < TOLERANCE[precision]
    if precision == "fp16":
        rows = [row for row in read_metrics(half) if "loss" in row]
        assert all(row["loss_scale"] == 2.0**16 and row["skipped_steps"] == 0 for row in rows)
