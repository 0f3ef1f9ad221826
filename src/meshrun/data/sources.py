"""Sources: files, folders and globs -> a stream of documents, one file at a time.

Kinds, chosen by name: `.jsonl` / `.jsonl.gz` (one JSON object per line, text under `field`),
`.parquet` (column `field`, read in record batches), a Hugging Face `datasets` folder written
by `save_to_disk` (its Arrow files, read with pyarrow), and anything else as one text document.
A record's `field` may hold token ids instead of text (a list of integers, as a tokenized
`datasets` column `input_ids`): such a document is an int64 array, stored as it is.
Nothing holds more than one record batch (or one text file) in memory.
"""

from __future__ import annotations

import fnmatch
import glob
import gzip
import hashlib
import json
import os
import sysconfig
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from meshrun.errors import ConfigError
from meshrun.files.confined import confined

BATCH_ROWS = 1024  # rows per pyarrow record batch
Document = str | bytes | np.ndarray  # text, a text file's bytes, or token ids (int64)


@dataclass(frozen=True)
class Source:
    """One input: a file, or a `datasets` folder (read as one unit)."""

    path: Path
    kind: str  # text | jsonl | parquet | hf

    def size(self) -> int:
        if self.kind != "hf":
            return self.path.stat().st_size
        return sum(f.stat().st_size for f in _hf_arrow_files(self.path))

    def sha256(self) -> str:
        digest = hashlib.sha256()
        for file in _hf_arrow_files(self.path) if self.kind == "hf" else [self.path]:
            with open(file, "rb") as f:
                while chunk := f.read(1 << 20):
                    digest.update(chunk)
        return digest.hexdigest()


def default_sources() -> list[str]:
    """A corpus every machine with Python has: the standard library's own source files, about
    9 MB. Installed packages, test suites and the generated tables (codec maps in `encodings`,
    help texts in `pydoc_data`: a third of the bytes, and no code) are left out, so a model
    trained on it writes code. One glob per folder."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    skip = {"site-packages", "dist-packages", "test", "tests", "idle_test", "encodings", "pydoc_data", "__pycache__"}
    folders = [stdlib]
    for folder in folders:  # grows while walking: breadth first, skipped folders not entered
        folders += sorted(d for d in folder.iterdir() if d.is_dir() and d.name not in skip)
    return [str(folder / "*.py") for folder in folders]


def is_hf_dataset(path: Path) -> bool:
    return (path / "dataset_dict.json").is_file() or (
        (path / "state.json").is_file() and (path / "dataset_info.json").is_file()
    )


def kind_of(path: Path) -> str:
    name = path.name.lower()
    if name.endswith((".jsonl", ".jsonl.gz")):
        return "jsonl"
    return "parquet" if name.endswith(".parquet") else "text"


def expand_sources(sources: list[str]) -> list[Path]:
    """Every file the sources name, sorted (a `datasets` folder counts as one entry)."""
    return [s.path for s in find_sources(sources)[0]]


def find_sources(sources: list[str]) -> tuple[list[Source], int]:
    """The inputs the sources name, sorted, and how many files their folders held that were
    skipped: hidden ones (.git, .cache, ...) and binary ones (a NUL byte in the first 8 KB, as git
    decides). A binary file named on its own is refused. Each file counts once, however many
    paths reach it (a `**` glob follows links to folders, round a link loop up to 40 times)."""
    found: dict[Path, Source] = {}  # by resolved path
    skipped = 0
    for source in sources:
        matches = expand_glob(source) if glob.has_magic(source) else [source]
        for match in matches:
            path = Path(match)
            if path.is_dir() and is_hf_dataset(path):
                _add(found, Source(path, "hf"))
            elif path.is_dir():
                for file in (p for p in path.rglob("*") if p.is_file()):
                    hidden = any(part.startswith(".") for part in file.relative_to(path).parts)
                    if hidden or (kind_of(file) == "text" and is_binary(file)):
                        skipped += 1
                    else:
                        _add(found, Source(file, kind_of(file)))
            elif path.is_file():
                if kind_of(path) == "text" and is_binary(path):
                    raise ConfigError(
                        f"--source {path} is not text (a NUL byte in its first 8 KB); name text, jsonl or parquet files"
                    )
                _add(found, Source(path, kind_of(path)))
    return sorted(found.values(), key=lambda s: s.path), skipped


def expand_glob(pattern: str) -> list[str]:
    """glob.glob's matches, except that `**` does not enter links to folders: glob follows them, so
    a link loop was walked round 40 times (and two links back up doubled that per level, a hang)."""
    parts = Path(pattern).parts
    if "**" not in parts:
        return glob.glob(pattern)
    fixed = next(i for i, part in enumerate(parts) if glob.has_magic(part))
    root, rest = Path(*parts[:fixed]) if fixed else Path(), parts[fixed:]
    hidden = any(part.startswith(".") for part in rest)
    matches = [str(root)] if _matches([], rest) and root.is_dir() else []  # `DIR/**` names DIR too
    for folder, dirs, files in os.walk(root):  # links to folders are listed in dirs, not entered
        if not hidden:
            dirs[:] = [d for d in dirs if not d.startswith(".")]
        below = Path(folder).relative_to(root).parts
        matches += [os.path.join(folder, name) for name in dirs + files if _matches([*below, name], rest)]
    return matches


def _matches(names: list[str], pattern: tuple[str, ...]) -> bool:
    """Path components against pattern components, as glob matches them: `**` is any number of
    folders, and a wildcard matches no hidden name unless the pattern's component starts with a dot."""
    if not pattern:
        return not names
    if pattern[0] == "**":
        return _matches(names, pattern[1:]) or (
            bool(names) and not names[0].startswith(".") and _matches(names[1:], pattern)
        )
    name_ok = bool(names) and fnmatch.fnmatchcase(names[0], pattern[0])
    visible = bool(names) and (pattern[0].startswith(".") or not names[0].startswith("."))
    return name_ok and visible and _matches(names[1:], pattern[1:])


