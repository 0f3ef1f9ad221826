"""Text pairs for seq2seq: reading (.jsonl fields, aligned text files), storage, padded batches."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import run_meshrun

from meshrun.data.pairs import (
    BOS,
    EOS,
    PAD,
    PairsDataset,
    example_pairs,
    prepare_pairs,
    read_pairs,
)
from meshrun.data.storage import IGNORE, read_meta
from meshrun.errors import ConfigError


def ids(text: str) -> list[int]:
    return [b + 3 for b in text.encode()]


def test_cli_prepares_jsonl_pairs_with_named_fields(tmp_path: Path) -> None:
    records = [{"q": f"question {i}", "a": "yes" if i % 2 else "no", "other": 1} for i in range(20)]
    (tmp_path / "qa.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    result = run_meshrun(
        [
            "prepare-data",
            "--pairs",
            "--source",
            "qa.jsonl",
            "--source-field",
            "q",
            "--target-field",
            "a",
            "--val-fraction",
            "0.1",
            "--out",
            "qa",
        ],
        tmp_path=tmp_path,
    )
    assert "train 18, val 2" in result.stdout
    data = PairsDataset(tmp_path / "qa", "val", read_meta(tmp_path / "qa"), seq_len=20, seed=0, source_len=12)
    x, y = data.batch(0, 8)
    for row in range(8):
        source = bytes(int(t) - 3 for t in x[row, :12] if t != PAD).decode()
        answer = "yes" if int(source.split()[1]) % 2 else "no"
        assert x[row, 12:].tolist() == [BOS, *ids(answer), *[PAD] * (7 - len(answer))]
        assert y[row].tolist() == [*ids(answer), EOS, *[IGNORE] * (7 - len(answer))]
    assert data.target_tokens(0, 8) == int((y != IGNORE).sum())


def test_aligned_text_files_and_decoder_only_batches(tmp_path: Path) -> None:
    (tmp_path / "src.txt").write_text("ab\ncde\nf\n")
    (tmp_path / "tgt.txt").write_text("AB\nCDE\nF\n")
    pairs = read_pairs([str(tmp_path / "src.txt"), str(tmp_path / "tgt.txt")])
    assert pairs == [("ab", "AB"), ("cde", "CDE"), ("f", "F")]
    prepare_pairs(pairs, tmp_path / "p", val_fraction=0.3)
    data = PairsDataset(tmp_path / "p", "train", read_meta(tmp_path / "p"), seq_len=6, seed=0, source_len=None)
    x, y = data.batch(0, 16)
    for row_x, row_y in zip(x.tolist(), y.tolist()):
        source = "ab" if row_x[0] == ids("a")[0] else "cde"
        full = [*ids(source), BOS, *ids(source.upper()), EOS]  # truncated to seq_len + 1 = 7
        assert row_x[: len(full) - 1] == full[:-1][:6]
        assert row_y == ([IGNORE] * len(source) + full[len(source) + 1 :] + [IGNORE] * 6)[:6]
    assert data.target_tokens(0, 16) == int((y != IGNORE).sum())


@pytest.mark.parametrize(
    "files,message",
    [
        ({"a.txt": "x\ny\n", "b.txt": "X\n"}, "has 2 lines but"),
        ({"a.jsonl": '{"source": "x"}\n'}, "has no text field 'target'"),
        ({"a.jsonl": "{not json\n"}, "is not valid JSON"),
        ({"a.jsonl": b'{"source": "x", "target": "y"}\n{"source": "caf\xe9"}\n'}, r"a.jsonl:2 is not UTF-8 text"),
        ({"a.txt": b"x\ny\n", "b.txt": b"X\n\xffY\n"}, r"b.txt:2 is not UTF-8 text \(byte 0xff\)"),
    ],
)
def test_bad_pairs_are_one_line_errors(files: dict[str, str | bytes], message: str, tmp_path: Path) -> None:
    for name, text in files.items():
        (tmp_path / name).write_bytes(text if isinstance(text, bytes) else text.encode())
    with pytest.raises(ConfigError, match=message):
        read_pairs([str(tmp_path / name) for name in files])


def test_prepare_refuses_a_folder_with_files(tmp_path: Path) -> None:
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "mine.txt").write_text("keep me")
    with pytest.raises(ConfigError, match=r"mine\.txt"):
        prepare_pairs([("a", "b"), ("c", "d")], tmp_path / "out")
    assert (tmp_path / "out" / "mine.txt").read_text() == "keep me"


def test_example_pairs_are_snake_to_camel_names() -> None:
    pairs = example_pairs()
    assert len(pairs) > 1000
    assert all(target == "".join(w.capitalize() for w in source.split("_")) for source, target in pairs)
    assert all("_" in source and len(source) <= 24 for source, _ in pairs)
