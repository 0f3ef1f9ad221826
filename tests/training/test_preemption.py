"""Surviving preemption and crashes: signals, a SIGKILLed rank under torchrun restarts, SAVE requests."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import time
from pathlib import Path

import pytest
import torch
from conftest import (
    descendants,
    final_weights,
    finish_meshrun,
    kill_tree,
    losses,
    run_meshrun,
    start_meshrun,
    tiny,
    wait_for,
)

from meshrun.checkpoint.paths import complete_checkpoints, step_of
from meshrun.launcher.lifetime import WORKER_NAME
from meshrun.launcher.run_lock import LOCK, hold_run_dir

# Long enough that a signal sent after the first checkpoint (step 5) always lands mid-run: 35
# more steps at >= 0.1 s each on 2 cores, against the milliseconds the test takes to send it.
STEPS = {"train.steps": 40, "checkpoint.interval": 5, "parallel.pp": 2, "train.log_interval": 1}
# a job that a signal must reach mid-run: 40 steps end ~3 s after the first checkpoint, which a loaded
# machine's scheduling can outlast (the signal then came after the end: exit 0); it stops at the signal
LONG = {"train.steps": 2000}


def workers(root_pid: int) -> dict[int, int]:
    """rank -> pid of the training workers under a launcher process, by their command name
    (meshrun.launcher.lifetime.name_worker: a forked worker's command line is its fork server's)."""
    found = {}
    for pid in descendants(root_pid):
        try:
            name = Path(f"/proc/{pid}/comm").read_text().strip()
        except OSError:
            continue
        if name.startswith(WORKER_NAME):
            found[int(name.removeprefix(WORKER_NAME))] = pid
    return found


def start(data_dir: Path, run: Path, **overrides: object) -> subprocess.Popen:
    return start_meshrun(["train", *tiny(data_dir, run, **{**STEPS, **overrides})], tmp_path=run.parent)


def finish(proc: subprocess.Popen) -> tuple[int, str]:
    result = finish_meshrun(proc, check=False)
    return result.returncode, result.stderr


@pytest.fixture(scope="module")
def uninterrupted(data_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    run = tmp_path_factory.mktemp("full") / "run"
    run_meshrun(["train", *tiny(data_dir, run, **STEPS)], tmp_path=run.parent)
    return run


def foreign_lines(stderr: str) -> list[str]:
    """Console lines that are not meshrun's own (its progress and summary, its launcher's and
    agent's one-liners): a torch traceback or log line, anything a user would have to wade through."""
    own = re.compile(r"(\[meshrun\] |meshrun: |torchrun: | *[a-z_]+: )")  # the last: the summary's rows
    return [line for line in stderr.splitlines() if line and not own.match(line)]


def assert_same_run(run: Path, reference: Path) -> None:
    got, want = final_weights(run), final_weights(reference)
    assert all(torch.equal(got[k], want[k]) for k in want)
    assert losses(run) == losses(reference)


@pytest.mark.timeout(600)  # the first row also trains the uninterrupted fixture: 3 runs on loaded cores
@pytest.mark.parametrize("sig,resume", [(signal.SIGTERM, True), (signal.SIGUSR1, False)], ids=["SIGTERM", "SIGUSR1"])
def test_signal_to_one_rank_checkpoints_all_and_resume_completes(
    sig, resume: bool, uninterrupted, data_dir: Path, tmp_path: Path
) -> None:
    """Either signal stops every rank at one checkpoint (exit 75); what resumes from it does not
    depend on which signal stopped it, so SIGTERM's row alone resumes (one launch fewer)."""
    run = tmp_path / "run"
    proc = start(data_dir, run)
    wait_for(lambda: (run / "checkpoints" / "latest").exists(), timeout=180, what="the first checkpoint")
    os.kill(workers(proc.pid)[1], sig)  # only the last stage's rank hears it
    code, err = finish(proc)
    assert code == 75, err[-3000:]
    assert "stop requested: checkpoint at step" in err
    stopped_at = int((run / "checkpoints" / "latest").read_text().split("-")[1])
    assert stopped_at < STEPS["train.steps"] and not (run / "summary.json").exists()
    if not resume:
        return
    resumed = run_meshrun(["train", *tiny(data_dir, run, **STEPS)], tmp_path=tmp_path)
    assert f"at step {stopped_at}" in resumed.stderr
    assert_same_run(run, uninterrupted)


