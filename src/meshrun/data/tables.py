"""Rows of named fields from .jsonl (.jsonl.gz), .csv and .parquet files, each with where it came
from (`FILE:LINE` for jsonl and csv, `FILE row N` for parquet), for the tasks whose data are
records: classification (text, label) and regression (numeric columns). One record batch (or one
line) in memory at a time; a field a row lacks is None, a column a file lacks is refused.
"""

from __future__ import annotations

import contextlib
import csv
import gzip
import json
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from meshrun.data.sources import BATCH_ROWS, expand_sources
from meshrun.errors import ConfigError

Row = tuple[str, list[Any]]  # (where, the values of the requested fields in order)
TABLE_KINDS = ".jsonl, .jsonl.gz, .csv or .parquet"


def table_files(sources: Sequence[str], flag: str = "--source") -> list[Path]:
    """The files `sources` name (files, folders, globs), each a table meshrun reads."""
    files = expand_sources(list(sources))
    if not files:
        raise ConfigError(f"no files match {flag} {' '.join(sources)}")
    for path in files:
        if _kind(path) is None:
            raise ConfigError(f"{flag} {path} is not a table; name {TABLE_KINDS} files")
    return files


def _kind(path: Path) -> str | None:
    name = path.name.lower()
    if name.endswith((".jsonl", ".jsonl.gz")):
        return "jsonl"
    return next((kind for kind in ("csv", "parquet") if name.endswith(f".{kind}")), None)


def table_rows(path: Path, fields: Sequence[str], *, hint: str) -> Iterator[Row]:
    """Every row of `path` as the values of `fields`; `hint` says which flag names a field (for a missing column)."""
    kind = _kind(path)
    with _reading(path):
        if kind == "jsonl":
            yield from _jsonl_rows(path, fields)
        elif kind == "csv":
            yield from _csv_rows(path, fields, hint)
        else:
            yield from _parquet_rows(path, fields, hint)


@contextlib.contextmanager
def _reading(path: Path) -> Iterator[None]:
    """A file that cannot be read or parsed: one line naming it."""
    try:
        yield
    except ConfigError:
        raise
    except OSError as exc:
        raise ConfigError(f"cannot read {path}: {exc.strerror or exc}") from None
    except Exception as exc:  # noqa: BLE001 - pyarrow / csv / gzip errors: the file does not parse
        raise ConfigError(f"cannot read {path}: {' '.join(str(exc).split()) or 'unreadable'}") from None


def _jsonl_rows(path: Path, fields: Sequence[str]) -> Iterator[Row]:
    opener = gzip.open if path.name.lower().endswith(".gz") else open
    with opener(path, "rb") as f:
        for number, raw in enumerate(f, 1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError:
                raise ConfigError(f"{path}:{number} is not UTF-8 text; convert the file to UTF-8") from None
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as exc:
                raise ConfigError(f"{path}:{number} is not valid JSON ({exc.msg}); fix the line") from None
            if not isinstance(record, dict):
                raise ConfigError(f"{path}:{number} is not a JSON object of fields; write one object per line")
            yield f"{path}:{number}", [record.get(name) for name in fields]


def _csv_rows(path: Path, fields: Sequence[str], hint: str) -> Iterator[Row]:
    """A header line, then one record per line (quoted cells may span lines: the record's first line is named)."""
    with open(path, newline="", encoding="utf-8-sig") as f:  # a spreadsheet's BOM is no part of the first name
        reader = csv.reader(f)
        header = next(reader, None)
        if header is None:
            raise ConfigError(f"{path} is empty; a .csv needs a header line naming its columns")
        columns = [_column_index(header, name, path, hint) for name in fields]
        start = reader.line_num + 1
        for record in reader:
            if any(cell.strip() for cell in record):
                yield f"{path}:{start}", [record[k] if k < len(record) else None for k in columns]
            start = reader.line_num + 1


def _column_index(header: list[str], name: str, path: Path, hint: str) -> int:
    names = [cell.strip() for cell in header]
    if name not in names:
        raise ConfigError(f"{path} has no column {name!r} (columns: {', '.join(names)}); {hint}")
    return names.index(name)


def _parquet_rows(path: Path, fields: Sequence[str], hint: str) -> Iterator[Row]:
    import pyarrow.parquet as pq

    table = pq.ParquetFile(path)
    for name in fields:
        _column_index(table.schema_arrow.names, name, path, hint)
    number = 0
    for batch in table.iter_batches(batch_size=BATCH_ROWS, columns=list(dict.fromkeys(fields))):
        values = [batch.column(name).to_pylist() for name in fields]
        for row in zip(*values):
            number += 1
            yield f"{path} row {number}", list(row)


def column_names(path: Path) -> list[str]:
    """The columns of a .csv (its header line) or .parquet file."""
    with _reading(path):
        if _kind(path) == "csv":
            with open(path, newline="", encoding="utf-8-sig") as f:  # a spreadsheet's BOM is no part of the first name
                return [cell.strip() for cell in next(csv.reader(f), [])]
        import pyarrow.parquet as pq

        return list(pq.ParquetFile(path).schema_arrow.names)
