"""The one atomic-write helper: old bytes or new, never a fragment; a full disk is one line."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from meshrun.errors import RunError
from meshrun.files.atomic import atomic_target, temporary_name, write_atomic


def test_write_replaces_and_leaves_no_temporary(tmp_path: Path) -> None:
    target = tmp_path / "config.json"
    target.write_text("old")
    write_atomic(target, "new")
    assert target.read_text() == "new"
    assert [p.name for p in tmp_path.iterdir()] == ["config.json"]


def test_failed_writer_keeps_the_old_file(tmp_path: Path) -> None:
    target = tmp_path / "summary.json"
    target.write_text("old")
    with pytest.raises(ValueError), atomic_target(target) as tmp:
        tmp.write_text("half")
        raise ValueError("writer failed")
    assert target.read_text() == "old"
    assert [p.name for p in tmp_path.iterdir()] == ["summary.json"]


def test_temporary_names_are_unique_per_call(tmp_path: Path) -> None:
    names = {temporary_name(tmp_path / "latest") for _ in range(100)}
    assert len(names) == 100


def test_full_disk_is_one_line_and_keeps_the_old_file(small_disk: Path) -> None:
    target = small_disk / "metrics.jsonl"
    target.write_text("row 1\n")
    with pytest.raises(RunError) as err:
        write_atomic(target, b"x" * 200_000)
    message = str(err.value)
    assert message == f"no space left on {small_disk} while writing {target}", message
    assert target.read_text() == "row 1\n"
    assert [p.name for p in small_disk.iterdir()] == ["metrics.jsonl"]


def test_a_new_file_is_never_written_over(tmp_path: Path) -> None:
    """replace=False: an output that appeared while it was being written (another job's) stays."""
    target = tmp_path / "plan.yaml"
    with pytest.raises(FileExistsError), atomic_target(target, replace=False) as tmp:
        tmp.write_text("ours")
        target.write_text("theirs")
    assert target.read_text() == "theirs"
    assert [p.name for p in tmp_path.iterdir()] == ["plan.yaml"]
    write_atomic(tmp_path / "new.yaml", "ours", replace=False)
    assert (tmp_path / "new.yaml").read_text() == "ours"


@pytest.mark.parametrize("umask", [0o022, 0o027])
def test_a_written_file_gets_the_usual_mode_whatever_the_writer_gave_it(tmp_path: Path, umask: int) -> None:
    """safetensors' save_file makes its file 0600: an export was readable by its owner alone. The
    file gets what `open` gives a new one under the umask (0644 under 022), like every other."""
    import torch
    from safetensors.torch import save_file

    old = os.umask(umask)
    try:
        with atomic_target(tmp_path / "model.safetensors") as tmp:
            save_file({"w": torch.zeros(2)}, str(tmp))
        write_atomic(tmp_path / "meta.json", "{}")
    finally:
        os.umask(old)
    for name in ("model.safetensors", "meta.json"):
        assert stat.S_IMODE((tmp_path / name).stat().st_mode) == 0o666 & ~umask, name
