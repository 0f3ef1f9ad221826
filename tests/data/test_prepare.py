"""`meshrun prepare-data` and `TokenDataset`: exact bytes, no overwrites, read-only, deterministic batches."""

from __future__ import annotations

import hashlib
import itertools
import json
import re
import shutil
import stat
import sysconfig
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import run_meshrun

from meshrun.data.dataset import TokenDataset
from meshrun.data.prepare import _spread_sample, default_sources, expand_sources, prepare
from meshrun.data.sources import find_sources
from meshrun.errors import ConfigError

SEPARATOR = b"\n\n"  # prepare appends this after every file


def _corpus(root: Path, num_files: int = 12) -> list[Path]:
    """Small text files with distinct contents (and one non-ASCII one: bytes, not characters)."""
    files = []
    for i in range(num_files):
        path = root / f"sub{i % 3}" / f"file{i}.txt"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(f"# file {i}\n".encode() + bytes(range(32, 127)) * (i + 1) + "é ✓\n".encode())
        files.append(path)
    return files


def _prepare(tmp_path: Path, *args: str, check: bool = True):
    return run_meshrun(["prepare-data", *args], tmp_path=tmp_path, timeout=120, check=check)


def _snapshot(folder: Path, *, times: bool = True) -> dict[str, tuple[str, int]]:
    return {
        p.name: (hashlib.sha256(p.read_bytes()).hexdigest(), p.stat().st_mtime_ns if times else 0)
        for p in sorted(folder.iterdir())
        if p.is_file()
    }


def _assert_one_line_error(result, *fragments: str) -> None:
    assert result.returncode == 2, result.stderr
    lines = result.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("meshrun: error: "), result.stderr
    for fragment in fragments:
        assert fragment in lines[0]


def split_bytes(out: Path, split: str) -> bytes:
    """A split's tokens as bytes, read from its shards as meta.json lists them."""
    meta = json.loads((out / "meta.json").read_text())
    assert meta["dtype"] == "uint8"
    return b"".join((out / shard["file"]).read_bytes() for shard in meta["splits"][split]["shards"])


def _assert_same_bytes(out: Path, files: list[Path]) -> None:
    """The shards hold exactly each source file (plus its separator), each file whole in one split."""
    train, val = (split_bytes(out, split) for split in ("train", "val"))
    assert train and val
    pieces = [f.read_bytes() + SEPARATOR for f in files]
    assert len(train) + len(val) == sum(map(len, pieces))
    assert Counter(train + val) == Counter(b"".join(pieces))
    for piece in pieces:
        assert (piece in train) != (piece in val), "a file must land wholly in exactly one split"


def test_prepare_writes_exact_byte_memmaps(tmp_path: Path) -> None:
    files = _corpus(tmp_path / "corpus")
    out = tmp_path / "ds"
    result = _prepare(
        tmp_path,
        "--source",
        str(tmp_path / "corpus" / "sub0"),
        "--source",
        str(tmp_path / "corpus" / "sub[12]" / "*.txt"),
        "--out",
        str(out),
    )
    names = {"train-00000.bin", "val-00000.bin", "train.docs.bin", "val.docs.bin", "meta.json"}
    assert {p.name for p in out.iterdir()} == names  # no temp files left behind
    assert not any(p.name.endswith(".partial") for p in tmp_path.iterdir())
    meta = json.loads((out / "meta.json").read_text())
    assert meta["num_files"] == len(files) and meta["vocab_size"] == 256 and meta["documents"] == len(files)
    for split in ("train", "val"):
        tokens = np.memmap(out / f"{split}-00000.bin", dtype=np.uint8, mode="r")
        assert tokens.size == meta[f"{split}_tokens"]
    _assert_same_bytes(out, files)
    assert (
        f"wrote {meta['train_tokens']} train and {meta['val_tokens']} val tokens from {len(files)} files"
        in result.stdout
    )