def _add(found: dict[Path, Source], source: Source) -> None:
    """Keep one path per file: the shortest (the one not through a link loop), then the first by name."""
    real = source.path.resolve()
    known = found.get(real)
    if known is None or (len(source.path.parts), source.path) < (len(known.path.parts), known.path):
        found[real] = source


def is_binary(path: Path) -> bool:
    with open(path, "rb") as f:
        return b"\0" in f.read(8192)


def corpus_root(sources: list[Source]) -> Path:
    """The folder all sources sit below: meta.json names each source relative to it, so a corpus
    is described the same wherever it lives."""
    return Path(os.path.commonpath([s.path if s.kind == "hf" else s.path.parent for s in sources]))


def documents(source: Source, *, field: str, text: bool = False) -> Iterator[Document]:
    """The documents of one source: text files as raw bytes (byte-exact), records as str, or as
    token ids where their field holds a list of integers. `text`: the documents go to a text
    tokenizer, so a text file that is not UTF-8 is refused (decoding would turn each of its
    undecodable bytes into U+FFFD, silently; the byte tokenizer keeps them)."""
    with _reading(source.path):
        if source.kind == "text":
            raw = source.path.read_bytes()
            if text:
                check_utf8(raw, source.path)
            yield raw
        elif source.kind == "jsonl":
            yield from _jsonl(source.path, field)
        elif source.kind == "parquet":
            import pyarrow.parquet as pq

            yield from _column(pq.ParquetFile(source.path).iter_batches(batch_size=BATCH_ROWS), source.path, field)
        else:
            for file in _hf_arrow_files(source.path):
                yield from _column(_arrow_batches(file), file, field)


@contextmanager
def _reading(path: Path) -> Iterator[None]:
    """A source's read errors as one line naming it (its own ConfigErrors pass as they are)."""
    try:
        yield
    except OSError as exc:
        raise ConfigError(f"cannot read source {path}: {exc.strerror or exc}") from None
    except ConfigError:
        raise
    except Exception as exc:  # noqa: BLE001 - pyarrow / gzip / json errors: the file does not parse
        raise ConfigError(f"cannot read source {path}: {' '.join(str(exc).split()) or 'unreadable'}") from None


def check_utf8(raw: bytes, path: Path) -> None:
    """Refuse a text file that is not UTF-8, naming how many of its bytes cannot be decoded."""
    try:
        raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        lost = len(raw) - len(raw.decode("utf-8", errors="ignore").encode("utf-8"))
        raise ConfigError(
            f"{path} is not UTF-8 text: {lost} bytes cannot be decoded (the first at offset {exc.start}), and a text "
            "tokenizer would store each as U+FFFD; convert the file to UTF-8, or use the byte tokenizer (keeps every byte)"
        ) from None


