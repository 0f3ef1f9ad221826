"""Tracking, proven on real files: the wandb offline run, metrics.jsonl, summary.json, loss.png.

Every job goes through the real CLI (`run_meshrun`). The wandb run is read back from its
`.wandb` file (tests/wandb_files.py), never from a mock, and compared with metrics.jsonl.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import meshrun_env, read_metrics, run_meshrun, tiny
from wandb_files import offline_runs, read_run

SECRET = "sk-secret-3f9c2e7b41d08a6512ce77"
STEPS, EVAL_INTERVAL = 4, 2
TRAIN_KEYS = {"loss", "lr", "grad_norm", "tokens_per_s", "tflops", "step_time_s", "memory_gb", "time/rank0/compute_s"}
SUMMARY_KEYS = ("steps", "final_loss", "final_val_loss", "tokens_per_s", "tflops", "peak_memory_gb", "run_dir")
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def env_for(tmp_path: Path, **extra: str) -> dict[str, str]:
    """meshrun_env with an empty HOME (no ~/.netrc, nothing written to the real home)."""
    home = tmp_path / "home"
    home.mkdir(exist_ok=True)
    return meshrun_env(tmp_path, HOME=str(home), **extra)


def train(data_dir: Path, tmp_path: Path, *, env: dict[str, str], timeout: float = 120, **overrides: object):
    """A tiny job with wandb offline (unless overridden); returns (run_dir, completed process)."""
    run_dir = tmp_path / "run"
    settings = {"tracker.mode": "offline", "train.steps": STEPS, "train.eval_interval": EVAL_INTERVAL, **overrides}
    proc = run_meshrun(["train", *tiny(data_dir, run_dir, **settings)], tmp_path=tmp_path, env=env, timeout=timeout)
    return run_dir, proc


def metrics_by_step(run_dir: Path) -> dict[int, dict]:
    """metrics.jsonl merged per step (a validation row shares its step with a train row), without
    the file's own wall-clock stamp (wandb keeps its own, _timestamp)."""
    merged: dict[int, dict] = {}
    for row in read_metrics(run_dir):
        del row["time"]
        merged.setdefault(row.pop("step"), {}).update(row)
    return merged


def assert_file_matches_jsonl(run_dir: Path) -> None:
    """The single offline run's history holds every metrics.jsonl value, exactly, at its step."""
    [wandb_file] = offline_runs(run_dir)
    history = read_run(wandb_file).rows_by_step()
    expected = metrics_by_step(run_dir)
    assert sorted(history) == sorted(expected) == list(range(1, STEPS + 1))
    for step, row in expected.items():
        assert {k: history[step].get(k) for k in row} == row, f"step {step}"


@pytest.fixture(scope="module")
def offline_job(data_dir: Path, tmp_path_factory: pytest.TempPathFactory):
    """One dp=1 job with wandb offline and a secret API key in its environment."""
    tmp_path = tmp_path_factory.mktemp("offline")
    env = env_for(tmp_path, WANDB_MODE="offline", WANDB_API_KEY=SECRET)
    run_dir, proc = train(data_dir, tmp_path, env=env, **{"metrics.plots": True})
    return tmp_path, run_dir, proc


def test_wandb_file_holds_the_logged_metrics(offline_job) -> None:
    _, run_dir, _ = offline_job
    rows = metrics_by_step(run_dir)
    for step, row in rows.items():
        assert row.keys() >= TRAIN_KEYS, f"step {step} lacks {TRAIN_KEYS - row.keys()}"
        assert ("val_loss" in row) == (step % EVAL_INTERVAL == 0), f"val_loss at step {step}"
    assert_file_matches_jsonl(run_dir)


def test_wandb_file_holds_the_resolved_config(offline_job) -> None:
    _, run_dir, _ = offline_job
    [wandb_file] = offline_runs(run_dir)
    run = read_run(wandb_file)
    saved = json.loads((run_dir / "config.json").read_text())
    assert run.config == saved
    assert run.config["model"]["dim"] == 32 and run.config["train"]["steps"] == STEPS
    assert run.config["train"]["lr"] == saved["train"]["lr"] > 0
    assert run.config["run_dir"] == str(run_dir)
    assert run.project == "meshrun" and run.display_name == run_dir.name


