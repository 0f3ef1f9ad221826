"""Token ids are checked once against what the data claims: a meta.json whose dtype lies while
the sizes agree, or ids beyond what was prepared, are refused before any worker (they were an
IndexError in one); a file's largest id is read on first open and cached outside the data (by
path, size and mtime), so a second launch reads the cache, and a changed file is read again."""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest
from conftest import tiny
from test_formats import (  # noqa: F401 (registers the clean_env and no_workers fixtures)
    VOCAB,
    _copy,
    _pairs,
    assert_refused,
    clean_env,
    no_workers,
    write_nanogpt,
)

from meshrun import cli


def _relabelled(folder: Path, tmp: Path, *, stored: str, said: str, recorded: bool = True) -> Path:
    """A copy whose shards hold the ids as `stored` while meta.json says `said`, the sizes agreeing."""

    def edit(meta: dict) -> None:
        for info in meta["splits"].values():
            for shard in info["shards"]:
                path = tmp / "inside" / folder.name / shard["file"]
                raw = np.fromfile(path, dtype=meta["dtype"]).astype(stored).tobytes()
                path.write_bytes(raw[: len(raw) // 4 * 4])  # whole 4-byte words: both dtypes read whole tokens
                shard["tokens"] = len(raw) // 4 * 4 // np.dtype(said).itemsize
                if not recorded:
                    del shard["max_id"]
        meta["dtype"] = said

    return _copy(folder, tmp, edit)


def _pairs_changed(tmp: Path, name: str, change) -> Path:
    """Prepared pairs whose file `name` (uint16 ids or uint64 offsets) is rewritten by `change`."""
    folder = _pairs(tmp)
    path = folder / name
    dtype = np.uint64 if name.endswith(".idx") else np.uint16
    values = np.fromfile(path, dtype=dtype)
    change(values)
    values.tofile(path)
    return folder


LIES = {  # name: (overrides from (byte data, tmp), fragments of the one error line)
    "meta-says-uint16-over-byte-ids": (
        lambda d, t: {"data.dir": _relabelled(d, t, stored="uint8", said="uint16")},
        ("train-00000.bin holds ids up to", "(meta.json says uint16)", "largest id was", "prepare the data again"),
    ),
    "meta-says-uint32-over-uint16-ids-unrecorded": (  # as meshrun wrote it before it recorded the largest id
        lambda d, t: {"data.dir": _relabelled(d, t, stored="uint16", said="uint32", recorded=False)},
        ("(meta.json says uint32), beyond the data's vocabulary of 256",),
    ),
    "meta-says-uint16-over-uint32-ids": (
        lambda d, t: {"data.dir": _relabelled(d, t, stored="uint32", said="uint16")},
        ("train-00000.bin holds wider ids than", "meta.json says uint16"),
    ),
    "pairs-id-beyond-what-was-prepared": (
        lambda d, t: {
            "data.dir": _pairs_changed(t, "train.target.bin", lambda ids: ids.__setitem__(0, 60000)),
            "model.vocab_size": VOCAB,
        },
        ("train.target.bin holds ids up to 60000", "largest id was"),
    ),
    "pairs-offsets-beyond-the-bin": (
        lambda d, t: {
            "data.dir": _pairs_changed(t, "train.source.idx", lambda offsets: offsets.__setitem__(-1, offsets[-1] + 9)),
            "model.vocab_size": VOCAB,
        },
        ("train.source.idx: offsets out of range", "train.source.bin"),
    ),
}


@pytest.mark.usefixtures("no_workers")
@pytest.mark.parametrize("name", list(LIES))
def test_lying_data_is_refused_before_spawning(
    name: str, data_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    make, fragments = LIES[name]
    assert_refused(make(data_dir, tmp_path), fragments, data_dir, tmp_path, capsys)


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
