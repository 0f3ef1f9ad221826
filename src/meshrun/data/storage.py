"""Token storage: meshrun's shards (written and read), nanoGPT's and Megatron-LM's files (read).

Every reader returns a `TokenSplit`: the split's tokens as a list of read-only 1-D memmaps
(training windows never cross from one to the next) plus what is known of the vocabulary, and
the files they come from with what their description claims (checked by token_ids). A file a
meta.json names is read only inside the meta.json's folder (meshrun.files.confined).

meshrun's layout (meta.json "format": "meshrun"): `{split}-{k:05d}.bin` shards of raw tokens in
the smallest sufficient dtype, `{split}.docs.bin` (little-endian uint64 start offset of each
document in the split), meta.json last (its presence marks a complete dataset). Datasets from
meshrun 0.1 (`train.bin` / `val.bin` bytes, no "format") are read as one uint8 shard.
Supervised documents ("format": "documents", data/chat.py) add beside each shard its loss mask
`{split}-{k:05d}.mask.bin` (one uint8 per token, 1 = trained): `open_documents` reads them.
"""

from __future__ import annotations

import os
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from meshrun.data.token_ids import TokenFile, looks_wider
from meshrun.errors import ConfigError
from meshrun.files.confined import confined
from meshrun.files.json_reader import read_json

SPLITS = ("train", "val")
IGNORE = -100  # target id of padding: the loss skips it (F.cross_entropy's default ignore_index)
DOC_DTYPE = np.dtype("<u8")
MASK_DTYPE = np.dtype(np.uint8)
DOCUMENTS_FORMAT = "documents"  # meta.json "format" of documents with loss masks (data/supervised.py)
OFFSET_DTYPE = np.dtype("<u8")  # ragged rows (pairs, labelled texts): where each row starts, and the end
MEGATRON_HEADER = b"MMIDIDX\x00\x00"
# Megatron-LM's DType codes (megatron/core/datasets/indexed_dataset.py)
MEGATRON_DTYPES = {
    1: np.uint8,
    2: np.int8,
    3: np.int16,
    4: np.int32,
    5: np.int64,
    6: np.float64,
    7: np.float32,
    8: np.uint16,
}


@dataclass
class TokenSplit:
    segments: list[np.ndarray]
    vocab_size: int | None  # None: not recorded in the files (nanoGPT): the config's model.vocab_size
    tokenizer: dict[str, Any] | None
    where: str
    files: list[TokenFile] = field(default_factory=list)  # every file the tokens come from, whole

    @property
    def num_tokens(self) -> int:
        return sum(len(s) for s in self.segments)


def smallest_dtype(vocab_size: int) -> np.dtype:
    for dtype in (np.uint8, np.uint16, np.uint32):
        if vocab_size - 1 <= np.iinfo(dtype).max:
            return np.dtype(dtype)
    raise ConfigError(f"vocabulary of {vocab_size} tokens does not fit uint32")


