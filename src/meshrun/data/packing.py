"""Whole documents packed into rows of `seq_len` tokens: best-fit decreasing.

The documents of a block (a window of the data order) are placed longest first, each into the
open row it fills most tightly (the least room that still holds it; a new row when none does).
No document that fits a row is ever split, and the result is a pure function of the lengths
(ties go to the earlier document and to the lower row), so every rank and every rerun packs the
same rows. On a chat-like length distribution it fills rows better than first-fit or greedy
(next-fit) packing in the input order: docs/guides/conversations.md has the numbers
(bench/packing.py measures them).

Open rows are kept by their room (an integer in 1 .. seq_len): a sorted list of the rooms that
have rows, and for each a heap of those rows, so placing a document costs a bisection over at
most seq_len rooms, not a scan over rows.
"""

from __future__ import annotations

import heapq
from bisect import bisect_left, insort
from dataclasses import dataclass

import numpy as np

PAD_DOCUMENT = -1  # document id of a row's padding tail


@dataclass(frozen=True)
class PackedRow:
    """One row: the documents it holds (ids into the packed block), in the order they sit."""

    docs: np.ndarray  # int64 document ids
    lengths: np.ndarray  # int64 tokens of each
    seq_len: int

    @property
    def starts(self) -> np.ndarray:
        """Each document's first position in the row."""
        return np.cumsum(self.lengths) - self.lengths

    @property
    def padding(self) -> int:
        return self.seq_len - int(self.lengths.sum())

    def positions(self) -> np.ndarray:
        """(seq_len,) position ids restarting at 0 at every document (and at the padding tail)."""
        pieces = [*self.lengths, self.padding] if self.padding else list(self.lengths)
        return np.concatenate([np.arange(n, dtype=np.int64) for n in pieces])

    def document_ids(self) -> np.ndarray:
        """(seq_len,) the index within this row of the document each position belongs to;
        PAD_DOCUMENT on the padding tail. Equal ids attend to each other (causally), others not."""
        ids = np.repeat(np.arange(len(self.docs), dtype=np.int64), self.lengths)
        return np.concatenate([ids, np.full(self.padding, PAD_DOCUMENT, dtype=np.int64)])


def pack(lengths: np.ndarray | list[int], seq_len: int) -> list[PackedRow]:
    """Rows of best-fit decreasing packing of documents of `lengths` tokens (each 1 .. seq_len)."""
    lengths = np.asarray(lengths, dtype=np.int64)
    if len(lengths) and (lengths.min() < 1 or lengths.max() > seq_len):
        raise ValueError(
            f"document lengths must lie in 1 .. {seq_len} to be packed whole, got {lengths.min()} .. {lengths.max()}"
        )
    rows: list[list[int]] = []
    rooms: list[int] = []  # sorted: the rooms some open row has
    by_room: dict[int, list[int]] = {}  # room -> heap of the open rows with that room
    for doc in np.argsort(-lengths, kind="stable").tolist():  # longest first, ties in input order
        need = int(lengths[doc])
        k = bisect_left(rooms, need)
        if k == len(rooms):
            row, room = len(rows), seq_len
            rows.append([])
        else:
            room = rooms[k]
            row = heapq.heappop(by_room[room])
            if not by_room[room]:
                del by_room[room]
                rooms.pop(k)
        rows[row].append(doc)
        left = room - need
        if left:
            if left not in by_room:
                by_room[left] = []
                insort(rooms, left)
            heapq.heappush(by_room[left], row)
    return [PackedRow(np.array(r, dtype=np.int64), lengths[r], seq_len) for r in rows]


def fill(rows: list[PackedRow]) -> float:
    """The share of the rows' positions that hold document tokens (1 - the padding share)."""
    total = sum(row.seq_len for row in rows)
    return 1.0 - sum(row.padding for row in rows) / total if total else 1.0
