"""`meshrun prepare-data --task classification | regression | masked_lm`: each task's data and its
manifest (meta.json "task"), the label set and the standardisation stored with the data, windows
that never cross a series or the validation cut, and bad input refused in one line (exit 2) naming
the file, the row and the column, with nothing written."""

from __future__ import annotations

import csv
import json
import math
from collections import Counter
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from meshrun import cli
from meshrun.data.labelled import EXAMPLE_PACKAGES, EXAMPLE_PER_LABEL, example_examples
from meshrun.data.series import Windows, example_series
from meshrun.data.storage import open_split, read_meta
from meshrun.errors import ConfigError


def prepare(args: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str]:
    code = cli.main(["prepare-data", *args])
    captured = capsys.readouterr()
    return code, captured.out if code == 0 else captured.err


def refused(args: list[str], capsys: pytest.CaptureFixture[str], out: Path) -> str:
    code, err = prepare([*args, "--out", str(out)], capsys)
    assert code == 2 and err.count("\n") == 1, err
    assert not out.exists() and not list(out.parent.glob(f".{out.name}*"))  # nothing written, no staging left
    return err


def write_csv(path: Path, header: list[str], rows: list[list[object]]) -> Path:
    with open(path, "w", newline="") as f:
        csv.writer(f).writerows([header, *rows])
    return path


