"""Where the time goes (metrics/time_split.py): each log window's split per rank sums to the window's
wall time with no negative part; a rank that sleeps in its forward (tests/metrics/straggling_gpt.py)
is the slowest rank of every window, its peers wait for it (under ddp, fsdp and pp: in FSDP's
all-gathers, which its hooks count as waiting, not compute), and it is named in one warning line."""

from __future__ import annotations

import math
import time
from pathlib import Path

import pytest
from conftest import in_process_trainer, meshrun_env, read_metrics, run_meshrun, tiny
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from meshrun.metrics import time_split
from meshrun.metrics.time_split import PARTS, Slowest, Stragglers

HERE = str(Path(__file__).parent)  # straggling_gpt.py
SLEEP_S = 0.15  # per training forward on the straggler: several times a tiny model's microbatch


def parts_of(row: dict, rank: int) -> dict[str, float]:
    return {part: row[f"time/rank{rank}/{part}_s"] for part in PARTS}


def test_one_ranks_split_is_its_windows_wall_time(data_dir: Path, tmp_path: Path) -> None:
    """The same clock reads bound the window and its parts: they sum to it to rounding. Validation
    and checkpoints after a log step belong to the next window, where they are counted."""
    settings = {"train.steps": 6, "train.log_interval": 2, "train.eval_interval": 3, "checkpoint.interval": 4}
    with in_process_trainer(data_dir, tmp_path / "run", **settings) as trainer:
        trainer.train()
        rows = trainer.report.rows
    windows = [row for row in rows if "time/wall_s" in row]
    assert [row["step"] for row in windows] == [2, 4, 6]
    for row in windows:
        parts = parts_of(row, 0)
        assert all(seconds >= 0 for seconds in parts.values()), parts
        assert math.isclose(sum(parts.values()), row["time/wall_s"], rel_tol=1e-9), (parts, row["time/wall_s"])
        assert parts["compute"] > 0 and parts["data"] > 0 and parts["optimizer"] > 0
        assert row["time/wall_s"] >= row["train_s"]
        assert not any(key.startswith("device_util/") for key in row)  # CPU: absent, not 0
    eval_s = {row["step"]: row["eval_s"] for row in rows if "eval_s" in row}  # at steps 3 and 6
    checkpoint_s = next(row["checkpoint_s"] for row in rows if "checkpoint_s" in row)  # at step 4
    assert parts_of(windows[1], 0)["eval"] == pytest.approx(eval_s[3], abs=0.01)
    assert parts_of(windows[2], 0)["checkpoint"] == pytest.approx(checkpoint_s, abs=0.01)
    assert parts_of(windows[0], 0)["eval"] == parts_of(windows[0], 0)["checkpoint"] == 0.0


def test_evaluation_forwards_are_no_compute() -> None:
    """The model marks compute in every forward, an evaluation's too; only a training step's count."""
    import torch

    time_split.start(torch.device("cpu"), at=time.perf_counter())
    time_split.phase("eval")
    with time_split.section("compute"):
        time.sleep(0.01)
    time_split.phase("forward_backward")
    with time_split.section("compute"):
        time.sleep(0.01)
        time_split.gradients_ready()
        time.sleep(0.02)  # after this rank's last gradient: the all-reduce, waiting
    split = time_split.close(at=time.perf_counter())
    assert split["eval"] >= 0.01 and 0.01 <= split["compute"] < 0.02 and split["wait"] >= 0.02


def test_a_collective_inside_compute_is_waiting() -> None:
    """FSDP's hooks (parallel/fsdp.py) carve its collectives out of a compute section as waiting;
    the parts still sum to the window, and outside a compute section the marks do nothing."""
    import torch

    start = time.perf_counter()
    time_split.start(torch.device("cpu"), at=start)
    time_split.phase("forward_backward")
    time_split.collective_starts()  # outside a section (a pipeline's explicit unshard): waiting already
    with time_split.section("compute"):
        time.sleep(0.005)
        time_split.collective_starts()
        time.sleep(0.03)
        time_split.collective_starts()  # a second output's hook: still the same wait
        time_split.collective_ends()
        time_split.collective_ends()  # the input's hook after the gradient's: nothing open
        time.sleep(0.005)
        time_split.collective_starts()  # still open when the section ends: the section closes it
        time.sleep(0.03)
    time_split.collective_ends()
    time_split.phase("optimizer")
    end = time.perf_counter()
    split = time_split.close(at=end)
    assert math.isclose(sum(split.values()), end - start, rel_tol=1e-9)
    assert split["wait"] >= 0.06 and 0.01 <= split["compute"] < 0.06, split


