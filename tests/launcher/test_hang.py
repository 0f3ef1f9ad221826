"""A run that stalls says where (launcher/hang.py): a rank blocked in its forward ends the job within
launch.hang_timeout and a few seconds, with one summary naming that rank, its stage and its stack
file; under max_restarts a block that happens once is survived, equal to an uninterrupted run; a
step that is slow but progressing is no hang."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from conftest import final_weights, max_weight_diff, meshrun_env, read_metrics, run_meshrun, tiny

HERE = str(Path(__file__).parent)  # hanging_gpt.py
HUNG_EXIT_CODE = 124
TIMEOUT = 4  # launch.hang_timeout in these tests (seconds)
LAYOUT = {"parallel.dp": 2, "model.factory": "hanging_gpt:build", "launch.hang_timeout": TIMEOUT}


@pytest.mark.timeout(240)
def test_a_blocked_rank_is_named_with_its_stage_and_stack(data_dir: Path, tmp_path: Path) -> None:
    run = tmp_path / "run"
    env = meshrun_env(tmp_path, PYTHONPATH=HERE, MESHRUN_TEST_HANG="1:3")
    result = run_meshrun(["train", *tiny(data_dir, run, **LAYOUT)], tmp_path=tmp_path, env=env, check=False)
    ended = time.time()
    assert result.returncode == HUNG_EXIT_CODE, result.stderr[-3000:]
    assert [row["step"] for row in read_metrics(run) if "loss" in row] == [1, 2]
    since_step_2 = ended - (run / "metrics.jsonl").stat().st_mtime
    assert since_step_2 < TIMEOUT + 15, f"ended {since_step_2:.0f} s after step 2"  # the timeout and a margin
    lines = result.stderr.strip().splitlines()
    summary = next(line for line in lines if "hang at step 3" in line)
    assert "rank 1 (pipeline rank 0, stages [0], dp 1)" in summary and "in forward (microbatch 1 of 2)" in summary
    stacks = Path(summary.rsplit("its stacks: ", 1)[1])
    assert "block_here" in stacks.read_text()  # the blocking frame
    assert any("waiting: ranks [0] in backward" in line for line in lines), result.stderr[-3000:]
    assert lines[-1].startswith("meshrun: error: rank 1 stopped making progress at step 3 (forward")
    assert "Traceback" not in result.stderr


@pytest.mark.timeout(300)
def test_a_hang_that_happens_once_is_survived_under_max_restarts(data_dir: Path, tmp_path: Path) -> None:
    settings = {**LAYOUT, "train.steps": 4, "checkpoint.interval": 2, "launch.max_restarts": 1}
    once = tmp_path / "blocked-once"
    env = meshrun_env(tmp_path, PYTHONPATH=HERE, MESHRUN_TEST_HANG="1:3", MESHRUN_TEST_HANG_ONCE=str(once))
    run = tmp_path / "run"
    result = run_meshrun(["train", *tiny(data_dir, run, **settings)], tmp_path=tmp_path, env=env, check=False)
    assert result.returncode == 0, result.stderr[-3000:]
    assert once.exists() and (run / "hang" / "attempt-0" / "rank1.json").is_file()  # it did hang, then resumed
    plain = tmp_path / "plain"
    run_meshrun(
        ["train", *tiny(data_dir, plain, **settings)], tmp_path=tmp_path, env=meshrun_env(tmp_path, PYTHONPATH=HERE)
    )
    assert max_weight_diff(final_weights(run), final_weights(plain)) == 0.0


@pytest.mark.timeout(240)
def test_a_slow_but_progressing_step_is_no_hang(data_dir: Path, tmp_path: Path) -> None:
    """Each microbatch takes 3 s, a step 6 s: longer than the 4 s timeout, but every microbatch moves."""
    env = meshrun_env(tmp_path, PYTHONPATH=HERE, MESHRUN_TEST_SLOW="3")
    settings = {**LAYOUT, "train.steps": 3, "train.global_batch": 4, "train.micro_batch": 1}
    result = run_meshrun(
        ["train", *tiny(data_dir, tmp_path / "run", **settings)], tmp_path=tmp_path, env=env, check=False
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert not (tmp_path / "run" / "hang").exists()
