"""Pairs of texts (source -> target) for sequence-to-sequence training, stored and batched with padding.

Layout (meta.json "format": "pairs"): per split, `{split}.source.bin` / `{split}.target.bin`
(token ids laid end to end, smallest dtype) and `{split}.source.idx` / `{split}.target.idx`
(little-endian uint64 offsets, one more than pairs). Ids are the tokenizer's ids + 3: 0 is
padding, 1 starts a target (BOS), 2 ends it (EOS), so one vocabulary serves every tokenizer.

Batches are padded to the length L of their bucket (L = seq_len without `data.buckets`):
- encdec (`source_len` given): x = [source padded to S | BOS target, padded], y = [target EOS,
  padded with IGNORE]; x is (B, L), y is (B, L - S), S = L * source_len / seq_len (the model
  splits x by the same ratio).
- decoder-only: x = source BOS target, y = the next tokens, the source's positions IGNORE.
Without buckets, sample `i` of a split is pair `hash(seed, i) mod num_pairs`, as for token
windows. With buckets, each pair belongs to the shortest bucket it fits (else the longest), and
global batch `b` (samples b*G .. b*G+G-1) draws every sample from one bucket, chosen by
hash(seed, b) with odds proportional to the bucket's pairs; sample `i` is that bucket's pair
`hash(seed, i) mod its pairs`. Both are pure functions of the global sample index, so any dp x pp
split sees the same global batches, and resuming needs only the samples consumed.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
import sysconfig
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from meshrun.data.hashing import splitmix64
from meshrun.data.prepare import AlreadyPrepared, _check_out, publishing
from meshrun.data.storage import IGNORE, OFFSET_DTYPE, SPLITS, read_meta, smallest_dtype, tokenizer_file, write_rows
from meshrun.data.token_ids import TokenFile
from meshrun.data.tokenize import TokenizerSpec, byte_tokenizer, encode_texts, load_tokenizer
from meshrun.errors import ConfigError
from meshrun.files.confined import confined

PAD, BOS, EOS, NUM_SPECIAL = 0, 1, 2, 3
EXAMPLE_MAX_CHARS = 24  # the example config's model.source_len
PAIRS_AGAIN = "prepare the pairs again"
_SNAKE_DEF = re.compile(r"^\s*def ([a-z][a-z0-9]*(?:_[a-z0-9]+)+)\(", re.MULTILINE)


def read_pairs(
    sources: list[str], *, source_field: str = "source", target_field: str = "target"
) -> list[tuple[str, str]]:
    """One .jsonl file (two fields per line) or two aligned text files (line k of each)."""
    paths = [Path(s) for s in sources]
    for path in paths:
        if not path.is_file():
            raise ConfigError(f"pairs source {path} is not a file; give one .jsonl file or two aligned text files")
    if len(paths) == 1 and paths[0].suffix == ".jsonl":
        return [
            _jsonl_pair(line, paths[0], n, source_field, target_field)
            for n, line in enumerate(_lines(paths[0]), 1)
            if line.strip()
        ]
    if len(paths) == 2:
        sources_text, targets = (_lines(p) for p in paths)
        if len(sources_text) != len(targets):
            raise ConfigError(
                f"{paths[0]} has {len(sources_text)} lines but {paths[1]} has {len(targets)}; "
                "aligned text files need one target line per source line"
            )
        return list(zip(sources_text, targets))
    raise ConfigError("pairs need one .jsonl file (with --source-field / --target-field) or two aligned text files")


def _lines(path: Path) -> list[str]:
    """The file's lines, refusing text that is not UTF-8 at its FILE:LINE."""
    raw = path.read_bytes()
    try:
        return raw.decode("utf-8").splitlines()
    except UnicodeDecodeError as exc:
        line = raw.count(b"\n", 0, exc.start) + 1
        raise ConfigError(
            f"{path}:{line} is not UTF-8 text (byte {raw[exc.start]:#04x}); convert the file to UTF-8"
        ) from None


