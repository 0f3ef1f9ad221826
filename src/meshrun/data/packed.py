"""Batches of documents with a loss mask (prepare-data --chat / --prompt-completion), addressed
by global row index: packed whole into rows of seq_len (data.packing: true) or one a row, padded.

The data order: each epoch a seeded permutation of the split's documents, cut into blocks of
BLOCK documents; each block packed by best-fit decreasing (data/packing.py) into rows, shuffled
(seeded). Global sample `i` is the i-th row of that stream: a pure function of `i`, the seed and
the split, so every rank and every layout reads the same rows, and resuming (or resharding)
needs only the number of rows consumed. Blocks are packed as they are first needed.

A row's input is (2, seq_len): token ids, then positions restarting at 0 for each document
(models/documents.py reads the documents from them). A document of n tokens fills n positions
and predicts its own next tokens: the target at its position j is token j+1 when the loss mask
trains it, else IGNORE, and IGNORE at its last position (nothing of it follows). The padding
tail holds token 0 at positions 0, 1, ... with no target.
"""

from __future__ import annotations

from bisect import bisect_right
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from meshrun.data.documents import open_documents
from meshrun.data.packing import pack
from meshrun.data.storage import IGNORE, SPLITS
from meshrun.errors import ConfigError

BLOCK = 1024  # documents packed together: fill 99.8% on chat-like lengths (docs/guides/conversations.md)
KEPT_BLOCKS = 4  # packed blocks kept: a batch spans at most a few


@dataclass(frozen=True)
class Row:
    docs: np.ndarray  # int64 document indices in the split, in row order
    lengths: np.ndarray  # int64 tokens of each


@dataclass(frozen=True)
class Occupancy:
    """What a batch's rows hold beyond their positions."""

    padding: int  # positions that hold no document token
    attention_length: int  # sum of squared document (and padding run) lengths / positions: the
    # length whose causal attention costs what these rows' attention within documents does


class PackedDataset:
    """One split of a documents folder, batched as rows of seq_len (see the module docstring)."""

    def __init__(self, data_dir: str | Path, split: str, *, seq_len: int, seed: int, packing: bool = True) -> None:
        self.docs = open_documents(data_dir, split)
        self.where = f"{data_dir} ({split})"
        self.vocab_size, self.tokenizer, self.files = self.docs.vocab_size, self.docs.tokenizer, self.docs.files
        lengths = self.docs.lengths
        if lengths.max() > seq_len:
            longer = int((lengths > seq_len).sum())
            raise ConfigError(
                f"{self.where}: {longer} documents are longer than model.seq_len {seq_len} (the longest "
                f"{int(lengths.max())} tokens); prepare the data with --max-len {seq_len} or raise model.seq_len"
            )
        self.seq_len, self.packing = seq_len, packing
        self.seed = (int(seed), SPLITS.index(split))
        self.blocks_per_epoch = -(-self.docs.num_documents // BLOCK)
        self.first_rows = [0]  # global row index of each block's first row, as far as blocks were packed
        self.kept: dict[int, tuple[Row, ...]] = {}

    def block(self, k: int) -> tuple[Row, ...]:
        """The rows of global block `k` (epoch k // blocks_per_epoch), in their shuffled order."""
        if k not in self.kept:
            if len(self.kept) >= KEPT_BLOCKS:
                del self.kept[next(iter(self.kept))]
            self.kept[k] = self._pack(k)
        return self.kept[k]

    def _pack(self, k: int) -> tuple[Row, ...]:
        epoch, b = divmod(k, self.blocks_per_epoch)
        order = np.random.default_rng((*self.seed, epoch)).permutation(self.docs.num_documents)
        docs = order[b * BLOCK : (b + 1) * BLOCK]
        lengths = self.docs.lengths[docs]
        if self.packing:
            rows = [Row(docs[r.docs], r.lengths) for r in pack(lengths, self.seq_len)]
        else:
            rows = [Row(docs[i : i + 1], lengths[i : i + 1]) for i in range(len(docs))]
        shuffle = np.random.default_rng((*self.seed, epoch, b)).permutation(len(rows))
        return tuple(rows[i] for i in shuffle)

    def rows(self, first: int, count: int) -> list[Row]:
        """Global rows first .. first+count-1."""
        while self.first_rows[-1] < first + count:  # pack blocks up to the last row asked for
            self.first_rows.append(self.first_rows[-1] + len(self.block(len(self.first_rows) - 1)))
        found = []
        for i in range(first, first + count):
            k = bisect_right(self.first_rows, i) - 1
            found.append(self.block(k)[i - self.first_rows[k]])
        return found

    def batch(self, first: int, count: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Rows first .. first+count-1 as (x (count, 2, seq_len): ids and positions, y (count, seq_len))."""
        x = np.zeros((count, 2, self.seq_len), dtype=np.int64)
        y = np.full((count, self.seq_len), IGNORE, dtype=np.int64)
        for r, row in enumerate(self.rows(first, count)):
            at = 0
            for doc, n in zip(row.docs.tolist(), row.lengths.tolist()):
                ids, mask = self.docs.document(doc)
                x[r, 0, at : at + n], x[r, 1, at : at + n] = ids, np.arange(n)
                y[r, at : at + n - 1] = np.where(mask[1:], ids[1:], IGNORE)
                at += n
            x[r, 1, at:] = np.arange(self.seq_len - at)
        return torch.from_numpy(x), torch.from_numpy(y)

    def target_tokens(self, first: int, count: int) -> int:
        """Trained targets in rows first .. first+count-1 (the loss's divisor)."""
        return sum(self.docs.trained(doc) for row in self.rows(first, count) for doc in row.docs.tolist())

    def occupancy(self, first: int, count: int) -> Occupancy:
        rows = self.rows(first, count)
        padding = [self.seq_len - int(row.lengths.sum()) for row in rows]
        squares = sum(int((row.lengths**2).sum()) + pad**2 for row, pad in zip(rows, padding))
        return Occupancy(padding=sum(padding), attention_length=round(squares / (count * self.seq_len)))

    def source_counts(self, first: int, count: int) -> dict[str, int]:
        return {}
