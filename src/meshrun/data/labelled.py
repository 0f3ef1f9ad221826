"""Labelled texts for classification: records with a text field and a label field (.jsonl, .csv,
.parquet), tokenized, with the label set stored beside them.

Layout (meta.json "format" and "task": "classification"): per split `{split}.text.bin` /
`{split}.text.idx` (the tokenizer's own ids, no specials added: a model adds its [CLS] / pads
as it needs, data/pairs.py's ragged layout) and `{split}.labels.bin` (little-endian uint32 label
ids). meta.json's "labels" lists the label names sorted (integers by value, then text), so an id
is the same however the rows are ordered or split. Validation rows come from `--val-source`
(their labels must be training labels) or, without it, each row goes to train or val by a hash
of its text, as prepare-data splits documents (the label set then spans both).
Batches of it: data/labelled_batches.py.
"""

from __future__ import annotations

import hashlib
import json
import sysconfig
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from meshrun.data.prepare import _check_out, publishing, split_of
from meshrun.data.storage import SPLITS, smallest_dtype, write_rows
from meshrun.data.tables import table_files, table_rows
from meshrun.data.tokenize import TokenizerSpec, byte_tokenizer, encode_texts, load_tokenizer
from meshrun.errors import ConfigError

LABEL_DTYPE = np.dtype("<u4")


@dataclass(frozen=True)
class Example:
    text: str
    label: str
    where: str  # FILE:LINE or FILE row N


def read_examples(sources: Sequence[str], *, text_field: str, label_field: str, flag: str) -> list[Example]:
    """Every row of the tables `sources` names; a row without text or label is refused at its FILE:LINE."""
    hint = "pass --field (the text) and --label-field (the label) naming its columns"
    examples = []
    for path in table_files(sources, flag):
        for where, (text, label) in table_rows(path, [text_field, label_field], hint=hint):
            if not isinstance(text, str) or not text.strip():
                raise ConfigError(
                    f"{where} has no text in field {text_field!r}; fill it, drop the row, or pass --field"
                )
            examples.append(Example(text, _label_name(label, where, label_field), where))
    if not examples:
        raise ConfigError(f"{flag} {' '.join(sources)} holds no rows; check the files")
    return examples


def _label_name(value: Any, where: str, label_field: str) -> str:
    """A label as text: a string (stripped) or a whole number (1.0 from a float column is 1); anything else
    (missing, empty, a fraction, a list) is refused."""
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, (str, int)) or not str(value).strip():
        got = "nothing" if value is None or not str(value).strip() else f"{type(value).__name__} {value!r}"
        raise ConfigError(
            f"{where} has no label in field {label_field!r} (got {got}); every row needs a text or whole-number "
            "label: fill it, drop the row, or pass --label-field"
        )
    return str(value).strip()


def sorted_labels(names: set[str]) -> list[str]:
    """Whole numbers by value first, then text: stable ids however rows are ordered."""
    return sorted(names, key=lambda name: (0, int(name), "") if _is_whole(name) else (1, 0, name))


def _is_whole(name: str) -> bool:
    try:
        int(name)
    except ValueError:
        return False
    return True


def split_examples(
    train: list[Example], val: list[Example] | None, *, val_fraction: float
) -> tuple[list[Example], list[Example], list[str]]:
    """(train rows, val rows, label names). With separate validation rows a label training never
    saw is refused at its row; without, rows are split by a hash of their text."""
    if val is None:
        held = [split_of(e.text, val_fraction) == "val" for e in train]
        train, val = [e for e, h in zip(train, held) if not h], [e for e, h in zip(train, held) if h]
        if not val and len(train) > 1:  # tiny sets can hash every row to train
            train, val = train[:-1], train[-1:]
        labels = sorted_labels({e.label for e in train + val})
    else:
        labels = sorted_labels({e.label for e in train})
        known = set(labels)
        for example in val:
            if example.label not in known:
                raise ConfigError(
                    f"{example.where}: label {example.label!r} is not a label of the training rows "
                    f"({_shown(labels)}); fix the row or add training rows with that label"
                )
    if not train or not val:
        raise ConfigError(f"{len(train) + len(val)} rows are too few to train and validate on; give at least 2")
    return train, val, labels