def _jsonl_pair(line: str, path: Path, number: int, source_field: str, target_field: str) -> tuple[str, str]:
    try:
        record = json.loads(line)
    except json.JSONDecodeError as exc:
        raise ConfigError(f"{path}:{number} is not valid JSON ({exc.msg}); fix the line") from None
    texts: list[str] = []
    for field in (source_field, target_field):
        text = record.get(field) if isinstance(record, dict) else None
        if not isinstance(text, str):
            raise ConfigError(f"{path}:{number} has no text field {field!r}; pass --source-field / --target-field")
        texts.append(text)
    return texts[0], texts[1]


def prepare_pairs(
    pairs: list[tuple[str, str]],
    out: str | Path,
    *,
    val_fraction: float = 0.05,
    tokenizer: str = "byte",
    reuse: bool = False,
) -> dict[str, Any]:
    """Tokenize pairs into a new folder; the last `val_fraction` of them (at least one) are validation.
    `reuse`: as for `prepare` (a dataset in `out`, or one another job prepares meanwhile, is used)."""
    out = Path(out)
    if len(pairs) < 2:
        raise ConfigError(f"{len(pairs)} pairs are too few to train and validate on; give at least 2")
    spec = byte_tokenizer() if tokenizer == "byte" else load_tokenizer(tokenizer)
    try:
        _check_out(out)
        with publishing(out) as staging:  # renamed to `out` when complete: an interrupted run leaves no dataset
            meta = _write_pairs(staging, spec, pairs, val_fraction)
    except AlreadyPrepared:
        if not reuse:
            raise
        return read_meta(out) or {}  # there already, or another job prepared it while this one waited
    return meta


def _write_pairs(staging: Path, spec: TokenizerSpec, pairs: list[tuple[str, str]], val_fraction: float) -> dict:
    """Every split's token ids and offsets, the tokenizer and meta.json into `staging`."""
    dtype = smallest_dtype(spec.vocab_size + NUM_SPECIAL)
    cut = len(pairs) - max(1, round(len(pairs) * val_fraction))
    splits = {}
    for split, chunk in zip(SPLITS, (pairs[:cut], pairs[cut:])):
        splits[split] = {"pairs": len(chunk), "max_id": {}}  # max_id: checked on first open
        for side, texts in (("source", [s for s, _ in chunk]), ("target", [t for _, t in chunk])):
            splits[split]["max_id"][side] = write_rows(
                staging, f"{split}.{side}", encode_texts(spec, texts, shift=NUM_SPECIAL), dtype
            )
    if spec.json_text is not None:
        (staging / "tokenizer.json").write_text(spec.json_text)
    meta = {
        "format": "pairs",
        "dtype": dtype.name,
        "vocab_size": spec.vocab_size + NUM_SPECIAL,
        "tokenizer": spec.describe(),
        "special_ids": {"pad": PAD, "bos": BOS, "eos": EOS},
        "splits": splits,
    }
    (staging / "meta.json").write_text(json.dumps(meta, indent=2))
    return meta


def bucket_lengths(buckets: Sequence[int], *, seq_len: int, source_len: int | None) -> list[int]:
    """Padded sample lengths, ascending, ending at seq_len; encdec lengths must split by source_len / seq_len."""
    lengths = sorted({*buckets, seq_len})
    if lengths[0] < 2 or lengths[-1] != seq_len:
        raise ConfigError(f"data.buckets {list(buckets)} must lie in 2 .. model.seq_len ({seq_len}); change them")
    uneven = [n for n in lengths if source_len is not None and (n * source_len % seq_len or n * source_len < seq_len)]
    if uneven:
        raise ConfigError(
            f"data.buckets {uneven} do not split into source and target by model.source_len / model.seq_len "
            f"({source_len}/{seq_len}): use multiples of {seq_len // math.gcd(seq_len, source_len or 1)}"
        )
    return lengths