class SplitWriter:
    """Appends encoded documents to one split's shards; a shard closes at the first document
    boundary past `shard_tokens`, so shards (and windows) always hold whole documents.
    `masks`: each shard gets a loss-mask shard beside it (one uint8 per token)."""

    def __init__(self, folder: Path, split: str, dtype: np.dtype, shard_tokens: int, *, masks: bool = False) -> None:
        self.folder, self.split, self.dtype, self.shard_tokens = folder, split, dtype, shard_tokens
        self.shards: list[dict[str, Any]] = []
        self.num_tokens = self.num_docs = self.num_trained = 0
        self.last_doc_start = 0
        self.masks = masks
        self._file: Any = None
        self._mask_file: Any = None
        self._docs = open(folder / f"{split}.docs.bin", "wb")  # noqa: SIM115 - open while the split is written

    def add(self, tokens: np.ndarray, lengths: np.ndarray, mask: np.ndarray | None = None) -> None:
        """Documents laid end to end in `tokens`, `lengths` tokens each (and their loss mask,
        as long as `tokens`, when the writer keeps masks)."""
        if not len(lengths):
            return
        if self.masks != (mask is not None) or (mask is not None and len(mask) != len(tokens)):
            raise ValueError("a loss mask goes with every document of a masked split, token for token")
        ends = np.cumsum(lengths)
        self._docs.write((self.num_tokens + ends - lengths).astype(DOC_DTYPE).tobytes())
        self.last_doc_start = self.num_tokens + int(ends[-1] - lengths[-1])
        self.num_docs += len(lengths)
        done = 0
        while done < len(tokens):
            room = self.shard_tokens - (self.shards[-1]["tokens"] if self._file else 0)
            crossing = int(np.searchsorted(ends, done + room, side="left"))  # the document that fills the shard
            end = int(ends[min(crossing, len(ends) - 1)])
            self._write(tokens[done:end], None if mask is None else mask[done:end])
            done = end
            if self.shards[-1]["tokens"] >= self.shard_tokens:
                self._close_shard()

    def _write(self, tokens: np.ndarray, mask: np.ndarray | None) -> None:
        if self._file is None:
            name = f"{self.split}-{len(self.shards):05d}.bin"
            self.shards.append({"file": name, "tokens": 0, "max_id": -1})  # max_id: checked on first open
            self._file = open(self.folder / name, "wb")  # noqa: SIM115 - open until the shard is full
            if self.masks:
                self.shards[-1]["mask"] = name.replace(".bin", ".mask.bin")
                self._mask_file = open(self.folder / self.shards[-1]["mask"], "wb")  # noqa: SIM115 - as the shard
        self._file.write(tokens.astype(self.dtype).tobytes())
        if mask is not None:
            self._mask_file.write(mask.astype(MASK_DTYPE).tobytes())
            self.num_trained += int(np.count_nonzero(mask))
        self.shards[-1]["tokens"] += len(tokens)
        if len(tokens):
            self.shards[-1]["max_id"] = max(self.shards[-1]["max_id"], int(tokens.max()))
        self.num_tokens += len(tokens)

    def _close_shard(self) -> None:
        for file in (self._file, self._mask_file):
            if file is not None:
                file.close()
        self._file = self._mask_file = None

    def pop_last_document(self) -> tuple[np.ndarray, np.ndarray | None]:
        """Take the last document back out (the tail of the last shard): its uint32 tokens and
        its loss mask (None without masks)."""
        self._close_shard()
        self._docs.flush()
        shard = self.shards[-1]
        keep = shard["tokens"] - (self.num_tokens - self.last_doc_start)
        path = self.folder / shard["file"]
        stored = np.fromfile(path, dtype=self.dtype)
        tokens = stored[keep:].astype(np.uint32)
        _truncate(path, keep * self.dtype.itemsize)
        mask = None
        if self.masks:
            mask_path = self.folder / shard["mask"]
            mask = np.fromfile(mask_path, dtype=MASK_DTYPE)[keep:]
            _truncate(mask_path, keep * MASK_DTYPE.itemsize)
            self.num_trained -= int(np.count_nonzero(mask))
        shard["tokens"], shard["max_id"] = keep, int(stored[:keep].max()) if keep else -1
        if keep == 0:
            path.unlink()
            if self.masks:
                (self.folder / shard["mask"]).unlink()
            self.shards.pop()
        self.num_tokens -= len(tokens)
        self.num_docs -= 1
        self._docs.truncate(self.num_docs * DOC_DTYPE.itemsize)
        self._docs.seek(0, 2)
        if self.num_docs:
            self.last_doc_start = int(np.fromfile(self._docs.name, dtype=DOC_DTYPE)[-1])
        return tokens, mask

    def close(self) -> dict[str, Any]:
        self._close_shard()
        self._docs.close()
        return {
            "tokens": self.num_tokens,
            "documents": self.num_docs,
            **({"trained_tokens": self.num_trained} if self.masks else {}),
            "shards": self.shards,
            "documents_file": f"{self.split}.docs.bin",
        }


