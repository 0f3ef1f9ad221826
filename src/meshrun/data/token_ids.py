"""Token files checked once against what they claim: every id inside the vocabulary, and equal to
the largest id meshrun recorded when it prepared them (a meta.json whose dtype lies but whose sizes
agree reads other ids, which a worker would meet as an IndexError, or train on, silently).

The ids are read in chunks (bounded memory, about 10 GB/s from the page cache) on first open and
the result cached under the user's cache folder, keyed by the file's path, size and mtime, so
every later launch reads a few bytes instead. Nothing is written beside the data: nanoGPT and
Megatron files are read where they are and are not meshrun's.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from meshrun.data.locations import cache_root
from meshrun.errors import ConfigError, RunError
from meshrun.files.atomic import write_atomic

CHUNK = 1 << 24  # tokens per read: 16 Mi (at most 128 MB of int64 at a time)
HEAD = 1 << 16  # tokens the width check looks at


@dataclass(frozen=True)
class TokenFile:
    """A whole file of token ids as its description claims them."""

    path: Path
    dtype: np.dtype
    max_id: int | None = None  # recorded when meshrun wrote it (-1: no tokens); None: not recorded
    card: Path | None = None  # the file that claims the dtype (meta.json); None: data.format does


def token_range(segments: Sequence[np.ndarray], chunk: int = CHUNK) -> tuple[int, int]:
    """The smallest and largest id in `segments` ((0, -1) when empty), read in chunks: a memmap is
    never loaded whole."""
    low, high = 0, -1
    for segment in segments:
        for start in range(0, len(segment), chunk):
            piece = segment[start : start + chunk]
            low, high = min(low, int(piece.min())), max(high, int(piece.max()))
    return low, high


def looks_wider(tokens: np.ndarray) -> bool:
    """Ids of a wider dtype read as uint8 / uint16 have a 0 in every second place (their high
    half): in the first 64k of real data that never happens."""
    head = tokens[:HEAD]
    return len(head) >= 64 and not head[1::2].any() and bool(head[0::2].any())


def file_range(path: Path, dtype: np.dtype) -> tuple[int, int]:
    """(smallest, largest) id in the file read as `dtype`, from the cache when the file is unchanged."""
    stat = path.stat()
    key = json.dumps([str(path.resolve()), stat.st_size, stat.st_mtime_ns, dtype.str])
    entry = _cache_folder() / f"{hashlib.sha256(key.encode()).hexdigest()[:32]}.json"
    with contextlib.suppress(OSError, ValueError, KeyError, TypeError):
        cached = json.loads(entry.read_text())
        if cached["key"] == key:
            return int(cached["low"]), int(cached["high"])
    tokens = [np.memmap(path, dtype=dtype, mode="r")] if stat.st_size >= dtype.itemsize else []
    low, high = token_range(tokens)
    with contextlib.suppress(OSError, RunError):  # no cache (read-only home, full disk): check again next time
        entry.parent.mkdir(parents=True, exist_ok=True)
        write_atomic(entry, json.dumps({"key": key, "low": low, "high": high}))
    return low, high


def _head_looks_wider(file: TokenFile) -> bool:
    return file.path.stat().st_size >= file.dtype.itemsize and looks_wider(np.memmap(file.path, file.dtype, "r"))


def _cache_folder() -> Path:
    return cache_root() / "token-ranges"


def check_token_files(
    files: list[TokenFile], *, vocab_size: int | None, model_vocab_size: int, key: str = "model.vocab_size"
) -> None:
    """Every id of `files` is what their description says: under `vocab_size` (the data's own,
    when recorded) and the model's, and, where recorded, exactly the largest id meshrun wrote."""
    for file in files:
        said = f"{file.card.name} says {file.dtype.name}" if file.card else f"read as {file.dtype.name}"
        if file.card is not None and file.dtype.itemsize <= 2 and _head_looks_wider(file):
            raise ConfigError(
                f"{file.path} holds wider ids than {said} (every second value is 0); "
                "the dataset is damaged or not meshrun's: prepare it again"
            )
        low, high = file_range(file.path, file.dtype)
        if low < 0:
            raise ConfigError(
                f"{file.path} holds token id {low} ({said}); token ids cannot be negative: check data.format"
            )
        if file.max_id is not None and high != file.max_id:
            raise ConfigError(
                f"{file.path} holds ids up to {high} ({said}) but its largest id was {file.max_id} when prepared; "
                "the dtype or the file is wrong: prepare the data again"
            )
        if vocab_size is not None and high >= vocab_size:
            raise ConfigError(
                f"{file.path} holds token id {high} ({said}), beyond the data's vocabulary of {vocab_size}; "
                "the dataset is damaged or its meta.json is not its own: prepare it again"
            )
        if high >= model_vocab_size:
            raise ConfigError(
                f"{file.path} holds token id {high} but the model has {model_vocab_size} tokens ({key}); "
                f"set {key} to at least {high + 1}, or check that data.format and the tokenizer match the model"
            )