class Rows:
    """Ragged token rows `{split}.{side}.bin` + `.idx` (one side of pairs, or labelled texts); the
    offsets must cover the .bin exactly (rising from 0 to its last token), or rows would read past
    it or skip part of it. `again`: how to remake them, as messages say it."""

    def __init__(
        self, folder: Path, split: str, side: str, dtype: np.dtype, max_id: int | None, *, again: str = PAIRS_AGAIN
    ) -> None:
        card = folder / "meta.json"
        idx, path = (confined(folder, f"{split}.{side}.{ext}", source=card) for ext in ("idx", "bin"))
        try:
            self.offsets = np.fromfile(idx, dtype=OFFSET_DTYPE).astype(np.int64)
            size = path.stat().st_size
        except OSError as exc:
            raise ConfigError(f"{folder}: {split}.{side} cannot be read ({exc}); {again}") from None
        offsets = self.offsets
        if not len(offsets) or offsets[0] or np.any(np.diff(offsets) < 0) or offsets[-1] * dtype.itemsize != size:
            raise ConfigError(
                f"{idx}: offsets out of range ({len(offsets)} offsets from {offsets[:1].tolist()} to "
                f"{offsets[-1:].tolist()}, for the {size // dtype.itemsize} {dtype.name} tokens of {path.name}); "
                f"{again}"
            )
        self.tokens = np.memmap(path, dtype=dtype, mode="r") if size else np.zeros(0, dtype)
        self.lengths = np.diff(offsets)
        self.file = TokenFile(path, dtype, max_id, card)

    def row(self, k: int) -> np.ndarray:
        return np.asarray(self.tokens[self.offsets[k] : self.offsets[k + 1]], dtype=np.int64)