def _truncate(path: Path, size: int) -> None:
    with open(path, "r+b") as f:
        f.truncate(size)


def write_rows(folder: Path, stem: str, rows: list[np.ndarray], dtype: np.dtype) -> int:
    """Ragged rows as `{stem}.bin` (ids end to end) + `{stem}.idx` (uint64 offsets, one more than rows);
    returns the largest id (-1: none), which meta.json records."""
    ids = np.concatenate(rows) if rows else np.zeros(0, np.int64)
    ids.astype(dtype).tofile(folder / f"{stem}.bin")
    np.cumsum([0, *map(len, rows)]).astype(OFFSET_DTYPE).tofile(folder / f"{stem}.idx")
    return int(ids.max()) if len(ids) else -1


# -- readers ------------------------------------------------------------------------------------


def read_meta(folder: Path) -> dict[str, Any] | None:
    path = folder / "meta.json"
    if not path.is_file():
        return None
    try:
        meta = read_json(path)
    except (OSError, ValueError) as exc:
        raise ConfigError(
            f"{path} cannot be read ({exc}); prepare the data again with `meshrun prepare-data`"
        ) from None
    if not isinstance(meta, dict):
        raise ConfigError(f"{path} is not a meshrun dataset description; prepare the data again")
    return meta


def open_split(path: str | Path, split: str, *, format: str = "meshrun", val_fraction: float = 0.05) -> TokenSplit:
    path = Path(path)
    if format in ("nanogpt", "nanogpt-uint32"):
        dtype = np.uint32 if format == "nanogpt-uint32" else np.uint16
        tokens = _flat_split(
            path, split, dtype, vocab_size=None, hint="point data.dir at a nanoGPT data folder (train.bin, val.bin)"
        )
        if dtype == np.uint16:
            _check_not_uint32(tokens)
        return tokens
    if format == "megatron":
        return _megatron(path, split, val_fraction)
    meta = read_meta(path)
    if meta is None or "format" not in meta:  # meshrun 0.1: bytes, train.bin / val.bin
        return _flat_split(path, split, np.uint8, vocab_size=256, hint=f"run `meshrun prepare-data --out {path}`")
    if meta["format"] == DOCUMENTS_FORMAT:  # their loss masks and boundaries would be ignored
        raise ConfigError(
            f"{path} holds {meta.get('kind', 'chat')} documents with a loss mask (prepare-data --chat or "
            "--prompt-completion), which train only as data.dir (packed rows), not as a data.mixture source or "
            "token stream; set data.dir to it"
        )
    if meta["format"] == "pairs":  # only data.dir reads pairs (PairsDataset); a token stream would mix them
        raise ConfigError(
            f"{path} holds source/target pairs, which train only as data.dir, not as a data.mixture source or "
            "token stream; prepare the sources without --pairs to mix them"
        )
    if meta["format"] in ("classification", "regression"):  # records, not a token stream
        raise ConfigError(
            f"{path} holds {meta['format']} data (prepared with --task {meta['format']}), not a token stream; "
            f"point data.dir at text prepared for this task, or set task: {meta['format']}"
        )
    return _shards(path, split, meta)


def _flat_split(folder: Path, split: str, dtype: type, *, vocab_size: int | None, hint: str) -> TokenSplit:
    path = folder / f"{split}.bin"
    if not path.is_file():
        raise ConfigError(f"data.dir {folder} has no {path.name}; {hint}")
    itemsize = np.dtype(dtype).itemsize
    if path.stat().st_size % itemsize:
        raise ConfigError(
            f"{path} is {path.stat().st_size} bytes, not a whole number of {np.dtype(dtype).name} tokens; "
            "check data.format"
        )
    segments: list[np.ndarray] = [np.memmap(path, dtype=dtype, mode="r")] if path.stat().st_size else []
    return TokenSplit(segments, vocab_size, None, str(path), [TokenFile(path, np.dtype(dtype))])