def reviews(folder: Path) -> list[dict]:
    """Labels are whole numbers (sorted by value: 2 before 10) and text."""
    rows = [
        {"review": f"film number {i} was {'good' if i % 2 else 'bad'}", "stars": [2, 10, "meh"][i % 3]}
        for i in range(30)
    ]
    (folder / "reviews.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return rows


@pytest.mark.parametrize("kind", ["jsonl", "csv", "parquet"])
def test_classification_stores_tokens_label_ids_and_the_sorted_label_set(
    kind: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    rows = reviews(tmp_path)
    source = tmp_path / f"reviews.{kind}"
    if kind == "csv":
        write_csv(source, ["stars", "review"], [[r["stars"], r["review"]] for r in rows])
    elif kind == "parquet":
        pq.write_table(
            pa.table({"review": [r["review"] for r in rows], "stars": [str(r["stars"]) for r in rows]}), source
        )
    code, out = prepare(
        ["--task", "classification", "--source", str(source), "--field", "review", "--label-field", "stars",
         "--out", str(tmp_path / "data")],
        capsys,
    )  # fmt: skip
    assert code == 0 and "3 labels" in out
    meta = read_meta(tmp_path / "data")
    assert meta and meta["task"] == "classification" and meta["labels"] == ["2", "10", "meh"]
    label_of = {r["review"]: str(r["stars"]) for r in rows}
    seen = 0
    for split in ("train", "val"):
        ids = np.fromfile(tmp_path / "data" / f"{split}.text.bin", dtype=meta["dtype"])
        offsets = np.fromfile(tmp_path / "data" / f"{split}.text.idx", dtype="<u8")
        labels = np.fromfile(tmp_path / "data" / f"{split}.labels.bin", dtype="<u4")
        assert len(labels) == len(offsets) - 1 == meta["splits"][split]["examples"] > 0
        for k, label in enumerate(labels):
            text = ids[offsets[k] : offsets[k + 1]].tobytes().decode()
            assert meta["labels"][label] == label_of[text]
            seen += 1
    assert seen == len(rows)


def test_validation_rows_come_from_val_source_and_their_labels_must_be_training_labels(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    reviews(tmp_path)
    val = tmp_path / "val.jsonl"
    val.write_text('{"review": "fine", "stars": 10}\n\n{"review": "odd", "stars": "superb"}\n')
    flags = ["--task", "classification", "--source", str(tmp_path / "reviews.jsonl"), "--field", "review"]
    flags += ["--label-field", "stars", "--val-source", str(val)]
    err = refused(flags, capsys, tmp_path / "data")
    assert f"{val}:3: label 'superb' is not a label of the training rows (2, 10, meh)" in err
    val.write_text('{"review": "fine", "stars": 10}\n')
    code, out = prepare([*flags, "--out", str(tmp_path / "data")], capsys)
    assert code == 0 and "train 30, val 1 rows" in out


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (
            '{"review": "a", "stars": 1}\n{"review": "b"}\n',
            "reviews.jsonl:2 has no label in field 'stars' (got nothing)",
        ),
        ('{"review": "a", "stars": 1}\n{"review": "b", "stars": ""}\n', "reviews.jsonl:2 has no label"),
        ('{"review": "a", "stars": [1]}\n', "reviews.jsonl:1 has no label in field 'stars' (got list [1])"),
        ('{"review": "a", "stars": 1.5}\n', "(got float 1.5)"),
        ('{"review": "a", "stars": NaN}\n', "(got float nan)"),
        ('{"text": "a", "stars": 1}\n', "reviews.jsonl:1 has no text in field 'review'"),
    ],
)
def test_a_row_without_a_label_or_text_is_refused_at_its_line(
    content: str, message: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "reviews.jsonl").write_text(content)
    flags = ["--task", "classification", "--source", str(tmp_path / "reviews.jsonl"), "--field", "review"]
    assert message in refused([*flags, "--label-field", "stars"], capsys, tmp_path / "data")


def test_a_missing_label_in_csv_and_parquet_names_the_row(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    source = write_csv(tmp_path / "r.csv", ["text", "label"], [["good", "pos"], ["multi\nline", "neg"], ["bad", ""]])
    source.write_bytes(b"\xef\xbb\xbf" + source.read_bytes())  # a spreadsheet's BOM: still column 'text'
    assert f"{source}:5 has no label in field 'label'" in refused(
        ["--task", "classification", "--source", str(source)], capsys, tmp_path / "a"
    )
    pq.write_table(pa.table({"text": ["good", "bad"], "label": ["pos", None]}), tmp_path / "r.parquet")
    err = refused(["--task", "classification", "--source", str(tmp_path / "r.parquet")], capsys, tmp_path / "b")
    assert f"{tmp_path / 'r.parquet'} row 2 has no label" in err
    err = refused(["--task", "classification", "--source", str(source), "--label-field", "y"], capsys, tmp_path / "c")
    assert f"{source} has no column 'y' (columns: text, label)" in err


def prices(folder: Path, name: str = "prices.csv", rows: int = 120) -> Path:
    return write_csv(
        folder / name,
        ["day", "price", "volume"],
        [[day, round(100 + 10 * math.sin(day / 5), 3), 1000 + day % 7] for day in range(rows)],
    )


def test_regression_standardises_by_the_training_rows_and_windows_stay_inside_their_split(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Two series (files) of 120 and 60 rows, seq_len 8, horizon 3, val_fraction 0.1: validation
    holds the last 12 and 6 rows of each; statistics come from the other rows only."""
    first, second = prices(tmp_path, "a.csv"), prices(tmp_path, "b.csv", rows=60)  # series in name order
    code, out = prepare(
        ["--task", "regression", "--source", str(first), "--source", str(second), "--time-column", "day",
         "--seq-len", "8", "--horizon", "3", "--val-fraction", "0.1", "--out", str(tmp_path / "data")],
        capsys,
    )  # fmt: skip
    assert code == 0 and "2 series, 180 rows of 2 columns" in out
    meta = read_meta(tmp_path / "data")
    assert meta and meta["task"] == "regression" and meta["columns"] == ["price", "volume"]
    raw = [np.loadtxt(path, delimiter=",", skiprows=1)[:, 1:] for path in (first, second)]
    training = np.concatenate([raw[0][:108], raw[1][:54]])
    np.testing.assert_allclose(meta["mean"], training.mean(axis=0), rtol=1e-12)
    np.testing.assert_allclose(meta["std"], training.std(axis=0), rtol=1e-12)
    standard = [(r - training.mean(axis=0)) / training.std(axis=0) for r in raw]
    train = Windows(tmp_path / "data", "train", meta, seq_len=8, horizon=3)
    val = Windows(tmp_path / "data", "val", meta, seq_len=8, horizon=3)
    assert (len(train), len(val)) == ((108 - 11 + 1) + (54 - 11 + 1), 10 + 4)
    x, y = train.window(0)
    np.testing.assert_allclose(x, standard[0][:8], rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(y, standard[0][8:11], rtol=1e-6, atol=1e-6)
    x, y = val.window(len(val) - 1)  # the second series' last window: its last 3 rows are the targets
    np.testing.assert_allclose(y, standard[1][-3:], rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(x, standard[1][-11:-3], rtol=1e-6, atol=1e-6)
    x, y = val.window(0)  # the first validation window: its targets start at the cut, inputs before it
    np.testing.assert_allclose(y, standard[0][108:111], rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize(
    ("row", "message"),
    [
        ([5, "12,5", 1000], "prices.csv:7: column 'price' holds '12,5', not a number"),
        ([5, "", 1000], "prices.csv:7: column 'price' holds an empty cell, not a number"),
        ([5, 101.0, "nan"], "prices.csv:7: column 'volume' is nan (not finite)"),
        ([5, "inf", 1000], "prices.csv:7: column 'price' is inf (not finite)"),
        ([3, 101.0, 1000], "prices.csv:7: time '3' in column 'day' is not after the previous row's"),
    ],
)
def test_a_bad_value_is_refused_naming_file_row_and_column(
    row: list, message: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    source = prices(tmp_path)
    lines = source.read_text().splitlines()
    lines[6] = ",".join(f'"{cell}"' if "," in str(cell) else str(cell) for cell in row)  # data row 6 = line 7
    source.write_text("\n".join(lines) + "\n")
    flags = ["--task", "regression", "--source", str(source), "--time-column", "day", "--seq-len", "8"]
    assert message in refused(flags, capsys, tmp_path / "data")


def test_a_non_numeric_parquet_value_names_its_row_and_column(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    pq.write_table(pa.table({"price": ["1.5", "2", "n/a"] + ["3"] * 20}), tmp_path / "p.parquet")
    err = refused(
        ["--task", "regression", "--source", str(tmp_path / "p.parquet"), "--seq-len", "4"], capsys, tmp_path / "d"
    )
    assert f"{tmp_path / 'p.parquet'} row 3: column 'price' holds 'n/a', not a number" in err


def test_a_series_shorter_than_seq_len_plus_horizon_is_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    source = prices(tmp_path, rows=20)
    flags = ["--task", "regression", "--source", str(source), "--columns", "price"]
    err = refused([*flags, "--seq-len", "16", "--horizon", "5"], capsys, tmp_path / "a")
    assert f"{source} has 20 rows, fewer than seq_len + horizon = 16 + 5" in err
    err = refused([*flags, "--seq-len", "18", "--horizon", "2"], capsys, tmp_path / "b")
    assert "after its last 2 rows are held out for validation, 18 remain, fewer than seq_len + horizon = 20" in err


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--label-field", "y"], "--label-field is a flag of --task classification, not of --task causal_lm"),
        (
            ["--task", "classification", "--horizon", "2", "--source", "x.csv"],
            "--horizon is a flag of --task regression",
        ),
        (["--task", "masked_lm", "--pairs"], "--pairs prepares seq2seq pairs, not --task masked_lm"),
        (["--task", "classification", "--chat"], "--chat prepares causal_lm documents with a loss mask"),
        (["--task", "regression", "--seq-len", "4", "--columns", "x"], "the built-in example has none"),
        (["--task", "regression"], "--task regression needs --seq-len N"),
        (["--task", "regression", "--tokenizer", "t.json"], "do not apply to --task regression"),
        (["--task", "regression", "--source", "x.txt", "--seq-len", "4"], "no files match --source x.txt"),
        # a flag the preparation would not read is refused, not ignored
        (["--task", "regression", "--seq-len", "4", "--workers", "2"], "--workers does not apply to --task regression"),
        (
            ["--task", "classification", "--shard-tokens", "99"],
            "--shard-tokens does not apply to --task classification",
        ),
        (["--task", "regression", "--seq-len", "4", "--field", "x"], "--field does not apply to --task regression"),
        (["--pairs", "--shard-tokens", "99"], "--shard-tokens does not apply to --pairs"),
        (["--source-field", "q"], "--source-field does not apply to --task causal_lm"),
    ],
)
def test_flags_of_another_task_are_refused(
    flags: list[str], message: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert message in refused(flags, capsys, tmp_path / "data")


def test_masked_lm_data_records_its_mask_token_and_record_data_is_no_token_stream(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Protein sequences, one per record, at the byte (character) level: the mask is id 256."""
    (tmp_path / "proteins.jsonl").write_text(
        "".join(json.dumps({"text": "MKTAYIAKQR" * (i + 3)}) + "\n" for i in range(20))
    )
    code, out = prepare(
        ["--task", "masked_lm", "--source", str(tmp_path / "proteins.jsonl"), "--out", str(tmp_path / "mlm")], capsys
    )
    meta = read_meta(tmp_path / "mlm")
    assert code == 0 and meta and "masked_lm" in out
    assert (meta["task"], meta["mask_id"], meta["special_ids"], meta["vocab_size"]) == ("masked_lm", 256, [256], 257)
    reviews(tmp_path)
    code, _ = prepare(
        ["--task", "classification", "--source", str(tmp_path / "reviews.jsonl"), "--field", "review",
         "--label-field", "stars", "--out", str(tmp_path / "cls")],
        capsys,
    )  # fmt: skip
    with pytest.raises(ConfigError, match=r"holds classification data .* not a token stream"):
        open_split(tmp_path / "cls", "train")


def test_the_built_in_examples_are_balanced_and_reproducible(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    examples = example_examples()
    counts = Counter(e.label for e in examples)
    assert sorted(counts) == sorted(EXAMPLE_PACKAGES) and set(counts.values()) == {EXAMPLE_PER_LABEL}
    where, _, line = examples[0].where.rpartition(":")
    below = Path(where).read_text().splitlines()[int(line) - 1 : int(line) + 30]
    assert examples[0].text in "\n".join(below)  # a real docstring line, where the row says
    assert len({e.text for e in examples}) == len(examples)
    np.testing.assert_array_equal(example_series().values, example_series().values)
    code, out = prepare(
        ["--task", "regression", "--seq-len", "64", "--horizon", "8", "--out", str(tmp_path / "r")], capsys
    )
    assert code == 0 and "1 series, 3000 rows of 2 columns" in out
    assert len(Windows(tmp_path / "r", "val", read_meta(tmp_path / "r") or {}, seq_len=64, horizon=8)) == 150 - 8 + 1