def test_wandb_summary_is_the_job_summary(offline_job) -> None:
    """Job-wide numbers, not the last window's (which the final history row would leave there)."""
    _, run_dir, _ = offline_job
    summary = json.loads((run_dir / "summary.json").read_text())
    [wandb_file] = offline_runs(run_dir)
    wandb_summary = read_run(wandb_file).summary
    assert {key: wandb_summary.get(key) for key in summary} == summary


def test_reader_agrees_with_wandb_own_inspector(offline_job) -> None:
    """Cross-check tests/wandb_files.py against `wandb leet inspect --json` on the same file."""
    _, run_dir, _ = offline_job
    [wandb_file] = offline_runs(run_dir)
    wandb_cli = Path(sys.executable).with_name("wandb")
    out = subprocess.run(
        [str(wandb_cli), "leet", "inspect", "--json", str(wandb_file)],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    ).stdout
    theirs = [json.loads(line)["history"]["item"] for line in out.splitlines() if '"type":"history"' in line]
    assert theirs == read_run(wandb_file).history


def test_one_offline_run_and_the_run_dir_files(offline_job) -> None:
    _, run_dir, _ = offline_job
    assert len(list((run_dir / "wandb").glob("offline-run-*"))) == 1
    for name in ("config.json", "metrics.jsonl", "summary.json"):
        assert (run_dir / name).stat().st_size > 0, name
    assert json.loads((run_dir / "config.json").read_text())["model"]["dim"] == 32
    assert set(SUMMARY_KEYS) <= json.loads((run_dir / "summary.json").read_text()).keys()
    png = (run_dir / "loss.png").read_bytes()
    assert png.startswith(PNG_MAGIC) and len(png) > 1000


def test_secret_key_is_never_written(offline_job) -> None:
    tmp_path, _, proc = offline_job
    for needle in (SECRET, SECRET[-12:]):
        assert needle not in proc.stdout and needle not in proc.stderr
        leaks = [p for p in tmp_path.rglob("*") if p.is_file() and needle.encode() in p.read_bytes()]
        assert not leaks, f"API key found in {leaks}"


def test_rank0_prints_progress_and_summary_without_wandb_banners(offline_job) -> None:
    _, run_dir, proc = offline_job
    for step in range(1, STEPS + 1):
        assert len(re.findall(rf"^\[meshrun\] step {step}/{STEPS} \| loss ", proc.stderr, re.M)) == 1, proc.stderr
    assert len(re.findall(rf"^\[meshrun\] step \d/{STEPS} \| val loss ", proc.stderr, re.M)) == STEPS // EVAL_INTERVAL
    summary = proc.stderr.split("[meshrun] summary", 1)[1]
    for key in SUMMARY_KEYS:
        assert re.search(rf"^\s*{key}: \S", summary, re.M), f"summary lacks {key}:\n{summary}"
    assert str(run_dir) in summary
    assert "wandb:" not in proc.stdout + proc.stderr  # quiet wandb: no banner, no hint lines


def test_online_without_a_key_falls_back_to_offline(data_dir: Path, tmp_path: Path) -> None:
    env = env_for(tmp_path)
    env.pop("WANDB_MODE", None)
    env.pop("NETRC", None)
    run_dir, proc = train(data_dir, tmp_path, env=env, **{"tracker.mode": "online"})
    notes = [line for line in proc.stderr.splitlines() if "API key" in line]
    assert len(notes) == 1 and "offline" in notes[0], proc.stderr
    assert "wandb:" not in proc.stderr.replace(notes[0], "")
    assert len(offline_runs(run_dir)) == 1
    assert_file_matches_jsonl(run_dir)


def test_wandb_mode_env_overrides_the_config(data_dir: Path, tmp_path: Path) -> None:
    run_dir, _ = train(data_dir, tmp_path, env=env_for(tmp_path, WANDB_MODE="disabled"))
    assert not (run_dir / "wandb").exists()
    assert not (run_dir / "loss.png").exists()  # metrics.plots: false (tiny's)
    assert len(read_metrics(run_dir)) == STEPS + STEPS // EVAL_INTERVAL


def test_wandb_env_variables_are_honoured(data_dir: Path, tmp_path: Path) -> None:
    wandb_dir = tmp_path / "elsewhere"
    wandb_dir.mkdir()
    env = env_for(
        tmp_path, WANDB_MODE="offline", WANDB_PROJECT="envproject", WANDB_NAME="envname", WANDB_DIR=str(wandb_dir)
    )
    run_dir, _ = train(data_dir, tmp_path, env=env, **{"tracker.project": "cfgproject", "tracker.name": "cfgname"})
    assert not (run_dir / "wandb").exists()
    [wandb_file] = offline_runs(wandb_dir)
    run = read_run(wandb_file)
    assert (run.project, run.display_name) == ("envproject", "envname")