def test_each_shard_records_its_largest_id(tmp_path: Path) -> None:
    """meta.json records each shard's largest id (checked against the shard on first open), right
    after a document moved from train to val too: the last file's high bytes leave train with it."""
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    for i in range(3):
        (corpus / f"f{i}.txt").write_bytes(b"plain ascii text %d\n" % i * 20 + ("é".encode() if i == 2 else b""))
    meta = prepare([str(corpus)], tmp_path / "ds", val_fraction=0.01, progress=False, workers=1)
    assert (meta["splits"]["train"]["documents"], meta["splits"]["val"]["documents"]) == (2, 1)  # one moved over
    for split in ("train", "val"):
        for shard in meta["splits"][split]["shards"]:
            assert shard["max_id"] == np.fromfile(tmp_path / "ds" / shard["file"], np.uint8).max()
    assert meta["splits"]["train"]["shards"][0]["max_id"] < 128 <= meta["splits"]["val"]["shards"][0]["max_id"]


def test_prepare_is_deterministic(tmp_path: Path) -> None:
    _corpus(tmp_path / "corpus")
    for out in ("a", "b"):
        _prepare(tmp_path, "--source", str(tmp_path / "corpus"), "--out", str(tmp_path / out))
    assert _snapshot(tmp_path / "a", times=False) == _snapshot(tmp_path / "b", times=False)


def test_single_file_is_split_into_train_and_val(tmp_path: Path) -> None:
    """One source file still yields two non-empty splits (a byte cut), so training can validate."""
    source = tmp_path / "one.txt"
    source.write_bytes(b"just one file of text\n" * 50)
    out = tmp_path / "ds"
    _prepare(tmp_path, "--source", str(source), "--out", str(out), "--val-fraction", "0.1")
    train, val = (split_bytes(out, split) for split in ("train", "val"))
    assert train + val == source.read_bytes() + SEPARATOR
    assert 0 < len(val) < len(train)


def test_refuses_to_overwrite_a_prepared_dataset(tmp_path: Path) -> None:
    _corpus(tmp_path / "corpus")
    out = tmp_path / "ds"
    _prepare(tmp_path, "--source", str(tmp_path / "corpus"), "--out", str(out))
    before = _snapshot(out)
    (tmp_path / "other.txt").write_text("different text\n" * 100)
    result = _prepare(tmp_path, "--source", str(tmp_path / "other.txt"), "--out", str(out), check=False)
    _assert_one_line_error(result, str(out), "already holds a prepared dataset", "another --out")
    assert _snapshot(out) == before


def test_refuses_to_overwrite_a_users_own_file(tmp_path: Path) -> None:
    """A folder with only some of our file names (say, the user's own train.bin) is left alone."""
    _corpus(tmp_path / "corpus")
    out = tmp_path / "ds"
    out.mkdir()
    (out / "train.bin").write_bytes(b"the user's own bytes")
    (out / "notes.txt").write_text("keep me")
    before = _snapshot(out)
    result = _prepare(tmp_path, "--source", str(tmp_path / "corpus"), "--out", str(out), check=False)
    _assert_one_line_error(result, "already has notes.txt, train.bin", "empty folder")
    assert _snapshot(out) == before


@pytest.mark.parametrize(
    ("args", "fragments"),
    [
        (["--source", "{tmp}/nothing-here/*.txt"], ("no files match --source", "nothing-here")),
        (["--source", "{tmp}/corpus", "--val-fraction", "0.7"], ("--val-fraction must be in (0, 0.5)", "0.7")),
        (["--source", "{tmp}/corpus", "--val-fraction", "0"], ("--val-fraction must be in (0, 0.5)",)),
    ],
    ids=["no-match", "val-fraction-too-big", "val-fraction-zero"],
)
def test_bad_prepare_arguments(tmp_path: Path, args: list[str], fragments: tuple[str, ...]) -> None:
    _corpus(tmp_path / "corpus")
    out = tmp_path / "ds"
    result = _prepare(tmp_path, *(a.format(tmp=tmp_path) for a in args), "--out", str(out), check=False)
    _assert_one_line_error(result, *fragments)
    assert not out.exists()


