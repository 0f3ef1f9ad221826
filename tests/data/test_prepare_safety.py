"""Preparing data safely: two jobs preparing one folder at once (one writes it, the other waits
and then uses or refuses that complete dataset, which matches a preparation by one process
alone), and a full disk (one line, nothing left behind)."""

from __future__ import annotations

import hashlib
import random
import subprocess
from pathlib import Path

import pytest
from conftest import WORDS, finish_meshrun, kill_tree, start_meshrun, tiny

from meshrun.data.prepare import prepare
from meshrun.errors import RunError

VAL_FRACTION = 0.2


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """~3 MB of text and a BPE tokenizer.json: encoding it takes a few seconds, so two jobs
    started together are preparing at the same time."""
    rng, root = random.Random(0), tmp_path_factory.mktemp("corpus")
    texts = root / "texts"
    texts.mkdir()
    for i in range(24):
        (texts / f"doc{i:02d}.txt").write_text(" ".join(rng.choice(WORDS) for _ in range(25_000)))
    prepare([str(texts / "doc00.txt")], root / "bpe", train_tokenizer="bpe:300", workers=1, progress=False)
    return texts, root / "bpe" / "tokenizer.json"


def _files(folder: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.iterdir())}


def _alone(corpus: tuple[Path, Path], out: Path) -> dict[str, str]:
    """The dataset one process prepares from the same sources (meta.json names them: the same strings)."""
    texts, tokenizer = corpus
    prepare([str(texts)], out, tokenizer=str(tokenizer), val_fraction=VAL_FRACTION, progress=False)
    return _files(out)


def _together(commands: list[list[str]], tmp_path: Path, timeout: float) -> list[subprocess.CompletedProcess]:
    procs = [start_meshrun(command, tmp_path=tmp_path) for command in commands]
    try:
        return [finish_meshrun(proc, timeout=timeout, check=False) for proc in procs]
    finally:
        for proc in procs:
            if proc.poll() is None:  # the other one, when one timed out
                kill_tree(proc.pid)


def test_two_prepare_data_into_one_folder(corpus: tuple[Path, Path], tmp_path: Path) -> None:
    texts, tokenizer = corpus
    out = tmp_path / "ds"
    command = ["prepare-data", "--source", str(texts), "--out", str(out), "--tokenizer", str(tokenizer)]
    results = _together([[*command, "--val-fraction", str(VAL_FRACTION)]] * 2, tmp_path, timeout=180)
    assert sorted(r.returncode for r in results) == [0, 2], [r.stderr for r in results]
    refused = next(r for r in results if r.returncode == 2)
    assert refused.stderr.splitlines()[-1] == (
        f"meshrun: error: {out} already holds a prepared dataset; choose another --out or delete it"
    )
    assert _files(out) == _alone(corpus, tmp_path / "alone")
    assert not [p.name for p in tmp_path.iterdir() if p.name.startswith(".")]  # no staging folder or lock left


def test_two_trainings_preparing_one_data_dir(corpus: tuple[Path, Path], tmp_path: Path) -> None:
    texts, tokenizer = corpus
    data = tmp_path / "data"
    settings = {"data.sources": f"[{texts}]", "data.tokenizer": tokenizer, "data.val_fraction": VAL_FRACTION}
    settings |= {"model.vocab_size": 300, "model.num_layers": 1, "train.steps": 1, "checkpoint.at_end": False}
    commands = [["train", *tiny(data, tmp_path / f"run{i}", **settings)] for i in range(2)]
    results = _together(commands, tmp_path, timeout=240)
    assert [r.returncode for r in results] == [0, 0], [r.stderr[-3000:] for r in results]
    assert _files(data) == _alone(corpus, tmp_path / "alone")
    assert not [p.name for p in tmp_path.iterdir() if p.name.startswith(".")]


def test_a_full_disk_is_one_line_and_leaves_nothing(corpus: tuple[Path, Path], small_disk: Path) -> None:
    texts, _ = corpus
    with pytest.raises(RunError, match=f"^no space left on {small_disk} while writing {small_disk}/"):
        prepare([str(texts)], small_disk / "ds", val_fraction=VAL_FRACTION, progress=False)
    assert list(small_disk.iterdir()) == []  # the staging folder and the lock went: the space is back
