"""A run that stalls says where (launcher/hang.py): a rank blocked in its forward ends the job within
launch.hang_timeout and a few seconds, with one summary naming that rank, its stage and its stack
file; under max_restarts a block that happens once is survived, equal to an uninterrupted run; a
step that is slow but progressing is no hang."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from conftest import final_weights, max_weight_diff, meshrun_env, meshrun_in_process, read_metrics, run_meshrun, tiny

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
    assert "rank 1 (dp 1, tp 0, pp 0, stages [0])" in summary and "in forward (microbatch 1 of 2)" in summary
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


def hang_run(data_dir: Path, tmp_path: Path, hang: str, **settings: object) -> tuple[Path, list[str], int]:
    """A tiny run with `settings` whose rank blocks as MESHRUN_TEST_HANG=`hang` says (hanging_gpt.py):
    its run folder, its stderr lines and exit code. It must end by itself: no hang goes unseen."""
    run = tmp_path / "run"
    env = meshrun_env(tmp_path, PYTHONPATH=HERE, MESHRUN_TEST_HANG=hang, MESHRUN_TEST_SPOIL_REPORTS=str(run / "hang"))
    if not settings.pop("spoil", False):
        del env["MESHRUN_TEST_SPOIL_REPORTS"]
    args = tiny(data_dir, run, **{**LAYOUT, **settings})
    result = run_meshrun(["train", *args], tmp_path=tmp_path, env=env, check=False, timeout=150)
    assert "Traceback" not in result.stderr, result.stderr[-3000:]
    return run, result.stderr.strip().splitlines(), result.returncode


@pytest.mark.timeout(200)
def test_a_one_process_job_stuck_in_forward_is_reported(data_dir: Path, tmp_path: Path) -> None:
    """dp 1, pp 1: no torchrun, the worker is the launcher: its watchdog says the summary itself."""
    run, lines, code = hang_run(data_dir, tmp_path, "0:2", **{"parallel.dp": 1})
    assert code == HUNG_EXIT_CODE, lines[-20:]
    assert "[meshrun] hang at step 2: rank 0 (dp 0, tp 0, pp 0, stages [0])" in "\n".join(lines)
    assert lines[-1].startswith("meshrun: error: rank 0 stopped making progress at step 2 (forward")
    assert "block_here" in (run / "hang" / "attempt-0" / "rank0.stacks.txt").read_text()


@pytest.mark.timeout(200)
def test_a_rank_stuck_before_step_1_is_reported(data_dir: Path, tmp_path: Path) -> None:
    """Rank 1 blocks in its weight initialisation, rank 0 waits in the first collective after it:
    watched from the start, at SLOW_FACTOR x the timeout while initialising."""
    started = time.time()
    run, lines, code = hang_run(data_dir, tmp_path, "1:0")
    assert code == HUNG_EXIT_CODE, lines[-20:]
    summary = next(line for line in lines if line.startswith("[meshrun] hang at"))
    assert summary.startswith("[meshrun] hang at initialisation (before step 1): rank 1 (dp 1, tp 0, pp 0, stages [0])")
    assert "in init (building the model" in summary
    assert "init_weights" in Path(summary.rsplit("its stacks: ", 1)[1]).read_text()
    assert "launch.hang_timeout (4 s; x3 in init)" in lines[-1]
    assert not (run / "metrics.jsonl").exists() or not read_metrics(run)
    assert time.time() - started < 3 * TIMEOUT + 60  # the bound, startup and a margin on a loaded machine


@pytest.mark.timeout(200)
def test_a_watchdog_that_cannot_write_its_report_still_ends_the_job(data_dir: Path, tmp_path: Path) -> None:
    """RUN_DIR/hang became a file while the job ran: no report, but exit 124 and a line saying why."""
    run, lines, code = hang_run(data_dir, tmp_path, "0:2", spoil=True, **{"parallel.dp": 1})
    assert code == HUNG_EXIT_CODE, lines[-20:]
    assert lines[-1].startswith("meshrun: error: rank 0 made no progress for"), lines[-5:]
    assert f"could not be written to {run / 'hang' / 'attempt-0'}" in lines[-1]
    assert (run / "hang").read_text() == "not a folder\n"  # not meshrun's: left as it was


def test_a_hang_folder_that_is_a_file_is_refused_before_any_worker(data_dir: Path, tmp_path: Path) -> None:
    run = tmp_path / "run"
    run.mkdir()
    (run / "hang").write_text("mine\n")
    args = tiny(data_dir, run, **{"launch.hang_timeout": TIMEOUT})
    result = meshrun_in_process(["train", *args], tmp_path=tmp_path, check=False)
    assert result.returncode == 2 and result.stderr.count("\n") == 1, result.stderr
    assert f"{run / 'hang'} is not a folder" in result.stderr and (run / "hang").read_text() == "mine\n"


@pytest.mark.timeout(200)
def test_the_last_pipeline_stage_hung_in_backward_is_blamed(data_dir: Path, tmp_path: Path) -> None:
    """pp 2: stage 1 blocks in its first backward of step 2; stage 0, which finished its forwards and
    waits for that gradient, is the consequence, though its last mark (a forward) looks earlier."""
    _, lines, code = hang_run(data_dir, tmp_path, "1:2:backward", **{"parallel.dp": 1, "parallel.pp": 2})
    assert code == HUNG_EXIT_CODE, lines[-20:]
    summary = next(line for line in lines if line.startswith("[meshrun] hang at"))
    assert summary.startswith("[meshrun] hang at step 2: rank 1 (dp 0, tp 0, pp 1, stages [1])"), summary
    assert "in backward (stage 1 microbatch 0)" in summary
    assert any(line.startswith("[meshrun]   waiting: ranks [0] in forward") for line in lines), lines[-5:]
