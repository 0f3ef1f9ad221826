"""The worker's training entry returns how the run ended (completed / stopped on request / failed)
and records it; `meshrun train` exits with that outcome's code (0 / 75 / 1), under torchrun too.
None of it looks at summary.json: a completed run whose summary.json is gone still exits 0."""

from __future__ import annotations

import contextlib
import os
import re
import signal
from pathlib import Path

import pytest
from conftest import descendants, finish_meshrun, meshrun_env, run_meshrun, start_meshrun, tiny, wait_for

from meshrun.config.schema import load_config
from meshrun.launcher.outcome import STOPPED_EXIT_CODE, Outcome, launcher_exit_code, read_record
from meshrun.training import worker as job

HERE = str(Path(__file__).parent)
# 4 steps of 4 microbatches on one process, 2 per rank with dp=2: a cue at forward 5 (or 3) lands in step 2
JOB = {"model.factory": "interrupting_gpt:build", "train.steps": 4, "checkpoint.at_end": False}


def steps_saved(run: Path) -> list[int]:
    return sorted(int(p.name.split("-")[1]) for p in (run / "checkpoints").glob("step-*"))


@pytest.fixture
def cue(monkeypatch: pytest.MonkeyPatch):
    """`cue(kind, after)`: the in-process model stops or fails at its `after`-th forward from now."""
    monkeypatch.syspath_prepend(HERE)
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    import interrupting_gpt

    def set_cue(kind: str, after: int) -> None:
        monkeypatch.setenv(f"MESHRUN_TEST_{kind}_AT", str(interrupting_gpt._calls["forward"] + after))

    return set_cue


def test_worker_returns_completed_and_records_it(cue, data_dir: Path, tmp_path: Path) -> None:
    cfg = load_config(None, [a.removeprefix("--set=") for a in tiny(data_dir, tmp_path / "run", **JOB)])
    assert job.run_worker(cfg) is Outcome.COMPLETED
    assert read_record(tmp_path / "run") is Outcome.COMPLETED
    (tmp_path / "run" / "summary.json").unlink()  # the outcome is not inferred from it
    assert job.run_worker(cfg) is Outcome.COMPLETED  # already at train.steps: nothing to do, still complete


def test_a_worker_with_nothing_to_do_leaves_the_run_as_it_was(cue, data_dir: Path, tmp_path: Path) -> None:
    """Workers started without meshrun's launcher (a torchrun by hand), which would have found the
    run complete first: no config.json, metrics, summary or tracker is rewritten."""
    run = tmp_path / "run"
    cfg = load_config(
        None, [a.removeprefix("--set=") for a in tiny(data_dir, run, **{**JOB, "checkpoint.at_end": True})]
    )
    assert job.run_worker(cfg) is Outcome.COMPLETED
    before = {p: p.read_bytes() for p in run.rglob("*") if p.is_file()}
    again = cfg.model_copy(update={"train": cfg.train.model_copy(update={"log_interval": 2})})
    assert job.run_worker(again) is Outcome.COMPLETED
    assert {p: p.read_bytes() for p in run.rglob("*") if p.is_file()} == before


def test_worker_returns_stopped_after_a_stop_signal_with_a_checkpoint(cue, data_dir: Path, tmp_path: Path) -> None:
    cfg = load_config(None, [a.removeprefix("--set=") for a in tiny(data_dir, tmp_path / "run", **JOB)])
    cue("SIGNAL", 5)  # SIGUSR1 during step 2: a lone process checkpoints at its end and stops
    assert job.run_worker(cfg) is Outcome.STOPPED
    assert read_record(tmp_path / "run") is Outcome.STOPPED
    assert steps_saved(tmp_path / "run") == [2]


def test_a_row_cut_short_by_a_crash_does_not_block_the_resume(cue, data_dir: Path, tmp_path: Path) -> None:
    """A run killed mid-write leaves half a metrics row: the resume drops it and logs on."""
    import json

    cfg = load_config(None, [a.removeprefix("--set=") for a in tiny(data_dir, tmp_path / "run", **JOB)])
    cue("SIGNAL", 5)
    assert job.run_worker(cfg) is Outcome.STOPPED
    with open(tmp_path / "run" / "metrics.jsonl", "a") as metrics:
        metrics.write('{"step": 3, "loss": 5.4')  # the crash
    assert job.run_worker(cfg) is Outcome.COMPLETED
    lines = (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(line)["step"] for line in lines if "loss" in json.loads(line)] == [1, 2, 3, 4]


def test_worker_records_failed_and_raises(cue, data_dir: Path, tmp_path: Path) -> None:
    cfg = load_config(None, [a.removeprefix("--set=") for a in tiny(data_dir, tmp_path / "run", **JOB)])
    cue("RAISE", 5)
    with pytest.raises(RuntimeError, match="failing on cue"):
        job.run_worker(cfg)
    assert read_record(tmp_path / "run") is Outcome.FAILED


