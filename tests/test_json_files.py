"""JSON from elsewhere: too large, too deep or not JSON is a ValueError each caller words as one line."""

from __future__ import annotations

from pathlib import Path

import pytest

from meshrun.files.json_reader import read_json


def test_a_deeply_nested_file_is_a_value_error(tmp_path: Path) -> None:
    deep = tmp_path / "manifest.json"
    deep.write_text("[" * 200_000 + "]" * 200_000)  # json.loads raises RecursionError, not ValueError
    with pytest.raises(ValueError, match="nested too deeply"):
        read_json(deep)


def test_a_file_over_the_limit_is_refused_unread(tmp_path: Path) -> None:
    big = tmp_path / "config.json"
    with big.open("wb") as f:  # sparse: no bytes written, the size alone
        f.truncate(2**20 + 1)
    with pytest.raises(ValueError, match="over the 1 MiB"):
        read_json(big, limit=2**20)


def test_json_that_is_not_json_or_not_utf8_is_a_value_error(tmp_path: Path) -> None:
    for name, data in (("torn.json", b'{"step": 4,'), ("latin1.json", b'{"name": "caf\xe9"}')):
        (tmp_path / name).write_bytes(data)
        with pytest.raises(ValueError):
            read_json(tmp_path / name)
    (tmp_path / "ok.json").write_text('{"step": 4}')
    assert read_json(tmp_path / "ok.json") == {"step": 4}