def _check_not_uint32(tokens: TokenSplit) -> None:
    """uint32 ids below 65536 read as uint16 are the ids with a 0 after each: training on them
    would run, on garbage."""
    if tokens.segments and looks_wider(tokens.segments[0]):
        raise ConfigError(
            f"{tokens.where} looks like uint32 token ids (every second uint16 is 0); set data.format=nanogpt-uint32"
        )


def _shards(folder: Path, split: str, meta: dict[str, Any]) -> TokenSplit:
    card = folder / "meta.json"
    try:
        dtype, info = np.dtype(meta["dtype"]), meta["splits"][split]
        if dtype.kind != "u":
            raise ValueError(f"dtype {dtype.name} is not an unsigned integer type")
        segments, files = [], []
        for shard in info["shards"]:
            path = confined(folder, shard["file"], source=card)
            if path.stat().st_size != shard["tokens"] * dtype.itemsize:
                raise ConfigError(
                    f"{path} is {path.stat().st_size} bytes but meta.json says {shard['tokens']} "
                    f"{dtype.name} tokens; the dataset is damaged: prepare it again"
                )
            if shard["tokens"]:
                segments.append(np.memmap(path, dtype=dtype, mode="r"))
            recorded = int(shard["max_id"]) if "max_id" in shard else None  # none: prepared before it was
            files.append(TokenFile(path, dtype, recorded, card))
        tokenizer_file(folder)  # refuses a tokenizer.json linked out of the folder, before any worker
        return TokenSplit(segments, int(meta["vocab_size"]), meta.get("tokenizer"), f"{folder} ({split})", files)
    except ConfigError:
        raise
    except (KeyError, TypeError, ValueError) as exc:
        raise ConfigError(
            f"{folder / 'meta.json'} is incomplete ({type(exc).__name__}: {exc}); prepare the data again"
        ) from None
    except FileNotFoundError as exc:
        raise ConfigError(
            f"{exc.filename} is missing; the dataset in {folder} is incomplete: prepare it again"
        ) from None


def tokenizer_file(folder: Path) -> Path | None:
    """The tokenizer.json beside a dataset's meta.json (None: bytes, no file), inside the folder:
    it is copied into checkpoints and exports, so a link out would carry another file with them."""
    if not os.path.lexists(folder / "tokenizer.json"):
        return None
    return confined(folder, "tokenizer.json", source=folder / "meta.json")


def megatron_prefix(path: Path) -> Path:
    """`data.dir` for Megatron: the path prefix (PREFIX.bin + PREFIX.idx) or a folder with one pair."""
    if path.is_dir():
        pairs = sorted(p.with_suffix("") for p in path.glob("*.idx") if p.with_suffix(".bin").is_file())
        if len(pairs) != 1:
            raise ConfigError(
                f"data.dir {path} holds {len(pairs)} Megatron .bin/.idx pairs; point data.dir at one PREFIX"
            )
        return pairs[0]
    prefix = path.with_suffix("") if path.suffix in (".bin", ".idx") else path
    for suffix in (".bin", ".idx"):
        if not prefix.with_name(prefix.name + suffix).is_file():
            raise ConfigError(
                f"data.dir {path}: no {prefix.name + suffix}; point data.dir at a Megatron PREFIX (PREFIX.bin + PREFIX.idx)"
            )
    return prefix


