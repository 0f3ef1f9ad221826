"""Reading documents with a loss mask (meta.json "format": "documents", data/supervised.py).

Every size is checked against meta.json before anything is mapped: each shard and its mask as
long as the tokens meta.json gives it, the document starts rising from 0 within the split's
tokens and never crossing a shard (shards close at document boundaries), and their count the
split's documents. Files are read only inside the folder meta.json sits in.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from meshrun.data.storage import DOC_DTYPE, DOCUMENTS_FORMAT, MASK_DTYPE, read_meta
from meshrun.data.token_ids import TokenFile
from meshrun.errors import ConfigError
from meshrun.files.confined import confined


@dataclass(frozen=True)
class DocumentSplit:
    """One split's documents: token ids and loss mask of document k by `document(k)`."""

    tokens: list[np.ndarray]  # per shard, read-only memmaps
    masks: list[np.ndarray]  # per shard, uint8, as long as its tokens
    starts: np.ndarray  # int64: each document's first token in the split, then the split's end
    shard_starts: np.ndarray  # int64: each shard's first token in the split
    meta: dict[str, Any]
    files: list[TokenFile]  # the token shards as meta.json claims them (token_ids checks them)

    @property
    def vocab_size(self) -> int:
        return int(self.meta["vocab_size"])

    @property
    def tokenizer(self) -> dict[str, Any] | None:
        return self.meta.get("tokenizer")

    @property
    def num_documents(self) -> int:
        return len(self.starts) - 1

    @property
    def lengths(self) -> np.ndarray:
        return np.diff(self.starts)

    def document(self, k: int) -> tuple[np.ndarray, np.ndarray]:
        """(token ids as int64, loss mask as bool) of document k."""
        start, end = int(self.starts[k]), int(self.starts[k + 1])
        shard = int(np.searchsorted(self.shard_starts, start, side="right")) - 1
        lo, hi = start - int(self.shard_starts[shard]), end - int(self.shard_starts[shard])
        return self.tokens[shard][lo:hi].astype(np.int64), self.masks[shard][lo:hi].astype(bool)

    def trained(self, k: int) -> int:
        """Targets document k trains as next-token prediction: its masked tokens after the first."""
        return int(self.document(k)[1][1:].sum())


def open_documents(folder: str | Path, split: str) -> DocumentSplit:
    folder = Path(folder)
    meta = read_meta(folder)
    if meta is None or meta.get("format") != DOCUMENTS_FORMAT:
        raise ConfigError(f"{folder} holds no documents with a loss mask; prepare them with prepare-data --chat")
    card = folder / "meta.json"
    try:
        dtype, info = np.dtype(meta["dtype"]), meta["splits"][split]
        tokens, masks, sizes, files = [], [], [], []
        for shard in info["shards"]:
            count = int(shard["tokens"])
            for name, kind in ((shard["file"], dtype), (shard["mask"], MASK_DTYPE)):
                path = confined(folder, name, source=card)
                if path.stat().st_size != count * kind.itemsize:
                    raise ConfigError(f"{path} is not {count} tokens long as meta.json says; prepare the data again")
            tokens.append(np.memmap(confined(folder, shard["file"], source=card), dtype=dtype, mode="r"))
            recorded = int(shard["max_id"]) if "max_id" in shard else None
            files.append(TokenFile(confined(folder, shard["file"], source=card), dtype, recorded, card))
            masks.append(np.memmap(confined(folder, shard["mask"], source=card), dtype=MASK_DTYPE, mode="r"))
            sizes.append(count)
        starts = _starts(confined(folder, info["documents_file"], source=card), int(info["documents"]), sum(sizes))
    except ConfigError:
        raise
    except (KeyError, TypeError, ValueError, OSError) as exc:
        raise ConfigError(f"{card} is incomplete ({type(exc).__name__}: {exc}); prepare the data again") from None
    shard_starts = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)
    if not np.isin(shard_starts[:-1], starts).all():
        raise ConfigError(f"{card}: a document crosses a shard boundary; prepare the data again")
    return DocumentSplit(tokens, masks, starts, shard_starts[:-1], meta, files)


def _starts(path: Path, count: int, total: int) -> np.ndarray:
    """The document starts file, as many as meta.json says, rising from 0 below `total`; the end appended."""
    if path.stat().st_size != count * DOC_DTYPE.itemsize or count < 1:
        raise ConfigError(f"{path} does not hold the {count} document starts meta.json says; prepare the data again")
    starts = np.fromfile(path, dtype=DOC_DTYPE).astype(np.int64)
    if starts[0] != 0 or np.any(np.diff(starts) <= 0) or starts[-1] >= total:
        raise ConfigError(f"{path}: document starts out of range; prepare the data again")
    return np.append(starts, total)