def _jsonl_lines(path: Path) -> Iterator[tuple[int, Any]]:
    """(line number, parsed JSON) of each non-blank line."""
    opener = gzip.open if path.name.lower().endswith(".gz") else open
    with opener(path, "rb") as f:
        for number, raw in enumerate(f, 1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as exc:
                raise ConfigError(
                    f"{path}:{number} is not UTF-8 text (byte {raw[exc.start]:#04x} at column {exc.start + 1}); "
                    "convert the file to UTF-8"
                ) from None
            if not line.strip():
                continue
            try:
                yield number, json.loads(line)
            except json.JSONDecodeError as exc:
                raise ConfigError(
                    f"{path}:{number} is not valid JSON ({exc.msg}); fix the line or drop the file"
                ) from None


def records(source: Source, fields: tuple[str, ...]) -> Iterator[tuple[str, dict[str, Any]]]:
    """(where, record) of a jsonl, parquet or `datasets` source, each record holding at least
    `fields` (a missing one is refused, naming FILE:LINE or the file's columns); `where` is
    FILE:LINE or FILE row N, for the messages that name a bad record."""
    if source.kind == "text":
        raise ConfigError(f"{source.path} is a text file; records need .jsonl, .parquet or a datasets folder")
    with _reading(source.path):
        if source.kind == "jsonl":
            for number, record in _jsonl_lines(source.path):
                missing = [f for f in fields if not isinstance(record, dict) or f not in record]
                if missing:
                    raise ConfigError(f"{source.path}:{number} has no field {missing[0]!r}; pass its name as a flag")
                yield f"{source.path}:{number}", record
            return
        if source.kind == "parquet":
            import pyarrow.parquet as pq

            files = [(source.path, pq.ParquetFile(source.path).iter_batches(batch_size=BATCH_ROWS))]
        else:
            files = [(file, _arrow_batches(file)) for file in _hf_arrow_files(source.path)]
        for path, batches in files:
            row = 0
            for batch in batches:
                missing = [f for f in fields if f not in batch.schema.names]
                if missing:
                    names = ", ".join(batch.schema.names)
                    raise ConfigError(
                        f"{path} has no column {missing[0]!r} (columns: {names}); pass its name as a flag"
                    )
                for record in batch.select(list(fields)).to_pylist():
                    row += 1
                    yield f"{path} row {row}", record


def _jsonl(path: Path, field: str) -> Iterator[str | np.ndarray]:
    for number, record in _jsonl_lines(path):
        value = record.get(field) if isinstance(record, dict) else None
        if isinstance(value, list) and all(type(i) is int for i in value):
            widest = max(value, key=abs, default=0)
            if not -(2**63) <= widest < 2**63:
                raise ConfigError(f"{path}:{number} holds token id {widest}, beyond any vocabulary")
            yield np.array(value, dtype=np.int64)
        elif isinstance(value, str):
            yield value
        else:
            raise ConfigError(
                f"{path}:{number} has no text field {field!r} (a string, or a list of token ids); pass --field NAME"
            )


def _column(batches: Iterator, path: Path, field: str) -> Iterator[str | np.ndarray]:
    import pyarrow as pa

    for batch in batches:
        if field not in batch.schema.names:
            raise ConfigError(
                f"{path} has no column {field!r} (columns: {', '.join(batch.schema.names)}); pass --field NAME"
            )
        column = batch.column(field)
        if pa.types.is_string(column.type) or pa.types.is_large_string(column.type):
            yield from (text for text in column.to_pylist() if text is not None)
        elif _is_id_list(column.type):
            yield from _id_rows(column, path, field)
        else:
            raise ConfigError(
                f"{path}: column {field!r} holds {column.type}, not text (nor lists of token ids); "
                "pass --field NAME of a text column"
            )


def _is_id_list(kind) -> bool:
    import pyarrow as pa

    lists = pa.types.is_list(kind) or pa.types.is_large_list(kind) or pa.types.is_fixed_size_list(kind)
    return lists and pa.types.is_integer(kind.value_type)


def _id_rows(column, path: Path, field: str) -> Iterator[np.ndarray]:
    """The rows of an integer-list column as int64 array views: no Python int per token. Missing
    rows are no documents (as missing texts); a missing id inside a row is refused."""
    import pyarrow as pa

    column = column.drop_null()
    if pa.types.is_fixed_size_list(column.type):
        column = column.cast(pa.large_list(column.type.value_type))
    if column.values.null_count:
        raise ConfigError(f"{path}: column {field!r} has missing token ids inside a row; fix the data")
    values = column.values.to_numpy()
    if values.dtype == np.uint64 and len(values) and values.max() >= 2**63:
        raise ConfigError(f"{path}: column {field!r} holds token id {values.max()}, beyond any vocabulary")
    values = values.astype(np.int64, copy=False)
    offsets = column.offsets.to_numpy()
    for row in range(len(column)):
        yield values[offsets[row] : offsets[row + 1]]


def _arrow_batches(path: Path) -> Iterator:
    import pyarrow as pa

    with pa.memory_map(str(path)) as mapped:
        yield from pa.ipc.open_stream(mapped)


def _hf_arrow_files(folder: Path) -> list[Path]:
    """The Arrow files of a `save_to_disk` folder, in its own order, each inside the folder whose
    state.json names it. Of a DatasetDict only its `train` split (or its only split): the user's
    own validation and test splits stay held out."""
    card = folder / ("dataset_dict.json" if (folder / "dataset_dict.json").is_file() else "state.json")
    try:
        listed = json.loads(card.read_text())
        if card.name == "dataset_dict.json":
            splits = list(listed["splits"])
            if "train" not in splits and len(splits) != 1:
                raise ConfigError(
                    f"{folder} is a DatasetDict without a 'train' split (splits: {', '.join(splits)}); "
                    "pass the split's folder as --source"
                )
            return _hf_arrow_files(confined(folder, "train" if "train" in splits else splits[0], source=card))
        return [confined(folder, entry["filename"], source=card) for entry in listed["_data_files"]]
    except ConfigError:
        raise
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ConfigError(f"{card} does not list a `datasets` folder's files ({type(exc).__name__}: {exc})") from None