def test_a_straggler_is_named_once_after_its_streak() -> None:
    stragglers = Stragglers(ratio=1.2, windows=3)
    seen = [stragglers.persistent(Slowest(rank, ratio)) for rank, ratio in [(1, 1.5), (1, 1.3), (2, 1.4), (2, 1.3)]]
    assert seen == [False, False, False, False]  # another rank broke the streak
    seen = [stragglers.persistent(Slowest(2, ratio)) for ratio in (1.25, 1.1, 1.3, 1.3, 1.3, 1.9, 2.0)]
    assert seen == [True, False, False, False, False, False, False]  # once; a fast window resets the streak
    assert [stragglers.persistent(Slowest(0, 1.3)) for _ in range(3)] == [False, False, True]


class Places:
    def place(self, rank: int) -> dict[str, int]:
        return {"dp": rank}

    def rank_text(self, rank: int) -> str:
        return f"rank {rank}"


def test_a_window_holding_a_recovery_is_judged_on_no_rank() -> None:
    """A peer recovery's window (some ranks trained its step twice) names nobody and ends any streak."""
    stragglers, slow = Stragglers(ratio=1.2, windows=2), [[0.0] * len(PARTS) for _ in range(2)]
    slow[1][PARTS.index("compute")], slow[0][PARTS.index("compute")] = 3.0, 1.0
    assert stragglers.row(slow, layout=Places())[1] is None  # one slow window of two
    stragglers.excuse()
    row, warning = stragglers.row(slow, layout=Places())
    assert warning is None and row["straggler/rank"] == 1
    assert stragglers.row(slow, layout=Places())[1] is None  # the streak starts again
    assert stragglers.row(slow, layout=Places())[1] == (
        "warning: rank 1 is a straggler: its compute took 1.50x the median rank's in 2 log windows in a row "
        "(metrics.straggler_ratio 1.2); the others wait for it (a slower device or host, or more work: an uneven "
        "pipeline split)"
    )


@pytest.mark.timeout(400)
@pytest.mark.parametrize(
    ("layout", "straggler", "where"),
    [
        ({"parallel.dp": 2}, 1, {"dp": 1, "tp": 0, "pp": 0}),
        ({"parallel.dp": 2, "parallel.dp_mode": "fsdp"}, 0, {"dp": 0, "tp": 0, "pp": 0}),
        ({"parallel.pp": 2, "model.num_layers": 2}, 1, {"dp": 0, "tp": 0, "pp": 1}),
    ],
    ids=["dp2", "fsdp2", "pp2"],
)
def test_a_sleeping_rank_is_the_straggler(
    data_dir: Path, tmp_path: Path, layout: dict, straggler: int, where: dict[str, int]
) -> None:
    run = tmp_path / "run"
    settings = {
        **layout,
        "model.factory": "straggling_gpt:build",
        "train.steps": 8,
        "train.log_interval": 2,
        "tracker.mode": "offline",
        "tracker.backends": "[jsonl,tensorboard]",
    }
    env = meshrun_env(tmp_path, PYTHONPATH=HERE, MESHRUN_TEST_STRAGGLER=f"{straggler}:{SLEEP_S}")
    result = run_meshrun(["train", *tiny(data_dir, run, **settings)], tmp_path=tmp_path, env=env, timeout=300)
    windows = [row for row in read_metrics(run) if "time/wall_s" in row]
    assert [row["step"] for row in windows] == [2, 4, 6, 8]
    other = 1 - straggler
    for row in windows:
        for rank in (0, 1):
            parts = parts_of(row, rank)
            assert all(seconds >= 0 for seconds in parts.values()), (rank, parts)
            # each rank's window is bounded by its own log steps, a few ms from rank 0's (wall_s)
            assert sum(parts.values()) == pytest.approx(row["time/wall_s"], rel=0.1, abs=0.05), (rank, parts, row)
        slow, fast = parts_of(row, straggler), parts_of(row, other)
        assert slow["compute"] >= 4 * SLEEP_S  # its forwards (2 steps x 2 microbatches) slept
        assert fast["wait"] > slow["wait"]  # the other rank waited for it: most of what it slept
        assert fast["wait"] >= 0.75 * 4 * SLEEP_S and fast["compute"] < 4 * SLEEP_S
        assert row["straggler/rank"] == straggler and row["straggler/ratio"] > 1.2
        assert {axis: row[f"straggler/{axis}"] for axis in where} == where
    warnings = [line for line in result.stderr.splitlines() if "is a straggler" in line]
    assert len(warnings) == 1, result.stderr[-3000:]
    label = f"rank {straggler} (dp {where['dp']}, tp 0, pp {where['pp']})"
    assert label in warnings[0]
    events = EventAccumulator(str(run / "tensorboard"), size_guidance={"scalars": 0})
    events.Reload()
    assert [e.value for e in events.Scalars("straggler/rank")] == [straggler] * 4
    assert len(events.Scalars(f"time/rank{other}/wait_s")) == 4
    report = run_meshrun(["report", str(run), "--out", str(tmp_path / "r.png")], tmp_path=tmp_path, timeout=60)
    assert f"| {label}: " in report.stdout
    assert "in 4/4 windows" in report.stdout