def test_killed_rank_restarts_and_resumes(uninterrupted, data_dir: Path, tmp_path: Path) -> None:
    run = tmp_path / "run"
    proc = start(data_dir, run, **{"launch.max_restarts": 1})
    wait_for(lambda: (run / "checkpoints" / "latest").exists(), timeout=180, what="the first checkpoint")
    os.kill(workers(proc.pid)[0], signal.SIGKILL)
    code, err = finish(proc)
    assert code == 0, err[-3000:]
    assert "resumed from" in err, err
    assert_same_run(run, uninterrupted)
    # the lost rank reads as one line (rank 1's broken send, and that torchrun restarts), not a
    # traceback per surviving rank: those are in RUN_DIR/logs
    assert foreign_lines(err) == []
    said = [line for line in err.splitlines() if "failed" in line]
    assert len(said) == 1 and "torchrun restarts the workers (attempt 2 of 2)" in said[0], err[-3000:]
    assert "Traceback" in (run / "logs" / "rank-1.log").read_text()


def test_a_lost_rank_reads_as_a_few_lines(data_dir: Path, tmp_path: Path) -> None:
    """A rank SIGKILLed mid-training with no restarts: the surviving rank's broken collective is
    not a traceback on the console (~60 lines before, per surviving rank) but the agent's line
    naming the killed rank and the launcher's line naming the survivor's cause and its log."""
    run = tmp_path / "run"
    proc = start(data_dir, run)
    wait_for(lambda: (run / "checkpoints" / "latest").exists(), timeout=180, what="the first checkpoint")
    os.kill(workers(proc.pid)[0], signal.SIGKILL)
    code, err = finish(proc)
    assert code == 1, err[-3000:]
    assert foreign_lines(err) == []
    said = [line for line in err.splitlines() if "fail" in line]  # bound: the agent's line and the launcher's
    assert len(said) == 2, err[-3000:]
    assert said[0].startswith("torchrun: workers failed: rank 0 killed by SIGKILL"), err[-3000:]
    assert said[1].startswith("meshrun: error: rank 1 failed: ") and err.splitlines()[-1] == said[1]
    log = run / "logs" / "rank-1.log"
    assert f"(traceback: {log})" in said[1] and "Traceback" in log.read_text()


def test_save_file_requests_a_checkpoint_without_stopping(data_dir: Path, tmp_path: Path) -> None:
    run = tmp_path / "run"
    proc = start(data_dir, run, **{"checkpoint.interval": 0, "parallel.pp": 1, "train.steps": 400})
    wait_for(lambda: (run / "metrics.jsonl").exists(), timeout=180, what="training to start")
    (run / "SAVE").touch()
    code, err = finish(proc)
    assert code == 0, err[-3000:]
    steps = sorted(int(p.name.split("-")[1]) for p in (run / "checkpoints").glob("step-*"))
    assert steps[-1] == 400 and len(steps) == 2 and steps[0] < 400  # the requested one, and the final one
    assert not (run / "SAVE").exists()


def test_a_save_folder_is_ignored_with_one_warning(data_dir: Path, tmp_path: Path) -> None:
    """`mkdir RUN_DIR/SAVE` (a folder where the request file goes) crashed every step's poll with a
    traceback, and every rerun while it was there: now the run trains on, saying so once."""
    run = tmp_path / "run"
    (run / "SAVE").mkdir(parents=True)
    result = run_meshrun(["train", *tiny(data_dir, run, **{"train.steps": 3})], tmp_path=tmp_path, check=False)
    assert result.returncode == 0, result.stderr[-3000:]
    warnings = [line for line in result.stderr.splitlines() if "SAVE" in line]
    assert len(warnings) == 1 and "not taken as a save request" in warnings[0], result.stderr[-3000:]
    assert (run / "SAVE").is_dir()  # not ours to remove
    assert [p.name for p in (run / "checkpoints").glob("step-*")] == ["step-00000003"]


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGUSR1], ids=["SIGTERM", "SIGUSR1"])
def test_signal_to_the_launcher_reaches_the_workers(sig, data_dir: Path, tmp_path: Path) -> None:
    """`meshrun train` as a container's PID 1 or a scheduler's child: the signal goes to it alone."""
    run = tmp_path / "run"
    proc = start(data_dir, run, **LONG)
    wait_for(lambda: (run / "checkpoints" / "latest").exists(), timeout=180, what="the first checkpoint")
    os.kill(proc.pid, sig)
    code, err = finish(proc)
    assert code == 75, err[-3000:]
    assert "stop requested: checkpoint at step" in err
    assert "Traceback" not in err, err[-3000:]  # torchrun's agent ends quietly on the stop it relayed
    assert not workers(proc.pid)  # nothing left behind