@pytest.mark.parametrize(
    "recorded,torchrun_code,relayed,exit_code",
    [
        (Outcome.COMPLETED, 0, False, 0),
        (Outcome.COMPLETED, 1, True, 0),  # the stop came after the last step
        (Outcome.STOPPED, 0, False, STOPPED_EXIT_CODE),  # workers stopped on request exit 0
        (None, 143, True, 143),  # relayed before any worker could record: no checkpoint, so not 75
        (Outcome.FAILED, 1, False, 1),
        (Outcome.FAILED, 1, True, 1),
        (None, 0, False, 1),  # workers that exit 0 without an outcome did not complete
        (None, 3, False, 3),
        (Outcome.FAILED, -9, False, 128 + 9),  # torchrun killed by SIGKILL: 128 + the signal, not 247
    ],
)
def test_launcher_exit_code_follows_the_recorded_outcome(
    recorded: Outcome | None, torchrun_code: int, relayed: bool, exit_code: int
) -> None:
    assert launcher_exit_code(recorded, torchrun_code, stop_relayed=relayed) == exit_code


def test_launcher_acts_on_the_workers_outcome_under_torchrun(data_dir: Path, tmp_path: Path) -> None:
    """Two ranks: rank 1 asks to stop (exit 75, stopped; torchrun itself saw two workers exit 0), or
    raises (exit 1, failed). Completed is every other multi-rank test: exit 0 needs the record."""
    env = {"PYTHONPATH": HERE, "MESHRUN_TEST_ON_RANK": "1"}
    for cue, code, outcome in (("SIGNAL", STOPPED_EXIT_CODE, Outcome.STOPPED), ("RAISE", 1, Outcome.FAILED)):
        run = tmp_path / cue
        args = ["train", *tiny(data_dir, run, **{**JOB, "parallel.dp": 2, "train.steps": 5})]
        done = run_meshrun(
            args, tmp_path=tmp_path, env=meshrun_env(tmp_path, **env, **{f"MESHRUN_TEST_{cue}_AT": "3"}), check=False
        )
        assert done.returncode == code, done.stderr[-3000:]
        assert read_record(run) is outcome
    assert steps_saved(tmp_path / "SIGNAL") == [3]  # asked during step 2, agreed on at the end of step 3
    # the failure reads as two lines: which ranks torchrun saw fail, then the cause and where its traceback is
    log = tmp_path / "RAISE" / "logs" / "rank-1.log"
    # torchrun's line names the failed worker it found first (forked workers: meshrun.launcher.forked), rank 1
    # or rank 0 (its collective broken by rank 1's end): timing; the launcher's names the cause from the record
    agent, launcher = done.stderr.splitlines()[-2:]
    assert re.fullmatch(
        r"torchrun: workers failed: rank [01] exit 1 \(the failed worker torchrun found first; it stops the others\)",
        agent,
    ), done.stderr[-3000:]
    assert launcher == (
        f"meshrun: error: rank 1 failed: RuntimeError: interrupting_gpt: failing on cue at forward 3 (traceback: {log})"
    )
    assert "Traceback" not in done.stderr and "raise RuntimeError" in log.read_text()


def torchrun_started(launcher: int) -> bool:
    """torchrun's agent runs (so this launcher relays stop signals to it); its workers take
    seconds more to start, let alone train."""
    for pid in descendants(launcher):
        with contextlib.suppress(OSError):
            if b"meshrun.launcher.agent" in Path(f"/proc/{pid}/cmdline").read_bytes():
                return True
    return False


@pytest.mark.parametrize("moment", ["torchrun-starting", "torchrun-started"])
def test_a_stop_before_the_first_step_claims_no_checkpoint(moment: str, data_dir: Path, tmp_path: Path) -> None:
    """SIGTERM to the launcher as it starts torchrun, or once torchrun runs (the launcher relays
    it): no worker has trained, so no checkpoint was written; one line says so and the exit is
    128 + SIGTERM, not 75 (which promises a checkpoint)."""
    run = tmp_path / "run"
    proc = start_meshrun(["train", *tiny(data_dir, run, **{"parallel.dp": 2})], tmp_path=tmp_path)
    try:
        assert proc.stderr is not None
        while "starting 2 workers" not in (line := proc.stderr.readline()):
            assert line, "the launcher ended before starting torchrun"
        if moment == "torchrun-started":
            wait_for(lambda: torchrun_started(proc.pid), timeout=120, what="torchrun to start")
        os.kill(proc.pid, signal.SIGTERM)
    finally:
        done = finish_meshrun(proc, timeout=120, check=False)
    assert done.returncode == 128 + signal.SIGTERM, done.stderr[-3000:]
    said = [line for line in done.stderr.splitlines() if line.startswith("meshrun:")]
    assert said == [
        "meshrun: stopped by SIGTERM before training began: no checkpoint written; rerun the same command to start"
    ], done.stderr[-3000:]
    assert "Traceback" not in done.stderr and not (run / "checkpoints").exists()


def test_a_recorded_exit_code_reaches_the_launcher(tmp_path: Path) -> None:
    """A hang whose report could not be written records its line and 124 (launcher/hang.py): the
    launcher's last line and exit code; a code out of range in the record is no exit code."""
    from meshrun.launcher.outcome import read_error, write_record

    write_record(tmp_path, Outcome.FAILED, error="rank 1 made no progress", exit_code=124)
    error = read_error(tmp_path)
    assert error is not None and str(error) == "rank 1 made no progress" and error.exit_code == 124
    (tmp_path / "outcome.json").write_text('{"outcome": "failed", "error": "x", "exit_code": 0}')
    assert getattr(read_error(tmp_path), "exit_code", None) == 1
