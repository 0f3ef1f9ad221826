"""Asynchronous checkpoints (`checkpoint.async`): the same bits as synchronous saves; a write
caught in flight (held_write_gpt holds it on cue, no racing sleeps) is never `latest` until it
completed, a kill mid-write resumes from the previous checkpoint, preemption waits for it, and a
full disk during it is one line with nothing complete lost."""

from __future__ import annotations

import os
import signal
import threading
from pathlib import Path

import pytest
import torch
from conftest import finish_meshrun, kill_tree, losses, meshrun_env, run_meshrun, start_meshrun, tiny, tmpfs, wait_for
from test_checkpoint_full_disk import SMALL

from meshrun.checkpoint.dcp import verify
from meshrun.checkpoint.paths import MANIFEST, complete_checkpoints

pytestmark = pytest.mark.timeout(600)  # every test runs two or three jobs under torchrun on 2 loaded cores

HELPERS = str(Path(__file__).parent / "training")
JOB = {
    "parallel.dp": 2,
    "train.steps": 6,
    "checkpoint.interval": 2,
    "model.num_layers": 2,
    "model.factory": "held_write_gpt:build",
}
ASYNC = {**JOB, "checkpoint.async": True}


@pytest.fixture(autouse=True)
def _test_model_importable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.syspath_prepend(HELPERS)  # final_weights builds the checkpoints' model.factory here


def held_env(tmp_path: Path, hold: str = "") -> dict[str, str]:
    """The test model on the path; `hold`: the checkpoint whose write waits for `tmp_path/release`."""
    extra = {"MESHRUN_TEST_HOLD": f"{tmp_path}:{hold}"} if hold else {}
    return meshrun_env(tmp_path, PYTHONPATH=HELPERS, **extra)


def held(tmp_path: Path, ranks: int = 2) -> bool:
    return all((tmp_path / f"held-{rank}").exists() for rank in range(ranks))


def checkpoints(run: Path) -> list[str]:
    return [p.name for p in complete_checkpoints(run)]


def latest(run: Path) -> str:
    return (run / "checkpoints" / "latest").read_text().strip()


def same_weights(a: Path, b: Path) -> bool:
    from conftest import final_weights

    got, want = final_weights(a), final_weights(b)
    return got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)


@pytest.fixture(scope="module")
def synchronous(data_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The job with synchronous saves, uninterrupted."""
    run = tmp_path_factory.mktemp("sync") / "run"
    run_meshrun(["train", *tiny(data_dir, run, **JOB)], tmp_path=run.parent, env=held_env(run.parent))
    return run


def test_async_saves_equal_sync_saves_bit_for_bit(synchronous: Path, data_dir: Path, tmp_path: Path) -> None:
    run = tmp_path / "run"
    result = run_meshrun(["train", *tiny(data_dir, run, **ASYNC)], tmp_path=tmp_path, env=held_env(tmp_path))
    assert "writing it in the background" in result.stderr and "(written in the background)" in result.stderr
    assert checkpoints(run) == checkpoints(synchronous) == ["step-00000002", "step-00000004", "step-00000006"]
    for name in checkpoints(run):
        verify(run / "checkpoints" / name)
        assert same_weights(run / "checkpoints" / name, synchronous / "checkpoints" / name)
    assert losses(run) == losses(synchronous)
    assert latest(run) == "step-00000006"


def test_a_kill_during_a_background_write_resumes_from_the_previous_checkpoint(
    synchronous: Path, data_dir: Path, tmp_path: Path
) -> None:
    run = tmp_path / "run"
    proc = start_meshrun(
        ["train", *tiny(data_dir, run, **ASYNC)], tmp_path=tmp_path, env=held_env(tmp_path, "step-00000004")
    )
    try:
        wait_for(lambda: held(tmp_path), timeout=240, what="the background write of step 4 on every rank")
    finally:
        kill_tree(proc.pid)  # SIGKILL: the shards of step 4 are on disk, its write not finished
    finish_meshrun(proc, check=False)
    assert latest(run) == "step-00000002" and checkpoints(run) == ["step-00000002"]
    assert not (run / "checkpoints" / "step-00000004.tmp" / MANIFEST).exists()
    resumed = run_meshrun(["train", *tiny(data_dir, run, **ASYNC)], tmp_path=tmp_path, env=held_env(tmp_path))
    assert "at step 2" in resumed.stderr, resumed.stderr[-3000:]
    assert same_weights(run, synchronous)
    assert losses(run) == losses(synchronous)


def test_preemption_waits_for_the_write_in_flight(data_dir: Path, tmp_path: Path) -> None:
    """SIGTERM while the write of a requested save (RUN_DIR/SAVE) is held: the stop waits for it
    (released only once the run says it waits), publishes it, then saves its own checkpoint
    synchronously. No interval saves: nothing else waits for the held write (2000 steps: the
    signal lands seconds before the end)."""
    run = tmp_path / "run"
    job = ["train", *tiny(data_dir, run, **ASYNC | {"train.steps": 2000, "checkpoint.interval": 0})]
    proc = start_meshrun(job, tmp_path=tmp_path, env=held_env(tmp_path, "step-*"))
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(iter(proc.stderr.readline, "")), daemon=True)  # type: ignore[union-attr]
    reader.start()
    try:
        wait_for(lambda: (run / "metrics.jsonl").exists(), timeout=240, what="training to start")
        (run / "SAVE").touch()
        wait_for(lambda: held(tmp_path), timeout=120, what="the background write of the requested save")
        requested = next(line for line in lines if "writing it in the background" in line).split()[3]
        os.kill(proc.pid, signal.SIGTERM)
        waiting = f"waiting for checkpoint {requested} to be written in the background"
        wait_for(lambda: any(waiting in line for line in lines), timeout=120, what="the stop to wait for the write")
        (tmp_path / "release").touch()
        code = proc.wait(timeout=120)
    finally:
        kill_tree(proc.pid)
        reader.join(timeout=10)
    err = "".join(lines)
    assert code == 75, err[-3000:]
    stopped_at = latest(run)
    assert stopped_at > requested and checkpoints(run) == [requested, stopped_at], err[-3000:]
    for name in checkpoints(run):
        verify(run / "checkpoints" / name)
    assert not list((run / "checkpoints").glob("*.tmp"))
    assert f"stop requested: checkpoint at step {int(stopped_at.split('-')[1])} written" in err


def test_a_background_write_that_fills_the_disk_is_one_line(data_dir: Path, tmp_path: Path) -> None:
    """Step 4's write meets a full disk in the background; the run stops at the latest when the
    next save (step 6) waits for it, before any metrics row after step 2 (log_interval 8)."""
    with tmpfs(tmp_path / "disk", "450k") as disk:
        run = disk / "run"
        settings = ASYNC | SMALL | {"train.steps": 8, "train.log_interval": 8, "train.global_batch": 4}
        result = run_meshrun(
            ["train", *tiny(data_dir, run, **settings)], tmp_path=tmp_path, env=held_env(tmp_path), check=False
        )
        assert result.returncode == 1, result.stderr[-3000:]
        assert result.stderr.splitlines()[-1] == (
            f"meshrun: error: no space left on {disk} while writing {run}/checkpoints/step-00000004.tmp; "
            "the last complete checkpoint is step 2"
        ), result.stderr[-3000:]
        assert "Traceback" not in result.stderr and "CheckpointException" not in result.stderr
        assert checkpoints(run) == ["step-00000002"] and latest(run) == "step-00000002"
        verify(run / "checkpoints" / "step-00000002")
        assert not list((run / "checkpoints").glob("*.tmp"))
