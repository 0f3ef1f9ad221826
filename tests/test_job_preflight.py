"""Preflight that touches the filesystem: a run_dir that cannot be written and a data folder that
cannot be read are one-line errors (exit 2) before any worker starts. The paths fail for root
too (tests run as root in CI, where permission bits are not enforced)."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
from conftest import meshrun_env, run_meshrun, tiny


def refused(args: list[str], tmp_path: Path) -> str:
    result = run_meshrun(args, tmp_path=tmp_path, timeout=120, check=False)
    assert result.returncode == 2 and result.stderr.count("\n") == 1, result.stderr
    assert "starting" not in result.stderr  # no worker was spawned
    return result.stderr


def unreadable_file(tmp_path: Path) -> Path:
    """A regular file this process cannot read: mode 000 for a normal user; for root, a
    write-only sysfs attribute (the kernel refuses to open it for reading, whoever asks)."""
    if os.geteuid() != 0:
        path = tmp_path / "secret"
        path.write_bytes(b"x" * 4096)
        path.chmod(0)
        return path
    for candidate in [Path("/sys/bus/pci/rescan"), *sorted(Path("/sys/bus").glob("*/uevent"))]:
        try:
            candidate.open("rb").close()
        except PermissionError:
            return candidate
        except OSError:
            continue
    pytest.fail("no unreadable file found: as root this needs a write-only file in /sys (is /sys mounted?)")


@pytest.mark.parametrize("where", ["under_a_file", "in_proc"])
def test_unwritable_run_dir_is_refused_before_spawning(where: str, data_dir: Path, tmp_path: Path) -> None:
    (tmp_path / "plain_file").write_text("a file, not a folder\n")
    run_dir = tmp_path / "plain_file" / "run" if where == "under_a_file" else Path("/proc/self/meshrun-run")
    error = refused(["train", *tiny(data_dir, run_dir)], tmp_path)
    assert f"run_dir {run_dir}" in error and ("plain_file" in error or "not writable" in error)


def test_unreadable_data_dir_is_refused_before_spawning(data_dir: Path, tmp_path: Path) -> None:
    data = tmp_path / "data"
    shutil.copytree(data_dir, data)
    (data / "val-00000.bin").unlink()
    (data / "val-00000.bin").symlink_to(unreadable_file(tmp_path))
    error = refused(["train", *tiny(data_dir=data, run_dir=tmp_path / "run")], tmp_path)
    assert f"data.dir {data} is not readable" in error and "val-00000.bin" in error
    assert not (tmp_path / "run").exists()


def test_dry_run_warns_when_a_rank_needs_more_memory_than_this_machine(data_dir: Path, tmp_path: Path) -> None:
    """Within the absolute bound but beyond this host: --dry-run says so (and still exits 0); a
    tiny model gets no warning."""
    host = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    if host > 2**40:
        pytest.skip("a host with over 1 TiB of memory: the model that exceeds it is past the 4 TiB bound")
    # embedding + head = 2 x vocab x dim(32) parameters at 16 bytes each (weights, grads, AdamW): ~2x the host
    vocab = 2 * host // (16 * 2 * 32)
    env = {"CUDA_VISIBLE_DEVICES": ""}  # the host's memory is what one rank has
    for size, warned in ((vocab, True), (256, False)):
        args = ["train", "--dry-run", *tiny(data_dir, tmp_path / "run", **{"model.vocab_size": size})]
        result = run_meshrun(args, tmp_path=tmp_path, timeout=120, env=meshrun_env(tmp_path, **env))
        assert ("warning: pipeline rank 0 needs ~" in result.stdout) is warned, result.stdout[-2000:]
        assert "this host's" in result.stdout or not warned