def test_fp16_logs_loss_scale_and_skipped_steps(data_dir: Path, tmp_path: Path) -> None:
    run_dir, _ = train(data_dir, tmp_path, env=env_for(tmp_path), precision="fp16")
    rows = [row for row in read_metrics(run_dir) if "loss" in row]
    assert len(rows) == STEPS and all({"loss_scale", "skipped_steps"} <= row.keys() for row in rows)
    assert "skipped_steps" in json.loads((run_dir / "summary.json").read_text())
    assert_file_matches_jsonl(run_dir)


def test_two_ranks_make_one_wandb_run(data_dir: Path, tmp_path: Path) -> None:
    run_dir, proc = train(data_dir, tmp_path, env=env_for(tmp_path), timeout=240, **{"parallel.dp": 2})
    assert len(list((run_dir / "wandb").glob("offline-run-*"))) == 1
    assert_file_matches_jsonl(run_dir)
    [wandb_file] = offline_runs(run_dir)
    assert read_run(wandb_file).config["parallel"]["dp"] == 2
    # Only rank 0 reports: one progress line per step, one summary.
    assert len(re.findall(rf"\[meshrun\] step 1/{STEPS} \| loss ", proc.stderr)) == 1
    assert proc.stderr.count("[meshrun] summary") == 1


def test_a_failing_tracker_is_dropped_and_the_others_keep_logging(tmp_path: Path) -> None:
    from meshrun.metrics.trackers import JsonlTracker, MultiTracker

    class ServiceGone:  # what wandb.Run.log raises once its service process was killed
        def log(self, row, step):
            raise ConnectionError("Connection lost")

        summarize = close = log

    warnings: list[str] = []
    trackers = MultiTracker(
        [ServiceGone(), JsonlTracker(tmp_path / "metrics.jsonl")], run_dir=tmp_path, warn=warnings.append
    )
    for step in (1, 2):
        trackers.log({"loss": 1.0 / step}, step)
    trackers.close()
    assert len(warnings) == 1 and "ServiceGone failed (ConnectionError: Connection lost)" in warnings[0]
    assert [json.loads(line)["step"] for line in (tmp_path / "metrics.jsonl").read_text().splitlines()] == [1, 2]


UNREACHABLE = "http://127.0.0.1:9"  # the discard port on loopback: refused at once, nothing leaves the machine


def test_online_without_a_network_waits_briefly_then_logs_offline(data_dir: Path, tmp_path: Path) -> None:
    env = env_for(tmp_path, WANDB_BASE_URL=UNREACHABLE, WANDB_API_KEY="0123456789abcdef" * 2 + "01234567")
    started = time.monotonic()
    run_dir, proc = train(data_dir, tmp_path, env=env, **{"tracker.mode": "online", "tracker.init_timeout": 3})
    assert time.monotonic() - started < 80  # wandb's own default waits 90 s before failing
    warnings = [line for line in proc.stderr.splitlines() if "logging offline" in line]
    assert len(warnings) == 1 and "warning: wandb online failed within 3 s" in warnings[0], proc.stderr
    assert "wandb sync" in warnings[0] and "Traceback" not in proc.stderr
    assert len(offline_runs(run_dir)) == 1  # the run to sync later
    assert_file_matches_jsonl(run_dir)


def test_credentials_are_found_by_wandb_itself(tmp_path: Path) -> None:
    """An identity token file is a credential (no API key): online is attempted, not skipped."""
    token = tmp_path / "token"
    token.write_text("header.payload.signature\n")
    probe = (
        "from meshrun.config.schema import TrackerConfig; from meshrun.metrics.trackers import wandb_mode; "
        "print(wandb_mode(TrackerConfig(mode='online')))"
    )
    env = env_for(tmp_path, WANDB_BASE_URL=UNREACHABLE)
    found = subprocess.run(
        [sys.executable, "-c", probe],
        env={**env, "WANDB_IDENTITY_TOKEN_FILE": str(token)},
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert found.stdout.strip() == "('online', None)", found.stderr
    missing = subprocess.run(
        [sys.executable, "-c", probe], env=env, capture_output=True, text=True, timeout=60, check=False
    )
    assert missing.stdout.startswith("('offline', 'wandb: no API key found"), missing.stderr