def read_megatron_index(idx: Path) -> tuple[np.dtype, np.ndarray, np.ndarray, np.ndarray]:
    """(token dtype, sequence lengths, sequence byte pointers, document indices) of an MMIDIDX file."""
    raw = idx.read_bytes()
    if raw[:9] != MEGATRON_HEADER or len(raw) < 34:
        raise ConfigError(f"{idx} is not a Megatron index (no MMIDIDX header); check data.format")
    (version,), (code,), (num_seqs, num_docs) = (
        struct.unpack_from("<Q", raw, 9),
        struct.unpack_from("<B", raw, 17),
        struct.unpack_from("<QQ", raw, 18),
    )
    if version != 1 or code not in MEGATRON_DTYPES or 34 + num_seqs * 12 + num_docs * 8 > len(raw):
        raise ConfigError(
            f"{idx} does not parse as a Megatron index (version {version}, dtype code {code}, "
            f"{num_seqs} sequences, {num_docs} document indices in {len(raw)} bytes)"
        )
    lengths = np.frombuffer(raw, np.int32, num_seqs, 34)
    pointers = np.frombuffer(raw, np.int64, num_seqs, 34 + 4 * num_seqs)
    documents = np.frombuffer(raw, np.int64, num_docs, 34 + 12 * num_seqs)
    return np.dtype(MEGATRON_DTYPES[code]), lengths, pointers, documents


def _check_megatron_index(
    idx: Path, bin_path: Path, dtype: np.dtype, lengths: np.ndarray, pointers: np.ndarray, documents: np.ndarray
) -> int:
    """The index describes its .bin exactly, as Megatron-LM writes it: sequences laid end to end
    from byte 0 (a pointer is the lengths before it), the .bin as long as they are, document
    boundaries rising from 0 to the sequence count. Returns the tokens in the .bin."""
    damaged = "the index is damaged or not Megatron's"
    if dtype.kind not in "ui" or not len(lengths):
        raise ConfigError(f"{idx} holds {len(lengths)} sequences of {dtype.name}; need integer tokens")
    if lengths.min() < 0:
        k = int(np.argmax(lengths < 0))
        raise ConfigError(f"{idx}: sequence lengths out of range (sequence {k} has length {lengths[k]}); {damaged}")
    starts = np.concatenate([[0], np.cumsum(lengths[:-1], dtype=np.int64)]) * dtype.itemsize
    if not np.array_equal(pointers, starts):
        k = int(np.argmax(pointers != starts))
        raise ConfigError(
            f"{idx}: sequence pointers out of range (sequence {k} starts at byte {pointers[k]}, "
            f"but the lengths before it end at byte {starts[k]}); {damaged}"
        )
    total = int(lengths.sum(dtype=np.int64))
    if bin_path.stat().st_size != total * dtype.itemsize:
        raise ConfigError(
            f"{bin_path} is {bin_path.stat().st_size} bytes but {idx.name} says {total} {dtype.name} tokens "
            f"({total * dtype.itemsize} bytes); the pair does not match"
        )
    rising = len(documents) >= 2 and documents[0] == 0 and documents[-1] == len(lengths)
    if not rising or np.any(np.diff(documents) < 0):
        raise ConfigError(
            f"{idx}: document index out of range ({len(documents)} entries from {documents[:1].tolist()} to "
            f"{documents[-1:].tolist()}, not rising from 0 to the {len(lengths)} sequences); {damaged}"
        )
    return total


def _megatron(path: Path, split: str, val_fraction: float) -> TokenSplit:
    """Train on the leading documents, validate on the last `val_fraction` of them (at least one)."""
    prefix = megatron_prefix(path)
    bin_path, idx = prefix.with_name(prefix.name + ".bin"), prefix.with_name(prefix.name + ".idx")
    dtype, lengths, pointers, documents = read_megatron_index(idx)
    total = _check_megatron_index(idx, bin_path, dtype, lengths, pointers, documents)
    seq_start = np.append(pointers // dtype.itemsize, total)  # token offset of each sequence, then the end
    doc_start = seq_start[documents]  # token offset of each document boundary
    num_docs = len(doc_start) - 1
    if num_docs >= 2:
        cut = int(doc_start[num_docs - max(1, round(num_docs * val_fraction))])
    else:
        cut = int(total * (1 - val_fraction))
    tokens = np.memmap(bin_path, dtype=dtype, mode="r", shape=(total,)) if total else np.zeros(0, dtype)
    part = tokens[:cut] if split == "train" else tokens[cut:]
    return TokenSplit([part] if len(part) else [], None, None, f"{prefix} ({split})", [TokenFile(bin_path, dtype)])