class PairsDataset:
    """Padded (x, y) batches of pairs; `target_tokens` counts a batch's non-pad targets without reading tokens."""

    def __init__(
        self,
        data_dir: str | Path,
        split: str,
        meta: dict[str, Any],
        *,
        seq_len: int,
        seed: int,
        source_len: int | None,
        buckets: Sequence[int] = (),
        global_batch: int = 1,
    ) -> None:
        folder = Path(data_dir)
        dtype, self.vocab_size, max_ids = _card(folder, meta, split)
        self.source, self.target = (
            Rows(folder, split, side, dtype, max_ids.get(side)) for side in ("source", "target")
        )
        self.files = [self.source.file, self.target.file]
        self.num_pairs = len(self.source.lengths)
        if not self.num_pairs or self.num_pairs != len(self.target.lengths):
            raise ConfigError(
                f"{folder} ({split}) holds {self.num_pairs} sources and {len(self.target.lengths)} targets; "
                "prepare the pairs again"
            )
        tokenizer_file(folder)  # refuses a tokenizer.json linked out of the folder, before any worker
        self.tokenizer, self.where = meta.get("tokenizer"), f"{folder} ({split})"
        self.seq_len, self.source_len, self.global_batch = seq_len, source_len, global_batch
        self.salt = np.uint64((seed * 2 + SPLITS.index(split)) & 0xFFFFFFFF) << np.uint64(32)
        self.lengths: Sequence[int] = bucket_lengths(buckets, seq_len=seq_len, source_len=source_len)
        home = self._home_buckets()
        members = [np.flatnonzero(home == k) for k in range(len(self.lengths))]
        self.lengths, self.members = zip(*[(n, m) for n, m in zip(self.lengths, members) if len(m)])  # no empty ones
        occupied = np.cumsum([len(m) for m in self.members], dtype=np.float64)
        self.thresholds = np.array([int(c * 2.0**64) for c in occupied[:-1] / occupied[-1]], dtype=np.uint64)

    def _home_buckets(self) -> np.ndarray:
        """Each pair's bucket: the shortest whose source and target sides hold it whole, else the longest."""
        source, target = self.source.lengths, self.target.lengths + 1  # BOS target / target EOS
        if self.source_len is None:
            fits = [source + target <= length for length in self.lengths]
        else:
            fits = [(source <= s) & (target <= length - s) for length, s in zip(self.lengths, self._split())]
        fits[-1][:] = True
        return np.argmax(np.stack(fits), axis=0)

    def _split(self) -> list[int]:
        """Source tokens S of each bucket (encdec: the model.source_len / model.seq_len share of its length)."""
        return [length * (self.source_len or 0) // self.seq_len for length in self.lengths]

    def bucket(self, first: int) -> int:
        """The bucket of the global batch holding global sample `first`."""
        if len(self.lengths) == 1:
            return 0
        step = np.array([first // self.global_batch], dtype=np.uint64)
        return int(np.searchsorted(self.thresholds, splitmix64(splitmix64(step ^ self.salt)), side="right")[0])

    def pairs(self, first: int, count: int) -> np.ndarray:
        """Pair numbers of samples first .. first+count-1, all within one global batch."""
        bucket = self.bucket(first)
        if len(self.lengths) > 1 and (first + count - 1) // self.global_batch != first // self.global_batch:
            raise ValueError(f"samples {first}..{first + count - 1} cross a global batch of {self.global_batch}")
        index = np.arange(first, first + count, dtype=np.uint64)
        members = self.members[bucket]
        return members[(splitmix64(index ^ self.salt) % np.uint64(len(members))).astype(np.int64)]

    def _visible_targets(self, which: np.ndarray, length: int, source: int) -> np.ndarray:
        """Target tokens (target + EOS) that fit each sample: the loss counts exactly these."""
        wanted = self.target.lengths[which] + 1
        if self.source_len is not None:
            return np.minimum(wanted, length - source)
        return np.clip(length - self.source.lengths[which], 0, wanted)

    def target_tokens(self, first: int, count: int) -> int:
        bucket = self.bucket(first)
        which = self.pairs(first, count)
        return int(self._visible_targets(which, self.lengths[bucket], self._split()[bucket]).sum())

    def batch(self, first: int, count: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Samples first .. first+count-1 as (x, y), padded to their bucket's length."""
        bucket = self.bucket(first)
        which, length, source_len = self.pairs(first, count), self.lengths[bucket], self._split()[bucket]
        x = np.full((count, length), PAD, dtype=np.int64)
        y = np.full((count, length - source_len), IGNORE, dtype=np.int64)
        for row, (k, visible) in enumerate(zip(which, self._visible_targets(which, length, source_len))):
            source, target = self.source.row(k), np.concatenate([[BOS], self.target.row(k), [EOS]])
            if self.source_len is not None:
                source = source[:source_len]
                x[row, : len(source)] = source
                x[row, source_len : source_len + visible] = target[:visible]
                y[row, :visible] = target[1 : visible + 1]
            else:
                sequence = np.concatenate([source, target])[: length + 1]
                x[row, : len(sequence) - 1] = sequence[:-1]
                y[row, len(source) : len(source) + visible] = target[1 : visible + 1]
        return torch.from_numpy(x), torch.from_numpy(y)

    def source_counts(self, first: int, count: int) -> dict[str, int]:
        return {}


def _card(folder: Path, meta: dict[str, Any], split: str) -> tuple[np.dtype, int, dict[str, int]]:
    """(token dtype, vocabulary, largest id recorded per side: none before it was recorded) of meta.json."""
    try:
        dtype, vocab_size = np.dtype(meta["dtype"]), int(meta["vocab_size"])
        max_ids = {side: int(high) for side, high in meta["splits"][split].get("max_id", {}).items()}
        if dtype.kind != "u":
            raise ValueError(f"dtype {dtype.name} is not an unsigned integer type")
    except (KeyError, TypeError, ValueError, AttributeError) as exc:
        raise ConfigError(
            f"{folder / 'meta.json'} is incomplete ({type(exc).__name__}: {exc}); prepare the pairs again"
        ) from None
    return dtype, vocab_size, max_ids


def example_pairs() -> list[tuple[str, str]]:
    """The no-download seq2seq example: snake_case function names defined in the Python standard
    library -> the same name in CamelCase (`get_terminal_size` -> `GetTerminalSize`). A rule a
    small model learns in minutes and can be checked on names it never saw; sorted by a hash so
    train and val hold different names however the library's files are ordered."""
    from meshrun.data.sources import expand_sources

    # every .py file of the library below its top-level folders (their own test suites included:
    # more names, and the example was measured on this set), site-packages and `test` left out
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    skip = {"site-packages", "dist-packages", "test", "tests", "idle_test"}
    folders = sorted(d for d in stdlib.iterdir() if d.is_dir() and d.name not in skip)
    names: set[str] = set()
    for path in expand_sources([str(stdlib / "*.py")] + [str(d / "**" / "*.py") for d in folders]):
        try:
            names.update(_SNAKE_DEF.findall(path.read_text(encoding="utf-8", errors="replace")))
        except OSError:
            continue
    names = {name for name in names if len(name) <= EXAMPLE_MAX_CHARS}
    ordered = sorted(names, key=lambda name: hashlib.sha256(name.encode()).digest())
    return [(name, "".join(word.capitalize() for word in name.split("_"))) for name in ordered]
