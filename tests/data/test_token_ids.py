"""Token ids are read once: a file's largest id is read on first open and cached outside the data
(by path, size and mtime), so a second launch reads the cache, and a changed file is read again."""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest
from conftest import tiny
from test_formats import clean_env, write_nanogpt  # noqa: F401 (registers the clean_env fixture)

from meshrun import cli


def dry_run(data: Path, tmp_path: Path) -> int:
    return cli.main(["train", *tiny(data, tmp_path / "run", **{"data.format": "nanogpt"}), "--dry-run"])


@pytest.mark.usefixtures("clean_env")
def test_largest_ids_are_cached_outside_the_data(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    data = write_nanogpt(tmp_path / "nano", np.arange(300) % 256, np.arange(100))
    before = sorted((p.name, p.stat().st_mtime_ns) for p in data.iterdir())
    assert dry_run(data, tmp_path) == 0
    assert sorted((p.name, p.stat().st_mtime_ns) for p in data.iterdir()) == before  # nothing written beside them
    entries = list((tmp_path / "cache" / "meshrun" / "token-ranges").iterdir())
    assert len(entries) == 2  # train.bin and val.bin
    (train_entry,) = [e for e in entries if "train.bin" in json.loads(e.read_text())["key"]]
    cached = json.loads(train_entry.read_text())
    train_entry.write_text(json.dumps({**cached, "high": 999}))  # a second launch believes the cache...
    capsys.readouterr()
    assert dry_run(data, tmp_path) == 2
    assert "train.bin holds token id 999 but the model has 256 tokens" in capsys.readouterr().err
    stat = (data / "train.bin").stat()
    os.utime(data / "train.bin", ns=(stat.st_atime_ns, stat.st_mtime_ns + 1_000_000))
    assert dry_run(data, tmp_path) == 0  # ...until the file changes: then it reads the ids again