def test_out_is_a_file(tmp_path: Path) -> None:
    _corpus(tmp_path / "corpus")
    out = tmp_path / "ds"
    out.write_text("a file, not a folder")
    result = _prepare(tmp_path, "--source", str(tmp_path / "corpus"), "--out", str(out), check=False)
    _assert_one_line_error(result, f"cannot prepare data in {out}")
    assert out.read_text() == "a file, not a folder"


def test_default_sources_are_the_standard_library() -> None:
    files = expand_sources(default_sources())
    stdlib = Path(sysconfig.get_paths()["stdlib"]).resolve()
    assert len(files) > 100
    assert all(f.suffix == ".py" for f in files)
    assert all(stdlib in f.resolve().parents for f in files)
    assert not any(part in {"site-packages", "dist-packages"} for f in files for part in f.parts)
    names = {f.relative_to(stdlib).as_posix() for f in files}
    assert {"os.py", "json/__init__.py", "email/mime/text.py"} <= names
    left_out = {"test", "tests", "idle_test", "encodings", "pydoc_data"}  # test suites, generated tables
    assert not any(left_out & set(f.relative_to(stdlib).parts) for f in files)


def test_a_bpe_is_trained_on_an_even_sample_of_a_large_corpus(tmp_path: Path) -> None:
    """Documents totalling the budget, drawn from the whole corpus (not its first files)."""
    for i in range(50):
        (tmp_path / f"doc{i:02d}.txt").write_bytes(f"{i:02d}".encode() * 500)
    found, _ = find_sources([str(tmp_path / "*.txt")])
    sample = list(_spread_sample(found, "text", budget=10_000))
    assert 9_000 <= sum(map(len, sample)) <= 11_000
    picked = sorted(int(doc[:2]) for doc in sample)
    assert (
        picked[0] < 5 and picked[-1] >= 45 and max(b - a for a, b in itertools.pairwise(picked)) <= 6
    )  # evenly spread
    assert sum(map(len, _spread_sample(found, "text", budget=10**9))) == 50_000  # small corpora: all of it


