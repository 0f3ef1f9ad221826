"""A full disk mid-run: one line naming the device, the file and the checkpoint a rerun resumes
from; every file written before it stays whole, and the same command works once there is room."""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

import pytest
from conftest import meshrun_env, run_meshrun, tiny, tmpfs

from meshrun.checkpoint.dcp import verify
from meshrun.checkpoint.paths import complete_checkpoints
from meshrun.metrics.record import read_metrics_rows

# one checkpoint of this model is ~300 KB (model + Adam state): two do not fit in 450 KB
SMALL = {"model.num_layers": 1, "model.dim": 16, "train.global_batch": 2, "checkpoint.keep": 5}


def _fill(disk: Path) -> Path:
    """Take every free byte of `disk`."""
    filler = disk / "filler"
    with contextlib.suppress(OSError), filler.open("wb") as f:  # ends when a write (or the close) fails
        while True:
            f.write(b"\0" * 4096)
            f.flush()
    return filler


@pytest.mark.parametrize("dp", [1, 2], ids=["one-process", "torchrun-dp2"])
def test_a_checkpoint_that_fills_the_disk_is_one_line(dp: int, data_dir: Path, tmp_path: Path) -> None:
    """dp 2: DCP hands every rank a CheckpointException wrapping the rank's OSError."""
    with tmpfs(tmp_path / "disk", "450k") as disk:
        run = disk / "run"
        settings = {"train.steps": 4, "checkpoint.interval": 2, "parallel.dp": dp, "train.global_batch": 2 * dp}
        result = run_meshrun(["train", *tiny(data_dir, run, **SMALL | settings)], tmp_path=tmp_path, check=False)
        assert result.returncode == 1, result.stderr
        error = (
            f"meshrun: error: no space left on {disk} while writing {run}/checkpoints/step-00000004.tmp; "
            "the last complete checkpoint is step 2"
        )
        # under torchrun the workers say it too (their lines may interleave); the launcher repeats it last
        assert result.stderr.splitlines()[-1] == error, result.stderr[-3000:]
        assert "Traceback" not in result.stderr
        assert "CheckpointException" not in result.stderr and "OSError" not in result.stderr
        assert [p.name for p in complete_checkpoints(run)] == ["step-00000002"]
        verify(run / "checkpoints" / "step-00000002")  # whole: sizes and checksums as saved
        assert (run / "checkpoints" / "latest").read_text() == "step-00000002\n"
        assert not list((run / "checkpoints").glob("*.tmp"))  # the partial save went, its space back


def test_a_resume_that_cannot_write_config_json_keeps_the_old_one(data_dir: Path, tmp_path: Path) -> None:
    with tmpfs(tmp_path / "disk", "1m") as disk:
        run = disk / "run"
        run_meshrun(["train", *tiny(data_dir, run, **SMALL, **{"train.steps": 2})], tmp_path=tmp_path)
        before = (run / "config.json").read_bytes()
        filler = _fill(disk)
        os.truncate(filler, filler.stat().st_size - 4096)  # one page: the run_dir lock's owner record fits
        longer = ["train", *tiny(data_dir, run, **SMALL, **{"train.steps": 4})]
        result = run_meshrun(longer, tmp_path=tmp_path, check=False)
        assert result.returncode == 1, result.stderr
        assert result.stderr.splitlines()[-1].startswith(
            f"meshrun: error: no space left on {disk} while writing {run}/config.json"
        ), result.stderr[-3000:]
        assert (run / "config.json").read_bytes() == before
        filler.unlink()
        resumed = run_meshrun(longer, tmp_path=tmp_path)
        assert "resumed from" in resumed.stderr and "step 2" in resumed.stderr
        assert [p.name for p in complete_checkpoints(run)][-1] == "step-00000004"


def test_a_metrics_row_that_meets_a_full_disk_is_one_line(data_dir: Path, tmp_path: Path) -> None:
    """The disk fills between steps (the model does it): the next metrics.jsonl row that needs a
    new page fails; the run says so in one line, and the rows written before stay readable."""
    with tmpfs(tmp_path / "disk", "1m") as disk:
        run = disk / "run"
        settings = {"train.steps": 60, "checkpoint.interval": 60, "model.factory": "disk_filling_gpt:build"}
        env = meshrun_env(tmp_path, PYTHONPATH=str(Path(__file__).parent / "training"), FILL_DISK=str(disk / "filler"))
        result = run_meshrun(
            ["train", *tiny(data_dir, run, **SMALL | settings)], tmp_path=tmp_path, env=env, check=False
        )
        assert result.returncode == 1, result.stderr[-3000:]
        assert result.stderr.splitlines()[-1] == (
            f"meshrun: error: no space left on {disk} while writing {run}/metrics.jsonl; no checkpoint is complete yet"
        ), result.stderr[-3000:]
        assert "Traceback" not in result.stderr
        rows = read_metrics_rows(run / "metrics.jsonl")  # as report reads it: a torn last row skipped
        assert len(rows) >= 2 and [row["step"] for row in rows] == list(range(1, len(rows) + 1))