@pytest.mark.parametrize("to", ["group", "launcher"])
def test_ctrl_c_ends_every_process_with_one_line(to: str, data_dir: Path, tmp_path: Path) -> None:
    """Ctrl-C (SIGINT to the launcher's process group, as a terminal sends it) or `kill -INT` of
    the launcher alone: every rank ends at once, no rank prints a traceback, no checkpoint is
    written on the way out, and the launcher says so in one line naming the one a rerun resumes
    from. (SIGINT to the launcher alone used to reach nobody: the job trained to its end.)"""
    run = tmp_path / "run"
    proc = start(data_dir, run, **LONG)
    wait_for(lambda: (run / "checkpoints" / "latest").exists(), timeout=180, what="the first checkpoint")
    (os.killpg if to == "group" else os.kill)(proc.pid, signal.SIGINT)
    code, err = finish(proc)
    assert code == 130, err[-3000:]
    assert foreign_lines(err) == [] and "stop requested" not in err, err[-3000:]
    saved = [step_of(folder) for folder in complete_checkpoints(run)]
    assert saved[-1] < LONG["train.steps"] and all(step % STEPS["checkpoint.interval"] == 0 for step in saved)
    assert err.splitlines()[-1] == (
        "meshrun: interrupted (Ctrl-C / SIGINT): every rank stopped at once, without writing a checkpoint; "
        f"rerunning the same command resumes from step {saved[-1]}, the last complete checkpoint "
        "(SIGTERM or SIGUSR1 instead writes one, then stops with exit 75)"
    ), err[-3000:]
    assert not workers(proc.pid) and not (run / "summary.json").exists()


def test_killed_while_writing_a_checkpoint_leaves_the_previous_one_loadable(data_dir: Path, tmp_path: Path) -> None:
    """SIGKILL the whole job while a save is in flight (its `.tmp` folder exists); every
    checkpoint that is visible afterwards verifies, and the rerun resumes from the newest."""
    from meshrun.checkpoint.dcp import complete_checkpoints, verify

    big = {"model.dim": 384, "model.num_heads": 4, "train.steps": 40, "checkpoint.interval": 1, "checkpoint.keep": 3}
    for attempt in range(5):  # a save lasts tens of milliseconds: retry if the kill came just after one
        run = tmp_path / f"run{attempt}"
        root = run / "checkpoints"
        proc = start(data_dir, run, **big)
        wait_for(lambda: len(complete_checkpoints(run)) >= 2, timeout=180, what="two complete checkpoints")  # noqa: B023 (called before the loop moves on)
        deadline = time.monotonic() + 60
        while not any(root.glob("*.tmp")) and time.monotonic() < deadline:
            pass
        kill_tree(proc.pid)
        finish(proc)
        if any(root.glob("*.tmp")):
            break
    else:
        pytest.fail("never caught a save in flight")
    complete = complete_checkpoints(run)
    for folder in complete:
        verify(folder)
    newest = int(complete[-1].name.split("-")[1])  # one more step: its save replaces the interrupted one
    result = run_meshrun(
        ["train", *tiny(data_dir, run, **{**STEPS, **big, "train.steps": newest + 1})], tmp_path=tmp_path
    )
    assert f"resumed from {complete[-1]} at step" in result.stderr
    assert not any(root.glob("*.tmp"))  # the interrupted save's folder was cleared by the next save


def test_a_second_job_on_a_run_dir_in_use_is_refused(data_dir: Path, tmp_path: Path) -> None:
    """The same command in a second terminal while the first job trains: refused in one line
    naming the owner (it resumed from the first job's checkpoints and truncated its metrics)."""
    run = tmp_path / "run"
    # one process (the launcher holds the lock all the same), long enough to outlive the second launch
    first = start(data_dir, run, **{"parallel.pp": 1, "train.steps": 5000, "checkpoint.interval": 5000})
    try:
        wait_for(lambda: (run / "metrics.jsonl").exists(), timeout=180, what="training to start")
        second = run_meshrun(["train", *tiny(data_dir, run, **STEPS)], tmp_path=tmp_path, check=False)
        assert second.returncode == 2, second.stderr[-3000:]
        assert len(second.stderr.splitlines()) == 1
        assert f"is in use by another meshrun job (pid {first.pid} (meshrun train) on " in second.stderr
    finally:
        os.kill(first.pid, signal.SIGTERM)
        finish(first)
    assert not (run / LOCK).exists()  # the job removed its owner record as it ended
    with hold_run_dir(run, job="next", role="test"):  # and the kernel dropped its lock: free again
        pass
