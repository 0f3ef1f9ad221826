"""A run directory has one history: a rerun continues the run it holds, finds it complete, or is
refused in one line; a rerun that does nothing or is refused changes no byte of the folder."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
from conftest import meshrun_in_process, tiny, train_job

from meshrun.config.schema import Config
from meshrun.launcher.rerun import RESUMABLE, changed_keys

STEPS = {"train.steps": 3, "checkpoint.interval": 0}


def hashes(run: Path) -> dict[str, str]:
    """Every file of the run directory (the job lock too), by content."""
    return {str(p.relative_to(run)): hashlib.sha256(p.read_bytes()).hexdigest() for p in run.rglob("*") if p.is_file()}


@pytest.fixture(scope="module")
def finished(data_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A finished one-process run with a final checkpoint at step 3."""
    run = tmp_path_factory.mktemp("rerun") / "run"
    train_job(tiny(data_dir, run, **STEPS), tmp_path=run.parent)
    return run


def test_every_resumable_key_is_a_config_key() -> None:
    """The list names real keys or sections, so a renamed key cannot silently become strict or loose."""
    dumped = Config().model_dump()
    for key in RESUMABLE:
        section: object = dumped
        for part in key.split("."):
            assert isinstance(section, dict) and part in section, key
            section = section[part]


def test_only_keys_outside_the_list_count_as_changes() -> None:
    before = Config()
    after = before.model_copy(
        update={
            "train": before.train.model_copy(update={"steps": 99, "lr": 0.5}),
            "parallel": before.parallel.model_copy(update={"dp": 2}),
            "run_dir": "elsewhere/../runs/default",
        }
    )
    assert changed_keys(before, after) == {"train.lr": (before.train.lr, 0.5)}


def test_a_finished_run_rerun_in_another_layout_changes_no_byte(finished: Path, data_dir: Path) -> None:
    """Decided in the launcher: no worker starts, no config.json, tracker or record is rewritten."""
    before = hashes(finished)
    other = {**STEPS, "parallel.dp": 2, "train.micro_batch": 1, "tracker.backends": '["jsonl"]'}
    result = train_job(tiny(data_dir, finished, **other), tmp_path=finished.parent)
    assert "run already complete" in result.stderr and "step-00000003 is at step 3" in result.stderr
    assert "starting" not in result.stderr, result.stderr
    assert hashes(finished) == before


def test_a_rerun_that_changes_the_training_is_refused_naming_the_keys(finished: Path, data_dir: Path) -> None:
    before = hashes(finished)
    other = {**STEPS, "train.steps": 6, "train.lr": 0.01, "train.seed": 7}
    result = meshrun_in_process(["train", *tiny(data_dir, finished, **other)], tmp_path=finished.parent, check=False)
    assert result.returncode == 2 and result.stderr.count("\n") == 1, result.stderr
    assert "train.lr is " in result.stderr and "there, 0.01 here" in result.stderr
    assert "train.seed is 1337 there, 7 here" in result.stderr
    assert "train.steps" not in result.stderr and "--set run_dir=NEW" in result.stderr
    assert hashes(finished) == before


def test_a_finished_run_without_a_checkpoint_is_not_trained_over(data_dir: Path, tmp_path: Path) -> None:
    run = tmp_path / "run"
    no_checkpoint = {**STEPS, "checkpoint.at_end": False}
    train_job(tiny(data_dir, run, **no_checkpoint), tmp_path=tmp_path)
    assert json.loads((run / "summary.json").read_text())["steps"] == 3 and not (run / "checkpoints").exists()
    before = hashes(run)
    result = meshrun_in_process(["train", *tiny(data_dir, run, **no_checkpoint)], tmp_path=tmp_path, check=False)
    assert result.returncode == 2 and result.stderr.count("\n") == 1, result.stderr
    assert "no checkpoint to continue from" in result.stderr and "--set run_dir=NEW" in result.stderr
    assert hashes(run) == before


def test_a_finished_run_whose_last_checkpoint_is_older_is_complete(data_dir: Path, tmp_path: Path) -> None:
    """checkpoint.at_end off: the newest checkpoint (step 2) is older than the run's end (step 3);
    the summary says it finished, so a rerun trains nothing again and changes no byte."""
    run = tmp_path / "run"
    settings = {"train.steps": 3, "checkpoint.interval": 2, "checkpoint.at_end": False}
    train_job(tiny(data_dir, run, **settings), tmp_path=tmp_path)
    assert [p.name for p in (run / "checkpoints").glob("step-*")] == ["step-00000002"]
    before = hashes(run)
    result = train_job(tiny(data_dir, run, **settings), tmp_path=tmp_path)
    assert "run already complete: its summary.json records step 3" in result.stderr, result.stderr
    assert hashes(run) == before
