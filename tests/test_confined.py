"""Paths read from files stay in the file's folder: `..`, absolute paths and symlinks out are refused."""

from __future__ import annotations

from pathlib import Path

import pytest

from meshrun.errors import ConfigError
from meshrun.files.confined import confined


def test_entries_inside_the_folder_resolve(tmp_path: Path) -> None:
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "a.bin").write_bytes(b"x")
    (tmp_path / "link.bin").symlink_to(tmp_path / "sub" / "a.bin")  # a link that stays inside is fine
    source = tmp_path / "index.json"
    assert confined(tmp_path, "sub/a.bin", source=source) == (tmp_path / "sub" / "a.bin").resolve()
    assert confined(tmp_path, "link.bin", source=source) == (tmp_path / "sub" / "a.bin").resolve()
    assert confined(tmp_path, "sub/../sub/a.bin", source=source) == (tmp_path / "sub" / "a.bin").resolve()


@pytest.mark.parametrize("entry", ["../../../../etc/passwd", "/etc/passwd", "sub/../../x", "out.bin", "", 3])
def test_entries_leaving_the_folder_are_refused(tmp_path: Path, entry: object) -> None:
    folder = tmp_path / "model"
    (folder / "sub").mkdir(parents=True)
    (folder / "out.bin").symlink_to("/etc/passwd")
    source = folder / "model.safetensors.index.json"
    with pytest.raises(ConfigError) as err:
        confined(folder, entry, source=source)  # type: ignore[arg-type] - files hold any JSON value
    line = str(err.value)
    assert "\n" not in line and str(source) in line and repr(entry) in line


def test_a_wider_trusted_folder_admits_links_into_it(tmp_path: Path) -> None:
    """A Hugging Face hub cache: snapshots/REV/file links into the repo's blobs/."""
    repo = tmp_path / "models--org--name"
    (repo / "blobs").mkdir(parents=True)
    (repo / "blobs" / "abc123").write_bytes(b"x")
    snapshot = repo / "snapshots" / "rev"
    snapshot.mkdir(parents=True)
    (snapshot / "model.safetensors").symlink_to("../../blobs/abc123")
    source = snapshot / "model.safetensors.index.json"
    with pytest.raises(ConfigError, match="leads outside"):
        confined(snapshot, "model.safetensors", source=source)
    assert confined(snapshot, "model.safetensors", source=source, within=repo) == (repo / "blobs" / "abc123").resolve()
    with pytest.raises(ConfigError, match="leads outside"):
        confined(snapshot, "../../../x", source=source, within=repo)
