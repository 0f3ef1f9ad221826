"""The best-fit packer: whole documents, each once, rows of seq_len, deterministic; positions and
document ids per row."""

from __future__ import annotations

import numpy as np
import pytest

from meshrun.data.packing import PAD_DOCUMENT, fill, pack


def lognormal_lengths(count: int, seq_len: int, seed: int = 0) -> np.ndarray:
    """Chat-like lengths: log-normal with median seq_len / 5, the tail clipped at seq_len."""
    rng = np.random.default_rng(seed)
    return np.clip(np.round(rng.lognormal(np.log(seq_len / 5), 0.8, count)), 1, seq_len).astype(np.int64)


def test_every_document_lands_whole_in_exactly_one_row() -> None:
    lengths = lognormal_lengths(2000, 512)
    rows = pack(lengths, 512)
    placed = np.concatenate([row.docs for row in rows])
    assert sorted(placed.tolist()) == list(range(len(lengths)))
    for row in rows:
        assert np.array_equal(row.lengths, lengths[row.docs]) and 0 <= row.padding < 512
    assert fill(rows) > 0.97  # best-fit decreasing on this distribution: see bench/packing.py
    again = pack(lengths, 512)  # a pure function of the lengths
    assert len(again) == len(rows) and all(np.array_equal(a.docs, b.docs) for a, b in zip(again, rows))


def test_each_document_goes_where_it_leaves_the_least_room() -> None:
    """5 4 3 3 2 2 1 into rows of 10 (greedy next-fit needs 3 rows): two rows, both full."""
    rows = pack([5, 4, 3, 3, 2, 2, 1], 10)
    assert [row.docs.tolist() for row in rows] == [[0, 1, 6], [2, 3, 4, 5]]
    assert fill(rows) == 1.0
    rows = pack([6, 5, 4, 3], 10)  # 6 then 5: a new row; 4 fits 6's row exactly (room 4), 3 the other
    assert [row.docs.tolist() for row in rows] == [[0, 2], [1, 3]]


def test_ties_go_to_the_earlier_document_and_the_lower_row() -> None:
    rows = pack([3, 3, 3, 3], 6)
    assert [row.docs.tolist() for row in rows] == [[0, 1], [2, 3]]


def test_positions_restart_per_document_and_padding_has_no_document() -> None:
    (row,) = pack([2, 3], 8)
    assert row.docs.tolist() == [1, 0] and row.starts.tolist() == [0, 3]
    assert row.positions().tolist() == [0, 1, 2, 0, 1, 0, 1, 2]
    assert row.document_ids().tolist() == [0, 0, 0, 1, 1, PAD_DOCUMENT, PAD_DOCUMENT, PAD_DOCUMENT]
    (full,) = pack([4, 4], 8)
    assert full.positions().tolist() == [0, 1, 2, 3, 0, 1, 2, 3] and full.padding == 0


@pytest.mark.parametrize("lengths", [[0, 3], [9], [-1]])
def test_a_document_that_cannot_be_placed_whole_is_refused(lengths: list[int]) -> None:
    with pytest.raises(ValueError, match=r"must lie in 1 \.\. 8"):
        pack(lengths, 8)