def _shown(labels: list[str], limit: int = 10) -> str:
    more = f", ... {len(labels) - limit} more" if len(labels) > limit else ""
    return ", ".join(labels[:limit]) + more


def prepare_classification(
    train: list[Example],
    val: list[Example] | None,
    out: str | Path,
    *,
    val_fraction: float = 0.05,
    tokenizer: str = "byte",
    sources: Sequence[str] = (),
) -> dict[str, Any]:
    """Tokenize labelled rows into a new folder `out` (atomically, as prepare-data's other formats); returns meta.json."""
    out = Path(out)
    train, val, labels = split_examples(train, val, val_fraction=val_fraction)
    spec = byte_tokenizer() if tokenizer == "byte" else load_tokenizer(tokenizer)
    _check_out(out)
    with publishing(out) as staging:
        meta = _write(staging, spec, {"train": train, "val": val}, labels)
        meta["sources"] = list(sources)
        (staging / "meta.json").write_text(json.dumps(meta, indent=2))
    return meta


def _write(staging: Path, spec: TokenizerSpec, rows: dict[str, list[Example]], labels: list[str]) -> dict[str, Any]:
    ids = {name: k for k, name in enumerate(labels)}
    dtype = smallest_dtype(spec.vocab_size)
    splits: dict[str, Any] = {}
    for split in SPLITS:
        examples = rows[split]
        encoded = encode_texts(spec, [e.text for e in examples], shift=0)
        empty = next((e for e, r in zip(examples, encoded) if not len(r)), None)
        if empty is not None:
            raise ConfigError(f"{empty.where}: the text encodes to no tokens; drop the row")
        max_id = write_rows(staging, f"{split}.text", encoded, dtype)
        np.array([ids[e.label] for e in examples], dtype=LABEL_DTYPE).tofile(staging / f"{split}.labels.bin")
        counts = Counter(e.label for e in examples)
        splits[split] = {"examples": len(examples), "max_id": max_id, "label_counts": {n: counts[n] for n in labels}}
    if spec.json_text is not None:
        (staging / "tokenizer.json").write_text(spec.json_text)
    return {
        "format": "classification",
        "task": "classification",
        "dtype": dtype.name,
        "vocab_size": spec.vocab_size,
        "tokenizer": spec.describe(),
        "labels": labels,
        "num_labels": len(labels),
        "labels_dtype": LABEL_DTYPE.str,
        "splits": splits,
    }


EXAMPLE_PACKAGES = ("asyncio", "email", "http", "importlib", "logging", "multiprocessing", "unittest", "xml")
EXAMPLE_PER_LABEL = 130  # balanced: a majority-class guess scores 1/8


def example_examples() -> list[Example]:
    """The no-download classification example: the first docstring line of functions and classes of
    eight standard-library packages, labelled by the package ("Return the payload as a string" ->
    email). Up to EXAMPLE_PER_LABEL lines each, chosen by a hash, so the set is balanced and the
    same however the files are ordered (its exact rows follow the Python version)."""
    import ast

    stdlib = Path(sysconfig.get_paths()["stdlib"])
    examples = []
    for package in EXAMPLE_PACKAGES:
        lines: dict[str, str] = {}
        for path in sorted((stdlib / package).rglob("*.py")):
            try:
                tree = ast.parse(path.read_text(encoding="utf-8"))
            except (OSError, SyntaxError, UnicodeDecodeError, ValueError):
                continue
            for node in ast.walk(tree):
                if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                    first = (ast.get_docstring(node) or "").strip().split("\n")[0].strip()
                    if len(first) >= 20:
                        lines.setdefault(first, f"{path}:{node.lineno}")
        chosen = sorted(lines, key=lambda text: hashlib.sha256(text.encode()).digest())[:EXAMPLE_PER_LABEL]
        examples += [Example(text, package, lines[text]) for text in chosen]
    return examples