def test_preparing_says_what_it_is_doing(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """First-use preparation of the default job (a BPE trained, then tokenized) was silent for ~30 s
    after its first line: each phase of sources large enough to take seconds now starts with a
    line, on a terminal or not; small ones (and so their one-line refusals) say nothing."""
    _corpus(tmp_path / "src")
    prepare([str(tmp_path / "src" / "**" / "*.txt")], tmp_path / "small", train_tokenizer="bpe:300", workers=1)
    assert capsys.readouterr().err == ""
    monkeypatch.setattr("meshrun.data.prepare.SAY_PHASES_FROM_BYTES", 0)  # as if the corpus were large
    prepare([str(tmp_path / "src" / "**" / "*.txt")], tmp_path / "ds", train_tokenizer="bpe:300", workers=1)
    lines = capsys.readouterr().err.splitlines()
    assert re.fullmatch(r"\[meshrun\] training the bpe:300 tokenizer on [\d.]+ MB sampled from 12 files", lines[0])
    assert re.fullmatch(r"\[meshrun\] tokenizing [\d.]+ MB in 12 files \(bpe:300 tokenizer\)", lines[1])
    prepare([str(tmp_path / "src" / "**" / "*.txt")], tmp_path / "quiet", progress=False)
    assert capsys.readouterr().err == ""


def test_prepare_without_source_uses_the_standard_library(tmp_path: Path) -> None:
    out = tmp_path / "stdlib"
    _prepare(tmp_path, "--out", str(out))
    meta = json.loads((out / "meta.json").read_text())
    files = expand_sources(default_sources())
    assert meta["num_files"] == len(files)
    assert meta["train_tokens"] + meta["val_tokens"] == sum(f.stat().st_size + len(SEPARATOR) for f in files)
    assert meta["val_tokens"] > 0 and meta["train_tokens"] > 10 * meta["val_tokens"]


# --- TokenDataset --------------------------------------------------------------------------------


def test_dataset_is_read_only(data_dir: Path, tmp_path: Path) -> None:
    ds = TokenDataset(data_dir, "train", seq_len=16, seed=0)
    tokens = ds.segments[0]
    assert isinstance(tokens, np.memmap) and tokens.mode == "r"
    with pytest.raises(ValueError, match="read-only"):
        tokens[0] = 1
    # opening needs no write permission on the files
    copy = tmp_path / "ro"
    shutil.copytree(data_dir, copy)
    for path in copy.iterdir():
        path.chmod(stat.S_IRUSR | stat.S_IRGRP | stat.S_IROTH)
    x, _ = TokenDataset(copy, "val", seq_len=16, seed=0).batch(0, 2)
    assert x.shape == (2, 16)


def test_batch_targets_are_inputs_shifted_by_one(data_dir: Path) -> None:
    seq_len = 16
    ds = TokenDataset(data_dir, "train", seq_len=seq_len, seed=3)
    x, y = ds.batch(5, 8)
    assert x.shape == y.shape == (8, seq_len) and x.dtype == y.dtype == torch.int64
    assert torch.equal(x[:, 1:], y[:, :-1])
    tokens = torch.from_numpy(np.frombuffer(split_bytes(data_dir, "train"), dtype=np.uint8).astype(np.int64))
    for row_x, row_y in zip(x, y):
        starts = [s for s in range(len(tokens) - seq_len) if torch.equal(tokens[s : s + seq_len], row_x)]
        assert any(torch.equal(tokens[s + 1 : s + seq_len + 1], row_y) for s in starts), "window not in the data"


def test_batch_is_deterministic_and_independent_of_the_split(data_dir: Path) -> None:
    ds = TokenDataset(data_dir, "train", seq_len=16, seed=7)
    again = TokenDataset(data_dir, "train", seq_len=16, seed=7)
    x, y = ds.batch(0, 8)
    assert torch.equal(x, again.batch(0, 8)[0]) and torch.equal(y, again.batch(0, 8)[1])
    for first_count in (4, 3, 1):
        x1, y1 = ds.batch(0, first_count)
        x2, y2 = ds.batch(first_count, 8 - first_count)
        assert torch.equal(torch.cat([x1, x2]), x) and torch.equal(torch.cat([y1, y2]), y)
    # a rank reading global samples 4..7 sees exactly those rows of the global batch
    assert torch.equal(ds.batch(4, 4)[0], x[4:])
    # other seeds and the other split give other data
    assert not torch.equal(TokenDataset(data_dir, "train", seq_len=16, seed=8).batch(0, 8)[0], x)
    assert not torch.equal(TokenDataset(data_dir, "val", seq_len=16, seed=7).batch(0, 8)[0], x)


@pytest.mark.parametrize(
    ("train_bytes", "fragment"),
    [
        (None, "has no train.bin; run `meshrun prepare-data"),
        (b"", "holds 0 tokens, fewer than model.seq_len + 1 = 17"),
        (b"x" * 16, "holds 16 tokens, fewer than model.seq_len + 1 = 17"),
    ],
    ids=["missing", "empty", "one-token-short"],
)
def test_dataset_refuses_missing_or_small_data(tmp_path: Path, train_bytes: bytes | None, fragment: str) -> None:
    if train_bytes is not None:
        (tmp_path / "train.bin").write_bytes(train_bytes)
    with pytest.raises(ConfigError, match=re.escape(fragment)):
        TokenDataset(tmp_path, "train", seq_len=16, seed=0)


def test_dataset_of_exactly_seq_len_plus_one_tokens(tmp_path: Path) -> None:
    (tmp_path / "train.bin").write_bytes(bytes(range(17)))
    x, y = TokenDataset(tmp_path, "train", seq_len=16, seed=0).batch(0, 3)
    assert torch.equal(x, torch.arange(16).expand(3, 16)) and torch.equal(y, torch.arange(1, 17).expand(3, 16))


def test_prepared_files_are_readable_by_others(tmp_path: Path) -> None:
    """Shared datasets: other users and container uids must be able to read them."""
    source = tmp_path / "a.txt"
    source.write_text("hello world\n" * 50)
    prepare([str(source)], tmp_path / "out")
    for path in [tmp_path / "out", *(tmp_path / "out").iterdir()]:
        assert path.stat().st_mode & 0o055 == 0o055 if path.is_dir() else path.stat().st_mode & 0o044 == 0o044
